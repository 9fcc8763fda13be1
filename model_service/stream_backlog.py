"""What a Generate call's client has not read yet, bounded.

The engine generates whether or not a client reads: once the client's flow-control window is
full, the call waits to send and the engine's events pile up behind it. A client that opens
streams and never reads them held every token of each in the server's memory for as long as it
kept them open. Here the events wait in a queue that counts its token entries (each token, and
once more per logprob asked with it); past the limit (--max-unread-tokens) the client is not
reading: the request is cancelled at once (its pages and its share of each step go back), what
waited is dropped, and the call ends RESOURCE_EXHAUSTED as soon as the client reads again or
leaves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvserve.model_service.engine.errors import ClientTooSlow
from kvserve.model_service.engine.events import Tokens


class Unread:
    """get()'s answer once the backlog overflowed: the error the call ends with."""

    def __init__(self, error: ClientTooSlow) -> None:
        self.error = error


class StreamBacklog:
    """A call's event queue (EventRelay puts, the call gets), at most `limit` token entries."""

    def __init__(self, limit: int, entries_per_token: int, on_overflow: Callable[[], None]) -> None:
        self.limit = limit
        self.entries_per_token = entries_per_token   # 1, plus the top logprobs each token carries
        self.on_overflow = on_overflow
        self.waiting = 0   # token entries in the queue
        self.overflowed: Unread | None = None
        self._queue: asyncio.Queue = asyncio.Queue()

    def put_nowait(self, event: object) -> None:
        if self.overflowed is not None:
            return   # the request is cancelled; nobody will read what it still sends
        if isinstance(event, Tokens):
            self.waiting += len(event.token_ids) * self.entries_per_token
            # (one event alone is never too much: the client has had no chance to read it yet)
            if self.waiting > self.limit and not self._queue.empty():
                self._overflow()
                return
        self._queue.put_nowait(event)

    def _overflow(self) -> None:
        tokens = self.waiting // self.entries_per_token
        self.overflowed = Unread(ClientTooSlow(
            f"the client did not read its stream: {tokens:,} tokens waited unread, more than this server keeps "
            f"for a stream (--max-unread-tokens {self.limit:,}, each logprob asked counted as one more); the "
            "request was cancelled"))
        while not self._queue.empty():   # what waited is never sent: let it go now
            self._queue.get_nowait()
        self.waiting = 0
        self._queue.put_nowait(self.overflowed)
        self.on_overflow()

    async def get(self) -> object:
        return self._taken(await self._queue.get())

    def get_nowait(self) -> object:
        return self._taken(self._queue.get_nowait())

    def empty(self) -> bool:
        return self._queue.empty()

    def _taken(self, event: object) -> object:
        if isinstance(event, Tokens):
            self.waiting -= len(event.token_ids) * self.entries_per_token
        return event
