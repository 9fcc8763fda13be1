"""kvserve.inference.v1.Inference over gRPC, RPC by RPC, against the real model service
(tiny checkpoint, page_size 4, in-process KV-cache manager).

Errors are checked by status code and by what the message says, and every error test
ends by generating again: a refused call must leave the server serving.
"""

from __future__ import annotations

import random
import threading

import grpc
import pytest
import torch

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.model_service.attention.select import select_backend
from kvserve.model_service.kernels.gemm import choose_gemm
from tests.engine.harness import assert_same_tokens, hf_greedy
from tests.service.util import (
    VOCAB,
    assert_pages_free,
    generate,
    greedy,
    request,
    rpc_error,
    wait_until,
)

_rng = random.Random(2024)
PROMPT_IDS = [_rng.randrange(3, VOCAB) for _ in range(23)]
CHAT = [("system", "You are terse."), ("user", "Name three colours.")]


def assert_serving(stub) -> None:
    """The server still answers a small generation correctly."""
    out = generate(stub, request(token_ids=[11, 12, 13], **greedy(3)))
    assert out.finished.finish_reason == pb.FINISH_REASON_LENGTH and len(out.tokens) == 3


def check_stream_shape(out, prompt_tokens: int, completion_tokens: int, reason) -> None:
    """prefill_done, then one or more chunks, then finished, and nothing after it."""
    kinds = out.kinds
    assert kinds[0] == "prefill_done", kinds
    assert kinds[-1] == "finished", kinds
    assert set(kinds[1:-1]) == {"chunk"} and len(kinds) >= 3, kinds
    assert out.prefill.prompt_tokens == prompt_tokens
    assert out.prefill.request_id  # the server assigns one when the request has none
    f = out.finished
    assert f.finish_reason == reason
    assert (f.usage.prompt_tokens, f.usage.completion_tokens) == (prompt_tokens, completion_tokens)
    assert f.usage.cached_tokens == out.prefill.cached_tokens
    assert len(out.tokens) == completion_tokens
    assert f.ttft_ms > 0 and f.total_ms >= f.ttft_ms


# ---------------------------------------------------------------------- Generate


def test_generate_prompt(stub, tokenizer):
    prompt = "The quick brown fox"
    n_prompt = len(tokenizer.encode(prompt))
    out = generate(stub, request(prompt=prompt, request_id="gen-prompt", **greedy(8)))
    check_stream_shape(out, n_prompt, 8, pb.FINISH_REASON_LENGTH)
    assert out.prefill.request_id == "gen-prompt"
    assert out.finished.stop == "" and not out.finished.HasField("stop_token_id")
    # the streamed text is the detokenized output (no stop strings, special tokens skipped)
    assert out.text == tokenizer.decode(out.tokens, skip_special_tokens=True)


def test_generate_token_ids_equals_transformers(stub, hf_tiny):
    out = generate(stub, request(token_ids=PROMPT_IDS, **greedy(12)))
    check_stream_shape(out, len(PROMPT_IDS), 12, pb.FINISH_REASON_LENGTH)
    ref, margins = hf_greedy(hf_tiny, PROMPT_IDS, 12)
    assert_same_tokens(out.tokens, ref, margins, "token_ids input")


def test_generate_messages(stub, tokenizer):
    chat = [{"role": r, "content": c} for r, c in CHAT]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    out = generate(stub, request(messages=CHAT, **greedy(5)))
    check_stream_shape(out, len(ids), 5, pb.FINISH_REASON_LENGTH)
    # the same conversation as token ids gives the same tokens
    same = generate(stub, request(token_ids=ids, **greedy(5)))
    assert same.tokens == out.tokens


def test_max_tokens_without_ignore_eos_is_length(stub):
    out = generate(stub, request(token_ids=PROMPT_IDS, temperature=0.0, max_tokens=4))
    # greedy never picks EOS on this prompt (checked against ignore_eos below)
    assert generate(stub, request(token_ids=PROMPT_IDS, **greedy(4))).tokens == out.tokens
    check_stream_shape(out, len(PROMPT_IDS), 4, pb.FINISH_REASON_LENGTH)


def test_unset_max_tokens_runs_to_the_model_length(tiny_dirs):
    from tests.service.conftest import ModelServerThread

    server = ModelServerThread(tiny_dirs["tiny"], max_model_len=40)
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).max_model_len == 40
            out = generate(stub, request(token_ids=PROMPT_IDS, temperature=0.0, ignore_eos=True))
            check_stream_shape(out, len(PROMPT_IDS), 40 - len(PROMPT_IDS), pb.FINISH_REASON_LENGTH)
            err = rpc_error(lambda: stub.Generate(request(token_ids=PROMPT_IDS, **greedy(18)), timeout=10))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "model length 40" in err.details()
    finally:
        server.stop()


def test_stop_token_id(stub):
    full = generate(stub, request(token_ids=PROMPT_IDS, **greedy(16))).tokens
    i = 5
    stop_id = full[i]
    i = full.index(stop_id)  # its first occurrence
    out = generate(stub, request(token_ids=PROMPT_IDS, stop_token_ids=[stop_id], **greedy(16)))
    check_stream_shape(out, len(PROMPT_IDS), i + 1, pb.FINISH_REASON_STOP)
    assert out.tokens == full[: i + 1]  # the stop token's id is reported ...
    assert out.finished.stop_token_id == stop_id and out.finished.HasField("stop_token_id")
    assert out.finished.stop == ""  # no stop string did it
    # ... but not its text: the text is that of the tokens before it (a character the
    # stop token cut in half is not flushed as U+FFFD, unlike at max_tokens)
    before = generate(stub, request(token_ids=PROMPT_IDS, **greedy(i))).text if i else ""
    assert before.startswith(out.text) and set(before[len(out.text):]) <= {"\ufffd"}


def _clean_window(text: str, width: int = 3) -> str | None:
    """A substring of `text` of `width` plain characters (no U+FFFD, no control characters)
    that begins after the first few characters."""
    for start in range(4, len(text) - width):
        s = text[start:start + width]
        if all(c.isprintable() and c != "\ufffd" for c in s) and s.strip() == s and s.strip():
            return s
    return None


def test_stop_string_is_never_streamed(stub):
    full = generate(stub, request(token_ids=PROMPT_IDS, **greedy(40)))
    stop = _clean_window(full.text)
    assert stop is not None, f"no usable stop string in {full.text!r}"
    cut = full.text.index(stop)
    out = generate(stub, request(token_ids=PROMPT_IDS, stop=[stop], **greedy(40)))
    assert out.finished.finish_reason == pb.FINISH_REASON_STOP
    assert out.finished.stop == stop and not out.finished.HasField("stop_token_id")
    assert out.text == full.text[:cut]
    assert stop not in out.text
    assert out.tokens == full.tokens[: len(out.tokens)] and len(out.tokens) < 40
    assert out.finished.usage.completion_tokens == len(out.tokens)


def _sample_until_eos(stub, eos: set[int], n: int = 400):
    """A (seed, tokens) whose near-uniform sampling (temperature 100) draws an EOS id before
    the last token; seeded sampling is deterministic, so this is a fixed search."""
    for seed in range(40):
        out = generate(stub, request(token_ids=PROMPT_IDS, temperature=100.0, seed=seed, max_tokens=n,
                                     ignore_eos=True))
        hits = [i for i, t in enumerate(out.tokens) if t in eos]
        if hits and hits[0] < n - 1:
            return seed, out, hits[0]
    pytest.fail("no seed in 0..39 sampled an EOS id")


def test_ignore_eos(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    eos = set(info.eos_token_ids)
    seed, past, i = _sample_until_eos(stub, eos)
    assert past.finished.finish_reason == pb.FINISH_REASON_LENGTH and len(past.tokens) == 400
    # without ignore_eos, the same seed stops at that EOS; its id is reported, its text is not
    out = generate(stub, request(token_ids=PROMPT_IDS, temperature=100.0, seed=seed, max_tokens=400))
    assert out.finished.finish_reason == pb.FINISH_REASON_STOP
    assert out.tokens == past.tokens[: i + 1]
    assert out.finished.stop_token_id == past.tokens[i] and out.finished.stop == ""
    assert not past.finished.HasField("stop_token_id")


# ---------------------------------------------------------------------- Cancel


def test_cancel_from_another_thread_ends_with_abort(stub, model_server):
    before = model_server.servicer.engine.counters.aborted
    call = stub.Generate(request(token_ids=PROMPT_IDS, request_id="to-cancel", **greedy(1900)), timeout=60)
    events = [next(call), next(call)]  # prefill_done and a first chunk: it is running
    assert events[0].HasField("prefill_done") and events[1].HasField("chunk")
    errors = []

    def cancel():
        try:
            stub.Cancel(pb.CancelRequest(request_id="to-cancel"), timeout=10)
        except grpc.RpcError as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=cancel)
    t.start()
    events += list(call)
    t.join(10)
    assert not errors, errors
    finished = events[-1]
    assert finished.HasField("finished"), [e.WhichOneof("event") for e in events]
    assert finished.finished.finish_reason == pb.FINISH_REASON_ABORT
    n = sum(len(e.chunk.token_ids) for e in events if e.HasField("chunk"))
    assert finished.finished.usage.completion_tokens == n < 1900
    assert model_server.servicer.engine.counters.aborted == before + 1
    # once finished, the id is unknown
    err = rpc_error(lambda: stub.Cancel(pb.CancelRequest(request_id="to-cancel"), timeout=10))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert_pages_free(model_server.servicer)


def test_cancel_unknown_id_is_not_found(stub):
    err = rpc_error(lambda: stub.Cancel(pb.CancelRequest(request_id="no-such-request"), timeout=10))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-request" in err.details()
    assert_serving(stub)


# ---------------------------------------------------------------------- Tokenize


def test_tokenize_prompt(stub, tokenizer):
    text = "Hello, wörld! 123"
    r = stub.Tokenize(pb.TokenizeRequest(prompt=text), timeout=10)
    assert list(r.token_ids) == tokenizer.encode(text)
    assert list(r.tokens) == tokenizer.convert_ids_to_tokens(list(r.token_ids))
    assert tokenizer.decode(list(r.token_ids)) == text
    # add_special_tokens=False: the tiny tokenizer adds none anyway
    r2 = stub.Tokenize(pb.TokenizeRequest(prompt=text, add_special_tokens=False), timeout=10)
    assert list(r2.token_ids) == tokenizer.encode(text, add_special_tokens=False)


def test_tokenize_messages(stub, tokenizer):
    msg = pb.TokenizeRequest(messages=pb.ChatMessages(
        messages=[pb.ChatMessage(role=r, content=c) for r, c in CHAT]))
    r = stub.Tokenize(msg, timeout=10)
    chat = [{"role": role, "content": c} for role, c in CHAT]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert list(r.token_ids) == ids
    assert len(r.tokens) == len(ids)
    assert r.tokens[-1] == "<|assistant|>"  # add_generation_prompt


def test_tokenize_without_input_is_invalid(stub):
    err = rpc_error(lambda: stub.Tokenize(pb.TokenizeRequest(), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt or messages" in err.details()


# ---------------------------------------------------------------------- info and stats


def test_get_model_info(stub, tokenizer):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.vocab_size == 1024
    assert info.page_size == 4
    assert info.dtype == info.kv_cache_dtype == "float32"
    assert info.attention_backend == select_backend("auto", "cpu").name   # cpu where its kernel builds
    assert info.cpu_gemm == choose_gemm("auto", torch.float32, torch.device("cpu"))   # native where it runs, else onednn
    assert info.device == "cpu"
    assert info.num_pages == 512
    assert info.max_model_len == 2048  # the model's; 512 pages of 4 hold that much
    assert info.architecture == "LlamaForCausalLM"
    assert info.name == "tiny"
    assert tokenizer.eos_token_id in info.eos_token_ids
    assert list(info.eos_token_ids) == sorted(info.eos_token_ids)


def test_get_server_stats_counters_move(stub, model_server):
    assert model_server.servicer.engine.wait_idle(10)
    before = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
    out = generate(stub, request(token_ids=PROMPT_IDS + [7], **greedy(6)))
    assert model_server.servicer.engine.wait_idle(10)
    after = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
    assert after.requests_finished == before.requests_finished + 1
    assert after.requests_aborted == before.requests_aborted
    assert after.prompt_tokens == before.prompt_tokens + len(PROMPT_IDS) + 1
    assert after.generated_tokens == before.generated_tokens + 6
    assert after.cached_tokens == before.cached_tokens + out.prefill.cached_tokens
    assert after.steps >= before.steps + 6
    assert after.running == 0 and after.waiting == 0 and after.swapped == 0
    for phase in ("schedule_seconds", "manager_seconds", "forward_seconds", "sample_seconds", "emit_seconds"):
        assert getattr(after, phase) > getattr(before, phase), phase
    kv = after.kvcache  # the manager's Stats, nested
    assert kv.total_pages == 512 and kv.page_size == 4
    assert kv.used_pages == 0 and kv.num_sequences == 0
    assert kv.free_pages + kv.cached_pages == kv.total_pages
    assert kv.prefix_query_tokens > before.kvcache.prefix_query_tokens


# ---------------------------------------------------------------------- errors


def _invalid(stub, msg: pb.GenerateRequest, *fragments: str) -> str:
    err = rpc_error(lambda: stub.Generate(msg, timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    for fragment in fragments:
        assert fragment in err.details(), (fragment, err.details())
    assert_serving(stub)
    return err.details()


def test_no_input(stub):
    _invalid(stub, request(**greedy(4)), "set one input")


@pytest.mark.parametrize("method, streams", [("Generate", True), ("Tokenize", False), ("Cancel", False),
                                             ("Detokenize", False)])
def test_bytes_that_do_not_parse_are_invalid_argument(channel, stub, method, streams):
    """Not a protobuf message, or a prompt that is not UTF-8: a sentence naming the message the
    method takes, not grpc's UNKNOWN with the parser's exception class."""
    valid = {"Generate": request(prompt="ab", **greedy(4)), "Tokenize": pb.TokenizeRequest(prompt="ab"),
             "Cancel": pb.CancelRequest(request_id="ab"), "Detokenize": pb.DetokenizeRequest(token_ids=[97, 98])}[method]
    bad_utf8 = valid.SerializeToString().replace(b"ab", b"\xc3\x28")
    call = (channel.unary_stream if streams else channel.unary_unary)(f"/kvserve.inference.v1.Inference/{method}")
    expected = method + "Request"
    texts = method != "Detokenize"   # (its request holds no string)
    for raw in (b"\xff\xff\xff\xff", bad_utf8) if texts else (b"\xff\xff\xff\xff",):
        err = rpc_error(lambda: list(call(raw, timeout=10)) if streams else call(raw, timeout=10))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
        assert err.details() == (f"the request is not a valid kvserve.inference.v1.{expected}: "
                                 "its bytes could not be parsed")
    assert_serving(stub)


def test_empty_prompt(stub):
    _invalid(stub, request(prompt="", **greedy(4)), "prompt is empty")


def test_empty_token_ids(stub):
    _invalid(stub, request(token_ids=[], **greedy(4)), "no tokens")


@pytest.mark.parametrize("bad", [1024, 5000, -1])
def test_token_id_outside_vocabulary(stub, bad):
    _invalid(stub, request(token_ids=[5, 6, bad, 7], **greedy(4)), f"token id {bad}", "1024")


def test_prompt_plus_max_tokens_over_model_length(stub):
    details = _invalid(stub, request(token_ids=list(range(3, 103)), **greedy(1949)), "100", "1949", "2048")
    assert "exceeds" in details
    # exactly the model length is fine
    out = generate(stub, request(token_ids=list(range(3, 103)), temperature=0.0, max_tokens=1948,
                                 stop_token_ids=list(range(VOCAB))))
    assert out.finished.finish_reason == pb.FINISH_REASON_STOP and len(out.tokens) == 1


def test_prompt_alone_at_model_length(stub):
    _invalid(stub, request(token_ids=[5] * 2048, temperature=0.0), "2048", "no room for output")


def test_negative_temperature(stub):
    _invalid(stub, request(prompt="hi", temperature=-0.5, max_tokens=4), "temperature", "-0.5")


@pytest.mark.parametrize("top_p", [0.0, 1.5])
def test_top_p_out_of_range(stub, top_p):
    _invalid(stub, request(prompt="hi", top_p=top_p, max_tokens=4), "top_p", str(top_p), "(0, 1]")


@pytest.mark.parametrize("penalty", [1e-45, 1e-3, 1e3])
def test_repetition_penalty_out_of_range(stub, penalty):
    """A penalty this small divided logits into inf, and sampling streamed NaN logprobs."""
    _invalid(stub, request(prompt="hi", repetition_penalty=penalty, temperature=1.0, max_tokens=4),
             "repetition_penalty", "[0.01, 100]")


@pytest.mark.parametrize("penalty", [0.01, 100.0])
def test_repetition_penalty_at_its_bounds_is_taken(stub, penalty):
    """The proto's float32 holds 0.01 as 0.0099999998, which is the bound all the same."""
    out = generate(stub, request(prompt="hi", repetition_penalty=penalty, temperature=0.0, max_tokens=3))
    assert len(out.tokens) == 3


def test_logprobs_over_20(stub):
    _invalid(stub, request(prompt="hi", logprobs=21, max_tokens=4), "logprobs", "21", "[0, 20]")


def test_stop_token_id_outside_vocabulary(stub):
    _invalid(stub, request(prompt="hi", stop_token_ids=[4096], max_tokens=4), "stop_token_ids", "4096")


def test_stop_token_ids_past_the_limit_are_refused_before_they_are_read(stub):
    """Each is checked on the event loop and masked in every step while min_tokens holds: an
    8 MB message held millions of them (a second of the loop's time, seconds a step)."""
    _invalid(stub, request(prompt="hi", stop_token_ids=[5] * 100_000, max_tokens=4, min_tokens=2),
             "100,000 stop_token_ids", "at most 1024")


def test_prompt_logprobs_past_what_one_message_holds_are_refused(stub, monkeypatch):
    """They all go in one prefill_done, built on the event loop: past the bound a client's default
    4 MB limit would refuse it after the whole prefill."""
    from kvserve.model_service import request_builder
    monkeypatch.setattr(request_builder, "MAX_PROMPT_LOGPROBS", 100)
    _invalid(stub, request(token_ids=list(range(3, 63)), prompt_logprobs=1, max_tokens=1),
             "prompt_logprobs 1 for a 60-token prompt is 118 logprobs", "at most 100")
    out = generate(stub, request(token_ids=list(range(3, 53)), prompt_logprobs=1, max_tokens=1))   # 98: taken
    assert len(out.tokens) == 1


def test_duplicate_request_id_in_flight(stub, model_server):
    call = stub.Generate(request(token_ids=PROMPT_IDS, request_id="dup", **greedy(1900)), timeout=60)
    assert next(call).HasField("prefill_done")
    err = rpc_error(lambda: stub.Generate(request(token_ids=[4, 5], request_id="dup", **greedy(2)), timeout=10))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "'dup'" in err.details() and "in flight" in err.details()
    # the first stream is untouched by the refused one
    stub.Cancel(pb.CancelRequest(request_id="dup"), timeout=10)
    events = list(call)
    assert events[-1].finished.finish_reason == pb.FINISH_REASON_ABORT
    # and once it is gone, the id is free again
    again = generate(stub, request(token_ids=[4, 5], request_id="dup", **greedy(2)))
    assert again.prefill.request_id == "dup" and len(again.tokens) == 2
    assert_pages_free(model_server.servicer)


def test_an_id_sent_again_right_after_its_cancel_is_served(stub, model_server):
    """A cancelled request ends within a step; a client that cancels and sends its id again at
    once waits that long rather than being told the id is in flight (a request still running
    is refused as before: the test above)."""
    for i in range(10):
        rid = f"again-{i}"
        call = stub.Generate(request(token_ids=PROMPT_IDS, request_id=rid, **greedy(1900)), timeout=60)
        assert next(call).HasField("prefill_done")
        stub.Cancel(pb.CancelRequest(request_id=rid), timeout=10)
        again = generate(stub, request(token_ids=[4, 5], request_id=rid, **greedy(2)))
        assert again.prefill.request_id == rid and len(again.tokens) == 2
        assert list(call)[-1].finished.finish_reason == pb.FINISH_REASON_ABORT
    assert_pages_free(model_server.servicer)


def test_full_waiting_queue_is_resource_exhausted(small_server):
    address, servicer = small_server
    engine = servicer.engine
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        # A runs (max_num_seqs 1) ...
        a = stub.Generate(request(token_ids=PROMPT_IDS, request_id="A", **greedy(1900)), timeout=60)
        assert next(a).HasField("prefill_done")
        # ... B waits behind it (max_waiting 1) ...
        b = stub.Generate(request(token_ids=PROMPT_IDS[:5], request_id="B", **greedy(5)), timeout=60)
        wait_until(lambda: engine.num_waiting == 1 and engine.num_running == 1, what="B to wait")
        # ... and C finds the queue full
        err = rpc_error(lambda: stub.Generate(request(token_ids=[5, 6], request_id="C", **greedy(2)),
                                              timeout=10))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
        assert "1 requests are already waiting" in err.details()
        assert dict(err.trailing_metadata())["retry-after-ms"] == "1000"   # HTTP's Retry-After
        # A still streams, and once it is cancelled B runs to completion
        assert next(a).HasField("chunk")
        stub.Cancel(pb.CancelRequest(request_id="A"), timeout=10)
        assert list(a)[-1].finished.finish_reason == pb.FINISH_REASON_ABORT
        b_events = list(b)
        assert b_events[-1].finished.finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(e.chunk.token_ids) for e in b_events if e.HasField("chunk")) == 5
        # the server still serves, C included
        assert_serving(stub)
        c = generate(stub, request(token_ids=[5, 6], request_id="C", **greedy(2)))
        assert len(c.tokens) == 2
    assert_pages_free(servicer)


def test_errors_leave_no_trace(stub, model_server):
    """Refused calls reach neither the engine nor the manager."""
    assert model_server.servicer.engine.wait_idle(10)
    before = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
    for msg in (request(), request(prompt=""), request(token_ids=[VOCAB]), request(prompt="x", top_p=2.0)):
        assert rpc_error(lambda: stub.Generate(msg, timeout=10)).code() == grpc.StatusCode.INVALID_ARGUMENT
    after = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
    assert (after.requests_finished, after.requests_aborted, after.prompt_tokens) == (
        before.requests_finished, before.requests_aborted, before.prompt_tokens)
    assert after.kvcache.prefix_query_tokens == before.kvcache.prefix_query_tokens


# ---------------------------------------------------------------------- Detokenize


def test_detokenize_writes_ids_as_the_tokenizer_does(stub, tokenizer):
    text = "Hello, wörld! 123"
    ids = list(stub.Tokenize(pb.TokenizeRequest(prompt=text), timeout=10).token_ids)
    assert stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=10).text == tokenizer.decode(ids) == text
    special = [tokenizer.convert_tokens_to_ids("<|assistant|>"), *ids]
    kept = stub.Detokenize(pb.DetokenizeRequest(token_ids=special), timeout=10).text
    skipped = stub.Detokenize(pb.DetokenizeRequest(token_ids=special, skip_special_tokens=True), timeout=10).text
    assert kept == tokenizer.decode(special) and kept.startswith("<|assistant|>")
    assert skipped == tokenizer.decode(special, skip_special_tokens=True) == text
    assert stub.Detokenize(pb.DetokenizeRequest(), timeout=10).text == ""


def test_detokenize_refuses_ids_the_model_does_not_have_and_too_many(stub, tokenizer):
    """A bare decode skips an unknown id without a word: the text would silently lack it."""
    size = max(len(tokenizer), stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).vocab_size)
    for bad in (size, -1):
        err = rpc_error(lambda: stub.Detokenize(pb.DetokenizeRequest(token_ids=[5, bad]), timeout=10))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == f"token id {bad} is outside the vocabulary [0, {size})"
    err = rpc_error(lambda: stub.Detokenize(pb.DetokenizeRequest(token_ids=[5] * ((1 << 17) + 1)), timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "131,073 token ids; at most 131,072 are written out in one call"
    assert_serving(stub)


def test_detokenize_answers_its_largest_call_within_a_clients_default_message_size(stub, tokenizer):
    """The most ids a call takes, each of the longest token the vocabulary has: its text fits
    the 4 MiB a gRPC client receives by default (a bound on ids alone did not)."""
    longest = max(range(len(tokenizer)), key=lambda i: len(tokenizer.decode([i]).encode()))
    answer = stub.Detokenize(pb.DetokenizeRequest(token_ids=[longest] * (1 << 17)), timeout=60)   # a default channel
    assert len(answer.text.encode()) <= 4_000_000 and answer.text.startswith(tokenizer.decode([longest]))
