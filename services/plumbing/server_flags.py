"""The flags every kvserve server shares (metrics, probes, TLS), declared once: each server's
config dataclass names its fields with these, so a flag reads the same on every server.

    @dataclass(frozen=True)
    class Config:
        tls_cert: str = server_flags.tls_cert()
"""

from __future__ import annotations

import logging
import re
from typing import Any

from kvserve.services.plumbing.address import is_private
from kvserve.services.plumbing.api_keys import ApiKeys, read_token
from kvserve.services.plumbing.config_flags import option
from kvserve.services.plumbing.tls import ClientTLS, ServerTLS


log = logging.getLogger(__name__)


def metrics_listen() -> Any:
    return option("", "serve Prometheus metrics at http://HOST:PORT/metrics (default: off)", metavar="HOST:PORT")


def health_listen() -> Any:
    return option("", "also serve grpc.health.v1 alone, in plaintext, on HOST:PORT: for Kubernetes probes, "
                      "which cannot speak TLS (default: off)", metavar="HOST:PORT")


def http_listen() -> Any:
    return option("", "serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
                      "/tokenize, /health) on HOST:PORT (default: off)", metavar="HOST:PORT")


def http_allowed_origins() -> Any:
    return option("", "browser origins the HTTP API answers (CORS), comma-separated, e.g. "
                      "https://chat.example.com, or * for any (default: none, as a browser page on another "
                      "origin may not read its answers)", metavar="ORIGINS")


def allowed_origins(text: str) -> list[str]:
    """--http-allowed-origins as a list, each `*` or scheme://host[:port] (ValueError otherwise)."""
    origins = [o.strip() for o in text.split(",") if o.strip()]
    for origin in origins:
        if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
            raise ValueError(f"--http-allowed-origins: {origin!r} is not an origin (scheme://host[:port], no "
                             "path) or *")
    return origins


def tls_cert() -> Any:
    return option("", "PEM certificate to serve TLS with on TCP addresses (Unix sockets stay plaintext; "
                      "default: plaintext)", metavar="FILE")


def tls_key() -> Any:
    return option("", "PEM private key of --tls-cert", metavar="FILE")


def tls_client_ca() -> Any:
    return option("", "PEM CA: require client certificates it signed (mutual TLS)", metavar="FILE")


# The client side of mutual TLS, to a peer of kvserve's (`whom`: "the manager", "the workers").

def peer_tls_ca(whom: str) -> Any:
    return option("", f"PEM CA that signed the certificate of {whom}: reach {whom} over TLS", metavar="FILE")


def peer_tls_cert(whom: str) -> Any:
    return option("", f"PEM client certificate for {whom} (mutual TLS)", metavar="FILE")


def peer_tls_key(flag: str) -> Any:
    return option("", f"PEM private key of {flag}", metavar="FILE")


def read_files(*tls: ServerTLS | ClientTLS | None, api_keys: str = "", token_file: str = "") -> None:
    """Reads every file a server's flags name (certificates, keys, tokens): a wrong path or a
    file that does not parse fails at start with a sentence, before anything loads."""
    for one in tls:
        if one is not None:
            one.credentials()
    if api_keys:
        ApiKeys(api_keys)
    read_token(token_file)


def warn_keys_in_plaintext(api_keys: str, tls_cert: str, *listens: str) -> None:
    """Said at start: API keys taken on an address beyond this host without TLS cross the network
    as they are. Not refused: a mesh or an ingress may terminate TLS in front."""
    open_to = [address for address in listens if address and not is_private(address)]
    if api_keys and not tls_cert and open_to:
        log.warning("--api-keys on %s without --tls-cert: clients send their keys in plaintext unless TLS ends "
                    "in front of this server (an ingress, a service mesh)", ", ".join(open_to))
