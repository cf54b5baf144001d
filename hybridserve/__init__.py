"""hybridserve: an inference engine for hybrid Mamba2/attention language models."""

from hybridserve.engine.request import CompletionOutput, Logprob, RequestOutput, SamplingParams
from hybridserve.llm import LLM
from hybridserve.structured import StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"
