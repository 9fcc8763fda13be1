"""The engine outlives its manager: a restarted manager gets a new epoch and every request it
held is re-admitted, in arrival order, from its prompt and the tokens it has generated; each
stream goes on where it was, with the tokens it would have had without the failure. A manager
that stays away past --manager-timeout ends the requests with UNAVAILABLE instead.
(Process-level versions, with kill -9 and SIGSTOP: tests/service/test_faults.py.)"""

from __future__ import annotations

import random
import threading

import pytest

from kvserve.kvcache_service.contract.types import Admit
from kvserve.model_service.engine.engine import MAX_RESYNCS
from kvserve.model_service.engine.errors import Unavailable
from tests.engine.flaky_kv import FlakyKV
from tests.engine.harness import EngineHarness, wait
from tests.service.util import wait_until

_rng = random.Random(77)
PROMPTS = [[_rng.randrange(3, 1024) for _ in range(n)] for n in (3, 9, 17, 30, 41, 55, 64, 70)]
NEW_TOKENS = 24
# Small pages and a small token budget: several pages per request and chunked prefills, so a
# kill lands on requests in every state.
CONFIG = dict(page_size=4, max_num_batched_tokens=48)


def run(model, prompts=PROMPTS, wrap_kv=None, **params):
    h = EngineHarness(model, wrap_kv=wrap_kv, **{**CONFIG, **params.pop("config", {})})
    try:
        outcomes = h.run(prompts, NEW_TOKENS, **params)
        return outcomes, h.stats(), h.engine.counters
    finally:
        h.close()


def flaky(**kwargs):
    box = {}

    def wrap(inner):
        box["kv"] = FlakyKV(inner, **kwargs)
        return box["kv"]
    return wrap, box


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.95, seed=5)],
                         ids=["greedy", "seeded"])
def test_three_restarts_change_no_token(tiny_dirs, params):
    model = tiny_dirs["tiny"]
    undisturbed, _, _ = run(model, **params)
    wrap, box = flaky(kill_at_steps=(3, 12, 30))
    outcomes, stats, counters = run(model, wrap_kv=wrap, **params)
    assert box["kv"].kills == 3 and counters.manager_losses == 3
    for i, (a, b) in enumerate(zip(outcomes, undisturbed)):
        assert a.tokens == b.tokens, f"request {i}: the restart changed its tokens"
        assert a.text == b.text and a.finished.reason == b.finished.reason == "length"
        assert a.finished.completion_tokens == NEW_TOKENS and a.prefill == b.prefill
    assert stats.used_pages == 0 and stats.num_sequences == 0


@pytest.mark.parametrize("extra", [dict(n=3), dict(config={"speculative": "ngram", "num_draft_tokens": 3})],
                         ids=["parallel-sampling", "speculative"])
def test_restarts_change_no_token_of_forked_or_speculating_sequences(tiny_dirs, extra):
    model = tiny_dirs["tiny"]
    prompts = [*PROMPTS[:5], [7] * 30]   # the last one's output repeats: drafts are accepted
    undisturbed, _, _ = run(model, prompts, temperature=0.0, **dict(extra))
    wrap, box = flaky(kill_at_steps=(4, 11, 25))
    outcomes, stats, counters = run(model, prompts, wrap_kv=wrap, temperature=0.0, **dict(extra))
    assert box["kv"].kills == 3 and counters.manager_losses == 3
    for i, (a, b) in enumerate(zip(outcomes, undisturbed)):
        assert a.sequences == b.sequences, f"request {i}: the restarts changed its tokens"
        assert len(a.finishes) == extra.get("n", 1)
    assert stats.used_pages == 0 and stats.num_sequences == 0
    if "config" in extra:
        assert counters.spec_accepted_tokens > 0


def test_requests_preempted_by_swap_are_recomputed_after_a_restart(tiny_dirs):
    """Swapped pages live in the manager's CPU pool: a restart loses them too."""
    model = tiny_dirs["tiny"]
    tight = dict(num_pages=40, swap_pages=40, preemption_mode="swap")
    undisturbed, quiet, _ = run(model, config=tight)
    assert quiet.preemptions_swap > 0, "the pool is not tight enough to swap"
    wrap, _ = flaky(kill_at_steps=(20, 40))
    outcomes, stats, counters = run(model, wrap_kv=wrap, config=tight)
    assert [o.tokens for o in outcomes] == [o.tokens for o in undisturbed]
    assert stats.used_pages == 0 and stats.cpu_free_pages == stats.cpu_total_pages


def test_a_hung_step_is_given_up_after_the_manager_timeout(tiny_dirs):
    wrap, box = flaky()
    h = EngineHarness(tiny_dirs["tiny"], wrap_kv=wrap, manager_timeout_s=0.5, **CONFIG)
    try:
        undisturbed = h.run(PROMPTS[:4], NEW_TOKENS)
        box["kv"].hang_at_steps = {box["kv"].steps + 5}
        outcomes = h.run(PROMPTS[:4], NEW_TOKENS)
        assert [o.tokens for o in outcomes] == [o.tokens for o in undisturbed]
        assert h.engine.counters.manager_losses == 1
        assert h.stats().used_pages == 0
    finally:
        h.close()


def test_a_manager_away_past_the_timeout_ends_requests_unavailable_then_serves_again(tiny_dirs):
    wrap, box = flaky()
    h = EngineHarness(tiny_dirs["tiny"], wrap_kv=wrap, manager_timeout_s=0.5, **CONFIG)
    try:
        kv = box["kv"]
        before = h.run(PROMPTS[:2], NEW_TOKENS)
        kv.down.set()
        kv.kill()
        outcomes = [h.submit(p, 200) for p in PROMPTS]
        for o in outcomes:
            assert o.done.wait(30), "a request hung while the manager was away"
            assert o.finished is None
            # the manager's address is the log's: a client (a tenant, or every client of a gateway) reads this
            assert "its KV-cache manager has been unreachable" in o.failure and "flaky-manager" not in o.failure
        assert "unreachable" in h.engine.problem() and "flaky-manager" not in h.engine.problem()
        with pytest.raises(Unavailable, match="unreachable"):
            h.submit(PROMPTS[0])
        kv.down.clear()
        wait_until(lambda: h.engine.problem() is None, what="the engine to find its manager again")
        after = h.run(PROMPTS[:2], NEW_TOKENS)
        assert [o.tokens for o in after] == [o.tokens for o in before]
        assert h.stats().used_pages == 0
        assert h.engine.counters.failed == len(PROMPTS)
    finally:
        h.close()


def test_a_request_cancelled_while_the_manager_is_away_ends_as_aborted(tiny_dirs):
    wrap, box = flaky()
    h = EngineHarness(tiny_dirs["tiny"], wrap_kv=wrap, manager_timeout_s=30, **CONFIG)
    try:
        kv = box["kv"]
        kv.down.set()
        kv.kill()
        outcome = h.submit(PROMPTS[3], 50)
        wait_until(lambda: h.engine.link.lost, what="the engine to notice")
        assert h.engine.cancel(outcome.request_id)
        assert outcome.done.wait(10) and outcome.finished.reason == "abort"
        kv.down.clear()
        wait([h.submit(PROMPTS[0], 4)])
        assert h.stats().used_pages == 0
    finally:
        h.close()


def test_another_model_service_taking_the_manager_is_not_fought(tiny_dirs):
    """A newer epoch at the manager is another instance's: this one stops, and never registers
    over it (that would wipe the other's requests)."""
    h = EngineHarness(tiny_dirs["tiny"], manager_timeout_s=0.5, **CONFIG)
    try:
        manager = h.stack.kv.manager
        outcome = h.submit(PROMPTS[6], 400)
        wait_until(lambda: outcome.tokens, what="the first token")
        newer = h.engine.epoch + 1
        manager.register(newer, h.stack.page_size, h.stack.num_pages)
        assert outcome.done.wait(30)
        assert "another one registered" in outcome.failure
        assert manager.epoch == newer
        assert h.engine.num_running == h.engine.num_waiting == h.engine.num_swapped == 0
        with pytest.raises(Unavailable):
            h.submit(PROMPTS[0])
        assert h.engine.problem() is not None
    finally:
        h.close()


def test_arrival_order_is_kept_through_a_restart(tiny_dirs):
    """One sequence at a time: requests are served strictly in arrival order, before and after."""
    wrap, box = flaky(kill_at_steps=(6,))
    h = EngineHarness(tiny_dirs["tiny"], wrap_kv=wrap, max_num_seqs=1, **CONFIG)
    try:
        order: list[str] = []
        lock = threading.Lock()

        def recording(o, event):   # from the first event: the engine may take a request at once
            if o.prefill is None and type(event).__name__ == "PrefillDone":
                with lock:
                    order.append(o.request_id)
        outcomes = [h.submit(p, 6, tap=recording) for p in PROMPTS[:4]]
        wait(outcomes)
        assert box["kv"].kills == 1
        assert order == [o.request_id for o in outcomes]
    finally:
        h.close()


def release_a_live_sequence(manager) -> None:
    manager.release(min(manager.state.seqs))


def truncate_a_live_sequence(manager) -> None:
    seq_id = max(manager.state.seqs, key=lambda i: len(manager.state.seqs[i].tokens))
    manager.truncate(seq_id, len(manager.state.seqs[seq_id].tokens) // 2)


def hold_every_seq_id(manager) -> None:
    for i in range(len(manager.state.seq_ids.free_ids())):
        manager.allocate(Admit(request_id=f"held-{i}", token_ids=[5, 6, 7]))


def admit_a_foreign_request(request_id: str):
    def meddle(manager) -> None:
        manager.allocate(Admit(request_id=request_id, token_ids=[5, 6, 7]))
    return meddle


@pytest.mark.parametrize("meddle", [release_a_live_sequence, lambda manager: manager.reset(),
                                    admit_a_foreign_request("req-8"), truncate_a_live_sequence],
                         ids=["release", "reset", "foreign-request-id", "truncate"])
def test_a_manager_changed_from_outside_changes_no_token(tiny_dirs, meddle):
    """Another client of the manager's API releases a live sequence, resets the manager, admits a
    sequence under the id a waiting request will have, or truncates a live sequence: the Step
    refused over it (NOT_FOUND, ALREADY_EXISTS, INVALID_ARGUMENT) is met as a restart, not by
    failing every request."""
    model = tiny_dirs["tiny"]
    config = {"max_num_seqs": 3}   # req-8 waits while the first requests run
    undisturbed, _, _ = run(model, temperature=0.0, config=config)
    wrap, box = flaky()

    def wrap_and_meddle(inner):
        kv = wrap(inner)
        kv.meddle_at_steps = {6: meddle}
        return kv
    outcomes, stats, counters = run(model, wrap_kv=wrap_and_meddle, temperature=0.0, config=config)
    assert counters.manager_losses == 1 and counters.failed == 0
    for i, (a, b) in enumerate(zip(outcomes, undisturbed)):
        assert a.tokens == b.tokens, f"request {i}: the meddling changed its tokens"
    assert stats.used_pages == 0 and stats.num_sequences == 0


def test_seq_ids_held_by_another_client_are_taken_back(tiny_dirs):
    """Another client of the manager's API takes every seq id before the engine's first Step: the
    admission refused while the manager holds nothing of this engine's is met as divergence (a
    new epoch frees them), not by waiting forever with health saying SERVING."""
    model = tiny_dirs["tiny"]
    undisturbed, _, _ = run(model, temperature=0.0)
    wrap, box = flaky()

    def wrap_and_hold(inner):
        kv = wrap(inner)
        kv.meddle_at_steps = {1: hold_every_seq_id}
        return kv
    outcomes, stats, counters = run(model, wrap_kv=wrap_and_hold, temperature=0.0)
    assert counters.manager_losses == 1 and counters.failed == 0
    assert [o.tokens for o in outcomes] == [o.tokens for o in undisturbed]
    assert stats.used_pages == 0 and stats.num_sequences == 0


def test_a_refusal_that_persists_is_a_fault_of_the_engines_own(tiny_dirs):
    """Registering again cannot cure every refusal: after MAX_RESYNCS in a row the requests end
    with INTERNAL, the engine starts clean, and serves once the refusals stop."""
    wrap, box = flaky()
    h = EngineHarness(tiny_dirs["tiny"], wrap_kv=wrap, **CONFIG)
    try:
        box["kv"].refuse_from_step = 4
        outcome = h.submit(PROMPTS[5], 400)
        assert outcome.done.wait(60)
        assert outcome.failure is not None and "refused" in outcome.failure
        assert h.engine.counters.manager_losses == MAX_RESYNCS
        assert h.engine.num_running == h.engine.num_waiting == 0
        box["kv"].refuse_from_step = None
        wait([h.submit(PROMPTS[0], 4)])
    finally:
        h.close()


def test_a_manager_that_refuses_this_engine_ends_its_requests_and_the_engine_lives_on(tiny_dirs):
    """A manager back with another pool size refuses Register (INVALID_ARGUMENT): the engine
    thread died of it, and nothing served again, nor ended the streams."""
    wrap, box = flaky()
    h = EngineHarness(tiny_dirs["tiny"], wrap_kv=wrap, manager_timeout_s=0.5, **CONFIG)
    try:
        kv = box["kv"]
        # (worded as the real client words it, with the manager's address)
        kv.refuse_register = (f"the KV-cache manager at {kv.address} refused to register this model service: "
                              "num_pages 2048 does not match the manager's 1024")
        kv.kill()   # the Step in flight breaks; the manager that comes back refuses us
        outcomes = [h.submit(p, 200) for p in PROMPTS[:3]]
        for o in outcomes:
            assert o.done.wait(30), "a request hung on a manager that refuses the engine"
            assert "num_pages 2048 does not match" in o.failure
            assert kv.address not in o.failure and "its KV-cache manager refused" in o.failure   # the log's alone
        assert "does not match" in h.engine.problem() and h.engine._thread.is_alive()
        assert kv.address not in h.engine.problem()
        kv.refuse_register = ""
        wait_until(lambda: h.engine.problem() is None, what="the engine registered with a manager that takes it")
        again = h.submit(PROMPTS[0], 4)
        wait([again])
        assert len(again.tokens) == 4
    finally:
        h.close()


def test_the_engine_tells_the_manager_its_swap_pages(tiny_dirs):
    """The manager refuses a model service with fewer swap pages than it plans swaps into."""
    wrap, box = flaky()
    h = EngineHarness(tiny_dirs["tiny"], wrap_kv=wrap, swap_pages=24, **CONFIG)
    try:
        assert box["kv"].registered_cpu_pages == h.engine.runner.kv_cache.num_cpu_pages == 24
    finally:
        h.close()


def test_an_idle_engine_notices_a_manager_that_stopped_answering(tiny_dirs):
    """No Step goes out while idle: health said SERVING for ever after the manager died."""
    wrap, box = flaky()
    h = EngineHarness(tiny_dirs["tiny"], wrap_kv=wrap, manager_timeout_s=0.5, **CONFIG)
    try:
        h.run(PROMPTS[:1], 4)
        h.stats()   # idle: the finished request's pages back, no Step left to send
        box["kv"].down.set()
        wait_until(lambda: h.engine.problem() is not None, timeout=15, what="the idle engine to notice")
        assert "has not answered for" in h.engine.problem() and "flaky-manager" not in h.engine.problem()
        box["kv"].down.clear()
        wait_until(lambda: h.engine.problem() is None, timeout=15, what="the manager answering again")
        assert len(h.run(PROMPTS[:1], 4)[0].tokens) == 4
    finally:
        h.close()


def test_ending_every_request_does_not_wait_for_a_manager_that_does_not_answer(tiny_dirs):
    """A drain past its grace period ends the streams at once, though the engine waits on a
    Step the manager never answers (it waited out --manager-timeout)."""
    import time

    wrap, box = flaky()
    h = EngineHarness(tiny_dirs["tiny"], wrap_kv=wrap, manager_timeout_s=60, **CONFIG)
    try:
        kv = box["kv"]
        outcome = h.submit(PROMPTS[2], 500)
        wait_until(lambda: kv.steps >= 3, what="the request running")
        kv.hang_at_steps.add(kv.steps + 1)
        wait_until(lambda: h.engine.link._waiting_since is not None and kv.steps in kv.hang_at_steps,
                   what="a Step hanging")
        start = time.monotonic()
        h.engine.end_all(Unavailable("the server shut down"))
        assert outcome.done.wait(30) and time.monotonic() - start < 30   # not the 60 s manager timeout
        assert outcome.failure == "the server shut down"
    finally:
        h.close()


def test_a_running_request_of_n_sequences_hides_no_waiting_request(tiny_dirs):
    """--max-waiting counts requests: a running request of n = 4 counted as four, and let three
    more wait than the limit allows (and the load report said one)."""
    from kvserve.model_service.engine.errors import QueueFull
    h = EngineHarness(tiny_dirs["tiny"], max_num_seqs=4, max_waiting=1, page_size=4)
    try:
        family = h.submit(PROMPTS[3], 400, n=4, temperature=1.0, seed=3)
        wait_until(lambda: h.engine.num_running == 4, what="the four sequences running")
        waiting = h.submit(PROMPTS[0], 4)
        assert h.engine.num_queued() == 1 and h.engine.num_waiting_requests() == 1
        with pytest.raises(QueueFull):
            h.submit(PROMPTS[1], 4)
        h.engine.cancel(family.request_id)
        wait([waiting])
    finally:
        h.close()
