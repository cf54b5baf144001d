"""Fused norms (:mod:`hybridserve.kernels.norms`): the Triton kernels against their torch
twins and a float64 evaluation on NaN-poisoned, strided outputs (float32 / bf16 / fp16,
rows that are not powers of two, one and several groups, both weight orders), under the
race checker and in three program orders; the layers' dispatch; whole tiny models with
the fused path forced through the interpreter against the torch path, and the decoder's
pending-residual order against adding first (bit-identical on the CPU).

The CPU tests need the interpreter (``TRITON_INTERPRET=1``, the default here). The GPU
test needs compiled kernels: ``TRITON_INTERPRET=0 pytest -m gpu tests/kernels/test_norms.py -s``.
"""

import os

# The interpreter must be chosen before the kernels are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from hybridserve.kernels import norms  # noqa: E402
from hybridserve.models.layers.norm import GatedRMSNorm, RMSNorm  # noqa: E402

INTERPRETED = bool(triton.knobs.runtime.interpret)
if INTERPRETED:
    from hybridserve.testing import racecheck

interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="CPU tensors run the kernels through TRITON_INTERPRET=1"
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-5


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _randn(g, *shape, dtype=torch.float32, scale=1.0):
    # Rows of mixed magnitude, no zeros: a wrong mean or a row mix-up shows.
    t = torch.randn(*shape, generator=g, dtype=torch.float64) * scale
    t = t * (0.5 + torch.rand(*shape[:-1], 1, generator=g, dtype=torch.float64) * 3)
    return t.to(dtype)


def _poisoned(rows, n, dtype, pad=3):
    """A NaN-filled ``[rows, n + pad]`` buffer and its strided ``[rows, n]`` view."""
    buf = torch.full((rows, n + pad), float("nan"), dtype=dtype)
    return buf, buf[:, :n]


def _rms64(h, weight, eps):
    h = h.double()
    return weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def _gated64(x, z, weight, groups, eps):
    z = z.double()
    h = x.double() * z * torch.sigmoid(z)
    g = h.view(*h.shape[:-1], groups, -1)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight.double() * g.view_as(h)


def _ulp(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


# --------------------------------------------------------------------------------------
# Kernels against twins and float64
# --------------------------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weight_in_fp32", [False, True], ids=["cast-first", "weight-fp32"])
@pytest.mark.parametrize("n,multiplier,add", [(40, 1.0, False), (100, 0.37, True), (257, 1.0, True)])
def test_rms_norm_kernel_matches_twin_and_float64(dtype, weight_in_fp32, n, multiplier, add):
    g = torch.Generator().manual_seed(_seed())
    rows = 5
    residual = _randn(g, rows, n, dtype=dtype, scale=2.0)
    x = _randn(g, rows, n, dtype=dtype)
    weight = (1 + torch.randn(n, generator=g) * 0.5).to(dtype)
    out_buf, out = _poisoned(rows, n, dtype)
    res_buf, res_out = _poisoned(rows, n, dtype)
    if add:
        h, y = norms.add_rms_norm(
            residual, x, weight, EPS, multiplier, weight_in_fp32, residual_out=res_out, out=out
        )
        h_twin, y_twin = norms.add_rms_norm_reference(
            residual, x, weight, EPS, multiplier, weight_in_fp32
        )
        assert h is res_out
        # The residual add is the same roundings in the same order: bit-identical.
        assert torch.equal(h, h_twin)
        assert res_buf[:, n:].isnan().all()
        exact = residual.double() + x.double() * multiplier
        bound = _ulp(dtype) * (residual.double().abs() + (x.double() * multiplier).abs())
        assert ((h.double() - exact).abs() <= bound).all()
    else:
        h = x
        y = norms.rms_norm(x, weight, EPS, weight_in_fp32, out=out)
        y_twin = norms.rms_norm_reference(x, weight, EPS, weight_in_fp32)
    assert y is out and y.dtype == y_twin.dtype == dtype
    assert not y.isnan().any() and out_buf[:, n:].isnan().all()
    # Only the float32 sum of squares is ordered differently from the twin.
    tol = 4e-7 if dtype == torch.float32 else _ulp(dtype)
    torch.testing.assert_close(y, y_twin, rtol=tol, atol=tol)
    if dtype != torch.float32:
        assert (y == y_twin).float().mean() > 0.95  # and nearly always bit-identical
    # Against float64 of the same input: one or two roundings of the output dtype.
    want = _rms64(h, weight, EPS)
    torch.testing.assert_close(y.double(), want, rtol=2 * _ulp(dtype) + 1e-6, atol=1e-6)


@interpreted
@pytest.mark.parametrize(
    "x_dtype,w_dtype,weight_in_fp32,want",
    [
        (torch.bfloat16, torch.float32, False, torch.float32),
        (torch.float32, torch.bfloat16, False, torch.float32),
        (torch.float16, torch.float32, True, torch.float16),
    ],
)
def test_rms_norm_output_dtype_follows_torch_promotion(x_dtype, w_dtype, weight_in_fp32, want):
    g = torch.Generator().manual_seed(_seed())
    x = _randn(g, 3, 48, dtype=x_dtype)
    weight = torch.randn(48, generator=g).to(w_dtype)
    y = norms.rms_norm(x, weight, EPS, weight_in_fp32)
    y_twin = norms.rms_norm_reference(x, weight, EPS, weight_in_fp32)
    assert y.dtype == y_twin.dtype == want
    torch.testing.assert_close(y, y_twin, rtol=1e-6, atol=1e-6)


GATED_CASES = [
    # (x, gate, weight, channels, groups, out_dtype): the first two are a bf16 model's
    # mixer (float32 scan output, bf16 z and weight), with and without the fused cast.
    (torch.float32, torch.bfloat16, torch.bfloat16, 60, 3, None),
    (torch.float32, torch.bfloat16, torch.bfloat16, 60, 3, torch.bfloat16),
    (torch.float32, torch.float32, torch.float32, 50, 1, None),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, 84, 4, None),
    (torch.float16, torch.float16, torch.float16, 36, 2, None),
    (torch.float16, torch.float32, torch.float32, 24, 1, torch.bfloat16),
    # A bf16 product widened afterwards: rounded to bf16 first, as the twin's product is.
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, 40, 2, torch.float32),
]


@interpreted
@pytest.mark.parametrize("x_dtype,z_dtype,w_dtype,n,groups,out_dtype", GATED_CASES)
def test_gated_rms_norm_kernel_matches_twin_and_float64(
    x_dtype, z_dtype, w_dtype, n, groups, out_dtype
):
    g = torch.Generator().manual_seed(_seed())
    rows = 5
    x = _randn(g, rows, n, dtype=x_dtype)
    # z as the mixer has it: a slice of the wider input projection (strided rows).
    z = _randn(g, rows, n + 11, dtype=z_dtype, scale=2.0)[:, :n]
    weight = (1 + torch.randn(n, generator=g) * 0.5).to(w_dtype)
    want_dtype = out_dtype or torch.promote_types(w_dtype, x_dtype)
    out_buf, out = _poisoned(rows, n, want_dtype)
    y = norms.gated_rms_norm(x, z, weight, groups, EPS, out_dtype, out=out)
    y_twin = norms.gated_rms_norm_reference(x, z, weight, groups, EPS, out_dtype)
    assert y is out and y.dtype == y_twin.dtype == want_dtype
    assert not y.isnan().any() and out_buf[:, n:].isnan().all()
    coarse = max(_ulp(x_dtype), _ulp(want_dtype), _ulp(torch.promote_types(w_dtype, x_dtype)))
    # silu's exp and the sum of squares are float32 here and in the twin, in other orders.
    tol = 2e-6 if coarse == _ulp(torch.float32) else coarse
    torch.testing.assert_close(y, y_twin, rtol=tol, atol=tol)
    if coarse != _ulp(torch.float32):
        assert (y == y_twin).float().mean() > 0.95  # the same roundings, in the same order
    want = _gated64(x, z, weight, groups, EPS)
    torch.testing.assert_close(y.double(), want, rtol=3 * coarse + 2e-6, atol=2e-6)


@interpreted
def test_gated_rms_norm_groups_are_normalised_separately():
    """Scaling one group's input leaves the other groups' outputs unchanged."""
    g = torch.Generator().manual_seed(_seed())
    x = _randn(g, 4, 30)
    z = _randn(g, 4, 30)
    weight = torch.randn(30, generator=g)
    y = norms.gated_rms_norm(x, z, weight, 3, EPS)
    x2 = x.clone()
    x2[:, 10:20] *= 7.0
    y2 = norms.gated_rms_norm(x2, z, weight, 3, EPS)
    assert torch.equal(y[:, :10], y2[:, :10]) and torch.equal(y[:, 20:], y2[:, 20:])
    # One group over all channels is a different function.
    y1 = norms.gated_rms_norm(x, z, weight, 1, EPS)
    assert not torch.allclose(y, y1)


@interpreted
def test_launchers_refuse_bad_shapes():
    x = torch.randn(2, 12)
    w = torch.randn(12)
    with pytest.raises(ValueError, match="groups do not divide"):
        norms.gated_rms_norm(x, x, w, 5, EPS)
    with pytest.raises(ValueError, match="residual must match"):
        norms.add_rms_norm(x.to(torch.bfloat16), x, w, EPS)
    with pytest.raises(ValueError, match="weight must be"):
        norms.rms_norm(x, torch.randn(11), EPS)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        norms.rms_norm(x.double(), w, EPS)
    assert norms.rms_norm(torch.empty(0, 12), w, EPS).shape == (0, 12)


# --------------------------------------------------------------------------------------
# Race checker and program orders
# --------------------------------------------------------------------------------------


def _race_cases(g):
    rows, n, groups = 6, 100, 4
    r = _randn(g, rows, n, dtype=torch.bfloat16)
    x = _randn(g, rows, n, dtype=torch.bfloat16)
    w = torch.randn(n, generator=g).to(torch.bfloat16)
    xs = _randn(g, rows, n)
    z = _randn(g, rows, n + 5, dtype=torch.bfloat16)[:, :n]
    nan = float("nan")
    return [
        (norms.rms_norm, lambda: dict(x=x, weight=w, eps=EPS, weight_in_fp32=True,
                                      out=torch.full((rows, n), nan, dtype=torch.bfloat16))),
        (norms.add_rms_norm, lambda: dict(
            residual=r, x=x, weight=w, eps=EPS, multiplier=0.37,
            residual_out=torch.full((rows, n), nan, dtype=torch.bfloat16),
            out=torch.full((rows, n), nan, dtype=torch.bfloat16))),
        (norms.gated_rms_norm, lambda: dict(
            x=xs, gate=z, weight=w, n_groups=groups, eps=EPS, out_dtype=torch.bfloat16,
            out=torch.full((rows, n), nan, dtype=torch.bfloat16))),
    ]


@interpreted
def test_kernels_race_free_and_independent_of_program_order():
    g = torch.Generator().manual_seed(_seed())
    for launcher, make_args in _race_cases(g):
        with racecheck.record_launches() as rec:
            launcher(**make_args())
        assert len(rec.reports) == 1 and rec.reports[0].clean, str(rec.reports[0])
        report = racecheck.run_launcher_in_orders(launcher, make_args, seed=_seed() % 1000)
        assert report.consistent, report.differences
        for order in report.orders:
            assert not report.outputs[order]["out"].isnan().any()


@interpreted
def test_in_place_residual_is_race_free():
    """``residual_out=residual``: each program reads its own row before writing it."""
    g = torch.Generator().manual_seed(_seed())
    r = _randn(g, 5, 70)
    x = _randn(g, 5, 70)
    w = torch.randn(70, generator=g)
    want_h, want_y = norms.add_rms_norm_reference(r, x, w, EPS, 0.5)
    with racecheck.record_launches() as rec:
        h, y = norms.add_rms_norm(r, x, w, EPS, 0.5, residual_out=r)
    assert rec.reports[0].clean, str(rec.reports[0])
    assert h is r and torch.equal(r, want_h)
    torch.testing.assert_close(y, want_y, rtol=4e-7, atol=4e-7)


# --------------------------------------------------------------------------------------
# Dispatch in the layers
# --------------------------------------------------------------------------------------


@interpreted
def test_triton_enabled_dispatch():
    x = torch.randn(3, 8)
    assert not norms.triton_enabled("auto", x)  # the default: CPU tensors take the twin
    assert norms.triton_enabled("triton", x, x.to(torch.bfloat16), x.half())
    assert not norms.triton_enabled("triton", x.double())
    assert not norms.triton_enabled("triton", x.t())  # rows not contiguous
    assert not norms.triton_enabled("triton", torch.randn(2, norms.MAX_ROW + 1))
    p = torch.nn.Parameter(torch.randn(8))
    assert not norms.triton_enabled("triton", x, p)  # the kernels have no backward
    with torch.no_grad():
        assert norms.triton_enabled("triton", x, p)
    assert not norms.triton_enabled("reference", x)
    with pytest.raises(ValueError, match="norms mode"):
        norms.triton_enabled("sometimes", x)


@interpreted
@pytest.mark.parametrize("weight_in_fp32", [False, True])
def test_modules_take_the_kernels_when_enabled(weight_in_fp32):
    g = torch.Generator().manual_seed(_seed())
    norm = RMSNorm(64, EPS, weight_in_fp32).to(torch.bfloat16).requires_grad_(False)
    gated = GatedRMSNorm(64, 4, EPS).to(torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g))
        gated.weight.copy_(torch.randn(64, generator=g))
    # The same weights with the kernels asked for.
    fused_norm = RMSNorm(64, EPS, weight_in_fp32, "triton").to(torch.bfloat16)
    fused_gated = GatedRMSNorm(64, 4, EPS, "triton").to(torch.bfloat16)
    fused_norm.load_state_dict(norm.state_dict())
    fused_gated.load_state_dict(gated.state_dict())
    fused_norm.requires_grad_(False)
    fused_gated.requires_grad_(False)
    r = _randn(g, 4, 64, dtype=torch.bfloat16)
    x = _randn(g, 4, 64, dtype=torch.bfloat16)
    y = _randn(g, 4, 64)
    z = _randn(g, 4, 64, dtype=torch.bfloat16)

    def run(norm, gated):
        with racecheck.record_launches(record=False) as rec:
            out = (norm(x), norm.add_norm(r, x, 0.25), gated(y, z), gated(y, z, torch.bfloat16))
        return out, rec.launches

    torch_out, launches = run(norm, gated)
    assert launches == 0
    fused_out, launches = run(fused_norm, fused_gated)
    assert launches == 4
    plain, (h, hn), gy, gy16 = fused_out
    t_plain, (t_h, t_hn), t_gy, t_gy16 = torch_out
    assert torch.equal(h, t_h)
    assert gy.dtype == torch.float32 and gy16.dtype == torch.bfloat16
    for a, b in ((plain, t_plain), (hn, t_hn), (gy, t_gy), (gy16, t_gy16)):
        assert a.dtype == b.dtype
        tol = 2e-6 if a.dtype == torch.float32 else _ulp(a.dtype)
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    # The fused cast is the twin's product rounded once more: the same bits.
    assert torch.equal(gy16, gy.to(torch.bfloat16))


# --------------------------------------------------------------------------------------
# Whole models
# --------------------------------------------------------------------------------------


def _driver():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from paged_driver import PagedDriver

    return PagedDriver


def _two_steps(model, seed):
    """Logits of a packed prefill of three rows, then one decode step of every row."""
    g = torch.Generator().manual_seed(seed)
    prompts = {i: torch.randint(3, 256, (4 + 3 * i,), generator=g).tolist() for i in range(3)}
    nxt = {i: torch.randint(3, 256, (1,), generator=g).tolist() for i in range(3)}
    d = _driver()(model)
    prefill, _ = d.step(list(prompts.items()))
    decode, _ = d.step(list(nxt.items()))
    return prefill, decode


def _add_first_forward(names):
    """A backbone forward in the add-then-normalise form: ``h += block(norm(h))`` per block."""

    def forward(backbone, input_ids, batch, caches):
        return _add_first(backbone, names, input_ids, batch, caches)

    return forward


def _add_first(backbone, names, input_ids, batch, caches):
    h = backbone.embed(input_ids)
    if backbone.embedding_multiplier != 1.0:
        h = h * backbone.embedding_multiplier
    from hybridserve.models.config import ATTENTION, MAMBA

    for layer in backbone.layers:
        x = getattr(layer, names.input_norm)(h)
        if layer.kind == MAMBA:
            x = getattr(layer, names.mamba)(x, batch, caches.states[layer.index])
        elif layer.kind == ATTENTION:
            x = getattr(layer, names.attention)(x, batch, caches.kv[layer.index])
        else:
            x = getattr(layer, names.mlp_mixer)(x)
        h = h + x * layer.residual_multiplier
        if layer.has_mlp:
            x = getattr(layer, names.mlp)(getattr(layer, names.post_norm)(h))
            h = h + x * layer.residual_multiplier
    return getattr(backbone, names.final_norm)(h)


@interpreted
@pytest.mark.parametrize("arch", ["tiny_granite", "tiny_nemotron", "tiny_bamba"])
def test_pending_residual_order_is_bit_identical_on_cpu(request, monkeypatch, arch):
    from hybridserve.models.hybrid import HybridBackbone
    from hybridserve.models.loader import load_model

    path = request.getfixturevalue(arch)
    seed = _seed()
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(path, dtype=dtype)
        got = _two_steps(model, seed)
        with monkeypatch.context() as m:
            m.setattr(HybridBackbone, "forward", _add_first_forward(type(model).names))
            want = _two_steps(model, seed)
        for a, b in zip(got, want):
            assert not a.isnan().any()
            assert torch.equal(a, b)


@interpreted
@pytest.mark.parametrize(
    "arch,dtype",
    [("tiny_granite", torch.float32), ("tiny_nemotron", torch.float32),
     ("tiny_bamba", torch.float32), ("tiny_nemotron", torch.bfloat16)],
)
def test_fused_path_through_whole_model_matches_torch_path(request, arch, dtype):
    """Every norm of a prefill and a decode step through the kernels (interpreted)."""
    from hybridserve.config import KernelPolicy
    from hybridserve.models.loader import load_model, with_kernel_policy

    model = load_model(request.getfixturevalue(arch), dtype=dtype)
    seed = _seed()
    with racecheck.record_launches(record=False) as rec:
        want = _two_steps(model, seed)
    assert rec.launches == 0  # the torch path launches nothing
    fused = with_kernel_policy(model, KernelPolicy(norms="triton"))
    with racecheck.record_launches(record=False) as rec:
        got = _two_steps(fused, seed)
    assert rec.launches > 0
    for a, b in zip(got, want):
        assert not a.isnan().any()
        scale = b.abs().max()
        # float32: the sums of squares in another order; bf16: a rare one-ulp flip of a
        # normalised value, carried through the layers.
        tol = 1e-5 if dtype == torch.float32 else 0.02
        assert (a - b).abs().max() <= tol * scale
        assert torch.equal(a.argmax(-1), b.argmax(-1))


# --------------------------------------------------------------------------------------
# GPU: a realistic shape, and the time saved
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRETED,
    reason="needs CUDA and compiled kernels (TRITON_INTERPRET=0)",
)
def test_gpu_realistic_shape_matches_twins():
    """Nemotron-H-8B decode at batch 64: hidden 4096, 8192 Mamba channels in 8 groups, bf16.

    The timings are printed, not asserted: at this size both sides are bound by launch
    latency (about 44 us each on the H200), so their order is noise; the speed of the
    fused norms is measured by ``benchmarks/bench_gpu.py``."""
    from triton.testing import do_bench

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows, hidden, channels, groups = 64, 4096, 8192, 8
    bf16 = torch.bfloat16

    def randn(*shape, dtype=bf16):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32).to(dtype)

    residual = randn(rows, hidden) * 4
    x = randn(rows, hidden)
    weight = 1 + randn(hidden) * 0.2
    timings = {}
    for weight_in_fp32 in (False, True):
        for multiplier in (1.0, 0.22):
            args = (residual, x, weight, EPS, multiplier, weight_in_fp32)
            h, y = norms.add_rms_norm(*args)
            h_twin, y_twin = norms.add_rms_norm_reference(*args)
            assert torch.equal(h, h_twin)
            torch.testing.assert_close(y, y_twin, rtol=_ulp(bf16), atol=_ulp(bf16))
            assert (y == y_twin).float().mean() > 0.99
        timings[f"add+norm fused (weight_in_fp32={weight_in_fp32})"] = do_bench(
            lambda a=args: norms.add_rms_norm(*a)
        )
        timings[f"add+norm torch (weight_in_fp32={weight_in_fp32})"] = do_bench(
            lambda a=args: norms.add_rms_norm_reference(*a)
        )

    # The mixer's operands: float32 scan output, z a slice of the bf16 input projection.
    y_scan = randn(rows, channels, dtype=torch.float32)
    zxbcdt = randn(rows, channels + 2 * channels // 8 + 128)
    z = zxbcdt[:, :channels]
    gweight = 1 + randn(channels) * 0.2
    out = norms.gated_rms_norm(y_scan, z, gweight, groups, EPS, bf16)
    want = norms.gated_rms_norm_reference(y_scan, z, gweight, groups, EPS).to(bf16)
    torch.testing.assert_close(out, want, rtol=_ulp(bf16), atol=_ulp(bf16))
    assert (out == want).float().mean() > 0.99
    timings["gated norm + cast fused"] = do_bench(
        lambda: norms.gated_rms_norm(y_scan, z, gweight, groups, EPS, bf16)
    )
    timings["gated norm + cast torch"] = do_bench(
        lambda: norms.gated_rms_norm_reference(y_scan, z, gweight, groups, EPS).to(bf16)
    )
    for name, ms in timings.items():
        print(f"{name}: {ms * 1000:.1f} us")
