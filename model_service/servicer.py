"""kvserve.inference.v1.Inference: validate, hand to the engine, stream its events.

Runs on the server's asyncio loop; the engine runs on its own thread and
reaches a call only through the call's queue (the sink hops onto this loop).
A call that ends early — cancelled, deadline passed, client gone — cancels
its request, so its pages go back within one engine step. Every way a call
can fail ends with the code of the one table in status.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import grpc

from kvserve.kvcache_service.contract import convert
from kvserve.kvcache_service.contract.errors import KVCacheError
from kvserve.kvcache_service.contract.hashing import extra_key_digest
from kvserve.model_service.engine.errors import (TAKEN_HEADER, DuplicateRequest, InvalidRequest, NothingToGenerate,
                                                 RequestFailed, Unauthenticated, Unavailable)
from kvserve.model_service.engine.events import Failed, Finished, PrefillDone, Queued, Tokens
from kvserve.model_service.event_relay import EventRelay
from kvserve.model_service.metrics import ServiceMetrics
from kvserve.model_service.request_builder import RequestBuilder, scoped_request_id
from kvserve.model_service.request_ids import CANCELLED_ID_WAIT_S, LEFT_CALL_WAIT_S, id_problem
from kvserve.model_service.status import abort, as_request_failed, status_code
from kvserve.model_service.stream_backlog import StreamBacklog, Unread
from kvserve.model_service.tiny_model import PRESETS
from kvserve.model_service.tokenizing import TokenizerLanes
from kvserve.services.plumbing import stats_watch
from kvserve.services.plumbing.api_keys import MAX_TENANT_CHARS, TENANT_METADATA, ApiKeys, bearer_token, metadata_value
from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
# The manager's stats, asked for a report: a hung manager makes a report without them, within a
# client's deadline (`kvserve top` polls every few seconds), not one that waits --manager-timeout.
MANAGER_STATS_TIMEOUT_S = 1.0
# Tokens that piled up for a slow client merge into chunks of at most this many: one message of a
# whole backlog (with logprobs) passed the 4 MiB a gRPC client takes by default, and the stream died.
MAX_CHUNK_TOKENS = 256

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, stack, relay: EventRelay, metrics: ServiceMetrics, keys: ApiKeys | None = None) -> None:
        self.stack = stack
        self.metrics = metrics
        self.keys = keys   # --api-keys: a key's tenant keeps its own prefix cache
        self.engine = stack.engine
        self.lanes = TokenizerLanes(stack.config.tokenizer_threads)
        self.builder = RequestBuilder(stack, self.lanes)
        self.draining = False
        self.health = None   # the HealthReporter, once the server runs (server.py)
        self.cache_events = None   # the CacheEventsServicer served beside this one (server.py)
        self.metrics_endpoint = None   # where Prometheus scrapes self.metrics, when asked (server.py)
        self.http_front = None   # the OpenAI-compatible HTTP front, when asked (server.py)
        self.lane = None   # the lane's server, when asked (server.py, lane_server.py)
        self._relay = relay   # the engine flushes it after each step (assembly.build's on_step_end)
        self.open_streams = 0   # Generate calls not yet returned: a drain waits for them (server.py)
        self._shared_stats = stats_watch.SharedStats(self._stats, self._load)   # WatchServerStats' messages
        self._token_text = TokenTexts(stack.tokenizer, stack.token_bytes)   # logprobs name their tokens

    def drain(self) -> None:
        """Shutting down: new calls get UNAVAILABLE, running ones finish."""
        self.draining = True

    def close(self) -> None:
        self.lanes.close()
        self.stack.grammars.close()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()

    async def Generate(self, request, context):
        self.open_streams += 1
        try:
            clock = self.metrics.stream()
            request_id = request.request_id or uuid.uuid4().hex
            try:
                if self.draining:
                    raise Unavailable("the server is draining: it takes no new requests (another worker, "
                                      "or this one once restarted, will)")
                tenant = self._tenant(context)
                req = await self.builder.build(request, request_id, tenant)
                req.arrival = clock.arrival   # its time to first token counts its tokenizing too
                clock.prompt_tokens = len(req.prompt_ids)
                events = StreamBacklog(self.stack.config.max_unread_tokens, 1 + (req.params.logprobs or 0),
                                       lambda: self.engine.cancel(req.request_id, req))
                await self._submit(req, request_id, self._relay.sink(events))
            except Exception as exc:
                failure = as_request_failed(exc, "building the request failed", request_id)
                if not isinstance(failure, NothingToGenerate):   # (a moved stream already complete: no refusal)
                    self.metrics.refused.labels(status_code(failure).name).inc()
                await abort(context, failure)
            self.metrics.params_n.observe(req.params.n)
            left = clock.sequences = req.params.n   # sequences running: the call ends after the last one's finished
            finished = failed = False
            try:
                # The response headers now, not with the first token: a gateway counts the request
                # as this worker's from them (services/gateway/worker.py, Routing).
                await context.send_initial_metadata(((TAKEN_HEADER, "1"),))
                while not finished:
                    event = await events.get()
                    if isinstance(event, Unread):
                        await abort(context, event.error)
                    batch = [event]
                    while not events.empty():  # coalesce what piled up while the client was slow
                        batch.append(events.get_nowait())
                    clock.tokens(e for e in batch if isinstance(e, Tokens))
                    for e in batch:
                        if isinstance(e, Finished):
                            clock.finished(e)
                    for message, ended, failure in _to_messages(request_id, batch, self._token_text):
                        if failure is not None:
                            failed = True   # the engine's failure, not the client's leaving
                            await abort(context, failure)
                        left -= ended
                        finished = not left
                        yield message
            finally:
                # cancelled, deadline, client gone: free the pages now (an overflow cancelled it
                # already, and its id may be another request's by now)
                if not finished and events.overflowed is None:
                    self.engine.cancel(req.request_id, req)   # this call's, not one reusing its id
                if not finished and not failed:
                    clock.abandoned()
        finally:
            self.open_streams -= 1

    async def _submit(self, req, request_id: str, sink) -> None:
        """Hands the request to the engine. An id in flight is refused, unless a cancel has
        reached the request holding it: that one ends within a step, and a client that cancelled
        (or left) and sends the id again is served once it has, not told the id is in flight.
        A call its client left frees its id as its handler unwinds, a few loop turns after grpc
        (or the lane) ended it: an id not yet ending is looked at for LEFT_CALL_WAIT_S first."""
        start = time.monotonic()
        while True:
            try:
                return self.engine.submit(req, sink)
            except DuplicateRequest:   # said with the id the client knows, not the engine's
                ending = self.engine.ending(req.request_id)
                if time.monotonic() - start > (CANCELLED_ID_WAIT_S if ending else LEFT_CALL_WAIT_S):
                    raise DuplicateRequest(f"request id {request_id!r} is already in flight") from None
            # (a client sending ids in flight again and again costs each call ten looks at most)
            await asyncio.sleep(0.005)

    def _tenant(self, context) -> str:
        """Whose prefix cache the request uses: its key's tenant, a trusted front's metadata, or
        the deployment's ("")."""
        metadata = context.invocation_metadata()
        if self.keys is not None:
            tenant = self.keys.tenant(bearer_token(metadata))
            if tenant is None:   # the key left the file since the interceptor saw it (SIGHUP)
                raise Unauthenticated("unknown API key")
            return tenant
        if self.stack.config.trust_tenant_metadata:
            tenant = metadata_value(metadata, TENANT_METADATA) or ""
            if len(tenant) > MAX_TENANT_CHARS:
                raise InvalidRequest(f"{TENANT_METADATA} metadata is longer than {MAX_TENANT_CHARS} characters")
            return tenant
        return ""

    async def Cancel(self, request, context):
        try:
            tenant = self._tenant(context)
        except RequestFailed as exc:
            await abort(context, exc)
        # another tenant's request is, to this caller, no request at all; nor is one under an id
        # Generate refuses (a NUL in it could spell another tenant's scoped id)
        if id_problem(request.request_id) is not None or \
                not self.engine.cancel(scoped_request_id(tenant, request.request_id)):
            shown = request.request_id if len(request.request_id) <= 64 else request.request_id[:64] + "..."
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no request {shown!r} in flight")
        return pb.CancelResponse()

    async def Tokenize(self, request, context):
        try:
            ids = await self.builder.tokenize(request)
            tokens = await self.builder.token_strings(ids)
        except Exception as exc:
            await abort(context, as_request_failed(exc, "tokenizing failed"))
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def Detokenize(self, request, context):
        try:
            text = await self.builder.detokenize(request)
        except Exception as exc:
            await abort(context, as_request_failed(exc, "detokenizing failed"))
        return pb.DetokenizeResponse(text=text)

    async def GetModelInfo(self, request, context):
        s = self.stack
        return pb.ModelInfo(
            name=served_name(s),
            architecture=s.model_config.architecture, max_model_len=s.max_model_len,
            vocab_size=s.model_config.vocab_size, page_size=s.page_size, dtype=str(s.dtype).removeprefix("torch."),
            attention_backend=s.backend_name, cpu_gemm=s.gemm, device=str(s.device), num_pages=s.num_pages,
            eos_token_ids=sorted(s.eos_token_ids), extra_key_digest=extra_key_digest(s.config.cache_salt),
            max_num_seqs=s.config.max_num_seqs, kv_cache_dtype=str(s.kv_cache_dtype).removeprefix("torch."),
            trusts_tenant_metadata=s.config.trust_tenant_metadata,
            attention_sink=s.config.attention_sink, max_waiting=s.config.max_waiting,
            sliding_window=s.model_config.sliding_window or 0, tokenizer_digest=s.tokenizer_digest,
            takes_cache_salt=True, config_digest=s.model_config.digest(),
            lane_address=self.lane.address if self.lane is not None else "", lane_pings=self.lane is not None)

    async def GetServerStats(self, request, context):
        return await self._stats()

    async def WatchServerStats(self, request, context):
        async for stats in stats_watch.watch(request, context, self._shared_stats,
                                             done=lambda: self.draining and not self.open_streams, keys=self.keys):
            yield stats   # (done: its last Generate returned)

    def _load(self) -> tuple:
        """What a WatchServerStats message is sent for when it changes."""
        e = self.engine
        return (e.num_running, self._waiting(), e.num_swapped,
                stats_watch.pages_key(e.scheduler.available_pages, self.stack.num_pages), not self._not_serving(),
                stats_watch.prefill_key(e.num_prefill_tokens, self.stack.page_size))

    def _waiting(self) -> int:
        """Requests here waiting to run, those submitted since the engine's last step included:
        a gateway's report then counts a request routed here before that step sees it."""
        return self.engine.num_waiting_requests()

    def _not_serving(self) -> str:
        """Why health says NOT_SERVING (its source: engine.problem() and the drain), or ""."""
        if self.draining or (self.health is not None and self.health.draining):
            return "the server is draining"
        return self.engine.problem() or ""

    async def _stats(self) -> pb.ServerStats:
        e, c = self.engine, self.engine.counters
        not_serving = self._not_serving()
        stats = pb.ServerStats(
            serving=not not_serving, not_serving=not_serving,
            running=e.num_running, waiting=self._waiting(), swapped=e.num_swapped,
            prompt_tokens=c.prompt_tokens, generated_tokens=c.generated_tokens, cached_tokens=c.cached_tokens,
            requests_finished=c.finished, requests_aborted=c.aborted, steps=c.steps,
            schedule_seconds=c.schedule_s, manager_seconds=c.manager_s, copy_seconds=c.copy_s,
            forward_seconds=c.forward_s, sample_seconds=c.sample_s, emit_seconds=c.emit_s,
            requests_failed=c.failed, manager_losses=c.manager_losses, prefill_tokens=e.num_prefill_tokens)
        if e.link.lost:   # its stats would wait out the manager's timeout: a client's deadline first
            stats.manager_reachable = False
            return stats
        try:
            kv = await asyncio.to_thread(self.stack.kv.stats, MANAGER_STATS_TIMEOUT_S)
            stats.kvcache.CopyFrom(convert.stats_to_pb(kv))
            stats.manager_reachable = not e.link.lost
        except KVCacheError:
            stats.manager_reachable = False
        return stats


def served_name(stack) -> str:
    """The model's name to clients: --served-model-name, else the preset's or its folder's."""
    config = stack.config
    return config.served_model_name or (config.model if config.model in PRESETS else stack.model_path.name)


def model_labels(stack) -> dict[str, str]:
    """kvserve:model_info's labels (metrics.py), as GetModelInfo says them."""
    return {"model_name": served_name(stack), "dtype": str(stack.dtype).removeprefix("torch."),
            "device": str(stack.device), "attention_backend": stack.backend_name, "cpu_gemm": stack.gemm}


class TokenTexts:
    """A token id's text alone, as a logprob names it (the tokenizer's own pieces joined as text:
    "▁the" and "Ġthe" read " the" or "the" as that tokenizer decodes them), cached: a vocabulary is
    bounded, and the top-n repeat. `bytes_of`: the bytes a token stands for (model_service/
    token_bytes.py), where its text shows U+FFFD for part of a character; None where unknown."""

    def __init__(self, tokenizer, bytes_of: Callable[[int], bytes] | None = None) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self.bytes_of = bytes_of or (lambda _token_id: b"")

    def decode(self, token_ids: list[int]) -> str:
        """Tokens as one text, special tokens kept (an echoed prompt)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            text = "" if piece is None else self.tokenizer.convert_tokens_to_string([piece])
            self._texts[token_id] = text
        return text


def _token_logprob(lp, token_text: TokenTexts) -> pb.TokenLogprob:
    raw = token_text.bytes_of
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, token=token_text(lp.token_id),
                           token_bytes=raw(lp.token_id),
                           top=[pb.TopLogprob(token_id=t, logprob=v, token=token_text(t), token_bytes=raw(t))
                                for t, v in lp.top])


def _to_messages(request_id: str, events: list, token_text: TokenTexts):
    """Engine events → (response, finished, failure: RequestFailed | None); consecutive tokens of
    one sequence merge into one chunk. token_text names the tokens of logprobs."""
    chunk: pb.TokenChunk | None = None
    index = 0
    for event in events:
        if isinstance(event, Tokens):
            if chunk is not None and event.index != index:
                yield pb.GenerateResponse(chunk=chunk, index=index), False, None
                chunk = None
            if chunk is not None and len(chunk.token_ids) >= MAX_CHUNK_TOKENS:
                yield pb.GenerateResponse(chunk=chunk, index=index), False, None
                chunk = None
            if chunk is None:
                chunk, index = pb.TokenChunk(), event.index
            chunk.token_ids.extend(event.token_ids)
            chunk.text += event.text
            chunk.logprobs.extend(_token_logprob(lp, token_text) for lp in event.logprobs)
            continue
        if chunk is not None:
            yield pb.GenerateResponse(chunk=chunk, index=index), False, None
            chunk = None
        if isinstance(event, Queued):
            yield pb.GenerateResponse(queued=pb.QueueStatus(position=event.position, eta_ms=event.eta_ms)), False, None
        elif isinstance(event, PrefillDone):
            done = pb.PrefillDone(request_id=request_id, prompt_tokens=event.prompt_tokens,
                                  cached_tokens=event.cached_tokens)
            asked = event.prompt_logprobs
            if asked is not None:
                shown, first = done.prompt_logprobs, asked.prompt_ids[0]
                shown.first_token_id, shown.first_token = first, token_text(first)
                shown.tokens.extend(_token_logprob(lp, token_text) for lp in asked.tokens)
                shown.text = token_text.decode(asked.prompt_ids)
            yield pb.GenerateResponse(prefill_done=done), False, None
        elif isinstance(event, Finished):
            usage = pb.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                             cached_tokens=event.cached_tokens)
            finished = pb.Finished(finish_reason=FINISH[event.reason], usage=usage, ttft_ms=event.ttft_ms,
                                   total_ms=event.total_ms, stop=event.stop)
            if event.stop_token_id is not None:
                finished.stop_token_id = event.stop_token_id
            yield pb.GenerateResponse(finished=finished, index=event.index), True, None
        elif isinstance(event, Failed):
            yield None, True, event.error
            return
    if chunk is not None:
        yield pb.GenerateResponse(chunk=chunk, index=index), False, None
