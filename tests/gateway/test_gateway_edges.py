"""The gateway where requests and workers misbehave, against scripted workers over real gRPC
(what each one streams, fails or answers is set by the test): a Cancel the worker does not know
yet, a move that must keep a client's own continuation, a request of n > 1 sequences split
across a move, prompts no worker can ever take, a
worker removed with streams on it, a look interval longer than a heartbeat, and the queue's
wake-ups."""

from __future__ import annotations

import asyncio
import re
import time
import types
from contextlib import contextmanager

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.kvcache.v1 import kvcache_pb2 as kv_pb
from kvserve.kvcache_service.contract.hashing import extra_key_digest
from kvserve.model_service.engine.errors import (ENDED_STOP_TOKEN_TRAILER, ENDED_STOP_TRAILER, ENDED_TRAILER,
                                                 FINAL_TRAILER, TAKEN_HEADER)
from kvserve.model_service.engine.family import child_seed
from kvserve.model_service.tokenizing import LONG_CHARS
from kvserve.services.gateway.inputs import InputError, Inputs
from kvserve.services.gateway.waiting import WaitQueue
from kvserve.services.plumbing import stats_watch
from kvserve.services.plumbing.retry_hints import NO_RETRY_TRAILER
from tests.gateway.conftest import GatewayThread
from tests.server_thread import LoopThread
from tests.service.util import greedy, request, rpc_error, wait_until


class ScriptedWorker(pb_grpc.InferenceServicer):
    """Streams `tokens` one every `delay_s` (failing UNAVAILABLE before token `fail_at`), reports
    `running` requests and room for more, answers Cancel NOT_FOUND (as a worker does for an id it
    has not registered yet), and records what it was sent."""

    def __init__(self, tokens=(5, 6, 7, 8), delay_s=0.0, fail_at=None, running=0, max_model_len=1000,
                 num_pages=100) -> None:
        self.tokens, self.delay_s, self.fail_at, self.running = list(tokens), delay_s, fail_at, running
        self.max_model_len, self.num_pages = max_model_len, num_pages
        self.requests: list[pb.GenerateRequest] = []
        self.cancels: list[str] = []
        self.calls_cancelled = 0
        self.watching = 0
        self.serving = True   # what its load reports say (False: "draining")

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(page_size=4, max_num_seqs=4, max_model_len=self.max_model_len, num_pages=self.num_pages,
                            extra_key_digest=extra_key_digest(""))

    async def WatchServerStats(self, request, context):
        try:
            _, heartbeat_s = stats_watch.periods(request)   # refused as a real worker refuses it
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.watching += 1
        try:
            while True:
                yield pb.ServerStats(serving=self.serving, not_serving="" if self.serving else "draining",
                                     running=self.running,
                                     kvcache=kv_pb.Stats(free_pages=self.num_pages, total_pages=self.num_pages))
                await asyncio.sleep(heartbeat_s)
        finally:
            self.watching -= 1

    async def Generate(self, request, context):
        copy = pb.GenerateRequest()
        copy.CopyFrom(request)
        self.requests.append(copy)
        try:
            yield pb.GenerateResponse(prefill_done=pb.PrefillDone(prompt_tokens=len(request.token_ids.ids)))
            for i, token in enumerate(self.tokens):
                if i == self.fail_at:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is going away")
                await asyncio.sleep(self.delay_s)
                yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[token]))
            yield pb.GenerateResponse(finished=pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH))
        except asyncio.CancelledError:
            self.calls_cancelled += 1
            raise

    async def Cancel(self, request, context):
        self.cancels.append(request.request_id)
        await context.abort(grpc.StatusCode.NOT_FOUND, f"no request {request.request_id!r} in flight")


@contextmanager
def scripted_fleet(tiny_dirs, *workers: ScriptedWorker, **gateway_config):
    """The workers on one private loop, a gateway in front; yields (gateway, stub, addresses)."""
    loop = LoopThread("scripted workers")
    servers, gateway, channel = [], None, None
    try:
        async def start(servicer):
            server = grpc.aio.server()
            pb_grpc.add_InferenceServicer_to_server(servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, f"127.0.0.1:{port}"
        started = [loop.call(start(w)) for w in workers]
        servers = [s for s, _ in started]
        addresses = [a for _, a in started]
        gateway = GatewayThread(addresses, model=str(tiny_dirs["tiny"]), **gateway_config)
        wait_until(lambda: len(gateway.fleet.board) == len(workers), what="every worker serving")
        channel = grpc.insecure_channel(gateway.address)
        yield gateway, pb_grpc.InferenceStub(channel), addresses
        # however its streams ended, none is left counted at a worker
        wait_until(lambda: not any(w.streaming or w.relays for w in gateway.fleet.workers.values()),
                   what="every worker's streams counted out")
    finally:
        if channel is not None:
            channel.close()
        if gateway is not None:
            gateway.stop()
        for server in servers:
            loop.call(server.stop(None))
        loop.close()


def tokens_of(events) -> list[int]:
    return [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids]


def test_a_cancel_the_worker_does_not_know_yet_still_ends_the_stream(tiny_dirs):
    worker = ScriptedWorker(tokens=range(10, 60), delay_s=0.05)
    with scripted_fleet(tiny_dirs, worker) as (_, stub, _):
        stream = stub.Generate(request(token_ids=[1, 2, 3], request_id="r1", **greedy(50)), timeout=30)
        first = [next(stream), next(stream)]      # prefill_done, the first token
        stub.Cancel(pb.CancelRequest(request_id="r1"), timeout=10)
        rest = list(stream)
        assert tokens_of(first) == [10] and rest[-1].finished.finish_reason == pb.FINISH_REASON_ABORT
        usage = rest[-1].finished.usage   # the usage so far, as a worker's own cancel gives it
        assert (usage.prompt_tokens, usage.completion_tokens) == (3, len(tokens_of(first + rest)))
        assert worker.cancels == ["r1"]
        wait_until(lambda: worker.calls_cancelled == 1, what="the call to the worker ended")
        err = rpc_error(lambda: stub.Cancel(pb.CancelRequest(request_id="r1"), timeout=10))
        assert err.code() == grpc.StatusCode.NOT_FOUND


def test_a_move_keeps_the_continuation_a_gateway_in_front_sent(tiny_dirs):
    failing = ScriptedWorker(tokens=[5, 6, 7, 8], fail_at=2)
    busier = ScriptedWorker(tokens=[7, 8], running=3)    # chosen only once the first fails
    with scripted_fleet(tiny_dirs, failing, busier, migration_limit=1) as (_, stub, _):
        msg = request(token_ids=[1, 2, 3], **greedy(6))
        msg.continuation.ids.extend([41, 42])             # streamed before, by another gateway's worker
        events = list(stub.Generate(msg, timeout=30))
        assert tokens_of(events) == [5, 6, 7, 8]
        assert list(failing.requests[0].continuation.ids) == [41, 42]
        assert list(busier.requests[0].continuation.ids) == [41, 42, 5, 6]
        # the client's request counts once in the gateway's totals, at each worker that prefilled it
        stats = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
        assert (stats.prompt_tokens, stats.generated_tokens) == (3, 4)
        assert sorted(w.prompt_tokens for w in stats.workers) == [3, 3]


def test_a_move_after_prefill_done_does_not_ask_for_the_prompts_logprobs_again(tiny_dirs):
    """The client has had them in prefill_done: the next worker neither computes them again nor
    skips its prefix cache for them; the request as the client sent it otherwise."""
    failing = ScriptedWorker(tokens=[5, 6, 7, 8], fail_at=2)
    busier = ScriptedWorker(tokens=[7, 8], running=3)
    with scripted_fleet(tiny_dirs, failing, busier, migration_limit=1) as (_, stub, _):
        events = list(stub.Generate(request(token_ids=[1, 2, 3], prompt_logprobs=2, **greedy(4)), timeout=30))
    assert tokens_of(events) == [5, 6, 7, 8]
    assert failing.requests[0].sampling.prompt_logprobs == 2
    assert not busier.requests[0].sampling.HasField("prompt_logprobs")
    assert busier.requests[0].sampling.max_tokens == 4 and list(busier.requests[0].continuation.ids) == [5, 6]


def drawn(seed: int, position: int) -> int:
    """The token a scripted sampler draws at `position` with `seed`: what a seeded worker's draw
    is, a function of the two alone."""
    return 10 + (seed * 31 + position * 7) % 1000


class SamplingWorker(ScriptedWorker):
    """Streams each of a request's n sequences one token a round, drawn as drawn() draws with the
    seed the sequence draws with (child_seed), from the continuation's end; sequence 1 of n > 1
    ends after `short` tokens (a stop condition); fails UNAVAILABLE at round `fail_at`."""

    def __init__(self, cached_tokens: int, short: int = 2, **kw) -> None:
        super().__init__(**kw)
        self.cached_tokens, self.short = cached_tokens, short

    async def Generate(self, request, context):
        copy = pb.GenerateRequest()
        copy.CopyFrom(request)
        self.requests.append(copy)
        n, p = request.sampling.n or 1, request.sampling
        start = len(request.continuation.ids)
        lengths = [self.short if (i == 1 and n > 1) else p.max_tokens for i in range(n)]
        try:
            yield pb.GenerateResponse(prefill_done=pb.PrefillDone(request_id=request.request_id, prompt_tokens=3,
                                                                  cached_tokens=self.cached_tokens))
            for position in range(start, p.max_tokens):
                if position - start == self.fail_at:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is going away")
                await asyncio.sleep(self.delay_s)
                for i in range(n):
                    if position < lengths[i]:
                        token = drawn(child_seed(p.seed, i), position)
                        yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[token]), index=i)
                    if position == lengths[i] - 1:
                        usage = pb.Usage(prompt_tokens=3, completion_tokens=lengths[i],
                                         cached_tokens=self.cached_tokens)
                        yield pb.GenerateResponse(finished=pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH,
                                                                       usage=usage), index=i)
        except asyncio.CancelledError:
            self.calls_cancelled += 1
            raise


def by_index(events) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for e in events:
        if e.HasField("chunk"):
            out.setdefault(e.index, []).extend(e.chunk.token_ids)
    return out


def test_a_request_of_n_sequences_moves_as_one_request_per_unfinished_sequence(tiny_dirs):
    """The worker fails after three rounds, sequence 1 already finished: sequences 0 and 2 go on
    at the other worker, each from its own tokens with its own seed, and the client's stream
    reads as one worker's would have."""
    failing = SamplingWorker(cached_tokens=2, fail_at=3)
    other = SamplingWorker(cached_tokens=1, running=3)    # chosen only once the first fails
    with scripted_fleet(tiny_dirs, failing, other, migration_limit=1) as (_, stub, _):
        msg = request(token_ids=[1, 2, 3], request_id="r", n=3, seed=7, temperature=1.0, max_tokens=6,
                      prompt_logprobs=0)
        events = list(stub.Generate(msg, timeout=30))
    want = {i: [drawn(child_seed(7, i), k) for k in range(2 if i == 1 else 6)] for i in range(3)}
    assert by_index(events) == want
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds.count("prefill_done") == 1 and "queued" not in kinds
    ends = {e.index: e.finished for e in events if e.HasField("finished")}
    assert sorted(ends) == [0, 1, 2] and kinds.count("finished") == 3
    # the cache hit the client was told at first, wherever each sequence ended
    assert all(f.usage.cached_tokens == 2 for f in ends.values())
    assert [f.usage.completion_tokens for f in (ends[0], ends[1], ends[2])] == [6, 2, 6]
    parts = sorted(other.requests, key=lambda r: r.request_id)
    # ids a client cannot pick: `<id>.<i>.<8 hex>` (`r.0` of the client's own met a part there)
    assert [re.fullmatch(r"r\.(\d)\.[0-9a-f]{8}", r.request_id)[1] for r in parts] == ["0", "2"]
    assert [(r.sampling.n, r.sampling.seed) for r in parts] == [(1, 7), (1, child_seed(7, 2))]
    assert not any(r.sampling.HasField("prompt_logprobs") for r in parts)   # the client had them
    assert [list(r.continuation.ids) for r in parts] == [want[0][:3], want[2][:3]]


def test_a_cancel_reaches_every_part_of_a_split_request(tiny_dirs):
    failing = SamplingWorker(cached_tokens=0, fail_at=2)
    slow = SamplingWorker(cached_tokens=0, running=3, delay_s=0.05)
    with scripted_fleet(tiny_dirs, failing, slow, migration_limit=1) as (_, stub, _):
        msg = request(token_ids=[1, 2, 3], request_id="c", n=3, seed=3, temperature=1.0, max_tokens=200)
        stream = stub.Generate(msg, timeout=30)
        seen = []
        for e in stream:   # past the split: a token the parts streamed
            seen.append(e)
            if len(slow.requests) == 2 and sum(e.HasField("chunk") for e in seen) >= 8:
                break
        stub.Cancel(pb.CancelRequest(request_id="c"), timeout=10)
        rest = list(stream)
    aborted = sorted(e.index for e in rest if e.HasField("finished"))
    assert aborted == [0, 2] and all(e.finished.finish_reason == pb.FINISH_REASON_ABORT
                                     for e in rest if e.HasField("finished"))
    assert [re.fullmatch(r"c\.(\d)\.[0-9a-f]{8}", c)[1] for c in sorted(slow.cancels)] == ["0", "2"]
    wait_until(lambda: slow.calls_cancelled == 2, what="both calls to the worker ended")


def test_a_request_of_n_cancelled_while_it_waits_ends_each_sequence(tiny_dirs):
    """Every worker full: the request waits in the gateway's queue; a Cancel ends each of its n
    sequences ABORT with its usage, as a worker's cancel would, not sequence 0 alone."""
    full = ScriptedWorker(running=50)
    with scripted_fleet(tiny_dirs, full) as (_, stub, _):
        stream = stub.Generate(request(token_ids=[1, 2, 3], request_id="q", n=3, temperature=1.0, max_tokens=5),
                               timeout=30)
        assert next(stream).HasField("queued")
        stub.Cancel(pb.CancelRequest(request_id="q"), timeout=10)
        ends = [e for e in stream if e.HasField("finished")]
    assert [e.index for e in ends] == [0, 1, 2] and not full.requests
    assert all(e.finished.finish_reason == pb.FINISH_REASON_ABORT and e.finished.usage.prompt_tokens == 3
               and e.finished.usage.completion_tokens == 0 for e in ends)


class HoldingWorker(SamplingWorker):
    """A SamplingWorker where other requests already hold some ids: those are ALREADY_EXISTS."""

    def __init__(self, held: set[str], **kw) -> None:
        super().__init__(**kw)
        self.held = held

    async def Generate(self, request, context):
        if request.request_id in self.held:
            self.requests.append(request)
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {request.request_id!r} is already in flight")
        async for response in super().Generate(request, context):
            yield response


def test_a_part_whose_id_another_request_holds_goes_on_under_a_fresh_one(tiny_dirs, monkeypatch):
    """The worker a split goes on at already runs a request of that part's id: that part goes
    on under a fresh id instead of ending the client's call ALREADY_EXISTS, and without spending
    a move. (Part ids are random; here the ones drawn are known.)"""
    import uuid

    from kvserve.services.gateway import relay
    drawn_ids = iter(range(1, 100))
    failing = SamplingWorker(cached_tokens=0, fail_at=3)
    other = HoldingWorker({"r.2.00000002"}, cached_tokens=0, running=3)
    with scripted_fleet(tiny_dirs, failing, other, migration_limit=1) as (_, stub, _):
        # (patched once the fleet is up: modules imported while it starts draw uuids too)
        monkeypatch.setattr(relay.uuid, "uuid4", lambda: uuid.UUID(int=next(drawn_ids) << 96))
        msg = request(token_ids=[1, 2, 3], request_id="r", n=3, seed=7, temperature=1.0, max_tokens=6)
        events = list(stub.Generate(msg, timeout=30))
    want = {i: [drawn(child_seed(7, i), k) for k in range(2 if i == 1 else 6)] for i in range(3)}
    assert by_index(events) == want
    ids = [r.request_id for r in other.requests]
    assert sorted(ids)[:2] == ["r.0.00000001", "r.2.00000002"] and len(ids) == 3
    (fresh,) = [i for i in ids if i not in ("r.0.00000001", "r.2.00000002")]
    assert fresh == "r.2.00000002.00000003"


def test_a_split_request_ends_unavailable_when_a_part_runs_out_of_moves(tiny_dirs):
    failing = SamplingWorker(cached_tokens=0, fail_at=2)
    also_failing = SamplingWorker(cached_tokens=0, fail_at=1, running=3)
    with scripted_fleet(tiny_dirs, failing, also_failing, migration_limit=1) as (_, stub, _):
        msg = request(token_ids=[1, 2, 3], n=3, seed=3, temperature=1.0, max_tokens=8)
        err = rpc_error(lambda: list(stub.Generate(msg, timeout=30)))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "--migration-limit" in err.details()


def test_a_prompt_no_worker_can_take_is_refused_and_the_queue_goes_on(tiny_dirs):
    small = ScriptedWorker(max_model_len=64, num_pages=10)   # 40 tokens of cache
    with scripted_fleet(tiny_dirs, small) as (_, stub, _):
        err = rpc_error(lambda: stub.Generate(request(token_ids=[5] * 64, **greedy(4)), timeout=10))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the prompt has 64 tokens; the model length is 64" in err.details()
        err = rpc_error(lambda: stub.Generate(request(token_ids=[5] * 48, **greedy(4)), timeout=10))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "KV cache holds 40" in err.details()
        err = rpc_error(lambda: stub.Generate(request(prompt="hello " * 100, **greedy(4)), timeout=10))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "the model length is 64" in err.details()
        assert tokens_of(stub.Generate(request(token_ids=[5] * 8, **greedy(4)), timeout=10)) == [5, 6, 7, 8]
        # max_tokens unset: min_tokens past what the model length leaves, as the worker would refuse it
        err = rpc_error(lambda: list(stub.Generate(request(token_ids=[5] * 8, min_tokens=60), timeout=10)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == "prompt (8 tokens) + min_tokens (60) = 68 exceeds the model length 64"


def test_min_tokens_goes_to_a_worker_whose_model_length_leaves_it_room(tiny_dirs):
    """max_tokens unset, a worker refuses min_tokens past what its model length leaves: in a
    fleet mixing --max-model-len such a request goes to a longer worker, whichever is idler."""
    short, long_ = ScriptedWorker(max_model_len=64), ScriptedWorker(max_model_len=1000, running=3)
    with scripted_fleet(tiny_dirs, short, long_) as (_, stub, _):
        for _ in range(4):
            assert tokens_of(stub.Generate(request(token_ids=[5] * 8, min_tokens=100), timeout=10)) == [5, 6, 7, 8]
        assert (len(short.requests), len(long_.requests)) == (0, 4)


def test_a_request_only_a_worker_away_could_take_is_refused_as_worth_a_retry(tiny_dirs):
    """While the only worker long enough for a request is away, the request is refused
    UNAVAILABLE (a client's retry will do), not INVALID_ARGUMENT; one too long for every worker
    stays INVALID_ARGUMENT; once the worker is back it takes the request."""
    short, long_ = ScriptedWorker(max_model_len=64), ScriptedWorker(max_model_len=1000)
    with scripted_fleet(tiny_dirs, short, long_, poll_interval_s=0.05) as (gateway, stub, _):
        long_.serving = False
        wait_until(lambda: len(gateway.fleet.board) == 1, what="the long worker off the board")
        for msg in (request(token_ids=[5] * 100, **greedy(4)), request(prompt="hello " * 100, **greedy(4))):
            err = rpc_error(lambda: list(stub.Generate(msg, timeout=10)))
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
            assert "the model length is 64" in err.details() and "once it is back: try again later" in err.details()
            # the request's own status: a gateway in front of this one passes it on rather than moving it
            assert dict(err.trailing_metadata() or ()).get(FINAL_TRAILER) == "1"
        err = rpc_error(lambda: list(stub.Generate(request(token_ids=[5] * 1000, **greedy(4)), timeout=10)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "the prompt has 1000 tokens" in err.details()
        long_.serving = True
        wait_until(lambda: len(gateway.fleet.board) == 2, what="the long worker back")
        assert tokens_of(stub.Generate(request(token_ids=[5] * 100, **greedy(4)), timeout=10)) == [5, 6, 7, 8]
        assert (len(short.requests), len(long_.requests)) == (0, 1)


def test_a_session_id_too_long_to_remember_is_refused(tiny_dirs):
    worker = ScriptedWorker()
    with scripted_fleet(tiny_dirs, worker) as (_, stub, _):
        msg = request(token_ids=[1, 2, 3], **greedy(4))
        msg.session_id = "s" * 257
        err = rpc_error(lambda: stub.Generate(msg, timeout=10))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "session id has 257 characters" in err.details()
        msg = request(request_id="a\nb", token_ids=[1, 2, 3], **greedy(4))   # refused before routing, as
        err = rpc_error(lambda: stub.Generate(msg, timeout=10))           # its worker would refuse it
        assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                               "the request id contains control characters")
        assert not worker.requests


class TrustingWorker(ScriptedWorker):
    """Takes each request's tenant from the gateway's metadata, as a worker behind a keyed gateway."""

    async def GetModelInfo(self, request, context):
        info = await super().GetModelInfo(request, context)
        info.trusts_tenant_metadata = True
        return info


def test_each_tenants_sessions_are_its_own(tiny_dirs, tmp_path):
    """The gateway remembered sessions by their bare ids: a tenant sending another's session id
    (OpenAI's `user`, "alice") was sent to that tenant's worker, learning from the routed counts
    that the id was in use, and moved it off its worker for the other."""
    keys = tmp_path / "keys"
    keys.write_text("key-a alpha\nkey-b beta\n")
    with scripted_fleet(tiny_dirs, TrustingWorker(), TrustingWorker(), api_keys=str(keys)) as (gateway, stub, _):
        for key in ("key-a", "key-b"):
            msg = request(token_ids=[1, 2, 3], **greedy(4))
            msg.session_id = "alice"
            assert tokens_of(stub.Generate(msg, timeout=10, metadata=(("authorization", f"Bearer {key}"),))) == \
                [5, 6, 7, 8]
        assert sorted(gateway.fleet._sessions) == ["alpha\x00alice", "beta\x00alice"]


class CuttingASlowClient(ScriptedWorker):
    """Streams two tokens, then ends the call as a worker ends a client too slow to read it:
    RESOURCE_EXHAUSTED, the request's own status (passed on, not moved)."""

    async def Generate(self, request, context):
        self.requests.append(request)
        yield pb.GenerateResponse(prefill_done=pb.PrefillDone(prompt_tokens=len(request.token_ids.ids)))
        yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[5, 6]))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the client did not read its stream",
                            ((FINAL_TRAILER, "1"),))


def test_a_stream_ended_by_an_error_after_it_ran_counts_as_failed_not_refused(tiny_dirs):
    """The refused count is of calls refused before they ran (load shed, bad input)."""
    with scripted_fleet(tiny_dirs, CuttingASlowClient()) as (gateway, stub, _):
        err = rpc_error(lambda: list(stub.Generate(request(token_ids=[1, 2, 3], **greedy(8)), timeout=10)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        wait_until(lambda: gateway.fleet.ended["failed"] == 1, what="the stream counted as failed")
        assert not gateway.fleet.refused


def test_a_cancel_under_an_id_generate_refuses_is_not_found_and_reaches_no_worker(tiny_dirs):
    """A NUL in it could spell another tenant's id at a worker that trusts its fronts' tenants."""
    worker = ScriptedWorker()
    with scripted_fleet(tiny_dirs, worker) as (_, stub, _):
        err = rpc_error(lambda: stub.Cancel(pb.CancelRequest(request_id="alpha\x00job-1"), timeout=10))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        assert not worker.cancels


def test_an_n_past_max_n_is_refused_before_it_waits_or_is_routed(tiny_dirs):
    """As its worker would refuse it; a request waiting here with n in the billions would end with
    as many ABORT events on a Cancel, and count as that many sequences on its worker's load."""
    from kvserve.model_service.config import ModelServiceConfig
    from kvserve.services.gateway.config import GatewayConfig

    # above any worker's default: a fleet run with a larger --max-n is not refused here by default
    assert GatewayConfig.max_n >= ModelServiceConfig.max_n
    worker = ScriptedWorker()
    with scripted_fleet(tiny_dirs, worker, max_n=4) as (_, stub, _):
        err = rpc_error(lambda: list(stub.Generate(request(token_ids=[1, 2, 3], n=2**32 - 1, **greedy(4)),
                                                    timeout=10)))
        assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                               "n must be an integer in [1, 4] (--max-n), got 4294967295")
        assert not worker.requests


def test_a_removed_workers_streams_stay_watched_until_they_end(tiny_dirs):
    slow, other = ScriptedWorker(tokens=range(10, 50), delay_s=0.05), ScriptedWorker(running=3)
    with scripted_fleet(tiny_dirs, slow, other) as (gateway, stub, (slow_address, _)):
        stream = stub.Generate(request(token_ids=[1, 2, 3], **greedy(40)), timeout=30)
        assert tokens_of([next(stream), next(stream)]) == [10]
        gateway.call(gateway.fleet.remove(slow_address))
        assert slow_address not in {w.address for w in gateway.fleet.board}
        time.sleep(0.5)                             # a stream closed on removal would have ended by now
        assert slow.watching == 1                   # its load still followed: a failure would move the stream
        assert len(list(stream)) == 40              # 39 tokens and the end
        wait_until(lambda: slow.watching == 0, what="the load stream of the removed worker closed")
        assert len(other.requests) == 0


def test_a_look_interval_longer_than_a_heartbeat_is_asked_for_as_the_worker_allows(tiny_dirs):
    with scripted_fleet(tiny_dirs, ScriptedWorker(), poll_interval_s=2.0) as (gateway, stub, _):
        assert {w.state for w in gateway.fleet.workers.values()} == {"serving"}
        assert tokens_of(stub.Generate(request(token_ids=[1, 2, 3], **greedy(4)), timeout=10)) == [5, 6, 7, 8]


def test_look_intervals_out_of_range_are_refused_at_start():
    from kvserve.services.gateway.config import GatewayConfig

    for bad in (0.001, 61.0, float("nan")):
        with pytest.raises(ValueError, match="--poll-interval must be from 0.01 to 60 seconds"):
            GatewayConfig(worker=("127.0.0.1:1",), poll_interval_s=bad)


@pytest.mark.parametrize("flags, words", [
    (dict(listen="127.0.0.1"), "--listen: '127.0.0.1': missing port"),
    (dict(worker=("127.0.0.1",)), "--worker: '127.0.0.1': missing port"),
    (dict(worker=("127.0.0.1:0",)), "--worker 127.0.0.1:0: a worker is dialled on a port from 1 to 65535"),
    (dict(workers_dns="workers:99999"), "--workers-dns: 'workers:99999': port 99999 is out of range"),
])
def test_addresses_no_one_can_serve_or_dial_are_refused_at_start(flags, words):
    from kvserve.services.gateway.config import GatewayConfig

    with pytest.raises(ValueError, match=re.escape(words)):
        GatewayConfig(**{"worker": ("127.0.0.1:1",), **flags})


def test_prompts_and_chats_over_the_character_limit_are_refused_before_tokenizing():
    inputs = Inputs(tokenizer=None, threads=1, max_prompt_chars=100)   # never reached: no tokenizer needed
    try:
        with pytest.raises(InputError, match="the prompt has 101 characters; at most 100"):
            asyncio.run(inputs.ids(request(prompt="x" * 101)))
        chat = request(messages=[("user", "x" * 60), ("assistant", "y" * 60)])
        with pytest.raises(InputError, match="the chat messages have 120 characters; at most 100"):
            asyncio.run(inputs.ids(chat))
    finally:
        inputs.close()


def test_a_chat_of_more_messages_than_the_workers_take_is_refused_before_rendering():
    inputs = Inputs(tokenizer=None, threads=1, max_chat_messages=3)   # never reached: no tokenizer needed
    try:
        with pytest.raises(InputError, match=r"4 chat messages; at most 3 are allowed \(--max-chat-messages\)"):
            asyncio.run(inputs.ids(request(messages=[("user", "")] * 4)))
    finally:
        inputs.close()


def test_a_role_past_64_characters_is_refused_before_rendering():
    inputs = Inputs(tokenizer=None, threads=1)   # never reached: no tokenizer needed
    try:
        with pytest.raises(InputError, match=r"messages\[0\].role has 65 characters; at most 64"):
            asyncio.run(inputs.ids(request(messages=[("r" * 65, "hi")])))
    finally:
        inputs.close()


def test_a_message_with_no_input_is_told_the_inputs_its_rpc_has():
    inputs = Inputs(SlowTokenizer(0.0), threads=1)
    try:
        with pytest.raises(InputError, match=r"^set one input: prompt, token_ids or messages$"):
            asyncio.run(inputs.ids(pb.GenerateRequest()))
        with pytest.raises(InputError, match=r"^set one input: prompt or messages$"):   # Tokenize has no token_ids
            asyncio.run(inputs.ids(pb.TokenizeRequest()))
    finally:
        inputs.close()


class SlowTokenizer:
    """Takes `slow_s` for a text over the long lane's bound, nothing for a short one."""

    def __init__(self, slow_s: float) -> None:
        self.slow_s = slow_s

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > LONG_CHARS:
            time.sleep(self.slow_s)
        return [1]


def test_long_prompts_do_not_hold_a_short_one_up():
    """As at a worker: texts over 32,768 characters are tokenized in a lane of their own, so a
    short prompt arriving behind a pair of them is done while they still run."""
    inputs = Inputs(SlowTokenizer(1.0), threads=2)

    async def scenario():
        long = [asyncio.ensure_future(inputs.ids(request(prompt="x" * (LONG_CHARS + 1)))) for _ in range(2)]
        await asyncio.sleep(0.05)   # both long ones taken up (the first) or waiting behind it
        assert await inputs.ids(request(prompt="short")) == [1]
        assert not any(f.done() for f in long)
        assert await asyncio.gather(*long) == [[1], [1]]
    try:
        asyncio.run(scenario())
    finally:
        inputs.close()


def test_a_message_over_max_request_bytes_is_resource_exhausted_at_the_gateway_too(tiny_dirs):
    with scripted_fleet(tiny_dirs, ScriptedWorker(), max_request_bytes=4096) as (_, stub, _):
        err = rpc_error(lambda: list(stub.Generate(request(prompt="x" * 5000, **greedy(4)), timeout=10)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert tokens_of(stub.Generate(request(token_ids=[5] * 8, **greedy(4)), timeout=10)) == [5, 6, 7, 8]


def test_streams_moving_back_to_the_front_keep_the_order_they_came_in():
    """Streams moved off a failed worker go ahead of the queue: each went to the very front, so
    several moved together were served last in, first out."""
    async def scenario():
        queue = WaitQueue(8)
        queue.enter("new-1"), queue.enter("new-2")
        queue.enter("moved-b", front=True, arrived=5.0)
        queue.enter("moved-a", front=True, arrived=3.0)   # came to the gateway before b
        queue.enter("moved-c", front=True, arrived=9.0)
        order = sorted(queue._waiters, key=queue.position)
        assert [w.request_id for w in order] == ["moved-a", "moved-b", "moved-c", "new-1", "new-2"]
        assert queue.fronts_before(4.0) == 1 and queue.fronts_before(10.0) == 3 and queue.fronts_before(1.0) == 0
    asyncio.run(scenario())


def test_room_wakes_only_the_head_and_a_move_wakes_everyone():
    async def scenario():
        queue = WaitQueue(8)
        head, second = queue.enter("a"), queue.enter("b")
        looks = {"a": 0, "b": 0}

        async def wait(waiter, name):
            await queue.changed(waiter, timeout_s=5)
            looks[name] += 1
        tasks = [asyncio.create_task(wait(head, "a")), asyncio.create_task(wait(second, "b"))]
        await asyncio.sleep(0)
        queue.wake()                                # room: the head looks, the second has nothing to see
        await asyncio.sleep(0.01)
        assert looks == {"a": 1, "b": 0}
        queue.leave(head)                           # positions move: the second looks
        await asyncio.wait_for(tasks[1], 1)
        assert looks == {"a": 1, "b": 1}
    asyncio.run(scenario())


def test_a_storm_of_leaves_costs_each_waiter_a_look_or_two_and_positions_stay_right():
    """A thousand cancels in a row once woke every waiter for each (and each re-counted its place
    from the head): 334 s for 1,200 cancels. Moved positions are now told at most every
    TELL_EVERY_S, and counted once."""
    async def scenario():
        queue = WaitQueue(1000)
        waiters = [queue.enter(f"r{i}") for i in range(300)]
        looks = [0] * 300

        async def watch(i):
            while True:
                await queue.changed(waiters[i], timeout_s=30)
                looks[i] += 1
        tasks = [asyncio.create_task(watch(i)) for i in range(300)]
        await asyncio.sleep(0)
        for w in waiters[:200:2]:   # a hundred leave, one after another
            queue.leave(w)
        await asyncio.sleep(2 * WaitQueue.TELL_EVERY_S)
        stay = [i for i in range(300) if not (i < 200 and i % 2 == 0)]
        assert max(looks[i] for i in stay) <= 2, max(looks)
        assert [queue.position(waiters[i]) for i in stay] == list(range(1, 201))
        before = sum(looks)
        queue.poke(waiters[5])   # a cancel wakes the one cancelled, not the queue
        for _ in range(500):   # (a loaded machine may take more than a moment to run its look)
            if looks[5] == 2:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)   # time for any other look to show
        assert looks[5] == 2 and sum(looks) == before + 1 == sum(looks[i] for i in stay)
        for t in tasks:
            t.cancel()
    asyncio.run(scenario())


def test_a_gateway_loop_busy_past_the_silence_does_not_call_a_reporting_worker_down(tiny_dirs, caplog):
    """The worker reports every second; the gateway's own loop is held 4 s (a storm of work): its
    silence timer fires late, the reports wait unread behind the backlog, and it is the loop, not
    the worker, that was silent."""
    worker = ScriptedWorker()
    with scripted_fleet(tiny_dirs, worker) as (gateway, stub, _):
        (w,) = gateway.fleet.workers.values()
        gateway.call(asyncio.sleep(0))
        gateway.loop.call_soon_threadsafe(time.sleep, 4.0)   # the whole loop held
        time.sleep(5.0)
        assert w.state == "serving"
        assert not [r for r in caplog.records if "is down" in r.getMessage()]
        assert tokens_of(stub.Generate(request(token_ids=[5] * 8, **greedy(4)), timeout=10)) == [5, 6, 7, 8]


def test_a_request_larger_than_the_workers_take_is_refused_once_and_moves_nowhere(tiny_dirs):
    """The workers' gRPC refuses it for its size (RESOURCE_EXHAUSTED): every worker would, so the
    gateway says so at once rather than moving it as if each had failed. Its HTTP front takes no
    body past its own --max-request-bytes (it took 8 MiB whatever the flag said)."""
    import http.client
    import json

    from tests.gateway.conftest import make_fleet
    stops = [f"{i:03d}" + "s" * 997 for i in range(36)]   # 36,000 characters: past the workers' limit alone
    for fleet in make_fleet(tiny_dirs["tiny"], 2, worker_config={"max_request_bytes": 32 << 10},
                            http_listen="127.0.0.1:0", max_request_bytes=40 << 10):
        err = rpc_error(lambda: list(fleet.stub.Generate(request(prompt="hello", max_tokens=2, stop=stops),
                                                         timeout=30)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.details().startswith("the request is larger than the workers take"), err.details()
        assert fleet.gateway.fleet.migrations == 0
        host, port = fleet.gateway.gateway.http_front.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            body = json.dumps({"prompt": "hello", "max_tokens": 2, "stop": stops + stops})   # past the gateway's
            conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
            reply = conn.getresponse()
            assert reply.status == 413 and b"larger than 40960 bytes" in reply.read()
        finally:
            conn.close()


class EndlessWorker(ScriptedWorker):
    """Streams every token of a request (max_tokens of them) and fails before its finished."""

    async def Generate(self, request, context):
        self.requests.append(request)
        yield pb.GenerateResponse(prefill_done=pb.PrefillDone(request_id=request.request_id, prompt_tokens=3))
        for k in range(request.sampling.max_tokens):
            yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[10 + k]))
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is going away")


class StrictWorker(ScriptedWorker):
    """Refuses a continuation that leaves nothing to generate, as a worker's request builder does."""

    async def Generate(self, request, context):
        self.requests.append(request)
        if len(request.continuation.ids) >= request.sampling.max_tokens:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the continuation has {len(request.continuation.ids)} tokens; max_tokens "
                                f"({request.sampling.max_tokens}) leaves none to generate",
                                ((ENDED_TRAILER, "FINISH_REASON_LENGTH"),))
        yield pb.GenerateResponse(prefill_done=pb.PrefillDone(request_id=request.request_id, prompt_tokens=3))


def test_a_worker_failing_between_the_last_token_and_its_end_ends_the_stream_as_it_would_have(tiny_dirs):
    """Every token was streamed, the finished was not: the next worker refuses a continuation
    that leaves nothing to generate, and that refusal reached the client as INVALID_ARGUMENT
    for a complete answer. The gateway ends the stream itself, with the usage."""
    endless = EndlessWorker(running=0)
    strict = StrictWorker(running=3)   # busier: the request goes to the endless worker first
    with scripted_fleet(tiny_dirs, endless, strict) as (_, stub, _):
        events = list(stub.Generate(request(token_ids=[1, 2, 3], max_tokens=4, temperature=0.0), timeout=30))
    assert [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids] == [10, 11, 12, 13]
    (end,) = [e.finished for e in events if e.HasField("finished")]
    assert end.finish_reason == pb.FINISH_REASON_LENGTH and end.usage.completion_tokens == 4
    assert end.usage.prompt_tokens == 3 and len(strict.requests) == 1



class StoppedWorker(ScriptedWorker):
    """Refuses every continuation as already ended by a stop, saying which as a worker does."""

    def __init__(self, said: tuple, **kwargs) -> None:
        super().__init__(**kwargs)
        self.said = said

    async def Generate(self, request, context):
        self.requests.append(request)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the continuation already meets a stop condition",
                            ((ENDED_TRAILER, "FINISH_REASON_STOP"), *self.said))
        yield pb.GenerateResponse()


@pytest.mark.parametrize("said, stop, stop_token_id", [
    (((ENDED_STOP_TRAILER, "1"),), "b", None),
    (((ENDED_STOP_TOKEN_TRAILER, "30"),), "", 30),
    (((ENDED_STOP_TRAILER, "7"), (ENDED_STOP_TOKEN_TRAILER, "x")), "", None),   # nonsense: left out
    (((ENDED_STOP_TRAILER, "-1"), (ENDED_STOP_TOKEN_TRAILER, "--5")), "", None),
    (((ENDED_STOP_TRAILER, "9" * 5000), (ENDED_STOP_TOKEN_TRAILER, "4294967296")), "", None),
])
def test_a_stream_the_next_worker_finds_ended_by_a_stop_says_which_stop(tiny_dirs, said, stop, stop_token_id):
    """The finished the gateway writes for it names the stop string or token id, as the worker
    that failed would have (the HTTP front's stop_reason reads them)."""
    endless, stopped = EndlessWorker(running=0), StoppedWorker(said, running=3)
    with scripted_fleet(tiny_dirs, endless, stopped) as (_, stub, _):
        events = list(stub.Generate(request(token_ids=[1, 2, 3], max_tokens=4, temperature=0.0, stop=["a", "b"]),
                                    timeout=30))
    (end,) = [e.finished for e in events if e.HasField("finished")]
    assert end.finish_reason == pb.FINISH_REASON_STOP and end.usage.completion_tokens == 4
    assert end.stop == stop
    assert (end.stop_token_id if end.HasField("stop_token_id") else None) == stop_token_id


class FailingOnce(ScriptedWorker):
    """Fails its first request UNAVAILABLE after `fail_at` tokens; streams a continuation on
    from where it left off."""

    async def Generate(self, request, context):
        self.requests.append(request)
        skip = len(request.continuation.ids)
        yield pb.GenerateResponse(prefill_done=pb.PrefillDone(prompt_tokens=len(request.token_ids.ids)))
        for i, token in enumerate(self.tokens[skip:]):
            if len(self.requests) == 1 and i == self.fail_at:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is going away")
            await asyncio.sleep(self.delay_s)
            yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[token]))
        yield pb.GenerateResponse(finished=pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH, ttft_ms=1.0,
                                                       total_ms=2.0))


def test_a_moved_streams_times_count_from_its_arrival_at_the_gateway(tiny_dirs):
    """A worker's ttft_ms and total_ms cover its own call: a moved stream's said only the last
    worker's part."""
    failing = FailingOnce(tokens=[5, 6, 7, 8], fail_at=2, delay_s=0.25)
    busier = ScriptedWorker(tokens=[7, 8], running=3)
    with scripted_fleet(tiny_dirs, failing, busier, migration_limit=1) as (_, stub, _):
        start = time.monotonic()
        events = list(stub.Generate(request(token_ids=[1, 2, 3], **greedy(4)), timeout=30))
        took_ms = 1e3 * (time.monotonic() - start)
    assert tokens_of(events) == [5, 6, 7, 8] and len(busier.requests) == 1
    (end,) = [e.finished for e in events if e.HasField("finished")]
    assert 250 <= end.ttft_ms < end.total_ms <= took_ms   # the first token came after one delay
    assert end.total_ms >= 500                             # and the second after two, before the move


class TwoChoices(ScriptedWorker):
    """Answers n = 2: choice 0's token at once, choice 1's after `delay_s`, each ending on its own."""

    async def Generate(self, request, context):
        self.requests.append(request)
        yield pb.GenerateResponse(prefill_done=pb.PrefillDone(prompt_tokens=len(request.token_ids.ids)))
        yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[5]), index=0)
        yield pb.GenerateResponse(finished=pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH), index=0)
        await asyncio.sleep(self.delay_s)
        yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[6]), index=1)
        yield pb.GenerateResponse(finished=pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH), index=1)


def test_each_choice_of_a_request_is_timed_from_its_own_first_token(tiny_dirs):
    """Every choice of n > 1 through the gateway said the request's first token as its ttft_ms, as
    a worker does not."""
    with scripted_fleet(tiny_dirs, TwoChoices(delay_s=0.3)) as (_, stub, _):
        events = list(stub.Generate(request(token_ids=[1, 2, 3], n=2, max_tokens=1, temperature=0.0), timeout=30))
    ends = {e.index: e.finished for e in events if e.HasField("finished")}
    assert ends[0].ttft_ms < ends[1].ttft_ms <= ends[1].total_ms and ends[1].ttft_ms >= 300, ends


def test_a_moved_stream_without_max_tokens_goes_only_where_its_tokens_fit(tiny_dirs):
    """In a fleet mixing --max-model-len, a stream that has run past a short worker's length
    goes on only at a worker that holds it: the short one ended it LENGTH (or refused the
    continuation) as if the client's request were at fault."""
    long_ = FailingOnce(tokens=list(range(100, 170)), fail_at=60, max_model_len=1000)
    short = ScriptedWorker(tokens=[9], max_model_len=64, running=3)   # busier: long is chosen first
    with scripted_fleet(tiny_dirs, long_, short, migration_limit=1) as (_, stub, _):
        events = list(stub.Generate(request(token_ids=[5] * 8, temperature=0.0), timeout=30))
    assert tokens_of(events) == list(range(100, 170))
    assert len(short.requests) == 0 and len(long_.requests) == 2
    assert list(long_.requests[1].continuation.ids) == list(range(100, 160))


class SinkWorker(ScriptedWorker):
    async def GetModelInfo(self, request, context):
        info = await super().GetModelInfo(request, context)
        info.attention_sink = 4
        return info


def test_a_moved_stream_without_max_tokens_goes_to_no_sink_worker_it_has_outrun(tiny_dirs):
    """Attention sinks let a stream run past the model length only where max_tokens asks for
    it: with max_tokens unset the worker's bound is its model length, and it would end the
    moved stream LENGTH."""
    long_ = FailingOnce(tokens=list(range(100, 170)), fail_at=60, max_model_len=1000)
    short = SinkWorker(tokens=[9], max_model_len=64, running=3)
    with scripted_fleet(tiny_dirs, long_, short, migration_limit=1) as (_, stub, _):
        events = list(stub.Generate(request(token_ids=[5] * 8, temperature=0.0), timeout=30))
    assert tokens_of(events) == list(range(100, 170))
    assert len(short.requests) == 0 and len(long_.requests) == 2


class PrefillFailure(ScriptedWorker):
    """Fails every request UNAVAILABLE before its prefill_done (its process died mid-prefill)."""

    async def Generate(self, request, context):
        self.requests.append(request)
        await asyncio.sleep(1.5)   # a load report (a heartbeat a second) comes first
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is going away")


def test_a_request_moved_before_its_prefill_done_waits_at_the_head_of_the_queue(tiny_dirs):
    """Moved before any event of the worker reached its client, it went to the back of the
    queue as a new request would, or was refused RESOURCE_EXHAUSTED by a full one."""
    failing = PrefillFailure(running=5)   # room for one more request (4 in a batch + 2 queued)
    busy = ScriptedWorker(running=10)     # no room until the test makes some
    with scripted_fleet(tiny_dirs, failing, busy, max_queued=1) as (gateway, stub, _):
        moved = stub.Generate(request(token_ids=[1, 2, 3], request_id="moved", max_tokens=4), timeout=30)
        wait_until(lambda: len(failing.requests) == 1, what="the first request at the failing worker")
        failing.running = 6   # full from its next report on: the moved request cannot go back there
        later = stub.Generate(request(token_ids=[4, 5, 6], request_id="later", max_tokens=4), timeout=30)
        wait_until(lambda: len(gateway.fleet.queue) == 1, what="the later request queued")
        wait_until(lambda: gateway.fleet.migrations == 1, what="the first request moved")
        wait_until(lambda: len(gateway.fleet.queue) == 2, what="the moved request waiting again")
        busy.running = 0
        moved_events, later_events = list(moved), list(later)
    assert [r.request_id for r in busy.requests] == ["moved", "later"]   # the moved one first
    assert moved_events[-1].HasField("finished") and later_events[-1].HasField("finished")
    assert not any(e.HasField("queued") for e in moved_events)   # to its client the stream only paused


class TakenThenLost(ScriptedWorker):
    """Takes every request in (its response headers say so, as a worker's do), then fails it
    UNAVAILABLE before its prefill_done: its process died computing the prompt."""

    async def Generate(self, request, context):
        self.requests.append(request)
        await context.send_initial_metadata(((TAKEN_HEADER, "1"),))
        await asyncio.sleep(1.5)   # a load report (a heartbeat a second) comes first
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is going away")


def test_a_request_two_workers_failed_while_computing_its_prompt_goes_to_no_third(tiny_dirs):
    """A query of death: with --migration-limit 3 it took four workers down. Two workers lost
    with it taken and before their prefill_done end it INTERNAL, and the third never sees it."""
    workers = [TakenThenLost(running=0) for _ in range(3)]
    with scripted_fleet(tiny_dirs, *workers, migration_limit=3) as (gateway, stub, _):
        err = rpc_error(lambda: list(stub.Generate(request(token_ids=[1, 2, 3], max_tokens=4), timeout=30)))
        assert err.code() == grpc.StatusCode.INTERNAL
        assert err.details().startswith("2 workers failed while computing the request's prompt (the last: "
                                        "it became unavailable); it is sent to no other")
        assert sorted(len(w.requests) for w in workers) == [0, 1, 1] and gateway.fleet.migrations == 1
        assert (NO_RETRY_TRAILER, "1") in err.trailing_metadata()   # an HTTP front says: do not retry


class QueuedThenLost(ScriptedWorker):
    """Takes every request in and tells it its place in the worker's queue (then, with `leaves`,
    that it left the queue: its prompt computing), then fails it before its prefill_done."""

    def __init__(self, leaves: bool, **kw) -> None:
        super().__init__(**kw)
        self.leaves = leaves

    async def Generate(self, request, context):
        self.requests.append(request)
        await context.send_initial_metadata(((TAKEN_HEADER, "1"),))
        yield pb.GenerateResponse(queued=pb.QueueStatus(position=2, eta_ms=40))
        yield pb.GenerateResponse(queued=pb.QueueStatus(position=1, eta_ms=20))
        if self.leaves:
            yield pb.GenerateResponse(queued=pb.QueueStatus(position=0))
        await asyncio.sleep(1.5)   # a load report (a heartbeat a second) comes first
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is going away")


def test_workers_that_fail_while_the_request_waits_in_their_queue_do_not_count_it_as_a_query_of_death(tiny_dirs):
    """Queued behind what the worker was computing, the request cannot be what made it fail: it
    moves on as far as --migration-limit allows, and its client heard the first worker's queue."""
    workers = [QueuedThenLost(leaves=False, running=0) for _ in range(3)]
    with scripted_fleet(tiny_dirs, *workers, migration_limit=2) as (gateway, stub, _):
        heard = []
        err = rpc_error(lambda: heard.extend(stub.Generate(request(token_ids=[1, 2, 3], max_tokens=4), timeout=30)))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "it has moved 2 times" in err.details()
        assert sorted(len(w.requests) for w in workers) == [1, 1, 1] and gateway.fleet.migrations == 2
        # the first worker's queue told as the worker told it; a moved stream only pauses
        assert [(e.queued.position, e.queued.eta_ms) for e in heard] == [(2, 40), (1, 20)]


def test_workers_that_fail_after_the_request_left_their_queue_count_it(tiny_dirs):
    workers = [QueuedThenLost(leaves=True, running=0) for _ in range(3)]
    with scripted_fleet(tiny_dirs, *workers, migration_limit=3) as (gateway, stub, _):
        err = rpc_error(lambda: list(stub.Generate(request(token_ids=[1, 2, 3], max_tokens=4), timeout=30)))
        assert err.code() == grpc.StatusCode.INTERNAL and (NO_RETRY_TRAILER, "1") in err.trailing_metadata()
        assert sorted(len(w.requests) for w in workers) == [0, 1, 1]


class TakenAndLostAtOnce(ScriptedWorker):
    """Takes every request in and fails it right after: its headers and its status come close
    together, most often in one read. (Not in the same instant: under load a status sent at once
    after the headers reached the gateway without them, in neither the call's headers nor its
    trailers, and a worker whose headers never came has, as far as a gateway can tell, not taken
    the request.)"""

    async def Generate(self, request, context):
        self.requests.append(request)
        await context.send_initial_metadata(((TAKEN_HEADER, "1"),))
        await asyncio.sleep(0.02)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is going away")


def test_headers_that_come_with_the_failure_count_the_worker_as_having_taken_the_request(tiny_dirs):
    workers = [TakenAndLostAtOnce(running=0) for _ in range(3)]
    with scripted_fleet(tiny_dirs, *workers, migration_limit=3) as (gateway, stub, _):
        for _ in range(3):
            err = rpc_error(lambda: list(stub.Generate(request(token_ids=[1, 2, 3], max_tokens=4), timeout=30)))
            assert err.code() == grpc.StatusCode.INTERNAL, err.details()


class OwnFailure(ScriptedWorker):
    """Ends every request with a status of the request's own, marked not to be retried."""

    async def Generate(self, request, context):
        self.requests.append(request)
        await context.abort(grpc.StatusCode.INTERNAL, "the request broke something",
                            trailing_metadata=((NO_RETRY_TRAILER, "1"), ("kvserve-private", "x")))
        yield pb.GenerateResponse()


def test_a_workers_status_passed_on_keeps_the_trailers_clients_retry_by(tiny_dirs):
    """A gateway in front of this one, and the HTTP front, read them; anything else stays here."""
    with scripted_fleet(tiny_dirs, OwnFailure()) as (_, stub, _):
        err = rpc_error(lambda: list(stub.Generate(request(token_ids=[1, 2, 3], max_tokens=4), timeout=30)))
        assert err.code() == grpc.StatusCode.INTERNAL and err.details() == "the request broke something"
        trailers = [tuple(t) for t in err.trailing_metadata()]
        assert (NO_RETRY_TRAILER, "1") in trailers and not any(key == "kvserve-private" for key, _ in trailers)


def test_workers_that_fail_a_request_before_taking_it_do_not_count_it_as_a_query_of_death(tiny_dirs):
    """A worker refusing a call before taking it in (draining, its port refused) has computed
    nothing of it: the request moves on, up to --migration-limit, as before."""
    workers = [PrefillFailure(running=0) for _ in range(3)]   # no response headers: never taken
    with scripted_fleet(tiny_dirs, *workers, migration_limit=2) as (gateway, stub, _):
        err = rpc_error(lambda: list(stub.Generate(request(token_ids=[1, 2, 3], max_tokens=4), timeout=30)))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "it has moved 2 times" in err.details()
        assert sorted(len(w.requests) for w in workers) == [1, 1, 1] and gateway.fleet.migrations == 2


def test_refused_requests_are_not_taken_for_room_freed_at_a_worker(tiny_dirs):
    """The queue's wait estimate counts streams that ended at a worker; refusals counted too and
    told a waiting client its turn was a millisecond away while no worker had served anything."""
    busy = ScriptedWorker(running=10)   # no room
    with scripted_fleet(tiny_dirs, busy, max_queued=1) as (gateway, stub, _):
        waiting = stub.Generate(request(token_ids=[1, 2, 3], request_id="w", max_tokens=4), timeout=30)
        assert next(waiting).HasField("queued")
        for i in range(5):
            err = rpc_error(lambda: list(stub.Generate(request(token_ids=[1, 2], max_tokens=2), timeout=10)))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        queue = gateway.fleet.queue
        assert len(queue._ends) == 0 and queue.eta_ms(1) == 0   # no estimate yet: nothing ran
        stub.Cancel(pb.CancelRequest(request_id="w"), timeout=10)
        list(waiting)
        assert len(queue._ends) == 0   # cancelled while queued: it freed no worker's room


def test_a_worker_removed_then_added_again_keeps_its_new_pages_in_the_index():
    """The old worker's follower, stopped once its last stream ended, dropped the index entries
    of the address again: the new worker's, whose event stream (live) never sent them again."""
    from types import SimpleNamespace

    from kvserve.services.gateway.follow import Follower
    from kvserve.services.gateway.index import PrefixIndex

    async def run():
        index = PrefixIndex()
        old = Follower(SimpleNamespace(address="w:1"), index, "", 1.0, lambda: None, lambda w: None)
        index.add("w:1", [11, 12])
        await old.stop_events()             # removed: its pages leave the index
        assert index.pages_of("w:1") == 0
        index.add("w:1", [21, 22, 23])      # added again: the new worker's snapshot
        await old.stop()                    # the old one's last stream ended
        return index.pages_of("w:1")
    assert asyncio.run(run()) == 3


class DeadlineWorker(ScriptedWorker):
    """Meets the client's deadline (its call carries it) before the gateway does."""

    async def Generate(self, request, context):
        self.requests.append(request)
        yield pb.GenerateResponse(prefill_done=pb.PrefillDone(request_id=request.request_id, prompt_tokens=3))
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


def test_a_clients_deadline_met_at_the_worker_first_is_the_client_leaving_not_a_fault(tiny_dirs, caplog):
    """The gateway counted a failure where the worker counts an abort (and, once the deadline
    had passed here too, aborting the finished call logged a traceback)."""
    with scripted_fleet(tiny_dirs, DeadlineWorker()) as (gateway, stub, _):
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request(token_ids=[1, 2, 3], max_tokens=50, temperature=0.0), timeout=30))
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: gateway.fleet.ended["aborted"] == 3, what="three aborted")
        assert gateway.fleet.ended["failed"] == 0
    assert "ExecuteBatchError" not in caplog.text


def test_a_split_requests_parts_hold_when_its_client_does_not_read(monkeypatch):
    """The parts' events wait in a bounded queue: a client that reads nothing after the split
    holds every part's pump within a few events, so the parts' workers see an unread stream (and
    apply their --max-unread-tokens) rather than this gateway keeping all they send."""
    from kvserve.services.gateway import relay as relay_mod

    sent = {"events": 0}

    async def endless(self, time_left):
        while True:
            sent["events"] += 1
            yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[7]))
            await asyncio.sleep(0)   # a worker's stream: the loop runs between its messages

    monkeypatch.setattr(relay_mod.Relay, "run", endless)

    async def main():
        request = pb.GenerateRequest(request_id="r", sampling=pb.SamplingParams(n=3, max_tokens=10_000))
        whole = relay_mod.Relay(fleet=None, request=request, request_id="r", ids=[1, 2], migration_limit=3)
        parts = whole._split({0: [5], 1: [5], 2: [5]}, set(), 0, failed=None, time_left=lambda: None,
                             moves_left=2)
        first = await parts.__anext__()
        assert first.index in (0, 1, 2) and list(first.chunk.token_ids) == [7]
        for _ in range(50):   # the pumps run as far as the queue lets them
            await asyncio.sleep(0)
        held = sent["events"]
        for _ in range(50):
            await asyncio.sleep(0)
        assert sent["events"] == held   # nothing more is produced while the client reads nothing
        assert held <= 4 * 3 + 3 + 1    # the queue's bound, an event per pump waiting, the one read
        read = 1
        for _ in range(40):             # reading lets them go on
            await parts.__anext__()
            read += 1
        assert sent["events"] >= read
        await parts.aclose()            # the client leaves: every pump is cancelled

    asyncio.run(main())


class FullAtFirst(ScriptedWorker):
    """Refuses its first `refusals` calls as a worker whose own queue is full (its --max-waiting,
    reached before the gateway's count of it showed it), then streams."""

    def __init__(self, refusals: int, **kw) -> None:
        super().__init__(**kw)
        self.refusals, self.calls = refusals, 0

    async def Generate(self, request, context):
        self.calls += 1
        if self.refusals > 0:
            self.refusals -= 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "1 requests are already waiting; try again later")
        async for response in super().Generate(request, context):
            yield response


def test_a_worker_refusing_a_request_as_full_is_waited_for_and_costs_no_move(tiny_dirs):
    """Its queue full is no failure: the request waits for its next report and goes on, even with
    --migration-limit 0 (each refusal was a move: a burst through workers with a small
    --max-waiting failed requests "a worker failed" with no worker failing)."""
    worker = FullAtFirst(3)
    with scripted_fleet(tiny_dirs, worker, migration_limit=0) as (gateway, stub, _):
        events = list(stub.Generate(request(token_ids=[1, 2, 3], **greedy(4)), timeout=30))
        assert tokens_of(events) == [5, 6, 7, 8] and events[-1].HasField("finished")
        assert worker.calls == 4 and gateway.fleet.migrations == 0


def test_a_worker_takes_its_max_waiting_past_its_batch_at_most():
    from kvserve.services.gateway.router import Policy, has_room
    from kvserve.services.gateway.worker import SERVING, Load, Worker

    w = Worker("w:1", channel=None, state=SERVING, info=pb.ModelInfo(max_num_seqs=2, max_waiting=1, max_model_len=100),
               load=Load(running=2, waiting=0, free_pages=50, asked_at=1.0))
    policy = Policy(page_size=4, worker_queue_depth=2)
    assert has_room(w, policy, 1)
    w.load.waiting = 1   # its --max-waiting reached: the gateway's --worker-queue-depth of 2 is not
    assert not has_room(w, policy, 1)
    w.load = Load(running=1, waiting=1, free_pages=50, asked_at=1.0)   # its batch held short by pages
    assert not has_room(w, policy, 1)
    w.load = Load(running=2, waiting=0, free_pages=50, asked_at=1.0)
    w.routed()           # sent since the report: not yet admitted there, it waits
    assert not has_room(w, policy, 1)
    w.routed_at.clear()
    w.hold_off()          # a call there failed or was refused since that report
    assert not has_room(w, policy, 1)
    w.loaded(Load(running=2, waiting=0, free_pages=50, asked_at=w.held_since + 1))
    assert has_room(w, policy, 1)


def test_a_request_of_n_sequences_counts_its_n_in_the_batch_it_is_sent_to():
    """The worker reports running sequences: a request of n sent since its report counts n, or
    requests of n = 16 piled up at a worker past --worker-queue-depth."""
    from kvserve.services.gateway.router import Policy, has_room
    from kvserve.services.gateway.worker import SERVING, Load, Routing, Worker

    w = Worker("w:1", channel=None, state=SERVING, info=pb.ModelInfo(max_num_seqs=32, max_model_len=100),
               load=Load(running=0, waiting=0, free_pages=500, asked_at=1.0))
    policy = Policy(page_size=4, worker_queue_depth=2)
    marks = [w.routed(16), w.routed(16)]   # the batch is full once the worker runs them
    assert w.active == 32 and w.pending == 2
    w.routed(16)
    assert w.active == 48 and not has_room(w, policy, 1)
    w.ended(marks[0])
    assert w.active == 32 and has_room(w, policy, 1)
    # a report counts a request partly running by its running sequences, one waiting as one: this
    # gateway's own streams there count their n whatever the report says
    for mark in w.routed_at:
        w.stream_started(mark, 16)
        mark.take()   # the worker has them
    w.loaded(Load(running=20, waiting=0, free_pages=500, asked_at=time.monotonic() + 1))   # 12 of 32 not running
    assert w.pending == 0 and w.active == 32 and has_room(w, policy, 1)
    w.stream_started("a third", 16)
    assert w.active == 48 and not has_room(w, policy, 1)
    w.stream_ended("a third", 16, Routing(16))
    assert w.active == 32 and w.streaming == 32
    for _ in range(12):   # sequences finishing early: room again before their request ends
        w.sequence_ended()
    assert w.active == 20 and w.streaming == 20


def test_a_workers_place_on_the_board_follows_its_streams():
    from kvserve.services.gateway.board import LoadBoard
    from kvserve.services.gateway.worker import SERVING, Load, Routing, Worker

    a, b = (Worker(name, channel=None, state=SERVING, info=pb.ModelInfo(max_num_seqs=8, page_size=4),
                   load=Load(running=2)) for name in ("a", "b"))
    board = LoadBoard()
    board.add(a)
    board.add(b)
    a.stream_started("s", 4)   # past what a's report says: it is the busier now
    assert list(board.least_busy()) == [b, a]
    a.sequence_ended()
    a.sequence_ended()
    a.sequence_ended()
    assert list(board.least_busy())[0] is b
    a.stream_ended("s", 1, Routing(4))
    b.stream_started("t", 3)
    assert list(board.least_busy()) == [a, b]


class DiesOnce(ScriptedWorker):
    """Its first stream fails after two tokens, and for `dead_s` after that it refuses every call
    UNAVAILABLE and reports nothing (a worker killed and not yet restarted, its load stream not
    yet seen to end), then serves."""

    def __init__(self, dead_s: float, **kw) -> None:
        super().__init__(fail_at=2, **kw)
        self.dead_s, self.dead_until = dead_s, 0.0

    async def WatchServerStats(self, request, context):
        stream = super().WatchServerStats(request, context)
        async for stats in stream:
            while time.monotonic() < self.dead_until:
                await asyncio.sleep(0.01)
            yield stats

    async def Generate(self, request, context):
        if time.monotonic() < self.dead_until:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        first = not self.requests
        self.requests.append(request)
        yield pb.GenerateResponse(prefill_done=pb.PrefillDone(prompt_tokens=len(request.token_ids.ids)))
        for i, token in enumerate(self.tokens[len(request.continuation.ids):]):   # it goes on after them
            if first and i == self.fail_at:
                self.dead_until = time.monotonic() + self.dead_s
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is going away")
            yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[token]))
        yield pb.GenerateResponse(finished=pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH))


def test_a_failed_worker_is_not_sent_the_moved_request_before_it_reports_again(tiny_dirs):
    """One failure costs one move: the request it failed waits for the worker's next report rather
    than going straight back to it while it is still dead (which spent a second move, and with
    --migration-limit 1 failed the stream)."""
    worker = DiesOnce(dead_s=0.6, tokens=(5, 6, 7, 8, 9))
    with scripted_fleet(tiny_dirs, worker, migration_limit=1) as (gateway, stub, _):
        events = list(stub.Generate(request(token_ids=[1, 2, 3], **greedy(5)), timeout=30))
        assert tokens_of(events) == [5, 6, 7, 8, 9] and events[-1].HasField("finished")
        assert gateway.fleet.migrations == 1 and len(worker.requests) == 2


def test_the_queues_estimate_counts_only_the_last_minutes_ends_up_to_now(monkeypatch):
    """Ends long ago give no estimate (a burst's fast rate was told ten minutes later), and a
    pause since the last end slows the rate."""
    from kvserve.services.gateway import waiting

    now = [1000.0]
    monkeypatch.setattr(waiting.time, "monotonic", lambda: now[0])
    queue = WaitQueue(8)
    monkeypatch.setattr(queue, "wake", lambda: None)
    for i in range(11):   # ten intervals of 0.1 s
        now[0] = 1000.0 + i / 10
        queue.stream_ended()
    assert queue.eta_ms(5) == 500
    now[0] += 1.0         # a second with no end: 10 ends over 2 s
    assert queue.eta_ms(5) == 1000
    now[0] += 600         # ten minutes on, none within the window
    assert queue.eta_ms(5) == 0


def test_a_client_that_leaves_as_it_reaches_the_queues_head_leaves_no_routing_behind():
    """The worker was chosen (its routing mark counted as pending there) before the client was
    told it reached the head; one that left at that message kept the mark for good. After a few
    such leavings under load the gateway saw its idle workers as full, and every new request
    waited at the head of its queue until its deadline."""
    from kvserve.services.gateway.relay import Relay

    worker = RoomLater()

    async def main():
        queue = WaitQueue(max_queued=8)
        fleet = types.SimpleNamespace(queue=queue, board=[object()])
        relay = Relay(fleet=fleet, request=pb.GenerateRequest(request_id="r"), request_id="r", ids=[1, 2],
                      migration_limit=3)
        ahead = queue.enter("ahead")
        acquired = relay._acquire(worker.choose)
        first = await acquired.__anext__()
        assert first.queued.position == 2
        worker.free = True
        queue.leave(ahead)   # the head: a worker has room, and the client is told position 1 first
        told = await asyncio.wait_for(acquired.__anext__(), 5)
        assert told.queued.position == 1 and worker.pending
        await acquired.aclose()   # the client leaves there
        assert worker.pending == [] and len(queue) == 0

    asyncio.run(main())


class RoomLater:
    """A worker with no room until `free`: chosen then, its routing marks counted as the router
    counts them; nothing may be sent to it."""

    def __init__(self) -> None:
        self.free = False
        self.pending: list[object] = []
        self.called = False

    def choose(self, *args, **kwargs):
        from kvserve.services.gateway.router import Choice

        if not self.free:
            return None
        mark = object()
        self.pending.append(mark)
        return Choice(self, 0, mark)

    def ended(self, mark) -> None:
        self.pending.remove(mark)

    def generate(self, *args, **kwargs):
        self.called = True
        raise AssertionError("a cancelled request was sent to a worker")


def test_a_cancel_while_the_client_is_told_it_reached_the_head_ends_it_abort_unsent():
    """The worker is chosen before the client is told it reached the head; a Cancel answered while
    that message was being written found no worker to tell, and the request went to the worker
    afterwards, streaming in full to a client told it was cancelled."""
    from kvserve.services.gateway.relay import Relay

    worker = RoomLater()

    async def main():
        queue = WaitQueue(max_queued=8)
        fleet = types.SimpleNamespace(queue=queue, board=[object()], page_size=None, never_fits=lambda *a: None,
                                      choose=worker.choose, hashes=lambda *a, **k: [])
        relay = Relay(fleet=fleet, request=pb.GenerateRequest(request_id="r"), request_id="r", ids=[1, 2],
                      migration_limit=3)
        ahead = queue.enter("ahead")
        events = relay.run(lambda: 30.0)
        assert (await events.__anext__()).queued.position == 2
        worker.free = True
        queue.leave(ahead)
        told = await asyncio.wait_for(events.__anext__(), 5)
        assert told.queued.position == 1 and worker.pending
        await relay.cancel()   # answered while the client reads its place: no worker to tell yet
        rest = [event async for event in events]
        assert [e.finished.finish_reason for e in rest] == [pb.FINISH_REASON_ABORT]
        assert not worker.called and worker.pending == [] and len(queue) == 0

    asyncio.run(main())


class FailingInTransportWords(ScriptedWorker):
    """Fails mid-stream as grpc words a lost connection (naming the peer's address and errno's
    text), or as the lane's client once worded a lost connection (an exception's class)."""

    def __init__(self, details: str, **kw) -> None:
        super().__init__(**kw)
        self.details = details

    async def Generate(self, request, context):
        self.requests.append(request)
        yield pb.GenerateResponse(prefill_done=pb.PrefillDone(prompt_tokens=len(request.token_ids.ids)))
        yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[5]))
        await context.abort(grpc.StatusCode.UNAVAILABLE, self.details)


@pytest.mark.parametrize("details", [
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.1.2.3:50051: Connection refused",
    "the worker's lane failed (ConnectionResetError: [Errno 104] Connection reset by peer)",
])
def test_a_workers_transport_words_never_reach_the_client(tiny_dirs, details):
    """What a client reads of a worker's failure is plain words; grpc's (and the lane's) are the log's."""
    with scripted_fleet(tiny_dirs, FailingInTransportWords(details), migration_limit=0) as (_, stub, _):
        err = rpc_error(lambda: list(stub.Generate(request(token_ids=[1, 2, 3], max_tokens=8), timeout=30)))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.details() == ("a worker failed before the request finished (it became unavailable); it has moved "
                             "0 times, as many as --migration-limit allows")


@pytest.mark.parametrize("details", [
    "last error: UNKNOWN: ipv6:%5B::1%5D:50051: Connection refused",   # grpc escapes the brackets
    "last error: UNKNOWN: ipv4:10.1.2.3:50051: Connection refused",
    "DNS resolution failed for worker-0.workers:50051: errors resolving worker-0.workers:50051: C-ares",
    "connect failed: unix:/run/kvserve/worker-0.sock: No such file",
    # a worker's own words: its manager, by host and port
    "its KV-cache manager at 10.1.2.3:50061 has been unreachable for 4 s",
    "the KV-cache manager at worker-0.workers.ns.svc:50061 did not answer",
    "the KV-cache manager at [::1]:50061 did not answer",
    "the KV-cache manager at localhost:50061 did not answer",
    "the KV-cache manager at 10.1.2.3.",   # an address that ends a sentence
])
def test_grpcs_words_for_every_kind_of_worker_address_are_scrubbed(details):
    from kvserve.services.gateway.relay import Refused

    scrubbed = Refused(grpc.StatusCode.UNAVAILABLE, details).message   # every message a client reads
    assert not any(name in scrubbed for name in ("::1", "10.1.2.3", "worker-0", "/run/kvserve", "localhost")), \
        scrubbed
    assert "the worker" in scrubbed


@pytest.mark.parametrize("words", [
    "prompt (10 tokens) + max_tokens (1500) = 1510 exceeds the model length 1024",
    "min_tokens must be at most max_tokens (4), got 5", "no worker has been serving for 2.5 s",
    "top_p must be in (0, 1], got 1.5", "the model is Qwen2.5-0.5B (v1.2)",
    # indexed fields and ids: brackets that hold no colon name no IPv6 address
    "messages[0].role has 65 characters; at most 64 are allowed", "logit_bias[50256] must be in [-100, 100]",
    "request id 'job[7]' is already in flight", "tokens [cafe] and [0]",
])
def test_words_that_name_no_address_are_left_alone(words):
    from kvserve.services.gateway.peer_addresses import without_addresses
    assert without_addresses(words) == words


class FailingAfterCancel(ScriptedWorker):
    """Answers Cancel OK, then fails the stream UNAVAILABLE instead of ending it ABORT."""

    def __init__(self) -> None:
        super().__init__(tokens=range(10, 20))
        self.cancelled = asyncio.Event()

    async def Generate(self, request, context):
        self.requests.append(request)
        yield pb.GenerateResponse(prefill_done=pb.PrefillDone(prompt_tokens=len(request.token_ids.ids)))
        yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[10]))
        await self.cancelled.wait()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is going away")

    async def Cancel(self, request, context):
        self.cancels.append(request.request_id)
        self.cancelled.set()
        return pb.CancelResponse()


def test_a_worker_failing_after_an_answered_cancel_ends_the_stream_abort(tiny_dirs):
    """Not UNAVAILABLE for a request out of moves (--migration-limit 0): its client was told its
    Cancel took."""
    worker, other = FailingAfterCancel(), ScriptedWorker(running=3)
    with scripted_fleet(tiny_dirs, worker, other, migration_limit=0) as (_, stub, _):
        events = stub.Generate(request(request_id="c1", token_ids=[1, 2, 3], max_tokens=8), timeout=30)
        assert next(events).HasField("prefill_done") and list(next(events).chunk.token_ids) == [10]
        stub.Cancel(pb.CancelRequest(request_id="c1"), timeout=10)
        rest = list(events)
        assert [e.finished.finish_reason for e in rest] == [pb.FINISH_REASON_ABORT]
        assert rest[0].finished.usage.completion_tokens == 1
        assert worker.cancels == ["c1"] and not other.requests


class LaneOffering(ScriptedWorker):
    """Says it serves a lane (which the test's gateway cannot set up)."""

    async def GetModelInfo(self, request, context):
        info = await super().GetModelInfo(request, context)
        info.lane_address = "127.0.0.1:9"
        return info


def test_a_lane_that_cannot_be_set_up_leaves_the_worker_served_over_grpc(tiny_dirs, monkeypatch, caplog):
    """Setting a lane up reads the TLS files; while they are being rotated that fails, and the
    task following the worker's load died with it: the worker stayed starting for good."""
    from kvserve.services.gateway import worker as worker_module

    def unreadable(*_, **__):
        raise ValueError("cannot read CA certificate /etc/tls/ca.crt")
    monkeypatch.setattr(worker_module, "LaneChannel", unreadable)
    caplog.set_level("WARNING", logger="kvserve.services.gateway.worker")
    with scripted_fleet(tiny_dirs, LaneOffering()) as (gateway, stub, _):
        events = list(stub.Generate(request(token_ids=[1, 2, 3], max_tokens=4), timeout=30))
        assert events[-1].HasField("finished")
        assert "its requests go over gRPC" in caplog.text


def test_a_failure_following_a_workers_load_marks_it_down_until_it_answers_again(tiny_dirs, monkeypatch, caplog):
    """A bug in reading a report ended the task following the worker: it kept its last state,
    unwatched. It is down for that moment now, and followed on, its traceback logged once for
    failures in a row (not 20 a second) and each try later than the last."""
    from kvserve.services.gateway.follow import Follower
    take, broken = Follower._take, iter([True] * 4)

    def flaky(self, *args):
        if next(broken, False):
            raise RuntimeError("a bug")
        return take(self, *args)
    monkeypatch.setattr(Follower, "_take", flaky)
    caplog.set_level("WARNING", logger="kvserve.services.gateway.follow")
    with scripted_fleet(tiny_dirs, ScriptedWorker()) as (gateway, stub, _):
        events = list(stub.Generate(request(token_ids=[1, 2, 3], max_tokens=4), timeout=30))
        assert events[-1].HasField("finished")
        assert [r.levelname for r in caplog.records if r.getMessage().endswith("following its load failed")] == ["ERROR"]


def test_a_request_whose_worker_is_removed_between_its_choice_and_its_send_goes_elsewhere(tiny_dirs):
    """A queued request told its place writes that to its client between the choice of a worker
    and the call there; the worker removed meanwhile (gone from DNS) had its channel closed, and
    the call raised grpc's UsageError past the failover: the client got UNKNOWN."""
    workers = [ScriptedWorker(), ScriptedWorker()]
    with scripted_fleet(tiny_dirs, *workers) as (gateway, stub, addresses):
        fleet, removed = gateway.fleet, []
        choose = fleet.choose

        def removed_after_the_choice(*args, **kw):
            choice = choose(*args, **kw)
            if choice is not None and not removed:   # as Fleet.remove leaves it, before the call is made
                removed.append(choice.worker.address)
                fleet.board.remove(choice.worker)
                choice.worker.closed = True
                asyncio.ensure_future(fleet.remove(choice.worker.address))
            return choice
        fleet.choose = removed_after_the_choice
        events = list(stub.Generate(request(token_ids=[1, 2, 3], max_tokens=4), timeout=30))
        assert events[-1].HasField("finished")
        served = [len(w.requests) for w in workers]
        assert served[addresses.index(removed[0])] == 0 and sum(served) == 1


def test_tokenize_with_the_long_lane_full_is_resource_exhausted():
    """The token strings of a long prompt's ids are written on the long lane too; a full lane is
    RESOURCE_EXHAUSTED with the lane's sentence, never UNKNOWN with the exception's class."""
    from types import SimpleNamespace

    from kvserve.model_service.engine.errors import QueueFull
    from kvserve.services.gateway.servicer import GatewayServicer

    class Aborted(Exception):
        pass

    class Context:
        async def abort(self, code, details):
            self.code, self.details = code, details
            raise Aborted

    async def ids(request, add_special):
        return [1] * 40_000

    async def tokens(ids):
        raise QueueFull("9 long prompts (over 32,768 characters) are already being tokenized; try again shortly")

    context = Context()
    servicer = SimpleNamespace(inputs=SimpleNamespace(ids=ids, tokens=tokens))
    with pytest.raises(Aborted):
        asyncio.run(GatewayServicer.Tokenize(servicer, pb.TokenizeRequest(prompt="x"), context))
    assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert context.details.startswith("9 long prompts")
