"""One process of a multi-node torchrun job on one GPU (test_gpu_torchrun_nodes.py starts one
`torchrun --nnodes 2 --node-rank i --nproc-per-node 2` agent per emulated node).

The rank builds its NcclWorld from the job's default torch.distributed group (gloo; torchrun's
RANK, WORLD_SIZE and LOCAL_WORLD_SIZE give the node layout), then checks every backend against
the torch reference of tests/python/ref.py: bf16 and bf16-to-fp8 rows, a low_latency round
captured in a CUDA graph and replayed with new inputs, and high_throughput routed by a rank mask;
high_throughput both with worst-case output and in exact sizes (worst_case_output=False, which
Python allows across nodes).
It prints one "torchrun_nodes: rank R ... PASS" line, or its traceback and exit code 1.

Every process takes an NCCL host id of its own before NCCL starts: NCCL refuses two ranks of
one host on one GPU, and epx groups its nodes by LOCAL_WORLD_SIZE, not by NCCL's hosts."""

import os
import sys
import traceback

os.environ["NCCL_HOSTID"] = f"epx-torchrun-rank-{os.environ.get('RANK', '0')}"
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import epx  # noqa: E402
import ref  # noqa: E402

BACKENDS = ("naive", "allgather_reducescatter", "low_latency", "high_throughput")
TOL = dict(rtol=3e-2, atol=3e-2)


def config(dtype, worst_case_output=False):
    return epx.EpConfig(hidden=1024, num_experts=16, topk=4, max_tokens_per_rank=32, dtype=dtype,
                        worst_case_output=worst_case_output, timeout_ms=30000)


def partials_of(a, rank, d):
    return ref.token_partials(a.config, rank, d.recv_x, d.recv_scales, d.recv_topk_ids,
                              d.recv_topk_weights)


def check_rounds(world, backend, dtype, dev, worst_case_output=False):
    """Two eager rounds (one rank without tokens in the first) against the reference."""
    rank, W = world.rank, world.size
    cfg = config(dtype, worst_case_output)
    a = epx.All2All.create(cfg, world, backend=backend)
    for seed in range(2):
        sizes = [(0, 17, 32, 5)[q % 4] if seed == 0 else 32 - 3 * q for q in range(W)]
        inputs = [ref.make_inputs(cfg, q, sizes[q], seed, dev) for q in range(W)]
        x, ids, w, sc = inputs[rank]
        d = a.dispatch(x, ids, w, sc)
        a.combine_buffer().copy_(partials_of(a, rank, d))
        y = a.combine(a.combine_buffer())
        a.synchronize()
        every = backend in ("naive", "allgather_reducescatter")
        want = ref.expected_rows(cfg.replace(world_size=W), inputs, rank, every)
        m = int(d.recv_count.item())
        got = sorted(zip(d.recv_src_rank[:m].tolist(), d.recv_src_idx[:m].tolist()))
        assert got == want, f"{backend}/{dtype} seed {seed}: rows {got} != {want}"
        torch.testing.assert_close(y.float(), ref.combined(cfg, x, ids, w, sc), **TOL)
    world.barrier()
    return a


def check_graph(world, dev):
    """low_latency captured once and replayed with new inputs: no host step across nodes."""
    rank = world.rank
    cfg = config("bf16-to-fp8")
    a = epx.All2All.create(cfg, world, backend="low_latency")
    x, ids, w, sc = ref.make_inputs(cfg, rank, 16, 7, dev)
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(g, stream=s):
        d = a.dispatch(x, ids, w, sc)
        a.combine_buffer().copy_(partials_of(a, rank, d))
        y = a.combine(a.combine_buffer())
    for it in range(5):
        fresh = ref.make_inputs(cfg, rank, 16, 50 + it, dev)
        ref.refill((x, ids, w, sc), fresh)
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y.float(), ref.combined(cfg, *fresh), **TOL)
    world.barrier()
    del g


def check_rank_mask(world, dev, worst_case_output):
    """high_throughput routed by a rank mask: rank r gets the tokens whose mask has r, its expert
    counts are the senders' counts of its experts, and combine sums the rows back in rank order
    (each rank's partial is its row times (r + 1))."""
    rank, W = world.rank, world.size
    cfg = config("bf16", worst_case_output)
    a = epx.All2All.create(cfg, world, backend="high_throughput")
    E, L, n = cfg.num_experts, cfg.num_experts // W, 24
    gen = [torch.Generator().manual_seed(100 + q) for q in range(W)]
    xs = [(torch.randn(n, cfg.hidden, generator=gen[q]) * 2).to(torch.bfloat16) for q in range(W)]
    masks = [torch.rand(n, W, generator=gen[q]) < 0.5 for q in range(W)]
    counts = [torch.randint(0, 9, (E,), generator=gen[q], dtype=torch.int32) for q in range(W)]
    d = a.dispatch_by_rank(xs[rank].to(dev), masks[rank].to(dev), counts[rank].to(dev))
    a.synchronize()
    m = int(d.recv_count.item())
    got = sorted(zip(d.recv_src_rank[:m].tolist(), d.recv_src_idx[:m].tolist()))
    want = [(q, i) for q in range(W) for i in range(n) if masks[q][i, rank]]
    assert got == want, f"rank mask: rows {got} != {want}"
    for j in range(m):
        q, i = int(d.recv_src_rank[j]), int(d.recv_src_idx[j])
        assert torch.equal(d.recv_x[j].cpu(), xs[q][i]), f"rank mask: row {j} of ({q}, {i})"
    want_counts = sum(c[rank * L:(rank + 1) * L] for c in counts)
    assert torch.equal(d.expert_counts.cpu(), want_counts), \
        f"rank mask: expert_counts {d.expert_counts.tolist()} != {want_counts.tolist()}"
    a.combine_buffer()[:m].copy_((d.recv_x[:m].float() * (rank + 1)).to(torch.bfloat16))
    y = a.combine(a.combine_buffer())
    a.synchronize()
    factor = (masks[rank].float() * torch.arange(1, W + 1).float()).sum(dim=1, keepdim=True)
    torch.testing.assert_close(y.float().cpu(), xs[rank].float() * factor, **TOL)
    world.barrier()


def main():
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    dist.init_process_group("gloo")
    try:
        world = epx.nccl_world_from_torch()
        local = int(os.environ["LOCAL_WORLD_SIZE"])
        assert (world.rank, world.size, world.num_nodes) == \
            (rank, dist.get_world_size(), dist.get_world_size() // local), \
            (world.rank, world.size, world.num_nodes)
        checks = 0
        for backend in BACKENDS:
            for dtype in ("bf16", "bf16-to-fp8"):
                check_rounds(world, backend, dtype, dev)
                checks += 1
        for dtype in ("bf16", "bf16-to-fp8"):  # high_throughput in fixed sizes too
            check_rounds(world, "high_throughput", dtype, dev, worst_case_output=True)
            checks += 1
        check_graph(world, dev)
        for worst in (False, True):
            check_rank_mask(world, dev, worst)
            checks += 1
        checks += 1
        print(f"torchrun_nodes: rank {rank} of {world.size} on node {rank // local} of "
              f"{world.num_nodes}: {checks} checks PASS", flush=True)
        torch.cuda.synchronize()
        world.barrier()
        return 0
    except BaseException:
        print(f"torchrun_nodes: rank {rank} FAILED\n{traceback.format_exc()}", flush=True)
        return 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
