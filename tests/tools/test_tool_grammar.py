"""Forced tool calls (``tool_choice="required"`` / a named function) through the
engine: a random-weight model's every output is a call in the parser's format whose
arguments validate against the function's schema."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.tools.grammar import tool_call_grammar
from hybridserve.tools.parsers import get_tool_parser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 8},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "hourly": {"type": "boolean"},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    }}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object",
        "properties": {
            "query": {"type": "string", "maxLength": 6},
            "limit": {"type": "integer", "minimum": 0, "maximum": 50},
            "filters": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 9}, "maxItems": 2},
        },
        "required": ["query"],
        "additionalProperties": False,
    }}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PARSERS = ["hermes", "granite4", "qwen3_coder", "nemotron_nano_v2"]
PROMPTS = ["What is the weather in Paris?", "search for cats", "x", "<tool_call> hello"]


@pytest.fixture(scope="module")
def llm(tiny_granite) -> LLM:
    return LLM(tiny_granite, max_num_seqs=16, max_model_len=512)


@pytest.fixture(scope="module")
def llm_spec(tiny_granite) -> LLM:
    return LLM(tiny_granite, max_num_seqs=16, max_model_len=512,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})


def _text(llm: LLM, c) -> str:
    assert c.finish_reason == "stop", c
    ids = c.token_ids[:-1] if c.token_ids and c.token_ids[-1] in llm.engine.eos_token_ids else c.token_ids
    return llm.tokenizer.decode(ids)


def _generate(llm, parser, tool_choice, parallel, temperatures=(0.0, 1.0)):
    so = tool_call_grammar(parser, TOOLS, tool_choice, parallel_tool_calls=parallel)
    params = [SamplingParams(max_tokens=400, temperature=t, seed=i, structured_outputs=so)
              for i, t in enumerate(temperatures * 2)]
    prompts = (PROMPTS * 2)[: len(params)]
    return [_text(llm, o.outputs[0]) for o in llm.generate(prompts, params, use_tqdm=False)]


def _check_calls(parser, text, allowed, parallel):
    got = get_tool_parser(parser)(TOOLS).extract(text)
    assert got.content is None, text
    assert got.tool_calls and (parallel or len(got.tool_calls) == 1), text
    for call in got.tool_calls:
        assert call.name in allowed
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return got


@pytest.mark.parametrize("parser", PARSERS)
def test_required_calls_validate(llm, parser):
    for text in _generate(llm, parser, "required", parallel=False):
        _check_calls(parser, text, set(SCHEMAS), parallel=False)


@pytest.mark.parametrize("parser", PARSERS)
def test_named_function_is_the_one_called(llm, parser):
    choice = {"type": "function", "function": {"name": "search"}}
    for text in _generate(llm, parser, choice, parallel=True):
        _check_calls(parser, text, {"search"}, parallel=False)


def test_parallel_calls_and_streamed_parse_of_generated_text(llm):
    rng = random.Random(0)
    for parser in ("hermes", "nemotron_nano_v2"):
        for text in _generate(llm, parser, "required", parallel=True, temperatures=(1.0,)):
            want = _check_calls(parser, text, set(SCHEMAS), parallel=True)
            stream = get_tool_parser(parser)(TOOLS)
            args: dict[int, str] = {}
            i = 0
            while i < len(text):
                k = rng.randint(1, 9)
                for d in stream.feed(text[i : i + k]).tool_calls:
                    args[d.index] = args.get(d.index, "") + d.arguments
                i += k
            for d in stream.finish().tool_calls:
                args[d.index] = args.get(d.index, "") + d.arguments
            assert [args[i] for i in sorted(args)] == [c.arguments for c in want.tool_calls]


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder"])
def test_forced_calls_with_speculation(llm_spec, parser):
    for text in _generate(llm_spec, parser, "required", parallel=False):
        _check_calls(parser, text, set(SCHEMAS), parallel=False)


def test_bad_tool_choice_names_the_field():
    with pytest.raises(ValueError, match="tools"):
        tool_call_grammar("hermes", [], "required")
    with pytest.raises(ValueError, match="not among the tools"):
        tool_call_grammar("hermes", TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="required"):
        tool_call_grammar("hermes", TOOLS, "auto")
    with pytest.raises(ValueError, match="parser"):
        tool_call_grammar("mystery", TOOLS, "required")


@pytest.mark.parametrize("parser", PARSERS)
def test_envelope_tags_are_tokens_only_where_the_tokenizer_has_them(llm, parser):
    from hybridserve.tools.grammar import envelope_tags, single_token_tags

    opening, closing = envelope_tags(parser)
    tok = llm.tokenizer
    # The tiny model's byte-level tokenizer has no tag token: the tags stay text.
    assert single_token_tags(parser, lambda t: tok.encode(t, add_special_tokens=False),
                             lambda ids: tok.decode(ids, skip_special_tokens=False)) == {}
    plain = tool_call_grammar(parser, TOOLS, "required").grammar
    assert "<[" not in plain and f'"{opening}"' in plain and f'"{closing}"' in plain
    # Given ids, the grammar names them instead of the text.
    named = tool_call_grammar(parser, TOOLS, "required", tag_ids={opening: 300, closing: 301}).grammar
    assert "<[300]>" in named and "<[301]>" in named
    assert f'"{opening}"' not in named and f'"{closing}"' not in named


@pytest.mark.parametrize("special", [True, False], ids=["special", "added"])
def test_single_token_tags_are_forced_as_their_ids(special):
    """Qwen-style tokenizers add ``<tool_call>`` as a token that is not special, others as a
    special one: either way the grammar forces the tag's one id, and a walk through the
    masks commits exactly those ids around a call that parses."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from hybridserve.structured.backend import GrammarBackend
    from hybridserve.tools.grammar import single_token_tags

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(alphabet[2], special=True)])  # EOS
    tok.add_tokens([AddedToken(t, special=special) for t in ("<tool_call>", "</tool_call>")])
    tags = single_token_tags("hermes", lambda t: tok.encode(t, add_special_tokens=False).ids,
                             lambda ids: tok.decode(ids, skip_special_tokens=False))
    assert tags == {"<tool_call>": 256, "</tool_call>": 257}
    backend = GrammarBackend(tok.to_str(), 258, [2])
    so = tool_call_grammar("hermes", TOOLS, "required", parallel_tool_calls=False, tag_ids=tags)
    rng = random.Random(0)
    for _ in range(3):
        m = backend.matcher(so)
        assert m.allowed() == [256]
        ids = []
        while not m.terminated and len(ids) < 400:
            allowed = m.allowed()
            # Prefer ending strings and objects, so the walk finishes.
            t = 2 if 2 in allowed else rng.choice(allowed)
            m.accept(t)
            ids.append(t)
        if ids[-1] == 2:
            ids.pop()  # EOS, where the grammar still offered it
        assert ids[0] == 256 and ids[-1] == 257 and ids.count(256) == ids.count(257) == 1
        _check_calls("hermes", tok.decode(ids, skip_special_tokens=False), set(SCHEMAS), parallel=False)
