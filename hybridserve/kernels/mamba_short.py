"""Short rows of a packed step: the Mamba2 recurrence token by token, over rows of any length.

A step whose rows are all short (a prompt's last tokens after a cached prefix, a short
prefill chunk, decode rows mixed in) is dominated by launches, not by arithmetic: the
chunked scan of :mod:`hybridserve.kernels.ssd_varlen` costs a library call with its own
host work and device reads, chunk-state gathers and a tail launch per Mamba layer. Here
the whole step takes two launches per layer, neither of which reads anything back to
the host:

- the conv: :func:`~hybridserve.kernels.conv_varlen.conv_varlen` with ``out_pages``, which
  also writes the window after every token that has an output page;
- the scan: :func:`ssm_short_update`, the recurrence
  ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t``, ``y_t = S_t . C_t + D x_t`` from the row's
  state page (zeros for -1), writing the state after token ``t`` to ``out_pages[t]`` when
  that is ``>= 0``.

This is :mod:`hybridserve.kernels.mamba_decode` generalised from uniform rows to rows of
any length (and from stored states to zero states too); the decode kernels stay separate
because they unroll their fixed row length and are what CUDA graphs capture. A row of
``L`` tokens costs ``L`` dependent steps, so the path is for rows up to
:data:`MAX_SHORT_TOKENS`; longer rows take the chunked scan.

Race rule (DESIGN.md section 5): one program owns one (row, head, head-dim block) slice of
its row's state. It reads that slice of the row's input page and writes that slice of
the row's output pages; output pages are never input pages and never repeat (section 4),
so no program reads or writes what another writes.

:func:`short_plan` decides whether a :class:`~hybridserve.models.batch.ForwardBatch`
qualifies and uploads its index tensors once per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from hybridserve.kernels.conv_varlen import token_rows
from hybridserve.kernels.mamba_decode import check_ssm_operands, ssm_token_step
from hybridserve.kernels.ssd import ssd_step_reference

if TYPE_CHECKING:  # annotations only: importing models here would be circular
    from hybridserve.models.batch import ForwardBatch

__all__ = [
    "MAX_SHORT_TOKENS",
    "ShortPlan",
    "short_plan",
    "ssm_short_update",
    "ssm_short_update_reference",
]

# The longest row the token-by-token path takes. A row of L tokens is L dependent steps
# of about a microsecond each on the GPU, against the chunked scan's fixed cost of about
# 2 ms of host work per Mamba layer. Measured on an H200 at 8B shapes (the first token
# after 8,064 cached tokens, benchmarks/results/gpu_ttft_1ab47c5.json): 28 ms against
# 50 ms for a 512-token tail, 53 against 56 ms at 1,024 tokens, where the two meet.
MAX_SHORT_TOKENS = 512


@dataclass(frozen=True)
class ShortPlan:
    """One step's index tensors for the short-row path, on the model's device.

    ``query_start [R + 1]`` and ``in_pages [R]`` (int32, -1 = zero state); ``token_out_pages
    [T]`` (int32): the state after packed token ``t`` goes to page ``token_out_pages[t]``
    when it is ``>= 0``; ``token_row [T]`` (int64) for the conv; ``unclamped [T]`` (bool, or
    None when there are none) marks the tokens of one-token rows that continue from a
    stored state (the dt clamp exception of :class:`~hybridserve.models.config.MambaParams`).
    """

    num_rows: int
    query_start: torch.Tensor
    in_pages: torch.Tensor
    token_out_pages: torch.Tensor
    token_row: torch.Tensor
    unclamped: torch.Tensor | None


_PLAN_ATTR = "_short_plan_memo"


def short_plan(batch: ForwardBatch, device: torch.device) -> ShortPlan | None:
    """The :class:`ShortPlan` of ``batch``, or None when the step needs another path: a row
    longer than :data:`MAX_SHORT_TOKENS`, no token at all, or an output page that repeats
    or is an input page of the step (the engine never plans that, DESIGN.md section 4;
    the per-row path, which gathers every input first, still computes such a step). Built
    once per batch and device (memoised on the batch, which a forward does not modify)
    and shared by every layer."""
    memo = batch.__dict__.setdefault(_PLAN_ATTR, {})
    key = str(device)
    if key not in memo:
        memo[key] = _build_plan(batch, device)
    return memo[key]


def _build_plan(batch: ForwardBatch, device: torch.device) -> ShortPlan | None:
    qs = list(batch.query_start)
    rows, tokens = batch.num_rows, batch.num_tokens
    if tokens == 0 or max(qs[i + 1] - qs[i] for i in range(rows)) > MAX_SHORT_TOKENS:
        return None
    if not batch.writes_only_unread_pages():
        return None
    out = batch.token_out_pages()
    unclamped = [0] * tokens
    for i in range(rows):
        if qs[i + 1] - qs[i] == 1 and batch.state_in_page[i] >= 0:
            unclamped[qs[i]] = 1
    host = torch.tensor([*qs, *batch.state_in_page, *out, *unclamped], dtype=torch.int32)
    if device.type == "cuda":
        # Pinned: a copy from pageable memory would stall the host until the device drains.
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    query_start, in_pages, out_pages, flags = flat.split([rows + 1, rows, tokens, tokens])
    return ShortPlan(
        num_rows=rows,
        query_start=query_start,
        in_pages=in_pages,
        token_out_pages=out_pages,
        token_row=token_rows(query_start, tokens),
        unclamped=flags != 0 if any(unclamped) else None,
    )


def _check(x, dt, B, C, ssm_cache, query_start, in_pages, out_pages, kernel=False):
    """``(rows, groups)``; raises ValueError on operands that do not fit."""
    tokens = x.shape[0]
    groups, _ = check_ssm_operands(x, dt, B, C, ssm_cache, kernel)
    rows = in_pages.shape[0]
    if query_start.shape != (rows + 1,) or out_pages.shape != (tokens,):
        raise ValueError(
            f"query_start must be [R + 1], in_pages [R] and out_pages [T={tokens}], got "
            f"{tuple(query_start.shape)}, {tuple(in_pages.shape)}, {tuple(out_pages.shape)}"
        )
    return rows, groups


def ssm_short_update_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    ssm_cache: torch.Tensor,
    query_start: torch.Tensor,
    in_pages: torch.Tensor,
    out_pages: torch.Tensor,
) -> torch.Tensor:
    """Torch twin of :func:`ssm_short_update` (same arguments, same result): the per-token
    reference step, row by row. Every input state is read before any page is written."""
    rows, _ = _check(x, dt, B, C, ssm_cache, query_start, in_pages, out_pages)
    starts, pages, outs = query_start.tolist(), in_pages.tolist(), out_pages.tolist()
    if starts[0] != 0 or starts[-1] != x.shape[0]:
        raise ValueError(f"query_start must run from 0 to T={x.shape[0]}, got {starts}")
    compute = torch.promote_types(x.dtype, torch.float32)
    initial = [ssm_cache[p].to(compute) if p >= 0 else None for p in pages]
    y = torch.empty(x.shape, dtype=compute, device=x.device)
    writes = []
    for r in range(rows):
        state = initial[r]
        for t in range(starts[r], starts[r + 1]):
            y[t], state = ssd_step_reference(x[t], dt[t], A, B[t], C[t], D, state)
            if outs[t] >= 0:
                writes.append((outs[t], state))
    for page, state in writes:
        ssm_cache[page] = state.to(ssm_cache.dtype)
    return y


@triton.jit
def _ssm_short_kernel(
    x_ptr,
    x_stride,
    dt_ptr,
    dt_stride,
    A_ptr,
    B_ptr,
    B_stride,
    C_ptr,
    C_stride,
    D_ptr,
    ssm_ptr,
    page_stride,
    query_start_ptr,
    in_pages_ptr,
    out_pages_ptr,
    y_ptr,
    heads,
    head_dim,
    d_state,
    heads_per_group,
    HAS_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program per (row, head, head-dim block): rows p of the [P, N] state of one head.
    r = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pmask = p < head_dim
    nmask = n < d_state
    smask = pmask[:, None] & nmask[None, :]
    g = h // heads_per_group
    start = tl.load(query_start_ptr + r)
    end = tl.load(query_start_ptr + r + 1)
    in_page = tl.load(in_pages_ptr + r)
    offs = h * head_dim * d_state + p[:, None] * d_state + n[None, :]
    # A row without a page starts from zeros (page 0 is never dereferenced for it).
    state = tl.load(
        ssm_ptr + tl.maximum(in_page, 0).to(tl.int64) * page_stride + offs,
        mask=smask & ((offs * 0 + in_page) >= 0),
        other=0.0,
    ).to(tl.float32)
    a = tl.load(A_ptr + h).to(tl.float32)
    d_skip = 0.0
    if HAS_D:
        d_skip = tl.load(D_ptr + h).to(tl.float32)
    for i in range(0, end - start):
        state = ssm_token_step(
            state, start.to(tl.int64) + i, h, g, p, n, pmask, nmask, smask, offs, a, d_skip,
            x_ptr, x_stride, dt_ptr, dt_stride, B_ptr, B_stride, C_ptr, C_stride,
            ssm_ptr, page_stride, out_pages_ptr, y_ptr, heads, head_dim, d_state,
        )


def ssm_short_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    ssm_cache: torch.Tensor,
    query_start: torch.Tensor,
    in_pages: torch.Tensor,
    out_pages: torch.Tensor,
) -> torch.Tensor:
    """Selective-state recurrence of every row of a packed step, from and to state pages.

    Args:
        x: ``[T, H, P]`` packed tokens (the head and head-dim axes contiguous).
        dt: ``[T, H]`` already discretised (head axis contiguous).
        A: ``[H]`` (negative); D: ``[H]`` or None.
        B, C: ``[T, G, N]`` (group and state axes contiguous).
        ssm_cache: ``[pages, H, P, N]`` states, contiguous (any float dtype; the
            recurrence runs in float32 and each written state is cast to it).
        query_start: ``[R + 1]`` int32, row ``r`` owns tokens
            ``query_start[r] .. query_start[r + 1]`` (rows may be empty).
        in_pages: ``[R]`` int32 page of each row's state before its first token, -1 for
            zeros.
        out_pages: ``[T]`` int32; the state after token ``t`` goes to page
            ``out_pages[t]`` when it is ``>= 0``. Must not repeat a page or name an input
            page.

    Returns:
        ``y [T, H, P]`` float32 (the D skip included, before the gated norm).
    """
    tokens, heads, head_dim = x.shape
    rows, groups = _check(x, dt, B, C, ssm_cache, query_start, in_pages, out_pages, kernel=True)
    d_state = B.shape[-1]
    y = torch.empty(tokens, heads, head_dim, dtype=torch.float32, device=x.device)
    if rows == 0 or tokens == 0:
        return y
    block_n = triton.next_power_of_2(d_state)
    # About 1K state elements per program: a single row still spreads over the whole chip.
    block_p = max(1, min(triton.next_power_of_2(head_dim), 1024 // block_n))
    grid = (rows, heads, triton.cdiv(head_dim, block_p))
    _ssm_short_kernel[grid](
        x,
        x.stride(0),
        dt,
        dt.stride(0),
        A.contiguous(),
        B,
        B.stride(0),
        C,
        C.stride(0),
        D.contiguous() if D is not None else A,
        ssm_cache,
        ssm_cache.stride(0),
        query_start.to(torch.int32).contiguous(),
        in_pages.to(torch.int32).contiguous(),
        out_pages.to(torch.int32).contiguous(),
        y,
        heads,
        head_dim,
        d_state,
        heads // groups,
        HAS_D=D is not None,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
    )
    return y
