"""Ranks as spawned processes, for the tests that need one process per rank.

run_ranks(target, world, *args, timeout_s=...) starts target(rank, *args, results) in `world`
processes (spawn: each starts CUDA afresh), waits for them, stops any still running after
timeout_s, and asserts that every rank put (rank, "ok") on `results`; a rank that failed puts
(rank, its traceback) instead, which the assertion shows.
"""

import multiprocessing as mp
import queue
import traceback


def in_gloo_group(rank, world, init_file, results, body):
    """body() as rank `rank` of a gloo group of `world` processes (rendezvous through the file
    init_file), every process on GPU 0; puts (rank, "ok") on `results`, or (rank, the
    traceback) if anything failed, and destroys the group whatever happened."""
    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        torch.cuda.set_device(0)
        body()
        results.put((rank, "ok"))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(target, world, *args, timeout_s):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, results)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
    outcome = {}
    try:
        for _ in range(world):
            rank, what = results.get(timeout=5)
            outcome[rank] = what
    except queue.Empty:
        pass  # a rank that ended without reporting is named below
    for p in procs:
        if p.is_alive():
            p.kill()
    for r in range(world):
        what = outcome.get(r, f"no report (exit code {procs[r].exitcode})")
        assert what == "ok", f"rank {r}:\n{what}"
