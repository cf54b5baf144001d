"""One hybrid decoder shared by every supported architecture.

A decoder layer is ``h += mixer(norm(h))`` followed, where the architecture has one, by
``h += mlp(norm2(h))`` (both scaled by Granite's ``residual_multiplier``). The mixer is a
Mamba2 mixer, a Gated DeltaNet mixer, an attention layer (gated, with q/k norms, for
Qwen3.5 / Qwen3-Next), or (Nemotron-H) a plain MLP or a mixture-of-experts block. Where a
layer has a mixture of experts beside its MLP (Granite's ``block_sparse_moe``) the second
block is ``mlp(x) + moe(x)``; where the block replaces the MLP (Qwen) it is ``moe(x)``.
The architectures differ
only in module names (which must equal their checkpoints' weight names), their MLP
flavour and a few multipliers; :class:`LayerNames` captures the names, the rest comes
from :class:`~hybridserve.models.config.ModelConfig`.

Every residual add is followed by a norm (the next block's, the next layer's input norm,
or the final norm), so the stack hands each block's output on *pending* and the next
norm adds it and normalises in one pass (:meth:`RMSNorm.add_norm
<hybridserve.models.layers.norm.RMSNorm.add_norm>`: one fused kernel on CUDA). The sums
and roundings are the same ones in the same order as adding first and normalising after.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from hybridserve.config import KernelPolicy
from hybridserve.models.base import CacheSpec
from hybridserve.models.batch import ForwardBatch, ModelCaches
from hybridserve.models.config import ATTENTION, GDN, MAMBA, MOE, ModelConfig
from hybridserve.models.layers.attention import Attention
from hybridserve.models.layers.gated_attention import GatedAttention
from hybridserve.models.layers.gated_deltanet import GatedDeltaNet
from hybridserve.models.layers.mamba2 import Mamba2Mixer
from hybridserve.models.layers.mlp import build_mlp
from hybridserve.models.layers.moe import MoEBlock
from hybridserve.models.layers.norm import RMSNorm, ZeroCentredRMSNorm
from hybridserve.models.layers.recurrent import RecurrentLayer
from hybridserve.models.step_plan import plan_states, uniform_q


def build_norm(config: ModelConfig, hidden_size: int, policy: KernelPolicy) -> RMSNorm:
    """The model's RMSNorm flavour (zero-centred weights for Qwen3.5 / Qwen3-Next)."""
    if config.norm_zero_centred:
        return ZeroCentredRMSNorm(hidden_size, config.norm_eps, policy.norms)
    return RMSNorm(hidden_size, config.norm_eps, config.norm_weight_in_fp32, policy.norms)


@dataclass(frozen=True)
class LayerNames:
    """Attribute names that make ``state_dict()`` keys equal the checkpoint's."""

    embed: str
    final_norm: str
    input_norm: str
    mamba: str
    attention: str
    mlp_mixer: str  # a layer whose mixer is an MLP or MoE block (Nemotron-H "-" / "E")
    post_norm: str | None  # norm before the per-layer MLP, if the architecture has one
    mlp: str | None
    gdn: str = "linear_attn"  # a Gated DeltaNet mixer
    moe: str | None = None  # the MoE block after the mixer (beside or instead of the MLP)


class DecoderLayer(nn.Module):
    """One decoder layer; see the module docstring."""

    def __init__(
        self, config: ModelConfig, index: int, names: LayerNames, policy: KernelPolicy
    ) -> None:
        super().__init__()
        self.index = index
        self.kind = config.layer_types[index]
        self.residual_multiplier = config.residual_multiplier
        hidden = config.hidden_size
        self._names = names
        self.add_module(names.input_norm, build_norm(config, hidden, policy))
        if self.kind == MAMBA:
            self._mixer = names.mamba
            self.add_module(names.mamba, Mamba2Mixer(hidden, config.mamba, policy))
        elif self.kind == GDN:
            self._mixer = names.gdn
            self.add_module(names.gdn, GatedDeltaNet(hidden, config.gdn, policy))
        elif self.kind == ATTENTION:
            self._mixer = names.attention
            if config.attention.output_gate:
                attn = GatedAttention(hidden, config.attention, config.norm_eps, policy)
            else:
                attn = Attention(hidden, config.attention, policy)
            self.add_module(names.attention, attn)
        elif self.kind == MOE:
            self._mixer = names.mlp_mixer
            self.add_module(names.mlp_mixer, MoEBlock(hidden, config.moe, policy))
        else:
            self._mixer = names.mlp_mixer
            self.add_module(names.mlp_mixer, build_mlp(hidden, config.mlp, policy.activations))
        self.has_mlp = config.layer_has_dense_mlp(index)
        self.has_moe = self.kind != MOE and index in config.moe_layers
        if self.has_moe and names.moe is None:
            raise ValueError(f"{type(self).__name__}: layer {index} has experts but no name for them")
        if self.has_mlp or self.has_moe:
            self.add_module(names.post_norm, build_norm(config, hidden, policy))
        if self.has_mlp:
            self.add_module(names.mlp, build_mlp(hidden, config.mlp, policy.activations))
        if self.has_moe:
            self.add_module(names.moe, MoEBlock(hidden, config.moe, policy))

    def mixer_module(self) -> nn.Module:
        """The layer's mixer (its attribute name is the checkpoint's, "mixer" in some)."""
        return getattr(self, self._mixer)

    def forward(
        self,
        h: torch.Tensor,
        pending: torch.Tensor | None,
        batch: ForwardBatch,
        caches: ModelCaches,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, pending)`` -> ``(h', pending')``: the residual stream is ``h`` plus
        ``pending * residual_multiplier`` (None: nothing pending) before and after."""
        norm = getattr(self, self._names.input_norm)
        if pending is None:
            x = norm(h)
        else:
            h, x = norm.add_norm(h, pending, self.residual_multiplier)
        mixer = self.mixer_module()
        if isinstance(mixer, RecurrentLayer):
            x = mixer(x, batch, caches.states[self.index])
        elif self.kind == ATTENTION:
            x = mixer(x, batch, caches.kv[self.index])
        else:
            x = mixer(x)
        if self.has_mlp or self.has_moe:
            h, x = getattr(self, self._names.post_norm).add_norm(h, x, self.residual_multiplier)
            y = getattr(self, self._names.mlp)(x) if self.has_mlp else None
            if self.has_moe:  # the dense MLP's output joins the experts' final sum
                y = getattr(self, self._names.moe)(x, add=y)
            x = y
        return h, x


class HybridBackbone(nn.Module):
    """Embedding, decoder layers and final norm (the checkpoint's ``model.*``)."""

    def __init__(self, config: ModelConfig, names: LayerNames, policy: KernelPolicy) -> None:
        super().__init__()
        self._names = names
        self.embedding_multiplier = config.embedding_multiplier
        self.residual_multiplier = config.residual_multiplier
        self.add_module(names.embed, nn.Embedding(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, names, policy) for i in range(config.num_layers)
        )
        self.add_module(names.final_norm, build_norm(config, config.hidden_size, policy))

    @property
    def embed(self) -> nn.Embedding:
        return getattr(self, self._names.embed)

    def forward(
        self, input_ids: torch.Tensor, batch: ForwardBatch, caches: ModelCaches
    ) -> torch.Tensor:
        h = self.embed(input_ids)
        if self.embedding_multiplier != 1.0:
            h = h * self.embedding_multiplier
        pending = None
        for layer in self.layers:
            h, pending = layer(h, pending, batch, caches)
        norm = getattr(self, self._names.final_norm)
        if pending is None:
            return norm(h)
        return norm.add_norm(h, pending, self.residual_multiplier)[1]


class HybridForCausalLM(nn.Module):
    """A hybrid Mamba2/attention causal LM; implements :class:`hybridserve.models.base.HybridModel`.

    Subclasses set :attr:`names` (and the registry maps ``config.architecture`` to them).
    ``forward`` only reads ``batch`` and writes the caches named in
    :mod:`hybridserve.models.batch`; it keeps no state between calls. ``policy`` (the
    engine's :class:`~hybridserve.config.KernelPolicy`, fixed for the model's life) says
    which implementation each op takes.
    """

    names: ClassVar[LayerNames]
    # (prefix in the file, prefix in state_dict()) pairs for checkpoints that name the
    # backbone differently from transformers' in-memory module tree.
    checkpoint_prefixes: ClassVar[tuple[tuple[str, str], ...]] = ()
    # Prefixes of weights a checkpoint may carry that the model does not use (each
    # skipped with a note in the log): multi-token-prediction heads, vision towers.
    ignored_weight_prefixes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: ModelConfig, policy: KernelPolicy | None = None) -> None:
        super().__init__()
        self.config = config
        self.kernel_policy = policy or KernelPolicy()
        self.model = HybridBackbone(config, self.names, self.kernel_policy)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        a = config.attention
        recurrent = [
            layer for layer in self.model.layers
            if isinstance(layer.mixer_module(), RecurrentLayer)
        ]
        self.cache_spec = CacheSpec(
            attention_layers=config.attention_layers,
            num_kv_heads=a.num_kv_heads if a else 0,
            head_dim=a.head_dim if a else 0,
            recurrent_layers=tuple(layer.index for layer in recurrent),
            # Each recurrent layer's page state, as its family declares it.
            state_tensors=tuple(layer.mixer_module().state_tensors() for layer in recurrent),
            mamba_layers=config.mamba_layers,
            gdn_layers=config.gdn_layers,
        )

    def plan_step(self, batch: ForwardBatch, device: torch.device | str | None = None) -> ForwardBatch:
        """``batch`` with its plan (:mod:`hybridserve.models.step_plan`), for ``device``
        (default: the parameters'). The runner calls this once per step; a batch that is
        already planned is returned as it is."""
        if batch.planned:
            return batch
        param = self.model.embed.weight
        device = torch.device(device) if device is not None else param.device
        q = uniform_q(batch.query_start) if self.kernel_policy.uniform_decode else 0
        states = None
        if self.cache_spec.recurrent_layers:
            # The scan's compute dtype: float32 at least, as every Mamba layer computes.
            compute = torch.promote_types(param.dtype, torch.float32)
            # Gated DeltaNet layers run rows of any length token by token: they need the
            # per-token index tensors of every step whose pages qualify.
            varlen = bool(self.cache_spec.gdn_layers)
            states = plan_states(batch, self.kernel_policy, device, compute, varlen)
        return replace(batch, planned=True, uniform_q=q, states=states)

    def forward(
        self, input_ids: torch.Tensor, batch: ForwardBatch, caches: ModelCaches
    ) -> torch.Tensor:
        """``input_ids [T]`` (packed rows) -> hidden ``[T, hidden_size]`` after the final norm.
        An unplanned ``batch`` (tests, reference code) is planned here first."""
        return self.model(input_ids, self.plan_step(batch, input_ids.device), caches)

    def num_active_weights(self) -> int:
        """Weights one token is multiplied by, embedding and LM head excluded: each MoE
        block's routed experts count ``top_k / num_experts`` of theirs (the FLOPs of a
        token are twice this, plus attention's products)."""
        total = 0.0
        for name, p in self.named_parameters():
            if "embed" in name or "lm_head" in name:
                continue
            total += p.numel()
        moe = self.config.moe
        if moe is not None:
            for module in self.modules():
                if isinstance(module, MoEBlock):
                    routed = sum(p.numel() for p in module.experts.parameters())
                    total -= routed * (1.0 - moe.top_k / moe.num_experts)
        return round(total)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> float32 ``[N, vocab_size]`` (divided by ``logits_scaling``)."""
        if self.lm_head is None:
            logits = torch.nn.functional.linear(hidden, self.model.embed.weight)
        else:
            # A module call: a tensor-parallel rank's head gathers the vocabulary shards.
            logits = self.lm_head(hidden)
        logits = logits.float()
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return logits


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    """IBM Granite 4.0-H: dense (``num_local_experts == 0``) or with ``block_sparse_moe``
    beside every layer's ``shared_mlp``."""

    names = LayerNames(
        embed="embed_tokens",
        final_norm="norm",
        input_norm="input_layernorm",
        mamba="mamba",
        attention="self_attn",
        mlp_mixer="shared_mlp",
        post_norm="post_attention_layernorm",
        mlp="shared_mlp",
        moe="block_sparse_moe",
    )


class NemotronHForCausalLM(HybridForCausalLM):
    """NVIDIA Nemotron-H: M / * / - / E (mixture-of-experts) layers.

    Its checkpoints (and transformers' ``save_pretrained``) name the backbone
    ``backbone.*``; transformers renames it to ``model.*`` in memory, and so do we.
    """

    checkpoint_prefixes = (("backbone.", "model."),)
    ignored_weight_prefixes = ("mtp.",)

    names = LayerNames(
        embed="embeddings",
        final_norm="norm_f",
        input_norm="norm",
        mamba="mixer",
        attention="mixer",
        mlp_mixer="mixer",
        post_norm=None,
        mlp=None,
    )


class BambaForCausalLM(HybridForCausalLM):
    """IBM Bamba."""

    names = LayerNames(
        embed="embed_tokens",
        final_norm="final_layernorm",
        input_norm="input_layernorm",
        mamba="mamba",
        attention="self_attn",
        mlp_mixer="feed_forward",
        post_norm="pre_ff_layernorm",
        mlp="feed_forward",
    )


_QWEN_NAMES = LayerNames(
    embed="embed_tokens",
    final_norm="norm",
    input_norm="input_layernorm",
    mamba="linear_attn",
    attention="self_attn",
    mlp_mixer="mlp",
    post_norm="post_attention_layernorm",
    mlp="mlp",
    gdn="linear_attn",
    moe="mlp",  # a sparse layer's block takes the dense MLP's place and name
)


class Qwen3_5ForCausalLM(HybridForCausalLM):
    """Qwen3.5 / Qwen3.6 dense text models: Gated DeltaNet and gated attention layers.

    Published checkpoints are the vision-language wrapper's: the language model's weights
    sit under ``model.language_model.*``, which maps to ``model.*`` (a text-only
    checkpoint's names load as they are). ``mtp.*`` (the multi-token-prediction head) is
    loaded by the MTP drafter (:mod:`hybridserve.drafters.mtp`), not here; ``model.visual.*``
    is not used.
    """

    names = _QWEN_NAMES
    checkpoint_prefixes = (("model.language_model.", "model."),)
    ignored_weight_prefixes = ("mtp.", "model.visual.")


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The text part of the Qwen3.5 / Qwen3.6 vision-language checkpoints (text prompts)."""


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE text models: Qwen3.5's layers with a mixture of experts (gated shared
    expert, always renormalised routing) as every layer's MLP."""


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """The text part of the Qwen3.5-MoE vision-language checkpoints (text prompts)."""


class Qwen3NextForCausalLM(HybridForCausalLM):
    """Qwen3-Next: Gated DeltaNet and gated attention layers; the MLP of each sparse layer
    (``decoder_sparse_step``, ``mlp_only_layers``) is a mixture of experts with a gated
    shared expert."""

    names = _QWEN_NAMES
    ignored_weight_prefixes = ("mtp.",)
