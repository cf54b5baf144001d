"""hybridserve: an inference engine for hybrid Mamba2/attention language models.

The public names are imported on first use, so that ``import hybridserve`` (and the
command line's ``--help`` and ``--version``) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "hybridserve.llm",
    "CompletionOutput": "hybridserve.step",
    "Logprob": "hybridserve.step",
    "RequestOutput": "hybridserve.step",
    "SamplingParams": "hybridserve.step",
    "StructuredOutputsParams": "hybridserve.structured",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]

if TYPE_CHECKING:
    from hybridserve.llm import LLM
    from hybridserve.step import CompletionOutput, Logprob, RequestOutput, SamplingParams
    from hybridserve.structured import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
