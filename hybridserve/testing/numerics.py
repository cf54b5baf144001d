"""Mamba2 decode numerics against float64: many decode steps at a bfloat16 model's rounding.

What the drift test (tests/kernels/test_mamba_decode.py) and the ``numerics`` section of
benchmarks/bench_gpu.py both run: one row or a few, ``steps`` decode tokens, each one
launch of the engine's recurrence (:func:`~hybridserve.kernels.mamba_decode.ssm_update`
or its twin) from the page the step before wrote, against the same recurrence in
float64 from the same rounded inputs. The relative state error after ``t`` tokens is
``|S_t - S64_t| / |S64_t|`` (Frobenius norms over all rows).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from hybridserve.kernels.ssd import ssd_step_reference

__all__ = ["decode_at_bf16_rounding", "decode_states", "reference_states", "rel_err"]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` in float64."""
    return float((got.double() - want.double()).norm() / want.double().norm())


def decode_at_bf16_rounding(
    g: torch.Generator,
    steps: int,
    rows: int,
    heads: int,
    head_dim: int,
    groups: int,
    d_state: int,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Random operands of ``steps`` decode tokens of ``rows`` rows (token ``t`` of row
    ``r`` packed at ``t * rows + r``) at the rounding a bfloat16 model's decode sees: x, B,
    C (the conv's outputs), the raw dt (the projection's), dt_bias and D (weights) in
    bfloat16; dt_bias drawn as Mamba2 initialises it (``softplus(dt_bias)`` log-uniform
    over [1e-3, 0.1]); A and the initial states ``init [rows, H, P, N]`` in float32 (the
    mixer's decay rates, the state pages). ``g`` is a generator on ``device``."""
    bf16 = torch.bfloat16
    t = steps * rows

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)

    def rand(*shape):
        return torch.rand(*shape, generator=g, device=device)

    lo, hi = math.log(1e-3), math.log(0.1)
    target = torch.exp(rand(heads) * (hi - lo) + lo)
    return dict(
        x=randn(t, heads, head_dim).to(bf16),
        dt=(randn(t, heads) * 0.5).to(bf16),
        dt_bias=(target + torch.log(-torch.expm1(-target))).to(bf16),  # inverse softplus
        A=-(rand(heads) * 7.5 + 0.5),
        B=randn(t, groups, d_state).to(bf16),
        C=randn(t, groups, d_state).to(bf16),
        D=(randn(heads) * 0.3 + 1.0).to(bf16),
        init=randn(rows, heads, head_dim, d_state),
    )


def decode_states(
    update: Callable[..., torch.Tensor],
    v: dict[str, torch.Tensor],
    steps: int,
    keep: Sequence[int],
) -> dict[int, torch.Tensor]:
    """Run ``steps`` decode steps of :func:`decode_at_bf16_rounding`'s operands through
    ``update`` (``ssm_update`` or its twin: raw dt in, no clamp, the single-token step's),
    one launch a step from the pages the step before wrote (float32 pages, two sets used
    in turn). Returns ``{t: states [rows, H, P, N]}`` after ``t`` tokens, ``t`` in ``keep``."""
    init = v["init"]
    rows = init.shape[0]
    cache = torch.zeros(2 * rows, *init.shape[1:], device=init.device)
    cache[:rows] = init
    pages = torch.arange(2 * rows, dtype=torch.int32, device=init.device).view(2, rows)
    out = {}
    for t in range(steps):
        tok = slice(t * rows, (t + 1) * rows)
        src, dst = pages[t % 2], pages[(t + 1) % 2]
        update(v["x"][tok], v["dt"][tok], v["A"], v["B"][tok], v["C"][tok], v["D"], cache,
               src, dst.view(rows, 1), dt_bias=v["dt_bias"], time_step_limit=None)
        if t + 1 in keep:
            out[t + 1] = cache[dst.long()].clone()
    return out


def reference_states(
    v: dict[str, torch.Tensor],
    dt: torch.Tensor,
    keep: Sequence[int],
    dtype: torch.dtype = torch.float64,
) -> dict[int, torch.Tensor]:
    """The same recurrence token by token in ``dtype`` from the same operands, with ``dt``
    the discretised dt ``[T, H]`` (its arithmetic is the caller's: float64 for the
    truth, bfloat16 to show what that rounding costs): ``{t: [rows, H, P, N]}``."""
    init = v["init"]
    rows = init.shape[0]
    state = init.to(dtype)
    A, D = v["A"].to(dtype), v["D"].to(dtype)
    out = {}
    for t in range(max(keep)):
        tok = slice(t * rows, (t + 1) * rows)
        x, dtt, B, C = (v["x"][tok].to(dtype), dt[tok].to(dtype), v["B"][tok].to(dtype),
                        v["C"][tok].to(dtype))
        state = torch.stack([ssd_step_reference(x[r], dtt[r], A, B[r], C[r], D, state[r])[1]
                             for r in range(rows)])
        if t + 1 in keep:
            out[t + 1] = state
    return out
