"""The lane's framing (protos/kvserve/inference/v1/lane.proto says the protocol): what the
worker's lane server (model_service/lane_server.py) and the gateway's lane client
(services/gateway/lane.py) both read and write. A frame is a 4-byte big-endian length, a 1-byte
kind and the bytes."""

from __future__ import annotations

import asyncio
import socket
import struct

import grpc

from kvserve.inference.v1 import lane_pb2 as lane_pb
from kvserve.services.plumbing.address import parse_address

MAGIC = b"kvlane01"   # a connection's first bytes, from the gateway: a stray client is told nothing
CALL, HEADERS, MESSAGE, STATUS, PING = 1, 2, 3, 4, 5
# A gateway pings each connection whose call runs this often; a worker ends a call whose gateway
# is silent QUIET_PINGS intervals, as the gRPC port drops a connection whose pings go unanswered.
PING_INTERVAL_S = 10.0
QUIET_PINGS = 4
MIN_PING_INTERVAL_MS = 1000   # a shorter one a LaneCall asks is taken as this
HEADER = struct.Struct(">IB")
CALL_OVERHEAD = 4096   # a LaneCall's bytes around its request: metadata and the deadline
# A frame the worker sends: a response message (at most 64 MiB, what a gateway's gRPC channel to
# a worker takes) or a status.
MAX_REPLY_BYTES = 64 << 20
CODES = {code.value[0]: code for code in grpc.StatusCode}


class FramingError(Exception):
    """The peer broke the protocol: the connection closes."""

    def __init__(self, message: str, length: int = 0) -> None:
        super().__init__(message)
        self.length = length   # a frame's length past the limit, when that was the fault


# A peer gone without a word (its machine lost, the network cut): the kernel probes an idle
# connection after 30 s and gives up on one whose bytes go unacknowledged for 40 s, about when
# gRPC's keepalive pings (grpc_server.py) would end the call.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 5, 2
USER_TIMEOUT_MS = 40_000


def keep_alive(writer: asyncio.StreamWriter, user_timeout: bool = True) -> None:
    """TCP keepalive on a lane connection (a Unix socket needs none), and the user timeout unless
    told not to. The worker's side goes without it: Linux applies it to a peer's zero window too,
    so a gateway whose client stopped reading for 40 s had its live stream reset, and moved, where
    gRPC holds the stream and the worker's --max-unread-tokens decides."""
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    options = [("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
               ("TCP_KEEPCNT", KEEPALIVE_PROBES), ("TCP_NODELAY", 1)]
    if user_timeout:
        options.append(("TCP_USER_TIMEOUT", USER_TIMEOUT_MS))
    for name, value in options:
        if hasattr(socket, name):   # Linux has them all; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def frame(kind: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), kind) + payload


async def read_frame(reader: asyncio.StreamReader, limit: int, body_s: float | None = None) -> tuple[int, bytes]:
    """The next frame's (kind, payload). IncompleteReadError at a clean or broken end of the
    stream; FramingError for one longer than `limit`; TimeoutError when its bytes take longer
    than `body_s` once its header came (a peer that stops mid-frame would hold what it sent)."""
    length, kind = HEADER.unpack(await reader.readexactly(HEADER.size))
    if length > limit:
        raise FramingError(f"a frame of {length} bytes, over the {limit} taken", length)
    if not length:
        return kind, b""
    if body_s is None:   # (the gateway's reads, one a message: no timer each)
        return kind, await reader.readexactly(length)
    async with asyncio.timeout(body_s):
        return kind, await reader.readexactly(length)


def metadata_pb(pairs) -> list[lane_pb.LaneMetadata]:
    return [lane_pb.LaneMetadata(key=key, value=value) for key, value in pairs]


def metadata_pairs(metadata) -> tuple[tuple[str, str], ...]:
    return tuple((m.key, m.value) for m in metadata)


def too_large(size: int, limit: int) -> str:
    """gRPC's own words for a message past the size taken, which a gateway reads (relay._too_large)."""
    return f"Received message larger than max ({size} vs. {limit})"


def status_frame(code: grpc.StatusCode, details: str = "", trailers: tuple = ()) -> bytes:
    status = lane_pb.LaneStatus(code=code.value[0], details=details, trailing_metadata=metadata_pb(trailers))
    return frame(STATUS, status.SerializeToString())


def dial_target(worker_address: str, lane_address: str) -> tuple[str, int] | str | None:
    """Where a gateway reaches a worker's lane: (host, port), the host the gateway reaches the
    worker at (the lane's own listen host, often 0.0.0.0, names no peer); a Unix socket's path
    only for a worker reached over a Unix socket itself (on this host: a worker elsewhere names
    a path on its own). None when unusable."""
    try:
        lane = parse_address(lane_address)
        worker = parse_address(worker_address.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:"))
    except ValueError:
        return None
    if lane.is_unix:
        return lane.unix_path if worker.is_unix else None
    if not lane.port:
        return None
    if not worker.is_unix:
        return worker.host, lane.port
    host = lane.host
    return ("127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host), lane.port
