"""Fused RMS norms: residual add + RMSNorm, and the Mamba2 gated grouped RMSNorm.

Each op is one Triton launch with a torch twin (``*_reference``) that computes the same
function; the twins are the arithmetic of :mod:`hybridserve.models.layers.norm` (the CPU
path and the test oracle), the kernels run on CUDA (and under the CPU interpreter in
tests).

- :func:`add_rms_norm`: ``h = residual + x * multiplier`` (the decoder's residual add),
  then ``rms_norm(h)``; returns both. One program per token row reads the row of
  ``residual`` and ``x`` once and writes the new residual and its normalised value.
- :func:`rms_norm`: the same without the add.
- :func:`gated_rms_norm`: ``x * silu(gate)``, RMS-normalised per group of channels, times
  the weight, cast to the output dtype. One program per (token row, group).

Numerics (the contract with the twins):

- The residual add is bit-identical to the twin: ``x * multiplier`` is rounded to the
  stream dtype before the add, as torch does, and no multiply-add is contracted into a
  fused multiply-add (launches pass ``enable_fp_fusion=False``).
- Normalisation runs in float32: mean of squares, ``rsqrt(mean + eps)``, then the
  weight. ``weight_in_fp32`` picks the order of the last two roundings exactly as the
  twin does: the weight multiplied in float32 and one cast at the end (Nemotron-H), or
  the normalised value cast to the input dtype first and then multiplied by the weight
  (Granite, Bamba). The differences from the twin are all in float32 before those
  roundings: the order of the sum of squares (a tree here), the mean as the sum times
  ``1 / n`` (as torch's CUDA reduction forms it; its CPU one divides) and, in the gated
  norm, the ``exp`` inside silu. Outputs therefore agree within one rounding of the
  output dtype, and in bf16 / fp16 are nearly always bit-identical.
- Output dtypes follow torch's promotion in the twins: ``rms_norm`` returns the input
  dtype when ``weight_in_fp32`` and ``promote(weight, input)`` otherwise;
  ``gated_rms_norm`` rounds ``weight * normalised`` to ``promote(weight, x)`` and then
  casts to ``out_dtype`` (default: that promoted dtype).

Programs touch only their own row (or row group) of every output, so no program reads
what another writes (the race rule, docs/racecheck.md).

:func:`triton_enabled` decides where the model layers take the kernels, given the
engine's choice (``KernelPolicy.norms``: ``"auto"``, ``"triton"`` or ``"reference"``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = [
    "MAX_ROW",
    "add_rms_norm",
    "add_rms_norm_reference",
    "gated_rms_norm",
    "gated_rms_norm_reference",
    "rms_norm",
    "rms_norm_reference",
    "triton_enabled",
]

# A program holds one whole row (or group) in registers; wider rows take the twin.
MAX_ROW = 65536

_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
}


def triton_enabled(mode: str, *tensors: torch.Tensor) -> bool:
    """Whether the layers should compute a norm over ``tensors`` with the Triton kernels.

    ``mode``: ``"auto"`` (CUDA tensors only), ``"triton"`` (CPU tensors too, through the
    interpreter: tests force the fused path through a whole model this way) or
    ``"reference"`` (the torch twins everywhere: for comparisons in benchmarks). Besides
    that, every tensor must be float32 / bfloat16 / float16 (float64 models take the
    twin), at most :data:`MAX_ROW` wide with a unit stride on its last axis, and none may
    need a gradient (the kernels have no backward).
    """
    if mode not in ("auto", "triton", "reference"):
        raise ValueError(f"norms mode must be 'auto', 'triton' or 'reference', got {mode!r}")
    if mode == "reference":
        return False
    if mode == "auto" and not all(t.is_cuda for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return all(
        t.dtype in _TL_DTYPES and t.dim() >= 1 and t.shape[-1] <= MAX_ROW and t.stride(-1) == 1
        for t in tensors
    )


# --------------------------------------------------------------------------------------
# Torch twins (the CPU path and the test oracle)
# --------------------------------------------------------------------------------------


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = False
) -> torch.Tensor:
    """``weight * x / rms(x)`` normalised in float32 (see :class:`~hybridserve.models.layers.norm.RMSNorm`)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_fp32:
        return (weight.float() * h).to(dtype)
    return weight * h.to(dtype)


def add_rms_norm_reference(
    residual: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    multiplier: float = 1.0,
    weight_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`add_rms_norm`: ``(h, rms_norm(h))`` with ``h = residual + x * multiplier``."""
    h = residual + x * multiplier
    return h, rms_norm_reference(h, weight, eps, weight_in_fp32)


def gated_rms_norm_reference(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    n_groups: int,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Torch twin of :func:`gated_rms_norm` (see :class:`~hybridserve.models.layers.norm.GatedRMSNorm`)."""
    dtype = x.dtype
    h = x.float() * F.silu(gate.float())
    g = h.view(*h.shape[:-1], n_groups, -1)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * g.view_as(h).to(dtype)
    return y if out_dtype is None else y.to(out_dtype)


# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _round(x, dtype: tl.constexpr):
    # float32 x rounded to dtype to nearest, ties to even, as torch and the GPU round.
    # bfloat16 is rounded on the bits and then cast exactly, because the CPU
    # interpreter's own float32 -> bfloat16 cast truncates and the tests compare bits
    # through it; on the GPU both ways give the same value.
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        r = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
        return r.to(tl.bfloat16)
    else:
        return x.to(dtype)


@triton.jit
def _rms_norm_kernel(
    res_ptr,
    res_stride,
    x_ptr,
    x_stride,
    w_ptr,
    res_out_ptr,
    res_out_stride,
    out_ptr,
    out_stride,
    n,
    inv_n,
    eps,
    multiplier,
    IN_TY: tl.constexpr,
    OUT_TY: tl.constexpr,
    HAS_ADD: tl.constexpr,
    SCALE_X: tl.constexpr,
    WEIGHT_IN_FP32: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per token row: it reads its row of x (and the residual) and writes its
    # row of the outputs, nothing else.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    h = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_ADD:
        if SCALE_X:
            # torch rounds x * multiplier to the stream dtype before adding it.
            h = _round(h * multiplier, IN_TY).to(tl.float32)
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        s = _round(r + h, IN_TY)
        tl.store(res_out_ptr + row * res_out_stride + cols, s, mask=mask)
        h = s.to(tl.float32)
    # Mean as torch's CUDA reduction forms it: the sum times 1 / n.
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=0) * inv_n + eps)
    y = h * rstd
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_IN_FP32:
        y = w * y
    else:
        y = w * _round(y, IN_TY).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, _round(y, OUT_TY), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,
    x_stride,
    z_ptr,
    z_stride,
    w_ptr,
    out_ptr,
    out_stride,
    group_size,
    inv_group_size,
    eps,
    IN_TY: tl.constexpr,
    PRODUCT_TY: tl.constexpr,
    OUT_TY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per (token row, group): it owns group_size channels of its row.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < group_size
    cols = tl.program_id(1) * group_size + offs
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * z_stride + cols, mask=mask, other=0.0).to(tl.float32)
    # silu as torch forms it, z / (1 + exp(-z)), with a correctly rounded division.
    h = x * tl.math.div_rn(z, 1.0 + tl.exp(-z))
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=0) * inv_group_size + eps)
    y = _round(h * rstd, IN_TY).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # Round to the dtype torch's product has, then to the requested output dtype.
    y = _round(w * y, PRODUCT_TY).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, _round(y, OUT_TY), mask=mask)


def _num_warps(block: int) -> int:
    return min(16, max(1, block // 256))


def _as_rows(t: torch.Tensor, n: int, name: str) -> torch.Tensor:
    """``t`` as ``[rows, n]`` (a view where possible) with a unit stride along a row."""
    if t.shape[-1] != n:
        raise ValueError(f"{name} must end in a dimension of {n}, got {tuple(t.shape)}")
    t2 = t.reshape(-1, n)
    if t2.stride(1) != 1 and n > 1:
        raise ValueError(f"{name}'s last axis must be contiguous")
    return t2


def _output(
    given: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(result, [rows, n] view written by the kernel)`` for an output argument."""
    n = like.shape[-1]
    if given is None:
        out = torch.empty(like.shape, dtype=dtype, device=like.device)
        return out, out.view(-1, n)
    if given.dtype != dtype or given.shape[-1] != n or given.numel() != like.numel():
        raise ValueError(
            f"{name} must be {dtype} with {like.numel()} elements in rows of {n}, got "
            f"{given.dtype} {tuple(given.shape)}"
        )
    rows = given if given.dim() == 2 else given.view(-1, n)
    if rows.stride(1) != 1 and n > 1:
        raise ValueError(f"{name}'s last axis must be contiguous")
    return given, rows


def _check_kernel_dtypes(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype not in _TL_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def _launch_rms_norm(
    residual: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    multiplier: float,
    weight_in_fp32: bool,
    residual_out: torch.Tensor | None,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    n = x.shape[-1]
    _check_kernel_dtypes(x=x, weight=weight)
    if weight.shape != (n,):
        raise ValueError(f"weight must be [{n}], got {tuple(weight.shape)}")
    if n > MAX_ROW:
        raise ValueError(f"rows of {n} exceed MAX_ROW={MAX_ROW}")
    x2 = _as_rows(x, n, "x")
    out_dtype = x.dtype if weight_in_fp32 else torch.promote_types(weight.dtype, x.dtype)
    out, out2 = _output(out, x, out_dtype, "out")
    if residual is not None:
        if residual.dtype != x.dtype or residual.shape != x.shape:
            raise ValueError(
                f"residual must match x ({x.dtype} {tuple(x.shape)}), got "
                f"{residual.dtype} {tuple(residual.shape)}"
            )
        res2 = _as_rows(residual, n, "residual")
        residual_out, res_out2 = _output(residual_out, x, x.dtype, "residual_out")
    else:
        res2 = res_out2 = x2
    rows = x2.shape[0]
    if rows == 0:
        return residual_out, out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        res2,
        res2.stride(0),
        x2,
        x2.stride(0),
        weight.contiguous(),
        res_out2,
        res_out2.stride(0),
        out2,
        out2.stride(0),
        n,
        1.0 / n,
        eps,
        multiplier,
        IN_TY=_TL_DTYPES[x.dtype],
        OUT_TY=_TL_DTYPES[out_dtype],
        HAS_ADD=residual is not None,
        SCALE_X=multiplier != 1.0,
        WEIGHT_IN_FP32=weight_in_fp32,
        BLOCK=block,
        num_warps=_num_warps(block),
        enable_fp_fusion=False,
    )
    return residual_out, out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_in_fp32: bool = False,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm of every row of ``x`` in one launch (twin: :func:`rms_norm_reference`).

    Args:
        x: ``[..., n]`` float32 / bfloat16 / float16, unit stride along a row.
        weight: ``[n]``.
        weight_in_fp32: multiply the weight in float32 and cast once (Nemotron-H), instead
            of casting the normalised value to ``x.dtype`` first (Granite, Bamba).
        out: optional destination of the result's shape and dtype (rows may be strided).

    Returns:
        ``x.dtype`` when ``weight_in_fp32``, else ``promote(weight.dtype, x.dtype)``.
    """
    _, y = _launch_rms_norm(None, x, weight, eps, 1.0, weight_in_fp32, None, out)
    return y


def add_rms_norm(
    residual: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    multiplier: float = 1.0,
    weight_in_fp32: bool = False,
    *,
    residual_out: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add and RMSNorm of every row in one launch (twin: :func:`add_rms_norm_reference`).

    Args:
        residual: ``[..., n]`` the residual stream; x: the block output, same shape and
            dtype (float32 / bfloat16 / float16, unit stride along a row).
        weight: ``[n]``; eps, weight_in_fp32: as :func:`rms_norm`.
        multiplier: scales ``x`` before the add (Granite's ``residual_multiplier``).
        residual_out, out: optional destinations (rows may be strided). ``residual_out``
            may be ``residual`` itself: each program reads its row before writing it.

    Returns:
        ``(h, rms_norm(h))`` with ``h = residual + x * multiplier`` in ``x.dtype``,
        bit-identical to the twin's ``h``.
    """
    h, y = _launch_rms_norm(residual, x, weight, eps, multiplier, weight_in_fp32, residual_out, out)
    assert h is not None
    return h, y


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    n_groups: int,
    eps: float,
    out_dtype: torch.dtype | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated grouped RMSNorm of every row in one launch (twin: :func:`gated_rms_norm_reference`).

    Args:
        x: ``[..., n]`` the Mamba2 scan output; gate: ``[..., n]`` (``z``; any of the
            kernel dtypes, rows may be strided, e.g. a slice of the input projection).
        weight: ``[n]``; ``n_groups`` must divide ``n``.
        out_dtype: the result's dtype; default ``promote(weight.dtype, x.dtype)``, the
            dtype of the twin's product (which is rounded to that dtype first).
        out: optional destination (rows may be strided).

    Returns:
        ``weight * normalise_per_group(x * silu(gate)).to(x.dtype)`` in ``out_dtype``.
    """
    n = x.shape[-1]
    _check_kernel_dtypes(x=x, gate=gate, weight=weight)
    if gate.shape != x.shape or weight.shape != (n,):
        raise ValueError(
            f"gate must match x {tuple(x.shape)} and weight be [{n}], got "
            f"{tuple(gate.shape)}, {tuple(weight.shape)}"
        )
    if n_groups < 1 or n % n_groups:
        raise ValueError(f"{n_groups} groups do not divide {n} channels")
    group_size = n // n_groups
    if group_size > MAX_ROW:
        raise ValueError(f"groups of {group_size} exceed MAX_ROW={MAX_ROW}")
    product = torch.promote_types(weight.dtype, x.dtype)
    out_dtype = product if out_dtype is None else out_dtype
    if out_dtype not in _TL_DTYPES:
        raise ValueError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    x2 = _as_rows(x, n, "x")
    z2 = _as_rows(gate, n, "gate")
    out, out2 = _output(out, x, out_dtype, "out")
    rows = x2.shape[0]
    if rows == 0:
        return out
    block = triton.next_power_of_2(group_size)
    _gated_rms_norm_kernel[(rows, n_groups)](
        x2,
        x2.stride(0),
        z2,
        z2.stride(0),
        weight.contiguous(),
        out2,
        out2.stride(0),
        group_size,
        1.0 / group_size,
        eps,
        IN_TY=_TL_DTYPES[x.dtype],
        PRODUCT_TY=_TL_DTYPES[product],
        OUT_TY=_TL_DTYPES[out_dtype],
        BLOCK=block,
        num_warps=_num_warps(block),
        enable_fp_fusion=False,
    )
    return out
