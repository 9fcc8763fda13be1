"""Protobuf <-> core types, at the servicer edge only (the core never sees protobuf)."""

from __future__ import annotations

from kvserve.kvcache_service.core import InvalidArgument
from kvserve.kvcache_service.core.events import CacheReset, PagesEvicted, PagesStored
from kvserve.kvcache_service.core.types import (
    Admit,
    Commit,
    Fork,
    Grow,
    NeedResult,
    PreemptionMode,
    Resume,
    SequenceInfo,
    Stats,
    StepPlan,
    StepRequest,
    Truncation,
)
from kvserve.kvcache.v1 import kvcache_pb2 as pb


def need_from_pb(msg: pb.Need):
    kind = msg.WhichOneof("kind")
    if kind == "grow":
        g = msg.grow
        return Grow(g.seq_id, g.num_tokens)
    if kind == "admit":
        a = msg.admit
        # rep[:] builds the list ~2x faster than list(rep) on the upb backend
        return Admit(a.request_id, a.token_ids[:], a.extra_key,
                     a.max_tokens if a.HasField("max_tokens") else None)
    if kind == "resume":
        return Resume(msg.resume.seq_id, msg.resume.num_tokens)
    if kind == "fork":
        return Fork(msg.fork.parent_seq_id, msg.fork.request_id)
    raise InvalidArgument("need: set one of grow, admit, resume, fork")


def mode_from_pb(value: int) -> PreemptionMode:
    if value in (pb.PREEMPTION_MODE_UNSPECIFIED, pb.PREEMPTION_MODE_RECOMPUTE):
        return PreemptionMode.RECOMPUTE
    if value == pb.PREEMPTION_MODE_SWAP:
        return PreemptionMode.SWAP
    raise InvalidArgument(f"unknown preemption_mode {value}")


def commit_from_pb(c: pb.Commit) -> Commit:
    return Commit(c.seq_id, c.num_computed, c.token_ids[:])


def step_from_pb(msg: pb.StepRequest) -> StepRequest:
    return StepRequest(
        epoch=msg.epoch,
        releases=list(msg.releases),
        truncations=[Truncation(t.seq_id, t.num_tokens) for t in msg.truncations],
        commits=[Commit(c.seq_id, c.num_computed, c.token_ids[:]) for c in msg.commits],
        needs=[need_from_pb(n) for n in msg.needs],
        preemption_mode=mode_from_pb(msg.preemption_mode),
    )


def result_to_pb(r: NeedResult) -> pb.NeedResult:
    return pb.NeedResult(granted=r.granted, seq_id=r.seq_id, page_ids=r.page_ids,
                         replaces_table=r.replaces_table, cached_tokens=r.cached_tokens,
                         num_tokens=r.num_tokens, reason=r.reason)


def copies_to_pb(copies: list[tuple[int, int]]) -> list[pb.PageCopy]:
    return [pb.PageCopy(src=s, dst=d) for s, d in copies]


def plan_to_pb(plan: StepPlan) -> pb.StepResponse:
    # Filled in place with .add(): building each sub-message and handing a list of them
    # to the constructor makes upb copy every one again. Fields at their default are not
    # passed (proto3: the same bytes on the wire).
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


def sequence_to_pb(info: SequenceInfo) -> pb.SequenceInfo:
    return pb.SequenceInfo(
        seq_id=info.seq_id, request_id=info.request_id, state=int(info.state),
        num_tokens=info.num_tokens, num_computed=info.num_computed, page_ids=info.page_ids,
        cpu_page_ids=info.cpu_page_ids, cached_tokens=info.cached_tokens, extra_key=info.extra_key)


def stats_to_pb(s: Stats) -> pb.Stats:
    return pb.Stats(**{f: getattr(s, f) for f in Stats.__slots__})


def event_to_pb(e) -> pb.Event:
    if isinstance(e, PagesStored):
        return pb.Event(number=e.number, stored=pb.PagesStored(parent_hash=e.parent_hash, hashes=e.hashes))
    if isinstance(e, PagesEvicted):
        return pb.Event(number=e.number, evicted=pb.PagesEvicted(hashes=e.hashes))
    assert isinstance(e, CacheReset)
    return pb.Event(number=e.number, reset=pb.CacheReset())


def snapshot_to_pb(number: int, nodes: list[tuple[int, int]]) -> pb.Event:
    pages = [pb.StoredPage(hash=h, parent_hash=p) for h, p in nodes]
    return pb.Event(number=number, snapshot=pb.Snapshot(pages=pages))
