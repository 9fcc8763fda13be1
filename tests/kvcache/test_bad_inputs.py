"""Every bad input, against every sequence it can name, alone and after valid releases and
commits in the same Step: the right error, no change at all."""

from __future__ import annotations

import pytest

from kvserve.kvcache_service.core import Admit, Commit, KVCacheManager, ManagerConfig
from tests.kvcache.bad_inputs import BAD_INPUTS, bad_call, expect_refusal, targets_for
from tests.kvcache.invariants import check_invariants


def _rich_manager() -> KVCacheManager:
    """Running sequences with and without computed tokens, a prefix hit, a swapped one."""
    m = KVCacheManager(ManagerConfig(num_pages=16, page_size=2, max_seqs=6, cpu_pages=8))
    a = m.try_allocate(Admit("a", [1, 2, 3, 4, 5]))[0].seq_id
    m.commit(Commit(a, 5, [6]))
    b = m.try_allocate(Admit("b", [1, 2, 3, 4, 9]))[0].seq_id  # hits a's two full pages
    m.commit(Commit(b, 5, [7]))
    c = m.try_allocate(Admit("c", [8, 8, 8]))[0].seq_id
    m.commit(Commit(c, 3, [8]))
    m.swap_out(c)
    m.try_allocate(Admit("d", [5, 5, 5, 5]))  # nothing computed yet
    check_invariants(m.state)
    return m


@pytest.mark.parametrize("kind", sorted(BAD_INPUTS))
def test_bad_input_is_refused_and_changes_nothing(kind):
    """Every bad input, against every sequence it can name, alone and after valid
    releases and commits in the same Step: the right error, no change at all."""
    targets = targets_for(_rich_manager(), BAD_INPUTS[kind])
    assert targets, f"the fixture has no sequence to try {kind!r} on"
    for target in targets:
        for with_valid_parts in (False, True):
            m = _rich_manager()
            d = m.state.by_request["d"]
            others = [sid for sid in sorted(m.state.seqs) if sid not in (target, d)]
            releases = others[-1:] if with_valid_parts else []
            commits = [Commit(d, 2)] if with_valid_parts and target != d else []
            call, exc = bad_call(m, kind, target, releases, commits, "new-request")
            expect_refusal(m, kind, call, exc)


@pytest.mark.parametrize("name", ["num_pages", "max_seqs", "cpu_pages", "page_size"])
def test_a_pool_the_protocol_cannot_address_is_refused_before_it_is_built(name):
    """Its ids are uint32 on the wire: --num-pages 4294967296 built a deque of that many ids until
    the memory ran out (a traceback, or the OOM killer)."""
    with pytest.raises(ValueError, match=f"{name} must be at most 4,294,967,295 .*got 4,294,967,296"):
        ManagerConfig(**{name: 2**32})
