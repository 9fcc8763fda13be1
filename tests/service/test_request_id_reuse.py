"""A request id sent again the moment its client left the call holding it.

grpc (or the lane) ends a call whose client left, and its handler frees the id as it unwinds: a
loop turn later when it waited for a token, a few when it was writing one (its generator is then
closed by a task of its own), and nothing on the call's context says so meanwhile. A retry under
the same id in that moment is served, not told the id is in flight, on the model service and on
the gateway alike; an id a running call holds is still refused (LEFT_CALL_WAIT_S later).
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


@pytest.mark.parametrize("unwinds_after", ["one loop turn", "a few milliseconds"])
def test_an_id_whose_call_was_left_a_moment_ago_is_served(unwinds_after: str) -> None:
    async def run() -> list[str]:
        engine = HeldIds("again")
        # the old call's handler cancels its request as it unwinds
        loop = asyncio.get_running_loop()
        if unwinds_after == "one loop turn":
            loop.call_soon(engine.cancel, "again")
        else:
            loop.call_later(0.01, engine.cancel, "again")
        await servicer_over(engine)._submit(Req(), "again", sink=None)
        return engine.submitted

    assert asyncio.run(run()) == ["again"]


def test_an_id_a_running_call_holds_is_refused() -> None:
    async def run() -> None:
        await servicer_over(HeldIds("again"))._submit(Req(), "again", sink=None)

    with pytest.raises(DuplicateRequest, match="request id 'again' is already in flight"):
        asyncio.run(run())


class Relay:
    cancelled = False   # no Cancel(request_id) answered for it


def gateway_holding() -> GatewayServicer:
    servicer = GatewayServicer.__new__(GatewayServicer)
    key = ("", "again")
    servicer.relays = {key: Relay()}
    servicer._streams_over = {key: asyncio.Event()}
    return servicer


@pytest.mark.parametrize("client_left", [True, False])
def test_the_gateway_waits_for_a_stream_its_client_just_left_and_not_for_one_running(client_left: bool) -> None:
    async def run() -> bool:
        servicer = gateway_holding()
        over = servicer._streams_over["", "again"]
        if client_left:   # its handler unwinds a few milliseconds on
            asyncio.get_running_loop().call_later(0.01, over.set)
        await asyncio.wait_for(servicer._cancelled_one_ended("", "again"), 5)
        return over.is_set()   # returned as the old stream ended, not before

    assert asyncio.run(run()) is client_left


def test_a_cancel_that_comes_while_the_gateway_waits_lets_it_wait_for_the_stream_to_end() -> None:
    async def run() -> bool:
        servicer = gateway_holding()
        relay, over = servicer.relays["", "again"], servicer._streams_over["", "again"]
        loop = asyncio.get_running_loop()
        loop.call_later(0.02, setattr, relay, "cancelled", True)   # Cancel(request_id) answered
        loop.call_later(0.2, over.set)   # its worker's ABORT relayed, past LEFT_CALL_WAIT_S
        await asyncio.wait_for(servicer._cancelled_one_ended("", "again"), 5)
        return over.is_set()

    assert asyncio.run(run())
