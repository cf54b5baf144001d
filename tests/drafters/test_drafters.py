"""Every drafter (n-gram, MTP head, draft model) composed with prefix caching, batching,
preemption and aborts: greedy output is the target's own, whatever is proposed."""

from __future__ import annotations

import random

import pytest
import torch
from spec_helpers import (
    assert_mtp_drafts_match_dense,
    assert_page_exact,
    motif_workload,
    output_tokens,
    rand_tokens,
    run_aborting_duplicates,
    step_waves,
)

from hybridserve import LLM, SamplingParams
from hybridserve.cache.block_pool import block_hashes
from hybridserve.config import SpecConfig
from hybridserve.drafters.base import DraftRequest
from hybridserve.models.batch import ForwardBatch
from hybridserve.testing.tiny_models import make_tiny_checkpoint
from hybridserve.testing.tiny_mtp import add_mtp_head, dense_hidden, dense_mtp_drafts

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen_mtp(tmp_path_factory):
    """A Qwen3.5 (GDN) target with a random MTP head."""
    return add_mtp_head(make_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("q35mtp"), seed=4))


@pytest.fixture(scope="module")
def qwen_draft(tmp_path_factory):
    """A smaller Qwen3.5 draft model (GDN then attention) with the target's vocabulary."""
    return make_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("q35draft"), seed=9, layers="MA")


@pytest.fixture(scope="module")
def granite_draft(tmp_path_factory):
    return make_tiny_checkpoint("granitemoehybrid", tmp_path_factory.mktemp("grdraft"), seed=7, layers="MA")


def _spec(method: str, d: int, draft=None) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": d}
    if method == "mtp":
        return {"method": "mtp", "num_speculative_tokens": d}
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": d}


# ---- configuration ------------------------------------------------------------------


def test_spec_config_errors_name_the_field():
    with pytest.raises(ValueError, match="method='eagle'.*ngram"):
        SpecConfig.from_dict({"method": "eagle"})
    with pytest.raises(ValueError, match="speculative_config.model is required"):
        SpecConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="only used with method='draft_model'"):
        SpecConfig.from_dict({"method": "ngram", "model": "x"})
    with pytest.raises(ValueError, match="unsupported keys"):
        SpecConfig.from_dict({"method": "mtp", "draft_tensor_parallel_size": 1})
    cfg = SpecConfig.from_dict({"method": "draft_model", "model": "/m", "num_speculative_tokens": 5})
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", "/m", 5)


def test_drafter_errors(tiny_granite, tiny_qwen3_5, tmp_path):
    with pytest.raises(ValueError, match="Qwen3_5ForCausalLM.*GraniteMoeHybridForCausalLM has none"):
        LLM(tiny_granite, speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match="declares no MTP layers"):
        LLM(tiny_qwen3_5, speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        LLM(tiny_granite, speculative_config={"method": "draft_model", "model": str(tmp_path)})
    other = make_tiny_checkpoint("granitemoehybrid", tmp_path / "v", vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size=300, the target 256"):
        LLM(tiny_granite, speculative_config={"method": "draft_model", "model": str(other)})


# ---- greedy output is the target's ----------------------------------------------------


@pytest.fixture(scope="module")
def references(qwen_mtp, tiny_granite):
    out = {}
    for name, path in (("qwen3_5", qwen_mtp), ("granite", tiny_granite)):
        llm = LLM(path, enable_prefix_caching=False)
        out[name] = {s: output_tokens(llm.generate(motif_workload(s), GREEDY)) for s in (0, 1)}
    return out


CASES = [("qwen3_5", m) for m in ("ngram", "mtp", "draft_model")] + [
    ("granite", m) for m in ("ngram", "draft_model")
]


@pytest.mark.parametrize("d", [1, 3, 5])
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("arch,method", CASES)
def test_greedy_identical_with_every_drafter(
    arch, method, caching, d, references, qwen_mtp, tiny_granite, qwen_draft, granite_draft
):
    target = qwen_mtp if arch == "qwen3_5" else tiny_granite
    draft = qwen_draft if arch == "qwen3_5" else granite_draft
    llm = LLM(target, enable_prefix_caching=caching, state_interval=16,
              speculative_config=_spec(method, d, draft))
    llm.engine.check_integrity_every_step = True
    # Workload 0, then 1 (new prompts, some sharing prefixes), then 0 again: prefix hits
    # (when caching) and speculation together.
    for seed in (0, 1, 0):
        assert output_tokens(llm.generate(motif_workload(seed), GREEDY)) == references[arch][seed]
    stats = llm.stats()
    assert stats["spec_draft_tokens"] > 0
    if caching:
        assert stats["prefix_hit_tokens"] > 0


@pytest.mark.parametrize("arch", ["qwen3_5", "granite"])
def test_draft_model_equal_to_target_accepts_every_draft(arch, qwen_mtp, tiny_granite, references):
    """The drafter's caches hold the target's own computation, so every draft is what the
    target picks: all accepted (every crossing of the checkpoint grid runs), still exact."""
    target = qwen_mtp if arch == "qwen3_5" else tiny_granite
    for d in (1, 3, 5):
        llm = LLM(target, state_interval=16,
                  speculative_config=_spec("draft_model", d, target))
        llm.engine.check_integrity_every_step = True
        assert output_tokens(llm.generate(motif_workload(d % 2), GREEDY)) == references[arch][d % 2]
        s = llm.stats()
        assert s["spec_draft_tokens"] > 0
        assert s["spec_accepted_tokens"] == s["spec_draft_tokens"]
        assert s["spec_mean_accepted_length"] > 1 + d - 1


def test_draft_model_states_are_exact_by_page(qwen_mtp):
    """After every step, each request's committed drafter page holds the draft model's
    exact recurrent state of the prefix the drafter has consumed (selected by page id,
    never copied), every checkpoint of the drafter's own prefix cache the exact state of
    its prefix, and every page reference is accounted for."""
    llm = LLM(qwen_mtp, state_interval=16, speculative_config=_spec("draft_model", 3, qwen_mtp))
    engine = llm.engine
    drafter = engine.drafter
    checked = 0
    seen: dict[str, list[int]] = {}
    # Twice the same prompts (the second wave after the first): the drafter's prefix
    # cache starts the second wave from checkpoints the first wrote.
    for seen in step_waves(engine, motif_workload(2), GREEDY):
        for key, seq in drafter._seqs.items():
            if seq.computed:
                assert_page_exact(drafter, seq.page, seen[key][: seq.computed])
                checked += 1
    assert checked > 10
    assert drafter.counters["prefix_hit_tokens"] >= 32
    assert not drafter._seqs
    drafter.states.check_integrity([])  # only checkpoints hold pages now
    by_key = {}
    for toks in seen.values():
        for i, h in enumerate(block_hashes(toks, 16)):
            by_key.setdefault(h, toks[: (i + 1) * 16])
    assert drafter.states.checkpoints
    for key, ckpt in drafter.states.checkpoints.items():
        assert len(by_key[key]) == ckpt.length
        assert_page_exact(drafter, ckpt.page, by_key[key])


def test_second_turns_hit_checkpoints_written_while_speculating(qwen_mtp, qwen_draft):
    rng = random.Random(5)
    first = [rand_tokens(rng, 20), rand_tokens(rng, 37)]
    plain = LLM(qwen_mtp, enable_prefix_caching=False)
    for method in ("mtp", "draft_model"):
        llm = LLM(qwen_mtp, state_interval=16, speculative_config=_spec(method, 3, qwen_draft))
        llm.engine.check_integrity_every_step = True
        outs = output_tokens(llm.generate(first, GREEDY))
        assert outs == output_tokens(plain.generate(first, GREEDY))
        second = [p + o + rand_tokens(rng, 5) for p, o in zip(first, outs)]
        hits_before = llm.stats()["prefix_hit_tokens"]
        assert output_tokens(llm.generate(second, GREEDY)) == output_tokens(plain.generate(second, GREEDY))
        assert llm.stats()["prefix_hit_tokens"] - hits_before >= 32
        if method == "draft_model":
            # The draft model's own prefix cache hit too.
            assert llm.engine.drafter.counters["prefix_hit_tokens"] >= 32


def test_hit_lengths_equal_with_and_without_speculation(qwen_mtp, qwen_draft):
    """The same multi-turn trace, request by request: every request's cached-token count
    is the same whichever drafter runs (speculation leaves the target's checkpoints)."""
    rng = random.Random(6)
    base = [rand_tokens(rng, 18), rand_tokens(rng, 25)]

    def trace(spec):
        llm = LLM(qwen_mtp, state_interval=16, speculative_config=spec)
        hits, convo = [], list(base)
        for _ in range(3):
            outs = llm.generate(convo, GREEDY)
            hits.append([o.num_cached_tokens for o in outs])
            convo = [c + o.outputs[0].token_ids + [7, 8, 9] for c, o in zip(convo, outs)]
        checkpoints = sorted(
            (c.length, key) for key, c in llm.engine.scheduler.states.checkpoints.items()
        )
        return hits, checkpoints

    expected = trace(None)
    assert sum(map(sum, expected[0])) > 0 and len(expected[1]) > 4
    specs = [_spec(m, 3, qwen_draft) for m in ("ngram", "mtp", "draft_model")]
    # The target as its own drafter: every draft accepted, grid points crossed mid-row.
    specs.append(_spec("draft_model", 3, qwen_mtp))
    for spec in specs:
        # The same hits and the same checkpoints (grid, junction, prompt end, finished).
        assert trace(spec) == expected, spec


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_preemption_and_aborts_mid_speculation(method, qwen_mtp, qwen_draft):
    rng = random.Random(7)
    prompts = [rand_tokens(rng, 10 + 3 * i) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = output_tokens(LLM(qwen_mtp, enable_prefix_caching=False, max_model_len=64).generate(prompts, params))
    # Few KV blocks: requests are preempted while speculating and recomputed.
    llm = LLM(qwen_mtp, state_interval=16, num_kv_blocks=12, max_model_len=64,
              speculative_config=_spec(method, 3, qwen_draft))
    llm.engine.check_integrity_every_step = True
    engine = llm.engine
    # The two duplicates are aborted mid-speculation.
    done = run_aborting_duplicates(engine, prompts, params)
    assert [done[f"r{i}"] for i in range(6)] == ref
    stats = engine.stats()
    assert stats["spec_draft_tokens"] > 0
    assert stats["preemptions"] > 0
    # Everything the drafter held is back.
    drafter = engine.drafter
    drafter.check_integrity()
    assert not drafter._seqs
    assert drafter.blocks.num_free == drafter.blocks.num_blocks


def test_draft_model_pool_pressure_evicts_the_least_recent(qwen_mtp, qwen_draft):
    """A drafter whose pages run short drops the least recently drafted request's caches
    (outside the current batch); that request catches up from token 0 when it drafts
    again, and proposes exactly what an unpressured drafter proposes."""
    def drafter(max_num_seqs):
        llm = LLM(qwen_mtp, max_num_seqs=max_num_seqs,
                  speculative_config=_spec("draft_model", 3, qwen_draft))
        return llm.engine.drafter

    tight, roomy = drafter(1), drafter(8)
    assert tight.num_state_pages == 9
    rng = random.Random(8)
    seqs = {key: rand_tokens(rng, 9 + i) for i, key in enumerate("abcd")}
    order = list("abcdabcda")
    for key in order:
        req = [DraftRequest(key, seqs[key], 3)]
        got, want = tight.propose_batch(req), roomy.propose_batch(req)
        assert got == want
        tight.check_integrity()
        seqs[key] = seqs[key] + got[0][:1] + [rng.randrange(3, 256)]
    assert tight.counters["evictions"] >= 3
    assert roomy.counters["evictions"] == 0
    assert tight.counters["catch_up_tokens"] > roomy.counters["catch_up_tokens"]


# ---- the MTP head ---------------------------------------------------------------------


def test_mtp_drafts_equal_a_from_scratch_computation(qwen_mtp):
    """Every proposal the engine's MTP drafter makes (incremental catch-up from the
    hidden states handed over after prefill and verify steps) equals the head run from
    scratch on the dense hidden states of the same prefix."""
    llm = LLM(qwen_mtp, enable_prefix_caching=False, speculative_config=_spec("mtp", 3))
    assert_mtp_drafts_match_dense(llm, motif_workload(3), GREEDY)


def test_mtp_head_computation_order(qwen_mtp):
    """One slot by hand: fc over [normed embedding, normed hidden] (in that order), the
    decoder layer, the final norm: a planted fc that passes only the hidden half shows
    the order (swapping the halves changes the output)."""
    llm = LLM(qwen_mtp, speculative_config=_spec("mtp", 1))
    head = llm.engine.drafter.head
    hsz = llm.model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    e, h = torch.randn(1, hsz, generator=g), torch.randn(1, hsz, generator=g)
    caches = head.cache_spec.allocate(1, 16, 1, torch.float32, torch.float32, "cpu")
    batch = ForwardBatch(
        query_start=[0, 1], num_computed=[0], positions=torch.zeros(1, dtype=torch.long),
        context_lens=[1], block_tables=torch.zeros(1, 1, dtype=torch.int32),
        slot_mapping=torch.zeros(1, dtype=torch.long), state_in_page=[-1], state_out_row=[],
        state_out_offset=[], state_out_page=[],
    )
    with torch.inference_mode():
        y = head(e, h, batch, caches)
        x = head.fc(torch.cat([head.pre_fc_norm_embedding(e), head.pre_fc_norm_hidden(h)], -1))
        layer = head.layers[0]
        a = layer.self_attn(layer.input_layernorm(x), batch, caches.kv[0])
        r = x + a
        expect = head.norm(r + layer.mlp(layer.post_attention_layernorm(r)))
        assert torch.allclose(y, expect, atol=1e-5)
        swapped = head.fc(torch.cat([head.pre_fc_norm_hidden(h), head.pre_fc_norm_embedding(e)], -1))
        assert not torch.allclose(x, swapped, atol=1e-3)


def test_mtp_kv_is_freed_with_the_request(qwen_mtp):
    llm = LLM(qwen_mtp, speculative_config=_spec("mtp", 3))
    engine = llm.engine
    drafter = engine.drafter
    engine.add_request("a", motif_workload(0)[0], GREEDY)
    engine.add_request("b", motif_workload(0)[1], GREEDY)
    for _ in range(4):
        engine.step()
    assert drafter.blocks.num_free < drafter.blocks.num_blocks
    engine.abort_request("a")
    assert "a" not in drafter._seqs and "a" not in drafter._hidden
    while engine.has_unfinished_requests():
        engine.step()
    assert drafter.blocks.num_free == drafter.blocks.num_blocks
    assert not drafter._hidden


def test_batch_interface_of_the_ngram_drafter(tiny_granite):
    llm = LLM(tiny_granite, speculative_config=_spec("ngram", 3))
    reqs = [DraftRequest("x", [1, 2, 3, 1, 2], 3), DraftRequest("y", [5, 6], 0)]
    assert llm.engine.drafter.propose_batch(reqs) == [[3, 1, 2], []]


# ---- speculative sampling with the drafter's distribution --------------------------


def _p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    df = torch.tensor((counts.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(chi2 / 2, dtype=torch.float64)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", ["close", "far", "equal"])
def test_speculative_sampling_reproduces_the_target_distribution(case, dtype):
    """Draft x ~ q (the drafter's stream), accepted with min(1, p/q), else the residual:
    the emitted token is distributed as p (chi-square), acceptance is sum(min(p, q));
    with log q in float64 and in the float32 the drafters and the decode graphs keep
    (``sampler.LOGQ_DTYPE``, the draft drawn from the rounded values), and log p in
    float32 as the sampler computes it."""
    from hybridserve.runner import sampler

    g = torch.Generator().manual_seed({"close": 1, "far": 2, "equal": 3}[case])
    vocab, trials = 10, 8000
    logp = torch.log_softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 1.2, -1)
    if dtype == torch.float32:
        logp = logp.float()
    if case == "equal":
        logq = logp.clone()
    else:
        noise = 0.5 if case == "close" else 2.0
        logq = torch.log_softmax(logp.double() + noise * torch.randn(vocab, generator=g, dtype=torch.float64), -1)
    logq = logq.to(dtype)
    seeds = torch.arange(trials, dtype=torch.int64) * 7919 + 13
    lo, hi = seeds & ((1 << 31) - 1), seeds >> 31
    index = torch.full((trials,), 5, dtype=torch.int64)
    drafts = sampler.draft_draw(logq.expand(trials, vocab), lo, hi, index)
    # The drafts follow q.
    assert _p_value(torch.bincount(drafts, minlength=vocab).double(), logq.exp() * trials) > 1e-3
    out = sampler.speculative_choices(logp.expand(trials, vocab), logq.expand(trials, vocab), drafts, lo, hi, index)
    counts = torch.bincount(out, minlength=vocab).double()
    assert _p_value(counts, logp.exp() * trials) > 1e-3
    accepted = float((out == drafts).double().mean())
    expect = float(torch.minimum(logp.exp(), logq.exp()).sum())
    assert abs(accepted - expect) < 0.025
    if case == "equal":
        assert accepted == 1.0
    # Reproducible: the same seeds give the same tokens.
    again = sampler.speculative_choices(logp.expand(trials, vocab), logq.expand(trials, vocab), drafts, lo, hi, index)
    assert torch.equal(out, again)


def test_the_chi_square_has_power_against_unverified_drafts():
    """The planted bug "accept every sampled draft" emits the drafts themselves: the
    same chi-square rejects them as samples of p, so passing it above means something."""
    from hybridserve.runner import sampler

    g = torch.Generator().manual_seed(2)
    vocab, trials = 10, 8000
    logp = torch.log_softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 1.2, -1)
    logq = torch.log_softmax(logp + 2.0 * torch.randn(vocab, generator=g, dtype=torch.float64), -1)
    seeds = torch.arange(trials, dtype=torch.int64) * 7919 + 13
    lo, hi = seeds & ((1 << 31) - 1), seeds >> 31
    index = torch.full((trials,), 5, dtype=torch.int64)
    drafts = sampler.draft_draw(logq.expand(trials, vocab), lo, hi, index)
    assert _p_value(torch.bincount(drafts, minlength=vocab).double(), logp.exp() * trials) < 1e-6


def _second_tokens(llm, prompt, seed, n=300):
    params = SamplingParams(n=n, max_tokens=3, temperature=0.8, seed=seed, ignore_eos=True)
    return [c.token_ids[1] for c in llm.generate([prompt], params)[0].outputs]


def test_sampled_outputs_with_a_draft_model_follow_the_target(qwen_mtp, qwen_draft):
    """Two-sample chi-square on the token emitted by the first verify step: plain
    sampling vs speculation with a different draft model (drafts sampled from q)."""
    prompt = motif_workload(0)[1]
    plain = LLM(qwen_mtp, max_num_seqs=300, num_state_pages=1400)
    spec = LLM(qwen_mtp, max_num_seqs=300, num_state_pages=2400,
               speculative_config=_spec("draft_model", 2, qwen_draft))
    a = _second_tokens(plain, prompt, 21)
    b = _second_tokens(spec, prompt, 22)
    s = spec.stats()
    assert s["spec_draft_tokens"] > 0 and 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"]
    tokens = sorted(set(a) | set(b))
    ca = torch.tensor([a.count(t) for t in tokens], dtype=torch.float64)
    cb = torch.tensor([b.count(t) for t in tokens], dtype=torch.float64)
    rare = (ca + cb) < 10
    if rare.any():
        ca = torch.cat([ca[~rare], ca[rare].sum()[None]])
        cb = torch.cat([cb[~rare], cb[rare].sum()[None]])
    total = ca + cb
    ea, eb = total / 2, total / 2
    chi2 = float(((ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb).sum())
    df = len(total) - 1
    assert df >= 3
    assert float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(chi2 / 2))) > 1e-3
    # Seeded requests reproduce under speculation.
    assert _second_tokens(spec, prompt, 22, n=40) == b[:40]


def test_sampled_draft_model_equal_to_target_accepts_every_draft(qwen_mtp):
    """q == p (the drafter is the target, plain temperature): min(1, p/q) = 1 always."""
    llm = LLM(qwen_mtp, speculative_config=_spec("draft_model", 3, qwen_mtp))
    params = SamplingParams(n=4, max_tokens=20, temperature=0.9, seed=3, ignore_eos=True)
    llm.generate([motif_workload(0)[1]], params)
    s = llm.stats()
    assert s["spec_draft_tokens"] > 0
    assert s["spec_accepted_tokens"] == s["spec_draft_tokens"]


def test_cli_speculative_config(qwen_mtp, qwen_draft, capsys):
    import argparse

    from hybridserve.cli import add_engine_arguments, llm_from_args

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    import json

    spec = json.dumps({"method": "draft_model", "model": str(qwen_draft), "num_speculative_tokens": 2})
    llm = llm_from_args(p.parse_args(["--model", str(qwen_mtp), "--speculative-config", spec]))
    assert llm.config.speculative.method == "draft_model" and llm.config.speculative.num_speculative_tokens == 2
    llm = llm_from_args(p.parse_args(["--model", str(qwen_mtp), "--speculative-config", '{"method": "mtp"}']))
    assert type(llm.engine.drafter).__name__ == "MtpDrafter"
    with pytest.raises(SystemExit):  # refused while parsing, before anything is built
        p.parse_args(["--model", str(qwen_mtp), "--speculative-config", "{mtp"])
    assert "not valid JSON" in capsys.readouterr().err
    with pytest.raises(ValueError, match="speculative_config.model is required"):
        llm_from_args(p.parse_args(["--model", str(qwen_mtp), "--speculative-config", '{"method": "draft_model"}']))


def test_mtp_catch_up_after_accepted_drafts_equals_from_scratch(qwen_mtp):
    """Drive the MTP drafter as the engine does, with acceptances a random head rarely
    earns: after each proposal accept a random number of its drafts plus a bonus token,
    hand over the target's hidden states of the newly computed positions, propose again;
    every proposal equals the head run from scratch on the dense hidden states."""
    llm = LLM(qwen_mtp, speculative_config=_spec("mtp", 4))
    drafter = llm.engine.drafter
    rng = random.Random(11)
    with torch.inference_mode():
        for trial in range(3):
            key = f"t{trial}"
            tokens = rand_tokens(rng, 9 + 5 * trial)
            hidden = dense_hidden(llm.model, tokens)
            drafter.observe(key, 0, hidden[: len(tokens) - 1])  # the prompt's prefill
            computed = len(tokens) - 1
            for _ in range(6):
                k = rng.randint(1, 4)
                drafts = drafter.propose_batch([DraftRequest(key, tokens, k)])[0]
                dense = dense_hidden(llm.model, tokens)
                assert drafts == dense_mtp_drafts(drafter, tokens, dense, k)
                a = rng.randint(1, len(drafts) + 1)  # accepted drafts + 1
                tokens = tokens + drafts[: a - 1] + [rng.randrange(3, 256)]
                # The verify row computed positions computed .. computed + a - 1 on true tokens.
                full = dense_hidden(llm.model, tokens)
                drafter.observe(key, computed, full[computed : computed + a])
                computed += a
            drafter.forget(key)
    drafter.check_integrity()
    assert drafter.blocks.num_free == drafter.blocks.num_blocks
