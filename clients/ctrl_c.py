"""Ctrl-C while a stream runs cancels its call, rather than raising inside grpc.

Python raises KeyboardInterrupt wherever the main thread happens to be. Inside
grpc's `threading.Condition.wait` it can land after the lock was released and
before the code that takes it back; the `with` around the wait then releases a
lock it no longer holds, and the interrupt surfaces as "RuntimeError: cannot
release un-acquired lock" with a traceback instead of a clean cancel. So while
a stream runs, SIGINT only marks the press and cancels the call from a thread
of its own; the stream's next event is then CANCELLED, and the command reports
the Ctrl-C it was.

    with CtrlCCancels() as ctrl_c:
        stream = ctrl_c.watch(client.generate(...))
        ...
        if ctrl_c.pressed: ...  # cancelled by the user, whatever the stream raised
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Protocol


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class CtrlCCancels:
    """Within the block, the first SIGINT cancels the watched stream; before a stream is
    watched, or at a second press, SIGINT interrupts as usual. Only the main thread can
    own signals; elsewhere the block changes nothing."""

    def __init__(self) -> None:
        self.pressed = False
        self._stream: Cancellable | None = None
        self._previous: Any = None
        self._installed = False

    def watch(self, stream: Cancellable) -> Any:
        self._stream = stream
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

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        stream = self._stream
        if stream is None or self.pressed:
            raise KeyboardInterrupt
        self.pressed = True
        # Not cancelled here: the handler may run while this very thread holds the call's lock.
        threading.Thread(target=stream.cancel, name="ctrl-c-cancel", daemon=True).start()
