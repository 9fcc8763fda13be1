"""One real model service (tiny checkpoint, in-process KV-cache manager) for the client tests.

The grpc.aio server runs on its own event loop in a daemon thread, as in
tests/kvcache/conftest.py; the tests talk to it like any client would: the
SDK over a synchronous channel, and `kvserve generate|chat` as subprocesses.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.inference_client import InferenceClient

RPC_TIMEOUT_S = 60.0


class ModelServerThread:
    def __init__(self, model: Path) -> None:
        from model_service.config import ModelServiceConfig
        from model_service.server import create_server

        # CPU and a small fixed pool: quick to start, same results on any machine.
        config = ModelServiceConfig(model=str(model), listen="127.0.0.1:0", kvcache="inprocess",
                                    device="cpu", num_pages=512)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="model-grpc-server", daemon=True)
        self.thread.start()
        try:
            self.running, self.servicer = self._call(create_server(config), timeout=120)
        except BaseException:
            self._close_loop()
            raise
        self.address: str = self.running.address

    def _call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        try:
            self._call(self.running.server.stop(None))
        finally:
            self.servicer.engine.stop()
            self.servicer.stack.kv.close()
            self._close_loop()

    def _close_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


@pytest.fixture(scope="session")
def model_server(tiny_dirs: dict[str, Path]) -> Iterator[ModelServerThread]:
    server = ModelServerThread(tiny_dirs["tiny"])
    yield server
    server.stop()


@pytest.fixture
def client(model_server: ModelServerThread) -> Iterator[InferenceClient]:
    with InferenceClient(model_server.address, timeout=RPC_TIMEOUT_S) as c:
        yield c
