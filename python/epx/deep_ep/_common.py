"""What the modes of epx.deep_ep share: how a missing feature is refused, DeepEP's event
wrappers, the hook that runs a call's receive half, and the pieces of the two modes over
``high_throughput`` (the normal mode of Buffer, ElasticBuffer): their world, objects, inputs and
combine."""

from __future__ import annotations

from typing import Callable, Optional

from .. import _epx
from .. import _torch as T


def _unsupported(what: str, why: str):
    return NotImplementedError(f"epx.deep_ep: {what} is not provided: {why}")


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


# ---- hooks --------------------------------------------------------------------------------------


class _Hook:
    """The receive half of a call, run once (later calls do nothing), as DeepEP's hooks."""

    def __init__(self, recv: Callable[[], None]):
        self._recv: Optional[Callable[[], None]] = recv

    def __call__(self) -> None:
        recv, self._recv = self._recv, None
        if recv is not None:
            recv()


# ---- the modes over high_throughput -------------------------------------------------------------

HT_BACKEND = "high_throughput"


class RoutedObject:
    """One epx All2All of a shape, and which routing its last dispatch carried (a number the
    mode gives each routing it dispatches, the same on every rank)."""

    def __init__(self, a2a):
        self.a2a = a2a
        self.layout: Optional[int] = None


def nodes_of(group_size: int) -> int:
    """The ranks of each node for a group of `group_size` ranks spread over several nodes, from
    the launcher's LOCAL_WORLD_SIZE (torchrun's; ranks on the nodes in blocks), else 0: one
    node."""
    import os

    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    local = int(env) if env.isdigit() else 0
    if 0 < local < group_size and group_size % local == 0:
        return local
    return 0


def make_world(group, comm=None):
    """This process's world over a torch.distributed group or an mpi4py communicator
    (collective: the handshake): an IpcWorld on one node; across nodes (LOCAL_WORLD_SIZE
    smaller than the group) an NcclWorld, whose backends run on NCCL's collectives."""
    torch = T.torch()
    device = torch.cuda.current_device()
    if group is not None:
        from ..world import ipc_world_from_torch, nccl_world_from_torch

        local = nodes_of(group.size())
        if local:
            return nccl_world_from_torch(group, device, local_world_size=local)
        return ipc_world_from_torch(group, device)
    from ..world import IpcWorld

    def all_gather(data: bytes) -> list:
        return [bytes(b) for b in comm.allgather(bytes(data))]

    return IpcWorld.from_all_gather(comm.Get_rank(), comm.Get_size(), all_gather, device, "auto")


def ht_config(*, world_size: int, rank: int, hidden: int, num_experts: int, topk: int,
              fp8: bool, max_tokens_per_rank: int, **fields):
    """The EpConfig of one high_throughput object of the modes: token-major rows ordered by
    (source rank, source index), receive areas for the worst case, one round in flight; `fields`
    adds to it (combine_order, timeout_ms). EPX_TIMEOUT_MS wins over a timeout given here."""
    from ..config import ep_config, with_env_timeout

    cfg = ep_config(world_size=world_size, rank=rank, hidden=hidden, num_experts=num_experts,
                    topk=topk, max_tokens_per_rank=max_tokens_per_rank,
                    dtype="fp8" if fp8 else "bf16", layout="token", deterministic=True,
                    worst_case_output=True, rounds_in_flight=1, **fields)
    return with_env_timeout(cfg)


def split_x(x):
    """(rows, row-major f32 scales or None) of DeepEP's x: bf16 [N, H], or a tuple
    (float8_e4m3fn [N, H], float32 [N, H/128] of any strides)."""
    torch = T.torch()
    if not isinstance(x, tuple):
        T.check("x", x, dtype=torch.bfloat16, shape=(None, None))
        return x, None
    if len(x) != 2:
        raise _epx.InputError(f"x = a tuple of {len(x)}, expected (fp8 rows, scales)")
    rows, scales = x
    T.check("x[0]", rows, dtype=T.fp8_dtype(), shape=(None, None))
    n, hidden = rows.shape
    if isinstance(scales, torch.Tensor) and scales.dtype == torch.int32:
        raise _unsupported("dispatch of int32 (UE8M0) scales",
                           "epx's fp8 wire carries float32 1x128 block scales")
    G = hidden // _epx.FP8_BLOCK_SIZE
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or \
            tuple(scales.shape) != (n, G) or hidden % _epx.FP8_BLOCK_SIZE != 0:
        got = (f"{scales.dtype} {list(scales.shape)}" if isinstance(scales, torch.Tensor)
               else type(scales).__name__)
        raise _epx.InputError(f"x[1] = {got}, expected float32 [{n}, {hidden} / "
                              f"{_epx.FP8_BLOCK_SIZE}] (1x128 block scales)")
    return rows, scales.contiguous()


def rows_of(t, rows: int, fill=None):
    """A new tensor of `rows` rows holding t's first min(rows, len(t)) rows; the rest `fill`
    (uninitialised when None)."""
    torch = T.torch()
    take = min(rows, t.shape[0])
    shape = (rows,) + tuple(t.shape[1:])
    out = (torch.empty(shape, dtype=t.dtype, device=t.device) if fill is None
           else torch.full(shape, fill, dtype=t.dtype, device=t.device))
    out[:take].copy_(t[:take])
    return out


def zero_rows(n: int, hidden: int, fp8: bool, device):
    """(rows, scales or None): n zero rows of a wire (fp8: unit scales), to send a routing
    again without its data."""
    torch = T.torch()
    if not fp8:
        return torch.zeros((n, hidden), dtype=torch.bfloat16, device=device), None
    return (torch.zeros((n, hidden), dtype=T.fp8_dtype(), device=device),
            torch.ones((n, hidden // _epx.FP8_BLOCK_SIZE), dtype=torch.float32, device=device))


def rows_per_source_psum(src_rank, valid, world_size: int):
    """[W] int32: entry i = the valid rows that came from ranks 0..i (no host read)."""
    torch = T.torch()
    ranks = torch.arange(world_size, device=src_rank.device)
    per_rank = ((src_rank[:, None] == ranks) & valid[:, None]).sum(0)
    return per_rank.cumsum(0).to(torch.int32)


def check_bias(bias, num_tokens: int, hidden: int) -> None:
    """DeepEP's combine bias: None, one [N, H] bf16 tensor or a pair (either may be None)."""
    torch = T.torch()
    biases = list(bias) if isinstance(bias, (tuple, list)) else [bias]
    if len(biases) > 2:
        raise _epx.InputError(f"combine: bias = {len(biases)} tensors, expected at most 2")
    for i, b in enumerate(biases):
        if b is not None:
            T.check(f"bias[{i}]", b, dtype=torch.bfloat16, shape=(num_tokens, hidden),
                    what="the handle's tokens")


def copy_epilogue(src, index=None, zero=None):
    """A fresh copy of rows of `src` ([R, ...], each row contiguous): all R, or row index[i]
    (int64 [N]) for row i, with zeros where `zero` ([N] bool) is set. On the GPU it is epx's
    copy epilogue (one kernel on the current stream, no host synchronisation): the copy that lets
    a dispatch's results outlive the object's next round, as DeepEP's own epilogue does."""
    torch = T.torch()
    dense_rows = src.dim() == 1 or src[:1].is_contiguous() or src.shape[0] == 0
    if src.device.type != "cuda" or not dense_rows:
        got = src.clone() if index is None else src.index_select(0, index)
        if zero is not None:
            got[zero] = 0
        return got
    rows = src.shape[0] if index is None else index.shape[0]
    out = torch.empty((rows, *src.shape[1:]), dtype=src.dtype, device=src.device)
    row = src.shape[1:].numel()
    if rows and row:
        es = src.element_size()
        index = None if index is None else index.to(torch.int64).contiguous()
        zero = None if zero is None else zero.to(torch.bool).contiguous()
        stream = torch.cuda.current_stream(src.device).cuda_stream
        _epx.copy_rows(out.data_ptr(), out.stride(0) * es, src.data_ptr(), src.stride(0) * es,
                       row * es, rows, 0 if index is None else index.data_ptr(),
                       0 if zero is None else zero.data_ptr(), stream)
    return out


def combine_rows(a2a, x, topk_weights=None, bias=None):
    """epx's combine of `a2a`'s last round from x [rows, H] bf16 (row-aligned with its
    received rows, rows <= capacity), with topk_weights [rows, K] float32 summed back per token
    and bias rows starting the sum: (combined [N, H] bf16, weights [N, K] float32 or None)."""
    torch = T.torch()
    buf = a2a.combine_buffer()
    take = min(x.shape[0], buf.shape[0])
    buf[:take].copy_(x[:take])
    weights = None
    if topk_weights is not None:  # row-aligned with the whole receive area
        weights = torch.zeros((buf.shape[0], topk_weights.shape[1]), dtype=torch.float32,
                              device=buf.device)
        weights[:take].copy_(topk_weights[:take])
    return a2a.combine_with(buf, topk_weights=weights, bias=bias)


def event_after(async_finish: bool, tensors) -> EventOverlap:
    """An EventOverlap of an event recorded now, keeping `tensors` alive, when async_finish;
    otherwise one without an event."""
    if not async_finish:
        return EventOverlap()
    return EventOverlap(EventHandle(), tuple(t for t in tensors if t is not None))
