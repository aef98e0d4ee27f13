"""ElasticBuffer's expand mode (DeepEP V2's ``do_expand``) over epx's token-major rows: the
layout, the gathers that make its outputs, and the two reduced combines of an expand handle.

The expand layout has one row per (received token, top-k slot whose expert is on this rank):
local expert e's rows stand together, in the order of epx's token-major rows (source rank, source
index), slots ascending within a token, from row ``aligned_start[e]`` (the sum of the counts of
the experts before e, each rounded up to ``expert_alignment``); the rows between one expert's
last row and the next expert's first one are padding. epx's core writes token-major rows only,
so the layout is a gather on the device: one index per expanded row into epx's rows, computed
with torch ops from the rows' top-k ids (a sort of the (row, slot) pairs by expert), with no host
read. The index is kept in the handle: a cached dispatch gathers again with it, so its rows are
the first dispatch's bit for bit. Cost: the gather copies every expanded row once (and the index
costs a sort of rows x K keys).

Combine of an expand handle (x: one row per expanded row):

- ``allow_multiple_reduction`` (the default): per token-major row, the rank sums its expanded
  rows in slot order, in f32 from +0, rounded to bf16 once; epx's combine (``highest_slot``)
  then adds, per token, the bias rows and each rank's sum at that rank's highest slot of the
  token: DeepEP's reduction within the rank first, then across ranks, bit for bit.
- Without it, every expanded row must reach the token's rank and be added there in slot order,
  after the bias rows, in one f32 sum rounded once. epx's combine rounds its per-token sum, so the
  rows cross in K combines of the same round: combine k carries, per token-major row, the row of
  slot k where its expert is here and zeros elsewhere. A token's slot k has one owner, so each
  such combine's per-token sum is that slot's row exactly (+0 plus one bf16 value and zeros);
  the token's rank then adds the bias sum and the K results in slot order in f32 and rounds once.
  Cost: K combines of the token-major rows instead of one (K times the bytes on the links and K
  launches), plus K [N, H] bf16 results read once more on the token's rank.

The top-k weights of an expand dispatch are one float per expanded row (the weight of its slot);
combine returns, per token and slot, the weight the slot's owner gave back (the others' copies
are zero, so the core's sum over ranks is exact).
"""

from __future__ import annotations

from typing import NamedTuple

from .. import _torch as T
from ._common import combine_rows, copy_epilogue


class ExpandLayout(NamedTuple):
    """Where the expanded rows of one routing come from (all on the device)."""

    rows: int  # expanded rows of the outputs (num_expanded_tokens)
    dest: object  # [m, K] int64: each (token-major row, slot)'s expanded row, -1 elsewhere
    pairs: object  # [rows] int64: the pair row x K + slot an expanded row holds, m x K: padding
    padding: object  # [rows] bool: the rows that hold no pair
    counts: object  # [L] int32: each local expert's pairs (unaligned)
    aligned_start: object  # [L] int64: each local expert's first expanded row


def expand_layout(local_ids, local, num_local_experts: int, alignment: int,
                  rows: int) -> ExpandLayout:
    """The expand layout of token-major rows whose slot k holds local expert ``local_ids[j, k]``
    where ``local[j, k]`` ([m, K]); `rows` expanded rows (at least the aligned counts' sum)."""
    torch = T.torch()
    m, K = local.shape
    L, dev, n_pairs = num_local_experts, local.device, m * K
    expert = torch.where(local, local_ids.long(), L).flatten()  # L: the expert is elsewhere
    index = torch.arange(n_pairs, dtype=torch.int64, device=dev)
    order = torch.argsort(expert * n_pairs + index, stable=True)  # by expert, then (row, slot)
    by_expert = expert[order]
    count_start = torch.searchsorted(by_expert, torch.arange(L + 1, dtype=torch.int64,
                                                             device=dev))
    counts = count_start[1:] - count_start[:-1]
    aligned = (counts + alignment - 1) // alignment * alignment
    aligned_start = aligned.cumsum(0) - aligned
    # the pair at place p of the order, of expert e, goes to aligned_start[e] + p - count_start[e]
    shift = torch.cat([aligned_start - count_start[:-1],
                       torch.zeros(1, dtype=torch.int64, device=dev)])
    at = torch.where(by_expert < L, index + shift[by_expert], rows)  # rows: nowhere
    dest = torch.empty_like(at).scatter_(0, order, at)
    dest = torch.where(local.flatten(), dest, -1).view(m, K)
    pairs = torch.full((rows + 1,), n_pairs, dtype=torch.int64, device=dev)
    pairs = pairs.scatter_(0, at, order)[:rows]
    return ExpandLayout(rows, dest, pairs, pairs == n_pairs, counts.to(torch.int32),
                        aligned_start)


def expand_psum(layout: ExpandLayout):
    """[L] int32: DeepEP's expand-mode prefix sum, each expert's first row plus its count."""
    return (layout.aligned_start + layout.counts).to(T.torch().int32)


def gather_rows(t, layout: ExpandLayout, topk: int, zero_padding: bool):
    """The expanded rows of token-major rows `t` ([>= m, ...]): padding rows hold the first row
    of t, or zeros (every byte) with `zero_padding`."""
    torch = T.torch()
    src = torch.where(layout.padding, 0, layout.pairs // topk)
    return copy_epilogue(t, src, layout.padding if zero_padding else None)


def gather_weights(weights, layout: ExpandLayout):
    """[rows] float32: each expanded row's weight (its slot's in the token's [m, K] weights),
    0 at padding."""
    torch = T.torch()
    flat = weights.reshape(-1)
    src = torch.where(layout.padding, 0, layout.pairs)
    return torch.where(layout.padding, 0.0, flat.index_select(0, src))


def _slot_rows(x, dest_k):
    """[m, H] bf16: the expanded rows of one slot's column of ``dest``, zeros where -1."""
    rows = x.index_select(0, dest_k.clamp(min=0))
    return rows.masked_fill_((dest_k < 0)[:, None], 0)


def _owned_weights(weights, layout: ExpandLayout):
    """[m, K] float32: each pair's weight from the [rows] weights, 0 where the expert is
    elsewhere (the core then sums one nonzero copy per slot)."""
    torch = T.torch()
    if weights is None:
        return None
    got = weights.index_select(0, layout.dest.clamp(min=0).flatten()).view(layout.dest.shape)
    return torch.where(layout.dest >= 0, got, 0.0)


def combine_expanded(a2a, x, layout: ExpandLayout, weights, bias, multiple_reduction: bool):
    """The combine of an expand handle's round on `a2a` (the module docstring says how): x
    [rows, H] bf16, weights [rows] float32 or None; returns (y [N, H] bf16, [N, K] float32 or
    None)."""
    torch = T.torch()
    m, K = layout.dest.shape
    owned = _owned_weights(weights, layout)
    if multiple_reduction:
        acc = torch.zeros((m, x.shape[1]), dtype=torch.float32, device=x.device)
        for k in range(K):  # slot order, from +0, in f32
            acc.add_(_slot_rows(x, layout.dest[:, k]))
        return combine_rows(a2a, acc.to(torch.bfloat16), owned, bias)
    acc, y_w = None, None
    for k in range(K):  # one combine per slot: each token's sum is its slot-k row exactly
        y_k, w_k = combine_rows(a2a, _slot_rows(x, layout.dest[:, k]),
                                owned if k == 0 else None, None)
        if k == 0:
            y_w = w_k
            acc = torch.zeros(y_k.shape, dtype=torch.float32, device=y_k.device)
            for b in (list(bias) if isinstance(bias, (tuple, list)) else [bias]):
                if b is not None:
                    acc.add_(b)
        acc.add_(y_k)
    return acc.to(torch.bfloat16), y_w
