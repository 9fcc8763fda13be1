"""GenerateRequest (protobuf) → engine Request, with every check a person needs to read.

Refused here, before anything is queued: no input, an empty prompt, a token id
outside the vocabulary, bad sampling parameters, and any request that could
never fit (prompt + max_tokens over the model length, which the page pool caps).
"""

from __future__ import annotations

from kvserve.model_service.engine.request import Request
from kvserve.model_service.sampling.params import SamplingParams
from kvserve.model_service.sampling.sampler import make_generator


class RequestError(ValueError):
    """Bad input: the call ends with INVALID_ARGUMENT and this message."""


class RequestBuilder:
    def __init__(self, stack) -> None:
        self.stack = stack
        self.tokenizer = stack.tokenizer
        self.vocab_size = stack.model_config.vocab_size

    def build(self, msg, request_id: str) -> Request:
        prompt = self._input_ids(msg)
        params = self._params(msg.sampling)
        limit = self.stack.max_model_len
        if len(prompt) >= limit:
            raise RequestError(f"the prompt has {len(prompt)} tokens; the model length is {limit}, "
                               "which leaves no room for output")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(prompt)
        if len(prompt) + max_tokens > limit:
            raise RequestError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = "
                               f"{len(prompt) + max_tokens} exceeds the model length {limit}")
        salt = self.stack.config.cache_salt
        if not self.stack.config.prefix_caching:
            salt = f"{salt}\x00{request_id}"  # pages of one request only: nothing is ever shared
        request = Request(request_id, prompt, max_tokens, params, extra_key=salt)
        if params.seed is not None:
            request.generator = make_generator(params.seed, self.stack.device)
        return request

    def tokenize(self, msg) -> list[int]:
        add_special = msg.add_special_tokens if msg.HasField("add_special_tokens") else True
        kind = msg.WhichOneof("input")
        if kind == "prompt":
            return self.tokenizer.encode(msg.prompt, add_special_tokens=add_special)
        if kind == "messages":
            return self._chat(msg.messages)
        raise RequestError("set one input: prompt or messages")

    # ------------------------------------------------------------ helpers

    def _input_ids(self, msg) -> list[int]:
        kind = msg.WhichOneof("input")
        if kind == "prompt":
            if not msg.prompt:
                raise RequestError("the prompt is empty")
            ids = self.tokenizer.encode(msg.prompt)
        elif kind == "token_ids":
            ids = list(msg.token_ids.ids)
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise RequestError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        elif kind == "messages":
            ids = self._chat(msg.messages)
        else:
            raise RequestError("set one input: prompt, token_ids or messages")
        if not ids:
            raise RequestError("the input has no tokens")
        return ids

    def _chat(self, messages) -> list[int]:
        if not messages.messages:
            raise RequestError("messages is empty")
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("this model's tokenizer has no chat template; send a prompt instead")
        chat = [{"role": m.role, "content": m.content} for m in messages.messages]
        try:
            out = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # the template rejects the conversation (e.g. roles out of order)
            raise RequestError(f"the chat template rejected the messages: {exc}") from None
        # transformers 5 returns a BatchEncoding here, 4.x a plain list
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def _params(self, s) -> SamplingParams:
        def opt(name, default):
            return getattr(s, name) if s.HasField(name) else default

        try:
            params = SamplingParams(
                temperature=opt("temperature", 1.0), top_p=opt("top_p", 1.0), top_k=s.top_k,
                min_p=s.min_p, repetition_penalty=opt("repetition_penalty", 1.0),
                presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                seed=opt("seed", None), max_tokens=opt("max_tokens", None),
                stop_token_ids=tuple(s.stop_token_ids), stop=tuple(s.stop), ignore_eos=s.ignore_eos,
                logprobs=opt("logprobs", None), skip_special_tokens=opt("skip_special_tokens", True))
            params.validate(self.vocab_size)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        return params
