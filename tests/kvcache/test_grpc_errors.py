"""Every status code the contract names, on every RPC that can return it.

For each error: the code, a message naming the offending value, no change to the
server's state (GetStats and the live sequences are the same before and after),
and a server that keeps serving (the next admission gets the next ids).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from kvserve.kvcache_service.core import ManagerConfig
from kvserve.kvcache.v1 import kvcache_pb2 as pb
from tests.kvcache.conftest import T10, KV, admit, commit, fork, grow, resume, rpc_error

from tests.kvcache.invariants import check_invariants, snapshot as core_state

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
EXISTS = grpc.StatusCode.ALREADY_EXISTS
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION

EPOCH = 3


def ref(seq_id: int | None = None, request_id: str | None = None) -> pb.SequenceRef:
    return pb.SequenceRef(seq_id=seq_id) if request_id is None else pb.SequenceRef(request_id=request_id)


def step(needs=(), **kw) -> Callable[[KV], object]:
    kw.setdefault("epoch", EPOCH)
    return lambda kv: kv.step(needs=needs, **kw)


def call(method: str, request) -> Callable[[KV], object]:
    return lambda kv: kv.call(method, request)


def allocate(need: pb.Need) -> Callable[[KV], object]:
    return call("Allocate", pb.AllocateRequest(need=need))


def can_allocate(need: pb.Need) -> Callable[[KV], object]:
    return call("CanAllocate", pb.CanAllocateRequest(need=need))


# (id, the failing call, code, substrings of the message)
CASES: list[tuple[str, Callable[[KV], object], grpc.StatusCode, tuple[str, ...]]] = [
    # ---- INVALID_ARGUMENT: malformed requests
    ("step-grow-zero", step([grow(0, 0)]), INVALID, ("seq id 0", "num_tokens", "got 0")),
    ("allocate-grow-zero", allocate(grow(0, 0)), INVALID, ("seq id 0", "got 0")),
    ("can-allocate-grow-zero", can_allocate(grow(0, 0)), INVALID, ("seq id 0", "got 0")),
    ("step-admit-empty", step([admit("new", [])]), INVALID, ("'new'", "token_ids")),
    ("allocate-admit-empty", allocate(admit("new", [])), INVALID, ("'new'", "token_ids")),
    ("step-admit-empty-request-id", step([admit("", [1])]), INVALID, ("request_id",)),
    ("step-admit-max-tokens-zero", step([admit("new", [1, 2], max_tokens=0)]), INVALID,
     ("'new'", "max_tokens", "got 0")),
    ("allocate-admit-max-tokens-zero", allocate(admit("new", [1, 2], max_tokens=0)), INVALID,
     ("'new'", "max_tokens", "got 0")),
    ("step-admit-negative-token", step([admit("neg", [1, -5, 3])]), INVALID, ("'neg'", "token id")),
    ("allocate-admit-negative-token", allocate(admit("neg", [-1])), INVALID, ("'neg'", "token id")),
    ("step-need-without-kind", step([pb.Need()]), INVALID, ("grow, admit, resume, fork",)),
    ("allocate-need-without-kind", allocate(pb.Need()), INVALID, ("grow, admit, resume, fork",)),
    ("can-allocate-need-without-kind", can_allocate(pb.Need()), INVALID, ("grow, admit, resume, fork",)),
    ("step-unknown-preemption-mode", step(mode=7), INVALID, ("preemption_mode 7",)),
    ("step-release-twice", step(releases=[0, 0]), INVALID, ("seq id 0", "twice")),
    ("step-commit-released", step(releases=[0], commits=[commit(0, 10)]), INVALID, ("seq id 0", "released")),
    ("step-two-needs-one-seq", step([grow(0, 12), grow(0, 16)]), INVALID, ("seq id 0", "two needs")),
    ("step-truncate-zero", step(truncations=[pb.Truncation(seq_id=0, num_tokens=0)]), INVALID,
     ("seq id 0", "got 0")),
    ("step-commit-beyond-known", step(commits=[commit(0, 11)]), INVALID, ("seq id 0", "11", "10 known")),
    ("register-page-size", call("Register", pb.RegisterRequest(epoch=EPOCH, page_size=8, num_pages=16)),
     INVALID, ("page_size 8", "4")),
    ("register-num-pages", call("Register", pb.RegisterRequest(epoch=EPOCH, page_size=4, num_pages=32)),
     INVALID, ("num_pages 32", "16")),
    ("register-page-size-new-epoch", call("Register", pb.RegisterRequest(epoch=9, page_size=16, num_pages=16)),
     INVALID, ("page_size 16", "4")),
    ("register-epoch-zero", call("Register", pb.RegisterRequest(epoch=0, page_size=4, num_pages=16)),
     INVALID, ("epoch", "got 0")),
    ("commit-below-computed", call("Commit", pb.CommitRequest(commit=commit(0, 4))), INVALID,
     ("seq id 0", "num_computed 4", "8")),
    ("commit-beyond-slots", call("Commit", pb.CommitRequest(commit=commit(0, 13, [1, 2, 3]))), INVALID,
     ("seq id 0", "13", "12 slots")),
    ("commit-negative-token", call("Commit", pb.CommitRequest(commit=commit(0, 10, [-7]))), INVALID,
     ("seq id 0", "token id")),
    ("truncate-zero", call("Truncate", pb.TruncateRequest(seq=ref(0), num_tokens=0)), INVALID,
     ("seq id 0", "got 0")),
    ("truncate-everything", call("Truncate", pb.TruncateRequest(seq=ref(0), num_tokens=10)), INVALID,
     ("seq id 0", "10 of its 10")),
    ("match-prefix-empty", call("MatchPrefix", pb.MatchPrefixRequest()), INVALID, ("token_ids",)),
    ("match-prefix-negative-id", call("MatchPrefix", pb.MatchPrefixRequest(token_ids=[1, -5, 2])), INVALID,
     ("token id -5",)),
    ("release-without-ref", call("Release", pb.ReleaseRequest()), INVALID, ("seq_id or request_id",)),
    # ids and keys past what any worker sends: an id quoted in a message passed gRPC's header limit
    # (RESOURCE_EXHAUSTED "Stream removed"), and a key of megabytes is hashed into every page
    ("step-admit-long-request-id", step([admit("r" * 1025, [1])]), INVALID, ("1,025 characters", "at most 1024")),
    ("fork-long-request-id", call("Fork", pb.ForkRequest(parent=ref(0), request_id="c" * 20_000)), INVALID,
     ("20,000 characters",)),
    ("step-admit-long-extra-key", step([admit("new", [1], extra_key="k" * 4097)]), INVALID,
     ("extra_key has 4,097 bytes", "at most 4096")),
    ("match-prefix-long-extra-key", call("MatchPrefix", pb.MatchPrefixRequest(token_ids=[1], extra_key="é" * 2049)),
     INVALID, ("extra_key has 4,098 bytes",)),
    ("commit-unset", call("Commit", pb.CommitRequest()), INVALID, ("commit: set it",)),   # not sequence 0's
    ("fork-without-parent", call("Fork", pb.ForkRequest(request_id="c")), INVALID, ("parent",)),
    ("fork-empty-request-id", call("Fork", pb.ForkRequest(parent=ref(0))), INVALID, ("request_id",)),
    # ---- NOT_FOUND: unknown seq ids and request ids
    ("get-sequence-seq-id", call("GetSequence", pb.GetSequenceRequest(seq=ref(42))), NOT_FOUND, ("42",)),
    ("get-sequence-request-id", call("GetSequence", pb.GetSequenceRequest(seq=ref(request_id="nope"))),
     NOT_FOUND, ("'nope'",)),
    ("get-sequence-long-request-id", call("GetSequence", pb.GetSequenceRequest(seq=ref(request_id="x" * 20_000))),
     NOT_FOUND, ("'" + "x" * 197 + "…'",)),   # quoted in part: a header holds the message
    ("release-seq-id", call("Release", pb.ReleaseRequest(seq=ref(42))), NOT_FOUND, ("42",)),
    ("release-request-id", call("Release", pb.ReleaseRequest(seq=ref(request_id="nope"))), NOT_FOUND,
     ("'nope'",)),
    ("commit", call("Commit", pb.CommitRequest(commit=commit(42, 1))), NOT_FOUND, ("42",)),
    ("truncate", call("Truncate", pb.TruncateRequest(seq=ref(42), num_tokens=1)), NOT_FOUND, ("42",)),
    ("swap-out", call("SwapOut", pb.SwapOutRequest(seq=ref(request_id="nope"))), NOT_FOUND, ("'nope'",)),
    ("swap-in", call("SwapIn", pb.SwapInRequest(seq=ref(42))), NOT_FOUND, ("42",)),
    ("fork-parent", call("Fork", pb.ForkRequest(parent=ref(42), request_id="c")), NOT_FOUND, ("42",)),
    ("step-release", step(releases=[42]), NOT_FOUND, ("42",)),
    ("step-grow", step([grow(42, 4)]), NOT_FOUND, ("42",)),
    ("step-resume", step([resume(42)]), NOT_FOUND, ("42",)),
    ("step-fork", step([fork(42, "c")]), NOT_FOUND, ("42",)),
    ("step-commit", step(commits=[commit(42, 1)]), NOT_FOUND, ("42",)),
    ("allocate-grow", allocate(grow(42, 4)), NOT_FOUND, ("42",)),
    ("can-allocate-resume", can_allocate(resume(42)), NOT_FOUND, ("42",)),
    # ---- ALREADY_EXISTS: a live request id
    ("allocate-admit-live", allocate(admit("run", [1])), EXISTS, ("'run'",)),
    ("allocate-admit-swapped", allocate(admit("swapped", [1])), EXISTS, ("'swapped'",)),
    ("step-admit-live", step([admit("run", [1])]), EXISTS, ("'run'",)),
    ("step-admit-twice", step([admit("dup", [1]), admit("dup", [2])]), EXISTS, ("'dup'",)),
    ("step-fork-live", step([fork(0, "swapped")]), EXISTS, ("'swapped'",)),
    ("fork-live", call("Fork", pb.ForkRequest(parent=ref(0), request_id="run")), EXISTS, ("'run'",)),
    # repr spells each of these in ten characters: quoted whole, the message passed gRPC's headers
    ("step-admit-twice-unprintable", step([admit("\U000e0001" * 1024, [1]), admit("\U000e0001" * 1024, [2])]),
     EXISTS, ("'\\U000e0001", "…' is already live")),
    # ---- RESOURCE_EXHAUSTED: the fine-grained calls run out of pages
    ("allocate-grow-too-big", allocate(grow(0, 100)), EXHAUSTED, ("22 pages", "13 available")),
    ("allocate-admit-too-big", allocate(admit("big", list(range(60)))), EXHAUSTED, ("15 pages", "13 available")),
    # ---- FAILED_PRECONDITION: a stale epoch, a sequence in the wrong state
    ("step-stale-epoch", step([admit("new", [1])], epoch=EPOCH - 1), PRECONDITION,
     (f"stale epoch {EPOCH - 1}", f"epoch {EPOCH}")),
    ("step-epoch-zero-after-register", step(epoch=0), PRECONDITION, ("stale epoch 0",)),
    ("step-grow-swapped", step([grow(1, 8)]), PRECONDITION, ("seq id 1", "swapped out")),
    ("allocate-grow-swapped", allocate(grow(1, 8)), PRECONDITION, ("seq id 1", "swapped out")),
    ("step-commit-swapped", step(commits=[commit(1, 5)]), PRECONDITION, ("seq id 1",)),
    ("commit-swapped", call("Commit", pb.CommitRequest(commit=commit(1, 5))), PRECONDITION, ("seq id 1",)),
    ("truncate-swapped", call("Truncate", pb.TruncateRequest(seq=ref(1), num_tokens=1)), PRECONDITION,
     ("seq id 1",)),
    ("swap-out-swapped", call("SwapOut", pb.SwapOutRequest(seq=ref(request_id="swapped"))), PRECONDITION,
     ("seq id 1", "swapped out")),
    ("swap-in-running", call("SwapIn", pb.SwapInRequest(seq=ref(0))), PRECONDITION,
     ("seq id 0", "not swapped out")),
    ("step-resume-running", step([resume(0)]), PRECONDITION, ("seq id 0", "not swapped out")),
    ("allocate-resume-running", allocate(resume(0)), PRECONDITION, ("seq id 0", "not swapped out")),
    ("step-fork-swapped", step([fork(1, "c")]), PRECONDITION, ("seq id 1",)),
    ("fork-swapped", call("Fork", pb.ForkRequest(parent=ref(1), request_id="c")), PRECONDITION, ("seq id 1",)),
]


@pytest.fixture
def seeded(kv: KV) -> KV:
    """Epoch 3; seq 0 'run' (10 tokens, 8 computed: pages 0-2, two in the tree);
    seq 1 'swapped' (5 tokens, swapped out to CPU pages 0-1). 13 device pages free."""
    kv.call("Register", pb.RegisterRequest(epoch=EPOCH, page_size=4, num_pages=16))
    assert kv.admit("run", T10).seq_id == 0
    assert kv.commit(0, 8) == 2
    assert kv.admit("swapped", [1, 2, 3, 4, 5]).seq_id == 1
    kv.call("SwapOut", pb.SwapOutRequest(seq=ref(1)))
    return kv


def snapshot(kv: KV) -> tuple:
    """What clients can see, plus (between calls, when the server is idle) the core's whole state."""
    seen = (kv.stats(), kv.seq(seq_id=0), kv.seq(seq_id=1))
    return (*seen, core_state(kv.manager.state))


@pytest.mark.parametrize("fails, code, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error_changes_nothing_and_the_server_keeps_serving(
    seeded: KV, fails: Callable[[KV], object], code: grpc.StatusCode, words: tuple[str, ...]
) -> None:
    kv = seeded
    before = snapshot(kv)
    err = rpc_error(lambda: fails(kv))
    assert err.code() == code, err.details()
    for word in words:
        assert word in err.details()
    assert snapshot(kv) == before
    check_invariants(kv.manager.state)
    # Still serving, and no id leaked: the next admission gets the next seq id and page.
    r = kv.step(epoch=EPOCH, needs=[admit("after", [9, 9])]).results[0]
    assert (r.granted, r.seq_id, list(r.page_ids)) == (True, 2, [5])


def test_no_free_seq_id_is_resource_exhausted_and_changes_nothing(kv_factory) -> None:
    kv = kv_factory(ManagerConfig(num_pages=16, page_size=4, max_seqs=2, cpu_pages=8))
    kv.admit("a", T10)
    kv.admit("b", [1])
    before = kv.stats()
    for fails in (lambda: kv.admit("c", [1]), lambda: kv.allocate(fork(0, "c")),
                  lambda: kv.call("Fork", pb.ForkRequest(parent=ref(0), request_id="c"))):
        err = rpc_error(fails)
        assert err.code() == EXHAUSTED and "no free seq id" in err.details()
    assert kv.stats() == before
    kv.release(request_id="b")
    assert kv.admit("c", [1]).seq_id == 1


def test_swap_out_without_cpu_pages_is_resource_exhausted(kv_factory) -> None:
    kv = kv_factory(ManagerConfig(num_pages=16, page_size=4, max_seqs=8, cpu_pages=0))
    kv.admit("a", T10)
    before = kv.stats()
    err = rpc_error(lambda: kv.call("SwapOut", pb.SwapOutRequest(seq=ref(0))))
    assert err.code() == EXHAUSTED
    assert "seq id 0" in err.details() and "needs 3 CPU pages, 0 free" in err.details()
    assert kv.stats() == before
    # Step falls back to RECOMPUTE when the CPU pool cannot take the victim.
    kv.admit("b", list(range(52)))  # pages 3-15
    step = kv.step(needs=[grow(0, 13)], mode=pb.PREEMPTION_MODE_SWAP)
    assert [(p.seq_id, p.mode) for p in step.preempted] == [(1, pb.PREEMPTION_MODE_RECOMPUTE)]


def test_swap_in_and_fork_without_pages_are_resource_exhausted(kv: KV) -> None:
    kv.admit("a", T10)  # pages 0-2
    kv.commit(0, 10)
    kv.call("SwapOut", pb.SwapOutRequest(seq=ref(0)))  # page 2 freed, 0 and 1 stay cached
    kv.admit("fill", list(range(500, 556)))  # 14 pages: 3-15 and 2
    before = kv.stats()
    assert (before.free_pages, before.cached_pages) == (0, 2)
    err = rpc_error(lambda: kv.call("SwapIn", pb.SwapInRequest(seq=ref(0))))
    # The two cached pages are the sequence's own (hits), so none is available for the copy.
    assert err.code() == EXHAUSTED and "needs 1 pages, 0 available" in err.details()
    kv.admit("x", [1])  # evicts page 1, then page 0: nothing is left to take
    kv.admit("y", [2])
    kv.commit(1, 55)
    err = rpc_error(lambda: kv.call("Fork", pb.ForkRequest(parent=ref(request_id="fill"), request_id="c")))
    assert err.code() == EXHAUSTED and "needs 1 pages, 0 available" in err.details()
    err = rpc_error(lambda: kv.call("SwapIn", pb.SwapInRequest(seq=ref(request_id="a"))))
    assert err.code() == EXHAUSTED and "needs 3 pages, 0 available" in err.details()
    after = kv.stats()
    assert (after.num_sequences, after.free_seq_ids, after.used_pages, after.free_pages) == (4, 4, 16, 0)


def test_a_truncation_without_a_page_for_its_copy_is_resource_exhausted(kv: KV) -> None:
    kv.admit("a", T10[:8])
    kv.commit(0, 8)                    # pages 0, 1: both full, both in the tree
    kv.admit("fill", list(range(56)))  # pages 2-15: nothing free, nothing cached
    before = snapshot(kv)
    # Dropping one token makes page 1 (a tree page) the partial last one: it must be copied,
    # the truncation itself frees nothing, and no page is left.
    err = rpc_error(lambda: kv.call("Truncate", pb.TruncateRequest(seq=ref(0), num_tokens=1)))
    assert err.code() == EXHAUSTED and "seq id 0" in err.details()
    err = rpc_error(lambda: kv.step(truncations=[pb.Truncation(seq_id=0, num_tokens=1)]))
    assert err.code() == EXHAUSTED and "0 available" in err.details()
    assert snapshot(kv) == before


def test_a_negative_token_id_is_named_in_the_message(seeded: KV) -> None:
    kv = seeded
    for fails in (lambda: kv.step(epoch=EPOCH, needs=[admit("neg", [1, -5, 3])]),
                  lambda: kv.allocate(admit("neg", [1, -5, 3])),
                  lambda: kv.call("Commit", pb.CommitRequest(commit=commit(0, 10, [-5])))):
        err = rpc_error(fails)
        assert err.code() == INVALID and "-5" in err.details(), err.details()


# Bytes that are no protobuf message (a truncated varint), and a ReleaseRequest whose
# seq.request_id holds bytes that are not UTF-8: grpc itself would answer UNKNOWN with the
# parser's exception class.
NOT_PROTOBUF = b"\xff\xff\xff\xff"
BAD_UTF8_RELEASE = b"\x0a\x04\x12\x02\xc3\x28"


@pytest.mark.parametrize("method, kind, expected, raw", [
    ("GetStats", "unary_unary", "kvserve.kvcache.v1.GetStatsRequest", NOT_PROTOBUF),
    ("Release", "unary_unary", "kvserve.kvcache.v1.ReleaseRequest", NOT_PROTOBUF),
    ("Release", "unary_unary", "kvserve.kvcache.v1.ReleaseRequest", BAD_UTF8_RELEASE),
    ("WatchEvents", "unary_stream", "kvserve.kvcache.v1.WatchEventsRequest", NOT_PROTOBUF),
    ("StepStream", "stream_stream", "kvserve.kvcache.v1.StepRequest", NOT_PROTOBUF),
], ids=["unary", "unary-other", "unary-bad-utf8", "server-stream", "bidi-stream"])
def test_bytes_that_do_not_parse_are_invalid_argument(kv: KV, method: str, kind: str, expected: str,
                                                      raw: bytes) -> None:
    before = kv.stats()
    path = f"/kvserve.kvcache.v1.KVCacheManager/{method}"
    call_raw = getattr(kv.channel, kind)(path)   # no serializers: the bytes go as they are

    def send():
        if kind == "stream_stream":
            return list(call_raw(iter([raw]), timeout=5))
        if kind == "unary_stream":
            return list(call_raw(raw, timeout=5))
        return call_raw(raw, timeout=5)

    err = rpc_error(send)
    assert err.code() == INVALID, err.details()
    assert err.details() == f"the request is not a valid {expected}: its bytes could not be parsed"
    assert kv.stats() == before
    kv.admit("after", T10)   # and the next call is served


def test_a_bad_message_later_in_a_step_stream_ends_it_after_the_good_ones(kv: KV) -> None:
    call_raw = kv.channel.stream_stream("/kvserve.kvcache.v1.KVCacheManager/StepStream")
    good = pb.StepRequest().SerializeToString()   # an empty step at the fresh manager's epoch, 0
    answers = []

    def send():
        for answer in call_raw(iter([good, good, NOT_PROTOBUF, good]), timeout=5):
            answers.append(answer)

    err = rpc_error(send)
    assert err.code() == INVALID, err.details()
    assert len(answers) == 2


def test_a_bug_in_the_core_ends_the_call_internal_with_an_incident_id_and_no_repr(kv: KV, monkeypatch, caplog) -> None:
    def broken(*args, **kwargs):
        raise KeyError("dictionary is empty")
    monkeypatch.setattr(kv.manager, "release", broken)
    kv.admit("a", T10)
    err = rpc_error(lambda: kv.release(seq_id=0))
    assert err.code() == grpc.StatusCode.INTERNAL, err.details()
    assert err.details().startswith("internal error in the manager (incident ")
    assert "KeyError" not in err.details() and "dictionary" not in err.details()
    incident = err.details().split("incident ")[1].split(";")[0]
    assert incident in caplog.text and "KeyError" in caplog.text   # the traceback is in the log
    monkeypatch.undo()
    assert kv.release(seq_id=0).pages_freed == 3   # and the next call is served
