"""epx inside vLLM: a modular-kernel prepare/finalize, an all2all manager and a general plugin.

- ``EpxPrepareAndFinalize(a2a)``: vLLM's FusedMoEPrepareAndFinalizeModular over an epx.All2All.
  Its activation format follows the All2All's layout: 'token' -> Standard (token-major rows,
  deduplicated per rank: one row per (token, rank), the token's full top-k row with it);
  'expert' -> BatchedExperts ([E/W, capacity, H] per local expert, like DeepEP low-latency).
  fp8 dispatch is block-scaled (1x128 activation scales, for 128x128 weight blocks): the
  All2All's dtype 'bf16-to-fp8' quantises inside dispatch; 'bf16' sends bf16.
  expert_num_tokens stays on the device (ExpertTokensMetadata.expert_num_tokens_cpu is None), and
  nothing synchronises the host, so prepare/finalize can be captured in CUDA graphs. Standard
  returns all `capacity` rows: rows past recv_count (and the -1 slots of a row) carry weight 0 and
  an expert id that is not this rank's (the expert map drops them), so the experts need no
  host-side row count.
- ``EpxAll2AllManager(cpu_group)``: one IpcWorld over vLLM's EP group (its gloo group's object
  all-gather bootstraps it) and one All2All per distinct configuration (``get_handle(kwargs)``).
- ``register()``: the ``vllm.general_plugins`` entry point (pyproject.toml). vLLM's all2all
  backend list is closed, so epx does not add a name to it: register() does nothing unless
  EPX_VLLM=1. With EPX_VLLM=1 it replaces exactly one function,
  ``vllm.model_executor.layers.fused_moe.all2all_utils.maybe_make_prepare_finalize`` (and the
  same function object wherever a loaded ``vllm.*`` module imported it by name), with a wrapper
  that returns EpxPrepareAndFinalize for layers that run with expert parallelism
  (``moe.moe_parallel_config.use_ep``) and calls the original otherwise. EPX_VLLM_LAYOUT
  ('expert', default, or 'token'), EPX_VLLM_DTYPE ('bf16-to-fp8' when the layer's quant config
  is fp8 block-quantised, else 'bf16') and EPX_BACKEND choose the All2All.

vLLM is imported lazily: this module imports without it, and then the classes derive from
``object`` with the same methods (that is how the tests drive them).
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


def _expert_tokens_metadata(counts):
    mk = _modular_kernel()
    if mk is None:
        return _ExpertTokensMetadata(counts, None)
    return mk.ExpertTokensMetadata(expert_num_tokens=counts, expert_num_tokens_cpu=None)


def _quant_dtype(quant_config):
    return getattr(quant_config, "quant_dtype", None) if quant_config is not None else None


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
        meta = _expert_tokens_metadata(d.expert_counts)
        if c.layout == "expert":
            return d.expert_x, d.expert_scales, meta, None, None
        # Standard: every row of the receive area; rows past recv_count, and the -1 slots of the
        # others, weigh nothing and name an expert of another rank (the expert map turns it into
        # "not here"; in a world of one rank that expert is local, and the zero weight keeps it
        # out of the sum).
        cap = c.capacity
        rows = torch.arange(cap, device=d.recv_count.device, dtype=torch.int32)
        used = (rows < d.recv_count)[:, None] & (d.recv_topk_ids >= 0)
        first_local = c.rank * c.num_local_experts
        other = c.num_experts - 1 if first_local == 0 else 0
        ids = torch.where(used, d.recv_topk_ids, torch.full_like(d.recv_topk_ids, other))
        w = torch.where(used, d.recv_topk_weights, torch.zeros_like(d.recv_topk_weights))
        return d.recv_x, d.recv_scales, meta, ids.to(self._ids_dtype), w

    # -- finalize ---------------------------------------------------------------------------------

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, weight_and_reduce_impl):
        torch = T.torch()
        c = self.a2a.config
        if c.layout == "token":
            partials = self._reduce(fused_expert_output, topk_weights, topk_ids,
                                    apply_router_weight_on_input, weight_and_reduce_impl)
        else:
            partials = fused_expert_output  # combine applies the router weights
        partials = partials.to(torch.bfloat16).contiguous()
        direct = (output.dtype == torch.bfloat16 and output.is_contiguous()
                  and output.device == self.a2a.device)
        y = self.a2a.combine(partials, out=output if direct else None)
        if not direct:
            output.copy_(y)

    def _reduce(self, out, topk_weights, topk_ids, on_input, impl):
        """[capacity, K, H] (unweighted) or [capacity, H] (reduced) expert output -> partials."""
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


def _init_base(self, base, *args):
    if base is None:
        return
    params = list(inspect.signature(base.__init__).parameters)[1:]
    base.__init__(self, *args[: len(params)])


def EpxPrepareAndFinalize(a2a: All2All, moe_config=None, quant_config=None):
    """A vLLM prepare/finalize over `a2a` (see the module docstring)."""
    cls, base = _class("EpxPrepareAndFinalize", _PrepareFinalizeMethods,
                       "FusedMoEPrepareAndFinalizeModular")
    obj = cls.__new__(cls)
    _init_base(obj, base, moe_config, quant_config)
    obj._epx_init(a2a)
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
        _init_base(obj, base, cpu_group)
    obj._epx_init(cpu_group, device)
    return obj


_manager = None


def _prepare_finalize_for(moe, quant_config):
    """EpxPrepareAndFinalize for a vLLM layer's FusedMoEConfig `moe` (the plugin's path)."""
    global _manager
    from vllm.distributed import get_ep_group

    if _manager is None:
        _manager = EpxAll2AllManager(get_ep_group().cpu_group, T.torch().cuda.current_device())
    need = {"hidden": "hidden_dim", "num_experts": "num_experts", "topk": "experts_per_token",
            "max_tokens_per_rank": "max_num_tokens"}
    missing = [a for a in need.values() if not hasattr(moe, a)]
    if missing:
        raise _epx.UnsupportedError(f"this vLLM's FusedMoEConfig lacks {missing}: epx.vllm "
                                    "reads hidden_dim, num_experts, experts_per_token, "
                                    "max_num_tokens")
    qd = _quant_dtype(quant_config)
    default_dtype = "bf16-to-fp8" if qd == T.fp8_dtype() else "bf16"
    kwargs = {k: int(getattr(moe, a)) for k, a in need.items()}
    kwargs.update(dtype=os.environ.get("EPX_VLLM_DTYPE", default_dtype),
                  layout=os.environ.get("EPX_VLLM_LAYOUT", "expert"))
    return EpxPrepareAndFinalize(_manager.get_handle(kwargs), moe, quant_config)


def register() -> None:
    """vLLM general plugin (entry point group ``vllm.general_plugins``, name ``epx``).

    Does nothing unless EPX_VLLM=1. Then it replaces
    ``vllm.model_executor.layers.fused_moe.all2all_utils.maybe_make_prepare_finalize`` (and every
    loaded ``vllm.*`` module's reference to that same function) with a wrapper that builds
    EpxPrepareAndFinalize for expert-parallel layers and calls the original for the others.
    Nothing else is changed; calling it twice changes nothing more.
    """
    if os.environ.get("EPX_VLLM", "0") != "1":
        return
    import vllm.model_executor.layers.fused_moe.all2all_utils as utils

    original = utils.maybe_make_prepare_finalize
    if getattr(original, "_epx_wrapper", False):
        return

    def maybe_make_prepare_finalize(moe, quant_config, *args, **kwargs):
        parallel = getattr(moe, "moe_parallel_config", None)
        if parallel is None or not getattr(parallel, "use_ep", False):
            return original(moe, quant_config, *args, **kwargs)
        return _prepare_finalize_for(moe, quant_config)

    maybe_make_prepare_finalize._epx_wrapper = True
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm") and getattr(module, "maybe_make_prepare_finalize",
                                               None) is original:
            setattr(module, "maybe_make_prepare_finalize", maybe_make_prepare_finalize)
