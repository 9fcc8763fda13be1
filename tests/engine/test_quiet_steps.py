"""Steps that ask the manager nothing are not sent: what the manager sees stays exact.

A decode inside the pages a sequence holds needs no slot, and a page not yet full needs no
commit: such a step's proposal is empty and the engine plans it itself. These tests record
every Step the manager does get and check that it still learns each page when it is needed
and each full page once, so its prefix tree and its stats end where they would have.
"""

from __future__ import annotations

from kvserve.kvcache_service.contract.types import Commit, Grow, StepRequest, Truncation
from kvserve.model_service.engine.engine import asks_nothing
from tests.engine.harness import EngineHarness

PAGE = 4
PROMPT = [5, 17, 300, 42, 9, 77, 130]   # 7 tokens: the first page fills during the prompt


class Recording:
    """The engine's KV client, keeping every Step it sends."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.address = inner.address
        self.sent: list[StepRequest] = []

    def send_step(self, request):
        self.sent.append(request)
        return self.inner.send_step(request)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_asks_nothing_only_for_an_empty_proposal():
    assert asks_nothing(StepRequest(epoch=3))
    assert not asks_nothing(StepRequest(epoch=3, releases=[1]))
    assert not asks_nothing(StepRequest(epoch=3, commits=[Commit(1, 8, [4])]))
    assert not asks_nothing(StepRequest(epoch=3, needs=[Grow(1, 9)]))
    assert not asks_nothing(StepRequest(epoch=3, truncations=[Truncation(1, 2)]))


def test_a_lone_decode_asks_the_manager_once_a_page(tiny_dirs):
    box = {}

    def wrap(inner):
        box["kv"] = Recording(inner)
        return box["kv"]

    h = EngineHarness(tiny_dirs["tiny"], page_size=PAGE, wrap_kv=wrap)
    try:
        engine, kv = h.engine, box["kv"]
        [outcome] = h.run([PROMPT], max_tokens=33)
        assert h.engine.wait_idle(30)
        assert len(outcome.tokens) == 33
        sent = kv.sent
        assert all(not asks_nothing(s) for s in sent), "an empty Step went to the manager"
        assert engine.counters.manager_steps == len(sent)
        # 33 steps (prefill + 32 decodes) and the release: a Step per page, not per token
        assert engine.counters.steps >= 33
        assert len(sent) <= 33 // PAGE + 4, [s for s in sent]
        # each Grow asks for exactly the next page, when the sequence reaches it
        grows = [n.num_tokens for s in sent for n in s.needs if isinstance(n, Grow)]
        assert grows == [PAGE * k + 1 for k in range(2, 2 + len(grows))]
        # and every full page was committed, in order, each sampled token told once (the
        # prompt's were told by the admission)
        commits = [c for s in sent for c in s.commits]
        told = [t for c in commits for t in c.token_ids]
        assert told == outcome.tokens[:len(told)] and len(told) >= 32 - PAGE
        computed = [c.num_computed for c in commits]
        assert computed == sorted(computed) and computed[-1] // PAGE == (len(PROMPT) + 32) // PAGE
        stats = kv.stats()
        assert stats.used_pages == 0 and stats.num_sequences == 0
        assert stats.cached_pages == (len(PROMPT) + 32) // PAGE   # every full computed page stays cached
    finally:
        h.close()


def test_a_repeated_prompt_hits_every_page_the_quiet_steps_filled(tiny_dirs):
    h = EngineHarness(tiny_dirs["tiny"], page_size=PAGE)
    try:
        [first] = h.run([PROMPT], max_tokens=20)
        # the whole first conversation again: its pages were committed though most steps were quiet
        [second] = h.run([PROMPT + first.tokens], max_tokens=4)
        computed = len(PROMPT) + 19   # the last sampled token's K/V was never computed
        assert second.prefill.cached_tokens == computed // PAGE * PAGE
    finally:
        h.close()
