"""hybridserve: an inference engine for hybrid Mamba2/attention language models."""

from hybridserve.llm import LLM
from hybridserve.step import CompletionOutput, Logprob, RequestOutput, SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
