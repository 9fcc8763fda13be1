"""A server's limit on open files, raised to what the system allows it.

Every client connection takes a file descriptor, and so does every stream a gateway runs over a
worker's lane (one connection each, services/gateway/lane.py), on both ends: a gateway with a few
hundred streams to each of four workers passes 1,024, the soft limit a shell or a systemd unit
often starts with while the hard limit is far higher. Past the soft limit, connects and accepts
fail with EMFILE (a lane falls back to gRPC, a client cannot connect). Any process may raise its
own soft limit up to its hard limit, as vLLM's and SGLang's servers do at start.
"""

from __future__ import annotations

import logging

try:
    import resource
except ImportError:   # not on every platform: nothing to raise there
    resource = None

log = logging.getLogger(__name__)

WANTED = 1 << 20   # more than any server here keeps open; a hard limit of "unlimited" is capped to it


def raise_open_files_limit() -> int | None:
    """Raises the soft RLIMIT_NOFILE towards the hard limit (at most WANTED); the soft limit in
    force after (None where the platform has none). Children started after this inherit it."""
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = WANTED if hard == resource.RLIM_INFINITY else min(hard, WANTED)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    # A kernel may refuse more than its own cap below the hard limit (macOS: OPEN_MAX under an
    # unlimited hard limit): halve until it takes one, or keep what there is.
    while target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            target //= 2
            continue
        log.debug("open files limit raised from %d to %d", soft, target)
        return target
    log.warning("cannot raise the open files limit above %d: past it, connections are refused", soft)
    return soft
