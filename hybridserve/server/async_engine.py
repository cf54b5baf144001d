"""One synchronous :class:`EngineCore` serving many asyncio clients.

Threading contract:

- A single worker thread owns the engine. Every engine call (``add_request``,
  ``abort_request``, ``step``, ``stats``, anything passed to :meth:`AsyncEngine.call`)
  runs on that thread, between steps; nothing else touches the engine.
- Clients talk to the worker through a thread-safe inbox of commands. A request added
  while others run joins the running batch at the next step.
- Outputs travel back through one :class:`RequestStream` per request: the worker
  posts onto the stream's event loop with ``call_soon_threadsafe``; the stream is read
  by exactly one coroutine.
- A request leaves the worker's table when its final output is posted, when it is
  aborted, or when it fails; after that nothing more is posted to its stream.

Failure contract: a request whose step could not be committed comes back finished
with an error (:attr:`RequestOutput.error`); its stream gets :class:`EngineError`
and the others go on. If ``step()`` itself raises, the failure is pinned on a single request
when the engine can tell which one (the oldest waiting request that cannot fit in an
empty engine); that request is aborted and its stream gets the error. Otherwise every
request in flight is aborted and gets the error, the cache integrity is checked, and
the worker keeps serving new requests; if the caches are found corrupted the engine
is marked unhealthy and refuses new work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from hybridserve.engine.engine_core import EngineCore
from hybridserve.engine.request import RequestOutput, SamplingParams

log = logging.getLogger("hybridserve.server")

T = TypeVar("T")


class EngineError(RuntimeError):
    """The engine failed while running a request (reported as a server error)."""


class EngineStopped(RuntimeError):
    """The engine shut down (or is unhealthy) before the request finished."""


class RequestStream:
    """The outputs of one request, read by one coroutine.

    Outputs are cumulative, so :meth:`next_output` returns the newest one available
    and drops older ones still queued: a slow reader sees fewer, larger deltas, never
    a gap.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        # The prefix hit the caches held for the prompt when it was added.
        self.predicted_cached_tokens = 0

    def _post(self, item: RequestOutput | BaseException) -> None:
        """Called by the worker thread only."""
        # A closed loop means nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def fail(self, exc: BaseException) -> None:
        """End the stream with ``exc`` (its reader gets it next); loop thread only."""
        self._queue.put_nowait(exc)

    async def next_output(self) -> RequestOutput:
        """The newest output; raises the request's error, if it failed."""
        item = await self._queue.get()
        while not isinstance(item, BaseException) and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    async def final_output(self) -> RequestOutput:
        """Wait for the request to finish; returns its last output."""
        while True:
            out = await self.next_output()
            if out.finished:
                return out


class AsyncEngine:
    """Runs an :class:`EngineCore` on a worker thread (see the module docstring)."""

    def __init__(self, engine: EngineCore, *, name: str = "hybridserve-engine") -> None:
        self.engine = engine
        self._name = name
        self._inbox: queue.SimpleQueue[
            tuple[Callable[[EngineCore], Any], concurrent.futures.Future] | None
        ] = queue.SimpleQueue()
        # Owned by the worker thread: request id -> stream.
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # Guards the hand-off between _submit and _stop_all so no command is queued
        # after the worker's last look at the inbox.
        self._inbox_lock = threading.Lock()
        self._closed = False
        self._aborted = 0
        self._failed = 0
        self.healthy = True
        self._stats: dict[str, float | int] = self._snapshot()

    # ---- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        if self._thread is not None:
            return
        self._stopping.clear()
        self._closed = False
        while not self._inbox.empty():  # a stop sentinel left by an earlier run
            self._inbox.get_nowait()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the worker: abort what is still in flight (its streams get
        :class:`EngineStopped`) and join the thread. Safe to call twice."""
        thread = self._thread
        if thread is None:
            return
        self._stopping.set()
        self._inbox.put(None)
        thread.join(timeout)
        if thread.is_alive():
            log.error("engine thread did not stop within %.1f s", timeout)
        self._thread = None

    # ---- client calls (any thread but the worker) ----------------------------------

    def call_sync(self, fn: Callable[[EngineCore], T], timeout: float | None = None) -> T:
        """Run ``fn(engine)`` on the worker between steps and return its result."""
        return self._submit(fn).result(timeout)

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Async form of :meth:`call_sync`."""
        return await asyncio.wrap_future(self._submit(fn))

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        final_only: bool = False,
    ) -> RequestStream:
        """Queue a request; returns its stream. Raises ValueError/TypeError from the
        engine's validation (nothing queued) or :class:`EngineStopped`.
        ``final_only``: the stream receives only the finished output (a response that
        is not streamed needs nothing else, and the engine then builds nothing else)."""
        stream = RequestStream(request_id, asyncio.get_running_loop())

        def add(engine: EngineCore) -> RequestStream:
            engine.add_request(
                request_id, prompt_token_ids, params, prompt=prompt, final_only=final_only
            )
            stream.predicted_cached_tokens = engine.predicted_cached_tokens(request_id)
            self._streams[request_id] = stream
            return stream

        return await self.call(add)

    def abort(self, request_id: str) -> None:
        """Abort a request (if still running) and free its caches; does not wait."""

        def abort(engine: EngineCore) -> None:
            stream = self._streams.pop(request_id, None)
            if engine.abort_request(request_id):
                self._aborted += 1
                log.info("request %s: aborted", request_id)
            if stream is not None:
                stream._post(EngineStopped(f"request {request_id} was aborted"))

        # A stopped worker has already aborted everything.
        with contextlib.suppress(EngineStopped):
            self._submit(abort)

    def stats(self) -> dict[str, float | int]:
        """The engine counters as of the last step, plus the server's own
        (``requests_aborted``, ``requests_failed``). Never waits for the engine."""
        return self._stats

    def stats_sync(self, timeout: float | None = None) -> dict[str, float | int]:
        """The same counters, taken now on the worker (waits for the current step)."""
        return self.call_sync(lambda _: self._snapshot(), timeout)

    # ---- worker --------------------------------------------------------------------

    def _submit(self, fn: Callable[[EngineCore], Any]) -> concurrent.futures.Future:
        if not self.healthy:
            raise EngineStopped("the engine is unhealthy after an internal error")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._inbox_lock:
            if self._closed or self._thread is None or self._stopping.is_set():
                raise EngineStopped("the engine is not running")
            self._inbox.put((fn, fut))
        return fut

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping.is_set():
                block = not engine.has_unfinished_requests()
                if not self._drain_inbox(block):
                    break
                if engine.has_unfinished_requests():
                    self._step()
                else:
                    self._publish_stats()
        finally:
            self._stop_all()

    def _drain_inbox(self, block: bool) -> bool:
        """Run queued commands; wait for one if ``block``. False when told to stop."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            if item is None:
                return False
            fn, fut = item
            block = False
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:  # the caller gets its own error, we keep going
                fut.set_exception(e)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._step_failed(e)
            self._publish_stats()
            return
        # Counters first, so a client that has its final output also sees it counted.
        self._failed += sum(1 for out in outputs if out.error is not None and out.request_id in self._streams)
        self._publish_stats()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            if out.error is not None:
                stream._post(EngineError(out.error))
                continue
            for o in out.outputs:
                # The engine hands out its live logprobs list; keep only this step's view.
                if o.logprobs is not None:
                    o.logprobs = list(o.logprobs[: len(o.token_ids)])
            stream._post(out)

    def _step_failed(self, exc: Exception) -> None:
        sched = self.engine.scheduler
        victims: list[str]
        if not sched.running and sched.waiting:
            victims = [EngineCore.group_id(sched.waiting[0])]
        else:
            victims = list(self._streams)
        log.error(
            "engine step failed (%s: %s); failing request(s) %s",
            type(exc).__name__,
            exc,
            ", ".join(victims),
            exc_info=exc,
        )
        err = EngineError(str(exc) or type(exc).__name__)
        for rid in victims:
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("request %s: abort after a failed step raised", rid)
            self._failed += 1
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._post(err)
        try:
            sched.check_integrity()
        except Exception:
            log.exception("cache integrity lost after a failed step; refusing new requests")
            self.healthy = False
            self._stopping.set()

    def _snapshot(self) -> dict[str, float | int]:
        stats = self.engine.stats()
        stats["requests_aborted"] = self._aborted
        stats["requests_failed"] = self._failed
        return stats

    def _publish_stats(self) -> None:
        self._stats = self._snapshot()  # one reference swap: readers see a whole snapshot

    def _stop_all(self) -> None:
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("request %s: abort at shutdown raised", rid)
            stream._post(EngineStopped("the server is shutting down"))
        self._streams.clear()
        with self._inbox_lock:
            self._closed = True
        # Commands queued before the close get an answer instead of hanging.
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(EngineStopped("the engine is not running"))
        self._publish_stats()
