"""Inference.WatchServerStats, for a model service and a gateway alike: a ServerStats at once,
then one whenever the load has changed (looked at every interval), and one at least every
heartbeat however quiet the server is, so that a silent stream means a server that hangs.

Only the load decides when to send (the caller's `load` key: requests running and waiting,
free pages in steps (pages_key), serving, the prefill ahead in pages): the counters that move with every token would
otherwise send a message at every look. One build serves every stream that sends at the same
load (SharedStats)."""

from __future__ import annotations

import asyncio
import ipaddress
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable

import grpc

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.services.plumbing.api_keys import ApiKeys, bearer_token

DEFAULT_INTERVAL_MS, DEFAULT_HEARTBEAT_MS = 50, 1000
MIN_INTERVAL_MS, MAX_PERIOD_MS = 10, 60_000
# A heartbeat says the server is alive: a message every 10 ms with nothing changed cost an idle
# worker much of a core at 64 streams.
MIN_HEARTBEAT_MS = 100
# Streams at once: each looks at the load every interval on the server's event loop, which every
# request's tokens go through (gateways following a worker take one each; `kvserve top` one).
MAX_STREAMS = 64
# From one address: one client could otherwise take every place, and the gateways following
# the worker would find none.
MAX_STREAMS_PER_ADDRESS = 16


def pages_key(available: int, total: int) -> tuple[bool, int]:
    """Available pages as far as a report is worth sending for: in steps of 1/64 of the cache,
    so that a decoding batch taking a page every few tokens does not send one at every look
    (docs/benchmarks.md); exact once fewer than four steps are left, where a gateway must not
    send what cannot fit. The report itself carries the exact count."""
    step = max(1, total // 64)
    return (True, available) if available < 4 * step else (False, available // step)


def prefill_key(tokens: int, page_size: int) -> int:
    """The prefill ahead as far as a report is worth sending for: in pages, so that a long
    prompt's chunks move it and a decode step does not."""
    return -(-tokens // page_size)


def periods(request: pb.WatchServerStatsRequest) -> tuple[float, float]:
    """(interval, heartbeat) in seconds; ValueError saying which is out of range."""
    interval = request.interval_ms or DEFAULT_INTERVAL_MS
    heartbeat = request.heartbeat_ms or max(DEFAULT_HEARTBEAT_MS, interval)
    if not MIN_INTERVAL_MS <= interval <= MAX_PERIOD_MS:
        raise ValueError(f"interval_ms is {interval}; it must be 0 (for {DEFAULT_INTERVAL_MS}) or "
                         f"{MIN_INTERVAL_MS} to {MAX_PERIOD_MS}")
    if not max(interval, MIN_HEARTBEAT_MS) <= heartbeat <= MAX_PERIOD_MS:
        raise ValueError(f"heartbeat_ms is {heartbeat}; it must be 0 (for {DEFAULT_HEARTBEAT_MS}) or from "
                         f"interval_ms ({interval}) and {MIN_HEARTBEAT_MS} up to {MAX_PERIOD_MS}")
    return interval / 1e3, heartbeat / 1e3


class SharedStats:
    """The server's stats as its streams send them: built once for every stream that wants a
    message at the same load within MIN_INTERVAL_MS, so that several gateways following one
    worker cost it one build (a call to its manager) per change, not one each."""

    def __init__(self, build: Callable[[], Awaitable[pb.ServerStats]], load: Callable[[], Hashable]) -> None:
        self.build, self.load = build, load
        self.streams = 0   # open WatchServerStats streams
        self.by_address = AddressCounts()   # of them, from each client address
        self._lock = asyncio.Lock()
        self._last: tuple[Hashable, float, pb.ServerStats] | None = None   # (load, built at, stats)

    async def get(self, load: Hashable) -> pb.ServerStats:
        async with self._lock:   # a stream that waited here finds what the one before it built
            now = asyncio.get_running_loop().time()
            if self._last is None or self._last[0] != load or now - self._last[1] > MIN_INTERVAL_MS / 1e3:
                self._last = (load, now, await self.build())
            return self._last[2]


async def watch(request: pb.WatchServerStatsRequest, context: grpc.aio.ServicerContext, stats: SharedStats,
                done: Callable[[], bool], keys: ApiKeys | None = None) -> AsyncIterator[pb.ServerStats]:
    """The stream: a message from `stats` whenever its load changed or a heartbeat is due;
    `done()` ends the stream (after one last message). With `keys`, the caller's key is looked
    at before each message: a stream that never ends on its own must not outlive a key taken
    out of the file (SIGHUP)."""
    try:
        interval, heartbeat = periods(request)
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if stats.streams >= MAX_STREAMS:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"{stats.streams} WatchServerStats streams are open, as many as this server keeps; "
                            "try again later, or poll GetServerStats")
    address = client_address(context.peer())
    if stats.by_address[address] >= MAX_STREAMS_PER_ADDRESS:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"{MAX_STREAMS_PER_ADDRESS} WatchServerStats streams are open from this client's "
                            "address, as many as one address may hold; close one, or poll GetServerStats")
    loop = asyncio.get_running_loop()
    told, told_at = None, 0.0
    stats.streams += 1
    stats.by_address[address] += 1
    try:
        while True:
            key, now, last = stats.load(), loop.time(), done()
            if told is None or key != told or now - told_at >= heartbeat or last:
                if keys is not None and keys.tenant(bearer_token(context.invocation_metadata())) is None:
                    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "the API key was revoked")
                yield await stats.get(key)
                told, told_at = key, now
            if last:
                return
            await asyncio.sleep(interval)
    finally:
        stats.streams -= 1
        stats.by_address.leave(address)


class AddressCounts(Counter):
    """Streams open from each client address (client_address), for a per-address cap: an address
    leaves the map with its last stream."""

    def leave(self, address: str) -> None:
        self[address] -= 1
        if not self[address]:
            del self[address]


def client_address(peer: str) -> str:
    """Who a client is for the per-address cap, from grpc's peer string: an IPv4 host; an IPv6
    host's /64 (one host holds a whole one), an IPv4-mapped one as its IPv4 host; a Unix
    socket's clients are one ("ipv4:10.0.0.7:41234", "ipv6:[2001:db8::7]:41234" or with %5B %5D,
    "unix:/path")."""
    if peer.startswith("ipv4:"):
        return peer.rsplit(":", 1)[0]
    if peer.startswith("ipv6:"):
        host = peer[5:].replace("%5B", "[").replace("%5D", "]").rsplit(":", 1)[0].strip("[]")
        try:
            address = ipaddress.IPv6Address(host.split("%")[0])   # (without a zone index)
        except ValueError:
            return peer
        if address.ipv4_mapped is not None:
            return f"ipv4:{address.ipv4_mapped}"
        return f"ipv6:{ipaddress.IPv6Network((address, 64), strict=False)}"
    return peer
