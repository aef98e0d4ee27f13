"""epx.deep_ep.Buffer: DeepEP's Buffer, made of one mixin per mode (_low_latency.py with
_shrink.py, _normal.py) and what is common to them here: the constructor and its world,
DeepEP's statics and the runtime calls besides the two ops (destroy, the stream, the raw
buffer). DeepEP V2's ElasticBuffer is _elastic.py's."""

from __future__ import annotations

from typing import List, Optional

from .. import _epx
from .. import _torch as T
from ..all2all import All2All
from ._common import EventHandle, EventOverlap, _unsupported, make_world
from ._low_latency import _LowLatencyMode
from ._normal import _NormalMode
from ._shrink import _ShrinkMode


class Buffer(_LowLatencyMode, _ShrinkMode, _NormalMode):
    """DeepEP's Buffer over epx: the low-latency mode (_low_latency.py) and the normal mode
    (_normal.py; see epx.deep_ep's docstring).

    Attributes as DeepEP's: rank, group_size, group, num_nvl_bytes, num_rdma_bytes,
    low_latency_mode, explicitly_destroy, enable_shrink; and num_sms (class attribute, recorded
    in the normal mode's default Config); epx's own: max_tokens_per_rank (normal mode).
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
                 rounds_in_flight: int = 2,
                 max_tokens_per_rank: Optional[int] = None) -> None:
        """DeepEP's arguments, same names and defaults. `num_nvl_bytes`, `num_rdma_bytes` and
        `num_qps_per_rank` are recorded and not used: epx allocates per shape, on the first
        dispatch of that shape. `allow_mnnvl` changes nothing (one node). epx's own, keyword
        only: `rounds_in_flight` (1 or 2): epx objects per shape, used in turn; 2 (DeepEP's two
        buffers) lets a dispatch follow a dispatch before the first one's combine, 1 halves the
        memory. `max_tokens_per_rank` (normal mode): the most tokens one rank dispatches in one
        call; epx holds world_size x that many received rows per normal-mode shape (default
        EPX_DEEP_EP_MAX_TOKENS, else 4096). Collective over the group (the IpcWorld's handshake,
        made when num_nvl_bytes > 0 or low_latency_mode).

        `enable_shrink`: every epx object masks a rank whose wait outlives EPX_TIMEOUT_MS
        instead of failing (see epx.deep_ep._shrink); make each shape with
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
        self._world = None
        self._destroyed = False
        if low_latency_mode or num_nvl_bytes > 0:
            self._world = self._make_world(group, comm)
        self._init_low_latency()
        self._init_normal(max_tokens_per_rank)

    @staticmethod
    def _make_world(group, comm):
        return make_world(group, comm)

    # ---- DeepEP's static helpers -----------------------------------------------------------------

    @staticmethod
    def is_sm90_compiled() -> bool:
        return bool(_epx.has_cuda)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Recorded as DeepEP does; the normal mode's default Config carries it (epx does
        not read it)."""
        if new_num_sms % 2 != 0:
            raise _epx.InputError(f"new_num_sms = {new_num_sms}, expected an even number")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded now on torch's current stream."""
        return EventOverlap(EventHandle())

    # ---- what DeepEP's runtime offers besides the two ops ----------------------------------------

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
        self._forget_low_latency_objects()
        self._forget_normal_objects()
        self._world = None
        self._destroyed = True

    def _objects(self) -> List[All2All]:
        """Every epx object of this Buffer, in the order they were made."""
        return self._low_latency_objects() + self._normal_objects()

    def __repr__(self) -> str:
        return (f"epx.deep_ep.Buffer(rank={self.rank}, group_size={self.group_size}, "
                f"low_latency_mode={self.low_latency_mode}, shapes={len(self._shapes)})")
