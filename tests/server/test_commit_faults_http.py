"""A fault while the engine commits one request's step (after the forward) fails that
request alone: it gets an ``engine_error``, a concurrent request gets its exact
output, nothing leaks, ``/health`` stays 200 and the server keeps serving."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from hybridserve import SamplingParams
from hybridserve.engine.engine_core import EngineCore
from hybridserve.engine.request import Request
from hybridserve.engine.scheduler import ScheduledRow, Scheduler

DOOMED = 17  # max_tokens that marks the request the fault is injected into


def _is_doomed(args) -> bool:
    for a in args:
        req = a.request if isinstance(a, ScheduledRow) else a
        if isinstance(req, Request):
            return req.params.max_tokens == DOOMED
    return False


def _inject(monkeypatch, owner: type, name: str, nth: int) -> list:
    real = getattr(owner, name)
    calls, raised = [0], []

    def faulty(self, *args, **kwargs):
        if _is_doomed(args):
            calls[0] += 1
            if calls[0] == nth:
                raised.append(name)
                raise RuntimeError(f"injected fault in {name}")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, faulty)
    return raised


SITES = [
    (EngineCore, "_append_tokens", 3),
    (Scheduler, "commit_prefill_row", 1),
    (Scheduler, "commit_decode_row", 3),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("owner", "name", "nth"), SITES, ids=[s[1] for s in SITES])
def test_a_commit_fault_fails_one_request(
    server, reference_llm, monkeypatch, owner, name, nth, stream
):
    failed_before = server.engine.stats_sync()["requests_failed"]
    raised = _inject(monkeypatch, owner, name, nth)
    other: dict = {}
    started = threading.Event()

    def bystander() -> None:
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            body = {"prompt": "bystander", "max_tokens": 48, "temperature": 0, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                text = ""
                for line in r.iter_lines():
                    started.set()
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
                other["r"] = (r.status_code, text)

    t = threading.Thread(target=bystander)
    t.start()
    assert started.wait(30)
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        body = {"prompt": "doomed", "max_tokens": DOOMED, "ignore_eos": True, "stream": stream}
        r = c.post("/v1/completions", json=body)
        if stream:
            events = [e for e in r.text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            err = json.loads(events[-2][6:])["error"]
        else:
            assert r.status_code == 500
            err = r.json()["error"]
        assert err["code"] == "engine_error"
        assert c.get("/health").status_code == 200
        t.join(60)
        want = reference_llm.generate(
            ["bystander"], SamplingParams(max_tokens=48, temperature=0), use_tqdm=False
        )[0].outputs[0].text
        assert other["r"] == (200, want)
        # The engine keeps serving, the same prompt included.
        ok = c.post("/v1/completions", json={**body, "max_tokens": 16, "stream": False})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 16
    assert raised == [name]
    stats = server.wait_idle()
    assert stats["requests_failed"] == failed_before + 1
    assert server.engine.healthy
    server.engine.call_sync(lambda e: e.scheduler.check_integrity())
    assert stats["state_pages_free"] + stats["checkpoint_pages"] == stats["state_pages_total"]
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
