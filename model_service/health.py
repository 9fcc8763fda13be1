"""grpc.health.v1 for the model service: SERVING means this worker can make progress now.

NOT_SERVING while the engine reports a problem (its KV-cache manager unreachable, no step
completed for --stall-timeout with requests in flight, another model service registered in its
place) and while the server drains; SERVING again when that clears. Probes and load balancers
(Kubernetes readiness, a gateway) read it to stop sending work here.

The service name `liveness` answers a narrower question, for a probe that restarts the process:
NOT_SERVING only while the engine is stalled with its manager reachable. A lost manager or a
drain is not cured by restarting the model service, so they leave `liveness` SERVING.
"""

from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

log = logging.getLogger(__name__)

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
LIVENESS = "liveness"


class HealthReporter:
    def __init__(self, health: health_aio.HealthServicer, names: list[str], engine,
                 period_s: float = 0.25) -> None:
        self.health = health
        self.names = ["", *names]
        self.engine = engine
        self.period_s = period_s
        self.draining = False
        self._problem: str | None = None
        self._stall: str | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvserve-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def drain(self) -> None:
        """NOT_SERVING from now on."""
        self.draining = True
        await self._report("the server is draining")
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        await self.health.set(LIVENESS, SERVING)
        while not self.draining:
            await self._report(self.engine.problem())
            await self._report_liveness(self.engine.stalled())
            await asyncio.sleep(self.period_s)

    async def _report_liveness(self, stall: str | None) -> None:
        if (stall is None) != (self._stall is None):
            await self.health.set(LIVENESS, SERVING if stall is None else NOT_SERVING)
        self._stall = stall

    async def _report(self, problem: str | None) -> None:
        if problem == self._problem:
            return
        if (problem is None) != (self._problem is None):
            if problem is None:
                log.info("health: SERVING again")
            else:
                log.warning("health: NOT_SERVING: %s", problem)
            for name in self.names:
                await self.health.set(name, SERVING if problem is None else NOT_SERVING)
        self._problem = problem
