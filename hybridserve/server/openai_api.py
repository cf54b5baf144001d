"""The FastAPI application: routes, API-key check, error handlers and the engine's
lifetime.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``. With an API key set, every ``/v1/`` route needs
``Authorization: Bearer <key>``; ``/health`` and ``/metrics`` stay open for probes and
scrapers.

Lifetime: the engine thread starts with the application (its lifespan) and stops
when the application shuts down, after the HTTP server has let in-flight responses
finish; whatever is still running then is aborted and its clients get an error.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridserve.chat_template import compile_chat_template, pick_template
from hybridserve.server import metrics
from hybridserve.server.async_engine import AsyncEngine
from hybridserve.server.errors import (
    APIError,
    error_body,
    handle_api_error,
    handle_http_error,
    handle_validation_error,
)
from hybridserve.server.protocol import ChatCompletionRequest, CompletionRequest
from hybridserve.server.serving import OpenAIServing, ServingConfig

log = logging.getLogger("hybridserve.server")


@dataclass
class ServerState:
    """Everything the routes share; lives on ``app.state.server``."""

    engine: AsyncEngine
    serving: OpenAIServing
    api_key: str | None
    info: dict[str, str]
    created: int


def create_app(
    llm: Any,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    chat_template: str | None = None,
) -> FastAPI:
    """An application serving ``llm`` (an :class:`~hybridserve.LLM`).

    ``chat_template`` is Jinja2 source that replaces the checkpoint's own; a template
    that does not compile raises ValueError here, not on the first chat request.
    The engine thread runs while the application's lifespan is active.
    """
    cfg = llm.config
    tokenizer = llm.tokenizer
    source = chat_template
    if source is None and tokenizer is not None:
        source = pick_template(tokenizer.chat_template)
    template = compile_chat_template(source) if source is not None else None
    model_path = str(cfg.model)
    name = served_model_name or Path(model_path).name or model_path
    serving_cfg = ServingConfig(
        model_name=name,
        model_aliases=frozenset({name, model_path}),
        max_model_len=cfg.scheduler.max_model_len,
        tokenizer=tokenizer,
        chat_template=template,
    )
    engine = AsyncEngine(llm.engine)
    state = ServerState(
        engine=engine,
        serving=OpenAIServing(engine, serving_cfg),
        api_key=api_key,
        info={"model": name, "dtype": str(cfg.dtype).removeprefix("torch."), "device": cfg.device},
        created=int(time.time()),
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

    app = FastAPI(title="hybridserve", version="0.1.0", lifespan=lifespan)
    app.state.server = state
    app.add_exception_handler(APIError, handle_api_error)
    app.add_exception_handler(RequestValidationError, handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, handle_http_error)
    app.add_exception_handler(Exception, _handle_unexpected)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next: Any) -> Response:
        if state.api_key is not None and request.url.path.startswith("/v1/"):
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

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await state.serving.completions(body, request.receive)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await state.serving.chat(body, request.receive)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "hybridserve",
                    "max_model_len": serving_cfg.max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health() -> Response:
        if engine.running and engine.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse(
            error_body("the engine is not running", "server_error", code="engine_unavailable"),
            status_code=503,
        )

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(engine.stats(), state.info), media_type=metrics.CONTENT_TYPE)

    return app


async def _handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()
