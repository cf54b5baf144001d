"""``hybridserve serve`` as a real process: startup log, chat template file, request
ids in the log, and a graceful stop on SIGINT that lets an in-flight stream finish."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with log.open("wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "hybridserve.cli", "serve", *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
        )


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"server did not come up:\n{log.read_text()}")


def test_serve_process_lifecycle(
    plain_model: Path, chat_template_text: str, tmp_path: Path
) -> None:
    template = tmp_path / "template.jinja"
    template.write_text(chat_template_text)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    proc = _serve(
        [
            "--model",
            str(plain_model),
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--chat-template",
            str(template),
            "--max-num-seqs",
            "8",
        ],
        log,
    )
    try:
        _wait_healthy(proc, url, log)
        with httpx.Client(base_url=url, timeout=60) as c:
            r = c.post(
                "/v1/chat/completions",
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3,
                },
            )
            assert r.status_code == 200, r.text
            chat_id = r.json()["id"]
            # SIGINT while a stream is in flight: the stream still ends normally.
            body = {
                "model": "tiny",
                "prompt": "graceful",
                "max_tokens": 40,
                "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            }
            events = []
            with c.stream("POST", "/v1/completions", json=body) as s:
                for line in s.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if len(events) == 1:
                        proc.send_signal(signal.SIGINT)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 40
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    for piece in (
        f"model={plain_model}",
        "as 'tiny'",
        "dtype=float32",
        "device=cpu",
        "num_kv_blocks=",
        "kv_block_size=16",
        "num_state_pages=",
        "state_interval=64",
        f"http://127.0.0.1:{port}",
    ):
        assert piece in text, piece
    assert f"request {chat_id}:" in text
    assert "shutting down" in text and "server stopped" in text
    assert "Traceback" not in text


def test_serve_bad_template_path(plain_model: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    proc = _serve(
        [
            "--model",
            str(plain_model),
            "--port",
            str(_free_port()),
            "--chat-template",
            str(tmp_path / "missing.jinja"),
        ],
        log,
    )
    assert proc.wait(timeout=90) == 2
    assert "--chat-template" in log.read_text()


def test_serve_refuses_an_empty_api_key(plain_model: Path, monkeypatch, capsys) -> None:
    from hybridserve.cli import main

    monkeypatch.setenv("HYBRIDSERVE_API_KEY", "")
    t0 = time.monotonic()
    assert main(["serve", "--model", str(plain_model)]) == 2
    assert "HYBRIDSERVE_API_KEY" in capsys.readouterr().err
    assert time.monotonic() - t0 < 5  # refused before the model is loaded


def test_serve_warns_when_reachable_without_a_key(plain_model: Path, monkeypatch, caplog) -> None:
    from hybridserve.cli import main
    from hybridserve.server import http

    ran = []
    monkeypatch.setattr(http.Server, "run", lambda self: ran.append(self.config.host))
    monkeypatch.delenv("HYBRIDSERVE_API_KEY", raising=False)
    caplog.set_level(logging.INFO, logger="hybridserve.server")
    assert main(["serve", "--model", str(plain_model), "--host", "0.0.0.0"]) == 0
    assert ran == ["0.0.0.0"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("0.0.0.0 without an API key" in w for w in warnings), warnings


def test_access_checks() -> None:
    from hybridserve.server.cli import check_access, is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("example.org")
    with pytest.raises(ValueError, match="empty"):
        check_access("127.0.0.1", " ")
    check_access("0.0.0.0", "key")  # a key: no refusal


def test_freeze_startup_heap_takes_the_live_objects_out_of_collections() -> None:
    """The server freezes what start-up left alive before it serves: a full collection
    then walks only what serving allocates since."""
    import gc

    from hybridserve.server.cli import freeze_startup_heap

    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > 1000
        assert len(gc.get_objects(generation=2)) < frozen
    finally:
        gc.unfreeze()
