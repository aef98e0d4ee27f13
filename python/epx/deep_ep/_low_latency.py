"""DeepEP's low-latency mode of epx.deep_ep.Buffer: low_latency_dispatch / low_latency_combine,
their handle and hooks, the shapes they make (_low_latency_shapes.py) and DeepEP's statics of the
mode. Shrink mode's calls are in _shrink.py.

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
- LogFMT (use_logfmt): an epx object combines in one format, fixed when it is made
  (EpConfig.combine_format), and a round is combined by the object that dispatched it. So the
  format is part of the shape: a shape's 'logfmt' objects are others than its 'bf16' ones, made
  collectively on first use like any shape. DeepEP names the format only at combine; epx's own
  keyword-only ``use_logfmt`` of low_latency_dispatch (and prepare_low_latency_shape) names it
  at dispatch, and a combine with the same use_logfmt takes the round's objects as they are:
  the partials cross as LogFMT-10 rows (about 0.64 of the bytes; low_latency, hidden a multiple
  of 128). A combine whose use_logfmt differs from the dispatch's (a DeepEP caller that passes
  it at combine only) is still served: the round is dispatched again, zero rows with the
  dispatch's routing and weights, on the same shape's objects of the combine's format (rows
  are ordered by (source rank, source index), so that dispatch lays the rows out exactly as
  the first did) and combined there. That costs one more dispatch per combine, and it counts as
  a round of those objects (rounds_in_flight); shrink mode, whose rows come in arrival order,
  refuses it (pass use_logfmt at dispatch there).
- Events and hooks: epx runs on torch's current stream and a dispatch is complete when its
  kernel is, so ``event`` (async_finish) is an event recorded after the call and ``hook``
  (return_recv_hook) runs the receive half: today the torch work that completes the outputs
  (layout_range, the UE8M0 packing, the statistics). With epx's send and receive halves the
  receive kernel moves into the hook.
"""

from __future__ import annotations

from typing import List, Optional

from .. import _epx
from .. import _torch as T
from ..all2all import All2All
from ..config import buffer_bytes
from ._common import EventHandle, EventOverlap, _Hook, _unsupported
from ._low_latency_shapes import (_BACKEND, _Shape, _ShapeState, _Slot, _carrier_config,
                                  _data_config, _make_barrier, _shape_of)

_UE8M0_GROUPS = 4  # exponents packed into one int32
_LOGFMT_BLOCK = 128  # values per LogFMT metadata word (src/core/logfmt.hpp)


def _check_logfmt_hidden(use_logfmt: bool, hidden: int) -> None:
    if use_logfmt and hidden % _LOGFMT_BLOCK != 0:
        raise _epx.InputError(f"hidden = {hidden}, expected a multiple of {_LOGFMT_BLOCK} with "
                              "use_logfmt (LogFMT rows are blocks of 128 values)")


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


# ---- UE8M0 scales (DeepEP's use_ue8m0) -----------------------------------------------------------


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


# ---- the mode -----------------------------------------------------------------------------------


class _LowLatencyMode:
    """Buffer's methods of DeepEP's low-latency mode. They read the Buffer's group_size,
    low_latency_mode, enable_shrink, rounds_in_flight, _world (its IpcWorld in this mode) and
    _destroyed, and its _objects(); the receive half of a shrink-mode dispatch is _order_rows
    (_shrink.py)."""

    def _init_low_latency(self) -> None:
        """The mode's state of a new Buffer, once its world is made: shapes are made on first
        use; in shrink mode the barrier object now (collective)."""
        self._shapes: dict = {}
        self._barrier: Optional[All2All] = None  # shrink mode: clean_low_latency_buffer's
        if self.low_latency_mode and self.enable_shrink:
            self._barrier, self._barrier_inputs = _make_barrier(self._world)

    def _low_latency_objects(self) -> List[All2All]:
        """The mode's epx objects, in the order they were made."""
        objects = [] if self._barrier is None else [self._barrier]
        for state in self._shapes.values():
            objects.extend(state.objects())
        return objects

    def _forget_low_latency_objects(self) -> None:
        """After destroy() closed them."""
        self._shapes.clear()
        self._barrier = None

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """Bytes of device memory a Buffer allocates per rank for one low-latency shape: the
        ``rounds_in_flight`` (2) All2All objects with bf16 rows (fp8 rows need less), at the
        largest top-k, plus the carrier of combine-time weights. Each further shape (another
        hidden, expert count, token count, top-k, wire dtype, round_scale or combine format)
        allocates its own."""
        topk = min(_epx.MAX_TOPK, num_experts)
        shape = _Shape(hidden, num_experts, num_max_dispatch_tokens_per_rank, topk, "bf16")
        rows = buffer_bytes(_data_config(shape, num_ranks), _BACKEND)
        carrier = buffer_bytes(_carrier_config(shape, num_ranks), _BACKEND)
        return 2 * rows + carrier

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
                                  round_scale: bool = False, *, use_logfmt: bool = False) -> None:
        """epx's own: makes the epx objects of the low-latency dispatches with these arguments
        now instead of at the first such dispatch (collective: every rank calls it, in the same
        order). Shrink mode needs it for every shape before any rank may fail; elsewhere it only
        moves the set-up cost out of the first dispatch. use_ue8m0 does not change the shape;
        use_logfmt does (the objects of LogFMT combines, see the module's notes)."""
        self._check_usable("prepare_low_latency_shape")
        if num_experts % self.group_size != 0:
            raise _epx.InputError(f"num_experts = {num_experts}, expected a multiple of the "
                                  f"group's size {self.group_size}")
        _check_logfmt_hidden(use_logfmt, hidden)
        self._state(_shape_of(hidden, num_experts, num_max_dispatch_tokens_per_rank, num_topk,
                              use_fp8, round_scale, use_logfmt))

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
                             *, topk_weights=None, use_logfmt: bool = False):
        """Sends each token to its experts' ranks; returns (recv_x, recv_count, handle, event,
        hook) as DeepEP's low_latency_dispatch.

        x: [N, H] bf16, N <= num_max_dispatch_tokens_per_rank; topk_idx: [N, K] int64
        (topk_idx_t) or int32, -1 = none. recv_x: [E/W, W*T, H] bf16, or with use_fp8 a tuple
        (float8_e4m3fn [E/W, W*T, H], scales [E/W, W*T, H/128] float32, or with use_ue8m0 int32
        [E/W, W*T, H/512], the token index fastest in memory); recv_count [E/W] int32.
        epx's own, keyword only: `topk_weights` [N, K] float32: the router weights, when they
        are known now; combine then folds them at the experts' ranks with no extra round trip,
        and must be given the same tensor, unmodified. Every rank gives them, or none.
        `use_logfmt`: the round's combine will have use_logfmt=True; its partials then cross
        as LogFMT-10 rows with no extra dispatch (see the module's notes). `topk_idx` must stay
        unmodified until the combine when the combine's use_logfmt differs from this one.
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
        _check_logfmt_hidden(use_logfmt, hidden)
        topk = topk_idx.shape[1]
        shape = _shape_of(hidden, num_experts, num_max_dispatch_tokens_per_rank, topk, use_fp8,
                          round_scale, use_logfmt)
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
        slot.topk_idx = topk_idx
        slot.topk_idx_version = topk_idx._version

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
        use_logfmt: the partials cross as LogFMT-10 rows (DeepEP's use_logfmt); named at
        dispatch too, it costs nothing more, else the round is dispatched again (module notes).
        """
        slot = self._slot_of(handle, "low_latency_combine")
        torch = T.torch()
        if combine_wait_recv_cost_stats is not None:
            raise _unsupported("low_latency_combine(combine_wait_recv_cost_stats=...)",
                               "epx does not time its waits per source rank")
        if async_finish and return_recv_hook:
            raise _epx.InputError("async_finish = True and return_recv_hook = True, expected at "
                                  "most one of them (as DeepEP)")
        state: _ShapeState = handle._state
        a2a = slot.a2a
        n = handle._num_tokens
        combine_format = "logfmt" if use_logfmt else "bf16"
        if combine_format != state.shape.combine_format:
            _check_logfmt_hidden(use_logfmt, state.shape.hidden)
            if state.shrink:
                raise _unsupported(
                    f"low_latency_combine(use_logfmt={use_logfmt}) of a dispatch with "
                    f"use_logfmt={not use_logfmt} in shrink mode",
                    "the round would be dispatched again, and shrink mode's rows come in "
                    "arrival order; pass the same use_logfmt to low_latency_dispatch")
            if slot.topk_idx._version != slot.topk_idx_version:
                raise _epx.InputError(
                    "Buffer.low_latency_combine: the dispatch's topk_idx was modified, expected "
                    "it unmodified when combine's use_logfmt differs from the dispatch's (the "
                    "round is dispatched again with it)")
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
        if combine_format != state.shape.combine_format:
            a2a = self._dispatch_again(state, slot, n, combine_format)
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

    def _dispatch_again(self, state: _ShapeState, slot: _Slot, n: int, combine_format: str):
        """The All2All of `state`'s shape in `combine_format`, after a dispatch of zero rows with
        `slot`'s routing and weights: its expert rows are laid out as `slot`'s (ordered rows), so
        its combine takes the caller's rows as they are."""
        other = self._state(state.shape._replace(combine_format=combine_format))
        again = other.take_slot()
        weights = slot.weights if slot.weights is not None else other.unit_weights[:n]
        again.out = again.a2a.dispatch(other.zeros(n), slot.topk_idx, weights)
        again.serial += 1  # a handle of that object's earlier round is gone
        again.weights = slot.weights
        again.weights_version = slot.weights_version
        again.topk_idx = slot.topk_idx
        again.topk_idx_version = slot.topk_idx_version
        return again.a2a

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

