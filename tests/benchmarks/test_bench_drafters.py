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
    assert report["args"]["target"] == "8b" and report["args"]["dtype"] == "float32"
    assert report["args"]["hidden"] is None and report["args"]["layers"] is None
    written = json.loads(out.read_text())
    assert written["results"] == json.loads(json.dumps(rows)) and written["wall_s"] > 0


def test_8b_target_refuses_fewer_prompts_than_the_batch():
    """The 8b rows at batch b run b prompts of one set: a set smaller than the largest
    batch is refused, naming ``--prompts``, before anything is built."""
    bench = load_benchmark("bench_drafters")
    with pytest.raises(SystemExit, match="--prompts 8: .* at least 16"):
        bench.main(["--target", "8b", "--batch", "1", "16", "--prompts", "8"])


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
