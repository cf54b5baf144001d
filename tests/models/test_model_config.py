"""ModelConfig: normalisation of the three architectures' config.json, quirks, and errors."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from hybridserve.models.config import ATTENTION, MAMBA, MLP, ConfigError, ModelConfig
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
        (_granite(num_local_experts=4), "num_local_experts", "not supported"),
        (_granite(num_local_experts=...), "num_local_experts", "not supported"),
        (_granite(hidden_size=...), "hidden_size", "missing"),
        (_granite(layer_types=["mamba", "mamba"]), "layer_types", "3 layer types"),
        (_granite(layer_types=["mamba", "conv", "mamba"]), "layer_types", "conv"),
        (_granite(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_type", "yarn"),
        (_granite(mamba_n_groups=3), "mamba_n_groups", "divide"),
        (_granite(time_step_limit=[1.0]), "time_step_limit", "[min, max]"),
        (_granite(hidden_act="tanh"), "hidden_act", "tanh"),
        (_granite(eos_token_id="x"), "eos_token_id", "integer"),
        (
            _nemotron(hybrid_override_pattern="M*EM"),
            "hybrid_override_pattern",
            "mixture-of-experts",
        ),
        (
            _nemotron(hybrid_override_pattern=..., layers_block_type=["moe"]),
            "layers_block_type",
            "MoE",
        ),
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
