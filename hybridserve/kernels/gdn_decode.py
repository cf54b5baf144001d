"""Batched Gated DeltaNet decode / verify over state pages: the paged delta-rule update.

The fast path for uniform steps (every row runs the same ``Q`` tokens from a stored
state: plain decode ``Q = 1``, uniform verify rows ``Q = 1 + d``;
the step plan's ``DECODE`` kind decides). The conv step is
Mamba2's (:func:`~hybridserve.kernels.mamba_decode.conv_decode_update`: channels are
channels); this module is the recurrence. :func:`gdn_decode_update` reads each row's state
from page ``in_pages[r]``, runs the gated delta rule of :mod:`hybridserve.kernels.gdn`
token by token, and writes the state after token ``t`` to page ``out_pages[r, t]`` (when
``>= 0``): each verify position's state lands on its own page, and no page is read and
written in one launch.

Why our own kernel: fla-core's ``fused_recurrent_gated_delta_rule`` takes one contiguous
block of states and returns only the last one, so paged use needs a gather before and a
scatter after (2.8-3.9x the kernel's own time on an H200; docs/design-notes.md, "Kernel
choices"), and a verify step needs every position's state.

One program per (row, value head, block of value columns): the delta rule updates every
value column of a head's ``[Dk, Dv]`` state independently (the prediction ``k^T S`` and
the output ``q^T S`` reduce over ``Dk`` only), so a program owns columns ``v`` of one
head's state in its row's pages and touches nothing any other program touches (the race
rule, docs/racecheck.md).

``round_state`` rounds the carried state to the page dtype after every token, as the
per-row path does (:mod:`hybridserve.kernels.gdn`), so bfloat16 pages give the same
states however tokens are split over steps.

Numerics: the kernels take the projections' raw ``a, b`` and compute the gates themselves
in float32, ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``
(:func:`~hybridserve.kernels.gdn.gdn_gates`, the twins' form), then the decay ``exp(g)``
and the state in float32. One token's update, :func:`gdn_token_step`, is shared with the
variable-length kernel (:mod:`hybridserve.kernels.gdn_varlen`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.kernels.gdn import gdn_gates
from hybridserve.kernels.mamba_decode import _check_pages, softplus, store_state_page

__all__ = ["gdn_decode_update", "gdn_decode_update_reference", "gdn_token_step"]


def _check_operands(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_cache: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> None:
    """Shapes of the delta rule's operands (``g, beta`` or the raw ``a, b``, all
    ``[T, Hv]``; ``A_log, dt_bias [Hv]`` when given); ValueError naming the one that does
    not fit."""
    tokens, hk, dk = k.shape
    hv, dv = v.shape[1:]
    if q.shape != k.shape or v.shape[0] != tokens or hv % hk:
        raise ValueError(
            f"q, k must be [T, Hk, Dk] and v [T, Hv, Dv] with Hk dividing Hv, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if g.shape != (tokens, hv) or beta.shape != (tokens, hv):
        raise ValueError(
            f"the gates' operands (a, b) must be [T={tokens}, Hv={hv}], got "
            f"{tuple(g.shape)}, {tuple(beta.shape)}"
        )
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t is not None and t.shape != (hv,):
            raise ValueError(f"{name} must be [Hv={hv}], got {tuple(t.shape)}")
    if ssm_cache.shape[1:] != (hv, dk, dv):
        raise ValueError(
            f"ssm_cache must be [pages, Hv={hv}, Dk={dk}, Dv={dv}], got {tuple(ssm_cache.shape)}"
        )


def gdn_decode_update_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ssm_cache: torch.Tensor,
    in_pages: torch.Tensor,
    out_pages: torch.Tensor,
    round_state: bool = False,
    *,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> torch.Tensor:
    """Torch twin of :func:`gdn_decode_update` (same arguments, same result), the CPU path."""
    _check_operands(q, k, v, a, b, ssm_cache, A_log, dt_bias)
    tokens, hk, dk = k.shape
    hv, dv = v.shape[1:]
    rows, steps = _check_pages(in_pages, out_pages, tokens)
    compute = torch.promote_types(v.dtype, torch.float32)
    rep = hv // hk
    q, k = (x.to(compute).view(rows, steps, hk, dk).repeat_interleave(rep, dim=2) for x in (q, k))
    v = v.to(compute).view(rows, steps, hv, dv)
    g, beta = gdn_gates(a, b, A_log, dt_bias, compute)
    decay = g.exp().view(rows, steps, hv)
    beta = beta.view(rows, steps, hv)
    state = ssm_cache[in_pages.long()].to(compute)  # [R, Hv, Dk, Dv]
    out = torch.empty(rows, steps, hv, dv, dtype=compute, device=v.device)
    for t in range(steps):
        state = state * decay[:, t, :, None, None]
        predicted = (state * k[:, t, :, :, None]).sum(dim=2)  # [R, Hv, Dv]
        delta = (v[:, t] - predicted) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        if round_state:
            state = state.to(ssm_cache.dtype).to(compute)
        out[:, t] = (state * q[:, t, :, :, None]).sum(dim=2)
        keep = out_pages[:, t] >= 0
        if bool(keep.any()):
            ssm_cache[out_pages[keep, t].long()] = state[keep].to(ssm_cache.dtype)
    return out.view(tokens, hv, dv)


@triton.jit
def gdn_token_operands(tok, end, h, hk, kk, vv, kmask, vmask, q_ptr, k_ptr, v_ptr, a_ptr,
                       b_ptr, key_heads, value_heads, key_dim, value_dim,
                       BOUNDED: tl.constexpr):
    """Packed token ``tok``'s float32 ``q, k [BLOCK_K]``, ``v [BLOCK_V]`` and raw gate
    inputs ``a, b`` for a program's (value head ``h``, key head ``hk``, value columns
    ``vv``) slice. ``BOUNDED``: zeros where ``tok`` is not below ``end`` (nothing is read
    there: the token past a row's end, when the next token's operands are loaded ahead);
    without it ``tok`` is a token of the row (the loads of before, unmasked)."""
    qk_off = tok * key_heads * key_dim + hk * key_dim + kk
    v_off = tok * value_heads * value_dim + h * value_dim + vv
    km, vm = kmask, vmask
    if BOUNDED:
        km = km & (kk * 0 + tok < end)
        vm = vm & (vv * 0 + tok < end)
    qt = tl.load(q_ptr + qk_off, mask=km, other=0.0).to(tl.float32)
    kt = tl.load(k_ptr + qk_off, mask=km, other=0.0).to(tl.float32)
    vt = tl.load(v_ptr + v_off, mask=vm, other=0.0).to(tl.float32)
    if BOUNDED:
        at = tl.load(a_ptr + tok * value_heads + h, mask=tok < end, other=0.0).to(tl.float32)
        bt = tl.load(b_ptr + tok * value_heads + h, mask=tok < end, other=0.0).to(tl.float32)
    else:
        at = tl.load(a_ptr + tok * value_heads + h).to(tl.float32)
        bt = tl.load(b_ptr + tok * value_heads + h).to(tl.float32)
    return qt, kt, vt, at, bt


@triton.jit
def gdn_token_update(state, qt, kt, vt, at, bt, tok, h, vv, vmask, smask, offs, neg_a,
                     dt_bias, ssm_ptr, page_stride, out_pages_ptr, o_ptr, value_heads,
                     value_dim, ROUND: tl.constexpr):
    """One token of the gated delta rule from its operands in registers
    (:func:`gdn_token_operands`): the gates in float32 from the raw ``a, b``
    (``neg_a = -exp(A_log[h])``), the decay, the delta-rule update; stores ``o`` and, when
    ``out_pages[tok] >= 0``, the new state to that page. Returns the state."""
    gt = neg_a * softplus(at + dt_bias)
    beta = tl.sigmoid(bt)
    state = state * tl.exp(gt)
    predicted = tl.sum(state * kt[:, None], axis=0)
    delta = (vt - predicted) * beta
    state = state + kt[:, None] * delta[None, :]
    if ROUND:
        state = state.to(ssm_ptr.dtype.element_ty).to(tl.float32)
    v_off = tok * value_heads * value_dim + h * value_dim + vv
    tl.store(o_ptr + v_off, tl.sum(state * qt[:, None], axis=0), mask=vmask)
    store_state_page(state, tok, offs, smask, ssm_ptr, page_stride, out_pages_ptr)
    return state


@triton.jit
def gdn_token_step(
    state,
    tok,
    h,
    hk,
    kk,
    vv,
    kmask,
    vmask,
    smask,
    offs,
    neg_a,
    dt_bias,
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    ssm_ptr,
    page_stride,
    out_pages_ptr,
    o_ptr,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    ROUND: tl.constexpr,
):
    """One token of the gated delta rule for a program's (value head ``h``, value columns
    ``vv``) slice of the ``[Dk, Dv]`` state: loads packed token ``tok``'s operands
    (:func:`gdn_token_operands`) and applies :func:`gdn_token_update`. Returns the state.
    Inlined into the decode kernel (unrolled rows) and the variable-length one."""
    qt, kt, vt, at, bt = gdn_token_operands(
        tok, tok + 1, h, hk, kk, vv, kmask, vmask, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr,
        key_heads, value_heads, key_dim, value_dim, False)
    return gdn_token_update(state, qt, kt, vt, at, bt, tok, h, vv, vmask, smask, offs, neg_a,
                            dt_bias, ssm_ptr, page_stride, out_pages_ptr, o_ptr, value_heads,
                            value_dim, ROUND)


@triton.jit
def _gdn_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    A_log_ptr,
    dt_bias_ptr,
    ssm_ptr,
    page_stride,
    in_pages_ptr,
    out_pages_ptr,
    o_ptr,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    heads_per_key,
    Q: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask = kk < key_dim
    vmask = vv < value_dim
    smask = kmask[:, None] & vmask[None, :]
    hk = h // heads_per_key
    in_page = tl.load(in_pages_ptr + r).to(tl.int64)
    offs = h * key_dim * value_dim + kk[:, None] * value_dim + vv[None, :]
    state = tl.load(ssm_ptr + in_page * page_stride + offs, mask=smask, other=0.0).to(tl.float32)
    neg_a = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    for t in tl.static_range(Q):
        state = gdn_token_step(
            state, r * Q + t, h, hk, kk, vv, kmask, vmask, smask, offs, neg_a, dt_bias,
            q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, ssm_ptr, page_stride, out_pages_ptr, o_ptr,
            key_heads, value_heads, key_dim, value_dim, ROUND,
        )


def gdn_decode_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ssm_cache: torch.Tensor,
    in_pages: torch.Tensor,
    out_pages: torch.Tensor,
    round_state: bool = False,
    *,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> torch.Tensor:
    """Gated delta rule of every row of a uniform step, from and to state pages.

    Args:
        q, k: ``[R * Q, Hk, Dk]`` (token-major, rows of ``Q`` tokens; L2-normalised, q
            already scaled by ``Dk ** -0.5``).
        v: ``[R * Q, Hv, Dv]``; a, b: ``[R * Q, Hv]``, the projections' raw gate inputs
            (the kernel computes ``g`` and ``beta`` from them in float32,
            :func:`~hybridserve.kernels.gdn.gdn_gates`).
        ssm_cache: ``[pages, Hv, Dk, Dv]`` states, contiguous (the recurrence runs in
            float32; each written state is cast to the page dtype).
        in_pages: ``[R]`` int32 page of each row's state before its first token.
        out_pages: ``[R, Q]`` int32; the state after token ``t`` of row ``r`` goes to page
            ``out_pages[r, t]`` when it is ``>= 0``. Must not repeat a page or name an
            input page.
        round_state: round the carried state to the page dtype after every token.
        A_log, dt_bias: ``[Hv]`` the layer's decay parameters.

    Returns:
        ``o [R * Q, Hv, Dv]`` float32.
    """
    _check_operands(q, k, v, a, b, ssm_cache, A_log, dt_bias)
    tokens, hk, dk = k.shape
    hv, dv = v.shape[1:]
    rows, steps = _check_pages(in_pages, out_pages, tokens)
    if not ssm_cache.is_contiguous():
        raise ValueError("ssm_cache must be contiguous")
    o = torch.empty(tokens, hv, dv, dtype=torch.float32, device=v.device)
    if rows == 0:
        return o
    block_k = triton.next_power_of_2(dk)
    # About 4K state elements per program: 128 x 32 for Qwen3.6's heads, so batch 1 still
    # spreads over Hv * 4 programs.
    block_v = max(1, min(triton.next_power_of_2(dv), 4096 // block_k))
    grid = (rows, hv, triton.cdiv(dv, block_v))
    _gdn_decode_kernel[grid](
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        a.contiguous(),
        b.contiguous(),
        A_log.contiguous(),
        dt_bias.contiguous(),
        ssm_cache,
        ssm_cache.stride(0),
        in_pages.contiguous(),
        out_pages.contiguous(),
        o,
        hk,
        hv,
        dk,
        dv,
        hv // hk,
        Q=steps,
        ROUND=round_state,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
    )
    return o
