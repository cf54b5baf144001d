"""``GET /metrics``: the server's Prometheus metrics, through ``prometheus_client``.

Two sets of names, both in every scrape:

- ``hybridserve:<name>``: vLLM's metric names with our prefix (``vllm:`` ->
  ``hybridserve:``), labelled ``model_name``, so dashboards written for vLLM need only
  the prefix changed. Latency and size histograms are observed per sequence by the
  engine (:mod:`hybridserve.engine.stats`): time to first token, inter-token latency
  (also as ``time_per_output_token_seconds``, vLLM's older name for the same
  observations), the per-request mean time per output token, end-to-end, queue,
  prefill, decode and inference time, prompt and generation tokens per request.
  Counters and gauges are read at scrape time from the engine's snapshot
  (:meth:`AsyncEngine.stats`). Beyond vLLM's: what the prefix cache did with the
  recurrent state (``checkpoint_hit_depth_tokens``, ``prefix_cache_state_miss_tokens``
  for KV cached beyond the last checkpoint, checkpoints written / evicted / dropped,
  host-tier offloads and restores).
- ``hybridserve_<stat>``: the engine snapshot's counters under their own names (what
  the benchmarks and operators of earlier versions read), kept as they were.

Every number a scrape shows comes from the engine's thread: histograms are observed
there between steps (under one lock per step, which a scrape takes only to copy the
counts), counters are a snapshot it published after its last step. A scrape never
waits for a step.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from hybridserve.engine.stats import StepStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LEGACY_PREFIX = "hybridserve_"
PREFIX = "hybridserve:"

# The hybridserve_* names: (stat key, metric name without prefix, type, help).
LEGACY_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("requests_running", "requests_running", "gauge", "Requests being generated."),
    ("requests_waiting", "requests_waiting", "gauge", "Requests queued for admission."),
    ("requests_finished", "requests_finished_total", "counter", "Requests finished (stop or length)."),
    ("requests_aborted", "requests_aborted_total", "counter", "Requests aborted (client gone or shutdown)."),
    ("requests_failed", "requests_failed_total", "counter", "Requests failed by an engine error."),
    ("prompt_tokens", "prompt_tokens_total", "counter", "Prompt tokens received."),
    ("generation_tokens", "generation_tokens_total", "counter", "Tokens generated."),
    ("steps", "engine_steps_total", "counter", "Engine steps run."),
    ("preemptions", "preemptions_total", "counter", "Requests preempted for lack of cache space."),
    ("prefix_queries", "prefix_queries_total", "counter", "Prefix-cache lookups (one per admitted prompt)."),
    ("prefix_query_tokens", "prefix_query_tokens_total", "counter", "Prompt tokens looked up in the prefix cache."),
    ("prefix_hits", "prefix_hits_total", "counter", "Prefix-cache lookups that reused a cached prefix."),
    ("prefix_hit_tokens", "prefix_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache."),
    ("prefix_hit_rate", "prefix_hit_rate", "gauge", "prefix_hit_tokens / prefix_query_tokens since start."),
    ("checkpoint_pages", "checkpoint_pages", "gauge", "State pages held by recurrent-state checkpoints."),
    ("checkpoints_admitted", "checkpoints_admitted_total", "counter", "Checkpoints admitted to the prefix cache."),
    ("checkpoints_evicted", "checkpoints_evicted_total", "counter", "Checkpoints evicted."),
    ("checkpoints_dropped", "checkpoints_dropped_total", "counter", "Checkpoints dropped because their KV prefix was evicted."),
    ("host_checkpoint_pages", "host_checkpoint_pages", "gauge", "Host-tier pages holding evicted checkpoints."),
    ("host_checkpoints_offloaded", "host_checkpoints_offloaded_total", "counter", "Checkpoints moved from the device to the host tier."),
    ("host_checkpoints_restored", "host_checkpoints_restored_total", "counter", "Host-tier checkpoints copied back to the device for a prefix hit."),
    ("kv_blocks_free", "kv_blocks_free", "gauge", "Free attention KV blocks."),
    ("kv_blocks_total", "kv_blocks", "gauge", "Attention KV blocks in the pool."),
    ("state_pages_free", "state_pages_free", "gauge", "Free recurrent-state pages."),
    ("state_pages_total", "state_pages", "gauge", "Recurrent-state pages in the pool."),
    ("spec_draft_tokens", "spec_draft_tokens_total", "counter", "Speculative draft tokens proposed."),
    ("spec_accepted_tokens", "spec_accepted_tokens_total", "counter", "Speculative draft tokens accepted."),
    ("spec_acceptance_rate", "spec_acceptance_rate", "gauge", "spec_accepted_tokens / spec_draft_tokens since start."),
    ("spec_mean_accepted_length", "spec_mean_accepted_length", "gauge", "Tokens gained per verify step (1 + accepted drafts)."),
)

# The hybridserve:* counters and gauges read from the snapshot: (name, type, help,
# value of the snapshot or None when the engine does not report it).
_Snapshot = Mapping[str, float | int]


def _ratio(num: str, den: str, used: bool = False) -> Callable[[_Snapshot], float | None]:
    def value(s: _Snapshot) -> float | None:
        if num not in s or den not in s:
            return None
        d = s[den]
        if not d:
            return 0.0
        return (d - s[num]) / d if used else s[num] / d

    return value


def _key(key: str) -> Callable[[_Snapshot], float | None]:
    return lambda s: s.get(key)


SNAPSHOT_METRICS: tuple[tuple[str, str, str, Callable[[_Snapshot], float | None]], ...] = (
    ("num_requests_running", "gauge", "Sequences being generated.", _key("requests_running")),
    ("num_requests_waiting", "gauge", "Sequences waiting for admission.", _key("requests_waiting")),
    ("kv_cache_usage_perc", "gauge", "Fraction of the attention KV blocks in use (1 = full).",
     _ratio("kv_blocks_free", "kv_blocks_total", used=True)),
    ("state_cache_usage_perc", "gauge", "Fraction of the recurrent-state pages in use (1 = full).",
     _ratio("state_pages_free", "state_pages_total", used=True)),
    ("prompt_tokens", "counter", "Prompt tokens received.", _key("prompt_tokens")),
    ("generation_tokens", "counter", "Tokens generated.", _key("generation_tokens")),
    ("num_preemptions", "counter", "Sequences preempted for lack of cache space.", _key("preemptions")),
    ("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache (tokens, as vLLM's).",
     _key("prefix_query_tokens")),
    ("prefix_cache_hits", "counter", "Prompt tokens served from the prefix cache: KV blocks and a state checkpoint.",
     _key("prefix_hit_tokens")),
    ("prefix_cache_predicted_hits", "counter",
     "Prompt tokens the prefix cache held for requests when they arrived (the "
     "x-hybridserve-predicted-cached-tokens header); prefix_cache_hits is what admission took.",
     _key("prefix_predicted_hit_tokens")),
    ("prefix_cache_state_miss_tokens", "counter",
     "Prompt tokens whose KV blocks were cached beyond the deepest usable state checkpoint, so they were "
     "recomputed: what a missing checkpoint cost.", _key("prefix_state_miss_tokens")),
    ("checkpoints_written", "counter", "Recurrent-state checkpoints admitted to the prefix cache.",
     _key("checkpoints_admitted")),
    ("checkpoints_evicted", "counter", "Checkpoints evicted from the device.", _key("checkpoints_evicted")),
    ("checkpoints_dropped", "counter", "Checkpoints dropped because their KV prefix was evicted.",
     _key("checkpoints_dropped")),
    ("checkpoint_pages", "gauge", "State pages held by checkpoints on the device.", _key("checkpoint_pages")),
    ("host_tier_offloads", "counter", "Checkpoints moved from the device to the host tier.",
     _key("host_checkpoints_offloaded")),
    ("host_tier_restores", "counter", "Host-tier checkpoints copied back to the device for a prefix hit.",
     _key("host_checkpoints_restored")),
    ("host_tier_pages", "gauge", "Host-tier pages holding checkpoints.", _key("host_checkpoint_pages")),
    ("spec_decode_num_drafts", "counter", "Verify rows (drafts checked by the target model).",
     _key("spec_verify_rows")),
    ("spec_decode_num_draft_tokens", "counter", "Speculative draft tokens proposed.", _key("spec_draft_tokens")),
    ("spec_decode_num_accepted_tokens", "counter", "Speculative draft tokens accepted.",
     _key("spec_accepted_tokens")),
    ("engine_steps", "counter", "Engine steps run.", _key("steps")),
)


def _seconds_buckets(low: float, high: float) -> tuple[float, ...]:
    """1-2.5-5 steps from ``low`` to ``high`` (seconds)."""
    out, scale = [], low
    while scale <= high * (1 + 1e-9):
        out += [v for v in (scale, scale * 2.5, scale * 5) if v <= high * (1 + 1e-9)]
        scale *= 10
    return tuple(round(v, 6) for v in out)


def _token_buckets(max_tokens: int) -> tuple[float, ...]:
    """1-2-5 steps up to ``max_tokens``, then ``max_tokens`` itself."""
    out, scale = [], 1
    while scale <= max_tokens:
        out += [v for v in (scale, 2 * scale, 5 * scale) if v <= max_tokens]
        scale *= 10
    if out[-1] != max_tokens:
        out.append(max_tokens)
    return tuple(float(v) for v in out)


LATENCY_BUCKETS = _seconds_buckets(0.001, 2500.0)
"""Time to first token, end-to-end and the per-request phases: 1 ms to 2,500 s."""

TOKEN_LATENCY_BUCKETS = _seconds_buckets(0.001, 100.0)
"""Inter-token latency and time per output token: 1 ms to 100 s."""


class _Histogram:
    """One histogram's counts, observed on the engine's thread and read at scrape
    time. ``prometheus_client``'s own histogram takes a lock and does its bookkeeping
    per observation (about 1.5 us); a decode step of a large batch observes hundreds
    of latencies, so these take a bisection and an increment each, and the owner
    (:class:`ServerMetrics`) holds one lock per step for all of them."""

    __slots__ = ("name", "doc", "bounds", "counts", "sum")

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...]) -> None:
        self.name, self.doc, self.bounds = name, doc, bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, name: str, doc: str, model_name: str) -> HistogramMetricFamily:
        cumulative, total = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            total += count
            cumulative.append((floatToGoString(bound), total))
        h = HistogramMetricFamily(name, doc, labels=["model_name"])
        h.add_metric([model_name], cumulative, sum_value=self.sum)
        return h


class ServerMetrics:
    """The registry behind ``/metrics`` and the engine's stats observer.

    ``stats``: returns the engine's latest snapshot (never waits); ``info``: labels of
    ``hybridserve_info`` (model, dtype, device); ``max_model_len`` bounds the token
    histograms' buckets. Install with ``engine.stats_observer = metrics`` (the
    engine's thread then calls :meth:`on_step`).
    """

    def __init__(
        self,
        stats: Callable[[], _Snapshot],
        *,
        model_name: str,
        max_model_len: int,
        info: Mapping[str, str] | None = None,
    ) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(stats, model_name, dict(info or {})))
        self._lock = threading.Lock()
        self.histograms: list[_Histogram] = []

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> _Histogram:
            h = _Histogram(PREFIX + name, doc, tuple(float(b) for b in buckets))
            self.histograms.append(h)
            return h

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "Seconds from a sequence's arrival at the engine to its first token.",
            LATENCY_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Seconds between two steps that gave a sequence tokens (one per step).",
            TOKEN_LATENCY_BUCKETS,
        )
        # vLLM's older name of inter_token_latency_seconds: the same counts, exposed
        # twice (see _HistogramCollector).
        self.aliases = {
            PREFIX + "time_per_output_token_seconds": (
                self.inter_token_latency,
                "vLLM's older name of inter_token_latency_seconds: the same observations.",
            )
        }
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Per finished sequence: decode seconds / (generated tokens - 1).",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "Seconds from arrival to finish, per finished sequence.",
            LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Seconds a sequence waited before its first step.",
            LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "Seconds from a sequence's first step to its first token.",
            LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "request_decode_time_seconds",
            "Seconds from a sequence's first token to its last.",
            LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "request_inference_time_seconds",
            "Seconds from a sequence's first step to its last token.",
            LATENCY_BUCKETS,
        )
        tokens = _token_buckets(max_model_len)
        self.prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished sequence.", tokens
        )
        self.generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished sequence.", tokens
        )
        self.max_tokens_param = histogram(
            "request_params_max_tokens", "The max_tokens of finished sequences (when set).", tokens
        )
        self.n_param = histogram(
            "request_params_n", "The n of finished sequences' requests.", (1, 2, 5, 10, 20)
        )
        self.checkpoint_hit_depth = histogram(
            "checkpoint_hit_depth_tokens",
            "Per admitted sequence with a prefix hit: the hit's length in tokens (the "
            "depth of the state checkpoint it resumed from).",
            tokens,
        )
        self.success = {"stop": 0, "length": 0}
        self.registry.register(_HistogramCollector(self))

    def on_step(self, stats: StepStats) -> None:
        """Observe one engine step (called on the engine's thread)."""
        with self._lock:
            if stats.time_to_first_token:
                observe = self.time_to_first_token.observe
                for ttft in stats.time_to_first_token:
                    observe(ttft)
            if stats.inter_token_latency:
                observe = self.inter_token_latency.observe
                for itl in stats.inter_token_latency:
                    observe(itl)
            for a in stats.admitted:
                self.queue_time.observe(a.queue_seconds)
                if a.cached_tokens:
                    self.checkpoint_hit_depth.observe(a.cached_tokens)
            for f in stats.finished:
                self.e2e.observe(f.e2e_seconds)
                self.prefill_time.observe(f.prefill_seconds)
                self.decode_time.observe(f.decode_seconds)
                self.inference_time.observe(f.inference_seconds)
                self.prompt_tokens.observe(f.prompt_tokens)
                self.generation_tokens.observe(f.generation_tokens)
                if f.max_tokens is not None:
                    self.max_tokens_param.observe(f.max_tokens)
                self.n_param.observe(f.n)
                tpot = f.time_per_output_token
                if tpot is not None:
                    self.request_time_per_output_token.observe(tpot)
                if f.finish_reason in self.success:
                    self.success[f.finish_reason] += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _HistogramCollector(Collector):
    """The histograms and the per-reason success counter, copied under the owner's
    lock so a scrape sees whole steps."""

    def __init__(self, owner: ServerMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        o = self.owner
        with o._lock:
            families = [h.family(h.name, h.doc, o.model_name) for h in o.histograms]
            families += [h.family(name, doc, o.model_name) for name, (h, doc) in o.aliases.items()]
            success = dict(o.success)
        yield from families
        c = CounterMetricFamily(PREFIX + "request_success", "Sequences finished, by finish reason.",
                                labels=["model_name", "finished_reason"])
        for reason, count in success.items():
            c.add_metric([o.model_name, reason], count)
        yield c


class _SnapshotCollector(Collector):
    """The snapshot's counters and gauges, built at scrape time: the ``hybridserve_*``
    names, then the ``hybridserve:*`` ones (``SNAPSHOT_METRICS``)."""

    def __init__(self, stats: Callable[[], _Snapshot], model_name: str, info: dict[str, str]) -> None:
        self.stats = stats
        self.model_name = model_name
        self.info = info

    def collect(self) -> Iterator[Metric]:
        stats = dict(self.stats())
        drafts = stats.get("spec_draft_tokens")
        if drafts is not None and "spec_acceptance_rate" not in stats:
            stats["spec_acceptance_rate"] = stats.get("spec_accepted_tokens", 0) / drafts if drafts else 0.0
        if self.info:
            labels = sorted(self.info)
            g = GaugeMetricFamily(LEGACY_PREFIX + "info", "The model being served.", labels=labels)
            g.add_metric([self.info[k] for k in labels], 1)
            yield g
        for key, name, kind, help_text in LEGACY_METRICS:
            if key in stats:
                family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                yield family(LEGACY_PREFIX + name, help_text, value=stats[key])
        for name, kind, help_text, value_of in SNAPSHOT_METRICS:
            value = value_of(stats)
            if value is None:
                continue
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            m = family(PREFIX + name, help_text, labels=["model_name"])
            m.add_metric([self.model_name], value)
            yield m
