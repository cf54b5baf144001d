"""``hybridserve serve``: options and entry point of the HTTP server."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

log = logging.getLogger("hybridserve.server")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Server options (the engine options come from ``add_engine_arguments``)."""
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: loopback only)"
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("HYBRIDSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/ routes "
        "(default: $HYBRIDSERVE_API_KEY, unset means no check)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients use (default: the checkpoint directory's name)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="PATH",
        help="Jinja2 chat template file, replacing the checkpoint's own",
    )
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    p.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, how long in-flight requests may take to finish "
        "before they are cancelled",
    )


def read_chat_template(path: str | None) -> str | None:
    """The template file's text; raises ValueError naming the file if it is unreadable."""
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--chat-template: cannot read {path}: {e.strerror or e}") from e


def startup_line(llm, name: str, host: str, port: int) -> str:
    cfg = llm.config
    cache, sched = cfg.cache, cfg.scheduler
    return (
        f"serving model={cfg.model} as {name!r} dtype={str(cfg.dtype).removeprefix('torch.')} "
        f"device={cfg.device} max_model_len={sched.max_model_len} "
        f"max_num_seqs={sched.max_num_seqs} num_kv_blocks={cache.num_kv_blocks} "
        f"kv_block_size={cache.kv_block_size} num_state_pages={cache.num_state_pages} "
        f"state_interval={cache.state_interval} "
        f"prefix_caching={'on' if cache.enable_prefix_caching else 'off'} "
        f"speculative_tokens={cfg.speculative.num_speculative_tokens if cfg.speculative else 0} "
        f"on http://{host}:{port}"
    )


def serve_main(args: argparse.Namespace) -> int:
    """Load the model, then serve until SIGINT/SIGTERM. Returns the exit status;
    raises ValueError for bad options (the caller prints it)."""
    import uvicorn

    from hybridserve.cli import llm_from_args
    from hybridserve.server.openai_api import create_app

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    template = read_chat_template(args.chat_template)
    llm = llm_from_args(args)
    app = create_app(
        llm, served_model_name=args.served_model_name, api_key=args.api_key, chat_template=template
    )
    name = app.state.server.serving.config.model_name
    log.info("%s", startup_line(llm, name, args.host, args.port))
    if args.api_key:
        log.info("API key required on /v1/ routes")
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.graceful_shutdown_timeout,
    )
    log.info("server stopped")
    return 0
