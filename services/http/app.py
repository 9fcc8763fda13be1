"""The ASGI app (Starlette): each route a call to the Inference service this front stands beside,
through the channel it is given (the server's local_channel(): its handlers, in this process,
behind its interceptors). The client's `Authorization: Bearer KEY` goes along as gRPC metadata,
so keys, tenants and their caches work exactly as over gRPC (a call without a known key is
refused before its body is read, as the interceptor refuses it before any work); gRPC status
codes come back as OpenAI's error shapes. A client that disconnects cancels its call, which frees its pages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import aclosing

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.services.http.translate import (HttpError, Limits, Reply, batch_requests, check_fields, client_param,
                                             detokenize_request, echo_only, prompt_top_of, prompts_of, request_of,
                                             shown, stream_usage, tokenize_request)
from kvserve.services.plumbing.api_keys import ApiKeys
from kvserve.services.plumbing.retry_hints import retry_after_ms, says_no_retry
from kvserve.services.plumbing.version import kvserve_version

log = logging.getLogger(__name__)

BODY_TIMEOUT_S = 30.0       # from the headers to the body's last byte
MAX_AUTHORIZATION = 4096    # characters of an Authorization header: far over any key

HTTP_OF = {grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
           grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
           grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
           grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
           grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
           grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
           grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
           grpc.StatusCode.CANCELLED: (499, "cancelled"),
           grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
           grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout")}


def from_rpc(exc: grpc.aio.AioRpcError) -> HttpError:
    status, kind = HTTP_OF.get(exc.code(), (500, "server_error"))
    return HttpError(status, exc.details() or exc.code().name, kind, code=exc.code().name.lower(),
                     headers=retry_headers(exc))


def retry_headers(exc: grpc.aio.AioRpcError) -> dict[str, str] | None:
    """What an HTTP client's retries go by: the server's retry-after-ms hint (a full queue, a
    gateway's estimate) as Retry-After and retry-after-ms, which the openai SDKs wait out; a
    request id already in flight is no error a retry mends (it could run the request twice), nor
    is one the server marks so (a request two workers died computing: a retry could kill more)."""
    if exc.code() == grpc.StatusCode.ALREADY_EXISTS or says_no_retry(exc.trailing_metadata()):
        return {"x-should-retry": "false"}
    hint = retry_after_ms(exc.trailing_metadata())
    if hint is None:
        return None
    return {"retry-after-ms": str(hint), "retry-after": str(max(1, math.ceil(hint / 1000)))}


def error_response(err: HttpError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n".encode()


class Front:
    """What the routes share: the channel to the Inference service and the limits."""

    def __init__(self, channel: grpc.aio.Channel, max_body_bytes: int, keys: ApiKeys | None = None,
                 limits: Limits | None = None) -> None:
        self.keys = keys   # the server's own: a caller without a key is refused before its body is read
        self.stub = pb_grpc.InferenceStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)
        self.max_body_bytes = max_body_bytes
        self.limits = limits or Limits()   # the server's bounds on a request's lists, where told them
        self.info: pb.ModelInfo | None = None   # the served model's, once asked

    def metadata(self, request: Request) -> tuple:
        """The client's Authorization header as gRPC metadata, where the server checks keys. One
        that no key can be (not printable ASCII, or longer than any) is a 401 here: gRPC refuses
        to send it. Without keys it is not looked at (a proxy in front may send its own token)."""
        auth = request.headers.get("authorization")
        if not auth or self.keys is None:
            return ()
        if len(auth) > MAX_AUTHORIZATION or not (auth.isascii() and auth.isprintable()):
            raise HttpError(401, "the Authorization header is malformed: it is `Bearer KEY`, printable ASCII, at "
                                 f"most {MAX_AUTHORIZATION} characters", "authentication_error",
                            code="unauthenticated")
        return (("authorization", auth),)

    async def keyed_body(self, request: Request) -> tuple[tuple, dict]:
        """The call's metadata and the JSON body, once its key is known good (401 as from gRPC
        otherwise: without a key nothing of the body is read)."""
        metadata = self.metadata(request)
        if self.keys is not None and (why := self.keys.refusal(metadata)) is not None:
            raise HttpError(401, why, "authentication_error", code="unauthenticated")
        return metadata, await self.body(request)

    async def body(self, request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise HttpError(413, f"the request body is larger than {self.max_body_bytes} bytes")
        chunks, size = [], 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise HttpError(413, f"the request body is larger than {self.max_body_bytes} bytes")
                chunks.append(chunk)
        try:
            await asyncio.wait_for(read(), BODY_TIMEOUT_S)
        except ClientDisconnect:
            raise HttpError(499, "the client went away", "cancelled") from None
        except asyncio.TimeoutError:   # a client that declares a body and sends less holds a connection
            raise HttpError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s") from None
        try:
            body = json.loads(b"".join(chunks) or b"null")
        except (ValueError, UnicodeDecodeError) as exc:
            raise HttpError(400, f"the body is not valid JSON: {exc}") from None
        except RecursionError:   # arrays or objects nested thousands deep
            raise HttpError(400, "the body is not valid JSON here: it nests too deep") from None
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        return body

    async def model(self, metadata: tuple) -> pb.ModelInfo:
        if self.info is None:
            self.info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=30)
        return self.info

    async def _model_asked(self, body: dict, metadata: tuple) -> pb.ModelInfo:
        """The served model, when the body's `model` names it (or names none); a 404 otherwise."""
        info = await self.model(metadata)
        asked = body.get("model")
        if asked is not None and not isinstance(asked, str):
            raise HttpError(400, "'model' must be a string", param="model")
        if asked not in (None, "", info.name):
            await self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=30)   # the key
            raise HttpError(404, f"the model `{shown(asked)}` does not exist; this server serves `{info.name}`",
                            "not_found_error", "model", "model_not_found")
        return info

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: the ids (and, asked, the token strings) the server makes of a prompt
        or of chat messages rendered by the model's template."""
        try:
            metadata, body = await self.keyed_body(request)
            check_fields("tokenize", body)
            msg, strings = tokenize_request(body, self.limits)
            info = await self._model_asked(body, metadata)
            answer = await self.stub.Tokenize(msg, metadata=metadata, timeout=60)
        except HttpError as err:
            return error_response(err)
        except grpc.aio.AioRpcError as exc:
            return error_response(from_rpc(exc))
        return JSONResponse({"count": len(answer.token_ids), "max_model_len": info.max_model_len,
                             "tokens": list(answer.token_ids), "token_strs": list(answer.tokens) if strings else None})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: the text of token ids, as the server's tokenizer writes it. The
        model is asked for only to check a `model` the body names: a gateway with no worker
        serving answers the rest from its own tokenizer at once."""
        try:
            metadata, body = await self.keyed_body(request)
            check_fields("detokenize", body)
            msg = detokenize_request(body)
            if body.get("model") is not None:
                await self._model_asked(body, metadata)
            answer = await self.stub.Detokenize(msg, metadata=metadata, timeout=60)
        except HttpError as err:
            return error_response(err)
        except grpc.aio.AioRpcError as exc:
            return error_response(from_rpc(exc))
        return JSONResponse({"prompt": answer.text})

    # ------------------------------------------------------------ routes

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def models(self, request: Request) -> Response:
        try:
            info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata(request), timeout=30)
        except HttpError as err:
            return error_response(err)
        except grpc.aio.AioRpcError as exc:
            return error_response(from_rpc(exc))
        self.info = info
        asked = request.path_params.get("model")
        if asked is None:
            return JSONResponse({"object": "list", "data": [_model_object(info)]})
        if asked != info.name:   # GET /v1/models/{model}, the SDKs' models.retrieve
            return error_response(HttpError(404, f"the model `{shown(asked)}` does not exist; this server serves "
                                                 f"`{info.name}`", "not_found_error", "model", "model_not_found"))
        return JSONResponse(_model_object(info))

    async def version(self, request: Request) -> Response:
        """vLLM's /version (no key asked, as for /health)."""
        return JSONResponse({"version": kvserve_version()})

    async def health_check(self, request: Request) -> Response:
        try:
            answer = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            serving = answer.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            serving = False
        return JSONResponse({"status": "ok" if serving else "unavailable"}, status_code=200 if serving else 503)

    async def _generate(self, request: Request, kind: str) -> Response:
        parts: list[Part] = []
        body = None
        try:
            metadata, body = await self.keyed_body(request)
            check_fields(kind, body)
            prompts = prompts_of(body) if kind == "completion" else None
            limits = self.limits
            msgs = batch_requests(body, prompts, limits) if prompts else [request_of(kind, body, limits=limits)]
            info = await self._model_asked(body, metadata)
            model = info.name
            stream = body.get("stream") is True
            usage, continuous = stream_usage(body.get("stream_options"), stream)
            # the reply's id is the one the server logs the request under (a batch's prompts: -0, -1, ...)
            base_id = msgs[0].request_id or uuid.uuid4().hex
            echo = kind == "completion" and body.get("echo") is True
            prompt_top = prompt_top_of(body)   # vLLM's, as request_of read it (1.0 is 1)
            for i, msg in enumerate(msgs):
                msg.request_id = base_id if len(msgs) == 1 else f"{base_id}-{i}"
                call = self.stub.Generate(msg, metadata=metadata)
                parts.append(Part(msg, call, self._events(call, echo or prompt_top is not None or continuous)))
            await self._first(request, parts)   # errors before it get their HTTP status
            offset = 0
            for part in parts:   # once the server took n: it bounds it
                msg = part.msg
                part.offset = offset
                part.reply = Reply(kind, model, msg.sampling.n or 1, logprobs=msg.sampling.HasField("logprobs"),
                                   echo=echo, prompt=msg.prompt if msg.HasField("prompt") else None,
                                   echo_top=msg.sampling.logprobs, prompt_top=prompt_top, request_id=base_id,
                                   eos_token_ids=info.eos_token_ids, echo_only=echo and echo_only(body))
                part.reply.created = parts[0].reply.created
                offset += part.reply.n
        except HttpError as err:
            _cancel(parts)
            return error_response(err)
        except grpc.aio.AioRpcError as exc:
            _cancel(parts)
            err = from_rpc(exc)
            if err.status == 400 and body is not None:   # the client's name for the field the server names
                err.param = client_param(kind, body, err.message)
            return error_response(err)
        except BaseException:   # a failure of this front's, or the request's task cancelled: no call left running
            _cancel(parts)
            raise
        if not stream:
            return await self._whole(request, parts)
        return _ClosingStream(self._stream(parts, usage, continuous), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    @staticmethod
    async def _first(request: Request, parts: list[Part]) -> None:
        """Each call's first event (None if it ends without one), or the first call's error. Until
        every call has its first, those that have one are read on (_read_ahead): a batch's prompt
        queued behind the others would otherwise leave theirs unread, and their server ends a
        stream left unread too long (--max-unread-tokens). A client that leaves before them (its
        request queued, or prefilling) cancels the calls, as it would later: their places in the
        queue and their prefills are freed at once."""
        all_in, left = asyncio.Event(), [len(parts)]

        async def first_of(part: Part) -> None:
            part.first = await anext(part.events, None)
            left[0] -= 1
            if not left[0]:
                all_in.set()
            await _read_ahead(part, all_in)
        firsts = asyncio.ensure_future(_each(first_of(part) for part in parts))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({firsts, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not gone.done():   # (a disconnect read here is seen by no later watcher: it ends the calls here)
                firsts.result()
                return
            raise HttpError(499, "the client went away", "cancelled")
        finally:
            gone.cancel()
            if not firsts.done():
                firsts.cancel()

    @staticmethod
    async def _events(call, prefill: bool) -> AsyncIterator[pb.GenerateResponse]:
        """The call's tokens and ends, and its prefill_done when the prompt is echoed or its
        logprobs asked for."""
        async for event in call:
            if event.HasField("chunk") or event.HasField("finished") or (prefill and event.HasField("prefill_done")):
                yield event

    async def _whole(self, request: Request, parts: list[Part]) -> Response:
        """The whole answer at once; a client that leaves before it is ready cancels the calls."""
        async def collect() -> Response:
            try:
                await _each(_collect(part) for part in parts)
            except grpc.aio.AioRpcError as exc:
                return error_response(from_rpc(exc))
            return JSONResponse(_whole_of(parts))

        work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                return work.result()
            return Response(status_code=499)   # nobody reads it
        finally:
            watch.cancel()
            work.cancel()
            _cancel(parts)   # a finished call ignores it; a running one frees its pages

    async def _stream(self, parts: list[Part], usage: bool, continuous: bool = False) -> AsyncIterator[bytes]:
        left = sum(part.reply.n for part in parts)   # choices not yet sent finished
        try:
            async with aclosing(_merged(parts, continuous)) as merged:   # its pumps stop with it
                async for chunks in merged:
                    out = b"".join(sse(chunk) for chunk in chunks)
                    left -= sum(c.get("finish_reason") is not None for chunk in chunks for c in chunk["choices"])
                    if not left:   # the calls' last event: the end goes in the same write
                        out += (sse(_usage_chunk(parts)) if usage else b"") + sse("[DONE]")
                    yield out
            if left:
                yield sse("[DONE]")
        except grpc.aio.AioRpcError as exc:   # after the 200 went out: the error is the stream's last event
            yield sse(from_rpc(exc).body())
            yield sse("[DONE]")
        except Exception as exc:   # this front's own failure: said, as the last event, not a cut connection
            yield sse(internal_error("streaming a reply", exc).body())
            yield sse("[DONE]")
        finally:
            _cancel(parts)   # the client went away (or the stream ended): nothing left running upstream


class _ClosingStream(StreamingResponse):
    """Closes its body however the response ends. Starlette leaves a body it stopped reading (its
    client gone while a write waited) to the garbage collector, and with it the body's `finally`
    that cancels the calls: until a collection, a client that stopped reading and left kept its
    requests generating (up to --max-unread-tokens)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class Part:
    """One Generate call of a reply: a request's only one, or one prompt of a batch, whose
    choices come after the `offset` choices of the prompts before it."""

    def __init__(self, msg: pb.GenerateRequest, call, events: AsyncIterator[pb.GenerateResponse]) -> None:
        self.msg, self.call, self.events = msg, call, events
        self.first: pb.GenerateResponse | None = None
        self.reply: Reply = None   # made once the server took the call
        self.offset = 0
        self.ahead: asyncio.Future | None = None   # a read _read_ahead left under way (_replayed awaits it)


async def _read_ahead(part: Part, all_in: asyncio.Event) -> None:
    """Reads `part`'s events after its first into memory until `all_in` is set, then puts them
    (and a read still under way) back in front of the rest of its events. Bounded by what the
    request asked for: the whole reply is held the same way when it is not streamed."""
    early: list[pb.GenerateResponse] = []
    ahead = None   # the read under way when all_in came: the reply's reader awaits it
    event = part.first
    waiting = asyncio.ensure_future(all_in.wait())
    try:
        while event is not None and not all_in.is_set():
            ahead = asyncio.ensure_future(anext(part.events, None))
            await asyncio.wait({ahead, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if not ahead.done():
                break
            event, ahead = ahead.result(), None
            if event is not None:
                early.append(event)
    except BaseException:   # cancelled, or the call failed: no read of it left running unseen
        if ahead is not None:
            ahead.cancel()
        raise
    finally:
        waiting.cancel()
    if ahead is not None:   # an error it ends with, should nobody await it, is not "never retrieved"
        ahead.add_done_callback(lambda done: done.cancelled() or done.exception())
        part.ahead = ahead
    if early or ahead is not None:
        part.events = _replayed(early, ahead, part.events)


async def _replayed(early: list, ahead, events: AsyncIterator) -> AsyncIterator:
    for event in early:
        yield event
    if ahead is not None:
        event = await ahead
        if event is None:
            return
        yield event
    async for event in events:
        yield event


def _cancel(parts: list[Part]) -> None:
    for part in parts:
        part.call.cancel()
        if part.ahead is not None:   # a reader: an in-process call stops only through it (local_channel.py)
            part.ahead.cancel()


async def _each(coroutines: Iterable[Awaitable]) -> None:
    """Runs them side by side to their ends; the first to fail cancels the others, so that the
    tasks reading a batch's other calls stop (an in-process call being read is cancelled only
    through its reader: local_channel.py), and its error is raised."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()   # (a task done already ignores it)


async def _collect(part: Part) -> None:
    """A call's events into its reply, to the call's end."""
    reply, event = part.reply, part.first
    while event is not None:
        if event.HasField("chunk"):
            reply.text[event.index].append(event.chunk.text)
            reply.tokens[event.index].extend(event.chunk.logprobs)
        elif event.HasField("prefill_done"):
            reply.prefill_done(event.prefill_done)
        else:
            reply.finished(event.finished, event.index)
        event = await anext(part.events, None)


async def _chunks(part: Part, continuous: bool) -> AsyncIterator[list[dict]]:
    """A call's events as the chunks a stream sends, a list for each write, each choice numbered
    after the batch's prompts before it."""
    reply = part.reply

    def sent(chunk: dict, index: int = 0) -> dict:
        if continuous:   # vLLM's continuous_usage_stats: each chunk says the usage so far
            chunk["usage"] = reply.usage_so_far(index)
        for choice in chunk["choices"]:
            choice["index"] += part.offset
        return chunk

    first = part.first
    if continuous and first is not None and first.HasField("prefill_done"):
        reply.prompt_tokens = first.prefill_done.prompt_tokens
    if reply.kind == "chat":
        yield [sent(reply.choice_chunk(role=True, index=index), index) for index in range(reply.n)]
    event = first
    while event is not None:
        if event.HasField("chunk"):
            if not reply.echo_only:   # (echo only: the token run for the prompt's logprobs is not shown)
                reply.generated[event.index] += len(event.chunk.token_ids)
                if event.chunk.text or event.chunk.logprobs:   # (text held back has its tokens' logprobs)
                    yield [sent(reply.choice_chunk(event.chunk.text, index=event.index,
                                                   logprobs=event.chunk.logprobs), event.index)]
        elif event.HasField("prefill_done"):   # the prompt: its logprobs (vLLM's), an echo
            reply.prefill_done(event.prefill_done)
            if reply.prompt_top is not None:   # vLLM's prompt_logprobs come first
                yield [sent(reply.prompt_logprobs_chunk(index), index)
                       for index in range(1 if reply.kind == "chat" else reply.n)]
            if reply.echo:
                yield [sent(reply.echo_chunk(index), index) for index in range(reply.n)]
        else:
            reason = reply.finished(event.finished, event.index)
            yield [sent(reply.choice_chunk(None if reply.kind == "chat" else "", reason, index=event.index),
                        event.index)]
        event = await anext(part.events, None)   # to the call's end, so that it ends as finished


async def _merged(parts: list[Part], continuous: bool) -> AsyncIterator[list[dict]]:
    """The parts' chunks as each comes; the first error of any ends it."""
    if len(parts) == 1:
        async for chunks in _chunks(parts[0], continuous):
            yield chunks
        return
    # Bounded: a client that does not read holds the pumps, so that each call's server sees it
    # (its --max-unread-tokens) instead of this front keeping every token of every part.
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * len(parts))

    async def pump(part: Part) -> None:
        try:
            async for chunks in _chunks(part, continuous):
                await queue.put(chunks)
            await queue.put(None)
        except Exception as exc:   # any: a pump that ended without a word would hold the stream open forever
            await queue.put(exc)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():   # the merge itself stopped it
                raise
            # its call was cancelled from elsewhere (a real channel closed under it; the server's
            # local channel cancels nothing at its close)
            await queue.put(grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                                 "the call was cancelled before the request finished"))
    tasks = [asyncio.ensure_future(pump(part)) for part in parts]
    try:
        running = len(parts)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


def _summed_usage(parts: list[Part]) -> dict | None:
    """The usage of a reply of several prompts: each prompt's tokens once, every choice's."""
    usages = [part.reply.usage for part in parts if part.reply.usage is not None]
    if not usages:
        return None
    total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "prompt_tokens_details": {"cached_tokens": 0}}
    for u in usages:
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            total[key] += u[key]
        total["prompt_tokens_details"]["cached_tokens"] += u["prompt_tokens_details"]["cached_tokens"]
    return total


def _usage_chunk(parts: list[Part]) -> dict:
    out = parts[0].reply.usage_chunk()
    out["usage"] = _summed_usage(parts)
    return out


def _whole_of(parts: list[Part]) -> dict:
    out = parts[0].reply.whole()
    for part in parts[1:]:
        for choice in part.reply.whole()["choices"]:
            choice["index"] += part.offset
            out["choices"].append(choice)
    out["usage"] = _summed_usage(parts)
    return out


def _model_object(info: pb.ModelInfo) -> dict:
    return {"id": info.name, "object": "model", "created": 0, "owned_by": "kvserve", "max_model_len": info.max_model_len}


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (its body is read: what comes next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


INTERNAL_ERROR = HttpError(500, "the server failed to answer this request (its log says why)", "server_error",
                           code="internal")


def internal_error(what: str, exc: Exception, request: Request | None = None) -> HttpError:
    """This front's own failure (`what` it was doing), logged with its traceback under an incident
    id that the answer names, so that a client's report finds its log line; the request's path
    as its client sent it, escaped."""
    incident = uuid.uuid4().hex[:12]
    on = f" ({request.method} {request.url.path!r})" if request is not None else ""
    log.error("the HTTP front failed %s%s (incident %s)", what, on, incident, exc_info=exc)
    return HttpError(500, f"internal error {what}; the server log has the details under incident {incident}",
                     "server_error", code="internal")


async def _internal_error(request: Request, exc: Exception) -> Response:
    """What fails outside an endpoint (a middleware): OpenAI's shape all the same, not plain text
    (Starlette raises it on to the server, which logs it)."""
    return error_response(INTERNAL_ERROR)


def _guarded(endpoint, route: str, answered: Callable[[str, int], None]):
    """The endpoint, its unexpected failures answered in OpenAI's error shape (not Starlette's
    plain text) from inside the middleware, so that a browser page allowed under CORS can read
    them too; the log has the traceback. `answered(route, status)` counts each answer (a stream's
    by the status it began with)."""
    async def guarded(request: Request) -> Response:
        try:
            response = await endpoint(request)
        except HTTPException:   # a 4xx of Starlette's: its own handler answers it
            raise
        except Exception as exc:
            response = error_response(internal_error(f"answering {route}", exc, request))
        answered(route, response.status_code)
        return response
    return guarded


async def _routing_error(request: Request, exc: HTTPException) -> Response:
    """A path or method this front does not serve, in OpenAI's error shape like every other."""
    if exc.status_code == 404:
        return error_response(HttpError(404, f"no route {request.url.path}: this server serves /v1/completions, "
                                             "/v1/chat/completions, /v1/models[/MODEL], /tokenize, /detokenize, "
                                             "/health, /ping and /version",
                                             "not_found_error"))
    if exc.status_code == 405:   # with the Allow header Starlette names the methods in
        err = HttpError(405, f"{request.method} is not allowed on {request.url.path}", "invalid_request_error")
        return JSONResponse(err.body(), status_code=405, headers=exc.headers)
    return error_response(HttpError(exc.status_code, exc.detail or "", "invalid_request_error"))


def make_app(channel: grpc.aio.Channel, max_body_bytes: int = 8 << 20, keys: ApiKeys | None = None,
             allowed_origins: list[str] | None = None, limits: Limits | None = None,
             answered: Callable[[str, int], None] = lambda _route, _status: None) -> Starlette:
    """`allowed_origins` (--http-allowed-origins): the browser origins answered under CORS, with the
    Authorization header allowed (a key is a header, not a cookie: no credentials mode). `limits`:
    the server's bounds on a request's lists (Limits.of(config)), refused before they are read.
    `answered(route, status)`: each answer of a route, for the server's metrics (its refusals
    before any call too)."""
    front = Front(channel, max_body_bytes, keys, limits)
    middleware = [Middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["GET", "POST"],
                             allow_headers=["*"], expose_headers=["retry-after", "retry-after-ms", "x-should-retry"],
                             max_age=600)] if allowed_origins else []
    endpoints = [("/v1/completions", front.completions, ["POST"]),
                 ("/v1/chat/completions", front.chat_completions, ["POST"]),
                 ("/v1/models", front.models, ["GET"]),
                 ("/v1/models/{model:path}", front.models, ["GET"]),
                 ("/tokenize", front.tokenize, ["POST"]),
                 ("/detokenize", front.detokenize, ["POST"]),
                 ("/health", front.health_check, ["GET"]),
                 ("/ping", front.health_check, ["GET", "POST"]),   # vLLM's, for SageMaker
                 ("/version", front.version, ["GET"])]
    return Starlette(middleware=middleware, routes=[
        Route(path, _guarded(endpoint, path, answered), methods=methods) for path, endpoint, methods in endpoints
    ], exception_handlers={HTTPException: _routing_error, Exception: _internal_error})
