"""The bytes each token stands for, beside its text: a byte-level BPE or byte-fallback token may
hold part of a UTF-8 character, which its text shows as U+FFFD. OpenAI's chat logprobs give
each token's bytes so that a client can join them back into the text; from the text alone they
were U+FFFD's three bytes. llguidance reads the bytes from the tokenizer as its grammars need
them, for every kind of tokenizer transformers loads fast. Its reading takes a while on a large
vocabulary, so it runs on a thread of its own from the start; a logprob asked before it is done
waits for it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


def token_bytes(tokenizer) -> Callable[[int], bytes]:
    """A token id's bytes; b"" (logprobs' bytes then come from their text) for an id outside the
    vocabulary, or for a tokenizer llguidance cannot read."""
    read: dict = {}
    ready = threading.Event()

    def build() -> None:
        try:
            import llguidance.hf

            read["vocabulary"] = llguidance.hf.from_tokenizer(tokenizer)
        except Exception as exc:   # noqa: BLE001 - a slow tokenizer, or one llguidance does not know
            log.warning("logprobs give their tokens' bytes from their text (U+FFFD for part of a character): "
                        "the tokenizer's bytes cannot be read (%s)", exc)
        finally:
            ready.set()

    threading.Thread(target=build, name="token-bytes", daemon=True).start()
    known: dict[int, bytes] = {}   # a vocabulary is bounded, and the top-n repeat

    def of(token_id: int) -> bytes:
        raw = known.get(token_id)
        if raw is None:
            ready.wait()
            vocabulary = read.get("vocabulary")
            raw = known[token_id] = (vocabulary.decode_bytes([token_id])
                                     if vocabulary is not None and 0 <= token_id < vocabulary.vocab_size else b"")
        return raw
    return of
