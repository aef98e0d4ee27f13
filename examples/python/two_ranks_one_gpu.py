"""Two processes, one GPU, one dispatch/combine round each, from Python.

    build/epx launch -n 2 -- python3 examples/python/two_ranks_one_gpu.py

`epx launch` starts one process per rank with EPX_RANK, EPX_WORLD_SIZE and EPX_BOOTSTRAP set;
epx.ipc_world_from_env() meets the other ranks there and maps their memory (processes on one GPU
are time-sliced: correct, not fast). Each rank sends its tokens to the ranks of their experts,
doubles what it receives (the "expert"), and combines: y must be 2 * sum_k w_k * x.
Exit code 0 when every rank got the right answer.
"""

import sys

import torch

import epx


def main() -> int:
    torch.cuda.set_device(0)
    world = epx.ipc_world_from_env()
    cfg = epx.EpConfig(hidden=2048, num_experts=16, topk=4, max_tokens_per_rank=64,
                       dtype="bf16", layout="token")
    a2a = epx.All2All.create(cfg, world)  # collective: every rank calls it

    gen = torch.Generator().manual_seed(world.rank)
    n = 32 + 8 * world.rank
    x = torch.randn(n, cfg.hidden, generator=gen).to(torch.bfloat16).cuda()
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=gen)[: cfg.topk]
                       for _ in range(n)]).int().cuda()
    w = torch.rand(n, cfg.topk, generator=gen).cuda()

    d = a2a.dispatch(x, ids, w)  # views of epx memory, valid until the next dispatch
    # The expert stage: each received row's partial = sum over this rank's experts of w_k * 2x.
    L = a2a.config.num_local_experts
    mine = (d.recv_topk_ids >= world.rank * L) & (d.recv_topk_ids < (world.rank + 1) * L)
    weight = torch.where(mine, d.recv_topk_weights, torch.zeros_like(d.recv_topk_weights))
    a2a.combine_buffer().copy_((d.recv_x.float() * 2 * weight.sum(1, keepdim=True)).bfloat16())
    y = a2a.combine(a2a.combine_buffer())
    a2a.synchronize()

    want = x.float() * 2 * w.sum(1, keepdim=True)
    ok = torch.allclose(y.float(), want, rtol=2e-2, atol=2e-2)
    m = int(d.recv_count.item())
    print(f"rank {world.rank} of {world.size}: received {m} rows, combine "
          f"{'OK' if ok else 'WRONG'}")
    world.barrier()  # nobody frees its memory while a peer may still read it
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
