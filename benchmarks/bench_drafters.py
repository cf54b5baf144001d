"""Tokens per second and acceptance with each drafter (none, n-gram, MTP, draft model).

Two targets:

- ``--target random`` (the default): random checkpoints built here (nothing downloaded),
  a Qwen3.5-shaped target with a random MTP head, a smaller draft model, and the target
  itself as a draft model (every draft accepted: the verify path's ceiling). Random
  weights accept few MTP / small-draft drafts, so those rows measure the drafters' cost,
  not a real acceptance.
- ``--target nemotron``: the same with a Nemotron-H target (``--layers`` in its codes:
  ``M`` Mamba2, ``A`` attention, ``E`` mixture of experts, ``-`` MLP) and a random
  Nemotron-H MTP head of the published ``["attention", "moe"]`` layout.
- ``--target default``: the embedded default model with the shipped trained draft model
  (``"model": "default-draft"``), the n-gram drafter, and the default model as its own
  draft model, on prompts cut from the held-out (``val``) split of the default model's
  corpus: ``--prompts`` windows of ``--prompt-len`` tokens at evenly spaced offsets of
  the val stream (rebuilt from the local standard library; ``corpus_matches_manifest``
  records whether its sha256 is the manifest's). Acceptance here is real.

Every row runs all prompts through one ``LLM`` at the given batch (``max_num_seqs``),
greedy, once to warm up and once timed, and checks its outputs against no speculation
(``matches_no_speculation``, ``token_agreement``, ``sequences_identical``). Per row: ``acceptance_rate`` =
accepted / drafted tokens; ``accepted_per_verify_step`` = accepted drafts per target row
that carried drafts; ``tokens_per_verify_step`` = 1 + that; ``tokens_per_target_step`` =
generated tokens / target rows that emitted them (steps without drafts included).

    python benchmarks/bench_drafters.py --target default --k 1 3 5 --batch 32 \
        --methods ngram draft_model --out benchmarks/results/drafters_trained_cpu.json
    python benchmarks/bench_drafters.py --target default --device cuda --dtype bfloat16 \
        --k 3 --batch 1 16 64 --prompts 64 --out drafters_trained_h200.json
    python benchmarks/bench_drafters.py --device cuda --hidden 1024 --layers MMMAMMMA \
        --batch 1 16 64 --out drafters.json
    python benchmarks/bench_drafters.py --target nemotron --device cuda --dtype bfloat16 \
        --hidden 1024 --layers MEMAMEMA --batch 1 16 64 --out drafters_nemotron_h200.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import random
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import git_commit, portable_path  # noqa: E402


def _checkpoints(root: Path, hidden: int, layers: str, arch: str = "qwen3_5") -> tuple[Path, Path]:
    from hybridserve.testing.tiny_models import make_tiny_checkpoint
    from hybridserve.testing.tiny_mtp import add_mtp_head

    heads = max(4, hidden // 64)
    common = dict(
        hidden_size=hidden, intermediate_size=hidden * 2, num_attention_heads=heads,
        num_key_value_heads=max(2, heads // 4), head_dim=64, vocab_size=4096,
    )
    if arch == "nemotron_h":
        # Mamba heads of 64, experts as wide as the hidden size (the MTP head's MoE too).
        shape = dict(common, mamba_num_heads=2 * hidden // 64, mamba_head_dim=64, n_groups=2,
                     ssm_state_size=64, chunk_size=64, n_routed_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=hidden, moe_shared_expert_intermediate_size=hidden)
    else:
        shape = dict(common, linear_num_key_heads=max(2, heads // 2), linear_num_value_heads=heads,
                     linear_key_head_dim=64, linear_value_head_dim=64)
    target = add_mtp_head(make_tiny_checkpoint(arch, root / "target", seed=1, layers=layers, **shape))
    draft = make_tiny_checkpoint(arch, root / "draft", seed=2, layers="MA", **shape)
    return target, draft


def heldout_prompts(n: int, length: int) -> tuple[list[list[int]], bool]:
    """``n`` prompts of ``length`` token ids from the default model's val split, and
    whether the local files match the manifest's sha256.

    The val files named by ``data_manifest.json`` are read from this interpreter's
    standard library (missing ones are skipped) and tokenized into the training stream's
    format (``EOS f1 EOS ... fN EOS``); the prompts are windows at evenly spaced offsets.
    """
    from tokenizers import Tokenizer

    from hybridserve.default_model import PATH

    manifest = json.loads((PATH / "data_manifest.json").read_text())
    root = Path(sysconfig.get_paths()["stdlib"])
    digest = hashlib.sha256()
    texts = []
    for rel, split in manifest["files"]:
        if split == "val" and (root / rel).is_file():
            raw = (root / rel).read_bytes()
            digest.update(raw)
            texts.append(raw.decode("utf-8", errors="replace"))
    tok = Tokenizer.from_file(str(PATH / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    stream = [eos]
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        stream.extend(enc.ids)
        stream.append(eos)
    if len(stream) < n + length:
        raise SystemExit(f"the local val split has {len(stream)} tokens; too few for the prompts")
    step = (len(stream) - length) // n
    prompts = [stream[i * step : i * step + length] for i in range(n)]
    return prompts, digest.hexdigest() == manifest["splits"]["val"]["sha256"]


def random_prompts(rng: random.Random, batch: int, length: int) -> list[list[int]]:
    """Half random ids, half a repeated motif (something for the n-gram drafter)."""
    motif = [rng.randrange(3, 4096) for _ in range(8)]
    return [
        (motif * (length // 8 + 1))[:length] if i % 2 else
        [rng.randrange(3, 4096) for _ in range(length)]
        for i in range(batch)
    ]


def run_row(target, spec, prompts, params, args, batch: int) -> tuple[dict, list[list[int]]]:
    """One ``LLM`` with ``spec`` at ``max_num_seqs=batch``: its measurements and tokens."""
    import torch

    from hybridserve import LLM
    from hybridserve.config import KernelPolicy

    llm = LLM(target, dtype=args.dtype, device=args.device, max_num_seqs=batch,
              speculative_config=spec, enable_prefix_caching=False,
              kernel_policy=KernelPolicy(drafter_graphs=args.drafter_graphs))
    # Warm-up: the same workload once, so that kernel compiles and graph captures of this
    # (drafter, batch) land here, not in the timed run.
    llm.generate(prompts, params, use_tqdm=False)
    before = dict(llm.stats())
    # The drafter's own steps: replayed from its graphs (CUDA) or run eagerly.
    drafter = llm.engine.drafter
    graphs = getattr(drafter, "graphs", None)

    def drafter_steps() -> tuple[int, int]:
        eager = getattr(drafter, "counters", {}).get("draft_forwards", 0)
        return (graphs.counters["graph_steps"] if graphs is not None else 0), eager

    steps_before = drafter_steps()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    s = llm.stats()

    def delta(key):
        return s[key] - before.get(key, 0)

    rows, acc, drafted = delta("spec_verify_rows"), delta("spec_accepted_tokens"), delta("spec_draft_tokens")
    generated = sum(map(len, tokens))
    row = dict(
        seconds=round(seconds, 4), tokens_per_s=round(generated / seconds, 1),
        generated_tokens=generated, draft_tokens=drafted, accepted_tokens=acc, verify_steps=rows,
        acceptance_rate=round(acc / drafted, 4) if drafted else None,
        accepted_per_verify_step=round(acc / rows, 3) if rows else None,
        tokens_per_verify_step=round(1 + acc / rows, 3) if rows else None,
        # Each target row emits its accepted drafts and one token of its own.
        tokens_per_target_step=round(generated / (generated - acc), 3),
        drafter_share=round(delta("spec_drafter_seconds") / seconds, 3),
        drafter_graph_steps=drafter_steps()[0] - steps_before[0],
        drafter_eager_steps=drafter_steps()[1] - steps_before[1],
    )
    if graphs is not None and graphs.capture_errors:
        row["drafter_capture_errors"] = graphs.capture_errors[:3]
    del llm
    return row, tokens


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=("random", "nemotron", "default"), default="random")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--hidden", type=int, default=256, help="random target only")
    ap.add_argument("--layers", default="MMMA", help="random target only")
    ap.add_argument("--batch", type=int, nargs="+", default=None,
                    help="max_num_seqs per row (random target: also the number of prompts)")
    ap.add_argument("--k", type=int, nargs="+", default=[3], help="num_speculative_tokens")
    ap.add_argument("--prompts", type=int, default=32, help="default target: held-out prompts")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--methods", nargs="+", default=None,
                    help="drafters to run besides none (default: all of the target's)")
    ap.add_argument("--drafter-graphs", choices=("auto", "on", "off"), default="auto",
                    help="KernelPolicy.drafter_graphs: the drafter's own steps from CUDA graphs")
    ap.add_argument("--smoke", action="store_true", help="a few tiny rows on the CPU (a check that it runs)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.batch is None:
        args.batch = [32] if args.target == "default" else [1, 4]
    if args.prompt_len is None:
        args.prompt_len = 128 if args.target == "default" else 64
    if args.smoke:
        args.batch, args.prompts, args.max_tokens, args.prompt_len = [1, 2], 2, 8, 32
        args.hidden, args.layers = min(args.hidden, 128), "MAE" if args.target == "nemotron" else "MA"

    import torch

    from hybridserve import SamplingParams

    torch.manual_seed(0)
    rng = random.Random(0)
    results = []
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    meta = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.target == "default":
            from hybridserve.default_model import DRAFT_PATH, PATH

            target = PATH
            prompts, matches = heldout_prompts(args.prompts, args.prompt_len)
            meta = {"corpus_matches_manifest": matches, "python": platform.python_version(),
                    "draft_model": portable_path(DRAFT_PATH)}
            drafters = {"ngram": lambda k: {"method": "ngram", "num_speculative_tokens": k},
                        "draft_model": lambda k: {"method": "draft_model", "model": "default-draft",
                                                  "num_speculative_tokens": k},
                        "draft_model=target": lambda k: {"method": "draft_model", "model": str(PATH),
                                                         "num_speculative_tokens": k}}
        else:
            arch = "nemotron_h" if args.target == "nemotron" else "qwen3_5"
            target, draft = _checkpoints(Path(tmp), args.hidden, args.layers, arch)
            drafters = {"ngram": lambda k: {"method": "ngram", "num_speculative_tokens": k},
                        "mtp": lambda k: {"method": "mtp", "num_speculative_tokens": k},
                        "draft_model": lambda k: {"method": "draft_model", "model": str(draft),
                                                  "num_speculative_tokens": k},
                        "draft_model=target": lambda k: {"method": "draft_model", "model": str(target),
                                                         "num_speculative_tokens": k}}
        if args.methods:
            unknown = sorted(set(args.methods) - set(drafters))
            if unknown:
                raise SystemExit(f"--methods: unknown {unknown}; known: {sorted(drafters)}")
            drafters = {name: make for name, make in drafters.items() if name in args.methods}
        for batch in args.batch:
            if args.target != "default":
                prompts = random_prompts(rng, batch, args.prompt_len)
            rows = [("none", None, None)] + [(name, k, make(k)) for k in args.k
                                             for name, make in drafters.items()]
            reference = None
            for name, k, spec in rows:
                row, tokens = run_row(target, spec, prompts, params, args, batch)
                if reference is None:
                    reference = tokens
                same = sum(a == b for x, y in zip(tokens, reference) for a, b in zip(x, y))
                row = dict(batch=batch, method=name, k=k, **row,
                           matches_no_speculation=tokens == reference,
                           # Positions equal to the run without speculation (greedy; in
                           # bf16 a verify step's products may round differently).
                           token_agreement=round(same / max(1, sum(map(len, reference))), 4),
                           sequences_identical=sum(x == y for x, y in zip(tokens, reference)))
                results.append(row)
                print(json.dumps(row), flush=True)
    config = {**vars(args), "out": portable_path(args.out) if args.out else None}
    report = dict(benchmark="drafters", commit=git_commit(), torch=torch.__version__,
                  device=torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.machine(),
                  args=config, **meta, results=results)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
