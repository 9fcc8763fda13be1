"""GenerateRequest (protobuf) → engine Request, with every check a person needs to read.

Refused here, before anything is queued, in order of cost:
  1. limits on size (the flags --max-prompt-chars, --max-chat-messages, --max-stop-strings,
     --max-logprobs; request ids up to 256 characters), and a prompt so long that it cannot
     fit the model whatever it tokenizes to (prompt_bound.py): no tokenizing;
  2. bad sampling parameters;
  3. after tokenizing (off the event loop, tokenizing.py): an empty input, a token id outside
     the vocabulary, prompt + max_tokens over the model length (which the page pool caps).
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable, Sequence

from kvserve.kvcache_service.contract.hashing import check_cache_salt, request_extra_key
from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.model_service.engine.errors import InvalidRequest, NothingToGenerate
from kvserve.model_service import prompt_tokens
from kvserve.model_service.engine.output import OutputProcessor
from kvserve.model_service.engine.request import Request
from kvserve.model_service.generation_defaults import GenerationDefaults
from kvserve.model_service.prompt_bound import fewest_tokens, max_bytes_per_token
from kvserve.model_service.request_ids import id_problem
from kvserve.model_service.sampling.params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SamplingParams
from kvserve.model_service.sampling.detokenizer import check_detokenize_count, detokenize
from kvserve.model_service.sampling.sampler import make_generator
from kvserve.model_service.sampling.structured import Format
from kvserve.model_service.tokenizing import TokenizerLanes

RequestError = InvalidRequest   # the name this module's callers know


def scoped_request_id(tenant: str, request_id: str) -> str:
    """The id the engine and the manager know a request by: each tenant's ids are its own, so one
    tenant can neither cancel another's request nor learn, from ALREADY_EXISTS, which ids it uses."""
    return f"{tenant}\x00{request_id}" if tenant else request_id


def _prompt_bytes(msg: pb.GenerateRequest | pb.TokenizeRequest) -> int:
    """At most the prompt's UTF-8 length, from encoded sizes, without decoding it (a few times
    cheaper): the message less every other field, each with up to 6 bytes of tag and length
    (a scalar: up to 11), whatever fields the message gains."""
    other = 6   # the prompt's own tag and length
    for f in msg.DESCRIPTOR.fields:
        if f.name == "prompt":
            continue
        if f.type == f.TYPE_MESSAGE and not f.is_repeated:
            other += getattr(msg, f.name).ByteSize() + 6 if msg.HasField(f.name) else 0
        elif f.type == f.TYPE_STRING and not f.is_repeated:
            text = getattr(msg, f.name)
            other += len(text.encode()) + 6 if text else 0   # an empty one is not on the wire
        else:
            other += 11 if not f.is_repeated else msg.ByteSize()   # none today; never over-count
    return max(0, msg.ByteSize() - other)


STREAM_LIMIT = 1 << 24   # tokens a stream with --attention-sink may reach (page tables keep an entry a page)
MAX_STOP_CHARS = 1024   # a stop string is matched against the text after every token
# A prompt's logprobs go in one message (prefill_done), built on the event loop: at ~17 bytes a
# logprob this many stay near 1 MB, under a gRPC client's default 4 MB.
MAX_PROMPT_LOGPROBS = 1 << 16


class RequestBuilder:
    def __init__(self, stack, lanes: TokenizerLanes | None = None) -> None:
        self.stack = stack
        self.config = stack.config
        self.tokenizer = stack.tokenizer
        self.vocab_size = stack.model_config.vocab_size
        self.lanes = lanes or TokenizerLanes(stack.config.tokenizer_threads)
        self.bytes_per_token = max_bytes_per_token(stack.tokenizer)
        self.chat_keeps_text = stack.chat_keeps_text   # a chat's size bounds its tokens (prompt_tokens.py)
        self.tokenizer_ids = len(stack.tokenizer)   # more than the model's vocabulary: a fine-tune's added tokens
        self.defaults = getattr(stack, "generation_defaults", GenerationDefaults())

    async def build(self, msg, request_id: str, tenant: str = "") -> Request:
        self.check_limits(msg, request_id)
        params = self._params(msg.sampling)
        prompt = await self._input_ids(msg)
        limit = self.stack.max_model_len
        if len(prompt) >= limit:
            raise RequestError(f"the prompt has {len(prompt)} tokens; the model length is {limit}, "
                               "which leaves no room for output")
        asked = params.prompt_logprobs
        if asked is not None and (len(prompt) - 1) * (1 + asked) > MAX_PROMPT_LOGPROBS:
            raise RequestError(f"prompt_logprobs {asked} for a {len(prompt):,}-token prompt is "
                               f"{(len(prompt) - 1) * (1 + asked):,} logprobs; at most {MAX_PROMPT_LOGPROBS:,} go "
                               "in one prefill_done (ask for fewer, or for a shorter prompt)")
        limit, what = self._stream_limit()
        # unset: up to the model length, sinks or not (a stream past it is asked for by its length)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.stack.max_model_len - len(prompt)
        if len(prompt) + max_tokens > limit:
            raise RequestError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = "
                               f"{len(prompt) + max_tokens} exceeds {what} {limit}")
        if params.min_tokens > max_tokens:   # against a max_tokens sent, SamplingParams refused it already
            raise RequestError(f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens the model length "
                               f"({self.stack.max_model_len}) leaves after the prompt's {len(prompt)}")
        salt = request_extra_key(self.config.cache_salt, tenant, msg.cache_salt)
        if not self.config.prefix_caching:
            # pages of this request only: nothing is ever shared (a client's own id, reused, would be)
            salt = f"{salt}\x00{uuid.uuid4().hex}"
        request = Request(scoped_request_id(tenant, request_id), prompt, max_tokens, params, extra_key=salt)
        if params.seed is not None:
            request.generator = make_generator(params.seed, self.stack.device)
        if params.format is not None:
            try:
                request.matcher = await self.lanes.compile(self.stack.grammars.matcher, params.format, tenant)
            except ValueError as exc:
                raise RequestError(str(exc)) from None
            request.forget_format = functools.partial(self.stack.grammars.forget, params.format, tenant)
        if msg.continuation.ids:
            if params.n > 1:
                raise RequestError("a continuation goes on one sequence; it cannot be given with n > 1")
            await self._continue(request, msg.continuation.ids)
        return request

    async def _continue(self, request: Request, ids: Sequence[int]) -> None:
        """The request goes on from the tokens `ids` it generated elsewhere: they join its output,
        and its output processor reads them first (detokenizer and stop checks in the state they
        would be in), so that what it streams next follows on without a gap or a repeat."""
        tokens = await self.lanes.run(len(ids), self._continuation_tokens, ids)   # millions, with sinks
        if len(tokens) >= request.max_tokens:
            if request.params.max_tokens is None:   # the bound is the model length, not a value sent
                raise NothingToGenerate(f"the prompt ({len(request.prompt_ids)} tokens) and the continuation "
                                        f"({len(tokens)}) fill the model length ({self.stack.max_model_len}): "
                                        "nothing is left to generate", "FINISH_REASON_LENGTH")
            raise NothingToGenerate(f"the continuation has {len(tokens)} tokens; max_tokens ({request.max_tokens}) "
                                    "leaves none to generate", "FINISH_REASON_LENGTH")
        request.tokens.extend(tokens)
        request.continued = len(tokens)
        request.output = await self.lanes.run(4 * len(tokens), self._primed_output, request, tokens)
        if request.matcher is not None:   # the format goes on from where the continuation left it
            await self.lanes.run(len(tokens), _feed_format, request.matcher, tokens)

    def _continuation_tokens(self, ids: Sequence[int]) -> list[int]:
        tokens = list(ids)
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"continuation token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return tokens

    def _primed_output(self, request: Request, tokens: list[int]) -> OutputProcessor:
        output = OutputProcessor(request, self.tokenizer, self.stack.eos_token_ids)
        for token in tokens:
            _, done, _, stop = output.add(token)
            if done:   # (a gateway ends the stream as the tokens ended it: by which stop, said)
                raise NothingToGenerate("the continuation already meets a stop condition (EOS, a stop token "
                                        "id or a stop string): there is nothing left to generate",
                                        "FINISH_REASON_STOP",
                                        stop_index=request.params.stop.index(stop) if isinstance(stop, str) else None,
                                        stop_token_id=stop if isinstance(stop, int) else None)
        return output

    async def tokenize(self, msg) -> list[int]:
        add_special = msg.add_special_tokens if msg.HasField("add_special_tokens") else True
        kind = msg.WhichOneof("input")
        if kind == "prompt":
            self._check_text(_prompt_bytes(msg), msg.ByteSize(), lambda: len(msg.prompt), "the prompt has",
                             fit=False)   # counting its tokens is the point
            text = msg.prompt
            return await self.lanes.run(len(text), self._encode, text, add_special)
        if kind == "messages":
            return await self._chat(msg.messages, fit=False)
        raise RequestError("set one input: prompt or messages")

    async def token_strings(self, ids: list[int]) -> list[str]:
        """The ids as the tokenizer's token strings, off the event loop (a long prompt's are millions)."""
        return await self.lanes.run(len(ids), self.tokenizer.convert_ids_to_tokens, ids)

    async def detokenize(self, msg: pb.DetokenizeRequest) -> str:
        try:
            check_detokenize_count(len(msg.token_ids))
            return await self.lanes.run(len(msg.token_ids), detokenize, self.stack.tokenizer, msg.token_ids,
                                        self.vocab_size, msg.skip_special_tokens)
        except ValueError as exc:
            raise RequestError(str(exc)) from None

    def check_limits(self, msg, request_id: str) -> None:
        """What can be refused from the message's sizes alone; a long prompt is not even decoded
        (reading a string field builds a Python str of it, every time)."""
        cfg = self.config
        problem = id_problem(request_id, msg.session_id)
        if problem is not None:
            raise RequestError(problem)
        try:
            check_cache_salt(msg.cache_salt)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        kind = msg.WhichOneof("input")
        if kind == "prompt":
            self._check_text(_prompt_bytes(msg), msg.ByteSize(), lambda: len(msg.prompt), "the prompt has")
        elif kind == "messages":
            self._check_chat(msg.messages.messages)
        elif kind == "token_ids" and len(msg.token_ids.ids) >= self.stack.max_model_len:
            raise RequestError(f"the prompt has {len(msg.token_ids.ids)} tokens; the model length is "
                               f"{self.stack.max_model_len}, which leaves no room for output")
        # counted before they are copied and checked one by one on the event loop (a message of
        # 8 MB holds millions of one-byte ids)
        continued = len(msg.continuation.ids)
        most, what = self._stream_limit()
        if continued >= most:
            raise RequestError(f"the continuation has {continued:,} tokens; {what} is {most:,}, which leaves "
                               "no room for more")
        if len(msg.sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(f"{len(msg.sampling.stop_token_ids):,} stop_token_ids; at most {MAX_STOP_TOKEN_IDS} "
                               "are allowed")
        if len(msg.sampling.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias has {len(msg.sampling.logit_bias)} entries; at most {MAX_LOGIT_BIAS} "
                               "are allowed")
        stops = msg.sampling.stop
        if len(stops) > cfg.max_stop_strings:
            raise RequestError(f"{len(stops)} stop strings; at most {cfg.max_stop_strings} are allowed "
                               "(--max-stop-strings)")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise RequestError(f"a stop string has {longest} characters; at most {MAX_STOP_CHARS} are allowed")

    # ------------------------------------------------------------ helpers

    def _stream_limit(self) -> tuple[int, str]:
        """The most tokens one request's prompt and output may reach, and its name in a message:
        a stream with attention sinks may run past the model length."""
        if self.config.attention_sink:
            return STREAM_LIMIT, "the longest stream with attention sinks"
        return self.stack.max_model_len, "the model length"

    def _check_text(self, nbytes: int, most_bytes: int, count_chars: Callable[[], int], what: str,
                    fit: bool = True) -> None:
        """`nbytes` at most, `most_bytes` at least the text's UTF-8 length (so at least its
        characters); count_chars() decodes it, only when it may be over the limit. `what`: the
        text and its verb ("the prompt has")."""
        cfg, limit = self.config, self.stack.max_model_len
        fewest = fewest_tokens(nbytes, self.bytes_per_token)
        if fit and fewest >= limit:
            raise RequestError(f"{what} at least {nbytes:,} bytes, so at least {fewest:,} tokens; "
                               f"the model length is {limit}")
        if most_bytes > cfg.max_prompt_chars and (chars := count_chars()) > cfg.max_prompt_chars:
            raise RequestError(f"{what} {chars:,} characters; at most {cfg.max_prompt_chars:,} are "
                               "allowed (--max-prompt-chars)")

    def _check_chat(self, messages, fit: bool = True) -> None:
        cfg = self.config
        if len(messages) > cfg.max_chat_messages:
            raise RequestError(f"{len(messages)} chat messages; at most {cfg.max_chat_messages} are allowed "
                               "(--max-chat-messages)")
        try:
            prompt_tokens.check_speakers(messages)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        # Each message's encoded size, less its role, its name and at most 12 bytes of tags and
        # lengths (3 for the role, 6 for the content, 3 for the name).
        nbytes = sum(max(0, m.ByteSize() - len(m.role.encode()) - len(m.name.encode()) - 12) for m in messages)
        self._check_text(nbytes, sum(m.ByteSize() for m in messages), lambda: sum(len(m.content) for m in messages),
                         "the chat messages have", fit and self.chat_keeps_text)

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return prompt_tokens.encode(self.tokenizer, text, add_special_tokens)

    async def _input_ids(self, msg) -> list[int]:
        kind = msg.WhichOneof("input")
        if kind == "prompt":
            text = msg.prompt
            if not text:
                raise RequestError("the prompt is empty")
            ids = await self.lanes.run(len(text), self._encode, text)
        elif kind == "token_ids":
            ids = list(msg.token_ids.ids)
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise RequestError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        elif kind == "messages":
            ids = await self._chat(msg.messages)
        else:
            raise RequestError("set one input: prompt, token_ids or messages")
        if not ids:
            raise RequestError("the input has no tokens")
        if self.tokenizer_ids > self.vocab_size and kind != "token_ids":
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:   # the embedding would fail the whole engine step, every request in it
                raise RequestError(f"the input's token {self.tokenizer.convert_ids_to_tokens(bad)!r} (id {bad}) "
                                   f"is past the model's vocabulary [0, {self.vocab_size}): its tokenizer has "
                                   f"{self.tokenizer_ids} tokens")
        return ids

    async def _chat(self, messages, fit: bool = True) -> list[int]:
        if not fit:   # Tokenize: build() has checked a Generate's already
            self._check_chat(messages.messages, fit)
        if not messages.messages:
            raise RequestError("messages is empty")
        try:
            options = prompt_tokens.chat_options(messages)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        chat = prompt_tokens.chat_turns(messages.messages)
        size = sum(len(m["content"]) for m in chat)
        return await self.lanes.run(size, self._render_chat, chat, options)

    def _render_chat(self, chat: list[dict], options: prompt_tokens.ChatOptions) -> list[int]:
        try:
            return prompt_tokens.render_chat(self.tokenizer, chat, options)
        except ValueError as exc:
            raise RequestError(str(exc)) from None

    def _params(self, s) -> SamplingParams:
        def opt(name, default):
            return getattr(s, name) if s.HasField(name) else default

        d = self.defaults   # what is unset: the model's recommendation (generation_defaults.py)
        try:
            params = SamplingParams(
                temperature=opt("temperature", d.temperature), top_p=opt("top_p", d.top_p), top_k=opt("top_k", d.top_k),
                min_p=opt("min_p", d.min_p), repetition_penalty=opt("repetition_penalty", d.repetition_penalty),
                presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                seed=opt("seed", None), max_tokens=opt("max_tokens", None),
                stop_token_ids=tuple(dict.fromkeys(s.stop_token_ids)), stop=tuple(s.stop), ignore_eos=s.ignore_eos,
                logprobs=opt("logprobs", None), skip_special_tokens=opt("skip_special_tokens", True),
                n=s.n or 1, prompt_logprobs=opt("prompt_logprobs", None),
                logit_bias=tuple(sorted(s.logit_bias.items())), min_tokens=s.min_tokens,
                format=_format(s.structured) if s.HasField("structured") else None)
            params.validate(self.vocab_size, self.config.max_logprobs, self.config.max_n)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        return params


def _format(structured) -> Format:
    """StructuredOutput's one format (INVALID_ARGUMENT when none is set)."""
    kind = structured.WhichOneof("format")
    if kind is None:
        raise ValueError("structured output: set one of json_schema, json_object, regex, choice, lark_grammar")
    if kind == "json_object":
        if not structured.json_object:   # set, but false: asks for no format while naming one
            raise ValueError("structured output json_object is false: set it true for any JSON object, or "
                             "leave structured unset for free text")
        return Format(kind, "")
    if kind == "choice":
        return Format(kind, json.dumps(list(structured.choice.choices)))
    return Format(kind, getattr(structured, kind))


def _feed_format(matcher, tokens: Sequence[int]) -> None:
    """The continuation's tokens into the format's matcher, on a tokenizer lane: a step of the
    matcher each, and a stream with attention sinks may continue from millions."""
    for i, token in enumerate(tokens):
        if not matcher.consume_token(token):
            raise RequestError(f"continuation token {i} ({token}) does not fit the structured output's format")
    if matcher.is_stopped():
        raise NothingToGenerate("the continuation already completes the structured output's format: "
                                "there is nothing left to generate", "FINISH_REASON_STOP")
