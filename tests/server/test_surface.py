"""The rest of vLLM's surface: unknown fields ignored with a warning, nulls as
defaults, /tokenize, /detokenize, /version, /v1/models/{id}, the client's X-Request-Id
echoed, stop_reason, include_stop_str_in_output, chat templates beside the checkpoint
and with ``{% generation %}``, and ``serve`` flags in vLLM's spelling."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import httpx
import pytest

from hybridserve import __version__
from hybridserve.cli import main as cli_main

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


def test_unknown_fields_are_ignored_with_a_warning(client: httpx.Client, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="hybridserve.server"):
        r = client.post(C, json={"prompt": "x", "max_tokens": 2, "best_of": 1, "suffix_x": "s"})
        assert r.status_code == 200, r.text
        body = {"messages": [{"role": "user", "content": "hi", "audio_x": 1}], "max_tokens": 2, "foo": {}}
        assert client.post(CHAT, json=body).status_code == 200
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "'best_of'" in warned and "'suffix_x'" in warned
    assert "'messages.0.audio_x'" in warned and "'foo'" in warned


def test_nulls_are_defaults(client: httpx.Client) -> None:
    body = {
        "messages": [
            {"role": "user", "content": "hi"},
            # The openai SDK's message.model_dump(), sent back as history.
            {"role": "assistant", "content": "yo", "refusal": None, "annotations": None,
             "audio": None, "function_call": None, "tool_calls": None},
            {"role": "user", "content": "again"},
        ],
        "n": None, "stream": None, "temperature": None, "stop": None, "max_tokens": 3,
        "stream_options": None, "tools": None, "tool_choice": None, "response_format": None,
    }
    r = client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    # A wrong type of a known field is still a 400.
    r = client.post(CHAT, json={**body, "n": "2"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_tokenize_detokenize(client: httpx.Client, server) -> None:
    r = client.post("/tokenize", json={"prompt": "héllo", "return_token_strs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    tok = server.app.state.server.serving.config.tokenizer
    assert out["tokens"] == tok.encode("héllo")
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] > 0
    assert len(out["token_strs"]) == out["count"]
    r = client.post("/detokenize", json={"tokens": out["tokens"]})
    assert r.json() == {"prompt": "héllo"}
    # Chat messages are rendered with the template first, as the chat route does.
    r = client.post("/tokenize", json={"messages": MSGS})
    text = client.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text.endswith("<user>hi" + tok.eos_token + "\n<assistant>")
    r = client.post("/tokenize", json={"messages": MSGS, "add_generation_prompt": False})
    assert client.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"].endswith("\n")
    assert client.post("/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert client.post("/tokenize", json={}).status_code == 400
    assert client.post("/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404


def test_version_and_model_card(client: httpx.Client) -> None:
    assert client.get("/version").json() == {"version": __version__}
    card = client.get("/v1/models/tiny")
    assert card.status_code == 200 and card.json()["id"] == "tiny"
    assert card.json() == client.get("/v1/models").json()["data"][0]
    assert client.get("/v1/models/other").status_code == 404


def test_request_id_echoed(client: httpx.Client) -> None:
    r = client.post(C, json={"prompt": "x", "max_tokens": 2}, headers={"X-Request-Id": "mine-1"})
    assert r.headers["x-request-id"] == "mine-1"
    with client.stream("POST", C, json={"prompt": "x", "max_tokens": 2, "stream": True},
                       headers={"X-Request-Id": "mine-2"}) as r:
        assert r.headers["x-request-id"] == "mine-2"
        r.read()
    r = client.post(C, json={"prompt": "x", "max_tokens": 2})
    assert r.headers["x-request-id"].startswith("cmpl-")


def test_stop_reason_and_include_stop_str(client: httpx.Client) -> None:
    base = {"prompt": "abc", "max_tokens": 40, "temperature": 0.0}
    free = client.post(C, json=base).json()["choices"][0]["text"]
    stop = free[5:7]
    assert len(stop) == 2
    cut = client.post(C, json={**base, "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["text"] == free[: free.index(stop)]
    kept = client.post(C, json={**base, "stop": [stop], "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == free[: free.index(stop)] + stop
    chat = client.post(CHAT, json={"messages": MSGS, "max_tokens": 3}).json()["choices"][0]
    assert chat["finish_reason"] == "length" and chat["stop_reason"] is None


def test_checkpoint_chat_template_jinja_and_generation_tags(plain_model: Path, tmp_path: Path, server_factory) -> None:
    # save_pretrained writes the template beside the weights, not into tokenizer_config.
    ckpt = tmp_path / "ckpt"
    shutil.copytree(plain_model, ckpt)
    (ckpt / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    srv = server_factory(ckpt, served_model_name="ckpt")
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        msgs = MSGS + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
        ids = c.post("/tokenize", json={"messages": msgs}).json()["tokens"]
        text = c.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        assert text == "[user]hi[assistant]ok[user]more[assistant]"
        assert c.post(CHAT, json={"messages": MSGS, "max_tokens": 2}).status_code == 200


def _cli_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_unknown_flags_name_the_nearest(capsys) -> None:
    err = _cli_error(["serve", "--enable-prefix-cashing"], capsys)
    assert "--enable-prefix-cashing" in err and "nearest option is --enable-prefix-caching" in err
    err = _cli_error(["serve", "--max-model-length", "5"], capsys)
    assert "--max-model-len" in err
    err = _cli_error(["serve", "--pipeline-parallel-size", "2"], capsys)
    assert "--tensor-parallel-size" in err
    assert "not valid JSON" in _cli_error(["serve", "--speculative-config", "{nope"], capsys)


def test_vllm_spelled_flags_reach_the_engine(tiny_granite: Path) -> None:
    import argparse

    from hybridserve.cli import add_engine_arguments, llm_from_args

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    args = p.parse_args([
        "--model", str(tiny_granite), "--no-enable-prefix-caching", "--max-model-len", "256",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
        "--mamba-ssm-cache-dtype", "bfloat16", "--seed", "3",
    ])
    llm = llm_from_args(args)
    cfg = llm.config
    assert not cfg.cache.enable_prefix_caching
    assert cfg.scheduler.max_model_len == 256
    assert cfg.speculative.num_speculative_tokens == 2
    assert "bfloat16" in str(cfg.cache.ssm_state_dtype) and cfg.seed == 3
    assert p.parse_args(["--enable-prefix-caching"]).enable_prefix_caching
    assert not p.parse_args(["--no-prefix-caching"]).enable_prefix_caching


def test_bad_parser_names_fail_before_loading(tmp_path: Path, capsys) -> None:
    # A model path that does not exist: the parser check must come first.
    for flags, words in (
        (["--tool-call-parser", "nope"], "--tool-call-parser 'nope'"),
        (["--reasoning-parser", "nope"], "--reasoning-parser 'nope'"),
        (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
    ):
        assert cli_main(["serve", str(tmp_path / "missing"), *flags]) == 2
        assert words in capsys.readouterr().err


def test_continuous_usage_stats(client: httpx.Client) -> None:
    body = {"prompt": "abc", "max_tokens": 6, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with client.stream("POST", C, json=body) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts and counts == sorted(counts) and counts[0] > 0
    assert all(c["usage"]["prompt_tokens"] == 3 for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert counts[-1] == 6


def test_generation_config_defaults_and_eos(plain_model: Path, chat_template_text: str, tmp_path: Path, server_factory) -> None:
    ckpt = tmp_path / "gen"
    shutil.copytree(plain_model, ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "temperature": 0.0}))
    srv = server_factory(ckpt, served_model_name="gen")
    assert set(srv.engine.engine.eos_token_ids) >= {2, 7}
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        body = {"prompt": "abc", "max_tokens": 12, "ignore_eos": True}
        # No temperature in the request: the checkpoint's default (greedy) applies.
        texts = {c.post(C, json=body).json()["choices"][0]["text"] for _ in range(2)}
        greedy = c.post(C, json={**body, "temperature": 0.0}).json()["choices"][0]["text"]
        assert texts == {greedy}
        sampled = {c.post(C, json={**body, "temperature": 1.0, "seed": s}).json()["choices"][0]["text"] for s in range(3)}
        assert len(sampled) > 1  # the request's own value wins
    (ckpt / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ValueError, match="generation_config.json.*top_p"):
        server_factory(ckpt)


def test_min_tokens_and_allowed_token_ids(client: httpx.Client) -> None:
    allowed = client.post("/tokenize", json={"prompt": "xyz", "add_special_tokens": False}).json()["tokens"]
    r = client.post(C, json={"prompt": [5, 6, 7], "max_tokens": 8, "allowed_token_ids": allowed,
                             "ignore_eos": True, "logprobs": 0, "temperature": 1.0, "seed": 1})
    assert r.status_code == 200, r.text
    assert set(r.json()["choices"][0]["text"]) <= set("xyz")
    base = {"prompt": "abc", "max_tokens": 8, "temperature": 0.0}
    first = client.post("/tokenize", json={"prompt": client.post(C, json={**base, "max_tokens": 1}).json()["choices"][0]["text"],
                                           "add_special_tokens": False}).json()["tokens"][0]
    short = client.post(C, json={**base, "stop_token_ids": [first]}).json()
    assert short["usage"]["completion_tokens"] == 1 and short["choices"][0]["stop_reason"] == first
    held = client.post(C, json={**base, "stop_token_ids": [first], "min_tokens": 5}).json()
    assert held["usage"]["completion_tokens"] >= 5
