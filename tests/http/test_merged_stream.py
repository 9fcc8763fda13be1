"""The merge of a batch's streams (services/http/app.py, _merged): whatever ends one call's
stream ends the merged one, never leaving it waiting on a pump that has stopped."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvserve.services.http import app


def run(parts_behaviour: dict[str, object], monkeypatch) -> tuple[list, BaseException | None, list[str]]:
    """_merged over fake parts named by parts_behaviour's keys: each yields one chunk, then
    raises the given exception, or (None) waits until cancelled. -> what the merge yielded,
    what it raised, and which parts' waits were cancelled."""
    cancelled: list[str] = []

    async def chunks(part, continuous):
        yield [{"part": part}]
        behaviour = parts_behaviour[part]
        if behaviour is None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(part)
                raise
        raise behaviour

    monkeypatch.setattr(app, "_chunks", chunks)

    async def merge() -> tuple[list, BaseException | None]:
        got, raised = [], None
        try:
            async for item in app._merged(list(parts_behaviour), False):
                got.append(item)
        except Exception as exc:
            raised = exc
        await asyncio.sleep(0)   # the cancelled pumps' turn to see it
        return got, raised

    got, raised = asyncio.run(asyncio.wait_for(merge(), 30))   # 30 s: a hang, not a timing
    return got, raised, cancelled


@pytest.mark.parametrize("error", [ValueError("a bug in one part"),
                                   grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(),
                                                        grpc.aio.Metadata(), "the worker failed")])
def test_an_error_in_one_part_ends_the_merge_and_cancels_the_others(error, monkeypatch):
    got, raised, cancelled = run({"a": error, "b": None}, monkeypatch)
    assert raised is error
    assert got[0] == [{"part": "a"}]
    assert cancelled == ["b"]   # the part still running is stopped, not left behind


def test_parts_that_finish_end_the_merge(monkeypatch):
    async def chunks(part, continuous):
        yield [{"part": part}]

    monkeypatch.setattr(app, "_chunks", chunks)

    async def merge() -> list:
        return [item async for item in app._merged(["a", "b", "c"], False)]

    got = asyncio.run(asyncio.wait_for(merge(), 30))
    assert sorted(item[0]["part"] for item in got) == ["a", "b", "c"]


def test_a_call_cancelled_from_elsewhere_ends_the_merge_as_cancelled(monkeypatch):
    """A call cancelled under a pump (the front's channel closed) raises CancelledError there:
    the merge ends CANCELLED instead of waiting for that pump forever."""
    got, raised, cancelled = run({"a": asyncio.CancelledError(), "b": None}, monkeypatch)
    assert isinstance(raised, grpc.aio.AioRpcError) and raised.code() == grpc.StatusCode.CANCELLED
    assert cancelled == ["b"]


def test_a_client_that_does_not_read_holds_the_parts_back(monkeypatch):
    """The merge's queue is bounded: parts stop pulling from their calls while the client reads
    nothing, so each call's server sees the backlog (--max-unread-tokens) instead of the front
    keeping every token of every part (it pulled 200,000 chunks for one read)."""
    pulled = {"a": 0, "b": 0}

    async def chunks(part, continuous):
        while True:
            pulled[part] += 1
            yield [{"part": part}]
            await asyncio.sleep(0)

    monkeypatch.setattr(app, "_chunks", chunks)

    async def read_one_then_stall() -> None:
        merged = app._merged(["a", "b"], False)
        await anext(merged)
        await asyncio.sleep(0.2)   # the client reads nothing more meanwhile
        await merged.aclose()

    asyncio.run(asyncio.wait_for(read_one_then_stall(), 30))
    assert sum(pulled.values()) <= 2 * 2 + 2 + 1, pulled   # the queue's room, one held by each pump, the one read
