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


def draft_choices(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seed_lo: torch.Tensor,
    seed_hi: torch.Tensor,
    index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device, per row of ``logits [N, vocab]``: the argmax where
    ``temperatures [N]`` (float32) is 0, else a sample of ``q = softmax(logits / T)``
    from the row's counter-based stream (seed words, generated-token ``index``: int64
    ``[N]``, :func:`hybridserve.runner.sampler.draft_draw`). Returns ``(tokens [N]
    int64, log q [N, vocab])`` in :data:`~hybridserve.runner.sampler.LOGQ_DTYPE`
    (``log q`` of greedy rows is that of ``T = 1``, unused): computed in float64,
    rounded, and the draft drawn from the rounded values, so the ``q`` the target's
    acceptance test reads is the one the draft was sampled from. Every op works row by
    row, so a row's result does not depend on the rows beside it; the eager drafters
    and their graph steps both call this."""
    from hybridserve.runner import sampler

    greedy = torch.argmax(logits, dim=-1)
    hot = temperatures > 0
    t = torch.where(hot, temperatures, torch.ones_like(temperatures))
    logq = torch.log_softmax(logits.double() / t[:, None], dim=-1).to(sampler.LOGQ_DTYPE)
    drawn = sampler.draft_draw(logq, seed_lo, seed_hi, index)
    return torch.where(hot, drawn, greedy), logq


def draw_tensors(
    requests: Sequence[DraftRequest], steps: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The :func:`draft_choices` inputs of ``requests`` at draft ``steps`` (0-based):
    temperatures (float32, 0 for greedy requests), seed words and token indices."""
    from hybridserve.runner import sampler

    words = [sampler.seed_words(r.sample_seed) for r in requests]
    return (
        torch.tensor([r.temperature for r in requests], dtype=torch.float32, device=device),
        torch.tensor([w[0] for w in words], dtype=torch.int64, device=device),
        torch.tensor([w[1] for w in words], dtype=torch.int64, device=device),
        torch.tensor([r.first_index + s for r, s in zip(requests, steps)], dtype=torch.int64,
                     device=device),
    )


def choose_drafts(
    logits: torch.Tensor, requests: Sequence[DraftRequest], step: int
) -> tuple[list[int], list[torch.Tensor | None]]:
    """Draft ``step`` (0-based) of each request from the drafter's ``logits [N, vocab]``:
    the argmax for greedy requests; for sampled ones a sample of
    ``q = softmax(logits / temperature)`` from the request's counter-based stream
    (:func:`draft_choices`), returned with ``log q`` so the target can accept it with
    ``min(1, p / q)``."""
    if not any(r.temperature > 0 for r in requests):
        return torch.argmax(logits, dim=-1).tolist(), [None] * len(requests)
    args = draw_tensors(requests, [step] * len(requests), logits.device)
    tokens, logq = draft_choices(logits, *args)
    return tokens.tolist(), [logq[i] if r.temperature > 0 else None
                             for i, r in enumerate(requests)]


def read_back_drafts(
    steps: Sequence[tuple[Sequence[int], torch.Tensor, torch.Tensor | None]],
    owners: Sequence[int],
    requests: Sequence[DraftRequest],
    out: list[list[int]],
) -> dict[int, list]:
    """Read a proposal's drafting steps back in one transfer. ``steps``: per step
    ``(live rows, drafts [rows] on the device, log q [rows, vocab] or None)``, a live row
    ``j`` drafting for request ``owners[j]``. Appends each step's drafts to ``out[i]``
    of their requests, in step order, and returns ``log q`` of the sampled requests'
    drafts by request index (every owner present)."""
    values = torch.cat([d for _, d, _ in steps]).tolist()
    logqs: dict[int, list] = {i: [] for i in owners}
    at = 0
    for act, _, logq in steps:
        for r, j in enumerate(act):
            i = owners[j]
            out[i].append(values[at + r])
            if requests[i].temperature > 0:
                logqs[i].append(logq[r])
        at += len(act)
    return logqs


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
