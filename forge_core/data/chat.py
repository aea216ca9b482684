"""Rendering chat-style records (`messages`) with a Jinja chat template, as transformers does.

The environment mirrors transformers' `apply_chat_template` so prompts rendered here match what a model sees
elsewhere. `strftime_now` is deliberately absent: templates fall back to their fixed date, which keeps
prepared data deterministic.

    template = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token, tok.pad_token)
    prompt, completion = template.split_last_turn(messages)
"""

from __future__ import annotations

import json
from functools import lru_cache

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A conversation that the template cannot split into prompt and completion."""


class _GenerationBlock(Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) and renders it."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


class ChatTemplate:
    """A compiled chat template with the tokenizer's special tokens bound as template variables."""

    def __init__(self, template: str, bos_token: str | None, eos_token: str, pad_token: str | None) -> None:
        self._template = _compile(template)
        self._variables = {"bos_token": bos_token or "", "eos_token": eos_token, "pad_token": pad_token or ""}

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self._variables
        )

    def split_last_turn(self, messages: list[dict]) -> tuple[str, str]:
        """(prompt up to the final assistant turn with the generation prompt, what the full rendering adds);
        ChatTemplateError when the template rewrites earlier turns, so the prompt is not a prefix."""


        prompt = self.render(messages[:-1], add_generation_prompt=True)
        full = self.render(messages, add_generation_prompt=False)
        if not full.startswith(prompt):
            raise ChatTemplateError(
                "the chat template renders the full conversation differently from its prompt prefix, so the "
                "completion cannot be cut out; use a template that only appends the assistant turn"
            )
        return prompt, full[len(prompt):]
