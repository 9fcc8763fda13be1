"""Protobuf <-> the SDK's plain results (results.py), in one place: the sync client
(inference_client.py) and the asyncio one (async_client.py) build the same requests and read
the same answers, so both return equal results for equal calls."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from kvserve.clients.results import (
    Chunk,
    Completion,
    Event,
    Finished,
    KVServeError,
    Message,
    ModelInfo,
    PrefillDone,
    PromptLogprobs,
    Queued,
    ServerStats,
    Tokenized,
    TokenLogprob,
    TopLogprob,
    WorkerStats,
)
from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.kvcache_service.contract.convert import stats_from_pb

_T = TypeVar("_T")


# --------------------------------------------------------------------------- answers

def scalars(cls: type[_T], msg: Any, **extra: Any) -> _T:
    """cls(**{field: msg.field}) for every dataclass field not given in extra."""
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(cls) if f.name not in extra}
    return cls(**values, **extra)


def _token_logprobs(items: Iterable[Any]) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(lp.token_id, lp.logprob,
                              tuple(TopLogprob(t.token_id, t.logprob, t.token, t.token_bytes) for t in lp.top),
                              lp.token, lp.token_bytes)
                 for lp in items)


def _finish_reason(value: int) -> str:
    """"stop", "length", "abort", ...; a reason a newer server added is "reason_<number>"."""
    try:
        return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()
    except ValueError:   # proto3 enums are open
        return f"reason_{value}"


def event(msg: pb.GenerateResponse) -> Event | None:
    kind = msg.WhichOneof("event")
    if kind == "chunk":
        c = msg.chunk
        return Chunk(tuple(c.token_ids), c.text, _token_logprobs(c.logprobs), msg.index)
    if kind == "prefill_done":
        p = msg.prefill_done
        shown = None
        if p.HasField("prompt_logprobs"):
            q = p.prompt_logprobs
            shown = PromptLogprobs(q.first_token_id, q.first_token, _token_logprobs(q.tokens), q.text)
        return PrefillDone(p.request_id, p.prompt_tokens, p.cached_tokens, shown)
    if kind == "finished":
        f = msg.finished
        return Finished(_finish_reason(f.finish_reason), f.usage.prompt_tokens, f.usage.completion_tokens,
                        f.usage.cached_tokens, f.ttft_ms, f.total_ms, f.stop,
                        f.stop_token_id if f.HasField("stop_token_id") else None, msg.index)
    if kind == "queued":
        return Queued(msg.queued.position, msg.queued.eta_ms)
    return None  # an event this client does not know (a newer server): skipped


def tokenized(r: pb.TokenizeResponse) -> Tokenized:
    return Tokenized(tuple(r.token_ids), tuple(r.tokens))


def model_info(r: pb.ModelInfo) -> ModelInfo:
    return scalars(ModelInfo, r, eos_token_ids=tuple(r.eos_token_ids))


def server_stats(r: pb.ServerStats) -> ServerStats:
    kv = stats_from_pb(r.kvcache) if r.HasField("kvcache") else None
    return scalars(ServerStats, r, kvcache=kv, workers=tuple(scalars(WorkerStats, w) for w in r.workers))


class Collector:
    """A stream's events gathered into one Completion (what complete() returns); with n > 1, one
    per sequence."""

    def __init__(self) -> None:
        self.text: dict[int, list[str]] = {}
        self.ids: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[TokenLogprob]] = {}
        self.prefill: PrefillDone | None = None
        self.finished: dict[int, Finished] = {}

    def add(self, e: Event) -> None:
        if isinstance(e, Chunk):
            self.text.setdefault(e.index, []).append(e.text)
            self.ids.setdefault(e.index, []).extend(e.token_ids)
            self.logprobs.setdefault(e.index, []).extend(e.logprobs)
        elif isinstance(e, PrefillDone):
            self.prefill = e
        elif isinstance(e, Finished):
            self.finished[e.index] = e

    def completion(self) -> Completion:
        if 0 not in self.finished:
            raise KVServeError("INTERNAL", "the stream ended without a finished event")
        each = [Completion("".join(self.text.get(i, ())), tuple(self.ids.get(i, ())), self.finished[i], self.prefill,
                           tuple(self.logprobs.get(i, ()))) for i in sorted(self.finished)]
        if len(each) == 1:
            return each[0]
        return Completion(each[0].text, each[0].token_ids, each[0].finished, self.prefill, each[0].logprobs,
                          tuple(each))


# --------------------------------------------------------------------------- requests

def _chat(messages: Sequence[Message], add_generation_prompt: bool | None = None,
          continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None
          ) -> pb.ChatMessages:
    """The messages and the chat template's options (the server checks what they may hold)."""
    out = pb.ChatMessages(continue_final_message=continue_final_message)
    if add_generation_prompt is not None:   # unset: true, unless continue_final_message
        out.add_generation_prompt = add_generation_prompt
    if chat_template_kwargs:
        try:
            out.template_kwargs = json.dumps(dict(chat_template_kwargs))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"chat_template_kwargs must be JSON values ({exc})") from None
    for i, m in enumerate(messages):
        name = None
        if isinstance(m, Mapping) and "role" in m and "content" in m:
            role, content, name = m["role"], m["content"], m.get("name")
        elif isinstance(m, tuple) and len(m) == 2:
            role, content = m
        elif hasattr(m, "role") and hasattr(m, "content"):
            role, content, name = m.role, m.content, getattr(m, "name", None)
        else:
            raise ValueError(f"messages[{i}] must be a (role, content) pair, a mapping with 'role' and 'content', "
                             f"or a Message; got {m!r}")
        if not (isinstance(role, str) and isinstance(content, str)):
            raise ValueError(f"messages[{i}]: role and content must be strings")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"messages[{i}]: name must be a string")
        with _field(f"messages[{i}]", None):
            out.messages.append(pb.ChatMessage(role=role, content=content, name=name))
    return out


def _one_input(**inputs: Any) -> dict[str, Any]:
    given = {k: v for k, v in inputs.items() if v is not None}
    if len(given) > 1:
        raise ValueError(f"give one input, not {' and '.join(given)}")
    return given  # none given: the server answers INVALID_ARGUMENT


def generate_request(
    prompt: str | None = None,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[Message] | None = None,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    logprobs: int | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    skip_special_tokens: bool | None = None,
    request_id: str = "",
    session_id: str = "",
    cache_salt: str = "",
    n: int | None = None,
    prompt_logprobs: int | None = None,
    logit_bias: Mapping[int, float] | None = None,
    min_tokens: int = 0,
    structured: Mapping[str, Any] | None = None,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> pb.GenerateRequest:
    """The GenerateRequest of InferenceClient.generate's arguments; None leaves a field unset
    (the server's default)."""
    if isinstance(stop, str):
        stop = (stop,)
    if n is not None:
        try:
            count = operator.index(n)   # an int, or numpy's
        except TypeError:
            count = 0
        if count < 1 or isinstance(n, bool):   # 0 would read as unset: one sequence
            raise ValueError(f"n is the number of sequences to sample, at least 1; got {n!r}")
        n = count
    with _field("penalties, stop, stop_token_ids, logit_bias or min_tokens", None):
        sampling = pb.SamplingParams(presence_penalty=presence_penalty,
                                     frequency_penalty=frequency_penalty, stop=list(stop or ()),
                                     stop_token_ids=list(stop_token_ids or ()), ignore_eos=ignore_eos,
                                     logit_bias=dict(logit_bias or {}), min_tokens=min_tokens)
    optional = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, max_tokens=max_tokens,
                    logprobs=logprobs, repetition_penalty=repetition_penalty,
                    skip_special_tokens=skip_special_tokens, n=n, prompt_logprobs=prompt_logprobs)
    for name, value in optional.items():
        if value is not None:
            with _field(name, value):
                setattr(sampling, name, value)
    if structured is not None:
        sampling.structured.CopyFrom(structured_output(structured))
    with _field("request_id, session_id or cache_salt", None):
        request = pb.GenerateRequest(request_id=request_id, session_id=session_id, cache_salt=cache_salt,
                                     sampling=sampling)
    inputs = _one_input(prompt=prompt, token_ids=token_ids, messages=messages)
    chat = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs)
    _chat_options_need_messages(inputs, chat)
    if "prompt" in inputs:
        with _field("prompt", None):
            request.prompt = prompt
    elif "token_ids" in inputs:
        request.token_ids.SetInParent()  # set even when empty, so the server says what is wrong
        request.token_ids.ids.extend(_token_ids(token_ids))
    elif "messages" in inputs:
        request.messages.SetInParent()
        request.messages.MergeFrom(_chat(messages, **chat))
    return request


def _chat_options_need_messages(inputs: dict[str, Any], chat: dict[str, Any]) -> None:
    given = [name for name, value in chat.items() if value not in (None, False)]
    if given and "messages" not in inputs:
        raise ValueError(f"{' and '.join(given)} shape how messages are rendered: give messages")


def structured_output(structured: Mapping[str, Any]) -> pb.StructuredOutput:
    """{"json_schema": a schema (dict or JSON text)}, {"json_object": True}, {"regex": str},
    {"choice": [str, ...]} or {"lark_grammar": str}: the one format the output keeps."""
    if not isinstance(structured, Mapping) or len(structured) != 1:
        raise ValueError("structured is one of {'json_schema': ...}, {'json_object': True}, {'regex': ...}, "
                         "{'choice': [...]}, {'lark_grammar': ...}")
    ((kind, value),) = structured.items()
    out = pb.StructuredOutput()
    with _field(f"structured {kind}", None):
        if kind == "json_schema":
            out.json_schema = value if isinstance(value, str) else json.dumps(value)
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"structured json_object is True (any JSON object), not {value!r}; leave "
                                 "structured out for free text")
            out.json_object = True
        elif kind == "choice":
            if isinstance(value, (str, bytes)):   # would be taken as one choice per character
                raise ValueError(f"structured choice is a list of strings, not one string: [{value!r}]")
            out.choice.choices.extend(value)
        elif kind in ("regex", "lark_grammar"):
            setattr(out, kind, value)
        else:
            raise ValueError(f"unknown format {kind!r}")
    return out


def _token_ids(token_ids: Iterable[Any]) -> list[int]:
    """Any iterable of integers (numpy's too), each in [0, 2^31)."""
    out = []
    for t in token_ids:
        try:
            value = operator.index(t)   # ints and numpy's integers; not floats, not bools' meaning
        except TypeError:
            raise ValueError(f"token ids must be integers in [0, 2^31), got {t!r}") from None
        if isinstance(t, bool) or not 0 <= value < 2**31:
            raise ValueError(f"token ids must be integers in [0, 2^31), got {t!r}")
        out.append(value)
    return out


@contextlib.contextmanager
def _field(name: str, value):
    """A value the request's field cannot hold (out of its integer range, text that is not UTF-8)
    is a ValueError naming the field, not protobuf's bare "Value out of range"."""
    try:
        yield
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not valid UTF-8 text") from None
    except (ValueError, TypeError) as exc:
        shown = "" if value is None else f" {value!r}"
        raise ValueError(f"{name}{shown} does not fit the request ({exc})") from None


def tokenize_request(prompt: str | None = None, messages: Sequence[Message] | None = None,
                     add_special_tokens: bool | None = None, add_generation_prompt: bool | None = None,
                     continue_final_message: bool = False,
                     chat_template_kwargs: Mapping[str, Any] | None = None) -> pb.TokenizeRequest:
    request = pb.TokenizeRequest()
    inputs = _one_input(prompt=prompt, messages=messages)
    chat = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs)
    _chat_options_need_messages(inputs, chat)
    if "prompt" in inputs:
        with _field("prompt", None):
            request.prompt = prompt
    elif "messages" in inputs:
        request.messages.SetInParent()
        request.messages.MergeFrom(_chat(messages, **chat))
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    return request


def detokenize_request(token_ids: Sequence[int], skip_special_tokens: bool = False) -> pb.DetokenizeRequest:
    request = pb.DetokenizeRequest(skip_special_tokens=skip_special_tokens)
    request.token_ids.extend(_token_ids(token_ids))
    return request


def stream_event(stream: Any, msg: pb.GenerateResponse) -> Event | None:
    """`msg` as an Event for a Generate stream (the sync or the asyncio one), which keeps the
    request id the server assigned and the Finished; None for a message it does not know."""
    out = event(msg)
    if isinstance(out, PrefillDone):
        stream.request_id = out.request_id or stream.request_id
    elif isinstance(out, Finished):
        stream.finished = out
    return out
