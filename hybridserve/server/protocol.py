"""Request bodies of the OpenAI-compatible API, as pydantic models.

Contract (vLLM's policy): a field this server does not know is ignored, and the
handler logs it (:func:`unknown_fields` lists them); a ``null`` stands for the field's
default (``"n": null`` is ``n=1``), so clients that send back every field of a reply
(the openai SDK's ``message.model_dump()`` with its ``refusal``, ``annotations`` and
``audio`` nulls) work. Types of known fields are strict (``"1"`` is not an integer).
Ranges of sampling fields are checked by :class:`~hybridserve.SamplingParams` itself,
so the offline API and the server accept exactly the same values;
:func:`sampling_params` maps a request onto it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hybridserve.engine.request import SamplingParams
from hybridserve.structured.params import StructuredOutputsParams

# Bounds that protect the server rather than restate SamplingParams' ranges: one
# request must not fan out into more sequences than a batch holds.
MAX_N = 16
MAX_BATCH_PROMPTS = 64
_INT64 = 2**63


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        # A null means "not given": the field's default applies.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "bad_words": ([],),
    "best_of": (1,),
    "suffix": ("",),
    "use_beam_search": (False,),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
}
"""Fields vLLM implements and this server does not yet, with the values that ask for
nothing (accepted): any other value is a 400, since ignoring it would change the
answer's meaning (an ``echo`` or ``logit_bias`` the client relies on). Other unknown
fields are ignored with a warning."""


def unsupported_field(model: BaseModel) -> str | None:
    """The first top-level field of :data:`UNSUPPORTED_FIELDS` set to a value that asks
    for something, or None."""
    for key, value in (model.model_extra or {}).items():
        if key in UNSUPPORTED_FIELDS and value not in UNSUPPORTED_FIELDS[key]:
            return key
    return None


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The dotted paths of the fields in ``model`` (and its nested models) that this
    server does not know; they were ignored."""
    found = [prefix + k for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                sub = f"{prefix}{name}.{i}." if isinstance(value, list) else f"{prefix}{name}."
                found += unknown_fields(item, sub)
    return found


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` request field: the fields of
    :class:`~hybridserve.StructuredOutputsParams`."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def params(self) -> StructuredOutputsParams:
        fields = self.model_dump(exclude_none=True, by_alias=True)
        fields = {k: v for k, v in fields.items() if k in StructuredOutputsParams.__slots__}
        return StructuredOutputsParams(**fields)


class JSONSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object) or ``json_schema`` (``{"json_schema": {"name", "schema", "strict"}}``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


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
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    # OpenAI's spelling: token ids as strings (JSON object keys), biases in [-100, 100].
    logit_bias: dict[str, float] | None = None
    # vLLM's extra field: the top-k logprobs of every prompt token (after the first).
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        """What ``response_format`` / ``structured_outputs`` ask the output to match;
        ValueError naming the field for a bad or doubled one."""
        fmt = self.response_format
        if fmt is not None and fmt.type != "text" and self.structured_outputs is not None:
            raise ValueError(
                "response_format: give response_format or structured_outputs, not both"
            )
        if self.structured_outputs is not None:
            return self.structured_outputs.params()
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise ValueError(
                "response_format.json_schema.schema is required for type json_schema"
            )
        return StructuredOutputsParams(
            json=fmt.json_schema.json_schema,
            disable_additional_properties=bool(fmt.json_schema.strict),
        )


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
    # Return the prompt before the completion (with its logprobs when logprobs is set).
    echo: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI shape the chat template and the tool parsers take."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCallRef(_Strict):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """One message of the history; ``role`` is any name the chat template knows."""

    role: Annotated[str, Field(min_length=1)]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallRef] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

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
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's shape): ``prompt`` text, or chat ``messages`` rendered
    with the chat template first (with the chat fields that shape the rendering)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    documents: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int]


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    logprobs: int | None,
    structured: StructuredOutputsParams | None = None,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """The request's sampling settings; raises ValueError naming the field when a value
    is out of range (SamplingParams' own checks). ``defaults`` (the checkpoint's
    ``generation_config.json`` sampling) fill the sampling fields the request leaves
    unset."""
    max_tokens = req.max_tokens
    prompt_logprobs = req.prompt_logprobs
    if isinstance(req, CompletionRequest) and req.echo and logprobs is not None:
        # Echoed prompt tokens come with logprobs as the generated ones do (at least
        # as many candidates as asked for either).
        prompt_logprobs = max(logprobs, prompt_logprobs or 0)
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
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        structured_outputs=structured,
        min_tokens=req.min_tokens,
        allowed_token_ids=req.allowed_token_ids,
        logit_bias=_logit_bias(req.logit_bias),
        prompt_logprobs=prompt_logprobs,
        **{**(defaults or {}), **{k: v for k, v in kwargs.items() if v is not None}},
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """``logit_bias`` with its keys as token ids; ValueError naming the field for a key
    that is not one."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if token < 0 or str(token) != key.strip():
            raise ValueError(f"logit_bias: {key!r} is not a token id (a non-negative integer)")
        out[token] = value
    return out


SAMPLING_FIELDS = frozenset(_SamplingFields.model_fields) | {
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "prompt",
    "messages",
}
