"""Chat templates: a model's Jinja2 ``chat_template`` rendered as transformers does, or the built-in one.

Sources, first found wins: an explicit ``--chat-template`` file; the model directory's
``chat_template.jinja``; ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
``{"name", "template"}`` of which ``default`` is taken); else the built-in ``TINY_TEMPLATE``,
one line per message and the assistant's turn opened at the end::

    <|system|>You are terse.\\n<|user|>Hi\\n<|assistant|>

Rendering uses Jinja2's ``ImmutableSandboxedEnvironment`` with the same settings and helpers
as transformers (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, ``raise_exception``,
``tojson``, ``strftime_now``); the variables are ``messages``, ``add_generation_prompt``,
``bos_token`` and ``eos_token``. A template's own ``raise_exception`` becomes a ValueError
(the front answers 400 naming ``messages``).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.model_files import TINY_CHAT_TEMPLATE

log = logging.getLogger(__name__)

TINY_TEMPLATE = TINY_CHAT_TEMPLATE  # the built-in model's, also in its tokenizer_config.json (engine.model_files)


class TemplateRaised(Exception):
    """``raise_exception(...)`` called by a template: the conversation does not fit it."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(value: object, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled template with its special tokens. Immutable after construction; thread-safe."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = "built-in"):
        self.source, self.bos_token, self.eos_token, self.origin = source, bos_token, eos_token, origin
        self._template = _environment().from_string(source)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text; ValueError with the template's reason for a conversation it refuses."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateRaised as e:
            raise ValueError(f"messages: the chat template refused them: {e}") from e
        except jinja2.TemplateError as e:  # a sandbox violation or a template bug, seen at render time
            raise ValueError(f"messages: the chat template failed: {e}") from e


def _token_text(value: object) -> str:
    """tokenizer_config.json writes a special token as a string or as ``{"content": ...}``."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _pick(template: object) -> str | None:
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


def load_chat_template(model: str, override_path: str = "") -> ChatTemplate:
    """The template for ``model`` ("tiny" or a checkpoint directory). Raises ValueError for an
    unreadable ``override_path`` or a template that does not compile."""
    config: dict = {}
    model_dir = Path(model)
    cfg_path = model_dir / "tokenizer_config.json"
    if model != "tiny" and cfg_path.is_file():
        config = json.loads(cfg_path.read_text())
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    candidates = []
    if override_path:
        candidates.append((Path(override_path).read_text(), override_path))
    if model != "tiny" and (model_dir / "chat_template.jinja").is_file():
        candidates.append(((model_dir / "chat_template.jinja").read_text(), str(model_dir / "chat_template.jinja")))
    picked = _pick(config.get("chat_template"))
    if picked is not None:
        candidates.append((picked, str(cfg_path)))
    if not candidates:
        if model != "tiny":
            log.warning("model %s has no chat_template; chat uses the built-in <|role|> template", model)
        return ChatTemplate(TINY_TEMPLATE, bos, eos)
    source, origin = candidates[0]
    try:
        return ChatTemplate(source, bos, eos, origin)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template from {origin} does not compile: {e}") from e
