"""Tokens per second and acceptance with each drafter (none, n-gram, MTP, draft model).

Random checkpoints (built here, nothing downloaded): a Qwen3.5-shaped target with a random
MTP head, a smaller draft model, and the target itself as a draft model (every draft
accepted: the verify path's ceiling). Random weights accept few MTP / small-draft drafts,
so those rows measure the drafters' cost, not a real acceptance. Greedy outputs of every
drafter are checked against no speculation.

    python benchmarks/bench_drafters.py --device cuda --hidden 1024 --layers MMMAMMMA \
        --batch 1 16 64 --out drafters.json
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path


def _checkpoints(root: Path, hidden: int, layers: str) -> tuple[Path, Path]:
    from hybridserve.testing.tiny_models import make_tiny_checkpoint
    from hybridserve.testing.tiny_mtp import add_mtp_head

    heads = max(4, hidden // 64)
    shape = dict(
        hidden_size=hidden, intermediate_size=hidden * 2, num_attention_heads=heads,
        num_key_value_heads=max(2, heads // 4), head_dim=64, linear_num_key_heads=max(2, heads // 2),
        linear_num_value_heads=heads, linear_key_head_dim=64, linear_value_head_dim=64,
        vocab_size=4096,
    )
    target = add_mtp_head(make_tiny_checkpoint("qwen3_5", root / "target", seed=1, layers=layers, **shape))
    draft = make_tiny_checkpoint("qwen3_5", root / "draft", seed=2, layers="MA", **shape)
    return target, draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", default="MMMA")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from hybridserve import LLM, SamplingParams

    torch.manual_seed(0)
    rng = random.Random(0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = _checkpoints(Path(tmp), args.hidden, args.layers)
        methods = {
            "none": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": args.k},
            "mtp": {"method": "mtp", "num_speculative_tokens": args.k},
            "draft_model": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.k},
            "draft_model=target": {"method": "draft_model", "model": str(target),
                                   "num_speculative_tokens": args.k},
        }
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        for batch in args.batch:
            motif = [rng.randrange(3, 4096) for _ in range(8)]
            prompts = [
                (motif * (args.prompt_len // 8))[: args.prompt_len] if i % 2 else
                [rng.randrange(3, 4096) for _ in range(args.prompt_len)]
                for i in range(batch)
            ]
            reference = None
            for name, spec in methods.items():
                llm = LLM(target, dtype=args.dtype, device=args.device, max_num_seqs=max(batch, 1),
                          speculative_config=spec, enable_prefix_caching=False)
                llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm up
                before = dict(llm.stats())
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                tokens = [o.outputs[0].token_ids for o in outs]
                if reference is None:
                    reference = tokens
                s = llm.stats()
                rows = s["spec_verify_rows"] - before.get("spec_verify_rows", 0)
                acc = s["spec_accepted_tokens"] - before.get("spec_accepted_tokens", 0)
                drafted = s["spec_draft_tokens"] - before.get("spec_draft_tokens", 0)
                row = dict(
                    batch=batch, method=name, seconds=round(seconds, 4),
                    tokens_per_s=round(sum(map(len, tokens)) / seconds, 1),
                    draft_tokens=drafted, accepted_tokens=acc,
                    mean_accepted_length=round(1 + acc / rows, 3) if rows else None,
                    drafter_share=round(
                        (s["spec_drafter_seconds"] - before.get("spec_drafter_seconds", 0.0)) / seconds, 3
                    ),
                    matches_no_speculation=tokens == reference,
                )
                results.append(row)
                print(json.dumps(row), flush=True)
                del llm
    if args.out:
        Path(args.out).write_text(json.dumps(dict(args=vars(args), results=results), indent=2))


if __name__ == "__main__":
    main()
