"""Mixture-of-experts models against transformers, and their checkpoints' expert layouts.

Tiny random Granite 4.0-H MoE, Nemotron-H MoE and Qwen3-Next MoE checkpoints (several
experts, top-k >= 2; Nemotron-H with groups, a non-zero correction bias, a shared expert,
dense ``-`` layers beside ``E`` layers, and the latent variant; Qwen3-Next with its gated
shared expert and a dense layer among sparse ones; Qwen3.5-MoE, experts in every layer)
are loaded both ways: all-position logits of
a packed multi-row forward within 1e-4 relative, and a prefill + 32 greedy tokens through
paged caches equal to ``generate``. The grouped Triton path, forced through the whole
model under the interpreter, gives the loop's logits. The loader accepts fused,
per-expert and already stacked expert names, across shards, and names what is missing.
"""

from __future__ import annotations

import json

import pytest
import torch
from paged_driver import PagedDriver
from safetensors.torch import load_file, save_file

from hybridserve.config import KernelPolicy
from hybridserve.models import CheckpointError, load_model
from hybridserve.models.loader import with_kernel_policy
from hybridserve.testing.tiny_models import make_tiny_checkpoint

transformers = pytest.importorskip("transformers")

HF_CLASSES = {
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
}

GRANITE_MOE = dict(num_local_experts=6, num_experts_per_tok=3, intermediate_size=48)
NEMOTRON_MOE = dict(
    n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
    routed_scaling_factor=2.5, norm_topk_prob=True,
)

CASES = [
    ("granitemoehybrid", "MAMMA", GRANITE_MOE),
    ("granitemoehybrid", "AMMA", dict(GRANITE_MOE, num_experts_per_tok=2, mamba_n_groups=4)),
    ("nemotron_h", "ME*-ME", NEMOTRON_MOE),
    ("nemotron_h", "*EM-E", dict(NEMOTRON_MOE, moe_latent_size=24, norm_topk_prob=False)),
    # Gated DeltaNet layers ("M"); layer 1 keeps its dense MLP (mlp_only_layers).
    ("qwen3_next", "MMAM", dict(num_experts=8, num_experts_per_tok=3, mlp_only_layers=[1])),
    ("qwen3_5_moe", "AMMA", dict(num_experts_per_tok=3)),
]


def _ids(case):
    arch, layers, extra = case
    return f"{arch}-{layers}" + ("-latent" if extra.get("moe_latent_size") else "")


@pytest.fixture(scope="module", params=CASES, ids=_ids)
def ckpt(request, tmp_path_factory):
    arch, layers, extra = request.param
    seed = 40 + CASES.index(request.param)
    path = make_tiny_checkpoint(
        arch, tmp_path_factory.mktemp(arch), seed=seed, layers=layers, **extra
    )
    return arch, path


@pytest.fixture(scope="module")
def pair(ckpt):
    arch, path = ckpt
    ref = getattr(transformers, HF_CLASSES[arch]).from_pretrained(path, attn_implementation="eager")
    return load_model(path), ref.eval()


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_packed_prefill_logits_match_transformers(pair):
    ours, ref = pair
    prompts = _prompts(int(torch.randint(0, 2**31 - 1, ())), (1, 6, 19, 33))
    logits, _ = PagedDriver(ours).step(list(enumerate(prompts)))
    start = 0
    for p in prompts:
        with torch.no_grad():
            expected = ref(torch.tensor([p])).logits[0].float()
        got = logits[start : start + len(p)]
        start += len(p)
        assert _rel_err(got, expected) < 1e-4, f"prompt of {len(p)} tokens"


def test_greedy_decode_matches_generate(pair):
    ours, ref = pair
    (prompt,) = _prompts(int(torch.randint(0, 2**31 - 1, ())), (13,))
    with torch.no_grad():
        expected = ref.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert PagedDriver(ours).greedy(0, prompt, 32) == expected


def test_routing_reaches_many_experts(pair):
    """The checkpoints exercise routing: tokens spread over the experts (no collapse onto
    a few, which would let a wrong router pass by luck)."""
    ours, _ = pair
    x = torch.randn(256, ours.config.hidden_size, generator=torch.Generator().manual_seed(0))
    routers = [m for m in ours.modules() if type(m).__name__ == "Router"]
    assert len(routers) == len(ours.config.moe_layers)
    for router in routers:
        with torch.no_grad():
            ids, _ = router(x)
        counts = torch.bincount(ids.flatten(), minlength=ours.config.moe.num_experts)
        assert (counts > 0).all(), counts.tolist()


def test_grouped_kernels_through_the_whole_model(pair, monkeypatch):
    ours, _ = pair
    prompts = _prompts(int(torch.randint(0, 2**31 - 1, ())), (3, 11))
    loop, _ = PagedDriver(ours).step(list(enumerate(prompts)))
    grouped, _ = PagedDriver(
        with_kernel_policy(ours, KernelPolicy(moe="triton"))
    ).step(list(enumerate(prompts)))
    assert _rel_err(grouped, loop) < 1e-5


# --------------------------------------------------------------------------------------
# Expert weight layouts in checkpoints
# --------------------------------------------------------------------------------------


def _logits(model, tokens):
    return PagedDriver(model).step([(0, tokens)])[0]


def test_published_expert_names_are_what_save_pretrained_writes(ckpt):
    arch, path = ckpt
    names = set(load_file(str(path / "model.safetensors")))
    if arch == "granitemoehybrid":
        assert "model.layers.0.block_sparse_moe.input_linear.weight" in names
        assert "model.layers.0.block_sparse_moe.router.layer.weight" in names
    elif arch == "qwen3_5_moe":
        assert any(".mlp.experts." in n for n in names)
        assert "model.layers.0.mlp.shared_expert_gate.weight" in names
    elif arch == "qwen3_next":
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in names
        assert "model.layers.0.mlp.shared_expert_gate.weight" in names
        assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense layer
    else:
        assert any(".mixer.experts.0.up_proj.weight" in n for n in names)
        assert any(".mixer.gate.e_score_correction_bias" in n for n in names)


def test_stacked_names_and_shards_load_the_same(ckpt, tmp_path):
    """The model's own stacked names (as a transformers 5 checkpoint saved without the
    reverse mapping would carry), split over shards so that one expert's parts sit in
    different files, give the same model."""
    _, path = ckpt
    model = load_model(path)
    tokens = torch.randint(3, 256, (10,)).tolist()
    expected = _logits(model, tokens)
    # Written under the file's prefix where the family's files have one (backbone.*,
    # model.language_model.*).
    on_disk, in_model = (model.checkpoint_prefixes or (("model.", "model."),))[0]
    stacked = {
        (on_disk + k[len(in_model):] if k.startswith(in_model) else k): v
        for k, v in model.state_dict().items()
    }
    out = tmp_path / "stacked"
    out.mkdir()
    (out / "config.json").write_text((path / "config.json").read_text())
    save_file(stacked, str(out / "model.safetensors"))
    torch.testing.assert_close(_logits(load_model(out), tokens), expected, rtol=0, atol=0)

    weights = load_file(str(path / "model.safetensors"))
    names = sorted(weights)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((path / "config.json").read_text())
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(sharded / file))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    again = load_model(sharded)
    assert again.load_stats.files == 2
    assert again.load_stats.bytes_read == sum(t.nbytes for t in weights.values())
    torch.testing.assert_close(_logits(again, tokens), expected, rtol=0, atol=0)


def test_per_expert_gate_and_up_are_stacked_into_gate_up(tmp_path):
    """Granite written with one gate_proj / up_proj / down_proj per expert (the Mixtral /
    Qwen layout) stacks into the same gate_up_proj as the fused file."""
    path = make_tiny_checkpoint("granitemoehybrid", tmp_path / "g", layers="MA", **GRANITE_MOE)
    fused = load_file(str(path / "model.safetensors"))
    split = {}
    for name, t in fused.items():
        base = name.removesuffix(".input_linear.weight").removesuffix(".output_linear.weight")
        if name.endswith("block_sparse_moe.input_linear.weight"):
            gate, up = t.chunk(2, dim=1)
            for j in range(t.shape[0]):
                split[f"{base}.experts.{j}.gate_proj.weight"] = gate[j].clone()
                split[f"{base}.experts.{j}.up_proj.weight"] = up[j].clone()
        elif name.endswith("block_sparse_moe.output_linear.weight"):
            for j in range(t.shape[0]):
                split[f"{base}.experts.{j}.down_proj.weight"] = t[j].clone()
        else:
            split[name] = t
    out = tmp_path / "split"
    out.mkdir()
    (out / "config.json").write_text((path / "config.json").read_text())
    save_file(split, str(out / "model.safetensors"))
    a, b = load_model(path), load_model(out)
    for name, t in a.state_dict().items():
        assert torch.equal(t, b.state_dict()[name]), name


def _nemotron_ckpt(tmp_path):
    return make_tiny_checkpoint("nemotron_h", tmp_path / "n", layers="ME", **NEMOTRON_MOE)


def test_missing_or_extra_expert_is_named(tmp_path):
    path = _nemotron_ckpt(tmp_path)
    weights = load_file(str(path / "model.safetensors"))
    gone = dict(weights)
    del gone["backbone.layers.1.mixer.experts.5.up_proj.weight"]
    save_file(gone, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"expert 5 of 'model\.layers\.1\.mixer\.experts\.up_proj' is missing"):
        load_model(path)
    extra = dict(weights)
    extra["backbone.layers.1.mixer.experts.8.up_proj.weight"] = weights[
        "backbone.layers.1.mixer.experts.0.up_proj.weight"
    ].clone()
    save_file(extra, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="names expert 8, but config.json has 8 experts"):
        load_model(path)
    bad = dict(weights)
    bad["backbone.layers.1.mixer.experts.2.down_proj.weight"] = torch.zeros(3, 3)
    save_file(bad, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"experts\.2\.down_proj\.weight' has shape \[3, 3\]"):
        load_model(path)
    both = dict(weights)
    both["backbone.layers.1.mixer.experts.down_proj"] = torch.zeros(8, 64, 32)
    save_file(both, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="given more than once"):
        load_model(path)


def test_correction_bias_stays_float32_in_low_precision(tmp_path, caplog):
    path = _nemotron_ckpt(tmp_path)
    with caplog.at_level("INFO", logger="hybridserve.models"):
        model = load_model(path, dtype=torch.bfloat16)
    assert "GB/s" in caplog.text
    bias = model.model.layers[1].mixer.gate.e_score_correction_bias
    assert bias.dtype == torch.float32
    on_disk = load_file(str(path / "model.safetensors"))
    assert torch.equal(bias, on_disk["backbone.layers.1.mixer.gate.e_score_correction_bias"])
    assert model.model.layers[1].mixer.experts.up_proj.dtype == torch.bfloat16


def test_active_weights_count_the_experts_a_token_reaches(pair):
    """The engine's prefill FLOPs (FLOP-aware eviction, the benchmarks' roofline) count a
    token's top-k experts, not all of them."""
    ours, _ = pair
    moe = ours.config.moe
    named = dict(ours.named_parameters())
    dense = sum(p.numel() for n, p in named.items()
                if "embed" not in n and "lm_head" not in n and ".experts." not in n)
    routed = sum(p.numel() for n, p in named.items() if ".experts." in n)
    assert routed > 0 and moe.top_k < moe.num_experts
    assert ours.num_active_weights() == round(dense + routed * moe.top_k / moe.num_experts)
