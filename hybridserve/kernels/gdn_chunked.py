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
(:func:`gdn_prefill_reference`): a chunked pass has the state at every chunk start of
the row anyway. A requested state right before a chunk start (or at the row end) is one
of them; any other is a *tail* of fewer than ``C`` tokens, run token by token from the
chunk state before it. Prefix-cache checkpoints sit on a grid of positions and rows
mostly start on it, so with ``state_interval`` a multiple of ``C`` most requested states
are chunk states. This is the orchestration the fla-core path will keep, with its
forward's chunk states (``h``) in place of this twin's.

Same arguments and result as :func:`~hybridserve.kernels.gdn_varlen.gdn_varlen_update`
(float32 pages: a chunked pass cannot round the state after every token, so bfloat16
pages keep the token-by-token path).
"""

from __future__ import annotations

import torch

from hybridserve.kernels.gdn import gated_delta_rule_reference
from hybridserve.kernels.gdn_decode import _check_operands

__all__ = ["CHUNK", "chunk_gated_delta_rule_reference", "gdn_prefill_reference"]

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


def gdn_prefill_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_cache: torch.Tensor,
    query_start: torch.Tensor,
    in_pages: torch.Tensor,
    token_out_pages: torch.Tensor,
    round_state: bool = False,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Every row of a packed step through the chunked form, states at the requested
    offsets from its chunk states and tails (module docstring). Arguments and result as
    :func:`~hybridserve.kernels.gdn_varlen.gdn_varlen_update`; ``round_state`` must be
    False; ``chunk_size`` defaults to :data:`CHUNK`. Every input state is read before any
    page is written."""
    chunk_size = CHUNK if chunk_size is None else chunk_size
    if round_state:
        raise ValueError(
            "the chunked form cannot round the state after every token; bfloat16 state "
            "pages take the token-by-token path"
        )
    _check_operands(q, k, v, g, beta, ssm_cache)
    starts, pages, outs = query_start.tolist(), in_pages.tolist(), token_out_pages.tolist()
    if starts[0] != 0 or starts[-1] != q.shape[0] or len(pages) != len(starts) - 1:
        raise ValueError(f"query_start must run from 0 to T={q.shape[0]} over {len(pages)} rows")
    compute = torch.promote_types(v.dtype, torch.float32)
    initial = [ssm_cache[p].to(compute) if p >= 0 else None for p in pages]
    o = torch.empty(v.shape, dtype=compute, device=v.device)
    writes = []
    for r, init in enumerate(initial):
        s, e = starts[r], starts[r + 1]
        if e == s:
            continue
        o[s:e], chunk_states = chunk_gated_delta_rule_reference(
            q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], init, chunk_size
        )
        for t in range(s, e):
            if outs[t] < 0:
                continue
            done = t + 1 - s  # tokens of the row the state includes
            if done % chunk_size == 0 or done == e - s:
                state = chunk_states[-(-done // chunk_size)]
            else:
                # A tail: fewer than chunk_size tokens after the last chunk start.
                c0 = (done // chunk_size) * chunk_size
                _, (state,) = gated_delta_rule_reference(
                    q[s + c0 : t + 1], k[s + c0 : t + 1], v[s + c0 : t + 1],
                    g[s + c0 : t + 1], beta[s + c0 : t + 1], chunk_states[c0 // chunk_size],
                    [t - s - c0],
                )
            writes.append((outs[t], state))
    for page, state in writes:
        ssm_cache[page] = state.to(ssm_cache.dtype)
    return o
