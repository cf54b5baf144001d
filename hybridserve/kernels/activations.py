"""Pointwise MLP activations in one pass over memory.

:func:`relu_square_` is Nemotron-H's ``relu2``, ``relu(x) ** 2``, in place: torch runs it
as two launches (the clamp, then the square), each reading and writing the whole
``[tokens, intermediate]`` activation, which at the 8B shape's prefill of 8 x 4,096 tokens
is 1.4 GB a pass, about 0.66 ms each on an H200, 24 times a step. One launch reads it
once and writes it once.

Numerics (the contract with the twin, :func:`relu_square_reference`): the product runs in
float32 on the exact upcast of the input and is rounded once to the input dtype, to
nearest with ties to even, as torch's square of a 16-bit tensor is; ``relu`` keeps NaN
(``x < 0`` is false for it) as torch's does. So the kernel gives the twin's bits.

One program owns one block of the flat tensor and reads only what it writes (the race
rule, docs/racecheck.md). :func:`triton_enabled` decides where the MLP layers take the
kernel (``KernelPolicy.activations``: ``"auto"``, ``"triton"`` or ``"reference"``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hybridserve.kernels.norms import _TL_DTYPES, _round

__all__ = ["relu_square_", "relu_square_reference", "triton_enabled"]

BLOCK = 4096


def triton_enabled(mode: str, x: torch.Tensor) -> bool:
    """Whether the layers should compute an activation over ``x`` with the kernel.

    ``mode``: ``"auto"`` (CUDA tensors only), ``"triton"`` (CPU tensors too, through the
    interpreter: tests force the kernel through a whole model this way) or
    ``"reference"`` (the torch twin everywhere). Besides that ``x`` must be contiguous,
    float32 / bfloat16 / float16, and need no gradient (the kernel has no backward).
    """
    if mode not in ("auto", "triton", "reference"):
        raise ValueError(
            f"activations mode must be 'auto', 'triton' or 'reference', got {mode!r}")
    if mode == "reference" or (mode == "auto" and not x.is_cuda):
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    return x.dtype in _TL_DTYPES and x.is_contiguous()


@triton.jit
def _relu_square_kernel(x_ptr, n, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    v = tl.where(v < 0, 0.0, v)
    tl.store(x_ptr + offs, _round(v * v, DTYPE), mask=mask)


def relu_square_(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2`` written over ``x`` (contiguous, float32 / bfloat16 / float16);
    returns ``x``."""
    if x.dtype not in _TL_DTYPES or not x.is_contiguous():
        raise ValueError(f"relu_square_ needs a contiguous float32 / bfloat16 / float16 "
                         f"tensor, got {x.dtype} with strides {x.stride()}")
    n = x.numel()
    if n:
        _relu_square_kernel[(triton.cdiv(n, BLOCK),)](x, n, BLOCK=BLOCK,
                                                      DTYPE=_TL_DTYPES[x.dtype], num_warps=8)
    return x


def relu_square_reference(x: torch.Tensor) -> torch.Tensor:
    """The twin: ``relu(x) ** 2`` as torch computes it (a new tensor)."""
    return torch.square(F.relu(x))
