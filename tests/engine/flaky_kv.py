"""A KV client whose manager dies on cue, for the engine's recovery tests without processes.

kill(): the Step in flight (or the next one sent) fails with ManagerUnavailable, as a broken
stream does, and a fresh manager (epoch 0, empty: what a restarted process holds) takes the old
one's place. While `down` is set, every call fails the same way, as an unreachable manager's do.
A hung Step is never answered until the engine interrupts it, as a stopped process's.
meddle_at_steps: before the engine's n-th Step reaches the manager, a function changes the
manager's tables as another client of its API could (release a live sequence, admit a request id
of its own); refuse_from_step: every Step from the n-th on is refused (a fault that persists);
refuse_register: every Register is refused (a manager started with another pool size).
"""

from __future__ import annotations

import threading

from kvserve.kvcache_service.contract.client import InProcessKVClient
from kvserve.kvcache_service.contract.errors import InvalidArgument, ManagerUnavailable, NotFound
from kvserve.kvcache_service.core.manager import KVCacheManager


class FlakyKV:
    address = "flaky-manager"

    def __init__(self, inner: InProcessKVClient, kill_at_steps: tuple[int, ...] = ()) -> None:
        self.inner = inner
        self.config = inner.manager.config
        self.kill_at_steps = set(kill_at_steps)   # kill when the engine sends its n-th Step
        self.hang_at_steps: set[int] = set()      # never answer that Step (a stopped process)
        self.meddle_at_steps: dict = {}           # n -> fn(manager), run before the n-th Step
        self.refuse_from_step: int | None = None  # refuse every Step from the n-th on
        self.refuse_register = ""                 # set: every Register is refused with this reason
        self.down = threading.Event()
        self._interrupted = threading.Event()
        self.steps = 0
        self.kills = 0

    @property
    def manager(self) -> KVCacheManager:
        return self.inner.manager

    def kill(self) -> None:
        """The process dies and is restarted at once: an empty manager at the same address."""
        self.kills += 1
        self.inner = InProcessKVClient(KVCacheManager(self.config))

    def _unavailable(self) -> ManagerUnavailable:
        return ManagerUnavailable(f"the KV-cache manager at {self.address} did not answer (UNAVAILABLE)")

    def register(self, epoch, page_size, num_pages, timeout_s=None, cpu_pages=None) -> None:
        if self.refuse_register:   # a manager of another pool size, say
            raise InvalidArgument(self.refuse_register)
        if self.down.is_set():
            if timeout_s:
                self.down.wait(0)   # a real client waits up to timeout_s for the channel
            raise self._unavailable()
        self.registered_cpu_pages = cpu_pages
        self.inner.register(epoch, page_size, num_pages, cpu_pages=cpu_pages)

    def send_step(self, request):
        self.steps += 1
        if self.steps in self.meddle_at_steps:
            self.meddle_at_steps[self.steps](self.manager)
        if self.refuse_from_step is not None and self.steps >= self.refuse_from_step:
            def refused():
                raise NotFound("unknown seq id 12345")
            return refused
        if self.steps in self.kill_at_steps:
            self.kill()
            error = self._unavailable()

            def broken():
                raise error
            return broken
        if self.steps in self.hang_at_steps:
            self._interrupted.clear()
            error = self._unavailable()

            def hung():   # as a stopped manager's stream: no answer until the engine gives up
                self._interrupted.wait()
                raise error
            return hung
        if self.down.is_set():
            error = self._unavailable()

            def unreachable():
                raise error
            return unreachable
        return self.inner.send_step(request)

    def interrupt(self) -> None:
        self._interrupted.set()

    def reset(self) -> None:
        self.inner.reset()

    def stats(self, timeout_s=None):
        if self.down.is_set():
            raise self._unavailable()
        return self.inner.stats()

    def close(self) -> None:
        pass
