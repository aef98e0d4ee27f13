"""DeepEP's normal (high-throughput) mode of epx.deep_ep.Buffer: Config, get_dispatch_config /
get_combine_config, get_dispatch_layout, dispatch (cached with ``handle=`` or not) and combine,
over epx's ``high_throughput`` backend. The names, arguments, shapes and dtypes are those of
DeepEP's legacy Buffer (deep_ep/buffers/legacy.py, commit dd758ca).

How each DeepEP call maps onto epx:

- World: the Buffer's constructor makes one ``IpcWorld`` from the group (``ipc_world_from_torch``;
  the group only carries the start-up handshake, gloo is enough) whenever ``num_nvl_bytes > 0``
  or ``low_latency_mode``. ``num_nvl_bytes`` is recorded, not used: epx sizes its memory per
  shape.
- Objects: per shape (hidden, num_experts, top-k, wire: bf16 or fp8 with f32 1x128 scales), made
  on the first dispatch of that shape (collective: every rank dispatches the same shapes in the
  same order), one epx ``All2All`` of the ``high_throughput`` backend, token-major layout, one
  round in flight. Its rows are always ordered by (source rank, source index): DeepEP's order
  (a source rank's rows together, in rank order; within one, its tokens in index order).
  From Python that backend holds its receive area for the worst case (``worst_case_output``):
  ``world_size * max_tokens_per_rank`` rows, with ``max_tokens_per_rank`` from the Buffer's
  keyword, else EPX_DEEP_EP_MAX_TOKENS, else 4096. A dispatch of more tokens raises InputError
  naming it. (DeepEP sizes each call's outputs to the round; epx's core can too, not yet from
  Python: see the gaps.)
- get_dispatch_layout: local torch arithmetic on topk_idx (no communication, as in DeepEP):
  tokens per rank, tokens per expert, is_token_in_rank (a token counts once per rank however
  many of its experts live there); ids outside [0, num_experts) take no part.
- dispatch (not cached): epx routes each token by its top-k ids (topk_idx as given, -1 = none):
  to each rank holding one of its experts, once. That is is_token_in_rank exactly when the
  caller's layout is get_dispatch_layout(topk_idx)'s, which DeepEP's callers pass; epx checks it
  after the count read (InputError naming the three layout tensors otherwise; skipped with
  num_worst_tokens, which must not synchronise). recv_x is a copy of epx's rows (fp8: the rows
  and their [M, H/128] f32 scales, row-major; input scales of any strides are made contiguous
  first). recv_topk_idx holds the token's ids made local (id - rank * E/W) where the expert is on
  this rank and -1 elsewhere, recv_topk_weights the weight there and 0 elsewhere, as DeepEP's.
  num_recv_tokens_per_expert_list is epx's per-local-expert row count, each rounded up to
  expert_alignment; reading it (and M) synchronises the host once, as DeepEP's dispatch does.
- num_worst_tokens > 0: no host synchronisation: every output has num_worst_tokens rows, rows
  at and after M carry recv_topk_idx -1 and weight 0 (x and scales undefined there), the list is
  empty. Rows beyond epx's capacity (world_size * max_tokens_per_rank) cannot hold tokens.
- handle: DeepEP's 6-tuple (rank_prefix_matrix, channel_prefix_matrix,
  recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head). rank_prefix_matrix
  [W, W] int32 holds this rank's column (row i: rows received from ranks 0..i) and -1 in the
  others (the whole matrix needs the core, see the gaps); recv_src_idx [rows] int32 is each
  row's source token index (epx's recv_src_idx); is_token_in_rank is the caller's tensor. epx has
  no DeepEP channels: the two channel matrices and send_head are None. The handle also keeps
  the top-k ids that routed the round, which is what a cached dispatch sends again.
- dispatch(handle=...) (cached): the same routing again, no top-k, no count read; x may have
  another wire than the first dispatch (its own object).
- dispatch without topk_idx (and without handle): epx routes each token by is_token_in_rank
  alone (the core's dispatch by rank mask, All2All.dispatch_by_rank) and each receiver's
  num_recv_tokens_per_expert_list is num_tokens_per_expert summed over the senders (the core's
  count exchange carries them); recv_topk_idx and recv_topk_weights are None, as DeepEP's.
- combine: epx's token-major combine: y[n] = the sum, in f32 in rank order and rounded once, of
  the rows the ranks that got token n give back (x row-aligned with the dispatch's recv_x): what
  DeepEP's combine computes (an unweighted sum). With topk_weights, the core's combine also sums
  each row's weights per token (f32, rank order: combined_topk_weights); with bias, the bias
  rows start the f32 sum (All2All.combine_with). epx's combine serves the last dispatch of the
  handle's object; when that object has dispatched another routing since (the handle's round is
  gone), combine first dispatches the handle's routing again with zero rows, which costs one
  dispatch and gives the exact result.
- previous_event: torch's current stream waits for it; async_finish: an event recorded after
  the call; allocate_on_comm_stream: accepted (epx runs on torch's current stream). config:
  accepted, its values are DeepEP's tuning and epx does not read them (epx's launch shapes come
  from EPX_CONFIG_PATH or are chosen per world).

Core pieces that would serve this mode better (none of them refuses a call):
- The whole count matrix of a round (rank_prefix_matrix's other columns): each receiver holds
  only what every rank sent it (`counts` in ht_layout.hpp). Belongs in the count exchange
  (every rank publishing its row to all peers) and in DispatchResult.
- Per-call sizing from Python: the core sizes high_throughput's receive area to each round when
  worst_case_output is off, but the binding refuses that on one node (python/src/gpu.cpp
  python_backend: across nodes it allows it, and the collective engine then moves exact sizes;
  combine_buffer_view uses cfg.capacity() rather than the round's) and the package's views have
  fixed shapes (all2all.py _field_specs). With it, max_tokens_per_rank could be 65536 without
  holding 65536 x W rows. num_worst_tokens would want the worst case set by the caller (an
  EpConfig field for the receive rows) rather than world_size * max_tokens_per_rank.
- A combine of a stored round (DeepEP's handle keeps its layout; epx's combine serves its
  object's last dispatch): today an extra dispatch, see above. Belongs in the high_throughput
  backend (a round's routing state kept per handle) and the All2All interface.
- Input scales of any strides: DispatchInput takes row-major [N, H/128] scales; other strides
  cost a copy here (a stride pair in DispatchInput would remove it). int32 (UE8M0) scales:
  refused (epx's wire carries f32 scales).
- internode_dispatch / internode_combine: not served. Across nodes (the world from the group is
  an NcclWorld when LOCAL_WORLD_SIZE is smaller than the group) dispatch and combine themselves
  run on epx's collective engine.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

from .. import _epx
from .. import _torch as T
from ..all2all import All2All
from ._common import (HT_BACKEND, RoutedObject as _Object, _unsupported, check_bias, combine_rows, event_after, ht_config,
                      rows_of, rows_per_source_psum, split_x, zero_rows)
MAX_TOKENS_ENV = "EPX_DEEP_EP_MAX_TOKENS"
DEFAULT_MAX_TOKENS = 4096
# What internode_dispatch / internode_combine say instead of running.
_CALL_DISPATCH_ACROSS_NODES = ("epx serves dispatch and combine across nodes too (an NcclWorld): "
                               "call those")


class Config:
    """DeepEP's launch configuration of the normal mode: the values are recorded and checked as
    DeepEP checks them; epx does not read them (its launch shapes come from EPX_CONFIG_PATH or
    are chosen per world)."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        if num_sms < 0:
            raise _epx.InputError(f"Config: num_sms = {num_sms}, expected >= 0")
        if not 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens:
            raise _epx.InputError(
                f"Config: num_max_nvl_chunked_send_tokens = {num_max_nvl_chunked_send_tokens}, "
                f"expected > 0 and < num_max_nvl_chunked_recv_tokens = "
                f"{num_max_nvl_chunked_recv_tokens}")
        if num_max_rdma_chunked_send_tokens <= 0:
            raise _epx.InputError(f"Config: num_max_rdma_chunked_send_tokens = "
                                  f"{num_max_rdma_chunked_send_tokens}, expected > 0")
        # DeepEP rounds the RDMA receive size up to a multiple of the send size.
        send = num_max_rdma_chunked_send_tokens
        recv = -(-num_max_rdma_chunked_recv_tokens // send) * send
        if not send <= recv // 2:
            raise _epx.InputError(
                f"Config: num_max_rdma_chunked_send_tokens = {send}, expected at most half of "
                f"num_max_rdma_chunked_recv_tokens (rounded up to it: {recv})")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = send
        self.num_max_rdma_chunked_recv_tokens = recv

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """A byte count for num_nvl_bytes, of the order DeepEP asks for (its per-channel
        queues of rows and their metadata); epx sizes its own memory and does not read it."""
        channels, peers = max(self.num_sms // 2, 1), min(num_ranks, 8)
        # a row, its source, up to 128 ids (8 bytes), weights and scales (4 bytes each)
        per_row = hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4
        total = channels * peers * (self.num_max_nvl_chunked_recv_tokens * per_row + 5 * 4)
        return (total + 127) // 128 * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: epx holds no RDMA buffer (across nodes NCCL's collectives carry the rows)."""
        return 0

    def __repr__(self) -> str:
        return (f"epx.deep_ep.Config(num_sms={self.num_sms}, "
                f"nvl=({self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}), "
                f"rdma=({self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens}))")


class _Key(NamedTuple):
    """What makes one epx object of the mode."""

    hidden: int
    num_experts: int
    topk: int
    fp8: bool


class _Handle(tuple):
    """DeepEP's handle (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
    recv_src_idx, is_token_in_rank, send_head), which also keeps what epx needs to send the same
    routing again: the top-k ids (or, for a dispatch without top-k, is_token_in_rank and the
    per-expert counts), the token count, the shape and the routing's number."""

    def __new__(cls, fields, owner, key, obj, layout, ids, num_tokens, expert_counts=None):
        h = super().__new__(cls, fields)
        h._owner, h._key, h._object, h._layout = owner, key, obj, layout
        h._ids, h._num_tokens, h._expert_counts = ids, num_tokens, expert_counts
        return h


def dispatch_layout(topk_idx, num_experts: int, num_ranks: int):
    """(num_tokens_per_rank [W] int32, num_tokens_per_expert [E] int32, is_token_in_rank [N, W]
    bool) of topk_idx [N, K]; ids outside [0, E) take no part. Torch only, no synchronisation."""
    torch = T.torch()
    n = topk_idx.shape[0]
    per_rank_experts = num_experts // num_ranks
    ids = topk_idx.long()
    valid = (ids >= 0) & (ids < num_experts)
    expert = torch.where(valid, ids, torch.full_like(ids, num_experts))  # E: nowhere
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    per_expert.index_add_(0, expert.flatten(), torch.ones_like(expert.flatten()))
    rank = torch.where(valid, ids // per_rank_experts, torch.full_like(ids, num_ranks))
    in_rank = torch.zeros((n, num_ranks + 1), dtype=torch.bool, device=ids.device)
    in_rank.scatter_(1, rank, True)
    in_rank = in_rank[:, :num_ranks].contiguous()
    per_rank = in_rank.sum(dim=0, dtype=torch.int32)
    return per_rank, per_expert[:num_experts].to(torch.int32), in_rank


class _NormalMode:
    """Buffer's methods of DeepEP's normal mode. They read the Buffer's rank, group_size,
    _world (its IpcWorld, made when num_nvl_bytes > 0 or in low-latency mode), _destroyed and
    num_sms."""

    def _init_normal(self, max_tokens_per_rank: Optional[int]) -> None:
        if max_tokens_per_rank is None:
            env = os.environ.get(MAX_TOKENS_ENV)
            try:
                max_tokens_per_rank = int(env) if env else DEFAULT_MAX_TOKENS
            except ValueError:
                raise _epx.ConfigError(f"{MAX_TOKENS_ENV} = {env!r}, expected an integer") \
                    from None
        if not 1 <= max_tokens_per_rank <= _epx.MAX_TOKENS_PER_RANK:
            raise _epx.ConfigError(f"max_tokens_per_rank = {max_tokens_per_rank}, expected 1.."
                                   f"{_epx.MAX_TOKENS_PER_RANK}")
        self.max_tokens_per_rank = max_tokens_per_rank
        self._normal: dict = {}
        self._layouts = 0  # routings dispatched (not cached): the same count on every rank

    def _normal_objects(self):
        return [o.a2a for o in self._normal.values()]

    def _forget_normal_objects(self) -> None:
        self._normal.clear()

    # ---- DeepEP's configuration calls ------------------------------------------------------------

    @classmethod
    def get_dispatch_config(cls, num_ranks: int) -> Config:
        """A Config with the Buffer's num_sms (set_num_sms) and DeepEP's defaults: epx does not
        read it."""
        return cls._default_config(num_ranks)

    @classmethod
    def get_combine_config(cls, num_ranks: int) -> Config:
        """As get_dispatch_config."""
        return cls._default_config(num_ranks)

    @classmethod
    def _default_config(cls, num_ranks: int) -> Config:
        if not 1 <= num_ranks <= _epx.MAX_RANKS:
            raise _epx.InputError(f"num_ranks = {num_ranks}, expected 1..{_epx.MAX_RANKS}")
        return Config(cls.num_sms)

    # ---- the calls -------------------------------------------------------------------------------

    def _check_normal(self, what: str) -> None:
        if self._destroyed:
            raise _epx.StateError(f"Buffer.{what}: the Buffer was destroyed")
        if self._world is None:
            raise _epx.ConfigError(
                f"Buffer.{what}: num_nvl_bytes = {self.num_nvl_bytes}, expected > 0 for "
                "DeepEP's normal mode (the Buffer makes its world when given NVLink bytes)")

    @staticmethod
    def _begin(previous_event, async_finish: bool, allocate_on_comm_stream: bool, config) -> None:
        if config is not None and not isinstance(config, Config):
            raise _epx.InputError(f"config = {type(config).__name__}, expected a deep_ep.Config "
                                  "or None")
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise _epx.InputError("allocate_on_comm_stream = True, expected with a previous_event "
                                  "and async_finish = True (as DeepEP)")
        if previous_event is not None and previous_event.event is not None:
            previous_event.event.current_stream_wait()

    _end = staticmethod(event_after)

    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """(num_tokens_per_rank [W] int32, None, num_tokens_per_expert [E] int32,
        is_token_in_rank [N, W] bool, event) of topk_idx [N, K] (int64 or int32, -1 = none), as
        DeepEP's; computed on torch's current stream, no communication."""
        if self._destroyed:
            raise _epx.StateError("Buffer.get_dispatch_layout: the Buffer was destroyed")
        torch = T.torch()
        T.check("topk_idx", topk_idx, dtypes=(torch.int64, torch.int32), shape=(None, None))
        W = self.group_size
        if num_experts <= 0 or num_experts % W != 0:
            raise _epx.InputError(f"num_experts = {num_experts}, expected a positive multiple of "
                                  f"the group's size {W}")
        self._begin(previous_event, async_finish, allocate_on_comm_stream, None)
        per_rank, per_expert, in_rank = dispatch_layout(topk_idx, num_experts, W)
        event = self._end(async_finish, (topk_idx, per_rank, per_expert, in_rank))
        return per_rank, None, per_expert, in_rank, event

    def _object(self, key: _Key) -> _Object:
        """The epx object of `key`, made on first use (collective over the group)."""
        obj = self._normal.get(key)
        if obj is None:
            cfg = ht_config(world_size=self.group_size, rank=self.rank, hidden=key.hidden,
                            num_experts=key.num_experts, topk=key.topk, fp8=key.fp8,
                            max_tokens_per_rank=self.max_tokens_per_rank)
            obj = _Object(All2All.create(cfg, self._world, backend=HT_BACKEND))
            self._normal[key] = obj
        return obj

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config=None, previous_event=None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Sends each token to the ranks of its experts; returns (recv_x, recv_topk_idx,
        recv_topk_weights, num_recv_tokens_per_expert_list, handle, event) as DeepEP's dispatch
        (the module docstring says how; with `handle`, a cached dispatch: (recv_x, None, None,
        None, None, event)). Collective: every rank calls it."""
        self._check_normal("dispatch")
        torch = T.torch()
        rows, scales = split_x(x)
        n, hidden = rows.shape
        if n > self.max_tokens_per_rank:
            raise _epx.InputError(
                f"x.shape[0] = {n}, expected at most max_tokens_per_rank = "
                f"{self.max_tokens_per_rank} (Buffer(..., max_tokens_per_rank=) or "
                f"{MAX_TOKENS_ENV}: epx holds world_size x that many received rows)")
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise _epx.InputError("dispatch(handle=...): topk_idx and topk_weights, expected "
                                      "None (a cached dispatch sends no top-k, as DeepEP)")
            return self._cached_dispatch(rows, scales, x, handle, config, previous_event,
                                         async_finish, allocate_on_comm_stream)
        for name, t in (("num_tokens_per_rank", num_tokens_per_rank),
                        ("is_token_in_rank", is_token_in_rank),
                        ("num_tokens_per_expert", num_tokens_per_expert)):
            if t is None:
                raise _epx.InputError(f"dispatch: {name} = None, expected a tensor (from "
                                      "get_dispatch_layout) when no handle is given")
        if (topk_idx is None) != (topk_weights is None):
            raise _epx.InputError(f"dispatch: topk_{'weights' if topk_weights is None else 'idx'}"
                                  " = None, expected topk_idx and topk_weights both or neither "
                                  "(as DeepEP)")
        W, dev = self.group_size, rows.device
        T.check("num_tokens_per_rank", num_tokens_per_rank, dtype=torch.int32, shape=(W,),
                device=dev)
        T.check("is_token_in_rank", is_token_in_rank, dtype=torch.bool, shape=(n, W), device=dev)
        T.check("num_tokens_per_expert", num_tokens_per_expert, dtype=torch.int32,
                shape=(None,), device=dev)
        E = num_tokens_per_expert.shape[0]
        if E == 0 or E % W != 0:
            raise _epx.InputError(f"num_tokens_per_expert.shape = [{E}], expected a positive "
                                  f"multiple of the group's size {W}")
        by_ids = topk_idx is not None
        if by_ids:
            T.check("topk_idx", topk_idx, dtypes=(torch.int64, torch.int32), shape=(n, None),
                    device=dev)
            K = topk_idx.shape[1]
            T.check("topk_weights", topk_weights, dtype=torch.float32, shape=(n, K), device=dev)
        else:
            K = 1  # rows routed by is_token_in_rank carry no top-k
        if expert_alignment < 1:
            raise _epx.InputError(f"expert_alignment = {expert_alignment}, expected >= 1")
        if num_worst_tokens < 0:
            raise _epx.InputError(f"num_worst_tokens = {num_worst_tokens}, expected >= 0")
        self._begin(previous_event, async_finish, allocate_on_comm_stream, config)

        key = _Key(hidden, E, K, scales is not None)
        obj = self._object(key)
        mismatch = None
        if num_worst_tokens == 0 and by_ids:  # checked once the count read has synchronised
            per_rank, per_expert, in_rank = dispatch_layout(topk_idx, E, W)
            mismatch = ((in_rank != is_token_in_rank).any()
                        | (per_rank != num_tokens_per_rank).any()
                        | (per_expert != num_tokens_per_expert).any())
        elif num_worst_tokens == 0:
            mismatch = (is_token_in_rank.sum(dim=0, dtype=torch.int32)
                        != num_tokens_per_rank).any()
        if by_ids:
            out = obj.a2a.dispatch(rows, topk_idx, topk_weights, scales)
        else:  # the core routes by the mask and sums the senders' per-expert counts
            out = obj.a2a.dispatch_by_rank(rows, is_token_in_rank, num_tokens_per_expert, scales)
        self._layouts += 1
        obj.layout = self._layouts

        cap = obj.a2a.config.capacity
        if num_worst_tokens > 0:
            count, expert_list = None, []
            total = num_worst_tokens
        else:
            count = int(out.recv_count.item())  # the host waits for the round's counts
            if bool(mismatch) and by_ids:
                raise _epx.InputError(
                    "dispatch: num_tokens_per_rank, is_token_in_rank or num_tokens_per_expert "
                    "differ from get_dispatch_layout(topk_idx, num_experts), expected that "
                    "layout (epx routes by topk_idx)")
            if bool(mismatch):
                raise _epx.InputError(
                    "dispatch: num_tokens_per_rank differs from is_token_in_rank's column sums, "
                    "expected them (without top-k, epx routes by is_token_in_rank)")
            a = expert_alignment
            expert_list = [-(-c // a) * a for c in out.expert_counts.tolist()]
            total = count
        valid = torch.arange(cap, device=dev) < out.recv_count  # rows [0, M), no host read
        recv_x = rows_of(out.recv_x, total)
        if scales is not None:
            recv_x = (recv_x, rows_of(out.recv_scales, total))
        L, r = E // W, self.rank
        recv_topk_idx = recv_topk_weights = None
        if by_ids:
            ids = out.recv_topk_ids.long()
            local = (ids >= r * L) & (ids < (r + 1) * L) & valid[:, None]
            recv_topk_idx = rows_of(torch.where(local, ids - r * L, -1).to(topk_idx.dtype),
                                     total, fill=-1)
            recv_topk_weights = rows_of(torch.where(local, out.recv_topk_weights, 0.0), total,
                                         fill=0.0)
        recv_src_idx = rows_of(out.recv_src_idx, total)
        rank_prefix_matrix = torch.full((W, W), -1, dtype=torch.int32, device=dev)
        rank_prefix_matrix[:, r] = rows_per_source_psum(out.recv_src_rank, valid, W)
        handle = _Handle((rank_prefix_matrix, None, None, recv_src_idx, is_token_in_rank, None),
                         self, key, obj, obj.layout, topk_idx, n,
                         None if by_ids else num_tokens_per_expert.clone())
        event = self._end(async_finish, (rows, scales, topk_idx, topk_weights, is_token_in_rank,
                                         recv_topk_idx, recv_topk_weights, recv_src_idx))
        return recv_x, recv_topk_idx, recv_topk_weights, expert_list, handle, event

    def _handle_of(self, handle, what: str) -> _Handle:
        if not isinstance(handle, _Handle) or handle._owner is not self:
            raise _epx.InputError(f"Buffer.{what}: handle = {type(handle).__name__}, expected a "
                                  "handle this Buffer's dispatch returned")
        return handle

    def _send_again(self, obj: _Object, h: _Handle, rows, scales):
        """Dispatches h's routing on `obj` (rows: x or zeros): obj's round is h's after it."""
        torch = T.torch()
        if h._ids is None:  # routed by is_token_in_rank
            out = obj.a2a.dispatch_by_rank(rows, h[4], h._expert_counts, scales)
        else:
            weights = torch.zeros(h._ids.shape, dtype=torch.float32, device=rows.device)
            out = obj.a2a.dispatch(rows, h._ids, weights, scales)
        obj.layout = h._layout
        return out

    def _cached_dispatch(self, rows, scales, x, handle, config, previous_event, async_finish,
                         allocate_on_comm_stream):
        h = self._handle_of(handle, "dispatch")
        n, hidden = rows.shape
        if n != h._num_tokens or hidden != h._key.hidden:
            raise _epx.InputError(f"dispatch(handle=...): x.shape = [{n}, {hidden}], expected "
                                  f"[{h._num_tokens}, {h._key.hidden}] (the handle's tokens)")
        self._begin(previous_event, async_finish, allocate_on_comm_stream, config)
        obj = self._object(h._key._replace(fp8=scales is not None))
        out = self._send_again(obj, h, rows, scales)
        total = h[3].shape[0]  # DeepEP: the handle's recv_src_idx rows
        recv_x = rows_of(out.recv_x, total)
        if scales is not None:
            recv_x = (recv_x, rows_of(out.recv_scales, total))
        parts = recv_x if isinstance(recv_x, tuple) else (recv_x,)
        event = self._end(async_finish, (rows, scales) + parts)
        return recv_x, None, None, None, None, event

    def combine(self, x, handle, topk_weights=None, bias=None, config=None,
                previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Sums, at each token's rank, the rows the ranks that got it give back (no weights):
        returns (combined_x [N, H] bf16, combined_topk_weights [N, K] float32 or None, event) as
        DeepEP's combine. x: [rows, H] bf16, row-aligned with the handle's dispatch (recv_x);
        topk_weights: [rows, K] float32 likewise (recv_topk_weights), summed per token over the
        ranks that got it; bias: None, an [N, H] bf16 tensor or a pair of them, added before the
        rows (f32, rounded once with them). Collective: every rank calls it."""
        self._check_normal("combine")
        torch = T.torch()
        h = self._handle_of(handle, "combine")
        rows = h[3].shape[0]
        T.check("x", x, dtype=torch.bfloat16, shape=(rows, h._key.hidden),
                what="the handle's received rows")
        if topk_weights is not None:
            T.check("topk_weights", topk_weights, dtype=torch.float32,
                    shape=(rows, h._key.topk), what="the handle's received rows")
            if h._ids is None:
                raise _epx.InputError("combine: topk_weights = a tensor, expected None for a "
                                      "handle of a dispatch without top-k")
        check_bias(bias, h._num_tokens, h._key.hidden)
        self._begin(previous_event, async_finish, allocate_on_comm_stream, config)
        obj: _Object = h._object
        if obj.layout != h._layout:  # the object has dispatched another routing since
            self._send_again(obj, h, *self._zero_rows(h))
        combined, combined_w = combine_rows(obj.a2a, x, topk_weights, bias)
        event = self._end(async_finish, (x, topk_weights, combined, combined_w))
        return combined, combined_w, event

    @staticmethod
    def _zero_rows(h: _Handle):
        """Zero rows (and unit scales) of h's tokens in h's wire."""
        return zero_rows(h._num_tokens, h._key.hidden, h._key.fp8, h[4].device)

    def internode_dispatch(self, *args, **kwargs):
        raise _unsupported("Buffer.internode_dispatch", _CALL_DISPATCH_ACROSS_NODES)

    def internode_combine(self, *args, **kwargs):
        raise _unsupported("Buffer.internode_combine", _CALL_DISPATCH_ACROSS_NODES)
