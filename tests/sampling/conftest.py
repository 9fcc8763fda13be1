"""A byte-level BPE tokenizer trained here on a small corpus, so tests need no download.

The vocabulary is small (300) on purpose: most CJK characters and every emoji stay split over
several byte tokens, which is what the detokenizer has to get right.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Streaming text one token at a time is harder than it looks.",
    "Café, naïve, façade, résumé — accents are two bytes in UTF-8.",
    "我们今天去公园散步，天气很好。",
    "你好，世界！这是一个测试。",
    "日本語のテキストも混ぜておきます。ありがとう。",
    "한국어 문장도 하나 있습니다.",
    "Emoji: 😀 🎉 👍🏽 🇫🇷 👨‍👩‍👧 ❤️ 🚀 and text after them.",
    "Mixed: hello 世界 🌍 done. The end is near: STOP here.",
    "def add(a, b):\n    return a + b\n",
]
SPECIAL_TOKENS = ["<eos>", "<pad>"]


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
