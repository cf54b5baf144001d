"""Batched paged attention for uniform decode / verify steps (every row runs ``Q`` tokens).

The per-row reference
(:func:`hybridserve.kernels.paged_attention_prefill.paged_attention_reference`) loops over
rows. For a step whose rows all run the same small ``Q`` the rows' cached keys
and values are gathered at once through their block tables into a padded
``[R, L, KV, D]`` view (``L`` = the longest context of the step) and every row attends in
one batched product, causally by absolute position: query token ``t`` of row ``r`` at
position ``pos`` sees the row's keys at positions ``0 .. pos``; padding and other rows'
blocks are masked out.

- :func:`paged_attention_decode_triton`: one Triton launch, one program per (row, KV
  head), reading keys and values straight through the block tables with an online
  softmax in float32; where those programs are too few to fill the GPU
  (:func:`decode_splits`: small batches), each row's keys are split across several
  programs whose float32 partials a second launch merges. The attention layer takes it
  for uniform steps on CUDA (and so inside the decode graphs), as the engine's
  ``KernelPolicy.decode_attention`` says;
- :func:`paged_attention_decode_reference`: its torch twin, float32 (float64) scores and
  softmax over the gathered, padded keys; the path uniform steps take on the CPU, and
  the test oracle;
- :func:`paged_attention_decode`: the same function through
  ``torch.nn.functional.scaled_dot_product_attention`` in the cache dtype. Not used by
  the layer: on the H200 the decode step with it cost about 60 ms at every batch size
  (against 42 ms for the per-row path at batch 1), with 0.5 s spikes every few steps at
  batch 16. The suspected cause, not yet confirmed, is backend planning for each new key
  length; docs/gpu.md records the measurement. Kept, tested, for that comparison.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = [
    "decode_splits",
    "gather_paged_kv",
    "paged_attention_decode",
    "paged_attention_decode_reference",
    "paged_attention_decode_triton",
]

def gather_paged_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: Sequence[int],
    last_pos: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys and values of every row, padded to the longest context.

    ``last_pos [R]`` (on the cache's device) is each row's last query position, so its
    context is ``last_pos + 1`` tokens; ``context_lens`` (host) only sizes the padding,
    so building the mask needs no host-to-device copy (which would stall the host until
    the device caught up).

    Returns ``(keys [R, L, KV, D], values [R, L, KV, D], key_pos [L])``; entries past a
    row's context are zeros (never cache contents: an unwritten slot may hold NaN, and a
    masked NaN value still poisons the probability-weighted sum).
    """
    block_size = k_cache.shape[1]
    longest = max(context_lens)
    n_blocks = -(-longest // block_size)
    tables = block_tables[:, :n_blocks].to(device=k_cache.device, dtype=torch.int64)
    # -1 pads point at block 0: read, then zeroed.
    tables = tables.clamp(min=0)
    offsets = torch.arange(block_size, device=k_cache.device)
    slots = (tables[:, :, None] * block_size + offsets).reshape(tables.shape[0], -1)[:, :longest]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    key_pos = torch.arange(longest, device=k_cache.device)
    valid = (key_pos[None, :] <= last_pos[:, None])[:, :, None, None]
    zero = k_cache.new_zeros(())
    keys = torch.where(valid, flat_k[slots], zero)
    values = torch.where(valid, flat_v[slots], zero)
    return keys, values, key_pos


def _row_positions(positions: torch.Tensor, device: torch.device, rows: int) -> torch.Tensor:
    return positions.to(device=device).view(rows, -1)


def _visible(pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """``[R, Q, L]`` bool: key ``l`` is visible to query ``t`` of row ``r`` (``pos [R, Q]``)."""
    return key_pos[None, None, :] <= pos[:, :, None]


def paged_attention_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: Sequence[int],
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attend ``q [R * Q, H, D]`` (rows of ``Q`` tokens) over the paged cache.

    ``block_tables [R, max_blocks]`` (-1 padded), ``context_lens`` per row, ``positions
    [R * Q]`` absolute positions of the queries. Returns ``[R * Q, H, D]`` in ``q.dtype``.
    """
    rows = block_tables.shape[0]
    tokens, heads, dim = q.shape
    qlen = tokens // rows
    num_kv = k_cache.shape[2]
    compute = torch.promote_types(q.dtype, torch.float32)
    pos = _row_positions(positions, k_cache.device, rows)
    keys, values, key_pos = gather_paged_kv(k_cache, v_cache, block_tables, context_lens, pos[:, -1])
    group = heads // num_kv
    # Grouped-query heads by reshaping the queries (head h uses KV head h // group), so the
    # keys and values are never repeated per query head.
    qr = q.to(compute).view(rows, qlen, num_kv, group, dim)
    scores = torch.einsum("rqkgd,rlkd->rkgql", qr, keys.to(compute)) * scale
    visible = _visible(pos, key_pos)  # [R, Q, L]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("rkgql,rlkd->rqkgd", probs, values.to(compute))
    return out.reshape(tokens, heads, dim).to(q.dtype)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: Sequence[int],
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`paged_attention_decode_reference` through fused SDPA (same arguments)."""
    rows = block_tables.shape[0]
    tokens, heads, dim = q.shape
    qlen = tokens // rows
    num_kv = k_cache.shape[2]
    pos = _row_positions(positions, k_cache.device, rows)
    keys, values, key_pos = gather_paged_kv(k_cache, v_cache, block_tables, context_lens, pos[:, -1])
    visible = _visible(pos, key_pos)  # [R, Q, L]
    out = F.scaled_dot_product_attention(
        q.view(rows, qlen, heads, dim).transpose(1, 2),  # [R, H, Q, D]
        keys.to(q.dtype).transpose(1, 2),  # [R, KV, L, D]
        values.to(q.dtype).transpose(1, 2),
        attn_mask=visible[:, None],
        scale=scale,
        enable_gqa=heads != num_kv,
    )
    return out.transpose(1, 2).reshape(tokens, heads, dim)


# --------------------------------------------------------------------------------------
# Triton kernel: reads keys and values through the block tables (no gathered copy)
# --------------------------------------------------------------------------------------


@triton.jit
def _paged_attention_decode_kernel(
    q_ptr,
    q_tok_stride,
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
    out_ptr,
    out_tok_stride,
    scale,
    head_dim,
    Q: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EXACT_TF32: tl.constexpr,
    part_ptr,
    SPLIT: tl.constexpr,
):
    # One program per (row, KV head, split). Its BLOCK_M query lines are the GROUP query heads
    # sharing that KV head times the row's Q tokens (line m: token m // GROUP, head
    # kv * GROUP + m % GROUP; lines past GROUP * Q repeat the last token and are never
    # stored). It walks the row's keys BLOCK_N positions at a time, looking each
    # position's block up in the row's table, with an online softmax in float32. It
    # reads only inputs and writes only its own query lines of ``out`` (the race rule).
    # With SPLIT, split s of S walks only the s-th of S equal runs of the row's keys
    # (whole tiles) and writes its unnormalised partial (m, l, acc) to its own slot of
    # ``part``; _paged_attention_combine_kernel, a launch of its own, merges them.
    r = tl.program_id(0)
    kv = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    t = tl.minimum(m // GROUP, Q - 1)
    head = kv * GROUP + m % GROUP
    live = m < GROUP * Q
    tok = r * Q + t
    q_off = tok.to(tl.int64)[:, None] * q_tok_stride + head[:, None] * head_dim + d[None, :]
    qmask = dmask[None, :] & (m[:, None] >= 0)
    q = tl.load(q_ptr + q_off, mask=qmask, other=0.0).to(tl.float32)
    # Absolute position of each line's token; the row's keys are positions 0 .. ctx - 1.
    q_pos = tl.load(pos_ptr + tok * pos_stride).to(tl.int32)
    ctx = tl.load(pos_ptr + (r * Q + (Q - 1)) * pos_stride).to(tl.int32) + 1
    ctx = tl.minimum(ctx, table_width * BLOCK_SIZE)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    n0 = tl.arange(0, BLOCK_N)
    table = tables_ptr + r.to(tl.int64) * table_stride
    lo = 0
    hi = ctx
    if SPLIT:
        split = tl.program_id(2)
        run = tl.cdiv(tl.cdiv(ctx, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        lo = split * run
        hi = tl.minimum(ctx, lo + run)
    for start in range(lo, hi, BLOCK_N):
        n = start + n0
        nmask = n < ctx
        block = tl.load(table + n // BLOCK_SIZE, mask=nmask, other=0)
        nmask = nmask & (block >= 0)
        slot = block.to(tl.int64) * kv_block_stride + (n % BLOCK_SIZE) * kv_slot_stride
        kv_off = slot[:, None] + kv * kv_head_stride + d[None, :]
        kvmask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kvmask, other=0.0)
        if EXACT_TF32:
            # 16-bit queries and keys fit tf32's 10-bit mantissa: the matrix units'
            # float32 mode then multiplies exactly and sums in float32.
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="tf32")
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        s = s * scale
        visible = (n[None, :] <= q_pos[:, None]) & nmask[None, :]
        s = tl.where(visible, s, float("-inf"))
        # Unsplit, key 0 lies in the first tile and every line sees it, so m_new is
        # finite. A later split's tile may hold no key a line sees (a verify row's
        # earlier tokens): the line's maximum stays -inf, and it is taken as 0 there so
        # that p and alpha are 0 rather than NaN.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, mask=kvmask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    if SPLIT:
        # part [R, KV, S, BLOCK_M, BLOCK_D + 2]: acc, then m and l, of this program only.
        slot = ((r * tl.num_programs(1) + kv) * tl.num_programs(2) + split).to(tl.int64)
        line = part_ptr + (slot * BLOCK_M + m) * (BLOCK_D + 2)
        tl.store(line[:, None] + d[None, :], acc)
        tl.store(line + BLOCK_D, m_i)
        tl.store(line + BLOCK_D + 1, l_i)
    else:
        acc = acc / l_i[:, None]
        o_off = tok.to(tl.int64)[:, None] * out_tok_stride + head[:, None] * head_dim + d[None, :]
        tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty),
                 mask=live[:, None] & dmask[None, :])


@triton.jit
def _paged_attention_combine_kernel(
    part_ptr,
    out_ptr,
    out_tok_stride,
    head_dim,
    splits,
    Q: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (row, KV head): merges the S partials its splits wrote (in split
    # order, so the result depends on nothing but the partials) and writes its query
    # lines of ``out``. It reads only ``part`` (written by the previous launch) and
    # writes only its own lines (the race rule). Split 0 holds key 0, which every line
    # sees, so the merged maximum is finite.
    r = tl.program_id(0)
    kv = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_all = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_all = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    base = (r * tl.num_programs(1) + kv).to(tl.int64) * splits
    for split in range(0, splits):
        line = part_ptr + ((base + split) * BLOCK_M + m) * (BLOCK_D + 2)
        m_s = tl.load(line + BLOCK_D)
        l_s = tl.load(line + BLOCK_D + 1)
        acc_s = tl.load(line[:, None] + d[None, :])
        m_new = tl.maximum(m_all, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m_all - m_safe)
        b = tl.exp(m_s - m_safe)
        l_all = l_all * a + l_s * b
        acc = acc * a[:, None] + acc_s * b[:, None]
        m_all = m_new
    acc = acc / l_all[:, None]
    t = tl.minimum(m // GROUP, Q - 1)
    head = kv * GROUP + m % GROUP
    live = m < GROUP * Q
    tok = r * Q + t
    o_off = tok.to(tl.int64)[:, None] * out_tok_stride + head[:, None] * head_dim + d[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty),
             mask=live[:, None] & (d < head_dim)[None, :])


# A split walks at least this many key positions: below it the partials' extra traffic
# and the second launch cost more than the programs they add gain.
MIN_SPLIT_KEYS = 512


def decode_splits(rows: int, num_kv: int, max_keys: int, device: torch.device) -> int:
    """How many programs share each (row, KV head)'s keys in
    :func:`paged_attention_decode_triton` when its ``splits`` is None: enough for about
    two programs a multiprocessor, each walking at least :data:`MIN_SPLIT_KEYS` of the
    ``max_keys`` positions the block tables can hold, where the (row, KV head) programs
    fill less than half the multiprocessors; two where they fill half or more but not
    all; 1 (no split) where they fill them all, and off CUDA. A function of the launch's
    shapes only, so a replayed graph keeps its split.

    On the H200 (132 multiprocessors, 8B decode, 8 KV heads, ``gpu_bench.json``):
    splitting 64 programs (8 rows) took 0.19 ms against 0.49 ms unsplit at 8,192 keys;
    128 programs (16 rows) split in two took 319 against 486 us at 8,192 keys and 1,237
    against 1,886 us at 32,768, and over the decode's 535 keys 35-66 against 42-43 us
    (noisy both ways, and 56-94 against 49-62 us in an earlier run): the long contexts an
    agent's rows reach are where a step's attention costs, so 16 rows split. 256 programs
    (32 rows) gained 6-8% from a split, within the runs' spread: not split."""
    if device.type != "cuda":
        return 1
    sms = _multiprocessors(device)
    base = rows * num_kv
    if base > sms:
        return 1
    if 2 * base > sms:
        return max(1, min(2, max_keys // MIN_SPLIT_KEYS))
    return max(1, min(-(-2 * sms // base), max_keys // MIN_SPLIT_KEYS))


_SMS: dict = {}


def _multiprocessors(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def paged_attention_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """:func:`paged_attention_decode_reference` as one Triton launch (no gathered copy),
    or two with its keys split.

    ``q [R * Q, H, D]`` (rows of ``Q`` tokens, token-major), ``k_cache, v_cache
    [num_blocks, block_size, KV, D]`` (the head-dim axis contiguous), ``block_tables [R,
    W]`` int32 or int64 (-1 padded; a row's keys must lie in its first ``W`` blocks),
    ``positions [R * Q]`` on the cache's device (any stride: a replayed graph passes a
    column slice of its static buffer). A row's context is its last position
    plus one; nothing on the host sizes the launch beyond the tensors' shapes, so a
    CUDA graph can replay it. Returns ``[R * Q, H, D]`` in ``q.dtype`` (written into
    ``out`` when given: contiguous, that shape and dtype). ``block_n``: key positions per
    tile (a power of two, at least 16).

    ``splits``: programs per (row, KV head), each over an equal run of the row's keys,
    merged by a second launch (flash-decoding): at small batches the unsplit launch has
    ``rows x KV heads`` programs, too few to fill the GPU while each walks a long
    context. None: :func:`decode_splits`. A split result differs from the unsplit one
    by float32 summation order only (the partials are float32).
    """
    rows = block_tables.shape[0]
    tokens, heads, dim = q.shape
    num_blocks, block_size, num_kv, kdim = k_cache.shape
    if rows == 0 or tokens % rows or heads % num_kv or kdim != dim:
        raise ValueError(
            f"q {tuple(q.shape)} does not make rows of a {rows}-row table over a cache of "
            f"{num_kv} KV heads of {kdim}"
        )
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.stride(-1) != 1:
        raise ValueError("the caches' head-dim axis must be contiguous")
    if q.stride(-1) != 1 or q.stride(1) != dim:
        q = q.contiguous()
    qlen = tokens // rows
    group = heads // num_kv
    positions = positions.reshape(-1)
    if positions.shape[0] != tokens:
        raise ValueError(f"{positions.shape[0]} positions for {tokens} query tokens")
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError("out must be a contiguous tensor of q's shape and dtype")
    block_m = max(16, triton.next_power_of_2(group * qlen))
    block_d = max(16, triton.next_power_of_2(dim))
    if block_n is None:
        block_n = 64 if block_m <= 32 else 32
    half = (torch.bfloat16, torch.float16)
    exact_tf32 = q.dtype in half and k_cache.dtype in half
    if splits is None:
        splits = decode_splits(rows, num_kv, block_tables.shape[1] * block_size, q.device)
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits must be an int >= 1, got {splits!r}")
    part = (torch.empty((rows, num_kv, splits, block_m, block_d + 2), dtype=torch.float32,
                        device=q.device) if splits > 1 else out)
    _paged_attention_decode_kernel[(rows, num_kv, splits)](
        q,
        q.stride(0),
        k_cache,
        v_cache,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables,
        block_tables.stride(0),
        block_tables.shape[1],
        positions,
        positions.stride(0),
        out,
        out.stride(0),
        float(scale),
        dim,
        Q=qlen,
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        EXACT_TF32=exact_tf32,
        part_ptr=part,
        SPLIT=splits > 1,
        num_warps=4,
    )
    if splits > 1:
        _paged_attention_combine_kernel[(rows, num_kv)](
            part, out, out.stride(0), dim, splits,
            Q=qlen, GROUP=group, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4,
        )
    return out
