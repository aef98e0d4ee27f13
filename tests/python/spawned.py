"""Ranks as spawned processes, for the tests that need one process per rank.

run_ranks(target, world, *args, timeout_s=...) starts target(rank, *args, results) in `world`
processes (spawn: each starts CUDA afresh), waits for them, stops any still running after
timeout_s, and asserts that every rank put (rank, "ok") on `results`; a rank that failed puts
(rank, its traceback) instead, which the assertion shows.
"""

import multiprocessing as mp
import queue


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
