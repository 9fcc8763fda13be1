"""What a failed call's trailing metadata tells a client about trying again, read by the HTTP
front (services/http/app.py) and set by whichever server knows."""

from __future__ import annotations

# On a failure a retry would repeat, or worsen (a request that killed the workers computing it,
# services/gateway/relay.py): the HTTP front answers it with x-should-retry: false, which the
# OpenAI SDKs obey.
NO_RETRY_TRAILER = "kvserve-no-retry"


def says_no_retry(trailing_metadata) -> bool:
    return any(key == NO_RETRY_TRAILER for key, _ in trailing_metadata or ())


def retry_after_ms(trailing_metadata) -> int | None:
    """The server's hint of when to try again (a full queue, a gateway's estimate), or None."""
    for key, value in trailing_metadata or ():
        if key == "retry-after-ms" and isinstance(value, str) and value.isascii() and value.isdigit():
            return int(value)
    return None
