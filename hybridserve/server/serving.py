"""Completions and chat completions: requests in, engine requests out, and engine
outputs back as OpenAI responses (whole, or as server-sent events).

Contracts:

- Validation happens before anything is queued: a request that fails it leaves the
  engine untouched and gets a 4xx naming the field. A prompt must leave room for its
  ``max_tokens`` within ``max_model_len`` (when ``max_tokens`` is given).
- One large request cannot stall the other clients: what the event loop does with a
  request is bounded (its body is capped, see ``openai_api``; text longer than
  ``max_model_len * MAX_CHARS_PER_TOKEN`` characters is refused before it is
  tokenized), and tokenizing and chat-template rendering run on a thread pool.
- A request of ``k`` prompts becomes ``k`` engine requests (``<id>-<i>``); each asks
  for ``n`` sequences; choice ``i * n + j`` is sequence ``j`` of prompt ``i``.
- Whatever ends a response early (client gone, an error while formatting, server
  shutdown) aborts every engine request of that response, so its pages are freed.
- A failure on the server's side reaches the client as a generic message with the
  request id; the log has the details under that id.
- A stream sends each choice's ``finish_reason`` exactly once.
- Streamed text deltas concatenate to the non-streamed text: a delta never ends in a
  partial UTF-8 character and never shows the start of what could become a stop string.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import jinja2
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive

from hybridserve.chat_template import ChatTemplateError, render_chat
from hybridserve.engine.request import CompletionOutput, Logprob, RequestOutput, SamplingParams
from hybridserve.reasoning import ReasoningParser, get_reasoning_parser, prompt_opens_reasoning
from hybridserve.server.async_engine import AsyncEngine, EngineError, EngineStopped, RequestStream
from hybridserve.server.chat_output import ChoiceSplitter, OutputSplit, SplitDelta
from hybridserve.server.errors import APIError, error_body, param_from_message
from hybridserve.server.protocol import (
    SAMPLING_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    sampling_params,
    unknown_fields,
    unsupported_field,
)
from hybridserve.structured.params import StructuredOutputsParams
from hybridserve.tokenizer import Tokenizer
from hybridserve.tools.grammar import single_token_tags, tool_call_grammar
from hybridserve.tools.parsers import get_tool_parser

log = logging.getLogger("hybridserve.server")

Prompt = tuple[str | None, list[int]]
T = TypeVar("T")

MAX_CHARS_PER_TOKEN = 64
"""The early length bound: text of more than ``max_model_len * MAX_CHARS_PER_TOKEN``
characters is refused untokenized. Tokenizers average a few characters per token and
their longest tokens are far shorter than this, so text that fits the context is not
refused in practice; tokenizing costs about a microsecond per character, which the
bound caps."""

TOKENIZER_THREADS = 2
"""Threads that tokenize and render chat templates, off the event loop."""

PREDICTED_CACHED_HEADER = "x-hybridserve-predicted-cached-tokens"
"""Response header: the prompt tokens the prefix cache held for the request's prompts
when they arrived (summed), by the lookup admission makes; ``usage`` reports what
admission actually took, which differs only if the caches changed in between."""


@dataclass
class ServingConfig:
    """What the handlers need to know about the model being served."""

    model_name: str
    model_aliases: frozenset[str]
    max_model_len: int
    tokenizer: Tokenizer | None
    chat_template: jinja2.Template | None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    default_sampling: dict[str, Any] = field(default_factory=dict)
    # usage.prompt_tokens_details.cached_tokens and the predicted-hit header.
    enable_prompt_tokens_details: bool = True

    @property
    def max_prompt_chars(self) -> int:
        """The early length bound on prompt text and chat content, in characters."""
        return self.max_model_len * MAX_CHARS_PER_TOKEN


class OpenAIServing:
    """Handlers for ``/v1/completions`` and ``/v1/chat/completions``.

    The handlers run on one event loop; :meth:`end_in_flight` and :meth:`close` are
    called on that loop too."""

    def __init__(self, engine: AsyncEngine, config: ServingConfig) -> None:
        self.engine = engine
        self.config = config
        self._pool = concurrent.futures.ThreadPoolExecutor(
            TOKENIZER_THREADS, thread_name_prefix="hybridserve-tokenize"
        )
        # Streams of responses in progress, so a shutdown can fail them.
        self._live: set[RequestStream] = set()
        self._closing = False
        # Parser tag -> its id when it is one special token (else None).
        self._tag_ids: dict[str, int | None] = {}
        self._envelope_ids: dict[str, dict[str, int]] = {}

    def end_in_flight(self, message: str = "the server is shutting down") -> None:
        """Fail every response in progress with a 503 (a JSON error, or an error event
        and ``[DONE]`` in a stream) and refuse new ones; their engine requests are
        aborted as the responses end."""
        self._closing = True
        if self._live:
            log.warning("ending %d request(s) still running: %s", len(self._live), message)
        for stream in list(self._live):
            stream.fail(EngineStopped(message))

    def close(self) -> None:
        self._closing = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _offload(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    # ---- endpoints ---------------------------------------------------------------

    async def completions(self, req: CompletionRequest, receive: Receive) -> Any:
        _warn_unknown(req, "/v1/completions")
        self.check_model(req.model)
        _check_stream_options(req)
        if req.logprobs is not None and not isinstance(req.logprobs, int):
            raise APIError(400, "logprobs must be an integer", param="logprobs")
        params = self._params(req, req.logprobs, self._constraint(req))
        prompts = await self._completion_prompts(req.prompt)
        for text_and_ids in prompts:
            self._check_length(text_and_ids[1], params.max_tokens, "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        fmt = _CompletionFormat(
            self, rid, req.n, req.logprobs, echo=req.echo,
            prompt_logprobs=req.prompt_logprobs is not None,
        )
        fmt.prompts = prompts
        return await self._respond(rid, prompts, params, req, fmt, receive)

    async def chat(self, req: ChatCompletionRequest, receive: Receive) -> Any:
        _warn_unknown(req, "/v1/chat/completions")
        self.check_model(req.model)
        _check_stream_options(req)
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(
                400, "prompt_logprobs is not supported with stream=true in chat completions",
                param="prompt_logprobs", code="invalid_value",
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        top = req.top_logprobs or 0
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise APIError(
                400,
                "give max_tokens or max_completion_tokens, not both",
                param="max_completion_tokens",
            )
        tools = [t.to_dict() for t in req.tools or []]
        constraint = self._constraint(req)
        split, constraint = self._tool_choice(req, tools, constraint)
        params = self._params(req, top if req.logprobs else None, constraint)
        prompt = await self._chat_prompt(req, tools)
        self._check_length(prompt[1], params.max_tokens, "messages")
        if self.config.reasoning_parser is not None:
            split.reasoning = get_reasoning_parser(self.config.reasoning_parser)
        split.constrained = constraint is not None
        if constraint is not None and split.reasoning is not None:
            tag = self._reasoning_end_tokens(split.reasoning, prompt[0] or "", req.chat_template_kwargs)
            if tag:
                # The output starts as reasoning: the grammar applies after it, as
                # vLLM's does, and the reasoning is parsed as usual.
                params.structured_outputs = dataclasses.replace(constraint, after_token_ids=tag)
                split.constrained = False
        split.prompt = prompt[0] or ""
        split.chat_template_kwargs = req.chat_template_kwargs
        params.keep_special_token_ids = self._special_tag_ids(split.tags)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        fmt = _ChatFormat(self, rid, req.n, top if req.logprobs else None, split=split)
        return await self._respond(rid, [prompt], params, req, fmt, receive)

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        _warn_unknown(req, "/tokenize")
        self.check_model(req.model)
        tok = self._need_tokenizer("prompt")
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give prompt or messages (one of them)", param="prompt")
        if req.messages is not None:
            chat = ChatCompletionRequest.model_validate(
                {
                    k: getattr(req, k)
                    for k in ("messages", "add_generation_prompt", "continue_final_message",
                              "chat_template_kwargs", "tools", "documents")
                    if getattr(req, k) is not None
                }
            )
            tools = [t.to_dict() for t in chat.tools or []]
            text, ids = await self._chat_prompt(chat, tools)
            if req.add_special_tokens:
                ids = tok.encode(text)
        else:
            self._check_text(req.prompt, "prompt")
            special = True if req.add_special_tokens is None else req.add_special_tokens
            text = req.prompt
            ids = await self._offload(lambda: tok.encode_batch([text], special)[0])
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.config.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
        if req.return_token_strs:
            out["token_strs"] = [tok.id_to_token(i) for i in ids]
        return out

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        _warn_unknown(req, "/detokenize")
        self.check_model(req.model)
        tok = self._need_tokenizer("tokens")
        vocab = tok.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(
                400, f"tokens: {bad} is not a token id of this model (0 to {vocab - 1})",
                param="tokens", code="invalid_value",
            )
        ids = list(req.tokens)
        return {"prompt": await self._offload(lambda: tok.decode(ids, skip_special_tokens=False))}

    def _special_tag_ids(self, tags: list[str]) -> frozenset[int]:
        """The ids of those ``tags`` that are single special tokens of the tokenizer (a
        decode skipping special tokens would drop them), so the output keeps their text
        for the parsers, which then take them out of the content."""
        tok = self.config.tokenizer
        if tok is None or not tags:
            return frozenset()
        cache = self._tag_ids
        ids = set()
        for tag in tags:
            if tag not in cache:
                enc = tok.encode(tag, add_special_tokens=False)
                special = (
                    len(enc) == 1
                    and tok.decode(enc, skip_special_tokens=True) == ""
                    and tok.decode(enc, skip_special_tokens=False) == tag
                )
                cache[tag] = enc[0] if special else None
            if cache[tag] is not None:
                ids.add(cache[tag])
        return frozenset(ids)

    def _envelope_tag_ids(self, parser: str) -> dict[str, int]:
        """The tool-call envelope tags of ``parser`` that the tokenizer has as single
        tokens (the forcing grammar writes those tokens); computed once."""
        if parser not in self._envelope_ids:
            tok = self.config.tokenizer
            found = {} if tok is None else single_token_tags(
                parser,
                lambda text: tok.encode(text, add_special_tokens=False),
                lambda ids: tok.decode(ids, skip_special_tokens=False),
            )
            # A token past the model's logits can never be sampled: such a tag stays text.
            width = self.engine.engine.vocab_size
            self._envelope_ids[parser] = {t: i for t, i in found.items() if i < width}
        return self._envelope_ids[parser]

    def _reasoning_end_tokens(
        self, parser: type[ReasoningParser], prompt: str, chat_template_kwargs: dict[str, Any] | None
    ) -> tuple[int, ...] | None:
        """The token ids of ``parser``'s end tag when the output starts inside a
        reasoning block (the prompt leaves one open, or the parser starts there and
        thinking is not turned off); else None."""
        if (chat_template_kwargs or {}).get("enable_thinking", True) is False:
            return None
        opens = prompt_opens_reasoning(prompt, parser.starts[0], parser.ends[0])
        if not (opens or parser.starts_in_reasoning) or self.config.tokenizer is None:
            return None
        ids = self.config.tokenizer.encode(parser.ends[0], add_special_tokens=False)
        return tuple(ids) or None

    def tokenizer_info(self, chat_template: str | None) -> dict[str, Any]:
        """``GET /tokenizer_info``: the tokenizer's configuration (its
        ``tokenizer_config.json`` fields, the special tokens and their ids) and the chat
        template this server renders with."""
        tok = self._need_tokenizer("tokenizer")
        info: dict[str, Any] = {
            k: v for k, v in tok.config.items() if k not in ("added_tokens_decoder", "chat_template")
        }
        info.update(
            tokenizer_class=tok.config.get("tokenizer_class", "PreTrainedTokenizerFast"),
            bos_token=tok.bos_token,
            eos_token=tok.eos_token,
            pad_token=_token_name(tok.config.get("pad_token")),
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            add_bos_token=tok.add_bos_token,
            vocab_size=tok.vocab_size,
            model_max_length=self.config.max_model_len,
            chat_template=chat_template,
        )
        return info

    def _need_tokenizer(self, param: str) -> Tokenizer:
        if self.config.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param=param)
        return self.config.tokenizer

    def _constraint(
        self, req: CompletionRequest | ChatCompletionRequest
    ) -> StructuredOutputsParams | None:
        try:
            return req.constraint()
        except ValueError as e:
            message = str(e)
            head = message.split(" ", 1)[0].rstrip(":")
            param = head if head.split(".", 1)[0] in type(req).model_fields else None
            raise APIError(
                400, message, param=param or "structured_outputs", code="invalid_value"
            ) from None

    def _tool_choice(
        self,
        req: ChatCompletionRequest,
        tools: list[dict[str, Any]],
        constraint: StructuredOutputsParams | None,
    ) -> tuple[OutputSplit, StructuredOutputsParams | None]:
        """How the request's tools are used: the parsing of its outputs and, for
        ``required`` or a named function, the grammar forcing the call."""
        cfg = self.config
        choice = req.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        split = OutputSplit(parallel_tool_calls=req.parallel_tool_calls, tools=tools)
        if choice == "none":
            return split, constraint
        if not tools:
            raise APIError(
                400,
                f"tool_choice={_choice_text(choice)} needs tools, and the request has none",
                param="tool_choice",
                code="invalid_value",
            )
        if cfg.tool_call_parser is None:
            raise APIError(
                400,
                f"tool_choice={_choice_text(choice)} needs the server started with "
                "--tool-call-parser (and --enable-auto-tool-choice for 'auto')",
                param="tool_choice",
                code="invalid_value",
            )
        if choice == "auto":
            if not cfg.enable_auto_tool_choice:
                raise APIError(
                    400,
                    "tool_choice='auto' (the default with tools) needs the server started "
                    "with --enable-auto-tool-choice; or send tool_choice 'none', 'required' "
                    "or a named function",
                    param="tool_choice",
                    code="invalid_value",
                )
            split.tool_parser = get_tool_parser(cfg.tool_call_parser)
            return split, constraint
        if constraint is not None:
            raise APIError(
                400,
                "tool_choice 'required' or a named function forces a tool call; it cannot "
                "be combined with response_format or structured_outputs",
                param="tool_choice",
                code="invalid_value",
            )
        wanted = choice if isinstance(choice, str) else choice.model_dump()
        try:
            forced = tool_call_grammar(
                cfg.tool_call_parser, tools, wanted, parallel_tool_calls=req.parallel_tool_calls,
                tag_ids=self._envelope_tag_ids(cfg.tool_call_parser),
            )
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice", code="invalid_value") from None
        split.tool_parser = get_tool_parser(cfg.tool_call_parser)
        return split, forced

    # ---- validation --------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.config.model_aliases:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves "
                f"{self.config.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _params(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        logprobs: int | None,
        constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        try:
            params = sampling_params(req, logprobs, constraint, self.config.default_sampling)
        except (ValueError, TypeError) as e:
            raise APIError(
                400,
                str(e),
                param=param_from_message(str(e), set(SAMPLING_FIELDS)),
                code="invalid_value",
            ) from None
        if params.stop and self.config.tokenizer is None:
            # The engine matches stop strings on detokenized text, which needs one.
            raise APIError(
                400,
                "stop strings need a tokenizer, and this model has none: use stop_token_ids",
                param="stop",
                code="invalid_value",
            )
        return params

    def _check_length(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens but this model's context is {limit} "
                "tokens and must leave room for at least one generated token",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is not None and len(ids) + max_tokens > limit:
            raise APIError(
                400,
                f"this model's context is {limit} tokens, but the request asks for "
                f"{len(ids) + max_tokens}: {len(ids)} in the prompt and {max_tokens} "
                f"to generate (max_tokens); lower max_tokens to at most {limit - len(ids)}",
                param="max_tokens",
                code="context_length_exceeded",
            )

    def _check_text(self, text: str, param: str) -> None:
        """Refuse text that cannot fit the context or is not valid Unicode, before
        any work proportional to its size is done with it."""
        self._check_chars(len(text), param)
        _check_unicode(text, param)

    def _check_chars(self, num_chars: int, param: str) -> None:
        limit = self.config.max_prompt_chars
        if num_chars > limit:
            raise APIError(
                400,
                f"{param} has {num_chars} characters; this model's context of "
                f"{self.config.max_model_len} tokens cannot hold more than {limit}",
                param=param,
                code="context_length_exceeded",
            )

    async def _completion_prompts(self, prompt: Any) -> list[Prompt]:
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        texts: list[str] = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise APIError(400, "prompt is empty", param="prompt")
                if self.config.tokenizer is None:
                    raise APIError(
                        400,
                        "this model has no tokenizer: send the prompt as token ids",
                        param="prompt",
                    )
                self._check_text(item, "prompt")
                texts.append(item)
        tok = self.config.tokenizer
        encoded = iter(await self._offload(lambda: tok.encode_batch(texts)) if texts else [])
        return [
            (item, next(encoded)) if isinstance(item, str) else (None, list(item)) for item in items
        ]

    async def _chat_prompt(
        self, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None = None
    ) -> Prompt:
        cfg = self.config
        if cfg.chat_template is None:
            raise APIError(
                400,
                "this model has no chat template: start the server with "
                "--chat-template FILE, or use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        if cfg.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, which chat needs", param="messages")
        messages = []
        total = 0
        for i, m in enumerate(req.messages):
            # No content (null) is left out of the message, as transformers does: the
            # template sees no key, never the word "None".
            content = m.text()
            total += len(content or "") + len(m.name or "")
            self._check_chars(total, "messages")
            if isinstance(m.content, list):
                for k, part in enumerate(m.content):
                    _check_unicode(part.text, f"messages.{i}.content.{k}.text")
            elif content is not None:
                _check_unicode(content, f"messages.{i}.content")
            msg: dict[str, Any] = {"role": m.role, "content": content}
            for key in ("name", "tool_call_id", "reasoning_content"):
                value = getattr(m, key)
                if value is not None:
                    total += len(value)
                    _check_unicode(value, f"messages.{i}.{key}")
                    msg[key] = value
            if m.tool_calls:
                msg["tool_calls"] = [_history_call(c) for c in m.tool_calls]
                total += sum(len(c.function.arguments) for c in m.tool_calls)
            self._check_chars(total, "messages")
            messages.append(msg)
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(
                400,
                "continue_final_message continues the last message, so it needs "
                "add_generation_prompt=false",
                param="continue_final_message",
                code="invalid_value",
            )
        if req.continue_final_message and messages[-1]["role"] != "assistant":
            raise APIError(
                400,
                "continue_final_message needs an assistant message last",
                param="continue_final_message",
                code="invalid_value",
            )
        extra: dict[str, Any] = dict(req.chat_template_kwargs or {})
        if tools:
            extra["tools"] = tools
        if req.documents is not None:
            extra["documents"] = req.documents
        template, tok = cfg.chat_template, cfg.tokenizer

        def render() -> tuple[str, list[int]]:
            text = render_chat(
                template,
                messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                bos_token=tok.bos_token,
                eos_token=tok.eos_token,
                max_chars=cfg.max_prompt_chars,
                **extra,
            )
            _check_unicode(text, "messages")  # a template can build surrogates too
            return text, tok.encode_batch([text], add_special_tokens=False)[0]

        try:
            text, ids = await self._offload(render)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages", code="invalid_messages") from None
        if not ids:
            raise APIError(400, "the messages render to an empty prompt", param="messages")
        return text, ids

    # ---- running -----------------------------------------------------------------

    async def _respond(
        self,
        rid: str,
        prompts: list[Prompt],
        params: SamplingParams,
        req: CompletionRequest | ChatCompletionRequest,
        fmt: _Format,
        receive: Receive,
    ) -> Any:
        log.info(
            "request %s: %d prompt(s), prompt_tokens=%s max_tokens=%s n=%d stream=%s user=%s",
            rid,
            len(prompts),
            ",".join(str(len(p[1])) for p in prompts),
            params.max_tokens,
            params.n,
            req.stream,
            _quote(req.user),
        )
        streams = await self._start(rid, prompts, params, final_only=not req.stream)
        headers = {"X-Request-Id": rid}
        if self.config.enable_prompt_tokens_details:
            predicted = sum(s.predicted_cached_tokens for s in streams)
            headers[PREDICTED_CACHED_HEADER] = str(predicted)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            body = self._sse(rid, streams, fmt, params, include_usage, continuous)
            return StreamingResponse(body, media_type="text/event-stream", headers=headers)
        finals = await _unless_disconnected(self._collect(rid, streams), receive)
        if finals is None:
            log.info("request %s: client disconnected; aborted", rid)
            return JSONResponse(error_body("client disconnected", "invalid_request_error"), 499)
        try:
            body = fmt.whole(finals)
        except Exception:
            log.exception("request %s: formatting the response failed", rid)
            raise APIError(
                500,
                f"building the response of request {rid} failed; the server log has the details",
                code="internal_error",
            ) from None
        return JSONResponse(body, headers=headers)

    async def _start(
        self, rid: str, prompts: list[Prompt], params: SamplingParams, final_only: bool = False
    ) -> list[RequestStream]:
        if self._closing:
            raise APIError(503, "the server is shutting down", code="engine_unavailable")
        streams: list[RequestStream] = []
        ids = [rid if len(prompts) == 1 else f"{rid}-{i}" for i in range(len(prompts))]
        try:
            for engine_id, (text, token_ids) in zip(ids, prompts):
                streams.append(
                    await self.engine.add_request(engine_id, token_ids, params, text, final_only)
                )
                self._live.add(streams[-1])
        except BaseException as e:
            self._live.difference_update(streams)
            # Including the request whose add was in flight: aborting an id the engine
            # never took is a no-op, and the abort runs after the add on the worker.
            for engine_id in ids[: len(streams) + 1]:
                self.engine.abort(engine_id)
            if isinstance(e, (ValueError, TypeError)):
                raise APIError(
                    400,
                    str(e),
                    param=param_from_message(
                        str(e), {"prompt", "structured_outputs", "allowed_token_ids", "logit_bias"}
                    )
                    or "prompt",
                    code="invalid_value",
                ) from None
            if isinstance(e, EngineStopped):
                raise APIError(503, str(e), code="engine_unavailable") from None
            raise
        return streams

    async def _iterate(
        self, rid: str, streams: list[RequestStream]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield ``(prompt index, output)`` as outputs arrive; on any exit before all
        are finished, abort the unfinished ones."""
        tasks: dict[asyncio.Task, int] = {}
        try:
            if len(streams) == 1:
                while not streams[0].finished:
                    out = await _engine_call(rid, streams[0].next_output())
                    yield 0, out
                return
            tasks = {asyncio.ensure_future(s.next_output()): i for i, s in enumerate(streams)}
            while tasks:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = tasks.pop(task)
                    out = await _engine_call(rid, task)
                    if not out.finished:
                        tasks[asyncio.ensure_future(streams[i].next_output())] = i
                    yield i, out
        finally:
            for task in tasks:
                task.cancel()
            self._live.difference_update(streams)
            unfinished = [s.request_id for s in streams if not s.finished]
            for engine_id in unfinished:
                self.engine.abort(engine_id)
            if unfinished:
                log.info("request %s: ended early; aborted %s", rid, ", ".join(unfinished))

    async def _collect(self, rid: str, streams: list[RequestStream]) -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(self._iterate(rid, streams)) as outputs:
            async for i, out in outputs:
                if out.finished:
                    finals[i] = out
        result = [finals[i] for i in range(len(streams))]
        _log_finished(rid, result)
        return result

    async def _sse(
        self,
        rid: str,
        streams: list[RequestStream],
        fmt: _Format,
        params: SamplingParams,
        include_usage: bool,
        continuous_usage: bool = False,
    ) -> AsyncIterator[str]:
        """``continuous_usage``: every chunk carries the usage so far (vLLM's
        ``stream_options.continuous_usage_stats``) instead of ``null``."""
        hold_back = max((len(s) for s in params.stop or ()), default=1) - 1
        cursors = [[_Cursor(hold_back) for _ in range(params.n)] for _ in streams]
        latest: dict[int, RequestOutput] = {}
        try:
            for chunk in fmt.opening(len(streams)):
                yield _event(chunk, include_usage)
            async with contextlib.aclosing(self._iterate(rid, streams)) as outputs:
                async for i, out in outputs:
                    latest[i] = out
                    for j, comp in enumerate(out.outputs):
                        if cursors[i][j].done:
                            continue  # sent its finish chunk; later outputs repeat it
                        chunk = fmt.delta(i * params.n + j, comp, cursors[i][j], out)
                        if chunk is not None:
                            if continuous_usage:
                                chunk["usage"] = fmt.usage(list(latest.values()))
                                yield _sse_line(chunk)
                            else:
                                yield _event(chunk, include_usage)
            if include_usage:
                yield _event(fmt.usage_chunk([latest[i] for i in range(len(streams))]), False)
            _log_finished(rid, [latest[i] for i in range(len(streams))])
        except APIError as e:
            yield _sse_line(e.body())
        except Exception:
            log.exception("request %s: streaming failed", rid)
            yield _sse_line(
                error_body(
                    f"streaming request {rid} failed; the server log has the details",
                    "server_error",
                    code="internal_error",
                )
            )
        yield "data: [DONE]\n\n"


async def _engine_call(rid: str, aw: Awaitable[RequestOutput]) -> RequestOutput:
    """Await an engine output of request ``rid``, turning engine failures into API
    errors; the engine's own message goes to the log only."""
    try:
        return await aw
    except EngineError as e:
        log.error("request %s: the engine failed: %s", rid, e)
        raise APIError(
            500,
            f"the engine failed while running request {rid}; the server log has the details",
            code="engine_error",
        ) from None
    except EngineStopped as e:
        raise APIError(503, str(e), code="engine_unavailable") from None


def _history_call(call: Any) -> dict[str, Any]:
    """An assistant message's tool call as chat templates expect it: ``arguments`` as
    an object where it is JSON text of one (templates write it with ``tojson``)."""
    args: Any = call.function.arguments
    try:
        parsed = json.loads(args)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        args = parsed
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": args},
    }


def _token_name(value: Any) -> str | None:
    """A special token as tokenizer_config.json gives it (text, or an object with
    ``content``)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _choice_text(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else repr(choice.function.name)


def _warn_unknown(req: Any, route: str) -> None:
    """Refuse a field we do not implement but whose value changes the answer; log the
    other unknown fields, which are ignored."""
    refused = unsupported_field(req)
    if refused is not None:
        raise APIError(
            400,
            f"{refused} is not supported by this server (only its default value is accepted)",
            param=refused,
            code="unsupported_field",
        )
    unknown = unknown_fields(req)
    if unknown:
        log.warning(
            "%s: ignoring field(s) this server does not know: %s",
            route,
            ", ".join(_quote(f) for f in unknown[:16]),
        )


def _quote(text: str | None, limit: int = 64) -> str:
    """The client's text for the log: quoted, so it cannot forge log lines, and cut
    short."""
    if text is not None and len(text) > limit:
        return repr(text[:limit]) + "..."
    return repr(text)


def _check_unicode(text: str, param: str) -> None:
    """400 for text holding a lone surrogate (JSON can spell one, ``"\\ud800"``, but it
    is no character: the tokenizer cannot encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(
            400,
            f"{param} is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} "
            f"at character {e.start}",
            param=param,
            code="invalid_value",
        ) from None


async def _unless_disconnected(work: Awaitable[Any], receive: Receive) -> Any:
    """Run ``work``; if the client disconnects first, cancel it and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _wait_disconnect(receive: Receive) -> None:
    # The body has been read, so the next message is the disconnect.
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _check_stream_options(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise APIError(
            400, "stream_options is only allowed with stream=true", param="stream_options"
        )


def _log_finished(rid: str, outs: list[RequestOutput]) -> None:
    reasons = ",".join(str(c.finish_reason) for o in outs for c in o.outputs)
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    predicted = sum(int(o.metrics.get("predicted_cached_tokens", 0)) for o in outs)
    log.info(
        "request %s: finished (%s) completion_tokens=%d cached_tokens=%d predicted_cached_tokens=%d",
        rid,
        reasons,
        tokens,
        cached,
        predicted,
    )


def _sse_line(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


def _event(chunk: dict[str, Any], include_usage: bool) -> str:
    if include_usage:
        chunk["usage"] = None
    return _sse_line(chunk)


# ---- response formatting ---------------------------------------------------------


@dataclass
class _Cursor:
    """How much of one sequence a stream has sent."""

    hold_back: int
    text: str = ""
    num_tokens: int = 0
    done: bool = False
    opened: bool = False  # an echoed prompt (or its prompt logprobs) has been sent
    offset: int = 0  # characters sent before the completion's text (an echoed prompt)

    def advance(self, comp: CompletionOutput) -> tuple[str, int, int]:
        """The new text delta and the range of new tokens ``[start, end)``."""
        finished = comp.finish_reason is not None
        text = comp.text
        if not finished:
            end = len(text)
            while end and text[end - 1] == "\ufffd":
                end -= 1  # maybe a partial UTF-8 character that the next token completes
            text = text[: max(len(self.text), end - self.hold_back)]
        delta = text[len(self.text) :] if text.startswith(self.text) else ""
        self.text += delta
        start, self.num_tokens = self.num_tokens, len(comp.token_ids)
        self.done = finished
        return delta, start, self.num_tokens


def usage(outs: list[RequestOutput], details: bool = True) -> dict[str, Any]:
    """The ``usage`` of ``outs`` (the prompts of one response). ``details``:
    ``prompt_tokens_details.cached_tokens`` is the prompt tokens the engine took from
    the prefix cache (each prompt's admission hit, summed); else that field is null."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": (
            {"cached_tokens": sum(o.num_cached_tokens for o in outs)} if details else None
        ),
    }


def _finite(x: float) -> float:
    # JSON has no infinities; OpenAI clients expect a number.
    return x if math.isfinite(x) else -9999.0


@dataclass
class _Format:
    serving: OpenAIServing
    rid: str
    n: int
    logprobs: int | None
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self, outs: list[RequestOutput]) -> dict[str, Any]:
        return usage(outs, self.serving.config.enable_prompt_tokens_details)

    def token_text(self, token_id: int) -> str:
        tok = self.serving.config.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok else f"token_id:{token_id}"

    def header(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.serving.config.model_name,
        }

    def opening(self, num_prompts: int) -> list[dict[str, Any]]:
        return []

    def prompt_logprobs_json(self, out: RequestOutput) -> list[Any] | None:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token id:
        {logprob, rank, decoded_token}}``."""
        if out.prompt_logprobs is None:
            return None
        return [
            None if cands is None else {
                str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                         "decoded_token": self.token_text(t)}
                for t, lp in sorted(cands.items(), key=lambda kv: kv[1].rank)
            }
            for cands in out.prompt_logprobs
        ]

    def whole(self, outs: list[RequestOutput]) -> dict[str, Any]:
        raise NotImplementedError

    def delta(
        self, index: int, comp: CompletionOutput, cursor: _Cursor, out: RequestOutput | None = None
    ) -> dict[str, Any] | None:
        """The chunk for choice ``index`` after ``out`` (whose sequence ``comp`` is), or
        None when it has nothing new."""
        raise NotImplementedError

    def usage_chunk(self, outs: list[RequestOutput]) -> dict[str, Any]:
        raise NotImplementedError


class _CompletionFormat(_Format):
    """Completions; with ``echo`` each choice's text (and, with ``logprobs``, its
    logprobs) starts with its prompt, as vLLM's: the prompt's first token has logprob
    None. ``prompt_logprobs`` (vLLM's extra field): each choice carries the prompt's
    logprobs keyed by token id."""

    def __init__(self, *args: Any, echo: bool = False, prompt_logprobs: bool = False) -> None:
        super().__init__(*args)
        self.echo = echo
        self.prompt_logprobs = prompt_logprobs
        self.prompts: list[Prompt] = []  # the request's prompts, in order

    def prompt_text(self, i: int) -> str:
        text, ids = self.prompts[i]
        if text is not None:
            return text
        tok = self.serving.config.tokenizer
        return tok.decode(ids, skip_special_tokens=False) if tok else ""

    def _entry_lists(
        self, token_ids: list[int], entries: list[dict[int, Logprob] | None], offset: int
    ) -> dict[str, list[Any]]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, cands in zip(token_ids, entries):
            text = self.token_text(tid)
            tokens.append(text)
            if cands is None:
                token_lps.append(None)
                tops.append(None)
            else:
                token_lps.append(_finite(cands[tid].logprob))
                ranked = sorted(cands.items(), key=lambda kv: kv[1].rank)
                tops.append({self.token_text(i): _finite(lp.logprob) for i, lp in ranked})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def legacy_logprobs(
        self, comp: CompletionOutput, start: int, end: int, offset: int
    ) -> dict[str, Any] | None:
        if self.logprobs is None or comp.logprobs is None:
            return None
        return self._entry_lists(comp.token_ids[start:end], comp.logprobs[start:end], offset)

    def echoed_logprobs(self, out: RequestOutput) -> dict[str, Any] | None:
        """The prompt's part of an echoed choice's logprobs."""
        if self.logprobs is None:
            return None
        entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        return self._entry_lists(out.prompt_token_ids, entries, 0)

    def whole(self, outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outs):
            head = self.prompt_text(i) if self.echo else ""
            for j, comp in enumerate(out.outputs):
                lps = self.legacy_logprobs(comp, 0, len(comp.token_ids), len(head))
                if self.echo and lps is not None:
                    lps = _joined(self.echoed_logprobs(out), lps)
                choice = {
                    "index": i * self.n + j,
                    "text": head + comp.text,
                    "logprobs": lps,
                    "finish_reason": comp.finish_reason,
                    "stop_reason": comp.stop_reason,
                }
                if self.prompt_logprobs:
                    choice["prompt_logprobs"] = self.prompt_logprobs_json(out)
                choices.append(choice)
        return {**self.header("text_completion"), "choices": choices, "usage": self.usage(outs)}

    def delta(
        self, index: int, comp: CompletionOutput, cursor: _Cursor, out: RequestOutput | None = None
    ) -> dict[str, Any] | None:
        # The prompt part goes with the choice's first chunk that has anything to say
        # (its prompt logprobs are complete once a token has been sampled).
        opening = (self.echo or self.prompt_logprobs) and not cursor.opened and (
            comp.token_ids or comp.finish_reason is not None
        )
        head = ""
        if opening:
            cursor.opened = True
            if self.echo:
                head = self.prompt_text(index // self.n)
                cursor.offset = len(head)
        offset = cursor.offset + len(cursor.text)
        text, start, end = cursor.advance(comp)
        lps = self.legacy_logprobs(comp, start, end, offset) if end > start else None
        if opening and self.echo and self.logprobs is not None and out is not None:
            lps = _joined(self.echoed_logprobs(out), lps)
        if not text and not head and comp.finish_reason is None and lps is None:
            return None
        choice = {
            "index": index,
            "text": head + text,
            "logprobs": lps,
            "finish_reason": comp.finish_reason,
        }
        if opening and self.prompt_logprobs and out is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs_json(out)
        if comp.finish_reason is not None:
            choice["stop_reason"] = comp.stop_reason
        return {**self.header("text_completion"), "choices": [choice]}

    def usage_chunk(self, outs: list[RequestOutput]) -> dict[str, Any]:
        return {**self.header("text_completion"), "choices": [], "usage": self.usage(outs)}


def _joined(first: dict[str, list[Any]] | None, second: dict[str, list[Any]] | None) -> dict[str, list[Any]] | None:
    """Two legacy logprobs objects, one after the other."""
    if first is None or second is None:
        return first or second
    return {k: first[k] + second[k] for k in first}


class _ChatFormat(_Format):
    """Chat replies; ``split`` parses reasoning and tool calls out of the text (one
    :class:`ChoiceSplitter` per streamed choice)."""

    def __init__(self, *args: Any, split: OutputSplit | None = None) -> None:
        super().__init__(*args)
        self.split = split or OutputSplit()
        self.splitters: dict[int, ChoiceSplitter] = {}

    def content_logprobs(
        self, comp: CompletionOutput, start: int, end: int
    ) -> dict[str, Any] | None:
        if self.logprobs is None or comp.logprobs is None:
            return None
        content = []
        for tid, cands in zip(comp.token_ids[start:end], comp.logprobs[start:end]):
            content.append(
                {
                    **self._entry(tid, cands[tid]),
                    "top_logprobs": [
                        self._entry(i, lp)
                        for i, lp in sorted(cands.items(), key=lambda kv: kv[1].rank)
                        if lp.rank <= self.logprobs
                    ],
                }
            )
        return {"content": content}

    def _entry(self, token_id: int, lp: Logprob) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _finite(lp.logprob), "bytes": list(text.encode())}

    def message(self, comp: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """The reply message and the finish reason of one choice."""
        msg: dict[str, Any] = {"role": "assistant", "content": comp.text}
        reason = comp.finish_reason
        if self.split.active:
            parts = self.split.new().whole(comp.text)
            msg["content"] = parts.content
            if self.split.reports_reasoning:
                msg["reasoning_content"] = parts.reasoning
            if parts.tool_calls:
                msg["tool_calls"] = parts.tool_calls
                if reason == "stop":
                    reason = "tool_calls"
        return msg, reason

    def whole(self, outs: list[RequestOutput]) -> dict[str, Any]:
        (out,) = outs
        choices = []
        for j, comp in enumerate(out.outputs):
            msg, reason = self.message(comp)
            choices.append(
                {
                    "index": j,
                    "message": msg,
                    "logprobs": self.content_logprobs(comp, 0, len(comp.token_ids)),
                    "finish_reason": reason,
                    "stop_reason": comp.stop_reason,
                }
            )
        body = {**self.header("chat.completion"), "choices": choices, "usage": self.usage(outs)}
        if out.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs_json(out)
        return body

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self.header("chat.completion.chunk"), "choices": [choice]}

    def opening(self, num_prompts: int) -> list[dict[str, Any]]:
        return [
            self._chunk(
                {
                    "index": j,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
            for j in range(self.n * num_prompts)
        ]

    def delta(
        self, index: int, comp: CompletionOutput, cursor: _Cursor, out: RequestOutput | None = None
    ) -> dict[str, Any] | None:
        text, start, end = cursor.advance(comp)
        lps = self.content_logprobs(comp, start, end) if end > start else None
        reason = comp.finish_reason
        if self.split.active:
            splitter = self.splitters.get(index)
            if splitter is None:
                splitter = self.splitters[index] = self.split.new()
            d = splitter.feed(text) if text else SplitDelta()
            if reason is not None:
                last = splitter.finish()
                d = SplitDelta(
                    d.reasoning + last.reasoning, d.content + last.content, d.tool_calls + last.tool_calls
                )
                if splitter.called and reason == "stop":
                    reason = "tool_calls"
            delta = d.to_openai()
        else:
            delta = {"content": text} if text else {}
        if not delta and reason is None and lps is None:
            return None
        choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": reason}
        if reason is not None:
            choice["stop_reason"] = comp.stop_reason
        return self._chunk(choice)

    def usage_chunk(self, outs: list[RequestOutput]) -> dict[str, Any]:
        return {**self.header("chat.completion.chunk"), "choices": [], "usage": self.usage(outs)}
