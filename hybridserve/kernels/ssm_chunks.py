"""The selective-state recurrence over rows of any length in chunks of tokens.

:func:`~hybridserve.kernels.mamba_decode.ssm_update` over a step's short rows (the tail
after a cached prefix, a short prompt, decode rows beside them) walks each row token by
token: every token's update waits for the previous one, so a 128-token tail costs 128
dependent rounds of loads and a ``[P, N]`` update in every program, however few the
FLOPs. Here a program walks its row in chunks of ``CHUNK`` tokens and does each chunk
as matrix products (the SSD form of the same recurrence), so the dependent rounds are
``tokens / CHUNK``. For a chunk of tokens ``0 .. L-1`` after state ``S`` (``[P, N]`` of
one head), with ``c_i`` the cumulative log decay ``sum_{k<=i} dt_k A``:

- ``y_i = exp(c_i) C_i S^T + sum_{j<=i} exp(c_i - c_j) dt_j (C_i . B_j) x_j + D x_i``;
- ``S' = exp(c_{L-1}) S + sum_j exp(c_{L-1} - c_j) dt_j x_j B_j^T``.

The token walk's values up to float32 rounding: the products are float32-exact (IEEE
FMA, or three TF32 tensor-core products a dot where the GPU has them: no plain TF32),
and each span's decay ``c_i - c_j`` is summed from its own terms (a
difference of two long cumulative sums would carry their rounding into every decay). A chunk ends at
``CHUNK`` tokens, at its row's end, or at the first token whose state is asked for
(``out_pages[t] >= 0``), so every requested state is a chunk's end state, stored as the
token walk stores it.

The contract is :func:`~hybridserve.kernels.mamba_decode.ssm_update`'s (its ``chunk``
argument); the twin is :func:`~hybridserve.kernels.mamba_decode.ssm_update_reference`.
Each program owns one (row, head, head-dim block) slice of the state: it reads the
row's input page and writes only the row's output pages, as the token walk does.
"""

import torch
import triton
import triton.language as tl

from hybridserve.kernels.mamba_decode import softplus, ssm_program, store_state_page

# Tokens a chunk holds at most: tl.dot needs every dimension >= 16.
SHORT_ROW_CHUNK = 16
MIN_BLOCK = 16
# Head-dim rows a program: on the H200 32 beat 16 and 64 (``short_rows.json``).
BLOCK_P = 32


def chunk_dots(device: torch.device) -> str:
    """The chunk's products on ``device``: "tf32x3" (three TF32 tensor-core products a
    dot, float32's accuracy) where tensor cores take TF32 (compute capability 8.0 on),
    else IEEE float32 FMA. On the H200 (8B tail, ``short_rows.json``) "tf32x3" took 128
    against 272 us for a 128-token tail and 556 against 1,245 us for 1,024 tokens, with
    a relative error against float64 of 2.3e-7 (IEEE 1.2e-7, the token walk 1.2e-7)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
        return "tf32x3"
    return "ieee"


@triton.jit
def _ssm_chunks_kernel(
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
    HAS_D: tl.constexpr,
    CLAMP: tl.constexpr,
    HAS_UNCLAMPED: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
    DOTS: tl.constexpr,
):
    # One program per (row, head, head-dim block), as the token walk.
    r, h, g, p, n, pmask, nmask, smask, offs, state, a, dt_bias, d_skip = ssm_program(
        in_pages_ptr, ssm_ptr, page_stride, A_ptr, dt_bias_ptr, D_ptr, head_dim, d_state,
        heads_per_group, HAS_D, BLOCK_P, BLOCK_N)
    j = tl.arange(0, CHUNK)
    causal = j[None, :] <= j[:, None]
    tok = tl.load(query_start_ptr + r).to(tl.int64)
    end = tl.load(query_start_ptr + r + 1).to(tl.int64)
    while tok < end:
        t = tok + j
        # The chunk's last token: the first whose state is asked for, else the row's last
        # or the tile's.
        outp = tl.load(out_pages_ptr + t, mask=t < end, other=-1)
        last = tl.min(tl.where((outp >= 0) | (t == end - 1), j, CHUNK - 1), axis=0)
        inc = j <= last
        pm = inc[:, None] & pmask[None, :]
        nm = inc[:, None] & nmask[None, :]
        x = tl.load(x_ptr + t[:, None] * x_stride + h * head_dim + p[None, :], mask=pm,
                    other=0.0).to(tl.float32)
        b = tl.load(B_ptr + t[:, None] * B_stride + g * d_state + n[None, :], mask=nm,
                    other=0.0).to(tl.float32)
        c = tl.load(C_ptr + t[:, None] * C_stride + g * d_state + n[None, :], mask=nm,
                    other=0.0).to(tl.float32)
        # dt discretised in float32 from the projection's value, token by token as the
        # walk does; zero past the chunk, so those tokens neither decay nor add.
        dt = softplus(tl.load(dt_ptr + t * dt_stride + h, mask=inc, other=0.0).to(tl.float32)
                      + dt_bias)
        if CLAMP:
            clamped = tl.minimum(tl.maximum(dt, dt_min), dt_max)
            if HAS_UNCLAMPED:
                dt = tl.where(tl.load(unclamped_ptr + t, mask=inc, other=0) != 0, dt, clamped)
            else:
                dt = clamped
        dt = tl.where(inc, dt, 0.0)
        la = dt * a
        cum = tl.cumsum(la, axis=0)
        # Decays over spans inside the chunk as direct sums of their own terms
        # (seg[i, k] = sum of la over k < . <= i), never as differences of cumulative
        # sums: those lose |cum| * eps of each span's log decay. The j > i entries are
        # masked to -inf before the exp, so they never overflow.
        seg = tl.cumsum(tl.where(j[:, None] > j[None, :], la[:, None], 0.0), axis=0)
        decay = tl.exp(tl.where(causal, seg, float("-inf")))
        # Each token's decay to the chunk's end: the last row of seg (la is 0 past it).
        to_end = tl.sum(tl.where(j[:, None] == CHUNK - 1, seg, 0.0), axis=0)
        total = tl.sum(la, axis=0)
        cb = tl.dot(c, tl.trans(b), input_precision=DOTS)
        y = tl.dot(c, tl.trans(state), input_precision=DOTS) * tl.exp(cum)[:, None]
        y += tl.dot(cb * decay * dt[None, :], x, input_precision=DOTS)
        y += d_skip * x
        tl.store(y_ptr + t[:, None] * heads * head_dim + h * head_dim + p[None, :], y, mask=pm)
        w = tl.exp(to_end) * dt
        state = state * tl.exp(total) + tl.dot(tl.trans(x * w[:, None]), b,
                                               input_precision=DOTS)
        store_state_page(state, tok + last, offs, smask, ssm_ptr, page_stride, out_pages_ptr)
        tok += last + 1


def launch(x, dt, dt_bias, dt_min, dt_max, unclamped, A, B, C, D, ssm_cache, query_start,
           in_pages, out_pages, y, groups, d_state, clamp, chunk, dots=None,
           block_p=BLOCK_P, num_warps=4):
    """Launch :func:`_ssm_chunks_kernel` on operands that
    :func:`~hybridserve.kernels.mamba_decode.ssm_update` has checked (rows of any length:
    ``query_start`` given; ``y`` float32 ``[T, H, P]`` to fill). ``dots`` (None:
    :func:`chunk_dots`), ``block_p`` (head-dim rows a program, a power of two >= 16) and
    ``num_warps``: what ``benchmarks/bench_short_rows.py`` sweeps; the defaults are the
    engine's."""
    dots = dots or chunk_dots(x.device)
    if chunk < MIN_BLOCK or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= {MIN_BLOCK}, got {chunk}")
    tokens, heads, head_dim = x.shape
    rows = in_pages.shape[0]
    block_n = max(MIN_BLOCK, triton.next_power_of_2(d_state))
    if block_p < MIN_BLOCK or block_p & (block_p - 1):
        raise ValueError(f"block_p must be a power of two >= {MIN_BLOCK}, got {block_p}")
    if dots not in ("ieee", "tf32x3"):
        raise ValueError(f"dots must be 'ieee' or 'tf32x3' (float32-exact), got {dots!r}")
    grid = (rows, heads, triton.cdiv(head_dim, block_p))
    _ssm_chunks_kernel[grid](
        x, x.stride(0), dt, dt.stride(0), dt_bias.contiguous(), float(dt_min), float(dt_max),
        unclamped.contiguous() if unclamped is not None else in_pages, A.contiguous(), B,
        B.stride(0), C, C.stride(0), D.contiguous() if D is not None else A, ssm_cache,
        ssm_cache.stride(0), query_start.to(torch.int32).contiguous(), in_pages, out_pages,
        y, heads, head_dim, d_state, heads // groups,
        HAS_D=D is not None, CLAMP=clamp, HAS_UNCLAMPED=clamp and unclamped is not None,
        BLOCK_P=block_p, BLOCK_N=block_n, CHUNK=chunk, DOTS=dots, num_warps=num_warps,
    )
    return y
