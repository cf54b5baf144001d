"""causal_conv1d_reference: against nn.functional.conv1d over the whole history, and the
windows it returns against the inputs they must hold."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridserve.kernels.conv1d import (
    causal_conv1d_reference,
    causal_conv1d_step_reference,
    causal_conv1d_varlen_reference,
)

torch.set_num_threads(1)


def _full_history_conv(history: torch.Tensor, weight, bias, activation: bool) -> torch.Tensor:
    """Plain padded conv over [C, N] history -> [N, C]."""
    k = weight.shape[-1]
    out = F.conv1d(history[None], weight[:, None, :], bias, padding=k - 1, groups=history.shape[0])
    out = out[0, :, : history.shape[1]].transpose(0, 1)
    return F.silu(out) if activation else out


@pytest.mark.parametrize("length", [1, 2, 3, 4, 11])
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_conv_over_the_whole_history(length, k, with_bias):
    c = 6
    prev = torch.randn(c, 9, dtype=torch.float64)  # tokens before this forward
    x = torch.randn(length, c, dtype=torch.float64)
    weight = torch.randn(c, k, dtype=torch.float64)
    bias = torch.randn(c, dtype=torch.float64) if with_bias else None
    history = torch.cat([prev, x.T], dim=1)
    expected = _full_history_conv(history, weight, bias, True)[9:]
    offsets = list(range(length))
    out, windows = causal_conv1d_reference(x, weight, bias, prev[:, -(k - 1) :], "silu", offsets)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for j, t in enumerate(offsets):
        # The window after token t is the last k - 1 inputs up to and including t,
        # reaching back into the carried window for the first tokens.
        torch.testing.assert_close(windows[j], history[:, 9 + t - (k - 2) : 9 + t + 1])


def test_zero_initial_window_is_a_fresh_sequence():
    x = torch.randn(5, 3, dtype=torch.float64)
    w = torch.randn(3, 4, dtype=torch.float64)
    a, wa = causal_conv1d_reference(x, w, None, None, None, [1])
    b, wb = causal_conv1d_reference(x, w, None, torch.zeros(3, 3, dtype=torch.float64), None, [1])
    assert torch.equal(a, b) and torch.equal(wa, wb)
    torch.testing.assert_close(a, _full_history_conv(x.T, w, None, False))
    assert torch.equal(wa[0, :, 0], torch.zeros(3, dtype=torch.float64))


def test_steps_equal_one_forward():
    x = torch.randn(7, 5, dtype=torch.float64)
    w = torch.randn(5, 4, dtype=torch.float64)
    bias = torch.randn(5, dtype=torch.float64)
    win0 = torch.randn(5, 3, dtype=torch.float64)
    out, windows = causal_conv1d_reference(x, w, bias, win0, "silu", list(range(7)))
    win = win0
    for t in range(7):
        o, win = causal_conv1d_step_reference(x[t], w, bias, win, "silu")
        torch.testing.assert_close(o, out[t], rtol=1e-12, atol=1e-12)
        assert torch.equal(win, windows[t])


def test_varlen_rows_are_independent():
    lengths = [2, 9, 1, 5]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    x = torch.randn(cu[-1], 4, dtype=torch.float64)
    w = torch.randn(4, 4, dtype=torch.float64)
    init = torch.randn(len(lengths), 4, 3, dtype=torch.float64)
    has_init = [True, False, True, True]
    rows, offs = [0, 1, 1, 2, 3], [1, 0, 8, 0, 2]
    out, windows = causal_conv1d_varlen_reference(
        x, cu, w, None, init, has_init, "silu", rows, offs
    )
    for i in range(len(lengths)):
        o, _ = causal_conv1d_reference(
            x[cu[i] : cu[i + 1]], w, None, init[i] if has_init[i] else None, "silu"
        )
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], o)
    for j, (r, t) in enumerate(zip(rows, offs)):
        _, wref = causal_conv1d_reference(
            x[cu[r] : cu[r + 1]], w, None, init[r] if has_init[r] else None, "silu", [t]
        )
        assert torch.equal(windows[j], wref[0])


def test_rejects_bad_shapes():
    x = torch.randn(3, 4)
    w = torch.randn(4, 4)
    with pytest.raises(ValueError, match="initial_window"):
        causal_conv1d_reference(x, w, None, torch.randn(4, 4))
    with pytest.raises(ValueError, match="window offset"):
        causal_conv1d_reference(x, w, None, None, "silu", [3])
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d_reference(x, torch.randn(5, 4))
