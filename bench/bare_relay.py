"""The least a Python gRPC hop can be: Inference.Generate relayed to one worker, nothing else
(no routing, hashing, queue or failover), on grpc.aio as the gateway is. gateway_bench.py runs
it beside the gateway, so that what the gateway adds to a request splits into the hop itself
and the gateway's own work.

    .venv/bin/python bench/bare_relay.py LISTEN UPSTREAM
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402


class Relay(pb_grpc.InferenceServicer):
    def __init__(self, upstream: str) -> None:
        self.stub = pb_grpc.InferenceStub(grpc.aio.insecure_channel(upstream))

    async def Generate(self, request, context):
        async for response in self.stub.Generate(request, timeout=context.time_remaining()):
            yield response


async def serve(listen: str, upstream: str) -> None:
    server = grpc.aio.server()
    pb_grpc.add_InferenceServicer_to_server(Relay(upstream), server)
    server.add_insecure_port(listen)
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], sys.argv[2]))
