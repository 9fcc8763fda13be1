"""GenerateRequest.continuation: a request that goes on from tokens it generated elsewhere (a
gateway moving it from a failed worker) streams exactly what the uninterrupted request would
have streamed after them: tokens, text and seeded draws, with usage counting all of them."""

from __future__ import annotations

import grpc
import pytest

from kvserve.model_service.engine.errors import ENDED_STOP_TOKEN_TRAILER, ENDED_STOP_TRAILER, ENDED_TRAILER
from tests.service.util import assert_pages_free, generate, greedy, request, rpc_error

PROMPT = "The model token cache pages the batch memory"


@pytest.mark.parametrize("sampling", [greedy(40), dict(temperature=0.9, top_p=0.9, seed=1234, max_tokens=40,
                                                       ignore_eos=True, repetition_penalty=1.3,
                                                       frequency_penalty=0.5)],
                         ids=["greedy", "seeded-with-penalties"])
@pytest.mark.parametrize("cut", [1, 17, 39])
def test_a_continued_request_streams_what_the_whole_one_would_have(stub, model_server, sampling, cut):
    whole = generate(stub, request(prompt=PROMPT, **sampling))
    msg = request(prompt=PROMPT, **sampling)
    msg.continuation.ids.extend(whole.tokens[:cut])
    rest = generate(stub, msg)
    assert rest.tokens == whole.tokens[cut:]
    # The rest's text is the whole text after what the first `cut` tokens streamed. A chunk may
    # carry several tokens (a slow reader's are coalesced): that one bounds the cut's text.
    assert rest.text and whole.text.endswith(rest.text)
    before, seen, lo = whole.text[:len(whole.text) - len(rest.text)], 0, ""
    for c in whole.chunks:
        if seen + len(c.token_ids) > cut:
            assert before.startswith(lo) and (lo + c.text).startswith(before), (lo, c.text, before)
            break
        seen, lo = seen + len(c.token_ids), lo + c.text
    assert rest.finished.usage.completion_tokens == len(whole.tokens)
    assert rest.finished.usage.prompt_tokens == whole.finished.usage.prompt_tokens
    # the cache holds the whole run's pages, continuation included: only the prompt's count
    assert rest.finished.usage.cached_tokens <= rest.finished.usage.prompt_tokens
    assert_pages_free(model_server.servicer)


def test_a_continuation_that_cannot_go_on_is_refused(stub, model_server):
    def refused() -> float:
        return model_server.servicer.metrics.registry.get_sample_value("kvserve:request_refused_total",
                                                                        {"code": "INVALID_ARGUMENT"})
    counted = refused()
    msg = request(prompt=PROMPT, **greedy(4))
    msg.continuation.ids.extend([5, 6, 7, 8])
    err = rpc_error(lambda: stub.Generate(msg, timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "leaves none to generate" in err.details()
    assert ended(err) == "FINISH_REASON_LENGTH"   # a gateway ends the stream by this, not the text
    assert refused() == counted   # a moved stream already complete is no refused call
    msg = request(prompt=PROMPT, **greedy(8))
    msg.continuation.ids.extend([5, 99999])
    err = rpc_error(lambda: stub.Generate(msg, timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "99999" in err.details()
    assert ended(err) is None   # a bad continuation: nothing ended
    assert refused() == counted + 1
    msg = request(prompt=PROMPT, temperature=0.0, max_tokens=8, stop_token_ids=[6])
    msg.continuation.ids.extend([5, 6])
    err = rpc_error(lambda: stub.Generate(msg, timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop condition" in err.details()
    assert ended(err) == "FINISH_REASON_STOP"
    # which stop, for the finished a gateway writes: the token id, or the stop string's index
    assert trailer(err, ENDED_STOP_TOKEN_TRAILER) == "6" and trailer(err, ENDED_STOP_TRAILER) is None
    whole = generate(stub, request(prompt=PROMPT, **greedy(6)))
    stop = whole.text.strip()[:2]
    assert len(stop) == 2, whole.text
    msg = request(prompt=PROMPT, temperature=0.0, max_tokens=8, stop=["never in this text \x01", stop])
    msg.continuation.ids.extend(whole.tokens)
    err = rpc_error(lambda: stub.Generate(msg, timeout=30))
    assert ended(err) == "FINISH_REASON_STOP"
    assert trailer(err, ENDED_STOP_TRAILER) == "1" and trailer(err, ENDED_STOP_TOKEN_TRAILER) is None
    # max_tokens unset: the model length is the bound, and the message names it, not a value never sent
    msg = request(token_ids=[5] * 2040, temperature=0.0)
    msg.continuation.ids.extend([6] * 8)
    err = rpc_error(lambda: stub.Generate(msg, timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == ("the prompt (2040 tokens) and the continuation (8) fill the model length (2048): "
                             "nothing is left to generate")
    assert ended(err) == "FINISH_REASON_LENGTH"
    # more than any stream of this model holds: refused from its size, before it is read
    msg = request(prompt=PROMPT, **greedy(8))
    msg.continuation.ids.extend([5] * 2_000_000)
    err = rpc_error(lambda: stub.Generate(msg, timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and ended(err) is None
    assert err.details() == ("the continuation has 2,000,000 tokens; the model length is 2,048, which leaves no "
                             "room for more")


def ended(err: grpc.RpcError) -> str | None:
    return trailer(err, ENDED_TRAILER)


def trailer(err: grpc.RpcError, key: str) -> str | None:
    return dict(err.trailing_metadata() or ()).get(key)
