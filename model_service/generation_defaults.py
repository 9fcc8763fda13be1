"""The sampling a request gets for what it leaves unset: the checkpoint's own recommendation
(its generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, as vLLM's
--generation-config auto and SGLang read it), or, with --generation-config none or no such file,
plain sampling (temperature 1, every other filter off). A value the file gets wrong (out of range,
not a number) is left out, said once in the log, rather than failing every request."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, fields
from pathlib import Path

log = logging.getLogger(__name__)

FILE = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0            # off
    min_p: float = 0.0        # off
    repetition_penalty: float = 1.0

    def changed(self) -> dict[str, float]:
        """The defaults that differ from plain sampling."""
        plain = GenerationDefaults()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(plain, f.name)}


def _valid(name: str, value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    if name == "temperature":
        return 0 <= value <= 100
    if name == "top_p":
        return 0 < value <= 1
    if name == "top_k":   # -1 and 0 both mean off in the configs seen
        return isinstance(value, int) and value >= -1
    if name == "min_p":
        return 0 <= value <= 1
    return 0.01 <= value <= 100   # repetition_penalty, as a request may set it


def load(model_path: Path, mode: str = "auto") -> GenerationDefaults:
    """The defaults for the checkpoint at `model_path` (`mode` "none": plain sampling)."""
    path = Path(model_path) / FILE
    if mode == "none" or not path.is_file():
        return GenerationDefaults()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("%s is not readable JSON (%s): requests get plain sampling for what they leave unset", path, exc)
        return GenerationDefaults()
    if not isinstance(raw, dict):
        log.warning("%s is not a JSON object: requests get plain sampling for what they leave unset", path)
        return GenerationDefaults()
    taken = {}
    for f in fields(GenerationDefaults):
        if f.name not in raw or raw[f.name] is None:
            continue
        value = raw[f.name]
        if not _valid(f.name, value):
            log.warning("%s: %s %r is out of range; left out of the defaults", path, f.name, value)
            continue
        taken[f.name] = max(0, value) if f.name == "top_k" else float(value)
    defaults = GenerationDefaults(**taken)
    if defaults.changed():
        log.info("sampling defaults from the model's %s for what a request leaves unset: %s "
                 "(--generation-config none: temperature 1, no filters)", FILE,
                 ", ".join(f"{k} {v:g}" for k, v in defaults.changed().items()))
    return defaults
