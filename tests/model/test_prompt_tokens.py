"""model_service/prompt_tokens.py, which the model service and the gateway both read inputs with:
ChatMessages' template options (a template's own variables reach it, apply_chat_template's
arguments cannot be set through them, what is not a JSON object is refused by name), and a
checkpoint whose tokenizer cannot be loaded told why."""

from __future__ import annotations

import json
import shutil

import pytest

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.model_service import prompt_tokens

THINKING_TEMPLATE = (   # Qwen3's switch, in the tiny tokenizer's markup
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<|system|><|end|>{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tiny_dirs, tmp_path_factory):
    path = tmp_path_factory.mktemp("thinking") / "tiny"
    shutil.copytree(tiny_dirs["tiny"], path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return prompt_tokens.load_tokenizer(path)


def chat(**options) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hello there")], **options)


def render(tokenizer, msg: pb.ChatMessages) -> list[str]:
    turns = [{"role": m.role, "content": m.content} for m in msg.messages]
    return tokenizer.convert_ids_to_tokens(prompt_tokens.render_chat(tokenizer, turns, prompt_tokens.chat_options(msg)))


def test_a_templates_own_variable_reaches_it(tokenizer):
    thinking = render(tokenizer, chat())
    assert thinking[-1] == "<|assistant|>"
    assert render(tokenizer, chat(template_kwargs='{"enable_thinking": true}')) == thinking
    assert render(tokenizer, chat(template_kwargs='{"enable_thinking": false}')) == thinking + ["<|system|>", "<|end|>"]
    assert render(tokenizer, chat(add_generation_prompt=False)) == thinking[:-1]


def test_the_template_calls_own_arguments_and_special_tokens_are_no_template_variables(tokenizer):
    """sanitize_control_tokens, say, is an argument of apply_chat_template in the transformers
    installed here: given as a variable it changed how the prompt was tokenized."""
    for kwargs in ('{"sanitize_control_tokens": true}', '{"pad_token": "x"}'):
        msg = chat(template_kwargs=kwargs)
        with pytest.raises(ValueError, match="template_kwargs may not set"):
            render(tokenizer, msg)
    assert render(tokenizer, chat(template_kwargs='{"kwargs": 1}')) == render(tokenizer, chat())


def test_continuing_the_last_message_leaves_its_turn_open(tokenizer):
    msg = chat()
    msg.messages.add(role="assistant", content="general")
    tokens = render(tokenizer, pb.ChatMessages(messages=msg.messages, continue_final_message=True))
    assert tokens[-1] != "<|end|>" and tokens[-3:-1] != ["<|end|>", "<|assistant|>"]
    assert tokens == render(tokenizer, pb.ChatMessages(messages=msg.messages, add_generation_prompt=False))[:-1]


@pytest.mark.parametrize("options, words", [
    (dict(continue_final_message=True, add_generation_prompt=True), "cannot be given with add_generation_prompt true"),
    (dict(template_kwargs="[1, 2]"), "template_kwargs is not a JSON object"),
    (dict(template_kwargs="{not json"), "template_kwargs is not a JSON object"),
    (dict(template_kwargs="[" * 100_000 + "]" * 100_000), "template_kwargs has 200,000 characters; at most 65,536 are allowed"),
    (dict(template_kwargs="[" * 30_000 + "]" * 30_000), "template_kwargs is not a JSON object"),   # too deep to parse
    (dict(template_kwargs='{"add_generation_prompt": false}'), "template_kwargs may not set add_generation_prompt"),
    (dict(template_kwargs='{"messages": [], "bos_token": "x"}'), "may not set bos_token, messages: they are"),
])
def test_options_that_cannot_be_used_are_refused_saying_why(options, words):
    with pytest.raises(ValueError, match=words):
        prompt_tokens.chat_options(chat(**options))


def test_a_checkpoint_without_tokenizer_files_is_told_so(tiny_dirs, tmp_path):
    """transformers' own reason was cut to its first line, which names nothing."""
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_dirs["tiny"] / name, tmp_path / name)
    with pytest.raises(ValueError, match=r"cannot load a tokenizer from .*: it has none of the usual tokenizer "
                                         r"files \(tokenizer.json, tokenizer.model, vocab.json"):
        prompt_tokens.load_tokenizer(tmp_path)


NAMED_TEMPLATE = (   # a template that renders a speaker's name where one is given, as OpenAI's clients send it
    "{% for message in messages %}<|{{ message['role'] }}|>{% if message.name is defined %}{{ message.name }}: "
    "{% endif %}{{ message['content'] }}<|end|>{% endfor %}")


def test_a_speakers_name_reaches_the_template_only_where_it_is_given(tiny_dirs, tmp_path):
    """The HTTP front dropped OpenAI's message `name`: a template that renders it saw another
    conversation than the client sent."""
    shutil.copytree(tiny_dirs["tiny"], tmp_path / "tiny")
    config = json.loads((tmp_path / "tiny" / "tokenizer_config.json").read_text())
    config["chat_template"] = NAMED_TEMPLATE
    (tmp_path / "tiny" / "tokenizer_config.json").write_text(json.dumps(config))
    tok = prompt_tokens.load_tokenizer(tmp_path / "tiny")
    msg = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hello there", name="ann"),
                                    pb.ChatMessage(role="user", content="hello there"),
                                    pb.ChatMessage(role="user", content="hello there", name="")])
    turns = prompt_tokens.chat_turns(msg.messages)
    assert turns == [{"role": "user", "content": "hello there", "name": "ann"},
                     {"role": "user", "content": "hello there"},
                     {"role": "user", "content": "hello there", "name": ""}]
    text = tok.decode(prompt_tokens.render_chat(tok, turns, prompt_tokens.chat_options(msg)))
    assert "<|user|>ann: hello there<|end|><|user|>hello there<|end|><|user|>: hello there" in text


def test_a_name_past_64_characters_is_refused_by_position():
    ok = pb.ChatMessage(role="user", content="", name="n" * 64)
    prompt_tokens.check_speakers([ok])
    with pytest.raises(ValueError, match=r"^messages\[1\].name has 65 characters; at most 64 are allowed$"):
        prompt_tokens.check_speakers([ok, pb.ChatMessage(role="user", content="", name="n" * 65)])
