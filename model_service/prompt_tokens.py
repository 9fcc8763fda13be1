"""A request's input as token ids, the one way every part of kvserve computes them: the model
service before it generates, the gateway before it routes (the page hashes it looks up must be
the ones the worker's manager will store). No torch here: the gateway imports it."""

from __future__ import annotations

from pathlib import Path

from kvserve.model_service import tiny_model


def resolve_model_path(name: str) -> Path:
    """A checkpoint directory, or a built-in preset generated on first use."""
    if name in tiny_model.PRESETS:
        return tiny_model.default_tiny_path(name)
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {name!r} is neither a built-in model ({', '.join(tiny_model.PRESETS)}) "
                         "nor a directory with a config.json")
    return path


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:   # no tokenizer files, or ones that do not read
        text = str(exc).strip().splitlines()
        raise ValueError(f"cannot load a tokenizer from {path}: {text[0] if text else type(exc).__name__}") from None


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    # The tokenizer itself, not its backend's encode: it releases the GIL (tokenizing.py).
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


MAX_ROLE_CHARS = 64   # "system", "user", "assistant", "tool", ... and a template's own


def check_roles(roles) -> None:
    """ValueError for a role no template names: past MAX_ROLE_CHARS it would be rendered and
    tokenized whole, outside the prompt's limits."""
    for i, role in enumerate(roles):
        if len(role) > MAX_ROLE_CHARS:
            raise ValueError(f"messages[{i}].role has {len(role):,} characters; at most {MAX_ROLE_CHARS} are allowed")


def render_chat(tokenizer, chat: list[dict]) -> list[int]:
    """The chat template's tokens with the generation prompt; ValueError saying why the template
    refused the messages."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a prompt instead")
    try:
        out = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # the template rejects the conversation (e.g. roles out of order)
        raise ValueError(f"the chat template rejected the messages: {exc}") from None
    # transformers 5 returns a BatchEncoding here, 4.x a plain list
    return list(out["input_ids"] if hasattr(out, "keys") else out)
