"""Request bodies of the OpenAI-compatible API, as strict pydantic models.

Contract: a field this server does not implement is refused (``extra="forbid"``), never
ignored; types are strict (``"1"`` is not an integer). Ranges of sampling fields are
checked by :class:`~hybridserve.SamplingParams` itself, so the offline API and the
server accept exactly the same values; :func:`sampling_params` maps a request onto it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from hybridserve.engine.request import SamplingParams

# Bounds that protect the server rather than restate SamplingParams' ranges: one
# request must not fan out into more sequences than a batch holds.
MAX_N = 16
MAX_BATCH_PROMPTS = 64
_INT64 = 2**63


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: Annotated[int, Field(ge=-_INT64, lt=_INT64)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


TokenIds = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is text, a batch of texts, token ids or a
    batch of token-id lists; ``logprobs`` is the number of top candidates per token."""

    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)]
    )
    max_tokens: int | None = 16
    logprobs: int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str | None:
        """The content as one string (text parts joined), None when absent."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: ``logprobs`` is a switch and ``top_logprobs`` the
    number of candidates per token, as in OpenAI's chat API."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest, logprobs: int | None
) -> SamplingParams:
    """The request's sampling settings; raises ValueError naming the field when a value
    is out of range (SamplingParams' own checks)."""
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    kwargs = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }
    return SamplingParams(
        n=req.n,
        max_tokens=max_tokens,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        **{k: v for k, v in kwargs.items() if v is not None},
    )


SAMPLING_FIELDS = frozenset(_SamplingFields.model_fields) | {
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "prompt",
    "messages",
}
