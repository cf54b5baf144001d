"""Malformed requests get OpenAI's error shape, the right status and the field's name;
none of them disturbs the engine."""

from __future__ import annotations

import json

import httpx
import pytest

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]

# (path, body, status, param, words the message must contain)
CASES = [
    (C, {"prompt": "x", "frobnicate": "two"}, 200, None, ""),  # unknown: ignored
    # vLLM fields not implemented here: their defaults pass, other values are refused.
    (C, {"prompt": "x", "echo": False, "logit_bias": {}, "best_of": 1}, 200, None, ""),
    (C, {"prompt": "x", "best_of": 2}, 400, "best_of", "not supported"),
    (C, {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search", "not supported"),
    (C, {"prompt": "x", "echo": "yes"}, 400, "echo", "boolean"),
    (C, {"prompt": "x", "logit_bias": {"one": 2}}, 400, "logit_bias", "token id"),
    (C, {"prompt": "x", "logit_bias": {"1": "2"}}, 400, "logit_bias.1", "number"),
    (C, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs", "20"),
    (CHAT, {"messages": MSGS, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", "stream"),
    (C, {"prompt": "x", "min_tokens": -1}, 400, "min_tokens", "min_tokens"),
    (C, {"prompt": "x", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens", "max_tokens"),
    (CHAT, {"messages": MSGS, "allowed_token_ids": []}, 400, "allowed_token_ids", "allowed_token_ids"),
    (C, {"prompt": "x", "allowed_token_ids": [10**6]}, 400, "allowed_token_ids", "allowed_token_ids"),
    (C, {}, 400, "prompt", "missing"),
    (C, {"prompt": 5}, 400, "prompt", "prompt"),
    (C, {"prompt": ""}, 400, "prompt", "empty"),
    (C, {"prompt": []}, 400, "prompt", "prompt"),
    (C, {"prompt": [[]]}, 400, "prompt", "prompt"),
    (C, {"prompt": [1, 2, 999999]}, 400, "prompt", "prompt_token_ids"),
    (C, {"prompt": [-1]}, 400, "prompt", "prompt_token_ids"),
    (C, {"prompt": "x", "max_tokens": "8"}, 400, "max_tokens", "integer"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    (C, {"prompt": "x", "temperature": -0.5}, 400, "temperature", "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p", "top_p"),
    # Out of SamplingParams' range (a vanishing penalty would overflow the logits).
    (
        C,
        {"prompt": "x", "repetition_penalty": 1e-300},
        400,
        "repetition_penalty",
        "repetition_penalty",
    ),
    (C, {"prompt": "x", "top_k": -3}, 400, "top_k", "top_k"),
    (C, {"prompt": "x", "min_p": 1.5}, 400, "min_p", "min_p"),
    (C, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", "presence_penalty"),
    (C, {"prompt": "x", "frequency_penalty": -2.5}, 400, "frequency_penalty", "frequency_penalty"),
    (C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "repetition_penalty"),
    (C, {"prompt": "x", "logprobs": 21}, 400, "logprobs", "logprobs"),
    (C, {"prompt": "x", "logprobs": True}, 400, "logprobs", "logprobs"),
    (C, {"prompt": "x", "n": 0}, 400, "n", "n"),
    (C, {"prompt": "x", "n": 1000}, 400, "n", "n"),
    (C, {"prompt": "x", "stop": ""}, 400, "stop", "stop"),
    (C, {"prompt": "x", "stop": [1]}, 400, "stop", "stop"),
    (C, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids", "stop_token_ids"),
    (C, {"prompt": "x", "seed": 2**70}, 400, "seed", "seed"),
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
    (
        C,
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "stream",
    ),
    (C, {"prompt": "x", "stream_options": {"include_usage": "yes"}}, 400, "stream_options.include_usage", "boolean"),
    (C, {"prompt": "x", "n": "2"}, 400, "n", "integer"),
    (C, {"prompt": "x", "response_format": {"type": "yaml"}}, 400, "response_format.type", "json"),
    (C, {"prompt": "x", "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema.schema", "required"),
    (C, {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs", "exactly one"),
    (C, {"prompt": "x", "structured_outputs": {"regex": "(unclosed"}}, 400, "structured_outputs", "regex"),
    (C, {"prompt": "x", "model": "gpt-4"}, 404, "model", "gpt-4"),
    (C, {"prompt": "x" * 5000}, 400, "prompt", "context"),
    (CHAT, {"messages": []}, 400, "messages", "messages"),
    # Any role reaches the template, which decides (this one refuses "robot").
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages", "robot"),
    (CHAT, {"messages": [{"role": 7, "content": "hi"}]}, 400, "messages.0.role", "string"),
    (CHAT, {"messages": [{"role": "tool", "content": "hi"}]}, 400, "messages", "not supported"),
    (CHAT, {"messages": MSGS, "logprobs": 3}, 400, "logprobs", "boolean"),
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 50}, 400, "logprobs", "logprobs"),
    (
        CHAT,
        {"messages": MSGS, "max_tokens": 2, "max_completion_tokens": 2},
        400,
        "max_completion_tokens",
        "max_tokens",
    ),
    (CHAT, {"messages": MSGS, "tool_choice": "required"}, 400, "tool_choice", "tools"),
    (CHAT, {"messages": MSGS, "tool_choice": "sometimes"}, 400, "tool_choice", "tool_choice"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function"}]}, 400, "tools.0.function", "missing"),
    (
        CHAT,
        {"messages": MSGS, "tools": [{"function": {"name": "f"}}]},
        400,
        "tool_choice",
        "--enable-auto-tool-choice",
    ),
    (
        CHAT,
        {"messages": MSGS, "add_generation_prompt": True, "continue_final_message": True},
        400,
        "continue_final_message",
        "add_generation_prompt",
    ),
    (CHAT, {"messages": MSGS, "model": "nope"}, 404, "model", "nope"),
    (CHAT, {"prompt": "x"}, 400, "messages", "missing"),
]


def _check_shape(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    if status == 200:
        return {}
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "words"),
    CASES,
    ids=[f"{i}-{c[3]}" for i, c in enumerate(CASES)],
)
def test_bad_request(client: httpx.Client, path, body, status, param, words) -> None:
    err = _check_shape(client.post(path, json=body), status)
    if status == 200:
        return
    assert err["param"] == param
    assert words in err["message"]
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("content", "headers", "code"),
    [
        (b"{not json", {"content-type": "application/json"}, "invalid_json"),
        (b'{"prompt": "x"', {"content-type": "application/json"}, "invalid_json"),
        (b"[1, 2]", {"content-type": "application/json"}, "invalid_body"),
        (b'{"prompt": "x"}', {"content-type": "text/plain"}, "invalid_body"),
        (b"", {"content-type": "application/json"}, "missing_body"),
    ],
)
def test_bad_body(client: httpx.Client, content: bytes, headers: dict, code: str) -> None:
    err = _check_shape(client.post(C, content=content, headers=headers), 400)
    assert err["code"] == code


def test_unknown_route_and_method(client: httpx.Client) -> None:
    assert _check_shape(client.get("/v1/nothing"), 404)["code"] == "not_found"
    assert _check_shape(client.get(C), 405)["code"] == "method_not_allowed"


def test_bad_requests_leave_engine_clean(server, client: httpx.Client) -> None:
    for path, body, *_ in CASES:
        client.post(path, json=body)
    stats = server.wait_idle()
    server.engine.call_sync(lambda e: e.scheduler.check_integrity())
    assert stats["requests_running"] == stats["requests_waiting"] == 0
    # ...and the server still answers.
    assert client.post(C, json={"prompt": "still fine", "max_tokens": 2}).status_code == 200


def test_api_key(chat_model, server_factory) -> None:
    srv = server_factory(chat_model, api_key="s3cret", served_model_name="tiny")
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        body = {"prompt": "x", "max_tokens": 2}
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "s3cret"},
            {"Authorization": "Basic s3cret"},
        ):
            r = c.post(C, json=body, headers=headers)
            err = _check_shape(r, 401)
            assert err["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        assert _check_shape(c.get("/v1/models"), 401)["code"] == "invalid_api_key"
        ok = {"Authorization": "Bearer s3cret"}
        assert c.post(C, json=body, headers=ok).status_code == 200
        assert c.get("/v1/models", headers=ok).status_code == 200
        # Probes and scrapers need no key.
        assert c.get("/health").status_code == 200
        assert c.head("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        # The schema and its viewers are behind the key too.
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
            assert _check_shape(c.get(path), 401)["code"] == "invalid_api_key", path
        assert c.get("/openapi.json", headers=ok).json()["info"]["title"] == "hybridserve"
        assert c.get("/docs", headers=ok).status_code == 200


def test_chat_without_template(plain_model, server_factory) -> None:
    srv = server_factory(plain_model, served_model_name="plain")
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        r = c.post(CHAT, json={"messages": MSGS, "max_tokens": 2})
        err = _check_shape(r, 400)
        assert err["code"] == "no_chat_template" and "--chat-template" in err["message"]
        # Completions still work.
        assert c.post(C, json={"prompt": "x", "max_tokens": 2}).status_code == 200


# ---- text that is not Unicode, templates that fail (500s that were 400s) -----------

SURROGATE = "a\ud800b"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (C, {"prompt": SURROGATE}, "prompt"),
        (C, {"prompt": ["fine", SURROGATE]}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": SURROGATE}]}, "messages.0.content"),
        (
            CHAT,
            {
                "messages": [
                    {"role": "system", "content": "ok"},
                    {"role": "user", "content": [{"type": "text", "text": SURROGATE}]},
                ]
            },
            "messages.1.content.0.text",
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "hi", "name": SURROGATE}]},
            "messages.0.name",
        ),
    ],
)
def test_lone_surrogate_is_a_400(client: httpx.Client, path, body, param) -> None:
    # json.dumps escapes the surrogate as \ud800, which JSON allows and Python decodes.
    raw = json.dumps({**body, "max_tokens": 2}).encode()
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    err = _check_shape(r, 400)
    assert err["param"] == param and "surrogate" in err["message"]


def test_null_content_renders_as_empty(client: httpx.Client) -> None:
    def prompt_tokens(content) -> int:
        msgs = [{"role": "system", "content": content}, {"role": "user", "content": "hi"}]
        r = client.post(CHAT, json={"messages": msgs, "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    assert prompt_tokens(None) == prompt_tokens("")  # not the text "None"


# Dispatches on the user's text to a template that fails in one way or another.
FAILING_TEMPLATE = (
    "{% set c = messages[-1]['content'] %}"
    "{% if c == 'overflow' %}{% for i in range(10**9) %}x{% endfor %}"
    "{% elif c == 'divide' %}{{ 1 / 0 }}"
    "{% elif c == 'huge' %}{% for i in range(99999) %}{{ 'y' * 99 }}{% endfor %}"
    "{% elif c == 'surrogate' %}{{ '\\ud800' }}"
    "{% else %}[{{ c }}]{% endif %}"
)


def test_template_failures_are_400s(chat_model, server_factory) -> None:
    srv = server_factory(chat_model, served_model_name="tiny", chat_template=FAILING_TEMPLATE)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:

        def chat(text: str) -> httpx.Response:
            return c.post(CHAT, json={"messages": [{"role": "user", "content": text}]})

        for text, words in [
            ("overflow", "OverflowError"),
            ("divide", "ZeroDivisionError"),
            ("huge", "passes"),  # the output cap, not a 10-million-character prompt
            ("surrogate", "surrogate"),
        ]:
            err = _check_shape(chat(text), 400)
            assert err["param"] == "messages" and words in err["message"], (text, err)
        ok = c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens"] == len("[hi]")
    srv.wait_idle()


# ---- access -----------------------------------------------------------------------


def test_model_must_be_a_served_name(server, client: httpx.Client, chat_model) -> None:
    for model in (str(chat_model), chat_model.name, "/etc"):
        err = _check_shape(client.post(C, json={"prompt": "x", "model": model}), 404)
        assert err["code"] == "model_not_found"
    assert client.post(C, json={"prompt": "x", "model": "tiny", "max_tokens": 1}).status_code == 200


def test_head_health(client: httpx.Client) -> None:
    r = client.head("/health")
    assert r.status_code == 200 and r.content == b""


def test_stop_strings_need_a_tokenizer(server_factory, tmp_path) -> None:
    from hybridserve.testing.tiny_models import make_tiny_checkpoint

    model = make_tiny_checkpoint("granitemoehybrid", tmp_path, seed=1)  # no tokenizer
    srv = server_factory(model, served_model_name="bare")
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        body = {"prompt": [5, 6, 7], "max_tokens": 3}
        err = _check_shape(c.post(C, json={**body, "stop": ["x"]}), 400)
        assert err["param"] == "stop" and "stop_token_ids" in err["message"]
        r = c.post(C, json={**body, "stop_token_ids": [9]})
        assert r.status_code == 200, r.text
    srv.wait_idle()


def test_empty_api_key_is_refused(chat_model) -> None:
    from hybridserve import LLM
    from hybridserve.server import create_app

    llm = LLM(chat_model, max_num_seqs=2)
    for key in ("", "  "):
        with pytest.raises(ValueError, match="api_key is empty"):
            create_app(llm, api_key=key)
