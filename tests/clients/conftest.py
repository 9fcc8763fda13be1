"""Real model services (tiny checkpoint, in-process KV-cache manager) for the client tests: a
plaintext one, and ones serving TLS, mutual TLS and API keys, each made once per session.

The grpc.aio server runs on its own event loop in a daemon thread
(tests/server_thread.py); the tests talk to it like any client would: the
SDK over a synchronous channel, and `kvserve generate|chat` as subprocesses.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.clients.inference_client import InferenceClient
from tests.security.certs import Certs, make_certs
from tests.server_thread import ModelServerThread

RPC_TIMEOUT_S = 60.0
API_KEY = "client-test-key"
SERVER_NAME = "kvserve.test"   # a name only the server certificate knows: the override must be used


def _start(model: Path, **config) -> ModelServerThread:
    # CPU and a small fixed pool: quick to start, same results on any machine.
    return ModelServerThread(model, listen="127.0.0.1:0", kvcache="inprocess", device="cpu", num_pages=512,
                             **config)


def _serve(model: Path, **config) -> Iterator[ModelServerThread]:
    server = _start(model, **config)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def model_server(tiny_dirs: dict[str, Path]) -> Iterator[ModelServerThread]:
    server = _start(tiny_dirs["tiny"])
    yield server
    server.stop()


@pytest.fixture
def client(model_server: ModelServerThread) -> Iterator[InferenceClient]:
    with InferenceClient(model_server.address, timeout=RPC_TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("client-certs"), names=(SERVER_NAME,))


@pytest.fixture(scope="session")
def tls_server(tiny_dirs: dict[str, Path], certs: Certs) -> Iterator[ModelServerThread]:
    yield from _serve(tiny_dirs["tiny"], tls_cert=certs.server.cert, tls_key=certs.server.key)


@pytest.fixture(scope="session")
def mtls_server(tiny_dirs: dict[str, Path], certs: Certs) -> Iterator[ModelServerThread]:
    yield from _serve(tiny_dirs["tiny"], tls_cert=certs.server.cert, tls_key=certs.server.key,
                      tls_client_ca=certs.ca)


@pytest.fixture(scope="session")
def keyed_server(tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[ModelServerThread]:
    keys = tmp_path_factory.mktemp("client-keys") / "keys"
    keys.write_text(f"{API_KEY} tenant-a\n")
    yield from _serve(tiny_dirs["tiny"], api_keys=str(keys))
