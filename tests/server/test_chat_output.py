"""The chat reply split (reasoning, content, tool calls): streamed in any split, the
deltas add up to the whole reply, with the reasoning parser feeding the tool parser
and ``parallel_tool_calls=False`` keeping the first call."""

from __future__ import annotations

import json
import random

import pytest

from hybridserve.reasoning import get_reasoning_parser
from hybridserve.server.chat_output import OutputSplit
from hybridserve.tools.parsers import get_tool_parser

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "f", "arguments": {"x": %d}}\n</tool_call>'
TEXTS = [
    "<think>plan <tool_call> not a call</think>answer " + CALL % 1 + "\n" + CALL % 2,
    "no reasoning, " + CALL % 3,
    "<think>unclosed reasoning " + CALL % 4,
    "plain text only",
    "",
]


def _split(parallel: bool, reasoning: bool = True, tools: bool = True) -> OutputSplit:
    return OutputSplit(
        reasoning=get_reasoning_parser("qwen3") if reasoning else None,
        tool_parser=get_tool_parser("hermes") if tools else None,
        tools=TOOLS,
        parallel_tool_calls=parallel,
    )


def _streamed(split: OutputSplit, text: str, rng: random.Random):
    s = split.new()
    reasoning = content = ""
    calls: dict[int, dict] = {}
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(0, 8))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    for d in [*(s.feed(p) for p in pieces if p), s.finish()]:
        reasoning += d.reasoning
        content += d.content
        for c in d.tool_calls:
            entry = calls.setdefault(c["index"], {"name": None, "arguments": ""})
            if "id" in c:
                entry["name"] = c["function"]["name"]
            entry["arguments"] += c["function"]["arguments"]
    return reasoning, content, [calls[i] for i in sorted(calls)], s.called


@pytest.mark.parametrize("parallel", [True, False])
def test_streamed_split_adds_up_to_whole(parallel: bool) -> None:
    rng = random.Random(0)
    for text in TEXTS:
        whole = _split(parallel).new()
        w = whole.whole(text)
        for _ in range(20):
            reasoning, content, calls, called = _streamed(_split(parallel), text, rng)
            assert reasoning == (w.reasoning or "")
            assert content.strip() == (w.content or "").strip()
            assert [(c["name"], c["arguments"]) for c in calls] == [
                (c["function"]["name"], c["function"]["arguments"]) for c in w.tool_calls
            ]
            assert called == whole.called == bool(w.tool_calls)


def test_what_is_a_call() -> None:
    w = _split(True).new().whole(TEXTS[0])
    # The tag inside the reasoning is reasoning, not a call.
    assert w.reasoning == "plan <tool_call> not a call"
    assert [json.loads(c["function"]["arguments"]) for c in w.tool_calls] == [{"x": 1}, {"x": 2}]
    assert w.content.strip() == "answer"
    assert len(_split(False).new().whole(TEXTS[0]).tool_calls) == 1
    # Unclosed reasoning: all of it is reasoning, calls included.
    w = _split(True).new().whole(TEXTS[2])
    assert w.tool_calls == [] and w.content is None
    # Without a tool parser the calls stay text; without a reasoning parser the tags do.
    assert _split(True, tools=False).new().whole(TEXTS[1]).content == TEXTS[1]
    w = _split(True, reasoning=False).new().whole("<think>a</think>b " + CALL % 5)
    assert w.reasoning is None and w.content.strip() == "<think>a</think>b"
    assert len(w.tool_calls) == 1


def test_constrained_output_starts_as_content() -> None:
    split = _split(True)
    split.prompt = "<assistant><think>\n"
    assert split.new().whole("abc").reasoning == "abc"
    split.constrained = True
    w = split.new().whole("abc")
    assert w.reasoning is None and w.content == "abc"
