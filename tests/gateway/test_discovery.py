"""--workers-dns: workers come and go as the name's addresses do."""

from __future__ import annotations

import asyncio
import threading

from kvserve.services.gateway import discovery


class FakeFleet:
    def __init__(self) -> None:
        self.workers: set[str] = set()
        self.log: list[str] = []

    def add(self, address: str) -> None:
        self.workers.add(address)
        self.log.append(f"+{address}")

    async def remove(self, address: str) -> None:
        self.workers.discard(address)
        self.log.append(f"-{address}")


def test_workers_follow_the_names_addresses(monkeypatch):
    answers = iter([{"10.0.0.1:50051", "10.0.0.2:50051"}, OSError("no such name"),
                    {"10.0.0.2:50051", "10.0.0.3:50051"}])
    seen = threading.Event()   # set on the resolver's thread

    def resolve(host, port):
        assert (host, port) == ("workers.kvserve.svc", 50051)
        try:
            answer = next(answers)
        except StopIteration:
            seen.set()
            return {"10.0.0.2:50051", "10.0.0.3:50051"}
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(discovery, "_resolve", resolve)
    fleet = FakeFleet()

    async def run() -> None:
        task = asyncio.create_task(discovery.follow_dns(fleet, "workers.kvserve.svc:50051", 0.01))
        assert await asyncio.to_thread(seen.wait, 10), "the names were not resolved again"
        task.cancel()

    asyncio.run(run())
    # a failed resolution keeps the workers known; then 1 goes, 3 comes
    assert fleet.log == ["+10.0.0.1:50051", "+10.0.0.2:50051", "+10.0.0.3:50051", "-10.0.0.1:50051"]
    assert fleet.workers == {"10.0.0.2:50051", "10.0.0.3:50051"}


def test_resolving_a_real_name_gives_host_port_addresses():
    found = discovery._resolve("localhost", 50051)
    assert "127.0.0.1:50051" in found
    assert all(a.endswith(":50051") for a in found)


def test_removing_a_worker_does_not_wait_for_its_streams():
    from kvserve.services.gateway.fleet import Fleet
    from kvserve.services.gateway.waiting import WaitQueue

    async def run() -> None:
        fleet = Fleet("", 1.0, 2, 10.0, WaitQueue(8))
        fleet.add("127.0.0.1:1")
        worker = fleet.workers["127.0.0.1:1"]
        worker.relays.add(object())            # a stream still running on it
        await asyncio.wait_for(fleet.remove("127.0.0.1:1"), 5)   # returns at once
        assert "127.0.0.1:1" not in fleet.workers and len(fleet._closing) == 1
        worker.relays.clear()                  # the stream ends: its channel is closed after it
        await asyncio.wait_for(asyncio.gather(*fleet._closing), 5)
        await fleet.close()

    asyncio.run(run())


def test_a_worker_that_cannot_be_added_now_is_tried_again_and_the_names_still_followed(monkeypatch):
    """Adding a worker reads the TLS files its channel uses; while they are being rotated that
    fails, and the task following the name died with it (no worker added or removed again)."""
    monkeypatch.setattr(discovery, "_resolve", lambda host, port: {"10.0.0.1:50051", "10.0.0.2:50051"})
    fleet, failures = FakeFleet(), iter([True])
    add = fleet.add

    def flaky_add(address: str) -> None:
        if address == "10.0.0.2:50051" and next(failures, False):
            raise ValueError("cannot read CA certificate /etc/tls/ca.crt")
        add(address)

    fleet.add = flaky_add

    async def run() -> None:
        task = asyncio.create_task(discovery.follow_dns(fleet, "workers.kvserve.svc:50051", 0.01))
        for _ in range(1000):
            if len(fleet.workers) == 2:
                break
            await asyncio.sleep(0.01)
        assert not task.done()
        task.cancel()

    asyncio.run(run())
    assert fleet.log == ["+10.0.0.1:50051", "+10.0.0.2:50051"]   # the second the next time round


def test_a_dual_stack_name_gives_each_pod_once(monkeypatch):
    """A dual-stack headless Service answers an IPv4 and an IPv6 address for each pod: kept
    both, each pod was two workers, sent twice its share. The resolver's first family is kept."""
    import socket

    answers = [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::1:2:3", 50051, 0, 0)),
               (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.3", 50051)),
               (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::1:2:4", 50051, 0, 0)),
               (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.4", 50051))]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: answers)
    assert discovery._resolve("workers", 50051) == {"[fd00::1:2:3]:50051", "[fd00::1:2:4]:50051"}
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: answers[1:])
    assert discovery._resolve("workers", 50051) == {"10.1.2.3:50051", "10.1.2.4:50051"}
