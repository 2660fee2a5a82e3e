"""Chat templates: a conversation rendered to prompt text by the model's own Jinja template.

The template is the one the checkpoint ships (``tokenizer_config.json``,
``chat_template.jinja`` or a GGUF file's ``tokenizer.chat_template``), rendered
as transformers' ``apply_chat_template`` renders it: a sandboxed Jinja
environment with ``trim_blocks`` and ``lstrip_blocks``, the variables
``messages``, ``add_generation_prompt``, ``bos_token`` and ``eos_token``, and
the helpers ``raise_exception`` and ``tojson``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache

__all__ = ["render_chat", "chat_messages"]


def chat_messages(user: str, system: str | None = None) -> list[dict[str, str]]:
    """One user turn, led by a system turn when ``system`` is given."""
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": user}]


@lru_cache(maxsize=8)
def _compiled(template: str):
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    return env.from_string(template)


def render_chat(
    template: str,
    messages: Sequence[dict[str, str]],
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text for ``messages``, ending where the assistant's reply starts; ValueError if the template fails."""
    from jinja2 import TemplateError

    try:
        return _compiled(template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except TemplateError as error:
        raise ValueError(f"the model's chat template failed: {error}") from None
