"""epx: expert-parallel dispatch/combine for MoE inference, from Python and torch.

    import epx, torch
    cfg = epx.EpConfig(hidden=7168, num_experts=256, topk=8, max_tokens_per_rank=128,
                       dtype="bf16-to-fp8")
    world = epx.ipc_world_from_torch(group)          # or epx.ipc_world_from_env() under `epx launch`
    a2a = epx.All2All.create(cfg, world)
    d = a2a.dispatch(x, topk_ids, topk_weights)      # views of epx memory, valid until the next dispatch
    ...expert stage: read d.recv_x[:d.recv_count], write a2a.combine_buffer()...
    y = a2a.combine(a2a.combine_buffer())

Importing epx needs neither torch nor a GPU: configurations, launch files, sizes and the error
classes work anywhere. Tensors need torch (imported on first use).

Errors: every C++ epx::Error arrives as the Python class of the same name, carrying the C++
message: epx.Error > ConfigError, InputError (both also ValueError), TimeoutError, PeerError,
CudaError, StateError, UnsupportedError.
"""

from . import _epx
from ._epx import (
    ConfigError,
    CudaError,
    Error,
    InputError,
    PeerError,
    StateError,
    TimeoutError,
    UnsupportedError,
    library_version,
    fingerprint,
    CallbackBootstrap,
)
from .config import (
    BACKENDS,
    DEFAULT_BACKEND,
    EpConfig,
    LaunchConfig,
    LaunchConfigs,
    backend_from_env,
    buffer_bytes,
    env,
    ep_config,
    launch_configs,
    launch_configs_from_env,
    launch_configs_from_file,
    launch_configs_from_json,
)
from .world import (
    InProcessWorld,
    IpcWorld,
    NcclWorld,
    ipc_world_from_env,
    ipc_world_from_torch,
    nccl_world_from_env,
    nccl_world_from_torch,
    set_device_max_connections,
)
from .all2all import All2All, DispatchOutput, make_group, sort_rows
from .moe import MoeLayer, MoeShape, ExpertWeights

has_cuda: bool = _epx.has_cuda
__version__ = _epx.library_version()

__all__ = [
    "All2All", "BACKENDS", "CallbackBootstrap", "ConfigError", "CudaError", "DEFAULT_BACKEND",
    "DispatchOutput", "EpConfig", "Error", "ExpertWeights", "InProcessWorld", "InputError",
    "IpcWorld", "LaunchConfig", "LaunchConfigs", "MoeLayer", "MoeShape", "NcclWorld", "PeerError",
    "StateError", "TimeoutError", "UnsupportedError", "backend_from_env", "buffer_bytes", "env",
    "ep_config", "fingerprint", "has_cuda", "ipc_world_from_env", "ipc_world_from_torch",
    "launch_configs", "launch_configs_from_env", "launch_configs_from_file",
    "launch_configs_from_json", "library_version", "make_group", "nccl_world_from_env",
    "nccl_world_from_torch", "set_device_max_connections", "sort_rows",
]
