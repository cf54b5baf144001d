"""Command line: `hybridserve generate | serve | demo`.

Option parsing imports neither torch nor the engine, so `--help` and `--version`
answer at once; each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import warnings
from collections.abc import Sequence

DESCRIPTION = """\
An inference engine for hybrid Mamba2/attention language models.

With no --model, every command uses the embedded default model (a small Python code
model). 'hybridserve COMMAND --help' lists a command's options."""

GENERATE_EPILOG = """\
examples:
  hybridserve generate "def fibonacci(n):"
  hybridserve generate --temperature 0.8 --seed 1 --n 3 "class Stack:"
  echo "def add(a, b):" | hybridserve generate -
  hybridserve generate --model ibm-granite/granite-4.0-h-tiny "def f(x):"

With one prompt and --n 1 the text is printed as it is generated; otherwise each
completion is printed under a '--- ' header line, in order, each as soon as it and
those before it are done."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions as written and adds "(default: X)" to options whose default
    says something (not None or False) and whose help does not already name it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.option_strings
            and action.default is not None
            and action.default is not False
            and action.default != argparse.SUPPRESS
            and "default" not in text
        ):
            text += " (default: %(default)s)"
        return text


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Engine options shared by every command (names follow vLLM's flags)."""
    p.add_argument(
        "--model", default=None,
        help="checkpoint directory or Hugging Face hub id org/name "
        "(default: the embedded model)",
    )
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument(
        "--mamba-ssm-cache-dtype", default="float32",
        help="dtype of the recurrent (SSM) state cache: float32, bfloat16 or float16",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    p.add_argument(
        "--max-model-len", type=int, default=None,
        help="context length: prompt plus output tokens (default: the model's "
        "max_position_embeddings, at most 4096)",
    )
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None,
        help="token budget of one step; prefills are chunked to fit "
        "(default: max(2048, --max-num-seqs))",
    )
    p.add_argument("--kv-block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument(
        "--num-kv-blocks", type=int, default=None,
        help="KV-cache blocks (default: enough for 8 sequences of --max-model-len, at least 256)",
    )
    p.add_argument(
        "--num-state-pages", type=int, default=None,
        help="recurrent-state pages (default: sized from --max-num-seqs and the checkpoint budget)",
    )
    p.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="prefix caching of KV blocks and recurrent-state checkpoints",
    )
    p.add_argument(
        "--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
        help=argparse.SUPPRESS,
    )
    p.add_argument("--state-interval", type=int, default=64, help="checkpoint grid in tokens")
    p.add_argument(
        "--max-checkpoint-pages", type=int, default=None,
        help="state pages checkpoints may hold (default: 64)",
    )
    p.add_argument(
        "--eviction-policy", choices=("lru", "flop_aware"), default="lru",
        help="which checkpoint to evict when the budget is full",
    )
    p.add_argument(
        "--checkpoint-offload-gib", type=float, default=0.0,
        help="host memory (GiB; pinned on CUDA) that evicted state checkpoints move to "
        "instead of being dropped; 0 = off",
    )
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=None,
        help="size the caches from this share of the device's memory (as vLLM's flag; "
        "max_model_len then defaults to the model's own); unset: sizes from max_num_seqs",
    )
    p.add_argument(
        "--checkpoint-memory-fraction", type=float, default=0.2,
        help="with --gpu-memory-utilization: the share of the cache memory left after live "
        "state that goes to checkpoint pages",
    )
    p.add_argument(
        "--num-speculative-tokens", type=int, default=0,
        help="n-gram (prompt lookup) speculative decoding with this many draft tokens; 0 = off",
    )
    p.add_argument(
        "--speculative-config", type=_json_object, default=None, metavar="JSON",
        help='speculative decoding as vLLM spells it, e.g. \'{"method": "mtp", '
        '"num_speculative_tokens": 3}\' (methods: ngram, mtp, draft_model with "model": PATH, or "default-draft" for the default model)',
    )
    p.add_argument("--seed", type=int, default=0, help="random seed of sampling")
    p.add_argument(
        "--enforce-eager", action="store_true",
        help="never replay decode steps from CUDA graphs",
    )
    p.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1,
        help="split the model over this many ranks, one process each (on cuda[:k], rank r "
        "uses cuda:k+r; on cpu every rank runs on the CPU)",
    )
    p.add_argument(
        "--num-threads", type=int, default=None,
        help="torch CPU threads (default: $HYBRIDSERVE_NUM_THREADS, else torch's own when "
        "$OMP_NUM_THREADS is set, else 1: more threads gain little on this engine's small "
        "CPU ops and are much slower when other work holds the cores)",
    )


def llm_kwargs_from_args(args: argparse.Namespace) -> dict:
    """The :class:`~hybridserve.LLM` keyword arguments of parsed :func:`add_engine_arguments`
    options (``model`` included)."""
    spec = args.speculative_config
    if args.num_speculative_tokens > 0:
        if spec is not None:
            raise ValueError("give --speculative-config or --num-speculative-tokens, not both")
        spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    return dict(
        model=args.model,
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
        checkpoint_offload_gib=args.checkpoint_offload_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        checkpoint_memory_fraction=args.checkpoint_memory_fraction,
        speculative_config=spec,
        enforce_eager=True if args.enforce_eager else None,
        num_threads=args.num_threads,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def llm_from_args(args: argparse.Namespace):
    """Build an :class:`~hybridserve.LLM` from parsed :func:`add_engine_arguments` options."""
    from hybridserve import LLM

    return LLM(**llm_kwargs_from_args(args))


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
    "--pipeline-parallel-size": "none: split a model with --tensor-parallel-size",
    "--trust-remote-code": "none: the supported model families are built in",
    "--tokenizer": "none: the checkpoint's tokenizer.json is used",
    "--kv-cache-dtype": "--dtype (the KV cache has the model's dtype)",
    "--uvicorn-log-level": "--log-level",
}
"""vLLM flags without a same-named counterpart, and what to use here instead."""


def _reject_unknown(sub: argparse.ArgumentParser, extra: list[str]) -> None:
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


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "prompts", nargs="+", metavar="PROMPT",
        help="prompt text; '-' reads one prompt from standard input (one trailing "
        "newline is dropped)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=64,
        help="new tokens per completion at most (capped to fit in --max-model-len)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely; 0 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    p.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeated tokens"
    )
    p.add_argument(
        "--stop", action="append", default=None, metavar="TEXT",
        help="stop when TEXT is generated (not printed); repeat for several",
    )
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end of text")


def _read_prompts(prompts: list[str]) -> list[str]:
    if prompts.count("-") > 1:
        raise ValueError("'-' (the prompt from standard input) may be given once")
    if "-" not in prompts:
        return prompts
    text = sys.stdin.read()
    if text.endswith("\n"):  # what `echo` and editors add, not part of the prompt
        text = text[:-2] if text.endswith("\r\n") else text[:-1]
    return [text if p == "-" else p for p in prompts]


class _Printer:
    """Prints completions in order, each as its text grows. Text that could still
    change is held back: a trailing incomplete character, and the last characters
    that could be the start of a stop string."""

    def __init__(self, prompts: list[str], n: int, stops: list[str], out) -> None:
        self.slots = [(i, j) for i in range(len(prompts)) for j in range(n)]
        self.prompts = prompts
        self.headers = len(self.slots) > 1
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.latest: dict[int, object] = {}
        self.current = 0
        self.printed = 0
        self.out = out
        self._begin()

    def _begin(self) -> None:
        if self.current >= len(self.slots):
            return
        i, j = self.slots[self.current]
        if self.headers:
            label = repr(self.prompts[i]) + (f" [{j}]" if len(self.slots) > len(self.prompts) else "")
            self.out.write(f"--- {label}\n")
        self.out.write(self.prompts[i])
        self.printed = 0

    def update(self, prompt_index: int, output) -> None:
        self.latest[prompt_index] = output
        while self.current < len(self.slots):
            i, j = self.slots[self.current]
            out = self.latest.get(i)
            if out is None:
                break
            comp = out.outputs[j]
            text = comp.text
            if comp.finish_reason is None:
                end = len(text) - self.hold
                if text[:end].endswith("\ufffd"):
                    end -= 1
                if end > self.printed:
                    self.out.write(text[self.printed : end])
                    self.printed = end
                break
            self.out.write(text[self.printed :] + "\n")
            self.current += 1
            self._begin()
        self.out.flush()


def _generate(args: argparse.Namespace) -> int:
    from hybridserve import SamplingParams

    prompts = _read_prompts(args.prompts)
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
    params = SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        stop=args.stop, seed=args.seed, ignore_eos=args.ignore_eos,
    )
    llm = llm_from_args(args)
    if llm.tokenizer is None:
        raise ValueError(
            f"{llm.config.model} ships no tokenizer.json, so its prompts cannot be given as text"
        )
    max_len = llm.config.scheduler.max_model_len
    for i, p in enumerate(prompts):
        n_ids = len(llm.tokenizer.encode(p))
        if n_ids >= max_len:
            raise ValueError(
                f"prompt {i} has {n_ids} tokens but the context (--max-model-len) is {max_len}: "
                "shorten it or raise --max-model-len"
            )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = llm._prepare(prompts, params)
    for w in caught:  # e.g. max_tokens capped to the context: say so before the text
        print(f"warning: {w.message}", file=sys.stderr)
    printer = _Printer(prompts, args.n, args.stop or [], sys.stdout)
    for index, out in llm._stream(prepared):
        printer.update(index, out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from hybridserve import __version__

    parser = argparse.ArgumentParser(
        prog="hybridserve", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"hybridserve {__version__}")
    sub = parser.add_subparsers(
        title="commands", dest="command", required=True, metavar="COMMAND"
    )

    gen = sub.add_parser(
        "generate", help="complete prompts and print the text as it is generated",
        description="Complete prompts and print the text as it is generated.",
        epilog=GENERATE_EPILOG, formatter_class=HelpFormatter,
    )
    add_generate_arguments(gen)
    add_engine_arguments(gen)

    demo = sub.add_parser(
        "demo", help="completions, prefix-cache hits and speculative decoding, shown on the embedded model",
        description="Completions, prefix-cache hits and speculative decoding on the "
        "embedded model, in half a minute.",
        formatter_class=HelpFormatter,
    )
    add_engine_arguments(demo)

    from hybridserve.server.cli import SERVE_DESCRIPTION, add_serve_arguments

    serve = sub.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server", description=SERVE_DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    add_serve_arguments(serve)
    add_engine_arguments(serve)
    serve.add_argument(
        "--replicas", type=int, default=1,
        help="engine replicas on a local Ray Serve cluster, routed by where their "
        "checkpoints are (needs the 'ray' extra; docs/scale-out.md)",
    )
    serve.add_argument(
        "--router-max-queue", type=int, default=8,
        help="with --replicas: a replica with more requests in flight than this is "
        "passed over even if it holds the deepest checkpoint",
    )
    parser.commands = {"generate": gen, "demo": demo, "serve": serve}
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    command = parser.commands[args.command]
    if extra:
        _reject_unknown(command, extra)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "demo":
            from hybridserve.demo import run_demo

            return run_demo(args)
        if args.replicas > 1:
            from hybridserve.routing.ray_app import serve_replicas_main

            return serve_replicas_main(args)
        from hybridserve.server.cli import serve_main

        return serve_main(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
