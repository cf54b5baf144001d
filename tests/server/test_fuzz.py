"""Property-based fuzzing of every route in the app's OpenAPI schema: whatever the
body, the server answers with a non-5xx status (and keeps its caches intact).

The default run is small (a fixed seed, 20 examples per route and mode); the ``slow``
variant runs 100 examples per route and mode.
"""

from __future__ import annotations

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode


def _fuzz(server, max_examples: int) -> int:
    schema = schemathesis.openapi.from_dict(server.app.openapi())
    session = requests.Session()
    calls = 0
    for result in schema.get_all_operations():
        op = result.ok()
        # A GET without parameters has no invalid form to generate.
        modes = [GenerationMode.POSITIVE]
        if op.method.upper() == "POST":
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(
                max_examples=max_examples,
                derandomize=True,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def check(case) -> None:
                nonlocal calls
                resp = case.call(base_url=server.base_url, session=session, timeout=60)
                calls += 1
                assert resp.status_code < 500, (
                    f"{case.method} {case.path} -> {resp.status_code}: {resp.text[:500]}\n"
                    f"body: {case.body!r}"
                )
                if resp.status_code >= 400:
                    err = resp.json()["error"]
                    assert err["message"] and err["type"]

            check()
    return calls


def _check_clean(server) -> None:
    server.wait_idle(timeout=60)
    server.engine.call_sync(lambda e: e.scheduler.check_integrity())
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        assert c.get("/health").status_code == 200


def test_fuzz_quick(chat_model, server_factory) -> None:
    # A short context keeps every generated request quick whatever its max_tokens.
    srv = server_factory(chat_model, served_model_name="tiny", max_model_len=48)
    assert _fuzz(srv, max_examples=20) > 0
    _check_clean(srv)


@pytest.mark.slow
def test_fuzz_full(chat_model, server_factory) -> None:
    srv = server_factory(chat_model, served_model_name="tiny", max_model_len=48)
    assert _fuzz(srv, max_examples=100) > 0
    _check_clean(srv)
