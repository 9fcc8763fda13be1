"""EventRelay: engine events reach each call's queue in order, one loop wake-up per flush."""

from __future__ import annotations

import asyncio
import threading

from kvserve.model_service.event_relay import EventRelay


class RecordingLoop:
    """Stands in for the loop: keeps what call_soon_threadsafe was asked to run."""

    def __init__(self) -> None:
        self.scheduled: list = []

    def call_soon_threadsafe(self, callback) -> None:
        self.scheduled.append(callback)

    def run_scheduled(self) -> None:
        callbacks, self.scheduled = self.scheduled, []
        for callback in callbacks:
            callback()


def drain_queue(q: asyncio.Queue) -> list:
    return [q.get_nowait() for _ in range(q.qsize())]


def test_a_flush_schedules_one_drain_that_delivers_everything_in_order() -> None:
    loop = RecordingLoop()
    relay = EventRelay(loop)
    a, b = asyncio.Queue(), asyncio.Queue()
    post_a, post_b = relay.sink(a), relay.sink(b)
    relay.flush()                       # nothing posted: no wake-up
    for i in range(5):
        post_a(("a", i))
        post_b(("b", i))
    assert loop.scheduled == []         # posting alone never wakes the loop
    relay.flush()
    relay.flush()                       # a drain is already on its way
    assert len(loop.scheduled) == 1 and a.empty()
    loop.run_scheduled()
    assert drain_queue(a) == [("a", i) for i in range(5)]
    assert drain_queue(b) == [("b", i) for i in range(5)]
    post_b("next")                      # after a drain, the next flush schedules again
    relay.flush()
    assert len(loop.scheduled) == 1
    loop.run_scheduled()
    assert drain_queue(b) == ["next"]


def test_a_flush_after_the_loop_closed_is_quiet() -> None:
    loop = asyncio.new_event_loop()
    relay = EventRelay(loop)
    relay.sink(asyncio.Queue())("late")
    loop.close()
    relay.flush()   # the engine thread must not die at shutdown


def test_events_from_the_engine_thread_arrive_on_the_loop_in_order() -> None:
    async def main() -> dict[int, list[int]]:
        relay = EventRelay(asyncio.get_running_loop())
        queues = {k: asyncio.Queue() for k in range(4)}
        sinks = {k: relay.sink(q) for k, q in queues.items()}

        def engine() -> None:
            for i in range(500):
                for k in range(4):
                    sinks[k](i)
                if i % 7 == 0:
                    relay.flush()
            relay.flush()

        thread = threading.Thread(target=engine)
        thread.start()
        got = {k: [await q.get() for _ in range(500)] for k, q in queues.items()}
        thread.join()
        return got

    got = asyncio.run(main())
    assert all(values == list(range(500)) for values in got.values())
