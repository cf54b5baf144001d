"""The sampler's draws in one pass over the vocabulary: counter-based Gumbel-max without
an ``[N, vocab]`` table.

:func:`draw` computes what :func:`hybridserve.runner.sampler.draw` (its torch twin, the
CPU path and the test oracle) computes: per row ``i`` of ``logp [N, vocab]``, the argmax
of ``logp[i]`` where ``greedy[i]``, else the argmax of the Gumbel keys
``logp[i, t] - log(-log u(i, t))`` with ``u`` the counter-based uniforms of
:func:`hybridserve.runner.sampler.uniforms`. The twin materialises the uniforms as an
``[N, vocab]`` int64 table (three keyed rounds of integer mixing, about thirty full-table
elementwise ops) and then a float64 key table: gigabytes of memory traffic at decode
batch sizes for a result of ``N`` tokens. Here each token's uniform is hashed in
registers, its key formed and folded into a running maximum, so the launch reads
``logp`` once and writes a few numbers per row.

:func:`residual_draw` does the same for the residual sample of speculative sampling with
a drafter's distribution (the twin: the rejected branch of
:func:`hybridserve.runner.sampler.speculative_choices`): ``r = max(exp(logp) -
exp(logq), 0)`` in float64 per token (``exp`` as ``log`` below: NumPy's under the
interpreter, libdevice's ``__nv_exp`` compiled), the keys of ``r`` and of the twin's
fallback ``p`` (taken where ``r`` has no positive entry or a NaN, the twin's ``sum > 0``
test) both folded, and the choice made per row after the launch. :func:`uniforms` writes
the uniform (or ``log(-log u)``) table itself, bit-identical to the twin's: no engine
path needs the table any more; it is the hash's direct check.

Contract (bit-for-bit with the twin):

- The hash is the twin's: the three round keys of a position come from its seed words
  and index by the same chain of ``_mix`` rounds (computed per program in int64, the
  twin's arithmetic, so even out-of-contract seed words give its keys), then three keyed
  rounds over the token id. The per-token rounds run in uint32: every value there is in
  ``[0, 2^31)`` (token ids, keys and ``_mix`` outputs all are), the shifts of a value
  below ``2^31`` are the same in either width, and ``(h * m) & (2^31 - 1)`` depends only
  on the low 31 bits of the product, which a wrapping 32-bit multiply keeps. So the
  values are the twin's int64 ones, at a fraction of the cost of 64-bit multiplies on a
  GPU. ``u = (2h + 1) * 2^-32`` in float64 (exact, as in the twin).
- Keys are ``float64(logp) - log(-log(u))`` in float64, the twin's operations in its
  order (no fused multiply-add is involved). ``log`` is the device's float64 log: NumPy's
  under the CPU interpreter (torch's CPU log is a few ulp from it on some hosts, so
  the tests take the twin's keys with NumPy's log there and compare them bit for bit),
  libdevice's ``__nv_log`` on CUDA, which is what torch's CUDA ``log`` of a double calls.
- The argmax follows ``torch.argmax``: the lowest index among equal maxima; NaN counts
  as larger than everything and the first NaN wins; a row that is all ``-inf`` gives
  index 0. ``-inf`` tokens (top-k / top-p / min-p / grammar masked) have key ``-inf``
  whatever their uniform, exactly as in the twin. Greedy rows take the argmax of
  ``logp`` itself (no hash is computed for them); float32 to float64 is exact and order
  preserving, so that is ``torch.argmax`` of the float32 row.

Grid: ``(N, S)`` programs, program ``(i, s)`` streaming split ``s`` of row ``i``'s
vocabulary in blocks of ``BLOCK`` tokens and writing the split's best key and its
(lowest) index to ``[N, S]`` partials; a ``torch.argmax`` over the ``S`` partials of a
row and a gather finish the row (the same tie and NaN rule across splits: split ``s``'s
index is below every index of split ``s + 1``). One program per row would leave most of
the GPU idle at small batches (at batch 1 a single program would walk 131,072 tokens
and their two float64 logs on one SM), so :func:`num_splits` picks ``S`` to give the
launch a few hundred programs; at ``S == 1`` the partials are the result. Each program
writes only its own partial and reads nothing any program writes (the race rule,
docs/racecheck.md). Shapes alone pick ``S`` and the block, so the launch is the same on
every replay of a CUDA graph; nothing is read back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["BLOCK", "HASH_CONSTANTS", "TARGET_PROGRAMS", "draw", "draw_kernel", "num_splits",
           "residual_draw", "residual_draw_kernel", "uniforms", "uniforms_kernel"]

BLOCK = 1024
"""Tokens per block of a program's loop on the GPU (a block of float64 keys fits four
warps' registers)."""

TARGET_PROGRAMS = 512
"""How many programs a launch aims for: a few per SM of an H200 (132 SMs), so that small
batches still fill the chip and large ones are not split for nothing."""

HASH_CONSTANTS = (0x7FFFFFFF, 0x2C1B3C6D, 0x297A2D39, (0x3C6EF372, 0x1B873593, 0x68E31DA4))
"""The counter-based hash's mask, two multipliers and three key salts: the values of the
twin's ``_MASK31``, ``_MUL_A``, ``_MUL_B`` and ``_KEY_SALTS`` (kernels import nothing from
the runner, so they are written here again; the tests check that they are the twin's)."""

# As constexprs, which is how a Triton function reads a module's values.
_MASK31 = tl.constexpr(HASH_CONSTANTS[0])
_MUL_A = tl.constexpr(HASH_CONSTANTS[1])
_MUL_B = tl.constexpr(HASH_CONSTANTS[2])
_SALT_0 = tl.constexpr(HASH_CONSTANTS[3][0])
_SALT_1 = tl.constexpr(HASH_CONSTANTS[3][1])
_SALT_2 = tl.constexpr(HASH_CONSTANTS[3][2])
_INV_2_32 = tl.constexpr(2.0**-32)


def _use_libdevice() -> bool:
    """The CPU interpreter has no libdevice (there ``tl.log`` is NumPy's float64 log).
    Compiled, the float64 log is named explicitly so that it is the libdevice routine
    torch's CUDA log of a double uses, whatever a Triton version lowers ``tl.log`` to."""
    return not triton.knobs.runtime.interpret


@triton.jit
def _mix(h):
    """The twin's ``_mix`` on any integer dtype holding values the twin's int64 would
    (int64 scalars for the round keys, uint32 tensors for the tokens)."""
    h = h ^ (h >> 16)
    h = (h * _MUL_A) & _MASK31
    h = h ^ (h >> 15)
    h = (h * _MUL_B) & _MASK31
    return h ^ (h >> 16)


@triton.jit
def _log64(x, USE_LIBDEVICE: tl.constexpr):
    if USE_LIBDEVICE:
        y = libdevice.log(x)
    else:
        y = tl.log(x)
    return y


@triton.jit
def _exp64(x, USE_LIBDEVICE: tl.constexpr):
    if USE_LIBDEVICE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _round_keys(seed_lo, seed_hi, index, row):
    """Row ``row``'s three round keys (the twin's ``_position_keys``), in the twin's
    int64 arithmetic, returned as uint32 (they are below ``2^31``)."""
    k1 = _mix(_mix(_mix(tl.load(seed_lo + row) ^ _SALT_0) ^ tl.load(seed_hi + row))
              ^ (tl.load(index + row) & _MASK31))
    k2 = _mix(k1 ^ _SALT_1)
    k3 = _mix(k2 ^ _SALT_2)
    return k1.to(tl.uint32), k2.to(tl.uint32), k3.to(tl.uint32)


@triton.jit
def _token_uniforms(offs, k1, k2, k3):
    """The float64 uniforms of token ids ``offs`` (int32, in ``[0, 2^31)``) under the
    round keys (the twin's ``_token_uniforms``)."""
    h = offs.to(tl.uint32)
    h = _mix(h ^ k1)
    h = _mix(h ^ k2)
    h = _mix(h ^ k3)
    return (h * 2 + 1).to(tl.float64) * _INV_2_32


@triton.jit
def _fold(key, offs, valid, best_key, best_idx, first_nan):
    """Fold one block of keys (token ids ``offs``, ``valid`` inside the vocabulary) into
    the running best key, its index and the first NaN's index (``2^31 - 1``: none yet),
    by torch.argmax's rule. The max and its first index come from explicit compares, so
    neither NaN nor ties depend on how ``tl.max`` / ``tl.argmax`` treat them."""
    none = 2147483647  # above every token id: "no candidate" for a min
    is_nan = key != key
    first_nan = tl.minimum(first_nan, tl.min(tl.where(is_nan & valid, offs, none), axis=0))
    key = tl.where(is_nan | ~valid, float("-inf"), key)
    m = tl.max(key, axis=0)
    at = tl.min(tl.where((key == m) & valid, offs, none), axis=0)
    # Strictly greater: an earlier block keeps an equal maximum (the lowest index wins).
    take = m > best_key
    return tl.where(take, m, best_key), tl.where(take, at, best_idx), first_nan


@triton.jit
def draw_kernel(
    logp, stride_row, greedy, seed_lo, seed_hi, index, part_key, part_idx, vocab,
    NUM_SPLITS: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, BLOCK: tl.constexpr,
    HAS_GREEDY: tl.constexpr, USE_LIBDEVICE: tl.constexpr,
):
    """Program ``(row, split)``: the best key and its index over tokens
    ``[split * SPLIT_BLOCKS * BLOCK, (split + 1) * SPLIT_BLOCKS * BLOCK)`` of ``row``,
    into ``part_key[row, split]`` / ``part_idx[row, split]``."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    sampled = True
    if HAS_GREEDY:
        sampled = tl.load(greedy + row) == 0
    k1, k2, k3 = _round_keys(seed_lo, seed_hi, index, row)

    lanes = tl.arange(0, BLOCK)
    best_key = tl.full((), float("-inf"), tl.float64)
    best_idx = tl.full((), 0, tl.int32) + split * (SPLIT_BLOCKS * BLOCK)
    first_nan = tl.full((), 2147483647, tl.int32)
    row_logp = logp + row.to(tl.int64) * stride_row
    for b in range(SPLIT_BLOCKS):
        offs = (split * SPLIT_BLOCKS + b) * BLOCK + lanes
        valid = offs < vocab
        key = tl.load(row_logp + offs, mask=valid, other=float("-inf")).to(tl.float64)
        if sampled:
            u = _token_uniforms(offs, k1, k2, k3)
            key = key - _log64(-_log64(u, USE_LIBDEVICE), USE_LIBDEVICE)
        best_key, best_idx, first_nan = _fold(key, offs, valid, best_key, best_idx, first_nan)
    has_nan = first_nan < 2147483647
    best_key = tl.where(has_nan, float("nan"), best_key)
    best_idx = tl.where(has_nan, first_nan, best_idx)
    out = row * NUM_SPLITS + split
    tl.store(part_key + out, best_key)
    tl.store(part_idx + out, best_idx.to(tl.int64))


def num_splits(rows: int, vocab: int, block: int = BLOCK) -> int:
    """The number of vocabulary splits per row for ``rows`` rows: enough programs to
    reach :data:`TARGET_PROGRAMS`, at most one split per block. A function of the shape
    only (a captured graph's launch is fixed)."""
    blocks = triton.cdiv(vocab, block)
    return max(1, min(blocks, triton.cdiv(TARGET_PROGRAMS, max(rows, 1))))


def draw(
    logp: torch.Tensor,
    greedy: torch.Tensor | None,
    seed_lo: torch.Tensor,
    seed_hi: torch.Tensor,
    index: torch.Tensor,
    *,
    block: int = BLOCK,
    splits: int | None = None,
    return_keys: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logp [N, vocab]`` (any float dtype, unit stride along the
    vocabulary) -> int64 ``[N]`` on its device: :func:`hybridserve.runner.sampler.draw`
    with ``any_sampled=True``. ``greedy``: bool ``[N]``, or None for all rows sampled
    (the drafter's draw). ``seed_lo`` / ``seed_hi`` / ``index``: integer ``[N]``, the
    twin's seed words and generated-token indices.

    ``block`` (a power of two) and ``splits`` (default :func:`num_splits`) set the
    launch; they change nothing in the result. ``return_keys`` also returns each row's
    winning key (float64 ``[N]``: ``logp`` for greedy rows, the Gumbel key otherwise,
    NaN where a NaN won), the value the twin's argmax selected."""
    _check_rows(logp, "logp", block)
    n, vocab = logp.shape
    _check_positions(n, logp.device, seed_lo=seed_lo, seed_hi=seed_hi, index=index,
                     greedy=greedy)
    if greedy is not None and greedy.dtype != torch.bool:
        raise ValueError(f"greedy must be a bool tensor, got {greedy.dtype}")
    s, split_blocks = _splits(n, vocab, block, splits)
    part_key = torch.empty((n, s), dtype=torch.float64, device=logp.device)
    part_idx = torch.empty((n, s), dtype=torch.int64, device=logp.device)
    if n:
        flags = greedy.contiguous().view(torch.uint8) if greedy is not None else part_idx
        draw_kernel[(n, s)](
            logp, logp.stride(0), flags,
            seed_lo.long().contiguous(), seed_hi.long().contiguous(), index.long().contiguous(),
            part_key, part_idx, vocab,
            NUM_SPLITS=s, SPLIT_BLOCKS=split_blocks, BLOCK=block,
            HAS_GREEDY=greedy is not None, USE_LIBDEVICE=_use_libdevice(),
        )
    tokens, keys = _reduce(part_key, part_idx)
    return (tokens, keys) if return_keys else tokens


def _check_rows(logp: torch.Tensor, name: str, block: int) -> None:
    if logp.dim() != 2:
        raise ValueError(f"{name} must be [N, vocab], got shape {tuple(logp.shape)}")
    if not logp.dtype.is_floating_point:
        raise ValueError(f"{name} must be a float tensor, got {logp.dtype}")
    if not 1 <= logp.shape[1] < 2**31 - block:
        raise ValueError(f"{name}'s vocabulary must be in [1, 2**31 - block), got {logp.shape[1]}")
    if logp.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride along the vocabulary")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")


def _check_positions(n: int, device: torch.device, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is None:
            continue
        if t.shape != (n,):
            raise ValueError(f"{name} must have shape [{n}], got {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the rows on {device}")


def _splits(n: int, vocab: int, block: int, splits: int | None) -> tuple[int, int]:
    """``(splits, blocks per split)`` of a launch; no split is left empty."""
    s = num_splits(n, vocab, block) if splits is None else splits
    blocks = triton.cdiv(vocab, block)
    if not 1 <= s <= blocks:
        raise ValueError(f"splits must be in [1, {blocks}] for this vocabulary and block, got {s}")
    split_blocks = triton.cdiv(blocks, s)
    return triton.cdiv(blocks, split_blocks), split_blocks


def _reduce(part_key: torch.Tensor, part_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token and key from its ``[..., S]`` split partials: torch.argmax over
    the splits (the lowest split among equal keys, the first NaN), since split ``s``'s
    index is below every index of split ``s + 1``."""
    if part_key.shape[-1] == 1:
        return part_idx[..., 0], part_key[..., 0]
    best = torch.argmax(part_key, dim=-1, keepdim=True)
    return part_idx.gather(-1, best)[..., 0], part_key.gather(-1, best)[..., 0]


@triton.jit
def uniforms_kernel(
    seed_lo, seed_hi, index, out, vocab, BLOCK: tl.constexpr, GUMBEL: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
):
    """Program ``(row, block)``: ``out[row, block * BLOCK : (block + 1) * BLOCK]``, the
    row's uniforms (or their ``log(-log u)`` where ``GUMBEL``)."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    k1, k2, k3 = _round_keys(seed_lo, seed_hi, index, row)
    u = _token_uniforms(offs, k1, k2, k3)
    if GUMBEL:
        u = _log64(-_log64(u, USE_LIBDEVICE), USE_LIBDEVICE)
    tl.store(out + row.to(tl.int64) * vocab + offs, u, mask=offs < vocab)


def uniforms(
    seed_lo: torch.Tensor,
    seed_hi: torch.Tensor,
    index: torch.Tensor,
    vocab: int,
    *,
    gumbel: bool = False,
    block: int = BLOCK,
) -> torch.Tensor:
    """:func:`hybridserve.runner.sampler.uniforms` (bit-identical) as one launch that
    writes the float64 ``[N, vocab]`` table and nothing else; with ``gumbel``, the
    table of ``log(-log u)`` instead (the twin's two float64 logs). For a caller that
    needs the whole table (the residual draw of
    :func:`~hybridserve.runner.sampler.speculative_choices`): one write of it, instead
    of the twin's thirty-odd int64 passes."""
    n = seed_lo.shape[0]
    for name, t in (("seed_lo", seed_lo), ("seed_hi", seed_hi), ("index", index)):
        if t.shape != (n,):
            raise ValueError(f"{name} must have shape [{n}], got {tuple(t.shape)}")
    if vocab < 1 or vocab >= 2**31 - block:
        raise ValueError(f"vocab must be in [1, 2**31 - block), got {vocab}")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    out = torch.empty((n, vocab), dtype=torch.float64, device=seed_lo.device)
    if n:
        uniforms_kernel[(n, triton.cdiv(vocab, block))](
            seed_lo.long().contiguous(), seed_hi.long().contiguous(), index.long().contiguous(),
            out, vocab, BLOCK=block, GUMBEL=gumbel, USE_LIBDEVICE=_use_libdevice(),
        )
    return out


@triton.jit
def residual_draw_kernel(
    logp, stride_p, logq, stride_q, seed_lo, seed_hi, index, part_key, part_idx, part_flags,
    vocab, NUM_SPLITS: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, BLOCK: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
):
    """Program ``(row, split)``, over the split's tokens: the best Gumbel key of the
    residual ``r = max(p - q, 0)`` and of ``p`` itself (the twin's fallback) with their
    indices, into ``part_key`` / ``part_idx`` ``[2, N, S]`` (0: residual, 1: ``p``), and
    into ``part_flags[row, split]`` bit 0 "some ``r > 0``", bit 1 "some ``r`` is NaN"."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    k1, k2, k3 = _round_keys(seed_lo, seed_hi, index, row)
    lanes = tl.arange(0, BLOCK)
    start = tl.full((), 0, tl.int32) + split * (SPLIT_BLOCKS * BLOCK)
    best_r = tl.full((), float("-inf"), tl.float64)
    best_p = tl.full((), float("-inf"), tl.float64)
    idx_r = start
    idx_p = start
    nan_r = tl.full((), 2147483647, tl.int32)
    nan_p = tl.full((), 2147483647, tl.int32)
    positive = tl.full((), 0, tl.int32)
    has_nan = tl.full((), 0, tl.int32)
    row_p = logp + row.to(tl.int64) * stride_p
    row_q = logq + row.to(tl.int64) * stride_q
    for b in range(SPLIT_BLOCKS):
        offs = (split * SPLIT_BLOCKS + b) * BLOCK + lanes
        valid = offs < vocab
        p = _exp64(tl.load(row_p + offs, mask=valid, other=float("-inf")).to(tl.float64),
                   USE_LIBDEVICE)
        q = _exp64(tl.load(row_q + offs, mask=valid, other=float("-inf")).to(tl.float64),
                   USE_LIBDEVICE)
        # The twin's clamp_min(p - q, 0): NaN stays NaN.
        r = p - q
        r = tl.where(r < 0, 0.0, r)
        positive = tl.maximum(positive, tl.max(((r > 0) & valid).to(tl.int32), axis=0))
        has_nan = tl.maximum(has_nan, tl.max(((r != r) & valid).to(tl.int32), axis=0))
        g = _log64(-_log64(_token_uniforms(offs, k1, k2, k3), USE_LIBDEVICE), USE_LIBDEVICE)
        best_r, idx_r, nan_r = _fold(_log64(r, USE_LIBDEVICE) - g, offs, valid, best_r, idx_r,
                                     nan_r)
        best_p, idx_p, nan_p = _fold(_log64(p, USE_LIBDEVICE) - g, offs, valid, best_p, idx_p,
                                     nan_p)
    out = row * NUM_SPLITS + split
    plane = tl.num_programs(0) * NUM_SPLITS
    tl.store(part_key + out, tl.where(nan_r < 2147483647, float("nan"), best_r))
    tl.store(part_idx + out, tl.where(nan_r < 2147483647, nan_r, idx_r).to(tl.int64))
    tl.store(part_key + plane + out, tl.where(nan_p < 2147483647, float("nan"), best_p))
    tl.store(part_idx + plane + out, tl.where(nan_p < 2147483647, nan_p, idx_p).to(tl.int64))
    tl.store(part_flags + out, positive | (has_nan * 2))


def residual_draw(
    logp: torch.Tensor,
    logq: torch.Tensor,
    seed_lo: torch.Tensor,
    seed_hi: torch.Tensor,
    index: torch.Tensor,
    *,
    block: int = BLOCK,
    splits: int | None = None,
) -> torch.Tensor:
    """The residual sample of :func:`hybridserve.runner.sampler.speculative_choices` (its
    choice where the draft is rejected), in one pass over both rows: per row of
    ``logp`` / ``logq [N, vocab]``, the argmax of ``log(r) - log(-log u)`` for the
    residual ``r = max(exp(logp) - exp(logq), 0)`` in float64, or of ``log(exp(logp)) -
    log(-log u)`` where ``r`` sums to nothing positive (no entry above 0, or a NaN: the
    twin's ``sum > 0`` test), with the twin's uniforms (unsalted seed words) and
    torch.argmax's rule. -> int64 ``[N]``. Both candidates are kept per split, so the
    fallback costs no second pass; ``block`` / ``splits`` as for :func:`draw`."""
    _check_rows(logp, "logp", block)
    _check_rows(logq, "logq", block)
    if logq.shape != logp.shape:
        raise ValueError(f"logq must have logp's shape {tuple(logp.shape)}, got {tuple(logq.shape)}")
    n, vocab = logp.shape
    _check_positions(n, logp.device, seed_lo=seed_lo, seed_hi=seed_hi, index=index)
    s, split_blocks = _splits(n, vocab, block, splits)
    part_key = torch.empty((2, n, s), dtype=torch.float64, device=logp.device)
    part_idx = torch.empty((2, n, s), dtype=torch.int64, device=logp.device)
    flags = torch.empty((n, s), dtype=torch.int32, device=logp.device)
    if n:
        residual_draw_kernel[(n, s)](
            logp, logp.stride(0), logq, logq.stride(0),
            seed_lo.long().contiguous(), seed_hi.long().contiguous(), index.long().contiguous(),
            part_key, part_idx, flags, vocab,
            NUM_SPLITS=s, SPLIT_BLOCKS=split_blocks, BLOCK=block, USE_LIBDEVICE=_use_libdevice(),
        )
    tokens, _ = _reduce(part_key, part_idx)
    use_residual = ((flags & 1) != 0).any(dim=1) & ~((flags & 2) != 0).any(dim=1)
    return torch.where(use_residual, tokens[0], tokens[1])
