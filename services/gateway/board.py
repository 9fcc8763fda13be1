"""The workers a request may go to, kept in order of how busy each is: the least busy few are
found without a pass over the fleet, so a routing decision costs the same at 1,000 workers as
at 10 (docs/benchmarks.md). Mechanism only: router.py decides whom to weigh.

A worker is on the board while it is serving and its model (page size, batch) is known. Its
place is Worker.active, the requests running or waiting there as the gateway counts them; a
worker added to a board (`add`) tells the board itself whenever that or its state changes
(Worker.changed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.services.gateway.worker import SERVING, Worker


class Shape(NamedTuple):
    """What a worker can take, from its ModelInfo."""
    page_size: int
    max_model_len: int
    num_pages: int
    streams: bool = False   # it keeps attention sinks: output may run past max_model_len
    slides: bool = False    # a sliding window: a prompt longer than its KV cache still fits
    salts: bool = False     # it keeps a request's cache_salt (an older version ignores it)
    batch: int = 1          # its --max-num-seqs


def shape_of(info: pb.ModelInfo) -> Shape:
    return Shape(info.page_size, info.max_model_len, info.num_pages, info.attention_sink > 0,
                 info.sliding_window > 0, info.takes_cache_salt, info.max_num_seqs or 1)


def why_not(s: Shape, prompt_tokens: int, length: int, output: str = "max_tokens",
            salted: bool = False) -> str | None:
    """Why a worker of shape `s` could never take the request, as it would say it (None: it
    could); {most} stands for the largest KV cache of the fleet. `output` names what asked for
    the tokens past the prompt; `salted`: the request carries a cache_salt. The one rule both a
    routing choice (router.has_room) and a refusal (never_fits) read."""
    if salted and not s.salts:
        return ("no serving worker takes a cache_salt (they run an older version, which would ignore it and "
                "share the request's pages)")
    if s.max_model_len and prompt_tokens >= s.max_model_len:
        return (f"the prompt has {prompt_tokens} tokens; the model length is {s.max_model_len}, which leaves no "
                "room for output")
    if s.max_model_len and length > s.max_model_len and (not s.streams or output != "max_tokens"):
        # (sinks let a stream run past the model length where max_tokens asks for it, nothing else:
        # min_tokens, or a moved stream's tokens with max_tokens unset, the worker refuses)
        return (f"prompt ({prompt_tokens} tokens) + {output} ({length - prompt_tokens}) = {length} exceeds "
                f"the model length {s.max_model_len}")
    if s.num_pages and not s.slides and -(-prompt_tokens // s.page_size) > s.num_pages:
        return f"the prompt has {prompt_tokens} tokens; the largest worker's KV cache holds {{most}}"
    return None


class LoadBoard:
    def __init__(self, workers: Iterable[Worker] = ()) -> None:
        """A board of `workers` as they are now (they do not report their changes to it: for
        one choice among them; `add` makes a worker keep its place current)."""
        self._place: dict[Worker, tuple[int, Shape]] = {}   # worker -> (its active count, its shape)
        self._rows: dict[int, dict[Worker, None]] = {}      # active count -> its workers, oldest move first
        self._shapes: Counter[Shape] = Counter()           # a few distinct ones, whatever the fleet's size
        self._by_address: dict[str, Worker] = {}
        self._absent: dict[Worker, Shape] = {}   # added workers off the board now, as they were when on it
        for w in workers:
            self.update(w)

    def add(self, worker: Worker) -> None:
        worker.on_change = self.update
        self.update(worker)

    def remove(self, worker: Worker) -> None:
        worker.on_change = None
        self._take_off(worker)
        self._absent.pop(worker, None)

    def update(self, worker: Worker) -> None:
        """Puts `worker` where its state and load say: in its row, or off the board."""
        place = self._take_off(worker)
        if worker.state != SERVING or worker.info is None:
            self._away(worker, place)
            return
        self._absent.pop(worker, None)
        info = worker.info
        active, shape = worker.active, shape_of(info)
        self._place[worker] = active, shape
        row = self._rows.get(active)
        if row is None:
            row = self._rows[active] = {}
        row[worker] = None
        self._shapes[shape] += 1
        self._by_address[worker.address] = worker

    def _away(self, worker: Worker, place: tuple[int, Shape] | None) -> None:
        """Remembers what a worker of this board off it now could take when back: its shape when
        it left, or what it says of itself since (it answered again, not serving yet); forgotten
        when it is back, removed, or one the gateway routes nothing to (another model)."""
        if worker.on_change != self.update or worker.excluded:   # (a board built for one choice remembers nothing)
            self._absent.pop(worker, None)
        elif place is not None:
            self._absent[worker] = place[1]
        elif worker.info is not None and worker in self._absent:
            self._absent[worker] = shape_of(worker.info)

    def least_busy(self, avoid: Worker | None = None, below: int | None = None) -> Iterator[Worker]:
        """The workers but `avoid`, the least busy first; among equals, the one whose load moved
        least recently first (so that idle workers take turns); with `below`, only those less
        busy than that."""
        for active in sorted(self._rows):
            if below is not None and active >= below:
                return
            for w in self._rows[active]:
                if w is not avoid:
                    yield w

    @property
    def largest_batch(self) -> int:
        """The largest --max-num-seqs on the board (0 when it is empty)."""
        return max((s.batch for s in self._shapes), default=0)

    def get(self, address: str) -> Worker | None:
        return self._by_address.get(address)

    @property
    def page_size(self) -> int | None:
        """The smallest page size on the board: requests are hashed and matched in it."""
        return min(s.page_size for s in self._shapes) if self._shapes else None

    def never_fits(self, prompt_tokens: int, length: int = 0, output: str = "max_tokens",
                   salted: bool = False) -> str | None:
        """Why no worker on the board could ever take a prompt of `prompt_tokens`, `length` tokens
        with its output (None: one could, or the board is empty and nothing is known yet), as the
        workers would say it; `output` names what asked for the output's length, `salted` says
        the request carries a cache_salt."""
        if not self._shapes:
            return None
        reasons = {s: why_not(s, prompt_tokens, length, output, salted) for s in self._shapes}
        if any(why is None for why in reasons.values()):
            return None
        # Each worker refuses it for a reason of its own: told as the one with the longest model says it.
        most = max(s.num_pages * s.page_size for s in self._shapes)
        return reasons[max(self._shapes, key=lambda s: (s.max_model_len, s.num_pages * s.page_size))].format(most=most)

    def fits_one_away(self, prompt_tokens: int, length: int = 0, output: str = "max_tokens",
                      salted: bool = False) -> bool:
        """A worker off the board now (down, draining, its manager lost) could take the request
        when it serves again, as it was when it last served: a request no serving worker can
        take is then worth a retry (UNAVAILABLE), not wrong in itself (INVALID_ARGUMENT)."""
        return any(why_not(s, prompt_tokens, length, output, salted) is None for s in set(self._absent.values()))

    def __contains__(self, worker: Worker) -> bool:
        return worker in self._place

    def __iter__(self) -> Iterator[Worker]:
        return iter(self._place)

    def __len__(self) -> int:
        return len(self._place)

    def _take_off(self, worker: Worker) -> tuple[int, Shape] | None:
        """Off the board; where it was (None: it was not on it)."""
        place = self._place.pop(worker, None)
        if place is None:
            return None
        active, shape = place
        row = self._rows[active]
        del row[worker]
        if not row:
            del self._rows[active]
        self._shapes[shape] -= 1
        if not self._shapes[shape]:
            del self._shapes[shape]
        if self._by_address.get(worker.address) is worker:   # not another worker of the same address
            del self._by_address[worker.address]
        return place
