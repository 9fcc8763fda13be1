"""A request's input as token ids, the one way every part of kvserve computes them: the model
service before it generates, the gateway before it routes (the page hashes it looks up must be
the ones the worker's manager will store). No torch here: the gateway imports it."""

from __future__ import annotations

import hashlib
import inspect
import json
import threading
from dataclasses import dataclass, field
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


# Files a Hugging Face tokenizer is commonly read from: named when a load fails and none is there.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:   # the directory's files alone: no hub, no code of the checkpoint's own (an auto_map)
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as exc:   # noqa: BLE001 - no tokenizer files, or ones that do not read (tokenizers
        # raises a bare Exception for a tokenizer.json it cannot parse, transformers a KeyError)
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"cannot load a tokenizer from {path}: it has none of the usual tokenizer files "
                             f"({', '.join(TOKENIZER_FILES)})") from None
        raise ValueError(f"cannot load a tokenizer from {path}: {joined_lines(exc)[:1000]}") from None


def joined_lines(exc: BaseException) -> str:
    """An error's whole message on one line: transformers says its reason after the first
    ("Class validation error for validator ...:", then why)."""
    return " ".join(line.strip() for line in (str(exc).strip() or type(exc).__name__).splitlines() if line.strip())


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    # The tokenizer itself, not its backend's encode: it releases the GIL (tokenizing.py).
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


# Texts a tokenizer_digest encodes: spaces, digits, accents, an emoji, something special-looking.
_PROBE_TEXTS = ("Hello, world!", "  Ünïcödé\tnew\nlines 1234567 <|x|></s>[INST] 🙂", "")


def tokenizer_digest(tokenizer) -> str:
    """16 hex digits that differ between tokenizers making other ids of the same text: its
    vocabulary, the ids of a few probe texts (what it normalizes, splits and adds around them)
    and its chat template. Read from what it does rather than from its files' bytes, so that
    processes loading one checkpoint agree (a transformers or tokenizers version that reads
    the same files otherwise may not). A gateway routes only to workers whose digest is its
    own (services/gateway/fleet_model.py)."""
    h = hashlib.sha256()
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    h.update(json.dumps(vocab, ensure_ascii=False).encode())
    for text in _PROBE_TEXTS:
        h.update(json.dumps(encode(tokenizer, text)).encode())
    h.update(json.dumps(getattr(tokenizer, "chat_template", None), sort_keys=True).encode())
    return h.hexdigest()[:16]


MAX_ROLE_CHARS = 64   # "system", "user", "assistant", "tool", ... and a template's own
MAX_NAME_CHARS = 64   # a speaker's name, as OpenAI bounds it


def check_speakers(messages) -> None:
    """ValueError for a role or a name past its bound (ChatMessage's role and name): either
    would be rendered and tokenized whole, outside the prompt's limits."""
    for i, m in enumerate(messages):
        if len(m.role) > MAX_ROLE_CHARS:
            raise ValueError(f"messages[{i}].role has {len(m.role):,} characters; at most {MAX_ROLE_CHARS} are allowed")
        if len(m.name) > MAX_NAME_CHARS:
            raise ValueError(f"messages[{i}].name has {len(m.name):,} characters; at most {MAX_NAME_CHARS} are allowed")


def chat_turns(messages) -> list[dict]:
    """ChatMessages' messages as the chat template takes them; a name only where one is set,
    so that templates testing `message.name is defined` see what OpenAI's clients meant."""
    return [{"role": m.role, "content": m.content, "name": m.name} if m.HasField("name")
            else {"role": m.role, "content": m.content} for m in messages]


MAX_TEMPLATE_KWARGS_CHARS = 64 << 10
# apply_chat_template's own arguments and the variables it sets: a client's template variable
# may not stand in for them (it would change what is rendered, or how, behind the options' backs).
# (render_chat also refuses the installed transformers' own arguments and the tokenizer's special
# tokens, whatever their version adds.)
RESERVED_TEMPLATE_NAMES = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
    "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
    "additional_special_tokens", "raise_exception", "strftime_now"})


@dataclass(frozen=True)
class ChatOptions:
    """How the chat template renders a conversation (ChatMessages' options)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict = field(default_factory=dict)


def chat_options(messages) -> ChatOptions:
    """A ChatMessages' template options; ValueError saying what is wrong with them."""
    add = messages.add_generation_prompt if messages.HasField("add_generation_prompt") else \
        not messages.continue_final_message
    if add and messages.continue_final_message:
        raise ValueError("continue_final_message continues the last message: it cannot be given with "
                         "add_generation_prompt true")
    kwargs = {}
    if messages.template_kwargs:
        if len(messages.template_kwargs) > MAX_TEMPLATE_KWARGS_CHARS:
            raise ValueError(f"template_kwargs has {len(messages.template_kwargs):,} characters; at most "
                             f"{MAX_TEMPLATE_KWARGS_CHARS:,} are allowed")
        try:
            kwargs = json.loads(messages.template_kwargs)
        except (ValueError, RecursionError):
            raise ValueError("template_kwargs is not a JSON object") from None
        if not isinstance(kwargs, dict):
            raise ValueError("template_kwargs is not a JSON object")
        taken = sorted(RESERVED_TEMPLATE_NAMES.intersection(kwargs))
        if taken:
            raise ValueError(f"template_kwargs may not set {', '.join(taken)}: "
                             + ("they are" if len(taken) > 1 else "it is") + " the template call's own")
    return ChatOptions(add, messages.continue_final_message, kwargs)


def _check_not_arguments(tokenizer, kwargs: dict) -> None:
    """ValueError when a template variable would be taken as one of apply_chat_template's own
    arguments, or stand in for a special token, in the transformers installed here."""
    own = {name for name, p in inspect.signature(tokenizer.apply_chat_template).parameters.items()
           if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    own.update(getattr(tokenizer, "special_tokens_map", {}) or {})
    taken = sorted(own.intersection(kwargs))
    if taken:
        raise ValueError(f"template_kwargs may not set {', '.join(taken)}: "
                         + ("they are" if len(taken) > 1 else "it is") + " the template call's own")


_PROBE_CHAT = [{"role": "user", "content": "  kvserve probe one \n"},
               {"role": "assistant", "content": "<think>kvserve probe two</think>kvserve probe three"},
               {"role": "user", "content": "\nkvserve probe four  "}]


TEMPLATE_PROBE_S = 10.0   # three short messages rendered within this, or the template is refused


def keeps_message_text(tokenizer, timeout_s: float = TEMPLATE_PROBE_S) -> bool:
    """Whether the chat template renders every message's text whole: then a conversation's
    bytes bound its tokens from below (prompt_bound.py). Llama 3's trims each message and Qwen3's
    drops earlier turns' <think> blocks: for them the messages' size bounds nothing. ValueError
    for a template that does not render the probe within `timeout_s`: each chat request would
    hold a tokenizer thread as long (the render cannot be stopped: its thread is left behind)."""
    if not getattr(tokenizer, "chat_template", None):
        return True   # no chat is served
    rendered: list = []

    def render() -> None:
        try:
            rendered.append(tokenizer.apply_chat_template(_PROBE_CHAT, tokenize=False, add_generation_prompt=True))
        except Exception:   # a template that wants other roles: nothing is known of it
            rendered.append(None)

    probe = threading.Thread(target=render, name="chat-template-probe", daemon=True)
    probe.start()
    probe.join(timeout_s)
    if probe.is_alive():
        raise ValueError(f"the chat template did not render three short messages within {timeout_s:g} s; a chat "
                         "request would hold a tokenizer thread as long (a loop in its chat_template?)")
    text = rendered[0]
    return isinstance(text, str) and all(m["content"] in text for m in _PROBE_CHAT)


def render_chat(tokenizer, chat: list[dict], options: ChatOptions = ChatOptions()) -> list[int]:
    """The chat template's tokens, the generation prompt added unless `options` say otherwise;
    ValueError saying why the template refused the messages."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a prompt instead")
    if options.template_kwargs:
        _check_not_arguments(tokenizer, options.template_kwargs)
    try:
        out = tokenizer.apply_chat_template(chat, add_generation_prompt=options.add_generation_prompt,
                                            continue_final_message=options.continue_final_message, tokenize=True,
                                            **options.template_kwargs)
    except Exception as exc:  # the template rejects the conversation (e.g. roles out of order)
        raise ValueError(f"the chat template rejected the messages: {exc}") from None
    # transformers 5 returns a BatchEncoding here, 4.x a plain list
    return list(out["input_ids"] if hasattr(out, "keys") else out)
