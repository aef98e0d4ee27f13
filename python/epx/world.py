"""Worlds from Python: how ranks reach each other (DESIGN §3).

- ``InProcessWorld(num_ranks, devices=[])``: N ranks in this process. Ranks that share a GPU run
  concurrently on their own streams, so the process needs one hardware queue per rank: set
  ``CUDA_DEVICE_MAX_CONNECTIONS=32`` before CUDA starts (before torch's first CUDA call);
  otherwise more than 8 ranks on one GPU raise ConfigError naming the variable.
- ``ipc_world_from_env()``: one process per rank on one node, started by ``epx launch``
  (EPX_RANK, EPX_WORLD_SIZE, EPX_BOOTSTRAP).
- ``ipc_world_from_torch(group)``: one process per rank, bootstrapped through a
  ``torch.distributed`` process group's object all-gather (gloo is enough); memory is shared with
  CUDA IPC handles (the all-gather cannot pass file descriptors).
- ``nccl_world_from_env()`` / ``nccl_world_from_torch(group)``: NcclWorld (one GPU per rank,
  NCCL 2.28 loaded at run time).

Each constructor is collective over its ranks and raises what the C++ one raises (TimeoutError
naming a rank that never came, PeerError, UnsupportedError without a GPU).
"""

from __future__ import annotations

from typing import Optional

from . import _epx
from ._torch import torch

if _epx.has_cuda:
    InProcessWorld = _epx.InProcessWorld
    IpcWorld = _epx.IpcWorld
    NcclWorld = _epx.NcclWorld
else:  # pragma: no cover - builds without the CUDA toolkit

    class _NoCuda:
        def __init__(self, *args, **kwargs):
            raise _epx.UnsupportedError("this epx was built without CUDA: no worlds")

    InProcessWorld = IpcWorld = NcclWorld = _NoCuda


def torch_all_gather(group=None):
    """(rank, size, all_gather) over a torch.distributed group: all_gather(bytes) -> [bytes].

    Uses ``all_gather_object``; with a gloo group nothing touches the GPU.
    """
    dist = torch().distributed
    rank = dist.get_rank(group)
    size = dist.get_world_size(group)

    def all_gather(data: bytes) -> list:
        out = [None] * size
        dist.all_gather_object(out, bytes(data), group=group)
        return [bytes(b) for b in out]

    return rank, size, all_gather


def _device_index(device) -> int:
    if device is None:
        return -1
    if isinstance(device, int):
        return device
    d = torch().device(device)
    if d.type != "cuda":
        raise _epx.InputError(f"device = {d}, expected a CUDA device")
    return -1 if d.index is None else d.index


def ipc_world_from_env(device=None, handles: str = "auto") -> "IpcWorld":
    """This process's IpcWorld, from EPX_RANK / EPX_WORLD_SIZE / EPX_BOOTSTRAP (``epx launch``).

    `device`: a CUDA ordinal or torch.device; None = the current device (torch.cuda.set_device
    first). `handles`: 'auto', 'posix-fd' or 'cuda-ipc'.
    """
    return IpcWorld.from_env(_device_index(device), handles)


def ipc_world_from_torch(group=None, device=None, handles: str = "auto") -> "IpcWorld":
    """This process's IpcWorld over a torch.distributed group (collective over the group)."""
    rank, size, all_gather = torch_all_gather(group)
    return IpcWorld.from_all_gather(rank, size, all_gather, _device_index(device), handles)


def nccl_world_from_env(device=None) -> "NcclWorld":
    """This process's NcclWorld (``epx launch``; one GPU per rank)."""
    return NcclWorld.from_env(_device_index(device))


def nccl_world_from_torch(group=None, device=None, local_world_size=None) -> "NcclWorld":
    """This process's NcclWorld, its unique id passed through a torch.distributed group.

    local_world_size: the ranks of each node (the group's ranks sit on the nodes in blocks);
    None takes torchrun's LOCAL_WORLD_SIZE when the group is the default one, else one node.
    Across nodes every backend runs on the collective engine (NCCL's all-gather and grouped
    send/recv between nodes; docs/scale-out.md)."""
    import os

    rank, size, all_gather = torch_all_gather(group)
    if local_world_size is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        local_world_size = int(env) if env and group is None else 0
    return NcclWorld.from_all_gather(rank, size, all_gather, _device_index(device),
                                     local_world_size)


def set_device_max_connections(value: int = 32) -> Optional[str]:
    """Sets CUDA_DEVICE_MAX_CONNECTIONS unless it is set already; returns the value in force.

    Call it before CUDA starts (before torch's first CUDA call) in a process that runs several
    in-process ranks on one GPU: each rank's stream needs a hardware queue of its own.
    """
    import os

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", str(value))
    return os.environ["CUDA_DEVICE_MAX_CONNECTIONS"]
