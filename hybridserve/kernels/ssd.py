"""Mamba2 SSD (state-space duality) scan: torch reference twins (CPU path, test oracle).

One sequence, token-major, heads ``H`` of width ``P``, ``G`` groups of state size ``N``
(head ``h`` uses group ``h // (H // G)``). With ``dt`` already discretised (bias added,
softplus, clamp: :func:`discretize_dt`) and ``A < 0`` per head, the recurrence is::

    S_t = exp(dt_t * A) * S_{t-1} + dt_t * x_t (outer) B_t        S: [H, P, N]
    y_t = S_t . C_t + D * x_t

:func:`ssd_recurrent_reference` runs it token by token; :func:`ssd_chunked_reference`
computes the same function in chunked (SSD) form: quadratic attention-like products
inside a chunk, a recurrence over chunk boundary states between chunks, and states at
any requested token straight from the chunk it falls in (boundary state decayed to the
token plus the chunk's contributions up to it), without splitting the sequence.

Both compute in ``promote(x.dtype, float32)`` (float64 in tests) and return states in
that dtype; callers cast when storing to a cache page.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def discretize_dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    time_step_limit: tuple[float, float] | None = (0.0, float("inf")),
) -> torch.Tensor:
    """``clamp(softplus(dt + dt_bias), *time_step_limit)``; ``dt [..., H]``, ``dt_bias [H]``.

    ``time_step_limit=None`` skips the clamp (what transformers' single-token step does).
    """
    out = F.softplus(dt + dt_bias.to(dt.dtype))
    if time_step_limit is not None:
        out = torch.clamp(out, min=time_step_limit[0], max=time_step_limit[1])
    return out


def heads_from_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[..., G, N] -> [..., H, N]``: each group serves ``H // G`` consecutive heads."""
    groups = t.shape[-2]
    if num_heads % groups:
        raise ValueError(f"{groups} groups do not divide {num_heads} heads")
    return t.repeat_interleave(num_heads // groups, dim=-2)


def _check_shapes(x, dt, A, B, C, D, initial_state) -> None:
    length, heads, head_dim = x.shape
    if dt.shape != (length, heads):
        raise ValueError(f"dt must be [L={length}, H={heads}], got {tuple(dt.shape)}")
    if A.shape != (heads,):
        raise ValueError(f"A must be [H={heads}], got {tuple(A.shape)}")
    if B.dim() != 3 or B.shape[0] != length or B.shape != C.shape:
        raise ValueError(
            f"B and C must both be [L={length}, G, N], got {tuple(B.shape)}, {tuple(C.shape)}"
        )
    if D is not None and D.shape != (heads,):
        raise ValueError(f"D must be [H={heads}], got {tuple(D.shape)}")
    if initial_state is not None and initial_state.shape != (heads, head_dim, B.shape[-1]):
        raise ValueError(
            f"initial_state must be [H={heads}, P={head_dim}, N={B.shape[-1]}], "
            f"got {tuple(initial_state.shape)}"
        )


def ssd_step_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: ``x [H, P]``, ``dt [H]``, ``B, C [G, N]`` and ``state [H, P, N]`` (None: zeros).

    Returns ``(y [H, P], new_state [H, P, N])`` in the compute dtype; ``state`` is not modified.
    """
    heads, head_dim = x.shape
    compute = torch.promote_types(x.dtype, torch.float32)
    x = x.to(compute)
    dt = dt.to(compute)
    Bh = heads_from_groups(B.to(compute), heads)  # [H, N]
    Ch = heads_from_groups(C.to(compute), heads)
    if state is None:
        state = x.new_zeros(heads, head_dim, Bh.shape[-1])
    decay = torch.exp(dt * A.to(compute))  # [H]
    # Same association as the single-token update of the reference implementation:
    # (dt * B) first, then the outer product with x.
    dBx = (dt[:, None] * Bh)[:, None, :] * x[:, :, None]  # [H, P, N]
    new_state = state.to(compute) * decay[:, None, None] + dBx
    y = torch.bmm(new_state, Ch[:, :, None])[..., 0]  # [H, P]
    if D is not None:
        y = y + x * D.to(compute)[:, None]
    return y, new_state


def ssd_recurrent_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token scan of one sequence.

    Args:
        x: ``[L, H, P]``; dt: ``[L, H]`` (discretised, >= 0); A: ``[H]``;
        B, C: ``[L, G, N]``; D: ``[H]`` or None; initial_state: ``[H, P, N]`` or None (zeros).

    Returns:
        ``(y [L, H, P], states [L, H, P, N])``; ``states[t]`` is the state after token ``t``.
    """
    _check_shapes(x, dt, A, B, C, D, initial_state)
    state = initial_state
    ys, states = [], []
    for t in range(x.shape[0]):
        y, state = ssd_step_reference(x[t], dt[t], A, B[t], C[t], D, state)
        ys.append(y)
        states.append(state)
    return torch.stack(ys), torch.stack(states)


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """``a [..., Q] -> seg [..., Q, Q]`` with ``seg[l, s] = a[s+1] + ... + a[l]`` for
    ``s <= l`` and ``-inf`` above the diagonal.

    Summing the masked increments directly (instead of differencing a cumulative sum)
    keeps ``exp(seg)`` accurate when the cumulative sum grows large.
    """
    q = a.shape[-1]
    rows = a[..., :, None].expand(*a.shape, q)  # rows[k, s] = a[k]
    strict = torch.ones(q, q, dtype=torch.bool, device=a.device).tril(-1)  # k > s
    seg = rows.masked_fill(~strict, 0).cumsum(dim=-2)  # sum over s < k <= l
    causal = torch.ones(q, q, dtype=torch.bool, device=a.device).tril()
    return seg.masked_fill(~causal, float("-inf"))


def ssd_chunked_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    state_offsets: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan of one sequence, with states at arbitrary tokens.

    Args:
        x: ``[L, H, P]``; dt: ``[L, H]`` (discretised, >= 0); A: ``[H]``;
        B, C: ``[L, G, N]``; D: ``[H]`` or None; initial_state: ``[H, P, N]`` or None (zeros).
        chunk_size: tokens per chunk, counted from the first token of ``x``.
        state_offsets: tokens ``t`` in ``[0, L)`` whose state (after ``t``) to return.

    Returns:
        ``(y [L, H, P], states [len(state_offsets), H, P, N])`` in the compute dtype;
        equal (up to rounding) to :func:`ssd_recurrent_reference`'s ``y`` and
        ``states[state_offsets]``.
    """
    _check_shapes(x, dt, A, B, C, D, initial_state)
    length, heads, head_dim = x.shape
    d_state = B.shape[-1]
    for t in state_offsets:
        if not 0 <= t < length:
            raise ValueError(f"state offset {t} outside [0, {length})")
    compute = torch.promote_types(x.dtype, torch.float32)
    q = chunk_size
    n_chunks = -(-length // q)
    pad = n_chunks * q - length

    def chunks(t: torch.Tensor) -> torch.Tensor:
        # Padded tokens get dt = 0 (no decay, no input), so they change no state.
        t = F.pad(t.to(compute), (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(n_chunks, q, *t.shape[1:])

    xc = chunks(x)  # [c, l, H, P]
    dtc = chunks(dt)  # [c, l, H]
    Bc = heads_from_groups(chunks(B), heads)  # [c, l, H, N]
    Cc = heads_from_groups(chunks(C), heads)
    xdt = xc * dtc[..., None]
    a = (dtc * A.to(compute)).permute(0, 2, 1)  # [c, H, l], log decay per token
    a_cum = a.cumsum(dim=-1)  # [c, H, l]
    seg = _segment_sum(a)  # [c, H, l, s]
    decay_ls = torch.exp(seg)

    # Intra-chunk (diagonal blocks): y[l] += sum_{s<=l} (C_l . B_s) decay(s->l) dt_s x_s.
    scores = torch.einsum("clhn,cshn->chls", Cc, Bc) * decay_ls
    y = torch.einsum("chls,cshp->clhp", scores, xdt)

    # Each chunk's own contribution to the state at its end (starting from zero).
    decay_to_end = decay_ls[..., -1, :]  # [c, H, s]: decay from token s to the chunk end
    chunk_states = torch.einsum("chs,cshn,cshp->chpn", decay_to_end, Bc, xdt)

    # Recurrence over chunk boundaries: start[c] is the state before chunk c's first token.
    start = torch.empty(n_chunks, heads, head_dim, d_state, dtype=compute, device=x.device)
    s = (
        torch.zeros(heads, head_dim, d_state, dtype=compute, device=x.device)
        if initial_state is None
        else initial_state.to(compute)
    )
    chunk_decay = torch.exp(a_cum[..., -1])  # [c, H]
    for c in range(n_chunks):
        start[c] = s
        s = s * chunk_decay[c][:, None, None] + chunk_states[c]

    # Off-diagonal blocks: the start state decayed to token l, read out through C_l.
    decay_from_start = torch.exp(a_cum)  # [c, H, l]
    y = y + torch.einsum("clhn,chpn,chl->clhp", Cc, start, decay_from_start)
    y = y.reshape(n_chunks * q, heads, head_dim)[:length]
    if D is not None:
        y = y + x.to(compute) * D.to(compute)[:, None]

    states = torch.empty(
        len(state_offsets), heads, head_dim, d_state, dtype=compute, device=x.device
    )
    for j, t in enumerate(state_offsets):
        c, l = divmod(t, q)
        intra = torch.einsum(
            "hs,shn,shp->hpn", decay_ls[c, :, l, : l + 1], Bc[c, : l + 1], xdt[c, : l + 1]
        )
        states[j] = start[c] * decay_from_start[c, :, l][:, None, None] + intra
    return y, states
