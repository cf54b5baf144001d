"""Causal depthwise conv1d of the Mamba2 mixer over a packed step of variable-length rows.

The prefill / mixed-step counterpart of :func:`~hybridserve.kernels.mamba_decode.conv_decode_update`.
Row ``i`` of the step owns tokens ``query_start[i] .. query_start[i + 1]`` of the packed
input ``xbc [T, C]`` (rows may be empty). Its conv starts from the window on page
``in_pages[i]`` of ``conv_cache [pages, C, K - 1]`` (oldest input first, the layout of
:mod:`hybridserve.kernels.conv1d`), or from zeros when the page is -1. Output token ``t``
of a row is ``act(bias + sum_k weight[:, k] * xp[t + k])`` over the row's padded input
``xp = concat(window, row inputs)``: exactly :func:`~hybridserve.kernels.conv1d.causal_conv1d_reference`
row by row.

Given ``out_pages [T]``, the conv also stores the window after every token that has an
output page: the last ``K - 1`` conv inputs up to and including that token, oldest first,
the oldest ones from the row's initial window (cast to the input dtype, as the per-row
reference concatenates them) when the row has fewer tokens; copies, bit for bit the
windows the per-row reference returns. Output pages never repeat and are never input
pages (the page rule of docs/state-lifecycle.md), so the launch that reads the initial
windows may write them.

- :func:`conv_varlen`: two Triton launches for the conv, and one for the windows when a
  window is asked for. The conv of every token at least ``K - 1`` tokens into its row
  (one program per (token block, channel block) tile; its taps are packed inputs only, so
  it carries no window gather and few registers; or, asked for and ``K == 4``, one
  program per (span of tokens, channel block), walking its span token by token with the
  last three inputs in registers, so each input is loaded once: the tiles' bits) and the conv
  of each row's first ``K - 1`` tokens (one program per (row, channel block), taps from
  the initial window).
  The windows, given ``out_pages``, take one of two writers:

  - the slab writer, given ``window_tokens`` (the ``[W]`` tokens that have an output
    page, which the step plan knows on the host and uploads with its other index
    tensors): one program per (window token, block of entries of its page), each storing
    one contiguous run of the page's ``[C, K - 1]`` entries (flattened
    ``c * (K - 1) + i``: consecutive addresses); no launch at all when ``W == 0``, so a
    step asks for its windows at the cost of the windows alone;
  - the full-grid writer, without ``window_tokens`` (a CUDA-graph step, whose pages are
    filled into a static buffer per replay: its grid is fixed at capture, and a window
    list's length varies per step with no bound per row): one program per conv tile,
    which stops after reading its tokens' pages when none has one, and stores each
    window entry of a channel at stride ``K - 1``. Graph steps are short rows, where
    these tiles are few.

  Each program writes only its own entries of the output (a separate buffer, never the
  input) or of its tokens' output pages, and reads only inputs (``xbc``, ``weight``,
  ``bias``, the initial windows and the index tensors), so no program reads what another
  writes (the race rule, docs/racecheck.md). A token block may span several rows: every
  token looks its row up in ``token_row``.
- :func:`conv_varlen_reference`: its torch twin (the CPU path and the test oracle), the
  per-row reference loop.

Index tensors (``query_start``, ``in_pages``, ``token_row``, ``out_pages``,
``window_tokens``) are integer tensors on the device of ``xbc``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hybridserve.kernels.conv1d import causal_conv1d_reference

__all__ = ["conv_varlen", "conv_varlen_reference", "token_rows", "window_token_list"]

# The conv's walk of a row's inner tokens (conv_varlen's ``walk``). On the H200 (8 x 4,096 tokens of
# the 8B conv, ``prefill_conv_walks.json``) the token walk with these defaults took
# 0.608 / 0.674 / 0.640 / 0.701 ms against the tiles' 0.623 / 0.693 / 0.676 / 0.715 ms
# (no window asked, the window mode with none, windows at row ends, every 64 tokens),
# and its `gpu` test holds it to the tiles' bits; but on a 128-token tail its few long
# programs took 0.76 ms over the 8B shape's 24 layers against the tiles' 0.11 ms
# (``gpu_bench_ttft_2c9bc15.json``). The tiles stay the default until a rule by the
# step's size is measured.
CONV_WALK = "tiles"
# The token walk's span (tokens a program), channels a program and warps.
TOKEN_WALK_SPAN = 64
TOKEN_WALK_CHANNELS = 256
TOKEN_WALK_WARPS = 2


def _check(
    xbc: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_cache: torch.Tensor,
    query_start: torch.Tensor,
    in_pages: torch.Tensor,
    activation: str | None,
    out_pages: torch.Tensor | None = None,
    window_tokens: torch.Tensor | None = None,
) -> int:
    tokens, channels = xbc.shape
    if out_pages is not None and out_pages.shape != (tokens,):
        raise ValueError(f"out_pages must be [T={tokens}], got {tuple(out_pages.shape)}")
    if window_tokens is not None and (out_pages is None or window_tokens.dim() != 1):
        raise ValueError(
            "window_tokens must be a [W] list of the tokens that have an output page, and "
            f"needs out_pages; got {tuple(window_tokens.shape)} with out_pages "
            f"{'None' if out_pages is None else 'given'}"
        )
    k = weight.shape[-1]
    if weight.shape != (channels, k) or conv_cache.shape[1:] != (channels, k - 1):
        raise ValueError(
            f"weight must be [C={channels}, K] and conv_cache [pages, C, K-1], got "
            f"{tuple(weight.shape)}, {tuple(conv_cache.shape)}"
        )
    if bias is not None and bias.shape != (channels,):
        raise ValueError(f"bias must be [C={channels}], got {tuple(bias.shape)}")
    rows = in_pages.shape[0]
    if in_pages.dim() != 1 or query_start.shape != (rows + 1,):
        raise ValueError(
            f"in_pages must be [B] and query_start [B + 1], got {tuple(in_pages.shape)}, "
            f"{tuple(query_start.shape)}"
        )
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r}; expected 'silu' or None")
    return rows


def _output(xbc: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(xbc.shape, dtype=xbc.dtype, device=xbc.device)
    if out.shape != xbc.shape or out.dtype != xbc.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(xbc.shape)} {xbc.dtype} tensor")
    if out.untyped_storage().data_ptr() == xbc.untyped_storage().data_ptr():
        raise ValueError("out must not share storage with xbc: the conv is never in place")
    return out


def window_token_list(out_pages: Sequence[int]) -> list[int]:
    """The host list ``window_tokens`` of :func:`conv_varlen` for the host ``out_pages
    [T]``: every token that has an output page (``>= 0``), ascending."""
    return [t for t, page in enumerate(out_pages) if page >= 0]


def token_rows(query_start: torch.Tensor, tokens: int) -> torch.Tensor:
    """``[T]`` int64: the row of every packed token (empty rows own none). No host sync."""
    return torch.searchsorted(
        query_start[1:].to(torch.int64),
        torch.arange(tokens, device=query_start.device),
        right=True,
    )


# --------------------------------------------------------------------------------------
# Torch twin and the windows
# --------------------------------------------------------------------------------------


def conv_varlen_reference(
    xbc: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_cache: torch.Tensor,
    query_start: torch.Tensor,
    in_pages: torch.Tensor,
    activation: str | None = "silu",
    token_row: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_pages: torch.Tensor | None = None,
    window_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch twin of :func:`conv_varlen` (same arguments, same result): the per-row loop.
    Every initial window is read before any page is written. ``window_tokens``, when
    given, must be :func:`window_token_list` of ``out_pages`` (checked here)."""
    rows = _check(xbc, weight, bias, conv_cache, query_start, in_pages, activation, out_pages,
                  window_tokens)
    del token_row  # the loop knows every row's tokens
    starts = query_start.tolist()
    pages = in_pages.tolist()
    outs = out_pages.tolist() if out_pages is not None else [-1] * xbc.shape[0]
    if window_tokens is not None and window_tokens.tolist() != window_token_list(outs):
        raise ValueError(
            "window_tokens must list every token with an output page, ascending, each once: "
            f"got {window_tokens.tolist()} for out_pages {outs}"
        )
    if starts[-1] != xbc.shape[0]:
        raise ValueError(f"query_start ends at {starts[-1]}, xbc has {xbc.shape[0]} tokens")
    out = _output(xbc, out)
    writes = []
    for i in range(rows):
        s, e = starts[i], starts[i + 1]
        if e == s:
            continue
        window = conv_cache[pages[i]] if pages[i] >= 0 else None
        offsets = [t - s for t in range(s, e) if outs[t] >= 0]
        out[s:e], windows = causal_conv1d_reference(
            xbc[s:e], weight, bias, window, activation, offsets
        )
        writes += [(outs[s + off], w) for off, w in zip(offsets, windows)]
    for page, window in writes:
        conv_cache[page] = window.to(conv_cache.dtype)
    return out


# --------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------


@triton.jit
def _conv_varlen_kernel(
    xbc_ptr,
    xbc_stride,
    weight_ptr,
    bias_ptr,
    query_start_ptr,
    token_row_ptr,
    out_ptr,
    tokens,
    channels,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # One program per (token block, channel block): every token K - 1 or more tokens
    # into its row, whose taps are all packed inputs. The first K - 1 tokens of each row
    # (taps in the initial window) are _conv_row_start_kernel's; this kernel has no
    # gather of windows, so it keeps few registers.
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tmask = tok < tokens
    cmask = c < channels
    row = tl.load(token_row_ptr + tok, mask=tmask, other=0)
    t = tok - tl.load(query_start_ptr + row, mask=tmask, other=0)  # offset within the row
    inner = tmask & (t >= K - 1)
    mask = inner[:, None] & cmask[None, :]
    tok64 = tok.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(K):
        xv = tl.load(xbc_ptr + (tok64 - (K - 1 - k))[:, None] * xbc_stride + c[None, :],
                     mask=mask, other=0.0)
        w = tl.load(weight_ptr + c * K + k, mask=cmask, other=0.0).to(tl.float32)
        acc += xv.to(tl.float32) * w[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + tok64[:, None] * channels + c[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _conv_token_walk_kernel(
    xbc_ptr,
    xbc_stride,
    weight_ptr,
    bias_ptr,
    query_start_ptr,
    token_row_ptr,
    out_ptr,
    tokens,
    channels,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # _conv_varlen_kernel's outputs (K = 4), one program per (span of BLOCK_T tokens,
    # channel block) walking its span token by token with the last three inputs in
    # registers: each input is loaded once (a tile loads each of its rows K times,
    # shifted), plus three before the span. The taps are summed in the tile kernel's
    # order, so every output has its bits. Tokens fewer than three into their row are
    # computed here from other rows' inputs and never stored (_conv_row_start_kernel's).
    t0 = tl.program_id(0) * BLOCK_T
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < channels
    col = xbc_ptr + c
    w0 = tl.load(weight_ptr + c * 4, mask=cmask, other=0.0).to(tl.float32)
    w1 = tl.load(weight_ptr + c * 4 + 1, mask=cmask, other=0.0).to(tl.float32)
    w2 = tl.load(weight_ptr + c * 4 + 2, mask=cmask, other=0.0).to(tl.float32)
    w3 = tl.load(weight_ptr + c * 4 + 3, mask=cmask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    # Inputs t0 - 3, t0 - 2, t0 - 1 (oldest first); before the first token: zeros, never
    # used by a stored output.
    base = t0.to(tl.int64)
    first = c * 0 + t0  # the span's first token, per lane
    a = tl.load(col + (base - 3) * xbc_stride, mask=cmask & (first >= 3), other=0.0)
    b = tl.load(col + (base - 2) * xbc_stride, mask=cmask & (first >= 2), other=0.0)
    d = tl.load(col + (base - 1) * xbc_stride, mask=cmask & (first >= 1), other=0.0)
    a, b, d = a.to(tl.float32), b.to(tl.float32), d.to(tl.float32)
    for i in range(0, BLOCK_T):
        tok64 = base + i
        live = tok64 < tokens
        lanes = cmask & (first + i < tokens)  # the same test, per lane
        x = tl.load(col + tok64 * xbc_stride, mask=lanes, other=0.0).to(tl.float32)
        row = tl.load(token_row_ptr + tok64, mask=live, other=0)
        offset = tok64 - tl.load(query_start_ptr + row, mask=live, other=0)
        inner = lanes & (c * 0 + offset >= 3)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        acc += bias
        acc += a * w0
        acc += b * w1
        acc += d * w2
        acc += x * w3
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + tok64 * channels + c, acc.to(out_ptr.dtype.element_ty), mask=inner)
        a = b
        b = d
        d = x


@triton.jit
def _conv_tap(xbc_ptr, xbc_stride, conv_ptr, page_stride, tok64, c, mask, t, page, back,
              K: tl.constexpr):
    """The conv input ``back`` tokens before each token of the tile, in the input dtype:
    the packed input inside the row, else entry ``(K - 1) + (offset in row) - back`` of
    the row's initial window (zeros without a page), cast to the input dtype as the
    reference concatenates it."""
    src = t - back
    in_row = src >= 0
    xv = tl.load(
        xbc_ptr + (tok64 - back)[:, None] * xbc_stride + c[None, :],
        mask=mask & in_row[:, None],
        other=0.0,
    )
    wv = tl.load(
        conv_ptr + page[:, None] * page_stride + c[None, :] * (K - 1) + (src + K - 1)[:, None],
        mask=mask & ((src < 0) & (page >= 0))[:, None],
        other=0.0,
    )
    return tl.where(in_row[:, None], xv, wv.to(xbc_ptr.dtype.element_ty))


@triton.jit
def _conv_row_start_kernel(
    xbc_ptr,
    xbc_stride,
    weight_ptr,
    bias_ptr,
    conv_ptr,
    page_stride,
    query_start_ptr,
    in_pages_ptr,
    out_ptr,
    channels,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # One program per (row, channel block): the row's first K - 1 tokens (fewer in a
    # shorter row), whose taps reach into the row's initial window.
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < channels
    s = tl.load(query_start_ptr + r).to(tl.int64)
    e = tl.load(query_start_ptr + r + 1).to(tl.int64)
    t = tl.arange(0, BLOCK_K)
    tmask = (t < K - 1) & (s + t < e)
    mask = tmask[:, None] & cmask[None, :]
    page = tl.load(in_pages_ptr + r + t * 0).to(tl.int64)  # the row's page, per token
    tok64 = s + t
    acc = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(K):
        v = _conv_tap(xbc_ptr, xbc_stride, conv_ptr, page_stride, tok64, c, mask, t, page,
                      K - 1 - k, K).to(tl.float32)
        w = tl.load(weight_ptr + c * K + k, mask=cmask, other=0.0).to(tl.float32)
        acc += v * w[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + tok64[:, None] * channels + c[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _conv_windows_kernel(
    xbc_ptr,
    xbc_stride,
    conv_ptr,
    page_stride,
    query_start_ptr,
    token_row_ptr,
    in_pages_ptr,
    out_pages_ptr,
    tokens,
    channels,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # The full-grid writer (steps whose window tokens the host does not know: graph
    # steps). One program per (token block, channel block) writes the window after each
    # of its tokens that has an output page; a block without one stops after reading its
    # pages. Entry i of the window after token t is the input K - 2 - i tokens back, from
    # the row or from its initial window, cast as the reference casts.
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < tokens
    out_page = tl.load(out_pages_ptr + tok, mask=tmask, other=-1).to(tl.int64)
    if tl.max(out_page) >= 0:
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < channels
        row = tl.load(token_row_ptr + tok, mask=tmask, other=0)
        t = tok - tl.load(query_start_ptr + row, mask=tmask, other=0)
        page = tl.load(in_pages_ptr + row, mask=tmask, other=-1).to(tl.int64)
        wmask = (tmask & (out_page >= 0))[:, None] & cmask[None, :]
        tok64 = tok.to(tl.int64)
        for i in tl.static_range(K - 1):
            v = _conv_tap(xbc_ptr, xbc_stride, conv_ptr, page_stride, tok64, c, wmask, t, page,
                          K - 2 - i, K)
            tl.store(
                conv_ptr + out_page[:, None] * page_stride + c[None, :] * (K - 1) + i,
                v.to(conv_ptr.dtype.element_ty),
                mask=wmask,
            )


@triton.jit
def _conv_window_slabs_kernel(
    xbc_ptr,
    xbc_stride,
    conv_ptr,
    page_stride,
    query_start_ptr,
    token_row_ptr,
    in_pages_ptr,
    out_pages_ptr,
    window_tokens_ptr,
    channels,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per (window token, block of BLOCK entries of its page): the page is
    # [C, K - 1] contiguous, so entry j = c * (K - 1) + i of the flattened page is entry i
    # of channel c's window, and a program stores BLOCK consecutive addresses (one
    # coalesced slab) where the full-grid writer stores every entry i at stride K - 1.
    # Entry i is the input K - 2 - i tokens back: in the row (a packed input) or entry
    # t + 1 + i of channel c's initial window (zeros without a page), cast to the input
    # dtype as the reference concatenates it.
    tok = tl.load(window_tokens_ptr + tl.program_id(0)).to(tl.int64)
    out_page = tl.load(out_pages_ptr + tok).to(tl.int64)
    if out_page >= 0:
        row = tl.load(token_row_ptr + tok)
        t = tok - tl.load(query_start_ptr + row).to(tl.int64)  # offset within the row
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = j < channels * (K - 1)
        # The row's page, per entry (a mask of vectors only).
        page = tl.load(in_pages_ptr + row + j * 0).to(tl.int64)
        c = j // (K - 1)
        back = K - 2 - (j - c * (K - 1))
        in_row = t >= back
        xv = tl.load(xbc_ptr + (tok - back) * xbc_stride + c, mask=mask & in_row, other=0.0)
        wv = tl.load(conv_ptr + page * page_stride + j + (t + 1),
                     mask=mask & (t < back) & (page >= 0), other=0.0)
        v = tl.where(in_row, xv, wv.to(xbc_ptr.dtype.element_ty))
        tl.store(conv_ptr + out_page * page_stride + j, v.to(conv_ptr.dtype.element_ty),
                 mask=mask)


def conv_varlen(
    xbc: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_cache: torch.Tensor,
    query_start: torch.Tensor,
    in_pages: torch.Tensor,
    activation: str | None = "silu",
    token_row: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_pages: torch.Tensor | None = None,
    window_tokens: torch.Tensor | None = None,
    *,
    block_t: int | None = None,
    block_c: int | None = None,
    num_warps: int | None = None,
    window_block: int = 1024,
    walk: str | None = None,
) -> torch.Tensor:
    """Causal depthwise conv of every row of a packed step, each from its initial window.

    Args:
        xbc: ``[T, C]`` conv inputs, packed rows (channel axis contiguous).
        weight: ``[C, K]`` depthwise kernel, contiguous; bias: ``[C]`` or None.
        conv_cache: ``[pages, C, K - 1]`` windows (oldest input first), contiguous; only
            read, except the pages ``out_pages`` names.
        query_start: ``[B + 1]`` integer, row ``i`` owns tokens
            ``query_start[i] .. query_start[i + 1]``; ``query_start[B] == T``.
        in_pages: ``[B]`` integer page of each row's initial window, -1 for zeros.
        activation: ``"silu"`` / ``"swish"`` or None, applied to the outputs.
        token_row: ``[T]`` integer row of every token (:func:`token_rows`); computed
            when None.
        out: ``[T, C]`` buffer for the result (contiguous, not sharing storage with
            ``xbc``); allocated when None.
        out_pages: ``[T]`` integer or None; the window after token ``t`` (module
            docstring) is written to page ``out_pages[t]`` when that is ``>= 0``. Must not
            repeat a page or name an input page (then no program reads what another
            writes).
        window_tokens: ``[W]`` integer, :func:`window_token_list` of ``out_pages`` on the
            device (the step plan uploads it with its other index tensors), or None when
            the host does not know the pages (a CUDA-graph step, filled per replay). Given,
            the windows take one program per (window token, ``window_block`` entries of
            its page), and none at all when ``W == 0``; None, the full-grid writer (one
            program per conv tile, module docstring). A token with a page that the list
            leaves out gets no window; the list must not repeat a token.
        block_t, block_c: tile of one program (powers of two; None: the walk's
            default); num_warps: the warps of the conv's program (None: 4 for the
            tiles, :data:`TOKEN_WALK_WARPS` for the token walk);
            window_block: the page entries of one window program (a power of two).
        walk: how the conv's programs cover the tokens at least ``K - 1`` into their
            row: ``"tiles"`` (a ``block_t x block_c`` tile, each tap a shifted load) or
            ``"tokens"`` (``K == 4`` only: a span of ``block_t`` tokens walked one by
            one, the last inputs in registers, each input loaded once); the same bits
            either way. None: :data:`CONV_WALK`.

    Returns:
        ``out [T, C]`` in ``xbc.dtype`` (accumulated in float32).
    """
    _check(xbc, weight, bias, conv_cache, query_start, in_pages, activation, out_pages,
           window_tokens)
    tokens, channels = xbc.shape
    if xbc.stride(1) != 1 or not conv_cache.is_contiguous() or not weight.is_contiguous():
        raise ValueError("xbc rows, conv_cache and weight must be contiguous")
    out = _output(xbc, out)
    if tokens == 0:
        return out
    if token_row is None:
        token_row = token_rows(query_start, tokens)
    k = weight.shape[-1]
    walk = CONV_WALK if walk is None else walk
    if walk not in ("tiles", "tokens"):
        raise ValueError(f"walk must be 'tiles' or 'tokens', got {walk!r}")
    if k != 4:
        walk = "tiles"
    # The token walk's span is the tile kernel's token block; the window writers keep
    # the tile kernel's tile.
    span, walk_c = (block_t or TOKEN_WALK_SPAN, block_c or TOKEN_WALK_CHANNELS)
    block_c = min(block_c or 128, triton.next_power_of_2(channels))
    block_t = min(block_t or 32, triton.next_power_of_2(tokens))
    bias_arg = bias if bias is not None else weight
    # 4 warps: on the H200 a 32 x 128 tile took 0.68 ms over 8 x 4,096 tokens of the
    # 10,240-channel conv against 1.03 ms with 8 (prefill_kernels.json); the extra
    # registers a thread (122 against 70) cost less than the halved occupancy.
    default_warps = TOKEN_WALK_WARPS if walk == "tokens" else 4
    warps = {"num_warps": default_warps if num_warps is None else num_warps}
    query_start = query_start.contiguous()
    token_row = token_row.contiguous()
    in_pages = in_pages.contiguous()
    if walk == "tokens":
        walk_c = min(walk_c, triton.next_power_of_2(channels))
        _conv_token_walk_kernel[(triton.cdiv(tokens, span), triton.cdiv(channels, walk_c))](
            xbc, xbc.stride(0), weight, bias_arg, query_start, token_row, out, tokens,
            channels, HAS_BIAS=bias is not None, SILU=activation is not None,
            BLOCK_T=span, BLOCK_C=walk_c, **warps,
        )
    else:
        _conv_varlen_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(channels, block_c))](
            xbc, xbc.stride(0), weight, bias_arg, query_start, token_row, out, tokens,
            channels, K=k, HAS_BIAS=bias is not None, SILU=activation is not None,
            BLOCK_T=block_t, BLOCK_C=block_c, **warps,
        )
    rows = in_pages.shape[0]
    if k > 1 and rows:
        _conv_row_start_kernel[(rows, triton.cdiv(channels, block_c))](
            xbc, xbc.stride(0), weight, bias_arg, conv_cache, conv_cache.stride(0),
            query_start, in_pages, out, channels,
            K=k, HAS_BIAS=bias is not None, SILU=activation is not None,
            BLOCK_K=triton.next_power_of_2(k - 1), BLOCK_C=block_c,
        )
    if out_pages is None or k == 1:
        return out
    # The windows are a launch of their own: their gathers would cost the conv's tiles
    # registers.
    if window_tokens is None:
        # Pages known only on the device: every conv tile looks for its tokens' pages.
        _conv_windows_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(channels, block_c))](
            xbc, xbc.stride(0), conv_cache, conv_cache.stride(0), query_start, token_row,
            in_pages, out_pages.contiguous(), tokens, channels,
            K=k, BLOCK_T=block_t, BLOCK_C=block_c,
        )
    elif window_tokens.numel():
        block = min(window_block, triton.next_power_of_2(channels * (k - 1)))
        _conv_window_slabs_kernel[(window_tokens.numel(), triton.cdiv(channels * (k - 1), block))](
            xbc, xbc.stride(0), conv_cache, conv_cache.stride(0), query_start, token_row,
            in_pages, out_pages.contiguous(), window_tokens.contiguous(), channels,
            K=k, BLOCK=block,
        )
    return out
