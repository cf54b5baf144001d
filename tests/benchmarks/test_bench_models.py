"""The model-level benchmark (benchmarks/bench_models.py): its three published shapes parse
into the models they describe (layer mix, parameter counts of the published cards), its
decode roofline counts the weights a step reads consistently with the engine's
active-weight count, and its CPU smoke mode runs every section end to end (two of the
shapes by default, every shape in the ``slow`` run)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridserve.models.config import ATTENTION, GDN, MAMBA, MOE, ModelConfig
from hybridserve.models.registry import model_class

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_models as bm  # noqa: E402


def _meta_model(name: str, smoke: bool = False, layers: int | None = None):
    c = ModelConfig.from_dict(bm.shape_config(name, smoke, layers))
    with torch.device("meta"):
        return model_class(c.architecture)(c).to(torch.bfloat16), c


@pytest.mark.parametrize(
    "name, counts, params_b, active_b",
    [
        # Published cards: Nemotron 3 Nano 31.6B total (about 3.5B active with embeddings),
        # Granite 4.0-H Small 32.2B (9B active), Qwen3.6-27B 27B dense.
        ("nemotron-3-nano-30b-a3b", {MAMBA: 23, MOE: 23, ATTENTION: 6}, 31.58, 2.88),
        ("granite-4.0-h-small", {MAMBA: 36, ATTENTION: 4}, 32.21, 8.39),
        ("qwen3.6-27b", {GDN: 48, ATTENTION: 16}, 26.90, 24.35),
    ],
)
def test_published_shapes(name, counts, params_b, active_b):
    model, c = _meta_model(name)
    assert {k: c.layer_types.count(k) for k in set(c.layer_types)} == counts
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(params_b, abs=0.01)
    assert model.num_active_weights() / 1e9 == pytest.approx(active_b, abs=0.01)
    if name == "granite-4.0-h-small":
        assert len(c.moe_layers) == 40 and (c.moe.num_experts, c.moe.top_k) == (72, 10)
    # The truncated baseline model keeps every layer kind of the full one.
    _, t = _meta_model(name, layers=bm.SHAPES[name]["truncated_layers"])
    assert set(t.layer_types) == set(c.layer_types)
    assert t.layer_types == c.layer_types[: len(t.layer_types)]


@pytest.mark.parametrize("name", ["nemotron-3-nano-30b-a3b", "granite-4.0-h-small"])
def test_decode_bytes_with_top_k_experts_are_the_active_weights(name):
    """At batch 1 a step touches top_k experts per block: the roofline's weight bytes are
    then the engine's active weights plus the LM head (the whole table when tied to the
    embedding) and one embedding row, counted independently."""
    model, c = _meta_model(name)
    hidden, head = c.hidden_size, c.vocab_size * c.hidden_size
    got = bm.step_bytes(model, 1, 100, torch.float32, touched=c.moe.top_k)
    rows = 0 if c.tie_word_embeddings else hidden
    assert got["weights"] == pytest.approx(2 * (model.num_active_weights() + head + rows), rel=1e-9)
    every = bm.step_bytes(model, 1, 100, torch.float32, touched=c.moe.num_experts)
    assert every["untouched_experts"] == 0
    assert every["weights"] > 3 * got["weights"]  # a 30B model with about 3-9B active
    # KV of 100 tokens over the attention layers, the state page read and written.
    spec = model.cache_spec
    assert got["kv"] == 100 * spec.kv_block_bytes(1, torch.bfloat16)
    assert got["state"] == 2 * spec.state_page_bytes(torch.bfloat16, torch.float32)


def test_qwen_decode_bytes_count_float32_state_pages():
    model, _ = _meta_model("qwen3.6-27b")
    b = 16
    f32 = bm.step_bytes(model, b, 256, torch.float32, touched=None)
    bf16 = bm.step_bytes(model, b, 256, torch.bfloat16, touched=None)
    page = 48 * 48 * 128 * 128 * 4 + 48 * (2 * 16 * 128 + 48 * 128) * 3 * 2
    assert f32["state"] == 2 * b * page
    assert f32["state"] - bf16["state"] == 2 * b * 48 * 48 * 128 * 128 * 2
    assert f32["untouched_experts"] == 0


def test_touched_experts_measured_from_the_routers(tmp_path):
    # The smoke size, built on the CPU: 8 experts, top 3.
    model, _ = bm.build_ours(bm.shape_config("granite-4.0-h-small", True), "cpu",
                             torch.float32, tmp_path)
    one = bm.touched_experts(model, 1)
    assert one["measured_mean"] == 3 == one["top_k"]
    many = bm.touched_experts(model, 64)
    assert 3 < many["measured_mean"] <= 8
    assert many["uniform_expectation"] == pytest.approx(8 * (1 - (5 / 8) ** 64))
    assert bm.touched_experts(_meta_model("qwen3.6-27b", smoke=True)[0], 4) is None


# The default run's shapes: a Mamba2 / MoE / attention one and the Gated DeltaNet one
# (Granite's is the first's layer families again); the slow run takes the script's
# default, every shape.
DEFAULT_SHAPES = ["nemotron-3-nano-30b-a3b", "qwen3.6-27b"]


@pytest.mark.parametrize("shapes", [
    pytest.param(DEFAULT_SHAPES, id="nemotron-qwen"),
    pytest.param(None, id="every-shape", marks=pytest.mark.slow),
])
def test_bench_models_smoke(tmp_path, shapes):
    out = tmp_path / "models.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/bench_models.py"), "--smoke", "--out", str(out),
         *(["--shapes", *shapes] if shapes else [])],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["errors"] == {}, r["errors"]
    for k in ("device", "torch", "triton", "transformers", "commit"):
        assert r["env"][k]
    assert r["copy_bandwidth"]["bytes_per_s"] > 0 and r["matmul"]["flops_per_s"] > 0
    assert list(r["shapes"]) == (shapes or list(bm.SHAPES))
    for name, s in r["shapes"].items():
        assert s["errors"] == {}, (name, s["errors"])
        assert s["skipped"] == [], (name, s["skipped"])
        assert s["source"] and s["config"]["architectures"]
        assert [d["batch"] for d in s["decode"]] == [1, 2]
        for d in s["decode"]:
            assert d["mode"] == "graph_async" and set(d["modes"]) == {"graph", "eager",
                                                                      "graph_async"}
            assert d["graphs"]["timed_graph_steps_replayed"] == d["modes"]["graph"]["steps_timed"]
            assert d["ssm_state_dtype"] == "float32"
            nbytes = d["roofline_bytes_per_step"]
            assert nbytes["total"] == pytest.approx(nbytes["weights"] + nbytes["kv"]
                                                    + nbytes["state"])
            assert d["fraction_of_roofline"] > 0
        moe = name != "qwen3.6-27b"
        assert all(bool(d["experts_touched"]) == moe for d in s["decode"])
        if moe:
            # One row touches exactly top_k experts: the untouched ones are not counted.
            first = s["decode"][0]
            assert first["experts_touched"]["measured_mean"] == first["experts_touched"]["top_k"]
            assert first["roofline_bytes_per_step"]["untouched_experts"] > 0
            share = s["moe_share"]
            assert share["batch"] == 2 and 0 < share["share_of_engine_step"] < 1
            assert 0 < share["share_of_step_kernels"] < 1
        else:
            assert "moe_share" not in s
        t = s["ttft"]
        assert t["cached_runs"][0][1] == t["cached_len"] == 64
        p = s["prefill"]
        assert p["prompts_run"] == 2 and p["flops"] >= 2 * s["model"]["active_weights"] * 64
        tr = s["truncated"]
        assert tr["load"]["bytes"] > 0 and tr["load"]["load_s"] > 0
        assert tr["layers"] == bm.SHAPES[name]["truncated_layers"] == len(tr["layer_types"])
        assert set(s["ratios"]["ours_over_transformers_truncated"]) == {"1", "2"}
        assert [d["batch"] for d in tr["decode_transformers"]] == [1, 2]
