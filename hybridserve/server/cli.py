"""``hybridserve serve``: options and entry point of the HTTP server."""

from __future__ import annotations

import argparse
import contextlib
import gc
import ipaddress
import logging
import os
from pathlib import Path

# Only torch-free modules at import: `hybridserve --help` builds these options.
from hybridserve.server.http import DEFAULT_MAX_REQUEST_BODY_BYTES, HTTPOptions

log = logging.getLogger("hybridserve.server")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_HTTP = HTTPOptions()


SERVE_DESCRIPTION = """\
Serve one model over an HTTP API shaped like OpenAI's (/v1/completions,
/v1/chat/completions, /v1/models, /health, /metrics). The model is given as
'hybridserve serve MODEL' or '--model MODEL': a checkpoint directory or a Hugging Face
hub id (org/name); with neither, the embedded default model."""


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Server options (the engine options come from ``add_engine_arguments``), and the
    model as an optional positional argument (vLLM's ``serve MODEL``)."""
    p.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL",
        help="checkpoint directory or hub id, the same as --model",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: loopback only)"
    )
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--api-key",
        default=os.environ.get("HYBRIDSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
        "(default: $HYBRIDSERVE_API_KEY; unset means no check, empty is refused)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send, the only one accepted "
        "(default: the checkpoint directory's name)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="PATH",
        help="Jinja2 chat template file, replacing the checkpoint's own",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="how the model writes tool calls: hermes, granite4, qwen3_coder (nemotron_v3), "
        "nemotron_nano_v2; needed for tool_choice other than 'none'",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let tool_choice='auto' (the default with tools) parse tool calls out of the "
        "output; needs --tool-call-parser",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="split reasoning_content out of chat replies: qwen3, deepseek_r1, "
        "nemotron_v3, granite_thinking, granite",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="report usage.prompt_tokens_details.cached_tokens (the prompt tokens served "
        "from the prefix cache) and the x-hybridserve-predicted-cached-tokens header "
        "(default: on; vLLM's default is off)",
    )
    p.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info (the tokenizer's configuration and the chat "
        "template), as vLLM's; lm-eval's remote tokenizer reads it",
    )
    p.add_argument(
        "--allowed-origins",
        type=_json_list("--allowed-origins"),
        default=None,
        metavar="JSON",
        help='turn on CORS for these origins, a JSON list (\'["*"]\' for any); '
        "default: off, no CORS headers",
    )
    p.add_argument(
        "--allowed-methods",
        type=_json_list("--allowed-methods"),
        default=None,
        metavar="JSON",
        help="with --allowed-origins: the methods allowed, a JSON list (default any)",
    )
    p.add_argument(
        "--allowed-headers",
        type=_json_list("--allowed-headers"),
        default=None,
        metavar="JSON",
        help="with --allowed-origins: the request headers allowed, a JSON list (default any)",
    )
    p.add_argument(
        "--allow-credentials",
        action="store_true",
        help="with --allowed-origins: let browsers send credentials (cookies, auth headers)",
    )
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="log verbosity")
    p.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=_HTTP.graceful_shutdown_timeout,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, how long in-flight requests may take to finish "
        "before they are ended with a 503 error",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        metavar="BYTES",
        help="larger request bodies get a 413 (default: %(default)s, 8 MiB)",
    )
    p.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=_HTTP.timeout_keep_alive,
        metavar="SECONDS",
        help="close a connection idle this long between requests (default: %(default)s)",
    )
    p.add_argument(
        "--request-read-timeout",
        type=float,
        default=_HTTP.request_read_timeout,
        metavar="SECONDS",
        help="close a connection that has not sent a whole request (head and body) "
        "this long after it opened or its last response ended (default: %(default)s)",
    )
    p.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=_HTTP.h11_max_incomplete_event_size,
        metavar="BYTES",
        help="the largest request head (request line and headers) accepted (default: %(default)s)",
    )


def _json_list(flag: str):
    """An argparse type: a JSON list of strings (vLLM's spelling of the CORS flags)."""

    def parse(text: str) -> list[str]:
        import json

        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(
                f"{flag} takes a JSON list of strings, e.g. '[\"https://example.com\"]', got {text!r}"
            )
        return value

    return parse


def read_chat_template(path: str | None) -> str | None:
    """The template file's text; raises ValueError naming the file if it is unreadable."""
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--chat-template: cannot read {path}: {e.strerror or e}") from e


def check_parsers(args: argparse.Namespace) -> None:
    """ValueError for an unknown parser name or auto tool choice without a parser."""
    from hybridserve.reasoning import get_reasoning_parser
    from hybridserve.tools.parsers import get_tool_parser

    if args.tool_call_parser is not None:
        get_tool_parser(args.tool_call_parser)
    if args.reasoning_parser is not None:
        get_reasoning_parser(args.reasoning_parser)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_access(host: str, api_key: str | None) -> None:
    """Refuse an empty key (ValueError); warn about an open port without one."""
    if api_key is not None and not api_key.strip():
        raise ValueError(
            "the API key (--api-key or HYBRIDSERVE_API_KEY) is empty: set a key, "
            "or unset HYBRIDSERVE_API_KEY to serve without one"
        )
    if api_key is None and not is_loopback(host):
        log.warning(
            "listening on %s without an API key: anyone who can reach this address can "
            "use the model (set --api-key or HYBRIDSERVE_API_KEY)",
            host,
        )


def startup_line(llm, name: str, host: str, port: int) -> str:
    cfg = llm.config
    cache, sched = cfg.cache, cfg.scheduler
    return (
        f"serving model={cfg.model} as {name!r} dtype={str(cfg.dtype).removeprefix('torch.')} "
        f"device={cfg.device} max_model_len={sched.max_model_len} "
        f"max_num_seqs={sched.max_num_seqs} num_kv_blocks={cache.num_kv_blocks} "
        f"kv_block_size={cache.kv_block_size} num_state_pages={cache.num_state_pages} "
        f"state_interval={cache.state_interval} max_checkpoint_pages={cache.checkpoint_budget} "
        f"host_checkpoint_pages={llm.engine.scheduler.host.num_pages} "
        f"prefix_caching={'on' if cache.enable_prefix_caching else 'off'} "
        f"speculative_tokens={cfg.speculative.num_speculative_tokens if cfg.speculative else 0} "
        f"on http://{host}:{port}"
    )


def apply_model_tag(args: argparse.Namespace) -> None:
    """Fold the positional MODEL into ``args.model``; raises ValueError when both are
    given and differ."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        raise ValueError(f"the model is given twice: {tag!r} and --model {args.model!r}")
    args.model = tag


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now (the model, the engine's caches'
    bookkeeping, the tokenizer: hundreds of thousands of objects that live as long as the
    server) out of the cyclic collector's reach; returns how many were frozen.

    Without it a full collection walks them all every few dozen steps: 0.2-0.4 s at
    batch 256 on the CPU benchmark, several ms a step on average, more than the rest of
    a step's host work (``benchmarks/bench_host.py --gc-freeze``). What serving
    allocates later is collected as before; a frozen object freed later is still freed
    by reference counting, and only a cycle among frozen objects would stay."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def serve_main(args: argparse.Namespace) -> int:
    """Load the model, then serve until SIGINT/SIGTERM. Returns the exit status;
    raises ValueError for bad options (the caller prints it)."""
    apply_model_tag(args)
    from hybridserve.cli import llm_from_args
    from hybridserve.server.http import make_server
    from hybridserve.server.openai_api import create_app

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    check_access(args.host, args.api_key)
    options = HTTPOptions(
        timeout_keep_alive=args.timeout_keep_alive,
        request_read_timeout=args.request_read_timeout,
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
        graceful_shutdown_timeout=args.graceful_shutdown_timeout,
    )
    template = read_chat_template(args.chat_template)
    check_parsers(args)  # before the model loads, which takes a while
    llm = llm_from_args(args)
    app = create_app(
        llm,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        chat_template=template,
        max_request_body_bytes=args.max_request_body_bytes,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        allowed_origins=args.allowed_origins,
        allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
    )
    if (args.allowed_methods or args.allowed_headers or args.allow_credentials) and args.allowed_origins is None:
        log.warning("--allowed-methods/--allowed-headers/--allow-credentials do nothing without --allowed-origins")
    name = app.state.server.serving.config.model_name
    log.info("%s", startup_line(llm, name, args.host, args.port))
    if args.api_key:
        log.info("API key required on every route but /health and /metrics")
    server = make_server(
        app, host=args.host, port=args.port, options=options, log_level=args.log_level
    )
    freeze_startup_heap()
    # uvicorn re-raises the SIGINT it handled once it has shut down cleanly.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    log.info("server stopped")
    return 0
