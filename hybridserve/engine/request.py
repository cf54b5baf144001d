"""Requests, sampling parameters and outputs, in vLLM's shape so users can switch."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from hybridserve.structured.params import StructuredOutputsParams


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request. Validated on construction; errors name the field.

    ``temperature == 0`` is greedy. ``seed`` makes sampling reproducible for this request
    regardless of batching or preemption. ``logprobs=k`` returns, for every generated
    token, the ``k`` most likely tokens plus the sampled one. ``structured_outputs``
    constrains the output to a JSON schema, regex, choice or grammar
    (:class:`~hybridserve.structured.StructuredOutputsParams`; a dict of its fields is
    accepted too).
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_GREEDY_BELOW = 1e-5


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # Committing one of its steps raised (after the forward); its caches were freed.
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


@dataclass(slots=True)
class Logprob:
    """One candidate token's log probability and its 1-based rank in the vocabulary."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class Request:
    """One sequence being generated. Owned by the scheduler.

    ``all_token_ids`` = prompt + generated tokens. ``num_computed_tokens`` of them are
    in the caches (KV blocks and the state page). ``block_ids`` are its KV blocks, in
    order; ``state_page`` is the page holding the state after ``num_computed_tokens``
    tokens (-1 before the first forward of a cold start). The request holds one
    reference on each block and on ``state_page``.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 4096
    sample_seed: int | None = None
    parent_id: str | None = None  # the user's request id when n > 1 fans out
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    state_page: int = -1
    # The latest state at a KV-block boundary reached while decoding, kept so that a
    # finished sequence can leave a checkpoint at its end (-1: none held).
    boundary_page: int = -1
    boundary_len: int = 0
    # Positions (prefix lengths) at which this request's prefill must leave checkpoints
    # besides the grid: the junction and the prompt end.
    extra_checkpoints: set[int] = field(default_factory=set)
    slot: int = -1
    # Chained hashes of the full blocks of all_token_ids, extended as blocks fill
    # (tokens are only ever appended, so computed hashes stay valid), and how many of
    # the request's current blocks are registered in the prefix index.
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    num_preemptions: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_steps: int = 0
    detokenizer: object | None = None  # the engine's IncrementalDetokenizer for the output
    stopped: bool = False  # EOS, a stop token or a stop string ended it
    stop_reason: int | str | None = None  # the stop token or string (None for EOS)
    # The sequence's GrammarMatcher when its params ask for structured outputs: the
    # grammar state after output_token_ids (drafts are never committed to it).
    grammar: object | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_prefill(self) -> bool:
        """True while more than the last token is still to be computed."""
        return self.num_computed_tokens < self.num_tokens - 1

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


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
    # Per-request counters: spec_draft_tokens, spec_accepted_tokens,
    # spec_mean_accepted_length (tokens per verify step), num_preemptions.
    metrics: dict[str, float] = field(default_factory=dict)
    # Why the request failed (its outputs finish with reason "error"), else None.
    error: str | None = None
