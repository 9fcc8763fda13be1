from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.model_service.sampling.detokenizer import _MAX_HELD, IncrementalDetokenizer, decoder_of
from tests.sampling.conftest import CORPUS

FFFD = "\ufffd"
TEXTS = CORPUS + [
    "Unseen: 龘 𝄞 🦀🦀 ☃ Ωmega — ok",
    "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 1️⃣ keycap",
    "",
    " leading and trailing spaces  ",
]
# Characters of 1 to 4 UTF-8 bytes, plus joiners and variation selectors.
ALPHABET = list("ab ,.\nSTOPéñ世界你好한글") + ["😀", "🌍", "👍", "\U0001f3fd", "\u200d", "\ufe0f", "𝄞"]


def _stream(tokenizer, ids, prompt_ids=(), chunk=1, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, list(prompt_ids), skip_special_tokens)
    chunks = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return detok, chunks


def test_the_fixture_splits_characters_over_tokens(tokenizer):
    # Otherwise the tests below would not exercise holding back incomplete characters.
    ids = tokenizer.encode("🌍 世界", add_special_tokens=False)
    assert any(FFFD in tokenizer.decode([i]) for i in ids)


def test_one_token_at_a_time_equals_decoding_all(tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok, chunks = _stream(tokenizer, ids)
        assert "".join(chunks) == tokenizer.decode(ids) == text
        assert not any(FFFD in c for c in chunks)
        assert detok.flush() == ""


def test_incomplete_characters_are_held_then_released_whole(tokenizer):
    ids = tokenizer.encode("a🌍", add_special_tokens=False)
    _, chunks = _stream(tokenizer, ids)
    assert chunks[0] == "a"
    assert all(c == "" for c in chunks[1:-1]) and chunks[-1] == "🌍"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.sampled_from(ALPHABET), max_size=40), chunk=st.integers(1, 4))
def test_random_text_streams_exactly(tokenizer, text, chunk):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, chunks = _stream(tokenizer, ids, chunk=chunk)
    assert "".join(chunks) == text
    assert not any(FFFD in c for c in chunks)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(2, 299), max_size=60))
def test_random_token_ids_match_decode_after_flush(tokenizer, ids):
    # Arbitrary ids may form invalid UTF-8; flush() releases what decode(all) shows as U+FFFD.
    detok, chunks = _stream(tokenizer, ids)
    assert "".join(chunks) + detok.flush() == tokenizer.decode(ids)
    if len(ids) <= _MAX_HELD:   # held until flush; past _MAX_HELD invalid bytes are written as they settle
        assert not any(c.endswith(FFFD) for c in chunks)


def _byte_token(tokenizer, byte: int) -> int:
    """The id of the token that is the one byte `byte`, in byte-level BPE's alphabet: GPT-2's table,
    printable bytes as themselves, the others as characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    char = chr(byte) if byte in printable else chr(256 + sorted(set(range(256)) - set(printable)).index(byte))
    token = tokenizer.convert_tokens_to_ids(char)
    assert tokenizer.decode([token]).encode("utf-8", "surrogateescape") != b"" and token != tokenizer.unk_token_id
    return token


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pattern=st.lists(st.sampled_from(["cont", "lead2", "lead3", "lead4", "a", "eos", "word"]), min_size=1,
                        max_size=12),
       length=st.integers(20, 200), chunk=st.integers(1, 3))
def test_a_stream_of_invalid_bytes_keeps_a_small_window_and_the_exact_text(tokenizer, pattern, length, chunk):
    # A model pushed to emit lone continuation bytes (a logit bias will do it) never completes a
    # character: the window must not grow with the output, and the text must still be decode(all)'s.
    pieces = {"cont": [_byte_token(tokenizer, 0x80)], "lead2": [_byte_token(tokenizer, 0xC3)],
              "lead3": [_byte_token(tokenizer, 0xE4)], "lead4": [_byte_token(tokenizer, 0xF0)],
              "a": tokenizer.encode("a", add_special_tokens=False), "eos": [tokenizer.eos_token_id],
              "word": tokenizer.encode(" 世界", add_special_tokens=False)}
    ids: list[int] = []
    while len(ids) < length:
        for name in pattern:
            ids += pieces[name]
    detok = IncrementalDetokenizer(tokenizer, [], True)
    widest = 0
    chunks = []
    for i in range(0, len(ids), chunk):
        chunks.append(detok.add(ids[i:i + chunk]))
        widest = max(widest, len(detok._ids))
    assert "".join(chunks) + detok.flush() == tokenizer.decode(ids, skip_special_tokens=True)
    assert widest <= 2 * _MAX_HELD + 2 * chunk + 5   # what was written last, as context, and what is held


def test_a_character_split_by_skipped_special_tokens_past_the_hold_comes_whole(tokenizer):
    """Tokens that write nothing between a character's bytes: its lead byte was written as U+FFFD
    once four tokens followed it, and the character never came (found by review)."""
    lead, cont = _byte_token(tokenizer, 0xE4), _byte_token(tokenizer, 0x80)
    rest = [_byte_token(tokenizer, 0xB8), _byte_token(tokenizer, 0xAD)] + tokenizer.encode("a", add_special_tokens=False)
    for k in range(17):
        ids = [cont] * k + [lead] + [tokenizer.eos_token_id] * (16 - k) + rest   # 中 split by 16 - k <eos>
        detok, chunks = _stream(tokenizer, ids)
        assert "".join(chunks) + detok.flush() == tokenizer.decode(ids, skip_special_tokens=True), k
        assert tokenizer.decode(ids, skip_special_tokens=True).endswith("中a")


def test_skipped_special_tokens_by_the_thousand_are_dropped_from_the_window(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hello", add_special_tokens=False) + [eos] * 1000
    ids += tokenizer.encode(" world 世界", add_special_tokens=False)
    detok, chunks = _stream(tokenizer, ids)
    assert "".join(chunks) == "Hello world 世界"
    assert len(detok._ids) <= _MAX_HELD + 8


def test_output_after_a_prompt(tokenizer):
    for prompt, output in [("Hello", " world 🌍!"), ("你好，", "世界。"), ("🎉", "🎉 again"), ("", "x")]:
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        output_ids = tokenizer.encode(output, add_special_tokens=False)
        assert tokenizer.decode(prompt_ids + output_ids) == prompt + output
        detok, chunks = _stream(tokenizer, output_ids, prompt_ids=prompt_ids)
        assert "".join(chunks) == output


def test_special_tokens_skipped_or_kept(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("abc", add_special_tokens=False) + [eos]
    ids += tokenizer.encode("世界", add_special_tokens=False)
    _, skipped = _stream(tokenizer, ids, skip_special_tokens=True)
    assert "".join(skipped) == "abc世界"
    _, kept = _stream(tokenizer, ids, skip_special_tokens=False)
    assert "".join(kept) == "abc<eos>世界"


def test_window_stays_small(tokenizer):
    ids = tokenizer.encode(" ".join(CORPUS), add_special_tokens=False)
    detok, _ = _stream(tokenizer, ids)
    assert len(detok._ids) <= 8


def test_a_truncated_character_is_held_and_flush_releases_it(tokenizer):
    ids = tokenizer.encode("ok 🌍", add_special_tokens=False)[:-1]  # the emoji's last byte is cut
    detok, chunks = _stream(tokenizer, ids)
    assert "".join(chunks) == "ok"  # " 🌍" starts with one token holding the space
    tail = detok.flush()
    assert tail and tail.endswith(FFFD)
    assert "".join(chunks) + tail == tokenizer.decode(ids)


def test_works_with_a_bare_tokenizers_tokenizer(tokenizer):
    bare = tokenizer.backend_tokenizer  # tokenizers.Tokenizer has the same decode signature
    ids = tokenizer.encode("你好 🌍 world", add_special_tokens=False)
    _, chunks = _stream(bare, ids)
    assert "".join(chunks) == "你好 🌍 world"


def test_the_rust_decode_stands_in_only_where_it_gives_transformers_text(tokenizer, monkeypatch):
    assert decoder_of(tokenizer) == tokenizer.backend_tokenizer.decode   # no clean-up configured
    ids = tokenizer.encode(" ".join(CORPUS), add_special_tokens=False)
    for skip in (True, False):
        assert decoder_of(tokenizer)(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)   # it rewrites spaces: its own path
    assert decoder_of(tokenizer) == tokenizer.decode
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", False)

    class Rewrites(type(tokenizer)):   # a class that changes the text its decode gives
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()

    rewriting = Rewrites(tokenizer_object=tokenizer.backend_tokenizer)
    assert decoder_of(rewriting) == rewriting.decode
    bare = tokenizer.backend_tokenizer
    assert decoder_of(bare) == bare.decode


def test_detokenize_is_the_tokenizers_decode_and_checks_its_ids(tokenizer, monkeypatch):
    """Detokenize's text: the tokenizer's own decode (its Rust one, which lets go of the GIL,
    where that writes the same); ids in the model's padding rows write nothing; ids past both and
    a text past the reply's bound are sentences."""
    import pytest

    from kvserve.model_service.sampling import detokenizer

    ids = tokenizer.encode(CORPUS[0], add_special_tokens=False)[:40]
    size = len(tokenizer)
    for skip in (False, True):
        assert detokenizer.detokenize(tokenizer, ids, size, skip) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert detokenizer.detokenize(tokenizer, [*ids[:3], size, size + 5, *ids[3:]], size + 8) == tokenizer.decode(ids)
    for bad in (-1, size + 8):
        with pytest.raises(ValueError, match=rf"^token id {bad} is outside the vocabulary \[0, {size + 8}\)$"):
            detokenizer.detokenize(tokenizer, [*ids, bad], size + 8)
    with pytest.raises(ValueError, match="^131,073 token ids; at most 131,072 are written out in one call$"):
        detokenizer.check_detokenize_count((1 << 17) + 1)
    monkeypatch.setattr(detokenizer, "MAX_DETOKENIZE_BYTES", len(tokenizer.decode(ids).encode()) - 1)
    with pytest.raises(ValueError, match="ask for fewer ids$"):
        detokenizer.detokenize(tokenizer, ids, size)


def test_the_http_fronts_bound_on_detokenized_ids_is_the_servers():
    from kvserve.model_service.sampling.detokenizer import MAX_DETOKENIZE_IDS
    from kvserve.services.http.translate import MAX_DETOKENIZE_IDS as FRONTS

    assert FRONTS == MAX_DETOKENIZE_IDS
