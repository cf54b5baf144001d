"""Reasoning parsers: a model's output split into ``reasoning_content`` and ``content``.

By parser name (vLLM's ``--reasoning-parser`` names):

- ``qwen3``: ``<think>...</think>``. The output starts as content unless the prompt
  left a ``<think>`` open (templates that write ``<think>\\n`` into the generation
  prompt; :func:`prompt_opens_reasoning` tells): then it starts as reasoning. Text
  outside the block is content.
- ``deepseek_r1``: the output starts as reasoning (the template opens the block; a
  leading ``<think>`` the model writes itself is dropped) up to ``</think>``; an output
  that never closes it is all reasoning.
- ``nemotron_v3``: ``deepseek_r1``'s rule for Nemotron 3; with
  ``chat_template_kwargs={"enable_thinking": False}`` (the template closes the block in
  the prompt) the whole output is content.
- ``granite_thinking``: Granite's ``<think>`` format (the same as ``nemotron_v3``), with
  the newlines the template writes after ``</think>`` dropped from the content's start.
- ``granite``: Granite 3.x's plain-text markers, ``Here is my thought process:`` (or
  ``Here's ...``) opening the reasoning and ``Here is my response:`` (or ``Here's ...``)
  opening the content; without the first marker the output is all content.

As for the tool-call parsers, one pure function of the text so far (``_split``) serves
:meth:`ReasoningParser.extract` and the streaming :meth:`ReasoningParser.feed` /
:meth:`ReasoningParser.finish`; a partial tag at the end is held back until it
resolves, so the streamed pieces concatenate to the non-streamed split. A server
composes the two kinds: content deltas from the reasoning parser feed the tool parser.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridserve.tools.parsers import held_back


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


def prompt_opens_reasoning(prompt: str, start: str = "<think>", end: str = "</think>") -> bool:
    """True when ``prompt`` ends inside an open reasoning block (its last ``start`` comes
    after its last ``end``), so the output begins as reasoning."""
    i = prompt.rfind(start)
    return i >= 0 and prompt.rfind(end) < i


class ReasoningParser:
    """Splits one output (one instance per output: it holds the stream's state)."""

    name = ""
    starts: Sequence[str] = ("<think>",)
    ends: Sequence[str] = ("</think>",)
    starts_in_reasoning = False
    strip_content_newlines = False

    def __init__(self, prompt_opens: bool | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        """``prompt_opens``: the prompt left a reasoning block open (None: the parser's
        default); ``chat_template_kwargs``: the request's, as the template saw them."""
        self.in_reasoning = self.starts_in_reasoning if prompt_opens is None else prompt_opens
        kwargs = chat_template_kwargs or {}
        self.thinking = kwargs.get("enable_thinking", True) is not False
        self._text = ""
        self._sent = (0, 0)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if not self.thinking:
            return "", text
        if self.in_reasoning:
            head, body = "", text
            for tag in self.starts:  # the model may write the opening tag itself
                if body.startswith(tag):
                    body = body[len(tag) :]
                    break
                if not final and body and tag.startswith(body):
                    return "", ""
        else:
            i, tag = _find_first(text, self.starts)
            if i < 0:
                return "", text if final else text[: len(text) - held_back(text, self.starts)]
            head, body = text[:i], text[i + len(tag) :]
        j, tag = _find_first(body, self.ends)
        if j < 0:
            return (body if final else body[: len(body) - held_back(body, self.ends)]), head
        content = body[j + len(tag) :]
        if self.strip_content_newlines:
            content = content.lstrip("\n")
        return body[:j], head + content

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning_content, content)`` of a whole output (None where empty)."""
        reasoning, content = self._split(text, final=True)
        return reasoning or None, content or None

    def feed(self, delta_text: str) -> ReasoningDelta:
        self._text += delta_text
        return self._diff(self._split(self._text, final=False))

    def finish(self) -> ReasoningDelta:
        return self._diff(self._split(self._text, final=True))

    def _diff(self, split: tuple[str, str]) -> ReasoningDelta:
        reasoning, content = split
        sent_r, sent_c = self._sent
        self._sent = (len(reasoning), len(content))
        return ReasoningDelta(reasoning[sent_r:], content[sent_c:])


def _find_first(text: str, tags: Sequence[str]) -> tuple[int, str]:
    """The earliest occurrence of any of ``tags`` (-1 if none)."""
    best, found = -1, ""
    for tag in tags:
        i = text.find(tag)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, tag
    return best, found


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True


class NemotronV3ReasoningParser(DeepSeekR1ReasoningParser):
    name = "nemotron_v3"


class GraniteThinkingReasoningParser(NemotronV3ReasoningParser):
    name = "granite_thinking"
    strip_content_newlines = True


class GraniteReasoningParser(ReasoningParser):
    name = "granite"
    starts = ("Here is my thought process:", "Here's my thought process:")
    ends = ("Here is my response:", "Here's my response:")


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p
    for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser, NemotronV3ReasoningParser,
              GraniteThinkingReasoningParser, GraniteReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name``; ValueError naming the choices."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"--reasoning-parser {name!r} is not supported; choose one of {sorted(REASONING_PARSERS)}"
        ) from None
