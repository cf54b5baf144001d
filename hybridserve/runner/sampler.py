"""Token sampling, speculative verification and logprobs (torch; the CPU reference path).

Reproducibility: the random draws for a request's k-th generated token come from a
generator seeded by ``(sample_seed, k)``, so a seeded request samples the same tokens
whatever the batch around it, after preemption and recompute, and in any step layout.

Logprobs are the model's raw distribution (log-softmax of the logits before
penalties, temperature and truncation), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridserve.engine.request import Logprob, SamplingParams


def _generator(sample_seed: int, index: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((sample_seed * 1_000_003 + index * 7919) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def process_logits(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> torch.Tensor:
    """Apply penalties, temperature and top-k / top-p / min-p to one row of logits.

    Returns float32 log-probabilities of the distribution to sample from (``-inf`` for
    excluded tokens). For greedy requests only the penalties apply and the result's
    argmax is the choice.
    """
    x = logits.float().clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        if seen.numel():
            vals = x[seen]
            x[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.tensor(list(output_ids), dtype=torch.long).unique(return_counts=True)
        x[ids] -= params.frequency_penalty * counts.float() + params.presence_penalty
    if params.greedy:
        return torch.log_softmax(x, dim=-1)
    x = x / params.temperature
    if params.top_k > 0 and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    logp = torch.log_softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_lp, order = torch.sort(logp, descending=True)
        cum = sorted_lp.exp().cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (always the top token).
        drop_sorted = (cum - sorted_lp.exp()) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    if params.min_p > 0.0:
        probs = logp.exp()
        drop = probs < params.min_p * probs.max()
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    return logp


def samples_by_argmax(params: SamplingParams) -> bool:
    """True when the token after any position is the plain argmax of the raw logits.

    Greedy with no penalty and no logprobs: :func:`process_logits` is then a
    log-softmax (order preserving) and nothing else of the row's logits is needed, so
    the runner can pick the token on the device and read back one id per position.
    """
    return (
        params.greedy
        and params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
        and params.logprobs is None
    )


def argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """Device-side greedy choice for every row of ``logits [N, vocab]`` -> ``[N]`` int64.

    Same value as ``argmax(process_logits(row))`` for a greedy request without penalties:
    the argmax is taken over the log-softmax, as on the general path, so ties resolve
    identically.
    """
    return torch.argmax(torch.log_softmax(logits.float(), dim=-1), dim=-1)


def verify_greedy_ids(choices: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """:func:`verify_drafts` for a greedy request, given the argmax after every position.

    ``choices[j]`` is the argmax after draft position j (``len(drafts) + 1`` entries).
    """
    out: list[int] = []
    for j, x in enumerate(drafts):
        if choices[j] != x:
            out.append(int(choices[j]))
            return out
        out.append(x)
    out.append(int(choices[len(drafts)]))
    return out


def sample_token(logp: torch.Tensor, params: SamplingParams, sample_seed: int, index: int) -> int:
    """Draw one token from processed log-probabilities (argmax when greedy)."""
    if params.greedy:
        return int(torch.argmax(logp))
    probs = logp.exp()
    return int(torch.multinomial(probs, 1, generator=_generator(sample_seed, index)))


def verify_drafts(
    logps: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    sample_seed: int,
    first_index: int,
) -> list[int]:
    """Speculative verification of point-mass drafts (an n-gram proposer's).

    ``logps[j]`` is the processed distribution for the token after draft position j
    (row 0 follows the last accepted token), ``len(logps) == len(drafts) + 1``.
    Returns the accepted drafts followed by one token from the target model, so
    1 <= len(result) <= len(drafts) + 1.

    Greedy: accept while the draft equals the argmax. Sampling: accept draft x with
    probability p(x); on rejection draw from p with x removed and renormalised (the
    residual max(p - q, 0) for q a point mass). This leaves every emitted token
    distributed exactly as the target model's sampling would make it.
    """
    out: list[int] = []
    for j, x in enumerate(drafts):
        logp = logps[j]
        idx = first_index + j
        if params.greedy:
            choice = int(torch.argmax(logp))
            if choice != x:
                out.append(choice)
                return out
            out.append(x)
            continue
        g = _generator(sample_seed, idx)
        u = float(torch.rand((), generator=g))
        px = float(logp[x].exp())
        if u < px:
            out.append(x)
            continue
        residual = logp.exp().clone()
        residual[x] = 0.0
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=g)))
        return out
    out.append(sample_token(logps[len(drafts)], params, sample_seed, first_index + len(drafts)))
    return out


def token_logprobs(raw_logits: torch.Tensor, token: int, k: int) -> dict[int, Logprob]:
    """The ``k`` most likely tokens and ``token`` itself, with 1-based ranks."""
    logp = torch.log_softmax(raw_logits.float(), dim=-1)
    out: dict[int, Logprob] = {}
    if k > 0:
        top = torch.topk(logp, k)
        for rank, (v, i) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            out[i] = Logprob(logprob=v, rank=rank)
    if token not in out:
        v = float(logp[token])
        rank = int((logp > logp[token]).sum()) + 1
        out[token] = Logprob(logprob=v, rank=rank)
    return out
