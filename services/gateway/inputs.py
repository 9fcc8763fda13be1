"""A request's prompt as the token ids its worker will compute, for routing: the same tokenizer
and the same code as the workers (model_service/prompt_tokens.py), off the event loop, in the
workers' two lanes (model_service/tokenizing.py: a long text waits behind long ones only). The
request itself is forwarded as the client sent it: the worker tokenizes it again, so a gateway
with the wrong tokenizer can route badly but never make a worker generate from the wrong ids.
The workers' limits on a text's size and a chat's length are checked first, from the message's
sizes, so that what a worker would refuse at once costs the gateway no tokenizing."""

from __future__ import annotations

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.model_service import prompt_tokens
from kvserve.model_service.sampling.detokenizer import check_detokenize_count, detokenize
from kvserve.model_service.tokenizing import TokenizerLanes


class InputError(ValueError):
    pass


class Inputs:
    def __init__(self, tokenizer, threads: int, max_prompt_chars: int = 1_000_000,
                 max_chat_messages: int = 1024) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_chars = max_prompt_chars
        self.max_chat_messages = max_chat_messages
        self._lanes = TokenizerLanes(threads)

    async def ids(self, msg: pb.GenerateRequest | pb.TokenizeRequest, add_special_tokens: bool = True) -> list[int]:
        kind = msg.WhichOneof("input")
        if kind == "token_ids":
            return list(msg.token_ids.ids)
        if kind == "prompt":
            # the encoded size first: reading the field builds a str, and it has at least as many bytes as characters
            if msg.ByteSize() > self.max_prompt_chars and len(msg.prompt) > self.max_prompt_chars:
                raise InputError(f"the prompt has {len(msg.prompt):,} characters; at most "
                                 f"{self.max_prompt_chars:,} are allowed (--max-prompt-chars)")
            text = msg.prompt
            return await self._lanes.run(len(text), prompt_tokens.encode, self.tokenizer, text, add_special_tokens)
        if kind == "messages":
            messages = msg.messages.messages
            if len(messages) > self.max_chat_messages:
                raise InputError(f"{len(messages)} chat messages; at most {self.max_chat_messages} are allowed "
                                 "(--max-chat-messages)")
            try:
                prompt_tokens.check_speakers(messages)
            except ValueError as exc:
                raise InputError(str(exc)) from None
            if msg.messages.ByteSize() > self.max_prompt_chars and \
                    (chars := sum(len(m.content) for m in messages)) > self.max_prompt_chars:
                raise InputError(f"the chat messages have {chars:,} characters; at most "
                                 f"{self.max_prompt_chars:,} are allowed (--max-prompt-chars)")
            chat = prompt_tokens.chat_turns(messages)
            if not chat:
                raise InputError("messages is empty")
            try:
                options = prompt_tokens.chat_options(msg.messages)
                return await self._lanes.run(sum(len(m["content"]) for m in chat), prompt_tokens.render_chat,
                                             self.tokenizer, chat, options)
            except ValueError as exc:
                raise InputError(str(exc)) from None
        # the inputs the message has, as the worker names them
        raise InputError("set one input: " + ("prompt, token_ids or messages" if isinstance(msg, pb.GenerateRequest)
                                              else "prompt or messages"))

    async def text(self, msg: pb.DetokenizeRequest, vocab_size: int) -> str:
        """The ids as the workers' tokenizer writes them, off the event loop."""
        try:
            check_detokenize_count(len(msg.token_ids))
            return await self._lanes.run(len(msg.token_ids), detokenize, self.tokenizer, msg.token_ids, vocab_size,
                                         msg.skip_special_tokens)
        except ValueError as exc:
            raise InputError(str(exc)) from None

    async def tokens(self, ids: list[int]) -> list[str]:
        """The ids as the tokenizer's token strings, off the event loop."""
        return await self._lanes.run(len(ids), self.tokenizer.convert_ids_to_tokens, ids)

    def close(self) -> None:
        self._lanes.close()
