"""Tokenizing and chat templating off the server's event loop, in two lanes.

On the loop, one 800,000-character prompt held every other stream for seconds. In a
thread it does not: transformers' fast tokenizers run their Rust code without the GIL (a batch
encode releases it; `backend_tokenizer.encode` alone would not, which is why the builder calls
the tokenizer itself), so the loop goes on streaming and the engine on stepping.

Lanes keep a long prompt from delaying a short one: texts up to `long_chars` go to a pool of
`threads`; longer ones to a single thread of their own, with at most `long_waiting` queued
behind it; past that a request is refused (RESOURCE_EXHAUSTED) rather than held in memory.
Structured outputs' formats compile in a lane of their own, bounded the same way: a small
hostile JSON Schema can take minutes to compile (llguidance weighs every pair of its
patternProperties), and on the short lane it held every text prompt behind it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvserve.model_service.engine.errors import QueueFull

T = TypeVar("T")

LONG_CHARS = 32_768     # longer texts go to the long lane
LONG_WAITING = 8
FORMATS_WAITING = 8     # formats compiling or waiting to, past which a request is refused


class _BoundedLane:
    """One thread and at most `waiting` jobs behind the running one; past that, QueueFull saying
    `busy` (with the count). A job is counted out when it ends, not when its caller gives up
    (that frees no thread)."""

    def __init__(self, name: str, waiting: int, busy: str) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.waiting, self.busy = waiting, busy
        self._queued = 0
        self._lock = threading.Lock()

    async def run(self, fn: Callable[..., T], *args) -> T:
        with self._lock:
            if self._queued > self.waiting:
                raise QueueFull(f"{self._queued} {self.busy}; try again shortly")
            self._queued += 1
        job = self._pool.submit(fn, *args)
        job.add_done_callback(self._done)
        return await asyncio.wrap_future(job)   # a cancelled caller cancels a job not yet started

    def _done(self, _job) -> None:
        with self._lock:
            self._queued -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class TokenizerLanes:
    def __init__(self, threads: int, long_chars: int = LONG_CHARS, long_waiting: int = LONG_WAITING) -> None:
        self.long_chars = long_chars
        self._short = ThreadPoolExecutor(threads, thread_name_prefix="kvserve-tokenize")
        self._long = _BoundedLane("kvserve-tokenize-long", long_waiting,
                                  f"long prompts (over {long_chars:,} characters) are already being tokenized")
        self._formats = _BoundedLane("kvserve-formats", FORMATS_WAITING,
                                     "structured output formats are already being compiled")

    async def run(self, size: int, fn: Callable[..., T], *args) -> T:
        """fn(*args) on a lane picked by `size` (characters of input)."""
        if size <= self.long_chars:
            return await asyncio.wrap_future(self._short.submit(fn, *args))
        return await self._long.run(fn, *args)

    async def compile(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) (a structured output's format) on the formats lane."""
        return await self._formats.run(fn, *args)

    def close(self) -> None:
        self._short.shutdown(wait=False, cancel_futures=True)
        self._long.close()
        self._formats.close()
