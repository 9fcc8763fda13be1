"""--no-prefix-caching: no request reads a page another computed, whatever ids the clients choose."""

from __future__ import annotations

import grpc

from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from tests.service.conftest import ModelServerThread
from tests.service.util import generate, request

PROMPT = list(range(300, 364))   # 64 tokens: 4 full pages at the test's page size


def test_no_request_reads_anothers_pages_even_under_a_reused_id(tiny_dirs):
    server = ModelServerThread(tiny_dirs["tiny"], prefix_caching=False)
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            cached = [generate(stub, request(request_id=rid, token_ids=PROMPT, temperature=0, max_tokens=2))
                      .prefill.cached_tokens for rid in ("req-1", "req-2", "req-1", "")]
        assert cached == [0, 0, 0, 0]   # the id was the salt: a reused one read the earlier prompt's pages
    finally:
        server.stop()
