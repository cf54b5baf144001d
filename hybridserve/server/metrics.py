"""``GET /metrics``: engine counters in the Prometheus text exposition format (0.0.4).

Every metric is named ``hybridserve_<stat>``; counters end in ``_total``. Values come
from :meth:`AsyncEngine.stats`, a snapshot the engine thread publishes after each
step, so a scrape never touches the engine. Stats the engine does not report are
left out rather than reported as zero.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

# (stat key, metric name without prefix, type, help)
METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("requests_running", "requests_running", "gauge", "Requests being generated."),
    ("requests_waiting", "requests_waiting", "gauge", "Requests queued for admission."),
    (
        "requests_finished",
        "requests_finished_total",
        "counter",
        "Requests finished (stop or length).",
    ),
    (
        "requests_aborted",
        "requests_aborted_total",
        "counter",
        "Requests aborted (client gone or shutdown).",
    ),
    ("requests_failed", "requests_failed_total", "counter", "Requests failed by an engine error."),
    ("prompt_tokens", "prompt_tokens_total", "counter", "Prompt tokens received."),
    ("generation_tokens", "generation_tokens_total", "counter", "Tokens generated."),
    ("steps", "engine_steps_total", "counter", "Engine steps run."),
    ("preemptions", "preemptions_total", "counter", "Requests preempted for lack of cache space."),
    (
        "prefix_queries",
        "prefix_queries_total",
        "counter",
        "Prefix-cache lookups (one per admitted prompt).",
    ),
    (
        "prefix_query_tokens",
        "prefix_query_tokens_total",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
    ),
    (
        "prefix_hits",
        "prefix_hits_total",
        "counter",
        "Prefix-cache lookups that reused a cached prefix.",
    ),
    (
        "prefix_hit_tokens",
        "prefix_hit_tokens_total",
        "counter",
        "Prompt tokens served from the prefix cache.",
    ),
    (
        "prefix_hit_rate",
        "prefix_hit_rate",
        "gauge",
        "prefix_hit_tokens / prefix_query_tokens since start.",
    ),
    (
        "checkpoint_pages",
        "checkpoint_pages",
        "gauge",
        "State pages held by recurrent-state checkpoints.",
    ),
    (
        "checkpoints_admitted",
        "checkpoints_admitted_total",
        "counter",
        "Checkpoints admitted to the prefix cache.",
    ),
    ("checkpoints_evicted", "checkpoints_evicted_total", "counter", "Checkpoints evicted."),
    (
        "checkpoints_dropped",
        "checkpoints_dropped_total",
        "counter",
        "Checkpoints dropped because their KV prefix was evicted.",
    ),
    (
        "host_checkpoint_pages",
        "host_checkpoint_pages",
        "gauge",
        "Host-tier pages holding evicted checkpoints.",
    ),
    (
        "host_checkpoints_offloaded",
        "host_checkpoints_offloaded_total",
        "counter",
        "Checkpoints moved from the device to the host tier.",
    ),
    (
        "host_checkpoints_restored",
        "host_checkpoints_restored_total",
        "counter",
        "Host-tier checkpoints copied back to the device for a prefix hit.",
    ),
    ("kv_blocks_free", "kv_blocks_free", "gauge", "Free attention KV blocks."),
    ("kv_blocks_total", "kv_blocks", "gauge", "Attention KV blocks in the pool."),
    ("state_pages_free", "state_pages_free", "gauge", "Free recurrent-state pages."),
    ("state_pages_total", "state_pages", "gauge", "Recurrent-state pages in the pool."),
    (
        "spec_draft_tokens",
        "spec_draft_tokens_total",
        "counter",
        "Speculative draft tokens proposed.",
    ),
    (
        "spec_accepted_tokens",
        "spec_accepted_tokens_total",
        "counter",
        "Speculative draft tokens accepted.",
    ),
    (
        "spec_acceptance_rate",
        "spec_acceptance_rate",
        "gauge",
        "spec_accepted_tokens / spec_draft_tokens since start.",
    ),
    (
        "spec_mean_accepted_length",
        "spec_mean_accepted_length",
        "gauge",
        "Tokens gained per verify step (1 + accepted drafts).",
    ),
)

PREFIX = "hybridserve_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _value(v: float | int) -> str:
    if isinstance(v, bool):
        v = int(v)
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def render(stats: Mapping[str, float | int], info: Mapping[str, str] | None = None) -> str:
    """The exposition text for ``stats``; ``info`` becomes labels of ``hybridserve_info``."""
    stats = dict(stats)
    drafts = stats.get("spec_draft_tokens")
    if drafts is not None and "spec_acceptance_rate" not in stats:
        stats["spec_acceptance_rate"] = (
            stats.get("spec_accepted_tokens", 0) / drafts if drafts else 0.0
        )
    lines = []
    if info:
        labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(info.items()))
        lines += [
            f"# HELP {PREFIX}info The model being served.",
            f"# TYPE {PREFIX}info gauge",
            f"{PREFIX}info{{{labels}}} 1",
        ]
    for key, name, kind, help_text in METRICS:
        if key not in stats:
            continue
        lines += [
            f"# HELP {PREFIX}{name} {help_text}",
            f"# TYPE {PREFIX}{name} {kind}",
            f"{PREFIX}{name} {_value(stats[key])}",
        ]
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
