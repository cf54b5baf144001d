"""Model-level GPU benchmark at three published shapes: Qwen3.6-27B, Nemotron-3-Nano-30B-A3B
and Granite-4.0-H-Small (random weights, bf16, built on the device; nothing downloaded).

Each shape's ``config.json`` fields are those of the published checkpoint (``SHAPES``
records which file and which fields). Per shape, within its own time budget
(``--budget-s``; a section that would start later is skipped and listed in ``skipped``):

decode        our engine's full-batch decode steps at ``--batches`` (decode CUDA graphs on:
              the engine's default, graph replay and eager steps alternating, then
              pipelined graph steps; :func:`bench_gpu.engine_decode`) against the byte
              roofline: every weight once (for a mixture of experts only the experts the
              step touches: the distinct experts the routers choose for ``batch`` random
              normalised rows, measured, beside the uniform-routing expectation
              ``E (1 - (1 - k/E)^batch)``), the embedding rows looked up (the whole table
              where it is also the LM head), every request's KV read and its state page
              read plus the new one written (Gated DeltaNet's float32 state included),
              over the device-to-device copy bandwidth measured in the same run. Where
              ``3 x batch`` float32 state pages do not fit beside the weights the pages
              are bfloat16 (``ssm_state_dtype`` says which); where neither fits, skipped.
moe_share     (mixture-of-experts shapes) the MoE blocks' share of one decode step at
              ``--profile-batch``: every MoE block of the model run on random rows of that
              batch, replayed from one CUDA graph, over the engine's graph-replayed step;
              and the same from ``torch.profiler``: the blocks' kernel time over the
              step's kernel time (the step's kernels from :func:`bench_gpu.profile_graph_step`).
ttft          first token of a ``--ttft-prompt`` prompt with ``--ttft-cached`` tokens cached
              (a grid checkpoint) against the same prompt cold (:func:`bench_gpu.ttft`).
prefill       ``--prefill-prompts`` x ``--prefill-len`` in one ``generate`` against the FLOP
              roofline of active parameters (2 x active weights x tokens plus attention's
              products; the recurrences' own FLOPs are not counted) over the bf16 matrix
              rate measured here (:func:`bench_gpu.prefill_throughput`).
truncated     transformers' ``generate`` cannot sit beside a 27-32B model of ours on one
              H200, so the baseline runs on the shape truncated to its first
              ``truncated_layers`` layers (full width, the same layer mix): transformers'
              model is built with random weights, written to disk with ``save_pretrained``
              (its family's checkpoint naming), loaded by our ``load_model`` (the load time
              and GB/s of that random checkpoint; the files were just written, so the page
              cache is likely warm), and both engines decode the same truncated model at
              ``--hf-batches``: ``ratios.ours_over_transformers`` compares like with like.

Writes ``--out`` (JSON: device, versions, commit, every configuration, medians and each
baseline of the same run, saved after every section). ``--smoke`` runs every section of
all three shapes on the CPU at tiny sizes (the check before spending device time; a test
runs it).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import bench_gpu as bg  # benchmarks/ is on the path when run as a script
import torch
from graph_timing import capture
from provenance import git_commit, portable_path

from hybridserve.models.config import ModelConfig
from hybridserve.models.layers.moe import MoEBlock
from hybridserve.models.loader import load_model
from hybridserve.models.registry import model_class

ROOT = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------------------
# Shapes: the published config.json fields (architecture-relevant ones only)
# --------------------------------------------------------------------------------------

_QWEN36_27B = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
    "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
    "num_hidden_layers": 64, "full_attention_interval": 4,
    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
    "attn_output_gate": True,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                        "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                        "mrope_interleaved": True},
    "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "bos_token_id": 248044, "eos_token_id": 248044,
}

_NEMOTRON3_NANO = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
    "vocab_size": 131072, "hidden_size": 2688, "num_hidden_layers": 52,
    # 23 Mamba2 (M), 23 MoE (E), 6 attention (*).
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
    "attention_bias": False,
    "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
    "conv_kernel": 4, "chunk_size": 128, "expand": 2, "mamba_hidden_act": "silu",
    "mamba_proj_bias": False, "use_conv_bias": True,
    "intermediate_size": 1856, "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712, "n_routed_experts": 128,
    "n_shared_experts": 1, "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "mlp_hidden_act": "relu2",
    "mlp_bias": False, "layer_norm_epsilon": 1e-5, "residual_in_fp32": False,
    "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}

_GRANITE_LAYERS = (["mamba"] * 5 + ["attention"] + ["mamba"] * 4) * 4  # attention at 5, 15, 25, 35
_GRANITE4_H_SMALL = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
    "vocab_size": 100352, "hidden_size": 4096, "num_hidden_layers": 40,
    "layer_types": _GRANITE_LAYERS,
    "num_attention_heads": 32, "num_key_value_heads": 8, "attention_bias": False,
    "num_local_experts": 72, "num_experts_per_tok": 10, "intermediate_size": 768,
    "shared_intermediate_size": 1536, "hidden_act": "silu",
    "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "embedding_multiplier": 12.0, "logits_scaling": 16.0, "residual_multiplier": 0.22,
    "attention_multiplier": 0.0078125, "position_embedding_type": "nope",
    "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": True,
    "bos_token_id": 100257, "eos_token_id": 100257, "pad_token_id": 100256,
}

SHAPES = {
    "nemotron-3-nano-30b-a3b": {
        "title": "Nemotron-3-Nano-30B-A3B-shaped (NemotronH, Mamba2 + MoE + attention)",
        "source": "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json: hidden_size, "
                  "num_hidden_layers, hybrid_override_pattern, num_attention_heads, "
                  "num_key_value_heads, head_dim, mamba_num_heads, mamba_head_dim, "
                  "ssm_state_size, n_groups, conv_kernel, chunk_size, expand, "
                  "moe_intermediate_size, moe_shared_expert_intermediate_size, "
                  "n_routed_experts, num_experts_per_tok, n_group, topk_group, "
                  "norm_topk_prob, routed_scaling_factor, mlp_hidden_act, vocab_size, "
                  "tie_word_embeddings",
        "config": _NEMOTRON3_NANO,
        # One stretch of the pattern with every kind: 3 M, 3 E, 1 attention.
        "truncated_layers": 7,
        # The agreement section's tiny model: (architecture, layer pattern, overrides).
        "tiny_family": ("nemotron_h", "ME*EM-", {}),
        "smoke": {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 8,
                  "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "chunk_size": 16,
                  "intermediate_size": 32, "moe_intermediate_size": 32,
                  "moe_shared_expert_intermediate_size": 48, "n_routed_experts": 8,
                  "num_experts_per_tok": 3, "num_hidden_layers": 7,
                  "hybrid_override_pattern": "MEMEM*E", "max_position_embeddings": 4096},
    },
    "granite-4.0-h-small": {
        "title": "Granite-4.0-H-Small-shaped (GraniteMoeHybrid, Mamba2 + attention, MoE + "
                 "shared_mlp in every layer)",
        "source": "ibm-granite/granite-4.0-h-small config.json: hidden_size, "
                  "num_hidden_layers, layer_types, num_attention_heads, num_key_value_heads, "
                  "num_local_experts, num_experts_per_tok, intermediate_size, "
                  "shared_intermediate_size, mamba_n_heads, mamba_d_head, mamba_d_state, "
                  "mamba_n_groups, mamba_d_conv, mamba_expand, mamba_chunk_size, "
                  "embedding_multiplier, logits_scaling, residual_multiplier, "
                  "attention_multiplier, position_embedding_type, vocab_size, "
                  "tie_word_embeddings",
        "config": _GRANITE4_H_SMALL,
        "truncated_layers": 6,  # 5 Mamba2 + 1 attention, each with its MoE and shared_mlp
        "tiny_family": ("granitemoehybrid", "MAMMA", {"num_local_experts": 4,
                                                      "num_experts_per_tok": 2}),
        "smoke": {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 3,
                  "intermediate_size": 32, "shared_intermediate_size": 48,
                  "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
                  "mamba_chunk_size": 16, "num_hidden_layers": 6,
                  "layer_types": ["mamba"] * 5 + ["attention"],
                  "max_position_embeddings": 4096,
                  "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
    },
    "qwen3.6-27b": {
        "title": "Qwen3.6-27B-shaped (Qwen3_5ForCausalLM text model: Gated DeltaNet 3:1 "
                 "with gated attention)",
        "source": "Qwen/Qwen3.6-27B config.json text_config: vocab_size, hidden_size, "
                  "intermediate_size, num_hidden_layers, full_attention_interval, "
                  "num_attention_heads, num_key_value_heads, head_dim, attn_output_gate, "
                  "linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, "
                  "linear_value_head_dim, linear_conv_kernel_dim, rope_parameters "
                  "(partial_rotary_factor, mrope_section), tie_word_embeddings",
        "config": _QWEN36_27B,
        "truncated_layers": 4,  # 3 Gated DeltaNet + 1 gated attention
        "tiny_family": ("qwen3_5", "MMAM", {}),
        "smoke": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                  "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                  "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                  "num_hidden_layers": 8, "max_position_embeddings": 4096,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                      "partial_rotary_factor": 0.25,
                                      "mrope_section": [1, 1, 0], "mrope_interleaved": True},
                  "bos_token_id": 1, "eos_token_id": 2},
    },
}


def shape_config(name: str, smoke: bool, layers: int | None = None) -> dict:
    """The config.json of shape ``name`` (tiny with ``smoke``), truncated to its first
    ``layers`` layers when given (the same layer kinds in the same order)."""
    cfg = json.loads(json.dumps(SHAPES[name]["config"]))
    if smoke:
        cfg.update(json.loads(json.dumps(SHAPES[name]["smoke"])))
    if layers is not None and layers < cfg["num_hidden_layers"]:
        cfg["num_hidden_layers"] = layers
        if "hybrid_override_pattern" in cfg:
            cfg["hybrid_override_pattern"] = cfg["hybrid_override_pattern"][:layers]
        if "layer_types" in cfg:
            cfg["layer_types"] = cfg["layer_types"][:layers]
    return cfg


# --------------------------------------------------------------------------------------
# Building models on the device
# --------------------------------------------------------------------------------------


def _default_dtype(dtype):
    class _Ctx:
        def __enter__(self):
            self.prev = torch.get_default_dtype()
            torch.set_default_dtype(dtype)

        def __exit__(self, *exc):
            torch.set_default_dtype(self.prev)

    return _Ctx()


def build_ours(cfg: dict, device: str, dtype: torch.dtype, path: Path, seed: int = 0):
    """Our model of ``cfg`` built directly on ``device`` in ``dtype`` with random weights
    (:func:`bench_gpu.randomize_`); ``path`` gets the config.json the engine reads."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    mcfg = ModelConfig.from_pretrained(path)
    cls = model_class(mcfg.architecture)
    with _default_dtype(dtype), torch.device(device):
        model = cls(mcfg)
    bg.randomize_(model, seed=seed)
    model.eval().requires_grad_(False)
    return model, mcfg


def build_hf(cfg: dict, device: str, dtype: torch.dtype, seed: int = 1):
    """transformers' model of ``cfg`` on ``device`` in ``dtype``, random weights."""
    import transformers

    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    hc = transformers.AutoConfig.for_model(cfg["model_type"], **kw)
    with _default_dtype(dtype), torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(hc)
    hf.eval().requires_grad_(False)
    bg.randomize_(hf, seed=seed)
    return hf


def moe_blocks(model) -> list[MoEBlock]:
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


# --------------------------------------------------------------------------------------
# The decode roofline, generalised: touched experts, tied embeddings, any state family
# --------------------------------------------------------------------------------------


@torch.no_grad()
def touched_experts(model, batch: int, draws: int = 3, seed: int = 0) -> dict | None:
    """Distinct experts the routers choose for ``batch`` random rows (unit-RMS normal
    rows, as the normed hidden state the router sees), mean over MoE blocks and
    ``draws``, beside the uniform-routing expectation. None without MoE blocks."""
    blocks = moe_blocks(model)
    if not blocks:
        return None
    p = blocks[0].p
    param = next(model.parameters())
    g = torch.Generator(device=param.device).manual_seed(seed)
    counts = []
    for block in blocks:
        router = getattr(block, block._router)
        for _ in range(draws):
            x = torch.randn(batch, model.config.hidden_size, device=param.device,
                            generator=g).to(param.dtype)
            ids, _ = router(x)
            counts.append(int(ids.unique().numel()))
    e, k = p.num_experts, p.top_k
    return {"batch": batch, "num_experts": e, "top_k": k,
            "measured_mean": statistics.mean(counts),
            "uniform_expectation": e * (1.0 - (1.0 - k / e) ** batch),
            "blocks": len(blocks), "draws": draws}


def step_bytes(model, batch: int, context: int, state_dtype: torch.dtype,
               touched: float | None) -> dict:
    """Fewest bytes one decode step of ``batch`` rows at ``context`` tokens moves: every
    weight once, except the routed experts a step does not touch (``touched`` distinct
    experts of each block); the embedding rows looked up (the whole table when tied: it is
    the LM head too); KV read; each state page read and the new one written."""
    param = next(model.parameters())
    dtype, elem = param.dtype, param.element_size()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed.weight
    weights = total
    if not model.config.tie_word_embeddings:
        weights += batch * model.config.hidden_size * elem - embed.numel() * embed.element_size()
    untouched = 0.0
    for block in moe_blocks(model):
        routed = sum(p.numel() * p.element_size() for p in block.experts.parameters())
        untouched += routed * (1.0 - min(touched, block.p.num_experts) / block.p.num_experts)
    weights -= untouched
    spec = model.cache_spec
    kv = batch * context * spec.kv_block_bytes(1, dtype)
    state = 2 * batch * spec.state_page_bytes(dtype, state_dtype)
    return {"weights": weights, "untouched_experts": untouched, "kv": kv, "state": state,
            "total": weights + kv + state}


def decode_cache(model, batch: int, max_len: int, device: str) -> dict:
    """``LLM`` cache arguments for ``batch`` decoding rows: ``3 x batch + 8`` state pages
    (each request's page, the page a step writes, the page a pipelined step writes ahead)
    in float32 where they fit beside what is allocated, else bfloat16, else None."""
    dtype = next(model.parameters()).dtype
    spec = model.cache_spec
    pages = 3 * batch + 8
    blocks = batch * (-(-max_len // 16)) + 8
    kv = blocks * spec.kv_block_bytes(16, dtype)
    if not device.startswith("cuda"):
        return {"num_state_pages": pages, "ssm_state_dtype": "float32"}
    free = torch.cuda.mem_get_info()[0]
    margin = 12 << 30  # activations of the ramp's prefill steps, graph pools, workspace
    for name, sd in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        if pages * spec.state_page_bytes(dtype, sd) + kv + margin <= free:
            return {"num_state_pages": pages, "ssm_state_dtype": name}
    return None


# --------------------------------------------------------------------------------------
# The MoE blocks' share of a decode step
# --------------------------------------------------------------------------------------


@torch.no_grad()
def moe_blocks_time(model, batch: int, device: str, reps: int = 20) -> dict:
    """Every MoE block of ``model`` on ``batch`` random rows (each block its own input
    rows, outputs dropped): replayed from one CUDA graph and timed with CUDA events (the
    host clock, eagerly, off CUDA), and its kernels' time from ``torch.profiler``."""
    blocks = moe_blocks(model)
    param = next(model.parameters())
    g = torch.Generator(device=device).manual_seed(batch)
    xs = [torch.randn(batch, model.config.hidden_size, device=device, generator=g)
          .to(param.dtype) for _ in blocks]

    def run():
        for block, x in zip(blocks, xs):
            block(x)

    fn, graph_error = run, None
    if device.startswith("cuda"):
        try:
            fn = capture(run).replay
        except Exception as e:  # the eager time still stands
            graph_error = f"{type(e).__name__}: {e}"
    t = bg._event_time(fn, reps, device)
    kernels = bg._profile_kernels(run, 3, device)
    return {"batch": batch, "blocks": len(blocks), "replay_s": t,
            "graph": graph_error is None and device.startswith("cuda"),
            "graph_error": graph_error, "kernel_s_total": kernels["kernel_s_total"],
            "top_kernels": kernels["top_kernels"][:8]}


def moe_share(model, decode_row: dict, device: str) -> dict:
    """The MoE blocks' share of the decode step of ``decode_row`` (a profiled
    :func:`bench_gpu.engine_decode` result)."""
    b = decode_row["batch"]
    moe = moe_blocks_time(model, b, device)
    out = {"batch": b, "moe_blocks": moe}
    graph = decode_row.get("modes", {}).get("graph") or decode_row
    out["engine_step_s"] = graph["median_step_s"]
    out["share_of_engine_step"] = moe["replay_s"] / graph["median_step_s"]
    prof = (decode_row.get("profile") or {}).get("triton_attention") or {}
    if "replay_s" in prof:
        out["step_replay_s"] = prof["replay_s"]
        out["share_of_step_replay"] = moe["replay_s"] / prof["replay_s"]
        out["step_kernel_s"] = prof["kernel_s_total"]
        out["share_of_step_kernels"] = moe["kernel_s_total"] / max(prof["kernel_s_total"], 1e-12)
    elif decode_row.get("profile"):
        out["profile_error"] = decode_row["profile"].get("error")
    return out


# --------------------------------------------------------------------------------------
# One shape
# --------------------------------------------------------------------------------------


def run_shape(name: str, args, env: dict, result: dict, save, workdir: Path) -> None:
    device, dtype, smoke = env["device_kind"], env["dtype"], args.smoke
    cfg = shape_config(name, smoke)
    out = result["shapes"][name] = {
        "title": SHAPES[name]["title"], "source": SHAPES[name]["source"], "config": cfg,
        "dtype": str(dtype), "random_weights": True, "errors": {}, "skipped": [],
        "budget_s": args.budget_s,
    }
    begin = time.perf_counter()

    def section(key, fn, needs_s: float = 0.0):
        """Run ``fn`` unless over this shape's budget (or the whole run's); errors are
        recorded and the rest goes on."""
        used = time.perf_counter() - begin
        total = time.perf_counter() - env["start"]
        if (used + needs_s > args.budget_s or total + needs_s > args.total_budget_s
                or any(key.startswith(k) for k in args.skip)):
            out["skipped"].append(key)
            print(f"[skip] {name}/{key}: over the time budget ({used:.0f}s of "
                  f"{args.budget_s:.0f}s) or asked", flush=True)
            return None
        t = time.perf_counter()
        try:
            value = fn()
        except Exception as e:  # keep every other section's numbers
            out["errors"][key] = f"{type(e).__name__}: {e}\n{bg._portable_traceback()}"
            print(f"[error] {name}/{key}: {type(e).__name__}: {e}", flush=True)
            value = None
        bg.free_memory(device)
        print(f"[done] {name}/{key} in {time.perf_counter() - t:.1f}s", flush=True)
        out.setdefault("section_s", {})[key] = time.perf_counter() - t
        save()
        return value

    bandwidth = (result.get("copy_bandwidth") or {}).get("bytes_per_s", float("nan"))
    rate = (result.get("matmul") or {}).get("flops_per_s", float("nan"))
    graphs_mode = None if device == "cuda" else False
    # Rough device seconds of the costlier sections (none in the smoke run): a section
    # that would run past the budget is skipped rather than started.
    needs = (lambda s: 0.0) if smoke else (lambda s: s)
    path = workdir / name / "full"
    built = section("build", lambda: build_ours(cfg, device, dtype, path), needs(10))
    if built is None:
        return
    model, mcfg = built
    vocab = mcfg.vocab_size
    mb = bg.model_bytes(model)
    out["model"] = {
        **mb, "active_weights": model.num_active_weights(),
        "layer_types": list(mcfg.layer_types),
        "state_page_bytes_float32": model.cache_spec.state_page_bytes(dtype, torch.float32),
        "state_page_bytes_bfloat16": model.cache_spec.state_page_bytes(dtype, torch.bfloat16),
        "kv_bytes_per_token": model.cache_spec.kv_block_bytes(1, dtype),
    }
    if device == "cuda":
        out["model"]["gpu_memory_allocated_after_build"] = torch.cuda.memory_allocated()
    out["decode"] = []
    for b in args.batches:
        def ours(b=b):
            max_len = args.prompt + 3 * (args.warmup_steps + args.steps) + b // 4 + 64
            cache = decode_cache(model, b, max_len, device)
            if cache is None:
                return {"batch": b, "skipped": "state pages do not fit beside the weights"}
            r = bg.engine_decode(model, path, device, dtype, b, args.prompt,
                                 args.warmup_steps, args.steps, vocab, seed=b,
                                 enforce_eager=graphs_mode, llm_kw=cache,
                                 profile=bool(moe_blocks(model)) and b == args.profile_batch)
            state_dtype = getattr(torch, cache["ssm_state_dtype"])
            context = args.prompt + args.warmup_steps + args.steps
            touched = touched_experts(model, b)
            r["ssm_state_dtype"] = cache["ssm_state_dtype"]
            r["num_state_pages"] = cache["num_state_pages"]
            r["experts_touched"] = touched
            nbytes = step_bytes(model, b, context, state_dtype,
                                touched["measured_mean"] if touched else None)
            r["roofline_bytes_per_step"] = nbytes
            r["roofline_step_s"] = nbytes["total"] / bandwidth
            r["roofline_tokens_per_s"] = b / r["roofline_step_s"]
            for m in [r, *r["modes"].values()]:
                m["fraction_of_roofline"] = m["tokens_per_s"] / r["roofline_tokens_per_s"]
            if touched:
                # The same roofline under uniform routing (the expectation, not measured).
                u = step_bytes(model, b, context, state_dtype, touched["uniform_expectation"])
                r["roofline_tokens_per_s_uniform_routing"] = b / (u["total"] / bandwidth)
            return r

        r = section(f"decode_ours_b{b}", ours, needs(5 + b / 16))
        if r:
            out["decode"].append(r)
    if moe_blocks(model):
        row = next((r for r in out["decode"] if r.get("batch") == args.profile_batch
                    and "modes" in r), None)
        if row is None:
            out["skipped"].append("moe_share (no decode row at --profile-batch)")
        else:
            out["moe_share"] = section("moe_share", lambda: moe_share(model, row, device))
    tails = (16,) if smoke else (128,)
    out["ttft"] = section("ttft", lambda: bg.ttft(
        model, path, device, dtype, args.ttft_prompt, args.ttft_cached, args.ttft_interval,
        vocab, seed=7, tails=tails), needs(20))
    out["prefill"] = section("prefill", lambda: bg.prefill_throughput(
        model, path, device, dtype, args.prefill_prompts, args.prefill_len, vocab, 3, rate,
        args.prefill_max_s), needs(15))
    model = built = None  # noqa: F841
    bg.free_memory(device)
    # GPU bf16 against CPU float32 greedy tokens on a tiny model of the same family (the
    # smoke run: two prompts of eight tokens, still a batched step through every form).
    arch, layers, overrides = SHAPES[name]["tiny_family"]
    size = {"prompts": 2, "new_tokens": 8} if args.smoke else {"prompts": 32}
    out["agreement"] = section("agreement", lambda: bg.agreement(
        device, "bfloat16" if device == "cuda" else "float32", workdir / name, arch=arch,
        layers=layers, **size, **overrides), needs(20))

    # transformers' baseline and the checkpoint load, on the truncated shape.
    layers = SHAPES[name]["truncated_layers"]
    tcfg = shape_config(name, smoke, layers)
    tpath = workdir / name / "truncated"
    out["truncated"] = {"layers": layers, "layer_types": None, "decode_ours": [],
                        "decode_transformers": []}
    trunc = out["truncated"]

    def write_and_load():
        hf = build_hf(tcfg, device, dtype)
        bg.sync(device)
        t = time.perf_counter()
        hf.save_pretrained(tpath)
        write_s = time.perf_counter() - t
        ours_t = load_model(tpath, dtype=dtype, device=device)
        bg.sync(device)
        st = ours_t.load_stats
        files = sorted(p.name for p in tpath.glob("*.safetensors"))
        return hf, ours_t, {"bytes": st.bytes_read, "files": st.files, "load_s": st.seconds,
                            "gb_per_s": st.gb_per_s, "write_s": write_s,
                            "shard_names": files[:3],
                            "note": "transformers' save_pretrained naming; files just "
                                    "written, so the page cache is likely warm"}

    loaded = section("truncated_checkpoint", write_and_load, needs(30))
    if loaded is not None:
        hf, ours_t, trunc["load"] = loaded
        trunc["transformers_model"] = {
            "class": type(hf).__name__,
            "dtypes": sorted({str(p.dtype) for p in hf.parameters()}),
            "attn_implementation": getattr(hf.config, "_attn_implementation", None),
            "experts_implementation": getattr(hf.config, "_experts_implementation", None),
        }
        trunc["layer_types"] = list(ours_t.config.layer_types)
        trunc["parameters"] = bg.model_bytes(ours_t)["parameters"]
        for b in args.hf_batches:
            r = section(f"decode_transformers_truncated_b{b}", lambda b=b: bg.hf_decode(
                hf, device, b, args.prompt, args.hf_new_tokens, vocab, b))
            if r:
                trunc["decode_transformers"].append(r)
        for b in args.hf_batches:
            r = section(f"decode_ours_truncated_b{b}", lambda b=b: bg.engine_decode(
                ours_t, tpath, device, dtype, b, args.prompt, args.warmup_steps, args.steps,
                vocab, seed=b, enforce_eager=graphs_mode))
            if r:
                trunc["decode_ours"].append(r)
        hf = ours_t = loaded = None  # noqa: F841
    shutil.rmtree(tpath, ignore_errors=True)
    bg.free_memory(device)
    ours_by_b = {r["batch"]: r for r in trunc["decode_ours"]}
    out["ratios"] = {
        "ours_over_transformers_truncated": {
            r["batch"]: ours_by_b[r["batch"]]["tokens_per_s"] / r["tokens_per_s"]
            for r in trunc["decode_transformers"] if r["batch"] in ours_by_b},
        "fraction_of_decode_roofline": {
            r["batch"]: r["fraction_of_roofline"] for r in out["decode"] if "modes" in r},
        "ttft_cached_speedup": (out["ttft"] or {}).get("speedup"),
        "prefill_fraction_of_roofline": (out["prefill"] or {}).get("fraction_of_roofline"),
    }
    out["elapsed_s"] = time.perf_counter() - begin


def print_shape(name: str, s: dict) -> None:
    print(f"\n== {name}: {s['title']}")
    m = s.get("model") or {}
    if m:
        print(f"  {m['parameters'] / 1e9:.2f}B parameters ({m['active_weights'] / 1e9:.2f}B "
              f"active, embedding/LM head excluded), state page "
              f"{m['state_page_bytes_float32'] / 1e6:.1f} MB float32")
    for r in s.get("decode", []):
        if "modes" not in r:
            print(f"  decode b{r['batch']}: {r.get('skipped')}")
            continue
        t = r.get("experts_touched")
        extra = (f", experts touched {t['measured_mean']:.1f}/{t['num_experts']} "
                 f"(uniform {t['uniform_expectation']:.1f})") if t else ""
        print(f"  decode b{r['batch']:>3} ({r['mode']}, state {r['ssm_state_dtype']}): "
              f"{r['tokens_per_s']:9.1f} tok/s, roofline {r['roofline_tokens_per_s']:9.1f} "
              f"({100 * r['fraction_of_roofline']:.0f}%){extra}")
    ms = s.get("moe_share")
    if ms:
        print(f"  MoE blocks at b{ms['batch']}: {1e3 * ms['moe_blocks']['replay_s']:.2f} ms of a "
              f"{1e3 * ms['engine_step_s']:.2f} ms step ({100 * ms['share_of_engine_step']:.0f}%)"
              + (f"; kernels {100 * ms['share_of_step_kernels']:.0f}%"
                 if "share_of_step_kernels" in ms else ""))
    t = s.get("ttft")
    if t:
        sp = t.get("cached_split") or {}
        print(f"  TTFT {t['prompt_len']}: cold {t['cold_s']:.3f}s, {t['cached_len']} cached "
              f"{t['cached_s']:.3f}s ({t['speedup']:.1f}x; short-row graph in "
              f"{sp.get('short_graph_steps', 0)} of {sp.get('cached_runs', 0)} runs)")
        if sp:
            print(f"    cached step: wall {1e3 * sp['wall_s']:.1f} ms = kernels "
                  f"{1e3 * sp['kernel_s']:.1f} ms + host {1e3 * sp['host_s']:.1f} ms")
        for err in sp.get("graph_capture_errors", [])[:3]:
            print(f"    graph capture error: {err}")
    p = s.get("prefill")
    if p:
        print(f"  prefill {p['prompts_run']} x {p['prompt_len']}: {p['tokens_per_s']:.0f} tok/s, "
              f"{100 * p['fraction_of_roofline']:.0f}% of the FLOP roofline")
    a = s.get("agreement")
    if a:
        f32 = (a.get("float32_on_device") or {}).get("positional_agreement")
        print(f"  agreement with CPU float32 (tiny model): {a['dtype']} "
              f"{a['positional_agreement']:.3f}" + (f", float32 {f32:.3f}" if f32 else ""))
    tr = s.get("truncated") or {}
    if tr.get("load"):
        ld = tr["load"]
        print(f"  truncated ({tr['layers']} layers) checkpoint: {ld['bytes'] / 1e9:.2f} GB "
              f"loaded in {ld['load_s']:.2f}s ({ld['gb_per_s']:.2f} GB/s)")
    for b, x in (s.get("ratios") or {}).get("ours_over_transformers_truncated", {}).items():
        print(f"  truncated b{b}: ours / transformers = {x:.1f}x")
    if s.get("skipped"):
        print(f"  skipped: {', '.join(s['skipped'])}")
    if s.get("errors"):
        print(f"  errors in: {', '.join(s['errors'])}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--out", type=Path, default=None,
                    help="default benchmarks/results/models_h200.json "
                         "(models_smoke.json with --smoke)")
    ap.add_argument("--budget-s", type=float, default=160.0,
                    help="per shape: sections that would start after this many seconds of "
                         "the shape are skipped")
    ap.add_argument("--total-budget-s", type=float, default=530.0,
                    help="the whole run: no section starts after this many seconds")
    ap.add_argument("--batches", type=str, default="1,16,64,256")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--profile-batch", type=int, default=64,
                    help="the decode batch whose MoE share is measured")
    ap.add_argument("--hf-batches", type=str, default="1,16")
    ap.add_argument("--hf-new-tokens", type=int, default=12)
    ap.add_argument("--ttft-prompt", type=int, default=8192)
    ap.add_argument("--ttft-cached", type=int, default=8064)
    ap.add_argument("--ttft-interval", type=int, default=64)
    ap.add_argument("--prefill-prompts", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--prefill-max-s", type=float, default=30.0,
                    help="run fewer prompts if the one-prompt warm-up says all would "
                         "take longer")
    ap.add_argument("--matmul-n", type=int, default=8192)
    ap.add_argument("--skip", type=str, default="",
                    help="comma-separated section names (or prefixes) not to run")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    if args.smoke:
        device, dtype = "cpu", torch.float32
        args.batches, args.hf_batches, args.profile_batch = "1,2", "1,2", 2
        args.prompt, args.warmup_steps, args.steps, args.hf_new_tokens = 12, 1, 2, 3
        args.ttft_prompt, args.ttft_cached, args.ttft_interval = 80, 64, 16
        args.prefill_prompts, args.prefill_len, args.matmul_n = 2, 32, 128
        bw_bytes = 16 << 20
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --smoke for the CPU check", file=sys.stderr)
            return 2
        device, dtype = "cuda", torch.bfloat16
        bw_bytes = 4 << 30
    args.batches = [int(b) for b in str(args.batches).split(",") if b]
    args.hf_batches = [int(b) for b in str(args.hf_batches).split(",") if b]
    args.skip = [k for k in args.skip.split(",") if k]
    out_path = args.out or ROOT / "benchmarks/results" / (
        "models_smoke.json" if args.smoke else "models_h200.json")
    import transformers
    import triton

    from hybridserve.kernels import ssd_varlen

    result: dict = {
        "benchmark": "bench_models",
        "env": {
            "device": torch.cuda.get_device_name() if device == "cuda"
            else platform.processor() or platform.machine(),
            "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "commit": git_commit(), "fla_core": ssd_varlen.fla_version(), "smoke": args.smoke,
        },
        "config": {k: (portable_path(v) if isinstance(v, Path) else v)
                   for k, v in vars(args).items()},
        "errors": {}, "shapes": {},
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save():
        result["elapsed_s"] = time.perf_counter() - start
        out_path.write_text(json.dumps(result, indent=2, default=str))

    torch.manual_seed(0)
    for key, fn in (("copy_bandwidth", lambda: bg.copy_bandwidth(device, bw_bytes)),
                    ("matmul", lambda: bg.matmul_rate(device, dtype, args.matmul_n))):
        try:
            result[key] = fn()
        except Exception as e:
            result["errors"][key] = f"{type(e).__name__}: {e}"
            result[key] = None
    save()
    env = {"device_kind": device, "dtype": dtype, "start": start}
    workdir = Path(tempfile.mkdtemp(prefix="bench_models_"))
    try:
        for name in args.shapes:
            try:
                run_shape(name, args, env, result, save, workdir)
            except Exception as e:  # one shape's failure keeps the others
                result["errors"][name] = f"{type(e).__name__}: {e}\n{bg._portable_traceback()}"
                print(f"[error] {name}: {type(e).__name__}: {e}", flush=True)
            bg.free_memory(device)
            shutil.rmtree(workdir / name, ignore_errors=True)
            save()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    save()
    bw, mm = result.get("copy_bandwidth"), result.get("matmul")
    print(f"\n{result['env']['device']}, torch {torch.__version__}, triton {triton.__version__}, "
          f"transformers {transformers.__version__}")
    if bw:
        print(f"copy bandwidth {bw['bytes_per_s'] / 1e12:.2f} TB/s (read + write)")
    if mm and not math.isnan(mm["flops_per_s"]):
        print(f"matmul {mm['n']}^3: {mm['flops_per_s'] / 1e12:.0f} TFLOP/s")
    for name, s in result["shapes"].items():
        print_shape(name, s)
    bad = result["errors"] or any(s["errors"] for s in result["shapes"].values())
    print(f"wrote {out_path} in {time.perf_counter() - start:.0f}s"
          + (" (with errors)" if bad else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
