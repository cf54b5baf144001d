"""The chunked SSD scan of a packed prefill step in three passes: every chunk's local
state in parallel, an elementwise pass of the states along each row, then the outputs.

Same contract as :func:`~hybridserve.kernels.ssd_two_pass.ssd_scan_two_pass` and
:func:`~hybridserve.kernels.ssd_chunked.ssd_scan_fused` (arguments, results, the states
it stores and where; the latter's module docstring has the layout and the float32
arithmetic), so :func:`~hybridserve.kernels.ssd_varlen.ssd_prefill` takes it
(``KernelPolicy.packed_prefill="chunk_states"``). The twin is theirs
(:func:`ssd_scan_chunk_states_reference` is that function).

**Why three passes.** The two-pass scan's state pass runs one program per (head, state
tile, sequence) that walks the sequence's chunks in order and computes each chunk's
``B^T (x w)`` product on the way: the products are independent of the state, yet they
run one after another, on ``sequences x heads x tiles`` programs. Here they run in a
launch parallel over every chunk, and only an elementwise chain stays sequential:

1. **Local states** (:func:`_ssd_local_state_kernel`), one program per (head, state
   tile: head_dim x state, flat chunk), all independent: the chunk's state from a zero
   state, ``L_c = (x * exp(c_last - c_s) dt_s)^T B`` (``c`` the running sum of
   ``a = dt * A`` inside the chunk; the two-pass scan's product, the same split
   precision), to a float32 scratch ``[chunks, H, P, N]``, and the chunk's log decay
   ``c_last`` to ``[chunks, H]``. It discretises dt (writes ``dt_out``).
2. **State passing** (:func:`_ssd_state_passing_kernel`), one program per (head, block
   of the flattened state, sequence): from the row's initial state, per chunk
   ``S_(c+1) = exp(c_last(c)) S_c + L_c``, elementwise. It stores ``S_c``, the state
   before chunk ``c``, where the two-pass scan's state pass does (its slot, the scratch
   row the output pass reads, the start slot; the same code), and the final state to its
   slot. ``S_c`` goes over ``L_c`` in the scratch: each program owns its (sequence, head,
   block) chain and loads ``L_c`` before it stores ``S_c`` over it (a barrier between
   the two orders them across the program's threads), so no program reads what another
   writes and the scan needs one scratch, not two.
3. **Outputs**: the two-pass scan's output pass (``_ssd_output_kernel``, the same launch),
   one program per (head, head_dim block, output chunk of 64 or 128 tokens).

Compared with the two-pass scan this moves the scratch through memory twice more (the
local states written, then read back by the state passing) for products spread over
``chunks x heads x tiles`` programs instead of ``sequences x heads x tiles``.

Chunks never cross a sequence boundary (flat numbering of
:func:`~hybridserve.kernels.ssd_chunked.chunk_starts`); like the two-pass scan, a call
makes no host read of device values when ``first_chunk`` (or ``cu_seqlens_cpu``) is
given, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.kernels.ssd_chunked import (
    CHUNK,
    _discretize_dt,
    _dt_limits,
    _initial_state,
    _load_state,
    _local_state,
    _prepare,
    _store_state,
    ssd_scan_fused_reference,
)
from hybridserve.kernels.ssd_two_pass import (
    _chunk_tile,
    _output_pass,
    _products,
    _reads_slots,
    _scratch,
    _store_incoming,
)

__all__ = ["ssd_scan_chunk_states", "ssd_scan_chunk_states_reference"]

# The same states as the fused and two-pass scans: one twin for all.
ssd_scan_chunk_states_reference = ssd_scan_fused_reference


@triton.jit
def _ssd_local_state_kernel(
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
    chunk_seq_ptr,
    local_ptr,
    decay_ptr,
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
    CLAMP: tl.constexpr,
    HAS_UNCLAMPED: tl.constexpr,
    PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT16: tl.constexpr,
):
    # Axis 0: (head, state block: head_dim block x state block), so the programs that run
    # together read one group's B through L2; axis 1: the flat chunk.
    blocks_p = tl.cdiv(head_dim, BLOCK_P)
    blocks_n = tl.cdiv(d_state, BLOCK_N)
    h = tl.program_id(0) // (blocks_p * blocks_n)
    pb = tl.program_id(0) % (blocks_p * blocks_n) // blocks_n
    nb = tl.program_id(0) % blocks_n
    c = tl.program_id(1).to(tl.int64)
    g = h // heads_per_group
    s = tl.load(chunk_seq_ptr + c)
    bos = tl.load(cu_ptr + s).to(tl.int64)
    eos = tl.load(cu_ptr + s + 1).to(tl.int64)
    j = c - tl.load(first_chunk_ptr + s).to(tl.int64)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    q = tl.arange(0, CHUNK)
    pmask = p < head_dim
    nmask = n < d_state
    # The state block transposed, [BLOCK_N, BLOCK_P], as in the two-pass scan's state pass.
    smask = nmask[:, None] & pmask[None, :]
    state_size = head_dim * d_state
    head_base = h.to(tl.int64) * state_size
    a_rate = tl.load(A_ptr + h).to(tl.float32)
    bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    block = p[None, :] * d_state + n[:, None]
    # In-chunk token offsets in int32 off scalar int64 bases.
    start = bos + j * CHUNK
    tm = q < eos - start
    # dt in float32, discretised here; 0 past the sequence (no decay, no input).
    d = tl.load(dt_ptr + start * dt_tok_stride + h + q * dt_tok_stride, mask=tm, other=0.0)
    d = _discretize_dt(d, bias, unclamped_ptr + start + q, tm, dt_min, dt_max, CLAMP,
                       HAS_UNCLAMPED)
    a = d * a_rate
    cum = tl.cumsum(a, 0)
    total = tl.sum(a, 0)
    if pb == 0 and nb == 0:
        tl.store(dt_out_ptr + start * heads + h + q * heads, d, mask=tm)
        tl.store(decay_ptr + c * heads + h, total)
    xv = _chunk_tile(x_ptr + start * x_tok_stride + h * x_head_stride, x_tok_stride, q, p, tm,
                     pmask)
    bv = _chunk_tile(B_ptr + start * B_tok_stride + g * B_group_stride, B_tok_stride, q, n, tm,
                     nmask)
    LT = _local_state(bv, xv.to(tl.float32), cum, total, d, SPLIT, PRECISION, DOT16)
    _store_state(local_ptr, c, heads, state_size, head_base, block, LT, smask)


@triton.jit
def _ssd_state_passing_kernel(
    cu_ptr,
    first_chunk_ptr,
    init_ptr,
    chunk_slot_ptr,
    final_slot_ptr,
    states_ptr,
    start_slot_ptr,
    starts_ptr,
    chunk_states_ptr,
    decay_ptr,
    heads,
    head_dim,
    d_state,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    READ_SLOTS: tl.constexpr,
    OUT_EVERY: tl.constexpr,
):
    # Axis 0: (head, block of the head's state flattened: BLOCK contiguous entries of
    # head_dim x state, any split will do for an elementwise chain); axis 1: the sequence,
    # whose chain this program owns.
    state_size = head_dim * d_state
    blocks = tl.cdiv(state_size, BLOCK)
    h = tl.program_id(0) // blocks
    b = tl.program_id(0) % blocks
    s = tl.program_id(1)
    bos = tl.load(cu_ptr + s).to(tl.int64)
    eos = tl.load(cu_ptr + s + 1).to(tl.int64)
    first = tl.load(first_chunk_ptr + s).to(tl.int64)
    # Offsets inside a state as a [1, BLOCK] tile, the shape the state helpers take.
    block = b * BLOCK + tl.arange(0, BLOCK)[None, :]
    smask = block < state_size
    head_base = h.to(tl.int64) * state_size
    ST = _initial_state(init_ptr, s, heads, state_size, head_base, block, smask,
                        HAS_INIT, 1, BLOCK)
    for j in range(0, tl.cdiv(eos - bos, CHUNK)):
        c = first + j
        # Chunk c's local state, loaded before the incoming state may go over it (the
        # scratch row is this program's: module docstring). The barrier orders the load
        # before the store for every thread of the program, whichever thread the
        # compiler gives each entry in either (the chain waits for the load anyway).
        LT = _load_state(chunk_states_ptr, c, heads, state_size, head_base, block, smask)
        total = tl.load(decay_ptr + c * heads + h)
        tl.debug_barrier()
        _store_incoming(ST, c, j, chunk_slot_ptr, states_ptr, chunk_states_ptr, start_slot_ptr,
                        starts_ptr, heads, state_size, head_base, block, smask, HAS_STARTS,
                        READ_SLOTS, OUT_EVERY, False)  # float32: S_c over L_c, entry for entry
        ST = ST * tl.exp(total) + LT
    fslot = tl.load(final_slot_ptr + s).to(tl.int64)
    if fslot >= 0:
        _store_state(states_ptr, fslot, heads, state_size, head_base, block, ST, smask)


def ssd_scan_chunk_states(
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
    local_block_p: int | None = None,
    local_block_n: int | None = None,
    local_warps: int | None = None,
    pass_block: int | None = None,
    pass_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan in three launches (module docstring); arguments and results as
    :func:`~hybridserve.kernels.ssd_chunked.ssd_scan_fused`, whose docstring has them.

    ``chunk_slot`` must have exactly one entry per chunk of the flat numbering (it sizes
    the scratch), and ``block_p`` / ``num_warps`` / ``out_chunk`` are the output pass's,
    as for :func:`~hybridserve.kernels.ssd_two_pass.ssd_scan_two_pass`.
    ``local_block_p`` x ``local_block_n`` (head_dim x state) / ``local_warps``: the
    local-state kernel's tile and warps; ``pass_block`` / ``pass_warps``: the state
    passing's (entries of a head's flattened state a program holds, a power of two).
    """
    split, precision, y, dt_out = _prepare(
        x, dt, A, B, C, D, dt_bias, cu_seqlens, initial_states, chunk_slot, final_slot,
        states, unclamped, start_slot, starts, precision)
    tokens, heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    seqs = cu_seqlens.shape[0] - 1
    if seqs == 0 or tokens == 0:
        return y, dt_out
    first_chunk, chunk_seq, chunk_states = _scratch(x, B, cu_seqlens, chunk_slot,
                                                    cu_seqlens_cpu, first_chunk, out_chunk)
    chunks = chunk_slot.shape[0]
    decay = torch.empty(chunks, heads, dtype=torch.float32, device=x.device)
    width = max(16, triton.next_power_of_2(head_dim))
    block_n = max(16, triton.next_power_of_2(d_state))
    # Defaults are guesses, not yet timed (bench_prefill_kernels.py sweeps them): the
    # local states of the whole state at once (B and x of a chunk read once per head; no
    # state carried across a loop, so the registers the two-pass state pass spilled at
    # this tile are free); the state passing in small blocks (many programs for its
    # sequential chain, whose step is a load, a scaled add and a store: 1,024 entries at 4
    # warps take 40 registers a thread in an sm_90 build, 2,048 take 71).
    local_block_p = max(16, min(local_block_p or 64, width))
    local_block_n = max(16, min(local_block_n or 128, block_n))
    local_warps = local_warps or 8
    pass_block = min(pass_block or 1024, triton.next_power_of_2(head_dim * d_state))
    if pass_block < 1 or pass_block & (pass_block - 1):
        raise ValueError(f"pass_block must be a power of two, got {pass_block}")
    pass_warps = pass_warps or 4
    unclamped, dt_min, dt_max = _dt_limits(unclamped, time_step_limit)
    products = _products(split, precision)
    if chunks:
        local_blocks = (triton.cdiv(head_dim, local_block_p)
                        * triton.cdiv(d_state, local_block_n))
        _ssd_local_state_kernel[(heads * local_blocks, chunks)](
            x, x.stride(0), x.stride(1), dt, dt.stride(0), dt_bias, A,
            B, B.stride(0), B.stride(1),
            unclamped if unclamped is not None else final_slot,
            cu_seqlens, first_chunk, chunk_seq, chunk_states, decay, dt_out,
            heads, head_dim, d_state, heads // groups, dt_min, dt_max,
            CHUNK=CHUNK, BLOCK_P=local_block_p, BLOCK_N=local_block_n,
            CLAMP=time_step_limit is not None, HAS_UNCLAMPED=unclamped is not None,
            num_warps=local_warps, **products,
        )
    pass_blocks = triton.cdiv(head_dim * d_state, pass_block)
    _ssd_state_passing_kernel[(heads * pass_blocks, seqs)](
        cu_seqlens, first_chunk,
        initial_states if initial_states is not None else states,
        chunk_slot, final_slot, states,
        start_slot if start_slot is not None else chunk_slot,
        starts if starts is not None else states, chunk_states, decay,
        heads, head_dim, d_state,
        CHUNK=CHUNK, BLOCK=pass_block,
        HAS_INIT=initial_states is not None, HAS_STARTS=starts is not None,
        READ_SLOTS=_reads_slots(states), OUT_EVERY=out_chunk // CHUNK, num_warps=pass_warps,
    )
    _output_pass(x, A, B, C, D, cu_seqlens, first_chunk, chunk_seq, chunk_slot, states,
                 chunk_states, dt_out, y, out_chunk, block_p, num_warps, products)
    return y, dt_out
