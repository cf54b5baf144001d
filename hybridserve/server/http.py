"""The HTTP layer under the application: uvicorn, with bounds on slow clients and a
shutdown that answers every in-flight request.

Contracts:

- A connection has ``request_read_timeout`` seconds, from when it opens or its last
  response ended, to deliver a whole request (head and body); otherwise it is
  closed. uvicorn alone waits forever for a request head that trickles in a byte at
  a time (its keep-alive timer restarts on every byte), so a handful of slow clients
  could hold connections open indefinitely.
- Between requests a connection idles at most ``timeout_keep_alive`` seconds
  (uvicorn's own setting); a request head is at most ``h11_max_incomplete_event_size``
  bytes (h11's limit; larger heads get a 400).
- Shutdown: new connections are refused at once; in-flight requests get
  ``graceful_shutdown_timeout`` seconds to finish. Then the application's
  ``end_in_flight`` fails whatever is left, so a non-streaming client gets a JSON 503
  and a stream gets an error event and ``data: [DONE]``; only a handler that still
  has not answered :data:`ANSWER_MARGIN` seconds later is cancelled by uvicorn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("hybridserve.server")

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 2**20
"""8 MiB: a 64-prompt batch of 4096-token prompts as token ids is under 2 MiB; parsing
a body costs the event loop time in proportion to its size, so a bound is kept.
(Defined here, with the other HTTP limits, because the command line's option parsing
imports this module but not the application's.)"""

ANSWER_MARGIN = 5.0
"""Seconds handlers get, after ``end_in_flight``, to send their error responses."""


@dataclass(frozen=True)
class HTTPOptions:
    """Connection limits and the shutdown grace period (``hybridserve serve`` flags)."""

    timeout_keep_alive: float = 5.0
    request_read_timeout: float = 30.0
    h11_max_incomplete_event_size: int = 16 * 1024
    graceful_shutdown_timeout: float = 30.0

    def __post_init__(self) -> None:
        # Each field is the flag of the same name (--timeout-keep-alive, ...).
        checks = {
            "timeout_keep_alive": (self.timeout_keep_alive > 0, "> 0 seconds"),
            "request_read_timeout": (self.request_read_timeout > 0, "> 0 seconds"),
            "graceful_shutdown_timeout": (self.graceful_shutdown_timeout >= 0, ">= 0 seconds"),
            "h11_max_incomplete_event_size": (
                self.h11_max_incomplete_event_size >= 1024,
                ">= 1024 bytes",
            ),
        }
        for name, (ok, rule) in checks.items():
            if not ok:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{name} ({flag}) must be {rule}, got {getattr(self, name)!r}")


class ReadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus the request read timeout (see the module docstring)."""

    _read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_read_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        # IDLE: no request head yet; SEND_BODY: the body is still arriving.
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._cancel_read_timer()

    def on_response_complete(self) -> None:
        # The next request's clock starts now; super() may parse a pipelined request
        # at once, and handle_events then stops the clock again.
        self._arm_read_timer()
        super().on_response_complete()

    def _arm_read_timer(self) -> None:
        self._cancel_read_timer()
        timeout = self.config.request_read_timeout  # type: ignore[attr-defined]
        self._read_timer = self.loop.call_later(timeout, self._read_timed_out)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
            log.info(
                "closing a connection from %s: no whole request within %.3g s",
                self.client,
                self.config.request_read_timeout,  # type: ignore[attr-defined]
            )
            # A handler waiting for the rest of the body sees a disconnect.
            self.transport.close()


class Config(uvicorn.Config):
    """uvicorn's config with :class:`HTTPOptions` applied."""

    def __init__(self, app: Any, options: HTTPOptions, **kwargs: Any) -> None:
        super().__init__(
            app,
            http=ReadTimeoutH11Protocol,
            timeout_keep_alive=options.timeout_keep_alive,  # type: ignore[arg-type]
            h11_max_incomplete_event_size=options.h11_max_incomplete_event_size,
            timeout_graceful_shutdown=options.graceful_shutdown_timeout + ANSWER_MARGIN,  # type: ignore[arg-type]
            **kwargs,
        )
        self.request_read_timeout = options.request_read_timeout
        self.graceful_shutdown_timeout = options.graceful_shutdown_timeout


class Server(uvicorn.Server):
    """uvicorn's server; when the grace period ends it calls ``end_in_flight``."""

    def __init__(self, config: Config, end_in_flight: Callable[[], None]) -> None:
        super().__init__(config)
        self._end_in_flight = end_in_flight

    async def shutdown(self, sockets: Any = None) -> None:
        grace = self.config.graceful_shutdown_timeout  # type: ignore[attr-defined]
        timer = asyncio.get_running_loop().call_later(grace, self._end_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def make_server(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    options: HTTPOptions | None = None,
    log_level: str = "info",
) -> Server:
    """A server for an application built by :func:`~hybridserve.server.create_app`."""
    config = Config(app, options or HTTPOptions(), host=host, port=port, log_level=log_level)
    return Server(config, app.state.server.serving.end_in_flight)
