"""Rotary position embedding (full or partial), computed from absolute positions.

The rotated channels are the first ``rotary_dim`` of each head, split in two halves
(the "rotate half" convention of the Hugging Face checkpoints); the rest pass through.
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions [T]`` -> ``(cos, sin)``, each ``[T, rotary_dim]`` in ``dtype``.

    Frequencies are built in float32 exactly as the reference implementation does, so
    the result is bit-identical to it for float32 models.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    freqs = positions.to(torch.float)[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by ``cos, sin [T, rotary_dim]``."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos[:, None, :] + rotated_half * sin[:, None, :]
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
