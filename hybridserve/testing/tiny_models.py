"""Tiny random hybrid checkpoints for tests.

:func:`make_tiny_checkpoint` builds a real Hugging Face model of one of the supported
architectures with ``transformers`` (a test dependency, imported on first use), fills
every parameter with well-spread random values, and writes it with ``save_pretrained``
(``config.json`` + ``model.safetensors``, float32). Typical use::

    path = make_tiny_checkpoint("granitemoehybrid", tmp_path / "g", layers="AMMA", seed=1)
    model = hybridserve.models.load_model(path)

Defaults: vocab 256, hidden 64, 4 attention heads / 2 KV heads of width 16, Mamba2 with
8 heads of width 16, 2 groups, d_state 16, d_conv 4, chunk_size 8 (so prompts of a few
dozen tokens span several chunks), MLP width 128. Mixture of experts: Granite gets experts
in every layer with ``num_local_experts > 0`` (an override); Nemotron-H ``E`` layers get
8 experts of width 32, top-2, a shared expert of width 48 (override any of these); Qwen3-Next
gets experts of width 32, top-2, a shared expert of width 48 with ``num_experts > 0``.

Values are chosen so that greedy decoding is not decided by near-ties: logits have a
spread of a few units, every norm weight, conv bias, ``D``, ``A_log`` and ``dt_bias`` is
random (so a weight loaded into the wrong place changes the output), and ``dt`` stays
well above Nemotron-H's ``time_step_min`` unless a test asks otherwise.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = (
    "granitemoehybrid", "nemotron_h", "bamba", "qwen3_5", "qwen3_5_vl", "qwen3_next",
    "qwen3_5_moe",
)

# Gated DeltaNet architectures: ``M`` in a layer pattern is a Gated DeltaNet
# (``linear_attention``) layer there.
GDN_ARCHITECTURES = ("qwen3_5", "qwen3_5_vl", "qwen3_next", "qwen3_5_moe")

DEFAULT_LAYERS = {
    "granitemoehybrid": "MAMMA",
    "nemotron_h": "M*-M*-",
    "bamba": "MAMMA",
    "qwen3_5": "MMAM",
    "qwen3_5_vl": "MMAM",
    "qwen3_next": "MMAM",
    "qwen3_5_moe": "MMAM",
}


def _layer_codes(arch: str, layers: str) -> list[str]:
    """Normalise a pattern: ``M`` Mamba, ``A`` or ``*`` attention, ``-`` MLP and ``E``
    mixture of experts (Nemotron-H only)."""
    codes = []
    for c in layers:
        if c in "A*":
            codes.append("A")
        elif c == "M" or (c in "-E" and arch == "nemotron_h"):
            codes.append(c)
        else:
            raise ValueError(
                f"layer code {c!r} not valid for {arch}; use M, A (or *)"
                + (", -, E" if arch == "nemotron_h" else "")
            )
    if not codes:
        raise ValueError("layers must name at least one layer")
    return codes


def _qwen_text_kwargs(codes: list[str]) -> dict[str, Any]:
    """Tiny Qwen3.5 / Qwen3-Next text settings: 4 attention heads / 2 KV heads of width 16
    (a quarter of each rotated), GDN with 2 key heads and 4 value heads (each key head
    shared by two value heads) of width 16, conv kernel 4."""
    return dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(codes),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["full_attention" if c == "A" else "linear_attention" for c in codes],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25},
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _hf_config(arch: str, codes: list[str], overrides: dict[str, Any]) -> Any:
    import transformers

    if arch == "qwen3_5_moe":  # every layer's MLP is a mixture of experts
        kwargs = _qwen_text_kwargs(codes)
        del kwargs["intermediate_size"]
        kwargs.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48)
        kwargs.update(overrides)
        return transformers.Qwen3_5MoeTextConfig(**kwargs)
    if arch == "qwen3_5":
        kwargs = _qwen_text_kwargs(codes)
        kwargs.update(overrides)
        return transformers.Qwen3_5TextConfig(**kwargs)
    if arch == "qwen3_5_vl":
        text = _qwen_text_kwargs(codes)
        top = {k: overrides.pop(k) for k in ("tie_word_embeddings",) if k in overrides}
        text.update(overrides)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=64, patch_size=4, num_position_embeddings=16)
        return transformers.Qwen3_5Config(text_config=text, vision_config=vision, **top)
    if arch == "qwen3_next":
        kwargs = _qwen_text_kwargs(codes)
        # Dense MLPs unless a test asks for experts (num_experts > 0); then tiny ones.
        kwargs.update(num_experts=0, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48)
        kwargs.update(overrides)
        return transformers.Qwen3NextConfig(**kwargs)

    if arch == "granitemoehybrid":
        kwargs: dict[str, Any] = dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            shared_intermediate_size=128,
            num_hidden_layers=len(codes),
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["attention" if c == "A" else "mamba" for c in codes],
            num_local_experts=0,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_chunk_size=8,
            position_embedding_type="rope",
            # Non-trivial multipliers so the loader and model must honour each of them.
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.125,
            logits_scaling=1.5,
            max_position_embeddings=4096,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        kwargs.update(overrides)
        return transformers.GraniteMoeHybridConfig(**kwargs)
    if arch == "nemotron_h":
        kwargs = dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            layers_block_type=[
                {"M": "mamba", "A": "attention", "-": "mlp", "E": "moe"}[c] for c in codes
            ],
            mamba_num_heads=8,
            mamba_head_dim=16,
            n_groups=2,
            ssm_state_size=16,
            conv_kernel=4,
            chunk_size=8,
            max_position_embeddings=4096,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        if "E" in codes:
            kwargs.update(
                n_routed_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                moe_shared_expert_intermediate_size=48,
            )
        kwargs.update(overrides)
        return transformers.NemotronHConfig(**kwargs)
    kwargs = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(codes),
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=[i for i, c in enumerate(codes) if c == "A"],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_chunk_size=8,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return transformers.BambaConfig(**kwargs)


def _model_class(arch: str) -> Any:
    import transformers

    return {
        "granitemoehybrid": transformers.GraniteMoeHybridForCausalLM,
        "nemotron_h": transformers.NemotronHForCausalLM,
        "bamba": transformers.BambaForCausalLM,
        "qwen3_5": transformers.Qwen3_5ForCausalLM,
        "qwen3_5_vl": transformers.Qwen3_5ForConditionalGeneration,
        "qwen3_5_moe": transformers.Qwen3_5MoeForCausalLM,
        "qwen3_next": transformers.Qwen3NextForCausalLM,
    }[arch]


@torch.no_grad()
def _randomize(
    model: torch.nn.Module, hidden: int, seed: int, zero_centred_norms: bool = False
) -> None:
    g = torch.Generator().manual_seed(seed)

    def normal(shape: torch.Size, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std + mean

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if ".visual." in name or name.startswith("visual."):
            continue  # a vision tower the engine does not use keeps its own init
        if "linear_attn" in name and leaf == "A_log":
            # Gated DeltaNet decays exp(-A * softplus(.)): A in [0.05, 1] keeps several
            # tokens of memory, so a state carried wrongly shows in the logits.
            value = torch.log(torch.rand(p.shape, generator=g) * 0.95 + 0.05)
        elif name.endswith("embed_tokens.weight") or name.endswith("embeddings.weight"):
            value = normal(p.shape, 1.0)
        elif name == "lm_head.weight":
            value = normal(p.shape, 2.5 / math.sqrt(hidden))  # logits spread ~2.5
        elif leaf == "A_log":
            value = torch.log(torch.rand(p.shape, generator=g) * 7.0 + 1.0)  # A in [-8, -1]
        elif leaf == "dt_bias":
            value = torch.rand(p.shape, generator=g) * 1.5 - 1.0  # softplus in ~[0.3, 1.0]
        elif leaf == "D":
            value = normal(p.shape, 0.3, 1.0)
        elif "conv1d.weight" in name:
            value = normal(p.shape, 0.5)
        elif leaf == "bias":
            value = normal(p.shape, 0.1)
        elif p.dim() == 1 and zero_centred_norms and "linear_attn.norm" not in name:
            # Zero-centred RMSNorm weights (the scale is 1 + weight), except GDN's output norm.
            value = normal(p.shape, 0.1)
        elif p.dim() == 1:  # norm weights
            value = normal(p.shape, 0.1, 1.0)
        elif p.dim() == 2:
            value = normal(p.shape, 1.0 / math.sqrt(p.shape[1]))
        elif p.dim() == 3:  # stacked experts [E, out, in]
            value = normal(p.shape, 1.0 / math.sqrt(p.shape[2]))
        else:
            raise AssertionError(f"no init rule for parameter {name} {tuple(p.shape)}")
        p.copy_(value)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            # Non-zero and of the size of the score differences, so choosing with and
            # without it differs.
            b.copy_(normal(b.shape, 0.1))


def tiny_config(arch: str, layers: str | None = None, **overrides: Any) -> Any:
    """The ``transformers`` config of :func:`make_tiny_checkpoint` (same arguments, no
    weights, nothing written), for tests that build the Hugging Face model themselves."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {ARCHITECTURES}")
    return _hf_config(arch, _layer_codes(arch, layers or DEFAULT_LAYERS[arch]), overrides)


def make_tiny_checkpoint(
    arch: str,
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    layers: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random float32 checkpoint of ``arch`` to directory ``path``; return it.

    Args:
        arch: one of :data:`ARCHITECTURES` (``"qwen3_5_vl"``: the vision-language
            wrapper ``Qwen3_5ForConditionalGeneration`` with a one-block vision tower).
        path: output directory (created if needed).
        seed: weights are a pure function of ``seed`` and the config.
        layers: layer pattern, one letter per decoder layer: ``M`` Mamba (Gated DeltaNet
            for the Qwen architectures), ``A`` (or ``*``) attention, ``-`` MLP and ``E``
            mixture of experts (Nemotron-H only). Defaults: ``DEFAULT_LAYERS[arch]``.
        **overrides: keyword arguments for the ``transformers`` config class of ``arch``
            (e.g. ``mamba_n_groups=4``, ``tie_word_embeddings=True``, ``time_step_min=0.3``;
            ``num_local_experts=6`` for a Granite MoE, ``n_group=4`` for grouped routing).

    Takes well under a second once ``transformers`` is imported.
    """
    config = tiny_config(arch, layers, **overrides)
    model = _model_class(arch)(config)
    _randomize(model, config.get_text_config().hidden_size, seed, arch in GDN_ARCHITECTURES)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    # The shard-writing progress bar would clutter every test log.
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(out)
    return out
