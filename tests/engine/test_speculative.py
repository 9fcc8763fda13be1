"""Speculative decoding by prompt lookup (--speculative ngram): greedy tokens equal transformers'
with speculation on, seeded sampling gives exactly the tokens it gives without, rejected drafts
are truncated from the manager and never reach its prefix tree."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.kvcache_service.contract.hashing import page_hashes
from tests.engine.harness import EngineHarness, Outcome, assert_same_tokens, hf_greedy, wait

NEW_TOKENS = 40
_rng = random.Random(5)
_span = [_rng.randrange(3, 1024) for _ in range(12)]
# Repeated spans (drafts found, often right) and random prompts (rarely found), short and long.
PROMPTS = [_span * 4, [_rng.randrange(3, 1024) for _ in range(23)], [7] * 30,
           [_rng.randrange(3, 1024) for _ in range(9)] * 3, list(range(100, 140))]


@pytest.fixture(scope="module")
def hf_refs(tiny_dirs):
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(arch):
        if arch not in cache:
            hf = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.float32).eval()
            cache[arch] = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
        return cache[arch]

    return get


def tree_hashes(h: EngineHarness) -> set[int]:
    return set(h.stack.kv.manager.state.tree.page_of)


@pytest.mark.parametrize("arch, config", [
    ("tiny", {}),
    ("tiny", {"max_num_batched_tokens": 16}),                        # chunked prefill, drafts cut to the budget
    ("tiny", {"num_pages": 48}),                                      # preempted while drafting
    ("tiny", {"num_pages": 48, "preemption_mode": "swap", "swap_pages": 64}),
    ("tiny-qwen3", {"num_draft_tokens": 7}),
    ("tiny-mistral", {"num_draft_tokens": 2}),
], ids=["batched", "chunked", "recompute", "swap", "qwen3-k7", "mistral-k2"])
def test_greedy_tokens_equal_transformers_with_speculation(tiny_dirs, hf_refs, arch, config):
    config.setdefault("num_draft_tokens", 4)
    h = EngineHarness(tiny_dirs[arch], page_size=4, speculative="ngram", **config)
    try:
        outcomes = h.run(PROMPTS, NEW_TOKENS)
        for i, (o, (ref, margins)) in enumerate(zip(outcomes, hf_refs(arch))):
            assert o.finished.completion_tokens == NEW_TOKENS
            assert_same_tokens(o.tokens, ref, margins, f"{arch} speculative, prompt {i}")
        c = h.engine.counters
        assert c.spec_drafts > 0 and 0 < c.spec_accepted_tokens < c.spec_draft_tokens   # some right, some not
        if "num_pages" in config:
            assert sum(c.preemptions.values()) > 0
        stats = h.stats()
        assert stats.used_pages == 0 and stats.num_sequences == 0
        # Only tokens the sequences really hold are cached: no rejected draft entered the tree.
        real = set()
        for p, o in zip(PROMPTS, outcomes):
            real.update(page_hashes(p + o.tokens, 4))
        assert tree_hashes(h) <= real
    finally:
        h.close()


@pytest.mark.parametrize("params", [
    {"temperature": 0.05, "seed": 11},
    {"temperature": 0.1, "top_p": 0.9, "seed": 3, "repetition_penalty": 1.02, "logprobs": 2},
    {"temperature": 0.05, "top_k": 5, "seed": 8, "frequency_penalty": 0.01},
], ids=["plain", "penalised-with-logprobs", "top-k-penalties"])
def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(tiny_dirs, params):
    """Each position is the target's own seeded draw: speculation changes how many steps it takes,
    never which token comes."""
    runs = {}
    for spec in ("off", "ngram"):
        h = EngineHarness(tiny_dirs["tiny"], page_size=4, speculative=spec, num_draft_tokens=5)
        try:
            outcomes = h.run(PROMPTS, NEW_TOKENS, **params)
            runs[spec] = [(o.tokens, o.finished.reason) for o in outcomes]
            if spec == "ngram":
                assert h.engine.counters.spec_accepted_tokens > 0
        finally:
            h.close()
    assert runs["ngram"] == runs["off"]


def test_a_drafting_sequence_holds_no_page_past_its_tokens(tiny_dirs):
    """After each step the manager's table of a sequence covers its tokens and at most the next
    step's slots: rejected drafts' pages go back at once."""
    h = EngineHarness(tiny_dirs["tiny"], page_size=4, speculative="ngram", num_draft_tokens=8)
    worst = []
    try:
        engine = h.engine
        inner = engine.runner.execute

        def execute(work):
            for w in work:
                held = len(w.request.page_table) * 4
                worst.append(held - (w.start + w.count))   # slots beyond what this step writes
            return inner(work)

        engine.runner.execute = execute
        wait([h.submit(p, 120) for p in PROMPTS])
        assert max(worst) < 4   # never a whole page beyond the step's last slot
        assert h.engine.counters.spec_draft_tokens > h.engine.counters.spec_accepted_tokens
    finally:
        h.close()


@pytest.mark.parametrize("ending", ["max_tokens=1", "stop-token", "after-a-draft"])
def test_a_request_that_ends_where_it_could_draft_still_caches_its_pages(tiny_dirs, ending):
    """No proposal is built ahead of a step whose requests may draft next, and that proposal is
    what commits a step's new pages; a request ending in such a step (in its prefill: max_tokens 1,
    a stop token first; or just after a verified draft) still gives its pages to the prefix cache,
    and the next request with its prefix hits them as without speculation."""
    prompt = _span * 4   # 48 tokens: 12 pages of 4
    hits = {}
    for spec in ("off", "ngram"):
        h = EngineHarness(tiny_dirs["tiny"], page_size=4, speculative=spec, num_draft_tokens=4)
        try:
            if ending == "max_tokens=1":
                first = h.run([prompt], 1)[0]
            elif ending == "stop-token":
                token = h.run([prompt], 1)[0].tokens[0]
                first = h.run([prompt], 10, ignore_eos=False, stop_token_ids=[token])[0]
                assert first.tokens == [token] and first.finished.reason == "stop"
            else:   # a bias makes it repeat one token: drafts found and accepted, the last ends it
                prompt = _span * 4 + [5] * 3
                first = h.run([prompt], 10, logit_bias=((5, 100.0),))[0]
                assert first.tokens == [5] * 10
            again = h.run([prompt + first.tokens], 1)[0]
            hits[spec] = again.prefill.cached_tokens
            if spec == "ngram" and ending == "after-a-draft":
                assert h.engine.counters.spec_drafts > 0
            stats = h.stats()
            assert stats.used_pages == 0 and stats.num_sequences == 0
            real = set(page_hashes(prompt + first.tokens, 4))
            assert tree_hashes(h) <= real   # no rejected draft token was committed
        finally:
            h.close()
    assert hits["ngram"] == hits["off"] > 0


def test_an_id_sent_again_as_its_request_ends_in_a_step_it_could_draft_after(tiny_dirs):
    """Such a request is released a step later than others (its last pages are committed first),
    and the manager still holds its id in that step: a request sent again under that id at once
    waits for the release instead of failing the step (ALREADY_EXISTS from the manager)."""
    from kvserve.model_service.engine.events import Finished
    from kvserve.model_service.engine.request import Request
    from kvserve.model_service.sampling.params import SamplingParams

    h = EngineHarness(tiny_dirs["tiny"], page_size=4, speculative="ngram")
    try:
        prompt = _span * 4
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        again = Outcome("same", n=1)

        def first_sink(event) -> None:
            if isinstance(event, Finished):   # on the engine thread, before the next step is built
                h.engine.submit(Request("same", list(prompt), 1, sp), again.sink)

        h.engine.submit(Request("same", list(prompt), 1, sp), first_sink)
        wait([again])
        assert len(again.tokens) == 1 and again.prefill.cached_tokens == 44   # all but the last token
        assert h.engine.counters.failed == 0
        stats = h.stats()
        assert stats.used_pages == 0 and stats.num_sequences == 0
    finally:
        h.close()


def test_the_ngram_index_covers_a_bounded_window_and_still_finds_recent_repeats(monkeypatch):
    """A stream of millions of tokens (attention sinks) grew the index with every token, and one
    continued from millions indexed them all at one step."""
    from kvserve.model_service.engine import speculation
    from kvserve.model_service.engine.speculation import DraftState, NgramDrafter

    monkeypatch.setattr(speculation, "NGRAM_WINDOW", 50)
    drafter, state = NgramDrafter(3), DraftState()
    rng = random.Random(3)
    tokens = [rng.randrange(1000, 10_000) for _ in range(1000)]
    tokens += [7, 8, 9, 10, 11] + [rng.randrange(1000, 10_000) for _ in range(20)] + [7, 8]
    assert drafter.propose(state, tokens, room=10) == [9, 10, 11]   # a repeat within the window
    assert sum(len(d) for d in state.index) <= 3 * 2 * 50
    early = tokens[:2]   # an n-gram from before the window: no longer indexed
    state.cooldown = 0
    assert drafter.propose(state, tokens + early, room=10) == []
