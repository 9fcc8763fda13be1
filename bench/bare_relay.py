"""The least a Python gRPC hop can be: Inference.Generate relayed to one worker, nothing else
(no routing, hashing, queue or failover), on grpc.aio as the gateway is. gateway_bench.py runs
it beside the gateway, so that what the gateway adds to a request splits into the hop itself
and the gateway's own work. With `-` for UPSTREAM it relays nothing and answers each Generate
itself, with the three messages a worker sends for a one-token request: a call to it is what one
Python gRPC call costs on this machine with no work behind it.

    .venv/bin/python bench/bare_relay.py LISTEN UPSTREAM
    .venv/bin/python bench/bare_relay.py LISTEN -
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvserve.inference.v1 import inference_pb2 as pb  # noqa: E402
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402


class Relay(pb_grpc.InferenceServicer):
    def __init__(self, upstream: str) -> None:
        self.stub = pb_grpc.InferenceStub(grpc.aio.insecure_channel(upstream))

    async def Generate(self, request, context):
        async for response in self.stub.Generate(request, timeout=context.time_remaining()):
            yield response


class Empty(pb_grpc.InferenceServicer):
    async def Generate(self, request, context):
        prompt = len(request.token_ids.ids)
        yield pb.GenerateResponse(prefill_done=pb.PrefillDone(request_id=request.request_id, prompt_tokens=prompt))
        yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[7], text="x"))
        yield pb.GenerateResponse(finished=pb.Finished(
            finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(prompt_tokens=prompt, completion_tokens=1)))


async def serve(listen: str, upstream: str) -> None:
    server = grpc.aio.server()
    pb_grpc.add_InferenceServicer_to_server(Empty() if upstream == "-" else Relay(upstream), server)
    server.add_insecure_port(listen)
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], sys.argv[2]))
