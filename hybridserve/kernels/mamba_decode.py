"""Batched Mamba2 decode over state pages: conv-window update and selective-state update.

The fast path for steps whose rows all run the same small number of tokens ``Q`` (plain
decode, ``Q = 1``, or uniform speculative verify rows, ``Q = 1 + d``) and all continue
from a stored state. Instead of the per-row loop of the reference mixer, every row of
the step is processed by one launch per op:

- :func:`conv_decode_update`: causal depthwise conv of the rows' ``Q`` new inputs,
  starting from the conv window on page ``in_pages[r]``;
- :func:`ssm_decode_update`: the recurrence ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t``,
  ``y_t = S_t . C_t + D x_t`` starting from the SSM state on page ``in_pages[r]``.

Both write the window / state *after* token ``t`` of row ``r`` to page
``out_pages[r, t]`` when that entry is ``>= 0`` and never write an input page (the
caller guarantees the output pages are disjoint from every input page, DESIGN.md
section 4), so no program of a launch reads what another writes (section 5): a
program owns one (row, channel block) or (row, head, head-dim block) slice of its
row's pages and touches nothing else.

Layout (token-major, packed): token ``r * Q + t`` is row ``r``'s token ``t``. Every op has
a torch twin (``*_reference``) computing the same function, the CPU path and the test
oracle; the Triton kernels run on CUDA (and under the CPU interpreter in tests).

:func:`decode_plan` decides whether a :class:`~hybridserve.models.batch.ForwardBatch`
qualifies and turns its host lists into the index tensors both ops take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from hybridserve.kernels.conv1d import apply_activation

if TYPE_CHECKING:  # annotations only: importing models here would be circular
    from hybridserve.models.batch import ForwardBatch

__all__ = [
    "MAX_DECODE_TOKENS",
    "DecodePlan",
    "attach_decode_plan",
    "check_ssm_operands",
    "conv_decode_update",
    "conv_decode_update_reference",
    "decode_plan",
    "ssm_decode_update",
    "ssm_decode_update_reference",
    "ssm_token_step",
]

# Rows longer than this are prefill chunks: the chunked scan serves them better.
MAX_DECODE_TOKENS = 16


@dataclass(frozen=True)
class DecodePlan:
    """A uniform step: ``num_rows`` rows of ``q`` tokens, every row with an input page.

    ``in_pages [R]`` and ``out_pages [R, q]`` (int32, -1 = no output) live on the model's
    device; the host lists keep the same values for launchers that need no device read.
    They are None for a plan whose pages exist only on the device (a step replayed from
    a CUDA graph, :func:`attach_decode_plan`).
    """

    num_rows: int
    q: int
    in_pages: torch.Tensor
    out_pages: torch.Tensor
    in_pages_host: tuple[int, ...] | None = None
    out_pages_host: tuple[tuple[int, ...], ...] | None = None


_PLAN_ATTR = "_decode_plan_memo"


def decode_plan(batch: ForwardBatch, device: torch.device) -> DecodePlan | None:
    """The :class:`DecodePlan` of ``batch``, or None when the step needs the per-row path.

    Qualifies: at least one row, every row runs the same ``q <= MAX_DECODE_TOKENS``
    tokens, every row reads a stored state (``state_in_page >= 0``: a sequence's first
    token takes the zero-state prefill path), and no output page is also an input page
    of any row. The plan is built once per batch and device (memoised on the batch, which
    is not modified during a forward) so every Mamba layer of a step shares its tensors.
    """
    memo = batch.__dict__.setdefault(_PLAN_ATTR, {})
    key = str(device)
    if key in memo:
        return memo[key]
    plan = _build_plan(batch, device)
    memo[key] = plan
    return plan


def attach_decode_plan(
    batch: ForwardBatch, in_pages: torch.Tensor, out_pages: torch.Tensor
) -> DecodePlan:
    """Give ``batch`` a plan over page tensors already on the model's device (no host copy).

    For a batch built over static device buffers (the CUDA-graph decode step): its host
    page lists are placeholders, and the pages a replay reads are whatever the buffers
    hold then. The caller vouches that the step qualifies (uniform rows of ``q`` tokens,
    every row with an input page, no output page that is an input page).
    """
    rows, q = out_pages.shape
    if in_pages.shape != (rows,) or rows != batch.num_rows or rows * q != batch.num_tokens:
        raise ValueError(
            f"pages [{tuple(in_pages.shape)}], [{tuple(out_pages.shape)}] do not fit a batch of "
            f"{batch.num_rows} rows and {batch.num_tokens} tokens"
        )
    plan = DecodePlan(num_rows=rows, q=q, in_pages=in_pages, out_pages=out_pages)
    batch.__dict__.setdefault(_PLAN_ATTR, {})[str(in_pages.device)] = plan
    return plan


def _build_plan(batch: ForwardBatch, device: torch.device) -> DecodePlan | None:
    rows = batch.num_rows
    if rows == 0:
        return None
    q = batch.query_len(0)
    if not 1 <= q <= MAX_DECODE_TOKENS:
        return None
    if any(batch.query_len(i) != q for i in range(rows)):
        return None
    if any(page < 0 for page in batch.state_in_page):
        return None
    if not batch.writes_only_unread_pages():
        return None
    out = [[-1] * q for _ in range(rows)]
    for r, off, page in zip(batch.state_out_row, batch.state_out_offset, batch.state_out_page):
        out[r][off] = page
    host = torch.tensor([[page, *o] for page, o in zip(batch.state_in_page, out)], dtype=torch.int32)
    # One asynchronous host-to-device copy for both index tensors: a copy from pageable
    # memory would stall the host until the device drained its queue, once per step.
    if device.type == "cuda":
        host = host.pin_memory()
    both = host.to(device, non_blocking=True)
    return DecodePlan(
        num_rows=rows,
        q=q,
        in_pages=both[:, 0].contiguous(),
        out_pages=both[:, 1:].contiguous(),
        in_pages_host=tuple(batch.state_in_page),
        out_pages_host=tuple(tuple(o) for o in out),
    )


# --------------------------------------------------------------------------------------
# Torch twins (the CPU path and the test oracle)
# --------------------------------------------------------------------------------------


def _check_pages(in_pages: torch.Tensor, out_pages: torch.Tensor, tokens: int) -> tuple[int, int]:
    if in_pages.dim() != 1 or out_pages.dim() != 2 or out_pages.shape[0] != in_pages.shape[0]:
        raise ValueError(
            f"in_pages must be [R] and out_pages [R, Q], got {tuple(in_pages.shape)}, "
            f"{tuple(out_pages.shape)}"
        )
    rows, q = out_pages.shape
    if rows * q != tokens:
        raise ValueError(f"{tokens} packed tokens do not make {rows} rows of {q}")
    return rows, q


def check_ssm_operands(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    ssm_cache: torch.Tensor,
    kernel: bool = False,
) -> tuple[int, int]:
    """``(groups, d_state)`` of the recurrence's operands ``x [T, H, P]``, ``dt [T, H]``,
    ``B, C [T, G, N]`` and ``ssm_cache [pages, H, P, N]``; raises ValueError on a shape
    that does not fit, and (``kernel``) on a layout the Triton kernels cannot read."""
    tokens, heads, head_dim = x.shape
    groups, d_state = B.shape[-2:]
    if heads % groups or B.shape != (tokens, groups, d_state) or C.shape != B.shape:
        raise ValueError(f"B and C must be [T={tokens}, G, N] with G dividing H={heads}")
    if dt.shape != (tokens, heads) or ssm_cache.shape[1:] != (heads, head_dim, d_state):
        raise ValueError(
            f"dt must be [T, H] and ssm_cache [pages, H={heads}, P={head_dim}, N={d_state}], "
            f"got {tuple(dt.shape)}, {tuple(ssm_cache.shape)}"
        )
    if kernel:
        for name, t in (("x", x), ("B", B), ("C", C)):
            if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
                raise ValueError(f"{name}'s last two axes must be contiguous")
        if dt.stride(1) != 1 or not ssm_cache.is_contiguous():
            raise ValueError("dt's head axis and ssm_cache must be contiguous")
    return groups, d_state


def conv_decode_update_reference(
    xbc: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_cache: torch.Tensor,
    in_pages: torch.Tensor,
    out_pages: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Torch twin of :func:`conv_decode_update` (same arguments, same result)."""
    tokens, channels = xbc.shape
    rows, q = _check_pages(in_pages, out_pages, tokens)
    k = weight.shape[-1]
    windows = conv_cache[in_pages.long()].to(xbc.dtype)  # [R, C, K-1]
    xp = torch.cat([windows, xbc.view(rows, q, channels).transpose(1, 2)], dim=2)  # [R, C, K-1+Q]
    compute = torch.promote_types(xbc.dtype, torch.float32)
    out = torch.nn.functional.conv1d(
        xp.to(compute),
        weight.to(compute).unsqueeze(1),
        None if bias is None else bias.to(compute),
        groups=channels,
    )  # [R, C, Q]
    out = apply_activation(out, activation).transpose(1, 2).reshape(tokens, channels)
    for t in range(q):
        keep = out_pages[:, t] >= 0
        if bool(keep.any()):
            conv_cache[out_pages[keep, t].long()] = xp[keep, :, t + 1 : t + k].to(conv_cache.dtype)
    return out.to(xbc.dtype)


def ssm_decode_update_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    ssm_cache: torch.Tensor,
    in_pages: torch.Tensor,
    out_pages: torch.Tensor,
) -> torch.Tensor:
    """Torch twin of :func:`ssm_decode_update` (same arguments, same result)."""
    tokens, heads, head_dim = x.shape
    rows, q = _check_pages(in_pages, out_pages, tokens)
    groups, d_state = B.shape[-2:]
    compute = torch.promote_types(x.dtype, torch.float32)
    rep = heads // groups
    x = x.to(compute).view(rows, q, heads, head_dim)
    dt = dt.to(compute).view(rows, q, heads)
    Bh = B.to(compute).view(rows, q, groups, d_state).repeat_interleave(rep, dim=2)
    Ch = C.to(compute).view(rows, q, groups, d_state).repeat_interleave(rep, dim=2)
    A = A.to(compute)
    state = ssm_cache[in_pages.long()].to(compute)  # [R, H, P, N]
    y = torch.empty(rows, q, heads, head_dim, dtype=compute, device=x.device)
    for t in range(q):
        decay = torch.exp(dt[:, t] * A)  # [R, H]
        # Same association as the per-token reference step: (dt * B) first, then x.
        dBx = (dt[:, t, :, None] * Bh[:, t])[:, :, None, :] * x[:, t, :, :, None]
        state = state * decay[:, :, None, None] + dBx
        yt = torch.bmm(
            state.reshape(rows * heads, head_dim, d_state),
            Ch[:, t].reshape(rows * heads, d_state, 1),
        ).view(rows, heads, head_dim)
        if D is not None:
            yt = yt + x[:, t] * D.to(compute)[:, None]
        y[:, t] = yt
        keep = out_pages[:, t] >= 0
        if bool(keep.any()):
            ssm_cache[out_pages[keep, t].long()] = state[keep].to(ssm_cache.dtype)
    return y.view(tokens, heads, head_dim)


# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _conv_decode_kernel(
    xbc_ptr,
    xbc_stride,
    weight_ptr,
    bias_ptr,
    conv_ptr,
    page_stride,
    in_pages_ptr,
    out_pages_ptr,
    out_ptr,
    channels,
    Q: tl.constexpr,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # One program per (row, channel block). The padded input of a channel is
    # xp = window (K - 1 values, oldest first) followed by the row's Q inputs; output t
    # reads xp[t .. t + K - 1] and the window after token t is xp[t + 1 .. t + K - 1].
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < channels
    in_page = tl.load(in_pages_ptr + r).to(tl.int64)
    win_ptr = conv_ptr + in_page * page_stride + c * (K - 1)
    tok0 = r * Q
    acc_bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc_bias += tl.load(bias_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    for t in tl.static_range(Q):
        acc = acc_bias
        for k in tl.static_range(K):
            if t + k < K - 1:
                v = tl.load(win_ptr + (t + k), mask=cmask, other=0.0)
            else:
                v = tl.load(xbc_ptr + (tok0 + t + k - (K - 1)) * xbc_stride + c, mask=cmask, other=0.0)
            w = tl.load(weight_ptr + c * K + k, mask=cmask, other=0.0)
            acc += v.to(tl.float32) * w.to(tl.float32)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + (tok0 + t) * channels + c, acc.to(out_ptr.dtype.element_ty), mask=cmask)
        out_page = tl.load(out_pages_ptr + r * Q + t)
        # Broadcast the page before comparing: a scalar comparison in a mask is rejected by
        # the CPU interpreter.
        wmask = cmask & ((c * 0 + out_page) >= 0)
        dst = conv_ptr + out_page.to(tl.int64) * page_stride + c * (K - 1)
        for i in tl.static_range(K - 1):
            if t + 1 + i < K - 1:
                v = tl.load(win_ptr + (t + 1 + i), mask=wmask, other=0.0)
            else:
                v = tl.load(
                    xbc_ptr + (tok0 + t + 1 + i - (K - 1)) * xbc_stride + c, mask=wmask, other=0.0
                )
            tl.store(dst + i, v.to(conv_ptr.dtype.element_ty), mask=wmask)


def conv_decode_update(
    xbc: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_cache: torch.Tensor,
    in_pages: torch.Tensor,
    out_pages: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Conv step of every row of a uniform step, from and to conv-window pages.

    Args:
        xbc: ``[R * Q, C]`` new conv inputs (token-major; rows of ``Q`` tokens).
        weight: ``[C, K]`` depthwise kernel; bias: ``[C]`` or None.
        conv_cache: ``[pages, C, K - 1]`` windows (oldest input first), contiguous.
        in_pages: ``[R]`` int32 page of each row's window before its first token.
        out_pages: ``[R, Q]`` int32; the window after token ``t`` of row ``r`` goes to
            page ``out_pages[r, t]`` when it is ``>= 0``. Must not repeat a page or name
            an input page.
        activation: ``"silu"`` / ``"swish"`` or None, applied to the outputs.

    Returns:
        ``out [R * Q, C]`` in ``xbc.dtype`` (accumulated in float32).
    """
    tokens, channels = xbc.shape
    rows, q = _check_pages(in_pages, out_pages, tokens)
    k = weight.shape[-1]
    if weight.shape != (channels, k) or conv_cache.shape[1:] != (channels, k - 1):
        raise ValueError(
            f"weight must be [C={channels}, K] and conv_cache [pages, C, K-1], got "
            f"{tuple(weight.shape)}, {tuple(conv_cache.shape)}"
        )
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r}")
    if xbc.stride(1) != 1 or not conv_cache.is_contiguous() or not weight.is_contiguous():
        raise ValueError("xbc rows, conv_cache and weight must be contiguous")
    out = torch.empty(tokens, channels, dtype=xbc.dtype, device=xbc.device)
    if rows == 0:
        return out
    block_c = min(256, triton.next_power_of_2(channels))
    grid = (rows, triton.cdiv(channels, block_c))
    _conv_decode_kernel[grid](
        xbc,
        xbc.stride(0),
        weight,
        bias if bias is not None else weight,
        conv_cache,
        conv_cache.stride(0),
        in_pages.contiguous(),
        out_pages.contiguous(),
        out,
        channels,
        Q=q,
        K=k,
        HAS_BIAS=bias is not None,
        SILU=activation is not None,
        BLOCK_C=block_c,
    )
    return out


@triton.jit
def ssm_token_step(
    state,
    tok,
    h,
    g,
    p,
    n,
    pmask,
    nmask,
    smask,
    offs,
    a,
    d_skip,
    x_ptr,
    x_stride,
    dt_ptr,
    dt_stride,
    B_ptr,
    B_stride,
    C_ptr,
    C_stride,
    ssm_ptr,
    page_stride,
    out_pages_ptr,
    y_ptr,
    heads,
    head_dim,
    d_state,
):
    """One token of the recurrence for a program's (head ``h``, head-dim rows ``p``) slice:
    updates ``state`` (returned), stores ``y`` of packed token ``tok`` and, when
    ``out_pages[tok] >= 0``, the new state to that page. Shared by the decode kernel and
    :mod:`~hybridserve.kernels.mamba_short` (inlined into each)."""
    x = tl.load(x_ptr + tok * x_stride + h * head_dim + p, mask=pmask, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + tok * dt_stride + h).to(tl.float32)
    b = tl.load(B_ptr + tok * B_stride + g * d_state + n, mask=nmask, other=0.0).to(tl.float32)
    c = tl.load(C_ptr + tok * C_stride + g * d_state + n, mask=nmask, other=0.0).to(tl.float32)
    decay = tl.exp(dt * a)
    state = state * decay + (dt * b)[None, :] * x[:, None]
    y = tl.sum(state * c[None, :], axis=1) + d_skip * x
    tl.store(y_ptr + tok * heads * head_dim + h * head_dim + p, y, mask=pmask)
    out_page = tl.load(out_pages_ptr + tok)
    # Broadcast the page before comparing: a scalar comparison in a mask is rejected by
    # the CPU interpreter.
    tl.store(
        ssm_ptr + out_page.to(tl.int64) * page_stride + offs,
        state.to(ssm_ptr.dtype.element_ty),
        mask=smask & ((offs * 0 + out_page) >= 0),
    )
    return state


@triton.jit
def _ssm_decode_kernel(
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
    in_pages_ptr,
    out_pages_ptr,
    y_ptr,
    heads,
    head_dim,
    d_state,
    heads_per_group,
    Q: tl.constexpr,
    HAS_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program per (row, head, head-dim block): it owns rows p of the [P, N] state of
    # one head in the row's input page (read) and output pages (written).
    r = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pmask = p < head_dim
    nmask = n < d_state
    smask = pmask[:, None] & nmask[None, :]
    g = h // heads_per_group
    in_page = tl.load(in_pages_ptr + r).to(tl.int64)
    offs = h * head_dim * d_state + p[:, None] * d_state + n[None, :]
    state = tl.load(ssm_ptr + in_page * page_stride + offs, mask=smask, other=0.0).to(tl.float32)
    a = tl.load(A_ptr + h).to(tl.float32)
    d_skip = 0.0
    if HAS_D:
        d_skip = tl.load(D_ptr + h).to(tl.float32)
    for t in tl.static_range(Q):
        # out_pages is [R, Q], row-major: row r's entry t is that of packed token r * Q + t.
        state = ssm_token_step(
            state, r * Q + t, h, g, p, n, pmask, nmask, smask, offs, a, d_skip,
            x_ptr, x_stride, dt_ptr, dt_stride, B_ptr, B_stride, C_ptr, C_stride,
            ssm_ptr, page_stride, out_pages_ptr, y_ptr, heads, head_dim, d_state,
        )


def ssm_decode_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    ssm_cache: torch.Tensor,
    in_pages: torch.Tensor,
    out_pages: torch.Tensor,
) -> torch.Tensor:
    """Selective-state update of every row of a uniform step, from and to state pages.

    Args:
        x: ``[R * Q, H, P]`` (token-major; the head and head-dim axes contiguous).
        dt: ``[R * Q, H]`` already discretised (:func:`~hybridserve.kernels.ssd.discretize_dt`).
        A: ``[H]`` (negative); D: ``[H]`` or None.
        B, C: ``[R * Q, G, N]`` (group and state axes contiguous).
        ssm_cache: ``[pages, H, P, N]`` states, contiguous (any float dtype; the
            recurrence runs in float32 and each written state is cast to it).
        in_pages: ``[R]`` int32 page of each row's state before its first token.
        out_pages: ``[R, Q]`` int32; the state after token ``t`` of row ``r`` goes to
            page ``out_pages[r, t]`` when it is ``>= 0``. Must not repeat a page or name
            an input page.

    Returns:
        ``y [R * Q, H, P]`` float32 (the D skip included, before the gated norm).
    """
    tokens, heads, head_dim = x.shape
    rows, q = _check_pages(in_pages, out_pages, tokens)
    groups, d_state = check_ssm_operands(x, dt, B, C, ssm_cache, kernel=True)
    y = torch.empty(tokens, heads, head_dim, dtype=torch.float32, device=x.device)
    if rows == 0:
        return y
    block_n = triton.next_power_of_2(d_state)
    # About 2K state elements per program: enough programs to fill the chip at batch 1.
    block_p = max(1, min(triton.next_power_of_2(head_dim), 2048 // block_n))
    grid = (rows, heads, triton.cdiv(head_dim, block_p))
    _ssm_decode_kernel[grid](
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
        in_pages.contiguous(),
        out_pages.contiguous(),
        y,
        heads,
        head_dim,
        d_state,
        heads // groups,
        Q=q,
        HAS_D=D is not None,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
    )
    return y
