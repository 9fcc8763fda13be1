"""One real model service (tiny checkpoint, in-process KV-cache manager) for the client tests.

The grpc.aio server runs on its own event loop in a daemon thread
(tests/server_thread.py); the tests talk to it like any client would: the
SDK over a synchronous channel, and `kvserve generate|chat` as subprocesses.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.clients.inference_client import InferenceClient
from tests.server_thread import ModelServerThread

RPC_TIMEOUT_S = 60.0


def _start(model: Path) -> ModelServerThread:
    # CPU and a small fixed pool: quick to start, same results on any machine.
    return ModelServerThread(model, listen="127.0.0.1:0", kvcache="inprocess", device="cpu", num_pages=512)


@pytest.fixture(scope="session")
def model_server(tiny_dirs: dict[str, Path]) -> Iterator[ModelServerThread]:
    server = _start(tiny_dirs["tiny"])
    yield server
    server.stop()


@pytest.fixture
def client(model_server: ModelServerThread) -> Iterator[InferenceClient]:
    with InferenceClient(model_server.address, timeout=RPC_TIMEOUT_S) as c:
        yield c
