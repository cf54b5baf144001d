"""A chat output split into ``reasoning_content``, ``content`` and ``tool_calls``, whole
or as stream deltas: the server's use of the reasoning parsers
(:mod:`hybridserve.reasoning`) and the tool-call parsers (:mod:`hybridserve.tools`).

Contract: :class:`OutputSplit` describes how one request's outputs are split (built once
per request); :meth:`OutputSplit.new` gives a :class:`ChoiceSplitter` per choice, which
holds that choice's stream state. The reasoning parser runs first and its content feeds
the tool parser, so a tool call written inside the reasoning is not a call. Streamed in
any split, the deltas add up to :meth:`ChoiceSplitter.whole` of the same text (the
parsers' own guarantee, kept by composing them the same way in both modes). Without
``parallel_tool_calls`` only the first call is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridserve.reasoning import ReasoningParser, prompt_opens_reasoning
from hybridserve.tools.parsers import ToolParser


@dataclass
class SplitDelta:
    """What one stream chunk adds to a choice; empty fields are left out of the delta."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.content:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


@dataclass
class WholeSplit:
    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]


@dataclass
class OutputSplit:
    """How to split one request's outputs. ``reasoning`` / ``tool_parser`` None: that
    part is not parsed. ``prompt`` is the rendered prompt (a reasoning block it leaves
    open makes the output start as reasoning). ``constrained``: a grammar shapes the
    output from its first token (a forced tool call, ``response_format``), so the
    output starts as content whatever the prompt or the parser's default says; only
    reasoning tags the grammar itself writes make reasoning."""

    reasoning: type[ReasoningParser] | None = None
    tool_parser: type[ToolParser] | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    parallel_tool_calls: bool = True
    prompt: str = ""
    chat_template_kwargs: dict[str, Any] | None = None
    constrained: bool = False

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tool_parser is not None

    @property
    def tags(self) -> list[str]:
        """The literal tags the active parsers look for in the output text."""
        out = [*self.reasoning.starts, *self.reasoning.ends] if self.reasoning is not None else []
        if self.tool_parser is not None:
            out += [t for t in (getattr(self.tool_parser, "start", ""), getattr(self.tool_parser, "end", "")) if t]
        return out

    @property
    def reports_reasoning(self) -> bool:
        return self.reasoning is not None

    def new(self) -> ChoiceSplitter:
        return ChoiceSplitter(self)


class ChoiceSplitter:
    """One choice's parsers (one instance per choice: it holds the stream's state)."""

    def __init__(self, split: OutputSplit) -> None:
        self.split = split
        self.reasoning: ReasoningParser | None = None
        if split.reasoning is not None:
            cls = split.reasoning
            if split.constrained:
                opens: bool | None = False
            else:
                opens = prompt_opens_reasoning(split.prompt, cls.starts[0], cls.ends[0]) or None
            self.reasoning = cls(opens, split.chat_template_kwargs)
        self.tools = split.tool_parser(split.tools) if split.tool_parser is not None else None
        self.called = False  # a tool call was emitted

    def _keep(self, calls: list[Any]) -> list[Any]:
        return calls if self.split.parallel_tool_calls else calls[:1]

    def whole(self, text: str) -> WholeSplit:
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract(text)
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            got = self.tools.extract(content or "")
            content = got.content
            calls = [c.to_openai() for c in self._keep(got.tool_calls)]
        self.called = bool(calls)
        return WholeSplit(reasoning, content, calls)

    def feed(self, text: str) -> SplitDelta:
        return self._step(text, final=False)

    def finish(self) -> SplitDelta:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> SplitDelta:
        if self.reasoning is not None:
            r = self.reasoning.finish() if final else self.reasoning.feed(text)
            reasoning, content = r.reasoning, r.content
        else:
            reasoning, content = "", text
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            pieces = [self.tools.feed(content)] if content else []
            if final:
                pieces.append(self.tools.finish())
            content = "".join(p.content for p in pieces)
            calls = [
                c.to_openai()
                for p in pieces
                for c in p.tool_calls
                if self.split.parallel_tool_calls or c.index == 0
            ]
            self.called = self.called or bool(calls)
        return SplitDelta(reasoning, content, calls)
