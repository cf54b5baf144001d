"""The decode / verify kernels compiled on CUDA at the Nemotron-H-8B shape (``-m gpu``,
``TRITON_INTERPRET=0``): the fused conv + recurrence (``conv_ssm_update``) against its
twin and against the two launches it replaces, and the conv update's register form
against the reload form and the twin, on bf16 activations and float32 state pages."""

import os

import pytest
import torch

from hybridserve.kernels.mamba_decode import (
    conv_decode_update,
    conv_decode_update_reference,
    conv_ssm_update,
    conv_ssm_update_reference,
    ssm_update,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="compiles the kernels: run with TRITON_INTERPRET=0"),
]

HEADS, HEAD_DIM, GROUPS, D_STATE, K = 128, 64, 8, 128, 4
CHANNELS = HEADS * HEAD_DIM + 2 * GROUPS * D_STATE


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _step(rows, q, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = rows * q

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device="cuda") * scale

    proj = rnd(t, CHANNELS + HEADS, scale=0.5).bfloat16()
    proj[:, CHANNELS:] -= 2.0
    xbc, dt = proj[:, :CHANNELS], proj[:, CHANNELS:]
    weight = rnd(CHANNELS, K, scale=0.5).bfloat16()
    bias = rnd(CHANNELS, scale=0.1).bfloat16()
    A = -torch.exp(rnd(HEADS, scale=0.5))
    D = rnd(HEADS)
    pages = rows * (q + 1) + 2
    conv_cache = rnd(pages, CHANNELS, K - 1).bfloat16()
    ssm_cache = rnd(pages, HEADS, HEAD_DIM, D_STATE, scale=0.1)
    perm = torch.randperm(pages, device="cuda", generator=g).to(torch.int32)
    in_pages = perm[:rows].contiguous()
    out_pages = perm[rows : rows + t].view(rows, q).contiguous()
    written = out_pages.reshape(-1).long()
    conv_cache[written] = float("nan")
    ssm_cache[written] = float("nan")
    kw = dict(dt_bias=rnd(HEADS, scale=0.5), time_step_limit=None)
    return xbc, dt, weight, bias, A, D, conv_cache, ssm_cache, in_pages, out_pages, kw


@pytest.mark.parametrize("rows,q", [(1, 1), (64, 1), (64, 4)])
def test_gpu_conv_ssm_matches_twin_and_two_launches(rows, q, record_property):
    xbc, dt, weight, bias, A, D, conv_cache, ssm_cache, in_pages, out_pages, kw = _step(
        rows, q, 1000 * rows + q)
    written = out_pages.reshape(-1).long()
    twin_conv, twin_ssm = conv_cache.clone(), ssm_cache.clone()
    want = conv_ssm_update_reference(xbc, dt, weight, bias, A, D, twin_conv, twin_ssm,
                                     in_pages, out_pages, **kw)
    two_conv, two_ssm = conv_cache.clone(), ssm_cache.clone()
    conv = conv_decode_update(xbc, weight, bias, two_conv, in_pages, out_pages)
    hp, gs = HEADS * HEAD_DIM, GROUPS * D_STATE
    x, B, C = conv.split([hp, gs, gs], dim=-1)
    two = ssm_update(x.view(-1, HEADS, HEAD_DIM), dt, A, B.view(-1, GROUPS, D_STATE),
                     C.view(-1, GROUPS, D_STATE), D, two_ssm, in_pages, out_pages, **kw)
    got = conv_ssm_update(xbc, dt, weight, bias, A, D, conv_cache, ssm_cache, in_pages,
                          out_pages, **kw)
    torch.cuda.synchronize()
    rel_twin, rel_two = _rel(got, want), _rel(got, two)
    rel_state = _rel(ssm_cache[written], twin_ssm[written])
    record_property("conv_ssm_rel_err_vs_twin", rel_twin)
    print(f"conv_ssm_update rows {rows} q {q}: y vs twin {rel_twin:.2e}, vs two launches "
          f"{rel_two:.2e}, states vs twin {rel_state:.2e}")
    # The same float32 arithmetic as the two launches (the conv output rounded to bf16 in
    # both); against the twin, a bf16 conv output can round an ulp apart.
    assert rel_two < 1e-5
    assert rel_twin < 1e-3 and rel_state < 1e-3
    assert torch.equal(conv_cache[written], twin_conv[written])
    assert torch.equal(conv_cache[written], two_conv[written])


@pytest.mark.parametrize("rows,q", [(64, 1), (64, 4), (256, 4)])
def test_gpu_conv_register_form_matches_reload_form_and_twin(rows, q):
    xbc, _, weight, bias, _, _, conv_cache, _, in_pages, out_pages, _ = _step(rows, q, rows + q)
    written = out_pages.reshape(-1).long()
    caches = [conv_cache.clone() for _ in range(3)]
    want = conv_decode_update_reference(xbc, weight, bias, caches[0], in_pages, out_pages)
    new = conv_decode_update(xbc, weight, bias, caches[1], in_pages, out_pages)
    old = conv_decode_update(xbc, weight, bias, caches[2], in_pages, out_pages,
                             registers=False)
    torch.cuda.synchronize()
    assert _rel(new, want) < 1e-3 and _rel(old, want) < 1e-3
    assert _rel(new, old) < 1e-3
    assert torch.equal(caches[1][written], caches[0][written])
    assert torch.equal(caches[2][written], caches[0][written])
