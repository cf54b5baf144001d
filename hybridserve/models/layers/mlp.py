"""Dense MLP blocks, with module names matching each architecture's checkpoint."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.models.config import MLPParams


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The pointwise activation named in a config (``relu2`` is ``relu(x) ** 2``)."""
    if name == "silu":
        return F.silu
    if name == "gelu":
        return F.gelu
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    if name == "relu2":
        return lambda x: torch.square(F.relu(x))
    raise ValueError(f"unsupported activation {name!r}")


class FusedGatedMLP(nn.Module):
    """Granite ``shared_mlp``: ``input_linear`` holds [gate; up]; ``output_linear`` maps down."""

    def __init__(self, hidden_size: int, p: MLPParams) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden_size, 2 * p.intermediate_size, bias=p.bias)
        self.output_linear = nn.Linear(p.intermediate_size, hidden_size, bias=p.bias)
        self.act = activation_fn(p.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(self.act(gate) * up)


class GatedMLP(nn.Module):
    """Bamba ``feed_forward``: ``down_proj(act(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden_size: int, p: MLPParams) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, p.intermediate_size, bias=p.bias)
        self.up_proj = nn.Linear(hidden_size, p.intermediate_size, bias=p.bias)
        self.down_proj = nn.Linear(p.intermediate_size, hidden_size, bias=p.bias)
        self.act = activation_fn(p.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    """Nemotron-H MLP layer: ``down_proj(act(up_proj(x)))`` (relu2 by default)."""

    def __init__(self, hidden_size: int, p: MLPParams) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, p.intermediate_size, bias=p.bias)
        self.down_proj = nn.Linear(p.intermediate_size, hidden_size, bias=p.bias)
        self.act = activation_fn(p.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


def build_mlp(hidden_size: int, p: MLPParams) -> nn.Module:
    """The MLP module for ``p.kind`` (see :class:`hybridserve.models.config.MLPParams`)."""
    kinds = {"gated_fused": FusedGatedMLP, "gated": GatedMLP, "plain": PlainMLP}
    return kinds[p.kind](hidden_size, p)
