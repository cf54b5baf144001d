"""The batched sampler (hybridserve.runner.sampler.sample_step): exact distributions,
the counter-based RNG, coupled speculative verification, batch invariance through the
engine, and one read-back per step."""

from __future__ import annotations

import random

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.runner import model_runner, sampler
from hybridserve.runner.model_runner import ModelRunner

P_MIN = 1e-4  # false-alarm rate of each goodness-of-fit check


def _p_value(chi2: float, df: int) -> float:
    """P(X > chi2) for X chi-square with ``df`` degrees of freedom."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of ``counts`` to ``probs`` (bins with expected count < 5 pooled).
    Zero-probability bins must be empty."""
    counts, probs = counts.double(), probs.double()
    assert counts[probs == 0].sum() == 0, "a token outside the support was drawn"
    expected = probs * counts.sum()
    small = expected < 5
    c = torch.cat([counts[~small], counts[small].sum()[None]])
    e = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = e > 0
    c, e = c[keep], e[keep]
    assert len(e) >= 3, "too few bins for a meaningful test"
    return _p_value(float(((c - e) ** 2 / e).sum()), len(e) - 1)


def _sample(logits: torch.Tensor, rows: list[sampler.SampleRow]) -> list[int]:
    plan = sampler.plan_draw(rows, logits.shape[-1])
    choices, _ = sampler.read_step(sampler.sample_step(logits, plan, plan.packed).tolist(), plan)
    return choices


def _row(params, seed=0, index=0, prompt=(), output=(), drafts=()) -> sampler.SampleRow:
    return sampler.SampleRow(params, seed, index, list(prompt), list(output), list(drafts))


# --- processing -------------------------------------------------------------------


def test_batched_processing_matches_process_logits():
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    vocab = 60
    rows, logits, want = [], [], []
    for _ in range(80):
        kw = dict(temperature=rng.choice([0.0, 0.3, 1.0, 1.7]))
        if rng.random() < 0.5:
            kw["top_k"] = rng.choice([-1, 0, 1, 5, 30, vocab, vocab + 3])
        if rng.random() < 0.5:
            kw["top_p"] = rng.choice([1e-6, 0.3, 0.8, 1.0])
        if rng.random() < 0.5:
            kw["min_p"] = rng.choice([0.0, 0.05, 0.5])
        if rng.random() < 0.4:
            kw["repetition_penalty"] = rng.choice([0.7, 1.0, 1.3])
        if rng.random() < 0.4:
            kw["presence_penalty"] = rng.choice([-0.5, 0.0, 0.8])
        if rng.random() < 0.4:
            kw["frequency_penalty"] = rng.choice([-0.3, 0.0, 0.6])
        if rng.random() < 0.4:
            # Biases past the vocabulary are ignored; out-of-range values are clamped.
            kw["logit_bias"] = {rng.randrange(vocab + 5): rng.choice([-150.0, -2.5, 0.7, 4.0, 101.0])
                                for _ in range(rng.randint(1, 4))}
        params = SamplingParams(**kw)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        drafts = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
        rows.append(_row(params, rng.randrange(2**62), len(output), prompt, output, drafts))
        for j in range(len(drafts) + 1):
            x = torch.randn(vocab, generator=g) * 3
            logits.append(x)
            want.append(sampler.process_logits(x, params, prompt, output + drafts[:j]))
    logits_t = torch.stack(logits)
    plan = sampler.plan_draw(rows, vocab)
    got = sampler.process_step(logits_t, plan, plan.packed)
    want_t = torch.stack(want)
    assert torch.equal(torch.isinf(got), torch.isinf(want_t))
    finite = torch.isfinite(want_t)
    torch.testing.assert_close(got[finite], want_t[finite], rtol=1e-5, atol=1e-5)


def test_greedy_rows_equal_argmax_ids_bit_for_bit():
    """Greedy rows without penalties choose exactly what the fast path chooses, ties
    included, whatever sampled rows share the step."""
    g = torch.Generator().manual_seed(1)
    # Integer logits: many exact ties.
    logits = torch.randint(-3, 4, (64, 50), generator=g).float()
    rows = []
    for i in range(32):
        rows.append(_row(SamplingParams(temperature=0.0), seed=i, index=i))
        rows.append(_row(SamplingParams(temperature=0.9, top_k=5, top_p=0.8), seed=i, index=i))
    got = torch.tensor(_sample(logits, rows))
    assert torch.equal(got[0::2], sampler.argmax_ids(logits)[0::2])


def test_logprobs_payload_matches_token_logprobs():
    g = torch.Generator().manual_seed(2)
    vocab = 40
    logits = torch.randn(7, vocab, generator=g) * 2
    rows = [
        _row(SamplingParams(temperature=1.0, logprobs=3), seed=5, drafts=[1, 2]),
        _row(SamplingParams(temperature=0.0), seed=6),
        _row(SamplingParams(temperature=0.5, logprobs=0, repetition_penalty=1.5),
             seed=7, prompt=[3, 4], output=[5]),
        _row(SamplingParams(temperature=0.0, logprobs=20), seed=8, drafts=[9]),
    ]
    plan = sampler.plan_draw(rows, vocab)
    choices, lps = sampler.read_step(sampler.sample_step(logits, plan, plan.packed).tolist(), plan)
    assert sorted(lps) == [0, 1, 2, 4, 5, 6]
    for pos, k in zip([0, 1, 2, 4, 5, 6], [3, 3, 3, 0, 20, 20]):
        assert lps[pos] == sampler.token_logprobs(logits[pos], choices[pos], k)


# --- distributions ----------------------------------------------------------------


CASES = {
    "temperature": dict(temperature=0.7),
    "hot": dict(temperature=1.8),
    "top_k": dict(temperature=1.0, top_k=7),
    "top_p": dict(temperature=1.0, top_p=0.6),
    "min_p": dict(temperature=1.0, min_p=0.08),
    "top_k+top_p": dict(temperature=0.8, top_k=12, top_p=0.9),
    "all": dict(temperature=1.3, top_k=20, top_p=0.85, min_p=0.02),
    "penalties": dict(temperature=1.0, top_p=0.95, repetition_penalty=1.4,
                      presence_penalty=0.5, frequency_penalty=0.3),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("vary", ["seed", "index"])
def test_draws_follow_the_processed_distribution(case, vary):
    g = torch.Generator().manual_seed(sorted(CASES).index(case))
    vocab, draws = 40, 12000
    x = torch.randn(vocab, generator=g) * 1.2
    params = SamplingParams(**CASES[case])
    prompt, output = [1, 2, 3, 4], [3, 3, 7]
    target = sampler.process_logits(x, params, prompt, output).exp()
    truncates = params.top_k > 0 or params.top_p < 1 or params.min_p > 0
    assert (target == 0).any() == truncates  # the case exercises what it names
    if vary == "seed":
        rows = [_row(params, seed=s, index=len(output), prompt=prompt, output=output) for s in range(draws)]
    else:
        rows = [_row(params, seed=12345, index=i, prompt=prompt, output=output) for i in range(draws)]
    got = torch.tensor(_sample(x.expand(draws, vocab), rows))
    counts = torch.bincount(got, minlength=vocab)
    assert _chi_square(counts, target) > P_MIN


def test_draws_detect_a_wrong_distribution():
    """The check above can fail: draws at temperature 1 do not fit temperature 0.7."""
    g = torch.Generator().manual_seed(3)
    vocab, draws = 40, 12000
    x = torch.randn(vocab, generator=g) * 2
    rows = [_row(SamplingParams(temperature=1.0), seed=s) for s in range(draws)]
    counts = torch.bincount(torch.tensor(_sample(x.expand(draws, vocab), rows)), minlength=vocab)
    wrong = sampler.process_logits(x, SamplingParams(temperature=0.7), [], []).exp()
    assert _chi_square(counts, wrong) < P_MIN


# --- the counter-based RNG ----------------------------------------------------------


def _u(seeds, indices, vocab):
    words = [sampler.seed_words(s) for s in seeds]
    lo = torch.tensor([w[0] for w in words])
    hi = torch.tensor([w[1] for w in words])
    return sampler.uniforms(lo, hi, torch.tensor(indices, dtype=torch.int64), vocab)


def test_uniforms_are_uniform_and_distinct_per_position():
    u = _u(range(1000), [7] * 1000, 1000)
    assert u.min() > 0 and u.max() < 1
    bins = 100
    counts = torch.bincount((u * bins).long().flatten(), minlength=bins)
    assert _chi_square(counts, torch.full((bins,), 1 / bins)) > P_MIN
    # Each round is a bijection of the token id: no two tokens of a position share u.
    assert all(len(set(row.tolist())) == u.shape[1] for row in u[:20])
    # Every bit of the underlying 31-bit value is fair.
    h = (u * 2**31 - 0.5).round().long().flatten()
    for b in range(31):
        ones = float(((h >> b) & 1).sum())
        assert abs(ones / h.numel() - 0.5) < 5 * 0.5 / h.numel() ** 0.5, b


@pytest.mark.parametrize("neighbour", ["token", "index", "seed", "seed_high_word"])
def test_uniforms_of_neighbouring_counters_are_independent(neighbour):
    n, vocab = 2000, 300
    seeds = [17 * s for s in range(n)]
    idx = [3 * s + 1 for s in range(n)]
    a = _u(seeds, idx, vocab + 1)
    if neighbour == "token":
        a, b = a[:, :-1], a[:, 1:]
    elif neighbour == "index":
        a, b = a[:, :-1], _u(seeds, [i + 1 for i in idx], vocab + 1)[:, :-1]
    elif neighbour == "seed":
        a, b = a[:, :-1], _u([s + 1 for s in seeds], idx, vocab + 1)[:, :-1]
    else:
        a, b = a[:, :-1], _u([s + 2**31 for s in seeds], idx, vocab + 1)[:, :-1]
    a, b = a.flatten(), b.flatten()
    corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    assert abs(corr) < 5 / a.numel() ** 0.5
    # Joint uniformity over an 8 x 8 grid: catches dependence a correlation misses.
    cells = (a * 8).long() * 8 + (b * 8).long()
    counts = torch.bincount(cells, minlength=64)
    assert _chi_square(counts, torch.full((64,), 1 / 64)) > P_MIN


# --- speculative verification -------------------------------------------------------


def test_verification_emits_the_target_distribution_for_random_drafts():
    g = torch.Generator().manual_seed(4)
    rng = random.Random(4)
    vocab, trials = 16, 15000
    logits = torch.randn(2, vocab, generator=g) * 1.5
    params = SamplingParams(temperature=1.0)
    p = sampler.process_logits(logits[0], params, [], []).exp()
    draft_dist = torch.softmax(torch.randn(vocab, generator=g), -1)
    drafts = torch.multinomial(draft_dist, trials, replacement=True, generator=g).tolist()
    rows = [_row(params, seed=rng.randrange(2**62), index=3, drafts=[d]) for d in drafts]
    choices = _sample(logits.repeat(trials, 1), rows)
    first, accepted = [], torch.zeros(vocab)
    offered = torch.zeros(vocab)
    rejected_at = {x: [] for x in range(vocab)}
    for t, d in enumerate(drafts):
        out = sampler.verify_choices(choices[2 * t : 2 * t + 2], [d])
        first.append(out[0])
        offered[d] += 1
        if len(out) == 2:
            assert out[0] == d
            accepted[d] += 1
        else:
            assert out[0] != d
            rejected_at[d].append(out[0])
    assert _chi_square(torch.bincount(torch.tensor(first), minlength=vocab), p) > P_MIN
    # Acceptance rate of draft x is p(x) (binomial, 5 standard deviations).
    for x in range(vocab):
        if offered[x] >= 200:
            rate, px = float(accepted[x] / offered[x]), float(p[x])
            assert abs(rate - px) < 5 * (px * (1 - px) / float(offered[x])) ** 0.5 + 1e-9, x
    # A rejection emits the residual: p with the draft removed and renormalised.
    x = int(torch.argmax(offered))
    residual = p.clone()
    residual[x] = 0
    counts = torch.bincount(torch.tensor(rejected_at[x]), minlength=vocab)
    assert _chi_square(counts, residual / residual.sum()) > P_MIN


def test_verify_drafts_uses_the_same_draw_as_the_batched_sampler():
    """The host reference and the device step sample the same tokens from the same
    distribution: which path processed a row cannot change its tokens."""
    g = torch.Generator().manual_seed(5)
    vocab = 30
    params = SamplingParams(temperature=1.0)
    for seed in range(50):
        logits = torch.randn(3, vocab, generator=g)
        drafts = torch.randint(0, vocab, (2,), generator=g).tolist()
        logps = torch.log_softmax(logits, -1)
        host = sampler.verify_drafts(logps, drafts, params, seed, 9)
        choices = _sample(logits, [_row(params, seed=seed, index=9, drafts=drafts)])
        assert sampler.verify_choices(choices, drafts) == host


# --- through the engine -------------------------------------------------------------


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(3, 50))] for _ in range(count)]


SEEDED = SamplingParams(max_tokens=16, temperature=0.9, top_k=40, top_p=0.9, min_p=0.01,
                        seed=4321, ignore_eos=True)


def test_seeded_request_is_batch_and_layout_invariant(tiny_granite):
    prompt = _prompts(20, 1)[0]
    alone = LLM(tiny_granite, max_num_seqs=1).generate([prompt], SEEDED)[0].outputs[0].token_ids
    others = _prompts(21, 15)
    mixed = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True) if i % 2 else
        SamplingParams(max_tokens=12, temperature=1.1, top_p=0.8, seed=i, ignore_eos=True,
                       repetition_penalty=1.2 if i % 4 == 0 else 1.0)
        for i in range(15)
    ]
    llm = LLM(tiny_granite, max_num_seqs=16)
    outs = llm.generate(others[:8] + [prompt] + others[8:], mixed[:8] + [SEEDED] + mixed[8:])
    assert outs[8].outputs[0].token_ids == alone
    # A small token budget: chunked prefills, rows in other steps and other batches.
    tight = LLM(tiny_granite, max_num_seqs=16, max_num_batched_tokens=7)
    outs = tight.generate(others[:8] + [prompt] + others[8:], mixed[:8] + [SEEDED] + mixed[8:])
    assert outs[8].outputs[0].token_ids == alone
    # Asking for logprobs changes no token.
    with_lp = SamplingParams(**{**_fields(SEEDED), "logprobs": 2})
    got = llm.generate([prompt], with_lp)[0].outputs[0]
    assert got.token_ids == alone and len(got.logprobs) == len(alone)
    # A different seed gives different tokens (the invariance is not a constant stream).
    other = SamplingParams(**{**_fields(SEEDED), "seed": 4322})
    assert llm.generate([prompt], other)[0].outputs[0].token_ids != alone


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in SamplingParams.__slots__}


def test_seeded_tokens_survive_preemption_and_speculation(tiny_granite):
    rng = random.Random(22)
    motif = [rng.randrange(3, 256) for _ in range(5)]
    prompts = [motif * 6 + [rng.randrange(3, 256)] for _ in range(6)]
    params = [SamplingParams(max_tokens=24, temperature=0.3, seed=100 + i, ignore_eos=True,
                             presence_penalty=0.2 if i % 2 else 0.0) for i in range(6)]
    ref = [o.outputs[0].token_ids for o in LLM(tiny_granite, max_num_seqs=8).generate(prompts, params)]
    tight = LLM(tiny_granite, max_num_seqs=8, max_model_len=128, num_kv_blocks=9)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.stats()["preemptions"] > 0
    assert got == ref
    # Drafts are accepted iff they equal the token the target draws, so speculation
    # leaves a seeded request's tokens unchanged.
    spec = LLM(tiny_granite, max_num_seqs=8,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert spec.stats()["spec_accepted_tokens"] > 0
    assert got == ref


def test_one_read_back_per_step(tiny_granite, monkeypatch):
    """After the logits exist, a step reads from the device exactly once, whatever mix
    of greedy, sampled, penalised, logprob and speculative rows it holds."""
    reads: list[str] = []
    state = {"after_logits": False, "per_step": []}

    def counting(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            if state["after_logits"]:
                reads.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    for name in ("tolist", "cpu", "item", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    execute = ModelRunner.execute

    def counted_execute(self, sched, *args):
        compute_logits = self.model.compute_logits

        def spy(hidden):
            out = compute_logits(hidden)
            state["after_logits"] = True
            return out

        self.model.compute_logits = spy
        reads.clear()
        try:
            return execute(self, sched, *args)
        finally:
            self.model.compute_logits = compute_logits
            if state["after_logits"]:
                state["per_step"].append(list(reads))
            state["after_logits"] = False

    monkeypatch.setattr(ModelRunner, "execute", counted_execute)
    # The state postprocess launches inside the step; on the CPU its kernel is the torch
    # twin, host code whose own reads are no device transfers (on CUDA the kernel reads
    # nothing back), so they are not counted.
    twin = model_runner.state_postprocess_reference

    def uncounted_twin(*args, **kwargs):
        saved, state["after_logits"] = state["after_logits"], False
        try:
            return twin(*args, **kwargs)
        finally:
            state["after_logits"] = saved

    monkeypatch.setattr(model_runner, "state_postprocess_reference", uncounted_twin)
    llm = LLM(tiny_granite, max_num_seqs=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    prompts = [p * 3 for p in _prompts(23, 6)]
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, top_p=0.7, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=1.0, frequency_penalty=0.5, top_k=9, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, logprobs=0, ignore_eos=True),
    ]
    llm.generate(prompts, params)
    assert len(state["per_step"]) >= 5
    # One read a step, the postprocess decisions of its verify rows included.
    assert all(r == ["tolist"] for r in state["per_step"]), state["per_step"]
