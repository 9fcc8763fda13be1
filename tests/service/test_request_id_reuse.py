"""A request id sent again the moment its client left the call holding it.

grpc (or the lane, or the gateway's client side) cancels a call's handler task when its client
leaves; the handler frees the id a loop turn later, as it unwinds. A retry under the same id
that reaches the server inside that turn is served, not told the id is in flight, on the
model service and on the gateway alike; an id a running call holds is still refused.
"""

from __future__ import annotations

import asyncio

import pytest

from kvserve.model_service.engine.errors import DuplicateRequest
from kvserve.model_service.servicer import InferenceServicer
from kvserve.services.gateway.servicer import GatewayServicer


class HeldIds:
    """The engine's side of request ids: held, ending once cancelled, free once ended."""

    def __init__(self, held: str) -> None:
        self.held = {held}
        self.cancelled: set[str] = set()
        self.submitted: list[str] = []

    def submit(self, req, sink) -> None:
        if req.request_id in self.held:
            raise DuplicateRequest(req.request_id)
        self.submitted.append(req.request_id)

    def ending(self, request_id: str) -> bool:
        return request_id in self.held and request_id in self.cancelled

    def cancel(self, request_id: str) -> None:   # the request ends at the engine's next step
        self.cancelled.add(request_id)
        asyncio.get_running_loop().call_later(0.02, self.held.discard, request_id)


class Req:
    request_id = "again"


def servicer_over(engine: HeldIds) -> InferenceServicer:
    servicer = InferenceServicer.__new__(InferenceServicer)
    servicer.engine = engine
    return servicer


def test_an_id_whose_call_was_cancelled_a_turn_ago_is_served() -> None:
    async def run() -> list[str]:
        engine = HeldIds("again")
        # the old call's handler, cancelled by grpc, cancels its request as it unwinds: next turn
        asyncio.get_running_loop().call_soon(engine.cancel, "again")
        await servicer_over(engine)._submit(Req(), "again", sink=None)
        return engine.submitted

    assert asyncio.run(run()) == ["again"]


def test_an_id_a_running_call_holds_is_refused() -> None:
    async def run() -> None:
        await servicer_over(HeldIds("again"))._submit(Req(), "again", sink=None)

    with pytest.raises(DuplicateRequest, match="request id 'again' is already in flight"):
        asyncio.run(run())


class Context:
    def __init__(self, cancelled: bool) -> None:
        self._cancelled = cancelled

    def cancelled(self) -> bool:
        return self._cancelled


class Relay:
    cancelled = False   # no Cancel(request_id) answered for it


def gateway_holding(context: Context) -> GatewayServicer:
    servicer = GatewayServicer.__new__(GatewayServicer)
    key = ("", "again")
    servicer.relays = {key: Relay()}
    servicer._contexts = {key: context}
    servicer._streams_over = {key: asyncio.Event()}
    return servicer


@pytest.mark.parametrize("client_left", [True, False])
def test_the_gateway_waits_for_a_stream_its_client_left_and_not_for_one_running(client_left: bool) -> None:
    async def run() -> bool:
        servicer = gateway_holding(Context(cancelled=client_left))
        waiting = asyncio.ensure_future(servicer._cancelled_one_ended("", "again"))
        for _ in range(5):
            await asyncio.sleep(0)
        waited = not waiting.done()
        servicer._streams_over["", "again"].set()   # the old handler unwound
        await asyncio.wait_for(waiting, 5)
        return waited

    assert asyncio.run(run()) is client_left
