"""A request's prompt as the token ids its worker will compute, for routing: the same tokenizer
and the same code as the workers (model_service/prompt_tokens.py), off the event loop. The
request itself is forwarded as the client sent it: the worker tokenizes it again, so a gateway
with the wrong tokenizer can route badly but never make a worker generate from the wrong ids."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.model_service import prompt_tokens


class InputError(ValueError):
    pass


class Inputs:
    def __init__(self, tokenizer, threads: int, max_prompt_chars: int = 1_000_000) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_chars = max_prompt_chars
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="gateway-tokenize")

    async def ids(self, msg: pb.GenerateRequest | pb.TokenizeRequest, add_special_tokens: bool = True) -> list[int]:
        kind = msg.WhichOneof("input")
        if kind == "token_ids":
            return list(msg.token_ids.ids)
        if kind == "prompt":
            # the encoded size first: reading the field builds a str, and it has at least as many bytes as characters
            if msg.ByteSize() > self.max_prompt_chars and len(msg.prompt) > self.max_prompt_chars:
                raise InputError(f"the prompt has {len(msg.prompt):,} characters; at most "
                                 f"{self.max_prompt_chars:,} are allowed (--max-prompt-chars)")
            return await self._run(prompt_tokens.encode, self.tokenizer, msg.prompt, add_special_tokens)
        if kind == "messages":
            messages = msg.messages.messages
            if msg.messages.ByteSize() > self.max_prompt_chars and \
                    (chars := sum(len(m.content) for m in messages)) > self.max_prompt_chars:
                raise InputError(f"the chat messages have {chars:,} characters; at most "
                                 f"{self.max_prompt_chars:,} are allowed (--max-prompt-chars)")
            chat = [{"role": m.role, "content": m.content} for m in messages]
            if not chat:
                raise InputError("messages is empty")
            try:
                return await self._run(prompt_tokens.render_chat, self.tokenizer, chat)
            except ValueError as exc:
                raise InputError(str(exc)) from None
        raise InputError("set one input: prompt, token_ids or messages")

    async def tokens(self, ids: list[int]) -> list[str]:
        """The ids as the tokenizer's token strings, off the event loop."""
        return await self._run(self.tokenizer.convert_ids_to_tokens, ids)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
