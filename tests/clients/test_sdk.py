"""The Python SDK against a real model service (tiny model, in-process KV-cache manager)."""

from __future__ import annotations

import dataclasses
import pickle
import re
import threading
import time

import grpc
import pytest

from kvserve.clients.inference_client import (
    Chunk, Completion, Finished, InferenceClient, KVCacheStats, KVServeError, ModelInfo, PrefillDone,
    ServerStats, Tokenized, TokenLogprob, TopLogprob,
)
from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.kvcache.v1 import kvcache_pb2 as kv_pb

# About 40 tokens: two full pages of 16, so a repeated prompt has something to find in the cache.
PROMPT = ("The cache page holds the key and value vectors of sixteen tokens, and the server keeps "
          "every full page in a prefix tree so that the next request with the same start reuses it")
SYSTEM = {"role": "system", "content": "You are a helpful assistant for the kvserve model server; answer briefly."}


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


# ---------------------------------------------------------------- generate / complete

def test_events_come_in_order(client: InferenceClient) -> None:
    events = list(client.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True))
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "PrefillDone" and kinds[-1] == "Finished", kinds
    assert set(kinds[1:-1]) == {"Chunk"}, kinds
    prefill, finished, chunks = events[0], events[-1], events[1:-1]
    assert prefill.request_id
    assert finished.reason == "length"
    assert finished.completion_tokens == 12 == sum(len(c.token_ids) for c in chunks)
    assert finished.prompt_tokens == prefill.prompt_tokens == len(client.tokenize(PROMPT).token_ids)
    assert finished.cached_tokens == prefill.cached_tokens
    assert 0 < finished.ttft_ms <= finished.total_ms
    assert all(isinstance(c.token_ids, tuple) and isinstance(c.text, str) for c in chunks)


def test_a_value_no_request_can_carry_is_a_value_error_naming_its_field(client: InferenceClient) -> None:
    with pytest.raises(ValueError, match="seed -1 does not fit the request"):
        client.generate("hi", seed=-1)
    with pytest.raises(ValueError, match="prompt is not valid UTF-8 text"):
        client.generate("hi \udcff")
    with pytest.raises(ValueError, match="got -3"):
        client.generate(token_ids=[1, -3])
    with pytest.raises(ValueError, match="got True"):
        client.generate(token_ids=[1, True])
    with pytest.raises(ValueError, match=r"messages\[0\] is not valid UTF-8 text"):
        client.generate(messages=[("user", "hi \udcff")])
    with pytest.raises(ValueError, match=r"messages\[1\] must be a \(role, content\) pair, a mapping"):
        client.generate(messages=[("user", "hi"), {"role": "user"}])
    with pytest.raises(ValueError, match=r"messages\[0\] must be"):
        client.generate(messages=["hi"])
    with pytest.raises(ValueError, match="request_id, session_id or cache_salt is not valid UTF-8 text"):
        client.generate("hi", request_id="r\udcff")
    with pytest.raises(ValueError, match="prompt is not valid UTF-8 text"):
        client.tokenize("hi \udcff")
    with pytest.raises(TypeError, match="api_key is a string, not int"):
        InferenceClient("127.0.0.1:1", api_key=5)
    with pytest.raises(ValueError, match=r"structured choice is a list of strings, not one string: \['yes'\]"):
        client.generate("hi", structured={"choice": "yes"})   # was three choices: "y", "e", "s"
    with pytest.raises(ValueError, match=r"structured json_object is True \(any JSON object\), not False"):
        client.generate("hi", structured={"json_object": False})   # was sent, and held to JSON


def test_token_ids_may_be_any_iterable_of_integers(client: InferenceClient) -> None:
    import numpy as np

    ids = client.tokenize(PROMPT).token_ids
    want = client.complete(token_ids=list(ids), max_tokens=4, temperature=0).token_ids
    assert client.complete(token_ids=iter(ids), max_tokens=4, temperature=0).token_ids == want
    assert client.complete(token_ids=(i for i in ids), max_tokens=4, temperature=0).token_ids == want
    assert client.complete(token_ids=np.array(ids), max_tokens=4, temperature=0).token_ids == want


def test_detokenize_gives_back_the_text_and_checks_its_ids(client: InferenceClient) -> None:
    import numpy as np

    ids = client.tokenize(PROMPT).token_ids
    assert client.detokenize(ids) == client.detokenize(np.array(ids)) == PROMPT
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 2\^31\), got -1"):
        client.detokenize([1, -1])
    with pytest.raises(KVServeError) as err:
        client.detokenize([1, 1 << 30])
    assert err.value.code == "INVALID_ARGUMENT" and "outside the vocabulary" in str(err.value)


def test_complete_is_the_concatenated_stream(client: InferenceClient) -> None:
    chunks = [e for e in client.generate(PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
              if isinstance(e, Chunk)]
    done = client.complete(PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
    assert isinstance(done, Completion)
    assert done.text == "".join(c.text for c in chunks)
    assert done.token_ids == tuple(t for c in chunks for t in c.token_ids)
    assert len(done.token_ids) == done.finished.completion_tokens == 16
    assert done.request_id == done.prefill.request_id != ""


def test_seeded_sampling_is_reproducible(client: InferenceClient) -> None:
    def sample(seed: int) -> tuple[int, ...]:
        return client.complete(PROMPT, max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True).token_ids

    first = sample(7)
    assert sample(7) == first
    assert any(sample(seed) != first for seed in (8, 9, 10))  # the seed is really used
    greedy = client.complete(PROMPT, max_tokens=16, temperature=0, ignore_eos=True).token_ids
    assert client.complete(PROMPT, max_tokens=16, temperature=0, ignore_eos=True).token_ids == greedy


def test_token_ids_input_is_the_prompt_tokenized(client: InferenceClient) -> None:
    ids = client.tokenize(PROMPT).token_ids
    by_text = client.complete(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    by_ids = client.complete(token_ids=list(ids), max_tokens=8, temperature=0, ignore_eos=True)
    assert by_ids.prefill.prompt_tokens == len(ids)
    assert by_ids.token_ids == by_text.token_ids
    # the second identical prompt finds the first one's full pages in the prefix cache
    page = client.model_info().page_size
    assert by_ids.finished.cached_tokens == (len(ids) - 1) // page * page
    # ...but not under a cache_salt, which shares pages with its own salt only
    salted = [client.complete(token_ids=list(ids), max_tokens=2, cache_salt="mine").finished.cached_tokens
              for _ in range(2)]
    assert salted == [0, (len(ids) - 1) // page * page]


def test_messages_input_uses_the_chat_template(client: InferenceClient) -> None:
    messages = [SYSTEM, {"role": "user", "content": "What is a page?"}]
    rendered = client.tokenize(messages=messages)
    assert rendered.tokens[:2] == ("<s>", "<|system|>")
    assert rendered.tokens[-1] == "<|assistant|>"
    done = client.complete(messages=messages, max_tokens=8, temperature=0)
    assert done.prefill.prompt_tokens == len(rendered.token_ids)
    # (role, content) pairs and plain dicts are the same conversation
    pairs = [(m["role"], m["content"]) for m in messages]
    assert client.tokenize(messages=pairs).token_ids == rendered.token_ids


def test_a_speakers_name_travels_with_its_message(client: InferenceClient) -> None:
    """A mapping's "name" or an object's .name is sent as ChatMessage.name, and the server
    bounds it as it bounds a role."""
    from types import SimpleNamespace

    from kvserve.clients.convert import tokenize_request
    msg = tokenize_request(messages=[{"role": "user", "content": "hi", "name": "ann"},
                                     SimpleNamespace(role="user", content="hi", name="bob"), ("user", "hi")])
    assert [(m.name, m.HasField("name")) for m in msg.messages.messages] == [("ann", True), ("bob", True), ("", False)]
    with pytest.raises(ValueError, match=r"messages\[0\]: name must be a string"):
        tokenize_request(messages=[{"role": "user", "content": "hi", "name": 1}])
    # the tiny template renders no names: the same prompt
    assert client.tokenize(messages=[{"role": "user", "content": "hi", "name": "ann"}]).token_ids == \
        client.tokenize(messages=[("user", "hi")]).token_ids
    with pytest.raises(KVServeError) as err:
        client.tokenize(messages=[{"role": "user", "content": "hi", "name": "n" * 65}])
    assert err.value.code == "INVALID_ARGUMENT" and "messages[0].name has 65 characters; at most 64" in str(err.value)


def test_the_chat_templates_options_shape_the_prompt(client: InferenceClient) -> None:
    """vLLM's three: no generation prompt, the last message continued (its end of turn left
    off), and the template's own variables; refusals are INVALID_ARGUMENT naming what is wrong."""
    messages = [SYSTEM, {"role": "user", "content": "What is a page?"}]
    full = client.tokenize(messages=messages).tokens
    assert client.tokenize(messages=messages, add_generation_prompt=False).tokens == full[:-1]
    answer = messages + [{"role": "assistant", "content": "A page"}]
    continued = client.tokenize(messages=answer, continue_final_message=True).tokens
    closed = client.tokenize(messages=answer, add_generation_prompt=False).tokens
    assert closed[-1] == "<|end|>" and continued == closed[:-1]
    done = client.complete(messages=answer, continue_final_message=True, max_tokens=4, temperature=0)
    assert done.prefill.prompt_tokens == len(continued)
    # the tiny template reads no variables of its own: one given changes nothing, and is accepted
    assert client.tokenize(messages=messages, chat_template_kwargs={"enable_thinking": False}).tokens == full
    for kwargs, words in [(dict(continue_final_message=True, add_generation_prompt=True), "cannot be given with add_generation_prompt true"),
                          (dict(chat_template_kwargs={"tools": [], "messages": []}),
                           "template_kwargs may not set messages, tools: they are the template call's own")]:
        with pytest.raises(KVServeError) as info:
            client.tokenize(messages=messages, **kwargs)
        assert info.value.code == "INVALID_ARGUMENT" and words in str(info.value), str(info.value)
    with pytest.raises(ValueError, match="continue_final_message shape how messages are rendered: give messages"):
        client.tokenize("hello", continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_kwargs must be JSON values"):
        client.tokenize(messages=messages, chat_template_kwargs={"x": object()})


def test_chat_history_rerenders_as_a_prefix(client: InferenceClient) -> None:
    """What `kvserve chat` relies on: turn n+1's prompt starts with all of turn n's prompt
    tokens, so every full page of it comes from the prefix cache."""
    page = client.model_info().page_size
    messages = [SYSTEM, {"role": "user", "content": "What is a page?"}]
    for turn in range(3):
        before = client.tokenize(messages=messages).token_ids
        reply = client.complete(messages=messages, max_tokens=16, temperature=0)
        messages += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": f"And {turn}?"}]
        after = client.tokenize(messages=messages).token_ids
        assert after[:len(before)] == before, f"turn {turn + 2} re-renders the history differently"
        nxt = client.complete(messages=messages, max_tokens=1, temperature=0)
        assert nxt.finished.cached_tokens >= len(before) // page * page > 0


def test_logprobs(client: InferenceClient) -> None:
    done = client.complete(PROMPT, max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    assert len(done.logprobs) == 6
    for token, lp in zip(done.token_ids, done.logprobs):
        assert lp.token_id == token and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0].token_id == token  # greedy: the chosen one is the top one
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
        assert lp.token and lp.token == lp.top[0].token   # each token named, the same id the same text
    named = "".join(lp.token for lp in done.logprobs)
    assert named == done.text or "\ufffd" in named   # (a token holding part of a character names it U+FFFD)


def test_prompt_logprobs(client: InferenceClient) -> None:
    done = client.complete(PROMPT, max_tokens=2, temperature=0, prompt_logprobs=2)
    shown = done.prefill.prompt_logprobs
    ids = client.tokenize(PROMPT).token_ids
    assert shown.first_token_id == ids[0] and [lp.token_id for lp in shown.tokens] == list(ids[1:])
    assert all(len(lp.top) == 2 and lp.logprob <= 0 and lp.token for lp in shown.tokens)
    assert shown.text == shown.first_token + "".join(lp.token for lp in shown.tokens) or "\ufffd" in shown.text
    assert client.complete(PROMPT, max_tokens=2).prefill.prompt_logprobs is None


def test_logit_bias_and_min_tokens(client: InferenceClient) -> None:
    assert client.complete(PROMPT, max_tokens=3, temperature=0, logit_bias={77: 100}).token_ids == (77, 77, 77)
    with pytest.raises(KVServeError) as info:
        client.complete(PROMPT, max_tokens=2, min_tokens=3)
    assert info.value.code == "INVALID_ARGUMENT" and "min_tokens must be at most max_tokens (2)" in info.value.message


def test_structured_output(client: InferenceClient) -> None:
    done = client.complete(PROMPT, max_tokens=16, temperature=0, structured={"regex": "[0-9]{2}-[a-c]"})
    assert re.fullmatch("[0-9]{2}-[a-c]", done.text) and done.finished.reason == "stop"
    schema = {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"], "additionalProperties": False}
    assert client.complete(PROMPT, max_tokens=16, temperature=0, structured={"json_schema": schema}).text in (
        '{"x":1}', '{"x":2}')
    with pytest.raises(ValueError, match="structured is one of"):
        client.generate(PROMPT, structured={"regex": "a", "choice": ["b"]})


def test_stop_string_ends_the_stream(client: InferenceClient) -> None:
    free = client.complete(PROMPT, max_tokens=24, temperature=0, ignore_eos=True)
    stop = re.search(r"[a-z]{2}", free.text).group()  # two letters the greedy output is sure to produce
    done = client.complete(PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    assert done.finished.reason == "stop" and done.finished.stop == stop
    assert done.text == free.text[:free.text.index(stop)]


# ---------------------------------------------------------------- cancellation

def test_cancel_by_request_id_ends_the_stream_with_abort(client: InferenceClient) -> None:
    stream = client.generate(PROMPT, max_tokens=1500, temperature=0, ignore_eos=True, request_id="to-cancel")
    first = next(stream)
    assert isinstance(first, PrefillDone) and first.request_id == "to-cancel" == stream.request_id
    client.cancel("to-cancel")
    rest = list(stream)
    assert isinstance(rest[-1], Finished) and rest[-1].reason == "abort"
    assert rest[-1].completion_tokens < 1500


def test_cancelling_the_stream_aborts_the_request(client: InferenceClient) -> None:
    before = client.server_stats().requests_aborted
    with client.generate(PROMPT, max_tokens=1500, temperature=0, ignore_eos=True) as stream:
        assert isinstance(next(stream), PrefillDone)
        assert isinstance(next(stream), Chunk)
        stream.cancel()
        with pytest.raises(KVServeError) as info:
            list(stream)
    assert info.value.code == "CANCELLED"
    wait_until(lambda: client.server_stats().requests_aborted == before + 1)
    wait_until(lambda: client.server_stats().running == 0)


def test_cancel_from_another_thread(client: InferenceClient) -> None:
    stream = client.generate(PROMPT, max_tokens=1500, temperature=0, ignore_eos=True, request_id="threaded")
    threading.Timer(0.3, client.cancel, args=("threaded",)).start()
    events = list(stream)
    assert events[-1].reason == "abort"


# ---------------------------------------------------------------- errors

def test_cancel_of_an_unknown_id_is_not_found(client: InferenceClient) -> None:
    with pytest.raises(KVServeError) as info:
        client.cancel("no-such-request")
    err = info.value
    assert err.code == "NOT_FOUND"
    assert "no-such-request" in err.message
    assert str(err) == f"NOT_FOUND: {err.message}"
    assert isinstance(err.__cause__, grpc.RpcError)
    assert pickle.loads(pickle.dumps(err)).args == err.args


@pytest.mark.parametrize("kwargs, words", [
    (dict(prompt=""), "prompt is empty"),
    (dict(), "set one input"),
    (dict(token_ids=[1, 5, 99999]), "99999 is outside the vocabulary"),
    (dict(token_ids=[]), "no tokens"),
    (dict(messages=[]), "messages is empty"),
    (dict(prompt="hi", temperature=-1.0), "temperature"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", max_tokens=10**6), "exceeds the model length"),
])
def test_bad_input_is_invalid_argument(client: InferenceClient, kwargs: dict, words: str) -> None:
    with pytest.raises(KVServeError) as info:
        client.complete(**kwargs)
    assert info.value.code == "INVALID_ARGUMENT"
    assert words in info.value.message


def test_two_inputs_are_refused_before_sending(client: InferenceClient) -> None:
    with pytest.raises(ValueError, match="one input"):
        client.generate(prompt="hi", token_ids=[1, 2])


def test_n_below_one_is_refused_before_sending(client: InferenceClient) -> None:
    with pytest.raises(ValueError, match="n is the number of sequences to sample, at least 1; got 0"):
        client.generate("hi", n=0)


@pytest.mark.parametrize("address, timeout, words", [
    ("127.0.0.1:65536", None, "the port must be in 1..65535"),
    ("[::1]:0", None, "the port must be in 1..65535"),
    ("", None, "address is host:port or unix:///path"),
    ("127.0.0.1:1", -1, "timeout is a number of seconds > 0"),
    ("127.0.0.1:1", 0, "timeout is a number of seconds > 0"),
    ("127.0.0.1:1", float("inf"), "timeout is a number of seconds > 0"),
    ("127.0.0.1:1", 1e10, "under 1e9"),   # past gRPC's clock: DEADLINE_EXCEEDED at once
])
def test_an_address_or_deadline_grpc_would_bend_is_refused_when_the_client_is_made(address, timeout, words):
    from kvserve.clients.async_client import AsyncInferenceClient
    for cls in (InferenceClient, AsyncInferenceClient):
        with pytest.raises(ValueError, match=words):
            cls(address, timeout=timeout)


def test_unreachable_server_is_unavailable() -> None:
    with InferenceClient("127.0.0.1:1", timeout=5) as c:
        with pytest.raises(KVServeError) as info:
            c.model_info()
        assert info.value.code == "UNAVAILABLE"


# ---------------------------------------------------------------- unary calls

def test_tokenize(client: InferenceClient) -> None:
    t = client.tokenize("hello world")
    assert isinstance(t, Tokenized) and len(t.token_ids) == len(t.tokens) > 0
    assert "".join(t.tokens).replace("\u0120", " ") == "hello world"  # byte-level BPE pieces
    with pytest.raises(KVServeError) as info:
        client.tokenize()
    assert info.value.code == "INVALID_ARGUMENT"


def test_model_info(client: InferenceClient) -> None:
    info = client.model_info()
    assert isinstance(info, ModelInfo)
    assert (info.name, info.architecture, info.vocab_size, info.page_size) == ("tiny", "LlamaForCausalLM", 1024, 16)
    assert info.device == "cpu" and info.num_pages == 512 and info.max_model_len == 2048
    assert info.eos_token_ids == (2, 6)  # </s> and <|end|>
    assert info.cpu_gemm in ("native", "onednn", "torch")


def test_server_stats(client: InferenceClient) -> None:
    before = client.server_stats()
    client.complete(PROMPT, max_tokens=5, temperature=0, ignore_eos=True)
    after = client.server_stats()
    assert isinstance(after, ServerStats) and isinstance(after.kvcache, KVCacheStats)
    assert after.requests_finished == before.requests_finished + 1
    assert after.generated_tokens == before.generated_tokens + 5
    assert after.running == after.waiting == 0
    assert after.kvcache.page_size == 16 and after.kvcache.total_pages == 512
    assert after.forward_seconds > before.forward_seconds > 0


@pytest.mark.parametrize("cls, message", [
    (ModelInfo, pb.ModelInfo), (ServerStats, pb.ServerStats), (KVCacheStats, kv_pb.Stats),
    (PrefillDone, pb.PrefillDone), (TokenLogprob, pb.TokenLogprob), (TopLogprob, pb.TopLogprob),
])
def test_dataclasses_cover_the_contract(cls: type, message) -> None:
    """Every proto field has its dataclass field and back, so the edge drops nothing."""
    assert {f.name for f in dataclasses.fields(cls)} == {f.name for f in message.DESCRIPTOR.fields}


def test_finished_covers_the_contract() -> None:
    usage = {f.name for f in pb.Usage.DESCRIPTOR.fields}
    finished = {f.name for f in pb.Finished.DESCRIPTOR.fields} - {"usage", "finish_reason"} | {"reason"}
    assert {f.name for f in dataclasses.fields(Finished)} == usage | finished | {"index"}   # the response's


def test_a_closed_client_says_so_as_a_kvserve_error() -> None:
    import asyncio

    from kvserve.clients.async_client import AsyncInferenceClient

    c = InferenceClient("127.0.0.1:1")
    c.close()
    for call in (c.model_info, lambda: list(c.generate("a")), lambda: c.cancel("x")):
        with pytest.raises(KVServeError, match="CANCELLED: the client is closed"):
            call()

    async def main():
        a = AsyncInferenceClient("127.0.0.1:1")
        await a.close()
        with pytest.raises(KVServeError, match="the client is closed"):
            await a.model_info()
        with pytest.raises(KVServeError, match="the client is closed"):
            await a.complete("a")

    asyncio.run(main())


def test_a_finish_reason_newer_than_the_sdk_is_named_by_its_number() -> None:
    from kvserve.clients import convert

    msg = pb.GenerateResponse(finished=pb.Finished(finish_reason=9))
    assert convert.event(msg).reason == "reason_9"
    assert convert.event(pb.GenerateResponse(finished=pb.Finished(finish_reason=pb.FINISH_REASON_STOP))).reason == "stop"


def test_none_for_stop_lists_and_an_index_for_n_are_taken_as_documented() -> None:
    from kvserve.clients.convert import generate_request

    class Two:   # numpy's integers are such: an __index__, no int subclass
        def __index__(self) -> int:
            return 2

    msg = generate_request(prompt="hi", stop=None, stop_token_ids=None, n=Two())
    assert list(msg.sampling.stop) == [] and list(msg.sampling.stop_token_ids) == [] and msg.sampling.n == 2
    for bad in (0, True, 1.5, "2"):
        with pytest.raises(ValueError, match="n is the number of sequences to sample"):
            generate_request(prompt="hi", n=bad)


def test_a_status_without_details_is_a_sentence_not_grpcs_repr() -> None:
    class Bare(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def details(self):
            return ""

        def __str__(self) -> str:
            return "<_InactiveRpcError of RPC that terminated with:\n\tstatus = ...>"

    err = KVServeError.from_rpc_error(Bare())
    assert (err.code, err.message) == ("RESOURCE_EXHAUSTED",
                                       "the server ended the call RESOURCE_EXHAUSTED without saying why")


def test_a_failure_says_what_the_server_said_of_trying_again() -> None:
    """The servers' hints (retry-after-ms on a full queue, kvserve-no-retry on a request that two
    workers died computing) reached HTTP clients only: the SDK's error kept a code and a message."""
    import grpc

    def failure(code, *trailers) -> KVServeError:
        return KVServeError.from_rpc_error(grpc.aio.AioRpcError(code, grpc.aio.Metadata(),
                                                                grpc.aio.Metadata(*trailers), "no"))

    full = failure(grpc.StatusCode.RESOURCE_EXHAUSTED, ("retry-after-ms", "1000"))
    assert (full.code, full.retry_after_ms, full.retryable) == ("RESOURCE_EXHAUSTED", 1000, True)
    deadly = failure(grpc.StatusCode.UNAVAILABLE, ("kvserve-no-retry", "1"))
    assert (deadly.retry_after_ms, deadly.retryable) == (None, False)
    assert not failure(grpc.StatusCode.ALREADY_EXISTS).retryable   # it could run the request twice
    assert not failure(grpc.StatusCode.INVALID_ARGUMENT).retryable   # the same request meets the same answer
    assert KVServeError("UNAVAILABLE", "gone").retryable
