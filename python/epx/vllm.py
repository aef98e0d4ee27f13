"""epx inside vLLM: a modular-kernel prepare/finalize, an all2all manager and a general plugin.

- ``EpxPrepareAndFinalize(a2a, moe_config=None, quant_config=None)``: vLLM's
  FusedMoEPrepareAndFinalizeModular over an epx.All2All. Its activation format follows the
  All2All's layout:
  - 'expert' -> BatchedExperts ([E/W, capacity, H] per local expert, like DeepEP low-latency):
    expert_num_tokens stays on the device (expert_num_tokens_cpu is None) and nothing
    synchronises the host, so prepare/finalize can be captured in CUDA graphs.
  - 'token' -> Standard, exact rows (like DeepEP high-throughput): prepare reads the received
    row count M on the host (one synchronisation) and returns M rows, deduplicated per rank (one
    row per (token, rank), the token's full top-k row with it), so the experts compute no padding.
    Top-k slots of no expert (-1) name an expert of another rank (the expert map drops them) and
    weigh 0. expert_num_tokens comes on the device and on the host.
  fp8 dispatch is block-scaled (1x128 activation scales, for 128x128 weight blocks): the
  All2All's dtype 'bf16-to-fp8' quantises inside dispatch; 'bf16' sends bf16.
  The experts write their output into epx's combine buffer where vLLM lets them
  (allocate_fused_expert_output); otherwise finalize copies it there. Either way combine never
  reads the tensor it writes (vLLM may hand finalize its `output` as the experts' output).
- ``EpxAll2AllManager(cpu_group)``: one IpcWorld over vLLM's EP group (its gloo group's object
  all-gather bootstraps it) and one All2All per distinct configuration (``get_handle(kwargs)``).
- ``register()``: the ``vllm.general_plugins`` entry point (pyproject.toml). vLLM's all2all
  backend list is closed, so epx does not add a name to it: register() does nothing unless
  EPX_VLLM=1. With EPX_VLLM=1 it replaces exactly one function,
  ``vllm.model_executor.layers.fused_moe.all2all_utils.maybe_make_prepare_finalize`` (and the
  same function object wherever a loaded ``vllm.*`` module imported it by name), with a wrapper
  that returns EpxPrepareAndFinalize where vLLM itself would build an all2all prepare/finalize
  (``moe.moe_parallel_config.use_all2all_kernels``: expert parallelism with DP > 1, and modular
  experts) and calls the original otherwise. The layout follows the format vLLM chose for the
  layer's experts: BatchedExperts (``--moe-backend batched_triton``, or the DeepEP low-latency
  backend's format) -> 'expert', Standard (the default all2all backend) -> 'token'.
  EPX_VLLM_DTYPE ('bf16-to-fp8' when the layer's quant config is fp8 block-quantised, else
  'bf16') and EPX_BACKEND choose the rest of the All2All.

Proven inside vLLM's own FusedMoEKernel (0.33.0 and 0.34.0): tests/python/test_cpu_vllm_kernel.py
on the CPU over a torch model of epx's transport, tests/compat/run_vllm_kernel.py on GPUs.

vLLM is imported lazily: this module imports without it, and then the classes derive from
``object`` with the same methods.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import NamedTuple, Optional

from . import _epx
from . import _torch as T
from .all2all import All2All
from .config import EpConfig


def _modular_kernel():
    try:
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    except Exception:  # vLLM absent (or broken): the stand-in base
        return None
    return mk


class _ExpertTokensMetadata(NamedTuple):
    expert_num_tokens: object
    expert_num_tokens_cpu: object = None


def _expert_tokens_metadata(counts, counts_cpu=None):
    mk = _modular_kernel()
    if mk is None:
        return _ExpertTokensMetadata(counts, counts_cpu)
    return mk.ExpertTokensMetadata(expert_num_tokens=counts, expert_num_tokens_cpu=counts_cpu)


def _quant_dtype(quant_config):
    return getattr(quant_config, "quant_dtype", None) if quant_config is not None else None


def _overlap(a, b) -> bool:
    """Whether tensors a and b share bytes."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0 = a.data_ptr()
    b0 = b.data_ptr()
    a1 = a0 + sum((n - 1) * st for n, st in zip(a.shape, a.stride())) * a.element_size() \
        + a.element_size()
    b1 = b0 + sum((n - 1) * st for n, st in zip(b.shape, b.stride())) * b.element_size() \
        + b.element_size()
    return a0 < b1 and b0 < a1


class _PrepareFinalizeMethods:
    """The methods of EpxPrepareAndFinalize (vLLM's signatures, read in modular_kernel.py)."""

    def _epx_init(self, a2a: All2All):
        self.a2a = a2a
        self._ids_dtype = None

    # -- what vLLM asks before it plans ---------------------------------------------------------

    @property
    def activation_format(self):
        mk = _modular_kernel()
        token = self.a2a.config.layout == "token"
        if mk is None:
            return "standard" if token else "batched_experts"
        f = mk.FusedMoEActivationFormat
        return f.Standard if token else f.BatchedExperts

    def topk_indices_dtype(self):
        return None  # int32 and int64 both go through dispatch as they are

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return self.a2a.config.max_tokens_per_rank

    def num_dispatchers(self) -> int:
        return self.a2a.config.world_size

    def output_is_reduced(self) -> bool:
        return True

    def supports_async(self) -> bool:
        return False

    def allocate_fused_expert_output(self, shape, dtype, device, weight_and_reduce_impl):
        """epx's combine buffer as the experts' output where it fits exactly: expert-major
        [E/W, capacity, H], or token-major [M, H] (experts that weigh and reduce themselves);
        finalize then combines it without a copy."""
        torch = T.torch()
        buf = self.a2a.combine_buffer()
        if dtype != torch.bfloat16 or torch.device(device) != buf.device:
            return None
        shape = tuple(shape)
        if self.a2a.config.layout == "expert":
            return buf if shape == tuple(buf.shape) else None
        if len(shape) == 2 and shape[1] == buf.shape[1] and shape[0] <= buf.shape[0]:
            return buf[: shape[0]]
        return None

    # -- prepare ----------------------------------------------------------------------------------

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input, quant_config, defer_input_quant=False):
        torch = T.torch()
        c = self.a2a.config
        if num_experts != c.num_experts:
            raise _epx.ConfigError(f"num_experts = {num_experts}, expected the All2All's "
                                   f"num_experts = {c.num_experts}")
        qd = _quant_dtype(quant_config)
        if c.dtype == "bf16-to-fp8":
            block = getattr(quant_config, "block_shape", None)
            if defer_input_quant or qd != T.fp8_dtype() or (block is not None
                                                            and list(block)[1] != 128):
                raise _epx.ConfigError(
                    f"quant_config (quant_dtype = {qd}, block_shape = {block}, defer_input_quant "
                    f"= {defer_input_quant}), expected fp8 e4m3 with 128-wide blocks for the "
                    "All2All's dtype 'bf16-to-fp8' (use dtype 'bf16' for unquantised experts)")
        elif c.dtype == "bf16":
            if qd is not None and not defer_input_quant:
                raise _epx.ConfigError(f"quant_config.quant_dtype = {qd}, expected None for the "
                                       "All2All's dtype 'bf16' (or defer_input_quant=True)")
        else:
            raise _epx.ConfigError(f"EpConfig.dtype = '{c.dtype}', expected 'bf16' or "
                                   "'bf16-to-fp8' (vLLM hands prepare bf16 activations)")
        weights = topk_weights.float()
        if apply_router_weight_on_input:
            if c.topk != 1:
                raise _epx.InputError(f"apply_router_weight_on_input with topk = {c.topk}, "
                                      "expected topk = 1")
            a1 = (a1 * topk_weights.to(a1.dtype)).contiguous()
            weights = torch.ones_like(weights)  # combine must not weigh them again
        self._ids_dtype = topk_ids.dtype
        d = self.a2a.dispatch(a1.contiguous(), topk_ids.contiguous(), weights.contiguous())
        if c.layout == "expert":
            return d.expert_x, d.expert_scales, _expert_tokens_metadata(d.expert_counts), \
                None, None
        # Standard, exact rows: the experts compute the M rows received and nothing else. The -1
        # slots of a row name an expert of another rank (the expert map turns it into "not
        # here"; in a world of one rank that expert is local, and the zero weight keeps it out
        # of the sum).
        m = int(d.recv_count.item())
        ids = d.recv_topk_ids[:m]
        used = ids >= 0
        first_local = c.rank * c.num_local_experts
        other = c.num_experts - 1 if first_local == 0 else 0
        ids = torch.where(used, ids, torch.full_like(ids, other))
        w = torch.where(used, d.recv_topk_weights[:m], torch.zeros_like(d.recv_topk_weights[:m]))
        scales = d.recv_scales[:m] if d.recv_scales is not None else None
        meta = _expert_tokens_metadata(d.expert_counts, d.expert_counts.cpu())
        return d.recv_x[:m], scales, meta, ids.to(self._ids_dtype), w

    # -- finalize ---------------------------------------------------------------------------------

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, weight_and_reduce_impl):
        torch = T.torch()
        c = self.a2a.config
        buf = self.a2a.combine_buffer()
        if c.layout == "token":
            # [M, K, H] (unweighted) or [M, H] (reduced) -> [M, H] partials, rows 0..M of the
            # combine buffer (rows past M are not read).
            partials = self._reduce(fused_expert_output, topk_weights, topk_ids,
                                    apply_router_weight_on_input, weight_and_reduce_impl)
            dst = buf[: partials.shape[0]]
        else:
            partials = fused_expert_output  # combine applies the router weights
            dst = buf
        # combine reads its own buffer, never the tensor it writes: vLLM may hand finalize its
        # `output` as the experts' output (when the shapes agree), so partials are moved out of
        # it first.
        if partials.data_ptr() != dst.data_ptr() or partials.stride() != dst.stride():
            dst.copy_(partials)
        direct = (output.dtype == torch.bfloat16 and output.is_contiguous()
                  and output.device == self.a2a.device and not _overlap(output, buf))
        y = self.a2a.combine(buf, out=output if direct else None)
        if not direct:
            output.copy_(y)

    def _reduce(self, out, topk_weights, topk_ids, on_input, impl):
        """[M, K, H] (unweighted) or [M, H] (reduced) expert output -> [M, H] partials."""
        delegate = impl is None or type(impl).__name__ == "TopKWeightAndReduceDelegate"
        if not delegate:
            return impl.apply(output=None, fused_expert_output=out, topk_weights=topk_weights,
                              topk_ids=topk_ids, apply_router_weight_on_input=on_input)
        if out.dim() == 2:
            return out
        w = topk_weights.to(out.dtype)[..., None]
        return out.sum(dim=1) if on_input else (out * w).sum(dim=1)


_classes = {}


def _class(name: str, methods: type, base_name: str):
    """`methods` over vLLM's base class `base_name` when vLLM imports, else over object."""
    if name in _classes:
        return _classes[name]
    mk = _modular_kernel()
    base = getattr(mk, base_name, None) if mk is not None else None
    if base is None and mk is not None and base_name == "FusedMoEPrepareAndFinalizeModular":
        base = getattr(mk, "FusedMoEPrepareAndFinalize", None)  # older vLLM
    cls = type(name, (methods,) if base is None else (methods, base), {})
    _classes[name] = (cls, base)
    return _classes[name]


def EpxPrepareAndFinalize(a2a: All2All, moe_config=None, quant_config=None):
    """A vLLM prepare/finalize over `a2a` (see the module docstring). vLLM's base class takes no
    constructor arguments; moe_config and quant_config are kept for the caller's reference."""
    cls, base = _class("EpxPrepareAndFinalize", _PrepareFinalizeMethods,
                       "FusedMoEPrepareAndFinalizeModular")
    obj = cls()
    obj._epx_init(a2a)
    obj.moe_config, obj.quant_config = moe_config, quant_config
    return obj


class _ManagerMethods:
    def _epx_init(self, cpu_group, device=None):
        from .world import ipc_world_from_torch

        self.world = ipc_world_from_torch(cpu_group, device)
        self.handles = {}

    def get_handle(self, kwargs) -> All2All:
        """The All2All of one configuration: kwargs are EpConfig fields plus 'backend'."""
        key = tuple(sorted(kwargs.items()))
        if key not in self.handles:
            fields = dict(kwargs)
            backend = fields.pop("backend", None)
            self.handles[key] = All2All.create(EpConfig(**fields), self.world, backend)
        return self.handles[key]

    def dispatch(self, *args, **kwargs):
        raise _epx.UnsupportedError("epx dispatches through EpxPrepareAndFinalize (modular kernel)")

    def combine(self, *args, **kwargs):
        raise _epx.UnsupportedError("epx combines through EpxPrepareAndFinalize (modular kernel)")

    def destroy(self):
        # Every rank destroys together, after a barrier: a peer may still read this rank's memory.
        for a2a in self.handles.values():
            a2a.synchronize()
        self.world.barrier()
        for a2a in self.handles.values():
            a2a.close()
        self.handles.clear()


def _init_manager_base(obj, base, cpu_group):
    """vLLM's All2AllManagerBase.__init__ reads vLLM's DP and TP groups; outside a vLLM process
    (no parallel state) the attributes it would set are set here from the group alone."""
    try:
        from vllm.distributed import parallel_state as ps

        ready = getattr(ps, "_DP", None) is not None and getattr(ps, "_TP", None) is not None
    except Exception:
        ready = False
    if ready:
        base.__init__(obj, cpu_group)
        return
    obj.cpu_group, obj.tcp_store_group = cpu_group, None
    obj.rank, obj.world_size = cpu_group.rank(), cpu_group.size()
    obj.dp_group = obj.tp_group = None
    obj.dp_rank, obj.dp_world_size = obj.rank, obj.world_size
    obj.internode = False
    obj.support_fault_tolerance = False


def EpxAll2AllManager(cpu_group, device=None):
    """vLLM's all2all manager over epx: one IpcWorld on `cpu_group` (collective)."""
    try:
        import vllm.distributed.device_communicators.base_device_communicator as bdc

        base = getattr(bdc, "All2AllManagerBase", None)
    except Exception:
        base = None
    cls = _classes.get("EpxAll2AllManager")
    if cls is None:
        cls = (type("EpxAll2AllManager", (_ManagerMethods,) if base is None
                    else (_ManagerMethods, base), {}), base)
        _classes["EpxAll2AllManager"] = cls
    cls, base = cls
    obj = cls.__new__(cls)
    if base is not None:
        _init_manager_base(obj, base, cpu_group)
    obj._epx_init(cpu_group, device)
    return obj


_manager = None


def set_manager(manager) -> None:
    """The all2all manager the plugin's prepare/finalize objects use (an EpxAll2AllManager, or
    anything with its get_handle); by default one is made on vLLM's EP group at first use."""
    global _manager
    _manager = manager


def _batched_format(moe) -> bool:
    """Whether vLLM runs the layer's experts in the BatchedExperts format (else Standard)."""
    fmt = getattr(moe, "activation_format", None)  # vLLM >= 0.34: the format vLLM chose
    if fmt is not None and not isinstance(fmt, str):
        batched = getattr(fmt, "is_batched", None)
        return bool(batched) if batched is not None else fmt.name == "BatchedExperts"
    parallel = getattr(moe, "moe_parallel_config", None)  # 0.33: what its oracles read
    return bool(getattr(parallel, "use_batched_activation_format", False)) or \
        getattr(moe, "moe_backend", None) == "batched_triton"


def _layout_for(moe) -> str:
    layout = "expert" if _batched_format(moe) else "token"
    asked = os.environ.get("EPX_VLLM_LAYOUT")
    if asked and asked != layout:
        raise _epx.ConfigError(
            f"EPX_VLLM_LAYOUT = '{asked}', expected '{layout}': vLLM runs this layer's experts "
            f"in the {'BatchedExperts' if layout == 'expert' else 'Standard'} format (the "
            "layout follows it; --moe-backend batched_triton gives BatchedExperts)")
    return layout


def _prepare_finalize_for(moe, quant_config, all2all_manager=None):
    """EpxPrepareAndFinalize for a vLLM layer's FusedMoEConfig `moe` (the plugin's path)."""
    global _manager
    manager = all2all_manager if isinstance(all2all_manager, _ManagerMethods) else _manager
    if manager is None:
        from vllm.distributed import get_ep_group

        manager = _manager = EpxAll2AllManager(get_ep_group().cpu_group,
                                               T.torch().cuda.current_device())
    need = {"hidden": "hidden_dim", "num_experts": "num_experts", "topk": "experts_per_token",
            "max_tokens_per_rank": "max_num_tokens"}
    missing = [a for a in need.values() if not hasattr(moe, a)]
    if missing:
        raise _epx.UnsupportedError(f"this vLLM's FusedMoEConfig lacks {missing}: epx.vllm "
                                    "reads hidden_dim, num_experts, experts_per_token, "
                                    "max_num_tokens")
    qd = _quant_dtype(quant_config)
    block = getattr(quant_config, "block_shape", None)
    fp8_blocks = qd == T.fp8_dtype() and block is not None and list(block)[1] == 128
    kwargs = {k: int(getattr(moe, a)) for k, a in need.items()}
    kwargs.update(dtype=os.environ.get("EPX_VLLM_DTYPE", "bf16-to-fp8" if fp8_blocks else "bf16"),
                  layout=_layout_for(moe))
    backend = os.environ.get("EPX_BACKEND")
    if backend:
        kwargs["backend"] = backend
    return EpxPrepareAndFinalize(manager.get_handle(kwargs), moe, quant_config)


def _epx_applies(moe, kwargs) -> bool:
    """Where vLLM would build an all2all prepare/finalize: expert parallelism over more than one
    DP rank (use_all2all_kernels), modular experts, no pass-through all2all."""
    parallel = getattr(moe, "moe_parallel_config", None)
    if parallel is None or kwargs.get("use_monolithic", False):
        return False
    if getattr(parallel, "use_passthrough_all2all", False):
        return False
    if hasattr(parallel, "use_all2all_kernels"):
        return bool(parallel.use_all2all_kernels)
    return bool(getattr(parallel, "use_ep", False)) and getattr(parallel, "dp_size", 1) > 1


def register() -> None:
    """vLLM general plugin (entry point group ``vllm.general_plugins``, name ``epx``).

    Does nothing unless EPX_VLLM=1. Then it replaces
    ``vllm.model_executor.layers.fused_moe.all2all_utils.maybe_make_prepare_finalize`` (and every
    loaded ``vllm.*`` module's reference to that same function) with a wrapper that builds
    EpxPrepareAndFinalize where vLLM would build an all2all prepare/finalize (its
    ``use_all2all_kernels``: expert parallelism with DP > 1; modular experts) and calls the
    original otherwise. The All2All's layout follows the experts' format vLLM chose
    (BatchedExperts -> 'expert', Standard -> 'token'). Nothing else is changed; calling it twice
    changes nothing more.
    """
    if os.environ.get("EPX_VLLM", "0") != "1":
        return
    import vllm.model_executor.layers.fused_moe.all2all_utils as utils

    original = utils.maybe_make_prepare_finalize
    if getattr(original, "_epx_wrapper", False):
        return

    signature = inspect.signature(original)

    def maybe_make_prepare_finalize(moe, quant_config, *args, **kwargs):
        try:
            named = signature.bind(moe, quant_config, *args, **kwargs).arguments
        except TypeError:  # not a call vLLM's function takes: let it say so
            return original(moe, quant_config, *args, **kwargs)
        if not _epx_applies(moe, named):
            return original(moe, quant_config, *args, **kwargs)
        return _prepare_finalize_for(moe, quant_config, named.get("all2all_manager"))

    maybe_make_prepare_finalize._epx_wrapper = True
    maybe_make_prepare_finalize._epx_original = original
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm") and getattr(module, "maybe_make_prepare_finalize",
                                               None) is original:
            setattr(module, "maybe_make_prepare_finalize", maybe_make_prepare_finalize)
