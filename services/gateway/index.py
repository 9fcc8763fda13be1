"""Which worker holds which page, as its manager's events say: hash -> workers, worker -> hashes.

Mechanism only: the follower (follow.py) decides when a worker's entries are replaced or
dropped; the router (router.py) reads matches. Only a stored event (or a snapshot) credits a
worker with a page; routing a request there never does.

Compact, as a gateway follows every page of every worker: each worker has a slot (the lowest
free one), and a page's holders are one int with a bit per slot, not a set of addresses (a set
per page cost ~370 bytes per page and worker; docs/benchmarks.md has both). A prefix match is
then an AND per page over every holder at once.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, int] = {}    # page hash -> bit (1 << slot) of each worker holding it
        self._slots: dict[str, int] = {}      # worker -> its slot
        self._names: list[str | None] = []    # slot -> worker
        self._held: list[set[int]] = []       # slot -> the pages it holds
        self._free: list[int] = []            # slots given back, lowest first

    def add(self, worker: str, hashes: Iterable[int]) -> None:
        slot = self._slots.get(worker)
        if slot is None:
            slot = self._take_slot(worker)
        bit, held, holders = 1 << slot, self._held[slot], self._holders
        for h in hashes:
            held.add(h)
            holders[h] = holders.get(h, 0) | bit

    def remove(self, worker: str, hashes: Iterable[int]) -> None:
        slot = self._slots.get(worker)
        if slot is not None:
            gone = self._held[slot].intersection(hashes)
            self._held[slot] -= gone
            self._unset(slot, gone)

    def drop(self, worker: str) -> None:
        """Forgets everything `worker` held, at once; its slot is free again."""
        slot = self._slots.pop(worker, None)
        if slot is None:
            return
        self._unset(slot, self._held[slot])
        self._held[slot] = set()
        self._names[slot] = None
        heapq.heappush(self._free, slot)

    def replace(self, worker: str, hashes: Iterable[int]) -> None:
        self.drop(worker)
        self.add(worker, hashes)

    def holders(self, hashes: Sequence[int], most: int | None = None) -> dict[str, int]:
        """The workers holding at least the first page of `hashes`, each with how many of the
        leading pages it holds; with `most`, only that many of those holding the most (a prompt
        whose first pages every warm worker holds, a shared system prompt's, would otherwise
        name the whole fleet)."""
        first = self._holders.get(hashes[0], 0) if hashes else 0
        if not first:
            return {}
        return self._depths(hashes, first) if most is None else self._deepest(hashes, first, most)

    def matches(self, hashes: Sequence[int], workers: Iterable[str]) -> dict[str, int]:
        """For each worker, how many of the leading pages of `hashes` it holds."""
        out = dict.fromkeys(workers, 0)
        mask = 0
        for w in out:
            slot = self._slots.get(w)
            if slot is not None:
                mask |= 1 << slot
        out.update(self._depths(hashes, mask))
        return out

    def pages_of(self, worker: str) -> int:
        slot = self._slots.get(worker)
        return 0 if slot is None else len(self._held[slot])

    def holds(self, worker: str, page_hash: int) -> bool:
        slot = self._slots.get(worker)
        return slot is not None and page_hash in self._held[slot]

    def __len__(self) -> int:
        return len(self._holders)

    # ------------------------------------------------------------ slots and bits

    def _take_slot(self, worker: str) -> int:
        if self._free:
            slot = heapq.heappop(self._free)
            self._names[slot] = worker
        else:
            slot = len(self._names)
            self._names.append(worker)
            self._held.append(set())
        self._slots[worker] = slot
        return slot

    def _unset(self, slot: int, hashes: Iterable[int]) -> None:
        """Clears the slot's bit on each of `hashes` (pages it held); a page nobody holds goes."""
        keep, holders = ~(1 << slot), self._holders
        for h in hashes:
            rest = holders[h] & keep
            if rest:
                holders[h] = rest
            else:
                del holders[h]

    def _depths(self, hashes: Sequence[int], active: int) -> dict[str, int]:
        """Each worker of the `active` bits with at least one leading page: how many it holds."""
        out: dict[str, int] = {}
        holders = self._holders
        for i, h in enumerate(hashes):
            still = active & holders.get(h, 0)
            if still != active:
                if i:
                    for slot in _bits(active & ~still):
                        out[self._names[slot]] = i
                active = still
                if not active:
                    return out
        for slot in _bits(active):
            out[self._names[slot]] = len(hashes)
        return out


    def _deepest(self, hashes: Sequence[int], active: int, most: int) -> dict[str, int]:
        """_depths' answer for the `most` workers holding the most leading pages (among those
        holding as many, the lowest slots): the ANDs over every holder at once, names for
        `most` alone."""
        holders, levels = self._holders, []   # (depth, the bits that stopped there), shallowest first
        for i, h in enumerate(hashes):
            still = active & holders.get(h, 0)
            if still != active:
                if i:
                    levels.append((i, active & ~still))
                active = still
                if not active:
                    break
        if active:
            levels.append((len(hashes), active))
        out: dict[str, int] = {}
        for depth, bits in reversed(levels):
            for slot in _bits(bits):
                out[self._names[slot]] = depth
                if len(out) == most:
                    return out
        return out


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
