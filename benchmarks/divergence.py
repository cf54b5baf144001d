"""Where two greedy runs of one model part, and how close the model's logits were there.

Two runs of the same prompts (one with speculation, one without; or the same engine at
two batch sizes) that compute the same function emit the same greedy tokens unless
rounding moves the top logit. Rounding can only do that where the top two logits are
nearly tied; a defect (a row reading another row's state or KV pages, a wrong position)
picks tokens whatever the gap. So at each request's first divergent position this
module recomputes the logits from the common prefix (prompt + agreed tokens) with a
precise forward of the same weights (float32, or float64 on the CPU) and reports the
gap between the two runs' tokens there, next to the top-1 / top-2 gap at every other
position of the reference run.

Shared by the benchmark scripts (run as ``python benchmarks/<script>.py``, so this
module is importable as ``divergence``).

Figures, per compared run (:func:`compare`):

- ``token_agreement``: positions equal to the reference run's, over its positions.
- ``points``: one per request that diverges: its first divergent ``position``, the two
  tokens, ``gap_rel`` = (logit of the reference run's token - logit of the other's) /
  the logits' standard deviation over the vocabulary at that position (positive: the
  precise forward prefers the reference run's token), ``top_gap_rel`` (the top-1 /
  top-2 gap there, same units), ``gap_percentile`` (the share of the reference run's
  positions whose top-1 / top-2 gap is smaller than ``|gap_rel|``: near 0 for a
  near-tie, about 0.5 for a token picked at random among the likely ones) and
  ``reference_pick`` (``"reference"``, ``"other"`` or ``"neither"``: which run's token
  the precise forward's argmax is).
- ``gap_rel_median`` / ``gap_rel_max`` (of ``|gap_rel|``), ``gap_percentile_median``,
  ``gap_percentile_max`` and ``reference_picks`` (counts).

And of the reference run itself (:func:`compare`'s ``typical``): the quantiles of the
top-1 / top-2 gap over all its positions and ``argmax_agreement``, the share of its
tokens that are the precise forward's argmax (below 1 where the run's own dtype
already flips near-ties).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

Tokens = Sequence[Sequence[int]]
LogitsFn = Callable[[Sequence[int], Sequence[int]], torch.Tensor]


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """The first position where ``other`` differs from ``reference`` (a shorter one
    differs where it ends), or None where they are equal."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def agreement(reference: Tokens, other: Tokens) -> float:
    """Positions of ``other`` equal to ``reference``'s, over ``reference``'s positions."""
    same = sum(a == b for x, y in zip(other, reference) for a, b in zip(x, y))
    return round(same / max(1, sum(map(len, reference))), 4)


@torch.inference_mode()
def model_logits(model: torch.nn.Module) -> LogitsFn:
    """``logits(prompt, tokens) -> [len(tokens), vocab]`` float64 on the CPU: row ``j``
    the logits ``model`` gives after ``prompt + tokens[:j]``, from one cold forward of
    ``prompt + tokens[:-1]`` in the model's own dtype (its caches too, float32 at
    least), nothing shared with any engine. The LM head runs in that dtype as well
    (``compute_logits`` would round a float64 model's logits to float32)."""
    from hybridserve.models.batch import ForwardBatch

    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    state_dtype = torch.promote_types(dtype, torch.float32)
    head = model.lm_head.weight if model.lm_head is not None else model.model.embed.weight
    scaling = model.config.logits_scaling

    @torch.inference_mode()
    def logits(prompt: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        if not prompt or not tokens:
            raise ValueError("logits: need a prompt and at least one token")
        ids = list(prompt) + list(tokens[:-1])
        n, bs = len(ids), 16
        nblocks = -(-n // bs)
        caches = model.cache_spec.allocate(nblocks, bs, 2, dtype, state_dtype, device)
        positions = torch.arange(n, device=device)
        batch = ForwardBatch(
            query_start=[0, n], num_computed=[0], positions=positions, context_lens=[n],
            block_tables=torch.arange(nblocks, dtype=torch.int32, device=device)[None],
            slot_mapping=positions.clone(), state_in_page=[-1], state_out_row=[],
            state_out_offset=[], state_out_page=[],
        )
        hidden = model.forward(torch.tensor(ids, device=device), batch, caches)
        out = torch.nn.functional.linear(hidden[len(prompt) - 1:], head)
        if scaling != 1.0:
            out = out / scaling
        return out.double().cpu()

    return logits


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    return round(float(torch.tensor(values, dtype=torch.float64).quantile(q)), 6)


def compare(logits: LogitsFn, prompts: Tokens, reference: Tokens,
            others: Mapping[str, Tokens]) -> tuple[dict, dict[str, dict]]:
    """``(typical, {name: figures})``: the reference run's own figures and each other
    run's against it (the module's docstring says what each is). ``reference[i]`` and
    every ``others[name][i]`` are the tokens generated after ``prompts[i]``; one precise
    forward a request serves every comparison."""
    top_gaps: list[float] = []
    argmax_same = positions = 0
    raw: dict[str, list[dict]] = {name: [] for name in others}
    for i, (prompt, ref) in enumerate(zip(prompts, reference)):
        if not ref:
            continue
        lg = logits(prompt, ref)
        top2 = lg.topk(2, dim=-1)
        scale = lg.std(dim=-1)
        gaps = ((top2.values[:, 0] - top2.values[:, 1]) / scale).tolist()
        top_gaps.extend(gaps)
        argmax = top2.indices[:, 0].tolist()
        argmax_same += sum(a == t for a, t in zip(argmax, ref))
        positions += len(ref)
        for name, runs in others.items():
            p = first_divergence(ref, runs[i])
            if p is None or p >= len(ref) or p >= len(runs[i]):
                continue
            a, b = ref[p], runs[i][p]
            pick = "reference" if argmax[p] == a else "other" if argmax[p] == b else "neither"
            raw[name].append(dict(
                request=i, position=p, reference_token=a, other_token=b,
                gap=round(float(lg[p, a] - lg[p, b]), 6),
                gap_rel=round(float((lg[p, a] - lg[p, b]) / scale[p]), 6),
                top_gap_rel=round(gaps[p], 6), reference_pick=pick))
    sorted_gaps = sorted(top_gaps)

    def percentile(x: float) -> float:
        # The share of the reference run's positions whose top-1 / top-2 gap is below x.
        lo, hi = 0, len(sorted_gaps)
        while lo < hi:
            mid = (lo + hi) // 2
            if sorted_gaps[mid] < x:
                lo = mid + 1
            else:
                hi = mid
        return round(lo / max(1, len(sorted_gaps)), 4)

    typical = dict(
        positions=positions,
        top_gap_rel_p10=_quantile(top_gaps, 0.1), top_gap_rel_median=_quantile(top_gaps, 0.5),
        top_gap_rel_p90=_quantile(top_gaps, 0.9),
        argmax_agreement=round(argmax_same / max(1, positions), 4),
    )
    figures = {}
    for name, runs in others.items():
        points = raw[name]
        for pt in points:
            pt["gap_percentile"] = percentile(abs(pt["gap_rel"]))
        mags = [abs(pt["gap_rel"]) for pt in points]
        pct = [pt["gap_percentile"] for pt in points]
        figures[name] = dict(
            token_agreement=agreement(reference, runs),
            sequences_identical=sum(list(x) == list(y) for x, y in zip(runs, reference)),
            diverged_requests=len(points),
            gap_rel_median=_quantile(mags, 0.5), gap_rel_max=max(mags) if mags else None,
            gap_percentile_median=_quantile(pct, 0.5), gap_percentile_max=max(pct) if pct else None,
            reference_picks={k: sum(pt["reference_pick"] == k for pt in points)
                             for k in ("reference", "other", "neither")},
            points=points,
        )
    return typical, figures
