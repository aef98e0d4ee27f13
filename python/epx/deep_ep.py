"""DeepEP's low-latency ``Buffer`` over epx: a DeepEP user changes an import.

    import epx.deep_ep as deep_ep          # or: epx.deep_ep.install_as_deep_ep(); import deep_ep

    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, W, E)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True,
                            num_qps_per_rank=E // W)
    recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(x, topk_idx, T, E)
    ...experts: expert e's rows [0, recv_count[e]) of recv_x [E/W, W*T, H]...
    y, event, hook = buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)

The signatures, shapes, dtypes and strides are DeepEP's (deep_ep/buffers/legacy.py, commit
dd758ca); the group is a torch.distributed process group (gloo is enough: it only carries the
start-up handshake) or an mpi4py communicator (``comm``).

How DeepEP's low-latency mode maps onto epx:
- One ``IpcWorld`` per Buffer (``epx.ipc_world_from_torch``), made by the constructor.
- Per shape (hidden, num_experts, num_max_dispatch_tokens_per_rank, top-k, wire dtype,
  round_scale), made on
  the first dispatch of that shape (collective: every rank dispatches the same shapes in the same
  order): ``rounds_in_flight`` (default 2, DeepEP's two buffers) epx ``All2All`` objects of the
  ``low_latency`` backend in the expert-major layout, used in turn, so that a round's outputs stay
  valid until the dispatch after next and two rounds may be in flight (dispatch, dispatch,
  combine, combine). Rows are ordered by (source rank, source index) (EpConfig.deterministic),
  which is what gives DeepEP's layout_range (each source rank's rows of an expert are one run).
- recv_x is epx's expert_x ([E/W, W*T, H]); with use_fp8 the rows travel as fp8 (epx quantises
  inside dispatch, 1x128 blocks, scale = amax / 448) and the scales are epx's column layout, the
  token dimension contiguous, as DeepEP lays them out for TMA. recv_count is expert_counts.
- handle = (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts):
  src_info [E/W, W*T] int32 is each expert row's source token index (epx's expert_src_idx);
  layout_range [E/W, W] int64 packs, per local expert and source rank, the first row of that
  rank's run in the high 32 bits and its length in the low 32 bits, as DeepEP packs it.
- round_scale / use_ue8m0: epx quantises inside dispatch with DeepEP's power-of-two rule
  (EpConfig.round_scale), so the rows travel as fp8 and the bytes and scales are exactly those
  DeepEP's fused cast produces; use_ue8m0 packs the scales' exponents four to an int32 at the
  expert's rank (a few bytes per row).
- Router weights: epx's expert-major combine folds each token's expert rows with the weights it
  carried at dispatch, at the expert's rank, before the token's rank pulls the sums. DeepEP gives
  the weights at combine. So, unless the caller passed them at dispatch (the keyword-only
  ``topk_weights`` of low_latency_dispatch, and the same tensor, unmodified, at combine), the
  rows travel with weight 1 and combine first sends the combine-time weights to the experts'
  ranks with a small epx dispatch of its own (an All2All of hidden 128 that carries only the
  weights), scales each expert row by its (token, k) weight there and then combines. The result
  is DeepEP's sum; the extra dispatch costs one more round trip per combine.
- Events and hooks: epx runs on torch's current stream and a dispatch is complete when its
  kernel is, so ``event`` (async_finish) is an event recorded after the call and ``hook``
  (return_recv_hook) runs the receive half: today the torch work that completes the outputs
  (layout_range, the UE8M0 packing, the statistics). With epx's send and receive halves the
  receive kernel moves into the hook.

Shrink mode (``Buffer(..., enable_shrink=True)``, DeepEP's rank masking) is epx's
EpConfig.mask_failed_ranks: a rank that does not arrive within EPX_TIMEOUT_MS (default 10 s) is
masked instead of failing the call. The call completes without it; later dispatches send nothing
to its experts and receive nothing from it, and combines leave its experts' outputs out of the
sum (y = the live experts' weighted outputs, which is what DeepEP's shrink test expects).
low_latency_query_mask_buffer, clean_low_latency_buffer (a barrier of the live ranks that masks
the absent ones) and low_latency_clean_mask_buffer do what DeepEP's do. How it differs:
- Every shape must be made while every rank is present: making a shape's epx objects is
  collective over all ranks, so a shape first dispatched after a rank failed cannot be made
  (StateError once a rank is masked; before any object has noticed, the making waits in the
  group's all-gather). ``prepare_low_latency_shape(T, H, E, K, use_fp8, round_scale)`` (epx's
  own) makes a shape right after the Buffer.
- The mask is per epx object, not one per Buffer: a Buffer has ``rounds_in_flight`` + 1 objects
  per shape and one for clean_low_latency_buffer, and each object that has not masked a failed
  rank yet waits the full timeout for it once before masking it. A rank counts as masked when
  any object masked it.
- epx's masks live in mapped host memory: the mask calls first wait for the work already enqueued
  on torch's current stream (DeepEP's are kernels on that stream), so they cannot be captured in
  a CUDA graph.
- epx masks a rank only when a wait for it expires, and unmasks only every rank at once, so
  low_latency_update_mask_buffer(r, mask=True) works only for a rank every object has masked
  already (nothing to do), and (r, mask=False) only when r is the only masked rank or not masked
  (NotImplementedError otherwise, naming the ranks).
- epx masks only with unordered rows: the Buffer orders each expert's rows by (source rank,
  source index) itself, in torch, into tensors of its own (one copy of the received rows in the
  receive half, and one of the expert outputs back in combine), so recv_x and src_info are
  new tensors per dispatch rather than views of epx memory.
- The rows a masked rank sent in the round it was masked in may be missing or partly written
  (nothing waits for them); destroy() stays collective (every rank, masked ones too, calls it).

Not provided (NotImplementedError naming what and why): DeepEP's normal (high-throughput) mode
(get_dispatch_layout, dispatch, combine, internode_*, Config, ElasticBuffer), LogFMT combine, the
per-rank wait-time statistics, the raw buffer (get_local_buffer_tensor), low-latency traffic
without NVLink (allow_nvlink_for_low_latency_mode=False); a combine of an earlier round of a shape
than the last ``rounds_in_flight`` ones; router weights given at dispatch and different ones at
combine; the mask updates above that epx cannot express.

Differences worth knowing: the returned tensors are views of epx memory, valid until the
dispatch after next of the same shape (DeepEP's "no more than 2 results at a time");
num_rdma_bytes / num_nvl_bytes / num_qps_per_rank are accepted and not used (epx sizes its memory
per shape, get_low_latency_rdma_size_hint says how much); a combine repeated for one dispatch is
only sound when the expert outputs and weights are unchanged (epx's combine serves its
dispatch's round, so a peer may read the earlier sums). Every rank must take the same path:
weights at dispatch on every rank, or on none.

Importing this module needs neither torch nor a GPU; tensors need torch.
"""

from __future__ import annotations

import sys
from typing import Callable, List, NamedTuple, Optional

from . import _epx
from . import _torch as T
from .all2all import All2All
from .config import EpConfig, buffer_bytes, with_env_timeout

# Also an attribute: topk_idx_t (torch.int64, read when asked for: importing needs no torch).
__all__ = [
    "Buffer", "Config", "ElasticBuffer", "EventHandle", "EventOverlap", "install_as_deep_ep",
]

_BACKEND = "low_latency"
# The carrier of combine-time router weights moves no payload of interest: one fp8 block.
_CARRIER_HIDDEN = _epx.FP8_BLOCK_SIZE
_UE8M0_GROUPS = 4  # exponents packed into one int32


def __getattr__(name):
    # deep_ep.topk_idx_t: the dtype of topk_idx DeepEP is built with by default (64-bit).
    if name == "topk_idx_t":
        return T.torch().int64
    raise AttributeError(f"module 'epx.deep_ep' has no attribute '{name}'")


def install_as_deep_ep() -> None:
    """Makes ``import deep_ep`` (anywhere in this process) give this module.

    Refuses (ImportError) when another ``deep_ep`` is already imported: two Buffers of different
    libraries in one process is never what was meant."""
    current = sys.modules.get("deep_ep")
    if current is not None and current is not sys.modules[__name__]:
        raise ImportError(
            f"deep_ep is already imported from {getattr(current, '__file__', current)!r}; "
            "call epx.deep_ep.install_as_deep_ep() before anything imports DeepEP"
        )
    sys.modules["deep_ep"] = sys.modules[__name__]


def _unsupported(what: str, why: str):
    return NotImplementedError(f"epx.deep_ep: {what} is not provided: {why}")


def _normal_mode(name: str):
    return _unsupported(
        f"Buffer.{name} (DeepEP's normal, high-throughput mode)",
        "epx.deep_ep implements the low-latency mode (low_latency_dispatch / "
        "low_latency_combine); epx has no high-throughput (prefill) backend to serve it yet",
    )


# ---- events -------------------------------------------------------------------------------------


class EventHandle:
    """A CUDA event recorded on a stream (torch's current stream by default) when made."""

    def __init__(self, stream=None):
        torch = T.torch()
        self.event = torch.cuda.Event()
        self.event.record(stream if stream is not None else torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """torch's current stream waits for the event (the host does not)."""
        T.torch().cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """DeepEP's event wrapper: ``current_stream_wait()``, and ``with event: ...`` runs the body on
    the current stream and makes the stream wait for the event on leaving.

    ``extra_tensors`` keeps tensors alive until the wrapper goes (what DeepEP uses in place of
    ``record_stream``, which CUDA graphs refuse)."""

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[tuple] = None):
        self.event = event
        self.extra_tensors = extra_tensors
        self._release_on_exit = False
        self.hook_after_wait: Optional[Callable[[], None]] = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        if self.event is None:
            raise _epx.StateError(
                "EventOverlap.current_stream_wait(): event = None, expected an event (the call "
                "that made this wrapper ran with async_finish = False: nothing to wait for)"
            )
        self.event.current_stream_wait()
        hook, self.hook_after_wait = self.hook_after_wait, None
        if hook is not None:
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook: Callable[[], None]) -> None:
        """`hook` runs once, after the next current_stream_wait()."""
        if self.hook_after_wait is not None:
            raise _epx.StateError("EventOverlap: a hook after wait is registered already")
        self.hook_after_wait = hook

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """``with event(release_handle=True):`` drops the event after the wait."""
        self._release_on_exit = release_handle
        return self

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_on_exit)
        self._release_on_exit = False


# ---- what epx does not provide ------------------------------------------------------------------


class Config:
    """DeepEP's launch configuration of the normal mode, which epx.deep_ep does not provide."""

    def __init__(self, *args, **kwargs):
        raise _normal_mode("Config")


class ElasticBuffer:
    """DeepEP's elastic (V2) buffer, which epx.deep_ep does not provide."""

    def __init__(self, *args, **kwargs):
        raise _unsupported("ElasticBuffer (DeepEP's elastic API)",
                           "epx.deep_ep implements the legacy Buffer's low-latency mode")


# ---- shapes -------------------------------------------------------------------------------------


class _Shape(NamedTuple):
    """What a dispatch's epx objects depend on. `wire` is the All2All dtype: 'bf16' (use_fp8
    off) or 'bf16-to-fp8'; `round_scale`: the fp8 wire's scales are powers of two."""

    hidden: int
    num_experts: int
    max_tokens: int
    topk: int
    wire: str
    round_scale: bool = False


def _data_config(shape: _Shape, world_size: int, rank: int = 0,
                 shrink: bool = False) -> EpConfig:
    # Masking needs unordered rows (epx's rule): in shrink mode the Buffer orders them itself.
    return with_env_timeout(EpConfig(
        rank=rank, world_size=world_size, hidden=shape.hidden, num_experts=shape.num_experts,
        topk=shape.topk, max_tokens_per_rank=shape.max_tokens, dtype=shape.wire,
        round_scale=shape.round_scale, layout="expert", scale_layout="column",
        deterministic=not shrink,
        mask_failed_ranks=shrink))


def _carrier_config(shape: _Shape, world_size: int, rank: int = 0,
                    shrink: bool = False) -> EpConfig:
    # The same wire dtype as the rows: the same kernels run (one name per op in a profile).
    return with_env_timeout(EpConfig(
        rank=rank, world_size=world_size, hidden=_CARRIER_HIDDEN, num_experts=shape.num_experts,
        topk=shape.topk, max_tokens_per_rank=shape.max_tokens, dtype=shape.wire,
        layout="token", mask_failed_ranks=shrink))


def _barrier_config(world_size: int, rank: int = 0) -> EpConfig:
    """The smallest masking All2All: a dispatch of no tokens waits for every live peer's
    signal, so it is a barrier that masks the ranks that do not come (shrink mode's
    clean_low_latency_buffer)."""
    return with_env_timeout(EpConfig(
        rank=rank, world_size=world_size, hidden=_epx.FP8_BLOCK_SIZE, num_experts=world_size,
        topk=1, max_tokens_per_rank=1, dtype="bf16", layout="token", mask_failed_ranks=True))


def _shape_of(hidden: int, num_experts: int, max_tokens: int, topk: int, use_fp8: bool,
              round_scale: bool) -> _Shape:
    """The shape of a low_latency_dispatch with these arguments."""
    wire = "bf16-to-fp8" if use_fp8 else "bf16"
    return _Shape(hidden, num_experts, max_tokens, topk, wire, use_fp8 and round_scale)


class _Slot:
    """One of a shape's All2All objects and its last dispatch."""

    def __init__(self, a2a: All2All):
        self.a2a = a2a
        self.serial = 0  # dispatches so far: a handle names the one it came from
        self.out = None  # DispatchOutput of the last dispatch
        self.weights = None  # router weights given at that dispatch (None: unit weights)
        self.weights_version = -1
        # Shrink mode: [E/W * W*T] int64, for each epx row (flattened over the experts), the
        # row of the order the caller sees that holds it; set by the dispatch's receive half.
        self.caller_row_of = None


class _ShapeState:
    """The epx objects and the device constants of one shape. In shrink mode every object masks
    failed ranks, and all of them are made here (making one is collective: it cannot wait for
    a rank that is gone)."""

    def __init__(self, shape: _Shape, world, rounds: int, shrink: bool = False):
        torch = T.torch()
        self.shape = shape
        self.shrink = shrink
        self.slots: List[_Slot] = []
        for _ in range(rounds):  # collective, every rank in the same order
            self.slots.append(_Slot(All2All.create(_data_config(shape, world.size, shrink=shrink),
                                                   world, _BACKEND)))
        self.next = 0
        self.carrier: Optional[All2All] = None
        c = self.slots[0].a2a.config
        dev = self.slots[0].a2a.device
        self.world_size = c.world_size
        self.num_local = c.num_local_experts
        self.capacity = c.capacity
        self.device = dev
        self.rows = torch.arange(c.capacity, device=dev, dtype=torch.int32)
        self.ranks = torch.arange(c.world_size, device=dev, dtype=torch.int32)
        self.unit_weights = torch.ones((shape.max_tokens, shape.topk), dtype=torch.float32,
                                       device=dev)
        if shrink:
            self.expert_base = (torch.arange(c.num_local_experts, device=dev, dtype=torch.int64)
                                * c.capacity).unsqueeze(1)  # [E/W, 1]: first flat row of each
            self.carrier_for(world)

    def carrier_for(self, world) -> All2All:
        """The All2All that carries combine-time router weights (made on first use: collective,
        every rank reaches it at the same combine)."""
        if self.carrier is None:
            torch = T.torch()
            self.carrier = All2All.create(
                _carrier_config(self.shape, world.size, shrink=self.shrink), world, _BACKEND)
            self.carrier_x = torch.zeros((self.shape.max_tokens, _CARRIER_HIDDEN),
                                         dtype=torch.bfloat16, device=self.device)
        return self.carrier

    def objects(self) -> List[All2All]:
        return [s.a2a for s in self.slots] + ([self.carrier] if self.carrier is not None else [])


class _Handle(tuple):
    """DeepEP's handle tuple (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden,
    num_experts); it also names the epx round it came from (read by combine)."""

    def __new__(cls, fields, owner, state, slot, serial, num_tokens):
        h = super().__new__(cls, fields)
        h._owner = owner
        h._state = state
        h._slot = slot
        h._serial = serial
        h._num_tokens = num_tokens
        return h


class _Hook:
    """The receive half of a call, run once (later calls do nothing), as DeepEP's hooks."""

    def __init__(self, recv: Callable[[], None]):
        self._recv: Optional[Callable[[], None]] = recv

    def __call__(self) -> None:
        recv, self._recv = self._recv, None
        if recv is not None:
            recv()


# ---- UE8M0 scales (DeepEP's use_ue8m0) ------------------------------------------------------------


def _ue8m0_pack(scales):
    """Power-of-two f32 scales [L, C, G] (epx's round_scale; any strides) -> their biased
    exponents packed four to an int32 [L, C, G/4] (group 4p + i in byte i of word p), the token
    index fastest in memory, as DeepEP lays out use_ue8m0 scales."""
    torch = T.torch()
    L, C, G = scales.shape
    biased = ((scales.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)  # e + 127
    packed = biased.view(L, C, G // _UE8M0_GROUPS, _UE8M0_GROUPS).permute(0, 2, 1, 3)
    words = packed.contiguous().view(torch.int32).view(L, G // _UE8M0_GROUPS, C)
    return words.transpose(1, 2)


# ---- Buffer -------------------------------------------------------------------------------------


class Buffer:
    """DeepEP's Buffer, low-latency mode, over epx (see the module docstring).

    Attributes as DeepEP's: rank, group_size, group, num_nvl_bytes, num_rdma_bytes,
    low_latency_mode, explicitly_destroy, enable_shrink; and num_sms (class attribute, used by
    the normal mode only).
    """

    num_sms: int = 20

    def __init__(self,
                 group,
                 num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False,
                 enable_shrink: bool = False,
                 comm=None,
                 *,
                 rounds_in_flight: int = 2) -> None:
        """DeepEP's arguments, same names and defaults. `num_nvl_bytes`, `num_rdma_bytes` and
        `num_qps_per_rank` are recorded and not used: epx allocates per shape, on the first
        dispatch of that shape. `allow_mnnvl` changes nothing (one node). epx's own, keyword
        only: `rounds_in_flight` (1 or 2): epx objects per shape, used in turn; 2 (DeepEP's two
        buffers) lets a dispatch follow a dispatch before the first one's combine, 1 halves the
        memory. Collective over the group (the IpcWorld's handshake).

        `enable_shrink`: every epx object masks a rank whose wait outlives EPX_TIMEOUT_MS
        instead of failing (see the module docstring); make each shape with
        prepare_low_latency_shape() here, while every rank is present."""
        if not allow_nvlink_for_low_latency_mode:
            raise _unsupported(
                "Buffer(allow_nvlink_for_low_latency_mode=False)",
                "epx moves low-latency traffic between the GPUs of one node over NVLink (CUDA "
                "IPC); it has no RDMA-only path")
        if rounds_in_flight not in (1, 2):
            raise _epx.InputError(f"rounds_in_flight = {rounds_in_flight!r}, expected 1 or 2")
        if group is None and comm is None:
            raise ValueError("Buffer: group = None and comm = None, expected one of them")
        self.group = group if group is not None else comm
        if group is not None:
            self.rank, self.group_size = group.rank(), group.size()
        else:
            self.rank, self.group_size = comm.Get_rank(), comm.Get_size()
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.num_qps_per_rank = num_qps_per_rank
        self.low_latency_mode = low_latency_mode
        self.allow_mnnvl = allow_mnnvl
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.rounds_in_flight = rounds_in_flight
        self._shapes: dict = {}
        self._world = None
        self._barrier: Optional[All2All] = None  # shrink mode: clean_low_latency_buffer's
        self._destroyed = False
        if low_latency_mode:
            self._world = self._make_world(group, comm)
            if enable_shrink:
                self._barrier = All2All.create(_barrier_config(self._world.size), self._world,
                                               _BACKEND)
                self._barrier_inputs = self._barrier_tensors()

    def _barrier_tensors(self):
        """A dispatch of no tokens on the barrier object: (x, topk_ids, topk_weights)."""
        torch = T.torch()
        dev = self._barrier.device
        return (torch.empty((0, _epx.FP8_BLOCK_SIZE), dtype=torch.bfloat16, device=dev),
                torch.empty((0, 1), dtype=torch.int32, device=dev),
                torch.empty((0, 1), dtype=torch.float32, device=dev))

    @staticmethod
    def _make_world(group, comm):
        torch = T.torch()
        device = torch.cuda.current_device()
        if group is not None:
            from .world import ipc_world_from_torch

            return ipc_world_from_torch(group, device)
        from .world import IpcWorld

        def all_gather(data: bytes) -> list:
            return [bytes(b) for b in comm.allgather(bytes(data))]

        return IpcWorld.from_all_gather(comm.Get_rank(), comm.Get_size(), all_gather, device,
                                        "auto")

    # ---- DeepEP's static helpers -----------------------------------------------------------------

    @staticmethod
    def is_sm90_compiled() -> bool:
        return bool(_epx.has_cuda)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Recorded as DeepEP does; only DeepEP's normal mode reads it."""
        if new_num_sms % 2 != 0:
            raise _epx.InputError(f"new_num_sms = {new_num_sms}, expected an even number")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded now on torch's current stream."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """Bytes of device memory a Buffer allocates per rank for one low-latency shape: the
        ``rounds_in_flight`` (2) All2All objects with bf16 rows (fp8 rows need less), at the
        largest top-k, plus the carrier of combine-time weights. Each further shape (another
        hidden, expert count, token count, top-k, wire dtype or round_scale) allocates its own."""
        topk = min(_epx.MAX_TOPK, num_experts)
        shape = _Shape(hidden, num_experts, num_max_dispatch_tokens_per_rank, topk, "bf16")
        rows = buffer_bytes(_data_config(shape, num_ranks), _BACKEND)
        carrier = buffer_bytes(_carrier_config(shape, num_ranks), _BACKEND)
        return 2 * rows + carrier

    @staticmethod
    def get_dispatch_config(num_ranks: int):
        raise _normal_mode("get_dispatch_config")

    @staticmethod
    def get_combine_config(num_ranks: int):
        raise _normal_mode("get_combine_config")

    # ---- what DeepEP's runtime offers besides the two ops ------------------------------------------

    def get_comm_stream(self):
        """epx runs on the caller's stream: torch's current stream."""
        return T.torch().cuda.current_stream()

    def get_local_buffer_tensor(self, dtype, size=None, offset: int = 0,
                                use_rdma_buffer: bool = False):
        raise _unsupported("Buffer.get_local_buffer_tensor",
                           "epx's memory is per shape and per round, not one raw buffer; use the "
                           "views dispatch returns and get_next_low_latency_combine_buffer")

    def destroy(self) -> None:
        """Releases the epx objects (collective: every rank calls it, after its last combine)."""
        if not self.explicitly_destroy:
            raise _epx.StateError("Buffer.destroy(): explicitly_destroy = False, expected True "
                                  "(as DeepEP: only a Buffer made to be destroyed explicitly)")
        if self._destroyed:
            return
        for a2a in self._objects():
            a2a.synchronize()
        if self._world is not None:
            self._world.barrier()  # nobody frees memory a peer may still read
        for a2a in self._objects():
            a2a.close()
        self._shapes.clear()
        self._barrier = None
        self._world = None
        self._destroyed = True

    def _objects(self) -> List[All2All]:
        """Every epx object of this Buffer, in the order they were made."""
        objects = [] if self._barrier is None else [self._barrier]
        for state in self._shapes.values():
            objects.extend(state.objects())
        return objects

    # ---- normal mode ----------------------------------------------------------------------------

    def get_dispatch_layout(self, *args, **kwargs):
        raise _normal_mode("get_dispatch_layout")

    def dispatch(self, *args, **kwargs):
        raise _normal_mode("dispatch")

    def combine(self, *args, **kwargs):
        raise _normal_mode("combine")

    def internode_dispatch(self, *args, **kwargs):
        raise _normal_mode("internode_dispatch")

    def internode_combine(self, *args, **kwargs):
        raise _normal_mode("internode_combine")

    # ---- rank masking (shrink mode) -------------------------------------------------------------

    def _check_shrink(self, what: str) -> None:
        self._check_usable(what)
        if not self.enable_shrink:
            raise _epx.ConfigError(f"Buffer.{what}: enable_shrink = False, expected True (make "
                                   "the Buffer with enable_shrink=True, as DeepEP)")

    def _settled_masks(self, what: str) -> List[int]:
        """Each epx object's masked ranks once this rank's calls enqueued so far have run.

        epx keeps its masks in mapped host memory, read by the host: to see what the calls
        already enqueued on torch's current stream do, wait for them (DeepEP's mask calls are
        kernels on that stream instead). Not while the stream is being captured."""
        torch = T.torch()
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise _epx.StateError(f"Buffer.{what} during CUDA-graph capture, expected an eager "
                                  "call (epx's rank masks are read by the host after the "
                                  "stream's work has run)")
        objects = self._objects()
        for a2a in objects:
            a2a.synchronize()
        return [a2a.masked_ranks for a2a in objects]

    def low_latency_query_mask_buffer(self, mask_status) -> None:
        """Writes into `mask_status` ([num_ranks] int32, or any contiguous int32 tensor of
        num_ranks elements, on this rank's GPU) 1 for each rank this rank has masked and 0 for
        the others, as DeepEP. A rank counts as masked once any of this Buffer's epx objects
        masked it. Waits for the calls already enqueued on torch's current stream (see the
        module docstring), then fills the tensor on that stream."""
        self._check_shrink("low_latency_query_mask_buffer")
        torch = T.torch()
        T.check("mask_status", mask_status, dtype=torch.int32, shape=None,
                device=self._barrier.device, what="one int32 per rank")
        if mask_status.numel() != self.group_size:
            raise _epx.InputError(f"mask_status.numel() = {mask_status.numel()}, expected the "
                                  f"group's size {self.group_size}")
        bits = 0
        for m in self._settled_masks("low_latency_query_mask_buffer"):
            bits |= m
        flags = [(bits >> r) & 1 for r in range(self.group_size)]
        mask_status.view(-1).copy_(torch.tensor(flags, dtype=torch.int32,
                                                device=mask_status.device))

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Masks (mask=True) or unmasks (mask=False) one rank, as far as epx can: it masks a rank
        only when a wait for it expires, and unmasks only every rank at once. So:
        - mask=False: done when `rank_to_mask` is masked nowhere (nothing to do) or it is the
          only masked rank (every object's mask is cleared on torch's current stream);
        - mask=True: done when every epx object of this Buffer has masked it already (nothing to
          do);
        anything else raises NotImplementedError naming the ranks involved. Waits for the calls
        already enqueued on torch's current stream first (see low_latency_query_mask_buffer)."""
        what = "low_latency_update_mask_buffer"
        self._check_shrink(what)
        if not 0 <= rank_to_mask < self.group_size:
            raise _epx.InputError(f"rank_to_mask = {rank_to_mask}, expected in [0, "
                                  f"{self.group_size})")
        masks = self._settled_masks(what)
        bit = 1 << rank_to_mask
        if mask:
            if all(m & bit for m in masks):
                return
            raise _unsupported(
                f"Buffer.{what}(rank_to_mask={rank_to_mask}, mask=True) of a rank that not every "
                "epx object has masked",
                "epx masks a rank only when a wait for it expires, never on request")
        union = 0
        for m in masks:
            union |= m
        if union & bit == 0:
            return
        others = union & ~bit
        if others:
            names = [r for r in range(self.group_size) if (others >> r) & 1]
            raise _unsupported(
                f"Buffer.{what}(rank_to_mask={rank_to_mask}, mask=False) while ranks {names} "
                "stay masked",
                "epx unmasks every rank at once (All2All.clear_mask); "
                "low_latency_clean_mask_buffer() unmasks them all")
        for a2a in self._objects():
            a2a.clear_mask()

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank, for the calls enqueued on torch's current stream after this one
        (each epx object's clear_mask), as DeepEP. A rank that is still gone is masked again,
        by each object that waits for it, after that object's timeout."""
        self._check_shrink("low_latency_clean_mask_buffer")
        for a2a in self._objects():
            a2a.clear_mask()

    # ---- low-latency mode -----------------------------------------------------------------------

    def _check_usable(self, what: str) -> None:
        if self._destroyed:
            raise _epx.StateError(f"Buffer.{what}: the Buffer was destroyed")
        if not self.low_latency_mode:
            raise _epx.ConfigError(f"Buffer.{what}: low_latency_mode = False, expected True "
                                   "(make the Buffer with low_latency_mode=True)")

    def _state(self, shape: _Shape) -> _ShapeState:
        state = self._shapes.get(shape)
        if state is None:
            if self.enable_shrink:
                gone = 0
                for a2a in self._objects():
                    gone |= a2a.masked_ranks
                if gone:
                    names = [r for r in range(self.group_size) if (gone >> r) & 1]
                    raise _epx.StateError(
                        f"Buffer: a first dispatch of {shape} while ranks {names} are masked, "
                        "expected every shape made before a rank fails (making a shape's epx "
                        "objects is collective over every rank: call "
                        "prepare_low_latency_shape() right after the Buffer)")
            state = _ShapeState(shape, self._world, self.rounds_in_flight, self.enable_shrink)
            self._shapes[shape] = state
        return state

    def prepare_low_latency_shape(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                  num_experts: int, num_topk: int, use_fp8: bool = True,
                                  round_scale: bool = False) -> None:
        """epx's own: makes the epx objects of the low-latency dispatches with these arguments
        now instead of at the first such dispatch (collective: every rank calls it, in the same
        order). Shrink mode needs it for every shape before any rank may fail; elsewhere it only
        moves the set-up cost out of the first dispatch. use_ue8m0 does not change the shape."""
        self._check_usable("prepare_low_latency_shape")
        if num_experts % self.group_size != 0:
            raise _epx.InputError(f"num_experts = {num_experts}, expected a multiple of the "
                                  f"group's size {self.group_size}")
        self._state(_shape_of(hidden, num_experts, num_max_dispatch_tokens_per_rank, num_topk,
                              use_fp8, round_scale))

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Nothing to clean: epx keeps its round state on the device and needs no zeroed
        regions between calls (DeepEP needs them after its normal mode). In shrink mode it is a
        barrier of the live ranks on torch's current stream, as DeepEP's: a rank that does not
        come within the timeout is masked."""
        self._check_usable("clean_low_latency_buffer")
        if self._barrier is not None:
            self._barrier.dispatch(*self._barrier_inputs)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int,
                             cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False,
                             *, topk_weights=None):
        """Sends each token to its experts' ranks; returns (recv_x, recv_count, handle, event,
        hook) as DeepEP's low_latency_dispatch.

        x: [N, H] bf16, N <= num_max_dispatch_tokens_per_rank; topk_idx: [N, K] int64
        (topk_idx_t) or int32, -1 = none. recv_x: [E/W, W*T, H] bf16, or with use_fp8 a tuple
        (float8_e4m3fn [E/W, W*T, H], scales [E/W, W*T, H/128] float32, or with use_ue8m0 int32
        [E/W, W*T, H/512], the token index fastest in memory); recv_count [E/W] int32.
        epx's own, keyword only: `topk_weights` [N, K] float32: the router weights, when they
        are known now; combine then folds them at the experts' ranks with no extra round trip,
        and must be given the same tensor, unmodified. Every rank gives them, or none.
        """
        self._check_usable("low_latency_dispatch")
        torch = T.torch()
        if dispatch_wait_recv_cost_stats is not None:
            raise _unsupported("low_latency_dispatch(dispatch_wait_recv_cost_stats=...)",
                               "epx does not time its waits per source rank")
        if async_finish and return_recv_hook:
            raise _epx.InputError("async_finish = True and return_recv_hook = True, expected at "
                                  "most one of them (as DeepEP)")
        if use_ue8m0 and not round_scale:
            raise _epx.InputError("use_ue8m0 = True with round_scale = False, expected "
                                  "round_scale = True (UE8M0 scales are powers of two)")
        T.check("x", x, dtype=torch.bfloat16, shape=(None, None))
        n, hidden = x.shape
        T.check("topk_idx", topk_idx, dtypes=(torch.int64, torch.int32), shape=(n, None),
                device=x.device)
        if n > num_max_dispatch_tokens_per_rank:
            raise _epx.InputError(
                f"x.shape[0] = {n}, expected at most num_max_dispatch_tokens_per_rank = "
                f"{num_max_dispatch_tokens_per_rank}")
        if use_fp8 and hidden % _epx.FP8_BLOCK_SIZE != 0:
            raise _epx.InputError(f"x.shape[1] = {hidden}, expected a multiple of "
                                  f"{_epx.FP8_BLOCK_SIZE} with use_fp8")
        if use_ue8m0 and hidden % (_epx.FP8_BLOCK_SIZE * _UE8M0_GROUPS) != 0:
            raise _epx.InputError(f"x.shape[1] = {hidden}, expected a multiple of "
                                  f"{_epx.FP8_BLOCK_SIZE * _UE8M0_GROUPS} with use_ue8m0")
        topk = topk_idx.shape[1]
        shape = _shape_of(hidden, num_experts, num_max_dispatch_tokens_per_rank, topk, use_fp8,
                          round_scale)
        if num_experts % self.group_size != 0:
            raise _epx.InputError(f"num_experts = {num_experts}, expected a multiple of the "
                                  f"group's size {self.group_size}")
        L = num_experts // self.group_size
        if cumulative_local_expert_recv_stats is not None:
            T.check("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                    dtype=torch.int32, shape=(L,), device=x.device)
        if topk_weights is not None:
            T.check("topk_weights", topk_weights, dtype=torch.float32, shape=(n, topk),
                    device=x.device)

        state = self._state(shape)
        slot_index = state.next
        state.next = (slot_index + 1) % len(state.slots)
        slot = state.slots[slot_index]

        # Send half: epx's dispatch (whole, today).
        weights = topk_weights if topk_weights is not None else state.unit_weights[:n]
        out = slot.a2a.dispatch(x, topk_idx, weights)
        slot.serial += 1
        slot.out = out
        slot.weights = topk_weights
        slot.weights_version = topk_weights._version if topk_weights is not None else -1

        # The outputs exist now; the receive half completes them. In shrink mode epx's rows
        # are in arrival order: they are ordered into tensors of the Buffer's own there.
        cap = state.capacity
        G = hidden // _epx.FP8_BLOCK_SIZE
        ordered = not state.shrink
        layout_range = torch.empty((L, self.group_size), dtype=torch.int64, device=x.device)
        rows_x = out.expert_x if ordered else torch.empty_like(out.expert_x)
        src_info = out.expert_src_idx if ordered else torch.empty_like(out.expert_src_idx)
        rows_scales = None
        if use_fp8:
            rows_scales = out.expert_scales if ordered else torch.empty(
                (L, G, cap), dtype=torch.float32, device=x.device).transpose(1, 2)
        slot.caller_row_of = None
        ue8m0 = use_fp8 and use_ue8m0  # (scales exist only on an fp8 wire)
        if not use_fp8:
            recv_x = rows_x
        elif not ue8m0:
            recv_x = (rows_x, rows_scales)
        else:
            s = torch.empty((L, G // _UE8M0_GROUPS, cap), dtype=torch.int32,
                            device=x.device).transpose(1, 2)
            recv_x = (rows_x, s)

        def recv() -> None:
            # (With epx's dispatch halves, the receive kernel goes first here.)
            if not ordered:
                self._order_rows(state, slot, out, rows_x, rows_scales, src_info)
            self._fill_layout_range(state, out, layout_range)
            if ue8m0:
                recv_x[1].copy_(_ue8m0_pack(rows_scales))
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(out.expert_counts)

        hook = None
        if return_recv_hook:
            hook = _Hook(recv)
        else:
            recv()
        handle = _Handle((src_info, layout_range, num_max_dispatch_tokens_per_rank,
                          hidden, num_experts), self, state, slot_index, slot.serial, n)
        event = EventOverlap(EventHandle() if async_finish else None,
                             (x, topk_idx, recv_x, out.expert_counts, layout_range)
                             if async_finish else None)
        return recv_x, out.expert_counts, handle, event, hook

    def _order_rows(self, state: _ShapeState, slot: _Slot, out, rows_x, rows_scales,
                    src_info) -> None:
        """Shrink mode: epx's expert rows, in arrival order, into rows_x, rows_scales (fp8 wire)
        and src_info ordered per expert by (source rank, source index), the layout DeepEP's
        layout_range describes; slot.caller_row_of records, for each epx row, the row of that
        order which holds it (combine takes the expert outputs back through it). Rows past an
        expert's count stay past it."""
        torch = T.torch()
        L, cap = state.num_local, state.capacity
        W, Tm = state.world_size, state.shape.max_tokens
        valid = state.rows.unsqueeze(0) < out.expert_counts.unsqueeze(1)  # [L, cap]
        key = torch.where(valid, out.expert_src_rank.long() * Tm + out.expert_src_idx.long(),
                          torch.full((L, cap), W * Tm, dtype=torch.int64, device=state.device))
        order = key.argsort(dim=1)  # [L, cap]: ordered row j of expert e is epx's row order[e, j]
        flat = (order + state.expert_base).view(-1)
        src, dst = out.expert_x, rows_x
        if src.dtype == T.fp8_dtype():  # gathered as bytes: fp8 indexing is not everywhere
            src, dst = src.view(torch.uint8), dst.view(torch.uint8)
        H = src.shape[-1]
        torch.index_select(src.view(L * cap, H), 0, flat, out=dst.view(L * cap, H))
        if rows_scales is not None:  # [L, cap, G], the row index fastest: gather in [L, G, cap]
            G = rows_scales.shape[-1]
            torch.gather(out.expert_scales.transpose(1, 2), 2,
                         order.unsqueeze(1).expand(L, G, cap), out=rows_scales.transpose(1, 2))
        torch.gather(out.expert_src_idx, 1, order, out=src_info)
        slot.caller_row_of = (order.argsort(dim=1) + state.expert_base).view(-1)

    def _fill_layout_range(self, state: _ShapeState, out, layout_range) -> None:
        """layout_range[e][r] = (first row of source rank r's run in expert e) << 32 | (its
        length). Rows are ordered by source rank (by epx, or in shrink mode by _order_rows), so
        the first row is the number of valid rows from lower ranks."""
        torch = T.torch()
        W = state.world_size
        valid = state.rows.unsqueeze(0) < out.expert_counts.unsqueeze(1)  # [L, cap]
        src = torch.where(valid, out.expert_src_rank, torch.full_like(out.expert_src_rank, W))
        src = src.unsqueeze(-1)  # [L, cap, 1]; invalid rows name rank W: in no run, below none
        ranks = state.ranks.view(1, 1, W)
        count = (src == ranks).sum(dim=1)  # [L, W] int64
        begin = (src < ranks).sum(dim=1)
        layout_range.copy_((begin << 32) | count)

    def get_next_low_latency_combine_buffer(self, handle):
        """Where the expert outputs of `handle`'s round can be written to save combine a copy
        (then combine with zero_copy=True): [E/W, W*T, H] bf16, epx's combine buffer, rows
        aligned with recv_x (in shrink mode combine puts them back into epx's order, a copy)."""
        slot = self._slot_of(handle, "get_next_low_latency_combine_buffer")
        return slot.a2a.combine_buffer()

    def _slot_of(self, handle, what: str) -> _Slot:
        self._check_usable(what)
        if not isinstance(handle, _Handle) or handle._owner is not self:
            raise _epx.InputError(f"Buffer.{what}: handle = {type(handle).__name__}, expected a "
                                  "handle this Buffer's low_latency_dispatch returned")
        slot = handle._state.slots[handle._slot]
        if slot.serial != handle._serial:
            raise _unsupported(
                f"Buffer.{what} of an earlier round",
                f"a later dispatch of this shape reused the handle's epx object (at most "
                f"rounds_in_flight = {self.rounds_in_flight} rounds of a shape may be in "
                "flight): its rows are gone")
        return slot

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out=None,
                            combine_wait_recv_cost_stats=None):
        """Brings the expert outputs back to the tokens' ranks and reduces them with the router
        weights: returns (combined_x [N, H] bf16, event, hook) as DeepEP's low_latency_combine.

        x: [E/W, W*T, H] bf16, the expert outputs row-aligned with the dispatch's recv_x (with
        zero_copy, they are in get_next_low_latency_combine_buffer(handle) and x is not read).
        topk_idx, topk_weights: [N, K] of the dispatch's tokens; a -1 id takes no part.
        """
        slot = self._slot_of(handle, "low_latency_combine")
        torch = T.torch()
        if use_logfmt:
            raise _unsupported("low_latency_combine(use_logfmt=True)",
                               "epx combines bf16 rows; DeepEP's LogFMT wire format is not "
                               "implemented")
        if combine_wait_recv_cost_stats is not None:
            raise _unsupported("low_latency_combine(combine_wait_recv_cost_stats=...)",
                               "epx does not time its waits per source rank")
        if async_finish and return_recv_hook:
            raise _epx.InputError("async_finish = True and return_recv_hook = True, expected at "
                                  "most one of them (as DeepEP)")
        state: _ShapeState = handle._state
        a2a = slot.a2a
        n = handle._num_tokens
        K = state.shape.topk
        dev = a2a.device
        buf = a2a.combine_buffer()
        if not zero_copy:
            T.check("x", x, dtype=torch.bfloat16, shape=tuple(buf.shape), device=dev)
        T.check("topk_idx", topk_idx, dtypes=(torch.int64, torch.int32), shape=(n, K),
                device=dev, what="the dispatch's tokens")
        T.check("topk_weights", topk_weights, dtype=torch.float32, shape=(n, K), device=dev,
                what="the dispatch's tokens")
        if slot.weights is not None:
            same = topk_weights is slot.weights and topk_weights._version == slot.weights_version
            if not same:
                raise _unsupported(
                    "low_latency_combine with router weights other than those given at dispatch",
                    "epx folds router weights at the expert's rank with the weights it carried "
                    "at dispatch; weights given at combine need core support (or give none at "
                    "dispatch)")

        # Send half: the weights reach the experts' ranks, then epx's combine (whole, today).
        given = buf if zero_copy else x
        if state.shrink:  # the caller's rows are in _order_rows' order: back to epx's
            if slot.caller_row_of is None:
                raise _epx.StateError("Buffer.low_latency_combine: the dispatch's receive hook "
                                      "has not run, expected hook() before the combine")
            rows = given.reshape(-1, given.shape[-1]).index_select(0, slot.caller_row_of)
            given = rows.view(buf.shape)
        if slot.weights is not None:
            expert_out = given
        else:
            row_weights = self._row_weights(state, slot.out, topk_idx, topk_weights)
            torch.mul(given, row_weights.unsqueeze(-1), out=buf)
            expert_out = buf
        combined = a2a.combine(expert_out, out=out)

        def recv() -> None:
            # (With epx's combine halves, the pull kernel goes here.)
            return None

        hook = None
        if return_recv_hook:
            hook = _Hook(recv)
        else:
            recv()
        event = EventOverlap(EventHandle() if async_finish else None,
                             (x, topk_idx, topk_weights, combined) if async_finish else None)
        return combined, event, hook

    def _row_weights(self, state: _ShapeState, d, topk_idx, topk_weights):
        """[E/W, W*T] float32: for each valid expert row of dispatch `d`, the combine-time weight
        of its (token, k), read from the token's rank: the carrier All2All dispatches the tokens
        with their weights (-1 slots weighing 0), and each received row files its weights under
        (source rank, source index). Rows of tokens the carrier did not bring weigh 0."""
        torch = T.torch()
        carrier = state.carrier_for(self._world)
        n = topk_idx.shape[0]
        weights = topk_weights.masked_fill(topk_idx < 0, 0.0)
        c = carrier.dispatch(state.carrier_x[:n], topk_idx, weights)
        W, Tm = state.world_size, state.shape.max_tokens
        nowhere = W * Tm  # a spare row of the table for rows that hold nothing
        cap_c = carrier.config.capacity
        arrived = state.rows[:cap_c] < c.recv_count
        where = torch.where(arrived, c.recv_src_rank.long() * Tm + c.recv_src_idx.long(),
                            torch.full((cap_c,), nowhere, dtype=torch.int64, device=state.device))
        table = torch.zeros((nowhere + 1, state.shape.topk), dtype=torch.float32,
                            device=state.device)
        table.index_copy_(0, where, c.recv_topk_weights)
        table[nowhere].zero_()
        valid = state.rows.unsqueeze(0) < d.expert_counts.unsqueeze(1)  # [L, cap]
        token = torch.where(valid, d.expert_src_rank.long() * Tm + d.expert_src_idx.long(),
                            torch.full_like(d.expert_src_idx, nowhere, dtype=torch.int64))
        k = torch.where(valid, d.expert_topk_slot.long(), torch.zeros_like(token))
        return table[token, k]

    def __repr__(self) -> str:
        return (f"epx.deep_ep.Buffer(rank={self.rank}, group_size={self.group_size}, "
                f"low_latency_mode={self.low_latency_mode}, shapes={len(self._shapes)})")

