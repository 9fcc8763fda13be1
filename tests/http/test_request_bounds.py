"""A body's lists past the server's bounds are refused by their length, before any element is
read: the front translates on the server's event loop, where a body of hundreds of thousands of
chat messages held every other client's stream before the server refused its count. The front
here runs over a LocalChannel to a servicer that answers any request."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import httpx
import pytest

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.services.http import translate
from kvserve.services.http.app import make_app
from kvserve.services.http.translate import FRONT_MAX_ITEMS, HttpError, Limits, prompts_of, request_of
from kvserve.services.plumbing.local_channel import HandlerRecorder, LocalChannel


class Answering(pb_grpc.InferenceServicer):
    """Answers every Generate with one token, counting the calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(name="answering", max_model_len=4096)

    async def Generate(self, request, context):
        self.calls += 1
        yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[7], text="x"))
        yield pb.GenerateResponse(finished=pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH,
                                                       usage=pb.Usage(prompt_tokens=1, completion_tokens=1)))


def _post(servicer: Answering, body: dict, limits: Limits | None) -> httpx.Response:
    async def post() -> httpx.Response:
        recorder = HandlerRecorder()
        pb_grpc.add_InferenceServicer_to_server(servicer, recorder)
        app = make_app(LocalChannel(recorder.handlers, []), limits=limits)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://front") as client:
            return await client.post("/v1/chat/completions", json=body)
    return asyncio.run(post())


@pytest.mark.parametrize("limits, count, words", [
    (Limits(max_chat_messages=8), 5000, "5,000 chat messages; at most 8 are allowed (--max-chat-messages)"),
    (None, FRONT_MAX_ITEMS + 1, f"{FRONT_MAX_ITEMS + 1:,} chat messages; this HTTP front takes at most "
                                f"{FRONT_MAX_ITEMS:,}"),   # the server's bound not told: the front's own
])
def test_a_chat_past_the_message_bound_is_refused_before_a_message_is_read(monkeypatch, limits, count, words):
    read = []
    message = translate._message
    monkeypatch.setattr(translate, "_message", lambda i, m: read.append(i) or message(i, m))
    servicer = Answering()
    answer = _post(servicer, {"messages": [{"role": "a"}] * count, "max_tokens": 1}, limits)
    assert answer.status_code == 400 and answer.json()["error"]["message"] == words
    assert answer.json()["error"]["param"] == "messages"
    assert read == [] and servicer.calls == 0
    # at the bound: each message read once, the call made
    answer = _post(servicer, {"messages": [{"role": "user", "content": "hi"}] * 8, "max_tokens": 1},
                   Limits(max_chat_messages=8))
    assert answer.status_code == 200 and len(read) == 8 and servicer.calls == 1, answer.text


class Unread(list):
    """A list refused by its length: iterating it fails the test."""

    def __iter__(self):
        raise AssertionError("the front read a list it refuses by its length")


@pytest.mark.parametrize("body, limits, words", [
    ({"prompt": "x", "stop_token_ids": Unread([1] * 1025)}, Limits(),
     "1,025 stop_token_ids; at most 1024 are allowed"),
    ({"prompt": "x", "stop": Unread(["s"] * 5)}, Limits(max_stop_strings=4),
     "5 stop strings; at most 4 are allowed (--max-stop-strings)"),
    ({"prompt": "x", "stop": Unread(["s"] * (FRONT_MAX_ITEMS + 1))}, Limits(),
     f"{FRONT_MAX_ITEMS + 1:,} stop strings; this HTTP front takes at most {FRONT_MAX_ITEMS:,}"),
])
def test_lists_past_the_servers_bounds_are_refused_unread(body, limits, words):
    with pytest.raises(HttpError) as err:
        request_of("completion", body, limits=limits)
    assert err.value.status == 400 and err.value.message == words


def test_a_batch_of_too_many_prompts_is_refused_unread():
    with pytest.raises(HttpError) as err:
        prompts_of({"prompt": Unread(["a"] * 257)})   # (its first looked at by index: a batch of strings)
    assert err.value.message == "at most 256 prompts in one request, got 257"


def test_the_limits_are_the_configs_fields():
    """Limits.of reads the model service's and the gateway's configs by these names."""
    from kvserve.model_service.config import ModelServiceConfig
    from kvserve.services.gateway.config import GatewayConfig

    assert {"max_chat_messages", "max_stop_strings"} <= {f.name for f in dataclasses.fields(ModelServiceConfig)}
    assert "max_chat_messages" in {f.name for f in dataclasses.fields(GatewayConfig)}
    assert Limits.of(SimpleNamespace(max_chat_messages=3, max_stop_strings=5)) == Limits(3, 5)
    assert Limits.of(SimpleNamespace(max_chat_messages=3)) == Limits(3, None)   # a gateway's: its workers check


def test_the_http_fronts_stop_token_ids_bound_is_the_servers():
    from kvserve.model_service.sampling.params import MAX_STOP_TOKEN_IDS

    assert translate.MAX_STOP_TOKEN_IDS == MAX_STOP_TOKEN_IDS
