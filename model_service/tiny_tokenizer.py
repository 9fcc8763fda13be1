"""A byte-level BPE tokenizer for the generated test models, trained on generated text.

The corpus comes from code alone: a splitmix64 generator (written out here, so
no library's PRNG can change it) draws from an embedded word list, syllables
for made-up words, digits, punctuation and multi-byte UTF-8 (accents, CJK,
emoji). The same seed gives the same corpus bytes on every machine and Python
version, and the `tokenizers` BPE trainer is deterministic on a given corpus.

Special tokens, in id order from 0: <pad> <s> </s> <|system|> <|user|>
<|assistant|> <|end|>. The chat template renders

    <s><|user|>hello<|end|><|assistant|>          (add_generation_prompt)

and no BOS is added to plain text, so decode(encode(text)) == text.

Two pre-tokenizer styles: "gpt2" (ByteLevel's own regex; Llama, Mistral) and
"qwen" (NFC, then Qwen2's split regex, then ByteLevel without its regex). The
qwen style is what transformers 5's Qwen2Tokenizer rebuilds from the vocab and
merges whatever tokenizer.json says, so with it the file and AutoTokenizer
split text the same way, and a client tokenizing with tokenizer.json alone
(say, a gateway computing page hashes) gets the ids the server gets.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS, END_OF_TURN)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_WORDS = """
the of and to in is was for on that with as by at from it his an were are which this be or
has had not first one their its new after who they have her she two been other when there
all during into school time may years more most only over city some world would where later
up such used many can state about national out known university united then made new year
people part under team new music while between would three system also since well both high
game until these series each early however city government group river war number found
history area long called second film album station public season released member several
language work life age four million became main including county small water north south
east west light house market power order place point case week company line end home country
model token cache page batch memory server stream request prompt decode prefill kernel tensor
queue worker router latency throughput engine sample greedy layer head vector matrix value
key query attention window cluster node shard replica message signal channel buffer record
""".split()
_FOREIGN = """
café naïve über señor façade crème brûlée déjà vu garçon jalapeño Zürich Ångström smörgåsbord
français español português ñandú œuvre straße Köln Ελλάδα Москва привет мир
日本語 東京 中文 你好 世界 漢字 한국어 서울 ありがとう こんにちは 北京 上海 学习 模型 缓存
🙂 🚀 🎉 👍🏽 ❤️ 🌍 🔥 ✨ 🤖 📦
""".split()
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
_PUNCT = [".", ",", "!", "?", ";", ":", " -", "...", "'s", "\""]
_MASK64 = (1 << 64) - 1
QWEN_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
TOKENIZER_CLASS = {"gpt2": "PreTrainedTokenizerFast", "qwen": "Qwen2Tokenizer"}


class SplitMix64:
    """The splitmix64 generator: 64-bit state, exact integer arithmetic, stable forever."""

    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n

    def pick(self, items: list[str]) -> str:
        return items[self.below(len(items))]


def corpus(seed: int, num_lines: int) -> Iterator[str]:
    """Deterministic lines of fake prose, a few percent of them multi-byte."""
    rng = SplitMix64(seed)
    for _ in range(num_lines):
        words = []
        for _ in range(4 + rng.below(14)):
            roll = rng.below(100)
            if roll < 55:
                word = rng.pick(_WORDS)
            elif roll < 80:   # a made-up word: 1-4 syllables
                word = "".join(rng.pick(_SYLLABLES) for _ in range(1 + rng.below(4)))
            elif roll < 88:
                word = str(rng.below(10 ** (1 + rng.below(5))))
            else:
                word = rng.pick(_FOREIGN)
            if rng.below(10) == 0:
                word += rng.pick(_PUNCT)
            words.append(word)
        line = " ".join(words)
        yield line[0].upper() + line[1:] + rng.pick([".", ".", ".", "!", "?", "\n"])


def train_tokenizer(vocab_size: int, seed: int = 0, style: str = "gpt2"):
    """-> tokenizers.Tokenizer with vocab_size tokens (specials and the 256 bytes included)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if style not in TOKENIZER_CLASS:
        raise ValueError(f"unknown tokenizer style {style!r}; choose from {', '.join(TOKENIZER_CLASS)}")
    tok = Tokenizer(models.BPE())
    if style == "qwen":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # Enough text for the merges to fill the vocabulary (made-up words supply the variety).
    tok.train_from_iterator(corpus(seed, num_lines=max(2000, vocab_size // 2)), trainer=trainer)
    return tok


def write_tokenizer(path: Path, vocab_size: int, max_length: int, seed: int = 0,
                    style: str = "gpt2") -> dict[str, int]:
    """Write tokenizer.json and tokenizer_config.json into `path`; -> special token ids."""
    tok = train_tokenizer(vocab_size, seed, style)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": TOKENIZER_CLASS[style],
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
