"""What the modes of epx.deep_ep share: how a missing feature is refused, DeepEP's event
wrappers, and the hook that runs a call's receive half."""

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
