"""The pool of seq ids: small integer slots bound one-to-one to live sequences."""

from __future__ import annotations

from collections import deque


class SeqIdPool:
    """`max_seqs` ids, handed out FIFO: a released id goes to the back of the
    queue, so it rests as long as possible before anybody reuses it."""

    __slots__ = ("max_seqs", "_free", "_in_use")

    def __init__(self, max_seqs: int) -> None:
        self.max_seqs = max_seqs
        self._free: deque[int] = deque(range(max_seqs))
        self._in_use: set[int] = set()

    def __len__(self) -> int:
        """Free ids."""
        return len(self._free)

    def acquire(self) -> int:
        """The caller checked len(self) > 0."""
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
        return list(self._free)

    def reset(self) -> None:
        self._free = deque(range(self.max_seqs))
        self._in_use = set()
