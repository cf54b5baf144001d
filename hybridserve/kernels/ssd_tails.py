"""SSD states a few tokens past a known state: the *tails* of the packed prefill plan.

A packed prefill step takes one scan whose chunk states lie every 64 tokens of a row
(:mod:`hybridserve.kernels.ssd_varlen`). A requested state off that grid (a prompt-end or
junction checkpoint) is the chunk state before it run on over the tail's tokens, fewer
than 64:

    S = exp(sum_i a_i) S0 + sum_i exp(sum_{j > i} a_j) dt_i x_i B_i^T,   a = dt * A.

Layout as in :mod:`hybridserve.kernels.ssd`: ``x [T, H, P]``, ``dt [T, H]``
(discretised), ``A [H]``, ``B [T, G, N]`` (each group serves ``H // G`` consecutive
heads); ``start [M, H, P, N]`` the tails' start states; ``tokens [M, W]`` their packed
tokens in order (padded past ``lengths [M]``, the padding never read). Returns ``[M, H,
P, N]`` in ``promote(x.dtype, float32)``.

- :func:`ssd_tail_states_reference`: the torch twin, the closed form batched over the
  tails (a dozen tensor operations for all tails of a step; the CPU path and oracle).
- :func:`ssd_tail_states`: Triton, the recurrence token by token: one program per
  (tail, head, block of head_dim). It reads its start block and the tail's inputs and
  writes only its own block of the output (the race rule). One launch instead of the
  twin's dozen per Mamba layer of a step that has tails.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.kernels.ssd import heads_from_groups

__all__ = ["ssd_tail_states", "ssd_tail_states_reference"]


def ssd_tail_states_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    start: torch.Tensor,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
) -> torch.Tensor:
    """Torch twin of :func:`ssd_tail_states` (same arguments, same result)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    valid = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < lengths[:, None]
    # Padding gets dt = 0: no decay and no input.
    dt_t = dt[tokens].to(compute) * valid[..., None]  # [M, W, H]
    cum = (dt_t * A.to(compute)).cumsum(1)
    total = cum[:, -1]  # [M, H]
    weight = torch.exp(total[:, None] - cum) * dt_t  # decay after token i, times dt_i
    xw = x[tokens].to(compute) * weight[..., None]  # [M, W, H, P]
    Bh = heads_from_groups(B[tokens].to(compute), x.shape[1])  # [M, W, H, N]
    return (torch.exp(total)[..., None, None] * start.to(compute)
            + torch.einsum("mwhp,mwhn->mhpn", xw, Bh))


@triton.jit
def _ssd_tail_kernel(
    x_ptr,
    x_tok_stride,
    x_head_stride,
    dt_ptr,
    dt_tok_stride,
    A_ptr,
    B_ptr,
    B_tok_stride,
    B_group_stride,
    start_ptr,
    tokens_ptr,
    lengths_ptr,
    out_ptr,
    width,
    heads,
    head_dim,
    d_state,
    heads_per_group,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program per (tail, head, block of head_dim): it owns that block of the tail's
    # output state and writes nothing else.
    m = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pmask = p < head_dim
    nmask = n < d_state
    mask = pmask[:, None] & nmask[None, :]
    g = h // heads_per_group
    a_rate = tl.load(A_ptr + h).to(tl.float32)
    block = (m.to(tl.int64) * heads + h) * head_dim * d_state + p[:, None] * d_state + n[None, :]
    s = tl.load(start_ptr + block, mask=mask, other=0.0).to(tl.float32)
    length = tl.load(lengths_ptr + m)
    for w in range(0, length):
        tok = tl.load(tokens_ptr + m.to(tl.int64) * width + w).to(tl.int64)
        d = tl.load(dt_ptr + tok * dt_tok_stride + h).to(tl.float32)
        xv = tl.load(x_ptr + tok * x_tok_stride + h * x_head_stride + p, mask=pmask, other=0.0)
        bv = tl.load(B_ptr + tok * B_tok_stride + g * B_group_stride + n, mask=nmask, other=0.0)
        s = s * tl.exp(d * a_rate) + (d * xv.to(tl.float32))[:, None] * bv.to(tl.float32)[None, :]
    tl.store(out_ptr + block, s, mask=mask)


def ssd_tail_states(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    start: torch.Tensor,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    *,
    block_p: int = 32,
) -> torch.Tensor:
    """The state after each tail (module docstring), float32, in one launch."""
    tails, width = tokens.shape
    _, heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    if heads % groups:
        raise ValueError(f"{groups} groups do not divide {heads} heads")
    if x.stride(2) != 1 or B.stride(2) != 1 or dt.stride(1) != 1:
        raise ValueError("x, dt and B must be contiguous along their last axis")
    if start.shape != (tails, heads, head_dim, d_state) or not start.is_contiguous():
        raise ValueError(f"start must be a contiguous [{tails}, {heads}, {head_dim}, {d_state}]")
    out = torch.empty(tails, heads, head_dim, d_state, dtype=torch.float32, device=x.device)
    if tails == 0:
        return out
    block_p = min(block_p, triton.next_power_of_2(head_dim))
    grid = (tails, heads, triton.cdiv(head_dim, block_p))
    _ssd_tail_kernel[grid](
        x, x.stride(0), x.stride(1), dt, dt.stride(0), A, B, B.stride(0), B.stride(1),
        start, tokens.contiguous(), lengths.contiguous(), out,
        width, heads, head_dim, d_state, heads // groups,
        BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(d_state),
    )
    return out
