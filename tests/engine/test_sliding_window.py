"""Sliding-window models served past their window (tiny-mistral: a 64-token window): greedy tokens
equal transformers' with prompts and outputs well past the window, under batching, chunked
prefill, preemption, speculative decoding and parallel sampling; the pages that left the window
go back to the manager while the sequence runs (its invariants checked after every step), so a
2,000-token sequence holds at most window / page_size + 2 pages; attention sinks run past the
model length."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.harness import EngineHarness, assert_same_tokens, hf_greedy, wait
from tests.kvcache.invariants import check_invariants

WINDOW, PS = 64, 4
NEW_TOKENS = 90
_rng = random.Random(64)
PROMPTS = [[_rng.randrange(3, 1024) for _ in range(n)] for n in (5, 63, 64, 65, 150, 200)]


@pytest.fixture(scope="module")
def hf_refs(tiny_dirs):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["tiny-mistral"], dtype=torch.float32).eval()
    assert hf.config.sliding_window == WINDOW
    return [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


def watch(h: EngineHarness, each_step) -> None:
    """Calls each_step(work) on the engine thread before every forward."""
    inner = h.engine.runner.execute

    def execute(work):
        each_step(work)
        return inner(work)

    h.engine.runner.execute = execute


def held_pages(h: EngineHarness, request) -> int:
    seq = h.stack.kv.manager.state.seqs.get(request.seq_id)
    return len(seq.held()) if seq is not None else 0


@pytest.mark.parametrize("config", [
    {},
    {"max_num_batched_tokens": 40},                                  # chunked prefill past the window
    {"num_pages": 120, "max_num_batched_tokens": 128},               # preempted (recompute)
    {"num_pages": 120, "max_num_batched_tokens": 128, "preemption_mode": "swap", "swap_pages": 256},
    {"speculative": "ngram", "num_draft_tokens": 4},
], ids=["batched", "chunked", "recompute", "swap", "speculative"])
def test_greedy_tokens_equal_transformers_past_the_window(tiny_dirs, hf_refs, config):
    h = EngineHarness(tiny_dirs["tiny-mistral"], page_size=PS, **config)
    try:
        assert h.stack.max_model_len == 2048   # not capped at the window
        watch(h, lambda work: check_invariants(h.stack.kv.manager.state))
        outcomes = h.run(PROMPTS, NEW_TOKENS)
        for i, (o, (ref, margins)) in enumerate(zip(outcomes, hf_refs)):
            assert_same_tokens(o.tokens, ref, margins, f"window {WINDOW}, prompt of {len(PROMPTS[i])}")
        if "num_pages" in config:
            assert sum(h.engine.counters.preemptions.values()) > 0
        stats = h.stats()
        assert stats.used_pages == 0 and stats.num_sequences == 0
    finally:
        h.close()


def test_parallel_sampling_forks_after_the_window_slid(tiny_dirs, hf_refs):
    h = EngineHarness(tiny_dirs["tiny-mistral"], page_size=PS)
    try:
        outcome = h.submit(PROMPTS[5], NEW_TOKENS, n=3)   # 200 tokens: slid before the fork
        wait([outcome])
        ref, margins = hf_refs[5]
        for i in range(3):
            assert_same_tokens(outcome.sequences[i], ref, margins, f"sequence {i}")
        assert h.engine.scheduler.forks == 2 and h.stats().used_pages == 0
    finally:
        h.close()


def test_a_long_sequence_holds_a_bounded_number_of_pages(tiny_dirs):
    h = EngineHarness(tiny_dirs["tiny-mistral"], page_size=PS)
    most = []
    try:
        request = []

        def each_step(work):
            for w in work:
                request.append(w.request)
                if w.request.num_computed > WINDOW:   # decoding past the window
                    most.append(held_pages(h, w.request))

        watch(h, each_step)
        outcome = h.submit([5, 6, 7, 8, 9, 10, 11, 12, 13, 14], 1990)
        wait([outcome])
        assert len(outcome.tokens) == 1990
        assert max(most) <= WINDOW // PS + 2, max(most)
        assert h.stats().used_pages == 0
    finally:
        h.close()


def test_a_conversation_s_turns_each_run_in_the_smallest_pool_accepted(tiny_dirs):
    """Each turn's prompt extends the last (prompt, reply, a new message) and hits the cache:
    the cached chain stays as long as one sequence stores before its first slide (each reuse
    made it a chunk longer, blocked by the sequence's own pages, until a turn that fits the
    model length was refused mid-prefill)."""
    rng = random.Random(4)
    h = EngineHarness(tiny_dirs["tiny-mistral"], num_pages=24)   # page_size 16: 384 tokens
    try:
        conversation = [rng.randrange(10, 1000) for _ in range(40)]
        for _ in range(12):   # prompts of 40 to 590 tokens
            (turn,) = h.run([conversation], 30)
            assert len(turn.tokens) == 30 and turn.prefill.cached_tokens <= WINDOW + 16
            conversation += turn.tokens + [rng.randrange(10, 1000) for _ in range(20)]
        assert h.stats().used_pages == 0
    finally:
        h.close()


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_a_growing_prompt_s_cached_chain_stays_one_window_long(tiny_dirs, speculative):
    """Each request extends the last prompt and asks for one token. Under speculation such a
    request ends in a step no proposal was built ahead of, and its last commit went without the
    slide beside it: the commit was stored, and the cached chain grew a chunk at each reuse."""
    rng = random.Random(1)
    h = EngineHarness(tiny_dirs["tiny-mistral"], page_size=4, speculative=speculative)
    try:
        prompt = [rng.randrange(10, 1000) for _ in range(60)]
        h.run([prompt], 1)
        hits = []
        for _ in range(5):
            prompt = prompt + [rng.randrange(10, 1000) for _ in range(20)]
            hits.append(h.run([prompt], 1)[0].prefill.cached_tokens)
        assert hits == [60] * 5
        assert h.stats().used_pages == 0
    finally:
        h.close()


@pytest.mark.parametrize("length", [100, 200, 400])
def test_a_prompt_longer_than_the_window_is_a_prefix_hit_when_sent_again(tiny_dirs, length):
    """Its first chunk crosses the window, and is committed beside its first slide: stored all
    the same (it is the chain later requests hit), as long as the sequence began without a hit."""
    h = EngineHarness(tiny_dirs["tiny-mistral"], num_pages=64)   # page_size 16
    try:
        prompt = [random.Random(length).randrange(10, 1000) for _ in range(length)]
        first, again = h.run([prompt], 4)[0], h.run([prompt], 4)[0]
        assert first.prefill.cached_tokens == 0 and again.prefill.cached_tokens == (length - 1) // 16 * 16
        assert again.tokens == first.tokens
    finally:
        h.close()


def test_attention_sinks_keep_their_pages_and_run_past_the_model_length(tiny_dirs):
    sinks = 8
    h = EngineHarness(tiny_dirs["tiny-mistral"], page_size=PS, attention_sink=sinks)
    most = []
    try:
        def each_step(work):
            for w in work:
                seq = h.stack.kv.manager.state.seqs.get(w.request.seq_id)
                if seq is not None and w.request.num_computed > WINDOW + sinks:
                    most.append(len(seq.held()))
                    assert all(p >= 0 for p in seq.pages[:sinks // PS]), "a sink page left"

        watch(h, each_step)
        outcome = h.submit(list(range(20, 40)), 2100)   # 2,120 tokens: past the model's 2,048
        wait([outcome])
        assert len(outcome.tokens) == 2100 and outcome.finished.reason == "length"
        assert max(most) <= sinks // PS + WINDOW // PS + 2
        assert h.stats().used_pages == 0
    finally:
        h.close()


def test_a_model_mixing_sliding_and_full_layers_equals_transformers(tiny_dirs, tmp_path):
    """Qwen2 with its first layer full and its second sliding (window 32): each layer masks its own
    way; no page leaves early (the full layer reads them all)."""
    import json

    from transformers import AutoModelForCausalLM

    src, dst = tiny_dirs["tiny-qwen2"], tmp_path / "mixed"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=32, max_window_layers=1,
               layer_types=["full_attention", "sliding_attention"])
    (dst / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    prompts = PROMPTS[1:5]
    h = EngineHarness(dst, page_size=PS, max_num_batched_tokens=48)
    try:
        outcomes = h.run(prompts, 60)
        for p, o in zip(prompts, outcomes):
            ref, margins = hf_greedy(hf, p, 60)
            assert_same_tokens(o.tokens, ref, margins, f"mixed layers, prompt of {len(p)}")
        assert h.engine.scheduler.slid_pages == 0
    finally:
        h.close()


def test_the_cpu_backend_refuses_a_sliding_window_with_a_reason(tiny_dirs):
    from kvserve.model_service.attention.select import select_backend

    try:
        backend = select_backend("cpu")
    except RuntimeError:
        pytest.skip("the cpu backend's kernel does not load here")
    with pytest.raises(RuntimeError, match="sliding-window model runs on the torch backend"):
        backend.set_window(WINDOW)


def test_the_smallest_pool_accepted_serves_a_stream_past_two_windows(tiny_dirs):
    """The prompt's pages a stream slid past stay cached, blocked by the pages it still holds,
    until the last of them leaves the window: a sequence may hold two windows' pages. A pool
    with less was accepted, and the stream ended part-way ("cannot go on with this server's KV
    cache"); it is refused at start now, and the smallest pool accepted serves the stream
    through, token for token, with a prompt long enough to be chunked and every page back."""
    from transformers import AutoModelForCausalLM

    from tests.engine.harness import EngineHarness
    sizes = dict(page_size=4, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match=r"32 pages of 4 tokens are too few for this model's 64-token sliding "
                                         r"window: a sequence may hold 128 tokens' pages and two chunks'; at least "
                                         r"38 are needed \(--num-pages, or more --kv-cache-memory\)"):
        EngineHarness(tiny_dirs["tiny-mistral"], num_pages=32, **sizes)
    with pytest.raises(ValueError, match=r"may hold 128 tokens' pages and --attention-sink 1000's and two chunks'; "
                                         r"at least 288 are needed \(--num-pages, or more --kv-cache-memory, or a "
                                         r"smaller --attention-sink\)"):   # the sink named where it is what asks
        EngineHarness(tiny_dirs["tiny-mistral"], num_pages=32, attention_sink=1000, **sizes)
    # served no longer than its window, a sequence never slides: a pool for one window will do
    EngineHarness(tiny_dirs["tiny-mistral"], num_pages=32, max_model_len=64, **sizes).close()
    prompt = list(range(20, 140))
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["tiny-mistral"], dtype=torch.float32).eval()
    ref = hf_greedy(hf, prompt, 200)
    h = EngineHarness(tiny_dirs["tiny-mistral"], num_pages=38, **sizes)
    try:
        o = h.submit(prompt, 200)
        assert o.done.wait(120), "the request never ended"
        assert o.failure is None, o.failure
        assert_same_tokens(o.tokens, *ref, "a stream past two windows in the smallest pool")
        assert h.stats().used_pages == 0
    finally:
        h.close()


def test_swapped_sequences_do_not_livelock_a_small_pool(tiny_dirs):
    """A slid sequence keeps its tree pages on the device when swapped. With two long prompts in a
    small pool and a CPU pool of three pages, the running one, short of exactly those pages,
    preempted itself (its work lost), the swapped one came back and lost its own the same way,
    and neither ever finished (thousands of steps). The manager now sends the swapped one back to
    be recomputed instead; both finish, token for token, with every page back."""
    from transformers import AutoModelForCausalLM

    prompts = [[10 + (i * 7 + j * 13) % 900 for j in range(n)] for i, n in enumerate((96, 87))]
    new_tokens = (20, 1)
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["tiny-mistral"], dtype=torch.float32).eval()
    refs = [hf_greedy(hf, p, n) for p, n in zip(prompts, new_tokens)]
    h = EngineHarness(tiny_dirs["tiny-mistral"], page_size=3, num_pages=50, preemption_mode="swap", swap_pages=3,
                      long_prefill_token_threshold=3, max_num_batched_tokens=14, max_num_seqs=4)
    try:
        watch(h, lambda work: check_invariants(h.stack.kv.manager.state))
        outcomes = [h.submit(p, n) for p, n in zip(prompts, new_tokens)]
        wait(outcomes, timeout=60)
        for o, ref in zip(outcomes, refs):
            assert_same_tokens(o.tokens, *ref, o.request_id)
        assert h.engine.counters.preemptions["swap"] >= 1   # the case is the one it was
        assert h.stats().used_pages == 0
    finally:
        h.close()
