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
import time
from types import FrameType
from typing import Any, Protocol

_CANCEL, _DONE = b"c", b"d"


class Cancellable(Protocol):
    def cancel(self) -> None: ...


# A second press this long after the first, the stream still not ended (its output blocked on a
# pager that does not read, say), interrupts as Ctrl-C always did.
INSIST_AFTER_S = 1.0


class CtrlCCancels:
    """Within the block, SIGINT cancels the watched stream; before a stream is watched, or
    pressed again INSIST_AFTER_S later, it interrupts as usual. Only the main thread can own
    signals; elsewhere the block changes nothing. One stream a block."""

    def __init__(self) -> None:
        self.pressed = False
        self._pressed_at = 0.0
        self._watching = False
        self._wake: int | None = None   # the pipe's write end: the cancelling thread reads the other
        self._previous: Any = None
        self._installed = False

    def watch(self, stream: Cancellable) -> Any:
        if self._watching:
            raise RuntimeError("CtrlCCancels watches one stream")
        self._watching = True   # from here a press is marked, never raised
        if self._installed:
            read_end, wake = os.pipe()
            try:
                threading.Thread(target=_cancel_when_told, args=(read_end, stream), name="ctrl-c-cancel",
                                 daemon=True).start()
            except BaseException:
                os.close(read_end)
                os.close(wake)
                raise
            self._wake = wake
            if self.pressed:   # pressed before the pipe was there
                os.write(wake, _CANCEL)
        return stream

    def __enter__(self) -> CtrlCCancels:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        # The pipe first, while a press still only marks: restored, the old handler could raise
        # between two lines here, leaving the thread and the pipe for good.
        wake, self._wake = self._wake, None
        try:
            if wake is not None:
                try:
                    os.write(wake, _DONE)   # the thread ends, after a cancel written before it
                finally:
                    os.close(wake)
        finally:
            if self._installed:
                signal.signal(signal.SIGINT, self._previous)
                self._installed = False

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if not self._watching:
            raise KeyboardInterrupt   # nothing in grpc's hands yet
        if not self.pressed:
            self.pressed, self._pressed_at = True, time.monotonic()
            wake = self._wake
            if wake is not None:
                os.write(wake, _CANCEL)
        elif time.monotonic() - self._pressed_at > INSIST_AFTER_S:
            raise KeyboardInterrupt   # the user insists: whatever holds the stream did not let go


def _cancel_when_told(read_end: int, stream: Cancellable) -> None:
    """Until the block ends (_DONE, or the write end closed): a press cancels the stream."""
    try:
        while os.read(read_end, 1) == _CANCEL:
            stream.cancel()
    finally:
        os.close(read_end)
