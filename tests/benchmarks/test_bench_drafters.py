"""benchmarks/bench_drafters.py --target default --smoke: it runs on the embedded model and
its trained draft model, on held-out prompts, and every output equals no speculation."""

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
