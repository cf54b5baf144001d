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


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without handing them the
    type itself (whose attributes reach further than a template needs)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace()``, refusing attribute names that start with ``_`` (as
    transformers' renderer does: such names lead towards Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._refuse_private(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._refuse_private(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _refuse_private(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not set the namespace attribute {name!r} (a leading underscore)"
            )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


# The names a message's reasoning comes under; templates read the first (most) or
# ``thinking`` (gpt-oss and others).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Appended to the final message when it is continued, to find where its text ends.
_CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with its reasoning (the first of :data:`REASONING_FIELDS` it has)
    also under ``reasoning_content`` and, unless it has its own, ``thinking``."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _mark_final(message: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A copy of the final ``message`` whose text ends in :data:`_CONTINUE_MARK`, and
    its text before the mark (the last text part of a list content)."""
    content = message.get("content")
    if isinstance(content, list):
        parts = [dict(p) if isinstance(p, dict) else p for p in content]
        for part in reversed(parts):
            if isinstance(part, dict) and "text" in part:
                text = part["text"]
                part["text"] = text + _CONTINUE_MARK
                return {**message, "content": parts}, text
        raise ChatTemplateError("continue_final_message: the last message has no text to continue")
    if not isinstance(content, str):
        raise ChatTemplateError("continue_final_message needs a last message with content")
    return {**message, "content": content + _CONTINUE_MARK}, content


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
    ``apply_chat_template(**kwargs)`` passes them; ``tools`` and ``documents`` are
    always defined (None when not given), as there. ``continue_final_message``: the
    text ends where the last message's content ends (what the template writes after
    it, an end-of-turn tag, is cut), so the model continues that message.

    The messages are what transformers' renderer hands a template: a key whose value
    is None is left out (an API's ``content: null`` or ``tool_calls: null``; templates
    test for missing keys and would write a literal "None"), and a message's reasoning
    under any of :data:`REASONING_FIELDS` is also under ``reasoning_content`` and
    ``thinking``."""
    messages = [_with_reasoning_aliases({k: v for k, v in m.items() if v is not None}) for m in messages]
    final_text = None
    if continue_final_message:
        if not messages:
            raise ChatTemplateError("continue_final_message needs a last message with content")
        messages[-1], final_text = _mark_final(messages[-1])
    context.setdefault("tools", None)
    context.setdefault("documents", None)
    pieces: list[str] = []
    size = 0
    try:
        # Piece by piece, so a runaway template stops at the cap instead of filling
        # memory first.
        # The fixed variables win over same-named ones from the request.
        reserved = ("messages", "add_generation_prompt", "bos_token", "eos_token")
        context = {k: v for k, v in context.items() if k not in reserved}
        # A tokenizer without a BOS (or EOS) token leaves the name undefined, as
        # transformers does (it passes the tokenizer's special tokens it has).
        specials = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None}
        for piece in template.generate(
            **context,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **specials,
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
    if final_text is not None:
        text = _cut_at_mark(text, final_text)
    return text


def _cut_at_mark(text: str, final: str) -> str:
    """``text`` up to where the continued message's text ends: the last
    :data:`_CONTINUE_MARK`; where the template trimmed the space after it, the text
    before it without trailing whitespace."""
    mark = _CONTINUE_MARK.strip()
    if final.strip() not in text or mark not in text:
        raise ChatTemplateError(
            "continue_final_message: the chat template does not write the last message's "
            "content verbatim, so it cannot be continued"
        )
    at = text.rindex(mark)
    if text.startswith(_CONTINUE_MARK, at):
        return text[:at]
    return text[:at].rstrip()
