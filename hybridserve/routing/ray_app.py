"""N engine replicas on Ray Serve behind one OpenAI-compatible ingress that routes by checkpoints.

Layout
------
- ``engine-<i>`` (one Serve deployment per replica, one replica each, so the ingress
  can address replica ``i``): an :class:`~hybridserve.LLM` inside the project's own
  OpenAI application (:func:`hybridserve.server.openai_api.create_app`, called
  in-process), with an :class:`~hybridserve.cache.events.EventLog` on its caches.
  Every answer carries the cache events since the previous one.
- ``ingress``: the HTTP entry. It renders/tokenizes the prompt only to hash its
  blocks, asks the :class:`~hybridserve.routing.router.Router` for a replica,
  forwards the request body unchanged, applies the events that come back, and returns
  the replica's response (status and JSON body) as is, with the replica's index in
  the ``x-hybridserve-replica`` header. The API is the one
  ``hybridserve serve`` offers for non-streamed requests; ``stream: true`` is refused
  with a 400 naming the field (not built yet).
- A replica that fails mid-request (its process dies): the requests it held get a
  503 ``replica_unavailable`` naming the replica; the router forgets that replica's
  index (Serve restarts it with empty caches) and the other replicas keep serving.
- ``GET /metrics``: every replica's Prometheus text with a ``replica="<i>"`` label
  added, plus the router's per-replica queue and routed counts. ``GET /v1/replicas``:
  the same as JSON.

Run it with ``hybridserve serve --replicas N`` or from Python (docs/scale-out.md)::

    try:
    from ray import serve
except ImportError as e:  # an optional extra
    raise ImportError("hybridserve.routing.ray_app needs Ray Serve: pip install 'hybridserve[ray]'") from e
    from hybridserve.routing.ray_app import build_app
    serve.run(build_app("path/to/model", num_replicas=2), route_prefix="/")

Needs the ``ray`` extra (``pip install hybridserve[ray]``).
"""


import os
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

try:
    from ray import serve
except ImportError as e:  # an optional extra
    raise ImportError("hybridserve.routing.ray_app needs Ray Serve: pip install 'hybridserve[ray]'") from e

from hybridserve.routing.router import Router

_PATHS = ("/v1/completions", "/v1/chat/completions")


class EngineReplica:
    """One engine and its OpenAI application, driven in-process (module docstring)."""

    def __init__(self, replica_id: int, model: str | None, llm_kwargs: dict[str, Any]) -> None:
        import httpx

        from hybridserve import LLM
        from hybridserve.cache.events import EventLog
        from hybridserve.server.openai_api import create_app

        self.replica_id = replica_id
        self.llm = LLM(model, **llm_kwargs)
        sched = self.llm.engine.scheduler
        self.events = EventLog().attach(sched.blocks, sched.states, sched.host)
        self.app = create_app(self.llm)
        # The application's lifespan would start the engine thread; in-process calls
        # skip the lifespan, so start it here.
        self.app.state.server.engine.start()
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://engine", timeout=None
        )

    async def handle(self, path: str, body: dict[str, Any]) -> tuple[int, Any, list]:
        """Run one API request; returns status, JSON body and the cache events since
        the last call."""
        resp = await self.client.post(path, json=body)
        return resp.status_code, resp.json(), self.events.drain()

    async def metrics(self) -> str:
        resp = await self.client.get("/metrics")
        return resp.text

    def pid(self) -> int:
        """The replica's process id (for operators, and fault tests that kill it)."""
        return os.getpid()


def _label(text: str, replica: int) -> str:
    """Add ``replica="<i>"`` to every sample line of a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            out.append(line)
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s(.*)$", line)
        if m is None:
            out.append(line)
            continue
        name, _, labels, rest = m.groups()
        labels = f'replica="{replica}"' + (f",{labels}" if labels else "")
        out.append(f"{name}{{{labels}}} {rest}")
    return "\n".join(out)


class Ingress:
    """Routes API requests to engine replicas by where their prefixes are cached."""

    def __init__(
        self,
        replicas: list,
        model: str | None,
        block_size: int,
        policy: str = "checkpoint",
        max_queue: int = 8,
    ) -> None:
        from hybridserve.chat_template import compile_chat_template, pick_template
        from hybridserve.default_model import PATH as DEFAULT_MODEL
        from hybridserve.hub import resolve_model
        from hybridserve.tokenizer import Tokenizer

        self.replicas = replicas
        self.router = Router(len(replicas), block_size, policy, max_queue=max_queue)
        self.tokenizer = Tokenizer.maybe_load(DEFAULT_MODEL if model is None else resolve_model(model))
        source = pick_template(self.tokenizer.chat_template) if self.tokenizer else None
        self.template = compile_chat_template(source) if source else None
        self.failures = [0] * len(replicas)

    def routing_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        """The prompt's token ids as the replica will see them, or [] when they cannot be
        worked out here (the router then goes by load; the replica validates)."""
        from hybridserve.chat_template import render_chat

        try:
            if path == "/v1/completions":
                prompt = body.get("prompt")
                if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                    return list(prompt)
                if isinstance(prompt, str) and self.tokenizer is not None:
                    return self.tokenizer.encode(prompt)
                return []
            if self.template is None or self.tokenizer is None:
                return []
            messages = [
                {"role": m["role"], "content": m.get("content") or ""} for m in body["messages"]
            ]
            tok = self.tokenizer
            text = render_chat(self.template, messages, add_generation_prompt=True,
                               bos_token=tok.bos_token, eos_token=tok.eos_token)
            return tok.encode_batch([text], add_special_tokens=False)[0]
        except Exception:
            return []

    async def forward(self, path: str, body: dict[str, Any]) -> JSONResponse:
        if body.get("stream"):
            return _error(400, "stream=true is not served across replicas yet", "stream")
        ids = self.routing_ids(path, body)
        r = self.router.route(ids).replica
        try:
            status, payload, events = await self.replicas[r].handle.remote(path, body)
        except Exception as e:  # the replica died or its call failed
            self.failures[r] += 1
            self.router.reset_replica(r)
            return _error(503, f"replica {r} failed while serving the request: {type(e).__name__}",
                          None, "replica_unavailable")
        finally:
            self.router.finished(r)
        self.router.apply_events(r, events)
        return JSONResponse(payload, status_code=status, headers={"x-hybridserve-replica": str(r)})

    def replica_stats(self) -> list[dict[str, Any]]:
        return [
            {"replica": i, "queue": v.queue, "failures": self.failures[i],
             "cached_blocks": len(v.blocks), "checkpoints": len(v.checkpoints)}
            for i, v in enumerate(self.router.replicas)
        ]

    async def metrics(self) -> str:
        parts = []
        for i, h in enumerate(self.replicas):
            try:
                parts.append(_label(await h.metrics.remote(), i))
            except Exception:
                parts.append(f"# replica {i} unavailable")
        parts.append("# TYPE hybridserve_router_queue gauge")
        for s in self.replica_stats():
            parts.append(f'hybridserve_router_queue{{replica="{s["replica"]}"}} {s["queue"]}')
        parts.append("# TYPE hybridserve_router_failures_total counter")
        for s in self.replica_stats():
            parts.append(f'hybridserve_router_failures_total{{replica="{s["replica"]}"}} {s["failures"]}')
        return "\n".join(parts) + "\n"


def _error(status: int, message: str, param: str | None, code: str | None = None) -> JSONResponse:
    err = {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
           "param": param, "code": code}
    return JSONResponse({"error": err}, status_code=status)


api = FastAPI(title="hybridserve replicas")


@serve.deployment(name="ingress")
@serve.ingress(api)
class IngressDeployment(Ingress):
    @api.post("/v1/completions")
    async def completions(self, request: Request) -> JSONResponse:
        return await self.forward("/v1/completions", await request.json())

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> JSONResponse:
        return await self.forward("/v1/chat/completions", await request.json())

    @api.get("/metrics")
    async def prometheus(self) -> PlainTextResponse:
        return PlainTextResponse(await self.metrics())

    @api.get("/v1/replicas")
    async def replicas_json(self) -> dict[str, Any]:
        return {"router": self.router.policy, "max_queue": self.router.max_queue,
                "replicas": self.replica_stats()}


def build_app(
    model: str | None = None,
    *,
    num_replicas: int = 2,
    policy: str = "checkpoint",
    max_queue: int = 8,
    kv_block_size: int = 16,
    num_cpus_per_replica: float = 1.0,
    **llm_kwargs: Any,
):
    """The Serve application: ``num_replicas`` engines and the routing ingress.

    ``llm_kwargs`` go to every replica's :class:`~hybridserve.LLM` (``max_num_seqs``,
    ``num_state_pages``, ...)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    llm_kwargs["kv_block_size"] = kv_block_size
    Router(num_replicas, kv_block_size, policy, max_queue=max_queue)  # validates the knobs
    engines = [
        serve.deployment(EngineReplica, name=f"engine-{i}", num_replicas=1,
                         ray_actor_options={"num_cpus": num_cpus_per_replica})
        .bind(i, model, dict(llm_kwargs))
        for i in range(num_replicas)
    ]
    return IngressDeployment.bind(engines, model, kv_block_size, policy, max_queue)


def serve_replicas_main(args) -> int:
    """``hybridserve serve --replicas N``: start a local Ray cluster and serve until
    interrupted. Returns the exit status; raises ValueError for options this mode does
    not take."""
    import time

    import ray

    from hybridserve.cli import llm_kwargs_from_args

    for opt in ("api_key", "chat_template", "served_model_name"):
        if getattr(args, opt, None):
            raise ValueError(f"--{opt.replace('_', '-')} is not supported with --replicas yet")
    if getattr(args, "tensor_parallel_size", 1) > 1:
        # A replica would spawn its ranks inside a Ray actor holding one GPU's worth.
        raise ValueError("--tensor-parallel-size > 1 is not supported with --replicas yet")
    kwargs = llm_kwargs_from_args(args)
    model = kwargs.pop("model")
    ray.init(include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build_app(model, num_replicas=args.replicas, max_queue=args.router_max_queue,
                    **kwargs)
    serve.run(app, route_prefix="/", name="hybridserve")
    print(f"serving {args.replicas} replicas on http://{args.host}:{args.port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
