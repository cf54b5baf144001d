"""With a reasoning parser, a grammar (``response_format``, a forced tool call) applies
after the reasoning block when the output starts inside one, as vLLM's does; it
applies from the first token when thinking is off. The tiny model's tokenizer has
``</think>`` as one added token, so a logit bias can make the random model close its
reasoning at once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest

from hybridserve.testing.tiny_models import make_tiny_checkpoint

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% if enable_thinking is not defined or enable_thinking %}"
    "<think>\n{% endif %}{% endif %}"
)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}
END = 256  # the id of "</think>"


@pytest.fixture(scope="module")
def think_server(tmp_path_factory: pytest.TempPathFactory, byte_tokenizer, launch) -> Iterator[Any]:
    from tokenizers import AddedToken, Tokenizer

    path = make_tiny_checkpoint("granitemoehybrid", tmp_path_factory.mktemp("think"), seed=5,
                                vocab_size=257)
    byte_tokenizer(path, TEMPLATE, eos_special=True)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens([AddedToken("</think>", special=False)])
    assert tok.token_to_id("</think>") == END
    tok.save(str(path / "tokenizer.json"))
    srv = launch(path, served_model_name="tiny", reasoning_parser="qwen3", tool_call_parser="hermes",
                 max_model_len=1024)
    yield srv
    srv.stop()


def _chat(srv: Any, **body: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "temperature": 0,
            "logit_bias": {str(END): 100}, **body}
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


# Compact JSON: the random model would otherwise fill the budget with whitespace.
SO = {"json": SCHEMA, "disable_any_whitespace": True}


def test_structured_outputs_apply_after_the_reasoning(think_server: Any) -> None:
    choice = _chat(think_server, structured_outputs=SO)
    # The bias closes the reasoning at once (it is free until then); the grammar then
    # shapes the content, where the bias can do nothing against the mask.
    assert choice["message"]["reasoning_content"] is None
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert choice["finish_reason"] == "stop"
    # Kept from closing the block, the output is all reasoning, stopped by the length
    # (a grammar from the first token would have made it JSON content).
    free = _chat(think_server, structured_outputs=SO, logit_bias={str(END): -100}, max_tokens=20)
    assert free["finish_reason"] == "length" and free["message"]["content"] is None
    assert free["message"]["reasoning_content"]


def test_with_thinking_off_the_grammar_starts_at_once(think_server: Any) -> None:
    choice = _chat(think_server, structured_outputs=SO, chat_template_kwargs={"enable_thinking": False})
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert "</think>" not in choice["message"]["content"]  # the mask beat the bias


def test_forced_tool_call_after_the_reasoning(think_server: Any) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]
    choice = _chat(think_server, tools=tools, tool_choice="required", parallel_tool_calls=False,
                   max_tokens=400)
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "f" and choice["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
