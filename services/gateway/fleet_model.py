"""The model a gateway's fleet serves: the one of its own --model, whose tokenizer it routes
with. A worker serving another (another architecture or vocabulary, or a tokenizer that makes
other ids of the same text) takes nothing from this gateway: its cache could never match the
gateway's hashes, and a stream moved onto it would go on in another model. Its shape is compared
too (ModelInfo.config_digest); weights are not: two checkpoints of one shape and tokenizer (a
model and its fine-tune) look alike here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.model_service.model.config import ModelConfig
from kvserve.model_service.prompt_tokens import tokenizer_digest


@dataclass(frozen=True)
class FleetModel:
    architecture: str
    vocab_size: int
    tokenizer_digest: str
    config_digest: str = ""   # its shape (ModelConfig.digest)

    @classmethod
    def of(cls, path: Path, tokenizer) -> FleetModel:
        """The gateway's model: `path`'s config.json and the tokenizer loaded from it."""
        config = ModelConfig.from_pretrained(path)
        return cls(config.architecture, config.vocab_size, tokenizer_digest(tokenizer), config.digest())

    def differs(self, info: pb.ModelInfo) -> str | None:
        """Why a worker reporting `info` serves another model; None when it serves this one. What
        a worker leaves out (an older version's tokenizer digest) is not compared."""
        theirs = f"{info.name} ({info.architecture or 'an architecture it does not say'}, a vocabulary of " \
                 f"{info.vocab_size or 'a size it does not say'})"
        if info.architecture not in ("", self.architecture) or info.vocab_size not in (0, self.vocab_size):
            return (f"it serves {theirs}; the gateway's --model is {self.architecture} with a vocabulary of "
                    f"{self.vocab_size}")
        if info.config_digest and self.config_digest and info.config_digest != self.config_digest:
            return (f"it serves {theirs}, of another shape than the gateway's --model (its sizes, layers, heads, "
                    f"rope, biases, norms or windows: config digest {info.config_digest}, the gateway's "
                    f"{self.config_digest})")
        if info.tokenizer_digest and info.tokenizer_digest != self.tokenizer_digest:
            return (f"its tokenizer makes other ids of the same text than the gateway's --model (tokenizer "
                    f"digest {info.tokenizer_digest}, the gateway's {self.tokenizer_digest})")
        return None


def unroutable(info: pb.ModelInfo) -> str | None:
    """Why no request can be routed by what a worker says of itself (a bug, or something that
    is not a kvserve worker): the board's page size and every fit are computed from these, and
    one worker's page size of 0 made every routing divide by zero."""
    return None if info.page_size else "it reports a page size of 0"
