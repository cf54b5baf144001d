"""State postprocess after a decode step (plain or speculative), and the state copy.

Semantics (fixed; docs/state-lifecycle.md). For batch row ``r`` of a step:

- ``s = idx_mapping[r]`` is the request's persistent slot (rows map to slots
  non-contiguously), ``n = num_computed[s]`` the tokens computed before the step;
- the step ran ``q_r = 1 + d_r`` tokens and wrote the state after each of them,
  ``S_0 .. S_{d_r}``, to its own page ``out_pages[r, j]`` (entries ``j >= q_r`` are -1);
- verification accepted ``a = num_accepted[r]`` tokens, ``1 <= a <= q_r``.

Then the request's state becomes ``S_{a-1}`` and its computed count ``n + a``; for every
grid point ``p`` (a multiple of ``boundary_interval``) with ``n < p <= n + a`` the
checkpoint for prefix length ``p`` is ``S_{p-1-n}``; every other ``S_j`` page is
released, and so is the page the step read its initial state from (``state_page[s]``)
when the request owns it (``release_prev[r]``; a checkpoint page read on a prefix hit
belongs to the prefix index and is never released by the request).

Ownership transfer, not copying: every ``S_j`` already lives on its own page, so
"state = S_{a-1}" and "checkpoint(p) = S_j" are page-id updates. When ``p = n + a``
the same page is both the running state and the checkpoint (one page, two roles; the
cache manager accounts for the shared ownership). :func:`state_postprocess` therefore
moves no state bytes at all. :func:`state_copy` is the data-moving kernel a copying
design needs (and the measured baseline for this one).

Outputs and the race rule (docs/racecheck.md): the decision inputs are read-only for
the launch and every output goes to a buffer no program of the launch reads. Per-slot
results (``new_state_page``, ``new_num_computed``) are written at ``idx_mapping[r]`` into
separate buffers that start as copies of ``state_page`` / ``num_computed``; the caller
swaps them in (or copies them back) after the launch, ordered on the same stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = [
    "PostprocessResult",
    "StateCopyPlan",
    "max_checkpoints_per_row",
    "state_copy",
    "state_copy_reference",
    "state_postprocess",
    "state_postprocess_reference",
]


@dataclass
class PostprocessResult:
    """What one step's postprocess decided, as device tensors (all int32).

    ``new_state_page[slot]`` and ``new_num_computed[slot]``: full per-slot arrays (slots
    outside the batch hold their previous values when the launcher allocated them).
    ``ckpt_page[r, k]`` / ``ckpt_len[r, k]``: the k-th checkpoint row ``r`` produced (the
    page holding it and the prefix length it summarizes), in increasing length, -1
    padded. ``release_pages[r, :]``: pages row ``r`` gives back to the pool (released
    ``S_j`` in increasing ``j``, then the previous state page if released), -1 padded.
    """

    new_state_page: torch.Tensor
    new_num_computed: torch.Tensor
    ckpt_page: torch.Tensor
    ckpt_len: torch.Tensor
    release_pages: torch.Tensor


def max_checkpoints_per_row(max_query_len: int, boundary_interval: int) -> int:
    """Most grid points ``a <= max_query_len`` accepted tokens can cross: ceil(q / interval)."""
    return -(-max_query_len // boundary_interval)


# --------------------------------------------------------------------------------------
# Reference twin (the CPU path and the test oracle)
# --------------------------------------------------------------------------------------


def state_postprocess_reference(
    idx_mapping: torch.Tensor,
    num_computed: torch.Tensor,
    num_accepted: torch.Tensor,
    out_pages: torch.Tensor,
    state_page: torch.Tensor,
    release_prev: torch.Tensor,
    boundary_interval: int,
) -> PostprocessResult:
    """Torch twin of :func:`state_postprocess`, written straight from the semantics above.

    Same inputs and outputs as the kernel (see the module docstring); runs on the
    host and validates every precondition the kernel assumes, raising ``ValueError``
    naming the row and field.
    """
    if boundary_interval < 1:
        raise ValueError(f"boundary_interval must be >= 1, got {boundary_interval}")
    num_rows, max_q = out_pages.shape
    max_k = max_checkpoints_per_row(max_q, boundary_interval)
    slots = idx_mapping.tolist()
    computed = num_computed.tolist()
    accepted = num_accepted.tolist()
    pages = out_pages.tolist()
    prev_pages = state_page.tolist()
    release = release_prev.tolist()
    if len(set(slots)) != len(slots):
        raise ValueError("idx_mapping must not repeat a slot")

    new_state_page = list(prev_pages)
    new_num_computed = list(computed)
    ckpt_page = [[-1] * max_k for _ in range(num_rows)]
    ckpt_len = [[-1] * max_k for _ in range(num_rows)]
    release_pages = [[-1] * max_q for _ in range(num_rows)]
    for r in range(num_rows):
        s, a, row = slots[r], accepted[r], pages[r]
        if not 0 <= s < len(computed):
            raise ValueError(f"row {r}: idx_mapping {s} out of range")
        q = sum(1 for page in row if page >= 0)
        if any(page < 0 for page in row[:q]) or any(page >= 0 for page in row[q:]):
            raise ValueError(f"row {r}: out_pages must be -1 exactly beyond the row's q tokens")
        if not 1 <= a <= q:
            raise ValueError(f"row {r}: num_accepted {a} outside [1, {q}]")
        n = computed[s]
        kept = {a - 1}
        k = 0
        for p in range(n + 1, n + a + 1):
            if p % boundary_interval == 0:
                j = p - 1 - n
                ckpt_page[r][k] = row[j]
                ckpt_len[r][k] = p
                kept.add(j)
                k += 1
        released = [row[j] for j in range(q) if j not in kept]
        if release[r] and prev_pages[s] >= 0:
            released.append(prev_pages[s])
        release_pages[r][: len(released)] = released
        new_state_page[s] = row[a - 1]
        new_num_computed[s] = n + a

    def as_tensor(values: list, width: int | None = None) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.int32, device=out_pages.device)
        return t.reshape(num_rows, width) if width is not None else t

    return PostprocessResult(
        new_state_page=as_tensor(new_state_page),
        new_num_computed=as_tensor(new_num_computed),
        ckpt_page=as_tensor(ckpt_page, max_k),
        ckpt_len=as_tensor(ckpt_len, max_k),
        release_pages=as_tensor(release_pages, max_q),
    )


# --------------------------------------------------------------------------------------
# Triton kernel: page-id bookkeeping only
# --------------------------------------------------------------------------------------


@triton.jit
def _state_postprocess_kernel(
    idx_mapping_ptr,
    num_computed_ptr,
    num_accepted_ptr,
    out_pages_ptr,
    out_pages_stride,
    state_page_ptr,
    release_prev_ptr,
    new_state_page_ptr,
    new_num_computed_ptr,
    ckpt_page_ptr,
    ckpt_len_ptr,
    ckpt_stride,
    release_ptr,
    release_stride,
    boundary_interval,
    max_q,
    max_k,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program per batch row: the whole decision of a request is made once, by one
    # program, from inputs nobody in this launch writes.
    r = tl.program_id(0)
    slot = tl.load(idx_mapping_ptr + r)
    n = tl.load(num_computed_ptr + slot)
    a = tl.load(num_accepted_ptr + r)
    prev_page = tl.load(state_page_ptr + slot)
    release_prev = tl.load(release_prev_ptr + r) != 0

    row_ptr = out_pages_ptr + r * out_pages_stride
    j = tl.arange(0, BLOCK_Q)
    pages = tl.load(row_ptr + j, mask=j < max_q, other=-1)
    q = tl.sum((pages >= 0).to(tl.int32), axis=0)

    # First grid point after n, and the S index that summarizes it.
    j0 = (n // boundary_interval + 1) * boundary_interval - 1 - n
    is_ckpt = (j < a) & (j >= j0) & ((j - j0) % boundary_interval == 0)
    kept = is_ckpt | (j == a - 1)
    released = (j < q) & (kept == 0)
    # Released pages are compacted to the front of the row: S_j goes to slot
    # j - (pages kept before j). An exclusive prefix count over the q lanes.
    kept_i = kept.to(tl.int32)
    pos = j - (tl.cumsum(kept_i, axis=0) - kept_i)
    num_released = tl.sum(released.to(tl.int32), axis=0)
    # Gather form (one-hot over a tiny BLOCK_Q x BLOCK_Q tile) rather than a scatter
    # after a -1 fill, so every output address is stored exactly once.
    sel = released[None, :] & (pos[None, :] == j[:, None])
    rel = tl.sum(tl.where(sel, pages[None, :] + 1, 0), axis=1) - 1
    rel = tl.where((j == num_released) & release_prev & (prev_page >= 0), prev_page, rel)
    tl.store(release_ptr + r * release_stride + j, rel, mask=j < max_q)

    k = tl.arange(0, BLOCK_K)
    jk = j0 + k * boundary_interval
    has_ckpt = (jk < a) & (k < max_k)
    ck_page = tl.load(row_ptr + jk, mask=has_ckpt, other=-1)
    ck_len = tl.where(has_ckpt, n + 1 + jk, -1)
    tl.store(ckpt_page_ptr + r * ckpt_stride + k, ck_page, mask=k < max_k)
    tl.store(ckpt_len_ptr + r * ckpt_stride + k, ck_len, mask=k < max_k)

    tl.store(new_state_page_ptr + slot, tl.load(row_ptr + a - 1))
    tl.store(new_num_computed_ptr + slot, n + a)


def _overlaps(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.numel() == 0 or y.numel() == 0 or x.device != y.device:
        return False
    x_lo = x.data_ptr()
    y_lo = y.data_ptr()
    x_hi = x_lo + x.untyped_storage().nbytes() - x.storage_offset() * x.element_size()
    y_hi = y_lo + y.untyped_storage().nbytes() - y.storage_offset() * y.element_size()
    return x_lo < y_hi and y_lo < x_hi


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"state_postprocess: {message}")


def state_postprocess(
    idx_mapping: torch.Tensor,
    num_computed: torch.Tensor,
    num_accepted: torch.Tensor,
    out_pages: torch.Tensor,
    state_page: torch.Tensor,
    release_prev: torch.Tensor,
    boundary_interval: int,
    *,
    out: PostprocessResult | None = None,
) -> PostprocessResult:
    """Decide a step's new state pages, checkpoints and releases on the device.

    Inputs (one device, int32 unless said): ``idx_mapping [B]`` (unique slots),
    ``num_computed [S]`` and ``state_page [S]`` (per slot), ``num_accepted [B]``,
    ``out_pages [B, Q]`` (unit stride along Q, -1 beyond each row's q tokens),
    ``release_prev [B]`` bool, ``boundary_interval`` a host int >= 1. Preconditions not
    checked on the device (checking them would need a host sync):
    ``1 <= num_accepted[r] <= q_r``, unique ``idx_mapping``, pages ``>= 0`` in the first
    ``q_r`` columns. :func:`state_postprocess_reference` checks them all.

    Returns a :class:`PostprocessResult` with the same values as the twin; ``ckpt_*``
    have ``max_checkpoints_per_row(Q, boundary_interval)`` columns, ``release_pages`` has Q.
    With ``out`` given, results are written into its tensors (which must not overlap
    any input) and it is returned; slots not in the batch are then left untouched.

    Traffic per row: reads 4 bytes each of idx_mapping, num_accepted, num_computed,
    state_page, 1 byte of release_prev, Q * 4 bytes of out_pages (plus re-reads of at
    most 1 + K of those words); writes 8 bytes of per-slot results and (2K + Q) * 4
    bytes of checkpoint and release lists. Zero bytes of state: the step's states
    stay where the forward wrote them. Without ``out`` the launcher also clones
    ``state_page`` and ``num_computed`` (4S bytes each, read and written once) so that
    slots outside the batch carry over.

    Why one program per row: the decision is per request, not per layer, and no layer
    dimension exists in this launch. The seed bug needed many programs (one per
    request and layer) each re-deriving the same decision from a buffer one of them
    mutated; here each decision is derived once, by one program, from read-only
    inputs, and every output goes to a buffer no program reads. No host sync: the
    launch only enqueues device work.
    """
    _check(boundary_interval >= 1, f"boundary_interval must be >= 1, got {boundary_interval}")
    _check(out_pages.dim() == 2, f"out_pages must be [B, Q], got {tuple(out_pages.shape)}")
    num_rows, max_q = out_pages.shape
    num_slots = num_computed.shape[0] if num_computed.dim() == 1 else -1
    device = out_pages.device
    for name, t, shape in (
        ("idx_mapping", idx_mapping, (num_rows,)),
        ("num_accepted", num_accepted, (num_rows,)),
        ("release_prev", release_prev, (num_rows,)),
        ("num_computed", num_computed, (num_slots,)),
        ("state_page", state_page, (num_slots,)),
        ("out_pages", out_pages, (num_rows, max_q)),
    ):
        _check(tuple(t.shape) == shape, f"{name} must have shape {shape}, got {tuple(t.shape)}")
        _check(t.device == device, f"{name} is on {t.device}, out_pages on {device}")
        want = torch.bool if name == "release_prev" else torch.int32
        _check(t.dtype == want, f"{name} must be {want}, got {t.dtype}")
        _check(t.dim() != 1 or t.stride(0) == 1 or t.numel() <= 1, f"{name} must be contiguous")
    _check(max_q >= 1, "out_pages needs at least one column")
    _check(out_pages.stride(1) == 1 or max_q == 1, "out_pages must have unit stride along Q")
    max_k = max_checkpoints_per_row(max_q, boundary_interval)

    if out is None:
        # Slots outside the batch keep their values, so the caller can swap buffers.
        out = PostprocessResult(
            new_state_page=state_page.clone(),
            new_num_computed=num_computed.clone(),
            ckpt_page=torch.empty(num_rows, max_k, dtype=torch.int32, device=device),
            ckpt_len=torch.empty(num_rows, max_k, dtype=torch.int32, device=device),
            release_pages=torch.empty(num_rows, max_q, dtype=torch.int32, device=device),
        )
    else:
        inputs = (idx_mapping, num_computed, num_accepted, out_pages, state_page, release_prev)
        for name, t, shape in (
            ("new_state_page", out.new_state_page, (num_slots,)),
            ("new_num_computed", out.new_num_computed, (num_slots,)),
            ("ckpt_page", out.ckpt_page, (num_rows, max_k)),
            ("ckpt_len", out.ckpt_len, (num_rows, max_k)),
            ("release_pages", out.release_pages, (num_rows, max_q)),
        ):
            _check(tuple(t.shape) == shape, f"out.{name} must have shape {shape}")
            _check(t.dtype == torch.int32 and t.device == device, f"out.{name}: int32 on {device}")
            _check(t.is_contiguous(), f"out.{name} must be contiguous")
            # An output aliasing an input is exactly the seed's race.
            _check(not any(_overlaps(t, x) for x in inputs), f"out.{name} overlaps an input")
    if num_rows == 0:
        return out

    _state_postprocess_kernel[(num_rows,)](
        idx_mapping,
        num_computed,
        num_accepted,
        out_pages,
        out_pages.stride(0),
        state_page,
        release_prev,
        out.new_state_page,
        out.new_num_computed,
        out.ckpt_page,
        out.ckpt_len,
        out.ckpt_page.stride(0),
        out.release_pages,
        out.release_pages.stride(0),
        boundary_interval,
        max_q,
        max_k,
        BLOCK_Q=triton.next_power_of_2(max(max_q, 2)),
        BLOCK_K=triton.next_power_of_2(max(max_k, 2)),
    )
    return out


# --------------------------------------------------------------------------------------
# State copy: what a copying design must do on every checkpoint crossing
# --------------------------------------------------------------------------------------


def _validate_state_tensors(conv: Sequence[torch.Tensor], ssm: Sequence[torch.Tensor]) -> None:
    if len(conv) != len(ssm) or not conv:
        raise ValueError("state_copy: need one conv and one ssm tensor per Mamba layer")
    num_pages = conv[0].shape[0]
    for t in (*conv, *ssm):
        if t.shape[0] != num_pages:
            raise ValueError("state_copy: every state tensor needs the same number of pages")
        if t.device != conv[0].device:
            raise ValueError("state_copy: state tensors must share one device")
        if not t[0].is_contiguous():
            raise ValueError("state_copy: each page of a state tensor must be contiguous")


def state_copy_reference(
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    conv: Sequence[torch.Tensor],
    ssm: Sequence[torch.Tensor],
) -> None:
    """Torch twin of :func:`state_copy`: same contract, validates the preconditions."""
    _validate_state_tensors(conv, ssm)
    pairs = [(s, d) for s, d in zip(src_pages.tolist(), dst_pages.tolist()) if s >= 0 and d >= 0]
    dsts = [d for _, d in pairs]
    if len(set(dsts)) != len(dsts):
        raise ValueError("state_copy: a destination page appears twice")
    if set(dsts) & {s for s, _ in pairs}:
        raise ValueError("state_copy: a destination page is also a source page")
    for layer_states in (*conv, *ssm):
        for s, d in pairs:
            layer_states[d].copy_(layer_states[s])


@triton.jit
def _state_copy_kernel(
    src_pages_ptr,
    dst_pages_ptr,
    base_ptrs_ptr,
    page_stride_ptr,
    page_units_ptr,
    UNIT: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    state = tl.program_id(1)  # layer * 2 + state type
    chunk = tl.program_id(2)
    src = tl.load(src_pages_ptr + row).to(tl.int64)
    dst = tl.load(dst_pages_ptr + row).to(tl.int64)
    page_units = tl.load(page_units_ptr + state)
    lo = chunk * CHUNK
    if (src >= 0) & (dst >= 0) & (lo < page_units):
        base = tl.load(base_ptrs_ptr + state).to(tl.pointer_type(UNIT))
        stride = tl.load(page_stride_ptr + state)
        src_ptr = base + src * stride
        dst_ptr = base + dst * stride
        # Pages of different state types differ in size; stop at this page's end.
        hi = tl.minimum(lo + CHUNK, page_units)
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < hi
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=m), mask=m)


_UNITS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


class StateCopyPlan:
    """A device page table for one set of state tensors, built once and launched often.

    ``conv[l]`` is ``[pages, conv_dim, d_conv - 1]`` and ``ssm[l]`` is
    ``[pages, heads, head_dim, d_state]`` (any dtypes; each page contiguous). The plan
    keeps references to the tensors, whose addresses it has baked into its table.
    Building it copies a small table to the device (once); calling it never syncs.
    """

    def __init__(
        self,
        conv: Sequence[torch.Tensor],
        ssm: Sequence[torch.Tensor],
        *,
        block_bytes: int = 8192,
        chunk_bytes: int = 65536,
    ) -> None:
        _validate_state_tensors(conv, ssm)
        self.device = conv[0].device
        self.states = [t for pair in zip(conv, ssm) for t in pair]
        page_bytes = [t[0].numel() * t.element_size() for t in self.states]
        stride_bytes = [t.stride(0) * t.element_size() for t in self.states]
        addresses = [t.data_ptr() for t in self.states]
        # Copy in the widest word every address, page stride and page size allows.
        self.unit = next(
            u for u in (8, 4, 2, 1) if all(x % u == 0 for x in (*page_bytes, *stride_bytes, *addresses))
        )
        self.page_bytes = sum(page_bytes)
        self.table = torch.tensor(
            [addresses, [b // self.unit for b in stride_bytes], [b // self.unit for b in page_bytes]],
            dtype=torch.int64,
            device=self.device,
        )
        largest = max(page_bytes) // self.unit
        self.block = min(triton.next_power_of_2(max(1, block_bytes // self.unit)),
                         triton.next_power_of_2(largest))
        self.chunk = max(self.block, triton.next_power_of_2(max(1, chunk_bytes // self.unit)))
        self.num_chunks = -(-largest // self.chunk)

    def __call__(self, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
        """Launch the copy for int32 ``[rows]`` page pairs (see :func:`state_copy`)."""
        num_rows = src_pages.shape[0]
        for name, t in (("src_pages", src_pages), ("dst_pages", dst_pages)):
            if t.dtype != torch.int32 or t.device != self.device or t.shape != (num_rows,):
                raise ValueError(f"state_copy: {name} must be int32 [rows] on {self.device}")
            if not t.is_contiguous():
                raise ValueError(f"state_copy: {name} must be contiguous")
        if num_rows == 0:
            return
        _state_copy_kernel[(num_rows, len(self.states), self.num_chunks)](
            src_pages,
            dst_pages,
            self.table[0],
            self.table[1],
            self.table[2],
            UNIT=_UNITS[self.unit],
            BLOCK=self.block,
            CHUNK=self.chunk,
        )


def state_copy(
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    conv: Sequence[torch.Tensor],
    ssm: Sequence[torch.Tensor],
    *,
    block_bytes: int = 8192,
    chunk_bytes: int = 65536,
) -> None:
    """Copy every Mamba layer's conv window and SSM state of page ``src_pages[r]`` to
    page ``dst_pages[r]``, for every row ``r`` (a -1 on either side skips the row).

    Shapes as in :class:`StateCopyPlan` (build one plan and reuse it on a hot path;
    this function builds a fresh plan per call). Grid
    ``(rows, layers x 2 state types, chunks)``: each program copies one ``chunk_bytes``
    slice of one page of one layer, so even a single crossing spreads over the chip.
    Moves ``2 x page bytes`` (read + write, all layers) per copied row.

    Race rule: programs read source pages and write destination pages, so destination
    pages must be distinct and never a source of the same launch. The twin checks
    this; the launch cannot without a host sync.
    """
    plan = StateCopyPlan(conv, ssm, block_bytes=block_bytes, chunk_bytes=chunk_bytes)
    plan(src_pages, dst_pages)
