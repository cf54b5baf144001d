"""ModelConfig: normalisation of the three architectures' config.json, quirks, and errors."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from hybridserve.models import config as config_module
from hybridserve.models.config import (
    ATTENTION,
    MAMBA,
    MLP,
    MOE,
    SIGMOID_GROUPED,
    SOFTMAX_THEN_TOPK,
    TOPK_THEN_SOFTMAX,
    ConfigError,
    ModelConfig,
)
from hybridserve.testing.tiny_models import make_tiny_checkpoint


def _granite(**changes):
    base = {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "vocab_size": 100,
        "hidden_size": 32,
        "num_hidden_layers": 3,
        "layer_types": ["mamba", "attention", "mamba"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 0,
        "shared_intermediate_size": 48,
        "mamba_n_heads": 4,
        "mamba_n_groups": 2,
        "mamba_d_state": 8,
        "position_embedding_type": "rope",
        "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"},
        "attention_multiplier": 0.0078125,
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "logits_scaling": 8.0,
        "time_step_limit": [0.0, {"__float__": "Infinity"}],
        "eos_token_id": [100257, 100261],
        "dtype": "bfloat16",
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not ...}


def _nemotron(**changes):
    base = {
        "architectures": ["NemotronHForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 32,
        "hybrid_override_pattern": "M-M*-",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "n_groups": 2,
        "ssm_state_size": 8,
        "time_step_min": 0.01,
        "time_step_limit": [0.0, 0.5],
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not ...}


def test_granite_normalised():
    c = ModelConfig.from_dict(_granite())
    assert c.architecture == "GraniteMoeHybridForCausalLM"
    assert c.layer_types == (MAMBA, ATTENTION, MAMBA) and c.layer_has_mlp
    assert c.attention_layers == (1,) and c.mamba_layers == (0, 2) and c.num_layers == 3
    a = c.attention
    assert (a.num_heads, a.num_kv_heads, a.head_dim) == (4, 2, 8)
    assert a.scale == 0.0078125 and a.rope_theta == 5000.0 and a.rotary_dim == 8
    m = c.mamba
    assert (m.n_heads, m.head_dim, m.n_groups, m.d_state, m.d_conv) == (4, 16, 2, 8, 4)
    assert m.intermediate_size == 64 and m.conv_dim == 64 + 2 * 2 * 8
    assert m.time_step_limit == (0.0, math.inf)
    assert c.mlp.kind == "gated_fused" and c.mlp.intermediate_size == 48
    assert (c.embedding_multiplier, c.residual_multiplier, c.logits_scaling) == (12.0, 0.22, 8.0)
    assert c.eos_token_ids == (100257, 100261) and c.torch_dtype == "bfloat16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.vocab_size = 5


def test_granite_legacy_rope_keys_and_nope():
    c = ModelConfig.from_dict(_granite(rope_parameters=..., rope_theta=1234.0))
    assert c.attention.rope_theta == 1234.0
    c = ModelConfig.from_dict(_granite(position_embedding_type=None))
    assert c.attention.rope_theta is None and c.attention.rotary_dim == 0


def test_nemotron_pattern_and_dt_limit():
    c = ModelConfig.from_dict(_nemotron())
    assert c.layer_types == (MAMBA, MLP, MAMBA, ATTENTION, MLP) and not c.layer_has_mlp
    assert c.attention.rope_theta is None and c.attention.scale == 8**-0.5
    assert c.mlp.kind == "plain" and c.mlp.activation == "relu2"
    # transformers ignores the file's time_step_limit for Nemotron-H.
    assert c.mamba.time_step_limit == (0.01, math.inf)
    assert c.norm_weight_in_fp32
    listed = ModelConfig.from_dict(
        _nemotron(
            hybrid_override_pattern=...,
            layers_block_type=["linear_attention", "mlp", "mamba", "full_attention", "mlp"],
        )
    )
    assert listed.layer_types == c.layer_types


def test_granite_experts():
    c = ModelConfig.from_dict(_granite(num_local_experts=6, num_experts_per_tok=3, intermediate_size=40))
    m = c.moe
    assert (m.routing, m.num_experts, m.top_k, m.intermediate_size) == (TOPK_THEN_SOFTMAX, 6, 3, 40)
    assert m.gated and m.activation == "silu" and m.shared_intermediate_size == 0
    assert c.moe_layers == (0, 1, 2)
    # shared_mlp stays each layer's dense MLP, beside the experts.
    assert all(c.layer_has_dense_mlp(i) for i in range(3)) and c.mlp.intermediate_size == 48
    # transformers' defaults when the keys are absent: 8 experts, top-2, width 11008.
    d = ModelConfig.from_dict(_granite(num_local_experts=...)).moe
    assert (d.num_experts, d.top_k, d.intermediate_size) == (8, 2, 11008)
    assert ModelConfig.from_dict(_granite()).moe is None


def test_nemotron_experts():
    c = ModelConfig.from_dict(
        _nemotron(
            hybrid_override_pattern="ME*E-",
            n_routed_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=24,
            moe_shared_expert_intermediate_size=40,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=False,
            moe_latent_size=12,
            mlp_bias=True,
        )
    )
    assert c.layer_types == (MAMBA, MOE, ATTENTION, MOE, MLP) and c.moe_layers == (1, 3)
    m = c.moe
    assert (m.routing, m.num_experts, m.top_k, m.intermediate_size) == (SIGMOID_GROUPED, 16, 4, 24)
    assert (m.n_group, m.topk_group, m.routed_scaling_factor) == (4, 2, 2.5)
    assert not m.gated and m.activation == "relu2" and not m.norm_topk_prob
    assert (m.shared_intermediate_size, m.latent_size, m.bias) == (40, 12, True)
    assert not any(c.layer_has_dense_mlp(i) for i in range(5))
    # The transformers attribute alias num_local_experts is read when n_routed_experts is absent.
    alias = ModelConfig.from_dict(_nemotron(hybrid_override_pattern="ME", num_local_experts=4))
    assert alias.moe.num_experts == 4 and alias.mlp is None


def test_qwen_sparse_layers():
    """The Qwen3-Next / Qwen3.5-MoE reading (for their architectures' parsers)."""
    r = config_module._Reader(
        {"num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 2,
         "mlp_only_layers": [3], "norm_topk_prob": False, "moe_intermediate_size": 16,
         "shared_expert_intermediate_size": 24},
        "x",
    )
    moe, layers = config_module._qwen_moe(r, 8, act="silu", always_normalise=False)
    assert layers == (1, 5, 7)
    assert (moe.routing, moe.shared_gate, moe.norm_topk_prob) == (SOFTMAX_THEN_TOPK, True, False)
    assert moe.shared_intermediate_size == 24 and moe.gated
    moe, layers = config_module._qwen_moe(r, 3, act="silu", always_normalise=True)
    assert layers == (0, 1, 2) and moe.norm_topk_prob


def test_bamba_partial_rotary_default_and_override(tmp_path):
    path = make_tiny_checkpoint("bamba", tmp_path / "b", layers="MAM")
    c = ModelConfig.from_pretrained(path)
    assert c.layer_types == (MAMBA, ATTENTION, MAMBA)
    assert c.attention.partial_rotary_factor == 0.5 and c.attention.rotary_dim == 8
    data = json.loads((path / "config.json").read_text())
    data["rope_parameters"] = {"rope_theta": 300.0, "partial_rotary_factor": 0.25}
    c = ModelConfig.from_dict(data)
    assert c.attention.rope_theta == 300.0 and c.attention.rotary_dim == 4
    del data["rope_parameters"]
    assert ModelConfig.from_dict(data).attention.partial_rotary_factor == 0.5


@pytest.mark.parametrize("arch", ["granitemoehybrid", "nemotron_h", "bamba"])
def test_tiny_checkpoints_parse(arch, tmp_path):
    c = ModelConfig.from_pretrained(make_tiny_checkpoint(arch, tmp_path / arch))
    assert c.vocab_size == 256 and c.hidden_size == 64
    assert c.mamba.n_groups == 2 and c.mamba.chunk_size == 8 and c.torch_dtype == "float32"
    assert ATTENTION in c.layer_types and MAMBA in c.layer_types


@pytest.mark.parametrize(
    "data,field,words",
    [
        (_granite(architectures=["LlamaForCausalLM"]), "architectures", "NemotronHForCausalLM"),
        (_granite(architectures=...), "architectures", "GraniteMoeHybridForCausalLM"),
        (_granite(num_local_experts=4, num_experts_per_tok=5), "num_experts_per_tok", "num_local_experts (4)"),
        (_granite(num_local_experts=-1), "num_local_experts", ">= 0"),
        (_granite(num_local_experts=4, intermediate_size=0), "intermediate_size", "> 0"),
        (_granite(hidden_size=...), "hidden_size", "missing"),
        (_granite(layer_types=["mamba", "mamba"]), "layer_types", "3 layer types"),
        (_granite(layer_types=["mamba", "conv", "mamba"]), "layer_types", "conv"),
        (_granite(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_type", "yarn"),
        (_granite(mamba_n_groups=3), "mamba_n_groups", "divide"),
        (_granite(time_step_limit=[1.0]), "time_step_limit", "[min, max]"),
        (_granite(hidden_act="tanh"), "hidden_act", "tanh"),
        (_granite(eos_token_id="x"), "eos_token_id", "integer"),
        (_nemotron(hybrid_override_pattern="M*EM", n_group=3), "n_group", "n_routed_experts"),
        (_nemotron(hybrid_override_pattern="ME", n_group=8), "n_group", "2 experts per group"),
        (_nemotron(hybrid_override_pattern="ME", n_group=4, topk_group=5), "topk_group", "n_group"),
        (
            _nemotron(hybrid_override_pattern="ME", n_group=4, topk_group=1, num_experts_per_tok=3),
            "num_experts_per_tok",
            "groups it may choose from",
        ),
        (_nemotron(hybrid_override_pattern="ME", moe_latent_size=0), "moe_latent_size", "positive"),
        (_nemotron(hybrid_override_pattern="ME", mlp_hidden_act="tanh"), "mlp_hidden_act", "tanh"),
        (_nemotron(hybrid_override_pattern="M?"), "hybrid_override_pattern", "'?'"),
        (_nemotron(hybrid_override_pattern=...), "layers_block_type", "missing"),
        (_nemotron(mamba_num_heads=...), "mamba_num_heads", "missing"),
    ],
)
def test_errors_name_file_field_and_fix(data, field, words):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(data, source="ckpt/config.json")
    msg = str(e.value)
    assert msg.startswith("ckpt/config.json: ") and field in msg and words in msg


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": [')
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.from_pretrained(tmp_path / "config.json")
    assert issubclass(ConfigError, ValueError)


def test_overrides_are_checked_for_consistency():
    c = ModelConfig.from_dict(_granite())
    mamba = dataclasses.replace(c.mamba, clamp_dt_in_single_token_step=True)
    assert c.with_overrides(mamba=mamba).mamba.clamp_dt_in_single_token_step
    with pytest.raises(ConfigError, match="ModelConfig.mamba"):
        c.with_overrides(mamba=None)
    with pytest.raises(ConfigError, match="ModelConfig.attention"):
        c.with_overrides(layer_types=(MAMBA, MAMBA, MAMBA))


def test_bamba_attn_layer_indices_checked(tmp_path):
    data = json.loads(
        (make_tiny_checkpoint("bamba", tmp_path / "b", layers="MA") / "config.json").read_text()
    )
    for bad in (5, [2], [True]):
        data["attn_layer_indices"] = bad
        with pytest.raises(ConfigError, match="attn_layer_indices"):
            ModelConfig.from_dict(data)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "data,field,words",
    [
        (_granite(num_hidden_layers=10**9, layer_types=...), "num_hidden_layers", "at most"),
        (_granite(num_hidden_layers=0, layer_types=[]), "num_hidden_layers", "> 0"),
        (_granite(mamba_chunk_size=0), "mamba_chunk_size", "> 0"),
        (_granite(mamba_chunk_size=-256), "mamba_chunk_size", "> 0"),
        (_granite(mamba_d_state=0), "mamba_d_state", "> 0"),
        (_granite(rms_norm_eps=NAN), "rms_norm_eps", "finite"),
        (_granite(rms_norm_eps=0.0), "rms_norm_eps", "> 0"),
        (_granite(rms_norm_eps=-1e-6), "rms_norm_eps", "> 0"),
        (_granite(logits_scaling=NAN), "logits_scaling", "finite"),
        (_granite(logits_scaling=INF), "logits_scaling", "finite"),
        (_granite(logits_scaling=0), "logits_scaling", "> 0"),
        (_granite(logits_scaling=-8.0), "logits_scaling", "> 0"),
        (_granite(embedding_multiplier=INF), "embedding_multiplier", "finite"),
        (_granite(residual_multiplier=0.0), "residual_multiplier", "> 0"),
        (_granite(attention_multiplier=NAN), "attention_multiplier", "finite"),
        (_granite(time_step_min=-0.1), "time_step_min", ">= 0"),
        (_granite(vocab_size=0), "vocab_size", "> 0"),
        (_granite(max_position_embeddings=-1), "max_position_embeddings", "> 0"),
        (_granite(rope_parameters={"rope_theta": NAN}), "rope_theta", "finite"),
        (_granite(rope_parameters={"rope_theta": 0.0}), "rope_theta", "> 0"),
        (_nemotron(chunk_size=0), "chunk_size", "> 0"),
        (_nemotron(layer_norm_epsilon=NAN), "layer_norm_epsilon", "finite"),
        (_nemotron(hybrid_override_pattern="M" * 5000), "hybrid_override_pattern", "at most"),
    ],
)
def test_absurd_or_non_finite_values_are_refused(data, field, words):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(data, source="ckpt/config.json")
    msg = str(e.value)
    assert msg.startswith("ckpt/config.json: ") and field in msg and words in msg


def test_a_billion_layers_is_refused_quickly(tmp_path):
    import time

    # JSON as a file may spell NaN and Infinity; a billion layers must not be listed.
    for arch, extra in (("GraniteMoeHybridForCausalLM", {}), ("BambaForCausalLM", {})):
        data = _granite(architectures=[arch], layer_types=..., num_hidden_layers=10**9, **extra)
        (tmp_path / "config.json").write_text(json.dumps(data))
        start = time.perf_counter()
        with pytest.raises(ConfigError, match="num_hidden_layers"):
            ModelConfig.from_pretrained(tmp_path)
        assert time.perf_counter() - start < 1.0
    qwen = {"architectures": ["Qwen3_5ForCausalLM"], "hidden_size": 32, "vocab_size": 100,
            "num_hidden_layers": 10**9}
    with pytest.raises(ConfigError, match="num_hidden_layers.*at most"):
        ModelConfig.from_dict(qwen)
    (tmp_path / "config.json").write_text(json.dumps(_granite(rms_norm_eps=NAN)))
    assert "NaN" in (tmp_path / "config.json").read_text()
    with pytest.raises(ConfigError, match="rms_norm_eps"):
        ModelConfig.from_pretrained(tmp_path)


def test_qwen3_5_moe_every_layer_sparse_without_a_dense_mlp():
    text = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8, "num_experts": 16, "num_experts_per_tok": 4,
            "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40,
            "norm_topk_prob": False}  # Qwen3.5-MoE renormalises whatever this says
    for data in ({"architectures": ["Qwen3_5MoeForCausalLM"], **text},
                 {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": text}):
        c = ModelConfig.from_dict(data)
        assert c.moe_layers == (0, 1, 2, 3) and c.mlp is None
        m = c.moe
        assert (m.routing, m.num_experts, m.top_k, m.norm_topk_prob, m.shared_gate) == (
            SOFTMAX_THEN_TOPK, 16, 4, True, True)
    with pytest.raises(ConfigError, match="num_experts"):
        ModelConfig.from_dict({"architectures": ["Qwen3_5MoeForCausalLM"], **text,
                               "num_experts": 0})
