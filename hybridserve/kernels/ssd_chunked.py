"""The fused chunked SSD scan of a packed prefill step: grouped B/C, dt discretised inside.

The scan primitive of :func:`~hybridserve.kernels.ssd_varlen.ssd_prefill` on the GPU.
Sequence ``s`` of a step owns tokens ``cu_seqlens[s] .. cu_seqlens[s + 1]`` (non-empty);
layout as in :mod:`hybridserve.kernels.ssd`: ``x [T, H, P]``, raw ``dt [T, H]`` (the
projection's output, before bias and softplus), ``A [H]``, ``B, C [T, G, N]`` (head ``h``
reads group ``h // (H // G)``), states ``[H, P, N]``. Every tensor may be a strided view
of the projection (last axis contiguous): nothing is expanded, copied or cast in memory.

Per token, in float32 whatever the input dtype: ``dt = clamp(softplus(dt + dt_bias),
*time_step_limit)`` (tokens flagged in ``unclamped`` skip the clamp), ``a = dt * A``, and
the recurrence ``S_t = exp(a_t) S_{t-1} + dt_t x_t B_t^T``, ``y_t = S_t C_t + D x_t``.

**Work split.** One program per (head, block of head_dim, sequence) walks its sequence's
chunks of :data:`CHUNK` tokens in order, carrying the state block ``S [BLOCK_P, N]`` in
registers (float32). Per chunk, with ``c`` the running sum of ``a`` inside the chunk:

    y  = ((C B^T) * exp(c_l - c_s) * dt_s, causal) x  +  exp(c_l) * C S^T  +  D x
    S <- exp(c_last) S  +  (x * exp(c_last - c_s) dt_s)^T B

So the state is never stored between chunks and never read back: the only state traffic
is the initial state read and the requested states written. The state *before* chunk
``j`` of a sequence (the state after its token ``64 j - 1``: every point of the
checkpoint grid) is stored to row ``chunk_slot[first_chunk[s] + j]`` of ``states`` when
that is ``>= 0`` (and, optionally, to row ``start_slot[...]`` of a float32 ``starts``);
the final state to row ``final_slot[s]``. ``states`` may be the cache of state pages
itself, the slots page ids: then no state is copied after the scan. Slots are distinct (the
plan's job), so no two programs write one location. The discretised dt goes to
``dt_out [T, H]`` (float32; the tails of :mod:`~hybridserve.kernels.ssd_tails` read it),
written by the programs of the first head_dim block only.

Every product has one input operand (x, B or C) on one side. With 16-bit inputs
(``precision="split"``, what ``"auto"`` takes for them) that operand is exact in its
dtype and the float32 side (the decay-weighted scores, the state, the weighted x) goes
in as two 16-bit halves ``hi + lo``: two 16-bit tensor-core products carry it to about
2^-16, better than one tf32 product (2^-11) at the same cost, with half the registers;
``C B^T`` multiplies inputs only and is exact. Otherwise (float32 inputs, or asked for)
both operands go in as float32 at ``precision``: ``"tf32"`` (what ``"auto"`` takes),
``"tf32x3"`` or ``"ieee"``.

- :func:`ssd_scan_fused`: the Triton kernel.
- :func:`ssd_scan_fused_reference`: its torch twin (same arguments, same results): the
  discretisation in ``promote(dt.dtype, float32)`` and
  :func:`~hybridserve.kernels.ssd_varlen.ssd_scan_varlen_reference` per sequence.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hybridserve.kernels.ssd import discretize_dt, ssd_chunked_reference

__all__ = ["CHUNK", "chunk_starts", "ssd_scan_fused", "ssd_scan_fused_reference"]

# Tokens per chunk: the engine's checkpoint grid (and ssd_varlen.SCAN_CHUNK).
CHUNK = 64
# Triton 3.9's "bf16x3" dot precision is not offered: on the H200 it gave results off by
# a factor of ~100 (relative error 2e2 against the float64 twin).
PRECISIONS = ("auto", "split", "tf32", "tf32x3", "ieee")


def chunk_starts(bounds: Sequence[int]) -> list[int]:
    """Index of every sequence's first chunk in the flat chunk numbering of sequences
    ``bounds`` (host ``cu_seqlens``): sequence ``i`` has ``ceil(len_i / CHUNK)`` chunks;
    the last entry is the total."""
    out = [0]
    for s, e in zip(bounds[:-1], bounds[1:]):
        out.append(out[-1] + -(-(e - s) // CHUNK))
    return out


def _check(x, dt, A, B, C, D, dt_bias, cu_seqlens, initial_states, chunk_slot, final_slot,
           states, unclamped, start_slot=None, starts=None):
    tokens, heads, head_dim = x.shape
    if dt.shape != (tokens, heads):
        raise ValueError(f"dt must be [T={tokens}, H={heads}], got {tuple(dt.shape)}")
    if A.shape != (heads,) or dt_bias.shape != (heads,) or (D is not None and D.shape != (heads,)):
        raise ValueError(f"A, dt_bias and D must be [H={heads}]")
    if B.dim() != 3 or B.shape != C.shape or B.shape[0] != tokens or heads % B.shape[1]:
        raise ValueError(
            f"B and C must both be [T={tokens}, G, N] with G dividing H={heads}, got "
            f"{tuple(B.shape)}, {tuple(C.shape)}"
        )
    seqs = cu_seqlens.shape[0] - 1
    state = (heads, head_dim, B.shape[2])
    if initial_states is not None and initial_states.shape != (seqs, *state):
        raise ValueError(f"initial_states must be [S={seqs}, {state}], got "
                         f"{tuple(initial_states.shape)}")
    if final_slot.shape != (seqs,) or chunk_slot.dim() != 1:
        raise ValueError("final_slot must be [S] and chunk_slot [chunks]")
    if states.shape[1:] != state:
        raise ValueError(f"states must be [rows, {state}], got {tuple(states.shape)}")
    if unclamped is not None and unclamped.shape != (tokens,):
        raise ValueError(f"unclamped must be [T={tokens}], got {tuple(unclamped.shape)}")
    if (start_slot is None) != (starts is None):
        raise ValueError("start_slot and starts go together")
    if start_slot is not None and (start_slot.shape != chunk_slot.shape
                                   or starts.shape[1:] != state):
        raise ValueError(f"start_slot must be shaped as chunk_slot and starts [rows, {state}]")


def _prepare(x, dt, A, B, C, D, dt_bias, cu_seqlens, initial_states, chunk_slot, final_slot,
             states, unclamped, start_slot, starts, precision):
    """The argument checks of the Triton scans (fused and two-pass), then their outputs.

    Returns ``(split, precision, y, dt_out)``: whether the products take the 16-bit split
    form, the float32 precision of the others (``"auto"`` resolved), and the uninitialised
    float32 results ``y [T, H, P]`` and ``dt_out [T, H]``."""
    _check(x, dt, A, B, C, D, dt_bias, cu_seqlens, initial_states, chunk_slot, final_slot,
           states, unclamped, start_slot, starts)
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: choose from {PRECISIONS}")
    sixteen = (torch.bfloat16, torch.float16)
    inputs16 = x.dtype in sixteen and B.dtype == x.dtype and C.dtype == x.dtype
    if precision == "split" and not inputs16:
        raise ValueError("precision='split' needs x, B and C in one 16-bit dtype")
    split = precision == "split" or (precision == "auto" and inputs16)
    if precision == "auto":
        precision = "tf32"
    if x.stride(2) != 1 or B.stride(2) != 1 or C.stride(2) != 1 or dt.stride(1) != 1:
        raise ValueError("x, dt, B and C must be contiguous along their last axis")
    if starts is not None and starts.dtype != torch.float32:
        raise ValueError(f"starts must be float32, got {starts.dtype}")
    if any(t is not None and not t.is_contiguous() for t in (states, initial_states, starts)):
        raise ValueError("states, initial_states and starts must be contiguous")
    tokens, heads, head_dim = x.shape
    y = torch.empty(tokens, heads, head_dim, dtype=torch.float32, device=x.device)
    dt_out = torch.empty(tokens, heads, dtype=torch.float32, device=x.device)
    return split, precision, y, dt_out


def _dt_limits(unclamped, time_step_limit):
    """``(unclamped, dt_min, dt_max)`` as the Triton scans take them: a bool mask viewed as
    int8, and the clamp's bounds as floats (unused when ``time_step_limit`` is None)."""
    if unclamped is not None and unclamped.dtype == torch.bool:
        unclamped = unclamped.view(torch.int8)  # the same bytes, a type Triton loads plainly
    limit = time_step_limit if time_step_limit is not None else (0.0, float("inf"))
    return unclamped, float(limit[0]), float(limit[1])


def ssd_scan_fused_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None,
    chunk_slot: torch.Tensor,
    final_slot: torch.Tensor,
    states: torch.Tensor,
    *,
    time_step_limit: tuple[float, float] | None = (0.0, float("inf")),
    unclamped: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    first_chunk: torch.Tensor | None = None,
    start_slot: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    precision: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`ssd_scan_fused` (module docstring): writes the requested rows
    of ``states`` (cast to its dtype) and returns ``(y [T, H, P], dt_out [T, H])`` in
    ``promote(x.dtype, float32)``. ``first_chunk`` and ``precision`` only matter to the
    kernel."""
    del first_chunk, precision
    _check(x, dt, A, B, C, D, dt_bias, cu_seqlens, initial_states, chunk_slot, final_slot,
           states, unclamped, start_slot, starts)
    compute = torch.promote_types(x.dtype, torch.float32)
    bounds = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    tokens, heads, head_dim = x.shape
    if bounds[0] != 0 or bounds[-1] != tokens or any(e <= s for s, e in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must run from 0 to T={tokens} in non-empty steps, got {bounds}")
    d = dt.to(compute)
    bias = dt_bias.to(compute)
    out_dt = discretize_dt(d, bias, time_step_limit)
    if unclamped is not None and time_step_limit is not None:
        out_dt = torch.where(unclamped[:, None] != 0, discretize_dt(d, bias, None), out_dt)
    y = torch.empty(tokens, heads, head_dim, dtype=compute, device=x.device)
    firsts = chunk_starts(bounds)
    slots = chunk_slot.tolist()
    finals = final_slot.tolist()
    start_slots = start_slot.tolist() if start_slot is not None else [-1] * len(slots)
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        init = None if initial_states is None else initial_states[i]
        # The state before chunk j is the state after token j * CHUNK - 1.
        inner = list(range(CHUNK - 1, e - s - 1, CHUNK))
        y[s:e], st = ssd_chunked_reference(
            x[s:e], out_dt[s:e], A, B[s:e], C[s:e], CHUNK, D, init, [*inner, e - s - 1]
        )
        before = [init if init is not None else torch.zeros_like(st[0]), *st[:-1]]
        for j, state in enumerate(before):
            if slots[firsts[i] + j] >= 0:
                states[slots[firsts[i] + j]] = state.to(states.dtype)
            if start_slots[firsts[i] + j] >= 0:
                starts[start_slots[firsts[i] + j]] = state.to(starts.dtype)
        if finals[i] >= 0:
            states[finals[i]] = st[-1].to(states.dtype)
    return y, out_dt


@triton.jit
def _softplus(v):
    # log(1 + exp(v)) = max(v, 0) + log1p(exp(-|v|)); log1p(u) as log(w) - ((w - 1) - u) / w
    # with w = 1 + u, which keeps its accuracy for small u (no libdevice call needed).
    u = tl.exp(-tl.abs(v))
    w = 1.0 + u
    lp = tl.log(w) - ((w - 1.0) - u) / w
    return tl.maximum(v, 0.0) + lp


@triton.jit
def _dot16(a, b, acc, DOT16: tl.constexpr):
    """``acc + a @ b`` of 16-bit operands, float32 accumulation. Triton's CPU interpreter
    multiplies 16-bit dot operands wrongly (3.9: their bits as integers), so under it
    (``DOT16`` False) the same values multiply as float32, which holds them exactly."""
    if DOT16:
        return tl.dot(a, b, acc=acc)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc, input_precision="ieee")


@triton.jit
def _halves(b, like):
    """float32 ``b`` as two halves in ``like``'s 16-bit dtype, ``hi + lo`` (``b`` to
    about 2^-16)."""
    hi = b.to(like.dtype)
    return hi, (b - hi.to(tl.float32)).to(like.dtype)


@triton.jit
def _dot_halves(a, hi, lo, DOT16: tl.constexpr):
    """``a @ (hi + lo)`` of 16-bit ``a`` and the halves of a float32 operand
    (:func:`_halves`), float32 accumulation."""
    return _dot16(a, lo, _dot16(a, hi, None, DOT16), DOT16)


@triton.jit
def _dot_split(a, b, SPLIT: tl.constexpr, PRECISION: tl.constexpr, DOT16: tl.constexpr):
    """``a @ b`` accumulated in float32. ``SPLIT``: ``a`` is exact in its 16-bit input
    dtype and ``b`` (float32) goes in as two 16-bit halves, ``hi + lo``: two 16-bit
    products carry ``b`` to about 2^-16 (tf32 carries 2^-11). Otherwise both in float32
    at ``PRECISION``."""
    if SPLIT:
        hi, lo = _halves(b, a)
        return _dot_halves(a, hi, lo, DOT16)
    else:
        return tl.dot(a.to(tl.float32), b, input_precision=PRECISION)


@triton.jit
def _dot_split_left(a, b, SPLIT: tl.constexpr, PRECISION: tl.constexpr, DOT16: tl.constexpr):
    """:func:`_dot_split` with the roles swapped: ``a`` float32 (split), ``b`` exact."""
    if SPLIT:
        hi = a.to(b.dtype)
        lo = (a - hi.to(tl.float32)).to(b.dtype)
        return _dot16(lo, b, _dot16(hi, b, None, DOT16), DOT16)
    else:
        return tl.dot(a, b.to(tl.float32), input_precision=PRECISION)


@triton.jit
def _discretize_dt(raw, bias, free_ptrs, tm, dt_min, dt_max, CLAMP: tl.constexpr,
                   HAS_UNCLAMPED: tl.constexpr):
    """The discretised dt of one chunk in float32 from its raw values ``raw`` (bias,
    softplus, clamp; tokens whose ``free_ptrs`` entry is nonzero skip the clamp); 0 past
    the sequence (``tm`` False), which makes padded tokens neither decay nor add to the
    state."""
    d = _softplus(raw.to(tl.float32) + bias)
    if CLAMP:
        dc = tl.minimum(tl.maximum(d, dt_min), dt_max)
        if HAS_UNCLAMPED:
            free = tl.load(free_ptrs, mask=tm, other=0) != 0
            dc = tl.where(free, d, dc)
        d = dc
    return tl.where(tm, d, 0.0)


@triton.jit
def _initial_state(init_ptr, s, heads, state_size, head_base, block, smask,
                   HAS_INIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr):
    """Sequence ``s``'s initial state block, transposed (``[BLOCK_N, BLOCK_P]`` float32),
    or zeros without ``HAS_INIT``."""
    if HAS_INIT:
        return _load_state(init_ptr, s.to(tl.int64), heads, state_size, head_base, block,
                           smask).to(tl.float32)
    else:
        return tl.zeros([BLOCK_N, BLOCK_P], dtype=tl.float32)


@triton.jit
def _load_state(ptr, row, heads, state_size, head_base, block, smask):
    """The transposed state block at row ``row`` of ``ptr``, in its dtype (0 off
    ``smask``); int32 offsets inside the state off a scalar int64 base."""
    return tl.load(ptr + (row * heads * state_size + head_base) + block, mask=smask, other=0.0)


@triton.jit
def _store_state(ptr, row, heads, state_size, head_base, block, ST, smask):
    """Store the transposed state block ``ST`` to row ``row`` of ``ptr`` (cast to its
    dtype); int32 offsets inside the state off a scalar int64 base."""
    tl.store(ptr + (row * heads * state_size + head_base) + block, ST.to(ptr.dtype.element_ty),
             mask=smask)


@triton.jit
def _inner_outputs(cv, bv, xv, cum, d, q, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                   DOT16: tl.constexpr):
    """The part of one chunk's outputs from inside it, ``[Q, BLOCK_P]`` float32. Inputs
    ``cv``, ``bv``, ``xv`` stay in their dtype (C B^T multiplies them as they are: exact
    products for bf16, float32 accumulation)."""
    # y_l = sum_{s <= l} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s.
    if SPLIT:
        cb = _dot16(cv, tl.trans(bv), None, DOT16)  # [Q, Q], exact products
    else:
        cb = tl.dot(cv.to(tl.float32), tl.trans(bv.to(tl.float32)), input_precision=PRECISION)
    causal = q[:, None] >= q[None, :]
    seg = tl.where(causal, cum[:, None] - cum[None, :], 0.0)
    mix = tl.where(causal, cb * tl.exp(seg) * d[None, :], 0.0)
    # x is the exact operand, the float32 weights are split.
    return _dot_split_left(mix, xv, SPLIT, PRECISION, DOT16)


@triton.jit
def _chunk_outputs(cv, bv, xv, cum, d, ST, q, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                   DOT16: tl.constexpr):
    """The outputs of one chunk without the D skip, ``[Q, BLOCK_P]`` float32: the part
    from inside the chunk (:func:`_inner_outputs`) plus the incoming state's (``ST``,
    transposed) decayed to each token."""
    y = _inner_outputs(cv, bv, xv, cum, d, q, SPLIT, PRECISION, DOT16)
    y += tl.exp(cum)[:, None] * _dot_split(cv, ST, SPLIT, PRECISION, DOT16)
    return y


@triton.jit
def _local_state(bv, xf, cum, total, d, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                 DOT16: tl.constexpr):
    """The transposed state a chunk leaves from a zero state: ``B^T (x exp(total - cum)
    dt)`` (``xf`` the chunk's x in float32)."""
    w = tl.exp(total - cum) * d
    return _dot_split(tl.trans(bv), xf * w[:, None], SPLIT, PRECISION, DOT16)


@triton.jit
def _state_step(ST, bv, xf, cum, total, d, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                DOT16: tl.constexpr):
    """The transposed state after a chunk: ``exp(total) ST + B^T (x exp(total - cum) dt)``
    (``xf`` the chunk's x in float32)."""
    return ST * tl.exp(total) + _local_state(bv, xf, cum, total, d, SPLIT, PRECISION, DOT16)


@triton.jit
def _ssd_scan_kernel(
    x_ptr,
    x_tok_stride,
    x_head_stride,
    dt_ptr,
    dt_tok_stride,
    dt_bias_ptr,
    A_ptr,
    D_ptr,
    B_ptr,
    B_tok_stride,
    B_group_stride,
    C_ptr,
    C_tok_stride,
    C_group_stride,
    unclamped_ptr,
    cu_ptr,
    first_chunk_ptr,
    init_ptr,
    chunk_slot_ptr,
    final_slot_ptr,
    states_ptr,
    start_slot_ptr,
    starts_ptr,
    y_ptr,
    dt_out_ptr,
    heads,
    head_dim,
    d_state,
    heads_per_group,
    dt_min,
    dt_max,
    CHUNK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_INIT: tl.constexpr,
    CLAMP: tl.constexpr,
    HAS_UNCLAMPED: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT16: tl.constexpr,
):
    # Axis 0: (head, head_dim block), heads fastest, so the programs that run together
    # read the same group's B and C (shared through L2); axis 1: the sequence.
    blocks_p = tl.cdiv(head_dim, BLOCK_P)
    h = tl.program_id(0) // blocks_p
    pb = tl.program_id(0) % blocks_p
    s = tl.program_id(1)
    g = h // heads_per_group
    bos = tl.load(cu_ptr + s).to(tl.int64)
    eos = tl.load(cu_ptr + s + 1).to(tl.int64)
    first = tl.load(first_chunk_ptr + s).to(tl.int64)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    q = tl.arange(0, CHUNK)
    pmask = p < head_dim
    nmask = n < d_state
    # The state block is held transposed, ST [BLOCK_N, BLOCK_P] (= S^T), so that both its
    # products have 64 rows or more (Hopper's warp-group MMA): C ST and B^T (x w).
    # Offsets inside one state (int32: a state has well under 2^31 entries) off scalar
    # int64 bases: a [BLOCK_N, BLOCK_P] int64 tensor live across the loop would cost
    # registers the products need.
    smask = nmask[:, None] & pmask[None, :]
    state_size = head_dim * d_state
    head_base = h.to(tl.int64) * state_size
    a_rate = tl.load(A_ptr + h).to(tl.float32)
    bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    skip = 0.0
    if HAS_D:
        skip = tl.load(D_ptr + h).to(tl.float32)
    block = p[None, :] * d_state + n[:, None]
    ST = _initial_state(init_ptr, s, heads, state_size, head_base, block, smask,
                        HAS_INIT, BLOCK_N, BLOCK_P)
    for j in range(0, tl.cdiv(eos - bos, CHUNK)):
        slot = tl.load(chunk_slot_ptr + first + j).to(tl.int64)
        if slot >= 0:
            _store_state(states_ptr, slot, heads, state_size, head_base, block, ST, smask)
        if HAS_STARTS:
            start_slot = tl.load(start_slot_ptr + first + j).to(tl.int64)
            if start_slot >= 0:
                _store_state(starts_ptr, start_slot, heads, state_size, head_base, block, ST,
                             smask)
        tok = bos + j * CHUNK + q
        tm = tok < eos
        # dt in float32, discretised here (bias, softplus, clamp).
        d = _discretize_dt(tl.load(dt_ptr + tok * dt_tok_stride + h, mask=tm, other=0.0), bias,
                           unclamped_ptr + tok, tm, dt_min, dt_max, CLAMP, HAS_UNCLAMPED)
        if pb == 0:
            tl.store(dt_out_ptr + tok * heads + h, d, mask=tm)
        a = d * a_rate
        cum = tl.cumsum(a, 0)  # [Q]: decay from the chunk start through token l
        total = tl.sum(a, 0)
        # Inputs stay in their dtype in registers (half the registers for bf16).
        xv = tl.load(x_ptr + tok[:, None] * x_tok_stride + h * x_head_stride + p[None, :],
                     mask=tm[:, None] & pmask[None, :], other=0.0)
        bv = tl.load(B_ptr + tok[:, None] * B_tok_stride + g * B_group_stride + n[None, :],
                     mask=tm[:, None] & nmask[None, :], other=0.0)
        cv = tl.load(C_ptr + tok[:, None] * C_tok_stride + g * C_group_stride + n[None, :],
                     mask=tm[:, None] & nmask[None, :], other=0.0)
        y = _chunk_outputs(cv, bv, xv, cum, d, ST, q, SPLIT, PRECISION, DOT16)
        xf = xv.to(tl.float32)
        if HAS_D:
            y += skip * xf
        tl.store(y_ptr + (tok[:, None] * heads + h) * head_dim + p[None, :], y,
                 mask=tm[:, None] & pmask[None, :])
        # The state after the chunk.
        ST = _state_step(ST, bv, xf, cum, total, d, SPLIT, PRECISION, DOT16)
    fslot = tl.load(final_slot_ptr + s).to(tl.int64)
    if fslot >= 0:
        _store_state(states_ptr, fslot, heads, state_size, head_base, block, ST, smask)


def ssd_scan_fused(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None,
    chunk_slot: torch.Tensor,
    final_slot: torch.Tensor,
    states: torch.Tensor,
    *,
    time_step_limit: tuple[float, float] | None = (0.0, float("inf")),
    unclamped: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    first_chunk: torch.Tensor | None = None,
    start_slot: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    precision: str = "auto",
    block_p: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused scan (module docstring) in one launch.

    Args:
        x: ``[T, H, P]``; dt: ``[T, H]`` raw; A, dt_bias, D: ``[H]`` (D may be None);
            B, C: ``[T, G, N]``; all with a contiguous last axis, any other strides.
        cu_seqlens: ``[S + 1]`` integer on the device, every sequence non-empty.
        initial_states: ``[S, H, P, N]`` contiguous or None (zeros); only read.
        chunk_slot: ``[chunks]`` integer, the row of ``states`` that receives the state
            before each chunk (flat numbering of :func:`chunk_starts`), -1 for none.
        final_slot: ``[S]`` integer, the row that receives each final state, or -1.
        states: ``[rows, H, P, N]`` contiguous output (any float dtype: a cache of state
            pages, the slots then page ids; the slots must be distinct and the buffer must
            not overlap ``initial_states``).
        start_slot, starts: optional second output, float32 ``[rows', H, P, N]``: the
            state before chunk ``c`` also goes to row ``start_slot[c]`` when that is ``>= 0``
            (the start states of tails, kept in float32 whatever the pages' dtype).
        time_step_limit: the clamp of the discretised dt, None for none; unclamped:
            ``[T]`` bool / integer, tokens that skip it, or None.
        cu_seqlens_cpu: host copy of ``cu_seqlens`` (spares a device read) and
            first_chunk: ``[S + 1]`` device copy of :func:`chunk_starts` (computed when None).
        precision: of the products (module docstring): ``"auto"``, ``"split"``
            (16-bit inputs), or float32 operands at ``"tf32"``, ``"tf32x3"`` or
            ``"ieee"``.
        block_p, num_warps: tile of a program (head_dim block) and its warps.

    Returns:
        ``(y [T, H, P]`` float32 with the D skip, ``dt_out [T, H]`` float32).
    """
    split, precision, y, dt_out = _prepare(
        x, dt, A, B, C, D, dt_bias, cu_seqlens, initial_states, chunk_slot, final_slot,
        states, unclamped, start_slot, starts, precision)
    tokens, heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    seqs = cu_seqlens.shape[0] - 1
    if seqs == 0 or tokens == 0:
        return y, dt_out
    if first_chunk is None:
        host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()
        first_chunk = torch.tensor(chunk_starts(host.tolist()), dtype=torch.int64,
                                   device=x.device)
    # 64 x 8 warps whatever the grid: on the H200 (prefill_kernels.json, head_dim 64,
    # state 128) narrower tiles or 4 warps were slower for one row too (1 x 8,192: 3.23 ms
    # at 32 x 4, 1.98 ms at 64 x 8), since every program then recomputes C B^T.
    block_p = max(16, min(block_p or 64, triton.next_power_of_2(head_dim)))
    block_n = max(16, triton.next_power_of_2(d_state))
    num_warps = num_warps or 8
    unclamped, dt_min, dt_max = _dt_limits(unclamped, time_step_limit)
    grid = (heads * triton.cdiv(head_dim, block_p), seqs)
    _ssd_scan_kernel[grid](
        x, x.stride(0), x.stride(1), dt, dt.stride(0), dt_bias, A,
        D if D is not None else A,
        B, B.stride(0), B.stride(1), C, C.stride(0), C.stride(1),
        unclamped if unclamped is not None else final_slot,
        cu_seqlens, first_chunk,
        initial_states if initial_states is not None else states,
        chunk_slot, final_slot, states,
        start_slot if start_slot is not None else chunk_slot,
        starts if starts is not None else states, y, dt_out,
        heads, head_dim, d_state, heads // groups, dt_min, dt_max,
        CHUNK=CHUNK, BLOCK_P=block_p, BLOCK_N=block_n,
        HAS_D=D is not None, HAS_INIT=initial_states is not None,
        CLAMP=time_step_limit is not None, HAS_UNCLAMPED=unclamped is not None,
        HAS_STARTS=starts is not None,
        PRECISION="tf32" if split else precision, SPLIT=split,
        DOT16=os.environ.get("TRITON_INTERPRET", "0") != "1", num_warps=num_warps,
    )
    return y, dt_out

