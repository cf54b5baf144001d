"""Tool-call and reasoning tags that are special tokens of the tokenizer: decoding with
``skip_special_tokens`` would drop them before the parsers see them. The server keeps
exactly those tokens' text for a request with parsers (the parsers then take the tags out
of the content); EOS and every other special token stay skipped, and requests without
parsers get the text they got before. A grammar naming the token ids makes the random
model write the tags as the special tokens themselves."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hybridserve.testing.tiny_models import make_tiny_checkpoint

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
TAGS = {"<think>": 256, "</think>": 257, "<tool_call>": 258, "</tool_call>": 259}
CALL = '{"name": "f", "arguments": {"n": 1}}'
# <think>ab</think><tool_call>CALL</tool_call>, every tag as its special token id.
GRAMMAR = 'start: <[256]> "ab" <[257]> <[258]> "' + CALL.replace('"', '\\"') + '" <[259]>'
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, byte_tokenizer) -> Any:
    from tokenizers import AddedToken, Tokenizer

    path = make_tiny_checkpoint("granitemoehybrid", tmp_path_factory.mktemp("tags"), seed=7,
                                vocab_size=260)
    byte_tokenizer(path, TEMPLATE, eos_special=True)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in TAGS])
    assert {t: tok.token_to_id(t) for t in TAGS} == TAGS
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def parsers(model: Any, launch: Any) -> Iterator[Any]:
    srv = launch(model, served_model_name="tiny", reasoning_parser="qwen3", tool_call_parser="hermes",
                 enable_auto_tool_choice=True, max_model_len=1024)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def plain(model: Any, launch: Any) -> Iterator[Any]:
    srv = launch(model, served_model_name="tiny", max_model_len=1024)
    yield srv
    srv.stop()


def _post(srv: Any, path: str, **body: Any) -> dict[str, Any]:
    body = {"model": "tiny", "max_tokens": 80, "temperature": 0,
            "structured_outputs": {"grammar": GRAMMAR}, **body}
    with httpx.Client(base_url=srv.base_url, timeout=120) as c:
        r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(srv: Any, **body: Any) -> list[dict[str, Any]]:
    body = {"model": "tiny", "max_tokens": 80, "temperature": 0, "stream": True,
            "structured_outputs": {"grammar": GRAMMAR}, **body}
    deltas = []
    with (httpx.Client(base_url=srv.base_url, timeout=120) as c,
          c.stream("POST", "/v1/chat/completions", json=body) as r):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    deltas.append({**ch["delta"], "finish_reason": ch.get("finish_reason")})
    return deltas


MSGS = [{"role": "user", "content": "hi"}]


def test_special_tags_reach_the_parsers(parsers: Any) -> None:
    choice = _post(parsers, "/v1/chat/completions", messages=MSGS, tools=TOOLS)["choices"][0]
    msg = choice["message"]
    assert msg["reasoning_content"] == "ab"
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "f" and json.loads(call["function"]["arguments"]) == {"n": 1}
    assert not msg["content"]
    assert choice["finish_reason"] == "tool_calls"


def test_special_tags_reach_the_parsers_streamed(parsers: Any) -> None:
    deltas = _stream(parsers, messages=MSGS, tools=TOOLS)
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert reasoning == "ab" and content == ""
    assert {c["function"]["name"] for c in calls if c["function"].get("name")} == {"f"}
    args = "".join(c["function"].get("arguments") or "" for c in calls)
    assert json.loads(args) == {"n": 1}
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_without_a_tool_parser_the_tool_tags_stay_skipped(parsers: Any) -> None:
    # tool_choice none: only the reasoning parser reads the output, so only its tags are
    # kept; the tool-call tokens are skipped as any special token.
    msg = _post(parsers, "/v1/chat/completions", messages=MSGS, tools=TOOLS,
                tool_choice="none")["choices"][0]["message"]
    assert msg["reasoning_content"] == "ab" and msg["content"] == CALL and not msg.get("tool_calls")


def test_completions_keep_skipping_special_tokens(parsers: Any) -> None:
    # No parser reads a completion: its text is the decode skipping every special token.
    text = _post(parsers, "/v1/completions", prompt="hi")["choices"][0]["text"]
    assert text == "ab" + CALL


def test_requests_without_parsers_are_unchanged(plain: Any) -> None:
    msg = _post(plain, "/v1/chat/completions", messages=MSGS)["choices"][0]["message"]
    assert msg["content"] == "ab" + CALL and msg.get("reasoning_content") is None
    # Asked not to skip special tokens, the reply shows them all (the EOS after them too).
    kept = _post(plain, "/v1/chat/completions", messages=MSGS, skip_special_tokens=False)
    assert kept["choices"][0]["message"]["content"].startswith(
        "<think>ab</think><tool_call>" + CALL + "</tool_call>")


def test_a_kept_stop_token_still_does_not_show(model: Any) -> None:
    # The engine's side, offline: kept ids show their text, except a stop token's (and
    # EOS's), whose text never appears in an output.
    from hybridserve.llm import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=2, max_model_len=256)
    keep = frozenset(TAGS.values())

    def text(**kw: Any) -> str:
        sp = SamplingParams(max_tokens=80, temperature=0, structured_outputs={"grammar": GRAMMAR},
                            keep_special_token_ids=keep, **kw)
        return llm.generate(["hi"], sp)[0].outputs[0].text

    assert text() == "<think>ab</think><tool_call>" + CALL + "</tool_call>"
    assert text(stop_token_ids=[TAGS["</tool_call>"]]) == "<think>ab</think><tool_call>" + CALL


def test_keep_special_token_ids_is_checked() -> None:
    from hybridserve.llm import SamplingParams

    assert SamplingParams(keep_special_token_ids=[3, 4]).keep_special_token_ids == frozenset({3, 4})
    with pytest.raises(ValueError, match="keep_special_token_ids"):
        SamplingParams(keep_special_token_ids=[-1])


# Forced calls (tool_choice "required" or a named function): the grammar writes the
# envelope tags as the tokenizer's special tokens, and the parser still finds the call.
FORCED_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"], "additionalProperties": False}}}]
CHOICES = ["required", {"type": "function", "function": {"name": "f"}}]


def _forced(srv: Any, choice: Any, stream: bool, **body: Any) -> Any:
    body = {"model": "tiny", "max_tokens": 80, "messages": MSGS, "tools": FORCED_TOOLS,
            "tool_choice": choice, "parallel_tool_calls": False, "seed": 1,
            "chat_template_kwargs": {"enable_thinking": False}, **body}
    with httpx.Client(base_url=srv.base_url, timeout=120) as c:
        if not stream:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]
        chunks = []
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.extend(json.loads(line[6:])["choices"])
        return chunks


@pytest.mark.parametrize("choice", CHOICES, ids=["required", "named"])
def test_forced_call_writes_the_tags_as_special_tokens(parsers: Any, choice: Any) -> None:
    choice_out = _forced(parsers, choice, stream=False, logprobs=True)
    # One logprobs entry per token: each tag is one entry, so one token (the special id).
    tokens = [e["token"] for e in choice_out["logprobs"]["content"]]
    assert tokens[0] == "<tool_call>" and tokens.count("</tool_call>") == 1, tokens
    msg = choice_out["message"]
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "f"
    assert set(json.loads(call["function"]["arguments"])) == {"n"}
    assert not msg["content"] and choice_out["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("choice", CHOICES, ids=["required", "named"])
def test_forced_call_with_special_tags_streamed(parsers: Any, choice: Any) -> None:
    whole = _forced(parsers, choice, stream=False)["message"]["tool_calls"][0]["function"]
    chunks = _forced(parsers, choice, stream=True)
    calls = [c for ch in chunks for c in ch["delta"].get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls if c["function"].get("name")] == ["f"]
    assert "".join(c["function"].get("arguments") or "" for c in calls) == whole["arguments"]
    assert "".join(ch["delta"].get("content") or "" for ch in chunks) == ""
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_forced_call_token_ids_offline(model: Any) -> None:
    # The engine's side: the grammar names the special ids, the output holds them, and
    # the text (keeping those ids) parses to the call.
    from hybridserve.llm import LLM, SamplingParams
    from hybridserve.tools.grammar import single_token_tags, tool_call_grammar
    from hybridserve.tools.parsers import get_tool_parser

    llm = LLM(model, max_num_seqs=4, max_model_len=256)
    tok = llm.tokenizer
    tag_ids = single_token_tags("hermes", lambda t: tok.encode(t, add_special_tokens=False),
                                lambda ids: tok.decode(ids, skip_special_tokens=False))
    assert tag_ids == {"<tool_call>": TAGS["<tool_call>"], "</tool_call>": TAGS["</tool_call>"]}
    for choice in CHOICES:
        so = tool_call_grammar("hermes", FORCED_TOOLS, choice, parallel_tool_calls=False, tag_ids=tag_ids)
        params = [SamplingParams(max_tokens=120, temperature=t, seed=i, structured_outputs=so,
                                 keep_special_token_ids=frozenset(tag_ids.values()))
                  for i, t in enumerate((0.0, 1.0, 1.0))]
        for out in llm.generate(["hi"] * len(params), params, use_tqdm=False):
            c = out.outputs[0]
            assert c.finish_reason == "stop", c
            assert c.token_ids[0] == TAGS["<tool_call>"]
            assert c.token_ids.count(TAGS["<tool_call>"]) == c.token_ids.count(TAGS["</tool_call>"]) == 1
            got = get_tool_parser("hermes")(FORCED_TOOLS).extract(c.text)
            assert got.content is None and len(got.tool_calls) == 1
            assert all(call.name == "f" and set(json.loads(call.arguments)) == {"n"} for call in got.tool_calls)
