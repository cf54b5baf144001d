"""Command line: ``hybridserve generate | serve | demo``.

With no ``--model``, every command uses the embedded default model.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Sequence


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Engine options shared by every command (names follow vLLM's flags)."""
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument(
        "--mamba-ssm-cache-dtype", default="float32",
        help="dtype of the recurrent (SSM) state cache: float32, bfloat16 or float16",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--num-state-pages", type=int, default=None)
    p.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="prefix caching of KV blocks and recurrent-state checkpoints (default: on)",
    )
    p.add_argument(
        "--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
        help=argparse.SUPPRESS,
    )
    p.add_argument("--state-interval", type=int, default=64, help="checkpoint grid in tokens")
    p.add_argument("--max-checkpoint-pages", type=int, default=None)
    p.add_argument(
        "--eviction-policy", choices=("lru", "flop_aware"), default="lru",
        help="which checkpoint to evict when the budget is full",
    )
    p.add_argument(
        "--num-speculative-tokens", type=int, default=0,
        help="n-gram (prompt lookup) speculative decoding with this many draft tokens; 0 = off",
    )
    p.add_argument(
        "--speculative-config", type=_json_object, default=None, metavar="JSON",
        help='speculative decoding as vLLM spells it, e.g. '
        '\'{"method": "ngram", "num_speculative_tokens": 3}\'',
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--enforce-eager", action="store_true",
        help="never replay decode steps from CUDA graphs",
    )
    p.add_argument(
        "--num-threads", type=int, default=None,
        help="CPU threads for torch (small models on few cores run fastest with 1)",
    )


def llm_from_args(args: argparse.Namespace):
    """Build an :class:`~hybridserve.LLM` from parsed :func:`add_engine_arguments` options."""
    import torch

    from hybridserve import LLM

    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    spec = args.speculative_config
    if args.num_speculative_tokens > 0:
        if spec is not None:
            raise ValueError("give --speculative-config or --num-speculative-tokens, not both")
        spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    return LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_block_size=args.kv_block_size,
        num_kv_blocks=args.num_kv_blocks,
        num_state_pages=args.num_state_pages,
        enable_prefix_caching=args.enable_prefix_caching,
        ssm_state_dtype=args.mamba_ssm_cache_dtype,
        state_interval=args.state_interval,
        max_checkpoint_pages=args.max_checkpoint_pages,
        eviction_policy=args.eviction_policy,
        speculative_config=spec,
        enforce_eager=True if args.enforce_eager else None,
    )


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


_VLLM_FLAGS = {
    "--block-size": "--kv-block-size",
    "--gpu-memory-utilization": "--num-kv-blocks and --num-state-pages (cache sizes are given, not a memory fraction)",
    "--tensor-parallel-size": "none: one device per server",
    "--pipeline-parallel-size": "none: one device per server",
    "--trust-remote-code": "none: the supported model families are built in",
    "--tokenizer": "none: the checkpoint's tokenizer.json is used",
    "--kv-cache-dtype": "--dtype (the KV cache has the model's dtype)",
    "--uvicorn-log-level": "--log-level",
}
"""vLLM flags without a same-named counterpart, and what to use here instead."""


def _reject_unknown(parser: argparse.ArgumentParser, sub: argparse.ArgumentParser, extra: list[str]) -> None:
    """Exit with an error naming each unknown option and the nearest one we have (a
    vLLM flag without a counterpart here gets told so, not silently dropped)."""
    known = [o for a in sub._actions for o in a.option_strings if a.help != argparse.SUPPRESS]
    lines = []
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if not flag.startswith("-"):
            lines.append(f"unexpected argument {arg!r}")
            continue
        near = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        if flag in _VLLM_FLAGS:
            hint = f"; use instead: {_VLLM_FLAGS[flag]}"
        else:
            hint = f"; the nearest option is {near[0]}" if near else ""
        lines.append(f"unknown option {flag}{hint} (see {sub.prog} --help)")
    sub.error("; ".join(lines))


def _generate(args: argparse.Namespace) -> int:
    from hybridserve import SamplingParams

    llm = llm_from_args(args)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.sample_seed
    )
    for out in llm.generate(args.prompts, params, use_tqdm=False):
        print(f"--- {out.prompt!r}")
        print(out.prompt + out.outputs[0].text if out.prompt else out.outputs[0].text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts and print the results")
    add_engine_arguments(gen)
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sample-seed", type=int, default=None)

    demo = sub.add_parser("demo", help="show completions, prefix-cache hits and speculation")
    add_engine_arguments(demo)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    # vLLM's positional model: ``hybridserve serve path/to/checkpoint``.
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="checkpoint directory (as --model)")
    add_engine_arguments(serve)
    try:
        from hybridserve.server.cli import add_serve_arguments
    except ImportError:  # the server's dependencies are optional at import time
        add_serve_arguments = None
    if add_serve_arguments is not None:
        add_serve_arguments(serve)

    args, extra = parser.parse_known_args(argv)
    if extra:
        _reject_unknown(parser, {"generate": gen, "demo": demo, "serve": serve}[args.command], extra)
    if getattr(args, "model_tag", None) is not None:
        if args.model is not None and args.model != args.model_tag:
            serve.error(f"the model is given twice: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "demo":
            from hybridserve.demo import run_demo

            return run_demo(args)
        from hybridserve.server.cli import serve_main

        return serve_main(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
