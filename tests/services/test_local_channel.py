"""LocalChannel: a call from inside the process answers as the same call over the server's socket
(responses, status codes, details, trailing metadata, the interceptors in their order), and a
cancelled or abandoned stream closes its handler."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.services.plumbing.api_keys import ApiKeys
from kvserve.services.plumbing.auth import RequireApiKey
from kvserve.services.plumbing.grpc_server import ServiceSpec, create_server

SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
KEY = (("authorization", "Bearer good"),)


class Scripted(pb_grpc.InferenceServicer):
    """Each method one behaviour: an answer built from the caller's metadata, an abort with
    trailing metadata, a crash, a slow answer, a stream that aborts part-way or never ends."""

    def __init__(self) -> None:
        self.closed = 0          # streams whose handler ran its finally
        self.seen: list[str] = []

    async def GetModelInfo(self, request, context):
        who = dict(context.invocation_metadata()).get("x-who", "")
        return pb.ModelInfo(name=f"for {who}", max_model_len=int(context.time_remaining() is not None))

    async def Tokenize(self, request, context):
        context.set_trailing_metadata((("retry-after-ms", "250"),))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full: try again later")

    async def Cancel(self, request, context):
        raise RuntimeError("a bug")

    async def GetServerStats(self, request, context):
        await asyncio.sleep(5)
        return pb.ServerStats()

    async def Generate(self, request, context):
        try:
            for i in range(request.sampling.max_tokens or 10**9):
                if request.request_id == "fail" and i == 2:
                    try:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no third token")
                    except grpc.aio.AbortError:   # caught by handler code: a second abort keeps the first status
                        await context.abort(grpc.StatusCode.INTERNAL, "second")
                if request.request_id == "slow":
                    await asyncio.sleep(0.01)
                yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[i]))
        finally:
            self.closed += 1


class Recording(grpc.aio.ServerInterceptor):
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    async def intercept_service(self, continuation, details):
        self.log.append(f"{self.name} {details.method.rsplit('/', 1)[1]}")
        return await continuation(details)


def run(scenario, tmp_path, with_keys: bool = False):
    async def main():
        servicer = Scripted()
        order: list[str] = []
        interceptors = [Recording("outer", order), Recording("inner", order)]
        if with_keys:
            path = tmp_path / "keys"
            path.write_text("good tenant-a\n")
            interceptors.insert(0, RequireApiKey(ApiKeys(str(path)), {SERVICE}))
        running = await create_server("127.0.0.1:0", [ServiceSpec(pb_grpc.add_InferenceServicer_to_server,
                                                                   servicer, SERVICE)], interceptors=interceptors)
        channel = grpc.aio.insecure_channel(running.address)
        try:
            await scenario(pb_grpc.InferenceStub(channel), pb_grpc.InferenceStub(running.local_channel()),
                           servicer, order, running)
        finally:
            await channel.close()
            await running.server.stop(None)
    asyncio.run(main())


async def outcome(call):
    """(response or list of responses, None) or (code, details, trailing metadata)."""
    try:
        result = await call()
        return result, None
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details(), tuple(exc.trailing_metadata() or ())


def test_unary_answers_and_failures_are_those_of_the_socket(tmp_path, caplog):
    async def scenario(remote, local, servicer, order, running):
        for stub in (remote, local):
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("x-who", "me"),))
            assert info.name == "for me" and info.max_model_len == 0   # no deadline given
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            assert info.max_model_len == 1
        code, details, trailing = await outcome(lambda: local.Tokenize(pb.TokenizeRequest()))
        assert (code, details) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "full: try again later")
        assert ("retry-after-ms", "250") in trailing
        assert (await outcome(lambda: remote.Tokenize(pb.TokenizeRequest())))[:2] == (code, details)
        with caplog.at_level(logging.ERROR):
            code, details, _ = await outcome(lambda: local.Cancel(pb.CancelRequest()))
        # a bug: INTERNAL naming an incident the log has with the traceback, not grpc's UNKNOWN and its repr
        assert code == grpc.StatusCode.INTERNAL and "RuntimeError" not in details and "a bug" not in details
        incident = details.rsplit(" ", 1)[-1]
        assert details == f"internal error in Cancel; the server log has the details under incident {incident}"
        assert f"incident {incident}" in caplog.text and "a bug" in caplog.text
        assert (await outcome(lambda: remote.Cancel(pb.CancelRequest())))[0] == code
        for stub in (remote, local):
            got = await outcome(lambda: stub.GetServerStats(pb.GetServerStatsRequest(), timeout=0.2))
            assert got[0] == grpc.StatusCode.DEADLINE_EXCEEDED
        health = health_pb2_grpc.HealthStub(running.local_channel())
        reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        missing = running.local_channel().unary_unary("/no.Such/Method")
        assert (await outcome(lambda: missing(pb.CancelRequest())))[0] == grpc.StatusCode.UNIMPLEMENTED
    run(scenario, tmp_path)


def test_the_interceptors_run_in_the_servers_order_and_keys_are_checked(tmp_path):
    async def scenario(remote, local, servicer, order, running):
        await remote.GetModelInfo(pb.GetModelInfoRequest(), metadata=KEY)
        over_socket = list(order)
        order.clear()
        await local.GetModelInfo(pb.GetModelInfoRequest(), metadata=KEY)
        assert order == over_socket == ["outer GetModelInfo", "inner GetModelInfo"]
        for metadata in ((), (("authorization", "Bearer bad"),)):
            for stub in (remote, local):
                got = await outcome(lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata))
                assert got[0] == grpc.StatusCode.UNAUTHENTICATED, got
            call = local.Generate(pb.GenerateRequest(), metadata=metadata)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert servicer.closed == 0   # refused before the handler ran
    run(scenario, tmp_path, with_keys=True)


def test_streams_answer_as_over_the_socket_and_their_handlers_close(tmp_path):
    async def scenario(remote, local, servicer, order, running):
        for stub in (remote, local):
            tokens = [r.chunk.token_ids[0] async for r in stub.Generate(pb.GenerateRequest(
                sampling=pb.SamplingParams(max_tokens=5)))]
            assert tokens == [0, 1, 2, 3, 4]
            seen, call = [], stub.Generate(pb.GenerateRequest(request_id="fail", sampling=pb.SamplingParams(
                max_tokens=5)))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for r in call:
                    seen.append(r.chunk.token_ids[0])
            assert seen == [0, 1] and err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == "no third token"
        closed = servicer.closed
        # cancel() after some reads closes the handler where it stands
        call = local.Generate(pb.GenerateRequest(request_id="slow"))
        assert (await call.read()).chunk.token_ids[0] == 0
        assert call.cancel() and not call.cancel()
        for _ in range(100):
            if servicer.closed > closed:
                break
            await asyncio.sleep(0.01)
        assert servicer.closed == closed + 1
        # cancelling the task that reads it (a client gone) closes it too
        call = local.Generate(pb.GenerateRequest(request_id="slow"))

        async def read_all():
            async for _ in call:
                pass
        reader = asyncio.ensure_future(read_all())
        await asyncio.sleep(0.05)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        assert servicer.closed == closed + 2
        # a deadline ends a stream DEADLINE_EXCEEDED, as over the socket
        for stub in (remote, local):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(pb.GenerateRequest(request_id="slow"), timeout=0.1):
                    pass
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    run(scenario, tmp_path)
