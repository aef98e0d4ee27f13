"""Shrink mode of epx.deep_ep.Buffer: its mask calls, and the ordering of a masking dispatch's
rows.

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
"""

from __future__ import annotations

from typing import List

from .. import _epx
from .. import _torch as T
from ._common import _unsupported
from ._low_latency_shapes import _ShapeState, _Slot


class _ShrinkMode:
    """Buffer's calls of DeepEP's shrink mode, a part of the low-latency mode (_low_latency.py):
    they read the Buffer's group_size, enable_shrink and _barrier, and its _objects() and
    _check_usable()."""

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
