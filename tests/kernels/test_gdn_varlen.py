"""Gated DeltaNet over packed variable-length rows: Triton kernel vs torch twin (rows of
any length, empty rows, zero and paged initial states, states at any offsets), poisoned
output pages, the race checker, several program orders, bfloat16 pages; and the mixer's
packed-rows path (twins, and the Triton kernels under the interpreter) against its
per-row path."""

import os

# The interpreter must be chosen before the kernels are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import sys
from pathlib import Path

import pytest
import torch

from hybridserve.kernels.gdn import l2_normalize
from hybridserve.kernels.gdn_varlen import gdn_varlen_update, gdn_varlen_update_reference
from hybridserve.models.layers import gated_deltanet

if os.environ["TRITON_INTERPRET"] != "1":
    # Every test here runs kernels through the race checker, which needs the CPU
    # interpreter: a GPU run (TRITON_INTERPRET=0) skips the module.
    pytest.skip("needs TRITON_INTERPRET=1 (the race checker)", allow_module_level=True)

from hybridserve.testing import racecheck  # noqa: E402


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _inputs(g, lengths, hk, hv, dk, dv, dtype=torch.float32):
    """One packed step's operands; ``a, b`` raw (the projections'), the last item holds
    the layer's ``A_log`` and ``dt_bias``."""
    t = sum(lengths)
    rows = len(lengths)
    q = l2_normalize(torch.randn(t, hk, dk, generator=g, dtype=dtype)) * dk**-0.5
    k = l2_normalize(torch.randn(t, hk, dk, generator=g, dtype=dtype))
    v = torch.randn(t, hv, dv, generator=g, dtype=dtype)
    a = torch.randn(t, hv, generator=g, dtype=dtype) * 1.5
    b = torch.randn(t, hv, generator=g, dtype=dtype) * 2
    kw = dict(A_log=torch.randn(hv, generator=g, dtype=dtype) * 0.5,
              dt_bias=torch.randn(hv, generator=g, dtype=dtype) * 0.5)
    num_pages = rows + t + 2
    cache = torch.randn(num_pages, hv, dk, dv, generator=g, dtype=dtype)
    perm = torch.randperm(num_pages, generator=g).to(torch.int32)
    in_pages = perm[:rows].clone()
    in_pages[torch.rand(rows, generator=g) < 0.4] = -1  # some rows start from zeros
    out_pages = perm[rows : rows + t].clone()
    out_pages[torch.rand(t, generator=g) < 0.5] = -1  # states at some offsets only
    query_start = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cache[out_pages[out_pages >= 0].long()] = float("nan")  # poison every output page
    return q, k, v, a, b, cache, query_start, in_pages, out_pages, kw


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize(
    "lengths,hk,hv,dk,dv",
    [([1, 5, 0, 9], 2, 4, 8, 8), ([13], 1, 3, 12, 5), ([2, 2, 7], 2, 2, 16, 40)],
)
def test_kernel_matches_twin_race_free(lengths, hk, hv, dk, dv, prefetch):
    g = torch.Generator().manual_seed(_seed())
    q, k, v, a, b, cache, qs, in_pages, out_pages, kw = _inputs(g, lengths, hk, hv, dk, dv)
    want_cache = cache.clone()
    want = gdn_varlen_update_reference(q, k, v, a, b, want_cache, qs, in_pages, out_pages, **kw)
    with racecheck.record_launches() as rec:
        got = gdn_varlen_update(q, k, v, a, b, cache, qs, in_pages, out_pages, **kw,
                                prefetch=prefetch)
    assert len(rec.reports) == 1 and rec.reports[0].clean, str(rec.reports[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, want_cache, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert not cache[out_pages[out_pages >= 0].long()].isnan().any()


def test_prefetch_gives_the_same_bits():
    """Loading each token's operands one token ahead (``KernelPolicy.token_prefetch``)
    moves loads, not arithmetic: outputs and pages equal the plain loop's bit for bit,
    from pages and from dense initial states, with the state rounded to bf16 pages, over
    rows of 0, 1 and many tokens (nothing is read past a row's end)."""
    g = torch.Generator().manual_seed(_seed())
    q, k, v, a, b, cache, qs, in_pages, out_pages, kw = _inputs(g, [4, 0, 1, 11], 2, 4, 8, 16)
    cache = cache.to(torch.bfloat16)
    init = torch.randn(4, 4, 8, 16, generator=g)
    for extra in ((True,), (False, init)):
        runs = []
        for prefetch in (False, True):
            c = cache.clone()
            o = gdn_varlen_update(q, k, v, a, b, c, qs, in_pages, out_pages, *extra, **kw,
                                  prefetch=prefetch)
            runs.append((o, c))
        assert torch.equal(runs[0][0], runs[1][0])
        assert torch.equal(runs[0][1].float().nan_to_num(7.0), runs[1][1].float().nan_to_num(7.0))


def test_kernel_bfloat16_pages_and_program_orders():
    g = torch.Generator().manual_seed(_seed())
    q, k, v, a, b, cache, qs, in_pages, out_pages, kw = _inputs(g, [3, 6, 1], 2, 4, 8, 16)
    cache = cache.to(torch.bfloat16)
    want_cache = cache.clone()
    want = gdn_varlen_update_reference(q, k, v, a, b, want_cache, qs, in_pages, out_pages,
                                       True, **kw)
    results = []
    for order in ("forward", "reversed", "shuffled"):
        c = cache.clone()
        with racecheck.record_launches(record=False, order=order, seed=5):
            o = gdn_varlen_update(q, k, v, a, b, c, qs, in_pages, out_pages, True, **kw)
        results.append((o, c))
    for o, c in results[1:]:
        assert torch.equal(o, results[0][0])
        assert torch.equal(c.float().nan_to_num(0.0), results[0][1].float().nan_to_num(0.0))
    # One bfloat16 rounding of the carried state may flip (2**-8 relative) and carry on.
    torch.testing.assert_close(results[0][0], want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(results[0][1].float(), want_cache.float(), rtol=2e-2, atol=2e-2,
                               equal_nan=True)


@pytest.mark.parametrize("mode", ["twin", "kernel", "chunked"])
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_mixer_packed_rows_path_matches_per_row_path(tmp_path, monkeypatch, arch, mode):
    """A mixed step (a prefill from zeros with inner checkpoints, a prompt tail after a
    stored state, a decode row) through the packed-rows path against the per-row path
    (the chunked twin with its chunk length, 64, longer than every row here: its tails)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from paged_driver import PagedDriver

    from hybridserve.config import KernelPolicy
    from hybridserve.models.loader import load_model, with_kernel_policy
    from hybridserve.testing.tiny_models import make_tiny_checkpoint

    model = load_model(make_tiny_checkpoint(arch, tmp_path, seed=6, layers="MAM"))
    torch.manual_seed(_seed())
    first = [torch.randint(3, 256, (n,)).tolist() for n in (9, 4)]
    second = [torch.randint(3, 256, (n,)).tolist() for n in (6, 1)]
    fresh = torch.randint(3, 256, (19,)).tolist()
    calls = []
    real = gated_deltanet.GatedDeltaNet._packed_rows

    def spy(self, *args):
        calls.append(args[-1])  # the mode
        return real(self, *args)

    monkeypatch.setattr(gated_deltanet.GatedDeltaNet, "_packed_rows", spy)
    results = []
    policy = {"twin": "reference", "kernel": "triton", "chunked": "chunked", None: "off"}
    for path in (mode, None):
        driver = PagedDriver(with_kernel_policy(model, KernelPolicy(gdn_rows=policy[path])))
        driver.step([(0, first[0]), (1, first[1])])
        logits, pages = driver.step([(0, second[0]), (1, second[1]), (2, fresh)],
                                    extra_state_offsets={0: [1, 3], 2: [0, 7, 15]})
        states = {(s, o): [t for layer in driver.caches.conv
                           for t in (driver.conv_state(layer, p), driver.ssm_state(layer, p))]
                  for s, offs in pages.items() for o, p in offs.items()}
        results.append((logits, states))
    # Both steps of both GDN layers took the packed path in the first run, none in the second.
    assert calls == [mode] * 4
    (pl, ps), (rl, rs) = results
    assert (pl - rl).abs().max() / rl.abs().max() < 1e-5
    assert ps.keys() == rs.keys()
    for key in rs:
        for a, b in zip(ps[key], rs[key]):
            assert (a - b).abs().max() < 1e-5, key
