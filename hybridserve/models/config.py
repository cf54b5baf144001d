"""One normalised view of a hybrid checkpoint's ``config.json``.

Granite 4.0-H, Nemotron-H and Bamba name the same things differently (``mamba_n_heads``
vs ``mamba_num_heads``, ``layer_types`` vs ``hybrid_override_pattern`` vs
``attn_layer_indices``). :class:`ModelConfig` is built in exactly one place
(:meth:`ModelConfig.from_dict`) and gives the rest of the engine one shape:

- ``layer_types[i]`` is the *mixer* of decoder layer ``i``: ``"mamba"``, ``"gdn"`` (a
  Gated DeltaNet layer: Qwen3.5 / Qwen3-Next ``linear_attention``), ``"attention"``,
  ``"mlp"`` (a Nemotron-H layer whose only block is an MLP) or ``"moe"`` (a Nemotron-H
  layer whose only block is a mixture of experts);
- ``layer_has_mlp`` says whether every decoder layer also carries its own MLP after the
  mixer (Granite, Bamba) or not (Nemotron-H, where MLPs are layers of their own);
- ``moe`` describes the mixture-of-experts blocks (:class:`MoEParams`) and
  ``moe_layers`` the decoder layers that have one (as mixer or beside / instead of the
  per-layer MLP; see :class:`MoEParams`).

Values follow what the Hugging Face ``transformers`` implementation actually computes
(not just what the file says), because logits must match it: e.g. Nemotron-H ignores
``time_step_limit`` and clamps ``dt`` to ``[time_step_min, inf)``.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

MAMBA = "mamba"
GDN = "gdn"
ATTENTION = "attention"
MLP = "mlp"
MOE = "moe"

SUPPORTED_ARCHITECTURES = (
    "GraniteMoeHybridForCausalLM",
    "NemotronHForCausalLM",
    "BambaForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3NextForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
)
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu", "relu2")


class ConfigError(ValueError):
    """A checkpoint's ``config.json`` cannot be used; the message names file, field and fix."""


# Sizes, counts and scales that must be > 0, in any architecture's spelling: zero or a
# negative value would load and then break every forward or silently empty the output.
_POSITIVE = frozenset({
    "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "shared_intermediate_size",
    "max_position_embeddings", "mamba_n_heads", "mamba_num_heads", "mamba_head_dim",
    "mamba_n_groups", "n_groups", "mamba_d_state", "ssm_state_size", "mamba_d_conv",
    "conv_kernel", "mamba_expand", "expand", "mamba_chunk_size", "chunk_size",
    "rms_norm_eps", "layer_norm_epsilon", "attention_multiplier", "embedding_multiplier",
    "residual_multiplier", "logits_scaling", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim",
})
# dt bounds: 0 is a valid bound, a negative one is not.
_NON_NEGATIVE = frozenset({"time_step_min", "time_step_max", "mamba_dt_min", "mamba_dt_max"})
# Far beyond any released model (the deepest have a few hundred layers); a config above
# it is refused before a per-layer list of that length is built.
MAX_LAYERS = 4096


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """Attention layers of one model (all attention layers share them)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool
    scale: float  # softmax scale: Granite's attention_multiplier, else head_dim ** -0.5
    rope_theta: float | None  # None: no positional encoding in attention (NoPE)
    partial_rotary_factor: float  # fraction of head_dim that is rotated
    # Qwen3.5 / Qwen3-Next: q_proj also yields a per-channel output gate (sigmoid) and
    # q / k are RMS-normalised per head (zero-centred weights) before RoPE.
    output_gate: bool = False
    qk_norm: bool = False

    @property
    def rotary_dim(self) -> int:
        """Number of leading channels of each head that RoPE rotates (0 without RoPE)."""
        if self.rope_theta is None:
            return 0
        return int(self.head_dim * self.partial_rotary_factor)


@dataclass(frozen=True, slots=True)
class MambaParams:
    """Mamba2 mixer hyper-parameters (all Mamba layers share them)."""

    n_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    d_conv: int
    expand: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    activation: str
    norm_eps: float  # eps of the grouped gated RMSNorm
    time_step_limit: tuple[float, float]  # dt clamp applied by the reference implementation
    time_step_min: float
    time_step_max: float
    # transformers' single-token continuation step (``selective_state_update``) does not
    # clamp dt; only its chunked path does. True applies the clamp on every token, which
    # keeps a step's result independent of how tokens are split over forwards.
    clamp_dt_in_single_token_step: bool = False

    @property
    def intermediate_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv (x, B and C concatenated)."""
        return self.intermediate_size + 2 * self.n_groups * self.d_state


@dataclass(frozen=True, slots=True)
class GDNParams:
    """Gated DeltaNet mixer hyper-parameters (all GDN layers share them).

    ``num_value_heads`` is a multiple of ``num_key_heads``: key head ``j`` serves value
    heads ``j * r .. j * r + r - 1`` (``r = num_value_heads // num_key_heads``).
    ``fused_projections``: Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` (laid out per
    key head group) instead of Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b``
    / ``in_proj_a``.
    """

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    d_conv: int
    activation: str  # of the conv
    norm_eps: float  # eps of the gated output norm
    fused_projections: bool

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv (q, k and v concatenated)."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True, slots=True)
class MLPParams:
    """Dense MLP of the model.

    ``kind``: ``"gated_fused"`` (Granite ``shared_mlp``: one ``input_linear`` holding gate
    then up), ``"gated"`` (Bamba: ``gate_proj``/``up_proj``/``down_proj``) or ``"plain"``
    (Nemotron-H: ``down_proj(act(up_proj(x)))``).
    """

    kind: str
    intermediate_size: int
    activation: str
    bias: bool


# Routing modes of a mixture-of-experts block, exactly as each reference computes them
# (transformers' modeling files are the oracles; hybridserve.models.layers.moe does the math).
TOPK_THEN_SOFTMAX = "topk_then_softmax"  # Granite 4.0-H: top-k router logits, softmax over k
SIGMOID_GROUPED = "sigmoid_grouped"  # Nemotron-H: sigmoid, selection-only bias, groups
SOFTMAX_THEN_TOPK = "softmax_then_topk"  # Qwen3-Next / Qwen3.5-MoE: softmax over all, top-k
MOE_ROUTINGS = (TOPK_THEN_SOFTMAX, SIGMOID_GROUPED, SOFTMAX_THEN_TOPK)


@dataclass(frozen=True, slots=True)
class MoEParams:
    """Mixture-of-experts blocks of one model (all MoE layers share them).

    ``routing`` (one of :data:`MOE_ROUTINGS`) fixes the router arithmetic and the module
    names, which are those of its family's checkpoints:

    - ``topk_then_softmax`` (Granite ``block_sparse_moe``): routed experts only; Granite's
      per-layer ``shared_mlp`` stays the layer's dense MLP and is added beside the block.
    - ``sigmoid_grouped`` (Nemotron-H ``mixer`` of an ``E`` layer): scores
      ``sigmoid(logits)``; ``e_score_correction_bias`` is added for *choosing* experts only;
      choice is limited to the ``topk_group`` best of ``n_group`` groups (a group scores
      the sum of its two best biased scores); the chosen unbiased scores are renormalised
      (``norm_topk_prob``) and multiplied by ``routed_scaling_factor``. Experts are plain
      (``down(act(up(x)))``, relu2); one shared expert of ``shared_intermediate_size`` is
      added; with ``latent_size`` the routed experts work in a smaller latent space
      (``fc1_latent_proj`` before, ``fc2_latent_proj`` after).
    - ``softmax_then_topk`` (Qwen3-Next / Qwen3.5-MoE ``mlp``): softmax over all experts,
      top-k, renormalised when ``norm_topk_prob``; the shared expert's output is scaled by
      ``sigmoid(shared_expert_gate(x))``. The block replaces the layer's dense MLP.
    """

    routing: str
    num_experts: int
    top_k: int
    intermediate_size: int  # width of one routed expert
    gated: bool  # experts are down(act(gate(x)) * up(x)); else down(act(up(x)))
    activation: str
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_intermediate_size: int = 0  # 0: no shared expert inside the block
    shared_gate: bool = False  # Qwen: sigmoid(shared_expert_gate(x)) scales the shared expert
    latent_size: int | None = None  # Nemotron-H latent MoE
    bias: bool = False  # bias of the shared expert and latent projections (mlp_bias)

    def __post_init__(self) -> None:
        if self.routing not in MOE_ROUTINGS:
            raise ConfigError(f"MoEParams.routing: expected one of {MOE_ROUTINGS}, got {self.routing!r}")
        if self.num_experts <= 0:
            raise ConfigError(f"MoEParams.num_experts must be positive, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(
                f"MoEParams.top_k must be in [1, num_experts ({self.num_experts})], "
                f"got {self.top_k}"
            )
        if self.n_group <= 0 or self.num_experts % self.n_group:
            raise ConfigError(
                f"MoEParams.n_group ({self.n_group}) must divide num_experts ({self.num_experts})"
            )
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ConfigError(
                f"MoEParams.n_group ({self.n_group}) must leave at least 2 experts per group "
                "(a group is scored by its two best experts)"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(
                f"MoEParams.topk_group ({self.topk_group}) must be in [1, n_group ({self.n_group})]"
            )
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ConfigError(
                f"MoEParams.top_k ({self.top_k}) exceeds the experts of the topk_group "
                f"({self.topk_group}) groups it may choose from"
            )

    @property
    def expert_input_size(self) -> int | None:
        """Width the routed experts read and write: the latent size, or None (hidden size)."""
        return self.latent_size


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture-independent description of a supported hybrid checkpoint."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    layer_has_mlp: bool
    attention: AttentionParams | None  # None when no layer is an attention layer
    mamba: MambaParams | None  # None when no layer is a Mamba layer
    mlp: MLPParams | None  # None when no layer has an MLP
    norm_eps: float
    norm_weight_in_fp32: bool  # Nemotron-H multiplies the norm weight in float32
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    torch_dtype: str | None  # the dtype named in config.json, e.g. "bfloat16"
    # Granite's scalings; every other family leaves them at 1.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0  # logits are divided by this
    moe: MoEParams | None = None  # None when no layer has a mixture of experts
    moe_layers: tuple[int, ...] = ()  # decoder layers with a mixture-of-experts block
    gdn: GDNParams | None = None  # None when no layer is a Gated DeltaNet layer
    # Qwen3.5 / Qwen3-Next store RMSNorm weights zero-centred: the scale is (1 + weight).
    norm_zero_centred: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == ATTENTION)

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == MAMBA)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == GDN)

    def __post_init__(self) -> None:
        kinds = set(self.layer_types)
        if not kinds <= {MAMBA, GDN, ATTENTION, MLP, MOE}:
            raise ConfigError(f"ModelConfig.layer_types: unknown kinds {sorted(kinds)}")
        if bool(self.moe_layers) != (self.moe is not None):
            raise ConfigError("ModelConfig.moe must be given exactly when moe_layers is not empty")
        mixer_moe = tuple(i for i, t in enumerate(self.layer_types) if t == MOE)
        if mixer_moe and tuple(self.moe_layers) != mixer_moe:
            raise ConfigError(
                f"ModelConfig.moe_layers {self.moe_layers} must be the 'moe' layers {mixer_moe}"
            )
        if any(not 0 <= i < len(self.layer_types) for i in self.moe_layers):
            raise ConfigError(f"ModelConfig.moe_layers {self.moe_layers}: index out of range")
        for kind, params, name in (
            (ATTENTION, self.attention, "attention"),
            (MAMBA, self.mamba, "mamba"),
            (GDN, self.gdn, "gdn"),
        ):
            if (kind in kinds) != (params is not None):
                raise ConfigError(
                    f"ModelConfig.{name} must be given exactly when a layer is {kind}"
                )
        dense_mlp = MLP in kinds or any(
            self.layer_has_dense_mlp(i) for i in range(len(self.layer_types))
        )
        if dense_mlp and self.mlp is None:
            raise ConfigError("ModelConfig.mlp is required when a layer has an MLP")

    def layer_has_dense_mlp(self, index: int) -> bool:
        """Whether decoder layer ``index`` carries a dense MLP after its mixer: every layer
        of an architecture with per-layer MLPs, except where a Qwen-style MoE block
        (``softmax_then_topk``) takes the MLP's place; Granite keeps its ``shared_mlp``
        beside the block."""
        if not self.layer_has_mlp:
            return False
        replaced = self.moe is not None and self.moe.routing == SOFTMAX_THEN_TOPK
        return not (replaced and index in self.moe_layers)

    def with_overrides(self, **changes: Any) -> ModelConfig:
        """A copy with some fields replaced, e.g. ``mamba=replace(c.mamba, ...)``."""
        return replace(self, **changes)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read ``config.json`` from a checkpoint directory (or the file itself).

        Raises :class:`ConfigError` naming the file when it is missing, unreadable, not
        valid JSON, or describes something this engine does not support.
        """
        p = Path(path)
        file = p / "config.json" if p.is_dir() else p
        try:
            text = file.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"{file}: cannot read the model config ({e.strerror or e})") from e
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{file}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
                "fix or re-export the file"
            ) from e
        if not isinstance(data, dict):
            raise ConfigError(f"{file}: expected a JSON object at the top level")
        return cls.from_dict(data, source=str(file))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from an already parsed ``config.json`` dict; ``source`` names it in errors."""
        r = _Reader(data, source)
        arch = _architecture(r)
        return _PARSERS[arch](r, arch)


class _Reader:
    """Field access with errors that name the file and the field."""

    def __init__(self, data: dict[str, Any], source: str) -> None:
        self.data = data
        self.source = source

    def error(self, field: str, msg: str) -> ConfigError:
        return ConfigError(f"{self.source}: field '{field}': {msg}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def req(self, key: str, kind: type = int) -> Any:
        if self.data.get(key) is None:
            raise self.error(key, f"missing required field; add '{key}' to the config")
        return self._check(key, self.data[key], kind)

    def opt(self, key: str, default: Any, kind: type = int) -> Any:
        value = self.data.get(key)
        if value is None:
            return default
        return self._check(key, value, kind)

    def first(self, keys: tuple[str, ...], default: Any, kind: type = int) -> Any:
        """The first of several alternative spellings that is present."""
        for key in keys:
            if self.data.get(key) is not None:
                return self._check(key, self.data[key], kind)
        return default

    def _check(self, key: str, value: Any, kind: type) -> Any:
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise self.error(key, f"expected a number, got {value!r}")
            if not math.isfinite(value):
                raise self.error(key, f"expected a finite number, got {value!r}")
            return self._sign(key, float(value))
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise self.error(key, f"expected an integer, got {value!r}")
            return self._sign(key, value)
        if kind is bool:
            if not isinstance(value, bool):
                raise self.error(key, f"expected true or false, got {value!r}")
            return value
        if kind is str:
            if not isinstance(value, str):
                raise self.error(key, f"expected a string, got {value!r}")
            return value
        return value


    def _sign(self, key: str, value: float) -> Any:
        if key in _POSITIVE and value <= 0:
            raise self.error(key, f"must be > 0, got {value!r}")
        if key in _NON_NEGATIVE and value < 0:
            raise self.error(key, f"must be >= 0, got {value!r}")
        return value

    def num_layers(self) -> int:
        """``num_hidden_layers``, bounded before anything per layer is built."""
        n = self.req("num_hidden_layers")
        if n > MAX_LAYERS:
            raise self.error(
                "num_hidden_layers",
                f"{n} layers is beyond any supported model (at most {MAX_LAYERS}); fix the config",
            )
        return n


def _architecture(r: _Reader) -> str:
    archs = r.data.get("architectures")
    if isinstance(archs, str):
        archs = [archs]
    if not archs or not isinstance(archs, list):
        raise r.error(
            "architectures",
            "missing; set it to one of " + ", ".join(SUPPORTED_ARCHITECTURES),
        )
    for a in archs:
        if a in _PARSERS:
            return a
    raise r.error(
        "architectures",
        f"unsupported architecture {archs!r}; supported: " + ", ".join(SUPPORTED_ARCHITECTURES),
    )


def _json_float(r: _Reader, field: str, value: Any) -> float:
    """A float as transformers saves it: a number, or {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    if isinstance(value, str):
        try:
            return float(value)  # accepts "Infinity", "-Infinity", "inf", "nan"
        except ValueError:
            pass
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise r.error(field, f'expected a number (or {{"__float__": "Infinity"}}), got {value!r}')


def _time_step_limit(
    r: _Reader, keys: tuple[str, ...] = ("time_step_limit",)
) -> tuple[float, float]:
    for key in keys:
        value = r.data.get(key)
        if value is None:
            continue
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise r.error(key, f"expected [min, max], got {value!r}")
        lo, hi = (_json_float(r, key, v) for v in value)
        if math.isnan(lo) or math.isnan(hi) or lo > hi:
            raise r.error(key, f"expected min <= max, got {value!r}")
        return (lo, hi)
    return (0.0, math.inf)


def _mamba_activation(r: _Reader, key: str, default: str) -> str:
    act = r.opt(key, default, str)
    if act not in ("silu", "swish"):
        raise r.error(key, f"the Mamba conv activation must be 'silu', got {act!r}")
    return act


def _activation(r: _Reader, key: str, default: str) -> str:
    act = r.opt(key, default, str)
    if act not in SUPPORTED_ACTIVATIONS:
        raise r.error(
            key, f"unsupported activation {act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    return act


def _rope(r: _Reader, default_partial: float) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from ``rope_parameters`` or the legacy keys."""
    params = r.data.get("rope_parameters")
    if params is None:
        params = r.data.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise r.error("rope_parameters", f"expected an object, got {params!r}")
    params = params or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise r.error(
            "rope_parameters.rope_type",
            f"RoPE scaling {rope_type!r} is not supported yet; only 'default' is",
        )
    theta = params.get("rope_theta", r.data.get("rope_theta", 10000.0))
    theta = _json_float(r, "rope_parameters.rope_theta", theta)
    if not (math.isfinite(theta) and theta > 0):
        raise r.error("rope_parameters.rope_theta", f"must be a finite number > 0, got {theta}")
    partial = params.get(
        "partial_rotary_factor", r.data.get("partial_rotary_factor", default_partial)
    )
    partial = _json_float(r, "rope_parameters.partial_rotary_factor", partial)
    if not 0.0 < partial <= 1.0:
        raise r.error("rope_parameters.partial_rotary_factor", f"must be in (0, 1], got {partial}")
    return theta, partial


def _token_ids(r: _Reader) -> tuple[int | None, tuple[int, ...], int | None]:
    eos = r.data.get("eos_token_id")
    if eos is None:
        eos_ids: tuple[int, ...] = ()
    elif isinstance(eos, int) and not isinstance(eos, bool):
        eos_ids = (eos,)
    elif isinstance(eos, list) and all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
        eos_ids = tuple(eos)
    else:
        raise r.error("eos_token_id", f"expected an integer or a list of integers, got {eos!r}")
    return r.opt("bos_token_id", None), eos_ids, r.opt("pad_token_id", None)


def _checkpoint_fields(r: _Reader, arch: str, model_type: str, max_len: int) -> dict[str, Any]:
    """The :class:`ModelConfig` fields every family reads the same way: names, vocabulary,
    tied head, length, special token ids and dtype (``model_type`` and ``max_len`` are
    the family's defaults)."""
    bos, eos, pad = _token_ids(r)
    return dict(
        architecture=arch,
        model_type=r.opt("model_type", model_type, str),
        vocab_size=r.req("vocab_size"),
        tie_word_embeddings=r.opt("tie_word_embeddings", False, bool),
        max_position_embeddings=r.opt("max_position_embeddings", max_len),
        bos_token_id=bos,
        eos_token_ids=eos,
        pad_token_id=pad,
        torch_dtype=_dtype_name(r),
    )


def _dtype_name(r: _Reader) -> str | None:
    value = r.data.get("dtype", r.data.get("torch_dtype"))
    return value if isinstance(value, str) else None


def _attention_params(
    r: _Reader,
    *,
    head_dim_key_default: bool,
    bias: bool,
    scale: float | None,
    rope: bool,
    default_partial: float = 1.0,
) -> AttentionParams:
    hidden = r.req("hidden_size")
    heads = r.req("num_attention_heads")
    kv_heads = r.opt("num_key_value_heads", heads)
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise r.error(
            "num_key_value_heads",
            f"num_attention_heads ({heads}) must be a positive multiple of it ({kv_heads})",
        )
    if head_dim_key_default:
        head_dim = r.opt("head_dim", None) or hidden // heads
    else:
        head_dim = r.opt("head_dim", 128)  # NemotronHConfig's default
    theta, partial = _rope(r, default_partial) if rope else (None, 1.0)
    return AttentionParams(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        bias=bias,
        scale=scale if scale is not None else head_dim**-0.5,
        rope_theta=theta,
        partial_rotary_factor=partial,
    )


def _mamba_heads(r: _Reader, hidden: int, heads_key: str, expand: int) -> tuple[int, int]:
    heads = r.req(heads_key)
    intermediate = expand * hidden
    head_dim = r.data.get("mamba_d_head", "auto")
    if head_dim in (None, "auto"):
        if heads <= 0 or intermediate % heads:
            raise r.error(heads_key, f"must divide mamba_expand * hidden_size ({intermediate})")
        head_dim = intermediate // heads
    elif isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise r.error("mamba_d_head", f"expected an integer or 'auto', got {head_dim!r}")
    if heads * head_dim != intermediate:
        raise r.error(
            "mamba_d_head",
            f"mamba_n_heads * mamba_d_head ({heads} * {head_dim}) must equal "
            f"mamba_expand * hidden_size ({intermediate})",
        )
    return heads, head_dim


def _check_mamba_groups(r: _Reader, key: str, n_heads: int, n_groups: int) -> None:
    if n_groups <= 0 or n_heads % n_groups:
        raise r.error(key, f"must divide the number of Mamba heads ({n_heads}), got {n_groups}")


_GRANITE_LAYER_NAMES = {
    "mamba": MAMBA,
    "linear_attention": MAMBA,
    "attention": ATTENTION,
    "full_attention": ATTENTION,
}


def _mamba_prefixed_params(r: _Reader, hidden: int, eps: float) -> MambaParams:
    """Mamba2 settings spelled ``mamba_*``, as Granite 4.0-H and Bamba configs name them."""
    expand = r.opt("mamba_expand", 2)
    n_heads, head_dim = _mamba_heads(r, hidden, "mamba_n_heads", expand)
    n_groups = r.opt("mamba_n_groups", 1)
    _check_mamba_groups(r, "mamba_n_groups", n_heads, n_groups)
    return MambaParams(
        n_heads=n_heads,
        head_dim=head_dim,
        n_groups=n_groups,
        d_state=r.opt("mamba_d_state", 256),
        d_conv=r.opt("mamba_d_conv", 4),
        expand=expand,
        chunk_size=r.opt("mamba_chunk_size", 256),
        conv_bias=r.opt("mamba_conv_bias", True, bool),
        proj_bias=r.opt("mamba_proj_bias", False, bool),
        activation=_mamba_activation(r, "hidden_act", "silu"),
        norm_eps=eps,
        time_step_limit=_time_step_limit(r),
        time_step_min=r.opt("time_step_min", 0.001, float),
        time_step_max=r.opt("time_step_max", 0.1, float),
    )


def _parse_granite(r: _Reader, arch: str) -> ModelConfig:
    hidden = r.req("hidden_size")
    n_layers = r.num_layers()
    raw = r.data.get("layer_types", r.data.get("layers_block_type"))
    if raw is None:
        raw = ["mamba"] * n_layers  # transformers' default: all Mamba
    if not isinstance(raw, list) or len(raw) != n_layers:
        raise r.error("layer_types", f"expected a list of {n_layers} layer types, got {raw!r}")
    layer_types = []
    for t in raw:
        if t not in _GRANITE_LAYER_NAMES:
            raise r.error(
                "layer_types",
                f"unknown layer type {t!r}; expected one of {sorted(_GRANITE_LAYER_NAMES)}",
            )
        layer_types.append(_GRANITE_LAYER_NAMES[t])
    pos = r.opt("position_embedding_type", None, str)
    if pos not in (None, "rope", "nope"):
        raise r.error("position_embedding_type", f"expected 'rope' or null, got {pos!r}")
    act = _activation(r, "hidden_act", "silu")
    eps = r.opt("rms_norm_eps", 1e-6, float)
    attn = None
    if ATTENTION in layer_types:
        attn = _attention_params(
            r,
            head_dim_key_default=True,
            bias=r.opt("attention_bias", False, bool),
            scale=r.opt("attention_multiplier", 1.0, float),
            rope=pos == "rope",
        )
    mamba = _mamba_prefixed_params(r, hidden, eps) if MAMBA in layer_types else None
    moe = _granite_moe(r, act)
    return ModelConfig(
        **_checkpoint_fields(r, arch, "granitemoehybrid", 2048),
        hidden_size=hidden,
        layer_types=tuple(layer_types),
        layer_has_mlp=True,
        attention=attn,
        mamba=mamba,
        mlp=MLPParams("gated_fused", r.opt("shared_intermediate_size", 1024), act, False),
        norm_eps=eps,
        norm_weight_in_fp32=False,
        embedding_multiplier=r.opt("embedding_multiplier", 1.0, float),
        residual_multiplier=r.opt("residual_multiplier", 1.0, float),
        logits_scaling=r.opt("logits_scaling", 1.0, float),
        moe=moe,
        moe_layers=tuple(range(n_layers)) if moe is not None else (),
    )


def _positive(r: _Reader, key: str, default: Any) -> int:
    value = r.opt(key, default)
    if value <= 0:
        raise r.error(key, f"must be a positive integer, got {value}")
    return value


def _moe_params(r: _Reader, keys: dict[str, str], **kw: Any) -> MoEParams:
    """MoEParams, its consistency errors reported against the config's own keys
    (``keys``: MoEParams field -> config.json key, for the fields that differ)."""
    try:
        return MoEParams(**kw)
    except ConfigError as e:
        msg = str(e).removeprefix("MoEParams.")
        field = msg.split(" ", 1)[0]
        for name, key in keys.items():
            msg = re.sub(rf"\b{name}\b", key, msg)
        raise r.error(keys.get(field, field), msg) from None


def _granite_moe(r: _Reader, act: str) -> MoEParams | None:
    """Granite 4.0-H ``block_sparse_moe`` (every layer), or None for a dense model."""
    experts = r.opt("num_local_experts", 8)  # transformers' default when the key is absent
    if experts < 0:
        raise r.error("num_local_experts", f"must be >= 0, got {experts}")
    if experts == 0:
        return None
    return _moe_params(
        r,
        {"num_experts": "num_local_experts", "top_k": "num_experts_per_tok"},
        routing=TOPK_THEN_SOFTMAX,
        num_experts=experts,
        top_k=_positive(r, "num_experts_per_tok", 2),
        intermediate_size=_positive(r, "intermediate_size", 11008),
        gated=True,
        activation=act,
        norm_topk_prob=False,
    )


def _nemotron_moe(r: _Reader, act: str, bias: bool) -> MoEParams:
    """Nemotron-H ``E`` layers; keys as transformers' NemotronHConfig reads them."""
    alias = r.has("num_local_experts") and not r.has("n_routed_experts")
    experts_key = "num_local_experts" if alias else "n_routed_experts"
    latent = r.opt("moe_latent_size", None)
    if latent is not None and latent <= 0:
        raise r.error("moe_latent_size", f"must be a positive integer or null, got {latent}")
    return _moe_params(
        r,
        {"num_experts": experts_key, "top_k": "num_experts_per_tok"},
        routing=SIGMOID_GROUPED,
        num_experts=_positive(r, experts_key, 8),
        top_k=_positive(r, "num_experts_per_tok", 2),
        intermediate_size=_positive(r, "moe_intermediate_size", 7688),
        gated=False,
        activation=act,
        norm_topk_prob=r.opt("norm_topk_prob", True, bool),
        routed_scaling_factor=r.opt("routed_scaling_factor", 1.0, float),
        n_group=_positive(r, "n_group", 1),
        topk_group=_positive(r, "topk_group", 1),
        # transformers builds exactly one shared expert of this width, whatever
        # n_shared_experts says.
        shared_intermediate_size=_positive(r, "moe_shared_expert_intermediate_size", 7688),
        latent_size=latent,
        bias=bias,
    )


def _qwen_moe(
    r: _Reader, num_layers: int, *, act: str, always_normalise: bool
) -> tuple[MoEParams | None, tuple[int, ...]]:
    """The MoE blocks of a Qwen3-Next (``always_normalise=False``: ``norm_topk_prob`` is
    read) or Qwen3.5-MoE (every layer, always renormalised) text config, and the layers
    that have one: layer ``i`` is sparse when it is not in ``mlp_only_layers`` and
    ``(i + 1) % decoder_sparse_step == 0`` (transformers' Qwen3NextDecoderLayer).

    For the parsers of those architectures; returns ``(None, ())`` without experts.
    """
    experts = r.opt("num_experts", 512 if not always_normalise else 256)
    if experts <= 0:
        return None, ()
    if always_normalise:
        layers = tuple(range(num_layers))
        norm = True
    else:
        step = _positive(r, "decoder_sparse_step", 1)
        only = r.opt("mlp_only_layers", [], list)
        if not isinstance(only, list) or any(
            isinstance(i, bool) or not isinstance(i, int) for i in only
        ):
            raise r.error("mlp_only_layers", f"expected a list of layer indices, got {only!r}")
        layers = tuple(i for i in range(num_layers) if i not in only and (i + 1) % step == 0)
        norm = r.opt("norm_topk_prob", True, bool)
    if not layers:
        return None, ()
    moe = _moe_params(
        r,
        {"top_k": "num_experts_per_tok"},
        routing=SOFTMAX_THEN_TOPK,
        num_experts=experts,
        top_k=_positive(r, "num_experts_per_tok", 10 if not always_normalise else 8),
        intermediate_size=_positive(r, "moe_intermediate_size", 512),
        gated=True,
        activation=act,
        norm_topk_prob=norm,
        shared_intermediate_size=_positive(r, "shared_expert_intermediate_size", 512),
        shared_gate=True,
    )
    return moe, layers


_NEMOTRON_PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
_NEMOTRON_NAMES = {
    "mamba": MAMBA,
    "linear_attention": MAMBA,
    "attention": ATTENTION,
    "full_attention": ATTENTION,
    "mlp": MLP,
    "moe": MOE,
}


def _parse_nemotron(r: _Reader, arch: str) -> ModelConfig:
    hidden = r.req("hidden_size")
    field = next((k for k in ("layers_block_type", "layer_types") if r.has(k)), None)
    if field is not None:
        raw = r.data[field]
        if not isinstance(raw, list) or any(t not in _NEMOTRON_NAMES for t in raw):
            raise r.error(field, f"expected a list of {sorted(_NEMOTRON_NAMES)}, got {raw!r}")
        layer_types = [_NEMOTRON_NAMES[t] for t in raw]
    elif r.has("hybrid_override_pattern"):
        field = "hybrid_override_pattern"
        pattern = r.req(field, str)
        bad = sorted(set(pattern) - set(_NEMOTRON_PATTERN))
        if bad:
            raise r.error(
                field,
                f"unknown layer codes {bad}; expected M (mamba), * (attention), - (mlp), "
                "E (mixture of experts)",
            )
        layer_types = [_NEMOTRON_PATTERN[c] for c in pattern]
    else:
        raise r.error(
            "layers_block_type",
            "missing; give 'layers_block_type' (a list) or 'hybrid_override_pattern' "
            '(e.g. "M-M*")',
        )
    if not layer_types:
        raise r.error(field, "no layers")
    if len(layer_types) > MAX_LAYERS:
        raise r.error(
            field, f"{len(layer_types)} layers is beyond any supported model (at most {MAX_LAYERS})"
        )
    eps = r.opt("layer_norm_epsilon", 1e-5, float)
    attn = None
    if ATTENTION in layer_types:
        # transformers' NemotronHAttention builds q/k/v/o without bias and without RoPE.
        attn = _attention_params(r, head_dim_key_default=False, bias=False, scale=None, rope=False)
    mamba = None
    if MAMBA in layer_types:
        n_heads = r.req("mamba_num_heads")
        n_groups = r.first(("mamba_n_groups", "n_groups"), 8)
        _check_mamba_groups(r, "n_groups", n_heads, n_groups)
        t_min = r.first(("mamba_dt_min", "time_step_min"), 0.001, float)
        mamba = MambaParams(
            n_heads=n_heads,
            head_dim=r.req("mamba_head_dim"),
            n_groups=n_groups,
            d_state=r.opt("ssm_state_size", 128),
            d_conv=r.first(("mamba_d_conv", "conv_kernel"), 4),
            expand=r.first(("mamba_expand", "expand"), 2),
            chunk_size=r.first(("mamba_chunk_size", "chunk_size"), 128),
            conv_bias=r.first(("mamba_conv_bias", "use_conv_bias"), True, bool),
            proj_bias=r.opt("use_bias", False, bool),
            activation=_mamba_activation(r, "mamba_hidden_act", "silu"),
            norm_eps=eps,
            # transformers ignores the file's time_step_limit and uses (time_step_min, inf).
            time_step_limit=(t_min, math.inf),
            time_step_min=t_min,
            time_step_max=r.first(("mamba_dt_max", "time_step_max"), 0.1, float),
        )
    mlp = None
    if MLP in layer_types:
        mlp = MLPParams(
            "plain",
            r.req("intermediate_size"),
            _activation(r, "mlp_hidden_act", "relu2"),
            r.opt("mlp_bias", False, bool),
        )
    moe = None
    if MOE in layer_types:
        moe = _nemotron_moe(
            r, _activation(r, "mlp_hidden_act", "relu2"), r.opt("mlp_bias", False, bool)
        )
    return ModelConfig(
        **_checkpoint_fields(r, arch, "nemotron_h", 4096),
        hidden_size=hidden,
        layer_types=tuple(layer_types),
        layer_has_mlp=False,
        attention=attn,
        mamba=mamba,
        mlp=mlp,
        norm_eps=eps,
        norm_weight_in_fp32=True,
        moe=moe,
        moe_layers=tuple(i for i, t in enumerate(layer_types) if t == MOE),
    )


def _parse_bamba(r: _Reader, arch: str) -> ModelConfig:
    hidden = r.req("hidden_size")
    n_layers = r.num_layers()
    attn_idx = r.opt("attn_layer_indices", [], list)
    if not isinstance(attn_idx, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers for i in attn_idx
    ):
        raise r.error(
            "attn_layer_indices", f"expected layer indices in [0, {n_layers}), got {attn_idx!r}"
        )
    layer_types = tuple(ATTENTION if i in attn_idx else MAMBA for i in range(n_layers))
    act = _activation(r, "hidden_act", "silu")
    eps = r.opt("rms_norm_eps", 1e-5, float)
    attn = None
    if ATTENTION in layer_types:
        # transformers' BambaConfig hard-codes partial_rotary_factor 0.5 unless the file sets one.
        attn = _attention_params(
            r,
            head_dim_key_default=True,
            bias=r.opt("attention_bias", False, bool),
            scale=None,
            rope=True,
            default_partial=0.5,
        )
    mamba = _mamba_prefixed_params(r, hidden, eps) if MAMBA in layer_types else None
    return ModelConfig(
        **_checkpoint_fields(r, arch, "bamba", 262144),
        hidden_size=hidden,
        layer_types=layer_types,
        layer_has_mlp=True,
        attention=attn,
        mamba=mamba,
        mlp=MLPParams("gated", r.req("intermediate_size"), act, r.opt("mlp_bias", False, bool)),
        norm_eps=eps,
        norm_weight_in_fp32=False,
    )


_QWEN_LAYER_NAMES = {"linear_attention": GDN, "full_attention": ATTENTION}


def _qwen_layer_types(r: _Reader) -> tuple[str, ...]:
    """``layer_types``, or transformers' default: every ``full_attention_interval``-th
    layer (4) is attention, the others linear attention."""
    n_layers = r.num_layers()
    raw = r.data.get("layer_types")
    if raw is None:
        interval = r.opt("full_attention_interval", 4)
        if interval <= 0:
            raise r.error("full_attention_interval", f"must be positive, got {interval}")
        raw = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(n_layers)
        ]
    if not isinstance(raw, list) or len(raw) != n_layers:
        raise r.error("layer_types", f"expected a list of {n_layers} layer types, got {raw!r}")
    bad = sorted({t for t in raw if t not in _QWEN_LAYER_NAMES}, key=str)
    if bad:
        raise r.error(
            "layer_types",
            f"unknown layer types {bad}; expected 'linear_attention' or 'full_attention'",
        )
    return tuple(_QWEN_LAYER_NAMES[t] for t in raw)


def _gdn_activation(r: _Reader) -> str:
    """The GDN conv's activation: transformers applies ``hidden_act`` there."""
    act = r.opt("hidden_act", "silu", str)
    if act not in ("silu", "swish"):
        raise r.error(
            "hidden_act", f"the Gated DeltaNet conv activation must be 'silu', got {act!r}"
        )
    return act


def _qwen_gdn_params(r: _Reader, fused: bool, eps: float) -> GDNParams:
    k_heads = r.opt("linear_num_key_heads", 16)
    v_heads = r.opt("linear_num_value_heads", 32)
    if k_heads <= 0 or v_heads <= 0 or v_heads % k_heads:
        raise r.error(
            "linear_num_value_heads",
            f"must be a positive multiple of linear_num_key_heads ({k_heads}), got {v_heads}",
        )
    d_conv = r.opt("linear_conv_kernel_dim", 4)
    if d_conv < 2:
        raise r.error("linear_conv_kernel_dim", f"must be at least 2, got {d_conv}")
    return GDNParams(
        num_key_heads=k_heads,
        num_value_heads=v_heads,
        key_head_dim=r.opt("linear_key_head_dim", 128),
        value_head_dim=r.opt("linear_value_head_dim", 128),
        d_conv=d_conv,
        activation=_gdn_activation(r),
        norm_eps=eps,
        fused_projections=fused,
    )


def _qwen_attention_params(r: _Reader) -> AttentionParams:
    hidden = r.req("hidden_size")
    heads = r.req("num_attention_heads")
    kv_heads = r.opt("num_key_value_heads", heads)
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise r.error(
            "num_key_value_heads",
            f"num_attention_heads ({heads}) must be a positive multiple of it ({kv_heads})",
        )
    head_dim = r.opt("head_dim", None) or hidden // heads
    # Text-only positions give all three mrope sections the same position, which makes
    # multimodal RoPE plain RoPE over the rotated channels: mrope_section is not needed.
    theta, partial = _rope(r, 0.25)
    return AttentionParams(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        bias=r.opt("attention_bias", False, bool),
        scale=head_dim**-0.5,
        rope_theta=theta,
        partial_rotary_factor=partial,
        output_gate=True,
        qk_norm=True,
    )


def _parse_qwen(
    r: _Reader, arch: str, *, fused: bool, default_model_type: str, moe_everywhere: bool = False
) -> ModelConfig:
    """Qwen3.5 / Qwen3-Next text configs. ``fused``: Qwen3-Next (fused GDN projections,
    sparse layers per ``decoder_sparse_step``); ``moe_everywhere``: Qwen3.5-MoE (every
    layer's MLP is a mixture of experts, always renormalised; no dense MLP)."""
    hidden = r.req("hidden_size")
    layer_types = _qwen_layer_types(r)
    act = _activation(r, "hidden_act", "silu")
    moe, moe_layers = None, ()
    if fused:  # Qwen3-Next: sparse layers per decoder_sparse_step / mlp_only_layers
        moe, moe_layers = _qwen_moe(r, len(layer_types), act=act, always_normalise=False)
    elif moe_everywhere:
        moe, moe_layers = _qwen_moe(r, len(layer_types), act=act, always_normalise=True)
        if moe is None:
            raise r.error("num_experts", "a Qwen3.5-MoE model needs num_experts > 0")
    dense = None if moe_everywhere else MLPParams("gated", r.req("intermediate_size"), act, False)
    eps = r.opt("rms_norm_eps", 1e-6, float)
    attn = _qwen_attention_params(r) if ATTENTION in layer_types else None
    gdn = _qwen_gdn_params(r, fused, eps) if GDN in layer_types else None
    return ModelConfig(
        **_checkpoint_fields(r, arch, default_model_type, 32768),
        hidden_size=hidden,
        layer_types=layer_types,
        layer_has_mlp=True,
        attention=attn,
        mamba=None,
        mlp=dense,
        norm_eps=eps,
        # (1 + weight) is formed and multiplied in float32, then cast once.
        norm_weight_in_fp32=True,
        gdn=gdn,
        norm_zero_centred=True,
        moe=moe,
        moe_layers=moe_layers,
    )


def _parse_qwen3_5(r: _Reader, arch: str) -> ModelConfig:
    return _parse_qwen(r, arch, fused=False, default_model_type="qwen3_5_text")


def _parse_qwen3_5_vl(r: _Reader, arch: str, moe_everywhere: bool = False) -> ModelConfig:
    """The vision-language wrapper: its language model is a ``text_config``; the vision
    tower's weights are skipped by the loader. Fields the wrapper sets itself (token ids,
    ``tie_word_embeddings``, the dtype) win over the text config's."""
    text = r.data.get("text_config")
    if not isinstance(text, dict):
        raise r.error("text_config", f"expected an object with the language model's config, got {text!r}")
    merged = dict(text)
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id",
                "dtype", "torch_dtype"):
        if r.data.get(key) is not None:
            merged[key] = r.data[key]
    return _parse_qwen(
        _Reader(merged, f"{r.source} (text_config)"), arch, fused=False,
        default_model_type="qwen3_5_moe_text" if moe_everywhere else "qwen3_5_text",
        moe_everywhere=moe_everywhere,
    )


def _parse_qwen3_5_moe(r: _Reader, arch: str) -> ModelConfig:
    return _parse_qwen(r, arch, fused=False, default_model_type="qwen3_5_moe_text",
                       moe_everywhere=True)


def _parse_qwen3_5_moe_vl(r: _Reader, arch: str) -> ModelConfig:
    return _parse_qwen3_5_vl(r, arch, moe_everywhere=True)


def _parse_qwen3_next(r: _Reader, arch: str) -> ModelConfig:
    return _parse_qwen(r, arch, fused=True, default_model_type="qwen3_next")


_PARSERS = {
    "GraniteMoeHybridForCausalLM": _parse_granite,
    "NemotronHForCausalLM": _parse_nemotron,
    "BambaForCausalLM": _parse_bamba,
    "Qwen3_5ForCausalLM": _parse_qwen3_5,
    "Qwen3_5ForConditionalGeneration": _parse_qwen3_5_vl,
    "Qwen3NextForCausalLM": _parse_qwen3_next,
    "Qwen3_5MoeForCausalLM": _parse_qwen3_5_moe,
    "Qwen3_5MoeForConditionalGeneration": _parse_qwen3_5_moe_vl,
}
