"""The one-pass draws (:mod:`hybridserve.kernels.sampling`) against their torch twins
:func:`hybridserve.runner.sampler.draw` on fresh random inputs: identical tokens and
bit-identical winning keys (with the kernels' own float64 log) over many seeds and indices, vocabularies that are not a
multiple of the block, one and several splits, greedy and sampled rows mixed, rows with
``-inf`` tokens (top-p / top-k masked, all but one, all), exact ties, NaN; the uniform
table bit-identical to :func:`~hybridserve.runner.sampler.uniforms`; the sampler's
``kernels`` dispatch (``sample_step``, ``draft_draw``, ``speculative_choices``) giving
the twin's tokens; the residual draw of speculative sampling against the twin's
(``p == q`` and NaN fallbacks, truncated supports); the race checker and three program
orders; planted bugs (round keys in the wrong order, the last of tied maxima) that the
comparisons catch; the engine sampling through the kernel.

The CPU tests need the interpreter (``TRITON_INTERPRET=1``, the default here). The GPU
test needs compiled kernels: ``TRITON_INTERPRET=0 pytest -m gpu tests/kernels/test_sampling.py -s``.
"""

import os

# The interpreter must be chosen before the kernels are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hybridserve.config import KernelPolicy  # noqa: E402
from hybridserve.kernels import sampling  # noqa: E402
from hybridserve.runner import sampler  # noqa: E402
from hybridserve.step import SamplingParams  # noqa: E402

INTERPRETED = bool(triton.knobs.runtime.interpret)
if INTERPRETED:
    from hybridserve.testing import racecheck

interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="CPU tensors run the kernels through TRITON_INTERPRET=1"
)

NEG = float("-inf")

# The interpreter's NumPy log of a residual's zeros: -inf, as torch gives, with a warning.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _positions(g, n):
    """Seed words over their whole range (a few at the edges) and indices past 2^31
    (the hash masks them to 31 bits)."""
    lo = torch.randint(0, 2**31, (n,), generator=g)
    hi = torch.randint(0, 2**31, (n,), generator=g)
    index = torch.randint(0, 2**40, (n,), generator=g)
    lo[0], hi[0], index[0] = 0, 0, 0
    if n > 1:
        lo[1], hi[1], index[1] = 2**31 - 1, 2**31 - 1, 2**31 - 1
    return lo, hi, index


def _logp(g, n, vocab):
    """Processed log-probabilities with the rows a step holds: plain, top-p-like
    truncated (a random set of ``-inf``), a few tokens left, all but one ``-inf``,
    all ``-inf``, and exact ties at the maximum."""
    x = torch.randn(n, vocab, generator=g) * (0.5 + 3 * torch.rand(n, 1, generator=g))
    logp = torch.log_softmax(x, dim=-1)
    for i in range(n):
        kind = i % 6
        if kind == 1:  # top-p / top-k: the low tail masked
            cut = torch.quantile(logp[i], float(torch.rand((), generator=g)) * 0.9)
            logp[i] = logp[i].masked_fill(logp[i] < cut, NEG)
        elif kind == 2:  # a few tokens left, scattered
            keep = torch.randperm(vocab, generator=g)[:3]
            row = torch.full((vocab,), NEG)
            row[keep] = logp[i, keep]
            logp[i] = row
        elif kind == 3:  # all but one
            row = torch.full((vocab,), NEG)
            row[int(torch.randint(0, vocab, (), generator=g))] = 0.0
            logp[i] = row
        elif kind == 4 and i % 12 == 4:  # nothing left (the twin gives token 0)
            logp[i] = NEG
        elif kind == 5:  # the maximum tied at three tokens (greedy rows must take the first)
            at = torch.randperm(vocab, generator=g)[:3]
            logp[i, at] = logp[i].max() + 0.25
    return logp


def _twin_keys(logp, greedy, lo, hi, index):
    """The keys the twin's argmax reads (float64 ``[N, vocab]``)."""
    u = sampler.uniforms(lo, hi, index, logp.shape[-1])
    return torch.where(greedy[:, None], logp.double(), logp.double() - _log(-_log(u)))


def _log(t: torch.Tensor) -> torch.Tensor:
    """The float64 log the kernels' ``tl.log`` computes where they run: NumPy's under the
    interpreter (torch's CPU log is up to 5 ulp from it on some hosts, an AMD EPYC one),
    torch's on CUDA (libdevice's ``__nv_log``, which the compiled kernel calls too). The
    twin's keys are taken with it, so the comparison stays bit for bit on every host."""
    if t.is_cuda:
        return torch.log(t)
    return torch.from_numpy(np.log(t.numpy()))


def _assert_matches_twin(logp, greedy, lo, hi, index, **launch):
    want = sampler.draw(logp, greedy, lo, hi, index, kernels="reference")
    got, keys = sampling.draw(logp, greedy, lo, hi, index, return_keys=True, **launch)
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got, want), (got, want)
    # The winning key itself, bit for bit (the twin's keys with the kernel's log: _log).
    twin = _twin_keys(logp, greedy, lo, hi, index)
    torch.testing.assert_close(keys, twin.gather(1, want[:, None])[:, 0], rtol=0, atol=0,
                               equal_nan=True)


# --------------------------------------------------------------------------------------
# The kernel against the twin
# --------------------------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("n,vocab,block,splits", [
    (12, 200, 64, 1),     # one program per row, a ragged last block
    (12, 200, 32, 3),     # several splits per row, ragged last split
    (6, 517, 128, None),  # the heuristic's split count
])
def test_draw_matches_twin(n, vocab, block, splits):
    g = torch.Generator().manual_seed(_seed())
    logp = _logp(g, n, vocab)
    greedy = torch.rand(n, generator=g) < 0.35
    greedy[5] = True  # a tied row drawn greedily: the first of the tied tokens
    _assert_matches_twin(logp, greedy, *_positions(g, n), block=block, splits=splits)


@interpreted
def test_many_seeds_and_indices_one_distribution():
    """One small distribution, many positions: every position's draw is the twin's (a
    wrong key, round or uniform shows as a different token at some position)."""
    g = torch.Generator().manual_seed(_seed())
    n, vocab = 48, 40
    logp = torch.log_softmax(torch.randn(1, vocab, generator=g), -1).expand(n, vocab).contiguous()
    greedy = torch.zeros(n, dtype=torch.bool)
    lo, hi, index = _positions(g, n)
    index[n // 2:] = index[0] + torch.arange(n - n // 2)  # consecutive tokens of one request
    _assert_matches_twin(logp, greedy, lo, hi, index, block=64)


@interpreted
def test_ties_nan_and_inf_follow_torch_argmax():
    """Exact ties of sampled keys (``+inf`` tokens), NaN (the first NaN wins, over
    ``+inf`` too), ``-inf`` rows, and greedy ties: torch.argmax's rule, across splits."""
    g = torch.Generator().manual_seed(_seed())
    vocab = 96
    logp = _logp(g, 8, vocab)
    logp[0, [70, 20, 50]] = float("inf")           # sampled: keys +inf, tie -> 20
    logp[1, [80, 33]] = float("nan")               # first NaN: 33
    logp[2, [10, 90]] = torch.tensor([float("inf"), float("nan")])  # NaN beats +inf
    logp[3] = NEG                                  # all -inf: 0
    logp[4] = torch.log_softmax(torch.randn(vocab, generator=g), -1)
    logp[4, [65, 40]] = logp[4].max() + 1          # greedy tie across splits: 40
    logp[5] = 0.0                                  # greedy: a row of equal values: 0
    logp[6, [95, 64]] = float("nan")               # NaN in the last split only: 64
    greedy = torch.tensor([False, False, True, False, True, True, False, False])
    lo, hi, index = _positions(g, 8)
    for splits in (1, 3):
        _assert_matches_twin(logp, greedy, lo, hi, index, block=32, splits=splits)
    got = sampling.draw(logp, greedy, lo, hi, index, block=32, splits=3)
    assert got[:7].tolist() == [20, 33, 90, 0, 40, 0, 64]


@interpreted
def test_all_rows_sampled_and_dtypes():
    """``greedy=None`` (the drafter's draw) and logp in float64 / bfloat16 / strided rows."""
    g = torch.Generator().manual_seed(_seed())
    n, vocab = 5, 150
    lo, hi, index = _positions(g, n)
    wide = _logp(g, n, vocab + 7).double()
    for logp in (wide[:, :vocab], wide[:, :vocab].to(torch.bfloat16)):
        want = sampler.draw(logp, torch.zeros(n, dtype=torch.bool), lo, hi, index)
        assert torch.equal(sampling.draw(logp, None, lo, hi, index, block=64), want)


@interpreted
def test_uniforms_bit_identical():
    g = torch.Generator().manual_seed(_seed())
    n, vocab = 9, 300
    lo, hi, index = _positions(g, n)
    want = sampler.uniforms(lo, hi, index, vocab)
    got = sampling.uniforms(lo, hi, index, vocab, block=128)
    assert got.dtype == torch.float64 and torch.equal(got, want)
    assert ((got > 0) & (got < 1)).all()
    gumbel = sampling.uniforms(lo, hi, index, vocab, gumbel=True, block=128)
    assert torch.equal(gumbel, _log(-_log(want)))


def test_bad_input_names_the_field():
    logp = torch.zeros(3, 10)
    z = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="seed_hi"):
        sampling.draw(logp, None, z, z[:2], z)
    with pytest.raises(ValueError, match="greedy must be a bool"):
        sampling.draw(logp, z, z, z, z)
    with pytest.raises(ValueError, match="logq must have"):
        sampling.residual_draw(logp, logp[:, :5], z, z, z)
    with pytest.raises(ValueError, match="unit stride"):
        sampling.draw(logp.t(), None, z, z, z)
    with pytest.raises(ValueError, match="splits"):
        sampling.draw(logp, None, z, z, z, block=8, splits=3)
    with pytest.raises(ValueError, match="kernel_policy.sampler"):
        sampler.draw(logp, z.bool(), z, z, z, kernels="fast")
    with pytest.raises(ValueError, match="kernel_policy.sampler"):
        KernelPolicy(sampler="fast")


def test_num_splits_fills_the_launch():
    assert sampling.num_splits(1, 131072) == 128
    assert sampling.num_splits(64, 131072) == 8
    assert sampling.num_splits(256, 131072) == 2
    assert sampling.num_splits(1024, 131072) == 1
    assert sampling.num_splits(1, 100) == 1


# --------------------------------------------------------------------------------------
# The sampler's dispatch
# --------------------------------------------------------------------------------------


def _row(params, seed, index, drafts=()):
    return sampler.SampleRow(params, seed, index, [1, 2], [3], list(drafts))


@interpreted
def test_sample_step_with_the_kernel_gives_the_twins_tokens():
    """A step of top-p 0.95 / temperature 0.8 rows, top-k and greedy rows, with drafts:
    the whole output (choices) through ``kernels="triton"`` equals ``"reference"``."""
    g = torch.Generator().manual_seed(_seed())
    vocab = 130
    rows = [
        _row(SamplingParams(temperature=0.8, top_p=0.95), _seed(), 4, drafts=[5, 9]),
        _row(SamplingParams(temperature=0.0), _seed(), 0),
        _row(SamplingParams(temperature=1.3, top_k=7), _seed(), 11),
        _row(SamplingParams(temperature=0.8, top_p=0.95, min_p=0.05), _seed(), 2**33),
    ]
    plan = sampler.plan_draw(rows, vocab)
    logits = torch.randn(plan.num_positions, vocab, generator=g) * 2
    want = sampler.sample_step(logits, plan, plan.packed, kernels="reference")
    got = sampler.sample_step(logits, plan, plan.packed, kernels="triton")
    assert torch.equal(got, want)


@interpreted
def test_draft_draw_and_speculative_choices_with_the_kernel():
    """The drafter's draw and the whole speculative choice (acceptance, residual) through
    the kernels give the twin's tokens, accepted and rejected drafts alike."""
    g = torch.Generator().manual_seed(_seed())
    n, vocab = 12, 90
    lo, hi, index = _positions(g, n)
    logp, logq = _residual_rows(g, n, vocab)
    logq = logq.nan_to_num(nan=-3.0)  # the drafter's own draw needs no NaN
    drafts = sampler.draft_draw(logq, lo, hi, index, kernels="reference")
    assert torch.equal(sampler.draft_draw(logq, lo, hi, index, kernels="triton"), drafts)
    want = sampler.speculative_choices(logp, logq, drafts, lo, hi, index, kernels="reference")
    got = sampler.speculative_choices(logp, logq, drafts, lo, hi, index, kernels="triton")
    assert torch.equal(got, want)


def _residual_rows(g, n, vocab):
    """Target / drafter log-probabilities with the residual's cases: plain rows, the
    target truncated (top-p), the drafter's support smaller than the target's, ``p ==
    q`` (nothing positive: the twin falls back to ``p``), a NaN in ``q`` (a NaN residual:
    the fallback too), ``q`` above ``p`` everywhere but one token."""
    logp = torch.log_softmax(torch.randn(n, vocab, generator=g) * 2, -1)
    logq = torch.log_softmax(torch.randn(n, vocab, generator=g) * 2, -1)
    for i in range(n):
        kind = i % 6
        if kind == 1:
            logp[i] = torch.log_softmax(logp[i].masked_fill(logp[i] < logp[i].median(), NEG), -1)
        elif kind == 2:
            logq[i] = torch.log_softmax(logq[i].masked_fill(logq[i] < logq[i].median(), NEG), -1)
        elif kind == 3:
            logq[i] = logp[i]
        elif kind == 4:
            logq[i, int(torch.randint(0, vocab, (), generator=g))] = float("nan")
        elif kind == 5:
            one = int(torch.randint(0, vocab, (), generator=g))
            logp[i] = NEG
            logp[i, one] = 0.0
    return logp, logq


@interpreted
@pytest.mark.parametrize("splits", [1, 3])
def test_residual_draw_matches_twin(splits):
    """Drafts the target gives no mass (always rejected): the twin's choice is its
    residual draw, which the kernel must give token for token."""
    g = torch.Generator().manual_seed(_seed())
    n, vocab = 12, 150
    lo, hi, index = _positions(g, n)
    logp, logq = _residual_rows(g, n, vocab)
    drafts = torch.randint(0, vocab, (n,), generator=g)
    drafts[5] = (int(logp[5].argmax()) + 1) % vocab  # not the row's only token
    logp[torch.arange(n), drafts] = NEG  # p(x) = 0: rejected
    want = sampler.speculative_choices(logp, logq, drafts, lo, hi, index, kernels="reference")
    got = sampling.residual_draw(logp, logq, lo, hi, index, block=32, splits=splits)
    assert torch.equal(got, want)


def test_auto_keeps_the_torch_path_on_the_cpu(monkeypatch):
    """Under ``"auto"`` CPU tensors never reach the kernel module's launchers."""
    def boom(*a, **k):
        raise AssertionError("the kernel ran for CPU tensors under 'auto'")

    monkeypatch.setattr(sampling, "draw", boom)
    monkeypatch.setattr(sampling, "uniforms", boom)
    monkeypatch.setattr(sampling, "residual_draw", boom)
    logp = torch.log_softmax(torch.randn(3, 20), -1)
    z = torch.arange(3)
    sampler.draw(logp, z == 0, z, z, z)
    sampler.draft_draw(logp, z, z, z)
    sampler.speculative_choices(logp, logp, z, z, z, z)


@interpreted
def test_engine_with_the_kernel_samples_the_twins_tokens(tiny_granite):
    """Seeded sampled requests (top-p 0.95 / temperature 0.8, top-k) through the engine
    with ``KernelPolicy(sampler="triton")``, eager steps and the decode graphs' static
    steps: the kernel runs and every token is the one the torch draw gives."""
    from hybridserve import LLM

    prompts = [[3, 14, 15, 92, 65], [2, 71, 82]]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.1, top_k=20, seed=12, max_tokens=6, ignore_eos=True)]

    calls = []
    kernel_draw = sampling.draw

    def counted(*a, **k):
        calls.append(1)
        return kernel_draw(*a, **k)

    def run(mode, graphs=False):
        llm = LLM(tiny_granite, kernel_policy=KernelPolicy(sampler=mode))
        if graphs:  # the decode-graph path's static steps (no capture on the CPU)
            from hybridserve.engine.engine_core import EngineCore

            eng, llm.engine = llm.engine, None
            llm.engine = EngineCore(llm.config, llm.model, llm.tokenizer, eng.vocab_size,
                                    eng.eos_token_ids, enforce_eager=False)
        calls.clear()
        with racecheck.record_launches(record=False) as rec, pytest.MonkeyPatch.context() as m:
            m.setattr(sampling, "draw", counted)
            outs = llm.generate(prompts, params, use_tqdm=False)
        if graphs:
            # Every step drew through the kernel, the graph path's static steps too.
            counters = llm.engine.runner.graphs.counters
            assert counters["graph_steps"] > 0
            assert len(calls) == counters["graph_steps"] + counters["eager_steps"], counters
        return [o.outputs[0].token_ids for o in outs], rec.launches

    want, twin_launches = run("reference")
    got, kernel_launches = run("triton")
    assert twin_launches == 0 and kernel_launches > 0
    assert got == want and all(len(t) == 6 for t in got)
    got, kernel_launches = run("triton", graphs=True)
    assert kernel_launches > 0 and got == want


# --------------------------------------------------------------------------------------
# The race checker and planted bugs
# --------------------------------------------------------------------------------------


def _race_cases(g):
    n, vocab = 4, 100
    lo, hi, index = _positions(g, n)
    logp = _logp(g, n, vocab)
    greedy = torch.tensor([False, True, False, False])
    logq = torch.log_softmax(torch.randn(n, vocab, generator=g), -1)
    return [
        (lambda **kw: sampling.draw(**kw, block=16, splits=3),
         lambda: dict(logp=logp.clone(), greedy=greedy.clone(), seed_lo=lo.clone(),
                      seed_hi=hi.clone(), index=index.clone())),
        (lambda **kw: sampling.uniforms(**kw, vocab=vocab, gumbel=True, block=32),
         lambda: dict(seed_lo=lo.clone(), seed_hi=hi.clone(), index=index.clone())),
        (lambda **kw: sampling.residual_draw(**kw, block=16, splits=3),
         lambda: dict(logp=logp.clone(), logq=logq.clone(),
                      seed_lo=lo.clone(), seed_hi=hi.clone(), index=index.clone())),
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


_kernel_round_keys = sampling._round_keys


@triton.jit
def _round_keys_wrong_order(seed_lo, seed_hi, index, row):
    k1, k2, k3 = _kernel_round_keys(seed_lo, seed_hi, index, row)
    return k1, k3, k2


@triton.jit
def _fold_last_tie(key, offs, valid, best_key, best_idx, first_nan):
    # sampling._fold with the last of equal maxima winning, in a block and across blocks.
    is_nan = key != key
    first_nan = tl.minimum(first_nan, tl.min(tl.where(is_nan & valid, offs, 2147483647), axis=0))
    key = tl.where(is_nan | ~valid, float("-inf"), key)
    m = tl.max(key, axis=0)
    at = tl.max(tl.where((key == m) & valid, offs, -1), axis=0)
    take = m >= best_key
    return tl.where(take, m, best_key), tl.where(take, at, best_idx), first_nan


@interpreted
def test_planted_bug_round_keys_in_the_wrong_order(monkeypatch):
    """The kernel with its second and third round keys swapped: the comparison with the
    twin fails (draws and the uniform table)."""
    g = torch.Generator().manual_seed(_seed())
    n, vocab = 8, 64
    lo, hi, index = _positions(g, n)
    logp = torch.log_softmax(torch.randn(n, vocab, generator=g), -1)
    greedy = torch.zeros(n, dtype=torch.bool)
    _assert_matches_twin(logp, greedy, lo, hi, index, block=64)
    monkeypatch.setattr(sampling, "_round_keys", _round_keys_wrong_order)
    with pytest.raises(AssertionError):
        _assert_matches_twin(logp, greedy, lo, hi, index, block=64)
    assert not torch.equal(sampling.uniforms(lo, hi, index, vocab, block=64),
                           sampler.uniforms(lo, hi, index, vocab))


@interpreted
def test_planted_bug_last_of_tied_maxima(monkeypatch):
    """The kernel taking the last of equal maxima: the tie rows of
    :func:`test_ties_nan_and_inf_follow_torch_argmax` tell it from the twin, in one
    split and in several."""
    vocab = 96
    logp = torch.log_softmax(torch.randn(3, vocab), -1)
    logp[0, [70, 20, 50]] = float("inf")  # sampled, +inf keys in three blocks
    logp[1, [65, 40]] = logp[1].max() + 1  # greedy, two blocks
    logp[2] = 0.0                          # greedy, every token tied
    greedy = torch.tensor([False, True, True])
    z = torch.arange(3)
    monkeypatch.setattr(sampling, "_fold", _fold_last_tie)
    for splits in (1, 3):
        got = sampling.draw(logp, greedy, z, z, z, block=32, splits=splits)
        assert got.tolist() != [20, 40, 0]
        with pytest.raises(AssertionError):
            _assert_matches_twin(logp, greedy, z, z, z, block=32, splits=splits)
    monkeypatch.undo()
    _assert_matches_twin(logp, greedy, z, z, z, block=32, splits=1)


def test_hash_constants_are_the_twins():
    assert sampling.HASH_CONSTANTS == (sampler._MASK31, sampler._MUL_A, sampler._MUL_B,
                                       sampler._KEY_SALTS)


# --------------------------------------------------------------------------------------
# On the GPU
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED,
                    reason="needs CUDA and compiled kernels (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("n", [1, 64, 256])
def test_draw_matches_twin_on_cuda(n):
    """At the 8B shape's vocabulary: the same tokens, and the same winning keys bit for
    bit (libdevice's float64 log against torch's CUDA log)."""
    g = torch.Generator().manual_seed(_seed())
    vocab = 131072
    logp = _logp(g, n, vocab).cuda()
    greedy = (torch.rand(n, generator=g) < 0.25).cuda()
    lo, hi, index = (t.cuda() for t in _positions(g, n))
    _assert_matches_twin(logp, greedy, lo, hi, index)
    assert torch.equal(sampling.uniforms(lo, hi, index, vocab),
                       sampler.uniforms(lo, hi, index, vocab))
    assert torch.equal(sampling.uniforms(lo, hi, index, vocab, gumbel=True),
                       torch.log(-torch.log(sampler.uniforms(lo, hi, index, vocab))))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED,
                    reason="needs CUDA and compiled kernels (TRITON_INTERPRET=0)")
def test_residual_draw_matches_twin_on_cuda():
    g = torch.Generator().manual_seed(_seed())
    n, vocab = 48, 131072
    lo, hi, index = (t.cuda() for t in _positions(g, n))
    logp, logq = (t.cuda() for t in _residual_rows(g, n, vocab))
    drafts = torch.randint(0, vocab, (n,), generator=g).cuda()
    want = sampler.speculative_choices(logp, logq, drafts, lo, hi, index, kernels="reference")
    assert torch.equal(sampler.speculative_choices(logp, logq, drafts, lo, hi, index), want)
    logp[torch.arange(n), drafts] = NEG  # every draft rejected: the residual draws alone
    want = sampler.speculative_choices(logp, logq, drafts, lo, hi, index, kernels="reference")
    assert torch.equal(sampling.residual_draw(logp, logq, lo, hi, index), want)
