"""The chunked SSD scan of a packed prefill step in two passes: a state pass, then the
outputs of every chunk in parallel.

Same contract as :func:`~hybridserve.kernels.ssd_chunked.ssd_scan_fused` (arguments,
results, the states it stores and where; its module docstring has the layout and the
float32 arithmetic), so :func:`~hybridserve.kernels.ssd_varlen.ssd_prefill` takes either.
The twin is the fused scan's (:func:`ssd_scan_two_pass_reference` is that function).

**Why two passes.** The fused scan runs one program per (head, head_dim block, sequence)
that walks its sequence's chunks in order and does each chunk's whole work (the
``C B^T`` scores, the outputs, the state update) on one dependent chain: few programs
(``sequences x heads``), each long and register-bound. Here the only sequential part is
the state, and the output work is spread over every chunk:

1. **State pass** (:func:`_ssd_state_pass_kernel`), one program per (head, block of the
   state: head_dim x state, sequence): per chunk of :data:`CHUNK` tokens, ``S <- exp(c_last) S +
   (x * exp(c_last - c_s) dt_s)^T B`` (``c`` the running sum of ``a = dt * A`` inside the
   chunk). The product does not depend on ``S``, so the chain between chunks is one
   scaled add. It discretises dt (writes ``dt_out``), stores the state *before* every
   chunk to a scratch of four-byte entries (what pass 2 reads: float32 ``[chunks, H,
   P, N]``, or for 16-bit inputs the two 16-bit halves its product takes, ``[2 chunks,
   H, P, N]``; :func:`_store_scratch`), and the
   requested chunk states, start states and final states to their slots, as the fused
   scan does. A chunk state that goes to a slot of float32 ``states`` (the state pages)
   skips the scratch: pass 2 reads it from its slot.
2. **Output pass** (:func:`_ssd_output_kernel`), one program per (head, head_dim block,
   output chunk), all independent: ``y = ((C B^T) * exp(c_l - c_s) * dt_s, causal) x +
   exp(c_l) C S_in^T + D x`` with ``S_in`` the chunk's incoming state from the scratch and
   ``dt`` from ``dt_out``. An output chunk is one chunk, or two (``out_chunk=128``: the
   state pass then stores the scratch rows of every other chunk only, and the output
   pass reads half as many states for a 128 x 128 ``C B^T``).

Chunks never cross a sequence boundary (sequence ``s``'s chunk ``j`` starts at token
``cu_seqlens[s] + CHUNK j``; flat numbering of
:func:`~hybridserve.kernels.ssd_chunked.chunk_starts`), so the state before chunk ``j``
is the state after the sequence's token ``CHUNK j - 1``: the checkpoint grid.

Compared with a split into a parallel local-state kernel and a separate state-passing
kernel, the state pass reads ``x`` and ``B`` of a chunk (24 KiB per head at bf16,
head_dim 64, state 128) instead of writing a local float32 state (32 KiB) and reading it
back: two trips of the state scratch through memory instead of four
(:mod:`~hybridserve.kernels.ssd_chunk_states` is that split, built to time against this
scan; it shares this module's slot stores and output pass).

The scratch's size comes from host-known shapes only (``chunk_slot`` has one entry per
chunk) and the chunk -> sequence map is computed on the device, so a call makes no host
read of device values (``cu_seqlens_cpu`` or ``first_chunk`` spare the one of the fused
scan's wrapper) and can be captured in a CUDA graph.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from hybridserve.kernels.ssd_chunked import (
    CHUNK,
    _discretize_dt,
    _dot_halves,
    _dot_split,
    _dt_limits,
    _halves,
    _initial_state,
    _inner_outputs,
    _load_state,
    _prepare,
    _state_step,
    _store_state,
    chunk_starts,
    ssd_scan_fused_reference,
)

__all__ = ["ssd_scan_two_pass", "ssd_scan_two_pass_reference"]

# The two passes write and read the same states as the fused scan: one twin for both.
ssd_scan_two_pass_reference = ssd_scan_fused_reference

# Rows x heads from which the state pass takes its small tiles (see ssd_scan_two_pass):
# timed at 128 (1 row of the 8B layer: large tiles win) and 1,024 (8 rows: small tiles
# win); the switch between them is a guess, not a measurement.
STATE_PASS_MANY_PROGRAMS = 512


@triton.jit
def _chunk_tile(base_ptr, tok_stride, q, cols, tm, cmask):
    """The ``[len(q), len(cols)]`` tile of a chunk's tokens ``q`` (rows ``tok_stride``
    apart from ``base_ptr``, the chunk's first token) and columns ``cols``, in its dtype;
    0 off ``tm`` x ``cmask``. The offsets are int32 off the scalar int64 base."""
    return tl.load(base_ptr + (q[:, None] * tok_stride + cols[None, :]),
                   mask=tm[:, None] & cmask[None, :], other=0.0)


@triton.jit
def _store_incoming(ST, c, j, chunk_slot_ptr, states_ptr, chunk_states_ptr, start_slot_ptr,
                    starts_ptr, heads, state_size, head_base, block, smask,
                    HAS_STARTS: tl.constexpr, READ_SLOTS: tl.constexpr, OUT_EVERY: tl.constexpr,
                    HALVES: tl.constexpr):
    """Store ``ST``, the incoming state of flat chunk ``c`` (its row's chunk ``j``): to its
    slot of ``states`` when asked for, to the scratch for the output pass (which reads the
    states before every ``OUT_EVERY``-th chunk only; :func:`_store_scratch`) unless that
    pass reads the slot (``READ_SLOTS``: float32 states, the same values), and to its row
    of ``starts`` when asked for."""
    slot = tl.load(chunk_slot_ptr + c).to(tl.int64)
    if slot >= 0:
        _store_state(states_ptr, slot, heads, state_size, head_base, block, ST, smask)
    if j % OUT_EVERY == 0:
        if READ_SLOTS:
            if slot < 0:
                _store_scratch(chunk_states_ptr, c, heads, state_size, head_base, block, ST,
                               smask, HALVES)
        else:
            _store_scratch(chunk_states_ptr, c, heads, state_size, head_base, block, ST, smask,
                           HALVES)
    if HAS_STARTS:
        start_slot = tl.load(start_slot_ptr + c).to(tl.int64)
        if start_slot >= 0:
            _store_state(starts_ptr, start_slot, heads, state_size, head_base, block, ST,
                         smask)


@triton.jit
def _store_scratch(ptr, c, heads, state_size, head_base, block, ST, smask, HALVES: tl.constexpr):
    """Chunk ``c``'s incoming state to the scratch: in float32 to row ``c``, or
    (``HALVES``) as the two 16-bit halves the output pass's product takes, ``hi`` to row
    ``2 c`` and ``lo`` to row ``2 c + 1`` (the same four bytes an entry)."""
    if HALVES:
        hi = ST.to(ptr.dtype.element_ty)
        _store_state(ptr, 2 * c, heads, state_size, head_base, block, hi, smask)
        _store_state(ptr, 2 * c + 1, heads, state_size, head_base, block,
                     ST - hi.to(tl.float32), smask)
    else:
        _store_state(ptr, c, heads, state_size, head_base, block, ST, smask)


@triton.jit
def _load_halves(ptr, c, heads, state_size, head_base, block, smask):
    """Chunk ``c``'s incoming state from a scratch of halves (:func:`_store_scratch`):
    ``(hi, lo)``, transposed blocks in the scratch's 16-bit dtype."""
    return (_load_state(ptr, 2 * c, heads, state_size, head_base, block, smask),
            _load_state(ptr, 2 * c + 1, heads, state_size, head_base, block, smask))


@triton.jit
def _state_pass_operands(dt_ptr, dt_tok_stride, h, x_base, x_tok_stride, b_base, B_tok_stride,
                         start, q, tm, p, n, pmask, nmask):
    """The raw dt, x and B of the chunk from token ``start`` (``tm``: its tokens inside the
    row; 0 elsewhere), in their dtypes."""
    d = tl.load(dt_ptr + start * dt_tok_stride + h + q * dt_tok_stride, mask=tm, other=0.0)
    xv = _chunk_tile(x_base + start * x_tok_stride, x_tok_stride, q, p, tm, pmask)
    bv = _chunk_tile(b_base + start * B_tok_stride, B_tok_stride, q, n, tm, nmask)
    return d, xv, bv


@triton.jit
def _ssd_state_pass_kernel(
    x_ptr,
    x_tok_stride,
    x_head_stride,
    dt_ptr,
    dt_tok_stride,
    dt_bias_ptr,
    A_ptr,
    B_ptr,
    B_tok_stride,
    B_group_stride,
    unclamped_ptr,
    cu_ptr,
    first_chunk_ptr,
    init_ptr,
    chunk_slot_ptr,
    final_slot_ptr,
    states_ptr,
    start_slot_ptr,
    starts_ptr,
    chunk_states_ptr,
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
    HAS_INIT: tl.constexpr,
    CLAMP: tl.constexpr,
    HAS_UNCLAMPED: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    READ_SLOTS: tl.constexpr,
    OUT_EVERY: tl.constexpr,
    PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT16: tl.constexpr,
    PREFETCH: tl.constexpr,
    HALVES: tl.constexpr,
):
    # Axis 0: (head, state block: head_dim block x state block), so the programs that run
    # together read one group's B through L2; axis 1: the sequence. The update is
    # separable in both axes of the state, so a program may hold any block of it.
    blocks_p = tl.cdiv(head_dim, BLOCK_P)
    blocks_n = tl.cdiv(d_state, BLOCK_N)
    h = tl.program_id(0) // (blocks_p * blocks_n)
    pb = tl.program_id(0) % (blocks_p * blocks_n) // blocks_n
    nb = tl.program_id(0) % blocks_n
    s = tl.program_id(1)
    g = h // heads_per_group
    bos = tl.load(cu_ptr + s).to(tl.int64)
    eos = tl.load(cu_ptr + s + 1).to(tl.int64)
    first = tl.load(first_chunk_ptr + s).to(tl.int64)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    q = tl.arange(0, CHUNK)
    pmask = p < head_dim
    nmask = n < d_state
    # The state block held transposed, ST [BLOCK_N, BLOCK_P] (= S^T): its update
    # B^T (x w) then has BLOCK_N rows (64 for Hopper's warp-group MMA). int32 offsets
    # inside a state off scalar int64 bases, as in the fused scan.
    smask = nmask[:, None] & pmask[None, :]
    state_size = head_dim * d_state
    head_base = h.to(tl.int64) * state_size
    a_rate = tl.load(A_ptr + h).to(tl.float32)
    bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    block = p[None, :] * d_state + n[:, None]
    ST = _initial_state(init_ptr, s, heads, state_size, head_base, block, smask,
                        HAS_INIT, BLOCK_N, BLOCK_P)
    x_base = x_ptr + h * x_head_stride
    b_base = B_ptr + g * B_group_stride
    if PREFETCH:
        # Chunk 0's operands; each iteration loads the next chunk's before it computes,
        # so their latency hides behind the product and the stores.
        dv, xv, bv = _state_pass_operands(dt_ptr, dt_tok_stride, h, x_base, x_tok_stride,
                                          b_base, B_tok_stride, bos, q, q < eos - bos, p, n,
                                          pmask, nmask)
    for j in range(0, tl.cdiv(eos - bos, CHUNK)):
        c = first + j
        _store_incoming(ST, c, j, chunk_slot_ptr, states_ptr, chunk_states_ptr, start_slot_ptr,
                        starts_ptr, heads, state_size, head_base, block, smask, HAS_STARTS,
                        READ_SLOTS, OUT_EVERY, HALVES)
        # Token offsets inside the chunk in int32 off scalar int64 bases: int64 address
        # tensors kept across the loop would take the registers the products need.
        start = bos + j * CHUNK
        tm = q < eos - start
        if PREFETCH:
            d, xc, bc = dv, xv, bv
            nxt = start + CHUNK  # past the row: every lane masked, nothing read
            dv, xv, bv = _state_pass_operands(dt_ptr, dt_tok_stride, h, x_base, x_tok_stride,
                                              b_base, B_tok_stride, nxt, q, q < eos - nxt, p,
                                              n, pmask, nmask)
        else:
            d, xc, bc = _state_pass_operands(dt_ptr, dt_tok_stride, h, x_base, x_tok_stride,
                                             b_base, B_tok_stride, start, q, tm, p, n, pmask,
                                             nmask)
        # dt in float32, discretised here; 0 past the sequence (no decay, no input).
        d = _discretize_dt(d, bias, unclamped_ptr + start + q, tm, dt_min, dt_max, CLAMP,
                           HAS_UNCLAMPED)
        if pb == 0 and nb == 0:
            tl.store(dt_out_ptr + start * heads + h + q * heads, d, mask=tm)
        a = d * a_rate
        cum = tl.cumsum(a, 0)
        total = tl.sum(a, 0)
        ST = _state_step(ST, bc, xc.to(tl.float32), cum, total, d, SPLIT, PRECISION, DOT16)
    fslot = tl.load(final_slot_ptr + s).to(tl.int64)
    if fslot >= 0:
        _store_state(states_ptr, fslot, heads, state_size, head_base, block, ST, smask)


@triton.jit
def _ssd_output_kernel(
    x_ptr,
    x_tok_stride,
    x_head_stride,
    A_ptr,
    D_ptr,
    B_ptr,
    B_tok_stride,
    B_group_stride,
    C_ptr,
    C_tok_stride,
    C_group_stride,
    cu_ptr,
    first_chunk_ptr,
    chunk_seq_ptr,
    chunk_slot_ptr,
    states_ptr,
    chunk_states_ptr,
    dt_out_ptr,
    y_ptr,
    heads,
    head_dim,
    d_state,
    heads_per_group,
    CHUNK: tl.constexpr,
    OUT_EVERY: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr,
    READ_SLOTS: tl.constexpr,
    HALVES: tl.constexpr,
    PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT16: tl.constexpr,
):
    # Axis 0: (head, head_dim block), heads fastest; axis 1: the flat chunk.
    blocks_p = tl.cdiv(head_dim, BLOCK_P)
    h = tl.program_id(0) // blocks_p
    pb = tl.program_id(0) % blocks_p
    c = tl.program_id(1).to(tl.int64)
    g = h // heads_per_group
    s = tl.load(chunk_seq_ptr + c)
    bos = tl.load(cu_ptr + s).to(tl.int64)
    eos = tl.load(cu_ptr + s + 1).to(tl.int64)
    j = c - tl.load(first_chunk_ptr + s).to(tl.int64)
    if j % OUT_EVERY != 0:
        return  # inside the output chunk of the program of chunk c - j % OUT_EVERY
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    # The output chunk: OUT_EVERY chunks from chunk c on (its row's tokens only).
    q = tl.arange(0, CHUNK * OUT_EVERY)
    pmask = p < head_dim
    nmask = n < d_state
    state_size = head_dim * d_state
    head_base = h.to(tl.int64) * state_size
    a_rate = tl.load(A_ptr + h).to(tl.float32)
    # In-chunk offsets in int32 off scalar int64 bases (registers, as in the state pass).
    start = bos + j * CHUNK
    tm = q < eos - start
    # The discretised dt of the state pass; 0 past the sequence.
    d = tl.load(dt_out_ptr + start * heads + h + q * heads, mask=tm, other=0.0)
    cum = tl.cumsum(d * a_rate, 0)
    # The incoming state: where the state pass put it (its slot, or the scratch), as the
    # two 16-bit halves its product takes (HALVES) or in float32.
    block = p[None, :] * d_state + n[:, None]
    smask = nmask[:, None] & pmask[None, :]
    xv = _chunk_tile(x_ptr + start * x_tok_stride + h * x_head_stride, x_tok_stride, q, p, tm,
                     pmask)
    if HALVES:
        if READ_SLOTS:
            slot = tl.load(chunk_slot_ptr + c).to(tl.int64)
            if slot >= 0:
                hi, lo = _halves(_load_state(states_ptr, slot, heads, state_size, head_base,
                                             block, smask), xv)
            else:
                hi, lo = _load_halves(chunk_states_ptr, c, heads, state_size, head_base, block,
                                      smask)
        else:
            hi, lo = _load_halves(chunk_states_ptr, c, heads, state_size, head_base, block,
                                  smask)
    else:
        if READ_SLOTS:
            slot = tl.load(chunk_slot_ptr + c).to(tl.int64)
            if slot >= 0:
                ST = _load_state(states_ptr, slot, heads, state_size, head_base, block, smask)
            else:
                ST = _load_state(chunk_states_ptr, c, heads, state_size, head_base, block,
                                 smask)
        else:
            ST = _load_state(chunk_states_ptr, c, heads, state_size, head_base, block, smask)
    bv = _chunk_tile(B_ptr + start * B_tok_stride + g * B_group_stride, B_tok_stride, q, n, tm,
                     nmask)
    cv = _chunk_tile(C_ptr + start * C_tok_stride + g * C_group_stride, C_tok_stride, q, n, tm,
                     nmask)
    y = _inner_outputs(cv, bv, xv, cum, d, q, SPLIT, PRECISION, DOT16)
    # From the state before the chunk, decayed to token l.
    if HALVES:
        y += tl.exp(cum)[:, None] * _dot_halves(cv, hi, lo, DOT16)
    else:
        y += tl.exp(cum)[:, None] * _dot_split(cv, ST, SPLIT, PRECISION, DOT16)
    if HAS_D:
        y += tl.load(D_ptr + h).to(tl.float32) * xv.to(tl.float32)
    tl.store(y_ptr + (start * heads + h) * head_dim + (q[:, None] * (heads * head_dim) + p[None, :]),
             y, mask=tm[:, None] & pmask[None, :])


def ssd_scan_two_pass(
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
    out_chunk: int = CHUNK,
    state_block_p: int | None = None,
    state_block_n: int | None = None,
    state_warps: int | None = None,
    prefetch: bool = True,
    halves: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan in two launches (module docstring); arguments and results as
    :func:`~hybridserve.kernels.ssd_chunked.ssd_scan_fused`, whose docstring has them.

    ``chunk_slot`` must have exactly one entry per chunk of the flat numbering
    (:func:`~hybridserve.kernels.ssd_chunked.chunk_starts`' last entry): its length sizes
    the float32 scratch of chunk states. ``block_p`` / ``num_warps``: the output pass's
    tile (head_dim block) and warps, ``out_chunk`` its chunk (:data:`CHUNK` or twice that:
    half the incoming states to store and read, a larger ``C B^T``); ``state_block_p`` x ``state_block_n`` (head_dim x
    state) / ``state_warps``: the state pass's.

    Two forms of the same arithmetic (the same values; their timings are in
    docs/gpu.md): ``prefetch`` (the default), the state pass loads each chunk's operands
    one chunk ahead, so their latency hides behind the previous chunk's product and
    stores; ``halves`` (the default for 16-bit inputs, where the products take the
    float32 state as two 16-bit halves), the scratch holds each state as those halves,
    split once by the state pass, so the output pass loads its product's operands as they
    are, with no float32 state block in its registers.
    """
    split, precision, y, dt_out = _prepare(
        x, dt, A, B, C, D, dt_bias, cu_seqlens, initial_states, chunk_slot, final_slot,
        states, unclamped, start_slot, starts, precision)
    tokens, heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    seqs = cu_seqlens.shape[0] - 1
    if seqs == 0 or tokens == 0:
        return y, dt_out
    halves = split if halves is None else halves
    if halves and not split:
        raise ValueError("halves needs the split products (x, B and C in one 16-bit dtype)")
    first_chunk, chunk_seq, chunk_states = _scratch(x, B, cu_seqlens, chunk_slot,
                                                    cu_seqlens_cpu, first_chunk, out_chunk,
                                                    halves)
    width = max(16, triton.next_power_of_2(head_dim))
    block_n = max(16, triton.next_power_of_2(d_state))
    # Defaults timed on the H200 (``prefill_kernels.json``, ``prefill_ssd_forms.json``;
    # 8B layer: head_dim 64, state 128, bf16 inputs). The state pass walks its row's
    # chunks in order, so its programs are heads x tiles x rows: with many rows, tiles of
    # 64 x 64 at 4 warps (with the operands loaded ahead: 1.57 ms a call for 8 x 4,096
    # against 1.81 at 32 x 64, the previous default, and 2.6 at 16 x 128 and 32 x 128 / 8
    # warps); with few rows, one tile of the whole state at 8 warps (64 x 128: 0.44 ms
    # for 1 x 8,192 against 0.73 at 64 x 64).
    many_rows = seqs * heads >= STATE_PASS_MANY_PROGRAMS
    state_block_p = max(16, min(state_block_p or 64, width))
    state_block_n = max(16, min(state_block_n or (64 if many_rows else 128), block_n))
    state_warps = state_warps or (4 if many_rows else 8)
    unclamped, dt_min, dt_max = _dt_limits(unclamped, time_step_limit)
    products = _products(split, precision)
    state_blocks = triton.cdiv(head_dim, state_block_p) * triton.cdiv(d_state, state_block_n)
    _ssd_state_pass_kernel[(heads * state_blocks, seqs)](
        x, x.stride(0), x.stride(1), dt, dt.stride(0), dt_bias, A,
        B, B.stride(0), B.stride(1),
        unclamped if unclamped is not None else final_slot,
        cu_seqlens, first_chunk,
        initial_states if initial_states is not None else states,
        chunk_slot, final_slot, states,
        start_slot if start_slot is not None else chunk_slot,
        starts if starts is not None else states, chunk_states, dt_out,
        heads, head_dim, d_state, heads // groups, dt_min, dt_max,
        CHUNK=CHUNK, BLOCK_P=state_block_p, BLOCK_N=state_block_n,
        HAS_INIT=initial_states is not None, CLAMP=time_step_limit is not None,
        HAS_UNCLAMPED=unclamped is not None, HAS_STARTS=starts is not None,
        READ_SLOTS=_reads_slots(states), OUT_EVERY=out_chunk // CHUNK, num_warps=state_warps,
        PREFETCH=prefetch, HALVES=halves, **products,
    )
    _output_pass(x, A, B, C, D, cu_seqlens, first_chunk, chunk_seq, chunk_slot, states,
                 chunk_states, dt_out, y, out_chunk, block_p, num_warps, products,
                 halves=halves)
    return y, dt_out


def _scratch(x, B, cu_seqlens, chunk_slot, cu_seqlens_cpu, first_chunk, out_chunk,
             halves=False):
    """What the passes of a chunked scan share, from host-known shapes (no host read when
    ``first_chunk`` is given): ``(first_chunk, chunk_seq, chunk_states)``, the first flat
    chunk of every row (computed from ``cu_seqlens_cpu`` or ``cu_seqlens`` when None), the
    row of every flat chunk, and the uninitialised scratch of chunk states: float32
    ``[chunks, H, P, N]`` (``chunks``: ``chunk_slot``'s length), or with ``halves``
    ``[2 chunks, H, P, N]`` in ``x``'s 16-bit dtype (:func:`_store_scratch`). Checks
    ``out_chunk`` and the chunk count (at most 65,535: a grid axis)."""
    chunks = chunk_slot.shape[0]
    tokens, heads, head_dim = x.shape
    if out_chunk not in (CHUNK, 2 * CHUNK):
        raise ValueError(f"out_chunk must be {CHUNK} or {2 * CHUNK}, got {out_chunk}")
    if chunks > 65535:  # the output pass's grid axis 1
        raise ValueError(f"at most 65,535 chunks of {CHUNK} tokens a call, got {chunks}")
    if first_chunk is None:
        host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()
        firsts = chunk_starts(host.tolist())
        if firsts[-1] != chunks:
            raise ValueError(f"chunk_slot must have one entry per chunk ({firsts[-1]}), "
                             f"got {chunks}")
        first_chunk = torch.tensor(firsts, dtype=torch.int64, device=x.device)
    # The sequence of every flat chunk: first_chunk[s] <= c < first_chunk[s + 1].
    chunk_seq = torch.searchsorted(
        first_chunk[1:], torch.arange(chunks, dtype=first_chunk.dtype, device=x.device),
        right=True)
    if halves:
        chunk_states = torch.empty(2 * chunks, heads, head_dim, B.shape[2], dtype=x.dtype,
                                   device=x.device)
    else:
        chunk_states = torch.empty(chunks, heads, head_dim, B.shape[2], dtype=torch.float32,
                                   device=x.device)
    return first_chunk, chunk_seq, chunk_states


def _reads_slots(states: torch.Tensor) -> bool:
    """Whether the output pass reads a chunk state stored to a slot from there: a float32
    state stored to its slot is the chunk's incoming state exactly, so the scratch row
    stays unwritten (a checkpoint every chunk then costs no state traffic beyond the
    pages')."""
    return states.dtype == torch.float32


def _products(split: bool, precision: str) -> dict:
    """The constexprs of the products (``_prepare``'s ``split`` and ``precision``); 16-bit
    dot operands only when compiled (the interpreter multiplies them wrongly)."""
    dot16 = os.environ.get("TRITON_INTERPRET", "0") != "1"
    return dict(PRECISION="tf32" if split else precision, SPLIT=split, DOT16=dot16)


def _output_pass(x, A, B, C, D, cu_seqlens, first_chunk, chunk_seq, chunk_slot, states,
                 chunk_states, dt_out, y, out_chunk, block_p, num_warps, products, *,
                 halves=False):
    """Launch the output pass (:func:`_ssd_output_kernel`) over every output chunk: it
    writes ``y`` from the incoming states (their slots or ``chunk_states``, a scratch of
    halves with ``halves``) and ``dt_out``. ``block_p`` / ``num_warps``: its tile and
    warps (None: 64 and 4)."""
    tokens, heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    chunks = chunk_slot.shape[0]
    if not chunks:
        return
    # 64 and 4 warps timed best on the H200 (``prefill_kernels.json``, 8B layer): 255
    # registers, 40 bytes spilled (32 wide: 194 and none, but C B^T twice; 5.37 ms).
    block_p = max(16, min(block_p or 64, max(16, triton.next_power_of_2(head_dim))))
    block_n = max(16, triton.next_power_of_2(d_state))
    _ssd_output_kernel[(heads * triton.cdiv(head_dim, block_p), chunks)](
        x, x.stride(0), x.stride(1), A, D if D is not None else A,
        B, B.stride(0), B.stride(1), C, C.stride(0), C.stride(1),
        cu_seqlens, first_chunk, chunk_seq, chunk_slot, states, chunk_states, dt_out, y,
        heads, head_dim, d_state, heads // groups,
        CHUNK=CHUNK, OUT_EVERY=out_chunk // CHUNK, BLOCK_P=block_p, BLOCK_N=block_n,
        HAS_D=D is not None,
        READ_SLOTS=_reads_slots(states), HALVES=halves,
        num_warps=num_warps or 4, **products,
    )
