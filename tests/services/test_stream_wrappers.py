"""The interceptors every kvserve server runs wrap a streaming handler's generator in one of
their own. A call that ends (its client gone, its deadline past) closes the outer generator;
the handler's own finally must run then, not whenever the inner one is collected: it frees the
request's id and pages (services/plumbing/malformed.py, unexpected.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.services.plumbing.malformed import RefuseMalformed
from kvserve.services.plumbing.unexpected import HideUnexpected


class Details:
    method = "/kvserve.inference.v1.Inference/Generate"
    invocation_metadata = ()


@pytest.mark.parametrize("interceptor", [RefuseMalformed(), HideUnexpected()], ids=lambda i: type(i).__name__)
def test_closing_the_wrapped_stream_runs_the_handlers_finally_at_once(interceptor) -> None:
    unwound = []

    async def generate(request, context):
        try:
            while True:
                yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[1]))
        finally:
            unwound.append(True)

    handler = grpc.unary_stream_rpc_method_handler(generate, request_deserializer=pb.GenerateRequest.FromString,
                                                   response_serializer=pb.GenerateResponse.SerializeToString)

    async def run() -> None:
        async def continuation(_details):
            return handler

        wrapped = await interceptor.intercept_service(continuation, Details())
        responses = wrapped.unary_stream(pb.GenerateRequest(), context=None)
        await anext(responses)
        await responses.aclose()   # what grpc does as the call ends
        assert unwound == [True], "the handler's finally waited for the garbage collector"

    asyncio.run(run())
