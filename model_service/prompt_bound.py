"""How few tokens a text can become, known from its size alone, so that a prompt far longer than
the model is refused without tokenizing it (800,000 characters take most of a second to
tokenize, and a second of a core).

The bound: no token stands for more than B bytes of UTF-8 (the longest token's text), so a text
of n bytes becomes at least n / B tokens, once normalized. Some normalizers shrink text: NFC / NFKC
composition at most threefold (three Hangul jamo, 9 bytes, compose into one syllable of 3), and
lowercasing as much (the Kelvin sign, 3 bytes, becomes "k"). With one of those in the chain the
bound divides by SHRINK * B; without (byte-level BPE as Llama 3 and Mistral ship it), by B.

It holds only when every byte of the text ends up in some token: byte-level BPE, or a model with
byte fallback, and nothing along the way that drops text (a Strip normalizer, a splitter that
removes what it matches, an added token that strips the whitespace beside it). A tokenizer that may fold a run of unknown characters into one unknown
token (WordPiece, BPE without byte fallback) gets no bound, and every prompt is tokenized.
"""

from __future__ import annotations

import json
import logging

log = logging.getLogger(__name__)

SHRINK = 3
_KEEPING_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace", "Sequence", "Precompiled"}
_SHRINKING_NORMALIZERS = {"NFC", "NFKC", "Lowercase", "Precompiled"}
_KEEPING_PRETOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Sequence", "Punctuation",
                          "UnicodeScripts"}


def max_bytes_per_token(tokenizer) -> int | None:
    """B for this tokenizer, times SHRINK when it normalizes with one that shrinks text; None
    when no bound holds (see the module's doc)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or ()):
        return None   # such a token takes in the whitespace beside it, however much: no bound
    pre = _flatten(spec.get("pre_tokenizer"), "pretokenizers")
    byte_level = any(p["type"] == "ByteLevel" for p in pre)
    if not (byte_level or spec["model"].get("byte_fallback")):
        return None
    if any(p["type"] not in _KEEPING_PRETOKENIZERS or p.get("behavior") == "Removed" for p in pre):
        return None
    norms = _flatten(spec.get("normalizer"), "normalizers")
    if any(n["type"] not in _KEEPING_NORMALIZERS or (n["type"] == "Replace" and not _grows(n)) for n in norms):
        return None
    longest = max(_token_bytes(backend, len(tokenizer), set(tokenizer.all_special_ids)))
    shrinks = any(n["type"] in _SHRINKING_NORMALIZERS for n in norms)
    return longest * (SHRINK if shrinks else 1) or None


def _token_bytes(backend, size: int, special: set[int]) -> list[int]:
    """Each token's bytes of text, as the tokenizers library decodes it (transformers' clean-up
    of spaces before punctuation would shorten it). Decoded after another token: a decoder that
    strips the text's leading space (Llama 2's and Mistral's Strip, Metaspace) dropped a byte from
    every token that begins with one, and the bound, too small, refused prompts that fit. A
    byte-fallback token decodes to U+FFFD, three bytes for one: larger is safe."""
    anchor = next(i for i in range(size) if i not in special and backend.decode([i]).strip())
    base = len(backend.decode([anchor], skip_special_tokens=False).encode("utf-8"))
    texts = backend.decode_batch([[anchor, i] for i in range(size)], skip_special_tokens=False)
    return [len(t.encode("utf-8")) - base for t in texts]


def fewest_tokens(nbytes: int, bytes_per_token: int | None) -> int:
    """A lower bound on the tokens of a text of `nbytes` bytes of UTF-8; 0 when nothing is known."""
    if bytes_per_token is None:
        return 0
    return nbytes // bytes_per_token


def _grows(replace: dict) -> bool:
    """A Replace of a plain string by one at least as long (Llama's " " → "▁")."""
    pattern = replace.get("pattern", {}).get("String")
    content = replace.get("content") or ""
    return pattern is not None and len(content.encode()) >= len(pattern.encode())


def _flatten(spec: dict | None, key: str) -> list[dict]:
    if spec is None:
        return []
    if spec["type"] == "Sequence":
        return [leaf for child in spec[key] for leaf in _flatten(child, key)]
    return [spec]
