"""DeepEP V2's ElasticBuffer and EPHandle (deep_ep/buffers/elastic.py, commit dd758ca) over epx's
``high_throughput`` backend: construction, the size hint and the runtime's queries, dispatch with
or without expansion (cached with ``handle=`` or not, with or without a host read of the counts)
and its combine, with DeepEP's names, arguments, shapes and dtypes. docs/deepep-v2.md maps the
class onto epx's core and lists what is left; _elastic_expand.py holds the expand mode.

How the calls map onto epx:

- World: the constructor makes the world from the group (collective; the group only carries
  the handshake, gloo is enough): an ``IpcWorld`` on one node, an ``NcclWorld`` across nodes
  (LOCAL_WORLD_SIZE smaller than the group), whose collective engine serves every call. The
  logical and physical domains are (1, W) either way (epx has no scale-out split of its own), so
  ``allow_hybrid_mode`` changes nothing.
- Objects: per shape (hidden, num_experts, top-k, wire: bf16 or fp8 with f32 1x128 scales,
  num_max_tokens_per_rank), made on the first dispatch of that shape (collective: every rank
  dispatches the same shapes in the same order): one epx ``All2All`` of ``high_throughput``,
  token-major rows ordered by (source rank, source index) (the order DeepEP's ``deterministic``
  sort makes, here always), receive areas for the worst case (W x num_max_tokens_per_rank rows,
  so ``do_cpu_sync=False`` reads nothing back), one round in flight, ``combine_order=
  'highest_slot'`` (V2's order of the combine sum), ``timeout_ms`` = num_gpu_timeout_secs
  (EPX_TIMEOUT_MS wins).
- dispatch: epx routes each token by its ids (-1 = none) to each rank that holds one of its
  experts, once. recv_x (and fp8 scales: row-major, or TMA-aligned column-major with
  ``use_tma_aligned_col_major_sf``) are copies of epx's rows; recv_topk_idx holds the ids made
  local, -1 for experts elsewhere; recv_topk_weights the token's whole weight row, as DeepEP's
  (None without topk_weights). With ``do_cpu_sync`` (the default without a handle) the host reads
  the row count once and the outputs have that many rows; without it every output has W x
  num_max_tokens_per_rank rows and rows past the count hold id -1, weight 0, metadata -1.
- The handle (EPHandle, DeepEP's fields): ``psum_num_recv_tokens_per_scaleup_rank`` [W] int32,
  the rows from ranks 0..i; ``psum_num_recv_tokens_per_expert`` [L] int32, the inclusive prefix
  sum of each local expert's count rounded up to ``expert_alignment``;
  ``num_unaligned_recv_tokens_per_expert`` [L] int32, the counts themselves;
  ``num_recv_tokens_per_expert_list``: the rounded counts read on the host (empty without the
  host read); ``recv_src_metadata`` [rows, K + 2] int32: column 0 = source rank x
  num_max_tokens_per_rank + source index, column 1 = source rank x K + the token's highest top-k
  slot whose expert is on this rank, columns 2.. = -1 (they are the expand layout's);
  ``dst_buffer_slot_idx`` [N, K] int32: for the highest slot of each destination rank of a token,
  rank x num_max_tokens_per_rank + its place among this rank's tokens sent there (epx's rows are
  in source order), -1 elsewhere; ``num_recv_tokens``, ``num_expanded_tokens`` (the rounded
  counts' sum; without the host read, DeepEP's worst case); ``topk_idx`` (a copy with
  ``do_handle_copy``, else the caller's tensor, which must then stay unchanged).
- dispatch(do_expand=True): one row per (received token, slot whose expert is here), local
  experts' rows together, each expert's padded to ``expert_alignment``, gathered on the device
  from epx's rows (_elastic_expand.py says how); recv_topk_idx is None, recv_topk_weights one
  float per expanded row; the handle's ``recv_src_metadata[:, 2:]`` holds each slot's expanded
  row (-1 where the expert is elsewhere), ``psum_num_recv_tokens_per_expert[i]`` expert i's first
  row plus its count, ``num_expanded_tokens`` the rows (without the host read, DeepEP's worst
  case). ``do_zero_padding`` zeroes the padding rows (and their scales); otherwise they hold a
  copy of some received row, and their weights are 0.
- dispatch(handle=...): the handle's routing again (its ids, no count read), the same rows bit
  for bit (expand: the same gather); the same handle object comes back, and recv_topk_idx again;
  topk_weights may be given; ``do_expand`` must be the handle's.
- combine: epx's token-major combine of the handle's round with extras: per token, the bias rows
  start the f32 sum, then each rank's row is added at that rank's highest top-k slot of the
  token, slots ascending, rounded once (the core's ``highest_slot`` order: V2's sum bit for
  bit). topk_weights come back as, per slot, the copy of the rank that holds the slot's expert
  (the other ranks' copies are zeroed before the core sums them; slots of id -1 give 0). When
  the handle's object has dispatched another routing since, combine first dispatches the
  handle's routing again with zero rows (one dispatch more, the exact result). An expand
  handle's combine takes [expanded rows, H] and weights [expanded rows]: with
  ``allow_multiple_reduction`` each rank sums its rows of a token first (one combine), without
  it every row is added at the token's rank in slot order (K combines; _elastic_expand.py).
- Events: ``previous_event`` (and ``previous_event_before_epilogue``): torch's current stream
  waits for it; DeepEP's rule holds (a previous_event needs allocate_on_comm_stream).
  ``async_with_compute_stream``: the event returned is recorded after the call (epx runs on
  torch's current stream, so waiting for it costs nothing). ``capture()`` records an EventHandle.
- Sizes and launch: ``get_buffer_size_hint`` = the bytes of epx's object of that shape, rounded
  up to 2 MiB; ``num_bytes`` = the value given, else that hint (recorded: epx allocates per shape
  on first dispatch). ``get_theoretical_num_sms`` = the blocks epx's high_throughput dispatch
  launches (EPX_CONFIG_PATH's dispatch.num_blocks, else 16: a sending and a receiving block for
  each of 8 channels); ``num_sms`` given to a call is kept in the handle, not read.
  ``get_theoretical_num_qps`` = 0 (no RDMA queue pairs on one node); ``num_qps``, ``sl_idx``,
  ``num_allocated_qps``, ``prefer_overlap_with_compute`` and ``num_cpu_timeout_secs`` are
  recorded, not read. ``deterministic``: recorded; the rows are always in that order.

Not served yet (NotImplementedError naming the argument or call):
- ``num_cpu_bytes > 0`` and the Engram, pipeline (PP) and all-gather/reduce-scatter (AGRS)
  calls and hints.
- int32 (UE8M0) scales: epx's fp8 wire carries float32 1x128 block scales.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from .. import _epx
from .. import _torch as T
from ..all2all import All2All
from ._common import (HT_BACKEND, RoutedObject as _Object, EventHandle, EventOverlap, _unsupported, check_bias,
                      combine_rows, copy_epilogue, event_after, ht_config, make_world,
                      rows_per_source_psum, split_x, zero_rows)
from ._elastic_expand import (ExpandLayout, combine_expanded, expand_layout, expand_psum,
                              gather_rows, gather_weights)
from ._normal import dispatch_layout

_BUFFER_ALIGNMENT = 2 << 20  # DeepEP's buffer sizes are multiples of 2 MiB
_DEFAULT_DISPATCH_BLOCKS = 16  # high_throughput's default: 8 channels, 2 blocks each
_SF_ALIGNMENT = 4  # TMA-aligned column-major scales: each column padded to 16 bytes


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _worst_expanded(W: int, max_tokens: int, K: int, L: int, alignment: int) -> int:
    """DeepEP's bound on the expanded rows of a dispatch (num_expanded_tokens without the host
    read): every received row at min(K, L) local slots, every expert padded."""
    return _align(W * max_tokens * min(K, L) + (alignment - 1) * L, alignment)


class _Key(NamedTuple):
    """What makes one epx object of the buffer."""

    hidden: int
    num_experts: int
    topk: int
    fp8: bool
    max_tokens_per_rank: int


class _Route(NamedTuple):
    """What epx keeps in a handle to send its routing again and to combine it."""

    owner: "ElasticBuffer"
    key: _Key
    obj: _Object
    layout: int  # the routing's number on its buffer
    num_tokens: int
    rows: int  # the rows of the dispatch's outputs (the count, or the worst case)
    local: object  # [rows, K] bool: the slot's expert is on this rank
    expand: Optional[ExpandLayout]  # the expand layout of an expand handle, else None


class EPHandle:
    """DeepEP's dispatch handle: what dispatch learnt of its routing, reused by a cached dispatch
    (``handle=``) and by combine. The fields are DeepEP's (the module docstring defines each as
    epx fills it); the expand mode's and hybrid mode's fields are None."""

    def __init__(self, do_expand: bool, num_experts: int, expert_alignment: int,
                 num_max_tokens_per_rank: int, num_sms: int, topk_idx,
                 num_recv_tokens: int, num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: list,
                 psum_num_recv_tokens_per_scaleup_rank, psum_num_recv_tokens_per_expert,
                 num_unaligned_recv_tokens_per_expert, recv_src_metadata, dst_buffer_slot_idx,
                 token_metadata_at_forward=None, channel_linked_list=None):
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        self.cached_recv_src_metadata_before_sort = None
        self._route: Optional[_Route] = None

    def deterministic_sort(self, *args, **kwargs) -> None:
        """Nothing to do: epx's rows are already ordered by (source rank, source index)."""


def _wait(event) -> None:
    """torch's current stream waits for a DeepEP event (EventHandle or EventOverlap)."""
    if isinstance(event, EventOverlap):
        event = event.event
    if event is not None:
        event.current_stream_wait()


def _check_count(name: str, value, low: int, high: Optional[int] = None, why: str = "") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or \
            (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise _epx.InputError(f"{name} = {value!r}, expected an integer {bound}{why}")
    return value


class ElasticBuffer:
    """DeepEP V2's ElasticBuffer over epx (see the module docstring for what is served).

    Attributes as DeepEP's: group, rank_idx, num_ranks, num_bytes, num_max_tokens_per_rank,
    allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute, deterministic,
    explicitly_destroy, num_allocated_qps, num_scaleout_ranks, num_scaleup_ranks,
    scaleout_rank_idx, scaleup_rank_idx, num_rdma_ranks, num_nvlink_ranks."""

    def __init__(self, group, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300,
                 num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False):
        """DeepEP's arguments, same names and defaults. Collective over the group (the
        IpcWorld's handshake). num_max_tokens_per_rank may be 0 when every dispatch names its
        own; hidden, num_topk and use_fp8_dispatch only size the hint for num_bytes."""
        if group is None:
            raise ValueError("ElasticBuffer: group = None, expected a torch.distributed group")
        if num_cpu_bytes:
            raise _unsupported(f"ElasticBuffer(num_cpu_bytes={num_cpu_bytes})",
                               "host memory for Engram storage is not part of epx")
        _check_count("num_max_tokens_per_rank", num_max_tokens_per_rank, 0,
                     _epx.MAX_TOKENS_PER_RANK)
        _check_count("num_gpu_timeout_secs", num_gpu_timeout_secs, 1)
        self.group = group
        self.rank_idx, self.num_ranks = group.rank(), group.size()
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = deterministic
        self.explicitly_destroy = explicitly_destroy
        self.sl_idx = sl_idx
        self.num_allocated_qps = num_allocated_qps
        self.num_cpu_timeout_secs = num_cpu_timeout_secs
        self.num_gpu_timeout_secs = num_gpu_timeout_secs
        if num_bytes is None:
            num_bytes = 0
            if num_max_tokens_per_rank > 0 and hidden > 0:
                num_bytes = self.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden,
                                                      num_topk, use_fp8_dispatch)
        self.num_bytes = num_bytes
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = self.get_physical_domain_size()
        self._objects: dict = {}
        self._layouts = 0  # routings dispatched (not cached): the same count on every rank
        self._world = self._make_world(group)

    @staticmethod
    def _make_world(group):
        return make_world(group)

    # ---- sizes, domains, launch shape --------------------------------------------------------

    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False,
                             allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes of epx's object of this shape (the wire use_fp8_dispatch names), rounded up to
        2 MiB. The expert count does not change it; num_topk = 0 counts as 1."""
        _check_count("num_max_tokens_per_rank", num_max_tokens_per_rank, 1,
                     _epx.MAX_TOKENS_PER_RANK)
        topk = max(num_topk, 1)
        cfg = ht_config(world_size=group.size(), rank=group.rank(), hidden=hidden,
                        num_experts=group.size() * topk, topk=topk, fp8=use_fp8_dispatch,
                        max_tokens_per_rank=num_max_tokens_per_rank,
                        combine_order="highest_slot")
        return _align(_epx.buffer_bytes(HT_BACKEND, cfg), _BUFFER_ALIGNMENT)

    def get_logical_domain_size(self):
        """(scale-out ranks, scale-up ranks): (1, W): epx has no scale-out split (across nodes
        its collective engine serves every rank alike)."""
        return 1, self.num_ranks

    def get_physical_domain_size(self):
        """(RDMA ranks, NVLink ranks): (1, W), as get_logical_domain_size."""
        return 1, self.num_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int,
                                num_scaleout_topk: int = 0, rdma_gbs: float = 0,
                                nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """The blocks epx's high_throughput dispatch launches (EPX_CONFIG_PATH's
        dispatch.num_blocks, else 16); DeepEP's bandwidth model does not apply."""
        from ..config import launch_configs_from_env

        launch = launch_configs_from_env()
        if launch is not None and launch.dispatch.num_blocks > 0:
            return launch.dispatch.num_blocks
        return _DEFAULT_DISPATCH_BLOCKS

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """0: epx opens no RDMA queue pairs of its own (across nodes NCCL does)."""
        return 0

    # ---- runtime -------------------------------------------------------------------------------

    @staticmethod
    def capture() -> EventHandle:
        """An event recorded now on torch's current stream."""
        return EventHandle()

    def get_comm_stream(self):
        """epx runs on the caller's stream: torch's current stream."""
        return T.torch().cuda.current_stream()

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False,
                sequential: bool = True) -> None:
        """Every rank waits for its GPU work so far, then for every other rank (a host barrier
        of the world): at least what DeepEP's barrier guarantees."""
        self._check_live("barrier")
        torch = T.torch()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._world.barrier()

    def destroy(self) -> None:
        """Releases the epx objects (collective: every rank calls it, after its last combine)."""
        if not self.explicitly_destroy:
            raise _epx.StateError("ElasticBuffer.destroy(): explicitly_destroy = False, expected "
                                  "True (as DeepEP: only a buffer made to be destroyed explicitly)")
        if self._world is None:
            return
        objects = [o.a2a for o in self._objects.values()]
        for a2a in objects:
            a2a.synchronize()
        self._world.barrier()  # nobody frees memory a peer may still read
        for a2a in objects:
            a2a.close()
        self._objects.clear()
        self._world = None

    def _check_live(self, what: str) -> None:
        if self._world is None:
            raise _epx.StateError(f"ElasticBuffer.{what}: the buffer was destroyed")

    def _object(self, key: _Key) -> _Object:
        """The epx object of `key`, made on first use (collective over the group)."""
        obj = self._objects.get(key)
        if obj is None:
            cfg = ht_config(world_size=self.num_ranks, rank=self.rank_idx, hidden=key.hidden,
                            num_experts=key.num_experts, topk=key.topk, fp8=key.fp8,
                            max_tokens_per_rank=key.max_tokens_per_rank,
                            combine_order="highest_slot",
                            timeout_ms=self.num_gpu_timeout_secs * 1000)
            obj = _Object(All2All.create(cfg, self._world, backend=HT_BACKEND))
            self._objects[key] = obj
        return obj

    def _handle_of(self, handle, what: str) -> EPHandle:
        if not isinstance(handle, EPHandle) or handle._route is None or \
                handle._route.owner is not self:
            raise _epx.InputError(f"ElasticBuffer.{what}: handle = {type(handle).__name__}, "
                                  "expected an EPHandle this buffer's dispatch returned")
        return handle

    @staticmethod
    def _begin(previous_event, previous_event_before_epilogue,
               allocate_on_comm_stream: bool) -> None:
        if previous_event is not None and not allocate_on_comm_stream:
            raise _epx.InputError("previous_event = an event, expected allocate_on_comm_stream "
                                  "= True with it (as DeepEP)")
        _wait(previous_event)
        _wait(previous_event_before_epilogue)

    # ---- dispatch ------------------------------------------------------------------------------

    def dispatch(self, x, topk_idx=None, topk_weights=None,
                 cumulative_local_expert_recv_stats=None, num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event=None, previous_event_before_epilogue=None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True,
                 do_cpu_sync: Optional[bool] = None, do_expand: bool = False,
                 do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        """Sends each token to the ranks of its experts; returns (recv_x, recv_topk_idx,
        recv_topk_weights, handle, event) as DeepEP's dispatch without expansion (the module
        docstring says how). Collective: every rank calls it."""
        self._check_live("dispatch")
        do_expand = bool(do_expand)
        if do_zero_padding and not do_expand:
            raise _epx.InputError("dispatch: do_zero_padding = True, expected False without "
                                  "do_expand (it zeroes the expand layout's padding)")
        torch = T.torch()
        rows, scales = split_x(x)
        n, hidden = rows.shape
        route = None
        if handle is not None:
            route = self._handle_of(handle, "dispatch")._route
            if topk_idx is not None:
                raise _epx.InputError("dispatch(handle=...): topk_idx = a tensor, expected None "
                                      "(a cached dispatch sends the handle's ids)")
            if do_cpu_sync:
                raise _epx.InputError("dispatch(handle=...): do_cpu_sync = True, expected None "
                                      "or False (the handle holds the counts)")
            for name, given in (("num_experts", num_experts),
                                ("expert_alignment", expert_alignment),
                                ("num_max_tokens_per_rank", num_max_tokens_per_rank)):
                if given is not None and given != getattr(handle, name):
                    raise _epx.InputError(f"dispatch(handle=...): {name} = {given}, expected "
                                          f"the handle's {getattr(handle, name)}")
            if do_expand != handle.do_expand:
                raise _epx.InputError(f"dispatch(handle=...): do_expand = {do_expand}, expected "
                                      f"the handle's {handle.do_expand}")
            if n != route.num_tokens:
                raise _epx.InputError(f"dispatch(handle=...): x.shape[0] = {n}, expected the "
                                      f"handle's {route.num_tokens} tokens")
            topk_idx, num_experts = handle.topk_idx, handle.num_experts
            expert_alignment = handle.expert_alignment
            num_max_tokens_per_rank = handle.num_max_tokens_per_rank
            do_cpu_sync = False
        elif topk_idx is None:
            raise _epx.InputError("dispatch: topk_idx = None, expected [num_tokens, num_topk] "
                                  "expert ids when no handle is given")
        W = self.num_ranks
        E = num_experts
        if not isinstance(E, int) or E <= 0 or E % W:
            raise _epx.InputError(f"num_experts = {E!r}, expected a positive multiple of the "
                                  f"group's size {W}")
        a = _check_count("expert_alignment", 1 if expert_alignment is None else expert_alignment,
                         1)
        max_tokens = (self.num_max_tokens_per_rank if num_max_tokens_per_rank is None
                      else num_max_tokens_per_rank)
        _check_count("num_max_tokens_per_rank", max_tokens, 1, _epx.MAX_TOKENS_PER_RANK,
                     " (the constructor's or the call's)")
        if n > max_tokens:
            raise _epx.InputError(f"x.shape[0] = {n}, expected at most num_max_tokens_per_rank "
                                  f"= {max_tokens}")
        _check_count("num_sms", num_sms, 0)
        _check_count("num_qps", num_qps, 0)
        dev = rows.device
        T.check("topk_idx", topk_idx, dtypes=(torch.int64, torch.int32), shape=(n, None),
                device=dev)
        K, L = topk_idx.shape[1], E // W
        if topk_weights is not None:
            T.check("topk_weights", topk_weights, dtype=torch.float32, shape=(n, K), device=dev)
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            T.check("cumulative_local_expert_recv_stats", stats, dtype=torch.int32, shape=(L,),
                    device=dev, what="the local experts' counts")
        sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        self._begin(previous_event, previous_event_before_epilogue, allocate_on_comm_stream)

        key = _Key(hidden, E, K, scales is not None, max_tokens)
        obj = self._object(key)
        weights = topk_weights if topk_weights is not None else \
            torch.zeros((n, K), dtype=torch.float32, device=dev)
        out = obj.a2a.dispatch(rows, topk_idx, weights, scales)
        if route is None:
            self._layouts += 1
        obj.layout = self._layouts if route is None else route.layout
        if stats is not None:
            stats += out.expert_counts

        cap = obj.a2a.config.capacity
        aligned = None  # the aligned counts read on the host (with the host read)
        if handle is not None:
            m = route.rows
        elif sync:  # the host reads the row count and the counts
            m = int(out.recv_count.item())
            aligned = ((out.expert_counts + a - 1) // a * a).tolist()
        else:
            m = cap
        valid = torch.arange(m, device=dev) < out.recv_count
        ids = out.recv_topk_ids[:m].long()
        r = self.rank_idx
        local = (ids >= r * L) & (ids < (r + 1) * L) & valid[:, None]
        local_ids = torch.where(local, ids - r * L, -1)
        expand = None if route is None else route.expand
        if do_expand and expand is None:
            rows = sum(aligned) if sync else _worst_expanded(W, max_tokens, K, L, a)
            expand = expand_layout(local_ids, local, L, a, rows)
        recv_topk_weights = None
        if topk_weights is not None:
            recv_topk_weights = torch.where(valid[:, None], out.recv_topk_weights[:m], 0.0)
        tma = use_tma_aligned_col_major_sf
        if expand is None:
            recv_x = copy_epilogue(out.recv_x[:m])
            if scales is not None:
                recv_x = (recv_x, self._scales_out(out.recv_scales[:m], tma))
            recv_topk_idx = local_ids.to(topk_idx.dtype)
        else:  # one row per (token, local slot), gathered from epx's rows
            recv_x = gather_rows(out.recv_x, expand, K, do_zero_padding)
            if scales is not None:  # a gathered copy already: column-major takes another
                gathered = gather_rows(out.recv_scales, expand, K, do_zero_padding)
                recv_x = (recv_x, self._scales_out(gathered, True) if tma else gathered)
            recv_topk_idx = None
            if recv_topk_weights is not None:
                recv_topk_weights = gather_weights(recv_topk_weights, expand)
        if handle is None:
            handle = self._new_handle(out, key, obj, topk_idx, m, valid, local, a, aligned,
                                      expand, num_sms, do_handle_copy)
        event = event_after(async_with_compute_stream,
                            (rows, scales, topk_idx, topk_weights, recv_topk_idx,
                             recv_topk_weights))
        return recv_x, recv_topk_idx, recv_topk_weights, handle, event

    @staticmethod
    def _scales_out(scales, tma_aligned: bool):
        """A copy of [M, G] f32 scales: row-major, or column-major with each column padded to 16
        bytes (DeepEP's TMA-aligned layout; strides (1, align(M, 4)))."""
        if not tma_aligned:
            return copy_epilogue(scales)
        torch = T.torch()
        m, groups = scales.shape
        columns = torch.empty((groups, _align(m, _SF_ALIGNMENT)), dtype=torch.float32,
                              device=scales.device)
        out = columns[:, :m].T
        out.copy_(scales)
        return out

    def _new_handle(self, out, key: _Key, obj: _Object, topk_idx, m: int, valid, local,
                    alignment: int, aligned: Optional[list], expand: Optional[ExpandLayout],
                    num_sms: int, do_handle_copy: bool) -> EPHandle:
        torch = T.torch()
        W, K, T_ = self.num_ranks, key.topk, key.max_tokens_per_rank
        L, dev = key.num_experts // W, valid.device
        src_rank = out.recv_src_rank[:m].long()
        meta = torch.full((m, K + 2), -1, dtype=torch.int32, device=dev)
        meta[:, 0] = torch.where(valid, src_rank * T_ + out.recv_src_idx[:m].long(), -1)
        slots = torch.arange(K, device=dev)
        highest = torch.where(local, slots, -1).amax(dim=1)
        meta[:, 1] = torch.where(valid, src_rank * K + highest, -1)
        counts = out.expert_counts.clone()
        if expand is None:
            psum = ((counts + alignment - 1) // alignment * alignment).cumsum(0)
            expanded = sum(aligned) if aligned is not None else \
                _worst_expanded(W, T_, K, L, alignment)
        else:
            meta[:, 2:] = expand.dest
            psum, expanded = expand_psum(expand), expand.rows
        handle = EPHandle(
            expand is not None, key.num_experts, alignment, T_,
            num_sms or self.get_theoretical_num_sms(key.num_experts, K),
            topk_idx.clone() if do_handle_copy else topk_idx, m, expanded,
            [] if aligned is None else aligned,
            rows_per_source_psum(out.recv_src_rank[:m], valid, W), psum.to(torch.int32),
            counts, meta, self._dst_slots(topk_idx, key.num_experts, T_))
        handle._route = _Route(self, key, obj, obj.layout, topk_idx.shape[0], m, local, expand)
        return handle

    def _dst_slots(self, topk_idx, num_experts: int, max_tokens: int):
        """dst_buffer_slot_idx [N, K] int32 (see the module docstring)."""
        torch = T.torch()
        W, (n, K) = self.num_ranks, topk_idx.shape
        ids = topk_idx.long()
        valid = (ids >= 0) & (ids < num_experts)
        dest = torch.where(valid, ids // (num_experts // W), W)  # W: nowhere
        slots = torch.arange(K, device=ids.device)
        later_same = (dest[:, :, None] == dest[:, None, :]) & (slots[None, :] > slots[:, None])
        highest = valid & ~later_same.any(dim=2)
        in_rank = dispatch_layout(topk_idx, num_experts, W)[2].long()
        before = torch.cat([in_rank.cumsum(0) - in_rank,
                            torch.zeros((n, 1), dtype=torch.long, device=ids.device)], dim=1)
        place = before.gather(1, dest)
        return torch.where(highest, self.rank_idx * max_tokens + place, -1).to(torch.int32)

    # ---- combine -------------------------------------------------------------------------------

    def combine(self, x, handle: EPHandle, topk_weights=None, bias=None, num_sms: int = 0,
                num_qps: int = 0, previous_event=None, previous_event_before_epilogue=None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        """Sums, at each token's rank, the rows the ranks that got it give back: returns
        (combined_x [N, H] bf16, combined_topk_weights [N, K] float32 or None, event) as
        DeepEP's combine (the module docstring gives the order of the sum). x: [rows, H] bf16,
        row-aligned with the handle's dispatch; topk_weights: [rows, K] float32 likewise; bias:
        None, an [N, H] bf16 tensor or a pair of them. Collective: every rank calls it."""
        self._check_live("combine")
        torch = T.torch()
        h = self._handle_of(handle, "combine")
        route = h._route
        key, expand = route.key, route.expand
        rows = route.rows if expand is None else expand.rows
        what = "the handle's received rows" if expand is None else "the handle's expanded rows"
        T.check("x", x, dtype=torch.bfloat16, shape=(rows, key.hidden), what=what)
        if topk_weights is not None:
            T.check("topk_weights", topk_weights, dtype=torch.float32,
                    shape=(rows,) if expand is not None else (rows, key.topk), what=what)
        check_bias(bias, route.num_tokens, key.hidden)
        _check_count("num_sms", num_sms, 0)
        _check_count("num_qps", num_qps, 0)
        self._begin(previous_event, previous_event_before_epilogue, allocate_on_comm_stream)
        obj = route.obj
        if obj.layout != route.layout:  # the object has dispatched another routing since
            zeros, scales = zero_rows(route.num_tokens, key.hidden, key.fp8, x.device)
            weights = torch.zeros(h.topk_idx.shape, dtype=torch.float32, device=x.device)
            obj.a2a.dispatch(zeros, h.topk_idx, weights, scales)
            obj.layout = route.layout
        if expand is not None:
            combined, combined_w = combine_expanded(obj.a2a, x, expand, topk_weights, bias,
                                                    self.allow_multiple_reduction)
        else:  # each slot's weight comes back from the rank that holds its expert alone
            owned = None if topk_weights is None else torch.where(route.local, topk_weights, 0.0)
            combined, combined_w = combine_rows(obj.a2a, x, owned, bias)
        event = event_after(async_with_compute_stream, (x, topk_weights, combined, combined_w))
        return combined, combined_w, event


def _refusal(name: str, why: str):
    def refused(*args, **kwargs):
        raise _unsupported(f"ElasticBuffer.{name}", why)

    refused.__name__ = name
    refused.__doc__ = f"Not provided: {why}."
    return staticmethod(refused)


for _name, _why in (
    ("get_engram_storage_size_hint", "Engram storage is not part of epx"),
    ("engram_write", "Engram storage is not part of epx"),
    ("engram_fetch", "Engram storage is not part of epx"),
    ("get_pp_buffer_size_hint", "pipeline-parallel send/recv is not part of epx"),
    ("pp_set_config", "pipeline-parallel send/recv is not part of epx"),
    ("pp_send", "pipeline-parallel send/recv is not part of epx"),
    ("pp_recv", "pipeline-parallel send/recv is not part of epx"),
    ("get_agrs_num_max_session_bytes", "all-gather/reduce-scatter sessions are not part of epx"),
    ("get_agrs_buffer_size_hint", "all-gather/reduce-scatter sessions are not part of epx"),
    ("agrs_set_config", "all-gather/reduce-scatter sessions are not part of epx"),
    ("create_agrs_session", "all-gather/reduce-scatter sessions are not part of epx"),
    ("destroy_agrs_session", "all-gather/reduce-scatter sessions are not part of epx"),
    ("agrs_new_session", "all-gather/reduce-scatter sessions are not part of epx"),
    ("agrs_get_inplace_tensor", "all-gather/reduce-scatter sessions are not part of epx"),
    ("all_gather", "all-gather/reduce-scatter sessions are not part of epx"),
):
    setattr(ElasticBuffer, _name, _refusal(_name, _why))
del _name, _why
