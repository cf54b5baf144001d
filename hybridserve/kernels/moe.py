"""Grouped routed experts: every (token, expert) pair of a step in two grouped launches.

A mixture-of-experts block sends each of ``T`` tokens to ``k`` experts: ``A = T * k``
*assignments*, numbered ``a = t * k + j`` (token ``t``'s ``j``-th choice). The experts'
weights are stacked, ``w1 [E, N1, H]`` (``N1 = 2 * I`` gated, gate rows then up rows;
``I`` plain) and ``w2 [E, H, I]``. :func:`moe_experts` computes, for every token,

    y[t] = sum_j  weight[t, j] * down_e( act(gate_e(x[t])) * up_e(x[t]) )    (gated)
    y[t] = sum_j  weight[t, j] * down_e( act(up_e(x[t])) )                   (plain)

with ``e = topk_ids[t, j]``, in four launches, all on the device and with no host sync
(the shapes depend on ``T`` only, so a decode step can be captured in a CUDA graph):

1. :func:`sort_by_expert` (Triton, a counting sort in one launch): assignments sorted by
   expert, each expert's run padded to a multiple of ``block_m`` rows, so that every
   block of ``block_m`` rows belongs to one expert. The number of blocks is bounded
   statically by ``ceil(A / block_m) + min(E, A)``; blocks past the used ones carry
   expert ``-1`` (their programs exit at once).
2. :func:`grouped_up` (Triton): one program per (block, tile of ``I``) multiplies the
   block's token rows by its expert's ``w1`` tile (for gated experts the gate and up
   tiles together), applies the activation, and writes ``h [A, I]`` in assignment order.
3. :func:`grouped_down` (Triton): one program per (block, tile of ``H``) multiplies the
   block's rows of ``h`` by its expert's ``w2`` tile, scales by the routing weight and
   writes ``out [A, H]`` (float32) in assignment order.
4. :func:`combine` (Triton): ``y`` is the float32 sum over each token's ``k`` rows (a
   fixed order: the result for a token does not depend on the rest of the batch), plus
   the shared expert's output when the caller passes it, cast once to ``x``'s dtype.

Tiles (:func:`tile_table`) depend on the rows per expert the step can reach, a host-known
number: decode steps take 16-row blocks and N tiles narrow enough that the few experts'
weight reads still spread over every SM; larger steps wider blocks.

Every program writes only the rows of its own block (each assignment sits in exactly one
block) and its own column tile, and reads only inputs no program writes: the race rule
holds by construction (checked under ``racecheck`` in the tests).

Numerics: products accumulate in float32 (full-precision ``ieee`` products for float32
inputs, the tensor cores' bf16 / fp16 products otherwise) over K chunks of 64 in every
tile configuration; the activation and gate product happen in float32 before the one
rounding of ``h`` to ``x``'s dtype; the routing weights and the shared expert's output
are applied in float32.

Torch twins: :func:`sort_by_expert_reference` (a stable ``torch.sort`` and scans, the
same blocks bit for bit); :func:`grouped_up_reference` / :func:`grouped_down_reference`
compute the same functions from the same inputs with a gather of each row's expert
weights and a batched product; :func:`combine_reference`; :func:`moe_experts_reference` is the whole path that way, and
:func:`moe_experts_loop` a loop over the experts present (one host sync per step), the
shape of the Hugging Face reference and the CPU path of the model layer.

:func:`triton_enabled` decides where the model layers take the kernels, for the engine's
``KernelPolicy.moe`` (tests and benchmarks pick the path by constructing a policy).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = [
    "ACTIVATIONS",
    "ExpertBlocks",
    "Tiles",
    "combine",
    "combine_reference",
    "default_tiles",
    "grouped_down",
    "grouped_down_reference",
    "grouped_up",
    "grouped_up_reference",
    "moe_experts",
    "moe_experts_loop",
    "moe_experts_reference",
    "sort_by_expert",
    "sort_by_expert_reference",
    "tile_table",
    "triton_enabled",
]

# Activations the kernels apply in-register; others take the loop.
ACTIVATIONS = {"silu": 0, "relu": 1, "relu2": 2}

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_enabled(
    mode: str, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation: str
) -> bool:
    """Whether :func:`moe_experts` (the kernels) should run for these operands.

    ``mode`` (``KernelPolicy.moe``): ``"auto"`` (CUDA tensors only, the default),
    ``"triton"`` (CPU tensors too, through the interpreter: tests force the grouped path
    through a whole model this way) or ``"reference"`` (the per-expert loop everywhere: a
    baseline for benchmarks). Besides that: float32 / bfloat16 / float16 operands of one
    dtype (float64 models take the loop), a supported activation, and no gradient needed.
    """
    if mode not in ("auto", "triton", "reference"):
        raise ValueError(f"moe mode must be 'auto', 'triton' or 'reference', got {mode!r}")
    if mode == "reference":
        return False
    tensors = (x, w1, w2)
    if mode == "auto" and not all(t.is_cuda for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return activation in ACTIVATIONS and x.dtype in _DTYPES and all(
        t.dtype == x.dtype for t in tensors
    )


# --------------------------------------------------------------------------------------
# Sorting assignments by expert (torch ops, on the device, no host sync)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertBlocks:
    """Assignments sorted by expert, padded to whole blocks of ``block_m`` rows.

    ``rows [num_blocks * block_m]`` int32: the assignment index of each padded row, -1 for
    padding; ``block_expert [num_blocks]`` int32: the expert of each block, -1 for a block
    past the used ones. Every assignment appears in exactly one row.
    """

    rows: torch.Tensor
    block_expert: torch.Tensor
    block_m: int
    num_assignments: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_blocks(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Blocks enough for any routing: each non-empty expert wastes less than one block."""
    return -(-num_assignments // block_m) + min(num_experts, num_assignments)


def sort_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, *, chunk: int = 64
) -> ExpertBlocks:
    """Sort the ``A = T * k`` assignments of ``topk_ids [T, k]`` by expert into blocks.

    Within an expert, assignments keep their order (a stable sort). Ids must lie in
    ``[0, num_experts)`` (the router guarantees it; not checked, to avoid a host sync).

    One Triton launch (a counting sort, :func:`_sort_kernel`), where the torch twin
    :func:`sort_by_expert_reference` takes some twenty small launches: each program
    counts every assignment's expert (``ceil(A / chunk)`` one-hot sums of ``chunk`` ids),
    scans the counts into each expert's first block, and places its own ``chunk``
    assignments (rank within the expert = the count in earlier chunks + the earlier ones
    of its own chunk) and the padding rows of its own ``chunk`` blocks. ``chunk`` (a
    power of two) only changes how the work is split, never the result.
    """
    _check_sort_args(topk_ids, block_m)
    if chunk <= 0 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    device = topk_ids.device
    a = topk_ids.numel()
    nb = max_blocks(a, num_experts, block_m)
    if device.type != "cuda" and not triton.knobs.runtime.interpret:
        return sort_by_expert_reference(topk_ids, num_experts, block_m)
    rows = torch.empty(nb * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=device)
    if nb:
        ids = topk_ids.reshape(-1).contiguous()
        bins = triton.next_power_of_2(num_experts)
        grid = (max(triton.cdiv(a, chunk), triton.cdiv(nb, chunk)),)
        _sort_kernel[grid](
            ids, rows, block_expert, a, num_experts, nb,
            BM=block_m, CHUNK=chunk, BINS=bins,
        )
    return ExpertBlocks(rows, block_expert, block_m, a)


def _check_sort_args(topk_ids: torch.Tensor, block_m: int) -> None:
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [tokens, top_k], got shape {tuple(topk_ids.shape)}")
    if block_m <= 0 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")


def sort_by_expert_reference(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> ExpertBlocks:
    """Twin of :func:`sort_by_expert` in torch ops (a stable ``torch.sort``, scans and
    scatters): the same blocks, bit for bit."""
    _check_sort_args(topk_ids, block_m)
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    a = flat.numel()
    nb = max_blocks(a, num_experts, block_m)
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    block_start = block_end - blocks
    first = torch.cumsum(counts, 0) - counts  # sorted position of each expert's first row
    sorted_expert = flat[order]
    rank = torch.arange(a, device=device) - first[sorted_expert]
    dest = block_start[sorted_expert] * block_m + rank
    rows = torch.full((nb * block_m,), -1, dtype=torch.int32, device=device)
    rows[dest] = order.to(torch.int32)
    expert = torch.searchsorted(block_end, torch.arange(nb, device=device), right=True)
    block_expert = torch.where(expert < num_experts, expert, -1).to(torch.int32)
    return ExpertBlocks(rows, block_expert, block_m, a)


def expert_of_assignment(blocks: ExpertBlocks) -> torch.Tensor:
    """``[A]`` int64: the expert each assignment was sorted to (for the twins)."""
    per_row = blocks.block_expert.to(torch.int64).repeat_interleave(blocks.block_m)
    valid = blocks.rows >= 0
    out = torch.full((blocks.num_assignments,), -1, dtype=torch.int64, device=per_row.device)
    out[blocks.rows[valid].to(torch.int64)] = per_row[valid]
    return out


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _sort_kernel(
    ids, rows, block_expert,
    A, E, NB,
    BM: tl.constexpr, CHUNK: tl.constexpr, BINS: tl.constexpr,
):
    """Program ``p``: rows of assignments ``[p * CHUNK, (p + 1) * CHUNK)`` and the expert
    and padding rows of blocks ``[p * CHUNK, (p + 1) * CHUNK)`` (:func:`sort_by_expert`).

    Every program recounts all ``A`` ids (``A * BINS`` compares: cheap next to a launch
    for decode sizes) so that no program reads what another writes. Gathers from the per-expert vectors are
    one-hot sums over the ``BINS`` bins (no register gather needed)."""
    p = tl.program_id(0)
    bins = tl.arange(0, BINS)
    lane = tl.arange(0, CHUNK)
    counts = tl.zeros((BINS,), dtype=tl.int32)
    before = tl.zeros((BINS,), dtype=tl.int32)  # counts over the chunks before this one
    for a0 in range(0, A, CHUNK):
        offs = a0 + lane
        e = tl.load(ids + offs, mask=offs < A, other=0).to(tl.int32)
        # A one-hot sum, not tl.histogram: that one needs bins in multiples of the warp
        # size on the GPU, and the sizes here are small.
        hist = tl.sum((e[:, None] == bins[None, :]).to(tl.int32), axis=0)
        counts += hist
        before += tl.where(a0 < p * CHUNK, hist, 0)
    # The masked-off lanes of the last chunk were counted in bin 0; only programs past
    # every assignment count that chunk in ``before``, and they place none.
    counts -= tl.where(bins == 0, tl.cdiv(A, CHUNK) * CHUNK - A, 0)
    nblk = (counts + BM - 1) // BM
    block_end = tl.cumsum(nblk, 0)
    block_start = block_end - nblk

    # This program's assignments: dest = first row of the expert + rank in the expert.
    offs = p * CHUNK + lane
    valid = offs < A
    e = tl.load(ids + offs, mask=valid, other=0).to(tl.int32)
    hot = e[:, None] == bins[None, :]
    start_e = tl.sum(tl.where(hot, block_start[None, :], 0), axis=1)
    before_e = tl.sum(tl.where(hot, before[None, :], 0), axis=1)
    earlier = (e[:, None] == e[None, :]) & (lane[None, :] < lane[:, None])
    within = tl.sum(earlier.to(tl.int32), axis=1)
    dest = start_e * BM + before_e + within
    tl.store(rows + dest, offs.to(tl.int32), mask=valid)

    # This program's blocks: their expert (-1 past the used ones) and padding rows.
    b = p * CHUNK + lane
    bvalid = b < NB
    ex = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
    used = ex < E
    tl.store(block_expert + b, tl.where(used, ex, -1), mask=bvalid)
    hot_b = ex[:, None] == bins[None, :]
    start_b = tl.sum(tl.where(hot_b, block_start[None, :], 0), axis=1)
    count_b = tl.sum(tl.where(hot_b, counts[None, :], 0), axis=1)
    i = tl.arange(0, BM)
    rank = (b - start_b)[:, None] * BM + i[None, :]
    pad = (~used[:, None]) | (rank >= count_b[:, None])
    tl.store(
        rows + b[:, None] * BM + i[None, :],
        tl.full((CHUNK, BM), -1, dtype=tl.int32),
        mask=bvalid[:, None] & pad,
    )


@triton.jit
def _activate(v, ACT: tl.constexpr):
    if ACT == 0:
        v = v / (1.0 + tl.exp(-v))  # silu
    elif ACT == 1:
        v = tl.maximum(v, 0.0)
    else:
        v = tl.maximum(v, 0.0)
        v = v * v  # relu2
    return v


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """``a @ b`` accumulated in float32: 16-bit operands as they are (``DOT`` 0), float32
    ones in full precision (1), or 16-bit ones widened to float32 first (2)."""
    if DOT == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if DOT == 1:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _grouped_up_kernel(
    x, w1, rows, block_expert, h,
    N, K, TOP_K,
    sx_t, sw_e, sw_n, sw_k, sh_a,
    GATED: tl.constexpr, ACT: tl.constexpr, DOT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    b = tl.program_id(0)
    pn = tl.program_id(1)
    e = tl.load(block_expert + b)
    if e >= 0:
        offs_m = tl.arange(0, BM)
        row = tl.load(rows + b * BM + offs_m)
        valid = row >= 0
        tok = tl.where(valid, row, 0) // TOP_K
        offs_n = pn * BN + tl.arange(0, BN)
        mask_n = offs_n < N
        offs_k = tl.arange(0, BK)
        w_base = w1 + e.to(tl.int64) * sw_e
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + offs_k
            mask_k = kk < K
            xa = tl.load(
                x + tok[:, None].to(tl.int64) * sx_t + kk[None, :],
                mask=valid[:, None] & mask_k[None, :], other=0.0,
            )
            wmask = mask_k[:, None] & mask_n[None, :]
            wg = tl.load(w_base + offs_n[None, :] * sw_n + kk[:, None] * sw_k, mask=wmask, other=0.0)
            acc += _dot(xa, wg, DOT)
            if GATED:
                wu = tl.load(
                    w_base + (N + offs_n[None, :]) * sw_n + kk[:, None] * sw_k,
                    mask=wmask, other=0.0,
                )
                acc_up += _dot(xa, wu, DOT)
        out = _activate(acc, ACT)
        if GATED:
            out = out * acc_up
        tl.store(
            h + tl.where(valid, row, 0)[:, None].to(tl.int64) * sh_a + offs_n[None, :],
            out.to(h.dtype.element_ty),
            mask=valid[:, None] & mask_n[None, :],
        )


@triton.jit
def _grouped_down_kernel(
    h, w2, rows, block_expert, weights, out,
    N, K,
    sh_a, sw_e, sw_n, sw_k, so_a,
    DOT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    b = tl.program_id(0)
    pn = tl.program_id(1)
    e = tl.load(block_expert + b)
    if e >= 0:
        offs_m = tl.arange(0, BM)
        row = tl.load(rows + b * BM + offs_m)
        valid = row >= 0
        arow = tl.where(valid, row, 0).to(tl.int64)
        offs_n = pn * BN + tl.arange(0, BN)
        mask_n = offs_n < N
        offs_k = tl.arange(0, BK)
        w_base = w2 + e.to(tl.int64) * sw_e
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + offs_k
            mask_k = kk < K
            ha = tl.load(
                h + arow[:, None] * sh_a + kk[None, :],
                mask=valid[:, None] & mask_k[None, :], other=0.0,
            )
            wd = tl.load(
                w_base + offs_n[None, :] * sw_n + kk[:, None] * sw_k,
                mask=mask_k[:, None] & mask_n[None, :], other=0.0,
            )
            acc += _dot(ha, wd, DOT)
        wt = tl.load(weights + arow, mask=valid, other=0.0).to(tl.float32)
        acc = acc * wt[:, None]
        tl.store(
            out + arow[:, None] * so_a + offs_n[None, :],
            acc,
            mask=valid[:, None] & mask_n[None, :],
        )


@triton.jit
def _combine_kernel(
    out, add, y,
    N, TOP_K,
    so_a, sa_t, sy_t,
    HAS_ADD: tl.constexpr, BN: tl.constexpr,
):
    """Program ``(t, pn)``: ``y[t] = sum_j out[t * TOP_K + j] (+ add[t])`` over one column
    tile, in float32, ``j`` in order, one rounding to ``y``'s dtype."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = offs < N
    base = t.to(tl.int64) * TOP_K
    acc = tl.zeros((BN,), dtype=tl.float32)
    for j in range(0, TOP_K):
        acc += tl.load(out + (base + j) * so_a + offs, mask=mask, other=0.0)
    if HAS_ADD:
        acc += tl.load(add + t.to(tl.int64) * sa_t + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y + t.to(tl.int64) * sy_t + offs, acc.to(y.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tiles:
    """Tile sizes of one launch pair: ``block_m`` rows per block; ``n`` x ``k`` tiles of
    the up launch and ``n_down`` x ``k`` of the down one (``n_down`` None: ``n``)."""

    block_m: int
    n: int
    k: int
    num_warps: int = 4
    num_stages: int = 2
    n_down: int | None = None

    @property
    def down_n(self) -> int:
        return self.n if self.n_down is None else self.n_down

    @classmethod
    def parse(cls, spec: str) -> Tiles:
        """``"block_m,n,k,warps,stages[,n_down]"`` (benchmarks name tiles this way)."""
        try:
            vals = [int(v) for v in spec.split(",")]
            tiles = cls(*vals)
        except (TypeError, ValueError):
            raise ValueError(
                f"tiles {spec!r}: expected 'block_m,n,k,warps,stages[,n_down]' integers"
            ) from None
        for name in ("block_m", "n", "k", "down_n"):
            v = getattr(tiles, name)
            if v <= 0 or v & (v - 1):
                raise ValueError(f"tiles {spec!r}: {name} must be a power of two, got {v}")
        return tiles


def legacy_tiles(num_assignments: int, x: torch.Tensor) -> Tiles:
    """The tiles of the first version (one threshold on the assignment count), kept so
    that benchmarks time the table of :func:`tile_table` against them in one run."""
    if not x.is_cuda:
        return Tiles(16, 64, 64, 1, 1)
    if num_assignments <= 256:
        return Tiles(16, 64, 64, 4, 3)
    return Tiles(64, 128, 64, 8, 3)


# The GPU table, keyed on the rows a touched expert gets at most on average
# (``A / min(E, A)``): (largest rows per expert, block_m, n (None: by occupancy),
# warps, stages for 16-bit operands). ``k`` is 64 in every row, so a token's products
# accumulate over the same K chunks whichever row its batch lands in.
_TABLE = (
    (16, 16, None, 4, 5),  # decode: one block per touched expert
    (48, 32, 64, 4, 4),
    (None, 64, 128, 8, 3),  # the first version's large tiles
)
_TILE_K = 64
# Shared memory the pipeline may take (the H100 / H200 have 227 KiB per block), counted
# as one x tile and one (gated: two) weight tiles per stage; Triton allocates one stage
# fewer than ``num_stages``, a margin. Compiled for sm_90 with these tiles, the decode
# launches take 24-72 KiB and 40-78 registers a thread, no spills.
_SMEM_BUDGET = 200 * 1024


def tile_table(
    tokens: int, top_k: int, num_experts: int, n_up: int, n_down: int, *,
    gated: bool, itemsize: int, sms: int,
) -> Tiles:
    """The tiles of one step on the GPU, from host-known sizes only (graph-safe).

    Few rows per expert (decode): ``block_m`` 16 and the N tiles of each launch as wide
    as still gives at least two programs per SM over the blocks that can hold rows
    (``min(E, A)``): the weights of a few experts are the whole cost, and they stream at
    the device's bandwidth only when every SM holds several tiles' loads in flight (at
    one token of Nemotron 3 Nano: 6 experts x 1856 / 32 = 348 up programs, not 174 of
    64). More rows per expert: wider blocks, fixed N tiles. The pipeline depth is cut
    until its buffers fit :data:`_SMEM_BUDGET` (float32 operands take 3 stages at most).
    """
    a = tokens * top_k
    per_expert = a / max(1, min(num_experts, a))
    row = next(r for r in _TABLE if r[0] is None or per_expert <= r[0])
    limit, block_m, n, warps, stages = row
    if n is None:
        active = max(1, min(num_experts, a))

        def width(cols: int) -> int:
            for cand in (64, 32):
                if active * triton.cdiv(cols, cand) >= 2 * sms:
                    return cand
            return 16

        n, n_down = width(n_up), width(n_down)
    else:
        n_down = n
    if itemsize > 2:
        stages = min(stages, 3)
    w_tiles = 2 if gated else 1
    while stages > 2 and stages * itemsize * _TILE_K * (
        block_m + w_tiles * max(n, n_down)
    ) > _SMEM_BUDGET:
        stages -= 1
    return Tiles(block_m, n, _TILE_K, warps, stages, None if n_down == n else n_down)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_tiles(
    tokens: int, top_k: int, num_experts: int, n_up: int, n_down: int, x: torch.Tensor,
    *, gated: bool,
) -> Tiles:
    """:func:`tile_table` for ``x``'s device; the interpreter takes few wide programs (its
    cost is per program)."""
    if not x.is_cuda:
        return Tiles(16, 64, 64, 1, 1)
    return tile_table(
        tokens, top_k, num_experts, n_up, n_down, gated=gated,
        itemsize=x.element_size(),
        sms=_sm_count(torch.cuda.current_device() if x.device.index is None else x.device.index),
    )


def _check_weights(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, gated: bool) -> int:
    if x.dim() != 2 or w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"expected x [T, H], w1 [E, N1, H], w2 [E, H, I]; got {tuple(x.shape)}, "
            f"{tuple(w1.shape)}, {tuple(w2.shape)}"
        )
    e, n1, hidden = w1.shape
    inter = n1 // 2 if gated else n1
    if hidden != x.shape[1] or (gated and n1 % 2) or tuple(w2.shape) != (e, hidden, inter):
        raise ValueError(
            f"weights do not fit: x {tuple(x.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}"
            f" ({'gated' if gated else 'plain'} experts)"
        )
    if x.stride(1) != 1:
        raise ValueError("x must have unit stride on its last axis")
    return inter


def _output(
    out: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype, device, name: str
) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(
            f"{name} must be {dtype} {list(shape)} with unit stride on its last axis, got "
            f"{out.dtype} {list(out.shape)} strides {out.stride()}"
        )
    return out


def _dot_mode(x: torch.Tensor) -> int:
    """The ``DOT`` constexpr of the kernels for operands of ``x``'s dtype."""
    if x.dtype == torch.float32:
        return 1
    # Triton's CPU interpreter multiplies bf16 dot operands as raw integers; widen them
    # there. On the GPU 16-bit operands go to the tensor cores as they are.
    return 2 if not x.is_cuda and x.dtype == torch.bfloat16 else 0


def grouped_up(
    x: torch.Tensor,
    w1: torch.Tensor,
    blocks: ExpertBlocks,
    top_k: int,
    *,
    gated: bool,
    activation: str,
    tiles: Tiles,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``h [A, I]`` (``x``'s dtype): ``act(gate_e(x_t)) * up_e(x_t)`` (or ``act(up_e(x_t))``)
    for every assignment ``a = t * top_k + j`` sorted into ``blocks``; written into
    ``out`` when given (unit stride on its last axis)."""
    n = w1.shape[1] // 2 if gated else w1.shape[1]
    k = w1.shape[2]
    h = _output(out, (blocks.num_assignments, n), x.dtype, x.device, "out")
    if blocks.num_assignments == 0:
        return h
    grid = (blocks.num_blocks, triton.cdiv(n, tiles.n))
    _grouped_up_kernel[grid](
        x, w1, blocks.rows, blocks.block_expert, h,
        n, k, top_k,
        x.stride(0), w1.stride(0), w1.stride(1), w1.stride(2), h.stride(0),
        GATED=gated, ACT=ACTIVATIONS[activation], DOT=_dot_mode(x),
        BM=tiles.block_m, BN=tiles.n, BK=tiles.k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return h


def grouped_down(
    h: torch.Tensor,
    w2: torch.Tensor,
    blocks: ExpertBlocks,
    weights: torch.Tensor,
    *,
    tiles: Tiles,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out [A, H]`` float32: ``weights[a] * down_e(h[a])`` for every assignment."""
    n, k = w2.shape[1], w2.shape[2]
    out = _output(out, (blocks.num_assignments, n), torch.float32, h.device, "out")
    if blocks.num_assignments == 0:
        return out
    weights = weights.reshape(-1).contiguous()
    grid = (blocks.num_blocks, triton.cdiv(n, tiles.down_n))
    _grouped_down_kernel[grid](
        h, w2, blocks.rows, blocks.block_expert, weights, out,
        n, k,
        h.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0),
        DOT=_dot_mode(h),
        BM=tiles.block_m, BN=tiles.down_n, BK=tiles.k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def combine(
    out: torch.Tensor, top_k: int, dtype: torch.dtype, add: torch.Tensor | None = None
) -> torch.Tensor:
    """``y [T, H]`` of ``dtype``: each token's ``top_k`` rows of ``out [T * top_k, H]``
    (float32) summed in order, plus ``add [T, H]`` (any float dtype; the shared expert's
    output) when given, all in float32 with one rounding at the end (one launch where a
    sum, a cast and an add took three)."""
    a, n = out.shape
    if out.dtype != torch.float32 or out.stride(1) != 1 or top_k <= 0 or a % top_k:
        raise ValueError(
            f"out must be float32 [T * top_k, H] with unit stride on its last axis, got "
            f"{out.dtype} {list(out.shape)} (top_k {top_k})"
        )
    t = a // top_k
    if add is not None and (tuple(add.shape) != (t, n) or add.stride(1) != 1):
        raise ValueError(
            f"add must be [{t}, {n}] with unit stride on its last axis, got "
            f"{list(add.shape)} strides {add.stride()}"
        )
    y = torch.empty((t, n), dtype=dtype, device=out.device)
    if t == 0:
        return y
    block = min(1024, triton.next_power_of_2(n))
    _combine_kernel[(t, triton.cdiv(n, block))](
        out, out if add is None else add, y,
        n, top_k,
        out.stride(0), 0 if add is None else add.stride(0), y.stride(0),
        HAS_ADD=add is not None, BN=block,
        num_warps=4 if out.is_cuda else 1,
    )
    return y


def moe_experts(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    gated: bool,
    activation: str,
    tiles: Tiles | None = None,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y [T, H]`` in ``x``'s dtype: the routed experts' weighted sum (module docstring),
    plus ``add [T, H]`` (the shared expert's output) before the one rounding.

    ``x [T, H]``; ``w1 [E, 2I or I, H]``; ``w2 [E, H, I]``; ``topk_ids [T, k]`` (any int
    dtype); ``topk_weights [T, k]`` (any float dtype, applied in float32). ``tiles``
    None: :func:`default_tiles` for the step's size. Four launches: the sort, the two
    grouped products and :func:`combine`.
    """
    _check_weights(x, w1, w2, gated)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} not in the kernels' {sorted(ACTIVATIONS)}")
    t, top_k = topk_ids.shape
    if t != x.shape[0] or tuple(topk_weights.shape) != (t, top_k):
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} "
            f"do not match x {tuple(x.shape)}"
        )
    if top_k < 1:
        raise ValueError(f"topk_ids must have at least one column, got shape {(t, top_k)}")
    if tiles is None:
        tiles = default_tiles(
            t, top_k, w1.shape[0], w2.shape[2], w2.shape[1], x, gated=gated
        )
    blocks = sort_by_expert(topk_ids, w1.shape[0], tiles.block_m)
    h = grouped_up(x, w1, blocks, top_k, gated=gated, activation=activation, tiles=tiles)
    out = grouped_down(h, w2, blocks, topk_weights, tiles=tiles)
    return combine(out, top_k, x.dtype, add)


# --------------------------------------------------------------------------------------
# Torch twins
# --------------------------------------------------------------------------------------


def _act(v: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(v)
    if activation == "relu":
        return F.relu(v)
    if activation == "relu2":
        return torch.square(F.relu(v))
    raise ValueError(f"activation {activation!r} not in {sorted(ACTIVATIONS)}")


def grouped_up_reference(
    x: torch.Tensor, w1: torch.Tensor, blocks: ExpertBlocks, top_k: int, *,
    gated: bool, activation: str,
) -> torch.Tensor:
    """Twin of :func:`grouped_up`: gather each assignment's expert weights, batched product
    (in float32, or float64 for float64 operands)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    expert = expert_of_assignment(blocks)
    tok = torch.arange(blocks.num_assignments, device=x.device) // top_k
    xr = x[tok].to(acc)
    v = torch.bmm(w1[expert].to(acc), xr[:, :, None])[:, :, 0]
    if gated:
        gate, up = v.chunk(2, dim=-1)
        return (_act(gate, activation) * up).to(x.dtype)
    return _act(v, activation).to(x.dtype)


def grouped_down_reference(
    h: torch.Tensor, w2: torch.Tensor, blocks: ExpertBlocks, weights: torch.Tensor
) -> torch.Tensor:
    """Twin of :func:`grouped_down` (float32, or float64 for float64 operands)."""
    acc = torch.promote_types(h.dtype, torch.float32)
    expert = expert_of_assignment(blocks)
    v = torch.bmm(w2[expert].to(acc), h.to(acc)[:, :, None])[:, :, 0]
    return v * weights.reshape(-1, 1).to(acc)


def moe_experts_reference(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, *, gated: bool, activation: str,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """Twin of :func:`moe_experts` (gathered weights; small shapes only)."""
    _check_weights(x, w1, w2, gated)
    t, top_k = topk_ids.shape
    blocks = sort_by_expert_reference(topk_ids, w1.shape[0], 16)
    h = grouped_up_reference(x, w1, blocks, top_k, gated=gated, activation=activation)
    out = grouped_down_reference(h, w2, blocks, topk_weights)
    return combine_reference(out, top_k, x.dtype, add)


def combine_reference(
    out: torch.Tensor, top_k: int, dtype: torch.dtype, add: torch.Tensor | None = None
) -> torch.Tensor:
    """Twin of :func:`combine` (float32, or float64 for float64 rows)."""
    y = out.view(-1, top_k, out.shape[1]).sum(dim=1)
    if add is not None:
        y = y + add.to(y.dtype)
    return y.to(dtype)


def moe_experts_loop(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    gated: bool,
    act,
    accumulate_dtype: torch.dtype,
) -> torch.Tensor:
    """The routed experts one expert at a time, as the Hugging Face references do.

    For each expert that got tokens: its rows of ``x``, ``down(act(gate) * up)`` (or
    ``down(act(up))``) in ``x``'s dtype, times the routing weight, added into a buffer of
    ``accumulate_dtype`` (Nemotron-H sums in float32, Granite and Qwen in the activation
    dtype). ``act`` is the activation callable. One host sync (the experts present).
    """
    out = torch.zeros(x.shape, dtype=accumulate_dtype, device=x.device)
    flat = topk_ids.reshape(-1)
    present = torch.unique(flat).tolist()
    top_k = topk_ids.shape[1]
    for e in present:
        pos = (flat == e).nonzero()[:, 0]
        tok = pos // top_k
        v = F.linear(x[tok], w1[e])
        if gated:
            gate, up = v.chunk(2, dim=-1)
            v = act(gate) * up
        else:
            v = act(v)
        v = F.linear(v, w2[e]) * topk_weights.reshape(-1)[pos, None]
        out.index_add_(0, tok, v.to(accumulate_dtype))
    return out.to(x.dtype)
