"""The chunked form of the gated delta rule, with its chunk states, over packed rows from
and to state pages: the torch twin of the fla-core prefill path, and that path.

Why a chunked form: the token recurrence (:mod:`hybridserve.kernels.gdn`) is ``L``
dependent steps for a row of ``L`` tokens. The chunked form does the work of a chunk of
``C`` tokens in a few matrix products (the WY / UT representation of a product of
Householder-like transitions) and carries the state only from chunk to chunk, which is
what fla-core's ``chunk_gated_delta_rule`` does on the GPU (docs/design-notes.md, the
prefill plan). Per chunk, with ``S`` the state at its start, cumulative log decays
``G_i = g_1 + .. + g_i`` and ``D_ij = exp(G_i - G_j)`` (``j <= i``)::

    (I + L) U = beta * V                L_ij = beta_i (k_i . k_j) D_ij, j < i
    (I + L) W = beta * exp(G) * K
    V' = U - W S                         # what the state does not already predict
    O  = exp(G) * (Q S) + (Q K^T * D, lower incl. diagonal) V'
    S' = exp(G_C) S + (exp(G_C - G) * K)^T V'

**States at offsets from the chunk states, never from cutting the row**
(:func:`gdn_prefill`): a chunked pass has the state at every chunk start of
the row anyway. A requested state right before a chunk start (or at the row end) is one
of them; any other is a *tail* of fewer than ``C`` tokens, run token by token from the
chunk state before it. Prefix-cache checkpoints sit on a grid of positions and rows
mostly start on it, so with ``state_interval`` a multiple of ``C`` most requested states
are chunk states. The fla-core path keeps this orchestration, with its forward's chunk
states (``h``) in place of this twin's.

The scan is pluggable (:data:`ChunkScanFn`): :func:`chunk_scan_reference` here (the CPU
twin), :func:`chunk_scan_fla` (fla-core 0.6.0's forward pieces; checked against the twin
on the CPU through Triton's interpreter, in float32). The tails run
with :func:`~hybridserve.kernels.gdn_varlen.gdn_varlen_update` (or its twin) from dense
initial states. Float32 pages only: a chunked pass cannot round the state after every
token, so bfloat16 pages keep the token-by-token path.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hybridserve.kernels.gdn import gdn_gates
from hybridserve.kernels.gdn_decode import _check_operands
from hybridserve.kernels.gdn_varlen import VarlenPlan, gdn_varlen_update_reference

__all__ = [
    "CHUNK",
    "ChunkScanFn",
    "chunk_gated_delta_rule_reference",
    "chunk_scan_fla",
    "chunk_scan_reference",
    "fla_chunk_scan_available",
    "gdn_prefill",
]

# fla-core's chunk length.
CHUNK = 64


def chunk_gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule over one sequence (layout of
    :func:`~hybridserve.kernels.gdn.gated_delta_rule_reference`).

    Returns ``(o [L, Hv, Dv]``, ``chunk_states [ceil(L / C) + 1, Hv, Dk, Dv])`` in the
    compute dtype ``promote(v.dtype, float32)``: ``chunk_states[c]`` is the state before
    token ``c * C`` and the last entry the state after the last token.
    """
    length, hk, dk = k.shape
    hv, dv = v.shape[1:]
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    compute = torch.promote_types(v.dtype, torch.float32)
    rep = hv // hk
    # Heads first: [Hv, L, .].
    q, k = (x.to(compute).repeat_interleave(rep, dim=1).transpose(0, 1) for x in (q, k))
    v = v.to(compute).transpose(0, 1)
    g, beta = (x.to(compute).transpose(0, 1) for x in (g, beta))
    state = (
        torch.zeros(hv, dk, dv, dtype=compute, device=v.device)
        if initial_state is None
        else initial_state.to(compute)
    )
    num_chunks = -(-length // chunk_size)
    states = torch.empty(num_chunks + 1, hv, dk, dv, dtype=compute, device=v.device)
    out = torch.empty(hv, length, dv, dtype=compute, device=v.device)
    for c in range(num_chunks):
        s, e = c * chunk_size, min((c + 1) * chunk_size, length)
        n = e - s
        states[c] = state
        qc, kc, vc = q[:, s:e], k[:, s:e], v[:, s:e]
        bc = beta[:, s:e, None]
        G = g[:, s:e].cumsum(dim=1)  # [Hv, n]
        lower = torch.ones(n, n, dtype=torch.bool, device=v.device).tril()
        # exp(G_i - G_j) where j <= i; 0 above the diagonal (masked before exp: no overflow).
        D = (G[:, :, None] - G[:, None, :]).masked_fill(~lower, float("-inf")).exp()
        L = (bc * kc) @ kc.transpose(1, 2) * D
        L = L.tril(-1)
        eye = torch.eye(n, dtype=compute, device=v.device)
        U = torch.linalg.solve_triangular(L + eye, bc * vc, upper=False, unitriangular=True)
        W = torch.linalg.solve_triangular(
            L + eye, bc * G.exp()[..., None] * kc, upper=False, unitriangular=True
        )
        v_new = U - W @ state
        out[:, s:e] = G.exp()[..., None] * (qc @ state) + (qc @ kc.transpose(1, 2) * D) @ v_new
        tail = (G[:, -1:] - G).exp()[..., None] * kc  # exp(G_C - G_i) k_i
        state = G[:, -1].exp()[:, None, None] * state + tail.transpose(1, 2) @ v_new
    states[num_chunks] = state
    return out.transpose(0, 1), states


# ``scan(q, k, v, g, beta, cu_seqlens_host, initial_states, chunk) -> (o, chunk_states,
# final_states)`` over packed non-empty sequences: ``o [T, Hv, Dv]``, ``chunk_states
# [sum_i n_i, Hv, Dk, Dv]`` (sequence i's ``n_i = ceil(L_i / chunk)`` chunk-start states,
# sequences in order) and ``final_states [N, Hv, Dk, Dv]``. Apart: a copy that joins them
# costs as much as the scan's own state pass writes (the chunk states of 8 x 4,096 tokens
# of one Qwen3.6-27B layer are 1.6 GB in float32).
ChunkScanFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def chunk_scan_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: Sequence[int],
    initial_states: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scan primitive's torch twin: :func:`chunk_gated_delta_rule_reference` per
    sequence (the CPU path of the chunked prefill and the oracle of fla-core's)."""
    compute = torch.promote_types(v.dtype, torch.float32)
    o = torch.empty(v.shape, dtype=compute, device=v.device)
    chunk_states, final_states = [], []
    for i in range(len(cu_seqlens) - 1):
        s, e = cu_seqlens[i], cu_seqlens[i + 1]
        o[s:e], st = chunk_gated_delta_rule_reference(
            q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], initial_states[i], chunk
        )
        chunk_states.append(st[:-1])
        final_states.append(st[-1])
    return o, torch.cat(chunk_states), torch.stack(final_states)


@dataclass(frozen=True)
class _PrefillLayout:
    """Where a step's requested states come from (:func:`gdn_prefill`), on the device:
    the same for every layer of the step, so planned once per step (:func:`_prefill_layout`).

    ``rows``: the non-empty rows (``row_index`` on the device), packed for the scan as
    ``cu_seqlens``; ``grid`` and ``final``: ``(state index, page)`` tensors into the
    scan's chunk states and final states; ``tails``: the tail rows' ``(tokens,
    query_start, in_pages (-1), token_out_pages, chunk-state index of each tail's
    initial state)``."""

    rows: tuple[int, ...]
    row_index: torch.Tensor
    cu_seqlens: tuple[int, ...]
    grid: tuple[torch.Tensor, torch.Tensor] | None
    final: tuple[torch.Tensor, torch.Tensor] | None
    tails: tuple[torch.Tensor, ...] | None


# The last plan's layout: every GDN layer of a step reads the same plan object.
_LAST_LAYOUT: list = []


def _prefill_layout(plan: VarlenPlan, chunk: int, device: torch.device) -> _PrefillLayout:
    """The :class:`_PrefillLayout` of ``plan``'s host lists (memoised for the last plan:
    the host walk over a step's tokens costs milliseconds at 8 x 4,096 tokens)."""
    if _LAST_LAYOUT and _LAST_LAYOUT[0] is plan and _LAST_LAYOUT[1:3] == [chunk, device]:
        return _LAST_LAYOUT[3]
    starts, outs = plan.query_start_host, plan.token_out_pages_host
    rows = tuple(r for r in range(plan.num_rows) if starts[r + 1] > starts[r])
    cu = [0]
    for r in rows:
        cu.append(cu[-1] + starts[r + 1] - starts[r])
    # Each requested state: a final state (row end), a chunk state (right before a chunk
    # start), or a tail from the chunk state before it.
    final_idx, final_pages, grid_idx, grid_pages = [], [], [], []
    tails: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (state index, start) -> outs
    base = 0
    for i, r in enumerate(rows):
        s, e = starts[r], starts[r + 1]
        for off, page in enumerate(outs[s:e]):
            if page < 0:
                continue
            done = off + 1
            if done == e - s:
                final_idx.append(i)
                final_pages.append(page)
            elif done % chunk == 0:
                grid_idx.append(base + done // chunk)
                grid_pages.append(page)
            else:
                c = done // chunk
                tails.setdefault((base + c, s + c * chunk), []).append((s + off, page))
        base += -(-(e - s) // chunk)

    def on_device(*lists, dtype=torch.long):
        return tuple(torch.tensor(x, dtype=dtype, device=device) for x in lists)

    tail_tensors = None
    if tails:
        # One tail row per (row, chunk) with requested states inside it: from the chunk's
        # start state through its last requested token, every requested state to its page.
        tokens, tail_starts, tail_outs, init_idx = [], [0], [], []
        for (state_index, first), wanted in tails.items():
            last = max(t for t, _ in wanted)
            page_of = dict(wanted)
            tokens += range(first, last + 1)
            tail_outs += [page_of.get(t, -1) for t in range(first, last + 1)]
            tail_starts.append(len(tokens))
            init_idx.append(state_index)
        tail_tensors = (
            *on_device(tokens),
            *on_device(tail_starts, [-1] * len(init_idx), tail_outs, dtype=torch.int32),
            *on_device(init_idx),
        )
    layout = _PrefillLayout(
        rows=rows, row_index=on_device(rows)[0], cu_seqlens=tuple(cu),
        grid=on_device(grid_idx, grid_pages) if grid_pages else None,
        final=on_device(final_idx, final_pages) if final_pages else None,
        tails=tail_tensors,
    )
    _LAST_LAYOUT[:] = [plan, chunk, device, layout]
    return layout


def gdn_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ssm_cache: torch.Tensor,
    plan: VarlenPlan,
    scan: ChunkScanFn | None = None,
    tail_rule: Callable[..., torch.Tensor] | None = None,
    chunk: int | None = None,
    *,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> torch.Tensor:
    """Every row of a packed step through a chunked scan; the states at the requested
    offsets from its chunk states and tails (module docstring).

    Args:
        q, k, v, a, b, ssm_cache, A_log, dt_bias: as
            :func:`~hybridserve.kernels.gdn_varlen.gdn_varlen_update` (float32 state pages
            or wider: no per-token rounding); the scan gets the gates of
            :func:`~hybridserve.kernels.gdn.gdn_gates` in the compute dtype, the tails the
            raw ``a, b``.
        plan: the step's :class:`~hybridserve.kernels.gdn_varlen.VarlenPlan` (its host
            lists decide which chunk state goes to which page, without a device read).
        scan: the chunked scan primitive (:data:`ChunkScanFn`; default the twin,
            :func:`chunk_scan_reference`).
        tail_rule: the token-by-token rule the tails run with (``gdn_varlen_update`` or
            its twin, the default), starting from chunk states.
        chunk: the scan's chunk length (default :data:`CHUNK`).

    Returns:
        ``o [T, Hv, Dv]`` in the compute dtype.

    Every initial state is gathered before any page is written, and every page this
    writes is an output page of the plan (never an input page), so the order of the
    writes cannot matter.
    """
    _check_operands(q, k, v, a, b, ssm_cache, A_log, dt_bias)
    chunk = CHUNK if chunk is None else chunk
    scan = chunk_scan_reference if scan is None else scan
    tail_rule = gdn_varlen_update_reference if tail_rule is None else tail_rule
    if plan.token_out_pages_host is None:
        raise ValueError(
            "gdn_prefill plans its chunk states from host pages: plan.token_out_pages_host "
            "is None (a device-only plan takes the token-by-token rule)"
        )
    compute = torch.promote_types(v.dtype, torch.float32)
    layout = _prefill_layout(plan, chunk, v.device)
    if not layout.rows:
        return torch.empty(v.shape, dtype=compute, device=v.device)
    g, beta = gdn_gates(a, b, A_log, dt_bias, compute)
    # Empty rows own no tokens: the scan sees the others only (packed the same way). A
    # select, not a mask: no device read.
    in_pages = plan.in_pages[layout.row_index]
    gathered = ssm_cache[in_pages.clamp(min=0).long()].to(compute)
    initial = torch.where((in_pages >= 0)[:, None, None, None], gathered, 0)
    o, chunk_states, final_states = scan(q, k, v, g, beta, layout.cu_seqlens, initial, chunk)
    for idx_pages, states in ((layout.grid, chunk_states), (layout.final, final_states)):
        if idx_pages is not None:
            idx, pages = idx_pages
            ssm_cache[pages] = states[idx].to(ssm_cache.dtype)
    if layout.tails is not None:
        sel, tail_starts, no_pages, tail_outs, init_idx = layout.tails
        tail_rule(
            q[sel], k[sel], v[sel], a[sel], b[sel], ssm_cache, tail_starts, no_pages,
            tail_outs, False, chunk_states[init_idx].to(compute), A_log=A_log, dt_bias=dt_bias,
        )
    # Empty rows own no tokens, so the scan's packing of the other rows is the step's.
    return o.to(compute)


@functools.cache
def _fla_forward_parts():
    """The pieces of fla-core's ``chunk_gated_delta_rule`` forward (fla-core 0.6.0's
    ``chunk_gated_delta_rule_fwd``, whose chunk states its public call does not return),
    or None where this fla-core does not have them under these names. ``RCP_LN2`` is
    part of the check: its kernels take the chunk-local log-decay sums in base 2."""
    try:
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices
        from fla.ops.utils.constant import RCP_LN2
    except Exception:  # absent, or present but unusable here (no GPU Triton backend)
        return None
    return (chunk_local_cumsum, prepare_chunk_indices, RCP_LN2,
            chunk_gated_delta_rule_fwd_intra, chunk_gated_delta_rule_fwd_h, chunk_fwd_o)


def fla_chunk_scan_available() -> bool:
    """fla-core is importable and exposes the forward pieces that return chunk states."""
    return _fla_forward_parts() is not None


# The last packing's tensors: every layer of a step scans the same rows (gdn_prefill hands
# over one ``cu_seqlens`` tuple per step), and fla-core memoises what it derives from
# ``cu_seqlens`` by tensor identity.
_LAST_ROWS: list = []


def _fla_rows(cu_seqlens, chunk, device, chunk_indices_of):
    """``(cu_seqlens, chunk indices)`` on ``device`` for fla-core, reused while the same
    host tuple comes back (a list is converted afresh: it could have changed)."""
    if (_LAST_ROWS and _LAST_ROWS[0] is cu_seqlens and isinstance(cu_seqlens, tuple)
            and _LAST_ROWS[1:3] == [chunk, device]):
        return _LAST_ROWS[3], _LAST_ROWS[4]
    cu_cpu = torch.tensor(cu_seqlens, dtype=torch.long)
    cu = cu_cpu.to(device)
    indices = chunk_indices_of(cu, chunk, cu_seqlens_cpu=cu_cpu)
    _LAST_ROWS[:] = [cu_seqlens, chunk, device, cu, indices]
    return cu, indices


def chunk_scan_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: Sequence[int],
    initial_states: torch.Tensor,
    chunk: int,
    *,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan primitive (:data:`ChunkScanFn`) through fla-core's chunked gated delta
    rule: the pieces of its forward, keeping the chunk states its output pass consumes.

    How our operands map onto fla-core 0.6.0's (each point a way to get it wrong):

    - layout ``[1, T, heads, dim]`` (batch 1 with ``cu_seqlens``: packed rows); states
      ``[N, Hv, Dk, Dv]`` key-major, ours (not ``state_v_first``);
    - grouped keys: q and k keep their ``Hk`` heads; its kernels read key head
      ``h // (Hv // Hk)`` for value head ``h``, as ours do (no expansion);
    - q is already L2-normalised and scaled by ``Dk ** -0.5`` (the mixer's), k normalised,
      so ``scale = 1`` (its default is ``Dk ** -0.5``) and no in-kernel L2 norm;
    - beta after the sigmoid; g the per-token log decay, which the pieces want as
      chunk-local running sums *in base 2* (``scale = 1 / ln 2``: the kernels use
      ``exp2``), as its public call forms them before its forward;
    - chunk states ``h [1, sum_i n_i, Hv, Dk, Dv]`` in ``dtype`` (the dtype of k), the
      state before every chunk, rows in order; final states float32.

    ``dtype``: what q, k, v go in as. float32 (default): the chunk states stay float32
    for float32 state pages (the dots run in TF32 on recent GPUs); bfloat16: the
    library's fast format, chunk states rounded to bfloat16. g, beta and the initial
    states go in as float32. Returns ``(o [T, Hv, Dv]`` float32, ``chunk_states`` in
    ``dtype``, ``final_states`` float32): :data:`ChunkScanFn`'s layout, the library's
    own tensors (no copy of the chunk states).
    """
    parts = _fla_forward_parts()
    if parts is None:
        raise RuntimeError("fla-core's chunked gated delta rule is not available here")
    if chunk != CHUNK:
        raise ValueError(f"kernel_policy.gdn_chunk must be {CHUNK} for fla-core's scan, got {chunk}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"chunk_scan_fla: dtype must be float32 or bfloat16, got {dtype}")
    cumsum, chunk_indices_of, rcp_ln2, intra, fwd_h, fwd_o = parts
    qf, kf, vf = (x.to(dtype).contiguous()[None] for x in (q, k, v))
    g2 = g.float().contiguous()[None]
    bt = beta.float().contiguous()[None]
    cu, indices = _fla_rows(cu_seqlens, chunk, v.device, chunk_indices_of)
    common = dict(cu_seqlens=cu, chunk_indices=indices, chunk_size=chunk)
    # The pieces launch on the current device (the public call sets it from its inputs).
    with torch.cuda.device(v.device) if v.is_cuda else contextlib.nullcontext():
        g2 = cumsum(g2, scale=rcp_ln2, **common)
        w, u, _ = intra(k=kf, v=vf, g=g2, beta=bt, **common)
        h, v_new, final = fwd_h(k=kf, w=w, u=u, g=g2, output_final_state=True,
                                initial_state=initial_states.float().contiguous(), **common)
        o = fwd_o(q=qf, k=kf, v=v_new, h=h, g=g2, scale=1.0, **common)
    # h [1, sum_i n_i, Hv, Dk, Dv]: the state before every chunk, rows in order.
    return o[0].float(), h[0], final
