"""Structured outputs: constraints on what a request may generate (JSON schemas,
regexes, choices, grammars), compiled to per-token masks the sampler applies."""

from hybridserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
