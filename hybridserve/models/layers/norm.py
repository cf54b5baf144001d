"""RMS norms of the hybrid models (plain, and grouped + gated for the Mamba2 output)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, normalised in float32.

    ``weight_in_fp32``: multiply the weight in float32 and cast once at the end (Nemotron-H)
    instead of casting the normalised value back first (Granite, Bamba). The two agree
    in float32 and differ by rounding in bf16.
    """

    def __init__(self, hidden_size: int, eps: float, weight_in_fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_fp32:
            return (self.weight.float() * h).to(dtype)
        return self.weight * h.to(dtype)


class GatedRMSNorm(nn.Module):
    """Mamba2 output norm: ``x * silu(z)``, then RMS-normalised per group of channels.

    With ``n_groups`` groups each group of ``hidden_size // n_groups`` channels is
    normalised on its own (the norm runs after the gate).
    """

    def __init__(self, hidden_size: int, n_groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.n_groups = n_groups

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``x, gate``: ``[T, hidden]`` (any float dtype); returns ``x.dtype``."""
        dtype = x.dtype
        h = x.float() * F.silu(gate.float())
        g = h.view(*h.shape[:-1], self.n_groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view_as(h).to(dtype)
