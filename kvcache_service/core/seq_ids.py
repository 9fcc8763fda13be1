"""The pool of seq ids: small integer slots bound one-to-one to live sequences."""

from __future__ import annotations

from collections import deque


class SeqIdPool:
    """`max_seqs` ids, handed out FIFO: a released id goes to the back of the
    queue, so it rests as long as possible before anybody reuses it. The ids never
    handed out yet are a counter, not a queue: a pool of billions (--max-seqs up to
    2^32-1) costs nothing until used."""

    __slots__ = ("max_seqs", "_fresh", "_free", "_in_use")

    def __init__(self, max_seqs: int) -> None:
        self.max_seqs = max_seqs
        self._fresh = 0                  # ids below it have been handed out at least once
        self._free: deque[int] = deque()  # released ids, oldest first: after every fresh one
        self._in_use: set[int] = set()

    def __len__(self) -> int:
        """Free ids."""
        return self.max_seqs - self._fresh + len(self._free)

    def acquire(self) -> int:
        """The caller checked len(self) > 0."""
        if self._fresh < self.max_seqs:
            seq_id = self._fresh
            self._fresh += 1
        else:
            seq_id = self._free.popleft()
        self._in_use.add(seq_id)
        return seq_id

    def release(self, seq_id: int) -> None:
        """Exactly once per acquire; a second release raises KeyError, never corrupts."""
        self._in_use.remove(seq_id)
        self._free.append(seq_id)

    def in_use(self) -> set[int]:
        return set(self._in_use)

    def free_ids(self) -> list[int]:
        return list(range(self._fresh, self.max_seqs)) + list(self._free)

    def reset(self) -> None:
        self._fresh = 0
        self._free = deque()
        self._in_use = set()
