"""Per-request timings and prefix-cache facts, reported once per step to an observer.

The engine keeps no histograms: with an observer set (``EngineCore.stats_observer``,
the server's Prometheus metrics), every step ends with one call
``observer.on_step(StepStats)`` listing what happened to individual sequences in that
step. Without one (the offline API's default) the engine records only the four
timestamps on each request and builds nothing.

Timestamps are ``time.monotonic()`` seconds, per sequence (``n > 1`` fans out into
sequences that are reported one by one):

- ``arrival``: ``EngineCore.add_request``;
- ``scheduled``: the first step that scheduled the sequence (queue time ends);
- ``first_token``: the commit of the step that produced its first token;
- ``last_token``: the commit of the latest step that produced tokens.

Inter-token latency is one observation per step that gave a sequence tokens after its
first (a verify step that accepts drafts counts once, as vLLM counts iterations).
Preemption does not reset anything: the recompute shows up as a long gap.

The observer runs on the engine's thread, between steps; it must not block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class AdmittedStats:
    """A sequence's first admission: its wait and what the prefix cache gave it.

    ``cached_tokens``: prompt tokens served from the cache (KV blocks and a state
    checkpoint at that length); ``kv_cached_tokens``: the longest cached KV prefix,
    with a checkpoint or not (``kv_cached_tokens - cached_tokens`` were recomputed for
    want of a checkpoint)."""

    queue_seconds: float
    prompt_tokens: int
    cached_tokens: int
    kv_cached_tokens: int


@dataclass(slots=True)
class FinishedStats:
    """A sequence that finished with ``stop`` or ``length`` (aborted and failed ones
    are not reported)."""

    finish_reason: str
    e2e_seconds: float
    queue_seconds: float
    prefill_seconds: float  # scheduled -> first token
    decode_seconds: float  # first token -> last token
    prompt_tokens: int
    generation_tokens: int
    max_tokens: int | None
    n: int

    @property
    def inference_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def time_per_output_token(self) -> float | None:
        """Mean decode time per token after the first (None with a single token)."""
        if self.generation_tokens < 2:
            return None
        return self.decode_seconds / (self.generation_tokens - 1)


@dataclass(slots=True)
class StepStats:
    """What one engine step did to individual sequences (see the module docstring)."""

    admitted: list[AdmittedStats] = field(default_factory=list)
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    finished: list[FinishedStats] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.admitted
            or self.time_to_first_token
            or self.inter_token_latency
            or self.finished
        )


class StatsObserver(Protocol):
    def on_step(self, stats: StepStats) -> None: ...
