"""The real model service (tiny checkpoint, in-process KV-cache manager) over gRPC.

The grpc.aio server runs on its own event loop in a daemon thread, as in
tests/kvcache/conftest.py; tests talk to it with ordinary synchronous channels,
like any client. Fixtures yield a `Served` (unpacks as (address, servicer));
teardown stops the server, then the engine, then closes the manager link.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc

# page_size 4 with 512 pages: max_model_len 2048 (the tiny model's), many pages per request.
BASE_CONFIG = dict(listen="127.0.0.1:0", kvcache="inprocess", device="cpu", page_size=4, num_pages=512)


class Served(NamedTuple):
    address: str
    servicer: object  # model_service.servicer.InferenceServicer


class ModelServerThread:
    """create_server(ModelServiceConfig(...)) on a private event loop in a daemon thread."""

    def __init__(self, model: Path, **overrides) -> None:
        from model_service.config import ModelServiceConfig
        from model_service.server import create_server

        self.config = ModelServiceConfig(model=str(model), **{**BASE_CONFIG, **overrides})
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="model-grpc-server", daemon=True)
        self.thread.start()
        try:
            self.running, self.servicer = self._call(create_server(self.config), timeout=120)
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


def _serve(model: Path, **overrides) -> Iterator[Served]:
    server = ModelServerThread(model, **overrides)
    try:
        yield Served(server.address, server.servicer)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def model_server(tiny_dirs: dict[str, Path]) -> Iterator[Served]:
    """One server per test module: tiny model, page_size 4, 512 pages, in-process manager."""
    yield from _serve(tiny_dirs["tiny"])


@pytest.fixture
def fresh_server(tiny_dirs: dict[str, Path]) -> Iterator[Served]:
    """A server of its own, for tests that break or stop it (the default config)."""
    yield from _serve(tiny_dirs["tiny"])


@pytest.fixture
def small_server(tiny_dirs: dict[str, Path]) -> Iterator[Served]:
    """One running sequence at a time and room for one waiting request: queue-full tests."""
    yield from _serve(tiny_dirs["tiny"], max_num_seqs=1, max_waiting=1)


@pytest.fixture
def channel(model_server: Served) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(model_server.address)
    yield ch
    ch.close()


@pytest.fixture
def stub(channel: grpc.Channel) -> pb_grpc.InferenceStub:
    return pb_grpc.InferenceStub(channel)


@pytest.fixture(scope="session")
def hf_tiny(tiny_dirs: dict[str, Path]):
    """transformers' own model of the tiny checkpoint (the oracle), float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dirs["tiny"], dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(tiny_dirs: dict[str, Path]):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dirs["tiny"])
