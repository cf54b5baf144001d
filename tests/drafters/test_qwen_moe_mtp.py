"""The MTP heads of the Qwen mixture-of-experts targets (Qwen3-Next with ``num_experts >
0``, Qwen3.5-MoE and its vision-language wrapper): one full-attention decoder layer whose
MLP is the target's sparse block (router ``gate``, routed experts, ``shared_expert`` and
``shared_expert_gate``). Greedy output is the target's with the prefix cache off and on,
a head built to equal a context-free target has every draft accepted, the head computes
the published structure (a hand-written reference from the file's own tensors, every
expert reached), and the loader takes the published names (one tensor per expert, or
the stacked ``experts.gate_up_proj`` / ``experts.down_proj``) and names what is missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from spec_helpers import (
    assert_every_mtp_draft_accepted,
    assert_greedy_workloads_match,
    assert_mtp_drafts_match_dense,
    copy_checkpoint,
    motif_workload,
    output_tokens,
)

from hybridserve import LLM, SamplingParams
from hybridserve.drafters.mtp import MtpHead
from hybridserve.models.batch import ForwardBatch
from hybridserve.models.config import ModelConfig
from hybridserve.models.registry import model_class
from hybridserve.testing.tiny_models import make_tiny_checkpoint
from hybridserve.testing.tiny_mtp import add_mtp_head

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
EXPERTS = 8

# (tiny architecture, overrides, head written with stacked experts): Qwen3-Next's files
# keep one tensor per expert; some Qwen3.5-MoE files carry the stacked form.
TARGETS = {
    "qwen3_next": ("qwen3_next", dict(num_experts=EXPERTS), False),
    "qwen3_5_moe": ("qwen3_5_moe", {}, True),
}


def _mtp(d: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": d}


def _target(root: Path, which: str, seed: int) -> Path:
    """A GDN + attention target with experts in both layers, and a random MTP head."""
    arch, overrides, fused = TARGETS[which]
    path = make_tiny_checkpoint(arch, root, seed=seed, layers="MA", **overrides)
    return add_mtp_head(path, seed=seed, fused_experts=fused)


@pytest.fixture(scope="module", params=sorted(TARGETS))
def moe_mtp(request, tmp_path_factory):
    return request.param, _target(tmp_path_factory.mktemp(request.param), request.param, 3)


@pytest.fixture(scope="module")
def references(moe_mtp):
    llm = LLM(moe_mtp[1], enable_prefix_caching=False)
    return {s: output_tokens(llm.generate(motif_workload(s), GREEDY)) for s in (0, 1)}


# ---- greedy output ---------------------------------------------------------------------


# By default one case per draft length and target, the cache off for d = 1 and on for
# d = 3; the other two are ``slow``.
@pytest.mark.parametrize("caching,d", [
    pytest.param(c, d, marks=() if (c, d) in {(False, 1), (True, 3)} else pytest.mark.slow)
    for c in (False, True) for d in (1, 3)])
def test_greedy_identical_with_a_qwen_moe_mtp_head(caching, d, moe_mtp, references):
    _, path = moe_mtp
    llm = LLM(path, enable_prefix_caching=caching, state_interval=16, speculative_config=_mtp(d))
    head = llm.engine.drafter.head
    assert type(head).__name__ == "MtpHead"
    assert type(head.layers[0].mlp).__name__ == "MoEBlock"
    assert_greedy_workloads_match(llm, references, GREEDY, caching)


def test_qwen_moe_mtp_drafts_equal_a_from_scratch_computation(moe_mtp):
    """Every proposal (incremental catch-up from the hidden states handed over) equals
    the head run from scratch on the dense hidden states of the same prefix."""
    llm = LLM(moe_mtp[1], enable_prefix_caching=False, speculative_config=_mtp(3))
    assert_mtp_drafts_match_dense(llm, motif_workload(3), GREEDY)


def _context_free_equal_head(path: Path) -> Path:
    """Make the target context-free and its MTP head equal to it. Target: layer 0 (GDN,
    experts) adds nothing (zero ``out_proj`` and expert / shared-expert ``down_proj``),
    layer 1's attention output projection is zero, so its output at a position is a
    function of that position's token. Head: embedding rows of RMS 1 and
    ``pre_fc_norm_embedding`` undoing its epsilon (its zero-centred scale is
    ``sqrt(1 + eps)``), ``fc = [I, 0]`` (the hidden state is ignored), ``mtp.layers.0``
    the target's layer 1 (attention and experts), ``mtp.norm`` its ``norm``: slot ``t``
    computes the target at ``t + 1``, so every draft is the target's token."""
    file = path / "model.safetensors"
    eps = json.loads((path / "config.json").read_text())["rms_norm_eps"]
    w = load_file(str(file))
    e = w["model.embed_tokens.weight"]
    w["model.embed_tokens.weight"] = e / e.pow(2).mean(-1, keepdim=True).sqrt()
    w["model.layers.0.linear_attn.out_proj.weight"].zero_()
    for name in w:
        if name.startswith("model.layers.0.mlp.") and name.endswith("down_proj.weight"):
            w[name].zero_()
    w["model.layers.1.self_attn.o_proj.weight"].zero_()
    for name in [n for n in w if n.startswith("mtp.")]:
        del w[name]
    for name in [n for n in w if n.startswith("model.layers.1.")]:
        w["mtp.layers.0." + name.removeprefix("model.layers.1.")] = w[name].clone()
    hidden = e.shape[1]
    w["mtp.pre_fc_norm_embedding.weight"] = torch.full((hidden,), (1 + eps) ** 0.5 - 1)
    w["mtp.pre_fc_norm_hidden.weight"] = torch.zeros(hidden)
    w["mtp.fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
    w["mtp.norm.weight"] = w["model.norm.weight"].clone()
    save_file(w, str(file), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("which", sorted(TARGETS))
def test_context_free_head_equal_to_the_target_accepts_every_draft(which, tmp_path):
    path = _context_free_equal_head(_target(tmp_path / which, which, 6))
    assert_every_mtp_draft_accepted(path, (False, True), GREEDY)


# ---- the published structure -----------------------------------------------------------


def _zc_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen's zero-centred RMSNorm: the scale is ``1 + weight``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def _expert_weights(w: dict, prefix: str) -> list[tuple[torch.Tensor, ...]]:
    """``(gate_proj, up_proj, down_proj)`` of each routed expert under ``prefix`` as the
    file stores them: one tensor per expert, or stacked (gate rows, then up rows)."""
    fused = w.get(f"{prefix}.experts.gate_up_proj")
    if fused is not None:
        half = fused.shape[1] // 2
        down = w[f"{prefix}.experts.down_proj"]
        return [(fused[j, :half], fused[j, half:], down[j]) for j in range(fused.shape[0])]
    return [
        tuple(w[f"{prefix}.experts.{j}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
        for j in range(EXPERTS)
    ]


def _gated(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def _moe(x: torch.Tensor, w: dict, prefix: str, top_k: int, experts) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse block by hand: softmax over all experts, top-k renormalised, the
    weighted experts' sum, plus the shared expert scaled by sigmoid(shared_expert_gate)."""
    probs = torch.softmax(x @ w[f"{prefix}.gate.weight"].T, dim=-1)
    top, ids = probs.topk(top_k, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, j in zip(top[t], ids[t].tolist()):
            out[t] += weight * _gated(x[t : t + 1], *experts[j])[0]
    shared = _gated(x, *(w[f"{prefix}.shared_expert.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")))
    return out + torch.sigmoid(x @ w[f"{prefix}.shared_expert_gate.weight"].T) * shared, ids


def test_qwen_moe_mtp_head_is_the_published_structure(moe_mtp):
    """24 one-slot rows (over one key, attention is ``o_proj(v * sigmoid(gate))``: no
    positions, no q/k norms) against a reference built from the checkpoint's own
    ``mtp.*`` tensors, not the loaded modules::

        x = fc(cat([pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)]))
        x += attention(layers.0.input_layernorm(x))
        x += moe(layers.0.post_attention_layernorm(x))       # gate, experts, shared expert
        y = norm(x)

    The rows reach every expert, so an expert loaded into another's place fails; the
    reference with two experts exchanged does not match."""
    which, path = moe_mtp
    llm = LLM(path, speculative_config=_mtp(1))
    head = llm.engine.drafter.head
    cfg = llm.model.config
    a, eps, hsz = cfg.attention, cfg.norm_eps, cfg.hidden_size
    w = {k.removeprefix("mtp."): v for k, v in load_file(str(path / "model.safetensors")).items()
         if k.startswith("mtp.")}
    g = torch.Generator().manual_seed(0)
    t = 24
    e, h = torch.randn(t, hsz, generator=g), torch.randn(t, hsz, generator=g)
    caches = head.cache_spec.allocate(t, 16, 1, torch.float32, torch.float32, "cpu")
    batch = ForwardBatch(
        query_start=list(range(t + 1)), num_computed=[0] * t,
        positions=torch.zeros(t, dtype=torch.long), context_lens=[1] * t,
        block_tables=torch.arange(t, dtype=torch.int32)[:, None],
        slot_mapping=torch.arange(t) * 16, state_in_page=[-1] * t, state_out_row=[],
        state_out_offset=[], state_out_page=[],
    )
    experts = _expert_weights(w, "layers.0.mlp")

    def reference(experts):
        x = torch.cat([_zc_rms(e, w["pre_fc_norm_embedding.weight"], eps),
                       _zc_rms(h, w["pre_fc_norm_hidden.weight"], eps)], -1) @ w["fc.weight"].T
        z = _zc_rms(x, w["layers.0.input_layernorm.weight"], eps)
        gate = (z @ w["layers.0.self_attn.q_proj.weight"].T).view(t, a.num_heads, 2 * a.head_dim)[..., a.head_dim:]
        v = (z @ w["layers.0.self_attn.v_proj.weight"].T).view(t, a.num_kv_heads, a.head_dim)
        v = v.repeat_interleave(a.num_heads // a.num_kv_heads, 1)
        x = x + (v * torch.sigmoid(gate)).reshape(t, -1) @ w["layers.0.self_attn.o_proj.weight"].T
        m, ids = _moe(_zc_rms(x, w["layers.0.post_attention_layernorm.weight"], eps), w,
                      "layers.0.mlp", cfg.moe.top_k, experts)
        return _zc_rms(x + m, w["norm.weight"], eps), ids

    with torch.inference_mode():
        y = head(e, h, batch, caches)
        expect, ids = reference(experts)
        assert set(ids.flatten().tolist()) == set(range(EXPERTS))
        assert torch.allclose(y, expect, atol=1e-5), (which, (y - expect).abs().max())
        exchanged = [experts[1], experts[0], *experts[2:]]
        assert not torch.allclose(y, reference(exchanged)[0], atol=1e-4)


def test_the_mtp_layer_is_sparse_where_the_targets_layer_0_is(moe_mtp):
    """Layer 0 of a one-layer stack: the sparse block under the target's own rule
    (``mlp_only_layers``, ``decoder_sparse_step``), else the dense MLP."""
    which, path = moe_mtp
    raw = json.loads((path / "config.json").read_text())
    cases = [({}, True)]
    if which == "qwen3_next":
        cases += [({"mlp_only_layers": [0]}, False), ({"decoder_sparse_step": 2}, False),
                  ({"mlp_only_layers": [1]}, True), ({"num_experts": 0}, False)]
    for change, sparse in cases:
        config = ModelConfig.from_dict({**raw, **change})
        with torch.device("meta"):
            names = set(MtpHead(model_class(config.architecture)(config)).state_dict())
        assert ("layers.0.mlp.experts.gate_up_proj" in names) == sparse, change
        assert ("layers.0.mlp.gate_proj.weight" in names) == (not sparse), change


# ---- the loader ------------------------------------------------------------------------


def _other_layout(w: dict) -> dict:
    """The head's routed experts rewritten in the other published layout (stacked <->
    one tensor per expert)."""
    prefix = "mtp.layers.0.mlp"
    was_fused = f"{prefix}.experts.gate_up_proj" in w
    experts = _expert_weights(w, prefix)
    for name in [n for n in w if n.startswith(prefix + ".experts.")]:
        del w[name]
    if was_fused:
        for j, (gate, up, down) in enumerate(experts):
            for p, v in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                w[f"{prefix}.experts.{j}.{p}.weight"] = v.contiguous()
    else:
        w[f"{prefix}.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in experts])
        w[f"{prefix}.experts.down_proj"] = torch.stack([d for *_, d in experts])
    return w


def test_loader_takes_the_published_names(moe_mtp, tmp_path):
    which, path = moe_mtp
    w = load_file(str(path / "model.safetensors"))
    expert_names = (
        ["mtp.layers.0.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts.down_proj"]
        if TARGETS[which][2] else
        [f"mtp.layers.0.mlp.experts.{j}.{p}.weight" for j in range(EXPERTS)
         for p in ("gate_proj", "up_proj", "down_proj")]
    )
    published = {
        "mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
        "mtp.norm.weight", "mtp.layers.0.input_layernorm.weight",
        "mtp.layers.0.post_attention_layernorm.weight",
        *(f"mtp.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")),
        "mtp.layers.0.mlp.gate.weight", "mtp.layers.0.mlp.shared_expert_gate.weight",
        *(f"mtp.layers.0.mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")),
        *expert_names,
    }
    # Every mtp.* tensor of the file is one of these, and each is loaded (strictly: the
    # loader refuses unknown names and names every missing one).
    assert {n for n in w if n.startswith("mtp.")} == published
    head = LLM(path, speculative_config=_mtp(1)).engine.drafter.head
    gate, up, down = _expert_weights(w, "mtp.layers.0.mlp")[7]
    experts = head.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj[7], torch.cat([gate, up]))
    assert torch.equal(experts.down_proj[7], down)
    assert torch.equal(head.layers[0].mlp.shared_expert_gate.weight, w["mtp.layers.0.mlp.shared_expert_gate.weight"])
    # The other layout of the same experts loads the same head.
    other = LLM(copy_checkpoint(path, tmp_path / "other", weights=_other_layout),
                speculative_config=_mtp(1)).engine.drafter.head
    for name, t in head.state_dict().items():
        assert torch.equal(other.state_dict()[name], t), name


def test_loader_names_what_is_missing_or_unknown(moe_mtp, tmp_path):
    which, path = moe_mtp
    fused = TARGETS[which][2]
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    where = rf"for the MTP head of {arch} \(speculative_config.method='mtp'\)"

    def drop(*names):
        def edit(w):
            for n in names:
                del w[n]
        return edit

    if fused:
        missing = drop("mtp.layers.0.mlp.experts.down_proj")
        message = r"missing weight\(s\) \['mtp.layers.0.mlp.experts.down_proj'\] required by the MTP head"
    else:
        missing = drop(*(f"mtp.layers.0.mlp.experts.3.{p}.weight" for p in ("gate_proj", "up_proj")))
        message = r"expert 3 of 'mtp.layers.0.mlp.experts.gate_up_proj' is missing .*" + where
    with pytest.raises(ValueError, match=message):
        LLM(copy_checkpoint(path, tmp_path / "a", weights=missing), speculative_config=_mtp(1))
    with pytest.raises(ValueError, match=r"missing weight\(s\) \['mtp.layers.0.mlp.shared_expert_gate.weight'\]"
                       r" required by the MTP head .*speculative_config"):
        LLM(copy_checkpoint(path, tmp_path / "b", weights=drop("mtp.layers.0.mlp.shared_expert_gate.weight")),
            speculative_config=_mtp(1))
    if not fused:
        half = drop("mtp.layers.0.mlp.experts.5.up_proj.weight")
        with pytest.raises(ValueError, match=r"expert 5 of 'mtp.layers.0.mlp.experts.gate_up_proj' is "
                           r"incomplete .*speculative_config"):
            LLM(copy_checkpoint(path, tmp_path / "c", weights=half), speculative_config=_mtp(1))

    def dense(w):  # a dense MLP where the head has experts
        w["mtp.layers.0.mlp.gate_proj.weight"] = torch.zeros(128, 64)

    with pytest.raises(ValueError, match=r"unexpected MTP weight\(s\) \['mtp.layers.0.mlp.gate_proj.weight'\]"):
        LLM(copy_checkpoint(path, tmp_path / "d", weights=dense), speculative_config=_mtp(1))
    # The target alone still loads (its loader skips mtp.*) and runs without speculation.
    assert LLM(path).generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids


def test_vision_language_checkpoint_keeps_the_head_at_top_level(tmp_path):
    """Qwen3_5MoeForConditionalGeneration: the language model under
    ``model.language_model.*`` and its config under ``text_config``, the head's ``mtp.*``
    at the top level as in the text checkpoint: the same drafts and outputs, which are
    the target's without speculation."""
    path = _target(tmp_path / "text", "qwen3_5_moe", 3)

    def wrap(raw):
        return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                "tie_word_embeddings": raw["tie_word_embeddings"], "text_config": raw}

    def rename(w):
        return {("model.language_model." + n.removeprefix("model.") if n.startswith("model.") else n): t
                for n, t in w.items()}

    vl = copy_checkpoint(path, tmp_path / "vl", weights=rename, config=wrap)
    ref = output_tokens(LLM(path, enable_prefix_caching=False).generate(motif_workload(0), GREEDY))
    stats = []
    for p in (path, vl):
        llm = LLM(p, enable_prefix_caching=False, speculative_config=_mtp(3))
        assert output_tokens(llm.generate(motif_workload(0), GREEDY)) == ref
        s = llm.stats()
        stats.append((s["spec_draft_tokens"], s["spec_accepted_tokens"]))
    assert llm.model.config.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert type(llm.engine.drafter.head.layers[0].mlp).__name__ == "MoEBlock"
    assert stats[0] == stats[1] and stats[0][0] > 0
