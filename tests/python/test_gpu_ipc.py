"""Two processes on one GPU, bootstrapped through torch.distributed (gloo) into an IpcWorld:
every dtype and layout against the torch reference, a captured round replayed, a configuration
mismatch refused on both ranks."""

import traceback


import epx
import ref
from spawned import run_ranks

WORLD = 2


def _rank_main(rank, init_file, mismatch, results):
    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=WORLD)
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
        world = epx.ipc_world_from_torch()
        assert (world.rank, world.size, world.handles) == (rank, WORLD, "cuda-ipc")
        if mismatch:
            cfg = epx.EpConfig(hidden=1024 if rank == 0 else 2048, num_experts=16, topk=4,
                               max_tokens_per_rank=32)
            try:
                epx.All2All.create(cfg, world)
            except epx.ConfigError as e:
                assert "hidden: rank 0 has 1024, rank 1 has 2048" in str(e), str(e)
                results.put((rank, "ok"))
                return
            raise AssertionError("a configuration mismatch was not refused")
        for dtype in ("bf16", "fp8", "bf16-to-fp8"):
            for layout in ("token", "expert"):
                cfg = epx.EpConfig(hidden=1024, num_experts=16, topk=4, max_tokens_per_rank=32,
                                   dtype=dtype, layout=layout, timeout_ms=20000)
                a = epx.All2All.create(cfg, world)
                for seed in range(2):
                    # Each process makes every rank's inputs (the same seeds) to know what it gets.
                    inputs = [ref.make_inputs(cfg, q, (32, 5)[q] if seed else (0, 17)[q], seed,
                                              dev) for q in range(WORLD)]
                    x, ids, w, sc = inputs[rank]
                    d = a.dispatch(x, ids, w, sc)
                    c = a.config
                    if layout == "token":
                        a.combine_buffer().copy_(ref.token_partials(
                            c, rank, d.recv_x, d.recv_scales, d.recv_topk_ids,
                            d.recv_topk_weights))
                    else:
                        a.combine_buffer().copy_(ref.expert_outputs(c, rank, d.expert_x,
                                                                    d.expert_scales))
                    y = a.combine(a.combine_buffer())
                    a.synchronize()
                    want_rows = ref.expected_rows(cfg.replace(world_size=WORLD), inputs, rank,
                                                  False)
                    m = int(d.recv_count.item())
                    got = sorted(zip(d.recv_src_rank[:m].tolist(), d.recv_src_idx[:m].tolist()))
                    assert got == want_rows, f"{dtype}/{layout}: rows {got} != {want_rows}"
                    torch.testing.assert_close(y.float(), ref.combined(cfg, x, ids, w, sc),
                                               rtol=3e-2, atol=3e-2)
                # A captured round replays with new inputs.
                x, ids, w, sc = ref.make_inputs(cfg, rank, 16, 7, dev)
                g = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream()
                with torch.cuda.graph(g, stream=s):
                    d = a.dispatch(x, ids, w, sc)
                    if layout == "token":
                        a.combine_buffer().copy_(ref.token_partials(
                            a.config, rank, d.recv_x, d.recv_scales, d.recv_topk_ids,
                            d.recv_topk_weights))
                    else:
                        a.combine_buffer().copy_(ref.expert_outputs(a.config, rank, d.expert_x,
                                                                    d.expert_scales))
                    yg = a.combine(a.combine_buffer())
                for it in range(5):
                    fresh = ref.make_inputs(cfg, rank, 16, 50 + it, dev)
                    ref.refill((x, ids, w, sc), fresh)
                    g.replay()
                    a.synchronize()
                    torch.testing.assert_close(yg.float(), ref.combined(cfg, *fresh),
                                               rtol=3e-2, atol=3e-2)
                torch.cuda.synchronize()
                world.barrier()  # nobody frees memory a peer may still read
                del g, a
        results.put((rank, "ok"))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(tmp_path, mismatch):
    run_ranks(_rank_main, WORLD, str(tmp_path / "init"), mismatch, timeout_s=300)


def test_two_processes_one_gpu_torch_distributed(gpu, tmp_path):
    _run(tmp_path, mismatch=False)


def test_two_processes_disagreeing_configs(gpu, tmp_path):
    _run(tmp_path, mismatch=True)
