"""Where the workers are: the --worker addresses, and the addresses --workers-dns resolves to,
resolved again every --dns-interval seconds (a Kubernetes headless Service lists one address per
ready pod), adding workers that appear and removing those that are gone."""

from __future__ import annotations

import asyncio
import logging
import socket

from kvserve.services.gateway.fleet import Fleet

log = logging.getLogger(__name__)


def _resolve(host: str, port: int) -> set[str]:
    """The name's addresses of one family, the first the resolver gives (its preferred): a
    dual-stack headless Service names each pod twice, once an IPv4 address and once an IPv6
    one, and each would have been a worker of its own, sent twice its share."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    first = next((family for family, *_ in infos if family in (socket.AF_INET, socket.AF_INET6)), None)
    out, left_out = set(), set()
    for family, _, _, _, addr in infos:
        ip = addr[0]
        (out if family == first else left_out).add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    if left_out and left_out != _left_out.get(host):   # said when it changes, not at every lookup
        log.info("%s names addresses of two families; taking %s, leaving out %s", host, sorted(out), sorted(left_out))
    _left_out[host] = left_out
    return out


_left_out: dict[str, set[str]] = {}   # the last lookup's addresses of the other family, by name


async def follow_dns(fleet: Fleet, name_port: str, interval_s: float) -> None:
    host, _, port = name_port.rpartition(":")
    known: set[str] = set()
    while True:
        try:
            found = await asyncio.to_thread(_resolve, host, int(port))
        except (OSError, UnicodeError) as exc:   # (a name IDNA cannot encode raises the second)
            log.warning("resolving %s failed (%s); keeping the %d workers known", name_port, exc, len(known))
        else:
            for address in sorted(found - known):
                try:
                    fleet.add(address)
                except Exception:   # its channel's TLS files unreadable now (being rotated): tried again next time
                    log.exception("adding worker %s failed; it is tried again at the next resolution", address)
                else:
                    known.add(address)
            for address in sorted(known - found):
                known.discard(address)
                try:
                    await fleet.remove(address)
                except Exception:   # a bug: the rest of the fleet is still followed
                    log.exception("removing worker %s failed", address)
        await asyncio.sleep(interval_s)
