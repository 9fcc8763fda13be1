"""What `kvserve kvcache` serves on, beside the pool sizes (core/config.py: ManagerConfig).
Every field is a flag (services/plumbing/config_flags.py generates them)."""

from __future__ import annotations

import math

from dataclasses import dataclass

from kvserve.services.plumbing import server_flags
from kvserve.services.plumbing.address import check_tcp_listen, is_private, parse_flag
from kvserve.services.plumbing.config_flags import option
from kvserve.services.plumbing.tls import ServerTLS

DEFAULT_LISTEN = "127.0.0.1:50061"


@dataclass(frozen=True)
class KVCacheServerConfig:
    listen: tuple[str, ...] = option((DEFAULT_LISTEN,), f"host:port or unix:///path; repeat to listen on "
                                                        f"several (default {DEFAULT_LISTEN})", metavar="ADDR")
    grace_s: float = option(5.0, "seconds in-flight calls get on SIGTERM", flag="--grace-period")
    metrics_listen: str = server_flags.metrics_listen()
    tls_cert: str = server_flags.tls_cert()
    tls_key: str = server_flags.tls_key()
    tls_client_ca: str = server_flags.tls_client_ca()
    health_listen: str = server_flags.health_listen()
    admin_token_file: str = option("", "file holding a token that lets a caller beyond this pod use the write "
                                       "RPCs (`authorization: Bearer TOKEN`); without it only a Unix socket or "
                                       "loopback may", metavar="FILE")

    def __post_init__(self) -> None:
        if not self.listen:
            raise ValueError("--listen: give at least one address")
        for address in self.listen:
            parse_flag("--listen", address)
        if self.health_listen:
            parse_flag("--health-listen", self.health_listen)
        check_tcp_listen("--metrics-listen", self.metrics_listen)
        if not (0 <= self.grace_s < math.inf):   # NaN compares false: "nan" drained for no time at all
            raise ValueError(f"--grace-period must be a number of seconds, 0 or more, got {self.grace_s}")
        open_to = [address for address in self.listen if not is_private(address)]
        if self.admin_token_file and open_to and not self.tls_cert:
            raise ValueError(f"--admin-token-file with --listen {open_to[0]}: callers would send the admin token "
                             "in plaintext; serve TLS there (--tls-cert, --tls-key) or listen on a Unix socket "
                             "or loopback only")
        self.server_tls()

    def server_tls(self) -> ServerTLS | None:
        return ServerTLS.of(self.tls_cert, self.tls_key, self.tls_client_ca)
