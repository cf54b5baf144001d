"""CORS (``--allowed-origins`` and friends, vLLM's flags): off by default; when on, the
listed origins get the headers, preflights pass the key check, others get none."""

from __future__ import annotations

import httpx

ORIGIN = "https://app.example"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


def test_no_cors_headers_by_default(client: httpx.Client) -> None:
    r = client.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200
    assert "access-control-allow-origin" not in r.headers
    r = client.options("/v1/completions", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in r.headers


def test_allowed_origins(chat_model, server_factory) -> None:
    srv = server_factory(chat_model, served_model_name="tiny", api_key="k3y",
                         allowed_origins=[ORIGIN], allowed_methods=["GET", "POST"])
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        # The preflight carries no key and must still be answered.
        r = c.options("/v1/completions", headers=PREFLIGHT)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert set(r.headers["access-control-allow-methods"].replace(" ", "").split(",")) == {"GET", "POST"}
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                   headers={"Origin": ORIGIN, "Authorization": "Bearer k3y"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        # A refused key still tells the browser what happened.
        r = c.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
        r = c.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert r.status_code == 400
        assert "access-control-allow-origin" not in r.headers
        r = c.options("/v1/completions", headers={**PREFLIGHT, "Access-Control-Request-Method": "DELETE"})
        assert r.status_code == 400


def test_cors_flags_parse_as_vllm_spells_them(capsys) -> None:
    import argparse

    import pytest

    from hybridserve.server.cli import add_serve_arguments

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    args = p.parse_args(["--allowed-origins", '["https://a.example", "https://b.example"]',
                         "--allowed-methods", '["GET"]', "--allow-credentials",
                         "--enable-tokenizer-info-endpoint"])
    assert args.allowed_origins == ["https://a.example", "https://b.example"]
    assert args.allowed_methods == ["GET"] and args.allowed_headers is None
    assert args.allow_credentials and args.enable_tokenizer_info_endpoint
    assert p.parse_args([]).allowed_origins is None
    with pytest.raises(SystemExit):
        p.parse_args(["--allowed-origins", "https://a.example"])
    assert "JSON list" in capsys.readouterr().err
