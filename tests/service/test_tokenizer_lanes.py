"""model_service/tokenizing.py: the formats lane is bounded like the long lane, and its jobs
never take the short lane's threads."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvserve.model_service import tokenizing
from kvserve.model_service.engine.errors import QueueFull
from kvserve.model_service.tokenizing import TokenizerLanes


def test_formats_past_the_bound_are_refused_and_text_goes_on(monkeypatch):
    monkeypatch.setattr(tokenizing, "FORMATS_WAITING", 1)
    lanes = TokenizerLanes(threads=1)
    release = threading.Event()

    async def scenario():
        held = [asyncio.ensure_future(lanes.compile(release.wait, 30)) for _ in range(2)]   # one runs, one waits
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull, match="2 structured output formats are already being compiled"):
            await lanes.compile(lambda: None)
        assert await lanes.run(5, str.upper, "short") == "SHORT"   # the short lane is free
        release.set()
        assert all(await asyncio.gather(*held))
        assert await lanes.compile(lambda: "again") == "again"   # counted out once done

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        lanes.close()
