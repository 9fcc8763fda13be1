"""ManagerLink's bookkeeping with a clock of the test's own: when a loss dates from."""

from __future__ import annotations

from kvserve.model_service.engine.manager_link import ManagerLink


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class QuietKV:
    address = "kv"

    def interrupt(self) -> None:
        pass


def test_a_watchdog_giving_up_as_the_answer_came_leaves_no_loss_behind():
    """The watchdog ended a wait just as its answer came: the next loss, much later, was dated
    back to that wait and so declared long at once."""
    clock = Clock()
    link = ManagerLink(QuietKV(), page_size=4, num_pages=8, timeout_s=5.0, clock=clock)

    def answered_late():
        clock.now += 6.0   # past the timeout: the watchdog gives up on this wait ...
        assert link.interrupt_if_overdue()
        return "plan"      # ... as the answer arrives
    assert link.wait_for_plan(answered_late) == "plan"
    clock.now += 600.0
    link.lose()   # a loss of its own, later
    assert link.lost_since == clock.now and not link.loss_is_long()


class WatchdogAtLock:
    """The link's lock, with the watchdog run just before its `at`-th acquisition once the answer
    is in: there the watchdog would give up on the wait between two of the engine thread's steps."""

    def __init__(self, link: ManagerLink, at: int) -> None:
        self.link, self.at, self.count, self.inner = link, at, 0, link._lock
        self.answered = self.fired = False

    def __enter__(self):
        if self.answered:
            self.count += 1
            if self.count == self.at:
                self.fired = self.link.interrupt_if_overdue()
        return self.inner.__enter__()

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


def test_no_moment_of_a_wait_answered_late_leaves_a_loss_behind():
    fired = []
    for at in (1, 2, 3):   # each acquisition of the lock after the answer came, if there are as many
        clock = Clock()
        link = ManagerLink(QuietKV(), page_size=4, num_pages=8, timeout_s=5.0, clock=clock)
        lock = link._lock = WatchdogAtLock(link, at)

        def answered_late(lock=lock, clock=clock):
            clock.now += 6.0   # past the timeout, and the answer is in
            lock.answered = True
            return "plan"
        assert link.wait_for_plan(answered_late) == "plan"
        link._lock = lock.inner
        fired.append(lock.fired)
        clock.now += 600.0
        link.lose()
        assert link.lost_since == clock.now and not link.loss_is_long(), f"the watchdog at acquisition {at}"
    assert fired[0]   # the watchdog did give up on the wait at least once


def test_a_wait_the_watchdog_ended_dates_the_loss():
    clock = Clock()
    link = ManagerLink(QuietKV(), page_size=4, num_pages=8, timeout_s=5.0, clock=clock)

    def never():
        clock.now += 6.0
        assert link.interrupt_if_overdue()
        raise ConnectionError("interrupted")
    try:
        link.wait_for_plan(never)
    except ConnectionError:
        link.lose()
    assert link.lost_since == 100.0   # when the unanswered wait began


def test_an_answer_that_comes_as_the_watchdog_ends_the_wait_waits_for_the_end():
    """The engine, its answer in, must not send its next Step on the stream the watchdog is about
    to end: that Step would be taken down with it, and the loss would be a false one."""
    import threading
    import time

    clock = Clock()
    started, ended = threading.Event(), threading.Event()

    class SlowInterrupt(QuietKV):
        def interrupt(self) -> None:
            started.set()
            time.sleep(0.2)   # the stream being ended
            ended.set()

    link = ManagerLink(SlowInterrupt(), page_size=4, num_pages=8, timeout_s=5.0, clock=clock)

    def answered_as_the_watchdog_acts():
        clock.now += 6.0
        threading.Thread(target=link.interrupt_if_overdue, daemon=True).start()
        assert started.wait(10)
        return "plan"   # here as the interrupt runs
    assert link.wait_for_plan(answered_as_the_watchdog_acts) == "plan"
    assert ended.is_set()   # the next Step goes on a stream opened after it


def test_a_fresh_process_registers_past_its_predecessors_epoch_even_after_the_clock_stepped_back():
    """Epochs are wall-clock times: a model service restarted after the clock stepped back
    registered an older epoch than its predecessor's, which the manager refuses, again at every
    restart until the clock caught up."""
    import time
    from types import SimpleNamespace

    from kvserve.kvcache_service.contract.errors import ManagerUnavailable

    class KV(QuietKV):
        def __init__(self, live):
            self.live, self.registered = live, []

        def stats(self, timeout_s=None):
            if self.live is None:
                raise ManagerUnavailable("no manager yet")
            return SimpleNamespace(epoch=self.live)

        def register(self, epoch, *args, **kwargs):
            self.registered.append(epoch)

    ahead = time.time_ns() + 3_600 * 10**9   # the predecessor's, an hour past this clock
    kv = KV(ahead)
    link = ManagerLink(kv, page_size=4, num_pages=8, timeout_s=5.0)
    link.register()
    assert kv.registered == [ahead + 1] and link.epoch == ahead + 1
    link.register()   # again (a reconnect): newer than its own
    assert kv.registered[-1] > ahead + 1
    first = KV(None)   # nothing answers yet (a stack starting): the clock's
    before = time.time_ns()
    ManagerLink(first, page_size=4, num_pages=8, timeout_s=5.0).register()
    assert first.registered[0] >= before
