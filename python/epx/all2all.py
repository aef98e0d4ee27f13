"""All2All on torch tensors: one object per rank, dispatch -> expert stage -> combine.

Every call is enqueued on ``torch.cuda.current_stream()`` of the object's GPU and never
synchronises the host (``synchronize()`` excepted), so a round can be captured with
``torch.cuda.graph`` and replayed; under ``torch.compile`` dispatch and combine become the custom
ops ``torch.ops.epx.dispatch`` and ``torch.ops.epx.combine`` (epx.ops), with fake implementations,
so ``fullgraph=True`` works.

What dispatch returns are views of epx's own device memory (no copy): valid until the next
dispatch of any rank of the world, and overwritten by it. Copy what must live longer.

Row order (token-major): with ``deterministic=True`` rows are ordered by (source rank, source
index); otherwise the order is whatever the backend produces (arrival order), and only the set of
rows, and combine's result, are fixed.
"""

from __future__ import annotations

import itertools
import weakref
from typing import List, NamedTuple, Optional, Sequence

from . import _epx
from . import _torch as T
from .config import (EpConfig, LaunchConfigs, backend_from_env, check_backend_config,
                     launch_configs_from_env)


class ConfigValues(NamedTuple):
    """An EpConfig as plain Python values (what torch.compile can read while it traces)."""

    rank: int
    world_size: int
    hidden: int
    num_experts: int
    topk: int
    max_tokens_per_rank: int
    dtype: str
    scale_layout: str
    round_scale: bool
    layout: str
    deterministic: bool
    rounds_in_flight: int
    mask_failed_ranks: bool
    worst_case_output: bool
    combine: str
    combine_format: str
    timeout_ms: int
    capacity: int
    num_local_experts: int
    num_scale_groups: int
    input_fp8: bool
    wire_fp8: bool

    @classmethod
    def of(cls, c: EpConfig) -> "ConfigValues":
        return cls(*(getattr(c, f) for f in cls._fields))


class DispatchOutput(NamedTuple):
    """What one dispatch delivered to this rank: views of epx memory, valid until the next
    dispatch (of any rank). ``capacity = world_size * max_tokens_per_rank`` rows.

    Token-major fields (both layouts; rows ``[0, recv_count)`` are valid):
      recv_x              [capacity, H] bf16, or float8_e4m3fn when fp8 is on the wire
      recv_scales         [capacity, H/128] float32 (fp8 wires; None for bf16). Indexed
                          [row, group] in either scale layout: with scale_layout='column' it is a
                          view whose row index is fastest in memory (stride (1, capacity)).
      recv_src_rank       [capacity] int32: the rank the row came from
      recv_src_idx        [capacity] int32: its token index there
      recv_topk_ids       [capacity, K] int32: the token's full top-k row (-1 = none)
      recv_topk_weights   [capacity, K] float32
      recv_count          [1] int32: M, on the device
      expert_counts       [E/W] int32: rows that use each local expert
    Expert-major fields (layout='expert'; None otherwise; expert e's rows [0, expert_counts[e])):
      expert_x            [E/W, capacity, H] bf16 or float8_e4m3fn
      expert_scales       [E/W, capacity, H/128] float32 (fp8 wires)
      expert_src_rank     [E/W, capacity] int32
      expert_src_idx      [E/W, capacity] int32
      expert_topk_slot    [E/W, capacity] int32: k of this expert in its token's row
      expert_weight       [E/W, capacity] float32: topk_weights[k]
    """

    recv_x: object
    recv_scales: Optional[object]
    recv_src_rank: object
    recv_src_idx: object
    recv_topk_ids: object
    recv_topk_weights: object
    recv_count: object
    expert_counts: object
    expert_x: Optional[object] = None
    expert_scales: Optional[object] = None
    expert_src_rank: Optional[object] = None
    expert_src_idx: Optional[object] = None
    expert_topk_slot: Optional[object] = None
    expert_weight: Optional[object] = None


_FP8_FIELDS = ("recv_x", "expert_x")

# Every live All2All by handle: the custom ops (epx.ops) take the handle, an int, in the graph.
_registry: "weakref.WeakValueDictionary[int, All2All]" = weakref.WeakValueDictionary()
_next_handle = itertools.count(1)


def from_handle(handle: int) -> "All2All":
    a2a = _registry.get(handle)
    if a2a is None:
        raise _epx.StateError(f"epx All2All handle = {handle}, expected a live object's handle")
    return a2a


def _field_specs(cfg: "ConfigValues"):
    """name -> (shape, strides, kind) of every field dispatch returns for `cfg`; kind is 'x'
    (bf16 or fp8 by the wire), 'f32' or 'i32'. The extension's views must match (checked)."""
    cap, H, K = cfg.capacity, cfg.hidden, cfg.topk
    G, L = cfg.num_scale_groups, cfg.num_local_experts
    col = cfg.scale_layout == "column"
    specs = {
        "recv_x": ((cap, H), (H, 1), "x"),
        "recv_src_rank": ((cap,), (1,), "i32"),
        "recv_src_idx": ((cap,), (1,), "i32"),
        "recv_topk_ids": ((cap, K), (K, 1), "i32"),
        "recv_topk_weights": ((cap, K), (K, 1), "f32"),
        "recv_count": ((1,), (1,), "i32"),
        "expert_counts": ((L,), (1,), "i32"),
    }
    if cfg.wire_fp8:
        specs["recv_scales"] = ((cap, G), (1, cap) if col else (G, 1), "f32")
    if cfg.layout == "expert":
        specs["expert_x"] = ((L, cap, H), (cap * H, H, 1), "x")
        if cfg.wire_fp8:
            specs["expert_scales"] = (
                (L, cap, G),
                (G * cap, 1, cap) if col else (cap * G, G, 1),
                "f32",
            )
        for name, kind in (
            ("expert_src_rank", "i32"),
            ("expert_src_idx", "i32"),
            ("expert_topk_slot", "i32"),
            ("expert_weight", "f32"),
        ):
            specs[name] = ((L, cap), (cap, 1), kind)
    # In DispatchOutput's order: the custom op returns them as a list in this order.
    return {n: specs[n] for n in DispatchOutput._fields if n in specs}


class All2All:
    """One rank's dispatch/combine over torch tensors (include/epx/all2all.hpp).

    Make one with ``All2All.create(config, world)`` (IpcWorld / NcclWorld: this process's rank,
    collective) or ``make_group(config, in_process_world)`` (one per rank of an in-process world:
    call each rank on its own stream, all ranks of a round enqueued before any waits).
    """

    def __init__(self, impl, world=None):
        self._impl = impl
        self._world = world  # the world outlives its objects
        self.ep_config: EpConfig = impl.config  # the library's value (validate, replace, ...)
        self.config: ConfigValues = ConfigValues.of(self.ep_config)
        self.backend: str = impl.backend
        self._combine_array = impl.combine_buffer()
        self.device_index: int = int(impl.device)
        self._specs = _field_specs(self.config)
        self._names: List[str] = list(self._specs)
        # Where each DispatchOutput field sits in the ops' output list (-1: absent, None).
        self._positions = [self._names.index(n) if n in self._specs else -1
                           for n in DispatchOutput._fields]
        self._views: Optional[DispatchOutput] = None
        self._views_key = None
        self._combine_tensor = None
        self._num_tokens = 0
        self._round: list = []
        self.handle: int = next(_next_handle)
        _registry[self.handle] = self
        if T.has_torch():  # the custom ops and the buffer's tensor exist before any tracing
            from . import ops

            ops.register()
            self.combine_buffer()

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        config: EpConfig,
        world,
        backend: Optional[str] = None,
        launch: Optional[LaunchConfigs] = None,
    ) -> "All2All":
        """This process's object of an IpcWorld or NcclWorld (collective over the world; rank
        and world_size come from the world). `backend` defaults to EPX_BACKEND, else
        'low_latency'; `launch` to EPX_CONFIG_PATH's file, else shapes chosen per world."""
        backend = backend or backend_from_env()
        check_backend_config(backend, config, world)
        launch = launch if launch is not None else (launch_configs_from_env() or LaunchConfigs())
        return cls(_epx.make_all2all(backend, config, world, launch), world)

    @property
    def device(self):
        return T.cuda_device(self.device_index)

    @property
    def symmetric_bytes(self) -> int:
        """Bytes of peer-visible memory this object holds."""
        return self._impl.symmetric_bytes

    @property
    def capacity(self) -> int:
        return self.config.capacity

    def buffer_bytes(self) -> int:
        """Bytes of device memory the library sizes for this object's config and backend."""
        return _epx.buffer_bytes(self.backend, self.ep_config)

    # ---- dispatch ------------------------------------------------------------------------------

    def dispatch(self, x, topk_ids, topk_weights, x_scales=None) -> DispatchOutput:
        """Sends each token to the ranks of its experts; returns what this rank received.

        x: [N, H] bf16 (dtype 'bf16', 'bf16-to-fp8') or float8_e4m3fn (dtype 'fp8'), N <=
        max_tokens_per_rank (0 is legal); x_scales: [N, H/128] float32 (dtype 'fp8' only);
        topk_ids: [N, K] int32 or int64, -1 = no expert; topk_weights: [N, K] float32. All on this
        object's GPU, contiguous. Bad tensors raise InputError before anything is launched.
        Enqueued on torch.cuda.current_stream(); the views returned are valid until the next
        dispatch. Device-side errors (bad expert ids, a timed-out peer) surface at poll(),
        synchronize() or the next dispatch.
        """
        torch = T.torch()
        if torch.compiler.is_compiling():
            outs = torch.ops.epx.dispatch(self.handle, x, topk_ids, topk_weights, x_scales)
            self._round = outs
            self._num_tokens = x.shape[0]
            return DispatchOutput(*[outs[i] if i >= 0 else None for i in self._positions])
        return self._dispatch_eager(x, topk_ids, topk_weights, x_scales)

    def check_dispatch_inputs(self, x, topk_ids, topk_weights, x_scales) -> None:
        """The host checks of dispatch, on real or fake tensors (InputError names the tensor)."""
        torch = T.torch()
        c = self.config
        dev = self.device
        x_dtype = T.fp8_dtype() if c.input_fp8 else torch.bfloat16
        what = f"EpConfig.dtype = '{c.dtype}'"
        T.check("x", x, dtype=x_dtype, shape=(None, c.hidden), device=dev, what=what)
        n = x.shape[0]
        if n > c.max_tokens_per_rank:
            raise _epx.InputError(
                f"x.shape[0] = {n}, expected at most max_tokens_per_rank = "
                f"{c.max_tokens_per_rank}"
            )
        if topk_ids is not None or topk_weights is not None:  # (None: dispatch_by_rank)
            T.check("topk_ids", topk_ids, dtypes=(torch.int32, torch.int64), shape=(n, c.topk),
                    device=dev)
            T.check("topk_weights", topk_weights, dtype=torch.float32, shape=(n, c.topk),
                    device=dev)
        if c.input_fp8:
            if x_scales is None:
                raise _epx.InputError(f"x_scales = None, expected [N, H/128] float32 ({what})")
            T.check("x_scales", x_scales, dtype=torch.float32,
                    shape=(n, c.num_scale_groups), device=dev, what="1x128 block scales")
        elif x_scales is not None:
            raise _epx.InputError(
                f"x_scales = a tensor, expected None ({what}: scales travel only with fp8 input)"
            )

    def _dispatch_eager(self, x, topk_ids, topk_weights, x_scales) -> DispatchOutput:
        result = self._impl.dispatch(*self._dispatch_args(x, topk_ids, topk_weights, x_scales))
        return self._views_of(result)

    def _dispatch_args(self, x, topk_ids, topk_weights, x_scales) -> tuple:
        """The extension's arguments of a dispatch (after the host checks)."""
        torch = T.torch()
        self.check_dispatch_inputs(x, topk_ids, topk_weights, x_scales)
        n = x.shape[0]
        self._num_tokens = n
        return (n, x.data_ptr(), 0 if x_scales is None else x_scales.data_ptr(),
                topk_ids.data_ptr(), topk_ids.dtype == torch.int64, topk_weights.data_ptr(),
                T.current_stream(self.device))

    def dispatch_by_rank(self, x, rank_mask, expert_counts, x_scales=None) -> DispatchOutput:
        """dispatch routed by rank instead of by expert (backend 'high_throughput'; eager): token n
        goes to every rank r with rank_mask[n, r] true, and each receiver's expert_counts is the
        sum over the senders of their expert_counts' entries for its experts. The rows carry
        top-k ids -1 and weights 0. rank_mask: [N, W] bool (or uint8); expert_counts: [E] int32,
        this rank's (token, expert) pairs per global expert. x, x_scales as dispatch()."""
        torch = T.torch()
        c = self.config
        self.check_dispatch_inputs(x, None, None, x_scales)
        n = x.shape[0]
        T.check("rank_mask", rank_mask, dtypes=(torch.bool, torch.uint8),
                shape=(n, c.world_size), device=self.device)
        T.check("expert_counts", expert_counts, dtype=torch.int32, shape=(c.num_experts,),
                device=self.device)
        self._num_tokens = n
        result = self._impl.dispatch_by_rank(
            n, x.data_ptr(), 0 if x_scales is None else x_scales.data_ptr(),
            rank_mask.data_ptr(), expert_counts.data_ptr(), T.current_stream(self.device))
        return self._views_of(result)

    # ---- halves (eager calls; under torch.compile use dispatch / combine) ----------------------

    def dispatch_send(self, x, topk_ids, topk_weights, x_scales=None) -> None:
        """dispatch's send half: routes and sends this rank's tokens, never waits for a peer
        (unless rows are ordered: deterministic=True or the naive backend). Run other work, then
        dispatch_recv(); dispatch(...) equals the two. Arguments as dispatch()."""
        self._impl.dispatch_send(*self._dispatch_args(x, topk_ids, topk_weights, x_scales))

    def dispatch_recv(self) -> DispatchOutput:
        """dispatch's receive half: waits for every peer's rows of the round and returns what
        dispatch() returns. StateError unless dispatch_send came first."""
        return self._views_of(self._impl.dispatch_recv(T.current_stream(self.device)))

    def combine_send(self, expert_out) -> None:
        """combine's send half: publishes the expert outputs (peers read them until their
        combine_recv; leave them as they are until this rank's combine_recv has run)."""
        self.check_combine_inputs(expert_out, None, None, out_needed=False)
        self._impl.combine_send(expert_out.data_ptr(), T.current_stream(self.device))

    def combine_recv(self, out=None):
        """combine's receive half: pulls and sums; returns y as combine() does."""
        torch = T.torch()
        if out is None:
            out = torch.empty((self._num_tokens, self.config.hidden), dtype=torch.bfloat16,
                              device=self.device)
        T.check("out", out, dtype=torch.bfloat16, shape=(self._num_tokens, self.config.hidden),
                device=self.device, what="the last dispatch's tokens")
        self._impl.combine_recv(out.data_ptr(), T.current_stream(self.device))
        return out

    def _views_of(self, result) -> DispatchOutput:
        # The object's memory does not move: the views are made once and returned every time.
        key = tuple(sorted(result.pointers().items()))
        if self._views is None or key != self._views_key:
            self._views = self._make_views(result)
            self._views_key = key
        return self._views

    def _make_views(self, result) -> DispatchOutput:
        torch = T.torch()
        arrays = self._impl.views(result)
        fp8 = self.config.wire_fp8
        fields = {}
        for name, (shape, strides, kind) in self._specs.items():
            t = T.from_dlpack(arrays[name], fp8=fp8 and kind == "x")
            want = {"x": T.fp8_dtype() if fp8 else torch.bfloat16, "f32": torch.float32,
                    "i32": torch.int32}[kind]
            if tuple(t.shape) != shape or tuple(t.stride()) != strides or t.dtype != want:
                raise _epx.StateError(
                    f"view {name}: shape {tuple(t.shape)} stride {tuple(t.stride())} {t.dtype}, "
                    f"expected {shape} {strides} {want} (extension and package disagree)"
                )
            fields[name] = t
        # Fields this config does not have (scales on a bf16 wire, the expert-major fields in
        # the token layout) are None.
        return DispatchOutput(*(fields.get(n) for n in DispatchOutput._fields))

    def empty_outputs(self, device) -> list:
        """Tensors shaped as dispatch's outputs (the custom op's fake implementation)."""
        torch = T.torch()
        fp8 = self.config.wire_fp8
        kinds = {"x": T.fp8_dtype() if fp8 else torch.bfloat16, "f32": torch.float32,
                 "i32": torch.int32}
        return [
            torch.empty_strided(shape, strides, dtype=kinds[kind], device=device)
            for shape, strides, kind in self._specs.values()
        ]

    def dispatch_outputs_list(self, out: DispatchOutput) -> list:
        return [getattr(out, n) for n in self._names]

    # ---- combine -------------------------------------------------------------------------------

    def combine_buffer(self):
        """Where the expert stage should write to save a copy (a view of epx memory):
        token-major [capacity, H] bf16 (row j = sum over local k of w_k * expert_k(recv_x[j]));
        expert-major [E/W, capacity, H] bf16, row-aligned with expert_x."""
        if self._combine_tensor is None:
            self._combine_tensor = T.from_dlpack(self._combine_array)
        return self._combine_tensor

    def combine_shape(self) -> tuple:
        c = self.config
        if c.layout == "expert":
            return (c.num_local_experts, c.capacity, c.hidden)
        return (c.capacity, c.hidden)

    def combine(self, expert_out, out=None):
        """Brings the expert outputs back: returns y [N, H] bf16 (N = the last dispatch's
        tokens), written into `out` when given ([N, H] bf16, contiguous, this GPU).

        expert_out: token-major [capacity, H] bf16 partials (router weights applied); expert-major
        [E/W, capacity, H] bf16 expert outputs (combine applies the weights). combine_buffer()
        saves a copy. Enqueued on torch.cuda.current_stream(); every rank must call it.
        """
        torch = T.torch()
        if torch.compiler.is_compiling():
            n = self._num_tokens
            if out is None:
                out = torch.empty((n, self.config.hidden), dtype=torch.bfloat16,
                                  device=expert_out.device)
            torch.ops.epx.combine(self.handle, expert_out, list(self._round), out)
            return out
        return self._combine_eager(expert_out, out)

    def check_combine_inputs(self, expert_out, out, num_tokens: Optional[int] = None,
                             out_needed: bool = True) -> None:
        """The host checks of combine, on real or fake tensors. `num_tokens` is the last
        dispatch's token count, which `out` must have; None (the fake implementation, which
        must not read this object's runtime state) checks only that it is at most
        max_tokens_per_rank. out_needed=False checks expert_out alone (combine_send)."""
        torch = T.torch()
        c = self.config
        T.check("expert_out", expert_out, dtype=torch.bfloat16, shape=self.combine_shape(),
                device=self.device, what=f"layout = '{c.layout}'")
        if not out_needed:
            return
        if num_tokens is not None:
            T.check("out", out, dtype=torch.bfloat16, shape=(num_tokens, c.hidden),
                    device=self.device, what="the last dispatch's tokens")
            return
        T.check("out", out, dtype=torch.bfloat16, shape=(None, c.hidden), device=self.device,
                what="[N, H], N = the last dispatch's tokens")
        if out.shape[0] > c.max_tokens_per_rank:
            raise _epx.InputError(
                f"out.shape[0] = {out.shape[0]}, expected at most max_tokens_per_rank = "
                f"{c.max_tokens_per_rank} (the last dispatch's tokens)"
            )

    def _combine_eager(self, expert_out, out):
        torch = T.torch()
        if out is None:
            out = torch.empty((self._num_tokens, self.config.hidden), dtype=torch.bfloat16,
                              device=self.device)
        self.check_combine_inputs(expert_out, out, self._num_tokens)
        self._impl.combine(expert_out.data_ptr(), out.data_ptr(), T.current_stream(self.device))
        return out

    def combine_with(self, expert_out, out=None, topk_weights=None, bias=None):
        """combine() that also brings the rows' top-k weights back and adds bias rows (backend
        'high_throughput', token layout; eager). Returns (y, y_topk_weights or None).

        topk_weights: [capacity, K] float32 row-aligned with the last dispatch's rows (recv_topk_weights,
        or the caller's own): y_topk_weights [N, K] is, per token, their sum over the ranks that
        got it, in f32 in rank order (every rank passes weights, or none). bias: None, one [N, H]
        bf16 tensor or a pair (either may be None): y = bf16(((0 + b0) + b1) + the partials in
        rank order), in f32, rounded once."""
        torch = T.torch()
        c = self.config
        n = self._num_tokens
        if out is None:
            out = torch.empty((n, c.hidden), dtype=torch.bfloat16, device=self.device)
        self.check_combine_inputs(expert_out, out, n)
        y_w = None
        if topk_weights is not None:
            T.check("topk_weights", topk_weights, dtype=torch.float32, shape=(c.capacity, c.topk),
                    device=self.device, what="[capacity, K]: the last dispatch's rows")
            y_w = torch.empty((n, c.topk), dtype=torch.float32, device=self.device)
        biases = list(bias) if isinstance(bias, (tuple, list)) else [bias]
        if len(biases) > 2:
            raise _epx.InputError(f"bias = {len(biases)} tensors, expected None, one or two")
        biases += [None] * (2 - len(biases))
        for i, b in enumerate(biases):
            if b is not None:
                T.check(f"bias[{i}]", b, dtype=torch.bfloat16, shape=(n, c.hidden),
                        device=self.device, what="[N, H]: the last dispatch's tokens")
        ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        self._impl.combine_extras(expert_out.data_ptr(), out.data_ptr(), ptr(topk_weights),
                                  ptr(y_w), ptr(biases[0]), ptr(biases[1]),
                                  T.current_stream(self.device))
        return out, y_w

    # ---- masking (EpConfig.mask_failed_ranks) --------------------------------------------------

    @property
    def masked_ranks(self) -> int:
        """The ranks this rank gave up waiting for, as a bit mask (bit r: rank r), since creation
        or clear_mask(); 0 without mask_failed_ranks.

        A peer is masked when a wait for it outlives timeout_ms: the call that waited completes
        without it, and later calls skip it. A masked rank's rows of the round it was masked in
        may be missing or partly written (nothing waits for them); from then on no token is sent
        to its experts (the pairs are counted in dropped_pairs) and its partials are left out of
        every combine, so y sums the live ranks' experts only. Read from mapped host memory:
        never synchronises, and what a kernel still running masks shows up as it happens
        (synchronize() first for the state after the calls enqueued so far)."""
        return int(self._impl.masked_ranks)

    def masked_rank_list(self) -> List[int]:
        """masked_ranks as a sorted list of rank indices (same read, same contract)."""
        bits = self.masked_ranks
        return [r for r in range(self.config.world_size) if (bits >> r) & 1]

    @property
    def dropped_pairs(self) -> int:
        """(token, expert) pairs this rank's dispatches dropped because the expert's rank was
        masked when the dispatch started, since creation or clear_mask(). Read from mapped host
        memory: never synchronises (a dispatch still running adds its count when it ends)."""
        return int(self._impl.dropped_pairs)

    def clear_mask(self) -> None:
        """Unmasks every rank for the calls enqueued on torch.cuda.current_stream() after this
        one, and zeroes dropped_pairs; masked_ranks and dropped_pairs read 0 at once (a kernel
        enqueued before and still running may mask again). For a peer that is back on the same
        memory and in step with this rank's calls, or a test: a peer that is still gone is
        masked again by the next call that waits for it, after timeout_ms."""
        self._impl.clear_mask(T.current_stream(self.device))

    # ---- errors and teardown -------------------------------------------------------------------

    def poll(self) -> None:
        """Raises the error a kernel recorded (TimeoutError, InputError), once; StateError after.
        Never synchronises."""
        self._impl.poll()

    def synchronize(self) -> None:
        """Waits for torch's current stream on this GPU, then poll()."""
        self._impl.synchronize(T.current_stream(self.device))

    def close(self) -> None:
        """Drops the custom ops' handle (the object itself goes when its last reference does)."""
        _registry.pop(self.handle, None)

    def __repr__(self) -> str:
        return f"epx.All2All(backend='{self.backend}', {self.config!r}, device={self.device_index})"


def make_group(
    config: EpConfig,
    world,
    backend: Optional[str] = None,
    launch: Optional[LaunchConfigs] = None,
) -> List[All2All]:
    """One All2All per rank of an in-process world (rank and world_size set per rank).

    Ranks sharing a GPU spin on each other: enqueue every rank's dispatch (each on its own
    stream) before anything waits for one, and the same for combine; keep torch kernels that
    load lazily out of the gap (or run once before the first round).
    """
    backend = backend or backend_from_env()
    check_backend_config(backend, config)
    launch = launch if launch is not None else (launch_configs_from_env() or LaunchConfigs())
    return [All2All(impl, world) for impl in _epx.make_all2all_group(backend, config, world, launch)]


def sort_rows(out: DispatchOutput, fields: Sequence[str] = ("recv_x",)):
    """The first recv_count rows of `fields`, ordered by (source rank, source index): compares
    token-major dispatches whatever their row order (synchronises to read recv_count). fp8
    rows come back as their bytes (uint8)."""
    torch = T.torch()
    m = int(out.recv_count.item())
    key = out.recv_src_rank[:m].long() * (1 << 32) + out.recv_src_idx[:m].long()
    order = key.argsort()
    rows = []
    for f in fields:
        t = getattr(out, f)[:m]
        if t.dtype == T.fp8_dtype():  # gathered as bytes: fp8 indexing is not everywhere
            t = t.view(torch.uint8)
        rows.append(t[order])
    return rows
