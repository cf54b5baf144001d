"""Mamba2 over state pages, token by token: the conv-window update and the recurrence.

The ops of steps dominated by launches rather than arithmetic: decode and verify rows
(every row the same small number of tokens ``Q``) and short rows of any length (a
prompt's tail after a cached prefix, a short chunk beside decode rows). Instead of the
per-row loop of the reference mixer, every row of the step is processed by one launch
per op:

- :func:`conv_decode_update`: causal depthwise conv of uniform rows' ``Q`` new inputs,
  starting from the conv window on page ``in_pages[r]`` (zeros for -1), reading the
  window and taps once and shifting the window in registers (short rows of any length take
  :func:`~hybridserve.kernels.conv_varlen.conv_varlen`, which writes windows the same
  way);
- :func:`ssm_update`: the recurrence ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t``,
  ``y_t = S_t . C_t + D x_t`` from the state on page ``in_pages[r]`` (zeros for -1), over
  uniform rows (``query_start`` None: the row length is unrolled, the form CUDA graphs
  capture) or rows of any length (``query_start``). One kernel, one twin, for both.
- :func:`conv_ssm_update`: the two in one launch for uniform rows (the decode and verify
  steps of Mamba2): each program convolves its own x channels and its group's B and C
  channels in registers, so the conv output makes no round trip through memory and the
  step costs one launch less.

Numerics: ``ssm_update`` takes the projection's raw dt and discretises it itself,
``dt_t = clamp(softplus(dt_raw + dt_bias), *time_step_limit)``, in float32 (the twin in
``promote(x.dtype, float32)``), as it computes the decay ``exp(dt_t A)`` and accumulates
the state. Discretising in the activations' dtype (bfloat16) instead costs a relative state
error against float64 of about 1e-3 after one step that grows with every step
(tests/kernels/test_mamba_decode.py measures it).

All write the window / state *after* packed token ``t`` to page ``out_pages[t]`` when
that entry is ``>= 0`` and never write an input page (the caller guarantees the output
pages are disjoint from every input page: docs/state-lifecycle.md), so no program of a
launch reads what another writes (the race rule, docs/racecheck.md): a program owns one
(row, channel block) or (row, head, head-dim block) slice of its row's pages and touches
nothing else (in the fused launch, the B and C windows of a group are written by the
group's first program only).

Layout (token-major, packed): uniform rows put row ``r``'s token ``t`` at ``r * Q + t``.
Every op has a torch twin (``*_reference``) computing the same function, the CPU path and
the test oracle; the Triton kernels run on CUDA (and under the CPU interpreter in tests).
A row of ``L`` tokens costs ``L`` dependent steps, so the step plan sends only rows up to
``KernelPolicy.max_short_tokens`` here; longer rows take the chunked scan.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.kernels.conv1d import apply_activation
from hybridserve.kernels.ssd_varlen import discretize_dt_varlen

__all__ = [
    "check_ssm_operands",
    "conv_decode_update",
    "conv_decode_update_reference",
    "conv_ssm_update",
    "conv_ssm_update_reference",
    "softplus",
    "ssm_update",
    "ssm_update_reference",
]

# The default dt clamp of Mamba2 checkpoints (a no-op after the softplus).
NO_CLAMP_LIMIT = (0.0, float("inf"))


# --------------------------------------------------------------------------------------
# Torch twins (the CPU path and the test oracle)
# --------------------------------------------------------------------------------------


def _check_pages(in_pages: torch.Tensor, out_pages: torch.Tensor, tokens: int) -> tuple[int, int]:
    if in_pages.dim() != 1 or out_pages.dim() != 2 or out_pages.shape[0] != in_pages.shape[0]:
        raise ValueError(
            f"in_pages must be [R] and out_pages [R, Q], got {tuple(in_pages.shape)}, "
            f"{tuple(out_pages.shape)}"
        )
    rows, q = out_pages.shape
    if rows * q != tokens:
        raise ValueError(f"{tokens} packed tokens do not make {rows} rows of {q}")
    return rows, q


def check_ssm_operands(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    ssm_cache: torch.Tensor,
    kernel: bool = False,
    dt_bias: torch.Tensor | None = None,
    unclamped: torch.Tensor | None = None,
) -> tuple[int, int]:
    """``(groups, d_state)`` of the recurrence's operands ``x [T, H, P]``, ``dt [T, H]``,
    ``B, C [T, G, N]``, ``ssm_cache [pages, H, P, N]`` and, when given, ``dt_bias [H]`` and
    ``unclamped [T]``; raises ValueError on a shape that does not fit, and (``kernel``) on
    a layout the Triton kernels cannot read."""
    tokens, heads, head_dim = x.shape
    if dt_bias is not None and dt_bias.shape != (heads,):
        raise ValueError(f"dt_bias must be [H={heads}], got {tuple(dt_bias.shape)}")
    if unclamped is not None and (unclamped.shape != (tokens,) or unclamped.dtype != torch.bool):
        raise ValueError(
            f"unclamped must be a bool [T={tokens}], got {unclamped.dtype} {tuple(unclamped.shape)}"
        )
    groups, d_state = B.shape[-2:]
    if heads % groups or B.shape != (tokens, groups, d_state) or C.shape != B.shape:
        raise ValueError(f"B and C must be [T={tokens}, G, N] with G dividing H={heads}")
    if dt.shape != (tokens, heads) or ssm_cache.shape[1:] != (heads, head_dim, d_state):
        raise ValueError(
            f"dt must be [T, H] and ssm_cache [pages, H={heads}, P={head_dim}, N={d_state}], "
            f"got {tuple(dt.shape)}, {tuple(ssm_cache.shape)}"
        )
    if kernel:
        for name, t in (("x", x), ("B", B), ("C", C)):
            if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
                raise ValueError(f"{name}'s last two axes must be contiguous")
        if dt.stride(1) != 1 or not ssm_cache.is_contiguous():
            raise ValueError("dt's head axis and ssm_cache must be contiguous")
    return groups, d_state


def conv_decode_update_reference(
    xbc: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_cache: torch.Tensor,
    in_pages: torch.Tensor,
    out_pages: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Torch twin of :func:`conv_decode_update` (same arguments, same result)."""
    tokens, channels = xbc.shape
    rows, q = _check_pages(in_pages, out_pages, tokens)
    k = weight.shape[-1]
    pages = in_pages.long()
    # A row without a page (-1) starts from a zero window.
    windows = torch.where(
        (pages >= 0)[:, None, None],
        conv_cache[pages.clamp(min=0)].to(xbc.dtype),
        torch.zeros((), dtype=xbc.dtype, device=xbc.device),
    )  # [R, C, K-1]
    xp = torch.cat([windows, xbc.view(rows, q, channels).transpose(1, 2)], dim=2)  # [R, C, K-1+Q]
    compute = torch.promote_types(xbc.dtype, torch.float32)
    out = torch.nn.functional.conv1d(
        xp.to(compute),
        weight.to(compute).unsqueeze(1),
        None if bias is None else bias.to(compute),
        groups=channels,
    )  # [R, C, Q]
    out = apply_activation(out, activation).transpose(1, 2).reshape(tokens, channels)
    for t in range(q):
        keep = out_pages[:, t] >= 0
        if bool(keep.any()):
            conv_cache[out_pages[keep, t].long()] = xp[keep, :, t + 1 : t + k].to(conv_cache.dtype)
    return out.to(xbc.dtype)


def _rows(
    x: torch.Tensor,
    in_pages: torch.Tensor,
    out_pages: torch.Tensor,
    query_start: torch.Tensor | None,
) -> tuple[int, int, torch.Tensor]:
    """``(rows, uniform q or 0, out_pages [T])``; raises ValueError on pages that do not
    fit ``x``'s tokens."""
    tokens = x.shape[0]
    rows = in_pages.shape[0]
    if in_pages.dim() != 1:
        raise ValueError(f"in_pages must be [R], got {tuple(in_pages.shape)}")
    if query_start is None:
        if rows == 0 or tokens % rows or out_pages.numel() != tokens:
            raise ValueError(
                f"{tokens} packed tokens and out_pages {tuple(out_pages.shape)} do not make "
                f"{rows} rows of equal length"
            )
        return rows, tokens // rows, out_pages.reshape(tokens)
    if query_start.shape != (rows + 1,) or out_pages.shape != (tokens,):
        raise ValueError(
            f"query_start must be [R + 1], in_pages [R] and out_pages [T={tokens}], got "
            f"{tuple(query_start.shape)}, {tuple(in_pages.shape)}, {tuple(out_pages.shape)}"
        )
    return rows, 0, out_pages


def ssm_update_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    ssm_cache: torch.Tensor,
    in_pages: torch.Tensor,
    out_pages: torch.Tensor,
    query_start: torch.Tensor | None = None,
    *,
    dt_bias: torch.Tensor,
    time_step_limit: tuple[float, float] | None = NO_CLAMP_LIMIT,
    unclamped: torch.Tensor | None = None,
    prefetch: bool = False,
    chunk: int = 0,
) -> torch.Tensor:
    """Torch twin of :func:`ssm_update` (same arguments, same result; ``prefetch`` and
    ``chunk``, the kernel's load order and walk, change nothing here): token index by
    token index, every row that has a token there at once. Every input state is read
    before any page is written."""
    tokens, heads, head_dim = x.shape
    rows, q, outs = _rows(x, in_pages, out_pages, query_start)
    groups, d_state = check_ssm_operands(
        x, dt, B, C, ssm_cache, dt_bias=dt_bias, unclamped=unclamped
    )
    if query_start is None:
        starts = [r * q for r in range(rows + 1)]
    else:
        starts = query_start.tolist()
        if starts[0] != 0 or starts[-1] != tokens:
            raise ValueError(f"query_start must run from 0 to T={tokens}, got {starts}")
    lens = [starts[r + 1] - starts[r] for r in range(rows)]
    compute = torch.promote_types(x.dtype, torch.float32)
    rep = heads // groups
    pages = in_pages.long()
    state = torch.where(
        (pages >= 0)[:, None, None, None],
        ssm_cache[pages.clamp(min=0)].to(compute),
        torch.zeros((), dtype=compute, device=x.device),
    )  # [R, H, P, N]
    A = A.to(compute)
    # Discretised in the compute dtype (float32 at least), never in the activations'.
    dt = discretize_dt_varlen(dt.to(compute), dt_bias.to(compute), time_step_limit, unclamped)
    y = torch.empty(tokens, heads, head_dim, dtype=compute, device=x.device)
    writes = []
    for t in range(max(lens, default=0)):
        active = [r for r in range(rows) if lens[r] > t]
        tok = torch.tensor([starts[r] + t for r in active], device=x.device)
        idx = torch.tensor(active, device=x.device)
        xt = x[tok].to(compute)
        dtt = dt[tok]
        Bh = B[tok].to(compute).repeat_interleave(rep, dim=1)  # [R', H, N]
        Ch = C[tok].to(compute).repeat_interleave(rep, dim=1)
        decay = torch.exp(dtt * A)  # [R', H]
        # Same association as the per-token reference step: (dt * B) first, then x.
        dBx = (dtt[:, :, None] * Bh)[:, :, None, :] * xt[:, :, :, None]
        st = state[idx] * decay[:, :, None, None] + dBx
        state[idx] = st
        yt = torch.bmm(
            st.reshape(-1, head_dim, d_state), Ch.reshape(-1, d_state, 1)
        ).view(len(active), heads, head_dim)
        if D is not None:
            yt = yt + xt * D.to(compute)[:, None]
        y[tok] = yt
        page = outs[tok].long()
        keep = page >= 0
        if bool(keep.any()):
            writes.append((page[keep], st[keep]))
    for page, st in writes:
        ssm_cache[page] = st.to(ssm_cache.dtype)
    return y


# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------


@triton.jit
def conv_taps(weight_ptr, bias_ptr, c, cmask, K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The depthwise taps of channels ``c`` as four float32 vectors ``(w0, w1, w2, w3)``,
    right-aligned (``w3`` is the tap of the newest input; taps a kernel of width ``K < 4``
    lacks are zeros), and the bias (zeros without one). ``weight`` is ``[C, K]``."""
    zero = tl.zeros_like(c).to(tl.float32)
    w0 = zero
    w1 = zero
    w2 = zero
    if K == 4:
        w0 = tl.load(weight_ptr + c * K + (K - 4), mask=cmask, other=0.0).to(tl.float32)
    if K >= 3:
        w1 = tl.load(weight_ptr + c * K + (K - 3), mask=cmask, other=0.0).to(tl.float32)
    w2 = tl.load(weight_ptr + c * K + (K - 2), mask=cmask, other=0.0).to(tl.float32)
    w3 = tl.load(weight_ptr + c * K + (K - 1), mask=cmask, other=0.0).to(tl.float32)
    b = zero
    if HAS_BIAS:
        b = tl.load(bias_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    return w0, w1, w2, w3, b


@triton.jit
def load_conv_window(page_ptr, c, wmask, K: tl.constexpr):
    """The window ``[C, K - 1]`` (oldest first) of channels ``c`` on the page at
    ``page_ptr`` as three vectors ``(c0, c1, c2)`` in the page dtype, right-aligned like
    :func:`conv_taps` (``c2`` the newest input; zeros where ``K < 4`` or ``wmask`` is off).
    Read once per program: the window then shifts in registers."""
    zero = tl.zeros_like(c).to(page_ptr.dtype.element_ty)
    c0 = zero
    c1 = zero
    if K == 4:
        c0 = tl.load(page_ptr + c * (K - 1) + (K - 4), mask=wmask, other=0.0)
    if K >= 3:
        c1 = tl.load(page_ptr + c * (K - 1) + (K - 3), mask=wmask, other=0.0)
    c2 = tl.load(page_ptr + c * (K - 1) + (K - 2), mask=wmask, other=0.0)
    return c0, c1, c2


@triton.jit
def _conv_window_dst(conv_ptr, page, page_stride, c, cmask, K: tl.constexpr):
    """``(dst, wmask)``: the address of entry 0 of channels ``c``'s window in page
    ``page``, and the store mask (``cmask``, off everywhere when ``page < 0``)."""
    # Broadcast the page before comparing: a scalar comparison in a mask is rejected by
    # the CPU interpreter.
    wmask = cmask & ((c * 0 + page) >= 0)
    dst = conv_ptr + page.to(tl.int64) * page_stride + c * (K - 1)
    return dst, wmask


@triton.jit
def store_conv_window(conv_ptr, page, page_stride, c, cmask, c0, c1, c2, K: tl.constexpr):
    """Store the right-aligned window ``(c0, c1, c2)`` of channels ``c`` (mask ``cmask``)
    to page ``page`` when that is ``>= 0``, cast to the page dtype."""
    dst, wmask = _conv_window_dst(conv_ptr, page, page_stride, c, cmask, K)
    ty = conv_ptr.dtype.element_ty
    if K == 4:
        tl.store(dst + (K - 4), c0.to(ty), mask=wmask)
    if K >= 3:
        tl.store(dst + (K - 3), c1.to(ty), mask=wmask)
    tl.store(dst + (K - 2), c2.to(ty), mask=wmask)


@triton.jit
def conv_tap_step(c0, c1, c2, xin, w0, w1, w2, w3, b, SILU: tl.constexpr):
    """One output of the causal conv in float32: ``act(b + w . (c0, c1, c2, xin))``."""
    acc = b + w0 * c0 + w1 * c1 + w2 * c2 + w3 * xin
    if SILU:
        acc = acc * tl.sigmoid(acc)
    return acc


@triton.jit
def _conv_decode_program(in_pages_ptr, conv_ptr, page_stride, channels, BLOCK_C: tl.constexpr):
    """The setup of a conv decode program (one per row, channel block): ``(r, c, cmask,
    in_base, inmask)``, its row, channels and their mask, the row's input window page and
    the mask that reads it (off for a row without a page, which starts from a zero window:
    page 0 is then never dereferenced)."""
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < channels
    in_page = tl.load(in_pages_ptr + r)
    in_base = conv_ptr + tl.maximum(in_page, 0).to(tl.int64) * page_stride
    inmask = cmask & ((c * 0 + in_page) >= 0)
    return r, c, cmask, in_base, inmask


@triton.jit
def _conv_decode_kernel(
    xbc_ptr,
    xbc_stride,
    weight_ptr,
    bias_ptr,
    conv_ptr,
    page_stride,
    in_pages_ptr,
    out_pages_ptr,
    out_ptr,
    channels,
    Q: tl.constexpr,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # One program per (row, channel block), kernels of width 2 to 4: the taps and the
    # window are read once, the row's Q inputs once each (a contiguous channel block of
    # one token), the window shifts in registers, and the window after token t is written
    # only where out_pages asks for it.
    r, c, cmask, in_base, inmask = _conv_decode_program(in_pages_ptr, conv_ptr, page_stride,
                                                        channels, BLOCK_C)
    w0, w1, w2, w3, b = conv_taps(weight_ptr, bias_ptr, c, cmask, K, HAS_BIAS)
    c0, c1, c2 = load_conv_window(in_base, c, inmask, K)
    # Windows hold inputs in the inputs' dtype (the twin's rounding of a wider page).
    ty = xbc_ptr.dtype.element_ty
    c0 = c0.to(ty).to(tl.float32)
    c1 = c1.to(ty).to(tl.float32)
    c2 = c2.to(ty).to(tl.float32)
    for t in tl.static_range(Q):
        tok = r * Q + t
        xin = tl.load(xbc_ptr + tok * xbc_stride + c, mask=cmask, other=0.0).to(tl.float32)
        acc = conv_tap_step(c0, c1, c2, xin, w0, w1, w2, w3, b, SILU)
        tl.store(out_ptr + tok * channels + c, acc.to(out_ptr.dtype.element_ty), mask=cmask)
        c0, c1, c2 = c1, c2, xin
        store_conv_window(conv_ptr, tl.load(out_pages_ptr + tok), page_stride, c, cmask,
                          c0, c1, c2, K)


@triton.jit
def _conv_decode_reload_kernel(
    xbc_ptr,
    xbc_stride,
    weight_ptr,
    bias_ptr,
    conv_ptr,
    page_stride,
    in_pages_ptr,
    out_pages_ptr,
    out_ptr,
    channels,
    Q: tl.constexpr,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # The previous form (any kernel width): one program per (row, channel block), every
    # output re-reading its K inputs and every window its K - 1 entries from memory. The
    # padded input of a channel is
    # xp = window (K - 1 values, oldest first) followed by the row's Q inputs; output t
    # reads xp[t .. t + K - 1] and the window after token t is xp[t + 1 .. t + K - 1].
    r, c, cmask, in_base, inmask = _conv_decode_program(in_pages_ptr, conv_ptr, page_stride,
                                                        channels, BLOCK_C)
    win_ptr = in_base + c * (K - 1)
    tok0 = r * Q
    acc_bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc_bias += tl.load(bias_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    for t in tl.static_range(Q):
        acc = acc_bias
        for k in tl.static_range(K):
            if t + k < K - 1:
                v = tl.load(win_ptr + (t + k), mask=inmask, other=0.0)
            else:
                v = tl.load(xbc_ptr + (tok0 + t + k - (K - 1)) * xbc_stride + c, mask=cmask, other=0.0)
            w = tl.load(weight_ptr + c * K + k, mask=cmask, other=0.0)
            acc += v.to(tl.float32) * w.to(tl.float32)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + (tok0 + t) * channels + c, acc.to(out_ptr.dtype.element_ty), mask=cmask)
        out_page = tl.load(out_pages_ptr + r * Q + t)
        dst, wmask = _conv_window_dst(conv_ptr, out_page, page_stride, c, cmask, K)
        for i in tl.static_range(K - 1):
            if t + 1 + i < K - 1:
                v = tl.load(win_ptr + (t + 1 + i), mask=wmask & inmask, other=0.0)
            else:
                v = tl.load(
                    xbc_ptr + (tok0 + t + 1 + i - (K - 1)) * xbc_stride + c, mask=wmask, other=0.0
                )
            tl.store(dst + i, v.to(conv_ptr.dtype.element_ty), mask=wmask)


def conv_decode_update(
    xbc: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_cache: torch.Tensor,
    in_pages: torch.Tensor,
    out_pages: torch.Tensor,
    activation: str | None = "silu",
    *,
    registers: bool = True,
    block_c: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Conv step of every row of a uniform step, from and to conv-window pages.

    Args:
        xbc: ``[R * Q, C]`` new conv inputs (token-major; rows of ``Q`` tokens).
        weight: ``[C, K]`` depthwise kernel; bias: ``[C]`` or None.
        conv_cache: ``[pages, C, K - 1]`` windows (oldest input first), contiguous.
        in_pages: ``[R]`` int32 page of each row's window before its first token, -1
            for zeros.
        out_pages: ``[R, Q]`` int32; the window after token ``t`` of row ``r`` goes to
            page ``out_pages[r, t]`` when it is ``>= 0``. Must not repeat a page or name
            an input page.
        activation: ``"silu"`` / ``"swish"`` or None, applied to the outputs.
        registers: kernel widths 2 to 4 read the window and taps once and shift the
            window in registers (the default); False, or any other width, takes the
            previous form, which re-reads every output's K inputs and every window's
            K - 1 entries (the benchmarks' baseline).
        block_c, num_warps: channels a program (a power of two; default
            ``min(256, next_power_of_2(C))``) and its warps: the benchmarks' tile sweep.

    Returns:
        ``out [R * Q, C]`` in ``xbc.dtype`` (accumulated in float32).
    """
    tokens, channels = xbc.shape
    rows, q = _check_pages(in_pages, out_pages, tokens)
    k = weight.shape[-1]
    if weight.shape != (channels, k) or conv_cache.shape[1:] != (channels, k - 1):
        raise ValueError(
            f"weight must be [C={channels}, K] and conv_cache [pages, C, K-1], got "
            f"{tuple(weight.shape)}, {tuple(conv_cache.shape)}"
        )
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r}")
    if xbc.stride(1) != 1 or not conv_cache.is_contiguous() or not weight.is_contiguous():
        raise ValueError("xbc rows, conv_cache and weight must be contiguous")
    out = torch.empty(tokens, channels, dtype=xbc.dtype, device=xbc.device)
    if rows == 0:
        return out
    if block_c is None:
        block_c = min(256, triton.next_power_of_2(channels))
    if block_c < 1 or block_c & (block_c - 1):
        raise ValueError(f"block_c must be a power of two, got {block_c}")
    grid = (rows, triton.cdiv(channels, block_c))
    kernel = _conv_decode_kernel if registers and 2 <= k <= 4 else _conv_decode_reload_kernel
    kernel[grid](
        xbc,
        xbc.stride(0),
        weight,
        bias if bias is not None else weight,
        conv_cache,
        conv_cache.stride(0),
        in_pages.to(torch.int32).contiguous(),
        out_pages.to(torch.int32).contiguous(),
        out,
        channels,
        Q=q,
        K=k,
        HAS_BIAS=bias is not None,
        SILU=activation is not None,
        BLOCK_C=block_c,
        num_warps=num_warps,
    )
    return out


@triton.jit
def softplus(x):
    """``log(1 + exp(x))`` of a float32 block, as torch's softplus computes it: no overflow
    for large ``x``, and ``exp(x)`` kept when it is tiny next to 1 (``log(u) * e / (u - 1)``
    with ``u = 1 + e`` is log1p to within an ulp; the interpreter has no log1p)."""
    e = tl.exp(-tl.abs(x))
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.maximum(x, 0.0) + log1p


@triton.jit
def store_state_page(state, tok, offs, smask, ssm_ptr, page_stride, out_pages_ptr):
    """Store a program's slice ``offs`` (mask ``smask``) of the state after packed token
    ``tok`` to page ``out_pages[tok]`` when that is ``>= 0``, cast to the page dtype (the
    token steps of Mamba2 here and of Gated DeltaNet share it)."""
    out_page = tl.load(out_pages_ptr + tok)
    # Broadcast the page before comparing: a scalar comparison in a mask is rejected by
    # the CPU interpreter.
    tl.store(
        ssm_ptr + out_page.to(tl.int64) * page_stride + offs,
        state.to(ssm_ptr.dtype.element_ty),
        mask=smask & ((offs * 0 + out_page) >= 0),
    )


@triton.jit
def ssm_token_update(
    state,
    x,
    b,
    c,
    dt_raw,
    tok,
    h,
    p,
    pmask,
    smask,
    offs,
    a,
    d_skip,
    dt_bias,
    dt_min,
    dt_max,
    unclamped_ptr,
    ssm_ptr,
    page_stride,
    out_pages_ptr,
    y_ptr,
    heads,
    head_dim,
    CLAMP: tl.constexpr,
    HAS_UNCLAMPED: tl.constexpr,
):
    """One token of the recurrence from its operands in registers (float32 ``x [BLOCK_P]``,
    ``b, c [BLOCK_N]``, the raw ``dt_raw``): discretises dt, updates ``state`` (returned),
    stores ``y`` of packed token ``tok`` and, when ``out_pages[tok] >= 0``, the new state
    to that page. Shared by :func:`ssm_token_step` and the fused conv + recurrence."""
    # dt discretised in float32 from the projection's value (module docstring).
    dt = softplus(dt_raw + dt_bias)
    if CLAMP:
        clamped = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        if HAS_UNCLAMPED:
            dt = tl.where(tl.load(unclamped_ptr + tok) != 0, dt, clamped)
        else:
            dt = clamped
    decay = tl.exp(dt * a)
    state = state * decay + (dt * b)[None, :] * x[:, None]
    y = tl.sum(state * c[None, :], axis=1) + d_skip * x
    tl.store(y_ptr + tok * heads * head_dim + h * head_dim + p, y, mask=pmask)
    store_state_page(state, tok, offs, smask, ssm_ptr, page_stride, out_pages_ptr)
    return state


@triton.jit
def ssm_token_step(
    state,
    tok,
    h,
    g,
    p,
    n,
    pmask,
    nmask,
    smask,
    offs,
    a,
    d_skip,
    dt_bias,
    dt_min,
    dt_max,
    x_ptr,
    x_stride,
    dt_ptr,
    dt_stride,
    unclamped_ptr,
    B_ptr,
    B_stride,
    C_ptr,
    C_stride,
    ssm_ptr,
    page_stride,
    out_pages_ptr,
    y_ptr,
    heads,
    head_dim,
    d_state,
    CLAMP: tl.constexpr,
    HAS_UNCLAMPED: tl.constexpr,
):
    """One token of the recurrence for a program's (head ``h``, head-dim rows ``p``) slice:
    loads the token's operands and applies :func:`ssm_token_update` (returns the state).
    Inlined into both loops of :func:`_ssm_kernel` (unrolled uniform rows, rows of any
    length)."""
    x, b, c, dt_raw = _ssm_operands(tok, tok + 1, h, g, p, n, pmask, nmask, x_ptr, x_stride,
                                    dt_ptr, dt_stride, B_ptr, B_stride, C_ptr, C_stride,
                                    head_dim, d_state, False)
    return ssm_token_update(
        state, x, b, c, dt_raw, tok, h, p, pmask, smask, offs, a, d_skip, dt_bias, dt_min,
        dt_max, unclamped_ptr, ssm_ptr, page_stride, out_pages_ptr, y_ptr, heads, head_dim,
        CLAMP, HAS_UNCLAMPED,
    )


@triton.jit
def _ssm_operands(tok, end, h, g, p, n, pmask, nmask, x_ptr, x_stride, dt_ptr, dt_stride,
                  B_ptr, B_stride, C_ptr, C_stride, head_dim, d_state, BOUNDED: tl.constexpr):
    """Packed token ``tok``'s float32 ``x [BLOCK_P]``, ``b, c [BLOCK_N]`` and raw dt for a
    program's (head ``h``, group ``g``, head-dim rows ``p``) slice. ``BOUNDED``: zeros
    where ``tok`` is not below ``end`` (the token past a row's end, loaded ahead: nothing
    is read); without it ``tok`` is a token of the row (the loads of before, unmasked)."""
    pm, nm = pmask, nmask
    if BOUNDED:
        pm = pm & (p * 0 + tok < end)
        nm = nm & (n * 0 + tok < end)
    x = tl.load(x_ptr + tok * x_stride + h * head_dim + p, mask=pm, other=0.0).to(tl.float32)
    b = tl.load(B_ptr + tok * B_stride + g * d_state + n, mask=nm, other=0.0).to(tl.float32)
    c = tl.load(C_ptr + tok * C_stride + g * d_state + n, mask=nm, other=0.0).to(tl.float32)
    if BOUNDED:
        dt_raw = tl.load(dt_ptr + tok * dt_stride + h, mask=tok < end, other=0.0).to(tl.float32)
    else:
        dt_raw = tl.load(dt_ptr + tok * dt_stride + h).to(tl.float32)
    return x, b, c, dt_raw


@triton.jit
def ssm_slice(in_pages_ptr, head_dim, d_state, heads_per_group, BLOCK_P: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """What a program of the recurrence over rows owns: one program per (row ``r``, head
    ``h``, head-dim block) of the grid holds rows ``p`` of head ``h``'s ``[P, N]`` state
    (group ``g``), starting from the row's input page ``in_page`` (-1: zeros). Returns
    ``(r, h, g, p, n, pmask, nmask, smask, in_page)``."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pmask = p < head_dim
    nmask = n < d_state
    smask = pmask[:, None] & nmask[None, :]
    g = h // heads_per_group
    in_page = tl.load(in_pages_ptr + r)
    return r, h, g, p, n, pmask, nmask, smask, in_page


@triton.jit
def ssm_start(in_page, h, p, n, smask, ssm_ptr, page_stride, A_ptr, dt_bias_ptr, D_ptr,
              head_dim, d_state, HAS_D: tl.constexpr):
    """A program's slice of its row's state before the row (float32; zeros for page -1,
    and page 0 is never dereferenced for it) and its head's ``A``, dt bias and D skip:
    ``(offs, state, a, dt_bias, d_skip)``, ``offs`` the slice's offsets in a page."""
    offs = h * head_dim * d_state + p[:, None] * d_state + n[None, :]
    state = tl.load(
        ssm_ptr + tl.maximum(in_page, 0).to(tl.int64) * page_stride + offs,
        mask=smask & ((offs * 0 + in_page) >= 0),
        other=0.0,
    ).to(tl.float32)
    a = tl.load(A_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    d_skip = 0.0
    if HAS_D:
        d_skip = tl.load(D_ptr + h).to(tl.float32)
    return offs, state, a, dt_bias, d_skip


@triton.jit
def ssm_program(in_pages_ptr, ssm_ptr, page_stride, A_ptr, dt_bias_ptr, D_ptr, head_dim,
                d_state, heads_per_group, HAS_D: tl.constexpr, BLOCK_P: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """:func:`ssm_slice` then :func:`ssm_start`: ``(r, h, g, p, n, pmask, nmask, smask,
    offs, state, a, dt_bias, d_skip)``. The token walk (:func:`_ssm_kernel`) and the
    chunked walk (:mod:`hybridserve.kernels.ssm_chunks`) start so; the fused conv +
    recurrence loads its conv windows between the two."""
    r, h, g, p, n, pmask, nmask, smask, in_page = ssm_slice(
        in_pages_ptr, head_dim, d_state, heads_per_group, BLOCK_P, BLOCK_N)
    offs, state, a, dt_bias, d_skip = ssm_start(
        in_page, h, p, n, smask, ssm_ptr, page_stride, A_ptr, dt_bias_ptr, D_ptr, head_dim,
        d_state, HAS_D)
    return r, h, g, p, n, pmask, nmask, smask, offs, state, a, dt_bias, d_skip


@triton.jit
def _ssm_kernel(
    x_ptr,
    x_stride,
    dt_ptr,
    dt_stride,
    dt_bias_ptr,
    dt_min,
    dt_max,
    unclamped_ptr,
    A_ptr,
    B_ptr,
    B_stride,
    C_ptr,
    C_stride,
    D_ptr,
    ssm_ptr,
    page_stride,
    query_start_ptr,
    in_pages_ptr,
    out_pages_ptr,
    y_ptr,
    heads,
    head_dim,
    d_state,
    heads_per_group,
    Q: tl.constexpr,
    HAS_D: tl.constexpr,
    CLAMP: tl.constexpr,
    HAS_UNCLAMPED: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    r, h, g, p, n, pmask, nmask, smask, offs, state, a, dt_bias, d_skip = ssm_program(
        in_pages_ptr, ssm_ptr, page_stride, A_ptr, dt_bias_ptr, D_ptr, head_dim, d_state,
        heads_per_group, HAS_D, BLOCK_P, BLOCK_N)
    if Q > 0:
        # Uniform rows: the row length is unrolled (what a CUDA graph captures).
        for t in tl.static_range(Q):
            state = ssm_token_step(
                state, r * Q + t, h, g, p, n, pmask, nmask, smask, offs, a, d_skip,
                dt_bias, dt_min, dt_max, x_ptr, x_stride, dt_ptr, dt_stride, unclamped_ptr,
                B_ptr, B_stride, C_ptr, C_stride, ssm_ptr, page_stride, out_pages_ptr, y_ptr,
                heads, head_dim, d_state, CLAMP, HAS_UNCLAMPED,
            )
    elif PREFETCH:
        # Rows of any length, software-pipelined: token i + 1's operands are loaded
        # before token i's update, so their memory latency overlaps its arithmetic and
        # stores instead of following them (the loads read only the step's inputs, never
        # a state page, so moving them ahead changes no value: same tokens, same order).
        start = tl.load(query_start_ptr + r).to(tl.int64)
        end = tl.load(query_start_ptr + r + 1).to(tl.int64)
        x, b, c, dt_raw = _ssm_operands(start, end, h, g, p, n, pmask, nmask, x_ptr,
                                        x_stride, dt_ptr, dt_stride, B_ptr, B_stride, C_ptr,
                                        C_stride, head_dim, d_state, True)
        for i in range(0, end - start):
            x_n, b_n, c_n, dt_n = _ssm_operands(
                start + i + 1, end, h, g, p, n, pmask, nmask, x_ptr, x_stride, dt_ptr,
                dt_stride, B_ptr, B_stride, C_ptr, C_stride, head_dim, d_state, True)
            state = ssm_token_update(
                state, x, b, c, dt_raw, start + i, h, p, pmask, smask, offs, a, d_skip,
                dt_bias, dt_min, dt_max, unclamped_ptr, ssm_ptr, page_stride, out_pages_ptr,
                y_ptr, heads, head_dim, CLAMP, HAS_UNCLAMPED,
            )
            x, b, c, dt_raw = x_n, b_n, c_n, dt_n
    else:
        start = tl.load(query_start_ptr + r)
        end = tl.load(query_start_ptr + r + 1)
        for i in range(0, end - start):
            state = ssm_token_step(
                state, start.to(tl.int64) + i, h, g, p, n, pmask, nmask, smask, offs, a,
                d_skip, dt_bias, dt_min, dt_max, x_ptr, x_stride, dt_ptr, dt_stride,
                unclamped_ptr, B_ptr, B_stride, C_ptr, C_stride, ssm_ptr, page_stride,
                out_pages_ptr, y_ptr, heads, head_dim, d_state, CLAMP, HAS_UNCLAMPED,
            )


def ssm_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    ssm_cache: torch.Tensor,
    in_pages: torch.Tensor,
    out_pages: torch.Tensor,
    query_start: torch.Tensor | None = None,
    *,
    dt_bias: torch.Tensor,
    time_step_limit: tuple[float, float] | None = NO_CLAMP_LIMIT,
    unclamped: torch.Tensor | None = None,
    prefetch: bool = False,
    chunk: int = 0,
) -> torch.Tensor:
    """Selective-state recurrence of every row of a step, from and to state pages.

    Args:
        x: ``[T, H, P]`` packed tokens (the head and head-dim axes contiguous).
        dt: ``[T, H]`` raw, as the input projection gives it (any float dtype, head axis
            contiguous): the kernel discretises it in float32,
            ``clamp(softplus(dt + dt_bias), *time_step_limit)``
            (:func:`~hybridserve.kernels.ssd.discretize_dt`'s function).
        A: ``[H]`` (negative); D: ``[H]`` or None.
        B, C: ``[T, G, N]`` (group and state axes contiguous).
        ssm_cache: ``[pages, H, P, N]`` states, contiguous (any float dtype; the
            recurrence runs in float32 and each written state is cast to it).
        in_pages: ``[R]`` int32 page of each row's state before its first token, -1 for
            zeros.
        out_pages: ``[T]`` int32 (``[R, Q]`` for uniform rows also accepted); the state
            after token ``t`` goes to page ``out_pages[t]`` when it is ``>= 0``. Must not
            repeat a page or name an input page.
        query_start: ``[R + 1]`` int32, row ``r`` owns tokens
            ``query_start[r] .. query_start[r + 1]`` (rows may be empty); None for uniform
            rows of ``T / R`` tokens each.
        dt_bias: ``[H]`` added to dt before the softplus.
        time_step_limit: ``(min, max)`` clamp of the discretised dt, None for none.
        unclamped: ``[T]`` bool or None: tokens whose dt skips the clamp (the
            single-token step's exception, :class:`~hybridserve.models.config.MambaParams`).
        prefetch: rows of any length (``query_start`` given) load each token's operands
            one token ahead (``KernelPolicy.token_prefetch``); the same result bit
            for bit. Uniform rows are unrolled and ignore it.
        chunk: rows of any length walk their tokens in chunks of this many (a power of
            two >= 16) as matrix products (:mod:`~hybridserve.kernels.ssm_chunks`,
            ``KernelPolicy.short_row_chunks``): the token walk's values to float32
            rounding; 0 (the default) walks token by token. Uniform rows ignore it.

    Returns:
        ``y [T, H, P]`` float32 (the D skip included, before the gated norm).
    """
    tokens, heads, head_dim = x.shape
    rows, q, outs = _rows(x, in_pages, out_pages, query_start)
    groups, d_state = check_ssm_operands(
        x, dt, B, C, ssm_cache, kernel=True, dt_bias=dt_bias, unclamped=unclamped
    )
    y = torch.empty(tokens, heads, head_dim, dtype=torch.float32, device=x.device)
    if rows == 0 or tokens == 0:
        return y
    in_pages = in_pages.to(torch.int32).contiguous()
    clamp = time_step_limit is not None
    dt_min, dt_max = time_step_limit if clamp else NO_CLAMP_LIMIT
    if chunk and not q:
        # Imported here: that module builds on this one's jitted helpers.
        from hybridserve.kernels import ssm_chunks

        return ssm_chunks.launch(x, dt, dt_bias, dt_min, dt_max, unclamped, A, B, C, D,
                                 ssm_cache, query_start, in_pages,
                                 outs.to(torch.int32).contiguous(), y, groups, d_state,
                                 clamp, chunk)
    block_n = triton.next_power_of_2(d_state)
    # State elements per program: about 2K for uniform rows (enough programs to fill the
    # chip at batch 1), 1K for rows of any length (a single long row still spreads).
    block_p = max(1, min(triton.next_power_of_2(head_dim), (2048 if q else 1024) // block_n))
    grid = (rows, heads, triton.cdiv(head_dim, block_p))
    _ssm_kernel[grid](
        x,
        x.stride(0),
        dt,
        dt.stride(0),
        dt_bias.contiguous(),
        float(dt_min),
        float(dt_max),
        unclamped.contiguous() if unclamped is not None else in_pages,
        A.contiguous(),
        B,
        B.stride(0),
        C,
        C.stride(0),
        D.contiguous() if D is not None else A,
        ssm_cache,
        ssm_cache.stride(0),
        query_start.to(torch.int32).contiguous() if query_start is not None else in_pages,
        in_pages,
        outs.to(torch.int32).contiguous(),
        y,
        heads,
        head_dim,
        d_state,
        heads // groups,
        Q=q,
        HAS_D=D is not None,
        CLAMP=clamp,
        HAS_UNCLAMPED=clamp and unclamped is not None,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        PREFETCH=bool(prefetch) and q == 0,
    )
    return y


@triton.jit
def _conv_ssm_kernel(
    xbc_ptr,
    xbc_stride,
    dt_ptr,
    dt_stride,
    weight_ptr,
    bias_ptr,
    conv_ptr,
    conv_page_stride,
    dt_bias_ptr,
    dt_min,
    dt_max,
    A_ptr,
    D_ptr,
    ssm_ptr,
    page_stride,
    in_pages_ptr,
    out_pages_ptr,
    y_ptr,
    heads,
    head_dim,
    d_state,
    heads_per_group,
    groups,
    Q: tl.constexpr,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    HAS_D: tl.constexpr,
    CLAMP: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program per (row, head, head-dim block), as _ssm_kernel, with the conv in front:
    # the program convolves its own x channels (head h, rows p) and its group's B and C
    # channels from the raw projection, in registers, so the conv output never goes
    # through memory. Every program of a group recomputes the group's B and C (2 N
    # channels, a few percent of its state arithmetic; the inputs are L2-resident); only
    # the group's first program (first head of the group, first head-dim block) writes
    # their windows, so every window element has exactly one writer.
    r, h, g, p, n, pmask, nmask, smask, in_page = ssm_slice(
        in_pages_ptr, head_dim, d_state, heads_per_group, BLOCK_P, BLOCK_N)
    pb = tl.program_id(2)
    inter = heads * head_dim
    cx = h * head_dim + p
    cb = inter + g * d_state + n
    cc = inter + (groups + g) * d_state + n
    owner = ((h % heads_per_group) == 0) & (pb == 0)
    bcmask = nmask & ((n * 0 + owner.to(tl.int32)) != 0)
    conv_in = conv_ptr + tl.maximum(in_page, 0).to(tl.int64) * conv_page_stride
    ty = xbc_ptr.dtype.element_ty
    # Taps and windows (a row without a page starts from zeros).
    xw0, xw1, xw2, xw3, xb = conv_taps(weight_ptr, bias_ptr, cx, pmask, K, HAS_BIAS)
    bw0, bw1, bw2, bw3, bb = conv_taps(weight_ptr, bias_ptr, cb, nmask, K, HAS_BIAS)
    cw0, cw1, cw2, cw3, cbias = conv_taps(weight_ptr, bias_ptr, cc, nmask, K, HAS_BIAS)
    x0, x1, x2 = load_conv_window(conv_in, cx, pmask & ((p * 0 + in_page) >= 0), K)
    b0, b1, b2 = load_conv_window(conv_in, cb, nmask & ((n * 0 + in_page) >= 0), K)
    k0, k1, k2 = load_conv_window(conv_in, cc, nmask & ((n * 0 + in_page) >= 0), K)
    x0 = x0.to(ty).to(tl.float32)
    x1 = x1.to(ty).to(tl.float32)
    x2 = x2.to(ty).to(tl.float32)
    b0 = b0.to(ty).to(tl.float32)
    b1 = b1.to(ty).to(tl.float32)
    b2 = b2.to(ty).to(tl.float32)
    k0 = k0.to(ty).to(tl.float32)
    k1 = k1.to(ty).to(tl.float32)
    k2 = k2.to(ty).to(tl.float32)
    offs, state, a, dt_bias, d_skip = ssm_start(
        in_page, h, p, n, smask, ssm_ptr, page_stride, A_ptr, dt_bias_ptr, D_ptr, head_dim,
        d_state, HAS_D)
    for t in tl.static_range(Q):
        tok = r * Q + t
        row = xbc_ptr + tok * xbc_stride
        xin = tl.load(row + cx, mask=pmask, other=0.0).to(tl.float32)
        bin_ = tl.load(row + cb, mask=nmask, other=0.0).to(tl.float32)
        cin = tl.load(row + cc, mask=nmask, other=0.0).to(tl.float32)
        # The conv outputs are rounded to the inputs' dtype, as the separate conv stores them.
        xt = conv_tap_step(x0, x1, x2, xin, xw0, xw1, xw2, xw3, xb, SILU).to(ty).to(tl.float32)
        bt = conv_tap_step(b0, b1, b2, bin_, bw0, bw1, bw2, bw3, bb, SILU).to(ty).to(tl.float32)
        ct = conv_tap_step(k0, k1, k2, cin, cw0, cw1, cw2, cw3, cbias, SILU).to(ty).to(tl.float32)
        x0, x1, x2 = x1, x2, xin
        b0, b1, b2 = b1, b2, bin_
        k0, k1, k2 = k1, k2, cin
        out_page = tl.load(out_pages_ptr + tok)
        store_conv_window(conv_ptr, out_page, conv_page_stride, cx, pmask, x0, x1, x2, K)
        store_conv_window(conv_ptr, out_page, conv_page_stride, cb, bcmask, b0, b1, b2, K)
        store_conv_window(conv_ptr, out_page, conv_page_stride, cc, bcmask, k0, k1, k2, K)
        state = ssm_token_update(
            state, xt, bt, ct, tl.load(dt_ptr + tok * dt_stride + h).to(tl.float32), tok, h,
            p, pmask, smask, offs, a, d_skip, dt_bias, dt_min, dt_max, dt_ptr, ssm_ptr,
            page_stride, out_pages_ptr, y_ptr, heads, head_dim, CLAMP, False,
        )


def _check_fused(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    weight: torch.Tensor,
    conv_cache: torch.Tensor,
    ssm_cache: torch.Tensor,
    in_pages: torch.Tensor,
    out_pages: torch.Tensor,
) -> tuple[int, int, int]:
    """``(rows, q, groups)`` of :func:`conv_ssm_update`'s operands; raises ValueError on
    shapes that do not fit together."""
    tokens, channels = xbc.shape
    rows, q = _check_pages(in_pages, out_pages, tokens)
    k = weight.shape[-1]
    if weight.shape != (channels, k) or conv_cache.shape[1:] != (channels, k - 1):
        raise ValueError(
            f"weight must be [C={channels}, K] and conv_cache [pages, C, K-1], got "
            f"{tuple(weight.shape)}, {tuple(conv_cache.shape)}"
        )
    if ssm_cache.dim() != 4:
        raise ValueError(f"ssm_cache must be [pages, H, P, N], got {tuple(ssm_cache.shape)}")
    heads, head_dim, d_state = ssm_cache.shape[1:]
    rest = channels - heads * head_dim
    groups = rest // (2 * d_state) if rest > 0 else 0
    if groups == 0 or rest != 2 * groups * d_state or heads % groups:
        raise ValueError(
            f"xbc's {channels} channels must be H * P + 2 * G * N (H={heads}, P={head_dim}, "
            f"N={d_state}) with G dividing H"
        )
    if dt.shape != (tokens, heads):
        raise ValueError(f"dt must be [T={tokens}, H={heads}], got {tuple(dt.shape)}")
    return rows, q, groups


def conv_ssm_update_reference(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    A: torch.Tensor,
    D: torch.Tensor | None,
    conv_cache: torch.Tensor,
    ssm_cache: torch.Tensor,
    in_pages: torch.Tensor,
    out_pages: torch.Tensor,
    activation: str | None = "silu",
    *,
    dt_bias: torch.Tensor,
    time_step_limit: tuple[float, float] | None = NO_CLAMP_LIMIT,
) -> torch.Tensor:
    """Torch twin of :func:`conv_ssm_update`: :func:`conv_decode_update_reference` then
    :func:`ssm_update_reference` on its output's x, B and C (same arguments, same result)."""
    tokens = xbc.shape[0]
    _, _, groups = _check_fused(xbc, dt, weight, conv_cache, ssm_cache, in_pages, out_pages)
    heads, head_dim, d_state = ssm_cache.shape[1:]
    conv = conv_decode_update_reference(
        xbc.contiguous(), weight, bias, conv_cache, in_pages, out_pages, activation
    )
    x, B, C = conv.split([heads * head_dim, groups * d_state, groups * d_state], dim=-1)
    return ssm_update_reference(
        x.reshape(tokens, heads, head_dim),
        dt.contiguous(),
        A,
        B.reshape(tokens, groups, d_state),
        C.reshape(tokens, groups, d_state),
        D,
        ssm_cache,
        in_pages,
        out_pages.reshape(tokens),
        dt_bias=dt_bias,
        time_step_limit=time_step_limit,
    )


def conv_ssm_update(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    A: torch.Tensor,
    D: torch.Tensor | None,
    conv_cache: torch.Tensor,
    ssm_cache: torch.Tensor,
    in_pages: torch.Tensor,
    out_pages: torch.Tensor,
    activation: str | None = "silu",
    *,
    dt_bias: torch.Tensor,
    time_step_limit: tuple[float, float] | None = NO_CLAMP_LIMIT,
    block_p: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """:func:`conv_decode_update` and :func:`ssm_update` of a uniform step in one launch:
    the conv output (x, B, C) stays in registers instead of a round trip through memory.

    Args:
        xbc: ``[R * Q, C]`` raw conv inputs, ``C = H * P + 2 * G * N`` channels in the
            order x, B, C (rows at any stride, channels contiguous: a column slice of the
            input projection).
        dt: ``[R * Q, H]`` raw dt (head axis contiguous), discretised in the kernel as by
            :func:`ssm_update`.
        weight: ``[C, K]`` depthwise taps (``K`` from 2 to 4); bias ``[C]`` or None.
        A: ``[H]``; D: ``[H]`` or None.
        conv_cache: ``[pages, C, K - 1]`` windows; ssm_cache: ``[pages, H, P, N]`` states;
            both contiguous.
        in_pages: ``[R]`` int32 page of each row's window and state, -1 for zeros.
        out_pages: ``[R, Q]`` int32; the window and the state after token ``t`` of row
            ``r`` go to page ``out_pages[r, t]`` when it is ``>= 0``. Must not repeat a
            page or name an input page.
        activation: the conv's (``"silu"`` / ``"swish"`` or None).
        dt_bias, time_step_limit: as for :func:`ssm_update`.
        block_p, num_warps: head-dim rows a program (a power of two; default about 2K
            state elements a program, as :func:`ssm_update`'s) and its warps: the
            benchmarks' tile sweep.

    Returns:
        ``y [R * Q, H, P]`` float32 (the D skip included, before the gated norm). The conv
        output is rounded to ``xbc.dtype`` before the recurrence reads it, as the two
        separate launches store it.
    """
    tokens, channels = xbc.shape
    rows, q, groups = _check_fused(xbc, dt, weight, conv_cache, ssm_cache, in_pages, out_pages)
    heads, head_dim, d_state = ssm_cache.shape[1:]
    k = weight.shape[-1]
    if not 2 <= k <= 4:
        raise ValueError(f"conv_ssm_update takes conv kernels of width 2 to 4, got {k}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r}")
    if xbc.stride(1) != 1 or dt.stride(1) != 1:
        raise ValueError("xbc's channel axis and dt's head axis must be contiguous")
    if not (conv_cache.is_contiguous() and ssm_cache.is_contiguous() and weight.is_contiguous()):
        raise ValueError("conv_cache, ssm_cache and weight must be contiguous")
    y = torch.empty(tokens, heads, head_dim, dtype=torch.float32, device=xbc.device)
    if rows == 0:
        return y
    block_n = triton.next_power_of_2(d_state)
    if block_p is None:
        # The state slice of ssm_update's uniform rows (about 2K elements a program).
        block_p = max(1, min(triton.next_power_of_2(head_dim), 2048 // block_n))
    if block_p < 1 or block_p & (block_p - 1):
        raise ValueError(f"block_p must be a power of two, got {block_p}")
    grid = (rows, heads, triton.cdiv(head_dim, block_p))
    clamp = time_step_limit is not None
    dt_min, dt_max = time_step_limit if clamp else NO_CLAMP_LIMIT
    _conv_ssm_kernel[grid](
        xbc,
        xbc.stride(0),
        dt,
        dt.stride(0),
        weight,
        bias if bias is not None else weight,
        conv_cache,
        conv_cache.stride(0),
        dt_bias.contiguous(),
        float(dt_min),
        float(dt_max),
        A.contiguous(),
        D.contiguous() if D is not None else A,
        ssm_cache,
        ssm_cache.stride(0),
        in_pages.to(torch.int32).contiguous(),
        out_pages.to(torch.int32).contiguous(),
        y,
        heads,
        head_dim,
        d_state,
        heads // groups,
        groups,
        Q=q,
        K=k,
        HAS_BIAS=bias is not None,
        SILU=activation is not None,
        HAS_D=D is not None,
        CLAMP=clamp,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return y
