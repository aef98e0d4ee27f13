"""DeepEP's legacy ``Buffer`` (low-latency and normal modes) and V2's ``ElasticBuffer`` over epx:
a DeepEP user changes an import.

    import epx.deep_ep as deep_ep          # or: epx.deep_ep.install_as_deep_ep(); import deep_ep

    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, W, E)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True,
                            num_qps_per_rank=E // W)
    recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(x, topk_idx, T, E)
    ...experts: expert e's rows [0, recv_count[e]) of recv_x [E/W, W*T, H]...
    y, event, hook = buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)

    buffer = deep_ep.Buffer(group, num_nvl_bytes=int(1e9))          # normal mode (prefill)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
    y, _, event = buffer.combine(expert_out, handle)

    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H)     # V2
    recv_x, recv_idx, recv_w, handle, event = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=E)
    y, y_weights, event = buffer.combine(expert_out, handle, topk_weights=recv_w, bias=b)

The signatures, shapes, dtypes and strides are DeepEP's (deep_ep/buffers/legacy.py and
elastic.py, commit dd758ca); the group is a torch.distributed process group (gloo is enough: it only carries the
start-up handshake) or an mpi4py communicator (``comm``).

The modes live in modules of this package, one each, beside what they share:
- ``_low_latency.py``: DeepEP's low-latency mode (low_latency_dispatch / low_latency_combine),
  with the epx objects of its shapes in ``_low_latency_shapes.py``; its docstring says how the
  mode maps onto epx.
- ``_shrink.py``: shrink mode (``Buffer(..., enable_shrink=True)``, DeepEP's rank masking); its
  docstring says what it does and how it differs from DeepEP's.
- ``_normal.py``: DeepEP's normal (high-throughput) mode (Config, get_dispatch_layout,
  dispatch, cached dispatch, combine) over epx's high_throughput backend; its docstring says how
  the calls map onto epx and which pieces epx's core lacks (refused by name).
- ``_buffer.py``: Buffer, one mixin per mode and what is common to them; ``_common.py``: events,
  hooks, how a missing feature is refused, and the pieces the normal mode and ElasticBuffer share.
- ``_elastic.py``: V2's ElasticBuffer and EPHandle: dispatch with or without expansion (cached
  or not, with or without the host read) and combine in V2's order, over epx's high_throughput
  backend, with the expand mode in ``_elastic_expand.py``; its docstring says how, and what is
  not served (Engram, PP, AGRS).

Not provided (NotImplementedError naming what and why): in the normal mode, int32 scales and
internode_* (see _normal.py); ElasticBuffer's Engram, PP and AGRS calls (see _elastic.py); the per-rank wait-time statistics, the raw buffer (get_local_buffer_tensor), low-latency traffic
without NVLink (allow_nvlink_for_low_latency_mode=False); a combine of an earlier round of a shape
than the last ``rounds_in_flight`` ones; router weights given at dispatch and different ones at
combine; the mask updates above that epx cannot express; in shrink mode, a LogFMT combine of a
round not dispatched with epx's ``use_logfmt`` keyword (see _low_latency.py: the format of a
combine is fixed per epx object, chosen at dispatch, else the round is dispatched again).

Differences worth knowing: the returned tensors are views of epx memory, valid until the
dispatch after next of the same shape (DeepEP's "no more than 2 results at a time");
num_rdma_bytes / num_nvl_bytes / num_qps_per_rank are accepted and not used (epx sizes its memory
per shape, get_low_latency_rdma_size_hint says how much; num_nvl_bytes > 0 makes the world of the
normal mode, whose dispatches take at most max_tokens_per_rank tokens: a keyword of Buffer, else
EPX_DEEP_EP_MAX_TOKENS, else 4096); a combine repeated for one dispatch is
only sound when the expert outputs and weights are unchanged (epx's combine serves its
dispatch's round, so a peer may read the earlier sums). Every rank must take the same path:
weights at dispatch on every rank, or on none.

Importing this package needs neither torch nor a GPU; tensors need torch.
"""

from __future__ import annotations

import sys

from .. import _torch as T
from ._buffer import Buffer
from ._common import EventHandle, EventOverlap
from ._elastic import ElasticBuffer, EPHandle
from ._normal import Config

# Also an attribute: topk_idx_t (torch.int64, read when asked for: importing needs no torch).
__all__ = [
    "Buffer", "Config", "ElasticBuffer", "EPHandle", "EventHandle", "EventOverlap",
    "install_as_deep_ep",
]


def __getattr__(name):
    # deep_ep.topk_idx_t: the dtype of topk_idx DeepEP is built with by default (64-bit).
    if name == "topk_idx_t":
        return T.torch().int64
    raise AttributeError(f"module 'epx.deep_ep' has no attribute '{name}'")


def install_as_deep_ep() -> None:
    """Makes ``import deep_ep`` (anywhere in this process) give this package.

    Refuses (ImportError) when another ``deep_ep`` is already imported: two Buffers of different
    libraries in one process is never what was meant."""
    current = sys.modules.get("deep_ep")
    if current is not None and current is not sys.modules[__name__]:
        raise ImportError(
            f"deep_ep is already imported from {getattr(current, '__file__', current)!r}; "
            "call epx.deep_ep.install_as_deep_ep() before anything imports DeepEP"
        )
    sys.modules["deep_ep"] = sys.modules[__name__]

