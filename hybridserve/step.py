"""The step contract: the values the engine, the runner and users exchange.

This module is the bottom of the package (it imports nothing from it but the plain value
type of structured outputs), so the runner and
the engine can both speak it without the runner reaching up into the engine:

- what users pass and get back: :class:`SamplingParams`, :class:`Logprob`,
  :class:`CompletionOutput`, :class:`RequestOutput` (vLLM's shapes);
- what the scheduler hands the runner: :class:`SchedulerOutput`, one
  :class:`ScheduledRow` per row, each naming the request it advances through the
  :class:`ScheduledRequest` fields the runner reads;
- what the runner hands back: :class:`StepResult`, one :class:`RowResult` per row plus
  the state postprocess's decisions (:class:`PostprocessDecision`) for decode rows, which the
  engine commits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hybridserve.structured.params import StructuredOutputsParams

__all__ = [
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "RowResult",
    "SamplingParams",
    "ScheduledRequest",
    "ScheduledRow",
    "SchedulerOutput",
    "StepResult",
    "PostprocessDecision",
    "Transfers",
    "kv_slot",
]


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request. Validated on construction; errors name the field.

    ``temperature == 0`` is greedy. ``seed`` makes sampling reproducible for this request
    regardless of batching or preemption. ``logprobs=k`` returns, for every generated
    token, the ``k`` most likely tokens plus the sampled one. ``structured_outputs``
    constrains the output to a JSON schema, regex, choice or grammar
    (:class:`~hybridserve.structured.StructuredOutputsParams`; a dict of its fields is
    accepted too). ``min_tokens``: EOS and ``stop_token_ids`` cannot be sampled, and
    stop strings do not end the output, before that many tokens (as vLLM's).
    ``allowed_token_ids``: only these tokens can be sampled. ``logit_bias``: ``{token
    id: bias}`` added to the logits before penalties and sampling (OpenAI's and vLLM's
    field; biases are clamped to [-100, 100] as theirs are). ``prompt_logprobs=k``:
    for every prompt token after the first, its log probability given the tokens before
    it and the ``k`` most likely tokens there (``RequestOutput.prompt_logprobs``); the
    request then computes its whole prompt (the prefix cache is not read for it).
    ``keep_special_token_ids``: special tokens whose text stays in the output text
    although ``skip_special_tokens`` drops the others (the server sets it to the tags its
    tool-call and reasoning parsers read; EOS and ``stop_token_ids`` stay out).
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    keep_special_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.temperature < _GREEDY_BELOW:
            # Dividing float32 logits by a vanishing temperature overflows; the limit of
            # sampling as temperature -> 0 is greedy decoding, so use that.
            self.temperature = 0.0
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        # Below float32's resolution top_p would round to 0 and drop every token; any
        # top_p this small keeps just the most likely token, as 1e-6 does.
        self.top_p = max(self.top_p, 1e-6)
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _finite(self.repetition_penalty) or not 0.01 <= self.repetition_penalty <= 100:
            raise ValueError(
                f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _finite(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if self.stop_token_ids is not None and not all(
            isinstance(t, int) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20
        ):
            raise ValueError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError("structured_outputs must be a StructuredOutputsParams (or a dict of its fields)")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})"
            )
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
            ):
                raise ValueError("allowed_token_ids must be a non-empty list of non-negative integers")
            self.allowed_token_ids = list(ids)
        keep = self.keep_special_token_ids
        if not isinstance(keep, (set, frozenset, list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in keep
        ):
            raise ValueError("keep_special_token_ids must be a set of non-negative integers")
        self.keep_special_token_ids = frozenset(keep)
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int)
            or isinstance(self.prompt_logprobs, bool)
            or not 0 <= self.prompt_logprobs <= 20
        ):
            raise ValueError(
                f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}"
            )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must be a dict of token id -> bias")
            bias = {}
            for t, v in self.logit_bias.items():
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise ValueError(f"logit_bias: {t!r} is not a token id (a non-negative integer)")
                if not _finite(v):
                    raise ValueError(f"logit_bias: the bias of token {t} must be a finite number, got {v!r}")
                bias[t] = float(min(max(v, -100.0), 100.0))
            self.logit_bias = bias or None

    @property
    def plain_logits(self) -> bool:
        """Whether sampling sees the model's logits unchanged before temperature: no
        penalty, bias, mask or grammar."""
        return (
            self.repetition_penalty == 1.0
            and not self.presence_penalty
            and not self.frequency_penalty
            and self.logit_bias is None
            and self.structured_outputs is None
            and not self.token_masked
        )

    @property
    def token_masked(self) -> bool:
        """Whether sampling masks tokens for reasons other than a grammar."""
        return self.min_tokens > 0 or self.allowed_token_ids is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_GREEDY_BELOW = 1e-5


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(slots=True)
class Logprob:
    """One candidate token's log probability and its 1-based rank in the vocabulary."""

    logprob: float
    rank: int
    decoded_token: str | None = None


class ScheduledRequest(Protocol):
    """The fields of a request the runner reads to build a row's inputs and draws
    (:class:`hybridserve.engine.request.Request` has them; the runner writes none)."""

    all_token_ids: list[int]
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    draft_token_ids: list[int]
    block_ids: list[int]
    params: SamplingParams
    sample_seed: int | None
    grammar: object | None  # the structured-outputs matcher, when the params ask for one
    eos_token_ids: tuple[int, ...]  # banned before the params' min_tokens (unless ignore_eos)


def kv_slot(block_ids: Sequence[int], pos: int, block_size: int) -> int:
    """The flat KV slot of absolute position ``pos`` of a sequence with ``block_ids``."""
    return block_ids[pos // block_size] * block_size + pos % block_size


@dataclass
class ScheduledRow:
    """One row of a step: ``request`` computes ``all_token_ids[n : n + num_tokens]``.

    ``num_drafts`` of those tokens are speculative (a decode row; with drafts, a verify
    row). ``samples``
    says whether the row's logits produce new tokens. ``state_outputs`` maps a prefix
    length p in (n, n + num_tokens] to the page that receives the state after it.
    """

    request: ScheduledRequest
    num_computed: int
    num_tokens: int
    num_drafts: int
    samples: bool
    state_in_page: int
    # A decode row (the last token plus any drafts): its surviving state depends on the
    # accepted count, which the state postprocess decides.
    is_decode: bool = False
    state_outputs: dict[int, int] = field(default_factory=dict)
    # Scheduled one step ahead (``Scheduler.schedule_ahead``): the row's input token
    # is the previous step's choice, still on the device, and the request's host state
    # (tokens, output count, state page) lags the row by that one token.
    ahead: bool = False
    # The step's references on ``state_outputs`` were released or handed on (by a commit
    # or a drop); until then ``Scheduler.release_row`` gives them back.
    settled: bool = False


@dataclass
class Transfers:
    """The host-tier copies one step runs before its forward: ``offloads`` as
    ``(device page, host page)`` and ``restores`` as ``(host page, device page)``
    (:mod:`hybridserve.cache.host_tier` states their order)."""

    offloads: list[tuple[int, int]] = field(default_factory=list)
    restores: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.offloads or self.restores)


@dataclass
class SchedulerOutput:
    rows: list[ScheduledRow]
    preempted: list = field(default_factory=list)
    # Host-tier copies the runner performs before this step's forward.
    transfers: Transfers = field(default_factory=Transfers)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def plain_decode(self) -> bool:
        """Every row decodes one token with no drafts (the steps async scheduling
        pipelines)."""
        return all(
            row.is_decode and row.num_tokens == 1 and row.num_drafts == 0 for row in self.rows
        )


@dataclass
class RowResult:
    """What one row of a step produced: ``new_tokens`` (accepted drafts, then one
    token from the target model; empty for a prefill chunk that does not sample)."""

    new_tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    # With the request's prompt_logprobs, a prefill row's: entry j is the prompt token
    # at position num_computed + 1 + j, given the tokens before it.
    prompt_logprobs: list[dict[int, Logprob]] | None = None


@dataclass(frozen=True)
class PostprocessDecision:
    """The state postprocess's decision for one decode row (docs/state-lifecycle.md):
    ``num_accepted`` tokens survived, the row's state is now ``state_page``, the
    checkpoints ``(prefix length, page)`` were kept and ``released`` pages are free."""

    num_accepted: int
    state_page: int
    checkpoints: tuple[tuple[int, int], ...]
    released: tuple[int, ...]


@dataclass
class StepResult:
    """What the runner returns for a step: per row its tokens, and for each decode row
    (by row index) the postprocess decision the engine commits."""

    rows: list[RowResult]
    decisions: dict[int, PostprocessDecision] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    """One generated sequence of a request (``n`` of them per request)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns per prompt, and the engine streams per step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # With prompt_logprobs: one entry per prompt token, None for the first (nothing
    # predicts it), else {token id: Logprob} (the k most likely and the prompt's token).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Per-request counters: spec_draft_tokens, spec_accepted_tokens,
    # spec_mean_accepted_length (tokens per verify step), num_preemptions,
    # predicted_cached_tokens (the hit the caches held when the prompt arrived; compare
    # num_cached_tokens, the hit admission took).
    metrics: dict[str, float] = field(default_factory=dict)
    # Why the request failed (its outputs finish with reason "error"), else None.
    error: str | None = None
