"""The fleet's board: the serving workers in order of load, kept current by the workers
themselves, so that the least busy are read off it instead of found by a pass over the fleet."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.services.gateway.board import LoadBoard
from kvserve.services.gateway.worker import DOWN, NOT_SERVING, SERVING, Load, Worker


def worker(name: str, page_size: int = 16) -> Worker:
    return Worker(name, channel=None, state=SERVING, info=pb.ModelInfo(page_size=page_size, max_num_seqs=4))


def test_the_least_busy_come_first_and_equals_take_turns():
    board = LoadBoard()
    a, b, c = worker("a"), worker("b"), worker("c")
    for w in (a, b, c):
        board.add(w)
    assert list(board.least_busy()) == [a, b, c]
    mark = a.routed()                  # a is busier until its request ends
    assert list(board.least_busy()) == [b, c, a]
    a.ended(mark)                        # idle again, but it moved last: it waits its turn
    assert list(board.least_busy()) == [b, c, a]
    b.loaded(Load(running=3))
    c.loaded(Load(running=1))
    assert list(board.least_busy()) == [a, c, b]
    assert list(board.least_busy(avoid=a)) == [c, b]


def test_only_serving_workers_with_a_known_model_are_on_it():
    board = LoadBoard()
    a, b = worker("a"), worker("b", page_size=32)
    starting = Worker("s", channel=None)
    for w in (a, b, starting):
        board.add(w)
    assert set(board) == {a, b} and board.page_size == 16
    assert list(board.least_busy()) == [a, b] and board.get("b") is b and board.get("s") is None
    a.state, a.info = DOWN, None
    a.changed()
    assert a not in board and board.page_size == 32
    starting.info = pb.ModelInfo(page_size=16)
    starting.state = SERVING
    starting.changed()
    assert list(board.least_busy()) == [b, starting]
    board.remove(b)
    assert len(board) == 1 and b.on_change is None
    b.routed()                         # a removed worker no longer moves anything
    assert set(board) == {starting} and board.page_size == 16


def test_a_board_made_of_workers_does_not_follow_them():
    a = worker("a")
    board = LoadBoard([a])
    assert a.on_change is None and list(board.least_busy()) == [a]


OPS = st.lists(st.tuples(st.sampled_from(["route", "end", "report", "state"]), st.integers(0, 4),
                         st.integers(0, 6)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_the_board_always_agrees_with_a_pass_over_the_fleet(ops):
    board = LoadBoard()
    fleet = [worker(f"w{i}", page_size=16 if i < 4 else 32) for i in range(5)]
    for w in fleet:
        board.add(w)
    marks: list[list[float]] = [[] for _ in fleet]
    for op, i, n in ops:
        w = fleet[i]
        if op == "route":
            marks[i].append(w.routed())
        elif op == "end" and marks[i]:
            w.ended(marks[i].pop(0))
        elif op == "report":
            w.loaded(Load(running=n, waiting=n // 3, asked_at=float("inf")))   # it counts every routing
        elif op == "state":
            w.state = [SERVING, NOT_SERVING, DOWN][n % 3]
            w.info = None if w.state == DOWN else w.info or pb.ModelInfo(page_size=16 if i < 4 else 32)
            w.changed()
        on = [w for w in fleet if w.state == SERVING and w.info is not None]
        assert set(board) == set(on)
        listed = list(board.least_busy())
        assert set(listed) == set(on)   # every page size: a request goes to any worker that can take it
        assert [w.active for w in listed] == sorted(w.active for w in listed)
        assert board.page_size == min((w.info.page_size for w in on), default=None)


def test_a_routing_stays_the_workers_until_a_report_made_after_the_worker_took_it():
    """During a burst a worker may take a call long after it was sent: a report that does not
    count it yet must not make room for another (workers queued far past --worker-queue-depth)."""
    import time

    a = worker("a")
    mark = a.routed()
    a.loaded(Load(running=0, asked_at=time.monotonic() + 60))   # a report long after: not taken yet
    assert a.pending == 1 and a.active == 1
    mark.take()
    a.loaded(Load(running=0, asked_at=mark.taken_at - 1))       # asked for before the worker took it
    assert a.pending == 1
    a.loaded(Load(running=1, asked_at=mark.taken_at + 0.001))   # made after: it counts the request
    assert a.pending == 0 and a.active == 1
    a.ended(mark)
    assert a.active == 0
