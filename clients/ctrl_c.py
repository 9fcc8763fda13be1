"""Ctrl-C while a stream runs cancels its call, rather than raising inside grpc.

Python raises KeyboardInterrupt wherever the main thread happens to be. Inside
grpc's `threading.Condition.wait` it can land after the lock was released and
before the code that takes it back; the `with` around the wait then releases a
lock it no longer holds, and the interrupt surfaces as "RuntimeError: cannot
release un-acquired lock" with a traceback instead of a clean cancel. So while
a stream runs, SIGINT only marks the press and wakes a thread of the stream's
own that cancels the call; the stream's next event is then CANCELLED, and the
command reports the Ctrl-C it was.

The handler takes no lock (a lock the interrupted code holds would deadlock
it): it writes a byte to a pipe, which the cancelling thread waits on.

    with CtrlCCancels() as ctrl_c:
        stream = ctrl_c.watch(client.generate(...))
        ...
        if ctrl_c.pressed: ...  # cancelled by the user, whatever the stream raised
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any, Protocol

_CANCEL, _DONE = b"c", b"d"


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class CtrlCCancels:
    """Within the block, SIGINT cancels the watched stream (a second press changes nothing
    more); before a stream is watched it interrupts as usual. Only the main thread can own
    signals; elsewhere the block changes nothing."""

    def __init__(self) -> None:
        self.pressed = False
        self._watching = False
        self._wake: int | None = None   # the pipe's write end: the cancelling thread reads the other
        self._previous: Any = None
        self._installed = False

    def watch(self, stream: Cancellable) -> Any:
        if self._installed and self._wake is None:
            read_end, self._wake = os.pipe()
            threading.Thread(target=_cancel_when_told, args=(read_end, stream), name="ctrl-c-cancel",
                             daemon=True).start()
        self._watching = True
        return stream

    def __enter__(self) -> CtrlCCancels:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False
        if self._wake is not None:
            os.write(self._wake, _DONE)   # the thread ends, after a cancel written before it
            os.close(self._wake)
            self._wake = None

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if not self._watching:
            raise KeyboardInterrupt   # nothing in grpc's hands yet
        if not self.pressed:
            self.pressed = True
            if self._wake is not None:
                os.write(self._wake, _CANCEL)


def _cancel_when_told(read_end: int, stream: Cancellable) -> None:
    """Until the block ends (_DONE, or the write end closed): a press cancels the stream."""
    try:
        while os.read(read_end, 1) == _CANCEL:
            stream.cancel()
    finally:
        os.close(read_end)
