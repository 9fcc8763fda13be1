"""create_server: binding, health, reflection and graceful stop, on real sockets."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvserve.kvcache.v1 import kvcache_pb2_grpc
from kvserve.services.plumbing.grpc_server import (
    BindError,
    RunningServer,
    ServiceSpec,
    create_server,
    stop_gracefully,
)

KVCACHE = "kvserve.kvcache.v1.KVCacheManager"
HEALTH = "grpc.health.v1.Health"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def kvcache_spec() -> ServiceSpec:
    # The generated base servicer answers UNIMPLEMENTED: enough for plumbing tests.
    return ServiceSpec(
        kvcache_pb2_grpc.add_KVCacheManagerServicer_to_server,
        kvcache_pb2_grpc.KVCacheManagerServicer(),
        KVCACHE,
    )


def with_server(
    address: str, scenario: Callable[[RunningServer, grpc.aio.Channel], Awaitable[None]]
) -> None:
    """Run ``scenario`` against a fresh server on ``address`` and stop it after."""

    async def main() -> None:
        running = await create_server(address, [kvcache_spec()])
        try:
            async with grpc.aio.insecure_channel(running.address) as channel:
                await scenario(running, channel)
        finally:
            await running.server.stop(None)

    asyncio.run(main())


async def check(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return response.status


def test_tcp_port_zero_binds_a_real_port_and_serves_health() -> None:
    async def scenario(running: RunningServer, channel: grpc.aio.Channel) -> None:
        host, _, port = running.address.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
        assert await check(channel) == SERVING
        assert await check(channel, KVCACHE) == SERVING

    with_server("127.0.0.1:0", scenario)


def test_unix_socket_serves_health(tmp_path: Path) -> None:
    path = tmp_path / "kv.sock"

    async def scenario(running: RunningServer, channel: grpc.aio.Channel) -> None:
        assert running.address == f"unix://{path}"
        assert await check(channel) == SERVING

    with_server(f"unix://{path}", scenario)


def test_one_server_listens_on_several_addresses(tmp_path: Path) -> None:
    """TCP for the world and a Unix socket for a sidecar, one server behind both."""
    path = tmp_path / "kv.sock"

    async def main() -> None:
        running = await create_server(["127.0.0.1:0", f"unix://{path}"], [kvcache_spec()])
        try:
            assert running.addresses[1] == f"unix://{path}" and running.address == running.addresses[0]
            for address in running.addresses:
                async with grpc.aio.insecure_channel(address) as channel:
                    assert await check(channel, KVCACHE) == SERVING
        finally:
            await running.server.stop(None)

    asyncio.run(main())


def test_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "kv.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays: what a crashed server leaves behind
    assert path.exists()

    async def scenario(running: RunningServer, channel: grpc.aio.Channel) -> None:
        assert await check(channel, KVCACHE) == SERVING

    with_server(f"unix://{path}", scenario)


def test_unknown_health_service_is_not_found() -> None:
    async def scenario(running: RunningServer, channel: grpc.aio.Channel) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await check(channel, "no.such.Service")
        assert error.value.code() == grpc.StatusCode.NOT_FOUND

    with_server("127.0.0.1:0", scenario)


def test_reflection_lists_and_describes_services() -> None:
    async def scenario(running: RunningServer, channel: grpc.aio.Channel) -> None:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=KVCACHE),
        ]
        responses = [r async for r in stub.ServerReflectionInfo(iter(requests), timeout=5)]
        listed = {s.name for s in responses[0].list_services_response.service}
        assert listed == {KVCACHE, HEALTH, "grpc.reflection.v1alpha.ServerReflection"}
        files = responses[1].file_descriptor_response.file_descriptor_proto
        assert files, "reflection could not describe the KV-cache service"

    with_server("127.0.0.1:0", scenario)


def test_graceful_stop_reports_not_serving_to_watchers() -> None:
    async def scenario(running: RunningServer, channel: grpc.aio.Channel) -> None:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=KVCACHE))
        assert (await watch.read()).status == SERVING
        stopping = asyncio.create_task(stop_gracefully(running.server, running.health, grace_s=0.5))
        assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING
        await asyncio.wait_for(stopping, 5)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await check(channel)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE

    with_server("127.0.0.1:0", scenario)


def test_busy_port_raises_bind_error() -> None:
    async def scenario(running: RunningServer, channel: grpc.aio.Channel) -> None:
        with pytest.raises(BindError, match="cannot listen on"):
            await create_server(running.address, [])

    with_server("127.0.0.1:0", scenario)


def test_unix_socket_of_a_live_server_is_not_stolen(tmp_path: Path) -> None:
    async def scenario(running: RunningServer, channel: grpc.aio.Channel) -> None:
        with pytest.raises(OSError, match="in use"):
            await create_server(running.address, [])
        assert await check(channel) == SERVING

    with_server(f"unix://{tmp_path / 'kv.sock'}", scenario)


@pytest.mark.parametrize(
    ("services", "message"),
    [
        ([kvcache_spec(), kvcache_spec()], "listed twice"),
        ([(kvcache_pb2_grpc.add_KVCacheManagerServicer_to_server, object(), "KVCacheManager")],
         "unknown gRPC service"),
    ],
)
def test_bad_service_lists_are_rejected(services: list[ServiceSpec], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        asyncio.run(create_server("127.0.0.1:0", services))
