"""A logprob's token bytes: what the token stands for, part of a UTF-8 character too, through to
the HTTP front's chat logprobs (OpenAI's `bytes`, which a client joins back into the text)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from kvserve.model_service.sampling.sampler import TokenLogprobs as EngineLogprob
from kvserve.model_service.servicer import TokenTexts, _token_logprob
from kvserve.model_service.token_bytes import token_bytes
from kvserve.services.http.translate import _named


@pytest.mark.parametrize("name", ["bench", "tiny"])
def test_a_token_holding_part_of_a_character_gives_its_own_bytes(tiny_dirs, name):
    """Its text is U+FFFD: its bytes were U+FFFD's three, and the joined bytes were not the text."""
    from kvserve.model_service.tiny_model import default_tiny_path

    tokenizer = AutoTokenizer.from_pretrained(default_tiny_path(name) if name == "bench" else tiny_dirs[name])
    names = TokenTexts(tokenizer, token_bytes(tokenizer))
    text = "héllo 🙂 世界 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    shown = [_named(_token_logprob(EngineLogprob(i, -0.5, [(i, -0.5)]), names)) for i in ids]
    assert b"".join(bytes(e["bytes"]) for e in shown).decode("utf-8").strip() == text.strip()
    # a lone byte of a character, as byte-level vocabularies hold every byte: its own byte, and
    # the top-n's entries too
    partial = [i for i in range(len(tokenizer)) if names.bytes_of(i) in (b"\xc3", b"\xe4", b"\xf0")]
    assert partial
    logprob = _token_logprob(EngineLogprob(partial[0], -1.0, [(partial[0], -1.0)]), names)
    entry, top = _named(logprob), _named(logprob.top[0])
    assert entry["token"] == "\ufffd" and len(entry["bytes"]) == 1 and top["bytes"] == entry["bytes"]


def test_without_bytes_known_they_come_from_the_text(tiny_dirs):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["tiny"])
    names = TokenTexts(tokenizer)   # an older worker's answer: no bytes
    [i] = tokenizer.encode("!", add_special_tokens=False)
    assert _named(_token_logprob(EngineLogprob(i, -0.1, []), names))["bytes"] == list(b"!")
