"""Mamba2 SSD scan over a packed step of variable-length rows, with states at any offset.

The prefill / mixed-step counterpart of the per-row scan of the reference mixer. Row ``i``
owns tokens ``query_start[i] .. query_start[i + 1]`` of the packed inputs (rows may be
empty), starts from an initial state (its page's, or zeros) and must deliver the state
*after* its token at every requested offset (grid points, junctions, the row end: the
``state_out_*`` fields of a step's batch). Layout as in
:mod:`hybridserve.kernels.ssd`: ``x [T, H, P]``, ``dt [T, H]`` (discretised), ``A [H]``,
``B, C [T, G, N]``; states ``[H, P, N]``, the layout of an ``ssm_state`` page.

**The scan primitive.** Everything here is built on one pluggable function::

    scan(x, dt, A, B, C, cu_seqlens, initial_states, cu_seqlens_cpu=None) -> (y, final_states)

over packed sequences ``cu_seqlens [S + 1]`` (int64, on the device of ``x``; the host copy
``cu_seqlens_cpu`` spares a device read), ``initial_states`` and ``final_states``
``[S, H, P, N]``, ``y [T, H, P]`` without the ``D`` skip. Two implementations:

- :func:`ssd_scan_varlen_reference`: the torch twin, a loop over sequences with
  :func:`~hybridserve.kernels.ssd.ssd_chunked_reference` (the CPU path and the oracle);
- :func:`ssd_scan_varlen_fla`: flash-linear-attention's ``chunk_simple_gla`` (fla-core,
  an optional GPU dependency imported on first use; :func:`fla_available`). With
  ``q = C``, ``k = B`` (groups expanded to heads), ``v = x * dt``, log decay ``g = dt * A``,
  ``scale = 1`` and the state stored value-first (``[H, P, N]``) it computes
  ``S_t = exp(g_t) S_{t-1} + v_t k_t^T``, ``y_t = S_t q_t``: the SSD recurrence.

**States at arbitrary offsets: two scans and a chain** (:func:`ssd_prefill`). A varlen
scan returns each sequence's *final* state only. So every row is cut into segments that
end right after each requested offset and at the row end (:func:`plan_segments`): every
requested state is then some segment's final state. When no row has more than one
segment, one scan over the segments does it. Otherwise a segment's true initial state is
the state its predecessor ends with, unknown before the scan. The recurrence is linear
in the state with a scalar decay per head, so:

1. scan once over all segments, the row's initial state for a row's first segment and
   zeros for the others: ``F_j``, segment ``j``'s own final state;
2. chain them per row: ``S_j = exp(sum over segment j of dt * A) * S_{j-1} + F_j``
   (vectorised over rows, a loop over the segment index; the decay sum in float64);
3. scan again with every segment's true initial state (``S_{j-1}``, or the row's for a
   first segment): exact outputs, and the states at every requested offset.

**States on the chunk grid: no cut.** A chunked scan computes the state at the start of
every chunk anyway (its output pass consumes them). A primitive that can return those
(``chunk_states=True``: the twin, and fla-core's forward pieces where this fla-core has
them) lets :func:`plan_segments` (given ``chunk``) serve a request that lies on its
segment's chunk grid from them, without a cut. Prefix-cache checkpoints sit on a grid of
positions and rows mostly start on it (a fresh prompt at 0, a cached prefix at a grid
point), so a prefill that writes a checkpoint every 64 tokens takes one scan.

**The fused scans.** :mod:`~hybridserve.kernels.ssd_chunked` is our own chunked scan in
one launch (the GPU path since fla-core's needed the groups expanded to heads and float32
copies of the inputs): it reads grouped B/C and the raw dt, discretises dt in float32
inside, adds the D skip, and stores the requested row ends and chunk states itself, into
the rows of a buffer or straight into their pages (``out_cache``); :func:`is_fused` tells
it from the plain primitive above. :mod:`~hybridserve.kernels.ssd_two_pass` (the default)
does the same in two launches, a sequential state pass and then the outputs of every
chunk in parallel, and :mod:`~hybridserve.kernels.ssd_chunk_states` in three (every
chunk's local state in parallel, an elementwise state passing, the same output pass),
with the same contract and the same twin. A fused scan needs a plan
with its chunk (:data:`SCAN_CHUNK`), whose :class:`Segments` then also say where each
state goes. The two-scan design below stays for plain primitives without chunk states.

The two-scan design uses a library scan as a black box: any varlen scan with initial and
final states plugs in, and the whole orchestration runs (and is tested) on the CPU with
the torch twin. Its cost is a second scan only in steps that need states inside a row,
plus a chain of ``max segments per row`` element-wise steps on ``[rows, H, P, N]``;
cutting at offsets also restarts the library's chunking at segment starts.

:func:`plan_segments` turns a step's host lists into the scan's index tensors (the model's
step plan calls it once per step); :func:`discretize_dt_varlen` applies the
dt discretisation with the per-row clamp exception of single-token continuation rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridserve.kernels import ssd_chunk_states, ssd_chunked, ssd_two_pass
from hybridserve.kernels.ssd import discretize_dt, heads_from_groups, ssd_chunked_reference
from hybridserve.kernels.ssd_tails import ssd_tail_states, ssd_tail_states_reference
from hybridserve.kernels.transfer import upload_lists

__all__ = [
    "ScanFn",
    "Segments",
    "discretize_dt_varlen",
    "fla_available",
    "plan_segments",
    "ssd_prefill",
    "ssd_scan_varlen_fla",
    "ssd_scan_varlen_reference",
]

ScanFn = Callable[..., tuple[torch.Tensor, ...]]
# The chunk of the scan primitives' chunk states (fla-core's default chunk): with
# ``chunk_states=True`` a primitive also returns the state at the start of every chunk of
# SCAN_CHUNK tokens of every sequence, so states that fall on that grid need no cut.
SCAN_CHUNK = 64


# --------------------------------------------------------------------------------------
# Scan primitives
# --------------------------------------------------------------------------------------


def ssd_scan_varlen_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_size: int = 64,
    chunk_states: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Torch twin of the scan primitive: a loop over sequences (see the module docstring).

    Returns ``(y [T, H, P], final_states [S, H, P, N])`` in ``promote(x.dtype, float32)``;
    an empty sequence's final state is its initial state. With ``chunk_states`` also the
    states at the start of every :data:`SCAN_CHUNK`-token chunk of every sequence
    (:func:`chunk_offsets` lays them out); ``chunk_size`` is only the twin's internal
    chunking and does not change any result.
    """
    bounds = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    tokens, heads, head_dim = x.shape
    d_state = B.shape[-1]
    if bounds[0] != 0 or bounds[-1] != tokens:
        raise ValueError(f"cu_seqlens must run from 0 to T={tokens}, got {bounds}")
    compute = torch.promote_types(x.dtype, torch.float32)
    n = len(bounds) - 1
    y = torch.empty(tokens, heads, head_dim, dtype=compute, device=x.device)
    final = torch.zeros(n, heads, head_dim, d_state, dtype=compute, device=x.device)
    starts = chunk_offsets(bounds)
    chunks = torch.zeros(starts[-1], heads, head_dim, d_state, dtype=compute, device=x.device)
    for i in range(n):
        s, e = bounds[i], bounds[i + 1]
        init = None if initial_states is None else initial_states[i]
        if e == s:
            if init is not None:
                final[i] = init
            continue
        # The state before chunk c is the state after token c * SCAN_CHUNK - 1.
        inner = list(range(SCAN_CHUNK - 1, e - s - 1, SCAN_CHUNK)) if chunk_states else []
        y[s:e], states = ssd_chunked_reference(
            x[s:e], dt[s:e], A, B[s:e], C[s:e], chunk_size, None, init, [*inner, e - s - 1]
        )
        final[i] = states[-1]
        if chunk_states:
            if init is not None:
                chunks[starts[i]] = init
            chunks[starts[i] + 1 : starts[i + 1]] = states[:-1]
    if chunk_states:
        return y, final, chunks
    return y, final


def chunk_offsets(bounds: Sequence[int]) -> list[int]:
    """Where each sequence's chunk states start in the flat chunk-state tensor of a scan
    over sequences ``bounds`` (host ``cu_seqlens``): sequence ``i`` has
    ``ceil(len_i / SCAN_CHUNK)`` chunks, the last entry is the total."""
    out = [0]
    for s, e in zip(bounds[:-1], bounds[1:]):
        out.append(out[-1] + -(-(e - s) // SCAN_CHUNK))
    return out


@functools.cache
def fla_available() -> bool:
    """Whether fla-core's ``chunk_simple_gla`` can be imported (imported once, then cached)."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla  # noqa: F401
    except Exception:  # absent, or present but unusable here (no GPU Triton backend)
        return False
    return True


def fla_version() -> str | None:
    """fla-core's version when its scan is usable here (recorded by benchmarks), else None."""
    if not fla_available():
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fla-core")
    except PackageNotFoundError:  # importable from a path without package metadata
        import fla

        return getattr(fla, "__version__", "unknown")


def ssd_scan_varlen_fla(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_states: bool = False,
) -> tuple[torch.Tensor, ...]:
    """The scan primitive through fla-core's ``chunk_simple_gla`` (CUDA; float32 inputs).

    ``cu_seqlens`` must be int64 on the device and every sequence non-empty. Reuse the same
    ``cu_seqlens`` tensor across calls of a step: fla memoises its chunk indices by tensor
    identity. Returns ``(y [T, H, P]`` in ``x.dtype``, ``final_states [S, H, P, N]`` float32),
    and with ``chunk_states`` (only where :func:`fla_chunk_states_available`) the states at
    the start of every chunk as the reference twin lays them out.
    """
    heads = x.shape[1]
    # fla takes one key per value head: expand the groups (copies; fla wants contiguous).
    q = heads_from_groups(C, heads).unsqueeze(0)  # [1, T, H, N]
    k = heads_from_groups(B, heads).unsqueeze(0)
    v = (x * dt[..., None]).unsqueeze(0)  # [1, T, H, P]
    g = (dt * A).unsqueeze(0)  # [1, T, H]
    if chunk_states:
        return _fla_scan_with_chunk_states(q, k, v, g, initial_states, cu_seqlens, cu_seqlens_cpu)
    from fla.ops.simple_gla import chunk_simple_gla

    y, final = chunk_simple_gla(
        q,
        k,
        v,
        g=g,
        scale=1.0,
        initial_state=initial_states,
        output_final_state=True,
        state_v_first=True,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    return y[0], final


@functools.cache
def _fla_forward_parts():
    """The pieces of fla-core's ``chunk_simple_gla`` forward, or None where this fla-core
    does not have them under these names (checked against fla-core 0.6.0)."""
    try:
        from fla.ops.common.chunk_h import chunk_fwd_h
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices
        from fla.ops.utils.constant import RCP_LN2
    except ImportError:
        return None
    return chunk_fwd_h, chunk_fwd_o, chunk_local_cumsum, prepare_chunk_indices, RCP_LN2


def fla_chunk_states_available() -> bool:
    """fla-core is importable and exposes the forward pieces that return chunk states."""
    return fla_available() and _fla_forward_parts() is not None


def _fla_scan_with_chunk_states(q, k, v, g, initial_states, cu_seqlens, cu_seqlens_cpu):
    """``chunk_simple_gla``'s forward (inference only), keeping the per-chunk states it
    computes anyway: the output kernel consumes the state at the start of every chunk, so
    states on the chunk grid cost nothing extra. The library's public function returns
    the final states only; with these, a row needs no cut (and no second scan) for states
    that fall on its chunk grid."""
    chunk_fwd_h, chunk_fwd_o, local_cumsum, chunk_indices_of, rcp_ln2 = _fla_forward_parts()
    indices = chunk_indices_of(cu_seqlens, SCAN_CHUNK, cu_seqlens_cpu=cu_seqlens_cpu)
    # The library's kernels take the log decay's running sum per chunk in base 2.
    g = local_cumsum(g, chunk_size=SCAN_CHUNK, scale=rcp_ln2, cu_seqlens=cu_seqlens,
                     chunk_indices=indices)
    h, final = chunk_fwd_h(
        k=k, v=v, g=g, g_gamma=None, gk=None, gv=None, h0=initial_states,
        output_final_state=True, cu_seqlens=cu_seqlens, chunk_size=SCAN_CHUNK,
        states_in_fp32=False, state_v_first=True,
    )
    y = chunk_fwd_o(
        q=q, k=k, v=v, g=g, g_gamma=None, h=h, scale=1.0, cu_seqlens=cu_seqlens,
        chunk_size=SCAN_CHUNK, chunk_indices=indices, state_v_first=True,
    )
    return y[0], final, h[0]


def chunk_states_supported(scan: ScanFn) -> bool:
    """Whether ``scan`` can return chunk states (``chunk_states=True``), or is a fused
    scan (:func:`is_fused`), which stores them itself."""
    if scan is ssd_scan_varlen_fla:
        return fla_chunk_states_available()
    return is_fused(scan) or getattr(scan, "func", scan) is ssd_scan_varlen_reference


def is_fused(scan: ScanFn) -> bool:
    """Whether ``scan`` is a fused scan of :mod:`~hybridserve.kernels.ssd_chunked`,
    :mod:`~hybridserve.kernels.ssd_two_pass` or :mod:`~hybridserve.kernels.ssd_chunk_states`
    (raw dt, the D skip, states into slots) rather than the plain scan primitive."""
    return getattr(scan, "func", scan) in (ssd_two_pass.ssd_scan_two_pass,
                                           ssd_chunk_states.ssd_scan_chunk_states,
                                           ssd_chunked.ssd_scan_fused,
                                           ssd_chunked.ssd_scan_fused_reference)


# --------------------------------------------------------------------------------------
# Segments
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segments:
    """How :func:`ssd_prefill` cuts a step's rows (segment ids in packed order).

    Every non-empty row is cut right after each requested offset and at its end; empty
    rows have no segment. All index tensors are int64 on the step's device.
    """

    num_segments: int
    cu_seqlens: torch.Tensor  # [S + 1]
    cu_seqlens_cpu: torch.Tensor  # [S + 1], host
    first_segment: torch.Tensor  # [R]: the first segment of every non-empty row ...
    first_row: torch.Tensor  # [R]: ... and that row
    later_segment: torch.Tensor  # the other segments; segment j's predecessor is j - 1
    chain_steps: tuple[torch.Tensor, ...]  # step k: the k-th segments (k >= 1) of each row
    request_segment: torch.Tensor  # [K]: the segment that holds each requested offset ...
    # ... at its end, except the requests chunk_request [C], which read the scan's chunk
    # state chunk_index [C] (a request on its row's chunk grid), and tail_request [M],
    # which run the first tail_lengths [M] of their tail_tokens [M, W] on from chunk
    # state tail_chunk [M] (:mod:`~hybridserve.kernels.ssd_tails`). All empty without a
    # chunk.
    chunk_request: torch.Tensor
    chunk_index: torch.Tensor
    tail_request: torch.Tensor
    tail_chunk: torch.Tensor
    tail_tokens: torch.Tensor
    tail_lengths: torch.Tensor
    # For a fused scan (:mod:`~hybridserve.kernels.ssd_chunked`), which stores the states
    # it is asked for itself: chunk_slot [chunks] / final_slot [S] name the request that
    # receives the state before each chunk / after each segment (the first request of
    # each distinct state; -1 for none), dup_request [D] copy theirs from request
    # dup_source [D]; start_slot [chunks] is the row of a float32 buffer of num_starts
    # rows that receives the start state of a tail (tail_start_slot [M]: each tail's);
    # first_chunk [S + 1] the flat index of every segment's first chunk. All empty
    # without a chunk.
    chunk: int | None = None
    num_starts: int = 0
    first_chunk: torch.Tensor | None = None
    chunk_slot: torch.Tensor | None = None
    final_slot: torch.Tensor | None = None
    start_slot: torch.Tensor | None = None
    tail_start_slot: torch.Tensor | None = None
    dup_request: torch.Tensor | None = None
    dup_source: torch.Tensor | None = None

    @property
    def reads_chunk_states(self) -> bool:
        return self.chunk_request.numel() > 0 or self.tail_request.numel() > 0

    @property
    def single_scan(self) -> bool:
        """No row has more than one segment: one scan gives every requested state."""
        return not self.chain_steps


def _to_device(lists: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """Host int lists -> int64 tensors on ``device`` with one asynchronous copy."""
    return upload_lists(lists, torch.int64, device)


def _segment_lists(
    query_start: Sequence[int],
    state_rows: Sequence[int],
    state_offsets: Sequence[int],
    chunk: int | None,
) -> dict[str, list]:
    rows = len(query_start) - 1
    ends: list[set[int]] = [set() for _ in range(rows)]
    for r, off in zip(state_rows, state_offsets, strict=True):
        if not 0 <= r < rows or not 0 <= off < query_start[r + 1] - query_start[r]:
            raise ValueError(f"state request (row {r}, offset {off}) out of range")
        ends[r].add(off)
    cu, first_segment, first_row, later, steps = [0], [], [], [], []
    # (row, offset) -> (segment, chunk state index or -1, tail tokens or None)
    source: dict[tuple[int, int], tuple[int, int, list[int] | None]] = {}
    chunks_before = 0  # chunk states of the sequences before the current one
    for i in range(rows):
        s, q = query_start[i], query_start[i + 1] - query_start[i]
        if q == 0:
            continue
        if chunk is not None:
            # One sequence per row. The row end is its final state, a state on the
            # chunk grid is a chunk state, any other is a tail of under ``chunk`` tokens
            # from the chunk state before it.
            seg = len(cu) - 1
            cu.append(s + q)
            first_segment.append(seg)
            first_row.append(i)
            for end in ends[i]:
                c = (end + 1) // chunk
                if end == q - 1:
                    source[(i, end)] = (seg, -1, None)
                elif (end + 1) % chunk == 0:
                    source[(i, end)] = (seg, chunks_before + c, None)
                else:
                    tail = list(range(s + c * chunk, s + end + 1))
                    source[(i, end)] = (seg, chunks_before + c, tail)
            chunks_before += -(-q // chunk)
            continue
        for k, end in enumerate(sorted(ends[i] | {q - 1})):
            seg = len(cu) - 1
            cu.append(s + end + 1)
            source[(i, end)] = (seg, -1, None)
            if k == 0:
                first_segment.append(seg)
                first_row.append(i)
            else:
                later.append(seg)
                if len(steps) < k:
                    steps.append([])
                steps[k - 1].append(seg)
    if cu[-1] != query_start[-1]:
        raise ValueError("query_start must start at 0 and be non-decreasing")
    found = [source[(r, off)] for r, off in zip(state_rows, state_offsets)]
    slots = _state_slots(found, len(cu) - 1, chunks_before) if chunk is not None else {}
    chunk_pos = [j for j, (_, c, tail) in enumerate(found) if c >= 0 and tail is None]
    tail_pos = [j for j, (_, _, tail) in enumerate(found) if tail is not None]
    width = max((len(found[j][2]) for j in tail_pos), default=0)
    return {
        "cu": cu, "first_segment": first_segment, "first_row": first_row, "later": later,
        "steps": steps, "request": [seg for seg, _, _ in found],
        "chunk_pos": chunk_pos, "chunk_index": [found[j][1] for j in chunk_pos],
        "tail_pos": tail_pos, "tail_chunk": [found[j][1] for j in tail_pos],
        # Tails padded with token 0 to the longest; the padding is masked out.
        "tail_tokens": [t for j in tail_pos for t in found[j][2] + [0] * (width - len(found[j][2]))],
        "tail_lengths": [len(found[j][2]) for j in tail_pos],
        "chunk": chunk,
        **slots,
    }


def _state_slots(found: list, segments: int, chunks: int) -> dict[str, list]:
    """Where a fused scan stores each state (see :class:`Segments`), for requests ``found``
    ((segment, chunk index or -1, tail tokens or None) each) of a chunk plan with
    ``segments`` segments and ``chunks`` chunks in all."""
    request_of: dict[tuple[str, int], int] = {}
    dup_request, dup_source = [], []
    for j, (seg, c, tail) in enumerate(found):
        if tail is not None:
            continue  # the tail kernel fills this one
        key = ("c", c) if c >= 0 else ("f", seg)
        if key in request_of:
            dup_request.append(j)
            dup_source.append(request_of[key])
        else:
            request_of[key] = j
    start_of: dict[int, int] = {}
    tail_start = [start_of.setdefault(c, len(start_of)) for _, c, tail in found
                  if tail is not None]
    chunk_slot, final_slot = [-1] * chunks, [-1] * segments
    for (kind, i), j in request_of.items():
        (chunk_slot if kind == "c" else final_slot)[i] = j
    start_slot = [-1] * chunks
    for c, row in start_of.items():
        start_slot[c] = row
    return {"num_starts": len(start_of), "chunk_slot": chunk_slot, "final_slot": final_slot,
            "start_slot": start_slot, "tail_start_slot": tail_start,
            "dup_request": dup_request, "dup_source": dup_source}


def _segments(lists: dict[str, list], device: torch.device) -> Segments:
    """:class:`Segments` from :func:`_segment_lists`' host lists, with one upload."""
    keys = ["cu", "first_segment", "first_row", "later", "request", "chunk_pos", "chunk_index",
            "tail_pos", "tail_chunk", "tail_tokens", "tail_lengths"]
    fused = ["first_chunk", "chunk_slot", "final_slot", "start_slot", "tail_start_slot",
             "dup_request", "dup_source"]
    chunked = lists["chunk"] is not None
    if chunked:
        q, cu = lists["chunk"], lists["cu"]
        firsts = [0]
        for a, b in zip(cu[:-1], cu[1:]):
            firsts.append(firsts[-1] + -(-(b - a) // q))
        lists = {**lists, "first_chunk": firsts}
        keys += fused
    t = dict(zip(keys, _to_device([lists[k] for k in keys], device)))
    steps = _to_device(lists["steps"], device) if lists["steps"] else []
    tails = len(lists["tail_pos"])
    width = len(lists["tail_tokens"]) // tails if tails else 0
    return Segments(
        num_segments=len(lists["cu"]) - 1,
        cu_seqlens=t["cu"],
        cu_seqlens_cpu=torch.tensor(lists["cu"], dtype=torch.int64),
        first_segment=t["first_segment"],
        first_row=t["first_row"],
        later_segment=t["later"],
        request_segment=t["request"],
        chunk_request=t["chunk_pos"],
        chunk_index=t["chunk_index"],
        tail_request=t["tail_pos"],
        tail_chunk=t["tail_chunk"],
        tail_tokens=t["tail_tokens"].view(tails, width),
        tail_lengths=t["tail_lengths"],
        chain_steps=tuple(steps),
        chunk=lists["chunk"],
        num_starts=lists["num_starts"] if chunked else 0,
        **{k: t[k] for k in fused if chunked},
    )


def plan_segments(
    query_start: Sequence[int],
    state_rows: Sequence[int],
    state_offsets: Sequence[int],
    device: torch.device | str = "cpu",
    chunk: int | None = None,
) -> Segments:
    """Plan the scan of a step's rows for the requested ``(row, offset)`` states (host
    lists, any order; a repeated request maps to the same place).

    Without ``chunk`` every requested state cuts its row (two scans when a row has more
    than one segment). With ``chunk`` (the scan's :data:`SCAN_CHUNK`, for a scan that
    returns chunk states) no row is cut: a request is the row's final state, a chunk state,
    or a *tail* of fewer than ``chunk`` tokens from the chunk state before it."""
    device = torch.device(device)
    return _segments(_segment_lists(query_start, state_rows, state_offsets, chunk), device)


# --------------------------------------------------------------------------------------
# dt and the orchestration
# --------------------------------------------------------------------------------------


def discretize_dt_varlen(
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    time_step_limit: tuple[float, float] | None,
    unclamped: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~hybridserve.kernels.ssd.discretize_dt` of packed tokens ``dt [T, H]``, except
    that tokens where ``unclamped [T]`` (bool) is True skip the clamp: per row, the same
    values the per-row path computes (the single-token step of Nemotron-H skips it)."""
    out = discretize_dt(dt, dt_bias, time_step_limit)
    if unclamped is None or time_step_limit is None:
        return out
    return torch.where(unclamped[:, None], discretize_dt(dt, dt_bias, None), out)


def ssd_prefill(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    initial_states: torch.Tensor,
    segments: Segments,
    scan: ScanFn = ssd_scan_varlen_reference,
    *,
    dt_bias: torch.Tensor | None = None,
    time_step_limit: tuple[float, float] | None = (0.0, float("inf")),
    unclamped: torch.Tensor | None = None,
    out_cache: torch.Tensor | None = None,
    out_pages: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The SSD scan of every row of a packed step, with states at the requested offsets.

    Args:
        x: ``[T, H, P]``; dt: ``[T, H]`` discretised (:func:`discretize_dt_varlen`), or
            raw when ``dt_bias`` is given; A: ``[H]``; B, C: ``[T, G, N]``; D: ``[H]`` or None.
        initial_states: ``[B, H, P, N]``, row ``i``'s state before its first token (zeros
            for a row that starts a sequence); only read.
        segments: :func:`plan_segments` of the step's rows and requests.
        scan: the scan primitive (module docstring), or a fused scan (:func:`is_fused`),
            which needs a plan with its chunk and the raw dt.
        dt_bias, time_step_limit, unclamped: with ``dt_bias``, ``dt`` is raw and is
            discretised as :func:`discretize_dt_varlen` does, in float32 at least: inside
            a fused scan, before a plain one.
        out_cache, out_pages: (fused scans only) store the ``j``-th requested state
            straight into page ``out_pages[j]`` of ``out_cache [pages, H, P, N]``
            (contiguous, cast to its dtype; no page may repeat or be an input page) and
            return None for the states: no copy after the scan.

    Returns:
        ``(y [T, H, P]`` with the D skip, ``states [K, H, P, N])`` in
        ``promote(x.dtype, float32)``: ``states[j]`` is the state after the token of the
        ``j``-th request (None with ``out_cache``).
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    tokens, heads, head_dim = x.shape
    d_state = B.shape[-1]
    if is_fused(scan):
        if dt_bias is None:
            raise ValueError("a fused scan takes the raw dt: pass dt_bias")
        if segments.chunk != ssd_chunked.CHUNK:
            raise ValueError(f"a fused scan needs a plan with chunk={ssd_chunked.CHUNK}, "
                             f"got chunk={segments.chunk}")
        return _fused_prefill(x, dt, A, B, C, D, initial_states, segments, scan, dt_bias,
                              time_step_limit, unclamped, out_cache, out_pages)
    if out_cache is not None:
        raise ValueError("out_cache needs a fused scan")
    if dt_bias is not None:
        # In the compute dtype (float32 at least), as the short-row and decode paths.
        dt = discretize_dt_varlen(dt.to(compute), dt_bias.to(compute), time_step_limit,
                                  unclamped).contiguous()
    x, dt, A, B, C = (t.to(compute) for t in (x, dt, A, B, C))
    if segments.num_segments == 0:
        y = x.new_zeros(tokens, heads, head_dim)
        return y, x.new_empty(segments.request_segment.shape[0], heads, head_dim, d_state)
    init = _segment_initial_states(initial_states, segments, compute)
    cu, cu_cpu = segments.cu_seqlens, segments.cu_seqlens_cpu
    chunked = segments.reads_chunk_states
    if segments.single_scan:
        y, final, *chunks = scan(x, dt, A, B, C, cu, init, cu_seqlens_cpu=cu_cpu,
                                 chunk_states=chunked)
    else:
        # Rows cut into segments (a plan without a chunk, so no chunk states are read).
        y, final = scan(x, dt, A, B, C, cu, init, cu_seqlens_cpu=cu_cpu)
        # Each segment's decay over its own tokens. A float64 running sum: differences of
        # it stay exact to ~1e-16 of the row's total even for long rows.
        total = F.pad((dt * A).to(torch.float64).cumsum(0), (0, 0, 1, 0))  # [T + 1, H]
        decay = torch.exp(total[cu[1:]] - total[cu[:-1]]).to(compute)  # [S, H]
        # ``final`` becomes the true state after each segment, one segment index at a time.
        for cur in segments.chain_steps:
            true = torch.addcmul(
                final.index_select(0, cur),
                final.index_select(0, cur - 1),
                decay.index_select(0, cur)[:, :, None, None],
            )
            final.index_copy_(0, cur, true)
        later = segments.later_segment
        init.index_copy_(0, later, final.index_select(0, later - 1))
        y, final = scan(x, dt, A, B, C, cu, init, cu_seqlens_cpu=cu_cpu)
    y = y.to(compute)
    if D is not None:
        y = y + x * D.to(compute)[:, None]
    states = final.to(compute).index_select(0, segments.request_segment)
    if chunked:
        chunks = chunks[0].to(compute)
        states.index_copy_(0, segments.chunk_request, chunks.index_select(0, segments.chunk_index))
        if segments.tail_request.numel():
            start = chunks.index_select(0, segments.tail_chunk)
            # Triton on CUDA (float32); the torch twin elsewhere, and for float64.
            run = (ssd_tail_states if x.is_cuda and compute == torch.float32
                   else ssd_tail_states_reference)
            states.index_copy_(0, segments.tail_request, run(
                x, dt, A, B, start, segments.tail_tokens, segments.tail_lengths
            ).to(compute))
    return y, states



def _segment_initial_states(
    initial_states: torch.Tensor, segments: Segments, dtype: torch.dtype
) -> torch.Tensor:
    """``[S, H, P, N]``: each segment's initial state, its row's for a first segment."""
    init = initial_states.new_zeros(segments.num_segments, *initial_states.shape[1:],
                                    dtype=dtype)
    init.index_copy_(
        0, segments.first_segment, initial_states.index_select(0, segments.first_row).to(dtype)
    )
    return init


def _fused_prefill(x, dt, A, B, C, D, initial_states, segments, scan, dt_bias,
                   time_step_limit, unclamped, out_cache, out_pages):
    """:func:`ssd_prefill` through a fused scan: one launch stores the row ends and the
    chunk states asked for (to the requests' rows of a buffer, or straight to their pages)
    and the tails' start states; the tails run on from theirs; repeated requests copy."""
    compute = torch.promote_types(x.dtype, torch.float32)
    tokens, heads, head_dim = x.shape
    d_state = B.shape[-1]
    requests = segments.request_segment.shape[0]
    if out_cache is None:
        states = torch.empty(requests, heads, head_dim, d_state, dtype=compute, device=x.device)
        chunk_slot, final_slot = segments.chunk_slot, segments.final_slot

        def dest(j):
            return j
    else:
        if out_pages is None or out_pages.shape != (requests,):
            raise ValueError(f"out_pages must be [K={requests}] with out_cache")
        states = out_cache
        pages = out_pages.to(torch.int64)

        def dest(j):
            return pages.index_select(0, j)

        # Request slots -> their pages (-1 stays -1; without requests every slot is -1).
        def paged(slot):
            if requests == 0:
                return slot
            return torch.where(slot >= 0, pages.index_select(0, slot.clamp(min=0)), -1)

        chunk_slot, final_slot = paged(segments.chunk_slot), paged(segments.final_slot)
    if segments.num_segments == 0:
        y = torch.zeros(tokens, heads, head_dim, dtype=compute, device=x.device)
        return y, (None if out_cache is not None else states)
    starts = None
    if segments.num_starts:
        starts = torch.empty(segments.num_starts, heads, head_dim, d_state,
                             dtype=torch.float32 if compute == torch.float32 else compute,
                             device=x.device)
    init = _segment_initial_states(initial_states, segments, compute)
    form = {}
    if (getattr(scan, "func", scan) is ssd_two_pass.ssd_scan_two_pass
            and states.dtype == torch.float32 and 2 * requests >= chunk_slot.shape[0]):
        # Most chunks' states go to float32 pages (a cold prompt's checkpoint every 64
        # tokens), where the output pass reads them: the scratch's halves would only cost
        # the output pass their second load path (1.89 against 1.73 ms a call for
        # 8 x 4,096 on the H200, prefill_ssd_forms.json).
        form = {"halves": False}
    y, dt_out = scan(
        x, dt, A, B, C, D, dt_bias, segments.cu_seqlens, init, chunk_slot, final_slot, states,
        time_step_limit=time_step_limit, unclamped=unclamped,
        cu_seqlens_cpu=segments.cu_seqlens_cpu, first_chunk=segments.first_chunk,
        start_slot=segments.start_slot if starts is not None else None, starts=starts,
        **form,
    )
    if segments.dup_request.numel():
        states.index_copy_(0, dest(segments.dup_request),
                           states.index_select(0, dest(segments.dup_source)))
    if segments.tail_request.numel():
        start = starts.index_select(0, segments.tail_start_slot)
        # Triton on CUDA (float32); the torch twin elsewhere, and for float64.
        run = (ssd_tail_states if x.is_cuda and compute == torch.float32
               else ssd_tail_states_reference)
        states.index_copy_(0, dest(segments.tail_request), run(
            x, dt_out, A, B, start, segments.tail_tokens, segments.tail_lengths
        ).to(states.dtype))
    return y.to(compute), (None if out_cache is not None else states)
