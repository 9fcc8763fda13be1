"""How both SDK clients reach a server: TLS settings and the API key, checked when the client is
made, so a wrong file or a malformed key fails there with a sentence rather than at the first call."""

from __future__ import annotations

from kvserve.services.plumbing.tls import ClientTLS

AUTHORIZATION = "authorization"


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
    if not api_key:
        return None
    key = api_key.strip()
    # gRPC metadata values are printable ASCII, and the server splits the header at the space.
    if not key or not all(33 <= ord(c) <= 126 for c in key):
        raise ValueError("an API key is printable ASCII without spaces")
    return ((AUTHORIZATION, f"Bearer {key}"),)
