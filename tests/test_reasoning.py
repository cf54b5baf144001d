"""Reasoning parsers on hand-written outputs: the non-streamed split and streams in
random splits, which must add up to it."""

from __future__ import annotations

import random
import zlib

import pytest

from hybridserve.reasoning import get_reasoning_parser, prompt_opens_reasoning

# (parser, prompt opens a block (None: the parser's default), chat_template_kwargs,
#  output, expected reasoning, expected content)
CASES = [
    ("qwen3", None, {}, "<think>\nFirst, 2+2.\n</think>\n\nIt is 4.", "\nFirst, 2+2.\n", "\n\nIt is 4."),
    ("qwen3", None, {}, "Plain answer, no thinking; a < b, <thi", None, "Plain answer, no thinking; a < b, <thi"),
    ("qwen3", True, {}, "the prompt opened it</think>Done.", "the prompt opened it", "Done."),
    ("qwen3", True, {}, "cut off while thinking </thi", "cut off while thinking </thi", None),
    ("qwen3", None, {}, 'Text first <think>then a thought</think> then more', "then a thought", "Text first  then more"),
    ("deepseek_r1", None, {}, "<think>reasoning</think>answer", "reasoning", "answer"),
    ("deepseek_r1", None, {}, "reasoning</think>answer", "reasoning", "answer"),
    ("deepseek_r1", None, {}, "never closes", "never closes", None),
    ("nemotron_v3", None, {}, "step by step</think>\nThe result.", "step by step", "\nThe result."),
    ("nemotron_v3", None, {"enable_thinking": False}, "Direct answer.", None, "Direct answer."),
    ("granite_thinking", None, {}, "Let me see.\n</think>\n\nHello!", "Let me see.\n", "Hello!"),
    ("granite_thinking", None, {}, "<think>only thoughts", "only thoughts", None),
    ("granite", None, {}, "Here is my thought process: add them. Here is my response: 4", " add them. ", " 4"),
    ("granite", None, {}, "Here's my thought process:\nhmm\nHere's my response:\nok", "\nhmm\n", "\nok"),
    ("granite", None, {}, "No markers at all.", None, "No markers at all."),
]


@pytest.mark.parametrize("name, opens, kwargs, text, reasoning, content", CASES)
def test_extract(name, opens, kwargs, text, reasoning, content):
    assert get_reasoning_parser(name)(opens, kwargs).extract(text) == (reasoning, content)


@pytest.mark.parametrize("name, opens, kwargs, text, reasoning, content", CASES)
def test_streaming_in_random_splits_equals_extract(name, opens, kwargs, text, reasoning, content):
    rng = random.Random(zlib.crc32(text.encode()))
    cls = get_reasoning_parser(name)
    for _ in range(60):
        p = cls(opens, kwargs)
        got_r = got_c = ""
        i = 0
        while i < len(text):
            k = rng.choice([1, 1, 2, 3, 4, 7])
            d = p.feed(text[i : i + k])
            got_r += d.reasoning
            got_c += d.content
            i += k
        d = p.finish()
        got_r, got_c = got_r + d.reasoning, got_c + d.content
        assert (got_r or None, got_c or None) == (reasoning, content)


def test_partial_tags_wait_for_the_next_piece():
    p = get_reasoning_parser("qwen3")()
    assert p.feed("Hi <th").content == "Hi "
    d = p.feed("ink>why")
    assert (d.reasoning, d.content) == ("why", "")
    assert p.feed("</thi").reasoning == ""
    d = p.feed("nk>so")
    assert (d.reasoning, d.content) == ("", "so")


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("nope")
