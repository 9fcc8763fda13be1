"""--stream-interval N over gRPC: a request's tokens reach the client in chunks of N.

The tokens, text, logprobs and stop behaviour are those of N = 1; only how they are cut
into messages changes (fewer messages: less per-message work in the server and client).
The exact cut, the first token alone, is tested at the engine (tests/engine/).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from tests.service.conftest import Served, _serve
from tests.service.util import assert_pages_free, generate, greedy, request

INTERVAL = 4
_rng = random.Random(7)
PROMPT_IDS = [_rng.randrange(3, 1024) for _ in range(19)]


@pytest.fixture(scope="module")
def chunked_server(tiny_dirs) -> Iterator[Served]:
    yield from _serve(tiny_dirs["tiny"], stream_interval=INTERVAL)


@pytest.fixture(scope="module")
def chunked(chunked_server: Served) -> Iterator[pb_grpc.InferenceStub]:
    with grpc.insecure_channel(chunked_server.address) as ch:
        yield pb_grpc.InferenceStub(ch)


def _cuts(n: int) -> set[int]:
    """Where a chunk may end: after token 1, after every INTERVAL more, and at the end."""
    return {1, n} | set(range(1 + INTERVAL, n, INTERVAL))


def _chunk_ends(out) -> list[int]:
    ends, total = [], 0
    for chunk in out.chunks:
        total += len(chunk.token_ids)
        ends.append(total)
    return ends


@pytest.mark.parametrize("max_tokens", [1, 4, 5, 11])
def test_chunks_of_interval_first_alone(chunked, stub, max_tokens):
    out = generate(chunked, request(token_ids=PROMPT_IDS, **greedy(max_tokens)))
    # The servicer merges events that piled up behind a slow client, so a chunk may span
    # several intervals; it never ends anywhere else.
    ends = _chunk_ends(out)
    assert set(ends) <= _cuts(max_tokens) and ends[-1] == max_tokens, ends
    assert out.kinds[0] == "prefill_done" and out.kinds[-1] == "finished"
    assert out.finished.usage.completion_tokens == max_tokens
    one_by_one = generate(stub, request(token_ids=PROMPT_IDS, **greedy(max_tokens)))
    assert out.tokens == one_by_one.tokens and out.text == one_by_one.text


def test_logprobs_ride_with_their_tokens(chunked, stub):
    out = generate(chunked, request(token_ids=PROMPT_IDS, logprobs=2, **greedy(9)))
    for chunk in out.chunks:
        assert [lp.token_id for lp in chunk.logprobs] == list(chunk.token_ids)
    one_by_one = generate(stub, request(token_ids=PROMPT_IDS, logprobs=2, **greedy(9)))
    assert [(lp.token_id, [t.token_id for t in lp.top]) for lp in out.logprobs] == \
        [(lp.token_id, [t.token_id for t in lp.top]) for lp in one_by_one.logprobs]
    assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in one_by_one.logprobs])


def test_stop_string_cuts_the_same_text(chunked, stub):
    full = generate(stub, request(token_ids=PROMPT_IDS, **greedy(30)))
    stop = next((full.text[i:i + 3] for i in range(6, len(full.text) - 3)
                 if full.text[i:i + 3].strip() == full.text[i:i + 3]), None)
    assert stop is not None, f"no usable stop string in {full.text!r}"
    expected = generate(stub, request(token_ids=PROMPT_IDS, stop=[stop], **greedy(30)))
    out = generate(chunked, request(token_ids=PROMPT_IDS, stop=[stop], **greedy(30)))
    assert out.finished.finish_reason == pb.FINISH_REASON_STOP and out.finished.stop == stop
    assert out.text == expected.text and stop not in out.text
    assert out.tokens == expected.tokens


def test_seeded_sampling_is_unchanged(chunked, stub):
    params = dict(token_ids=PROMPT_IDS, temperature=1.0, seed=11, max_tokens=10)
    assert generate(chunked, request(**params)).tokens == generate(stub, request(**params)).tokens


def test_cancel_sends_what_was_sampled_then_abort(chunked, chunked_server):
    call = chunked.Generate(request(token_ids=PROMPT_IDS, request_id="chunked-cancel", **greedy(400)))
    events = [next(call), next(call)]   # prefill_done, then the first token alone
    assert [e.WhichOneof("event") for e in events] == ["prefill_done", "chunk"]
    chunked.Cancel(pb.CancelRequest(request_id="chunked-cancel"), timeout=10)
    events += list(call)
    assert events[-1].finished.finish_reason == pb.FINISH_REASON_ABORT
    streamed = sum(len(e.chunk.token_ids) for e in events if e.HasField("chunk"))
    assert streamed == events[-1].finished.usage.completion_tokens < 400
    assert_pages_free(chunked_server.servicer)


def test_interval_must_be_positive():
    from kvserve.model_service.config import ModelServiceConfig

    with pytest.raises(ValueError, match="--stream-interval must be a positive integer"):
        ModelServiceConfig(stream_interval=0)


@pytest.mark.parametrize("continued", [1, 2, 5])
def test_a_continuation_s_first_new_token_comes_alone_too(chunked, stub, continued):
    """A stream moved to this worker goes on from `continued` tokens: its first new token is
    sent at once, then every INTERVAL of its own."""
    whole = generate(stub, request(token_ids=PROMPT_IDS, **greedy(12)))
    msg = request(token_ids=PROMPT_IDS, **greedy(12))
    msg.continuation.ids.extend(whole.tokens[:continued])
    out = generate(chunked, msg)
    ends = _chunk_ends(out)
    assert set(ends) <= _cuts(12 - continued) and ends[-1] == 12 - continued, ends
    assert out.tokens == whole.tokens[continued:]
