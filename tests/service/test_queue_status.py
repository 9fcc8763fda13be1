"""A request waiting in a model service's own queue hears its place over gRPC, then that it
left the queue, before its prefill_done (engine/queue_positions.py); its tokens are the ones it
gets without waiting."""

from __future__ import annotations

import threading

import grpc

from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from tests.service.util import greedy, request, wait_until


def test_a_request_behind_a_full_batch_is_told_its_place_and_when_it_leaves(small_server):
    with grpc.insecure_channel(small_server.address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        alone = list(stub.Generate(request(token_ids=[9, 8, 7], **greedy(6)), timeout=60))
        engine = small_server.servicer.engine
        running: list = []
        ahead = threading.Thread(target=lambda: running.extend(
            stub.Generate(request(token_ids=[3, 4, 5], **greedy(60)), timeout=60)))
        ahead.start()
        wait_until(lambda: engine.num_live() == 1 and engine.num_queued() == 0, what="the first request running")
        behind = list(stub.Generate(request(token_ids=[9, 8, 7], **greedy(6)), timeout=60))
        ahead.join(60)
    kinds = [e.WhichOneof("event") for e in behind]
    assert kinds[:3] == ["queued", "queued", "prefill_done"], kinds
    assert [e.queued.position for e in behind[:2]] == [1, 0]
    assert "queued" not in [e.WhichOneof("event") for e in running + alone]   # never waited
    tokens = [[t for e in events if e.HasField("chunk") for t in e.chunk.token_ids] for events in (alone, behind)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6
