"""Tool calling, structured outputs and reasoning over HTTP with the official openai
client, on a random-weight model: forced tool calls and schemas hold for every reply
(jsonschema), streamed and not, with and without n-gram speculation and prefix
caching; the history's tool calls and tool messages reach the chat template as
transformers passes them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 6}, "limit": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["query"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "parameters": SEARCH}},
]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


TOOL_SERVER = dict(
    served_model_name="tiny",
    tool_call_parser="hermes",
    enable_auto_tool_choice=True,
    reasoning_parser="qwen3",
    max_model_len=2048,
)
ENGINES = {
    "plain": {},
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    "no-prefix-cache": {"enable_prefix_caching": False},
}


@pytest.fixture(scope="module", params=list(ENGINES))
def engine_server(request: pytest.FixtureRequest, tool_model: Path, launch: Any, tool_server: Any) -> Any:
    """The server on each engine variant (the plain one is ``tool_server`` itself)."""
    if request.param == "plain":
        yield tool_server
        return
    srv = launch(tool_model, **TOOL_SERVER, **ENGINES[request.param])
    yield srv
    srv.stop()


def _client(srv: Any) -> OpenAI:
    return OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def oai(tool_server: Any) -> OpenAI:
    return _client(tool_server)


@pytest.fixture
def any_engine(engine_server: Any) -> OpenAI:
    return _client(engine_server)


def _check_calls(calls: list[Any], allowed: set[str], single: bool) -> None:
    assert calls, "no tool call"
    assert not single or len(calls) == 1
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _stream_calls(stream: Any) -> tuple[dict[int, dict[str, Any]], str | None, str]:
    """Accumulate streamed tool-call deltas by index, as OpenAI clients do."""
    calls: dict[int, dict[str, Any]] = {}
    reason, content = None, ""
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert entry["id"] is None, "a call's id comes once, in its first delta"
                    entry["id"] = d.id
                    assert d.function.name, "the first delta names the function"
                    entry["name"] = d.function.name
                else:
                    assert d.function.name is None
                entry["arguments"] += d.function.arguments or ""
            if ch.finish_reason is not None:
                assert reason is None
                reason = ch.finish_reason
    return calls, reason, content


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_tool_call_validates(any_engine: OpenAI, temperature: float) -> None:
    for seed in range(2):
        r = any_engine.chat.completions.create(
            model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=300, temperature=temperature, seed=seed,
        )
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        assert ch.message.content is None
        _check_calls(ch.message.tool_calls, set(SCHEMAS), single=True)


def test_named_tool_call_streamed_validates(any_engine: OpenAI) -> None:
    for seed in range(2):
        stream = any_engine.chat.completions.create(
            model="tiny", messages=MSGS, tools=TOOLS, max_tokens=300, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "search"}}, stream=True,
        )
        calls, reason, content = _stream_calls(stream)
        assert reason == "tool_calls" and content == ""
        assert list(calls) == [0] and calls[0]["name"] == "search"
        assert calls[0]["id"].startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(calls[0]["arguments"]), SEARCH)


def test_streamed_calls_equal_unstreamed(oai: OpenAI) -> None:
    kw = dict(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=300,
              temperature=1.0, seed=7, parallel_tool_calls=False)
    whole = oai.chat.completions.create(**kw).choices[0].message.tool_calls
    calls, reason, _ = _stream_calls(oai.chat.completions.create(**kw, stream=True))
    assert reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole
    ]


def test_auto_parses_calls_and_content(oai: OpenAI) -> None:
    # The random model would never write a call by itself: a regex makes it write one
    # (with content around it), which tool_choice="auto" parses out.
    regex = r'ok <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "P[a-z]{1,4}", "days": [1-7]\}\}\n</tool_call>'
    extra = {"structured_outputs": {"regex": regex}}
    r = oai.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=200,
                                    extra_body=extra, temperature=1.0, seed=3)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content.strip() == "ok"
    _check_calls(ch.message.tool_calls, {"get_weather"}, single=True)
    calls, reason, content = _stream_calls(
        oai.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=200,
                                    extra_body=extra, temperature=1.0, seed=3, stream=True)
    )
    assert reason == "tool_calls" and content.strip() == "ok"
    assert calls[0]["arguments"] == ch.message.tool_calls[0].function.arguments


def test_tool_choice_none_and_no_parallel(oai: OpenAI) -> None:
    regex = r'<tool_call>\n\{"name": "search", "arguments": \{"query": "a"\}\}\n</tool_call>'
    twice = {"structured_outputs": {"regex": regex + "\n" + regex}}
    # none: the text stays content, nothing is parsed.
    r = oai.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="none",
                                    max_tokens=200, extra_body=twice)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.count("<tool_call>") == 2
    assert r.choices[0].finish_reason == "stop"
    # auto without parallel calls keeps the first call only.
    r = oai.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, parallel_tool_calls=False,
                                    max_tokens=200, extra_body=twice)
    assert len(r.choices[0].message.tool_calls) == 1
    r = oai.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=200, extra_body=twice)
    assert len(r.choices[0].message.tool_calls) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_validates(any_engine: OpenAI, stream: bool) -> None:
    oai = any_engine
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(2):
        kw = dict(model="tiny", messages=MSGS, response_format=fmt, max_tokens=200, temperature=1.0, seed=seed)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(**kw, stream=True) if c.choices)
        else:
            r = oai.chat.completions.create(**kw)
            assert r.choices[0].finish_reason == "stop"
            text = r.choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_structured_outputs(oai: OpenAI, tool_server: Any) -> None:
    r = oai.chat.completions.create(model="tiny", messages=MSGS, response_format={"type": "json_object"},
                                    max_tokens=300, temperature=0.0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: a prefix of an object
        assert r.choices[0].message.content.lstrip().startswith("{")
    r = oai.chat.completions.create(model="tiny", messages=MSGS, max_tokens=20,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    # The completions endpoint takes them too.
    r = oai.completions.create(model="tiny", prompt="date:", max_tokens=20,
                               extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}})
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.choices[0].text)
    grammar = 'start: "a" ("b" | "c")+ "."\n'
    r = oai.completions.create(model="tiny", prompt="x", max_tokens=30, temperature=1.0, seed=1,
                               extra_body={"structured_outputs": {"grammar": grammar}})
    if r.choices[0].finish_reason == "stop":
        assert re.fullmatch(r"a[bc]+\.", r.choices[0].text)
    r = oai.completions.create(model="tiny", prompt="x", max_tokens=200, temperature=1.0, seed=2,
                               extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = oai.completions.create(model="tiny", prompt="x", max_tokens=200, temperature=1.0, seed=3,
                               extra_body={"response_format": {"type": "json_schema",
                                                               "json_schema": {"name": "p", "schema": PERSON}}})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_forced_call_conflicts_are_400(oai: OpenAI) -> None:
    with pytest.raises(BadRequestError, match="response_format"):
        oai.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
                                    response_format={"type": "json_object"})
    with pytest.raises(BadRequestError, match="nope"):
        oai.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "nope"}})


def test_reasoning_content_with_enable_thinking(oai: OpenAI, tool_server: Any) -> None:
    kw = dict(model="tiny", messages=MSGS, max_tokens=12, temperature=1.0, seed=5, stop=["<"])
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    # enable_thinking makes the template open <think> (stop=["<"] keeps the model from
    # closing it): the whole output is reasoning.
    assert _rendered(tool_server.base_url, {"messages": MSGS, **think}).endswith("<think>\n")
    msg = oai.chat.completions.create(**kw, extra_body=think).choices[0].message
    assert msg.reasoning_content and msg.content is None
    # Without it the output is content, and reasoning_content is null.
    plain = oai.chat.completions.create(**kw).choices[0].message
    assert plain.reasoning_content is None and plain.content
    # Streams report the same split.
    reasoning = content = ""
    for c in oai.chat.completions.create(**kw, stream=True, extra_body=think):
        for ch in c.choices:
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            content += ch.delta.content or ""
    assert (reasoning, content) == (msg.reasoning_content, "")


def test_reasoning_split_by_the_model_text(oai: OpenAI) -> None:
    # A grammar makes the output a think block then an answer.
    extra = {"structured_outputs": {"regex": r"<think>[a-z]{2,5}</think>[a-z]{2,5}"}}
    kw = dict(model="tiny", messages=MSGS, max_tokens=40, temperature=1.0, seed=4, extra_body=extra)
    msg = oai.chat.completions.create(**kw).choices[0].message
    assert re.fullmatch("[a-z]{2,5}", msg.reasoning_content) and re.fullmatch("[a-z]{2,5}", msg.content)
    reasoning = content = ""
    for c in oai.chat.completions.create(**kw, stream=True):
        for ch in c.choices:
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            content += ch.delta.content or ""
    assert (reasoning, content) == (msg.reasoning_content, msg.content)


# ---- the history: tool calls and tool messages, as transformers renders them ------


def _history() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]


def _rendered(base_url: str, body: dict[str, Any]) -> str:
    with httpx.Client(base_url=base_url, timeout=30) as c:
        r = c.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        ids = r.json()["tokens"]
        r = c.post("/detokenize", json={"tokens": ids})
        assert r.status_code == 200, r.text
        return r.json()["prompt"]


def test_history_renders_as_transformers(tool_server: Any, tool_model: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tool_model)
    docs = [{"title": "t", "text": "doc text"}]
    for kwargs in (
        {"tools": TOOLS},
        {"tools": TOOLS, "enable_thinking": True},
        {"documents": docs},
        {},
    ):
        # transformers gets the arguments as an object, as vLLM passes them.
        hf_msgs = _history()
        hf_msgs[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "days": 2}
        want = hf.apply_chat_template(hf_msgs, tokenize=False, add_generation_prompt=True, **kwargs)
        body: dict[str, Any] = {"messages": _history()}
        for key in ("tools", "documents"):
            if key in kwargs:
                body[key] = kwargs[key]
        if "enable_thinking" in kwargs:
            body["chat_template_kwargs"] = {"enable_thinking": True}
        assert _rendered(tool_server.base_url, body) == want
    # continue_final_message: the prompt ends inside the last message.
    msgs = MSGS + [{"role": "assistant", "content": "It is"}]
    want = hf.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    got = _rendered(tool_server.base_url, {"messages": msgs, "add_generation_prompt": False,
                                           "continue_final_message": True})
    assert got == want and got.endswith("It is")


def test_sdk_message_dump_round_trip(oai: OpenAI) -> None:
    """The SDK's own reply, sent back with model_dump() (nulls for refusal, audio,
    annotations, function_call), continues the conversation."""
    r = oai.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_tokens=300)
    reply = r.choices[0].message
    dumped = reply.model_dump()
    assert "refusal" in dumped and dumped["tool_calls"]
    history = MSGS + [dumped, {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "20C"}]
    r2 = oai.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=5,
                                     n=None, stream=None)
    assert r2.choices[0].finish_reason in ("stop", "length")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
