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


class TokenizerLanes:
    def __init__(self, threads: int, long_chars: int = LONG_CHARS, long_waiting: int = LONG_WAITING) -> None:
        self.long_chars = long_chars
        self.long_waiting = long_waiting
        self._short = ThreadPoolExecutor(threads, thread_name_prefix="kvserve-tokenize")
        self._long = ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenize-long")
        self._formats = ThreadPoolExecutor(1, thread_name_prefix="kvserve-formats")
        # jobs in the long and the formats lanes, running or waiting; counted down when a job
        # ends, not when its caller gives up (that frees no thread)
        self._long_queued = self._formats_queued = 0
        self._lock = threading.Lock()

    async def run(self, size: int, fn: Callable[..., T], *args) -> T:
        """fn(*args) on a lane picked by `size` (characters of input)."""
        if size <= self.long_chars:
            return await asyncio.wrap_future(self._short.submit(fn, *args))
        with self._lock:
            if self._long_queued > self.long_waiting:
                raise QueueFull(f"{self._long_queued} long prompts (over {self.long_chars:,} characters) are "
                                "already being tokenized; try again shortly")
            self._long_queued += 1
        job = self._long.submit(fn, *args)
        job.add_done_callback(self._long_done)
        return await asyncio.wrap_future(job)   # a cancelled caller cancels a job not yet started

    def _long_done(self, _job) -> None:
        with self._lock:
            self._long_queued -= 1

    async def compile(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) (a structured output's format) on the formats lane."""
        with self._lock:
            if self._formats_queued > FORMATS_WAITING:
                raise QueueFull(f"{self._formats_queued} structured output formats are already being compiled; "
                                "try again shortly")
            self._formats_queued += 1
        job = self._formats.submit(fn, *args)
        job.add_done_callback(self._formats_done)
        return await asyncio.wrap_future(job)

    def _formats_done(self, _job) -> None:
        with self._lock:
            self._formats_queued -= 1

    def close(self) -> None:
        self._short.shutdown(wait=False, cancel_futures=True)
        self._long.shutdown(wait=False, cancel_futures=True)
        self._formats.shutdown(wait=False, cancel_futures=True)
