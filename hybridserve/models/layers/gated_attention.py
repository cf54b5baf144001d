"""Gated attention of Qwen3.5 / Qwen3-Next (``self_attn``): :class:`Attention
<hybridserve.models.layers.attention.Attention>` plus an output gate and q/k norms.

``q_proj`` yields, per head, the query (first ``head_dim`` channels) and an output gate
(next ``head_dim``); q and k are RMS-normalised per head with zero-centred weights
(``q_norm``, ``k_norm``) before the (partial) RoPE; the attention output is multiplied by
``sigmoid(gate)`` before ``o_proj``. The paged cache and kernels are Attention's.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.config import KernelPolicy
from hybridserve.models.batch import ForwardBatch
from hybridserve.models.config import AttentionParams
from hybridserve.models.layers.attention import Attention
from hybridserve.models.layers.norm import ZeroCentredRMSNorm


class GatedAttention(Attention):
    """See the module docstring; names match the checkpoints (``q_norm``, ``k_norm``)."""

    def __init__(
        self, hidden_size: int, p: AttentionParams, norm_eps: float,
        policy: KernelPolicy | None = None,
    ) -> None:
        super().__init__(hidden_size, p, policy)
        self.q_proj = nn.Linear(hidden_size, 2 * p.num_heads * p.head_dim, bias=p.bias)
        self.q_norm = ZeroCentredRMSNorm(p.head_dim, norm_eps, self.policy.norms)
        self.k_norm = ZeroCentredRMSNorm(p.head_dim, norm_eps, self.policy.norms)

    def forward(
        self,
        h: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        p = self.p
        t = h.shape[0]
        q, gate = self.q_proj(h).view(t, p.num_heads, 2 * p.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(self.k_proj(h).view(t, p.num_kv_heads, p.head_dim))
        v = self.v_proj(h).view(t, p.num_kv_heads, p.head_dim)
        out = self.attend(q, k, v, batch, kv_cache).reshape(t, p.num_heads * p.head_dim)
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))
