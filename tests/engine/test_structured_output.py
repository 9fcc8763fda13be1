"""Structured outputs through the real engine: the output keeps its format (a regular expression,
a list of choices, a JSON Schema) under batching beside free-text requests, parallel sampling,
speculative decoding of the others, and recompute preemption, and ends "stop" once the format is
complete."""

from __future__ import annotations

import json
import re

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
