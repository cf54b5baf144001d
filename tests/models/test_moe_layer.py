"""MoEBlock against the transformers blocks it mirrors, instantiated directly.

For each routing mode a tiny transformers config builds the reference block (Granite's
``GraniteMoeHybridMoE``, Nemotron-H's ``NemotronHMoE``, ``Qwen3NextSparseMoeBlock`` and
``Qwen3_5MoeSparseMoeBlock``); its random weights are copied into our block under the
checkpoint names, and outputs must agree in float32 (1e-5 relative) on fresh random
inputs, including routers with exact ties. The chosen experts are compared too (a
routing difference would show there first).
"""

from __future__ import annotations

import pytest
import torch

from hybridserve.models.config import (
    SIGMOID_GROUPED,
    SOFTMAX_THEN_TOPK,
    TOPK_THEN_SOFTMAX,
    MoEParams,
)
from hybridserve.models.layers.moe import MoEBlock, checkpoint_slot

transformers = pytest.importorskip("transformers")

HIDDEN = 32


def _granite():
    cfg = transformers.GraniteMoeHybridConfig(
        hidden_size=HIDDEN, intermediate_size=24, num_local_experts=6, num_experts_per_tok=3,
        shared_intermediate_size=40, hidden_act="silu", mamba_n_heads=4, mamba_d_head=16,
    )
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMoE

    p = MoEParams(TOPK_THEN_SOFTMAX, 6, 3, 24, gated=True, activation="silu",
                  norm_topk_prob=False)
    return GraniteMoeHybridMoE(cfg), p


def _nemotron(latent=None, norm=True, groups=(4, 2)):
    cfg = transformers.NemotronHConfig(
        hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=40, n_group=groups[0], topk_group=groups[1],
        routed_scaling_factor=2.5, norm_topk_prob=norm, moe_latent_size=latent,
        mlp_hidden_act="relu2", layers_block_type=["moe"],
    )
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    p = MoEParams(SIGMOID_GROUPED, 16, 4, 24, gated=False, activation="relu2",
                  norm_topk_prob=norm, routed_scaling_factor=2.5, n_group=groups[0],
                  topk_group=groups[1], shared_intermediate_size=40, latent_size=latent)
    return NemotronHMoE(cfg), p


def _qwen3_next(norm=True):
    cfg = transformers.Qwen3NextConfig(
        hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, norm_topk_prob=norm, hidden_act="silu",
    )
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    p = MoEParams(SOFTMAX_THEN_TOPK, 8, 3, 24, gated=True, activation="silu",
                  norm_topk_prob=norm, shared_intermediate_size=40, shared_gate=True)
    return Qwen3NextSparseMoeBlock(cfg), p


def _qwen3_5_moe():
    cfg = transformers.Qwen3_5MoeTextConfig(
        hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, hidden_act="silu",
    )
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    p = MoEParams(SOFTMAX_THEN_TOPK, 8, 2, 24, gated=True, activation="silu",
                  norm_topk_prob=True, shared_intermediate_size=40, shared_gate=True)
    return Qwen3_5MoeSparseMoeBlock(cfg), p


CASES = {
    "granite": _granite,
    "nemotron-grouped": _nemotron,
    "nemotron-latent-unnormalised": lambda: _nemotron(latent=12, norm=False),
    "nemotron-one-group": lambda: _nemotron(groups=(1, 1)),
    "qwen3-next": _qwen3_next,
    "qwen3-next-unnormalised": lambda: _qwen3_next(norm=False),
    "qwen3.5-moe": _qwen3_5_moe,
}


def _randomise(ref: torch.nn.Module, g: torch.Generator) -> None:
    with torch.no_grad():
        for _, t in [*ref.named_parameters(), *ref.named_buffers()]:
            fan_in = t.shape[-1] if t.dim() > 1 else 1
            std = 1.0 / fan_in**0.5 if t.dim() > 1 else 0.2
            t.copy_(torch.randn(t.shape, generator=g) * std)


def _ours(ref: torch.nn.Module, p: MoEParams) -> MoEBlock:
    """Our block with the reference's weights, loaded through the checkpoint slots."""
    ours = MoEBlock(HIDDEN, p)
    expected = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    state = {}
    for name, t in ref.state_dict().items():
        key = f"x.{name}"  # checkpoint_slot wants a dotted prefix, like a layer's
        slot = checkpoint_slot(key, {f"x.{k}": s for k, s in expected.items()})
        target = slot.param[2:] if slot is not None else name
        assert target in expected, f"reference weight {name} has no place in MoEBlock"
        state[target] = t.clone()
    ours.load_state_dict(state, strict=True)
    return ours.eval()


def _routing_of(block: torch.nn.Module, x: torch.Tensor, ours: bool) -> set:
    router = getattr(block, "router", None) or block.gate
    ids = router(x)[0] if ours else router(x)[2]
    return [set(r) for r in ids.tolist()]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tokens", [1, 37])
def test_block_matches_transformers(case, tokens):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    g = torch.Generator().manual_seed(seed)
    ref, p = CASES[case]()
    _randomise(ref, g)
    ref.eval()
    ours = _ours(ref, p)
    x = torch.randn(1, tokens, HIDDEN, generator=g)
    with torch.no_grad():
        want = ref(x).reshape(tokens, HIDDEN)
        got = ours(x[0])
        assert _routing_of(ours, x[0], True) == _routing_of(ref, x[0], False), f"seed {seed}"
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, f"seed {seed}: relative error {err:.3g}"


@pytest.mark.parametrize("case", ["granite", "nemotron-grouped", "qwen3-next"])
def test_ties_fall_as_in_transformers(case):
    """Duplicate router rows make exact ties between experts (and, for Nemotron-H, between
    groups); both implementations must break them the same way."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    ref, p = CASES[case]()
    _randomise(ref, g)
    router = getattr(ref, "router", None) or ref.gate
    with torch.no_grad():
        w = router.weight
        w[1] = w[0]
        w[3] = w[2]
        if case.startswith("nemotron"):
            per = p.num_experts // p.n_group
            w[per : 2 * per] = w[:per]  # two identical groups
            router.e_score_correction_bias[per : 2 * per] = router.e_score_correction_bias[:per]
    ref.eval()
    ours = _ours(ref, p)
    x = torch.randn(1, 29, HIDDEN, generator=g)
    with torch.no_grad():
        want = ref(x)[0]
        got = ours(x[0])
        assert _routing_of(ours, x[0], True) == _routing_of(ref, x[0], False)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_correction_bias_chooses_but_does_not_weight():
    """A large bias on one expert makes every token choose it, with its unbiased score."""
    ref, p = _nemotron(groups=(1, 1))
    _randomise(ref, torch.Generator().manual_seed(1))
    ours = _ours(ref, p)
    router = ours.gate
    with torch.no_grad():
        router.e_score_correction_bias.zero_()
        router.e_score_correction_bias[5] = 100.0
        x = torch.randn(9, HIDDEN)
        ids, weights = router(x)
        assert (ids == 5).any(dim=1).all()
        scores = torch.sigmoid(x @ router.weight.T)
        chosen = scores.gather(1, ids)
        torch.testing.assert_close(weights, chosen / chosen.sum(1, keepdim=True) * 2.5)


def test_qwen_style_block_replaces_the_mlp_of_its_layers():
    """A ``softmax_then_topk`` block takes the place of the dense MLP in its layers only
    (``decoder_sparse_step`` / ``mlp_only_layers`` decide which), under the same name: the
    seam the Qwen3-Next / Qwen3.5-MoE architectures plug into."""
    from hybridserve.models.config import MAMBA, MambaParams, MLPParams, ModelConfig
    from hybridserve.models.hybrid import HybridForCausalLM, LayerNames

    class QwenStyle(HybridForCausalLM):
        names = LayerNames(
            embed="embed_tokens", final_norm="norm", input_norm="input_layernorm",
            mamba="linear_attn", attention="self_attn", mlp_mixer="mlp",
            post_norm="post_attention_layernorm", mlp="mlp", moe="mlp",
        )

    _, p = _qwen3_next()
    mamba = MambaParams(4, 16, 1, 8, 4, 2, 8, True, False, "silu", 1e-6, (0.0, float("inf")),
                        0.001, 0.1)
    config = ModelConfig(
        architecture="QwenStyle", model_type="x", vocab_size=50, hidden_size=HIDDEN,
        layer_types=(MAMBA,) * 4, layer_has_mlp=True, attention=None, mamba=mamba,
        mlp=MLPParams("gated", 48, "silu", False), norm_eps=1e-6, norm_weight_in_fp32=False,
        tie_word_embeddings=True, embedding_multiplier=1.0, residual_multiplier=1.0,
        logits_scaling=1.0, max_position_embeddings=64, bos_token_id=None, eos_token_ids=(),
        pad_token_id=None, torch_dtype=None, moe=p, moe_layers=(1, 3),
    )
    assert [config.layer_has_dense_mlp(i) for i in range(4)] == [True, False, True, False]
    model = QwenStyle(config)
    keys = set(model.state_dict())
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys
    assert "model.layers.1.mlp.shared_expert_gate.weight" in keys
    assert "model.layers.0.mlp.gate_proj.weight" in keys
    assert not any(k.startswith("model.layers.0.mlp.experts") for k in keys)
    assert isinstance(model.model.layers[3].mlp, MoEBlock)
