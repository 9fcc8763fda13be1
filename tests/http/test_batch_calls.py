"""A completion's batch of prompts is one call per prompt (services/http/app.py): when one call
fails, before its first event or after, the others are cancelled at once, not left generating
for a client that already has its error. The front here runs over a LocalChannel to a scripted
servicer, as the model service's own front runs over one to the real servicer."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.services.http.app import make_app
from kvserve.services.plumbing.local_channel import HandlerRecorder, LocalChannel

STEP_S = 0.02
TOKENS = 500   # 10 s of tokens: a call the front leaves running is still running when the test looks


class Scripted(pb_grpc.InferenceServicer):
    """Each prompt says what its call does: "fail-now" is refused at once, "fail-later" fails
    after one token, "silent" sends nothing, anything else streams TOKENS tokens."""

    def __init__(self) -> None:
        self.closed: dict[str, int] = {}   # prompt -> tokens it had sent when its handler ended

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(name="scripted", max_model_len=4096)

    async def Generate(self, request, context):
        prompt, sent = request.prompt, 0
        try:
            if prompt == "fail-now":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is refused")
            if prompt == "silent":
                await asyncio.Event().wait()
            yield pb.GenerateResponse(prefill_done=pb.PrefillDone(prompt_tokens=1))
            for _ in range(TOKENS):
                if prompt == "fail-later" and sent:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is going away")
                yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[7], text="x"))
                sent += 1
                await asyncio.sleep(STEP_S)
            yield pb.GenerateResponse(finished=pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH,
                                                           usage=pb.Usage(prompt_tokens=1, completion_tokens=sent)))
        finally:
            self.closed[prompt] = sent


async def _post_and_watch(servicer: Scripted, body: dict, others: list[str]) -> tuple[httpx.Response, dict]:
    """The answer, and which handlers had ended (with their tokens sent) once `others` all had,
    or 5 s later: looked at here, before the loop's shutdown closes what is left."""
    recorder = HandlerRecorder()
    pb_grpc.add_InferenceServicer_to_server(servicer, recorder)
    app = make_app(LocalChannel(recorder.handlers, []))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://front") as client:
        answer = await client.post("/v1/completions", json=body)
        await answer.aread()
    for _ in range(500):   # the others' handlers end within a few loop turns: 5 s is a hang, not a timing
        if all(prompt in servicer.closed for prompt in others):
            break
        await asyncio.sleep(0.01)
    return answer, dict(servicer.closed)


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_refused_before_its_first_event_cancels_the_batchs_others(stream):
    answer, closed = asyncio.run(_post_and_watch(Scripted(), {"prompt": ["silent", "fail-now", "long"],
                                                              "max_tokens": 9, "stream": stream}, ["silent", "long"]))
    assert answer.status_code == 400 and "the prompt is refused" in answer.json()["error"]["message"]
    assert "silent" in closed and closed.get("long", TOKENS) < TOKENS, closed


def test_a_call_failing_mid_generation_cancels_the_others_of_a_whole_reply():
    answer, closed = asyncio.run(_post_and_watch(Scripted(), {"prompt": ["fail-later", "long", "long2"],
                                                              "max_tokens": 9}, ["long", "long2"]))
    assert answer.status_code == 503, answer.text
    assert all(closed.get(p, TOKENS) < TOKENS for p in ("long", "long2")), closed


async def _stop_reading_then_leave(servicer: Scripted, prompts: list[str]) -> dict:
    """A streamed request whose client takes the first write, never reads another, then leaves;
    which handlers had ended 2 s later (no garbage collection asked for)."""
    recorder = HandlerRecorder()
    pb_grpc.add_InferenceServicer_to_server(servicer, recorder)
    app = make_app(LocalChannel(recorder.handlers, []))
    body = json.dumps({"prompt": prompts if len(prompts) > 1 else prompts[0], "max_tokens": 400,
                       "stream": True}).encode()
    gone, wrote = asyncio.Event(), asyncio.Event()
    asked = []

    async def receive():
        if not asked:
            asked.append(1)
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            if wrote.is_set():
                await asyncio.Event().wait()   # stopped reading: this write never completes
            wrote.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("front", 80)}
    answering = asyncio.ensure_future(app(scope, receive, send))
    await wrote.wait()
    await asyncio.sleep(0.2)   # tokens come meanwhile, the writes wait
    gone.set()
    await asyncio.wait_for(answering, 10)
    for _ in range(200):
        if all(prompt in servicer.closed for prompt in prompts):
            break
        await asyncio.sleep(0.01)
    return dict(servicer.closed)


@pytest.mark.parametrize("prompts", [["long"], ["long", "long2"]])
def test_a_client_that_stops_reading_and_leaves_ends_its_calls_at_once(prompts):
    """Starlette leaves a stream's body it stopped reading to the garbage collector, and the
    body's `finally` cancels the calls: until a collection the requests went on generating."""
    closed = asyncio.run(_stop_reading_then_leave(Scripted(), prompts))
    assert set(closed) == set(prompts) and all(sent < TOKENS for sent in closed.values()), closed
