"""Maps a checkpoint's ``architectures`` name to the model class that implements it."""

from __future__ import annotations

from hybridserve.models.config import ConfigError
from hybridserve.models.hybrid import (
    BambaForCausalLM,
    GraniteMoeHybridForCausalLM,
    HybridForCausalLM,
    NemotronHForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3NextForCausalLM,
)

MODEL_CLASSES: dict[str, type[HybridForCausalLM]] = {
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
}


def model_class(architecture: str) -> type[HybridForCausalLM]:
    """The class for ``architecture``; raises :class:`ConfigError` listing the supported ones."""
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ConfigError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_CLASSES)}"
        ) from None
