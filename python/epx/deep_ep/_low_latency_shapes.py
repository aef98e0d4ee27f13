"""The epx objects behind the low-latency mode. Per shape (_Shape: what a dispatch's objects
depend on), a _ShapeState holds ``rounds_in_flight`` All2Alls of the expert-major layout used in
turn (one _Slot each), the carrier of combine-time router weights and the device constants the
receive half uses; in shrink mode the Buffer also has a barrier object. Every All2All of the
mode is made here."""

from __future__ import annotations

from typing import List, NamedTuple, Optional

from .. import _epx
from .. import _torch as T
from ..all2all import All2All
from ..config import EpConfig, with_env_timeout

_BACKEND = "low_latency"
# The carrier of combine-time router weights moves no payload of interest: one fp8 block.
_CARRIER_HIDDEN = _epx.FP8_BLOCK_SIZE


class _Shape(NamedTuple):
    """What a dispatch's epx objects depend on. `wire` is the All2All dtype: 'bf16' (use_fp8
    off) or 'bf16-to-fp8'; `round_scale`: the fp8 wire's scales are powers of two;
    `combine_format`: what the partials cross as in the objects' combine, 'bf16' or 'logfmt'
    (EpConfig.combine_format: an object combines in one format only)."""

    hidden: int
    num_experts: int
    max_tokens: int
    topk: int
    wire: str
    round_scale: bool = False
    combine_format: str = "bf16"


def _data_config(shape: _Shape, world_size: int, rank: int = 0,
                 shrink: bool = False) -> EpConfig:
    # Masking needs unordered rows (epx's rule): in shrink mode the Buffer orders them itself.
    return with_env_timeout(EpConfig(
        rank=rank, world_size=world_size, hidden=shape.hidden, num_experts=shape.num_experts,
        topk=shape.topk, max_tokens_per_rank=shape.max_tokens, dtype=shape.wire,
        round_scale=shape.round_scale, layout="expert", scale_layout="column",
        combine_format=shape.combine_format, deterministic=not shrink,
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
              round_scale: bool, use_logfmt: bool = False) -> _Shape:
    """The shape of a low_latency_dispatch with these arguments."""
    wire = "bf16-to-fp8" if use_fp8 else "bf16"
    return _Shape(hidden, num_experts, max_tokens, topk, wire, use_fp8 and round_scale,
                  "logfmt" if use_logfmt else "bf16")



def _make_barrier(world):
    """Shrink mode's barrier object (collective) and its dispatch of no tokens: (All2All,
    (x, topk_ids, topk_weights))."""
    barrier = All2All.create(_barrier_config(world.size), world, _BACKEND)
    torch = T.torch()
    dev = barrier.device
    return barrier, (torch.empty((0, _epx.FP8_BLOCK_SIZE), dtype=torch.bfloat16, device=dev),
                     torch.empty((0, 1), dtype=torch.int32, device=dev),
                     torch.empty((0, 1), dtype=torch.float32, device=dev))


class _Slot:
    """One of a shape's All2All objects and its last dispatch."""

    def __init__(self, a2a: All2All):
        self.a2a = a2a
        self.serial = 0  # dispatches so far: a handle names the one it came from
        self.out = None  # DispatchOutput of the last dispatch
        self.weights = None  # router weights given at that dispatch (None: unit weights)
        self.weights_version = -1
        self.topk_idx = None  # that dispatch's routing (a combine in the other format sends
        self.topk_idx_version = -1  # the round again with it)
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
        self.zero_x = None  # [max_tokens, H] bf16 zeros: the rows of a dispatch sent again
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

    def take_slot(self) -> _Slot:
        """The next object in turn; the handles of its earlier dispatch are gone."""
        slot = self.slots[self.next]
        self.next = (self.next + 1) % len(self.slots)
        return slot

    def zeros(self, n: int):
        if self.zero_x is None:
            self.zero_x = T.torch().zeros((self.shape.max_tokens, self.shape.hidden),
                                          dtype=T.torch().bfloat16, device=self.device)
        return self.zero_x[:n]

    def objects(self) -> List[All2All]:
        return [s.a2a for s in self.slots] + ([self.carrier] if self.carrier is not None else [])
