"""CtrlCCancels: SIGINT while a stream runs cancels the call and raises nothing in the main thread."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvserve.clients.ctrl_c import CtrlCCancels


class FakeStream:
    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.cancel_thread: str | None = None

    def cancel(self) -> None:
        self.cancel_thread = threading.current_thread().name
        self.cancelled.set()


def _press() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs at the next bytecode boundary of the main thread


def test_sigint_cancels_the_watched_stream_from_another_thread() -> None:
    before = signal.getsignal(signal.SIGINT)
    stream = FakeStream()
    with CtrlCCancels() as ctrl_c:
        ctrl_c.watch(stream)
        _press()  # no KeyboardInterrupt here
        assert stream.cancelled.wait(5)
        assert ctrl_c.pressed
    assert stream.cancel_thread == "ctrl-c-cancel"
    assert signal.getsignal(signal.SIGINT) is before


def test_sigint_before_a_stream_interrupts_as_usual_and_a_second_press_changes_nothing() -> None:
    with CtrlCCancels() as ctrl_c, pytest.raises(KeyboardInterrupt):
        _press()
    assert not ctrl_c.pressed
    stream = FakeStream()
    with CtrlCCancels() as ctrl_c:
        ctrl_c.watch(stream)
        _press()
        _press()   # raised, it could land inside grpc's wait as the first one would have
        assert stream.cancelled.wait(5) and ctrl_c.pressed
        with pytest.raises(RuntimeError, match="one stream"):
            ctrl_c.watch(FakeStream())


def test_a_press_well_after_the_first_interrupts_as_usual(monkeypatch) -> None:
    """The stream cancelled but the command still held (its output blocked on a pager that does
    not read): pressing again gets out, as Ctrl-C always did."""
    from kvserve.clients import ctrl_c as module

    monkeypatch.setattr(module, "INSIST_AFTER_S", 0.1)
    stream = FakeStream()
    with pytest.raises(KeyboardInterrupt), CtrlCCancels() as ctrl_c:
        ctrl_c.watch(stream)
        _press()
        assert stream.cancelled.wait(5)
        time.sleep(0.2)
        _press()


def test_a_stream_left_unpressed_is_not_cancelled_and_its_thread_ends() -> None:
    stream = FakeStream()
    before = {t.ident for t in threading.enumerate()}
    with CtrlCCancels() as ctrl_c:
        ctrl_c.watch(stream)
    deadline = time.monotonic() + 5
    while any(t.name == "ctrl-c-cancel" and t.ident not in before for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the cancelling thread outlived its block"
        time.sleep(0.01)
    assert not stream.cancelled.is_set()


def test_outside_the_main_thread_signals_are_left_alone() -> None:
    before = signal.getsignal(signal.SIGINT)
    seen: list[object] = []

    def body() -> None:
        with CtrlCCancels():
            seen.append(signal.getsignal(signal.SIGINT))

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert seen == [before]
