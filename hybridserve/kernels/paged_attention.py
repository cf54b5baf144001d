"""Batched paged attention for uniform decode / verify steps (every row runs ``Q`` tokens).

The per-row reference (:func:`hybridserve.models.layers.attention.paged_attention_reference`)
loops over rows. For a step whose rows all run the same small ``Q`` the rows' cached keys
and values are gathered at once through their block tables into a padded
``[R, L, KV, D]`` view (``L`` = the longest context of the step) and every row attends in
one batched product, causally by absolute position: query token ``t`` of row ``r`` at
position ``pos`` sees the row's keys at positions ``0 .. pos``; padding and other rows'
blocks are masked out.

- :func:`paged_attention_decode_reference`: float32 (float64) scores and softmax; the
  path the attention layer takes for uniform steps on every device, and the test oracle;
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

__all__ = ["gather_paged_kv", "paged_attention_decode", "paged_attention_decode_reference"]


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
