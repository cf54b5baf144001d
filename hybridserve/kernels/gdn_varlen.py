"""Gated DeltaNet over a packed step of variable-length rows, token by token, from and to
state pages: the GPU path of steps that are not uniform decode steps (prefill chunks,
prompt tails after a prefix hit, mixed steps).

:func:`gdn_varlen_update` is :func:`~hybridserve.kernels.gdn_decode.gdn_decode_update`
generalised to rows of any length that start from a page or from zeros: one program per
(row, value head, block of value columns) runs its row's tokens in order, reading the
state slice from page ``in_pages[r]`` (zeros for -1) and writing the state after packed
token ``t`` to page ``token_out_pages[t]`` when that is ``>= 0``. Every requested state
(grid checkpoints, junctions, prompt ends, the row end) therefore comes out of the one
pass, at any offset: no cut, no second scan. The conv of the same step is
:func:`~hybridserve.kernels.conv_varlen.conv_varlen`, which writes its windows itself.

Cost: a row of ``L`` tokens is ``L`` dependent steps (about a microsecond each on an
H200, estimated), so long prompts want the chunked delta rule
(:mod:`hybridserve.kernels.gdn_chunked`); this path is exact for any length, and the right
one for short rows (launch-bound), as for Mamba2's short rows (:func:`~hybridserve.kernels.mamba_decode.ssm_update`).
It also runs the chunked prefill's tails, from dense initial states (chunk states).

The per-token update, gates included (the raw ``a, b`` in, float32 inside), is
:func:`~hybridserve.kernels.gdn_decode.gdn_token_step`, the decode kernel's.

Race rule (docs/racecheck.md): a program touches only its own slice of its row's input
page and output pages; output pages never repeat and are never input pages (the plan
checks, the step plan), so no program reads or writes what another writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hybridserve.kernels.gdn import gated_delta_rule_reference, gdn_gates
from hybridserve.kernels.gdn_decode import (
    _check_operands,
    gdn_token_operands,
    gdn_token_step,
    gdn_token_update,
)

__all__ = ["VarlenPlan", "gdn_varlen_update", "gdn_varlen_update_reference"]


@dataclass(frozen=True)
class VarlenPlan:
    """One step's index tensors on the model's device: ``query_start [R + 1]``,
    ``in_pages [R]`` (int32, -1 = zero state), ``token_out_pages [T]`` (int32, -1 = none),
    ``token_row [T]`` (int64, for the conv).

    ``query_start_host``: the row starts on the host (the layer picks its path by the
    longest row). ``token_out_pages_host``: the output pages on the host, which only the
    chunked prefill reads (it plans its chunk states from them); None for a step whose
    pages exist only on the device (a CUDA-graph step, filled per replay), which therefore
    never takes the chunked prefill. ``window_tokens [W]`` (int32): the tokens that have an
    output page, for the conv's window writer
    (:func:`~hybridserve.kernels.conv_varlen.conv_varlen`); None where the host does not
    know them (the conv's full-grid writer)."""

    num_rows: int
    query_start: torch.Tensor
    in_pages: torch.Tensor
    token_out_pages: torch.Tensor
    token_row: torch.Tensor
    # The same values on the host (the chunked prefill plans its chunk states from them).
    query_start_host: tuple[int, ...] = ()
    token_out_pages_host: tuple[int, ...] | None = ()
    window_tokens: torch.Tensor | None = None


def _check_initial(initial_states, rows, ssm_cache) -> None:
    if initial_states is not None and initial_states.shape != (rows, *ssm_cache.shape[1:]):
        raise ValueError(
            f"initial_states must be [R={rows}, {', '.join(map(str, ssm_cache.shape[1:]))}], "
            f"got {tuple(initial_states.shape)}"
        )


def _check_pages(query_start, in_pages, token_out_pages, tokens) -> int:
    rows = in_pages.shape[0]
    if query_start.shape != (rows + 1,) or token_out_pages.shape != (tokens,):
        raise ValueError(
            f"query_start must be [R + 1], in_pages [R] and token_out_pages [T={tokens}], got "
            f"{tuple(query_start.shape)}, {tuple(in_pages.shape)}, {tuple(token_out_pages.shape)}"
        )
    return rows


def gdn_varlen_update_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ssm_cache: torch.Tensor,
    query_start: torch.Tensor,
    in_pages: torch.Tensor,
    token_out_pages: torch.Tensor,
    round_state: bool = False,
    initial_states: torch.Tensor | None = None,
    *,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    prefetch: bool = False,
) -> torch.Tensor:
    """Torch twin of :func:`gdn_varlen_update` (same arguments, same result; ``prefetch``,
    a load order of the kernel's, changes nothing here): the per-row recurrence of
    :mod:`hybridserve.kernels.gdn`. Every input state is read before any page is
    written."""
    _check_operands(q, k, v, a, b, ssm_cache, A_log, dt_bias)
    tokens = q.shape[0]
    rows = _check_pages(query_start, in_pages, token_out_pages, tokens)
    _check_initial(initial_states, rows, ssm_cache)
    starts, pages, outs = query_start.tolist(), in_pages.tolist(), token_out_pages.tolist()
    if starts[0] != 0 or starts[-1] != tokens:
        raise ValueError(f"query_start must run from 0 to T={tokens}, got {starts}")
    compute = torch.promote_types(v.dtype, torch.float32)
    g, beta = gdn_gates(a, b, A_log, dt_bias, compute)
    state_dtype = ssm_cache.dtype if round_state else None
    if initial_states is not None:
        initial = list(initial_states.to(compute))
    else:
        initial = [ssm_cache[p].to(compute) if p >= 0 else None for p in pages]
    o = torch.empty(v.shape, dtype=compute, device=v.device)
    writes = []
    for r in range(rows):
        s, e = starts[r], starts[r + 1]
        if e == s:
            continue
        offsets = [t - s for t in range(s, e) if outs[t] >= 0]
        o[s:e], states = gated_delta_rule_reference(
            q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], initial[r], offsets, state_dtype
        )
        writes += [(outs[s + off], st) for off, st in zip(offsets, states)]
    for page, state in writes:
        ssm_cache[page] = state.to(ssm_cache.dtype)
    return o


@triton.jit
def _gdn_varlen_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    A_log_ptr,
    dt_bias_ptr,
    ssm_ptr,
    page_stride,
    query_start_ptr,
    in_pages_ptr,
    out_pages_ptr,
    o_ptr,
    init_ptr,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    heads_per_key,
    ROUND: tl.constexpr,
    DENSE_INIT: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask = kk < key_dim
    vmask = vv < value_dim
    smask = kmask[:, None] & vmask[None, :]
    hk = h // heads_per_key
    start = tl.load(query_start_ptr + r)
    end = tl.load(query_start_ptr + r + 1)
    in_page = tl.load(in_pages_ptr + r)
    offs = h * key_dim * value_dim + kk[:, None] * value_dim + vv[None, :]
    if DENSE_INIT:
        # initial_states [R, Hv, Dk, Dv] (float32) instead of pages.
        state = tl.load(init_ptr + r.to(tl.int64) * page_stride + offs, mask=smask, other=0.0)
    else:
        # A row without a page starts from zeros (page 0 is never dereferenced for it).
        state = tl.load(
            ssm_ptr + tl.maximum(in_page, 0).to(tl.int64) * page_stride + offs,
            mask=smask & ((offs * 0 + in_page) >= 0),
            other=0.0,
        ).to(tl.float32)
    neg_a = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    if PREFETCH:
        # Token i + 1's operands loaded before token i's update (inputs only, never a
        # state page: the same values in the same order, their latency hidden).
        first = start.to(tl.int64)
        last = end.to(tl.int64)
        qt, kt, vt, at, bt = gdn_token_operands(
            first, last, h, hk, kk, vv, kmask, vmask, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr,
            key_heads, value_heads, key_dim, value_dim, True)
        for i in range(0, end - start):
            q_n, k_n, v_n, a_n, b_n = gdn_token_operands(
                first + i + 1, last, h, hk, kk, vv, kmask, vmask, q_ptr, k_ptr, v_ptr, a_ptr,
                b_ptr, key_heads, value_heads, key_dim, value_dim, True)
            state = gdn_token_update(
                state, qt, kt, vt, at, bt, first + i, h, vv, vmask, smask, offs, neg_a,
                dt_bias, ssm_ptr, page_stride, out_pages_ptr, o_ptr, value_heads, value_dim,
                ROUND)
            qt, kt, vt, at, bt = q_n, k_n, v_n, a_n, b_n
    else:
        for i in range(0, end - start):
            state = gdn_token_step(
                state, start.to(tl.int64) + i, h, hk, kk, vv, kmask, vmask, smask, offs,
                neg_a, dt_bias, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, ssm_ptr, page_stride,
                out_pages_ptr, o_ptr, key_heads, value_heads, key_dim, value_dim, ROUND,
            )


def gdn_varlen_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ssm_cache: torch.Tensor,
    query_start: torch.Tensor,
    in_pages: torch.Tensor,
    token_out_pages: torch.Tensor,
    round_state: bool = False,
    initial_states: torch.Tensor | None = None,
    *,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    prefetch: bool = False,
) -> torch.Tensor:
    """Gated delta rule of every row of a packed step, from and to state pages.

    Args:
        q, k: ``[T, Hk, Dk]`` packed tokens (L2-normalised, q scaled by ``Dk ** -0.5``).
        v: ``[T, Hv, Dv]``; a, b: ``[T, Hv]``, the projections' raw gate inputs (the
            kernel computes ``g`` and ``beta`` from them in float32,
            :func:`~hybridserve.kernels.gdn.gdn_gates`).
        ssm_cache: ``[pages, Hv, Dk, Dv]`` states, contiguous.
        query_start: ``[R + 1]`` int32, row ``r`` owns tokens
            ``query_start[r] .. query_start[r + 1]`` (rows may be empty).
        in_pages: ``[R]`` int32 page of each row's state before its first token, -1 for
            zeros.
        token_out_pages: ``[T]`` int32; the state after token ``t`` goes to page
            ``token_out_pages[t]`` when ``>= 0``. Must not repeat a page or name an input page.
        round_state: round the carried state to the page dtype after every token.
        initial_states: ``[R, Hv, Dk, Dv]`` or None; when given, row ``r`` starts from
            ``initial_states[r]`` instead of a page (``in_pages`` is then not read): the
            tails of the chunked prefill start from chunk states
            (:mod:`hybridserve.kernels.gdn_chunked`).
        A_log, dt_bias: ``[Hv]`` the layer's decay parameters.
        prefetch: load each token's operands one token ahead
            (``KernelPolicy.token_prefetch``); the same result bit for bit.

    Returns:
        ``o [T, Hv, Dv]`` float32.
    """
    _check_operands(q, k, v, a, b, ssm_cache, A_log, dt_bias)
    tokens, hk, dk = k.shape
    hv, dv = v.shape[1:]
    rows = _check_pages(query_start, in_pages, token_out_pages, tokens)
    _check_initial(initial_states, rows, ssm_cache)
    init = None if initial_states is None else initial_states.to(torch.float32).contiguous()
    if not ssm_cache.is_contiguous():
        raise ValueError("ssm_cache must be contiguous")
    o = torch.empty(tokens, hv, dv, dtype=torch.float32, device=v.device)
    if rows == 0 or tokens == 0:
        return o
    block_k = triton.next_power_of_2(dk)
    block_v = max(1, min(triton.next_power_of_2(dv), 4096 // block_k))
    grid = (rows, hv, triton.cdiv(dv, block_v))
    _gdn_varlen_kernel[grid](
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        a.contiguous(),
        b.contiguous(),
        A_log.contiguous(),
        dt_bias.contiguous(),
        ssm_cache,
        ssm_cache.stride(0),
        query_start.to(torch.int32).contiguous(),
        in_pages.to(torch.int32).contiguous(),
        token_out_pages.to(torch.int32).contiguous(),
        o,
        init if init is not None else o,
        hk,
        hv,
        dk,
        dv,
        hv // hk,
        ROUND=round_state,
        DENSE_INIT=init is not None,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
        PREFETCH=bool(prefetch),
    )
    return o
