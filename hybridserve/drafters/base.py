"""The drafter interface and the factory that builds a drafter from ``speculative_config``.

A drafter proposes, for every decoding request of a step, up to ``k`` tokens to follow
its sequence; the target verifies them all in the step's one forward
(:mod:`hybridserve.runner.sampler`). Contract:

- :meth:`Drafter.propose_batch` gets one :class:`DraftRequest` per decoding request
  (its key, its whole token sequence: prompt and output, and ``k``) and returns one
  list of at most ``k`` token ids per request, in order. It may propose fewer (none);
  it never changes what the target computes, so whatever it proposes, greedy output is
  the target's own.
- The sequence a key is called with only grows between calls, by what verification
  accepted plus the target's token after it; a drafter that keeps per-request caches
  reconciles them against that sequence (:mod:`hybridserve.drafters.draft_model`).
- :meth:`Drafter.forget` drops everything kept for a key (the engine calls it when a
  request finishes or is aborted); unknown keys are ignored.

Methods (``speculative_config["method"]``): ``ngram`` (:mod:`hybridserve.drafters.ngram`),
``draft_model`` (:mod:`hybridserve.drafters.draft_model`) and ``mtp`` (the target's own
multi-token-prediction head, :mod:`hybridserve.drafters.mtp`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from hybridserve.config import EngineConfig


@dataclass(frozen=True)
class DraftRequest:
    """One decoding request of a step, as a drafter sees it. ``temperature`` > 0: a
    drafter with a distribution samples its drafts from it (with the request's
    ``sample_seed``; draft ``j`` generates output token ``first_index + j``) and reports
    it (:func:`choose_drafts`); 0: it proposes its argmax."""

    key: Hashable
    token_ids: Sequence[int]
    k: int
    temperature: float = 0.0
    sample_seed: int | None = None
    first_index: int = 0


def choose_drafts(
    logits: torch.Tensor, requests: Sequence[DraftRequest], step: int
) -> tuple[list[int], list[torch.Tensor | None]]:
    """Draft ``step`` (0-based) of each request from the drafter's ``logits [N, vocab]``:
    the argmax for greedy requests; for sampled ones a sample of
    ``q = softmax(logits / temperature)`` from the request's counter-based stream
    (:func:`hybridserve.runner.sampler.draft_draw`), returned with ``log q`` so the
    target can accept it with ``min(1, p / q)``."""
    from hybridserve.runner import sampler

    tokens = torch.argmax(logits, dim=-1)
    logqs: list[torch.Tensor | None] = [None] * len(requests)
    sampled = [i for i, r in enumerate(requests) if r.temperature > 0]
    if sampled:
        temps = torch.tensor([requests[i].temperature for i in sampled], device=logits.device)
        logq = torch.log_softmax(logits[sampled].double() / temps[:, None], dim=-1)
        words = [sampler.seed_words(requests[i].sample_seed) for i in sampled]
        lo = torch.tensor([w[0] for w in words], dtype=torch.int64, device=logits.device)
        hi = torch.tensor([w[1] for w in words], dtype=torch.int64, device=logits.device)
        index = torch.tensor(
            [requests[i].first_index + step for i in sampled], dtype=torch.int64, device=logits.device
        )
        tokens = tokens.index_put(
            (torch.tensor(sampled, device=logits.device),), sampler.draft_draw(logq, lo, hi, index)
        )
        for j, i in enumerate(sampled):
            logqs[i] = logq[j]
    return tokens.tolist(), logqs


class Drafter(Protocol):
    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[list[int]]: ...

    def forget(self, key: Hashable) -> None: ...


class SequenceDrafter:
    """A drafter of one sequence at a time (``propose(token_ids, k, key)``, as the n-gram
    drafter) seen through the batch interface."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [
            self.inner.propose(r.token_ids, r.k, key=r.key) if r.k > 0 else [] for r in requests
        ]

    def forget(self, key: Hashable) -> None:
        self.inner.forget(key)


def build_drafter(config: EngineConfig, target: torch.nn.Module) -> Drafter | None:
    """The drafter ``config.speculative`` asks for, or None without speculative decoding.

    Raises ValueError naming the ``speculative_config`` field when the method cannot run
    with this target (a draft model with another vocabulary, a target without MTP
    weights)."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        from hybridserve.drafters.ngram import NgramDrafter

        return SequenceDrafter(NgramDrafter(spec))
    if spec.method == "draft_model":
        from hybridserve.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter.from_config(config, target)
    if spec.method == "mtp":
        from hybridserve.drafters.mtp import MtpDrafter

        return MtpDrafter.from_config(config, target)
    raise ValueError(f"speculative_config.method={spec.method!r} is not supported")
