"""The FastAPI application: routes, API-key check, error handlers and the engine's
lifetime.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /tokenize``, ``POST /detokenize``, ``GET /version``,
``GET /tokenizer_info`` (when enabled),
``GET|HEAD /health``, ``GET /metrics`` (and FastAPI's ``/docs``, ``/redoc``,
``/openapi.json``). A client's ``X-Request-Id`` header is echoed on the response. With an API key set, every route but ``/health`` and ``/metrics``
needs ``Authorization: Bearer <key>``: those two stay open for probes and scrapers.

A request body larger than ``max_request_body_bytes`` gets a 413 before the
application reads it (one declared by ``Content-Length``), or as soon as the bytes
read pass the limit (a chunked one).

Lifetime: the engine thread starts with the application (its lifespan) and stops
when the application shuts down, after the HTTP server has let in-flight responses
finish (and, past its grace period, ended them with an error through
``OpenAIServing.end_in_flight``; see :mod:`hybridserve.server.http`); whatever is
still running then is aborted and its clients get an error.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridserve import __version__
from hybridserve.chat_template import compile_chat_template, pick_template
from hybridserve.engine.request import SamplingParams
from hybridserve.reasoning import get_reasoning_parser
from hybridserve.server import metrics
from hybridserve.server.async_engine import AsyncEngine
from hybridserve.server.errors import (
    APIError,
    error_body,
    handle_api_error,
    handle_http_error,
    handle_validation_error,
)
from hybridserve.server.http import DEFAULT_MAX_REQUEST_BODY_BYTES
from hybridserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from hybridserve.server.serving import OpenAIServing, ServingConfig
from hybridserve.tools.parsers import get_tool_parser

log = logging.getLogger("hybridserve.server")

OPEN_PATHS = frozenset({"/health", "/metrics"})
"""Routes that need no API key."""


@dataclass
class ServerState:
    """Everything the routes share; lives on ``app.state.server``."""

    engine: AsyncEngine
    serving: OpenAIServing
    api_key: str | None
    info: dict[str, str]
    created: int
    metrics: metrics.ServerMetrics


def create_app(
    llm: Any,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    chat_template: str | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    reasoning_parser: str | None = None,
    enable_tokenizer_info_endpoint: bool = False,
    allowed_origins: list[str] | None = None,
    allowed_methods: list[str] | None = None,
    allowed_headers: list[str] | None = None,
    allow_credentials: bool = False,
    enable_prompt_tokens_details: bool = True,
) -> FastAPI:
    """An application serving ``llm`` (an :class:`~hybridserve.LLM`).

    ``chat_template`` is Jinja2 source that replaces the checkpoint's own (else the
    checkpoint's ``chat_template.jinja``, else ``tokenizer_config.json``'s); a template
    that does not compile raises ValueError here, not on the first chat request.
    ``tool_call_parser`` / ``reasoning_parser`` name the parsers
    (:mod:`hybridserve.tools.parsers`, :mod:`hybridserve.reasoning`; an unknown name
    is a ValueError); ``enable_auto_tool_choice`` lets ``tool_choice="auto"`` parse
    calls, and needs a tool parser.
    ``api_key`` None means no check; an empty key is refused (ValueError), since it
    would let anyone in while looking like protection. The engine thread runs while
    the application's lifespan is active.

    ``enable_tokenizer_info_endpoint`` adds ``GET /tokenizer_info`` (vLLM's, off by
    default as there: it shows the chat template). ``allowed_origins`` turns on CORS
    for those origins (``["*"]`` for any), with ``allowed_methods`` /
    ``allowed_headers`` (default any) and ``allow_credentials``; None (the default)
    sends no CORS headers, so browsers keep other origins out.

    ``enable_prompt_tokens_details`` (vLLM's ``--enable-prompt-tokens-details``, on
    by default here: prefix caching is this engine's point) fills
    ``usage.prompt_tokens_details.cached_tokens`` with the prompt tokens served from
    the prefix cache and sends the ``x-hybridserve-predicted-cached-tokens`` header;
    off, that field is null and the header absent.
    """
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key is empty: give a non-empty key, or None for no check")
    if not isinstance(max_request_body_bytes, int) or max_request_body_bytes < 1024:
        raise ValueError(
            f"max_request_body_bytes must be an integer >= 1024, got {max_request_body_bytes!r}"
        )
    if tool_call_parser is not None:
        get_tool_parser(tool_call_parser)
    if reasoning_parser is not None:
        get_reasoning_parser(reasoning_parser)
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    cfg = llm.config
    tokenizer = llm.tokenizer
    source = chat_template
    if source is None and tokenizer is not None:
        source = checkpoint_chat_template(Path(str(cfg.model)), tokenizer.chat_template)
    template = compile_chat_template(source) if source is not None else None
    if tokenizer is not None:
        # The grammar tokenizer takes about a second at a 32k vocabulary: built now,
        # not on the step loop when the first constrained request comes.
        llm.engine.grammar_backend()
    model_path = str(cfg.model)
    name = served_model_name or Path(model_path).name or model_path
    serving_cfg = ServingConfig(
        model_name=name,
        model_aliases=frozenset({name}),
        max_model_len=cfg.scheduler.max_model_len,
        tokenizer=tokenizer,
        chat_template=template,
        tool_call_parser=tool_call_parser,
        enable_auto_tool_choice=enable_auto_tool_choice,
        reasoning_parser=reasoning_parser,
        default_sampling=dict(llm.generation_config.sampling),
        enable_prompt_tokens_details=enable_prompt_tokens_details,
    )
    try:
        SamplingParams(**serving_cfg.default_sampling)
    except ValueError as e:
        raise ValueError(f"generation_config.json of {model_path}: {e}") from None
    if serving_cfg.default_sampling:
        log.info("default sampling from generation_config.json: %s", serving_cfg.default_sampling)
    engine = AsyncEngine(llm.engine)
    info = {"model": name, "dtype": str(cfg.dtype).removeprefix("torch."), "device": cfg.device}
    prometheus = metrics.ServerMetrics(
        engine.stats, model_name=name, max_model_len=cfg.scheduler.max_model_len, info=info
    )
    # The engine's thread observes the latency histograms after each step.
    llm.engine.stats_observer = prometheus
    state = ServerState(
        engine=engine,
        serving=OpenAIServing(engine, serving_cfg),
        api_key=api_key,
        info=info,
        created=int(time.time()),
        metrics=prometheus,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            log.info("shutting down: stopping the engine")
            # Joining the thread blocks; keep the loop free to deliver the last outputs.
            await asyncio.to_thread(engine.shutdown)
            state.serving.close()

    app = FastAPI(title="hybridserve", version="0.1.0", lifespan=lifespan)
    app.state.server = state
    app.add_exception_handler(APIError, handle_api_error)
    app.add_exception_handler(RequestValidationError, handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, handle_http_error)
    app.add_exception_handler(Exception, _handle_unexpected)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next: Any) -> Response:
        if state.api_key is not None and request.url.path not in OPEN_PATHS:
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), state.api_key.encode()
            ):
                return APIError(
                    401,
                    "invalid or missing API key (send Authorization: Bearer <key>)",
                    code="invalid_api_key",
                ).response()
        return await call_next(request)

    @app.middleware("http")
    async def echo_request_id(request: Request, call_next: Any) -> Response:
        response = await call_next(request)
        given = request.headers.get("x-request-id")
        if given:
            response.headers["X-Request-Id"] = given
        return response

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await state.serving.completions(body, request.receive)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await state.serving.chat(body, request.receive)

    def model_card() -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "hybridserve",
            "root": model_path,
            "parent": None,
            "max_model_len": serving_cfg.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        state.serving.check_model(model_id)
        return model_card()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await state.serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await state.serving.detokenize(body)

    if enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info")
        async def tokenizer_info() -> dict[str, Any]:
            return state.serving.tokenizer_info(source)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/health")
    async def health() -> Response:
        if engine.running and engine.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse(
            error_body("the engine is not running", "server_error", code="engine_unavailable"),
            status_code=503,
        )

    # Probes that send HEAD get the same status (the HTTP layer drops the body).
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(state.metrics.render(), media_type=metrics.CONTENT_TYPE)

    if allowed_origins is not None:
        # Outside the key check: a browser's preflight (OPTIONS) carries no key.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=list(allowed_methods or ["*"]),
            allow_headers=list(allowed_headers or ["*"]),
            allow_credentials=allow_credentials,
        )
    # Added last, so it runs first: no route, key check or handler sees an oversized body.
    app.add_middleware(BodyLimit, max_bytes=max_request_body_bytes)
    return app


def checkpoint_chat_template(path: Path, from_config: Any) -> str | None:
    """The checkpoint's chat template: ``chat_template.jinja`` beside the weights (what
    transformers' ``save_pretrained`` writes), else ``tokenizer_config.json``'s."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    return pick_template(from_config)


async def _handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # The client gets an id to quote, never the exception's text (it may name files,
    # settings or data of other requests); the log has both.
    error_id = f"err-{uuid.uuid4().hex}"
    log.error(
        "unexpected error %s on %s %s", error_id, request.method, request.url.path, exc_info=exc
    )
    return APIError(
        500, f"internal error {error_id}; the server log has the details", code="internal_error"
    ).response()


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets a 413 (see the module
    docstring). A body within the limit reaches the application unchanged."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: str) -> Response:
        return APIError(
            413,
            f"the request body has {size} bytes; this server accepts at most "
            f"{self.max_bytes} (--max-request-body-bytes)",
            code="request_too_large",
        ).response()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None:
            # The HTTP layer holds the body to its declared length, so checking the
            # header is enough; what the client still sends is read and dropped.
            if declared.isdigit() and int(declared) > self.max_bytes:
                await self._too_large(declared.decode())(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        # Chunked (or no) body: read it here, up to the limit, then replay it.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                chunks = []
                pending: list[Message] = [message]
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(f"more than {self.max_bytes}")(scope, receive, send)
                return
            if not message.get("more_body", False):
                pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
                break

        async def replay() -> Message:
            return pending.pop(0) if pending else await receive()

        await self.app(scope, replay, send)
