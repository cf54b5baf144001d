"""The GPU benchmark's CPU smoke mode runs every section end to end and writes its JSON;
its kernel checks cover every module of hybridserve/kernels that defines a Triton kernel,
and all of them pass."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _triton_kernel_modules() -> list[str]:
    """Modules of hybridserve/kernels with a ``@triton.jit`` function (or ``@jit``)."""
    modules = []
    for path in sorted((ROOT / "hybridserve" / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                ast.unparse(d.func if isinstance(d, ast.Call) else d) in ("triton.jit", "jit")
                for d in node.decorator_list
            ):
                modules.append(path.stem)
                break
    return modules


def test_bench_gpu_smoke(tmp_path):
    out = tmp_path / "gpu_bench.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/bench_gpu.py"), "--smoke", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600,  # a hang guard, not a time limit
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == {}, result["errors"]
    assert not result["skipped"]
    for key in ("copy_bandwidth", "matmul", "kernels", "kernel_checks", "ttft", "agreement",
                "ratios", "prefill"):
        assert result[key], key
    _check_kernel_checks(result["kernel_checks"], proc.stdout)
    assert [r["batch"] for r in result["decode"]["ours"]] == [1, 4]
    # The smoke run takes the decode-graph path (its static-buffer step, no capture on the
    # CPU) on alternate steps, the eager fast path on the others; then pipelined graph
    # steps (async scheduling, the engine's default with graphs), each launching one.
    for r in result["decode"]["ours"]:
        assert r["mode"] == "graph_async"
        assert set(r["modes"]) == {"graph", "eager", "graph_async"}
        assert r["graphs"]["timed_graph_steps_replayed"] == r["modes"]["graph"]["steps_timed"]
        assert r["graph_steps_launched"] == r["steps_timed"]
        assert not r["graphs"]["capture_errors"]
    assert [r["batch"] for r in result["decode"]["ours_eager"]] == [1, 4]
    # Sampled decode steps replay graphs too (the draw inside the graph).
    sampled = result["decode_sampled"]
    assert sampled["mode"] == "graph_async"
    assert sampled["graphs"]["timed_graph_steps_replayed"] == sampled["modes"]["graph"]["steps_timed"]
    assert sampled["graph_steps_launched"] == sampled["steps_timed"]
    assert any("any_sampled=True" in str(k) for k in sampled["graphs"]["keys"])
    twin = result["decode_sampled_twin"]
    assert twin["mode"] == "graph_async" and twin["steps_timed"] == sampled["steps_timed"]
    assert result["prefill"]["prompts_run"] == 2
    assert result["agreement"]["graphs_vs_eager"]["positional_agreement"] == 1.0
    assert result["agreement"]["graph_counters"]["graph_steps"] > 0
    assert result["ttft"]["cached_runs"][0][1] == result["ttft"]["cached_len"]
    by_tail = result["ttft"]["cached_by_tail"]
    assert {r["short_rows"] for r in by_tail} == {"short", "chunks", "off"}
    assert all(hit == result["ttft"]["cached_len"] for r in by_tail for _, hit in r["runs"])
    profile = result["ttft"]["cached_profile"]
    assert profile["wall_s"] > 0 and profile["top_host_ops"]
    split = result["ttft"]["cached_split"]
    assert split["wall_s"] == result["ttft"]["cached_s"]
    assert split["host_s"] == split["wall_s"] - split["kernel_s"]
    assert split["cached_runs"] == len(result["ttft"]["cached_runs"])
    # A cached run right after a cold run, profiled, and cached runs after an idle gap.
    first = result["ttft"]["first_cached_profile"]
    assert first["wall_s"] > 0 and split["first_run_kernel_s"] == first["kernel_s_total"]
    idle = result["ttft"]["cached_after_idle"]
    assert idle and all(hit == result["ttft"]["cached_len"] for r in idle for _, hit in r["runs"])
    assert result["ttft"]["meets_target"] == (result["ttft"]["speedup"] >= 20.0)
    assert result["agreement"]["positional_agreement"] == 1.0
    for k in ("device", "torch", "triton", "commit"):
        assert result["env"][k]
    # Split keys (forced to two on the CPU) against one program per (row, KV head).
    long = result["attention_kernel_long"]
    assert [(r["batch"], r["context"]) for r in long] == [(2, 40)]
    for r in result["attention_kernel"] + long:
        assert r["splits"] == 2 and r["unsplit_s"] > 0, r
        assert r["triton_vs_float64_rel_err"] < 1e-5 and r["unsplit_vs_twin_rel_err"] < 1e-5, r
    _check_numerics(result["numerics"], result["agreement"])


def _check_numerics(n: dict, agreement: dict) -> None:
    """The 8B Mamba layer at bf16 rounding: the engine's float32 dt keeps the decode and
    prefill states within 1e-5 of float64, where dt discretised in bf16 does not."""
    assert (n["layer"]["heads"], n["layer"]["head_dim"], n["layer"]["d_state"]) == (128, 64, 128)
    d, p = n["decode"], n["prefill"]
    for key in ("state_rel_err_after_1", f"state_rel_err_after_{d['steps']}"):
        assert d[key] <= 1e-5 < d["bf16_dt"][key], (key, d)
    assert p["final_state_rel_err"] <= 1e-5 < p["bf16_dt"]["final_state_rel_err"], p
    assert n["bf16_vs_float32_greedy_agreement"] == agreement["positional_agreement"]


def _check_kernel_checks(kc: dict, stdout: str) -> None:
    modules = _triton_kernel_modules()
    assert len(modules) >= 4, "the scan found fewer Triton kernel modules than the project has"
    checks = kc["checks"]
    missing = sorted(set(modules) - {c["module"] for c in checks})
    assert not missing, f"Triton kernel modules without a kernel check: {missing}"
    assert isinstance(kc["seed"], int)
    for c in checks:
        if c["status"] == "skipped":
            # Only fla-core's scan may be missing (it needs CUDA and the optional package).
            assert c["module"] == "ssd_varlen", c
            continue
        assert c["status"] == "pass", (c["name"], c.get("failures"), c.get("error"),
                                       c.get("traceback"))
        assert c["seed"] == kc["seed"] and c["shapes"] and c["dtype"]
        assert c["kernel_s"] > 0
        assert c["outputs"] and all(o["rel_err_vs_twin"] <= o["tolerance_vs_twin"]
                                    for o in c["outputs"].values())
        assert c["name"] in stdout  # the table at the end of the console output
    assert {c["module"] for c in checks if c["status"] == "pass"} >= set(modules)


def test_policy_overrides_parse_each_field_as_its_type():
    """``bench_gpu.py --policy``: values take their field's type; an unknown field, a
    malformed pair or a value the policy refuses stops the run before anything is built."""
    import pytest

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_gpu

    got = bench_gpu.policy_overrides(
        ["token_prefetch=on", "fused_decode=false", "max_short_tokens=256"])
    assert got == {"token_prefetch": "on", "fused_decode": False, "max_short_tokens": 256}
    assert bench_gpu.policy_overrides([]) == {}
    for bad in (["no_such_field=1"], ["token_prefetch"], ["fused_decode=maybe"],
                ["max_short_tokens=many"], ["token_prefetch=yes"]):
        with pytest.raises(SystemExit, match="--policy"):
            bench_gpu.policy_overrides(bad)
