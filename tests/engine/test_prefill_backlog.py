"""The prefill a worker reports ahead of a new request (ServerStats.prefill_tokens): a gateway
weighs it, since a long prompt's step stands between a request sent there and its first token."""

from __future__ import annotations

from tests.engine.harness import EngineHarness


def test_the_prefill_ahead_counts_the_running_step_and_what_is_left_after_it(tiny_dirs):
    h = EngineHarness(tiny_dirs["tiny"], page_size=4, max_num_batched_tokens=16)
    seen = []   # the figure while each forward runs, and after it
    engine = h.engine
    execute = engine.runner.execute

    def watched(work):
        seen.append(engine.num_prefill_tokens)
        return execute(work)

    engine.runner.execute = watched
    try:
        [outcome] = h.run([list(range(3, 43))], max_tokens=3)   # 40 prompt tokens, 16 a step
        assert h.engine.wait_idle(30)
        # 16 computed now and 24 after; 16 and 8; 8; then decodes, which are no prefill
        assert seen[:3] == [40, 24, 8], seen
        assert set(seen[3:]) == {0}, seen
        assert engine.num_prefill_tokens == 0   # nothing left once the last step ran
        assert len(outcome.tokens) == 3
    finally:
        h.close()
