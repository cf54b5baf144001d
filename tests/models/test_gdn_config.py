"""Qwen3.5 / Qwen3-Next configs and checkpoints: parsing, refusals, skipped weights, and
the state page size of a Qwen3.6-27B-shaped model."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridserve.models.config import ATTENTION, GDN, ConfigError, ModelConfig
from hybridserve.models.hybrid import Qwen3_5ForCausalLM
from hybridserve.models.loader import CheckpointError, load_model
from hybridserve.testing.tiny_models import make_tiny_checkpoint


def _qwen36_27b(**changes):
    """The text config of the published Qwen3.6-27B (its shape; nothing is loaded)."""
    text = {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120,
        "intermediate_size": 17408, "num_hidden_layers": 64, "num_attention_heads": 24,
        "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                            "mrope_interleaved": True},
        "max_position_embeddings": 262144, "eos_token_id": 248044,
    }
    text.update(changes)
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "text_config": text, "vision_config": {"depth": 27}, "tie_word_embeddings": False}


def test_qwen36_27b_shape_and_state_page_bytes():
    c = ModelConfig.from_dict(_qwen36_27b())
    assert c.layer_types == (GDN, GDN, GDN, ATTENTION) * 16
    assert c.gdn.conv_dim == 2 * 16 * 128 + 48 * 128
    a = c.attention
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim) == (24, 4, 256, 64)
    assert a.output_gate and a.qk_norm and c.norm_zero_centred
    with torch.device("meta"):
        spec = Qwen3_5ForCausalLM(c).cache_spec
    state = 48 * 48 * 128 * 128
    conv = 48 * 10240 * 3
    assert spec.state_page_bytes(torch.bfloat16, torch.float32) == 4 * state + 2 * conv
    assert spec.state_page_bytes(torch.bfloat16, torch.float32) / 1e6 == pytest.approx(153.9, 0.01)
    assert spec.state_page_bytes(torch.bfloat16, torch.bfloat16) == 2 * state + 2 * conv


def _next(**changes):
    base = {"architectures": ["Qwen3NextForCausalLM"], "vocab_size": 100, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
            "num_experts": 0}
    base.update(changes)
    return base


def test_qwen3_next_sparse_layers_and_dense_layers():
    """transformers' rule: layer i is sparse unless in mlp_only_layers, when num_experts > 0
    and (i + 1) % decoder_sparse_step == 0; the others keep the dense MLP."""
    assert ModelConfig.from_dict(_next(num_experts=8, num_experts_per_tok=2)).moe_layers == (0, 1, 2, 3)
    c = ModelConfig.from_dict(_next(num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0, 2]))
    assert c.moe_layers == (1, 3)
    assert [c.layer_has_dense_mlp(i) for i in range(4)] == [True, False, True, False]
    c = ModelConfig.from_dict(_next(num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert c.moe_layers == (1,) and c.moe.routing == "softmax_then_topk" and c.moe.shared_gate
    c = ModelConfig.from_dict(_next(num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0, 1, 2, 3]))
    assert c.moe is None and c.gdn.fused_projections and c.mlp.kind == "gated"
    assert ModelConfig.from_dict(_next()).layer_types == (GDN, GDN, GDN, ATTENTION)
    with pytest.raises(ConfigError, match="decoder_sparse_step"):
        ModelConfig.from_dict(_next(num_experts=8, num_experts_per_tok=2, decoder_sparse_step=0))
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig.from_dict(_next(num_experts=8, num_experts_per_tok=9))


def test_bad_qwen_fields_name_the_field():
    with pytest.raises(ConfigError, match="layer_types.*'sliding_attention'"):
        ModelConfig.from_dict(_next(layer_types=["linear_attention"] * 3 + ["sliding_attention"]))
    with pytest.raises(ConfigError, match="linear_num_value_heads"):
        ModelConfig.from_dict(_next(linear_num_value_heads=3))
    with pytest.raises(ConfigError, match="hidden_act.*Gated DeltaNet"):
        ModelConfig.from_dict(_next(hidden_act="gelu"))
    with pytest.raises(ConfigError, match="text_config"):
        ModelConfig.from_dict({"architectures": ["Qwen3_5ForConditionalGeneration"]})


def test_vision_language_checkpoint_loads_its_text_part_and_logs_skipped_weights(
    tmp_path, caplog
):
    path = make_tiny_checkpoint("qwen3_5_vl", tmp_path / "vl", seed=3, layers="MA")
    weights = load_file(path / "model.safetensors")
    assert any(n.startswith("model.visual.") for n in weights)
    weights["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(weights, path / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="hybridserve.models"):
        model = load_model(path)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "'model.visual.*'" in messages and "1 'mtp.*'" in messages
    assert torch.equal(model.model.embed_tokens.weight,
                       weights["model.language_model.embed_tokens.weight"])
    # A weight that is neither the model's nor a known skipped prefix is still refused.
    weights["model.language_model.layers.0.linear_attn.extra"] = torch.zeros(2)
    save_file(weights, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected weight"):
        load_model(path)


def test_text_only_checkpoint_names_load_as_they_are(tmp_path):
    path = make_tiny_checkpoint("qwen3_5", tmp_path / "t", seed=4, layers="AM")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"]
    model = load_model(path)
    weights = load_file(path / "model.safetensors")
    assert torch.equal(model.model.layers[1].linear_attn.A_log,
                       weights["model.layers.1.linear_attn.A_log"])
