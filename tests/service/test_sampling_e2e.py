"""Sampling through the server: seeds, top-k/top-p limits, logprobs and stop strings,
end to end over gRPC (tiny checkpoint, in-process KV-cache manager)."""

from __future__ import annotations

import json
import math
import random
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.model_service.engine.errors import ENDED_TRAILER
from tests.service.util import RPC_TIMEOUT_S, Stream, assert_pages_free, generate, greedy, request

_rng = random.Random(99)
PROMPTS = [[_rng.randrange(3, 1024) for _ in range(n)] for n in (7, 16, 29, 38)]


# ---------------------------------------------------------------------- seeds


TARGET = dict(temperature=0.9, top_p=0.95, seed=1234, max_tokens=32, ignore_eos=True)
# Five neighbours with every other kind of parameter, seeded and not.
NEIGHBOURS = [
    (PROMPTS[1], dict(temperature=0.0, max_tokens=48, ignore_eos=True)),
    (PROMPTS[2], dict(temperature=1.3, seed=7, max_tokens=48, ignore_eos=True)),
    (PROMPTS[3], dict(temperature=1.0, top_k=20, max_tokens=48, ignore_eos=True)),
    (PROMPTS[0], dict(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3,
                      seed=99, max_tokens=48, ignore_eos=True)),
    (PROMPTS[0], dict(temperature=1.0, min_p=0.1, logprobs=5, seed=1234, max_tokens=48, ignore_eos=True)),
]


def _concurrently(stub, jobs: list[tuple[list[int], dict]]) -> list[Stream]:
    """Runs every job at once: all have finished prefill before any stream is read further."""
    started = threading.Barrier(len(jobs), timeout=30)

    def run(job):
        prompt, sampling = job
        out = Stream()
        for event in stub.Generate(request(token_ids=prompt, **sampling), timeout=60):
            out.events.append(event)
            if event.HasField("prefill_done"):
                started.wait()
        return out

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(run, jobs))


def test_seed_gives_the_same_tokens_whatever_the_batch(stub, model_server):
    alone = generate(stub, request(token_ids=PROMPTS[0], **TARGET))
    assert len(alone.tokens) == 32
    # twice, in two different mixes: the target first, then last
    for jobs in ([(PROMPTS[0], TARGET)] + NEIGHBOURS, NEIGHBOURS[::-1] + [(PROMPTS[0], TARGET)]):
        results = _concurrently(stub, jobs)
        target = results[jobs.index((PROMPTS[0], TARGET))]
        assert target.tokens == alone.tokens
        assert all(r.finished.finish_reason == pb.FINISH_REASON_LENGTH for r in results)
    # two copies of the target in one batch agree too
    a, b = _concurrently(stub, [(PROMPTS[0], TARGET), (PROMPTS[0], TARGET)])
    assert a.tokens == b.tokens == alone.tokens
    # ... and the seed matters: another one samples something else
    other = generate(stub, request(token_ids=PROMPTS[0], **{**TARGET, "seed": 4321}))
    assert other.tokens != alone.tokens
    assert_pages_free(model_server.servicer)


def test_unseeded_sampling_varies(stub):
    """Without a seed, sampling at temperature 1 draws from the shared stream (not a constant)."""
    runs = {tuple(generate(stub, request(token_ids=PROMPTS[1], temperature=1.0, max_tokens=16,
                                         ignore_eos=True)).tokens) for _ in range(3)}
    assert len(runs) > 1


# ---------------------------------------------------------------------- limits that make it greedy


@pytest.mark.parametrize("limit", [dict(top_k=1), dict(top_p=1e-6)], ids=["top_k=1", "top_p=1e-6"])
def test_limits_that_keep_one_token_equal_greedy(stub, limit):
    for prompt in PROMPTS:
        want = generate(stub, request(token_ids=prompt, **greedy(24))).tokens
        got = generate(stub, request(token_ids=prompt, temperature=1.0, max_tokens=24, ignore_eos=True,
                                     **limit)).tokens
        assert got == want


# ---------------------------------------------------------------------- logprobs


def _hf_logprobs(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at each output position: (len(output), V)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) + len(output) - 1], dim=-1)


def test_greedy_logprobs_match_transformers(stub, hf_tiny):
    prompt = PROMPTS[2]
    out = generate(stub, request(token_ids=prompt, logprobs=5, **greedy(12)))
    lps = out.logprobs
    assert len(lps) == len(out.tokens) == 12
    ref = _hf_logprobs(hf_tiny, prompt, out.tokens)
    for i, (token, lp) in enumerate(zip(out.tokens, lps)):
        assert lp.token_id == token
        top = [(t.token_id, t.logprob) for t in lp.top]
        assert len(top) == 5
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert top[0][0] == token and top[0][1] == lp.logprob  # greedy: the chosen one is the best
        assert lp.logprob <= 0 and math.isfinite(lp.logprob)
        assert sum(math.exp(v) for _, v in top) <= 1 + 1e-5
        ref_top = torch.topk(ref[i], 5)
        assert [t for t, _ in top] == ref_top.indices.tolist(), i
        assert [v for _, v in top] == pytest.approx(ref_top.values.tolist(), abs=1e-4)


def test_prompt_logprobs_come_in_prefill_done(stub, hf_tiny, tokenizer):
    """Over gRPC: the first prompt token, then a logprob for each after it, each named as the tokenizer names it,
    equal to transformers'; the prefix cache is not read for them, and a request past
    --max-logprobs is refused by name."""
    prompt = PROMPTS[3]
    generate(stub, request(token_ids=prompt, **greedy(2)))   # its pages are cached now
    out = generate(stub, request(token_ids=prompt, prompt_logprobs=2, **greedy(2)))
    (done,) = [e.prefill_done for e in out.events if e.HasField("prefill_done")]
    name = lambda t: tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(t)])  # noqa: E731
    assert done.cached_tokens == 0 and len(done.prompt_logprobs.tokens) == len(prompt) - 1
    assert (done.prompt_logprobs.first_token_id, done.prompt_logprobs.first_token) == (prompt[0], name(prompt[0]))
    assert done.prompt_logprobs.text == tokenizer.decode(prompt, skip_special_tokens=False)
    with torch.no_grad():
        ref = torch.log_softmax(hf_tiny(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    for i, lp in enumerate(done.prompt_logprobs.tokens):
        assert lp.token_id == prompt[i + 1] and lp.token == name(lp.token_id)
        assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-4)
        assert [t.token_id for t in lp.top] == torch.topk(ref[i], 2).indices.tolist()
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, request(token_ids=prompt, prompt_logprobs=21, **greedy(2)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "prompt_logprobs must be an integer in [0, 20] (--max-logprobs), got 21"


def test_logit_bias_and_min_tokens(stub):
    prompt = PROMPTS[1]
    forced = generate(stub, request(token_ids=prompt, logit_bias={77: 100.0}, **greedy(5)))
    assert forced.tokens == [77] * 5
    plain = generate(stub, request(token_ids=prompt, **greedy(6))).tokens
    stopped = generate(stub, request(token_ids=prompt, stop_token_ids=[plain[0]], **greedy(6)))
    assert stopped.tokens == [plain[0]] and stopped.finished.finish_reason == pb.FINISH_REASON_STOP
    held = generate(stub, request(token_ids=prompt, stop_token_ids=[plain[0]], min_tokens=3, **greedy(6)))
    assert len(held.tokens) >= 3 and plain[0] not in held.tokens[:3]
    for sampling, message in [
        (dict(min_tokens=5, max_tokens=4), "min_tokens must be at most max_tokens (4), got 5"),
        (dict(logit_bias={5000: 1.0}), "logit_bias must be keyed by token ids in [0, 1024), got 5000"),
        (dict(logit_bias={5: 200.0}), "logit_bias[5] must be in [-100, 100], got 200.0"),
        (dict(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias has 1025 entries; at most 1024 are allowed"),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            generate(stub, request(token_ids=prompt, **{"max_tokens": 4, **sampling}))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details() == message
    # max_tokens unset: the model length bounds the output, and min_tokens by it
    left = 2048 - len(prompt)
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, request(token_ids=prompt, min_tokens=left + 1, temperature=0))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details() == (
        f"min_tokens ({left + 1}) exceeds the {left} tokens the model length (2048) leaves after the prompt's "
        f"{len(prompt)}")
    call = stub.Generate(request(token_ids=prompt, min_tokens=left, temperature=0), timeout=RPC_TIMEOUT_S)
    assert next(call).HasField("prefill_done")   # exactly what is left: taken
    call.cancel()


def test_structured_output_over_grpc(stub, tokenizer):
    """A format over gRPC; a request moved mid-stream (its continuation) goes on in the format
    from where it left it; formats that cannot be used are refused with the engine's reason."""
    prompt = PROMPTS[2]
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                         "required": ["n"], "additionalProperties": False})
    whole = generate(stub, request(token_ids=prompt, temperature=0, max_tokens=32,
                                   structured=pb.StructuredOutput(json_schema=schema)))
    assert set(json.loads(whole.text)) == {"n"} and whole.finished.finish_reason == pb.FINISH_REASON_STOP
    for k in range(1, len(whole.tokens)):
        msg = request(token_ids=prompt, temperature=0, max_tokens=32, structured=pb.StructuredOutput(json_schema=schema))
        msg.continuation.ids.extend(whole.tokens[:k])
        assert generate(stub, msg).tokens == whole.tokens[k:], k
    msg.ClearField("continuation")   # every token: the format (or its EOS) already ended it
    msg.continuation.ids.extend(whole.tokens)
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, msg)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nothing left to generate" in info.value.details()
    assert dict(info.value.trailing_metadata())[ENDED_TRAILER] == "FINISH_REASON_STOP"
    choice = generate(stub, request(token_ids=prompt, temperature=0, max_tokens=8,
                                    structured=pb.StructuredOutput(choice=pb.Choices(choices=["alpha", "beta"]))))
    assert choice.text in ("alpha", "beta")
    for structured, words in [
        (pb.StructuredOutput(regex="("), "the regex cannot be used: "),
        (pb.StructuredOutput(json_schema="{not json"), "json_schema is not JSON"),
        (pb.StructuredOutput(json_schema='{"type": "nonsense"}'), "the json_schema cannot be used: "),
        (pb.StructuredOutput(choice=pb.Choices()), "choice needs at least one choice"),
        (pb.StructuredOutput(lark_grammar="start: undefined_rule"), "the lark_grammar cannot be used: "),
        (pb.StructuredOutput(), "structured output: set one of json_schema"),
        (pb.StructuredOutput(json_object=False), "structured output json_object is false"),
        (pb.StructuredOutput(json_schema='{"type": "string", "x-guidance": 5}'), "json_schema's x-guidance must be"),
        (pb.StructuredOutput(json_schema='{"type": "array", "items": ' * 5000 + "{}" + "}" * 5000),
         "the json_schema nests too deeply"),
        (pb.StructuredOutput(regex="[^\\x00-\\x{10FFFF}]"), "the regex allows no output"),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            generate(stub, request(token_ids=prompt, max_tokens=4, structured=structured))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(words), \
            info.value.details()
    # llguidance's message quotes the whole pattern: past gRPC's 16 KiB header limit the call
    # ended RESOURCE_EXHAUSTED (which the gateway took for a full worker, and tried 17 times)
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, request(token_ids=prompt, max_tokens=4, structured=pb.StructuredOutput(regex="(" + "a" * 20000)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(info.value.details()) <= 1000
    assert info.value.details().startswith("the regex cannot be used: "), info.value.details()[:200]
    # Chains of $refs and of rules thousands deep (106 KB and 37 KB) overflowed the compiling
    # thread's stack: the server died of SIGSEGV. They are served.
    refs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(3000)}
    refs["d3000"] = {"type": "integer"}
    rules = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(3000)) + 'r3000: "z"'
    for structured, keeps in [
        (pb.StructuredOutput(json_schema=json.dumps({"$ref": "#/$defs/d0", "$defs": refs})), r"-?[0-9]+"),
        (pb.StructuredOutput(lark_grammar=rules), "z"),
    ]:
        out = generate(stub, request(token_ids=prompt, temperature=0, max_tokens=8, structured=structured))
        assert re.fullmatch(keeps, out.text) or out.finished.finish_reason == pb.FINISH_REASON_LENGTH, out.text
    with pytest.raises(grpc.RpcError) as info:   # compiles, then meets a limit of llguidance's lexer
        generate(stub, request(token_ids=prompt, max_tokens=4, structured=pb.StructuredOutput(regex="a{1000000}")))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("the structured output cannot be followed: "), info.value.details()
    bad = request(token_ids=prompt, temperature=0, max_tokens=8, structured=pb.StructuredOutput(regex="[0-9]+"))
    bad.continuation.ids.extend(tokenizer.encode("xyz", add_special_tokens=False))
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, bad)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not fit the structured output" in \
        info.value.details()


def test_sampled_logprobs_are_the_models_before_temperature(stub, hf_tiny):
    """At temperature 2 the chosen token is often not the best; its logprob is still present,
    and it is the model's own (before temperature), as transformers computes it."""
    prompt = PROMPTS[1]
    out = generate(stub, request(token_ids=prompt, temperature=2.0, seed=5, logprobs=20, max_tokens=16,
                                 ignore_eos=True))
    ref = _hf_logprobs(hf_tiny, prompt, out.tokens)
    for i, (token, lp) in enumerate(zip(out.tokens, out.logprobs)):
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(ref[i, token].item(), abs=1e-4)
        top = {t.token_id: t.logprob for t in lp.top}
        assert len(lp.top) == 20
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
        if token in top:
            assert top[token] == lp.logprob
        else:  # not among the top 20: no likelier than the 20th
            assert lp.logprob <= lp.top[-1].logprob
    assert any(lp.token_id != lp.top[0].token_id for lp in out.logprobs), "nothing but argmax at temperature 2"


def test_logprobs_zero_is_the_chosen_token_only(stub):
    out = generate(stub, request(token_ids=PROMPTS[0], logprobs=0, **greedy(6)))
    assert [lp.token_id for lp in out.logprobs] == out.tokens
    assert all(len(lp.top) == 0 and lp.logprob <= 0 for lp in out.logprobs)
    # unset: none at all
    assert generate(stub, request(token_ids=PROMPTS[0], **greedy(6))).logprobs == []


# ---------------------------------------------------------------------- stop strings


def _boundaries(tokenizer, tokens: list[int], text: str) -> list[tuple[int, int]]:
    """(k, offset): the text of the first k output tokens is text[:offset], cleanly."""
    out = []
    for k in range(1, len(tokens) + 1):
        piece = tokenizer.decode(tokens[:k], skip_special_tokens=True)
        if text.startswith(piece) and not piece.endswith("\ufffd"):
            out.append((k, len(piece)))
    return out


def _clean(s: str) -> bool:
    return bool(s) and all(c.isprintable() and c != "\ufffd" for c in s)


def _spanning_stop(tokenizer, full: Stream, tokens_spanned: int) -> tuple[str, int, int]:
    """A stop string that first occurs across `tokens_spanned` output tokens:
    (string, where it starts in the text, tokens up to the one that completes it)."""
    text = full.text
    bounds = _boundaries(tokenizer, full.tokens, text)
    # the last character of token k0, tokens k0+1 .. k1 whole, the first character of token k1+1
    for (k0, b0), (k1, b1) in zip(bounds, bounds[tokens_spanned - 2:]):
        if k1 - k0 != tokens_spanned - 2 or b0 < 1 or b1 >= len(text):
            continue
        start, end = b0 - 1, b1 + 1
        s = text[start:end]
        if _clean(s) and text.find(s) == start:
            done = next(k for k, b in bounds if b >= end)
            return s, start, done
    pytest.skip(f"no clean stop string across {tokens_spanned} tokens in {text!r}")


@pytest.fixture(scope="module")
def long_greedy(model_server):
    """Each prompt's 60-token greedy run (the texts stop strings are picked from)."""
    with grpc.insecure_channel(model_server.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        return [generate(stub, request(token_ids=p, **greedy(60))) for p in PROMPTS]


def test_a_continuation_is_fed_to_its_format_off_the_event_loop(model_server, tokenizer):
    """A continuation's tokens go into the format's matcher a few microseconds each, and a
    stream with attention sinks may continue from millions: on the server's event loop that
    froze every other stream. They are fed on a tokenizer lane."""
    grammars = model_server.servicer.stack.grammars
    fed_on: list[str] = []

    class Watched:
        def __init__(self, inner) -> None:
            self.inner = inner

        def consume_token(self, token):
            fed_on.append(threading.current_thread().name)
            return self.inner.consume_token(token)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    real = grammars.matcher
    grammars.matcher = lambda fmt, tenant="": Watched(real(fmt, tenant))
    try:
        with grpc.insecure_channel(model_server.address) as ch:
            msg = request(token_ids=[5, 6, 7], temperature=0, max_tokens=8,
                          structured=pb.StructuredOutput(regex="[0-9]+"))
            msg.continuation.ids.extend(tokenizer.encode("12", add_special_tokens=False))
            generate(pb_grpc.InferenceStub(ch), msg)
    finally:
        del grammars.matcher
    continued = len(tokenizer.encode("12", add_special_tokens=False))
    assert len(fed_on) >= continued and all(name.startswith("kvserve-tokenize") for name in fed_on[:continued])


@pytest.mark.parametrize("span", [2, 3, 5])
def test_stop_string_across_tokens(stub, tokenizer, long_greedy, span):
    for prompt, full in zip(PROMPTS, long_greedy):
        try:
            s, start, done = _spanning_stop(tokenizer, full, span)
        except pytest.skip.Exception:
            continue
        out = generate(stub, request(token_ids=prompt, stop=[s], **greedy(60)))
        assert out.finished.finish_reason == pb.FINISH_REASON_STOP
        assert out.finished.stop == s and not out.finished.HasField("stop_token_id")
        assert out.text == full.text[:start]  # nothing of the stop string, nothing after it
        assert out.tokens == full.tokens[:done]  # ends with the token that completes it
        assert out.finished.usage.completion_tokens == done
        # no chunk ever carried a part of it that was later taken back
        assert "".join(c.text for c in out.chunks) == full.text[:start]
        return
    pytest.fail(f"no prompt's greedy text has a clean stop string across {span} tokens")


def test_a_stop_string_completed_within_min_tokens_is_text_as_vllm_takes_it(stub, tokenizer, long_greedy):
    """vLLM checks stop strings only past min_tokens; kvserve ended the request at once."""
    prompt, full = PROMPTS[0], long_greedy[0]
    s, start, done = _spanning_stop(tokenizer, full, 2)
    out = generate(stub, request(token_ids=prompt, stop=[s], min_tokens=done, **greedy(60)))
    assert out.tokens[:done] == full.tokens[:done] and out.text.startswith(full.text[:start + len(s)])
    again = full.text.find(s, start + 1)   # the next one, which completes past min_tokens
    if again < 0:
        assert out.finished.finish_reason == pb.FINISH_REASON_LENGTH and out.tokens == full.tokens
    else:
        assert out.finished.finish_reason == pb.FINISH_REASON_STOP and out.text == full.text[:again]
    assert "".join(c.text for c in out.chunks) == out.text


def test_earliest_of_several_stop_strings_wins(stub, tokenizer, long_greedy):
    prompt, full = PROMPTS[0], long_greedy[0]
    early, start, done = _spanning_stop(tokenizer, full, 2)
    late = next((full.text[i:i + 3] for i in range(start + len(early), len(full.text) - 3)
                 if _clean(full.text[i:i + 3]) and full.text.find(full.text[i:i + 3]) == i), None)
    assert late is not None
    out = generate(stub, request(token_ids=prompt, stop=[late, early], **greedy(60)))
    assert out.finished.stop == early and out.text == full.text[:start]


def test_held_back_prefix_is_released_at_max_tokens(stub, long_greedy):
    """A text that could begin a stop string is held back, and released when the request
    ends by length: the streamed text is then the whole output."""
    prompt, full = PROMPTS[1], long_greedy[1]
    tail = full.text[-2:]
    out = generate(stub, request(token_ids=prompt, stop=[tail + "\x00never"], **greedy(60)))
    assert out.finished.finish_reason == pb.FINISH_REASON_LENGTH
    assert out.text == full.text and out.tokens == full.tokens
    assert out.chunks[-1].text.endswith(tail)
