"""A handler's bug is INTERNAL with an incident id, never grpc's UNKNOWN with the exception's repr;
a peer's failed call a handler lets through is a bug too (its status and details spoke of another
call); a handler's own abort is untouched (services/plumbing/unexpected.py, on every server)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.services.plumbing.grpc_server import ServiceSpec, create_server


class Buggy(pb_grpc.InferenceServicer):
    async def Tokenize(self, request, context):
        raise KeyError("a bug")

    async def Cancel(self, request, context):   # a peer's failure let through
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAUTHENTICATED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "failed to connect to all addresses; ipv4:10.0.0.7:50051")

    async def GetModelInfo(self, request, context):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "its own words")

    async def Generate(self, request, context):
        yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[1]))
        raise ZeroDivisionError("a bug mid-stream")


def test_bugs_are_internal_with_an_incident_and_the_rest_as_they_were(caplog):
    async def main():
        running = await create_server("127.0.0.1:0", [ServiceSpec(pb_grpc.add_InferenceServicer_to_server,
                                                                  Buggy(), "kvserve.inference.v1.Inference")])
        try:
            async with grpc.aio.insecure_channel(running.address) as channel:
                for stub in (pb_grpc.InferenceStub(channel), pb_grpc.InferenceStub(running.local_channel())):
                    outcomes = []
                    for call in (lambda: stub.Tokenize(pb.TokenizeRequest()),
                                 lambda: stub.Cancel(pb.CancelRequest()),
                                 lambda: stub.GetModelInfo(pb.GetModelInfoRequest())):
                        try:
                            await call()
                        except grpc.aio.AioRpcError as exc:
                            outcomes.append((exc.code(), exc.details()))
                    got = []
                    try:
                        async for response in stub.Generate(pb.GenerateRequest()):
                            got.append(response)
                    except grpc.aio.AioRpcError as exc:
                        outcomes.append((exc.code(), exc.details()))
                    yield outcomes, len(got)
        finally:
            await running.server.stop(None)

    async def collect():
        return [item async for item in main()]

    with caplog.at_level(logging.ERROR):
        results = asyncio.run(collect())
    for outcomes, streamed in results:   # over the socket, then in-process
        (bug, bug_details), peer, own, (mid, mid_details) = outcomes
        assert bug == grpc.StatusCode.INTERNAL and bug_details.startswith("internal error in Tokenize; the server")
        assert "KeyError" not in bug_details and bug_details.rsplit(" ", 1)[-1] in caplog.text
        assert peer[0] == grpc.StatusCode.INTERNAL and "10.0.0.7" not in peer[1]
        assert own == (grpc.StatusCode.FAILED_PRECONDITION, "its own words")
        assert streamed == 1 and mid == grpc.StatusCode.INTERNAL and "ZeroDivisionError" not in mid_details
    assert "a bug mid-stream" in caplog.text
