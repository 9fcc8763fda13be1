"""A fleet for gateway tests: workers (the tiny model's service, each with its own manager over
real gRPC, on private loops in this process) and the gateway in front of them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.kvcache_service.core import ManagerConfig
from tests.kvcache.conftest import ServerThread
from tests.server_thread import LoopThread
from tests.service.conftest import ModelServerThread

PAGE_SIZE, NUM_PAGES = 4, 512


class WorkerThreads:
    """One worker: its manager and its model service, serving its lane too (the gateway sends
    Generate over it; lane_listen="" for a worker without one)."""

    def __init__(self, model, num_pages: int = NUM_PAGES, **config) -> None:
        config.setdefault("lane_listen", "127.0.0.1:0")
        self.manager = ServerThread("127.0.0.1:0", ManagerConfig(num_pages=num_pages, page_size=PAGE_SIZE,
                                                                 max_seqs=64))
        try:
            self.model = ModelServerThread(model, kvcache=self.manager.address, num_pages=num_pages, **config)
        except BaseException:
            self.manager.stop()
            raise
        self.address = self.model.address

    def stop(self) -> None:
        try:
            if self.model.thread.is_alive():   # a test may have stopped it
                self.model.stop()
        finally:
            if self.manager.thread.is_alive():
                self.manager.stop()


class GatewayThread(LoopThread):
    def __init__(self, workers: list[str], **config) -> None:
        from kvserve.services.gateway.config import GatewayConfig
        from kvserve.services.gateway.server import create_gateway

        super().__init__("gateway")
        self.config = GatewayConfig(listen="127.0.0.1:0", worker=tuple(workers), **config)
        try:
            self.gateway = self.call(create_gateway(self.config), timeout=60)
        except BaseException:
            self.close()
            raise
        self.address = self.gateway.running.address
        self.fleet = self.gateway.fleet

    def wait_serving(self, n: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while sum(1 for w in list(self.fleet.workers.values()) if w.state == "serving" and w.events_live) < n:
            assert time.monotonic() < deadline, "the gateway never saw its workers serving"
            time.sleep(0.02)

    def stop(self) -> None:
        try:
            self.call(self.gateway.running.server.stop(None))
            self.call(self.gateway.close())
        finally:
            self.close()


@dataclass
class Fleet:
    gateway: GatewayThread
    workers: list[WorkerThreads]
    channel: grpc.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.gateway.address)
        self.stub = pb_grpc.InferenceStub(self.channel)

    def worker_at(self, address: str) -> WorkerThreads:
        return next(w for w in self.workers if w.address == address)


def make_fleet(model, n: int, worker_config: dict | None = None, **gateway_config) -> Iterator[Fleet]:
    workers: list[WorkerThreads] = []
    gateway = None
    try:
        for _ in range(n):
            workers.append(WorkerThreads(model, **(worker_config or {})))
        gateway = GatewayThread([w.address for w in workers], model=str(model), **gateway_config)
        gateway.wait_serving(n)
        fleet = Fleet(gateway, workers)
        yield fleet
        fleet.channel.close()
    finally:
        if gateway is not None:
            gateway.stop()
        for w in workers:
            w.stop()


@pytest.fixture
def two_workers(tiny_dirs) -> Iterator[Fleet]:
    yield from make_fleet(tiny_dirs["tiny"], 2)
