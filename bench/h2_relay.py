#!/usr/bin/env python
"""A gRPC hop below grpcio, for bench/hop_floor.py --h2: Inference calls relayed at the HTTP/2
level with the `h2` library (pip install h2; not a kvserve dependency) on one asyncio loop.
Each client stream is opened on one shared upstream connection; headers and trailers are passed
on, and each request message is parsed and encoded again (GenerateRequest) as a gateway must to
route it. Small messages only (the bench's): received data is acknowledged at once, so neither
side's flow-control window runs dry, and nothing waits for one.

    .venv/bin/python bench/h2_relay.py LISTEN UPSTREAM
"""

from __future__ import annotations

import asyncio
import struct
import sys
from pathlib import Path

import h2.config
import h2.connection
import h2.events

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvserve.inference.v1 import inference_pb2 as pb  # noqa: E402


def reencoded(data: bytes) -> bytes:
    """One length-prefixed gRPC message (uncompressed, whole in one DATA frame: the bench's)
    parsed and encoded again."""
    message = pb.GenerateRequest.FromString(data[5:]).SerializeToString()
    return struct.pack(">BI", 0, len(message)) + message


class _Side(asyncio.Protocol):
    """One HTTP/2 connection: its h2 state machine and its socket."""

    def __init__(self, client_side: bool) -> None:
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=client_side,
                                                                         header_encoding=None))
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.conn.initiate_connection()
        self.flush()

    def flush(self) -> None:
        if out := self.conn.data_to_send():
            self.transport.write(out)


class Upstream(_Side):
    """One client connection to the server behind; streams map back to (front, stream id)."""

    def __init__(self) -> None:
        super().__init__(client_side=True)
        self.routes: dict[int, tuple[Front, int]] = {}

    def data_received(self, data: bytes) -> None:
        for event in self.conn.receive_data(data):
            route = self.routes.get(getattr(event, "stream_id", 0))
            if route is None:
                continue
            front, stream = route
            if isinstance(event, h2.events.ResponseReceived):
                front.conn.send_headers(stream, event.headers)
            elif isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                front.conn.send_data(stream, event.data)
            elif isinstance(event, h2.events.TrailersReceived):
                front.conn.send_headers(stream, event.headers, end_stream=True)
                del self.routes[event.stream_id]
            elif isinstance(event, h2.events.StreamReset):
                front.conn.reset_stream(stream, event.error_code)
                del self.routes[event.stream_id]
            front.flush()
        self.flush()


class Front(_Side):
    """One client's connection: its streams opened upstream as they come."""

    def __init__(self, upstream: Upstream) -> None:
        super().__init__(client_side=False)
        self.upstream = upstream
        self.streams: dict[int, int] = {}   # ours -> upstream's

    def data_received(self, data: bytes) -> None:
        up = self.upstream
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                self.streams[event.stream_id] = stream = up.conn.get_next_available_stream_id()
                up.routes[stream] = (self, event.stream_id)
                up.conn.send_headers(stream, event.headers)
            elif isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                up.conn.send_data(self.streams[event.stream_id], reencoded(event.data))
            elif isinstance(event, h2.events.StreamEnded):
                up.conn.end_stream(self.streams.pop(event.stream_id))
            elif isinstance(event, h2.events.StreamReset) and event.stream_id in self.streams:
                up.conn.reset_stream(self.streams.pop(event.stream_id), event.error_code)
        up.flush()
        self.flush()


async def serve(listen: str, upstream: str) -> None:
    loop = asyncio.get_running_loop()
    host, port = upstream.rsplit(":", 1)
    _, up = await loop.create_connection(Upstream, host, int(port))
    host, port = listen.rsplit(":", 1)
    server = await loop.create_server(lambda: Front(up), host, int(port))
    await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], sys.argv[2]))
