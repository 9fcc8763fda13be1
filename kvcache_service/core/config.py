"""ManagerConfig: the sizes of the manager's pools, validated at construction.

Each field's "help" makes it a flag of `kvserve kvcache` (services/plumbing/config_flags.py
generates them; the core itself imports nothing for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Page ids, seq ids, token counts and the pool sizes in Register are uint32 on the wire
# (kvcache.proto): a pool past this could never be served, and building it took every byte of memory.
MAX_POOL = 2**32 - 1


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    """Sizes of the pools. Defaults fit a demo on one small model."""
    num_pages: int = field(default=4096, metadata={"help": "device KV pages; must match the model service"})
    page_size: int = field(default=16, metadata={"help": "tokens per page; must match the model service"})
    max_seqs: int = field(default=256, metadata={"help": "live sequences at once: the seq-id pool"})
    cpu_pages: int = field(default=0, metadata={"help": "CPU swap pages; 0 disables swapping"})
    event_capacity: int = field(default=65536, metadata={
        "help": "most events kept for a WatchEvents subscriber that falls behind (only unread ones are kept)"})

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_seqs", "event_capacity"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.cpu_pages, int) or self.cpu_pages < 0:
            raise ValueError(f"cpu_pages must be a non-negative integer, got {self.cpu_pages!r}")
        for name in ("num_pages", "page_size", "max_seqs", "cpu_pages"):
            if getattr(self, name) > MAX_POOL:
                raise ValueError(f"{name} must be at most {MAX_POOL:,} (the protocol's ids and sizes are 32-bit), "
                                 f"got {getattr(self, name):,}")
