#!/usr/bin/env python3
"""Runs one of DeepEP's own tests (tests/legacy/test_low_latency.py by default, or the file
``--test`` names, e.g. tests/legacy/test_intranode.py for the normal mode; unmodified) against
epx.deep_ep.

    PYTHONPATH=<build>/python python3 tests/compat/run_deepep_low_latency.py <deepep-checkout> \\
        [--mode auto|one-gpu|gpu-per-rank] [--test PATH] [--shrink] [-- <the test's arguments>]

``--test`` is a path, or one relative to the checkout (``tests/legacy/test_intranode.py``). The
test's arguments default, for test_low_latency.py, to ``--num-processes 2 --num-tokens 128
--hidden 7168 --num-topk 8 --num-experts 32``; for test_intranode.py to ``--num-processes 2
--num-tokens 4096 --hidden 7168 --num-topk 8 --num-experts 256``; for tests/elastic/test_ep.py
(V2's ElasticBuffer) to ``--num-processes 2 --num-tokens 256 --skip-perf-test``; for any other
file to none (the test's own defaults). The normal mode holds world_size x EPX_DEEP_EP_MAX_TOKENS received rows
per shape: the runner sets that variable to the test's --num-tokens unless it is set. The
test's folder is on the path of every process (test_intranode.py imports test_low_latency).

A ``deep_ep`` package is assembled in a temporary folder (deepep_shim.py: epx's Buffer under
DeepEP's name, DeepEP's own deep_ep/utils from the checkout), and the test
runs as its own ``__main__``, spawning its processes as it always does.

Modes: ``one-gpu`` (auto when there are fewer GPUs than processes) puts every process on GPU 0
through a gloo group; ``gpu-per-rank`` leaves DeepEP's init_dist alone (NCCL, GPU i for rank i).
``--assemble-only DIR`` writes the package into DIR and prints how to run DeepEP's test with no
runner at all (``PYTHONPATH=DIR:...`` python3 tests/legacy/test_low_latency.py ...).

Emulated nodes (``--emulated-nodes N``, one-gpu mode): the processes as N nodes of a block of
ranks each (LOCAL_WORLD_SIZE, an NCCL_HOSTID per process: deepep_shim.emulate_node), so that
epx.deep_ep builds an NcclWorld across them and its modes run on NCCL's collectives, e.g.
``... -- --num-processes 4 --num-tokens 128 --hidden 7168 --num-topk 8 --num-experts 32`` with
``--emulated-nodes 2``; also ``--test tests/legacy/test_intranode.py`` (normal mode) and
``--test tests/elastic/test_ep.py`` (V2), each ``--num-tokens 64`` (LogFMT and shrink mode are
one node's).

Shrink mode (DeepEP's ``--shrink-test``: ranks 1, 3 and 5 stop calling, at their first dispatch,
combine and clean, and the others must mask them): ``--shrink`` adds ``--shrink-test`` to the
test's arguments, whose defaults become 8 processes (the test needs at least 6). With
``--shrink-test`` among the test's arguments (from ``--shrink`` or given after ``--``), the runner
sets EPX_DEEP_EP_SHAPES to the test's shape, so that every Buffer makes its shapes while every
rank is there (deepep_shim.preparing_buffer: epx's shrink mode needs that), and EPX_TIMEOUT_MS
defaults to 10 s: every epx object that waits for a stopped rank waits that long once (about a
dozen times in the test), and the test runs no CPU GEMMs in this mode.

V2's test, tests/elastic/test_ep.py (ElasticBuffer: dispatch with and without expansion, cached,
combine and the reduced combine, bit for bit against DeepEP's references, over 144 modes), on a
GPU machine, from the repository root (<tree>: a DeepEP tree of dd758ca, e.g. ``git -C <clone>
archive dd758ca deep_ep/utils tests | tar -x -C <tree>``):

    export PYTHONPATH=<build>/python
    R="python3 tests/compat/run_deepep_low_latency.py <tree> --test tests/elastic/test_ep.py"
    $R                                   # 2 processes, --num-tokens 256, --skip-perf-test
    $R -- --num-processes 4 --num-tokens 256 --skip-perf-test
    $R -- --num-processes 2 --num-tokens 256 --skip-perf-test --allow-multiple-reduction 0
    $R -- --num-processes 2 --num-tokens 256 --skip-perf-test --do-cpu-sync 0
    $R -- --num-processes 2 --num-tokens 256 --skip-perf-test --masked-ratio 0.1

The performance part (without --skip-perf-test) times kernels by DeepEP's stage names through
its profiler (bench_kineto): epx's kernels carry them (dispatch_impl: high_throughput's
transfer; dispatch_copy_epilogue_impl: the copy of the received rows out of epx's buffer;
combine_impl and combine_reduce_epilogue_impl: both name high_throughput's one combine kernel,
whose time is then printed for both). Each of the 144 modes then runs five profiled benchmarks of
60 calls with a 10 ms sleep before each: about 10 s a mode with 2 processes on one shared GPU,
so a whole run outlives a 10-minute slot there. ``--test-first-only`` (the test's own option:
the first mode, checks and perf part) shows the perf lines in a minute:

    $R -- --num-processes 2 --num-tokens 256 --test-first-only

Not served: the hybrid mode and more than one node (--allow-hybrid-mode changes nothing on one node). --deterministic asks for
what epx always does (rows in source order) and --do-pressure-test repeats the checks with other
seeds: neither has run yet.

The last line is ``deepep_low_latency: 1 passed, 0 failed`` (or ``0 passed, 1 failed``;
``deepep_intranode: ...`` for test_intranode.py, ``deepep_ep: ...`` for test_ep.py: the file's
name without ``test_``); the exit
status is 0 when the test passed.

The DeepEP checkout is a tree of github.com/deepseek-ai/DeepEP (the acceptance commit is
dd758ca), e.g. ``git -C <clone> archive dd758ca deep_ep/utils tests | tar -x -C <dir>``; it
needs only deep_ep/utils and tests.
"""

from __future__ import annotations

import argparse
import os
import runpy
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import deepep_shim  # noqa: E402

DEFAULT_TEST_ARGS = ["--num-processes", "2", "--num-tokens", "128", "--hidden", "7168",
                     "--num-topk", "8", "--num-experts", "32"]
# A time-sliced GPU shared by every rank, and a test that runs CPU GEMMs between its hooks: the
# kernels' waits get a wider bound than epx's default 10 s unless EPX_TIMEOUT_MS says otherwise.
ONE_GPU_TIMEOUT_MS = "120000"
INTRANODE_TEST_ARGS = ["--num-processes", "2", "--num-tokens", "4096", "--hidden", "7168",
                       "--num-topk", "8", "--num-experts", "256"]
# V2's test (tests/elastic/test_ep.py): its performance part finds DeepEP's kernels by name
# (bench_kineto), which epx's kernels do not bear, so it is skipped by default.
ELASTIC_TEST_ARGS = ["--num-processes", "2", "--num-tokens", "256", "--skip-perf-test"]
DEFAULT_ARGS_BY_TEST = {"test_low_latency": DEFAULT_TEST_ARGS,
                        "test_intranode": INTRANODE_TEST_ARGS,
                        "test_ep": ELASTIC_TEST_ARGS}
SHRINK_TEST_ARGS = ["--num-processes", "8"] + DEFAULT_TEST_ARGS[2:] + ["--shrink-test"]
# Long enough for the ranks' host checks between calls, short enough for a dozen expiries
# (the whole test took 168 s with 8 processes on one H200).
SHRINK_TIMEOUT_MS = "10000"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _num_processes(test_args) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--num-processes", type=int, default=8)  # the test's own default
    known, _ = parser.parse_known_args(test_args)
    return known.num_processes


def _shape_spec(test_args) -> str:
    """"T,H,E,K" of the test's arguments (the test's own defaults where absent)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--num-tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--num-experts", type=int, default=288)
    parser.add_argument("--num-topk", type=int, default=8)
    known, _ = parser.parse_known_args(test_args)
    return f"{known.num_tokens},{known.hidden},{known.num_experts},{known.num_topk}"


def _num_tokens(test_args) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--num-tokens", type=int, default=4096)  # the largest default (intranode)
    known, _ = parser.parse_known_args(test_args)
    return known.num_tokens


def _test_path(checkout: Path, given) -> Path:
    """The test file: DeepEP's low-latency test by default; a given path as is when it exists,
    else relative to the checkout."""
    if given is None:
        return (checkout / "tests" / "legacy" / "test_low_latency.py").resolve()
    given = Path(given)
    path = given if given.exists() or given.is_absolute() else checkout / given
    if not path.is_file():
        raise SystemExit(f"--test {given}: no such file (here or in {checkout})")
    return path.resolve()


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # no torch or no driver: the test will say so itself
        return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    test_args = None
    if "--" in argv:
        cut = argv.index("--")
        argv, test_args = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", type=Path, help="a DeepEP tree (deep_ep/utils, tests)")
    parser.add_argument("--mode", choices=("auto", "one-gpu", "gpu-per-rank"), default="auto")
    parser.add_argument("--test", type=Path, default=None,
                        help="the test file, a path or one relative to the checkout (default "
                             "tests/legacy/test_low_latency.py)")
    parser.add_argument("--assemble-only", type=Path, default=None, metavar="DIR",
                        help="write the deep_ep package into DIR and exit")
    parser.add_argument("--shrink", action="store_true",
                        help="run the test's --shrink-test (rank masking; 8 processes by default)")
    parser.add_argument("--emulated-nodes", type=int, default=0, metavar="N",
                        help="one-gpu mode: the processes as N nodes (a block of ranks each, "
                             "LOCAL_WORLD_SIZE; every process its own NCCL_HOSTID), so that "
                             "epx.deep_ep builds an NcclWorld across them")
    args = parser.parse_args(argv)
    checkout = args.checkout.resolve()
    test = _test_path(checkout, args.test)
    name = "deepep_" + test.stem.removeprefix("test_")
    if not test_args:
        test_args = SHRINK_TEST_ARGS if args.shrink else DEFAULT_ARGS_BY_TEST.get(test.stem, [])
    elif args.shrink and "--shrink-test" not in test_args:
        test_args = test_args + ["--shrink-test"]
    shrink = "--shrink-test" in test_args

    if args.assemble_only is not None:
        pkg = deepep_shim.assemble(checkout, args.assemble_only)
        where = pkg.parent.resolve()
        print(f"deep_ep assembled in {pkg}")
        print(f"run DeepEP's test with it (one GPU per rank): "
              f"EPX_DEEP_EP_MAX_TOKENS={_num_tokens(test_args)} "
              f"PYTHONPATH={where}:{test.parent}:$PYTHONPATH python3 {test} {' '.join(test_args)}")
        print(f"(all ranks on one GPU: also set {deepep_shim.ONE_GPU_ENV}=1)")
        if shrink:
            print(f"(shrink test: also set {deepep_shim.SHAPES_ENV}={_shape_spec(test_args)})")
        return 0

    processes = _num_processes(test_args)
    mode = args.mode
    if mode == "auto":
        mode = "gpu-per-rank" if _gpu_count() >= processes else "one-gpu"
    where = Path(tempfile.mkdtemp(prefix="epx-deep_ep-"))
    deepep_shim.assemble(checkout, where)
    # The spawned processes get this sys.path from multiprocessing and the environment as is.
    sys.path[:0] = [str(where), str(test.parent)]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(where), str(test.parent)]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("EPX_DEEP_EP_MAX_TOKENS", str(_num_tokens(test_args)))
    if shrink:
        os.environ[deepep_shim.SHAPES_ENV] = _shape_spec(test_args)
        os.environ.setdefault("EPX_TIMEOUT_MS", SHRINK_TIMEOUT_MS)
    if mode == "one-gpu":
        os.environ[deepep_shim.ONE_GPU_ENV] = "1"
        os.environ.setdefault("EPX_TIMEOUT_MS", ONE_GPU_TIMEOUT_MS)
    if args.emulated_nodes:
        if mode != "one-gpu" or processes % args.emulated_nodes != 0:
            parser.error(f"--emulated-nodes = {args.emulated_nodes}, expected a divisor of the "
                         f"{processes} processes in mode one-gpu (mode here: {mode})")
        os.environ[deepep_shim.NODES_ENV] = str(args.emulated_nodes)
    # The test multiplies 8192 x 8192 matrices on the CPU between its hooks, in every process at
    # once: each gets its share of the cores instead of all of them.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes)))
    print(f"{name}: {test} {' '.join(test_args)} (mode {mode}, {processes} "
          f"processes, package in {where})", flush=True)

    sys.argv = [str(test)] + list(test_args)
    start = time.monotonic()
    try:
        runpy.run_path(str(test), run_name="__main__")
        ok = True
    except SystemExit as e:  # argparse, or the test's own exit
        ok = e.code in (None, 0)
    except BaseException:
        traceback.print_exc()
        ok = False
    print(f"{name}: ran {time.monotonic() - start:.0f} s", flush=True)
    print(f"{name}: {int(ok)} passed, {int(not ok)} failed", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
