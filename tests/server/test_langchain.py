"""langchain-openai against the server: ``bind_tools``, ``with_structured_output`` in
its three modes (json_schema, function_calling, json_mode), histories holding tool
messages, and streaming. The model has random weights: forced calls and schemas make
its replies valid, which langchain's own parsers then check."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, Field

pytest.importorskip("langchain_openai")

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402


class GetWeather(BaseModel):
    """Get the weather of a city."""

    city: str = Field(min_length=1, max_length=8)
    days: int = Field(ge=1, le=7)


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)


@pytest.fixture
def llm(tool_server: Any) -> ChatOpenAI:
    return ChatOpenAI(
        model="tiny",
        base_url=tool_server.base_url + "/v1",
        api_key="unused",
        max_retries=0,
        temperature=1.0,
        seed=1,
        max_tokens=200,
        timeout=60,
    )


def test_plain_invoke_and_stream(llm: ChatOpenAI) -> None:
    msg = llm.invoke([SystemMessage("be brief"), HumanMessage("hi")])
    assert isinstance(msg.content, str) and msg.response_metadata["finish_reason"] in ("stop", "length")
    chunks = list(llm.stream([SystemMessage("be brief"), HumanMessage("hi")]))
    assert "".join(c.content for c in chunks) == msg.content  # same seed, same text


def test_bind_tools_forced_call(llm: ChatOpenAI) -> None:
    bound = llm.bind_tools([GetWeather], tool_choice="GetWeather")
    msg = bound.invoke("weather in Paris?")
    assert [c["name"] for c in msg.tool_calls] == ["GetWeather"]
    GetWeather.model_validate(msg.tool_calls[0]["args"])
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    # Streamed: langchain assembles the argument deltas into the same call.
    total = None
    for chunk in bound.stream("weather in Paris?"):
        total = chunk if total is None else total + chunk
    assert [c["name"] for c in total.tool_calls] == ["GetWeather"]
    assert total.tool_calls[0]["args"] == msg.tool_calls[0]["args"]


def test_bind_tools_required_and_auto(llm: ChatOpenAI) -> None:
    msg = llm.bind_tools([GetWeather, Person], tool_choice="any", parallel_tool_calls=False).invoke("go")
    assert len(msg.tool_calls) == 1
    model = {"GetWeather": GetWeather, "Person": Person}[msg.tool_calls[0]["name"]]
    model.model_validate(msg.tool_calls[0]["args"])
    # auto (the default): the random model writes text, not calls.
    msg = llm.bind_tools([GetWeather]).invoke("hello")
    assert msg.tool_calls == [] and isinstance(msg.content, str)


def test_tool_message_history(llm: ChatOpenAI) -> None:
    history = [
        HumanMessage("weather in Paris?"),
        AIMessage("", tool_calls=[{"name": "GetWeather", "args": {"city": "Paris", "days": 1}, "id": "call_1"}]),
        ToolMessage("sunny, 20C", tool_call_id="call_1"),
    ]
    msg = llm.bind_tools([GetWeather]).invoke(history)
    assert isinstance(msg.content, str)
    assert msg.usage_metadata["input_tokens"] > 100  # the tools and the history were rendered


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(llm: ChatOpenAI, method: str) -> None:
    structured = llm.with_structured_output(Person, method=method)
    for seed in (1, 2):
        got = structured.bind(seed=seed).invoke("describe someone") if method == "json_schema" else structured.invoke("x")
        assert isinstance(got, Person)


def test_with_structured_output_json_mode(llm: ChatOpenAI) -> None:
    schema = {"title": "Anything", "type": "object"}
    got = llm.with_structured_output(schema, method="json_mode").invoke("give JSON")
    assert isinstance(got, dict)


def test_with_structured_output_include_raw_streams(llm: ChatOpenAI) -> None:
    structured = llm.with_structured_output(Person, method="json_schema", include_raw=True)
    out = structured.invoke("who?")
    assert out["parsing_error"] is None and isinstance(out["parsed"], Person)
