"""The manager's contract in plain data: needs, results, step plans, stats, events.

The manager's core takes and returns these; the model service and a gateway build and read
them; convert.py maps each to its protobuf message and back. No protobuf, grpc or torch here.

The per-step types (needs, commits, StepRequest, Preemption) are not frozen: a frozen
dataclass's __init__ sets every field through object.__setattr__, several times slower to
build (docs/benchmarks.md), and each Step builds dozens of them on both sides of the wire.
Treat them as read-only all the same.

Page copies are (src, dst) pairs; which pool each id refers to depends on the
list they are in (see StepPlan).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


class PreemptionMode(enum.IntEnum):
    RECOMPUTE = 1  # release the victim; its full computed pages stay cached
    SWAP = 2       # move the victim's private pages to the CPU pool


class SeqState(enum.IntEnum):
    RUNNING = 1
    SWAPPED = 2


@dataclass(slots=True)
class Grow:
    """A running sequence needs slots for positions 0 .. num_tokens-1 (a total, not a delta)."""
    seq_id: int
    num_tokens: int


@dataclass(slots=True)
class Admit:
    """A new sequence; its full prompt pages are matched against the prefix tree."""
    request_id: str
    token_ids: Sequence[int]
    extra_key: str = ""
    max_tokens: int | None = None  # at most this many uncached tokens get slots now
    skip_prefix_hits: bool = False  # computes the whole prompt: its prompt logprobs need every position


@dataclass(slots=True)
class Resume:
    """A swapped sequence comes back, with slots for num_tokens (0: those it held)."""
    seq_id: int
    num_tokens: int = 0


@dataclass(slots=True)
class Fork:
    """A child sharing the parent's full computed pages; the partial page is copied. The child
    has slots for num_tokens (0: the parent's computed tokens)."""
    parent_seq_id: int
    request_id: str
    num_tokens: int = 0


Need = Grow | Admit | Resume | Fork


@dataclass(slots=True)
class Commit:
    seq_id: int
    num_computed: int              # tokens whose K/V are written, absolute
    token_ids: Sequence[int] = ()  # tokens appended since the last commit


@dataclass(slots=True)
class Truncation:
    seq_id: int
    num_tokens: int  # dropped from the end


@dataclass(slots=True)
class Slide:
    """Pages [first_page, end_page) leave the sequence: they fell out of its attention window
    (a sliding window; first_page > 0 keeps attention sinks). Pages already gone are skipped."""
    seq_id: int
    first_page: int
    end_page: int


@dataclass(slots=True)
class StepRequest:
    epoch: int = 0
    releases: Sequence[int] = ()
    truncations: Sequence[Truncation] = ()
    commits: Sequence[Commit] = ()
    needs: Sequence[Need] = ()  # highest priority first
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    slides: Sequence[Slide] = ()


@dataclass(slots=True)
class NeedResult:
    granted: bool
    seq_id: int = 0
    page_ids: list[int] = field(default_factory=list)  # appended, or the whole table
    replaces_table: bool = False
    cached_tokens: int = 0
    num_tokens: int = 0
    reason: str = ""


@dataclass(slots=True)
class Preemption:
    seq_id: int
    request_id: str
    mode: PreemptionMode


@dataclass(slots=True)
class StepPlan:
    """What the engine executes before its forward pass, in this order:
    swap_out (device -> CPU), copies (device -> device, in order), swap_in (CPU -> device)."""
    results: list[NeedResult] = field(default_factory=list)
    preempted: list[Preemption] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    available_pages: int = 0


class Allocation(NamedTuple):
    """What one need served outside a Step gets: its result and the copies to run first."""
    result: NeedResult
    swap_in: list[tuple[int, int]]   # (CPU page, device page)
    copies: list[tuple[int, int]]    # (device page, device page), copy-on-write


@dataclass(frozen=True, slots=True)
class Check:
    """The answer of can_allocate."""
    ok: bool
    pages_needed: int
    pages_available: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SequenceInfo:
    seq_id: int
    request_id: str
    state: SeqState
    num_tokens: int
    num_computed: int
    page_ids: list[int]
    cpu_page_ids: list[int]
    cached_tokens: int
    extra_key: str


@dataclass(frozen=True, slots=True)
class Stats:
    total_pages: int
    free_pages: int
    cached_pages: int
    used_pages: int
    num_sequences: int
    free_seq_ids: int
    cpu_total_pages: int
    cpu_free_pages: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    evictions: int
    preemptions_recompute: int
    preemptions_swap: int
    page_size: int
    max_seqs: int
    num_swapped: int
    epoch: int
    tree_pages: int
    last_event: int


# ------------------------------------------------------------------ events (WatchEvents)
# Numbered from 1, one more per event; a gap in the numbers means events were missed. Each
# carries the epoch it happened in: a reader that sees the epoch change knows the cache it
# mirrors was reset, even across a restart of the manager that numbers from 1 again.

@dataclass(slots=True)
class PagesStored:
    number: int
    parent_hash: int
    hashes: tuple[int, ...]  # a chain: each the parent of the next
    epoch: int = 0


@dataclass(slots=True)
class PagesEvicted:
    number: int
    hashes: tuple[int, ...]
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class CacheReset:
    number: int
    epoch: int = 0          # the new epoch


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every page in the tree as (hash, parent hash), parents first; `number`: the last event
    it includes."""
    number: int
    pages: tuple[tuple[int, int], ...]
    epoch: int = 0


Event = PagesStored | PagesEvicted | CacheReset | Snapshot
