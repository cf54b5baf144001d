"""Requests: the scheduler's per-sequence state. The values users see (sampling
parameters, outputs, logprobs) live in :mod:`hybridserve.step` and are re-exported here."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from hybridserve.step import CompletionOutput, Logprob, RequestOutput, SamplingParams

__all__ = [
    "CompletionOutput",
    "Logprob",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
]


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
        # A set built once: asked per request per step, and naming the members inside
        # the property (class attribute lookups on the enum) cost more than the test.
        return self in _FINISHED


_FINISHED = frozenset(
    (
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    )
)


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
    seat: int = -1  # its seat among max_num_seqs (admission accounting), -1 for none
    # Chained hashes of the full blocks of all_token_ids, extended as blocks fill
    # (tokens are only ever appended, so computed hashes stay valid), and how many of
    # the request's current blocks are registered in the prefix index.
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    # With params.prompt_logprobs: entry p holds prompt token p's logprobs (None for
    # p = 0, and until a prefill row has computed position p - 1).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
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
    # A matcher waiting for the output to write its params' after_token_ids (the end of
    # a reasoning block); it becomes ``grammar`` from the token after them.
    pending_grammar: object | None = None
    # Prefix-cache facts of the first admission: the longest cached KV prefix (with a
    # checkpoint or not; num_cached_tokens is the part served).
    kv_prefix_tokens: int = 0
    # Timestamps (time.monotonic(); -1 until they happen) for the engine's statistics
    # (hybridserve.engine.stats).
    arrival_time: float = -1.0
    scheduled_time: float = -1.0
    first_token_time: float = -1.0
    last_token_time: float = -1.0

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
