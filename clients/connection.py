"""How both SDK clients reach a server: TLS settings and the API key, checked when the client is
made, so a wrong file or a malformed key fails there with a sentence rather than at the first call."""

from __future__ import annotations

import re

from kvserve.services.plumbing.tls import ClientTLS

MAX_TIMEOUT_S = 1e9   # a deadline past it overflows gRPC's clock: the call failed DEADLINE_EXCEEDED at once
_HOST_PORT = re.compile(r"^(?:\[[^\]]*\]|[^:/\[\]]*):(\d+)$")   # host:port or [v6]:port, not dns:/unix: targets

AUTHORIZATION = "authorization"

# A client pings a connection quiet for 20 s and drops it when 10 s pass without the answer:
# a frozen server, or a network path gone without a reset, then ends the call UNAVAILABLE
# instead of holding it forever. kvserve's servers accept pings every 10 s
# (services/plumbing/grpc_server.py), so these never earn a GOAWAY for pinging too often.
KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),   # the wait gRPC core really applies to the answer
    # gRPC stops pinging after 2 pings with no data between them, until data comes: a stream quiet
    # for a while (queued, a long prefill, a gateway moving it) found a frozen server only a minute
    # later. Pinging on costs nothing the servers refuse.
    ("grpc.http2.max_pings_without_data", 0),
)


def check_target(address: str, timeout: float | None) -> None:
    """A port out of range (gRPC would dial it modulo 65536) or a deadline that is not a
    positive number of seconds is a ValueError here, before any call."""
    if not isinstance(address, str) or not address.strip():
        raise ValueError("address is host:port or unix:///path, got nothing")
    port = _HOST_PORT.match(address.strip())
    if port and not 0 < int(port.group(1)) <= 65535:
        raise ValueError(f"address {address}: the port must be in 1..65535")
    if timeout is not None and not (isinstance(timeout, (int, float)) and 0 < timeout < MAX_TIMEOUT_S):
        raise ValueError(f"timeout is a number of seconds > 0 and under 1e9 (gRPC's deadlines end there), or None "
                         f"for no deadline; got {timeout!r}")


def channel_options(options) -> list[tuple[str, object]]:
    """The caller's channel options over the keepalive defaults: a key given wins."""
    given = [tuple(o) for o in options]
    names = {name for name, _ in given}
    return [o for o in KEEPALIVE_OPTIONS if o[0] not in names] + given


def client_tls(tls: ClientTLS | bool | None) -> ClientTLS | None:
    """None or False: plaintext; True: TLS trusting the system's roots; a ClientTLS: its CA,
    client certificate (mutual TLS) and server-name override. Its files are read now."""
    if tls is None or tls is False:
        return None
    if tls is True:
        return ClientTLS.of(enabled=True)
    if isinstance(tls, ClientTLS):
        if bool(tls.cert) != bool(tls.key):
            raise ValueError("ClientTLS: give both cert and key (mutual TLS), or neither")
        return ClientTLS.of(tls.ca, tls.cert, tls.key, enabled=True, server_name=tls.server_name)
    raise TypeError(f"tls is a ClientTLS, True, False or None, not {type(tls).__name__}")


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata carrying the key (`authorization: Bearer KEY`); None without a key."""
    if api_key is None or api_key == "":
        return None
    if not isinstance(api_key, str):
        raise TypeError(f"api_key is a string, not {type(api_key).__name__}")
    key = api_key.strip()
    # gRPC metadata values are printable ASCII, and the server splits the header at the space.
    if not key or not all(33 <= ord(c) <= 126 for c in key):
        raise ValueError("an API key is printable ASCII without spaces")
    return ((AUTHORIZATION, f"Bearer {key}"),)
