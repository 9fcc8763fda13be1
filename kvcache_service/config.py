"""What `kvserve kvcache` serves on, beside the pool sizes (core/config.py: ManagerConfig).
Every field is a flag (services/plumbing/config_flags.py generates them)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.services.plumbing.config_flags import option

DEFAULT_LISTEN = "127.0.0.1:50061"


@dataclass(frozen=True)
class KVCacheServerConfig:
    listen: tuple[str, ...] = option((DEFAULT_LISTEN,), f"host:port or unix:///path; repeat to listen on "
                                                        f"several (default {DEFAULT_LISTEN})", metavar="ADDR")
    grace_s: float = option(5.0, "seconds in-flight calls get on SIGTERM", flag="--grace-period")

    def __post_init__(self) -> None:
        if not self.listen:
            raise ValueError("--listen: give at least one address")
        if self.grace_s < 0:
            raise ValueError(f"--grace-period must not be negative, got {self.grace_s}")
