"""The gated delta rule of Gated DeltaNet layers: torch reference twins (CPU path, oracle).

One sequence, heads-major per token. With ``q, k [L, Hk, Dk]`` (already L2-normalised;
``q`` also scaled by ``Dk ** -0.5``), ``v [L, Hv, Dv]``, log decay ``g [L, Hv]`` (<= 0)
and ``beta [L, Hv]``, value head ``h`` reads key head ``h // (Hv // Hk)`` and carries a
state ``S [Dk, Dv]`` updated per token ``t``::

    S = exp(g_t) * S                     # decay
    S = S + k_t (beta_t * (v_t - k_t^T S))^T   # delta rule: correct what S predicts for k_t
    o_t = q_t^T S                        # [Dv]

so the state after token ``t`` is a pure function of the tokens up to ``t`` (no chunk
boundary enters it). The recurrence runs in float32 or wider (the inputs' promotion
with float32); ``state_dtype`` rounds the carried state after every token to the dtype
its page stores (bfloat16 with ``ssm_state_dtype = "bfloat16"``): a state read back from
a page at any position is then the state an uninterrupted run carries there, so steps
of any split (prefill chunks, prefix hits, verify rows) give identical results.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def gdn_gates(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)`` of the projections' raw ``a, b [..., Hv]``: the log decay
    ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, both computed in
    ``dtype`` (default ``promote(a.dtype, float32)``: never in bfloat16, whose rounding of
    the decay compounds over every token). The kernels compute the same in float32
    (:func:`~hybridserve.kernels.gdn_decode.gdn_token_step`)."""
    dtype = dtype or torch.promote_types(a.dtype, torch.float32)
    g = -A_log.to(dtype).exp() * F.softplus(a.to(dtype) + dt_bias.to(dtype))
    return g, b.to(dtype).sigmoid()


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in ``x``'s dtype (the reference's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    state_offsets: Sequence[int] = (),
    state_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, token by token (see the module docstring).

    Args:
        q, k: ``[L, Hk, Dk]``; v: ``[L, Hv, Dv]`` with ``Hv % Hk == 0``.
        g, beta: ``[L, Hv]``.
        initial_state: ``[Hv, Dk, Dv]`` state before token 0; None means zeros.
        state_offsets: offsets ``t`` in ``[0, L)`` whose state (after token ``t``) to return.
        state_dtype: the carried state is rounded to it after every token (None: no
            rounding beyond the compute dtype).

    Returns:
        ``(o [L, Hv, Dv]``, ``states [len(state_offsets), Hv, Dk, Dv])``, both in the
        compute dtype ``promote(v.dtype, float32)``.
    """
    length, hk, dk = k.shape
    hv, dv = v.shape[1:]
    if q.shape != k.shape or v.shape[0] != length or g.shape != (length, hv) or (
        beta.shape != (length, hv)
    ):
        raise ValueError(
            f"shapes: q, k [L, Hk, Dk], v [L, Hv, Dv], g, beta [L, Hv]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}"
        )
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    bad = [t for t in state_offsets if not 0 <= t < length]
    if bad:
        raise ValueError(f"state_offsets {bad} outside [0, {length})")
    compute = torch.promote_types(v.dtype, torch.float32)
    rep = hv // hk
    q, k = (x.to(compute).repeat_interleave(rep, dim=1) for x in (q, k))
    v, g, beta = (x.to(compute) for x in (v, g, beta))
    if initial_state is None:
        state = torch.zeros(hv, dk, dv, dtype=compute, device=v.device)
    else:
        if initial_state.shape != (hv, dk, dv):
            raise ValueError(
                f"initial_state must be [{hv}, {dk}, {dv}], got {tuple(initial_state.shape)}"
            )
        state = initial_state.to(compute)
    wanted = {t: i for i, t in enumerate(state_offsets)}
    states = torch.empty(len(state_offsets), hv, dk, dv, dtype=compute, device=v.device)
    out = torch.empty(length, hv, dv, dtype=compute, device=v.device)
    decay = g.exp()
    for t in range(length):
        state = state * decay[t][:, None, None]
        predicted = (state * k[t][:, :, None]).sum(dim=1)  # [Hv, Dv]
        delta = (v[t] - predicted) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        if state_dtype is not None:
            state = state.to(state_dtype).to(compute)
        out[t] = (state * q[t][:, :, None]).sum(dim=1)
        if t in wanted:
            states[wanted[t]] = state
    return out, states
