"""Chat templates: the documented built-in one, a model directory's Jinja2 template, the sandbox."""

import json

import pytest

from openai_api.chat_template import TINY_TEMPLATE, load_chat_template

MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]

# A ChatML-style template as models ship it in tokenizer_config.json (whitespace control,
# loop variables, raise_exception, bos_token), rendered as transformers renders it.
CHATML = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' and loop.first %}{{ raise_exception('assistant first') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_builtin_tiny_template_is_role_lines_then_assistant():
    t = load_chat_template("tiny")
    assert t.source == TINY_TEMPLATE
    assert t.render(MESSAGES) == "<|system|>Be terse.\n<|user|>Hi\n<|assistant|>"
    assert t.render(MESSAGES, add_generation_prompt=False) == "<|system|>Be terse.\n<|user|>Hi\n"


def test_model_directory_template_from_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    t = load_chat_template(str(tmp_path))
    assert t.origin.endswith("tokenizer_config.json") and t.bos_token == "<s>" and t.eos_token == "</s>"
    assert t.render(MESSAGES) == ("<s><|im_start|>system\nBe terse.<|im_end|>\n"
                                  "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="messages: the chat template refused them: assistant first"):
        t.render([{"role": "assistant", "content": "x"}])


def test_named_templates_and_jinja_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}],
         "eos_token": "</s>"}))
    assert load_chat_template(str(tmp_path)).render(MESSAGES) == "D</s>"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(str(tmp_path)).render(MESSAGES) == "J"
    override = tmp_path / "mine.jinja"
    override.write_text("{{ messages | length }}")
    assert load_chat_template(str(tmp_path), str(override)).render(MESSAGES) == "2"


def test_directory_without_template_falls_back_to_builtin(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert load_chat_template(str(tmp_path)).source == TINY_TEMPLATE


def test_sandbox_refuses_attribute_escapes(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"}))
    with pytest.raises(ValueError, match="chat template failed"):
        load_chat_template(str(tmp_path)).render(MESSAGES)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages.append(1) }}"}))
    with pytest.raises(ValueError, match="chat template failed"):
        load_chat_template(str(tmp_path)).render(MESSAGES)


def test_template_that_does_not_compile(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(ValueError, match="does not compile"):
        load_chat_template(str(tmp_path))
