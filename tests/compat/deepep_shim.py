"""What DeepEP's own tests need around epx.deep_ep, assembled at run time (none of DeepEP's files
are in this project):

- ``assemble(checkout, where)`` writes a package ``deep_ep`` under `where`: epx.deep_ep (Buffer,
  EventOverlap, topk_idx_t, ...) under DeepEP's package name, a stand-in for DeepEP's extension
  module ``deep_ep._C`` (the names DeepEP's utilities import from it), and ``deep_ep.utils`` as a
  link to the checkout's own ``deep_ep/utils`` (init_dist, calc_diff, per_token_cast_back,
  bench, bench_kineto ...), imported from there as they are.
- ``install_one_gpu()`` (run by that package's import when EPX_DEEP_EP_ONE_GPU=1, so in every
  process the test spawns) lets N processes share GPU 0: DeepEP's ``init_dist`` is replaced by one
  that makes a gloo group (NCCL refuses two ranks on one GPU) and selects GPU 0, and the CUDA
  collectives gloo lacks are staged through the CPU (``all_gather_into_tensor``, and
  ``all_gather``, ``all_reduce`` and ``all_to_all_single`` of CUDA tensors; the last as bytes,
  for the fp8 rows of V2's reference dispatch). Only torch.distributed functions of the test's processes are
  replaced; the epx side is unchanged (its bootstrap only needs the group's object all-gather).
- ``emulate_node(rank, world_size)`` (called by that init_dist when EPX_DEEP_EP_EMULATED_NODES=N,
  the runner's --emulated-nodes): each process one of N emulated nodes (LOCAL_WORLD_SIZE, and an
  NCCL_HOSTID of its own), so that epx.deep_ep's Buffer builds an NcclWorld across them.
- ``preparing_buffer(Buffer, spec)`` (used by that package when EPX_DEEP_EP_SHAPES="T,H,E,K" is
  set, for DeepEP's --shrink-test): a Buffer whose constructor also makes the low-latency shapes
  of T tokens, hidden H, E experts and top-K, on each wire (DeepEP's test dispatches with
  use_fp8 off and on, and with round_scale, its own shape), while every rank is there. epx's shrink mode needs every shape made before
  a rank stops calling (making a shape is collective), and DeepEP's test makes its first dispatch
  after a rank has stopped; its own Buffer needs no shapes up front.
"""

from __future__ import annotations

import os
from pathlib import Path

ONE_GPU_ENV = "EPX_DEEP_EP_ONE_GPU"
SHAPES_ENV = "EPX_DEEP_EP_SHAPES"
NODES_ENV = "EPX_DEEP_EP_EMULATED_NODES"  # the runner's --emulated-nodes: see emulate_node

_INIT = '''\
"""deep_ep as DeepEP's tests import it, assembled by epx's {runner}: epx.deep_ep under DeepEP's
package name; deep_ep.utils is DeepEP's own (a link into the checkout {checkout})."""

import os as _os
import sys as _sys

import epx.deep_ep as _impl
from epx.deep_ep import *  # noqa: F401,F403
from epx.deep_ep import Buffer, Config, ElasticBuffer, EventHandle, EventOverlap  # noqa: F401

__version__ = "epx-" + __import__("epx").__version__


def __getattr__(name):
    return getattr(_impl, name)


if _os.environ.get("{env}") == "1":
    _sys.path.insert(0, {compat_dir!r})
    import deepep_shim as _shim

    _shim.install_one_gpu()

if _os.environ.get("{shapes_env}"):
    _sys.path.insert(0, {compat_dir!r})
    import deepep_shim as _shim

    Buffer = _shim.preparing_buffer(Buffer, _os.environ["{shapes_env}"])
'''

_EXTENSION = '''\
"""Stands in for DeepEP's extension module in a package assembled by epx's {runner}: the names
DeepEP's utilities import from it. DeepEP's own runtime (NVSHMEM, NCCL communicators, JIT) is
not here: asking for anything else raises AttributeError naming it."""

from epx.deep_ep import Config, EventHandle  # noqa: F401


def __getattr__(name):
    if name == "topk_idx_t":
        import torch

        return torch.int64
    raise AttributeError(f"deep_ep._C.{{name}}: DeepEP's extension is not part of epx.deep_ep")
'''


def check_checkout(checkout: Path) -> None:
    """ValueError naming what is missing unless `checkout` holds deep_ep/utils and tests."""
    for rel in ("deep_ep/utils/__init__.py", "deep_ep/utils/envs.py", "tests/legacy"):
        if not (checkout / rel).exists():
            raise ValueError(f"DeepEP checkout {checkout}: {rel} is missing (expected a tree of "
                             "DeepEP's repository: deep_ep/utils and tests)")


def assemble(checkout: Path, where: Path) -> Path:
    """Writes the package `where`/deep_ep; returns its folder."""
    checkout = Path(checkout).resolve()
    check_checkout(checkout)
    pkg = Path(where) / "deep_ep"
    pkg.mkdir(parents=True, exist_ok=True)
    runner = "tests/compat/run_deepep_low_latency.py"
    compat_dir = str(Path(__file__).resolve().parent)
    (pkg / "__init__.py").write_text(_INIT.format(runner=runner, checkout=checkout,
                                                  env=ONE_GPU_ENV, shapes_env=SHAPES_ENV,
                                                  compat_dir=compat_dir))
    (pkg / "_C.py").write_text(_EXTENSION.format(runner=runner))
    utils = pkg / "utils"
    if utils.is_symlink() or utils.exists():
        utils.unlink()
    utils.symlink_to(checkout / "deep_ep" / "utils", target_is_directory=True)
    return pkg


def parse_shapes(spec: str):
    """"T,H,E,K" -> (T, H, E, K) as ints; ValueError naming the variable otherwise."""
    parts = spec.split(",")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 4:
        raise ValueError(f"{SHAPES_ENV} = {spec!r}, expected four integers "
                         "'num_tokens,hidden,num_experts,num_topk'")
    return values


def preparing_buffer(base, spec: str):
    """A subclass of `base` (epx.deep_ep.Buffer) whose low-latency instances make the shapes of
    `spec` ("T,H,E,K") on each wire in their constructor (see the module docstring)."""
    tokens, hidden, experts, topk = parse_shapes(spec)

    class Buffer(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.low_latency_mode:
                # collective: every rank, in this order
                for wire in ({"use_fp8": False}, {"use_fp8": True},
                             {"use_fp8": True, "round_scale": True}):
                    self.prepare_low_latency_shape(tokens, hidden, experts, topk, **wire)

    Buffer.__qualname__ = Buffer.__name__ = base.__name__
    Buffer.__doc__ = base.__doc__
    return Buffer


def as_bytes(t):
    """A contiguous tensor of one or more dimensions as a [rows, bytes of a row] uint8 view (its
    first dimension kept: the collectives' splits count rows)."""
    import math

    import torch

    return t.view(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


class _Done:
    """The work object of a collective that already finished (async_op=True callers wait)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_installed = False


def emulate_node(rank: int, world_size: int) -> None:
    """With NODES_ENV = N set (the runner's --emulated-nodes): this process as one of N nodes of
    world_size / N ranks each: LOCAL_RANK and LOCAL_WORLD_SIZE as torchrun sets them, and an
    NCCL_HOSTID of its own, so that NCCL, which refuses two ranks of one host on one GPU, sees
    every process as a host (epx groups the nodes by LOCAL_WORLD_SIZE, not by NCCL's hosts)."""
    nodes = int(os.environ.get(NODES_ENV, "0") or 0)
    if nodes <= 0:
        return
    local = world_size // nodes
    os.environ["LOCAL_WORLD_SIZE"] = str(local)
    os.environ["LOCAL_RANK"] = str(rank % local)
    os.environ["NCCL_HOSTID"] = f"epx-emulated-{rank}"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def install_one_gpu() -> None:
    """N ranks on GPU 0 over gloo (see the module docstring). Idempotent."""
    global _installed
    if _installed:
        return
    import torch
    import torch.distributed as dist

    import deep_ep.utils.envs as envs

    def init_dist(local_rank: int, num_local_ranks: int, seed: int = 0):
        # DeepEP's init_dist, for one node and one GPU: gloo, every rank on cuda:0, the same
        # defaults and seeds as DeepEP's.
        address = os.getenv("MASTER_ADDR", "127.0.0.1")
        port = int(os.getenv("MASTER_PORT", "8361"))
        emulate_node(local_rank, num_local_ranks)
        dist.init_process_group(backend="gloo", init_method=f"tcp://{address}:{port}",
                                world_size=num_local_ranks, rank=local_rank)
        torch.cuda.set_device(0)
        torch.set_default_dtype(torch.bfloat16)
        torch.set_default_device("cuda")
        if hasattr(envs, "_local_rank"):
            envs._local_rank = local_rank
        if hasattr(envs, "init_seed"):
            envs.init_seed(seed)
        group = dist.new_group(list(range(num_local_ranks)))
        return dist.get_rank(), dist.get_world_size(), group

    gather_into = dist.all_gather_into_tensor
    gather = dist.all_gather
    reduce = dist.all_reduce
    to_all = dist.all_to_all_single

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if not (output_tensor.is_cuda or input_tensor.is_cuda):
            return gather_into(output_tensor, input_tensor, group=group, async_op=async_op)
        n = dist.get_world_size(group)
        mine = input_tensor.detach().to("cpu").contiguous()
        parts = [torch.empty_like(mine) for _ in range(n)]
        gather(parts, mine, group=group)
        output_tensor.copy_(torch.cat(parts).reshape(output_tensor.shape))
        return _Done() if async_op else None

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if not (tensor.is_cuda or any(t.is_cuda for t in tensor_list)):
            return gather(tensor_list, tensor, group=group, async_op=async_op)
        parts = [torch.empty_like(t, device="cpu") for t in tensor_list]
        gather(parts, tensor.detach().to("cpu").contiguous(), group=group)
        for t, part in zip(tensor_list, parts):
            t.copy_(part)
        return _Done() if async_op else None

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not tensor.is_cuda:
            return reduce(tensor, op=op, group=group, async_op=async_op)
        staged = tensor.detach().to("cpu")
        reduce(staged, op=op, group=group)
        tensor.copy_(staged)
        return _Done() if async_op else None

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        if not (output.is_cuda or input.is_cuda):
            return to_all(output, input, output_split_sizes, input_split_sizes, group=group,
                          async_op=async_op)
        # as bytes: gloo knows no fp8 (the splits count rows of dim 0, unchanged)
        staged = torch.empty(output.shape, dtype=output.dtype, device="cpu")
        mine = input.detach().to("cpu").contiguous()
        to_all(as_bytes(staged), as_bytes(mine), output_split_sizes, input_split_sizes,
               group=group)
        output.copy_(staged)
        return _Done() if async_op else None

    envs.init_dist = init_dist
    dist.all_to_all_single = all_to_all_single
    dist.all_gather_into_tensor = all_gather_into_tensor
    dist.all_gather = all_gather
    dist.all_reduce = all_reduce
    _installed = True

