"""Generated checkpoints: transformers loads them, the tokenizer round-trips, the cache dir."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from kvserve.model_service import tiny_model
from kvserve.model_service.tiny_model import default_tiny_path, make_preset, make_tiny_model
from kvserve.model_service.tiny_tokenizer import SplitMix64, corpus
from tests.model.conftest import ARCH_PRESETS

TEXT = "Héllo wörld, naïve café! 日本語のテキスト 🚀👍🏽 ❤️ 12345\n\ttabs  and   spaces's end"


def test_corpus_bytes_are_pinned() -> None:
    """The generator is pure integer arithmetic: these bytes must never change (bump
    GENERATOR_VERSION if they must)."""
    assert SplitMix64(0).next() == 0xE220A8397B1DCDAF   # splitmix64's published first output
    text = "".join(corpus(0, 500))
    assert hashlib.sha256(text.encode()).hexdigest() == (
        "b7bab9dc61303b72ace80acffc92f01f100f28df4e1e6a2bed1a6e6126aa55b0")
    assert any(ord(c) > 0xFFFF for c in text) and any("\u4e00" <= c <= "\u9fff" for c in text)


@pytest.mark.parametrize("name", ARCH_PRESETS)
def test_tokenizer_round_trips_and_agrees_with_its_file(tiny_dirs, name: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dirs[name])
    ids = tok.encode(TEXT, add_special_tokens=True)
    assert tok.decode(ids) == TEXT
    assert max(ids) < json.loads((tiny_dirs[name] / "config.json").read_text())["vocab_size"]
    # A client holding only tokenizer.json gets the same ids (see tiny_tokenizer's docstring).
    assert Tokenizer.from_file(str(tiny_dirs[name] / "tokenizer.json")).encode(TEXT).ids == ids
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_chat_template_renders(tiny_dirs) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dirs["tiny"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>Be brief.<|end|><|user|>Hi 👋<|end|><|assistant|>"
    ids = tok(text, add_special_tokens=False).input_ids
    special = [tok.convert_tokens_to_ids(t) for t in ("<|system|>", "<|user|>", "<|end|>", "<|assistant|>")]
    assert ids[0] == tok.bos_token_id and set(special) <= set(ids)   # each marker is one token
    assert ids[-1] == special[-1]


def test_weights_depend_on_the_seed_only(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", num_hidden_layers=1, seed=5)
    b = make_tiny_model(tmp_path / "b", num_hidden_layers=1, seed=5)
    c = make_tiny_model(tmp_path / "c", num_hidden_layers=1, seed=6)
    digest = {p: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest() for p in (a, b, c)}
    assert digest[a] == digest[b] != digest[c]
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_unknown_names_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny-qwen2"):
        make_preset(tmp_path / "x", "huge")
    with pytest.raises(ValueError, match="llama, qwen2, qwen3, mistral"):
        make_tiny_model(tmp_path / "y", "gpt2")


def test_default_path_is_built_once_atomically_under_concurrent_first_use(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    builds = []
    real = tiny_model.make_preset

    def counting(path, preset="tiny", seed=None):
        builds.append(path)
        return real(path, preset, seed)

    monkeypatch.setattr(tiny_model, "make_preset", counting)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(default_tiny_path())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    path = results[0]
    assert results == [path] * 3
    assert path.parent == tmp_path / "cache" / "kvserve" / "models"
    assert path.name.startswith("tiny-") and (path / "config.json").is_file()
    assert [p.name for p in path.parent.iterdir()] == [path.name]   # no temp dirs left behind
    builds_before = len(builds)
    assert default_tiny_path() == path and len(builds) == builds_before   # cached: no rebuild


def test_a_built_in_model_that_cannot_be_written_is_one_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk or an unwritable cache dir was an OSError traceback from `kvserve up`."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))   # the cache dir cannot be made under a file
    with pytest.raises(ValueError, match="could not write the built-in model 'tiny' under .*XDG_CACHE_HOME"):
        default_tiny_path()

    def full_disk(path, preset="tiny", seed=None):
        Path(path, "config.json").write_text("{")
        raise OSError(28, "No space left on device")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(tiny_model, "make_preset", full_disk)
    with pytest.raises(ValueError, match="No space left on device; free space there"):
        default_tiny_path()
    assert list((tmp_path / "cache" / "kvserve" / "models").iterdir()) == []   # the half-written copy is gone
