"""A peer to freeze (SIGSTOP) in tests/service/test_keepalive.py, run as its own process.

    python -m tests.service.frozen_peer server OPTIONS_JSON   # prints its port, then a line per ended call
    python -m tests.service.frozen_peer client ADDRESS        # prints "streaming" at its first message

The server is kvserve's own (`create_server`, its default options under OPTIONS_JSON) with an
Inference service whose Generate sends one chunk and then nothing; the client is a bare gRPC one
with no options of its own, as grpcurl or another language's client would be."""

from __future__ import annotations

import asyncio
import json
import sys

import grpc

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.services.plumbing.grpc_server import ServiceSpec, create_server


class SilentAfterOne(pb_grpc.InferenceServicer):
    async def Generate(self, request, context):
        yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[1], text="a"))
        try:
            await asyncio.Event().wait()
        finally:   # the call ended: its client went away or was dropped
            print("call ended", flush=True)


async def serve(options: dict) -> None:
    running = await create_server("127.0.0.1:0", [ServiceSpec(pb_grpc.add_InferenceServicer_to_server,
                                                             SilentAfterOne(), "kvserve.inference.v1.Inference")],
                                  options=options)
    print(running.address.rsplit(":", 1)[1], flush=True)
    await running.server.wait_for_termination()


def stream(address: str) -> None:
    with grpc.insecure_channel(address) as ch:
        for _ in pb_grpc.InferenceStub(ch).Generate(pb.GenerateRequest(prompt="a")):
            print("streaming", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        asyncio.run(serve(json.loads(sys.argv[2])))
    else:
        stream(sys.argv[2])
