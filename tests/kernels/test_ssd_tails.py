"""The tail-state kernel against its torch twin and a token-by-token float64 recurrence,
under the race checker, in every program order (Triton's CPU interpreter)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from hybridserve.kernels.ssd import ssd_recurrent_reference
from hybridserve.kernels.ssd_tails import ssd_tail_states, ssd_tail_states_reference

if os.environ["TRITON_INTERPRET"] != "1":
    # Every test here runs kernels through the race checker, which needs the CPU
    # interpreter: a GPU run (TRITON_INTERPRET=0) skips the module.
    pytest.skip("needs TRITON_INTERPRET=1 (the race checker)", allow_module_level=True)

from hybridserve.testing import racecheck  # noqa: E402

INTERPRETED = os.environ["TRITON_INTERPRET"] == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs Triton's CPU interpreter")


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _inputs(g, lengths, heads=4, head_dim=6, groups=2, d_state=5, dtype=torch.float32):
    """Packed inputs of ``sum(lengths) + 3`` tokens, tails over shuffled distinct tokens;
    ``x`` and ``B`` strided as the mixer's split of its projection leaves them."""
    t = sum(lengths) + 3
    xbc = torch.randn(t, heads * head_dim + groups * d_state + 7, generator=g, dtype=dtype)
    x = xbc[:, : heads * head_dim].view(t, heads, head_dim)
    B = xbc[:, heads * head_dim : heads * head_dim + groups * d_state].view(t, groups, d_state)
    dt = torch.rand(t, heads, generator=g, dtype=dtype) * 0.5 + 0.05
    A = -(torch.rand(heads, generator=g, dtype=dtype) * 2 + 0.2)
    start = torch.randn(len(lengths), heads, head_dim, d_state, generator=g, dtype=dtype)
    width = max(lengths, default=0)
    perm = torch.randperm(t, generator=g)
    tokens = torch.zeros(len(lengths), max(width, 1), dtype=torch.int64)
    used = 0
    for i, n in enumerate(lengths):
        tokens[i, :n] = perm[used : used + n]
        used += n
    return x, dt, A, B, start, tokens, torch.tensor(lengths, dtype=torch.int64)


def _recurrence(x, dt, A, B, start, tokens, lengths):
    out = []
    for i, n in enumerate(lengths.tolist()):
        if n == 0:
            out.append(start[i].double())
            continue
        tok = tokens[i, :n]
        C = torch.zeros_like(B[tok])  # outputs unused
        _, states = ssd_recurrent_reference(
            x[tok].double(), dt[tok].double(), A.double(), B[tok].double(), C.double(),
            None, start[i].double(),
        )
        out.append(states[-1])
    return torch.stack(out)


@pytest.mark.parametrize("lengths", [[3, 1, 63, 7], [1], [20, 0, 5]])
def test_twin_matches_the_recurrence_float64(lengths):
    g = torch.Generator().manual_seed(_seed())
    args = _inputs(g, lengths, dtype=torch.float64)
    got = ssd_tail_states_reference(*args)
    torch.testing.assert_close(got, _recurrence(*args), rtol=1e-10, atol=1e-10)


@interpreted
@pytest.mark.parametrize("lengths,block_p", [([3, 1, 63, 7], 4), ([20, 0, 5], 8), ([9], 2)])
def test_kernel_matches_twin_race_free(lengths, block_p):
    g = torch.Generator().manual_seed(_seed())
    args = _inputs(g, lengths)
    x, dt, A, B, start, tokens, lens = args
    before = start.clone()
    want = ssd_tail_states_reference(*args)
    with racecheck.record_launches() as rec:
        got = ssd_tail_states(*args, block_p=block_p)
    assert len(rec.reports) == 1 and rec.reports[0].clean, str(rec.reports[0])
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got.double(), _recurrence(*args), rtol=2e-5, atol=2e-5)
    assert torch.equal(start, before)


@interpreted
def test_kernel_independent_of_program_order():
    g = torch.Generator().manual_seed(_seed())
    args = _inputs(g, [5, 2, 11])

    def launch(x, dt, A, B, start, tokens, lengths):
        return ssd_tail_states(x, dt, A, B, start, tokens, lengths, block_p=2)

    names = ("x", "dt", "A", "B", "start", "tokens", "lengths")
    report = racecheck.run_launcher_in_orders(launch, lambda: dict(zip(names, args)))
    assert report.consistent, str(report)


def test_kernel_rejects_bad_layouts():
    g = torch.Generator().manual_seed(_seed())
    x, dt, A, B, start, tokens, lengths = _inputs(g, [2, 3])
    with pytest.raises(ValueError, match="start must be"):
        ssd_tail_states(x, dt, A, B, start[:1], tokens, lengths)
    with pytest.raises(ValueError, match="contiguous along"):
        ssd_tail_states(x.transpose(1, 2).contiguous().transpose(1, 2), dt, A, B, start,
                        tokens, lengths)
