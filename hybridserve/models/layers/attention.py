"""Grouped-query attention over the paged KV cache.

Per step (see :mod:`hybridserve.models.batch`): keys and values of every packed token are
written to their ``slot_mapping`` slot first, then each row attends over its first
``context_lens[i]`` cached tokens, causally: a token at absolute position ``p`` sees the
keys at positions ``0 .. p``. The per-row torch path
(:func:`hybridserve.kernels.paged_attention_prefill.paged_attention_reference`, processing
rows one at a time) is the CPU reference and the oracle.

Which path a step takes is decided once, in the step plan: ``batch.uniform_q`` (see
:mod:`hybridserve.models.step_plan`); which implementation, by the engine's
:class:`~hybridserve.config.KernelPolicy` (``decode_attention``, ``prefill_attention``).

Prefill and mixed steps (rows of any lengths): on CUDA every row attends in one Triton
launch that reads keys and values through the block tables
(:func:`hybridserve.kernels.paged_attention_prefill.paged_attention_prefill_triton`);
elsewhere through the per-row path.

Decode fast path: when every row runs the same few tokens (plain decode, uniform verify
rows), all rows attend at once: on CUDA through the Triton kernel that reads keys and
values through the block tables
(:func:`hybridserve.kernels.paged_attention.paged_attention_decode_triton`), elsewhere
through its torch twin over the gathered blocks
(:func:`hybridserve.kernels.paged_attention.paged_attention_decode_reference`); float32
scores and softmax either way.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.config import KernelPolicy, runs_triton
from hybridserve.kernels import paged_attention, paged_attention_prefill
from hybridserve.kernels.paged_attention_prefill import paged_attention_reference
from hybridserve.models.batch import ForwardBatch
from hybridserve.models.config import AttentionParams
from hybridserve.models.layers.rotary import apply_rope
from hybridserve.models.step_plan import uniform_q


class Attention(nn.Module):
    """q/k/v/o projections + optional (partial) RoPE + paged causal attention."""

    def __init__(
        self, hidden_size: int, p: AttentionParams, policy: KernelPolicy | None = None
    ) -> None:
        super().__init__()
        self.p = p
        self.policy = policy or KernelPolicy()
        self.q_proj = nn.Linear(hidden_size, p.num_heads * p.head_dim, bias=p.bias)
        self.k_proj = nn.Linear(hidden_size, p.num_kv_heads * p.head_dim, bias=p.bias)
        self.v_proj = nn.Linear(hidden_size, p.num_kv_heads * p.head_dim, bias=p.bias)
        self.o_proj = nn.Linear(p.num_heads * p.head_dim, hidden_size, bias=p.bias)
        # RoPE inverse frequencies per device, built once: a forward copies nothing from
        # the host (a captured CUDA graph cannot).
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def _rope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """:func:`~hybridserve.models.layers.rotary.rope_cos_sin` (the same float32 ops, so
        the same bits) with the inverse frequencies kept on the device."""
        rd = self.p.rotary_dim
        inv = self._inv_freq.get(positions.device)
        if inv is None:
            inv = 1.0 / (self.p.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
            inv = self._inv_freq.setdefault(positions.device, inv.to(positions.device))
        freqs = positions.to(torch.float)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _prefill_splits(self, batch: ForwardBatch) -> bool:
        """Whether this step's prefill attention may split its keys
        (``KernelPolicy.attention_splits``): "auto" in captured short-row steps only (a
        graph step sets ``max_context``), "on" in every step, "off" never."""
        mode = self.policy.attention_splits
        return mode == "on" or (mode == "auto" and bool(batch.max_context))

    def forward(
        self,
        h: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """``h [T, hidden]`` -> ``[T, hidden]``; writes the step's K/V at ``batch.slot_mapping``."""
        p = self.p
        t = h.shape[0]
        q = self.q_proj(h).view(t, p.num_heads, p.head_dim)
        k = self.k_proj(h).view(t, p.num_kv_heads, p.head_dim)
        v = self.v_proj(h).view(t, p.num_kv_heads, p.head_dim)
        out = self.attend(q, k, v, batch, kv_cache)
        return self.o_proj(out.reshape(t, p.num_heads * p.head_dim))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """RoPE on ``q [T, heads, head_dim]`` and ``k, v [T, kv_heads, head_dim]``, the K/V
        write at ``batch.slot_mapping``, and paged causal attention: ``[T, heads, head_dim]``."""
        p = self.p
        if p.rotary_dim:
            positions = batch.positions.to(q.device)
            cos, sin = self._rope_cos_sin(positions, q.dtype)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
        k_cache, v_cache = kv_cache
        slots = batch.slot_mapping.to(device=q.device, dtype=torch.int64)
        k_cache.view(-1, p.num_kv_heads, p.head_dim)[slots] = k.to(k_cache.dtype)
        v_cache.view(-1, p.num_kv_heads, p.head_dim)[slots] = v.to(v_cache.dtype)
        # The plan's decision; a layer test's unplanned batch is planned here (its rows).
        uniform = batch.uniform_q if batch.planned else uniform_q(batch.query_start)
        if uniform and runs_triton(self.policy.decode_attention, q.device):
            # Device-side positions and tables only: nothing here blocks the host, and the
            # launch depends on no host value a CUDA graph would freeze.
            out = paged_attention.paged_attention_decode_triton(
                q, k_cache, v_cache,
                batch.block_tables.to(device=q.device, non_blocking=True),
                batch.positions.to(device=q.device, non_blocking=True), p.scale,
                # None: split the keys where the shapes call for it (decode_splits).
                splits=None if self.policy.attention_splits != "off" else 1,
            )
        elif uniform:
            out = paged_attention.paged_attention_decode_reference(
                q, k_cache, v_cache, batch.block_tables, (batch.longest_context,),
                batch.positions, p.scale,
            )
        elif runs_triton(self.policy.prefill_attention, q.device):
            out = paged_attention_prefill.paged_attention_prefill_triton(
                q, k_cache, v_cache, batch.query_start, batch.num_computed,
                batch.block_tables, batch.positions, p.scale, tile_cache=batch.attention_tiles,
                # Captured short-row steps (max_context set) split the keys where the
                # shapes call for it (prefill_splits): on the H200 the cached first
                # token's attention took 0.28 against 0.97 ms over 4 layers at the 8B
                # shape. Eager steps split only under "on": with splits the 8B packed
                # path over a cached prefix took 50-77 against 38-46 ms on one machine
                # (gpu_bench_ttft_chunks_on.json, gpu_bench_ttft_splits_off.json), a
                # cost not yet explained ("on" is there to measure it).
                splits=None if self._prefill_splits(batch) else 1,
            )
        else:
            out = paged_attention_reference(
                q, k_cache, v_cache, batch.query_start, batch.context_lens,
                batch.block_tables, batch.positions, p.scale,
            )
        return out
