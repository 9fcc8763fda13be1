"""ManagerConfig: the sizes of the manager's pools, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    """Sizes of the pools. Defaults fit a demo on one small model."""
    num_pages: int = 4096      # device pages; must equal the model service's
    page_size: int = 16        # tokens per page; must equal the model service's
    max_seqs: int = 256        # live sequences at once (the seq-id pool)
    cpu_pages: int = 0         # CPU swap pages; 0 disables SWAP preemption
    event_capacity: int = 65536  # events kept for slow WatchEvents subscribers

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_seqs", "event_capacity"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.cpu_pages, int) or self.cpu_pages < 0:
            raise ValueError(f"cpu_pages must be a non-negative integer, got {self.cpu_pages!r}")
