"""Paged attention for packed variable-length steps (prefill, mixed): Triton kernel + twin.

Contract (the step layout of :mod:`hybridserve.models.batch`): row ``i`` owns the packed
query tokens ``[query_start[i], query_start[i + 1])``, ``q_i`` of them (any number, 0
included), at absolute positions ``num_computed[i] .. num_computed[i] + q_i - 1``
(``positions`` holds them per token). The query at position ``p`` attends causally over
the row's keys ``0 .. p``, read from ``k_cache, v_cache [num_blocks, block_size, KV, D]``
through ``block_tables[i]``; the step's own keys and values are already in their slots.
Grouped-query heads: query head ``h`` reads KV head ``h // (H // KV)``. Scores and the
softmax are in float32 (float64 for float64 inputs in the twin); the output is ``[T, H,
D]`` in the queries' dtype. The only parameter is the softmax scale: the models served
here use no logit softcapping and no sliding window.

- :func:`paged_attention_reference`: the torch twin, one row at a time over the row's
  gathered keys. It is the CPU path of prefill and mixed steps and the oracle of the
  tests (of the decode kernel's too).
- :func:`paged_attention_prefill_triton`: every row of the step in one launch. The
  attention layer takes it for non-uniform steps on CUDA (the engine's
  ``KernelPolicy.prefill_attention``).

Decomposition: the host cuts every row's tokens into tiles of ``block_m // group``
tokens (:func:`prefill_tiles`, the tile -> row map), and the grid is (tile, KV head).
A program's ``block_m`` query lines are its tile's tokens times the group's query heads
(line ``m``: token ``m // group``, head ``kv * group + m % group``), so the group shares
every key and value the program loads. It walks the row's keys ``block_n`` positions at
a time, looking each position's block up in the row's table, and stops at its tile's
last position: keys no line of the tile sees are never read, so a row with a long cached
prefix costs the prefix once per tile plus the causal diagonal, nothing more. Key tiles
that every line sees entirely (below the tile's first position) run without the causal
mask; the rest are masked by position, and keys past the tile's last position (other
tokens' keys, unwritten slots, other rows' blocks) are never loaded. A program reads
only inputs and writes only its own query lines of the output (the race rule,
docs/racecheck.md).

Split keys (flash-decoding): where the (tile, KV head) programs are too few to fill the
GPU (on CUDA, fewer than half the multiprocessors: a step of one or a few short rows,
such as the engine's cached first-token step, 4 tiles x 8 KV heads on 132
multiprocessors, each walking a long cached prefix), a third grid axis cuts every
program's keys ``0 .. hi - 1`` into equal runs of whole key tiles
(:func:`prefill_splits` says how many). Each split walks its run as the unsplit program
would (the same unmasked and masked tiles, stopping at the tile's last position) and
writes its unnormalised float32 partial to its own slot of a scratch buffer; a second
launch, one program per (tile, KV head), merges the partials in split order and writes
the tile's lines of the output. A split result differs from the unsplit one by float32
summation order only; the unsplit kernel is compiled without any of the split's code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hybridserve.kernels import paged_attention
from hybridserve.kernels.paged_attention import MIN_SPLIT_KEYS
from hybridserve.kernels.transfer import upload

__all__ = [
    "PV_PRECISIONS",
    "paged_attention_prefill_triton",
    "paged_attention_reference",
    "prefill_splits",
    "prefill_tiles",
]

# How the probability-value product multiplies (see paged_attention_prefill_triton).
PV_PRECISIONS = ("half", "tf32", "ieee")

_HALF = (torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------
# Torch twin (the CPU path and the test oracle)
# --------------------------------------------------------------------------------------


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start: Sequence[int],
    context_lens: Sequence[int],
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attend ``q [T, H, D]`` over the paged cache (already holding this step's keys).

    ``k_cache, v_cache``: ``[num_blocks, block_size, KV, D]``; row ``i`` owns queries
    ``query_start[i] .. query_start[i + 1]`` (host) and attends over its first
    ``context_lens[i]`` keys (host) through ``block_tables[i]``, causally by ``positions
    [T]``. Returns ``[T, H, D]`` in ``q.dtype``; scores and softmax are computed in
    float32 (or float64 for float64 input).
    """
    num_heads = q.shape[1]
    block_size, num_kv = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv
    compute = torch.promote_types(q.dtype, torch.float32)
    flat_k = k_cache.reshape(-1, num_kv, k_cache.shape[-1])
    flat_v = v_cache.reshape(-1, num_kv, v_cache.shape[-1])
    out = torch.empty_like(q)
    offsets = torch.arange(block_size, device=q.device)
    for i in range(len(query_start) - 1):
        s, e = query_start[i], query_start[i + 1]
        if e == s:
            continue
        ctx = context_lens[i]
        n_blocks = -(-ctx // block_size)
        blocks = block_tables[i, :n_blocks].to(device=q.device, dtype=torch.int64)
        slots = (blocks[:, None] * block_size + offsets[None, :]).reshape(-1)[:ctx]
        keys = flat_k[slots].to(compute).repeat_interleave(group, dim=1)  # [ctx, H, D]
        values = flat_v[slots].to(compute).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].to(compute), keys) * scale
        key_pos = torch.arange(ctx, device=q.device)
        visible = key_pos[None, :] <= positions[s:e, None].to(q.device)  # [q, ctx]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


# --------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------


@triton.jit
def _prefill_key_tile(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    start,
    hi,
    table,
    k_ptr,
    v_ptr,
    kv_head_off,
    kv_block_stride,
    kv_slot_stride,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_16BIT: tl.constexpr,
    QK_TF32: tl.constexpr,
    PV_MODE: tl.constexpr,
    MASKED: tl.constexpr,
    SAFE: tl.constexpr,
):
    # One step of the online softmax over the keys at positions start .. start+BLOCK_N-1.
    # MASKED=False: every line sees every one of these keys (they lie below the tile's
    # first position, inside the row's context), so no bound or causal mask is needed.
    n = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    if MASKED:
        nmask = n < hi
        block = tl.load(table + n // BLOCK_SIZE, mask=nmask, other=-1)
        nmask = nmask & (block >= 0)
        kvmask = nmask[:, None] & (d[None, :] < HEAD_DIM)
    else:
        block = tl.load(table + n // BLOCK_SIZE)
        kvmask = (n[:, None] >= 0) & (d[None, :] < HEAD_DIM)
    slot = block.to(tl.int64) * kv_block_stride + (n % BLOCK_SIZE) * kv_slot_stride
    kv_off = slot[:, None] + kv_head_off + d[None, :]
    if MASKED or HEAD_DIM != BLOCK_D:
        k = tl.load(k_ptr + kv_off, mask=kvmask, other=0.0)
    else:
        # Unmasked: full-width vector loads.
        k = tl.load(k_ptr + kv_off)
    if DOT_16BIT:
        # 16-bit queries and keys into the matrix units as they are: the products of
        # 16-bit values are exact and the sums run in float32.
        s = tl.dot(q, tl.trans(k))
    elif QK_TF32:
        # 16-bit values widened to float32 fit tf32's mantissa: exact products again.
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="tf32")
    else:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    # Base-2 softmax: qk_scale carries log2(e), so exp2 gives the same probabilities.
    s = s * qk_scale
    if MASKED:
        visible = (n[None, :] <= q_pos[:, None]) & nmask[None, :]
        s = tl.where(visible, s, float("-inf"))
    # Unsplit, key 0 lies in the first key tile a program walks and every line sees it,
    # so m_new is finite from the first tile on. SAFE (a split's masked tiles): a split
    # that starts past a line's position leaves the line's maximum at -inf, taken as 0
    # there so that p and alpha are 0 rather than NaN.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if SAFE:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
    else:
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # Values masked like the keys: a masked-out probability is 0, but 0 * NaN is NaN.
    if MASKED or HEAD_DIM != BLOCK_D:
        v = tl.load(v_ptr + kv_off, mask=kvmask, other=0.0)
    else:
        v = tl.load(v_ptr + kv_off)
    if PV_MODE == 0:
        # Probabilities rounded to the values' 16-bit type, as flash attention does.
        if DOT_16BIT:
            pv = tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="tf32")
    elif PV_MODE == 1:
        pv = tl.dot(p, v.to(tl.float32), input_precision="tf32")
    else:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _paged_attention_prefill_kernel(
    q_ptr,
    q_tok_stride,
    q_head_stride,
    k_ptr,
    v_ptr,
    kv_block_stride,
    kv_slot_stride,
    kv_head_stride,
    tables_ptr,
    table_stride,
    table_width,
    pos_ptr,
    pos_stride,
    tiles_ptr,
    out_ptr,
    out_tok_stride,
    out_head_stride,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_16BIT: tl.constexpr,
    QK_TF32: tl.constexpr,
    PV_MODE: tl.constexpr,
    part_ptr,
    SPLIT: tl.constexpr,
):
    # One program per (tile, KV head, split); tile = (row, first token, end token) from
    # the host's map. Lines past the tile's tokens repeat its last token and are never
    # stored, so every line has a real position and a finite softmax.
    tile = tl.program_id(0)
    kv = tl.program_id(1)
    row = tl.load(tiles_ptr + tile * 3)
    first = tl.load(tiles_ptr + tile * 3 + 1)
    end = tl.load(tiles_ptr + tile * 3 + 2)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    live = first + m // GROUP < end
    tok = tl.minimum(first + m // GROUP, end - 1).to(tl.int64)
    head = kv * GROUP + m % GROUP
    q_off = tok[:, None] * q_tok_stride + head[:, None] * q_head_stride + d[None, :]
    q = tl.load(q_ptr + q_off, mask=dmask[None, :] & (m[:, None] >= 0), other=0.0)
    if not DOT_16BIT:
        q = q.to(tl.float32)
    q_pos = tl.load(pos_ptr + tok * pos_stride).to(tl.int32)
    # Keys 0 .. hi - 1 are the ones some line sees (never past the table); keys below
    # lo are seen by every line.
    hi = tl.minimum(tl.max(q_pos, axis=0) + 1, table_width * BLOCK_SIZE)
    lo = tl.minimum(tl.min(q_pos, axis=0) + 1, hi)
    full = (lo // BLOCK_N) * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = tables_ptr + row.to(tl.int64) * table_stride
    kv_head_off = kv.to(tl.int64) * kv_head_stride
    # Unmasked tiles [open_lo, open_hi), masked ones [causal_lo, causal_hi).
    open_lo = 0
    open_hi = full
    causal_lo = full
    causal_hi = hi
    if SPLIT:
        # Split s of S walks the s-th of S equal runs of whole key tiles of [0, hi); the
        # tile boundaries stay where the unsplit walk has them (run and full are
        # multiples of BLOCK_N), so the masked tiles' bound stays hi.
        split = tl.program_id(2)
        run = tl.cdiv(tl.cdiv(hi, BLOCK_N), tl.num_programs(2)) * BLOCK_N
        lo = split * run
        end = tl.minimum(hi, lo + run)
        open_lo = lo
        open_hi = tl.minimum(full, end)
        causal_lo = tl.maximum(full, lo)
        causal_hi = end
    for start in range(open_lo, open_hi, BLOCK_N):
        # Every line sees every key of these tiles: the maximum is finite after the
        # first, so no guard even in a split.
        acc, m_i, l_i = _prefill_key_tile(
            acc, m_i, l_i, q, q_pos, start, hi, table, k_ptr, v_ptr, kv_head_off,
            kv_block_stride, kv_slot_stride, qk_scale,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, DOT_16BIT, QK_TF32, PV_MODE, False, False,
        )
    for start in range(causal_lo, causal_hi, BLOCK_N):
        acc, m_i, l_i = _prefill_key_tile(
            acc, m_i, l_i, q, q_pos, start, hi, table, k_ptr, v_ptr, kv_head_off,
            kv_block_stride, kv_slot_stride, qk_scale,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, DOT_16BIT, QK_TF32, PV_MODE, True, SPLIT,
        )
    if SPLIT:
        # part [tiles, KV, S, BLOCK_M, BLOCK_D + 2]: acc, then m and l, of this program
        # only. A line that saw no key (an empty run: the later splits of a short tile)
        # stores m = -inf and l = 0 but not its acc, which the merge weighs as 0 and does
        # not read: the tables' capacity sets the split count, so a short row's later
        # splits are empty, and their accumulators would be most of its traffic.
        slot = ((tile * tl.num_programs(1) + kv) * tl.num_programs(2) + split).to(tl.int64)
        line = part_ptr + (slot * BLOCK_M + m) * (BLOCK_D + 2)
        seen = m_i > float("-inf")
        tl.store(line[:, None] + d[None, :], acc, mask=seen[:, None])
        tl.store(line + BLOCK_D, m_i)
        tl.store(line + BLOCK_D + 1, l_i)
    else:
        acc = acc / l_i[:, None]
        o_off = tok[:, None] * out_tok_stride + head[:, None] * out_head_stride + d[None, :]
        tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty),
                 mask=live[:, None] & dmask[None, :])


@triton.jit
def _paged_attention_prefill_combine_kernel(
    part_ptr,
    tiles_ptr,
    out_ptr,
    out_tok_stride,
    out_head_stride,
    splits,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (tile, KV head): merges the S partials its splits wrote, in split
    # order (so the result depends on nothing but the partials), and writes the tile's
    # live query lines of ``out`` (the main kernel's line -> (token, head) map). It
    # reads only ``part`` (written by the previous launch) and the tile map, and writes
    # only its own lines (the race rule). The maxima are base 2 like the main kernel's.
    # Split 0 holds key 0, which every line sees, so its maximum is finite and every
    # merged l positive.
    tile = tl.program_id(0)
    kv = tl.program_id(1)
    first = tl.load(tiles_ptr + tile * 3 + 1)
    end = tl.load(tiles_ptr + tile * 3 + 2)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_all = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_all = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    base = (tile * tl.num_programs(1) + kv).to(tl.int64) * splits
    for split in range(0, splits):
        line = part_ptr + ((base + split) * BLOCK_M + m) * (BLOCK_D + 2)
        m_s = tl.load(line + BLOCK_D)
        l_s = tl.load(line + BLOCK_D + 1)
        # A line's acc is there only where it saw a key (m finite).
        acc_s = tl.load(line[:, None] + d[None, :], mask=(m_s > float("-inf"))[:, None],
                        other=0.0)
        # Split 0 comes first, so m_new is finite from it on (no -inf - -inf), and a
        # later split's -inf (an empty run, a line that saw none of its keys) weighs 0.
        m_new = tl.maximum(m_all, m_s)
        a = tl.exp2(m_all - m_new)
        b = tl.exp2(m_s - m_new)
        l_all = l_all * a + l_s * b
        acc = acc * a[:, None] + acc_s * b[:, None]
        m_all = m_new
    acc = acc / l_all[:, None]
    live = first + m // GROUP < end
    tok = tl.minimum(first + m // GROUP, end - 1).to(tl.int64)
    head = kv * GROUP + m % GROUP
    o_off = tok[:, None] * out_tok_stride + head[:, None] * out_head_stride + d[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty),
             mask=live[:, None] & (d < HEAD_DIM)[None, :])


def prefill_tiles(
    query_start: Sequence[int], num_computed: Sequence[int], tokens_per_tile: int
) -> torch.Tensor:
    """The tile -> row map: ``[num_tiles, 3]`` int32 rows ``(row, first token, end token)``.

    Every row's packed tokens ``[query_start[i], query_start[i + 1])`` are cut into tiles
    of at most ``tokens_per_tile`` tokens; rows without tokens get none. Tiles are listed
    by the keys they walk (their last position + 1, from ``num_computed``), most first:
    the longest programs start first and short ones fill the tail of the launch. The
    order only schedules; no result depends on it.
    """
    if tokens_per_tile < 1:
        raise ValueError(f"tokens_per_tile must be positive, got {tokens_per_tile}")
    qs = torch.as_tensor(query_start, dtype=torch.int64)
    lens = qs[1:] - qs[:-1]
    counts = (lens + tokens_per_tile - 1) // tokens_per_tile
    rows = torch.repeat_interleave(torch.arange(lens.shape[0]), counts)
    index = torch.arange(rows.shape[0]) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    first = qs[rows] + index * tokens_per_tile
    end = torch.minimum(first + tokens_per_tile, qs[rows + 1])
    keys = torch.as_tensor(num_computed, dtype=torch.int64)[rows] + (end - qs[rows])
    order = torch.argsort(keys, descending=True, stable=True)
    return torch.stack([rows, first, end], dim=1)[order].to(torch.int32)


def _default_tiles(block_d: int, dot_16bit: bool, pv_half: bool) -> tuple[int, int, int, int]:
    """``(block_m, block_n, num_warps, num_stages)`` by padded head dim and operand width.

    Chosen so that ptxas reports no register spills for sm_90 (H100 / H200): 16-bit
    operands take flash-attention-like tiles; a float32 probability-value product holds
    twice the bytes per value (half the key tile); float32 operands multiply outside
    the matrix units' 16-bit path and need small tiles.
    """
    if dot_16bit and pv_half:
        if block_d <= 64:
            return 128, 64, 8, 3
        if block_d <= 128:
            return 128, 64, 8, 2
        return 64, 32, 8, 2
    if dot_16bit:
        return (128, 32, 8, 2) if block_d <= 128 else (64, 16, 8, 2)
    if block_d <= 64:
        return 32, 32, 4, 2
    return (32, 16, 8, 2) if block_d <= 128 else (16, 16, 8, 2)


def prefill_splits(programs: int, max_keys: int, device: torch.device) -> int:
    """How many programs share each (tile, KV head)'s keys in
    :func:`paged_attention_prefill_triton` when its ``splits`` is None: as many as fit
    the ``programs`` (tiles x KV heads) into one wave, one program a multiprocessor,
    each split walking at least
    :data:`~hybridserve.kernels.paged_attention.MIN_SPLIT_KEYS` of the ``max_keys``
    positions the block tables can hold; 1 (no split) where the programs fill more than
    half the multiprocessors, and off CUDA.

    One a multiprocessor, not the decode split's two: in a sweep of 2-16 splits on the
    H200 (not kept as a result file) the times stepped up as soon as a grid passed one
    such wave, as if a prefill program (128 lines of 8 warps at the 8B shape) held a
    multiprocessor alone. Kept: at the 8B shape's cached first token (one row of 128
    tokens after 8,064 cached keys, 32 programs, 4 splits) the launch took 81 against
    233 us unsplit inside a CUDA graph, at 2.25e-3 against 2.29e-3 from float64
    (``gpu_tests_e797882.txt``), and the engine's 4 attention layers 0.28-0.29 against
    0.97 ms (``gpu_bench_ttft_chunks_on.json``, ``gpu_bench_ttft_splits_off.json``).

    A function of the launch's shapes only (never of ``num_computed``), so a CUDA graph
    that replays the launch keeps its split: the engine's captured short steps pass
    tables ``max_model_len`` wide with nothing computed yet, and a replay then runs rows
    with long cached prefixes, the case the split is for. The price is paid by short
    rows without a prefix in such steps (their later splits are empty), and eager steps
    do not split (:class:`~hybridserve.models.layers.attention.Attention`)."""
    if device.type != "cuda" or programs < 1:
        return 1
    sms = paged_attention._multiprocessors(device)
    return max(1, min(sms // programs, max_keys // MIN_SPLIT_KEYS))


def paged_attention_prefill_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start: Sequence[int],
    num_computed: Sequence[int],
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pv_precision: str | None = None,
    out: torch.Tensor | None = None,
    tile_cache: dict[int, torch.Tensor] | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """:func:`paged_attention_reference` as one Triton launch over every row of the step,
    or two with its keys split.

    ``q [T, H, D]`` (packed as ``query_start`` says; the head-dim axis contiguous),
    ``k_cache, v_cache [num_blocks, block_size, KV, D]`` of one dtype and layout (the
    head-dim axis contiguous); ``query_start`` and ``num_computed`` (host, for the tile
    map), ``block_tables [B, W]`` (int32 or int64, -1 padded, a row's keys in its first
    ``W`` blocks) and ``positions [T]`` (moved to the cache's device without blocking).
    No context lengths: a query's keys end at its own position.
    Returns ``[T, H, D]`` in ``q.dtype`` (written into ``out`` when given: that shape and
    dtype, head-dim axis contiguous).

    ``tile_cache``: tile maps on the device by tokens a tile, reused when present and
    stored when computed. A step whose rows never change shape (a CUDA graph's static
    step) fills it on its warm-up run, so its capture uploads nothing (a copy captured
    from a pinned buffer would be replayed from memory the allocator hands out again).

    Tiles: ``block_m`` query lines (tokens times the group's heads; a power of two, at
    least 16 and at least the group), ``block_n`` key positions (a power of two, at least
    16), ``num_warps`` and ``num_stages`` as Triton takes them; None picks defaults by
    head dim and operand width, and shrinks ``block_m`` to the step's longest row.

    Precision. Scores and softmax are float32 always. On CUDA, 16-bit queries and cache
    of one dtype go to the matrix units as they are (exact products, float32 sums: the
    same products as the decode kernel's tf32 mode on widened operands, at twice the
    rate); otherwise the operands are widened to float32 and multiplied in tf32 when
    both are 16-bit (exact) and in full float32 when not. ``pv_precision`` chooses the
    probability-value product: ``"half"`` rounds the probabilities to the cache's 16-bit
    type and multiplies exactly (flash attention's choice; the default for 16-bit
    caches; its error is of the order of the 16-bit output's own rounding), ``"tf32"``
    rounds them to tf32, ``"ieee"`` multiplies in full float32 (the decode kernel's
    choice and the default for float32 caches; on CUDA the matrix units cannot run it,
    several times slower at prefill sizes). On the CPU interpreter bf16 operands are
    always widened (it cannot multiply bf16), with the same roundings.

    ``splits``: programs per (tile, KV head), each over an equal run of whole key tiles
    of the tile's keys, their float32 partials merged by a second launch
    (flash-decoding): a step of few short rows over long cached prefixes has too few
    (tile, KV head) programs to fill the GPU while each walks the whole prefix. None:
    :func:`prefill_splits` (a function of the shapes: the tile count, the KV heads and
    the tables' capacity); an int forces that count. A split result differs from the
    unsplit one by float32 summation order only. The split path, too, uploads and reads
    back nothing (a CUDA graph captures it): its scratch is allocated on the device.
    """
    tokens, heads, dim = q.shape
    num_blocks, block_size, num_kv, kdim = k_cache.shape
    rows = len(query_start) - 1
    if heads % num_kv or kdim != dim or query_start[-1] != tokens:
        raise ValueError(
            f"q {tuple(q.shape)} does not match a step of {query_start[-1]} tokens over "
            f"a cache of {num_kv} KV heads of {kdim}"
        )
    if (
        v_cache.shape != k_cache.shape
        or v_cache.stride() != k_cache.stride()
        or v_cache.dtype != k_cache.dtype
    ):
        raise ValueError("k_cache and v_cache must have the same shape, strides and dtype")
    if k_cache.stride(-1) != 1:
        raise ValueError("the caches' head-dim axis must be contiguous")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("out must have q's shape and dtype and a contiguous head-dim axis")
    if splits is not None and (not isinstance(splits, int) or splits < 1):
        raise ValueError(f"splits must be an int >= 1, got {splits!r}")
    if tokens == 0 or rows == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = heads // num_kv
    cache_half = k_cache.dtype in _HALF
    if pv_precision is None:
        pv_precision = "half" if cache_half else "ieee"
    if pv_precision not in PV_PRECISIONS:
        raise ValueError(f"pv_precision must be one of {PV_PRECISIONS}, got {pv_precision!r}")
    if pv_precision == "half" and not cache_half:
        raise ValueError("pv_precision 'half' needs a 16-bit cache")
    # The interpreter multiplies bf16 operands as raw integers: on the CPU only float16
    # stays 16-bit into tl.dot.
    dot_16bit = (
        cache_half
        and q.dtype == k_cache.dtype
        and (q.is_cuda or q.dtype == torch.float16)
    )
    qk_tf32 = cache_half and q.dtype in _HALF
    block_d = max(16, triton.next_power_of_2(dim))
    d_m, d_n, d_warps, d_stages = _default_tiles(block_d, dot_16bit, pv_precision == "half")
    if block_m is None:
        longest = max(query_start[i + 1] - query_start[i] for i in range(rows))
        block_m = min(d_m, max(16, triton.next_power_of_2(longest * group)))
        block_m = max(block_m, triton.next_power_of_2(group))
    if block_m < max(16, group) or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= max(16, group), got {block_m}")
    block_n = d_n if block_n is None else block_n
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    device = k_cache.device
    per_tile = block_m // group
    tiles = None if tile_cache is None else tile_cache.get(per_tile)
    if tiles is None:
        tiles = prefill_tiles(query_start, num_computed, per_tile)
        if tiles.shape[0] == 0:
            return out
        tiles = upload(tiles, device)
        if tile_cache is not None:
            tile_cache[per_tile] = tiles
    if tiles.shape[0] == 0:
        return out
    tables = block_tables.to(device=device, non_blocking=True)
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    positions = positions.to(device=device, non_blocking=True).reshape(-1)
    num_tiles = tiles.shape[0]
    if splits is None:
        splits = prefill_splits(num_tiles * num_kv, block_tables.shape[1] * block_size, device)
    part = (torch.empty((num_tiles, num_kv, splits, block_m, block_d + 2),
                        dtype=torch.float32, device=device) if splits > 1 else out)
    log2e = 1.4426950408889634
    _paged_attention_prefill_kernel[(num_tiles, num_kv, splits)](
        q,
        q.stride(0),
        q.stride(1),
        k_cache,
        v_cache,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tables,
        tables.stride(0),
        tables.shape[1],
        positions,
        positions.stride(0),
        tiles,
        out,
        out.stride(0),
        out.stride(1),
        float(scale) * log2e,
        HEAD_DIM=dim,
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_16BIT=dot_16bit,
        QK_TF32=qk_tf32,
        PV_MODE=PV_PRECISIONS.index(pv_precision),
        part_ptr=part,
        SPLIT=splits > 1,
        num_warps=d_warps if num_warps is None else num_warps,
        num_stages=d_stages if num_stages is None else num_stages,
    )
    if splits > 1:
        _paged_attention_prefill_combine_kernel[(num_tiles, num_kv)](
            part, tiles, out, out.stride(0), out.stride(1), splits,
            HEAD_DIM=dim, GROUP=group, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4,
        )
    return out
