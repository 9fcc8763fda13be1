"""Every check the manager makes before it changes anything.

A call that fails a check raises a KVCacheError and has changed nothing. Step validates its
whole request first (validate_step, against the state each part will meet: releases, then
truncations, then commits, then slides, then needs); a fine-grained call runs the same check for its one
operation.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from kvserve.kvcache_service.contract.errors import AlreadyExists, InvalidArgument, ResourceExhausted, shown
from kvserve.kvcache_service.contract.hashing import checked_token_bytes
from kvserve.kvcache_service.contract.types import (
    Admit,
    Commit,
    Fork,
    Grow,
    Need,
    Resume,
    Slide,
    SeqState,
    StepRequest,
)
from kvserve.kvcache_service.core import release
from kvserve.kvcache_service.core.sequence import DROPPED, Sequence
from kvserve.kvcache_service.core.state import ManagerState

_INT32_MAX = 2**31 - 1

MAX_NEEDS = 1 << 16   # a Step's needs, unless twice the seq-id pool is more: answers stay a few MB
# A worker's ids are its tenant's and its client's (256 characters each) together: well inside.
# Longer, an id quoted in an error's message passed what gRPC's headers hold, and the error
# reached the client as RESOURCE_EXHAUSTED "Stream removed".
MAX_REQUEST_ID_CHARS = 1024
# Hashed into every page of the sequence: a key of megabytes made each commit take seconds, the
# server's one event loop stalled meanwhile. A worker's (its salt, a tenant, a request's
# cache_salt of 256 bytes) fits well inside.
MAX_EXTRA_KEY_BYTES = 4096


def check_request_id(request_id: str, what: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"{what}: the request id has {len(request_id):,} characters; at most "
                              f"{MAX_REQUEST_ID_CHARS} are allowed")


def check_extra_key(extra_key: str, what: str) -> None:
    if extra_key.isascii() and len(extra_key) <= MAX_EXTRA_KEY_BYTES:   # the common case, without encoding it
        return
    try:   # hashed as UTF-8: a lone surrogate (an in-process caller's) failed the hashing mid-Step
        size = len(extra_key.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgument(f"{what}: extra_key is not Unicode text (it holds a lone surrogate)") from None
    if size > MAX_EXTRA_KEY_BYTES:
        raise InvalidArgument(f"{what}: extra_key has {size:,} bytes; at most {MAX_EXTRA_KEY_BYTES} are allowed")


def out_of_range(token_ids: Seq[int]) -> int | None:
    """The first token id outside [0, 2^31), or None."""
    if not token_ids or checked_token_bytes(token_ids) is not None:  # one C pass: the common case
        return None
    return next((t for t in token_ids if not (isinstance(t, int) and 0 <= t <= _INT32_MAX)), token_ids[0])


def check_new_request_id(state: ManagerState, request_id: str, what: str, pending: set[str] | None,
                         released: frozenset[str] = frozenset()) -> None:
    """`pending`: ids admitted or forked earlier in the same Step; `released`: ids of sequences the
    same Step releases first, free again by the time its needs are served."""
    if not request_id:
        raise InvalidArgument(f"{what}: request_id must not be empty")
    check_request_id(request_id, what)
    if (request_id in state.by_request and request_id not in released) or (pending and request_id in pending):
        raise AlreadyExists(f"request id {shown(request_id)} is already live")


def check_admit(state: ManagerState, need: Admit, pending: set[str] | None = None,
                released: frozenset[str] = frozenset()) -> None:
    check_new_request_id(state, need.request_id, "admit", pending, released)
    check_extra_key(need.extra_key, "admit")
    if not need.token_ids:
        raise InvalidArgument(f"admit {shown(need.request_id)}: token_ids must not be empty")
    if need.max_tokens is not None and need.max_tokens <= 0:
        raise InvalidArgument(f"admit {shown(need.request_id)}: max_tokens must be positive, got {need.max_tokens}")
    bad = out_of_range(need.token_ids)
    if bad is not None:
        raise InvalidArgument(f"admit {shown(need.request_id)}: token id {bad} is not in [0, 2^31)")


def check_need(state: ManagerState, need: Need, pending: set[str] | None = None,
               released: frozenset[str] = frozenset(), computed: int | None = None) -> None:
    """Raises for a malformed need or one naming a sequence in the wrong state. `pending`:
    request ids admitted or forked earlier in the same Step; `released`: those it releases;
    `computed`: a fork's parent's computed tokens once the Step's truncations and commits ran."""
    if isinstance(need, Grow):
        state.running_seq(need.seq_id)
        if need.num_tokens <= 0:
            raise InvalidArgument(f"grow seq id {need.seq_id}: num_tokens must be positive, got {need.num_tokens}")
    elif isinstance(need, Admit):
        check_admit(state, need, pending, released)
    elif isinstance(need, Resume):
        state.swapped_seq(need.seq_id)
        if need.num_tokens < 0:
            raise InvalidArgument(f"resume seq id {need.seq_id}: num_tokens must not be negative")
    elif isinstance(need, Fork):
        parent = state.running_seq(need.parent_seq_id)
        check_new_request_id(state, need.request_id, "fork", pending, released)
        shared = parent.num_computed if computed is None else computed
        if need.num_tokens and need.num_tokens < shared:
            raise InvalidArgument(f"fork of seq id {need.parent_seq_id}: num_tokens {need.num_tokens} is fewer "
                                  f"than the {shared} tokens the child shares")
    else:
        raise InvalidArgument(f"unknown need {need!r}")


def check_commit(state: ManagerState, c: Commit, num_tokens: int | None = None) -> None:
    """num_tokens: the sequence's token count if a truncation precedes the commit."""
    ps = state.page_size
    seq = state.seqs.get(c.seq_id)
    if seq is None or seq.state is not SeqState.RUNNING:
        seq = state.running_seq(c.seq_id)  # raises the right error
    # Tokens known past the slots held are the few sampled ahead of their slots (a draft's too);
    # past the whole pool's more, never computable: they would only cost memory, and each fork a copy.
    ahead = state.pool.num_pages * ps
    if num_tokens is None:  # the common case, in one expression; any failure is reported below
        n, ids = c.num_computed, c.token_ids
        known = len(seq.tokens) + len(ids)
        if (seq.num_computed <= n <= known and n <= len(seq.pages) * ps and known <= len(seq.pages) * ps + ahead
                and out_of_range(ids) is None):
            return
    known = (len(seq.tokens) if num_tokens is None else num_tokens) + len(c.token_ids)
    computed = seq.num_computed if num_tokens is None else min(seq.num_computed, num_tokens)
    pages = len(seq.pages) if num_tokens is None else min(len(seq.pages), -(-num_tokens // ps))
    slots = pages * ps
    if len(c.token_ids) and known > slots + ahead:
        raise InvalidArgument(
            f"commit seq id {c.seq_id}: {known} known tokens would be more than its {slots} slots and the "
            f"{ahead} the whole pool holds could ever compute")
    if c.num_computed < computed:
        raise InvalidArgument(
            f"commit seq id {c.seq_id}: num_computed {c.num_computed} is below the {computed} "
            "already computed (use Truncate to roll back)")
    if c.num_computed > known:
        raise InvalidArgument(
            f"commit seq id {c.seq_id}: num_computed {c.num_computed} exceeds the {known} known tokens")
    if c.num_computed > slots:
        raise InvalidArgument(
            f"commit seq id {c.seq_id}: num_computed {c.num_computed} exceeds the {slots} slots held")
    bad = out_of_range(c.token_ids)
    if bad is not None:
        raise InvalidArgument(f"commit seq id {c.seq_id}: token id {bad} is not in [0, 2^31)")


def check_truncate(state: ManagerState, seq_id: int, num_tokens: int) -> Sequence:
    seq = state.running_seq(seq_id)
    if num_tokens <= 0:
        raise InvalidArgument(f"truncate seq id {seq_id}: num_tokens must be positive, got {num_tokens}")
    if num_tokens >= len(seq.tokens):
        raise InvalidArgument(
            f"truncate seq id {seq_id}: cannot drop {num_tokens} of its {len(seq.tokens)} tokens "
            "(at least one must stay; release it instead)")
    keep = -(-(len(seq.tokens) - num_tokens) // state.page_size)
    if seq.pages[keep - 1:keep] == [DROPPED]:
        raise InvalidArgument(f"truncate seq id {seq_id}: its last page would be one a slide dropped")
    return seq


def check_slide(state: ManagerState, s: Slide, num_computed: int | None = None,
                num_tokens: int | None = None) -> None:
    """num_computed: the sequence's computed tokens after this Step's commit, if it has one;
    num_tokens: its tokens after this Step's truncation, if it has one."""
    seq = state.running_seq(s.seq_id)
    computed = seq.num_computed if num_computed is None else num_computed
    if num_tokens is not None:
        computed = min(computed, num_tokens)
    if not 0 <= s.first_page < s.end_page:
        raise InvalidArgument(f"slide seq id {s.seq_id}: pages [{s.first_page}, {s.end_page}) is not a "
                              "non-empty range")
    if s.end_page * state.page_size > computed:
        raise InvalidArgument(f"slide seq id {s.seq_id}: page {s.end_page - 1} is not computed yet "
                              f"({computed} tokens are)")


def check_truncate_room(state: ManagerState, seq: Sequence, num_tokens: int, available: int,
                        forecast: release.DropForecast | None = None) -> int:
    """Raises unless a truncation finds the page its copy may need, given `available` pages
    before it runs (and the drops `forecast` has seen). Returns the pages available after it."""
    forecast = forecast if forecast is not None else release.DropForecast(state)
    available += release.truncate_gain(state, seq, num_tokens, forecast)
    cost = release.truncate_cost(state, seq, num_tokens, forecast)
    if cost > available:
        raise ResourceExhausted(f"truncating seq id {seq.seq_id} needs {cost} page for the copy of its "
                                f"last page, {available} available")
    if cost:   # the copy takes the old last page's place: its reference goes, after the take
        keep = -(-(len(seq.tokens) - num_tokens) // state.page_size)
        available += forecast.drop(seq.pages[keep - 1])
    return available - cost


def validate_step(state: ManagerState, req: StepRequest) -> None:
    """Checks the whole request against the state it will meet, before any change."""
    # Each entry of these names a distinct sequence the manager holds: more cannot be valid.
    most = state.seq_ids.max_seqs
    for what, entries in (("releases", req.releases), ("truncations", req.truncations), ("commits", req.commits),
                          ("slides", req.slides)):
        if len(entries) > most:
            raise InvalidArgument(f"step: {len(entries)} {what}, more than the {most} sequences the manager "
                                  "holds at once")
    # Needs: a Grow per sequence held, and new ones; admissions past the free seq ids are refused
    # one by one (an engine may run more sequences than this manager's pool and learns it so). Past
    # MAX_NEEDS the whole Step is: the answer to a million needs outgrew gRPC's message limit after
    # the Step had been applied, and the client read "nothing changed".
    if len(req.needs) > max(MAX_NEEDS, 2 * most):
        raise InvalidArgument(f"step: {len(req.needs):,} needs, more than the {max(MAX_NEEDS, 2 * most):,} a Step "
                              "may carry")
    released = set()
    gained = 0  # pages the releases make available (freed or parked evictable) before the truncations run
    forecast = release.DropForecast(state)
    for seq_id in req.releases:
        seq = state.resolve(seq_id)
        if seq_id in released:
            raise InvalidArgument(f"step: seq id {seq_id} is released twice")
        released.add(seq_id)
        if req.truncations:  # only truncations need it: a walk over every page of the sequence
            gained += release.release_gain(forecast, seq)

    def live(seq_id: int, what: str) -> None:
        if seq_id in released:
            raise InvalidArgument(f"step: seq id {seq_id} is released and named by a {what} in the same step")

    truncated: dict[int, int] = {}
    available = state.available() + gained  # followed truncation by truncation, in the order they run
    for t in req.truncations:
        live(t.seq_id, "truncation")
        seq = check_truncate(state, t.seq_id, t.num_tokens)
        if t.seq_id in truncated:
            raise InvalidArgument(f"step: seq id {t.seq_id} is truncated twice")
        truncated[t.seq_id] = len(seq.tokens) - t.num_tokens
        available = check_truncate_room(state, seq, t.num_tokens, available, forecast)
    committed = set()
    for c in req.commits:
        live(c.seq_id, "commit")
        if c.seq_id in committed:
            raise InvalidArgument(f"step: seq id {c.seq_id} is committed twice")
        committed.add(c.seq_id)
        check_commit(state, c, truncated.get(c.seq_id))
    computed = {c.seq_id: c.num_computed for c in req.commits}
    slid = set()
    for s in req.slides:
        live(s.seq_id, "slide")
        if s.seq_id in slid:
            raise InvalidArgument(f"step: seq id {s.seq_id} slides twice")
        slid.add(s.seq_id)
        check_slide(state, s, computed.get(s.seq_id), truncated.get(s.seq_id))
    # A request released by this Step may be admitted again by it (a client retrying an id).
    freed = frozenset(state.seqs[seq_id].request_id for seq_id in released) if released else frozenset()
    _validate_needs(state, req, live, freed, truncated, computed)


def _validate_needs(state: ManagerState, req: StepRequest, live, freed: frozenset[str],
                    truncated: dict[int, int], computed: dict[int, int]) -> None:
    def computed_after(seq_id: int) -> int:
        """The sequence's computed tokens once the Step's truncations and commits have run."""
        if seq_id in computed:
            return computed[seq_id]
        n = state.seqs[seq_id].num_computed
        return min(n, truncated[seq_id]) if seq_id in truncated else n

    new_ids: set[str] = set()
    needing: set[int] = set()
    seqs = state.seqs
    for need in req.needs:
        if type(need) is Grow:  # the common need, checked inline; errors come from check_need
            seq_id = need.seq_id
            seq = seqs.get(seq_id)
            if seq is None or seq.state is not SeqState.RUNNING or need.num_tokens <= 0:
                check_need(state, need, new_ids, freed)
            live(seq_id, "need")
            if seq_id in needing:
                raise InvalidArgument(f"step: seq id {seq_id} has two needs")
            needing.add(seq_id)
            continue
        parent = need.parent_seq_id if isinstance(need, Fork) else None
        check_need(state, need, new_ids, freed,
                   computed_after(parent) if parent is not None and parent in state.seqs else None)
        if isinstance(need, (Admit, Fork)):
            new_ids.add(need.request_id)
        if isinstance(need, Fork):
            live(need.parent_seq_id, "fork")
        if isinstance(need, Resume):
            live(need.seq_id, "need")
            if need.seq_id in needing:
                raise InvalidArgument(f"step: seq id {need.seq_id} has two needs")
            needing.add(need.seq_id)
