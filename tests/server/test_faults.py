"""Clients that leave, and failures inside one request or one engine step: the
request concerned is aborted and its pages freed, everyone else keeps being served."""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time

import httpx
import pytest

from hybridserve import SamplingParams
from hybridserve.server import serving

LONG = 3500  # tokens: far more than a test waits for, so only an abort ends it early


def _generic_error(err: dict, secret: str, caplog) -> str:
    """Check a server-side error as clients get it: a request id to quote, none of
    the exception's text; the log has that text under the same id."""
    assert secret not in err["message"]
    match = re.search(r"(?:chat)?cmpl-[0-9a-f]{32}", err["message"])
    assert match, err["message"]
    rid = match.group(0)
    logged = [r for r in caplog.records if rid in r.getMessage()]
    assert any(
        secret in r.getMessage() or (r.exc_info and secret in str(r.exc_info[1])) for r in logged
    ), [r.getMessage() for r in logged]
    return rid


def _assert_clean(server, aborted_before: int, at_least: int = 1) -> dict:
    stats = server.wait_idle(timeout=20)
    server.engine.call_sync(lambda e: e.scheduler.check_integrity())
    assert stats["requests_aborted"] - aborted_before >= at_least
    return stats


def test_stream_disconnect_aborts_and_frees(server, reference_llm) -> None:
    aborted = server.engine.stats()["requests_aborted"]
    other: dict = {}

    def bystander() -> None:
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            other["r"] = c.post(
                "/v1/completions", json={"prompt": "bystander", "max_tokens": 24, "temperature": 0}
            )

    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        body = {
            "prompt": "a long story",
            "max_tokens": LONG,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            t = threading.Thread(target=bystander)
            t.start()
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break
        # Leaving the block closed the connection mid-stream.
    stats = _assert_clean(server, aborted)
    assert stats["requests_running"] == 0
    t.join(30)
    want = (
        reference_llm.generate(
            ["bystander"], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    assert other["r"].status_code == 200 and other["r"].json()["choices"][0]["text"] == want


def test_non_streaming_disconnect_aborts(server) -> None:
    aborted = server.engine.stats()["requests_aborted"]
    body = json.dumps(
        {"prompt": "never read", "max_tokens": LONG, "ignore_eos": True, "n": 2}
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        deadline = time.monotonic() + 20
        while server.engine.stats()["requests_running"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
    _assert_clean(server, aborted)


def test_error_while_formatting_one_request(server, monkeypatch, caplog) -> None:
    """A request whose response cannot be built gets a 500 of its own; a concurrent
    request is unaffected and nothing is leaked."""
    caplog.set_level(logging.INFO, logger="hybridserve.server")
    original = serving._CompletionFormat.legacy_logprobs

    def broken(self, comp, start, end, offset):
        if self.logprobs == 4:
            raise RuntimeError("formatting exploded")
        return original(self, comp, start, end, offset)

    monkeypatch.setattr(serving._CompletionFormat, "legacy_logprobs", broken)
    aborted = server.engine.stats()["requests_aborted"]
    results: dict = {}

    def good() -> None:
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            results["good"] = c.post(
                "/v1/completions",
                json={"prompt": "fine", "max_tokens": 16, "ignore_eos": True, "logprobs": 1},
            )

    t = threading.Thread(target=good)
    t.start()
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "bad", "max_tokens": 4, "logprobs": 4})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "internal_error"
        _generic_error(err, "formatting exploded", caplog)
        body = {
            "prompt": "bad",
            "max_tokens": LONG,
            "ignore_eos": True,
            "logprobs": 4,
            "stream": True,
        }
        with c.stream("POST", "/v1/completions", json=body) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        _generic_error(json.loads(lines[-2][6:])["error"], "formatting exploded", caplog)
    t.join(30)
    assert results["good"].status_code == 200
    assert len(results["good"].json()["choices"][0]["logprobs"]["tokens"]) == 16
    # The failed stream was aborted long before its 3500 tokens.
    _assert_clean(server, aborted)


@pytest.mark.parametrize("stream", [False, True])
def test_engine_step_failure(chat_model, server_factory, stream: bool, caplog) -> None:
    caplog.set_level(logging.INFO, logger="hybridserve.server")
    srv = server_factory(chat_model, served_model_name="tiny")
    core = srv.engine.engine
    real_step = core.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected step failure")
        return real_step()

    core.step = failing_step  # runs on the engine thread, like the real one
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        body = {"prompt": "doomed", "max_tokens": 20, "stream": stream}
        r = c.post("/v1/completions", json=body)
        if stream:
            events = [e for e in r.text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            err = json.loads(events[-2][6:])["error"]
        else:
            assert r.status_code == 500
            err = r.json()["error"]
        assert err["code"] == "engine_error"
        _generic_error(err, "injected step failure", caplog)
        assert c.get("/health").status_code == 200
        # The engine is intact and keeps serving.
        ok = c.post("/v1/completions", json={"prompt": "next", "max_tokens": 4})
        assert ok.status_code == 200
        assert ok.json()["usage"]["completion_tokens"] == 4
        stats = srv.wait_idle()
        assert stats["requests_failed"] == 1
        srv.engine.call_sync(lambda e: e.scheduler.check_integrity())
        metrics = c.get("/metrics").text
        assert "hybridserve_requests_failed_total 1" in metrics


def test_unexpected_error_is_generic(server, monkeypatch, caplog) -> None:
    """An exception no handler expected: a 500 with an error id, the text only in the log."""
    caplog.set_level(logging.INFO, logger="hybridserve.server")

    async def broken(self, req, receive):
        raise RuntimeError("secret path /srv/models/x")

    monkeypatch.setattr(serving.OpenAIServing, "completions", broken)
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == "internal_error" and "secret" not in err["message"]
    (error_id,) = re.findall(r"err-[0-9a-f]{32}", err["message"])
    assert any(
        error_id in rec.getMessage() and "secret path" in str(rec.exc_info[1])
        for rec in caplog.records
        if rec.exc_info
    )
