"""Engine configuration: frozen dataclasses validated once, with errors that name the field.

The model's own configuration (parsed from a checkpoint's ``config.json``) lives in
:mod:`hybridserve.models.config` beside the code that interprets it; this module holds
what the engine decides: cache sizes, scheduling budgets and speculative decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    # float64 is for reference computations in tests, not for serving.
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}


def resolve_dtype(value: str | torch.dtype, field_name: str = "dtype") -> torch.dtype:
    """Map a user-facing dtype spelling to a torch dtype, or raise naming the field."""
    if isinstance(value, torch.dtype):
        if value in _DTYPES.values():
            return value
        raise ValueError(f"{field_name}={value} is not supported; use float32, bfloat16 or float16")
    try:
        return _DTYPES[str(value).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(
            f"{field_name}={value!r} is not supported; use one of {sorted(set(_DTYPES))}"
        ) from None


CHECKPOINT_POLICIES = ("grid", "junction", "prompt_end", "finished")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Sizes and policies of the attention KV cache and the recurrent-state page pool.

    ``state_interval`` is the checkpoint grid (a multiple of ``kv_block_size``).
    ``checkpoint_policies`` selects which positions get a state checkpoint: ``grid``
    (every multiple of ``state_interval``), ``junction`` (where a new prompt leaves
    the cached path), ``prompt_end`` (each prompt's end, rounded down to a block) and
    ``finished`` (each finished sequence's end, rounded down to a block).
    ``max_checkpoint_pages`` caps the pages checkpoints may hold (None: a quarter of
    the pool); beyond it checkpoints are evicted by ``eviction_policy``: ``lru`` or
    ``flop_aware`` (recency plus ``eviction_alpha`` (default 2) times the prefill FLOPs a hit saves;
    see :mod:`hybridserve.cache.state_cache`).
    ``checkpoint_offload_gib`` (or, exactly, ``checkpoint_offload_pages``) sizes the host
    tier that evicted checkpoints move to instead of being dropped (0: no tier; see
    :mod:`hybridserve.cache.host_tier`).
    """

    kv_block_size: int = 16
    num_kv_blocks: int = 1024
    num_state_pages: int = 256
    enable_prefix_caching: bool = True
    state_interval: int = 64
    checkpoint_policies: tuple[str, ...] = CHECKPOINT_POLICIES
    max_checkpoint_pages: int | None = None
    ssm_state_dtype: torch.dtype = torch.float32
    eviction_policy: str = "lru"
    eviction_alpha: float = 2.0
    checkpoint_offload_gib: float = 0.0
    checkpoint_offload_pages: int | None = None

    def __post_init__(self) -> None:
        if self.kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {self.kv_block_size}")
        if self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.num_state_pages < 2:
            raise ValueError(f"num_state_pages must be >= 2, got {self.num_state_pages}")
        if self.state_interval < 1 or self.state_interval % self.kv_block_size:
            raise ValueError(
                f"state_interval={self.state_interval} must be a positive multiple of "
                f"kv_block_size={self.kv_block_size} (checkpoints sit on KV block boundaries)"
            )
        if self.eviction_policy not in ("lru", "flop_aware"):
            raise ValueError(
                f"eviction_policy={self.eviction_policy!r} is not supported; use 'lru' or 'flop_aware'"
            )
        bad = [p for p in self.checkpoint_policies if p not in CHECKPOINT_POLICIES]
        if bad:
            raise ValueError(
                f"checkpoint_policies has unknown entries {bad}; choose from {CHECKPOINT_POLICIES}"
            )
        if not self.checkpoint_offload_gib >= 0:
            raise ValueError(
                f"checkpoint_offload_gib must be >= 0, got {self.checkpoint_offload_gib}"
            )
        if self.checkpoint_offload_pages is not None:
            if self.checkpoint_offload_pages < 0:
                raise ValueError(
                    f"checkpoint_offload_pages must be >= 0, got {self.checkpoint_offload_pages}"
                )
            if self.checkpoint_offload_gib:
                raise ValueError("give checkpoint_offload_gib or checkpoint_offload_pages, not both")
        if self.max_checkpoint_pages is not None and not (
            0 <= self.max_checkpoint_pages < self.num_state_pages
        ):
            raise ValueError(
                f"max_checkpoint_pages={self.max_checkpoint_pages} must be in "
                f"[0, num_state_pages={self.num_state_pages})"
            )

    @property
    def checkpoint_budget(self) -> int:
        if self.max_checkpoint_pages is not None:
            return self.max_checkpoint_pages
        return self.num_state_pages // 4


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Per-step budgets. ``max_num_batched_tokens`` bounds the tokens of one forward
    (prefill chunks are cut to fit); ``max_num_seqs`` bounds the rows of one step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


SPEC_METHODS = ("ngram", "draft_model", "mtp")


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Speculative decoding, spelled as vLLM users write ``speculative_config``.

    ``method="ngram"``: prompt lookup; the last ``prompt_lookup_max`` down to
    ``prompt_lookup_min`` tokens are matched against earlier text and the tokens that
    followed the match are proposed, up to ``num_speculative_tokens`` of them.

    ``method="draft_model"``: a second, smaller checkpoint at ``model`` (any supported
    architecture with the target's vocabulary) proposes ``num_speculative_tokens``
    tokens autoregressively, with KV blocks and state pages of its own
    (:mod:`hybridserve.spec.draft_model`).

    ``method="mtp"``: the target checkpoint's own multi-token-prediction head
    (``mtp.*`` weights, Qwen3.5 / Qwen3-Next) proposes them from the target's last
    hidden state.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config.method={self.method!r} is not supported; use one of "
                f"{list(SPEC_METHODS)}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                "speculative_config.num_speculative_tokens must be in [1, 16], got "
                f"{self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError(
                "speculative_config.model is required with method='draft_model' (the draft "
                "checkpoint's path)"
            )
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(
                f"speculative_config.model is only used with method='draft_model', not "
                f"method={self.method!r}"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SpecConfig | None:
        if d is None:
            return None
        if isinstance(d, SpecConfig):
            return d
        if not isinstance(d, dict):
            raise TypeError("speculative_config must be a dict such as {'method': 'ngram', ...}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config has unsupported keys {unknown}; known: {sorted(known)}")
        if "model" in d and d["model"] is not None:
            d = {**d, "model": str(d["model"])}
        return cls(**d)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine core needs besides the model."""

    model: str
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig | None = None
