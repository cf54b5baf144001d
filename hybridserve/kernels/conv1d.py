"""Causal depthwise conv1d of the Mamba2 mixer: torch reference twin (CPU path, test oracle).

Layout: token-major. A sequence is ``x[L, C]`` (one row of a packed batch); the conv
window carried between forwards is ``[C, K - 1]`` for kernel width ``K``, oldest input
first, i.e. the layout of a ``conv_state`` page (see :mod:`hybridserve.models.batch`).

Output ``t`` is ``act(bias + sum_k weight[:, k] * xp[t + k])`` over the padded input
``xp = concat(window, x)``, which equals ``torch.nn.Conv1d(padding=K - 1)`` truncated to
``L`` outputs when the window is zeros.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def apply_activation(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The conv's pointwise activation: ``"silu"``, ``"swish"`` or ``None`` (identity)."""
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"unsupported conv activation {activation!r}; expected 'silu' or None")


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_window: torch.Tensor | None = None,
    activation: str | None = "silu",
    window_offsets: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over one sequence, starting from a carried window.

    Args:
        x: ``[L, C]`` inputs (L >= 1).
        weight: ``[C, K]`` depthwise kernel.
        bias: ``[C]`` or None.
        initial_window: ``[C, K - 1]``, the last ``K - 1`` inputs before ``x`` (oldest
            first); None means zeros (a sequence starting at token 0).
        activation: applied to the outputs (not to the windows).
        window_offsets: offsets ``t`` in ``[0, L)`` whose window to return.

    Returns:
        ``(out [L, C]`` in ``x.dtype``, ``windows [len(window_offsets), C, K - 1]`` in
        ``x.dtype)``: ``windows[j]`` holds the last ``K - 1`` inputs up to and including
        token ``window_offsets[j]``; when fewer than ``K - 1`` tokens of ``x`` precede it,
        the oldest entries come from ``initial_window``.
    """
    length, channels = x.shape
    k = weight.shape[-1]
    if weight.shape != (channels, k):
        raise ValueError(f"weight must be [C={channels}, K], got {tuple(weight.shape)}")
    if initial_window is None:
        initial_window = x.new_zeros(channels, k - 1)
    elif initial_window.shape != (channels, k - 1):
        raise ValueError(
            f"initial_window must be [C={channels}, K-1={k - 1}], got {tuple(initial_window.shape)}"
        )
    xp = torch.cat([initial_window.to(x.dtype), x.transpose(0, 1)], dim=1)  # [C, K-1+L]
    compute = torch.promote_types(x.dtype, torch.float32)
    out = F.conv1d(
        xp.to(compute).unsqueeze(0),
        weight.to(compute).unsqueeze(1),
        None if bias is None else bias.to(compute),
        groups=channels,
    )[0]  # [C, L]
    out = apply_activation(out, activation).transpose(0, 1).to(x.dtype)
    for t in window_offsets:
        if not 0 <= t < length:
            raise ValueError(f"window offset {t} outside [0, {length})")
    # Token t sits at xp[:, t + K - 1]; its window is the K - 1 entries ending there.
    windows = (
        torch.stack([xp[:, t + 1 : t + k] for t in window_offsets])
        if window_offsets
        else x.new_empty(0, channels, k - 1)
    )
    return out, windows


def causal_conv1d_step_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    window: torch.Tensor,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step: ``x [C]`` with window ``[C, K - 1]`` -> ``(out [C], new window)``."""
    out, windows = causal_conv1d_reference(x[None], weight, bias, window, activation, (0,))
    return out[0], windows[0]


def causal_conv1d_varlen_reference(
    x: torch.Tensor,
    cu_seqlens: Sequence[int],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_windows: torch.Tensor | None,
    has_initial: Sequence[bool] | None = None,
    activation: str | None = "silu",
    out_rows: Sequence[int] = (),
    out_offsets: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_conv1d_reference` over a packed batch of sequences.

    Args:
        x: ``[T, C]``, row ``i`` is ``x[cu_seqlens[i]:cu_seqlens[i + 1]]``.
        initial_windows: ``[B, C, K - 1]`` or None (all zeros).
        has_initial: per row, False means start from zeros whatever ``initial_windows`` holds.
        out_rows, out_offsets: window requests ``(row, offset within the row)``.

    Returns:
        ``(out [T, C], windows [len(out_rows), C, K - 1])`` in request order.
    """
    b = len(cu_seqlens) - 1
    out = torch.empty_like(x)
    windows = x.new_empty(len(out_rows), x.shape[1], weight.shape[-1] - 1)
    for i in range(b):
        s, e = cu_seqlens[i], cu_seqlens[i + 1]
        req = [j for j, r in enumerate(out_rows) if r == i]
        init = None
        if initial_windows is not None and (has_initial is None or has_initial[i]):
            init = initial_windows[i]
        if e == s:
            continue
        o, w = causal_conv1d_reference(
            x[s:e], weight, bias, init, activation, [out_offsets[j] for j in req]
        )
        out[s:e] = o
        for n, j in enumerate(req):
            windows[j] = w[n]
    return out, windows
