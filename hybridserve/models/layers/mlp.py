"""Dense MLP blocks, with module names matching each architecture's checkpoint."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.kernels import activations
from hybridserve.models.config import MLPParams


def activation_fn(name: str, kernels: str = "reference") -> Callable[[torch.Tensor], torch.Tensor]:
    """The pointwise activation named in a config (``relu2`` is ``relu(x) ** 2``).

    ``kernels`` (``KernelPolicy.activations``): where
    :func:`hybridserve.kernels.activations.triton_enabled` says so, ``relu2`` runs as one
    Triton pass *over its input* (the same bits as the torch twin), so a layer passes it
    only a tensor nothing else reads (a projection's fresh output)."""
    if name == "silu":
        return F.silu
    if name == "gelu":
        return F.gelu
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    if name == "relu2":
        if kernels == "reference":
            return activations.relu_square_reference
        return functools.partial(_relu2, kernels)
    raise ValueError(f"unsupported activation {name!r}")


def _relu2(kernels: str, x: torch.Tensor) -> torch.Tensor:
    if activations.triton_enabled(kernels, x):
        return activations.relu_square_(x)
    return activations.relu_square_reference(x)


class FusedGatedMLP(nn.Module):
    """Granite ``shared_mlp``: ``input_linear`` holds [gate; up]; ``output_linear`` maps down."""

    def __init__(self, hidden_size: int, p: MLPParams, kernels: str = "reference") -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden_size, 2 * p.intermediate_size, bias=p.bias)
        self.output_linear = nn.Linear(p.intermediate_size, hidden_size, bias=p.bias)
        self.act = activation_fn(p.activation, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(self.act(gate) * up)


class GatedMLP(nn.Module):
    """Bamba ``feed_forward``: ``down_proj(act(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden_size: int, p: MLPParams, kernels: str = "reference") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, p.intermediate_size, bias=p.bias)
        self.up_proj = nn.Linear(hidden_size, p.intermediate_size, bias=p.bias)
        self.down_proj = nn.Linear(p.intermediate_size, hidden_size, bias=p.bias)
        self.act = activation_fn(p.activation, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    """Nemotron-H MLP layer: ``down_proj(act(up_proj(x)))`` (relu2 by default)."""

    def __init__(self, hidden_size: int, p: MLPParams, kernels: str = "reference") -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, p.intermediate_size, bias=p.bias)
        self.down_proj = nn.Linear(p.intermediate_size, hidden_size, bias=p.bias)
        self.act = activation_fn(p.activation, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


def build_mlp(hidden_size: int, p: MLPParams, kernels: str = "reference") -> nn.Module:
    """The MLP module for ``p.kind`` (see :class:`hybridserve.models.config.MLPParams`);
    ``kernels``: ``KernelPolicy.activations``."""
    kinds = {"gated_fused": FusedGatedMLP, "gated": GatedMLP, "plain": PlainMLP}
    return kinds[p.kind](hidden_size, p, kernels)
