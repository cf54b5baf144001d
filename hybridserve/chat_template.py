"""Chat templates: Jinja2 sources from ``tokenizer_config.json`` (or a file), compiled
once in a sandbox and rendered per request the way Hugging Face tokenizers do.

Contract: :func:`compile_chat_template` raises :class:`ChatTemplateError` for a
template that does not parse; :func:`render_chat` raises it for a conversation the
template refuses (its ``raise_exception(...)``), fails on with any exception, or
renders to more than ``max_chars`` characters. The sandbox is immutable: a template
cannot mutate the objects it is given or reach Python internals.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A template failed to compile, or refused or failed to render a conversation."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja2's own tojson escapes HTML characters, which changes prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers' marker of the assistant
    tokens (for training masks); rendering passes its body through unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def pick_template(source: str | list[dict[str, Any]] | None) -> str | None:
    """The template text from a tokenizer config's ``chat_template`` value, which may
    be a string or a list of named templates (the one named ``default`` is used)."""
    if source is None or isinstance(source, str):
        return source
    named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
    return named.get("default") or next(iter(named.values()), None)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile ``source``; raises ChatTemplateError naming the problem."""
    try:
        return _environment().from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from e


def render_chat(
    template: jinja2.Template,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    bos_token: str | None = None,
    eos_token: str | None = None,
    max_chars: int | None = None,
    **context: Any,
) -> str:
    """The prompt text for ``messages``; raises ChatTemplateError if the template
    refuses the conversation, fails on it, or its output passes ``max_chars``.

    ``context`` holds further template variables (``tools``, ``documents``, a
    request's ``chat_template_kwargs`` such as ``enable_thinking``), as transformers'
    ``apply_chat_template(**kwargs)`` passes them. ``continue_final_message``: the text
    ends where the last message's content ends (what the template writes after it,
    an end-of-turn tag, is cut), so the model continues that message."""
    # As transformers does: a key whose value is None is left out of its message (an
    # API's ``content: null`` or ``tool_calls: null``), since templates test for
    # missing keys and would write a literal "None".
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    pieces: list[str] = []
    size = 0
    try:
        # Piece by piece, so a runaway template stops at the cap instead of filling
        # memory first.
        # The fixed variables win over same-named ones from the request.
        reserved = ("messages", "add_generation_prompt", "bos_token", "eos_token")
        context = {k: v for k, v in context.items() if k not in reserved}
        for piece in template.generate(
            **context,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
        ):
            size += len(piece)
            if max_chars is not None and size > max_chars:
                raise ChatTemplateError(
                    f"the chat template's output for these messages passes {max_chars} "
                    "characters, more than the context can hold"
                )
            pieces.append(piece)
    except ChatTemplateError:
        raise
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template refused the messages: {e}") from e
    except Exception as e:
        # A template is code from the checkpoint: whatever it raises (OverflowError
        # from a huge range, RecursionError, ...) is about this conversation, not the
        # server.
        raise ChatTemplateError(
            f"the chat template failed on the messages: {type(e).__name__}: {e}"
        ) from e
    text = "".join(pieces)
    if continue_final_message:
        text = _cut_after_final(text, messages[-1].get("content"))
    return text


def _cut_after_final(text: str, content: Any) -> str:
    # As transformers does: cut after the last occurrence of the final message's text.
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    final = content or ""
    if not final.strip():
        raise ChatTemplateError("continue_final_message needs a last message with content")
    at = text.rfind(final.strip())
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message: the chat template does not write the last message's "
            "content verbatim, so it cannot be continued"
        )
    if text[at : at + len(final.lstrip())] == final.lstrip():
        return text[: at + len(final.lstrip())]
    return text[: at + len(final.strip())]
