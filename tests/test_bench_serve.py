"""benchmarks/bench_serve.py: its traces, its statistics, and (slow) one end-to-end run."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_serve  # noqa: E402


def test_traces_are_poisson_and_agentic_turns_share_the_system_prompt():
    rng = random.Random(0)
    system = bench_serve.system_prompt(rng, 3, 10)
    assert system.count('"name": "tool_') == 3
    convs = bench_serve.agentic_trace(rng, rate=4.0, n=2000, turns=3, system=system,
                                      max_tokens=8, think_s=1.0, tool_words=5)
    arrivals = [c.arrival for c in convs]
    assert arrivals == sorted(arrivals)
    gaps = [b - a for a, b in zip([0.0] + arrivals, arrivals)]
    assert abs(sum(gaps) / len(gaps) - 0.25) < 0.02  # mean gap 1 / rate
    assert all(c.opening.startswith(system) and len(c.tool_results) == 2 for c in convs)
    chat = bench_serve.chat_trace(random.Random(1), 2.0, 500, (5, 10), (50, 60), (4, 16))
    lengths = {len(r.prompt.split()) > 40 for r in chat}
    assert lengths == {True, False} and {r.max_tokens for r in chat} == {4, 16}


def test_summarize_computes_latency_goodput_and_hit_rates():
    R = bench_serve.Record
    recs = [
        R(sent=0.0, first=0.1, end=1.1, prompt_tokens=100, cached_tokens=80, completion_tokens=11,
          reusable_tokens=90),
        R(sent=1.0, first=3.0, end=3.5, prompt_tokens=50, cached_tokens=0, completion_tokens=6),
        R(sent=2.0, error="HTTP 500"),
    ]
    before = {"prefix_query_tokens_total": 10.0, "prefix_hit_tokens_total": 5.0, "preemptions_total": 1.0}
    after = {"prefix_query_tokens_total": 160.0, "prefix_hit_tokens_total": 85.0, "preemptions_total": 3.0}
    s = bench_serve.summarize(recs, wall=4.0, before=before, after=after, slo_ttft=500.0, slo_itl=150.0)
    assert s["errors"] == 1 and s["first_error"] == "HTTP 500"
    assert s["ttft_ms"]["p50"] == pytest.approx(1050.0)
    assert s["itl_ms"]["p50"] == pytest.approx(100.0)  # 1 s / 10 gaps and 0.5 s / 5 gaps
    assert s["e2e_ms"]["p99"] == pytest.approx(1100.0 + 0.99 * 1400.0)
    assert s["goodput_rps"] == pytest.approx(1 / 4.0)  # only the first meets both SLOs
    assert s["token_hit_rate"] == pytest.approx(80 / 150)
    assert s["reusable_hit_rate"] == pytest.approx(80 / 90)
    assert s["metrics_hit_rate"] == pytest.approx(80 / 150)
    assert s["preemptions"] == 2.0


@pytest.mark.slow
def test_smoke_run_writes_every_configuration(tmp_path):
    out = tmp_path / "serve.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"), "--smoke", "--out", str(out),
         "--log-dir", str(tmp_path), "--configs", "caching_off,caching_host_tier"],
        check=True, cwd=ROOT, timeout=900,
    )
    doc = json.loads(out.read_text())
    res = doc["results"]
    assert set(res) == {"caching_off", "caching_host_tier"}
    for name in res:
        for trace in ("agentic", "chat"):
            for run in res[name][trace].values():
                assert run["errors"] == 0 and run["requests"] > 0
    off = res["caching_off"]["agentic"]["4.0"]
    on = res["caching_host_tier"]["agentic"]["4.0"]
    assert off["token_hit_rate"] == 0.0 and on["reusable_hit_rate"] > 0.8
    assert doc["profile"]["pure_decode"]["host_ms_p50"] > 0


def test_random_model_tokenizer_decodes_every_id_and_encodes_to_bytes():
    # Random weights generate ids across the vocabulary; each must stream visible text,
    # or the client never sees a first token.
    tok, alphabet = bench_serve.byte_tokenizer(131072)
    assert tok.get_vocab_size() == 131072
    for i in (256, 257, 4096, 131071):
        text = tok.decode([i])
        assert len(text) == 3 and text.isascii() and text.isalpha()
    ids = tok.encode("def f(x):\n    return x  # é").ids
    assert ids and max(ids) < 256
