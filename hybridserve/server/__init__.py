"""The OpenAI-compatible HTTP server: ``hybridserve serve``.

:func:`create_app` builds the FastAPI application over an :class:`~hybridserve.LLM`;
:class:`AsyncEngine` drives the engine from one worker thread for many clients.
Both are imported on first use, so that the command line's option parsing
(:mod:`hybridserve.server.cli`) loads neither the engine nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncEngine": "hybridserve.server.async_engine",
    "RequestStream": "hybridserve.server.async_engine",
    "create_app": "hybridserve.server.openai_api",
}

__all__ = ["AsyncEngine", "RequestStream", "create_app"]

if TYPE_CHECKING:
    from hybridserve.server.async_engine import AsyncEngine, RequestStream
    from hybridserve.server.openai_api import create_app


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridserve.server' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
