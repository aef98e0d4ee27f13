#!/usr/bin/env python3
"""Runs vLLM's own fused-MoE modular kernel (FusedMoEKernel: prepare/finalize + experts, `apply`)
with epx's prepare/finalize on GPUs, against a dense torch MoE over the full weights at vLLM's
tolerance (tests/python/vllm_kernel_case.py).

    python3 tests/compat/run_vllm_kernel.py [--bundle .vllm] [--worlds 1,2,4] [--cases ...]

Each world size W runs as W processes on GPU 0 (or one GPU per rank with --gpu-per-rank), a
gloo group among them and epx.ipc_world_from_torch over it; every rank builds vLLM's
FusedMoEConfig for its DP/EP rank, the kernel, and calls apply with its slice of the weights and
its expert map. The cases (each in every world):

- expert layout (BatchedExperts) x {NaiveBatchedExperts, BatchedTritonExperts} x {bf16, fp8
  (128x128 weight blocks, 1x128 activation scales)};
- token layout (Standard) with a torch Standard experts class x {bf16, fp8};
- plugin: vLLM's maybe_make_prepare_finalize, patched by epx.vllm.register(), builds the
  prepare/finalize (EpxAll2AllManager on the group), bf16, both layouts (W > 1: with one DP rank
  vLLM builds no all2all prepare/finalize, and the runner checks that it keeps its own);
- each case makes calls above max_num_tokens, split in chunks as vLLM's layer splits them.

vLLM comes from a bundle (tools/vllm/bundle.sh; --bundle, default .vllm, or $EPX_VLLM_BUNDLE)
unless it imports already. One line per case and world, then a closing line:
``vllm_kernel: vLLM 0.34.0, epx <commit>, <device>, processes 1,2,4: N passed, M failed``.
The exit status is 0 when every case passed.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "python"))
sys.path.insert(0, str(REPO / "tools" / "vllm"))

CASES = [f"{e}-{d}" for e in ("naive_batched", "batched_triton", "torch_standard")
         for d in ("bf16", "fp8")] + ["plugin-naive_batched", "plugin-torch_standard"]
# Token counts per step for rank r of W: one step under max_tokens, one above (chunked), one
# where a rank has none.
STEPS = [lambda r, W: 5 + 3 * r, lambda r, W: 37 - 5 * r, lambda r, W: 0 if r == W - 1 else 9]
TIMEOUT_MS = "120000"  # ranks time-share one GPU and compute the dense reference on it


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return "unknown"


def _activate(bundle):
    """Puts the bundle on sys.path (before vLLM is imported); without one, vLLM as installed."""
    if not bundle:
        return "installed"
    import bundle_env

    return bundle_env.activate(bundle)["vllm"]


def _run_case(name, rank, world, group, device, manager, weights_cache):
    import torch
    import torch.distributed as dist

    import epx
    import epx.vllm
    import vllm_kernel_case as case

    shape = case.Shape(hidden=1024, intermediate=512, num_experts=16, topk=4, max_tokens=16)
    plugin = name.startswith("plugin-")
    experts, dtype = (name.split("-", 1)[1], "bf16") if plugin else name.rsplit("-", 1)
    key = dtype
    if key not in weights_cache:
        weights_cache[key] = case.Weights(shape, dtype, device)
    weights = weights_cache[key]
    moe = case.moe_config(shape, world, rank, experts, device)
    qc = weights.quant_config(world, rank)
    if plugin:
        import vllm.model_executor.layers.fused_moe.all2all_utils as au

        pf = au.maybe_make_prepare_finalize(moe=moe, quant_config=qc, routing_tables=None,
                                            allow_new_interface=True, use_monolithic=False,
                                            all2all_manager=manager)
        if world == 1:
            assert type(pf).__name__ != "EpxPrepareAndFinalize", type(pf)
            return "vLLM kept its own prepare/finalize (one DP rank)"
        assert type(pf).__name__ == "EpxPrepareAndFinalize", type(pf)
        assert pf.a2a.config.layout == case.layout_of(experts)
    else:
        a2a = manager.get_handle(case.handle_kwargs(shape, experts, dtype))
        pf = epx.vllm.EpxPrepareAndFinalize(a2a, moe, qc)
    kernel = case.make_kernel(pf, moe, qc, experts)
    tokens = [[step(q, world) for q in range(world)] for step in STEPS]
    worst = case.run_rank(kernel, weights, shape, world, rank, tokens, seed=5, device=device,
                          sync=torch.cuda.synchronize if device.type == "cuda" else None)
    dist.barrier(group)
    return f"worst |err|/(1+|ref|) {worst:.4f}"


def _gloo_fake_manager(group):
    """--cpu: an all2all manager whose All2Alls are test_cpu_deep_ep_fake_core's torch model of
    epx's contract, the ranks' data exchanged through the gloo group instead of threads."""
    import torch.distributed as dist

    import epx
    import epx.vllm
    import test_cpu_deep_ep_fake_core as fake

    class GlooFakeAll2All(fake.FakeAll2All):
        def __init__(self, cfg, world):
            self.shared = {}
            super().__init__(cfg, world)

        def _exchange(self, what, call, value):
            got = [None] * self.config.world_size
            dist.all_gather_object(got, value, group=group)
            return dict(enumerate(got))

    class World:
        fabric = fake.Fabric(1)  # only its lock is used: the exchange goes through gloo

        def __init__(self):
            self.rank, self.size, self.made = group.rank(), group.size(), 0

    class Manager(epx.vllm._ManagerMethods):
        def __init__(self):
            self.world, self.handles = World(), {}

        def get_handle(self, kwargs):
            key = tuple(sorted(kwargs.items()))
            if key not in self.handles:
                self.handles[key] = GlooFakeAll2All(epx.EpConfig(**kwargs), self.world)
            return self.handles[key]

        def destroy(self):
            self.handles.clear()

    return Manager()


def _worker(rank, world, port, cases, bundle, gpu_per_rank, queue, cpu=False):
    os.environ.setdefault("EPX_TIMEOUT_MS", TIMEOUT_MS)
    try:
        _activate(bundle)
        import torch
        import torch.distributed as dist

        device = torch.device("cpu") if cpu else torch.device("cuda", rank if gpu_per_rank
                                                               else 0)
        if not cpu:
            torch.cuda.set_device(device)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        group = dist.group.WORLD
        import epx.vllm
        from vllm.v1.worker import workspace

        workspace.init_workspace_manager(device)
        os.environ["EPX_VLLM"] = "1"
        epx.vllm.register()
        if cpu:
            import torch.accelerator
            from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe

            if not torch.accelerator.is_available():  # nothing is captured on the CPU
                fused_batched_moe._is_capturing_or_compiling = torch.compiler.is_compiling
            manager = _gloo_fake_manager(group)
        else:
            manager = epx.vllm.EpxAll2AllManager(group, device.index)
    except BaseException:
        queue.put((rank, "setup", False, traceback.format_exc()))
        return
    weights_cache = {}
    for name in cases:
        start = time.monotonic()
        try:
            dist.barrier(group)
            note = _run_case(name, rank, world, group, device, manager, weights_cache)
            queue.put((rank, name, True, f"{note} ({time.monotonic() - start:.1f} s)"))
        except BaseException:
            queue.put((rank, name, False, traceback.format_exc()))
            break  # the others may wait for this rank: the world ends here
    try:
        manager.destroy()
        dist.destroy_process_group()
    except BaseException:
        pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", default=None, help="a vLLM bundle (default .vllm or "
                        "$EPX_VLLM_BUNDLE, when vLLM does not import as installed)")
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--gpu-per-rank", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="no GPU: the ranks' All2Alls are a "
                        "torch model of epx's contract over gloo (checks the runner itself)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per world")
    args = parser.parse_args(argv)
    version = _activate(args.bundle or os.environ.get("EPX_VLLM_BUNDLE")
                        or (str(REPO / ".vllm") if (REPO / ".vllm").exists() else None))
    import importlib.metadata

    import torch
    import torch.multiprocessing as mp

    version = importlib.metadata.version("vllm")
    device_name = "CPU (fake transport)" if args.cpu else torch.cuda.get_device_name(0)
    worlds = [int(w) for w in args.worlds.split(",")]
    cases = [c for c in args.cases.split(",") if c]
    from vllm.triton_utils import HAS_TRITON

    print(f"vllm_kernel: vLLM {version} (Triton {'on' if HAS_TRITON else 'off'}), torch "
          f"{torch.__version__}, {device_name}, cases {len(cases)}, worlds {worlds}", flush=True)
    if not HAS_TRITON or args.cpu:
        cases = [c for c in cases if not c.startswith("batched_triton")]
        print("vllm_kernel: no Triton (vLLM disabled it, or --cpu): the batched_triton cases "
              "are left out", flush=True)
    passed = failed = 0
    ctx = mp.get_context("spawn")
    for world in worlds:
        queue = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, cases,
                                                    args.bundle, args.gpu_per_rank, queue,
                                                    args.cpu))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        deadline = time.monotonic() + args.timeout
        expected = world * len(cases)
        while len(results) < expected and time.monotonic() < deadline:
            try:
                rank, name, ok, note = queue.get(timeout=5)
            except Exception:
                if not any(p.is_alive() for p in procs) and queue.empty():
                    break
                continue
            results[(rank, name)] = (ok, note)
            if name == "setup":
                break
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        earlier_failed = False  # a rank that fails a case ends its world: the rest do not run
        for name in cases:
            per_rank = [results.get((r, name)) for r in range(world)]
            setup = results.get((0, "setup")) or next(
                (results[(r, "setup")] for r in range(world) if (r, "setup") in results), None)
            ok = all(x is not None and x[0] for x in per_rank)
            passed += ok
            failed += not ok
            if ok:
                note = per_rank[0][1]
            else:
                bad = next((x for x in per_rank if x is not None and not x[0]), setup)
                if bad:
                    note = bad[1].strip().splitlines()[-1]
                elif earlier_failed:
                    note = "not run: an earlier case failed, which ends the world"
                else:
                    note = "no result (timed out or a rank died)"
                earlier_failed = True
            print(f"vllm_kernel: {name} x{world}: {'PASS' if ok else 'FAIL'} {note}", flush=True)
            for r, x in enumerate(per_rank):
                if x is not None and not x[0]:
                    print(f"--- rank {r} of {world}, {name}:\n{x[1]}", flush=True)
        if setup_failed := [r for r in range(world) if (r, "setup") in results]:
            print(f"--- setup failed on ranks {setup_failed}:\n"
                  f"{results[(setup_failed[0], 'setup')][1]}", flush=True)
    print(f"vllm_kernel: vLLM {version}, epx {_commit()}, {device_name}, processes "
          f"{','.join(map(str, worlds))}: {passed} passed, {failed} failed", flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
