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
