"""OpenAI request bodies to GenerateRequests, and Inference events back to OpenAI's JSON shapes.
Plain functions on dicts and protobuf messages; HttpError carries the status and the message a
client reads, in OpenAI's error shape."""

from __future__ import annotations

import itertools
import json
import math
import re
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from kvserve.inference.v1 import inference_pb2 as pb

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
# Fields of the OpenAI API (and vLLM's extensions) kvserve does not do: refused by name rather than
# silently ignored, unless the value asks for nothing (what each accepts, given the body).
_NOTHING = (None, False, 0, [], {}, "")
UNSUPPORTED = {
    "best_of": lambda v, body: v in _NOTHING or v == 1 or v == body.get("n"),
    "suffix": lambda v, body: v in _NOTHING,
    "tools": lambda v, body: v in _NOTHING,
    "tool_choice": lambda v, body: v in _NOTHING or v == "none" or (v == "auto" and not body.get("tools")),
    "functions": lambda v, body: v in _NOTHING,
    "function_call": lambda v, body: v in _NOTHING or v == "none" or (v == "auto" and not body.get("functions")),
    "n_best": lambda v, body: v in _NOTHING,
    "include_stop_str_in_output": lambda v, body: v in _NOTHING,
    "use_beam_search": lambda v, body: v in _NOTHING,
    "allowed_token_ids": lambda v, body: v is None,   # [] would allow no token at all
    "bad_words": lambda v, body: v in _NOTHING,
    "truncate_prompt_tokens": lambda v, body: v is None,
    "logits_processors": lambda v, body: v in _NOTHING,
    "chat_template": lambda v, body: v is None,   # the model's own template only: no client's Jinja
    "modalities": lambda v, body: v is None or v == ["text"],
    "audio": lambda v, body: v is None,
    "web_search_options": lambda v, body: v is None,
    "return_tokens_as_token_ids": lambda v, body: v in _NOTHING,
    "prompt_embeds": lambda v, body: v is None,
    "documents": lambda v, body: v in _NOTHING,            # a template's documents (retrieval)
    "priority": lambda v, body: v in _NOTHING,             # vLLM's priority scheduling: first come, first served here
    "reasoning_effort": lambda v, body: v is None,
    "return_token_ids": lambda v, body: v in _NOTHING,
    "length_penalty": lambda v, body: v is None or v == 1,   # beam search's
    "spaces_between_special_tokens": lambda v, body: v is None or v is True,   # the tokenizer's own decoding
    **{name: (lambda v, body: v is None) for name in ("guided_decoding_backend", "guided_whitespace_pattern")},
    # OpenAI's: no completion is stored, no client's prediction used, one service tier, the prefix
    # cache automatic (no breakpoints, no retention asked), no tools to call in parallel
    "store": lambda v, body: v is None or v is False,
    "prediction": lambda v, body: v is None,
    "service_tier": lambda v, body: v in (None, "auto", "default"),
    "moderation": lambda v, body: v is None,
    "verbosity": lambda v, body: v is None,
    "prompt_cache_options": lambda v, body: v is None or v == {},
    "prompt_cache_retention": lambda v, body: v in (None, "in_memory"),
    "parallel_tool_calls": lambda v, body: v is None or isinstance(v, bool),
}
# Every field each endpoint reads, or refuses above by name: any other is refused as OpenAI
# refuses it (a misspelt field, or another server's, did nothing where it was dropped).
_GENERATE = frozenset({
    "model", "stream", "stream_options", "n", "temperature", "top_p", "presence_penalty", "frequency_penalty",
    "max_tokens", "max_completion_tokens", "seed", "stop", "top_k", "min_p", "repetition_penalty", "ignore_eos",
    "skip_special_tokens", "logit_bias", "min_tokens", "response_format", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "structured_outputs", "stop_token_ids", "prompt_logprobs", "cache_salt",
    "request_id", "user", "safety_identifier", "prompt_cache_key", "metadata", "add_special_tokens", "logprobs",
    "top_logprobs", "echo", *UNSUPPORTED})   # (echo, top_logprobs: each endpoint refuses the other's, saying so)
FIELDS = {
    "completion": _GENERATE | {"prompt"},
    "chat": _GENERATE | {"messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs"},
    "tokenize": frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                           "continue_final_message", "chat_template_kwargs", "return_token_strs"}),
    "detokenize": frozenset({"model", "tokens", "skip_special_tokens"}),
}
# What an unknown field is called here, for the other endpoint's and other servers' well-known
# ones (TGI, SGLang, llama.cpp).
HINTS = {
    "messages": "a chat's field: POST it to /v1/chat/completions",
    "prompt": "a completion's field: POST it to /v1/completions",
    **dict.fromkeys(("max_new_tokens", "n_predict"), "this server's is 'max_tokens'"),
    "stop_sequences": "this server's is 'stop'",
    "repeat_penalty": "this server's is 'repetition_penalty'",
    "regex": "this server's is 'guided_regex'",
    "json_schema": "this server's is 'response_format' of type json_schema, or 'guided_json'",
    "ebnf": "this server's is 'guided_grammar', in Lark's notation",
    "grammar": "this server's are 'guided_grammar' (Lark), 'guided_regex' and 'response_format'",
    "top_n_tokens": "this server's is 'logprobs', a chat's 'top_logprobs'",
    "return_full_text": "this server's is a completion's 'echo'",
    "do_sample": "this server samples unless 'temperature' is 0",
}
UINT32, INT32 = 2**32 - 1, 2**31 - 1
MAX_PROMPTS = 256   # a completion's batch of prompts: each is a call of its own
MAX_LOGIT_BIAS = 1024   # the server's (model_service/sampling/params.py), counted before they are read
MAX_STOP_TOKEN_IDS = 1024   # the server's too (the same file; a test holds them equal)
# A list whose server bound (a flag) the front is not told is refused past this, unread: far over
# any sane setting, far under the items an 8 MB body can hold.
FRONT_MAX_ITEMS = 1 << 16
# What a batch's prompts may repeat of the request's sampling fields (stop strings, logit_bias, a
# schema) in their calls, in all: each prompt's call carries its own copy.
MAX_BATCH_SAMPLING_BYTES = 32 << 20
COMPLETION_MAX_TOKENS = 16   # a completion without max_tokens, as OpenAI's and vLLM's (a chat's runs to the model length)


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers   # the response's own: a retry's hint

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """The server's flags that bound a request's lists, as far as the front is told them (None:
    not told, FRONT_MAX_ITEMS stands in): a list past one is refused by its length before any of
    it is read. Translating is on the server's event loop: a body of hundreds of thousands of
    messages held it, every other client's stream frozen, before the server refused its count
    (docs/benchmarks.md)."""
    max_chat_messages: int | None = None
    max_stop_strings: int | None = None   # (a gateway's config has none: its workers check)
    # A model service's --max-waiting: a batch's prompts enter its queue at once, so a batch of
    # more is refused however idle the server is. (A gateway's queue takes a batch any size.)
    max_waiting: int | None = None

    @classmethod
    def of(cls, config) -> Limits:
        """A model service's or a gateway's config's."""
        return cls(getattr(config, "max_chat_messages", None), getattr(config, "max_stop_strings", None),
                   getattr(config, "max_waiting", None))


def _count(items: list, told: int | None, what: str, flag: str, param: str) -> None:
    """A 400 for more `items` than the server's `told` bound, or than the front's own where it
    is not told; looks at the length only."""
    if told is not None and len(items) > told:
        raise HttpError(400, f"{len(items):,} {what}; at most {told:,} are allowed ({flag})", param=param)
    if told is None and len(items) > FRONT_MAX_ITEMS:
        raise HttpError(400, f"{len(items):,} {what}; this HTTP front takes at most {FRONT_MAX_ITEMS:,}",
                        param=param)


def _flag(body: dict, name: str) -> bool | None:
    """A JSON boolean or nothing: 1 and 1.0 are not flags (1.0 == True in Python: it passed a
    `not in (True, False)` test, and the protobuf field refused it with a 500)."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise HttpError(400, f"'{name}' must be true or false", param=name)
    return value


def _number(body: dict, name: str, kind: type, low: float | None = None, high: float | None = None):
    value = body.get(name)
    if value is None:
        return None
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)   # 100.0 is 100, as vLLM's models read it (clients compute max_tokens as floats)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise HttpError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}", param=name)
    try:
        finite = math.isfinite(value)   # Python's json reads NaN and Infinity
    except OverflowError:   # an integer of hundreds of digits: no float holds it
        finite = False
    if not finite:
        raise HttpError(400, f"'{name}' must be a finite number", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        bound = (f"in [{low}, {high}]" if low is not None and high is not None
                 else f"at least {low}" if low is not None else f"at most {high}")
        raise HttpError(400, f"'{name}' must be {bound}, got {value}", param=name)
    return value


def stream_usage(options, stream: bool) -> tuple[bool, bool]:
    """Whether a stream ends with a usage chunk, and whether every chunk carries the usage so
    far (vLLM's continuous_usage_stats), from its stream_options. OpenAI's include_obfuscation
    only pads chunks against length side channels: taken, with no padding."""
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise HttpError(400, "'stream_options' must be an object", param="stream_options")
    if options and not stream:   # as OpenAI and vLLM answer it
        raise HttpError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    for name, value in options.items():
        if name not in ("include_usage", "continuous_usage_stats", "include_obfuscation"):
            raise HttpError(400, f"'stream_options.{shown(name)}' is not an option of a stream",
                            param="stream_options")
        if value is not None and not isinstance(value, bool):
            raise HttpError(400, f"'stream_options.{name}' must be true or false", param="stream_options")
    return options.get("include_usage") is True, options.get("continuous_usage_stats") is True


def check_fields(endpoint: str, body: dict) -> None:
    """A 400 naming the fields of the body that `endpoint` ("completion", "chat", "tokenize",
    "detokenize") does not know, in OpenAI's words, with what this server calls a well-known one
    of another server's. Counted over the known names, in C: a body of a million keys is no loop."""
    known = FIELDS[endpoint]
    unknown = len(body) - len(body.keys() & known)
    if not unknown:
        return
    first = list(itertools.islice((k for k in body if k not in known), 5))   # in the body's order
    said = ", ".join(shown(k[:100]) + (f" ({HINTS[k]})" if k in HINTS else "") for k in first)
    if unknown > len(first):
        said += f", and {unknown - len(first):,} more"
    raise HttpError(400, f"Unrecognized request argument{'s' if unknown > 1 else ''} supplied: {said}",
                    param=shown(first[0][:100]))


def client_param(kind: str, body: dict, message: str) -> str | None:
    """The client's field a server's refusal names, where the message opens with a field this
    front set ("logprobs must be ...", from a chat's top_logprobs), for OpenAI's `param`."""
    said = re.match(r"([a-z_]+)(?:\[\d+\])? (?:must|has) ", message)
    if said is None:
        return None
    name = said.group(1)
    field = {"logprobs": "top_logprobs" if kind == "chat" else "logprobs",
             "max_tokens": "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens",
             "prompt_logprobs": "prompt_logprobs" if body.get("prompt_logprobs") is not None else "logprobs",
             }.get(name, name)
    return field if body.get(field) is not None else None


def sampling(body: dict, limits: Limits = Limits()) -> pb.SamplingParams:
    for name, asks_nothing in UNSUPPORTED.items():
        if name in body and not asks_nothing(body[name], body):
            raise HttpError(400, f"'{name}' is not supported by this server", param=name)
    out = pb.SamplingParams()
    n = _number(body, "n", int, 1, UINT32)   # the server refuses n past its --max-n
    if n is not None:
        out.n = n
    temperature = _number(body, "temperature", float, 0, 2)
    if temperature is not None:
        out.temperature = temperature
    top_p = _number(body, "top_p", float)
    if top_p is not None:
        if not 0 < top_p <= 1:
            raise HttpError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
        out.top_p = top_p
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name, float, -2, 2)
        if value is not None:
            setattr(out, name, value)
    # both checked: the newer name wins, but a bad value of the older one is still a 400
    legacy = _number(body, "max_tokens", int, 1, UINT32)
    max_tokens = _number(body, "max_completion_tokens", int, 1, UINT32)
    max_tokens = legacy if max_tokens is None else max_tokens
    if max_tokens is not None:
        out.max_tokens = max_tokens
    seed = _number(body, "seed", int, -2**63, 2**63 - 1)   # OpenAI's int64
    if seed is not None:
        out.seed = seed % 2**64   # the server's seed is unsigned: a negative one as its two's complement
    stop = body.get("stop")
    if isinstance(stop, list):
        _count(stop, limits.max_stop_strings, "stop strings", "--max-stop-strings", "stop")
    if isinstance(stop, str):
        out.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        out.stop.extend(stop)
    elif stop is not None:
        raise HttpError(400, "'stop' must be a string or a list of strings", param="stop")
    top_k = _number(body, "top_k", int, -1, INT32)   # vLLM's extensions, accepted as it accepts them
    if top_k is not None:
        out.top_k = max(top_k, 0)   # -1 is vLLM's "off", as 0 is here
    min_p = _number(body, "min_p", float, 0, 1)
    if min_p is not None:
        out.min_p = min_p
    repetition = _number(body, "repetition_penalty", float, 0)
    if repetition is not None:
        out.repetition_penalty = repetition
    for name in ("ignore_eos", "stream", "skip_special_tokens"):
        _flag(body, name)
    if body.get("ignore_eos") is True:
        out.ignore_eos = True
    if body.get("skip_special_tokens") is not None:
        out.skip_special_tokens = body["skip_special_tokens"]
    bias = body.get("logit_bias")   # OpenAI's: token ids as strings; the server checks ids and range
    if bias is not None:
        if not isinstance(bias, dict):
            raise HttpError(400, "'logit_bias' must be an object of token ids to numbers", param="logit_bias")
        if len(bias) > MAX_LOGIT_BIAS:
            raise HttpError(400, f"'logit_bias' has {len(bias):,} entries; at most {MAX_LOGIT_BIAS} are allowed",
                            param="logit_bias")
        for key in bias:
            if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10
                    and int(key) <= INT32):
                raise HttpError(400, f"'logit_bias' key {shown(key)!r} is not a token id", param="logit_bias")
            value = bias[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise HttpError(400, f"'logit_bias' values must be numbers in [-100, 100]; token {key} has "
                                     f"{shown(value) if isinstance(value, str) else value}", param="logit_bias")
            out.logit_bias[int(key)] = value
    min_tokens = _number(body, "min_tokens", int, 0, UINT32)   # vLLM's; the server bounds it by max_tokens
    if min_tokens:
        out.min_tokens = min_tokens
    structured = structured_output(body)
    if structured is not None:
        out.structured.CopyFrom(structured)
    stop_ids = body.get("stop_token_ids")   # the server checks them against its vocabulary
    if stop_ids is not None:
        if isinstance(stop_ids, list) and len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise HttpError(400, f"{len(stop_ids):,} stop_token_ids; at most {MAX_STOP_TOKEN_IDS} are allowed",
                            param="stop_token_ids")
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                     and 0 <= t <= INT32 for t in stop_ids):
            raise HttpError(400, "'stop_token_ids' must be a list of token ids (0 to 2^31-1)", param="stop_token_ids")
        out.stop_token_ids.extend(stop_ids)
    return out


def structured_output(body: dict) -> pb.StructuredOutput | None:
    """The one format a body asks its output to keep: OpenAI's response_format (json_object,
    json_schema), vLLM's guided_json / guided_regex / guided_choice / guided_grammar, or its
    structured_outputs object; None for free text."""
    asked: list[tuple[str, str, object]] = []   # (the field, the format, its value)
    response_format = body.get("response_format")
    if response_format not in (None, {}):
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "json_object":
            asked.append(("response_format", "json_object", True))
        elif kind == "json_schema":
            schema = response_format.get("json_schema")
            if not isinstance(schema, dict) or not isinstance(schema.get("schema"), (dict, bool)):
                raise HttpError(400, "'response_format' json_schema needs {\"json_schema\": {\"schema\": {...}}}",
                                param="response_format")
            asked.append(("response_format", "json_schema", schema["schema"]))
        elif kind != "text":
            raise HttpError(400, "'response_format' type is text, json_object or json_schema", param="response_format")
    for field, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "lark_grammar")):
        if body.get(field) is not None:
            asked.append((field, kind, body[field]))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise HttpError(400, "'structured_outputs' must be an object", param="structured_outputs")
        kinds = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark_grammar",
                 "json_object": "json_object"}
        for key, value in outputs.items():
            if key in kinds:
                if value not in (None, False):
                    asked.append((f"structured_outputs.{key}", kinds[key], value))
            elif key == "disable_any_whitespace":   # kvserve's JSON has no free whitespace either way
                if not isinstance(value, bool):
                    raise HttpError(400, "'structured_outputs.disable_any_whitespace' must be true or false",
                                    param="structured_outputs")
            elif value not in _NOTHING:   # structural_tag, whitespace_pattern, a backend's options, ...
                raise HttpError(400, f"'structured_outputs.{shown(key)}' is not supported by this server",
                                param="structured_outputs")
    if not asked:
        return None
    if len(asked) > 1:
        raise HttpError(400, f"give one structured output, not {' and '.join(f for f, _, _ in asked)}",
                        param=asked[1][0].split(".")[0])   # the request's own field, as below
    field, kind, value = asked[0]
    param = field.split(".")[0]   # the request's own field; the message names the one inside it
    out = pb.StructuredOutput()
    if kind == "json_object":
        out.json_object = True
    elif kind == "json_schema":
        if isinstance(value, str):   # vLLM takes a schema as text too
            out.json_schema = value
        elif isinstance(value, (dict, bool)):
            out.json_schema = json.dumps(value)
        else:
            raise HttpError(400, f"'{field}' must be a JSON schema", param=param)
    elif kind == "choice":
        # (in C: a list of 8 MB holds two million choices, checked on the server's event loop)
        if not isinstance(value, list) or not value or set(map(type, value)) != {str} or "" in value:
            raise HttpError(400, f"'{field}' must be a list of non-empty strings", param=param)
        out.choice.choices.extend(value)
    else:
        if not isinstance(value, str):
            raise HttpError(400, f"'{field}' must be a string", param=param)
        setattr(out, kind, value)
    return out


def prompts_of(body: dict) -> list | None:
    """A completion's batch of prompts (OpenAI's list of strings, or of token-id lists, as
    LangChain and lm-evaluation-harness send them), or None for one prompt."""
    prompt = body.get("prompt")
    if not (isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))):
        return None   # (a list of token ids)
    if len(prompt) > MAX_PROMPTS:   # counted before any is looked at
        raise HttpError(400, f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt):,}", param="prompt")
    return prompt if all(isinstance(p, (str, list)) for p in prompt) else None   # (None: refused as one prompt)


def batch_requests(body: dict, prompts: list, limits: Limits = Limits()) -> list[pb.GenerateRequest]:
    """One Generate message a prompt of a completion's batch; refused (400) before the second is
    built when their copies of the sampling fields would pass MAX_BATCH_SAMPLING_BYTES."""
    if limits.max_waiting is not None and len(prompts) > limits.max_waiting:   # never taken: not a 429
        raise HttpError(400, f"{len(prompts):,} prompts in one request; this server queues at most "
                             f"{limits.max_waiting:,} requests at once (--max-waiting): send at most that many",
                        param="prompt")
    first = request_of("completion", body, prompts[0], limits)
    shared = first.sampling.ByteSize()
    if len(prompts) * shared > MAX_BATCH_SAMPLING_BYTES:
        raise HttpError(400, f"each of the {len(prompts)} prompts' calls carries the request's sampling fields "
                             f"(stop strings, logit_bias, a schema: {shared:,} bytes); at most "
                             f"{MAX_BATCH_SAMPLING_BYTES:,} bytes of them in all: send fewer prompts at once",
                        param="prompt")
    return [first] + [request_of("completion", body, prompt, limits) for prompt in prompts[1:]]


def prompt_top_of(body: dict) -> int | None:
    """vLLM's prompt_logprobs: how many of each prompt token's top logprobs to show (1.0 is 1);
    the server bounds it (--max-logprobs)."""
    return _number(body, "prompt_logprobs", int, 0, UINT32)


def request_of(kind: str, body: dict, prompt=None, limits: Limits = Limits()) -> pb.GenerateRequest:
    """The Generate message of a completion or chat body (`prompt`: one of a completion's batch).
    A string holding a lone surrogate (JSON allows the escape "\\ud800"; no UTF-8 text holds one)
    is a 400, not protobuf's error."""
    try:
        msg = completion_request(body, prompt, limits) if kind == "completion" else chat_request(body, limits)
        prompt_top = prompt_top_of(body)
        if prompt_top is not None:   # an echo's logprobs may already ask for more of each top
            msg.sampling.prompt_logprobs = max(prompt_top, msg.sampling.prompt_logprobs)
        for name in ("user", "prompt_cache_key", "safety_identifier"):
            if body.get(name) is not None and not isinstance(body[name], str):
                raise HttpError(400, f"'{name}' must be a string", param=name)
        if body.get("metadata") is not None and not isinstance(body["metadata"], dict):   # a label: nothing stored
            raise HttpError(400, "'metadata' must be an object", param="metadata")
        session = body.get("prompt_cache_key") or body.get("user")   # OpenAI's newer name for the cache's key
        if session:
            msg.session_id = session[:256]   # a conversation's user keeps it on one worker
        salt = body.get("cache_salt")   # vLLM's: the request's prefix cache apart; the server checks its size
        if salt is not None:
            if not isinstance(salt, str) or not salt:
                raise HttpError(400, "'cache_salt' must be a non-empty string", param="cache_salt")
            msg.cache_salt = salt
        request_id = body.get("request_id")   # vLLM's: the request's id at the server, and in the reply's
        if request_id is not None:
            if not isinstance(request_id, str) or not request_id:
                raise HttpError(400, "'request_id' must be a non-empty string", param="request_id")
            msg.request_id = request_id   # the server checks it (and that no request of it is in flight)
    except UnicodeEncodeError:
        raise HttpError(400, "a string in the body holds a lone UTF-16 surrogate (such as \\ud800), which is "
                             "not text") from None
    except RecursionError:   # a value nested nearly as deep as the body's parse allows, re-encoded deeper
        raise HttpError(400, "a value in the body (a schema, chat_template_kwargs) nests too deeply to pass "
                             "on") from None
    return msg


def shown(value) -> str:
    """A client's value inside a message: a string as it is (a lone surrogate escaped, so the
    JSON error can be encoded), anything else by its JSON type."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return f"a JSON {type(value).__name__}"


def _special_tokens(body: dict, as_served: bool) -> None:
    """vLLM's add_special_tokens: a completion's prompt is tokenized with them, a chat's template
    writes its own; the other way is not done here."""
    if _flag(body, "add_special_tokens") not in (None, as_served):
        raise HttpError(400, "'add_special_tokens' is not supported by this server", param="add_special_tokens")


def echo_only(body: dict) -> bool:
    """A completion that scores its prompt and generates nothing (echo with max_tokens 0, as older
    lm-evaluation-harness and HELM send it): run for one token, answered with the prompt alone."""
    return (body.get("echo") is True and body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool)
            and body.get("max_completion_tokens") in (None, 0))


def completion_request(body: dict, prompt=None, limits: Limits = Limits()) -> pb.GenerateRequest:
    prompt = body.get("prompt") if prompt is None else prompt
    _special_tokens(body, True)
    if echo_only(body):
        body = {**body, "max_tokens": 1, "max_completion_tokens": None}
    msg = pb.GenerateRequest(sampling=sampling(body, limits))
    if not msg.sampling.HasField("max_tokens"):
        msg.sampling.max_tokens = COMPLETION_MAX_TOKENS
    if "top_logprobs" in body and body["top_logprobs"] is not None:
        raise HttpError(400, "'top_logprobs' is a chat field: a completion asks for its top-n with 'logprobs'",
                        param="top_logprobs")
    logprobs = _number(body, "logprobs", int, 0, UINT32)   # the top-n; the server bounds it (--max-logprobs)
    if logprobs is not None:
        msg.sampling.logprobs = logprobs
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]   # one prompt in a list, as the openai client sends
    if isinstance(prompt, str):
        msg.prompt = prompt
    elif not (isinstance(prompt, list) and prompt and _token_ids(prompt, msg.token_ids.ids)):
        raise _bad_prompt(prompt)
    echo = _flag(body, "echo")
    if echo and (logprobs is not None or not msg.HasField("prompt")):
        # the prompt's own logprobs; for token ids, also the prompt's text (the server decodes it)
        msg.sampling.prompt_logprobs = logprobs or 0
    return msg


def _token_ids(prompt: list, out) -> bool:
    """Whether `prompt` is token ids, into `out`: in C, as a body of 8 MB holds two million
    of them (protobuf's int32 refuses a bool, a float, a string and what is past 2^31-1)."""
    try:
        out.extend(prompt)
    except (TypeError, ValueError):
        return False
    return min(prompt) >= 0


def _bad_prompt(prompt) -> HttpError:
    """Why a completion's prompt is refused: for a list of integers, one that is no token id
    (found in C, as _token_ids looked)."""
    if isinstance(prompt, list) and prompt and set(map(type, prompt)) == {int}:
        low = min(prompt)
        return HttpError(400, f"'prompt' token id {low if low < 0 else max(prompt)} is not in [0, 2^31-1]",
                         param="prompt")
    return HttpError(400, "'prompt' must be a string, a list of token ids (0 to 2^31-1), or a list of either",
                     param="prompt")


def chat_request(body: dict, limits: Limits = Limits()) -> pb.GenerateRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "'messages' must be a non-empty list", param="messages")
    _count(messages, limits.max_chat_messages, "chat messages", "--max-chat-messages", "messages")
    if body.get("echo") not in (None, False):
        raise HttpError(400, "'echo' is a completion field: a chat does not echo its messages", param="echo")
    _special_tokens(body, False)
    msg = pb.GenerateRequest(sampling=sampling(body, limits))
    wanted = _flag(body, "logprobs")
    top = _number(body, "top_logprobs", int, 0, UINT32)   # the server bounds it (--max-logprobs)
    if wanted is True:
        msg.sampling.logprobs = top or 0
    elif top is not None:
        raise HttpError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    add = msg.messages.messages.add
    for i, m in enumerate(messages):
        role, content, name = _message(i, m)
        add(role=role, content=content, name=name)
    for name in ("add_generation_prompt", "continue_final_message"):   # vLLM's template options
        _flag(body, name)
    if body.get("add_generation_prompt") is not None:
        msg.messages.add_generation_prompt = body["add_generation_prompt"]
    if body.get("continue_final_message") is True:   # (alone: no generation prompt, where vLLM refuses it)
        msg.messages.continue_final_message = True
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise HttpError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        if kwargs:
            msg.messages.template_kwargs = json.dumps(kwargs)
    return msg


def _message(i: int, m) -> tuple[str, str, str | None]:
    """messages[i]'s role, text and name."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise HttpError(400, f"messages[{i}] must be an object with a 'role'", param="messages")
    if m.get("tool_calls") or m.get("function_call") or m.get("tool_call_id"):   # the template never sees them
        raise HttpError(400, f"messages[{i}]: tool calls are not supported by this server", param="messages")
    content = m.get("content")
    if isinstance(content, list):   # content parts: only text
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise HttpError(400, f"messages[{i}]: only text content parts are supported", param="messages")
            texts.append(part["text"])
        content = "\n".join(texts)   # as vLLM joins them: the same prompt, the same answer
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise HttpError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
    name = m.get("name")
    if name is not None and not isinstance(name, str):
        raise HttpError(400, f"messages[{i}].name must be a string", param="messages")
    return m["role"], content, name


def tokenize_request(body: dict, limits: Limits = Limits()) -> tuple[pb.TokenizeRequest, bool]:
    """vLLM's /tokenize body (a prompt, or chat messages with their template options) as a
    TokenizeRequest, and whether it asks for each token's string (return_token_strs)."""
    strings = _flag(body, "return_token_strs") is True
    out = pb.TokenizeRequest()
    try:
        if body.get("messages") is not None and body.get("prompt") is None:
            _special_tokens(body, False)
            chat = chat_request({k: body[k] for k in ("messages", "add_generation_prompt", "continue_final_message",
                                                      "chat_template_kwargs") if k in body}, limits)
            out.messages.CopyFrom(chat.messages)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise HttpError(400, "'prompt' must be a string, or give 'messages'", param="prompt")
            out.prompt = prompt
            special = _flag(body, "add_special_tokens")
            if special is not None:
                out.add_special_tokens = special
    except UnicodeEncodeError:
        raise HttpError(400, "a string in the body holds a lone UTF-16 surrogate (such as \\ud800), which is "
                             "not text") from None
    return out, strings


# The servers' bound on a Detokenize call's ids (model_service/sampling/detokenizer.py; a test holds
# the two equal): a longer list is refused before its ids are looked at one by one.
MAX_DETOKENIZE_IDS = 1 << 17


def detokenize_request(body: dict) -> pb.DetokenizeRequest:
    """vLLM's /detokenize body: `tokens`, a list of token ids (and, kvserve's, skip_special_tokens)."""
    tokens = body.get("tokens")
    if isinstance(tokens, list) and len(tokens) > MAX_DETOKENIZE_IDS:
        raise HttpError(400, f"{len(tokens):,} token ids; at most {MAX_DETOKENIZE_IDS:,} are written out in one call",
                        param="tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < 2**31 for t in tokens):
        raise HttpError(400, "'tokens' must be a list of token ids (integers from 0)", param="tokens")
    return pb.DetokenizeRequest(token_ids=tokens, skip_special_tokens=_flag(body, "skip_special_tokens") is True)


def usage(u: pb.Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


class Reply:
    """One response being built: the id, the model, each choice's text and how it finished."""

    def __init__(self, kind: str, model: str, n: int = 1, logprobs: bool = False, echo: bool = False,
                 prompt: str | None = None, echo_top: int = 0, prompt_top: int | None = None,
                 request_id: str = "", eos_token_ids=(), echo_only: bool = False) -> None:
        self.kind = kind   # "completion" | "chat"
        self.model = model
        self.n = n
        self.logprobs = logprobs   # asked for: each choice carries its tokens' logprobs
        self.echo = echo           # a completion's choices begin with the prompt (and its logprobs)
        self.echo_only = echo_only   # ... and are the prompt alone: the token run for it is not shown
        self.prompt = prompt       # its text: the client's string, or what prefill_done says
        self.prompt_logprobs: list[tuple[str, float | None, dict | None]] = []   # the echo's (token, logprob, top)
        self.echo_top = echo_top       # how many of each prompt token's top the echo shows
        self.prompt_top = prompt_top   # vLLM's prompt_logprobs, when asked: how many of each top
        self.vllm_prompt_logprobs: list[dict | None] | None = None
        self.tokens: dict[int, list] = defaultdict(list)   # each choice's TokenLogprobs, for whole()
        self.offset: dict[int, int] = defaultdict(int)     # characters of each choice's tokens so far
        self.id = ("cmpl-" if kind == "completion" else "chatcmpl-") + (request_id or uuid.uuid4().hex)
        self.created = int(time.time())
        self.text: dict[int, list[str]] = defaultdict(list)   # by the sequences that sent text
        self.finish_reason: dict[int, str] = {}
        self.stop_reason: dict[int, str | int | None] = {}   # vLLM's: the stop string or token (not EOS) that ended it
        self.eos_token_ids = frozenset(eos_token_ids)
        self.usage: dict | None = None
        self.prompt_tokens: int | None = None   # from prefill_done, when it is asked for
        self.generated: dict[int, int] = defaultdict(int)   # each choice's tokens so far

    @property
    def done(self) -> bool:
        return len(self.finish_reason) == self.n

    def _object(self, chunk: bool) -> str:
        if self.kind == "completion":
            return "text_completion"
        return "chat.completion.chunk" if chunk else "chat.completion"

    def head(self, choices: list, chunk: bool) -> dict:
        return {"id": self.id, "object": self._object(chunk), "created": self.created, "model": self.model,
                "choices": choices}

    def choice_chunk(self, text: str | None = None, finish: str | None = None, role: bool = False,
                     index: int = 0, logprobs=()) -> dict:
        shown = self.logprobs_of(index, logprobs) if logprobs else None
        if self.kind == "completion":
            choice = {"index": index, "text": text or "", "logprobs": shown, "finish_reason": finish}
        else:
            delta: dict[str, Any] = {}
            if role:   # with empty content, as OpenAI's first chunk: clients that join contents find a string
                delta["role"], delta["content"] = "assistant", ""
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": shown, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = self.stop_reason.get(index)
        return self.head([choice], True)

    def usage_so_far(self, index: int) -> dict:
        """vLLM's continuous usage: the prompt's tokens and choice `index`'s so far."""
        prompt, done = self.prompt_tokens or 0, self.generated[index]
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def prefill_done(self, done: pb.PrefillDone) -> None:
        """Takes the prompt's size, and its text and logprobs for the echo, from the server's prefill_done."""
        if self.prompt_tokens is None:   # (a moved request's second prefill_done counts the same prompt)
            self.prompt_tokens = done.prompt_tokens
        if not done.HasField("prompt_logprobs"):
            return
        shown = done.prompt_logprobs
        if self.prompt is None:   # token ids: the server decoded them
            self.prompt = shown.text
        if self.logprobs:   # the first token has nothing before it: no logprob (null, as OpenAI's)
            self.prompt_logprobs = [(shown.first_token, None, None)] + [
                (lp.token, _json_logprob(lp.logprob),
                 {t.token: _json_logprob(t.logprob) for t in lp.top[:self.echo_top]}
                 or {lp.token: _json_logprob(lp.logprob)})
                for lp in shown.tokens]
        if self.prompt_top is not None:
            self.vllm_prompt_logprobs = [None] + [_ranked(lp, self.prompt_top) for lp in shown.tokens]

    def prompt_logprobs_chunk(self, index: int) -> dict:
        """A streamed reply's chunk with vLLM's prompt_logprobs: a completion's on each choice, a
        chat's once, beside no choices."""
        if self.kind == "chat":
            out = self.head([], True)
            out["prompt_logprobs"] = self.vllm_prompt_logprobs
            return out
        return self.head([{"index": index, "text": "", "logprobs": None, "finish_reason": None,
                           "prompt_logprobs": self.vllm_prompt_logprobs}], True)

    def echo_chunk(self, index: int) -> dict:
        """A streamed completion's first chunk of choice `index` when it echoes: the prompt."""
        shown = self._echoed_logprobs(index) if self.logprobs else None
        return self.head([{"index": index, "text": self.prompt or "", "logprobs": shown, "finish_reason": None}],
                         True)

    def _echoed_logprobs(self, index: int) -> dict:
        offsets = []
        for token, _, _ in self.prompt_logprobs:
            offsets.append(self.offset[index])
            self.offset[index] += len(token)
        return {"tokens": [t for t, _, _ in self.prompt_logprobs],
                "token_logprobs": [lp for _, lp, _ in self.prompt_logprobs],
                "top_logprobs": [top for _, _, top in self.prompt_logprobs], "text_offset": offsets}

    def logprobs_of(self, index: int, logprobs) -> dict:
        """OpenAI's logprobs object for these TokenLogprobs of choice `index`: a completion's
        parallel lists (text offsets counted from the choice's first token), a chat's content list."""
        if self.kind == "chat":
            return {"content": [{**_named(lp), "top_logprobs": [_named(t) for t in lp.top]} for lp in logprobs]}
        offsets = []
        for lp in logprobs:
            offsets.append(self.offset[index])
            self.offset[index] += len(lp.token)
        return {"tokens": [lp.token for lp in logprobs],
                "token_logprobs": [_json_logprob(lp.logprob) for lp in logprobs],
                "top_logprobs": [{t.token: _json_logprob(t.logprob) for t in lp.top}
                                 or {lp.token: _json_logprob(lp.logprob)} for lp in logprobs],
                "text_offset": offsets}

    def usage_chunk(self) -> dict:
        out = self.head([], True)
        out["usage"] = self.usage
        return out

    def whole(self) -> dict:
        choices = []
        for i in range(self.n):
            text = "" if self.echo_only else "".join(self.text[i])
            echoed = self._echoed_logprobs(i) if self.echo and self.logprobs else None   # offsets go on after it
            shown = self.logprobs_of(i, [] if self.echo_only else self.tokens[i]) if self.logprobs else None
            if self.echo:
                text = (self.prompt or "") + text
                if echoed is not None:
                    shown = {key: echoed[key] + shown[key] for key in shown}
            if self.kind == "completion":
                choices.append({"index": i, "text": text, "logprobs": shown, "finish_reason": self.finish_reason.get(i),
                                "stop_reason": self.stop_reason.get(i)})
                if self.prompt_top is not None:
                    choices[-1]["prompt_logprobs"] = self.vllm_prompt_logprobs
            else:
                choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": shown,
                                "finish_reason": self.finish_reason.get(i), "stop_reason": self.stop_reason.get(i)})
        out = self.head(choices, False)
        if self.kind == "chat" and self.prompt_top is not None:
            out["prompt_logprobs"] = self.vllm_prompt_logprobs
        out["usage"] = self.usage
        return out

    def finished(self, f: pb.Finished, index: int = 0) -> str:
        """Records sequence `index`'s end; usage counts the prompt once and every choice's tokens."""
        self.finish_reason[index] = reason = FINISH.get(f.finish_reason, "stop")
        if f.stop:
            self.stop_reason[index] = f.stop
        elif f.HasField("stop_token_id") and f.stop_token_id not in self.eos_token_ids:
            self.stop_reason[index] = f.stop_token_id
        completion = 0 if self.echo_only else f.usage.completion_tokens
        if self.usage is None:
            self.usage = usage(f.usage)
            self.usage["completion_tokens"] = completion
            self.usage["total_tokens"] = f.usage.prompt_tokens + completion
        else:
            self.usage["completion_tokens"] += completion
            self.usage["total_tokens"] += completion
        return reason


def _json_logprob(x: float) -> float:
    """A logprob JSON can carry: a token a structured output masks has -inf, which JSON has no
    number for; -9999.0 as vLLM writes it."""
    return x if x > -9999.0 else -9999.0


def _ranked(lp, top: int) -> dict:
    """vLLM's entry for one prompt token: by token id (a JSON key, so a string), the token itself
    and then the `top` most likely, each with its logprob, its rank when known (1 = the most
    likely) and its text."""
    ranks = {t.token_id: rank for rank, t in enumerate(lp.top, 1)}
    out = {str(lp.token_id): {"logprob": _json_logprob(lp.logprob), "rank": ranks.get(lp.token_id),
                              "decoded_token": lp.token}}
    for rank, t in enumerate(lp.top[:top], 1):
        out.setdefault(str(t.token_id), {"logprob": _json_logprob(t.logprob), "rank": rank, "decoded_token": t.token})
    return out


def _named(lp) -> dict:
    """A chat logprob entry: the token, its logprob and its bytes: those the worker says it stands
    for (part of a character too, where its text shows U+FFFD: a client joins the bytes back into
    the text), else its text's (a worker of an older version)."""
    raw = lp.token_bytes or lp.token.encode("utf-8")
    return {"token": lp.token, "logprob": _json_logprob(lp.logprob), "bytes": list(raw)}
