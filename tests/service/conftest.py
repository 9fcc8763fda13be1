"""The real model service (tiny checkpoint, in-process KV-cache manager) over gRPC.

The grpc.aio server runs on its own event loop in a daemon thread
(tests/server_thread.py); tests talk to it with ordinary synchronous channels,
like any client. Fixtures yield a `Served` (unpacks as (address, servicer));
teardown stops the server, then the engine, then closes the manager link.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from tests import server_thread

# page_size 4 with 512 pages: max_model_len 2048 (the tiny model's), many pages per request.
BASE_CONFIG = dict(listen="127.0.0.1:0", kvcache="inprocess", device="cpu", page_size=4, num_pages=512)


class ModelServerThread(server_thread.ModelServerThread):
    """The shared test server with this package's defaults (BASE_CONFIG) under the overrides."""

    def __init__(self, model: Path, **overrides) -> None:
        super().__init__(model, **{**BASE_CONFIG, **overrides})


class Served(NamedTuple):
    address: str
    servicer: object  # model_service.servicer.InferenceServicer


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
