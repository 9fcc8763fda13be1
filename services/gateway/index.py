"""Which worker holds which page, as its manager's events say: hash -> workers, worker -> hashes.

Mechanism only: the follower (follow.py) decides when a worker's entries are replaced or
dropped; the router (router.py) reads matches. Only a stored event (or a snapshot) credits a
worker with a page; routing a request there never does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._held: dict[str, set[int]] = {}

    def add(self, worker: str, hashes: Iterable[int]) -> None:
        held = self._held.setdefault(worker, set())
        for h in hashes:
            held.add(h)
            self._holders.setdefault(h, set()).add(worker)

    def remove(self, worker: str, hashes: Iterable[int]) -> None:
        held = self._held.get(worker)
        if held is None:
            return
        for h in hashes:
            held.discard(h)
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self._holders[h]

    def drop(self, worker: str) -> None:
        """Forgets everything `worker` held, at once."""
        self.remove(worker, list(self._held.get(worker, ())))
        self._held.pop(worker, None)

    def replace(self, worker: str, hashes: Iterable[int]) -> None:
        self.drop(worker)
        self.add(worker, hashes)

    def holders(self, hashes: Sequence[int]) -> dict[str, int]:
        """The workers holding at least the first page of `hashes`, each with how many of the
        leading pages it holds: as many entries as holders, whatever the fleet's size."""
        first = self._holders.get(hashes[0]) if hashes else None
        return self.matches(hashes, first) if first else {}

    def matches(self, hashes: Sequence[int], workers: Iterable[str]) -> dict[str, int]:
        """For each worker, how many of the leading pages of `hashes` it holds."""
        out = dict.fromkeys(workers, 0)
        active = set(out)
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            active &= holders
            if not active:
                break
            for w in active:
                out[w] = i + 1
        return out

    def pages_of(self, worker: str) -> int:
        return len(self._held.get(worker, ()))

    def holds(self, worker: str, page_hash: int) -> bool:
        return page_hash in self._held.get(worker, ())

    def __len__(self) -> int:
        return len(self._holders)
