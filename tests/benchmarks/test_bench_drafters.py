"""benchmarks/bench_drafters.py --smoke for its targets: the embedded model with its trained
draft model on held-out prompts, a random Nemotron-H with an MTP head, and the 8B shape's
tiny twin as its own draft model; every output equals no speculation."""

import json

import pytest
import torch
import triton
from bench_smoke_helpers import load_benchmark


def test_trained_draft_benchmark_runs():
    bench = load_benchmark("bench_drafters")
    report = bench.main(["--target", "default", "--smoke", "--k", "2", "--methods", "draft_model"])
    rows = report["results"]
    assert [(r["batch"], r["method"]) for r in rows] == [
        (1, "none"), (1, "draft_model"), (2, "none"), (2, "draft_model")]
    assert all(r["matches_no_speculation"] for r in rows)
    for r in rows[1::2]:
        assert r["draft_tokens"] > 0 and r["verify_steps"] > 0
        # The CPU runs eagerly: no drafter graphs.
        assert r["drafter_eager_steps"] > 0 and r["drafter_graph_steps"] == 0
        assert r["tokens_per_target_step"] == round(r["generated_tokens"] /
                                                    (r["generated_tokens"] - r["accepted_tokens"]), 3)
    assert report["draft_model"] == "hybridserve/default_model/draft"
    assert isinstance(report["corpus_matches_manifest"], bool)


def test_nemotron_mtp_benchmark_runs():
    """``--target nemotron --smoke``: a random Nemotron-H target with its MTP head drafts,
    and every output equals no speculation."""
    bench = load_benchmark("bench_drafters")
    report = bench.main(["--target", "nemotron", "--smoke", "--k", "2", "--methods", "mtp"])
    rows = report["results"]
    assert [(r["batch"], r["method"]) for r in rows] == [(1, "none"), (1, "mtp"), (2, "none"), (2, "mtp")]
    assert all(r["matches_no_speculation"] for r in rows)
    assert all(r["draft_tokens"] > 0 for r in rows[1::2])


def test_8b_shape_benchmark_runs(tmp_path):
    """``--target 8b --smoke``: the random Nemotron-H of ``bench_gpu``'s shapes (its tiny
    one here) runs without speculation, with the n-gram drafter (the motif prompts give it
    proposals) and as its own draft model on the target's weights (every draft accepted),
    every output equal to no speculation, and the report says where it came from."""
    bench = load_benchmark("bench_drafters")
    gpu = load_benchmark("bench_gpu")
    out = tmp_path / "drafters.json"
    report = bench.main(["--target", "8b", "--smoke", "--k", "2", "--out", str(out)])
    rows = report["results"]
    assert [(r["batch"], r["method"], r["k"]) for r in rows] == [
        (b, m, k) for b in (1, 2)
        for m, k in (("none", None), ("ngram", 2), ("draft_model=target", 2))]
    assert all(r["matches_no_speculation"] and r["requests"] == 2 for r in rows)
    for r in rows:
        assert r["tokens_per_s"] > 0 and 0.0 <= r["drafter_share"] <= 1.0
        if r["method"] == "ngram":
            assert r["draft_tokens"] > 0 and "draft_weights_shared" not in r
        if r["method"] == "draft_model=target":
            assert r["draft_tokens"] > 0 and r["accepted_tokens"] == r["draft_tokens"]
            assert r["acceptance_rate"] == 1.0 and r["drafter_share"] > 0
            # One copy of the weights: the draft model's parameters are the target's.
            assert r["draft_weights_shared"] is True
            assert r["drafter_eager_steps"] > 0 and r["drafter_graph_steps"] == 0
    assert report["target_shape"] == gpu.TINY
    assert report["target_parameters"] > 0
    assert report["torch"] == torch.__version__ and report["triton"] == triton.__version__
    assert report["commit"] and report["device"] and report["python"]
    assert report["args"]["target"] == "8b" and report["args"]["dtype"] == ["float32"]
    assert report["args"]["hidden"] is None and report["args"]["layers"] is None
    # The divergence sections: against no speculation of the same batch, with the
    # batch's prompts run at max_num_seqs 1 as the baseline (batch 2 only), and the
    # precise (float64) forward's argmax equal to the float32 engine's every greedy token.
    for r in rows:
        d = r["divergence"]
        assert d["reference"]["reference_dtype"] == "float64"
        assert d["reference"]["argmax_agreement"] == 1.0
        assert d["reference"]["positions"] == 2 * 8
        assert 0 < d["reference"]["top_gap_rel_p10"] <= d["reference"]["top_gap_rel_median"]
        if r["method"] == "none":
            base = d["baseline"]
            if r["batch"] == 1:
                assert base is None
            else:
                assert base["max_num_seqs"] == 1 and base["token_agreement"] == 1.0
                assert base["diverged_requests"] == 0 and base["points"] == []
        else:
            assert d["against"] == "none" and d["token_agreement"] == r["token_agreement"] == 1.0
            assert d["diverged_requests"] == 0 and d["points"] == [] and d["gap_rel_max"] is None
            assert d["baseline_agreement"] == (None if r["batch"] == 1 else 1.0)
            assert d["baseline_max_num_seqs"] == (None if r["batch"] == 1 else 1)
    written = json.loads(out.read_text())
    assert written["results"] == json.loads(json.dumps(rows)) and written["wall_s"] > 0


def test_8b_target_takes_a_depth_and_several_dtypes():
    """``--layers`` (M / A / -) replaces the 8b shape's layer pattern, ``--vocab`` its
    vocabulary, and ``--dtype`` takes several: each dtype's rows in turn, each row
    naming its dtype, each with its divergence section. ``draft_model=other`` drafts
    from another random model of the shape: its drafts are rejected (every verify step
    rolls the target back), and in float32 the output still equals no speculation."""
    bench = load_benchmark("bench_drafters")
    gpu = load_benchmark("bench_gpu")
    report = bench.main(["--target", "8b", "--smoke", "--k", "2", "--layers", "M-A",
                         "--vocab", "512", "--methods", "ngram", "draft_model=other",
                         "--dtype", "bfloat16", "float32"])
    assert report["target_shape"] == dict(gpu.TINY, pattern="M-*", vocab_size=512)
    rows = report["results"]
    assert [(r["dtype"], r["batch"], r["method"]) for r in rows] == [
        (dt, b, m) for dt in ("bfloat16", "float32") for b in (1, 2)
        for m in ("none", "ngram", "draft_model=other")]
    for r in rows:
        d = r["divergence"]
        assert 0.0 <= d["reference"]["argmax_agreement"] <= 1.0
        if r["method"] == "draft_model=other":
            assert r["draft_weights_shared"] is False
            assert r["draft_tokens"] > 0 and r["accepted_tokens"] < r["draft_tokens"] / 2
        if r["method"] != "none":
            assert d["token_agreement"] == r["token_agreement"]
            assert len(d["points"]) == d["diverged_requests"] == 2 - r["sequences_identical"]
    assert all(r["matches_no_speculation"] for r in rows if r["dtype"] == "float32")


def test_divergence_points_measure_the_precise_logit_gap(tmp_path):
    """``divergence.compare`` on planted runs: a run equal to the reference has no
    points; one that takes the precise forward's second choice at a position parts
    there with a gap equal to the top-1 / top-2 gap; one that takes its worst token
    parts with the largest gap of all (percentile 1), the reference's token picked."""
    load_benchmark("bench_drafters")  # puts benchmarks/ on the path (bench_gpu's imports)
    gpu = load_benchmark("bench_gpu")
    div = load_benchmark("divergence")
    from hybridserve import LLM, SamplingParams

    model, _, _, path = gpu.build_models(gpu.TINY, "cpu", torch.float32, tmp_path, with_hf=False)
    prompts = [[5, 9, 17, 33, 65, 129, 7, 11], [200, 3, 4, 250, 8, 8, 9, 100]]
    with gpu.engine_with(model):
        llm = LLM(path, max_num_seqs=2, enable_prefix_caching=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    reference = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    logits = div.model_logits(model.to(torch.float64))
    lg0, lg1 = logits(prompts[0], reference[0]), logits(prompts[1], reference[1])
    second = int(lg0[3].topk(2).indices[1])
    worst = int(lg1[0].argmin())
    planted_second = [reference[0][:3] + [second] + reference[0][4:], reference[1]]
    planted_worst = [reference[0], [worst] + reference[1][1:]]
    typical, figures = div.compare(logits, prompts, reference, {
        "same": reference, "second": planted_second, "worst": planted_worst})
    assert typical["argmax_agreement"] == 1.0 and typical["positions"] == 12
    same, sec, wor = figures["same"], figures["second"], figures["worst"]
    assert same["token_agreement"] == 1.0 and same["diverged_requests"] == 0
    assert same["sequences_identical"] == 2
    (p,) = sec["points"]
    assert (p["request"], p["position"], p["other_token"]) == (0, 3, second)
    assert p["reference_pick"] == "reference" and p["gap_rel"] > 0
    assert p["gap_rel"] == pytest.approx(p["top_gap_rel"], abs=1e-5)
    assert sec["token_agreement"] == round(11 / 12, 4)
    (w,) = wor["points"]
    assert (w["request"], w["position"], w["other_token"]) == (1, 0, worst)
    assert w["gap_rel"] > typical["top_gap_rel_p90"] and w["gap_percentile"] == 1.0
    assert wor["reference_picks"] == {"reference": 1, "other": 0, "neither": 0}
    assert div.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert div.first_divergence([1, 2, 3], [1, 2]) == 2


def test_8b_target_refuses_fewer_prompts_than_the_batch():
    """The 8b rows at batch b run b prompts of one set: a set smaller than the largest
    batch is refused, naming ``--prompts``, before anything is built."""
    bench = load_benchmark("bench_drafters")
    with pytest.raises(SystemExit, match="--prompts 8: .* at least 16"):
        bench.main(["--target", "8b", "--batch", "1", "16", "--prompts", "8"])
    with pytest.raises(SystemExit, match="--layers 'MX'"):
        bench.main(["--target", "8b", "--layers", "MX"])


def test_sampled_rows_accept_every_draft_of_the_target_itself():
    """``--temperature``: sampled rows (one seed per prompt) leave out the token checks,
    and the target as its own draft model, whose q is the target's p, has every draft
    accepted by the min(1, p / q) test."""
    bench = load_benchmark("bench_drafters")
    report = bench.main(["--target", "default", "--smoke", "--k", "2", "--temperature", "0.8",
                         "--methods", "draft_model=target"])
    rows = report["results"]
    assert [r["method"] for r in rows] == ["none", "draft_model=target"] * 2
    assert all(r["matches_no_speculation"] is None and r["token_agreement"] is None
               for r in rows)
    for r in rows[1::2]:
        assert r["draft_tokens"] > 0 and r["acceptance_rate"] == 1.0


def test_random_prompts_are_distinct_and_the_motif_ones_repeat():
    """Every prompt of the 8b set is a sample of its own (no two alike): the odd ones
    repeat an 8-token motif each (the n-gram drafter's matches), the even ones do not."""
    import random

    bench = load_benchmark("bench_drafters")
    prompts = bench.random_prompts(random.Random(0), 6, 20, vocab=1000)
    assert len({tuple(p) for p in prompts}) == 6
    for i, p in enumerate(prompts):
        assert len(p) == 20 and all(3 <= t < 1000 for t in p)
        assert (p[8:] == p[:12]) == bool(i % 2)
