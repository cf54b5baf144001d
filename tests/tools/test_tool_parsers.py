"""Tool-call parsers on hand-written model outputs: the non-streamed split, and streams
of the same text in random splits, which must add up to it with each call's name
first."""

from __future__ import annotations

import itertools
import json
import random
import zlib

import pytest

from hybridserve.tools.parsers import ToolCallDelta, get_tool_parser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
                "zip": {"type": "string"}, "opts": {"type": "object"}, "hours": {"type": ["array", "null"]},
            },
        },
    },
}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]

# (parser, model output, expected content, expected [(name, arguments JSON text)])
CASES = [
    ("hermes", 'I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
     "I will look it up.\n", [("get_weather", '{"city": "Paris", "days": 3}')]),
    ("hermes", '<tool_call>\n{"name": "search", "arguments": {"q": "a \\"b\\" \\u00e9\\ud83d\\ude00", "n": [1, {"x": null}]}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
     None, [("search", '{"q": "a \\"b\\" \\u00e9\\ud83d\\ude00", "n": [1, {"x": null}]}'), ("get_weather", "{}")]),
    # Arguments written as a JSON string are decoded to the JSON text they hold.
    ("hermes", '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"caf\\u00e9\\"}"}</tool_call>',
     None, [("search", '{"q": "café"}')]),
    # Name after arguments: nothing of the call streams before its name.
    ("hermes", '<tool_call>{"arguments": {"q": 1}, "name": "search"}</tool_call>', None, [("search", '{"q": 1}')]),
    ("hermes", "No tools needed: 1 < 2 and <b>bold</b> <tool_", "No tools needed: 1 < 2 and <b>bold</b> <tool_", []),
    ("granite4", 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
     "Sure.", [("get_weather", '{"city": "Rome"}')]),
    ("qwen3_coder",
     "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
     "<parameter=days>\n5\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=zip>\n007\n</parameter>\n"
     '<parameter=opts>\n{"a": [1, 2]}\n</parameter>\n<parameter=hours>\nnull\n</parameter>\n</function>\n</tool_call>',
     "Checking.\n",
     [("get_weather", '{"city": "New York", "days": 5, "metric": true, "zip": "007", "opts": {"a": [1, 2]}, "hours": null}')]),
    ("qwen3_coder",
     "<tool_call>\n<function=search>\n<parameter=text>\nline one\nline <two>\n</parameter>\n</function>\n</tool_call>\n"
     "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
     None, [("search", '{"text": "line one\\nline <two>"}'), ("get_weather", "{}")]),
    ("nemotron_v3", "<tool_call>\n<function=search>\n<parameter=q>\nx\n</parameter>\n</function>\n</tool_call>",
     None, [("search", '{"q": "x"}')]),
    ("nemotron_nano_v2",
     'Calling.<TOOLCALL>[{"name": "search", "arguments": {"q": "x"}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]</TOOLCALL>',
     "Calling.", [("search", '{"q": "x"}'), ("get_weather", '{"city": "Oslo"}')]),
]


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _stream(parser_name: str, text: str, rng: random.Random):
    parser = get_tool_parser(parser_name)(TOOLS, id_factory=_ids())
    pieces, i = [], 0
    while i < len(text):
        k = rng.choice([1, 1, 2, 3, 5, 8, 13])
        pieces.append(text[i : i + k])
        i += k
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.tool_calls:
            if c.index not in calls:
                # Name first: a call's first delta carries its id and name.
                assert c.name is not None and c.id is not None, c
                calls[c.index] = {"id": c.id, "name": c.name, "arguments": ""}
            else:
                assert c.name is None and c.id is None, c
            calls[c.index]["arguments"] += c.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in range(len(calls))]


@pytest.mark.parametrize("parser_name, text, content, calls", CASES)
def test_extract(parser_name, text, content, calls):
    got = get_tool_parser(parser_name)(TOOLS).extract(text)
    assert got.content == content
    assert [(c.name, c.arguments) for c in got.tool_calls] == calls
    for c in got.tool_calls:
        json.loads(c.arguments)
        assert c.id.startswith("chatcmpl-tool-")
    assert got.tools_called == bool(calls)


@pytest.mark.parametrize("parser_name, text, content, calls", CASES)
def test_streaming_in_random_splits_equals_extract(parser_name, text, content, calls):
    rng = random.Random(zlib.crc32(text.encode()))
    want = get_tool_parser(parser_name)(TOOLS, id_factory=_ids()).extract(text)
    for _ in range(60):
        streamed, streamed_calls = _stream(parser_name, text, rng)
        assert (streamed if streamed.strip() else None) == want.content
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == [(c.name, c.arguments) for c in want.tool_calls]
        assert [c["id"] for c in streamed_calls] == [f"call_{i}" for i in range(len(streamed_calls))]


def test_partial_start_tag_is_held_back_then_released():
    p = get_tool_parser("hermes")(TOOLS)
    assert p.feed("hello <tool").content == "hello "
    assert p.feed("box").content == "<toolbox"
    assert p.feed(" <tool_c").content == " "
    d = p.feed('all>{"name": "search", "arguments": {"q"')
    assert d.content == "" and d.tool_calls[0].name == "search" and d.tool_calls[0].arguments == '{"q"'
    assert p.feed(": 1}}</tool_call>").tool_calls[0].arguments == ": 1}"


def test_openai_shapes():
    call = get_tool_parser("hermes")(TOOLS).extract(CASES[0][1]).tool_calls[0]
    assert call.to_openai() == {"id": call.id, "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}
    first = ToolCallDelta(index=0, id="c", name="f", arguments="")
    assert first.to_openai() == {"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}
    assert ToolCallDelta(index=1, arguments='{"a"').to_openai() == {"index": 1, "function": {"arguments": '{"a"'}}


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")
