"""prompt_bound: the fewest tokens a text of n bytes can become is a true lower bound, for the
tokenizer families it claims one for (byte-level BPE; SentencePiece-style byte fallback)."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvserve.model_service.prompt_bound import fewest_tokens, max_bytes_per_token

WORD = " abcdefghij"   # its piece, "▁abcdefghij", is the vocabulary's longest
CORPUS = [("the" + WORD + "  x   y") * 20, "quick brown fox " * 20]


@pytest.fixture(scope="module")
def llama2_style() -> PreTrainedTokenizerFast:
    """As Llama 2 and Mistral ship theirs: "▁" for spaces, byte fallback, and a decoder that
    strips the text's leading space."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace()   # pieces learned within words, as SentencePiece's
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "<s>", "</s>"],
                                                            show_progress=False))
    learned = trained.get_vocab()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(learned, key=learned.get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(trained.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_a_piece_that_begins_with_a_space_counts_its_space(llama2_style):
    """Decoded alone, "▁abcdefghij" lost its space to the decoder's Strip: the bound took 10
    bytes a token where one holds 11, and a prompt of such words that fit was refused."""
    ids = llama2_style.encode("the" + WORD * 100, add_special_tokens=False)
    assert llama2_style.convert_ids_to_tokens(ids[1:]) == ["▁abcdefghij"] * 100
    per_token = max_bytes_per_token(llama2_style)
    assert per_token == len(WORD.encode())
    for text in ("the" + WORD * 100, "the" + WORD * 50 + "    " * 30, "   x" * 40):
        assert len(llama2_style.encode(text, add_special_tokens=False)) >= fewest_tokens(len(text.encode()), per_token)


def test_a_byte_level_tokenizers_bound_holds(tiny_dirs):
    from kvserve.model_service.prompt_tokens import load_tokenizer
    tok = load_tokenizer(tiny_dirs["tiny"])
    per_token = max_bytes_per_token(tok)
    assert per_token is not None
    longest = max(range(len(tok)), key=lambda i: len(tok.decode([i]).encode()))
    text = tok.decode([longest]) * 50
    assert len(tok.encode(text, add_special_tokens=False)) >= fewest_tokens(len(text.encode()), per_token)


def test_no_bound_where_an_added_token_takes_in_the_whitespace_beside_it(llama2_style):
    """One such token and a run of spaces beside it are one token: 40,000 bytes in a handful."""
    backend = Tokenizer.from_str(llama2_style.backend_tokenizer.to_str())
    backend.add_special_tokens([AddedToken("<mask>", special=True, lstrip=True, rstrip=True, normalized=False)])
    stripping = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    text = (" " * 4000 + "<mask>") * 10
    assert len(stripping.encode(text, add_special_tokens=False)) < 40
    assert max_bytes_per_token(stripping) is None
    assert max_bytes_per_token(llama2_style) is not None


@pytest.mark.parametrize("template, keeps", [
    ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}", True),
    # Llama 3's: each message trimmed
    ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}<|end|>{% endfor %}", False),
    # Qwen3's way: an assistant turn's <think> block left out
    ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'].split('</think>')[-1] }}<|end|>{% endfor %}",
     False),
])
def test_a_conversation_is_bounded_by_its_size_only_where_the_template_keeps_its_text(tiny_dirs, template, keeps):
    """A template that drops text (trimmed spaces, a think block) makes fewer tokens than the
    messages' bytes say: a conversation that fits was refused as too long before it was rendered."""
    from kvserve.model_service import prompt_tokens

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_dirs["tiny"])
    tokenizer.chat_template = template
    assert prompt_tokens.keeps_message_text(tokenizer) is keeps


def test_a_chat_template_that_does_not_render_is_refused_at_start_not_hung_on(tiny_dirs):
    """A template looping 10^10 times held the model service's start for ever after its pages
    were sized, and would have held a tokenizer thread per chat request."""
    from kvserve.model_service import prompt_tokens

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_dirs["tiny"])
    # (a few seconds of loop, not 10^10: the render cannot be stopped, and would spin on beside the tests)
    tokenizer.chat_template = ("{% for i in range(10000) %}{% for j in range(2000) %}{% endfor %}{% endfor %}"
                               "{{ messages[0]['content'] }}")
    with pytest.raises(ValueError, match="did not render three short messages within 0.05 s"):
        prompt_tokens.keeps_message_text(tokenizer, timeout_s=0.05)


@pytest.mark.parametrize("damage", ["model type", "no added_tokens"])
def test_a_tokenizer_that_does_not_read_is_a_sentence_said_before_the_weights_load(tiny_dirs, tmp_path, damage,
                                                                                   monkeypatch):
    """tokenizers' bare Exception and transformers' KeyError went up as tracebacks, and only after
    the weights, the warm-up step and any CUDA graphs."""
    import json
    import shutil

    from kvserve.model_service import assembly
    from kvserve.model_service.config import ModelServiceConfig

    path = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs["tiny"], path)
    data = json.loads((path / "tokenizer.json").read_text())
    if damage == "model type":
        data["model"]["type"] = "Bogus"
    else:
        data.pop("added_tokens")
    (path / "tokenizer.json").write_text(json.dumps(data))
    monkeypatch.setattr(assembly, "load_model", lambda *a, **k: pytest.fail("the weights were loaded first"))
    with pytest.raises(ValueError, match=f"^cannot load a tokenizer from {path}: "):
        assembly.build(ModelServiceConfig(model=str(path), kvcache="inprocess", device="cpu"))
