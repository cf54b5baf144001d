"""litellm against the server through its ``openai/`` and ``hosted_vllm/`` providers:
chat, streaming, tool calls (forced and required, and a history holding them) and
``response_format``. The model has random weights: forced calls and schemas make its
replies valid, and jsonschema checks them. litellm reads its bundled model cost map
(``LITELLM_LOCAL_MODEL_COST_MAP``): nothing leaves the machine."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm = pytest.importorskip("litellm")
jsonschema = pytest.importorskip("jsonschema")

PROVIDERS = pytest.mark.parametrize("provider", ["openai", "hosted_vllm"])

# litellm's hosted_vllm provider strips "additionalProperties": false (and "strict")
# from tool schemas before sending them, so the server may rightly let the random
# model add keys until it runs out of tokens; "maxProperties" (kept) bounds the
# objects for both providers.

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
    "maxProperties": 2,
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
    "maxProperties": 2,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "describe", "description": "A person.",
                                      "parameters": PERSON}},
]
SCHEMAS = {"get_weather": WEATHER, "describe": PERSON}


@pytest.fixture
def call(tool_server: Any):
    """``call(provider, **kwargs)``: ``litellm.completion`` against the server."""

    def completion(provider: str, **kwargs: Any) -> Any:
        kwargs.setdefault("messages", [{"role": "user", "content": "hi"}])
        kwargs.setdefault("max_tokens", 200)
        return litellm.completion(
            model=f"{provider}/tiny", api_base=tool_server.base_url + "/v1", api_key="unused",
            num_retries=0, timeout=60, **kwargs,
        )

    return completion


@PROVIDERS
def test_chat_and_stream(call, provider: str, tool_server: Any) -> None:
    import openai

    kw = {"max_tokens": 12, "temperature": 1.0, "seed": 5}
    r = call(provider, **kw)
    oai = openai.OpenAI(base_url=tool_server.base_url + "/v1", api_key="unused")
    want = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], **kw)
    assert r.choices[0].message.content == want.choices[0].message.content
    assert r.choices[0].finish_reason == want.choices[0].finish_reason
    assert r.usage.prompt_tokens == want.usage.prompt_tokens
    chunks = list(call(provider, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.choices[0].message.content


@PROVIDERS
def test_named_and_required_tool_calls(call, provider: str) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = call(provider, tools=TOOLS, tool_choice=named, seed=1)
    (tc,) = r.choices[0].message.tool_calls
    assert tc.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(tc.function.arguments), WEATHER)
    r = call(provider, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=2)
    (tc,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(tc.function.arguments), SCHEMAS[tc.function.name])


@PROVIDERS
def test_streamed_tool_call_assembles_to_the_whole_one(call, provider: str) -> None:
    named = {"type": "function", "function": {"name": "describe"}}
    whole = call(provider, tools=TOOLS, tool_choice=named, seed=4).choices[0].message.tool_calls[0]
    name, args = None, ""
    for chunk in call(provider, tools=TOOLS, tool_choice=named, seed=4, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or []:
            name = tc.function.name or name
            args += tc.function.arguments or ""
    assert name == "describe" and json.loads(args) == json.loads(whole.function.arguments)


@PROVIDERS
def test_tool_history_round_trip(call, provider: str) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = call(provider, tools=TOOLS, tool_choice=named, seed=6,
                 messages=[{"role": "user", "content": "weather in Rome?"}])
    msg = first.choices[0].message
    history = [
        {"role": "user", "content": "weather in Rome?"},
        msg.model_dump(),  # litellm's own message, sent back as it came
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny"},
    ]
    r = call(provider, tools=TOOLS, messages=history, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length")
    # The tools, the call and its result were all rendered into the prompt.
    assert r.usage.prompt_tokens > first.usage.prompt_tokens + 20


@PROVIDERS
def test_response_format(call, provider: str) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = call(provider, response_format=rf, seed=1)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
