"""Protobuf <-> the contract's plain types, both directions, in one place.

The manager's servicer decodes requests and encodes answers with it; the client (client.py)
encodes requests and decodes answers; nothing else in kvserve touches a kvcache_pb2 message.
Every `X_to_pb(x)` has its `X_from_pb(msg)`, and tests/kvcache/test_convert.py checks that
each pair gives back what it was given. The engine needs only the Step pairs and Stats; the
rest (the fine-grained answers, events) serve clients beyond it: a gateway's index of what
each worker holds is fed by event_from_pb.

Hot paths (a Step's request and plan, on both sides) fill repeated fields in place with
.add(): building each sub-message and handing a list of them to a constructor makes upb copy
every one again; fields at their default are not set (proto3: the same bytes on the wire).
`rep[:]` builds a list from a repeated scalar field faster than list(rep) on upb.
"""

from __future__ import annotations

from kvserve.kvcache.v1 import kvcache_pb2 as pb
from kvserve.kvcache_service.contract.errors import InvalidArgument
from kvserve.kvcache_service.contract.types import (
    Admit,
    Allocation,
    CacheReset,
    Check,
    Commit,
    Event,
    Fork,
    Grow,
    Need,
    NeedResult,
    PagesEvicted,
    PagesStored,
    Preemption,
    PreemptionMode,
    Resume,
    Slide,
    SeqState,
    SequenceInfo,
    Snapshot,
    Stats,
    StepPlan,
    StepRequest,
    Truncation,
)

Copies = list[tuple[int, int]]

# ------------------------------------------------------------------------ needs


def need_from_pb(msg: pb.Need) -> Need:
    kind = msg.WhichOneof("kind")
    if kind == "grow":
        g = msg.grow
        return Grow(g.seq_id, g.num_tokens)
    if kind == "admit":
        a = msg.admit
        return Admit(a.request_id, a.token_ids[:], a.extra_key, a.max_tokens if a.HasField("max_tokens") else None,
                     a.skip_prefix_hits)
    if kind == "resume":
        return Resume(msg.resume.seq_id, msg.resume.num_tokens)
    if kind == "fork":
        return Fork(msg.fork.parent_seq_id, msg.fork.request_id, msg.fork.num_tokens)
    raise InvalidArgument("need: set one of grow, admit, resume, fork")


def need_to_pb(need: Need) -> pb.Need:
    msg = pb.Need()
    fill_need_pb(msg, need)
    return msg


def fill_need_pb(msg: pb.Need, need: Need) -> None:
    """Sets `need` into an empty Need message, in place (`fill_need_pb(repeated.add(), need)`)."""
    kind = type(need)
    if kind is Grow:
        g = msg.grow
        g.seq_id = need.seq_id
        g.num_tokens = need.num_tokens
    elif kind is Admit:
        a = msg.admit
        a.request_id = need.request_id
        a.token_ids.extend(need.token_ids)
        if need.extra_key:
            a.extra_key = need.extra_key
        if need.max_tokens is not None:
            a.max_tokens = need.max_tokens
        if need.skip_prefix_hits:
            a.skip_prefix_hits = True
    elif kind is Resume:
        r = msg.resume
        r.seq_id = need.seq_id
        r.num_tokens = need.num_tokens
    elif kind is Fork:
        f = msg.fork
        f.parent_seq_id = need.parent_seq_id
        f.request_id = need.request_id
        if need.num_tokens:
            f.num_tokens = need.num_tokens
    else:
        raise TypeError(f"not a need: {need!r}")


def mode_from_pb(value: int) -> PreemptionMode:
    if value in (pb.PREEMPTION_MODE_UNSPECIFIED, pb.PREEMPTION_MODE_RECOMPUTE):
        return PreemptionMode.RECOMPUTE
    if value == pb.PREEMPTION_MODE_SWAP:
        return PreemptionMode.SWAP
    raise InvalidArgument(f"unknown preemption_mode {value}")


def commit_from_pb(c: pb.Commit) -> Commit:
    return Commit(c.seq_id, c.num_computed, c.token_ids[:])


def commit_to_pb(c: Commit) -> pb.Commit:
    return pb.Commit(seq_id=c.seq_id, num_computed=c.num_computed, token_ids=c.token_ids)


# ------------------------------------------------------------------------- step


def step_request_from_pb(msg: pb.StepRequest) -> StepRequest:
    return StepRequest(
        epoch=msg.epoch,
        releases=msg.releases[:],
        truncations=[Truncation(t.seq_id, t.num_tokens) for t in msg.truncations],
        commits=[Commit(c.seq_id, c.num_computed, c.token_ids[:]) for c in msg.commits],
        needs=[need_from_pb(n) for n in msg.needs],
        preemption_mode=mode_from_pb(msg.preemption_mode),
        slides=[Slide(s.seq_id, s.first_page, s.end_page) for s in msg.slides],
    )


def step_request_to_pb(r: StepRequest) -> pb.StepRequest:
    msg = pb.StepRequest(epoch=r.epoch, releases=r.releases, preemption_mode=int(r.preemption_mode))
    if r.truncations:
        add = msg.truncations.add
        for t in r.truncations:
            add(seq_id=t.seq_id, num_tokens=t.num_tokens)
    add = msg.commits.add
    for c in r.commits:
        add(seq_id=c.seq_id, num_computed=c.num_computed, token_ids=c.token_ids)
    add = msg.needs.add
    for n in r.needs:
        fill_need_pb(add(), n)
    if r.slides:
        add = msg.slides.add
        for s in r.slides:
            add(seq_id=s.seq_id, first_page=s.first_page, end_page=s.end_page)
    return msg


def result_to_pb(r: NeedResult) -> pb.NeedResult:
    return pb.NeedResult(granted=r.granted, seq_id=r.seq_id, page_ids=r.page_ids,
                         replaces_table=r.replaces_table, cached_tokens=r.cached_tokens,
                         num_tokens=r.num_tokens, reason=r.reason)


def result_from_pb(r: pb.NeedResult) -> NeedResult:
    return NeedResult(r.granted, r.seq_id, r.page_ids[:], r.replaces_table, r.cached_tokens, r.num_tokens, r.reason)


def copies_to_pb(copies: Copies) -> list[pb.PageCopy]:
    return [pb.PageCopy(src=s, dst=d) for s, d in copies]


def copies_from_pb(copies) -> Copies:
    return [(c.src, c.dst) for c in copies]


def step_plan_to_pb(plan: StepPlan) -> pb.StepResponse:
    resp = pb.StepResponse(available_pages=plan.available_pages)
    add = resp.results.add
    for r in plan.results:
        if r.granted and not r.replaces_table:  # a Grow: the common result
            add(granted=True, seq_id=r.seq_id, page_ids=r.page_ids)
        else:
            add(granted=r.granted, seq_id=r.seq_id, page_ids=r.page_ids, replaces_table=r.replaces_table,
                cached_tokens=r.cached_tokens, num_tokens=r.num_tokens, reason=r.reason)
    if plan.preempted:
        add = resp.preempted.add
        for p in plan.preempted:
            add(seq_id=p.seq_id, request_id=p.request_id, mode=int(p.mode))
    for out, copies in ((resp.swap_out, plan.swap_out), (resp.swap_in, plan.swap_in), (resp.copies, plan.copies)):
        if copies:
            add = out.add
            for src, dst in copies:
                add(src=src, dst=dst)
    return resp


def step_plan_from_pb(msg: pb.StepResponse) -> StepPlan:
    # result_from_pb inlined: once per need of every Step on the engine's thread
    return StepPlan(
        results=[NeedResult(r.granted, r.seq_id, r.page_ids[:], r.replaces_table, r.cached_tokens,
                            r.num_tokens, r.reason) for r in msg.results],
        preempted=[Preemption(p.seq_id, p.request_id, PreemptionMode(p.mode)) for p in msg.preempted],
        swap_out=copies_from_pb(msg.swap_out),
        copies=copies_from_pb(msg.copies),
        swap_in=copies_from_pb(msg.swap_in),
        available_pages=msg.available_pages,
    )


# ------------------------------------------------------------ fine-grained calls


def check_to_pb(check: Check) -> pb.CanAllocateResponse:
    return pb.CanAllocateResponse(ok=check.ok, pages_needed=check.pages_needed,
                                  pages_available=check.pages_available, reason=check.reason)


def check_from_pb(msg: pb.CanAllocateResponse) -> Check:
    return Check(msg.ok, msg.pages_needed, msg.pages_available, msg.reason)


def allocation_to_pb(a: Allocation) -> pb.AllocateResponse:
    return pb.AllocateResponse(result=result_to_pb(a.result), swap_in=copies_to_pb(a.swap_in),
                               copies=copies_to_pb(a.copies))


def allocation_from_pb(msg: pb.AllocateResponse) -> Allocation:
    return Allocation(result_from_pb(msg.result), copies_from_pb(msg.swap_in), copies_from_pb(msg.copies))


# --------------------------------------------------------------------- reads


def sequence_to_pb(info: SequenceInfo) -> pb.SequenceInfo:
    return pb.SequenceInfo(
        seq_id=info.seq_id, request_id=info.request_id, state=int(info.state),
        num_tokens=info.num_tokens, num_computed=info.num_computed, page_ids=info.page_ids,
        cpu_page_ids=info.cpu_page_ids, cached_tokens=info.cached_tokens, extra_key=info.extra_key)


def sequence_from_pb(msg: pb.SequenceInfo) -> SequenceInfo:
    return SequenceInfo(msg.seq_id, msg.request_id, SeqState(msg.state), msg.num_tokens, msg.num_computed,
                        msg.page_ids[:], msg.cpu_page_ids[:], msg.cached_tokens, msg.extra_key)


def stats_to_pb(s: Stats) -> pb.Stats:
    return pb.Stats(**{f: getattr(s, f) for f in Stats.__slots__})


def stats_from_pb(msg: pb.Stats) -> Stats:
    return Stats(**{f: getattr(msg, f) for f in Stats.__slots__})


# -------------------------------------------------------------------- events


def event_to_pb(e: Event) -> pb.Event:
    if isinstance(e, PagesStored):
        return pb.Event(number=e.number, epoch=e.epoch,
                        stored=pb.PagesStored(parent_hash=e.parent_hash, hashes=e.hashes))
    if isinstance(e, PagesEvicted):
        return pb.Event(number=e.number, epoch=e.epoch, evicted=pb.PagesEvicted(hashes=e.hashes))
    if isinstance(e, CacheReset):
        return pb.Event(number=e.number, epoch=e.epoch, reset=pb.CacheReset())
    if isinstance(e, Snapshot):
        snapshot = pb.Snapshot(hashes=[h for h, _ in e.pages], parent_hashes=[p for _, p in e.pages])
        return pb.Event(number=e.number, epoch=e.epoch, snapshot=snapshot)
    raise TypeError(f"not an event: {e!r}")


def event_from_pb(msg: pb.Event) -> Event:
    kind = msg.WhichOneof("kind")
    if kind == "stored":
        return PagesStored(msg.number, msg.stored.parent_hash, tuple(msg.stored.hashes), msg.epoch)
    if kind == "evicted":
        return PagesEvicted(msg.number, tuple(msg.evicted.hashes), msg.epoch)
    if kind == "reset":
        return CacheReset(msg.number, msg.epoch)
    if kind == "snapshot":
        snap = msg.snapshot
        if len(snap.hashes) != len(snap.parent_hashes):
            raise ValueError(f"a snapshot of {len(snap.hashes)} hashes and {len(snap.parent_hashes)} parents")
        pages = tuple(zip(snap.hashes, snap.parent_hashes)) or tuple((p.hash, p.parent_hash) for p in snap.pages)
        return Snapshot(msg.number, pages, msg.epoch)
    raise ValueError(f"an event with no kind (number {msg.number})")
