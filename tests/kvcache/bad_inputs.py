"""Bad inputs for the manager: each names what it needs as a target; bad_call builds the call,
expect_refusal checks the right KVCacheError and not a single change."""

from __future__ import annotations

import pytest

from kvserve.kvcache_service.core import (
    Admit,
    AlreadyExists,
    Commit,
    FailedPrecondition,
    Fork,
    Grow,
    InvalidArgument,
    KVCacheError,
    KVCacheManager,
    NotFound,
    Resume,
    StepRequest,
    Truncation,
)
from kvserve.kvcache_service.contract.types import SeqState
from tests.kvcache.invariants import check_invariants, snapshot

BAD_INPUTS = {
    "stale epoch": None, "unknown release": None, "admit empty": None,
    "admit negative token": None, "admit token too big": None, "admit max_tokens 0": None,
    "more releases than sequences": None,
    "admit twice in a step": None, "unknown grow": None, "fork empty rid": None,
    "register epoch 0": None, "register page_size": None, "register num_pages": None,
    "match empty": None, "resolve unknown request": None, "allocate unknown": None,
    "double release": "any", "admit live rid": "any", "fork live rid": "any",
    "grow zero": "running", "resume running": "running", "commit beyond slots": "running",
    "commit beyond tokens": "running", "commit negative token": "running",
    "release and commit": "running", "release and grow": "running",
    "truncate everything": "running", "truncate zero": "running", "truncate twice": "running",
    "two needs": "running", "commit twice": "running", "can_allocate grow zero": "running",
    "commit call beyond slots": "running", "truncate call everything": "running",
    "swap-in call running": "running", "commit below computed": "computed",
    "grow swapped": "swapped", "fork swapped": "swapped", "commit swapped": "swapped",
    "swap-out call swapped": "swapped", "truncate swapped": "swapped",
}


def targets_for(m: KVCacheManager, need: str | None) -> list:
    """The seq ids a bad input of this kind can name ([None]: it names none)."""
    if need is None:
        return [None]
    running = sorted(sid for sid, s in m.state.seqs.items() if s.state is SeqState.RUNNING)
    return {
        "any": sorted(m.state.seqs),
        "running": running,
        "computed": [sid for sid in running if m.state.seqs[sid].num_computed > 0],
        "swapped": sorted(sid for sid, s in m.state.seqs.items() if s.state is SeqState.SWAPPED),
    }[need]


def bad_call(m: KVCacheManager, kind: str, sid: int | None, releases: list[int],
             commits: list[Commit], new_rid: str):
    """(a call that must fail, the KVCacheError class it must raise). Steps carry
    the valid `releases` and `commits` too, which must not be applied."""
    ps = m.page_size
    unknown = next(i for i in range(10_000) if i not in m.state.seqs)
    live = [i for i in sorted(m.state.seqs) if i not in releases and i != sid
            and m.state.seqs[i].state is SeqState.RUNNING]
    fine = [Grow(live[0], len(m.state.seqs[live[0]].tokens))] if live else []

    def step(**kw):
        base = dict(epoch=m.epoch, releases=releases, commits=commits)
        base.update(kw)
        return lambda: m.step(StepRequest(**base))

    if sid is None:
        return {
            "stale epoch": (step(epoch=m.epoch + 1), FailedPrecondition),
            "unknown release": (step(releases=releases + [unknown]), NotFound),
            "admit empty": (step(needs=fine + [Admit(new_rid, [])]), InvalidArgument),
            "admit negative token": (step(needs=[Admit(new_rid, [1, -1])]), InvalidArgument),
            "admit token too big": (step(needs=fine + [Admit(new_rid, [2**31])]), InvalidArgument),
            "admit max_tokens 0": (step(needs=[Admit(new_rid, [1], max_tokens=0)]), InvalidArgument),
            "more releases than sequences": (step(releases=list(range(m.state.seq_ids.max_seqs + 1))),
                                             InvalidArgument),
            "admit twice in a step": (step(needs=[Admit(new_rid, [1]), Admit(new_rid, [2])]),
                                      AlreadyExists),
            "unknown grow": (step(needs=fine + [Grow(unknown, 1)]), NotFound),
            "fork empty rid": (step(needs=[Fork(live[0], "")]) if live
                               else step(needs=[Admit("", [1])]), InvalidArgument),
            "register epoch 0": (lambda: m.register(0, ps, m.state.pool.num_pages), InvalidArgument),
            "register page_size": (lambda: m.register(m.epoch + 1, ps + 1, m.state.pool.num_pages),
                                   InvalidArgument),
            "register num_pages": (lambda: m.register(m.epoch + 1, ps, m.state.pool.num_pages + 1),
                                   InvalidArgument),
            "match empty": (lambda: m.match_prefix([]), InvalidArgument),
            "resolve unknown request": (lambda: m.seq_id_of("no-such-request"), NotFound),
            "allocate unknown": (lambda: m.try_allocate(Grow(unknown, 1)), NotFound),
        }[kind]
    seq = m.state.seqs[sid]
    n, computed, slots = len(seq.tokens), seq.num_computed, len(seq.pages) * ps
    over = Commit(sid, slots + 1, tuple([0] * (slots + 1)))
    return {
        "double release": (step(releases=[sid, sid]), InvalidArgument),
        "admit live rid": (step(needs=fine + [Admit(seq.request_id, [1, 2])]), AlreadyExists),
        "fork live rid": (step(needs=[Fork(live[0], seq.request_id)]) if live
                          else (lambda: m.try_allocate(Admit(seq.request_id, [1]))), AlreadyExists),
        "grow zero": (step(needs=[Grow(sid, 0)]), InvalidArgument),
        "resume running": (step(needs=[Resume(sid)]), FailedPrecondition),
        "commit beyond slots": (step(commits=commits + [over]), InvalidArgument),
        "commit beyond tokens": (step(commits=commits + [Commit(sid, n + 1)]), InvalidArgument),
        "commit negative token": (step(commits=commits + [Commit(sid, computed, (1, -3))]),
                                  InvalidArgument),
        "commit below computed": (step(commits=commits + [Commit(sid, computed - 1)]), InvalidArgument),
        "release and commit": (step(releases=releases + [sid],
                                    commits=commits + [Commit(sid, computed)]), InvalidArgument),
        "release and grow": (step(releases=releases + [sid], needs=fine + [Grow(sid, n)]),
                             InvalidArgument),
        "truncate everything": (step(truncations=[Truncation(sid, n)]), InvalidArgument),
        "truncate zero": (step(truncations=[Truncation(sid, 0)]), InvalidArgument),
        # (dropping to a page boundary: no copy, so no page shortage can answer first)
        "truncate twice": (step(truncations=[Truncation(sid, n % ps or ps)] * 2)
                           if (n % ps or ps) < n else step(truncations=[Truncation(sid, n)]),
                           InvalidArgument),
        "two needs": (step(needs=[Grow(sid, 1), Grow(sid, 2)]), InvalidArgument),
        "commit twice": (step(commits=[Commit(sid, computed), Commit(sid, computed)]), InvalidArgument),
        "can_allocate grow zero": (lambda: m.can_allocate(Grow(sid, 0)), InvalidArgument),
        "commit call beyond slots": (lambda: m.commit(over), InvalidArgument),
        "truncate call everything": (lambda: m.truncate(sid, n), InvalidArgument),
        "swap-in call running": (lambda: m.try_allocate(Resume(sid)), FailedPrecondition),
        "grow swapped": (step(needs=[Grow(sid, 1)]), FailedPrecondition),
        "fork swapped": (step(needs=[Fork(sid, new_rid)]), FailedPrecondition),
        "commit swapped": (step(commits=commits + [Commit(sid, computed)]), FailedPrecondition),
        "swap-out call swapped": (lambda: m.swap_out(sid), FailedPrecondition),
        "truncate swapped": (step(truncations=[Truncation(sid, 1)]), FailedPrecondition),
    }[kind]


def expect_refusal(m: KVCacheManager, kind: str, call, exc) -> None:
    before = snapshot(m.state)
    with pytest.raises(KVCacheError) as info:
        call()
    assert type(info.value) is exc, f"{kind}: raised {type(info.value).__name__}: {info.value}"
    assert snapshot(m.state) == before, f"{kind}: the failed call changed the state"
    check_invariants(m.state)
