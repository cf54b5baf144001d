"""The OpenAI-compatible HTTP server: ``hybridserve serve``.

:func:`create_app` builds the FastAPI application over an :class:`~hybridserve.LLM`;
:class:`AsyncEngine` drives the engine from one worker thread for many clients.
"""

from hybridserve.server.async_engine import AsyncEngine, RequestStream
from hybridserve.server.openai_api import create_app

__all__ = ["AsyncEngine", "RequestStream", "create_app"]
