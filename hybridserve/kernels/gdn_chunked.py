"""The chunked form of the gated delta rule, with its chunk states, over packed rows from
and to state pages: the torch twin of the planned fla-core prefill path.

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
are chunk states. This is the orchestration the fla-core path will keep, with its
forward's chunk states (``h``) in place of this twin's.

The scan is pluggable (:data:`ChunkScanFn`): :func:`chunk_scan_reference` here (the CPU
twin), fla-core's forward pieces on the GPU once wired and checked there. The tails run
with :func:`~hybridserve.kernels.gdn_varlen.gdn_varlen_update` (or its twin) from dense
initial states. Float32 pages only: a chunked pass cannot round the state after every
token, so bfloat16 pages keep the token-by-token path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


# ``scan(q, k, v, g, beta, cu_seqlens_host, initial_states, chunk) -> (o, states)`` over
# packed non-empty sequences: ``o [T, Hv, Dv]`` and ``states [sum_i (n_i + 1), Hv, Dk, Dv]``,
# sequence i's ``n_i = ceil(L_i / chunk)`` chunk-start states followed by its final state.
ChunkScanFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def chunk_scan_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: Sequence[int],
    initial_states: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan primitive's torch twin: :func:`chunk_gated_delta_rule_reference` per
    sequence (the CPU path of the chunked prefill and the oracle of fla-core's)."""
    compute = torch.promote_types(v.dtype, torch.float32)
    o = torch.empty(v.shape, dtype=compute, device=v.device)
    states = []
    for i in range(len(cu_seqlens) - 1):
        s, e = cu_seqlens[i], cu_seqlens[i + 1]
        o[s:e], st = chunk_gated_delta_rule_reference(
            q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], initial_states[i], chunk
        )
        states.append(st)
    return o, torch.cat(states)


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
    starts, outs = plan.query_start_host, plan.token_out_pages_host
    if outs is None:
        raise ValueError(
            "gdn_prefill plans its chunk states from host pages: plan.token_out_pages_host "
            "is None (a device-only plan takes the token-by-token rule)"
        )
    compute = torch.promote_types(v.dtype, torch.float32)
    g, beta = gdn_gates(a, b, A_log, dt_bias, compute)
    hv, dk, dv = ssm_cache.shape[1:]
    rows = [r for r in range(plan.num_rows) if starts[r + 1] > starts[r]]
    if not rows:
        return torch.empty(v.shape, dtype=compute, device=v.device)
    # Empty rows own no tokens: the scan sees the others only (packed the same way).
    initial = torch.zeros(plan.num_rows, hv, dk, dv, dtype=compute, device=v.device)
    has = plan.in_pages >= 0
    initial[has] = ssm_cache[plan.in_pages[has].long()].to(compute)
    cu = [0]
    for r in rows:
        cu.append(cu[-1] + starts[r + 1] - starts[r])
    o, states = scan(q, k, v, g, beta, cu, initial[rows], chunk)
    grid_idx: list[int] = []
    grid_pages: list[int] = []
    tails: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (state index, start) -> outs
    base = 0
    for r in rows:
        s, e = starts[r], starts[r + 1]
        for t in range(s, e):
            if outs[t] < 0:
                continue
            done = t + 1 - s
            if done % chunk == 0 or done == e - s:
                grid_idx.append(base + -(-done // chunk))
                grid_pages.append(outs[t])
            else:
                c = done // chunk
                tails.setdefault((base + c, s + c * chunk), []).append((t, outs[t]))
        base += -(-(e - s) // chunk) + 1
    if grid_pages:
        idx = torch.tensor(grid_idx, device=v.device)
        pages = torch.tensor(grid_pages, device=v.device)
        ssm_cache[pages] = states[idx].to(ssm_cache.dtype)
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
        sel = torch.tensor(tokens, device=v.device)
        tail_rule(
            q[sel], k[sel], v[sel], a[sel], b[sel], ssm_cache,
            torch.tensor(tail_starts, dtype=torch.int32, device=v.device),
            torch.full((len(init_idx),), -1, dtype=torch.int32, device=v.device),
            torch.tensor(tail_outs, dtype=torch.int32, device=v.device),
            False,
            states[torch.tensor(init_idx, device=v.device)],
            A_log=A_log,
            dt_bias=dt_bias,
        )
    # Empty rows own no tokens, so the scan's packing of the other rows is the step's.
    return o.to(compute)


def _fla_forward_parts():
    """The pieces of fla-core's ``chunk_gated_delta_rule`` forward, or None where this
    fla-core does not have them under these names (written against fla-core's main
    branch of late 2026; not yet run on a GPU here)."""
    try:
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.common.chunk_scaled_dot_kkt import chunk_scaled_dot_kkt_fwd
        from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd
        from fla.ops.utils import chunk_local_cumsum, solve_tril
    except Exception:  # absent, or present but unusable here (no GPU Triton backend)
        return None
    return (chunk_local_cumsum, chunk_scaled_dot_kkt_fwd, solve_tril, recompute_w_u_fwd,
            chunk_gated_delta_rule_fwd_h, chunk_fwd_o)


def fla_chunk_scan_available() -> bool:
    """fla-core is importable and exposes the forward pieces that return chunk states."""
    return _fla_forward_parts() is not None


def chunk_scan_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: Sequence[int],
    initial_states: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan primitive through fla-core's chunked gated delta rule (CUDA): its forward's
    pieces, keeping the chunk states ``h`` its output pass consumes. q, k, v go in as
    bfloat16 (the library's compute format), g, beta and the states in float32; key heads
    are expanded to value heads (the library takes one key per value head)."""
    parts = _fla_forward_parts()
    if parts is None:
        raise RuntimeError("fla-core's chunked gated delta rule is not available here")
    if chunk != 64:
        raise ValueError(f"fla-core's chunk is 64, got {chunk}")
    cumsum, kkt, solve, w_u, fwd_h, fwd_o = parts
    hv = v.shape[1]
    rep = hv // k.shape[1]
    qh, kh = (x.repeat_interleave(rep, dim=1).to(torch.bfloat16)[None] for x in (q, k))
    vh = v.to(torch.bfloat16)[None]
    cu = torch.tensor(cu_seqlens, dtype=torch.long, device=v.device)
    gc = cumsum(g.float()[None], chunk_size=64, cu_seqlens=cu)
    bt = beta.float()[None]
    A = solve(A=kkt(k=kh, g=gc, beta=bt, cu_seqlens=cu, output_dtype=torch.float32),
              cu_seqlens=cu, output_dtype=kh.dtype)
    w, u = w_u(k=kh, v=vh, beta=bt, A=A, g=gc, cu_seqlens=cu)
    h, v_new, final = fwd_h(k=kh, w=w, u=u, g=gc, initial_state=initial_states.float(),
                            output_final_state=True, cu_seqlens=cu)
    o = fwd_o(q=qh, k=kh, v=v_new, h=h, g=gc, scale=1.0, cu_seqlens=cu)
    # h [1, NT, H, K, V]: the chunk-start states of every sequence in order; then the
    # final states, in the layout of ChunkScanFn.
    idx, offset = [], 0
    num = len(cu_seqlens) - 1
    total = h.shape[1]
    for i in range(num):
        n = -(-(cu_seqlens[i + 1] - cu_seqlens[i]) // 64)
        idx += [*range(offset, offset + n), total + i]
        offset += n
    states = torch.cat([h[0].float(), final.float()])[torch.tensor(idx, device=v.device)]
    return o[0].float(), states
