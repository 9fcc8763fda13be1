"""Two gateway replicas in front of the same workers, as behind one Kubernetes Service: a
Cancel that reaches the replica not streaming the request still ends it, and a conversation
whose turns come through different replicas stays on the worker holding it even when that
worker is the busier one."""

from __future__ import annotations

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from tests.gateway.conftest import GatewayThread, WorkerThreads
from tests.service.util import generate, greedy, request, wait_until


@pytest.fixture
def replicas(tiny_dirs):
    workers = [WorkerThreads(tiny_dirs["tiny"]) for _ in range(2)]
    gateways = []
    try:
        for _ in range(2):   # no slack: one request more makes a worker the busier one
            gateways.append(GatewayThread([w.address for w in workers], model=str(tiny_dirs["tiny"]),
                                          balance_slack=0))
            gateways[-1].wait_serving(2)
        channels = [grpc.insecure_channel(g.address) for g in gateways]
        yield gateways, [pb_grpc.InferenceStub(c) for c in channels], workers
        for c in channels:
            c.close()
    finally:
        for g in gateways:
            g.stop()
        for w in workers:
            w.stop()


def test_a_cancel_through_the_other_replica_ends_the_stream(replicas):
    _, (a, b), workers = replicas
    stream = a.Generate(request(token_ids=[5, 6, 7], request_id="long-one", **greedy(2000)), timeout=60)
    assert next(stream).HasField("prefill_done")
    b.Cancel(pb.CancelRequest(request_id="long-one"), timeout=10)   # replica b does not stream it
    events = list(stream)
    assert events[-1].finished.finish_reason == pb.FINISH_REASON_ABORT
    with pytest.raises(grpc.RpcError) as info:
        b.Cancel(pb.CancelRequest(request_id="nobody"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    for w in workers:
        wait_until(lambda w=w: w.model.servicer.stack.kv.stats().used_pages == 0, what="pages back")


def in_session(msg: pb.GenerateRequest, session_id: str) -> pb.GenerateRequest:
    msg.session_id = session_id
    return msg


def test_a_session_through_another_replica_stays_on_the_worker_holding_it(replicas):
    gateways, (a, b), workers = replicas
    prompt = list(range(100, 180))
    first = generate(a, in_session(request(token_ids=prompt, **greedy(8)), "chat-1"))
    holder = next(w for w in gateways[0].fleet.workers.values() if w.requests_routed == 1)
    for g in gateways:   # both replicas' indexes hold the first turn's pages (its worker's events)
        wait_until(lambda g=g: g.fleet.index.pages_of(holder.address) >= 20, what="the pages in the index")
    # the holder busier than the other worker, as replica b sees it: a long request sent to it directly
    channel = grpc.insecure_channel(holder.address)
    busy = pb_grpc.InferenceStub(channel).Generate(request(token_ids=[7, 8, 9], **greedy(1900)), timeout=60)
    assert next(busy).HasField("prefill_done")
    seen_by_b = gateways[1].fleet.workers[holder.address]
    wait_until(lambda: seen_by_b.load.running == 1, what="replica b seeing the holder busy")
    second = generate(b, in_session(request(token_ids=prompt + first.tokens + [42] * 8, **greedy(4)), "chat-1"))
    assert second.prefill.cached_tokens >= 80   # on the holder: its first turn's pages
    assert seen_by_b.requests_routed == 1
    busy.cancel()
    channel.close()
