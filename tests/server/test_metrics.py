"""``/metrics`` is valid Prometheus text and its counters follow the requests."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

EXPECTED = {
    "hybridserve_requests_running": "gauge",
    "hybridserve_requests_waiting": "gauge",
    "hybridserve_prompt_tokens": "counter",
    "hybridserve_generation_tokens": "counter",
    "hybridserve_prefix_queries": "counter",
    "hybridserve_prefix_query_tokens": "counter",
    "hybridserve_prefix_hit_tokens": "counter",
    "hybridserve_prefix_hit_rate": "gauge",
    "hybridserve_checkpoint_pages": "gauge",
    "hybridserve_spec_draft_tokens": "counter",
    "hybridserve_spec_accepted_tokens": "counter",
    "hybridserve_spec_acceptance_rate": "gauge",
    "hybridserve_requests_finished": "counter",
    "hybridserve_requests_aborted": "counter",
    "hybridserve_kv_blocks_free": "gauge",
    "hybridserve_state_pages_free": "gauge",
}


def scrape(c: httpx.Client) -> dict[str, float]:
    r = c.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    values: dict[str, float] = {}
    kinds = {}
    for family in text_string_to_metric_families(r.text):
        kinds[family.name] = family.type
        for sample in family.samples:
            values[sample.name] = sample.value
    for name, kind in EXPECTED.items():
        assert kinds.get(name) == kind, f"{name}: {kinds.get(name)}"
    return values


def test_counters_move(chat_model, server_factory) -> None:
    srv = server_factory(chat_model, served_model_name="tiny", state_interval=16)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        m0 = scrape(c)
        assert m0["hybridserve_requests_running"] == 0
        assert m0["hybridserve_prompt_tokens_total"] == 0
        prefix = "a shared system prompt, long enough to span checkpoints. " * 2
        usages = []
        for tail in ("first question", "second question"):
            r = c.post("/v1/completions", json={"prompt": prefix + tail, "max_tokens": 5})
            usages.append(r.json()["usage"])
        m1 = scrape(c)
        prompt_tokens = sum(u["prompt_tokens"] for u in usages)
        gen_tokens = sum(u["completion_tokens"] for u in usages)
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
        assert m1["hybridserve_prompt_tokens_total"] == prompt_tokens
        assert m1["hybridserve_generation_tokens_total"] == gen_tokens
        assert m1["hybridserve_requests_finished_total"] == 2
        assert m1["hybridserve_prefix_queries_total"] == 2
        assert m1["hybridserve_prefix_query_tokens_total"] == prompt_tokens
        # The second prompt reuses the first one's checkpointed prefix.
        assert cached > 0
        assert m1["hybridserve_prefix_hit_tokens_total"] == cached
        assert m1["hybridserve_prefix_hit_rate"] == cached / prompt_tokens
        assert m1["hybridserve_checkpoint_pages"] > 0
        # vLLM's names under hybridserve: carry the same snapshot values.
        same = {
            "hybridserve:prompt_tokens_total": "hybridserve_prompt_tokens_total",
            "hybridserve:generation_tokens_total": "hybridserve_generation_tokens_total",
            "hybridserve:prefix_cache_queries_total": "hybridserve_prefix_query_tokens_total",
            "hybridserve:prefix_cache_hits_total": "hybridserve_prefix_hit_tokens_total",
            "hybridserve:num_preemptions_total": "hybridserve_preemptions_total",
            "hybridserve:checkpoints_written_total": "hybridserve_checkpoints_admitted_total",
            "hybridserve:checkpoints_evicted_total": "hybridserve_checkpoints_evicted_total",
            "hybridserve:checkpoint_pages": "hybridserve_checkpoint_pages",
            "hybridserve:host_tier_restores_total": "hybridserve_host_checkpoints_restored_total",
            "hybridserve:host_tier_offloads_total": "hybridserve_host_checkpoints_offloaded_total",
            "hybridserve:engine_steps_total": "hybridserve_engine_steps_total",
        }
        for new, old in same.items():
            assert m1[new] == m1[old], new
        used = 1 - m1["hybridserve_kv_blocks_free"] / m1["hybridserve_kv_blocks"]
        assert m1["hybridserve:kv_cache_usage_perc"] == used
        info = next(
            f
            for f in text_string_to_metric_families(c.get("/metrics").text)
            if f.name == "hybridserve_info"
        )
        assert info.samples[0].labels == {"model": "tiny", "dtype": "float32", "device": "cpu"}


def test_speculative_counters(chat_model, server_factory) -> None:
    srv = server_factory(
        chat_model,
        served_model_name="tiny",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        before = scrape(c)
        assert before["hybridserve_spec_draft_tokens_total"] == 0
        # A repetitive prompt gives the n-gram drafter something to propose.
        r = c.post(
            "/v1/completions",
            json={"prompt": "abcabcabcabcabcabc" * 3, "max_tokens": 32, "temperature": 0},
        )
        assert r.status_code == 200
        m = scrape(c)
        drafts = m["hybridserve_spec_draft_tokens_total"]
        accepted = m["hybridserve_spec_accepted_tokens_total"]
        assert drafts > 0 and 0 <= accepted <= drafts
        assert m["hybridserve_spec_acceptance_rate"] == accepted / drafts
        # 1.0 would hold with no draft ever accepted; this prompt's greedy answer falls
        # into a loop the drafter predicts: measured 4.0 (every draft of every row).
        assert m["hybridserve_spec_mean_accepted_length"] >= 3.0
        assert accepted >= 9
        # vLLM's names carry the same counts.
        assert m["hybridserve:spec_decode_num_draft_tokens_total"] == drafts
        assert m["hybridserve:spec_decode_num_accepted_tokens_total"] == accepted
        assert 0 < m["hybridserve:spec_decode_num_drafts_total"] <= drafts


def families(c: httpx.Client) -> dict[str, Any]:
    r = c.get("/metrics")
    assert r.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(fams: dict[str, Any], family: str, sample: str | None = None, **labels: str) -> float:
    """The one sample named ``sample`` (default: the family's own) with ``labels``."""
    found = [
        s.value
        for s in fams[family].samples
        if s.name == (sample or family) and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, (family, sample, labels, fams[family].samples)
    return found[0]


def buckets(fams: dict[str, Any], family: str) -> dict[float, float]:
    out = {float(s.labels["le"]): s.value for s in fams[family].samples if s.name == family + "_bucket"}
    counts = [out[k] for k in sorted(out)]
    assert counts == sorted(counts), f"{family}: buckets not cumulative"
    return out


STEP_DELAY = 0.03


def test_latency_histograms_follow_the_requests(chat_model, server_factory) -> None:
    """Every step is slowed by STEP_DELAY, so every latency the engine observes is at
    least that long; counts and token sums must match what the clients got."""
    import time

    srv = server_factory(chat_model, served_model_name="tiny", state_interval=32)
    runner = srv.engine.engine.runner
    execute = runner.execute

    def slow_execute(sched, *args):
        time.sleep(STEP_DELAY)
        return execute(sched, *args)

    runner.execute = slow_execute
    k = 4
    bs = srv.engine.engine.config.cache.kv_block_size
    prefix = list(range(40, 40 + 3 * bs))  # three full blocks, a checkpoint at 32 only
    prompts = [prefix + [7, 8, 9], prefix[: 2 * bs + 5] + [200, 201]]
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        usages, walls = [], []
        for ids in prompts:
            t0 = time.monotonic()
            r = c.post(
                "/v1/completions",
                json={"prompt": ids, "max_tokens": k, "ignore_eos": True, "temperature": 0},
            )
            walls.append(time.monotonic() - t0)
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
        # And one streamed request: the same observations.
        t0 = time.monotonic()
        with c.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "streamed", "max_tokens": k, "ignore_eos": True, "stream": True,
                  "stream_options": {"include_usage": True}},
        ) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        walls.append(time.monotonic() - t0)
        usages.append(json.loads(lines[-1][len("data: "):])["usage"])
        srv.wait_idle()
        fams = families(c)
    n = len(usages)
    pre = "hybridserve:"
    ttft = pre + "time_to_first_token_seconds"
    itl = pre + "inter_token_latency_seconds"
    e2e = pre + "e2e_request_latency_seconds"
    assert value(fams, ttft, ttft + "_count") == n
    assert value(fams, itl, itl + "_count") == n * (k - 1)
    tpot = pre + "time_per_output_token_seconds"
    assert value(fams, tpot, tpot + "_count") == n * (k - 1)
    assert value(fams, tpot, tpot + "_sum") == value(fams, itl, itl + "_sum")
    # Every observation is at least one slowed step: nothing in buckets below it.
    for family in (ttft, itl, e2e):
        b = buckets(fams, family)
        assert b[0.025] == 0 and b[float("inf")] == value(fams, family, family + "_count")
    assert value(fams, itl, itl + "_sum") >= n * (k - 1) * STEP_DELAY
    # End to end covers the first token and every gap after it, and no more than the
    # client waited.
    e2e_sum = value(fams, e2e, e2e + "_sum")
    assert value(fams, e2e, e2e + "_count") == n
    assert e2e_sum >= value(fams, ttft, ttft + "_sum") + value(fams, itl, itl + "_sum") - 1e-6
    assert e2e_sum <= sum(walls)
    queue = pre + "request_queue_time_seconds"
    assert value(fams, queue, queue + "_count") == n
    assert value(fams, queue, queue + "_sum") < value(fams, ttft, ttft + "_sum")
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    hist = pre + "request_prompt_tokens"
    assert value(fams, hist, hist + "_sum") == prompt_tokens
    hist = pre + "request_generation_tokens"
    assert value(fams, hist, hist + "_sum") == n * k and value(fams, hist, hist + "_count") == n
    assert value(fams, pre + "request_success", pre + "request_success_total",
                 finished_reason="length") == n
    assert value(fams, pre + "prompt_tokens", pre + "prompt_tokens_total") == prompt_tokens
    assert value(fams, pre + "generation_tokens", pre + "generation_tokens_total") == n * k
    assert value(fams, pre + "num_requests_running") == 0
    assert value(fams, pre + "num_requests_waiting") == 0
    # The second prompt shares 2 blocks + 5 tokens with the first: both blocks' KV is
    # cached, the state only at the grid point 32 = 2 blocks (bs 16) or its largest
    # multiple below.
    cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
    kv_shared = 2 * bs
    assert 0 < cached <= kv_shared
    assert value(fams, pre + "prefix_cache_hits", pre + "prefix_cache_hits_total") == cached
    assert value(fams, pre + "prefix_cache_queries", pre + "prefix_cache_queries_total") == prompt_tokens
    miss = pre + "prefix_cache_state_miss_tokens"
    assert value(fams, miss, miss + "_total") == kv_shared - cached
    depth = pre + "checkpoint_hit_depth_tokens"
    assert value(fams, depth, depth + "_count") == 1
    assert value(fams, depth, depth + "_sum") == cached
    written = pre + "checkpoints_written"
    assert value(fams, written, written + "_total") == value(
        fams, "hybridserve_checkpoints_admitted", "hybridserve_checkpoints_admitted_total"
    ) > 0


def test_state_miss_is_counted_when_a_checkpoint_is_missing(chat_model, server_factory) -> None:
    """With the grid at 64 and prompts of three blocks, the first prompt leaves KV for
    three blocks but checkpoints only at its end boundaries; a second prompt leaving
    it after two blocks finds their KV and no state there: 32 tokens recomputed."""
    srv = server_factory(
        chat_model, served_model_name="tiny", state_interval=64,
        checkpoint_policies=("grid", "prompt_end"),
    )
    bs = srv.engine.engine.config.cache.kv_block_size
    first = list(range(40, 40 + 3 * bs)) + [5]
    second = first[: 2 * bs] + [250, 251, 252]
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        for ids in (first, second):
            r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 2})
            assert r.status_code == 200, r.text
        fams = families(c)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    miss = "hybridserve:prefix_cache_state_miss_tokens"
    assert value(fams, miss, miss + "_total") == 2 * bs
    depth = "hybridserve:checkpoint_hit_depth_tokens"
    assert value(fams, depth, depth + "_count") == 0


def test_host_tier_restores_and_hit_depth(chat_model, server_factory) -> None:
    """Two device checkpoint pages: a second prompt pushes the first one's checkpoints
    to the host tier; the first prompt again is served by a restore."""
    import random

    srv = server_factory(chat_model, served_model_name="tiny", state_interval=16,
                         max_checkpoint_pages=2, checkpoint_offload_pages=32, max_num_seqs=2)
    rng = random.Random(3)
    a, b = ([rng.randrange(3, 256) for _ in range(70)] for _ in range(2))
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        for ids in (a, b, a):
            r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        fams = families(c)
    assert cached > 0
    restores = "hybridserve:host_tier_restores"
    assert value(fams, restores, restores + "_total") >= 1
    offloads = "hybridserve:host_tier_offloads"
    assert value(fams, offloads, offloads + "_total") >= value(fams, restores, restores + "_total")
    depth = "hybridserve:checkpoint_hit_depth_tokens"
    # The third request is the one hit (the second shares no prefix with the first).
    assert value(fams, depth, depth + "_count") == 1
    assert value(fams, depth, depth + "_sum") == cached


def test_histograms_count_as_prometheus_client_does() -> None:
    """The engine-side histograms give the samples prometheus_client's own Histogram
    gives for the same observations (bounds included: a value equal to a bound is in
    that bucket)."""
    import random

    from prometheus_client import CollectorRegistry, Histogram

    from hybridserve.engine.stats import StepStats
    from hybridserve.server.metrics import TOKEN_LATENCY_BUCKETS, ServerMetrics

    rng = random.Random(0)
    values = [rng.choice([rng.uniform(0, 0.3), rng.choice(TOKEN_LATENCY_BUCKETS), 500.0])
              for _ in range(400)]
    ours = ServerMetrics(lambda: {}, model_name="m", max_model_len=64)
    ours.on_step(StepStats(inter_token_latency=values[:150]))
    ours.on_step(StepStats(inter_token_latency=values[150:]))
    reg = CollectorRegistry()
    ref = Histogram("hybridserve:inter_token_latency_seconds", "x", ["model_name"],
                    buckets=TOKEN_LATENCY_BUCKETS, registry=reg).labels("m")
    for v in values:
        ref.observe(v)

    def samples(text: str) -> dict:
        fam = {f.name: f for f in text_string_to_metric_families(text)}["hybridserve:inter_token_latency_seconds"]
        return {(s.name, s.labels.get("le")): s.value for s in fam.samples if not s.name.endswith("_created")}

    from prometheus_client import generate_latest

    got, want = samples(ours.render().decode()), samples(generate_latest(reg).decode())
    assert got.keys() == want.keys()
    for key, v in want.items():
        assert got[key] == pytest.approx(v, rel=1e-12), key
