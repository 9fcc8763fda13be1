"""Real grpc.aio servers for tests, each on a private event loop in a daemon thread,
so tests talk to them with ordinary synchronous channels, as any client would."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path


class LoopThread:
    """A private asyncio loop running on a daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def call(self, coro, timeout: float = 30.0):
        """Runs a coroutine on the loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


class ModelServerThread(LoopThread):
    """create_server(ModelServiceConfig(model=..., **config)): the model service and its engine."""

    def __init__(self, model: Path, **config) -> None:
        from kvserve.model_service.config import ModelServiceConfig
        from kvserve.model_service.server import create_server

        super().__init__("model-grpc-server")
        self.config = ModelServiceConfig(model=str(model), **config)
        try:
            self.running, self.servicer = self.call(create_server(self.config), timeout=120)
        except BaseException:
            self.close()
            raise
        self.address: str = self.running.address

    def stop(self) -> None:
        try:
            self.call(self.running.server.stop(None))
            self.call(self.servicer.health.stop())
            self.call(self.servicer.cache_events.close())
            if self.servicer.http_front is not None:
                self.call(self.servicer.http_front.stop())
            if self.servicer.lane is not None:
                self.call(self.servicer.lane.close())
        finally:
            self.servicer.engine.stop()
            self.servicer.close()
            self.servicer.stack.kv.close()
            self.close()
