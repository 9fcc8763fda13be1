"""Structured outputs through the real engine: the output keeps its format (a regular expression,
a list of choices, a JSON Schema) under batching beside free-text requests, parallel sampling,
speculative decoding of the others, and recompute preemption, and ends "stop" once the format is
complete."""

from __future__ import annotations

import json
import re
import time

import pytest

from kvserve.model_service.sampling.structured import Format
from tests.engine.harness import EngineHarness, wait

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 7, [11, 12, 13, 14, 15, 16, 17, 18, 19]]
DIGITS = Format("regex", "[0-9]{3}")
CHOICES = ["yes", "no", "maybe later"]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green"]}},
          "required": ["ok", "colour"], "additionalProperties": False}
FORMATS = [DIGITS, Format("choice", json.dumps(CHOICES)), Format("json_schema", json.dumps(SCHEMA))]


def keeps(fmt: Format, text: str) -> bool:
    if fmt.kind == "regex":
        return re.fullmatch(fmt.spec, text) is not None
    if fmt.kind == "choice":
        return text in json.loads(fmt.spec)
    value = json.loads(text)
    return set(value) == {"ok", "colour"} and isinstance(value["ok"], bool) and value["colour"] in ("red", "green")


@pytest.fixture(scope="module")
def harness(tiny_dirs):
    h = EngineHarness(tiny_dirs["tiny"], page_size=4)
    yield h
    h.close()


def test_each_format_is_kept_beside_free_text(harness):
    free = harness.run(PROMPTS, 12)
    formatted = [harness.submit(p, 64, format=fmt) for fmt in FORMATS for p in PROMPTS]
    again = [harness.submit(p, 12) for p in PROMPTS]
    wait(formatted + again)
    for i, o in enumerate(formatted):
        fmt = FORMATS[i // len(PROMPTS)]
        assert keeps(fmt, o.text), (fmt.kind, o.text)
        assert o.finished.reason == "stop" and o.finished.completion_tokens < 64
    assert [o.tokens for o in again] == [o.tokens for o in free]   # the mask is its own row's alone


def test_each_sequence_of_n_keeps_the_format(harness):
    family = harness.submit(PROMPTS[0], 16, format=DIGITS, n=4, temperature=1.0, seed=9)
    wait([family])
    texts = [harness.stack.tokenizer.decode(ids) for ids in family.sequences.values()]
    assert len(texts) == 4 and all(re.fullmatch("[0-9]{3}", t) for t in texts), texts
    assert len(set(texts)) > 1   # each drew on its own


def test_speculation_of_the_others_and_recompute_preemption(tiny_dirs):
    """With speculative decoding on, a request with a format drafts nothing while free-text ones
    beside it still do; in a pool small enough to preempt, formats are still kept."""
    plain = EngineHarness(tiny_dirs["tiny"], page_size=4)
    try:
        want = [o.tokens for o in plain.run(PROMPTS, 24)]
        want_formatted = [o.text for o in plain.run(PROMPTS, 64, format=FORMATS[2])]
    finally:
        plain.close()
    spec = EngineHarness(tiny_dirs["tiny"], page_size=4, speculative="ngram", num_draft_tokens=4)
    try:
        free = [spec.submit(p, 24) for p in PROMPTS]
        formatted = [spec.submit(p, 64, format=FORMATS[2]) for p in PROMPTS]
        wait(free + formatted)
        drafted = spec.engine.counters.spec_drafts
    finally:
        spec.close()
    assert [o.tokens for o in free] == want and [o.text for o in formatted] == want_formatted
    assert drafted > 0
    small = EngineHarness(tiny_dirs["tiny"], page_size=4, num_pages=24, preemption_mode="recompute")
    long_prompts = [[(7 * i + j) % 900 + 3 for j in range(30)] for i in range(6)]
    try:
        outcomes = small.run(long_prompts, 40, format=Format("regex", "[a-z ]{20,30}"))
        preempted = small.stats().preemptions_recompute
    finally:
        small.close()
    assert preempted > 0, "the small pool did not force any preemption"
    assert all(re.fullmatch("[a-z ]{20,30}", o.text) for o in outcomes), [o.text for o in outcomes]


@pytest.mark.parametrize("fmt, stop", [(Format("choice", json.dumps(["yes"])), ["s."]),
                                       (Format("regex", "[a-c]{2}z"), ["z!", "zz"]),
                                       (Format("json_schema", json.dumps(SCHEMA)), ["}\n"])])
def test_a_format_completed_while_its_tail_could_begin_a_stop_string_is_sent_whole(harness, fmt, stop):
    """The stop check holds text back while it may begin a stop string; the format's end ends
    the request, and what was held goes out (it ended "ye" for the choice "yes")."""
    plain, held = harness.submit(PROMPTS[0], 32, format=fmt), harness.submit(PROMPTS[0], 32, format=fmt, stop=stop)
    wait([plain, held])
    assert keeps(fmt, held.text) and held.text == plain.text and held.tokens == plain.tokens
    assert held.finished.reason == "stop" and held.finished.stop == ""


def test_an_eos_that_ends_a_format_adds_no_text_even_with_ignore_eos(harness):
    eos = min(harness.stack.eos_token_ids)
    o = harness.submit(PROMPTS[0], 12, format=Format("regex", "[a-z]{1,5}"), ignore_eos=True,
                       skip_special_tokens=False, logit_bias=((eos, 30.0),))
    wait([o])
    assert o.tokens[-1] == eos and o.finished.reason == "stop"
    assert re.fullmatch("[a-z]{1,5}", o.text), o.text


def test_a_format_llguidance_cannot_follow_fails_the_request_and_not_the_others(harness):
    """A format that compiles but meets a limit of llguidance's lexer while generating: the
    request fails, saying so (it ended "stop" with text outside its format); a format no output
    can begin is refused before it runs."""
    broken = harness.submit(PROMPTS[0], 10, format=Format("regex", "a{1000000}"))
    beside = harness.submit(PROMPTS[1], 10)
    assert broken.done.wait(60) and beside.done.wait(60)
    assert broken.failure is not None and "structured output cannot be followed" in str(broken.failure)
    assert broken.finished is None
    # Copies share the compiled format's lexer, grown as the request ran (hundreds of MB for some
    # regexes): the format that failed is not kept.
    assert ("", Format("regex", "a{1000000}")) not in harness.stack.grammars._compiled
    assert beside.failure is None and len(beside.tokens) == 10
    with pytest.raises(ValueError, match="allows no output, not even an empty one"):
        harness.stack.grammars.matcher(Format("regex", "[^\\x00-\\x{10FFFF}]"))
    assert harness.stats().used_pages == 0   # the failed request's pages went back


def test_each_tenant_compiles_its_own_formats(harness):
    """A format another tenant compiled is compiled again: how fast it came would tell whether
    another tenant had used it. One tenant's second request copies its own."""
    grammars = harness.stack.grammars
    fmt = Format("regex", "[a-f]{7}")
    kept = lambda: sorted(key for key in grammars._compiled if key[1] == fmt)  # noqa: E731
    grammars.matcher(fmt, "alpha")
    grammars.matcher(fmt, "alpha")
    assert kept() == [("alpha", fmt)]
    grammars.matcher(fmt, "beta")
    assert kept() == [("alpha", fmt), ("beta", fmt)]


@pytest.mark.parametrize("fmt, text", [
    (Format("regex", "<s>x"), "<s>x"),
    (Format("regex", "ok</s>"), "ok</s>"),
    (Format("json_schema", json.dumps({"const": "a</s>"})), '"a</s>"'),
    (Format("choice", json.dumps(["<pad>", "</s> and <s>"])), None),
])
def test_a_format_that_spells_a_special_token_is_followed_as_text(harness, fmt, text):
    """A format's literal "<s>" is text (an HTML tag; Qwen's "<think>" likewise), written in
    ordinary tokens: the mask offered the special token the tokenizer reads it as, the matcher
    refused it, and the request failed mid-stream."""
    o = harness.submit(PROMPTS[2], 24, format=fmt, skip_special_tokens=False)
    wait([o])
    assert o.failure is None and o.finished.reason == "stop", o.failure
    specials = set(harness.stack.tokenizer.all_special_ids)
    assert not specials & set(o.tokens[:-1])   # spelled out; an EOS may end it
    assert (o.text == text) if text is not None else o.text in json.loads(fmt.spec), o.text


def test_x_guidance_must_be_an_object_when_given(harness):
    with pytest.raises(ValueError, match="x-guidance must be an object"):
        harness.stack.grammars.matcher(Format("json_schema", json.dumps({"type": "string", "x-guidance": []})))
    harness.stack.grammars.matcher(Format("json_schema", json.dumps({"type": "string", "x-guidance": None})))


def _whitespace_outside_strings(text: str) -> int:
    count, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            escaped, in_string = (not escaped and ch == "\\"), in_string and (escaped or ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in " \t\n\r":
            count += 1
    return count


def test_the_schema_true_is_any_value_as_compact_as_an_empty_schemas(harness):
    """`true` reached llguidance without {}'s whitespace rule: its objects were free to hold
    whitespace (where a model can loop on it for ever); `false` admits nothing and is refused."""
    family = harness.submit(PROMPTS[1], 48, format=Format("json_schema", "true"), n=8, temperature=1.0, seed=2)
    wait([family])
    texts = [harness.stack.tokenizer.decode(ids) for ids in family.sequences.values()]
    assert len(texts) == 8 and sum(map(_whitespace_outside_strings, texts)) == 0, texts
    with pytest.raises(ValueError, match="json_schema false admits no JSON value"):
        harness.stack.grammars.matcher(Format("json_schema", "false"))


def slow_schema(patterns: int) -> Format:
    """patternProperties llguidance weighs pair by pair: 400 compile for minutes."""
    props = {f"^[a-z]{{1,8}}\\.{i}\\.[a-z]{{1,8}}$": {"type": "integer"} for i in range(patterns)}
    return Format("json_schema", json.dumps({"type": "object", "patternProperties": props,
                                             "additionalProperties": False}))


def test_a_format_that_compiles_for_minutes_is_stopped_and_not_tried_again(harness):
    """--format-compile-timeout: a new format compiles first in a child process, killed past it."""
    from kvserve.model_service.sampling.structured import Grammars

    stack = harness.stack
    grammars = Grammars(stack.tokenizer, stack.model_config.vocab_size, stack.eos_token_ids, compile_timeout_s=1.0)
    try:
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"json_schema takes more than 1 s to compile"):
            grammars.matcher(slow_schema(400), "alpha")
        assert time.monotonic() - start < 30                  # not the minutes the compile would take
        assert grammars._probe._child is None                 # the child that ran it was killed
        with pytest.raises(ValueError, match="took too long to compile before"):
            grammars.matcher(slow_schema(400), "alpha")
        assert grammars.matcher(DIGITS, "alpha") is not None  # a new child for the next format
        with pytest.raises(ValueError, match="cannot be used"):   # llguidance's own refusal, from the child
            grammars.matcher(Format("json_schema", json.dumps({"type": "object", "patternProperties": {
                "^a": {}, "^ab": {}}, "additionalProperties": False})), "alpha")
    finally:
        grammars.close()


def test_the_format_probe_works_past_selects_descriptor_limit(harness):
    """select() refuses a descriptor numbered 1024 or more, and a server of thousands of
    connections has them: the child's pipes got such numbers, and every new format was refused."""
    import os
    import resource

    from kvserve.model_service.sampling.structured import Grammars

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the open-file limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    stack = harness.stack
    grammars = Grammars(stack.tokenizer, stack.model_config.vocab_size, stack.eos_token_ids, compile_timeout_s=30)
    try:
        assert grammars.matcher(Format("regex", "[0-9]{2}"), "alpha") is not None
        assert grammars._probe._child.stdout.fileno() >= 1024
    finally:
        grammars.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
