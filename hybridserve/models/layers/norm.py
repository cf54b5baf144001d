"""RMS norms of the hybrid models (plain, and grouped + gated for the Mamba2 output).

The arithmetic is that of the torch twins in :mod:`hybridserve.kernels.norms`; where
:func:`~hybridserve.kernels.norms.triton_enabled` says so for the engine's
``KernelPolicy.norms`` (CUDA tensors under ``"auto"``, the default) the
modules run the fused Triton kernels of that module instead, which compute the same
function (see its docstring for how close). Everything else, the CPU path included,
takes the twins unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.kernels import norms


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, normalised in float32.

    ``weight_in_fp32``: multiply the weight in float32 and cast once at the end (Nemotron-H)
    instead of casting the normalised value back first (Granite, Bamba). The two agree
    in float32 and differ by rounding in bf16.

    :meth:`add_norm` folds the decoder's residual add into the same pass.
    """

    def __init__(
        self, hidden_size: int, eps: float, weight_in_fp32: bool = False, kernels: str = "auto"
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32
        self.kernels = kernels  # KernelPolicy.norms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if norms.triton_enabled(self.kernels, x, self.weight):
            return norms.rms_norm(x, self.weight, self.eps, self.weight_in_fp32)
        return norms.rms_norm_reference(x, self.weight, self.eps, self.weight_in_fp32)

    def add_norm(
        self, residual: torch.Tensor, x: torch.Tensor, multiplier: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h = residual + x * multiplier``; returns ``(h, self(h))`` (one kernel on CUDA)."""
        if residual.dtype == x.dtype and residual.shape == x.shape and norms.triton_enabled(
            self.kernels, residual, x, self.weight
        ):
            return norms.add_rms_norm(
                residual, x, self.weight, self.eps, multiplier, self.weight_in_fp32
            )
        return norms.add_rms_norm_reference(
            residual, x, self.weight, self.eps, multiplier, self.weight_in_fp32
        )


class GatedRMSNorm(nn.Module):
    """Mamba2 output norm: ``x * silu(z)``, then RMS-normalised per group of channels.

    With ``n_groups`` groups each group of ``hidden_size // n_groups`` channels is
    normalised on its own (the norm runs after the gate).
    """

    def __init__(self, hidden_size: int, n_groups: int, eps: float, kernels: str = "auto") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.n_groups = n_groups
        self.kernels = kernels  # KernelPolicy.norms

    def forward(
        self, x: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """``x, gate``: ``[T, hidden]`` (any float dtype).

        Returns ``promote(weight.dtype, x.dtype)``, or ``out_dtype`` when given (the cast
        then happens inside the kernel's single pass instead of in a separate one).
        """
        kernel_out = out_dtype in (None, torch.float32, torch.bfloat16, torch.float16)
        if kernel_out and gate.shape == x.shape and norms.triton_enabled(
            self.kernels, x, gate, self.weight
        ):
            return norms.gated_rms_norm(x, gate, self.weight, self.n_groups, self.eps, out_dtype)
        return norms.gated_rms_norm_reference(
            x, gate, self.weight, self.n_groups, self.eps, out_dtype
        )


class ZeroCentredRMSNorm(RMSNorm):
    """Qwen3.5 / Qwen3-Next RMSNorm: the stored weight is zero-centred, the scale is
    ``1 + weight``, formed and multiplied in float32 with one cast at the end (the
    reference's order), through the same kernels and twins as :class:`RMSNorm`."""

    def __init__(self, hidden_size: int, eps: float, kernels: str = "auto") -> None:
        super().__init__(hidden_size, eps, weight_in_fp32=True, kernels=kernels)
        with torch.no_grad():
            self.weight.zero_()

    def _scale(self) -> torch.Tensor:
        """``1 + weight`` in float32, recomputed when the weight changes (its version
        counter moves on every in-place write, as loading does) or moves."""
        w = self.weight
        key = (w._version, w.data_ptr(), w.device)
        cached = self.__dict__.get("_scale_cache")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = (key, 1.0 + w.detach().float())
            self.__dict__["_scale_cache"] = cached
        return cached[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self._scale()
        if norms.triton_enabled(self.kernels, x, scale):
            return norms.rms_norm(x, scale, self.eps, True)
        return norms.rms_norm_reference(x, scale, self.eps, True)

    def add_norm(
        self, residual: torch.Tensor, x: torch.Tensor, multiplier: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self._scale()
        if residual.dtype == x.dtype and residual.shape == x.shape and norms.triton_enabled(
            self.kernels, residual, x, scale
        ):
            return norms.add_rms_norm(residual, x, scale, self.eps, multiplier, True)
        return norms.add_rms_norm_reference(residual, x, scale, self.eps, multiplier, True)
