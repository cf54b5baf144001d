"""The gated delta rule twin (kernels/gdn.py) against transformers' own two forms of it
(token recurrence and chunked, both computed in float32 there), on fresh random inputs
with initial states; states at offsets against prefix runs; page-dtype rounding."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels.gdn import gated_delta_rule_reference, l2_normalize

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def _inputs(g: torch.Generator, length: int, hk: int, hv: int, dk: int, dv: int):
    q = torch.randn(length, hk, dk, generator=g, dtype=torch.float64)
    k = torch.randn(length, hk, dk, generator=g, dtype=torch.float64)
    v = torch.randn(length, hv, dv, generator=g, dtype=torch.float64)
    a = torch.randn(length, hv, generator=g, dtype=torch.float64)
    gdecay = -torch.rand(hv, generator=g, dtype=torch.float64) * torch.nn.functional.softplus(a)
    beta = torch.rand(length, hv, generator=g, dtype=torch.float64)
    state = torch.randn(hv, dk, dv, generator=g, dtype=torch.float64)
    return q, k, v, gdecay, beta, state


@pytest.mark.parametrize("length,hk,hv,dk,dv", [(1, 1, 1, 4, 4), (13, 2, 4, 8, 6), (70, 2, 6, 16, 8)])
@pytest.mark.parametrize("initial", [False, True])
def test_matches_transformers_recurrence_and_chunked_form(length, hk, hv, dk, dv, initial):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    q, k, v, gd, beta, state = _inputs(g, length, hk, hv, dk, dv)
    init = state if initial else None
    offsets = sorted({0, length // 2, length - 1})
    qn, kn = l2_normalize(q), l2_normalize(k)
    out, states = gated_delta_rule_reference(qn * dk**-0.5, kn, v, gd, beta, init, offsets)
    for fn, kw in ((hf.torch_recurrent_gated_delta_rule, {}),
                   (hf.torch_chunk_gated_delta_rule, {"chunk_size": 8})):
        ref_out, ref_state = fn(q[None], k[None], v[None], gd[None], beta[None],
                                initial_state=None if init is None else init[None],
                                output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
        # transformers computes in float32: agreement to float32 rounding.
        assert (out - ref_out[0]).abs().max() < 1e-5 * max(1.0, out.abs().max().item())
        assert (states[-1] - ref_state[0]).abs().max() < 1e-5 * max(1.0, states.abs().max().item())
    # A state at an offset is the final state of the prefix.
    for j, t in enumerate(offsets):
        _, s = gated_delta_rule_reference(qn[: t + 1] * dk**-0.5, kn[: t + 1], v[: t + 1],
                                          gd[: t + 1], beta[: t + 1], init, [t])
        assert torch.equal(s[0], states[j])


def test_state_dtype_rounds_the_carried_state_after_every_token():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    q, k, v, gd, beta, state = _inputs(g, 9, 2, 4, 8, 8)
    q, k = l2_normalize(q) * 8**-0.5, l2_normalize(k)
    state = state.to(torch.bfloat16)  # a state read from a bfloat16 page
    whole, states = gated_delta_rule_reference(q, k, v, gd, beta, state, range(9), torch.bfloat16)
    # Token by token, each step starting from the previous step's rounded state.
    s = state
    for t in range(9):
        o, (s,) = gated_delta_rule_reference(q[t:t + 1], k[t:t + 1], v[t:t + 1], gd[t:t + 1],
                                             beta[t:t + 1], s.to(torch.bfloat16), [0],
                                             torch.bfloat16)
        assert torch.equal(o[0], whole[t]) and torch.equal(s, states[t])
        assert torch.equal(s, s.to(torch.bfloat16).to(s.dtype))


def test_bad_shapes_are_refused():
    x = torch.zeros(3, 2, 4)
    with pytest.raises(ValueError, match="multiple of key heads"):
        gated_delta_rule_reference(x, x, torch.zeros(3, 3, 4), torch.zeros(3, 3), torch.zeros(3, 3))
    with pytest.raises(ValueError, match="state_offsets"):
        gated_delta_rule_reference(x, x, x, torch.zeros(3, 2), torch.zeros(3, 2), None, [3])
