"""Tokens per second and acceptance with each drafter (none, n-gram, MTP, draft model).

The targets:

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
- ``--target 8b``: the random-weight Nemotron-H-8B-shaped model of ``bench_gpu.py``
  (``NEMOTRON_8B``: 52 layers, d_model 4096, vocab 131072; built in memory, nothing
  downloaded nor written but its ``config.json``; ``--smoke``: ``bench_gpu.TINY``, the
  same layer kinds at d_model 64), bf16 on CUDA, with no speculation, the n-gram
  drafter, and the target as its own draft model (``draft_model=target``: every draft
  is accepted, the verify path's ceiling); ``--methods draft_model=other`` adds another
  random model of the shape (other weights) as draft model, whose drafts are rejected:
  every verify step rolls the target's state back. ``LLM`` and the draft model both
  take the built model's weights (:func:`make_llm`): one copy of the weights, the
  draft model's KV blocks and state pages its own. With random weights the n-gram
  drafter proposes only where the context repeats itself: ``--prompts`` prompts are
  drawn once (:func:`random_prompts`: random ids alternating with a repeated 8-token
  motif, each its own, so that it has matches to propose from), and the rows at batch
  ``b`` run the first ``max(b, 2)`` of them: ``b`` requests in flight from the first
  step (at batch 1, one of each kind after the other). ``--layers`` (``M``, ``A``,
  ``-``) and ``--vocab`` change the shape's depth and vocabulary: the 8B width at a
  depth the CPU runs (``--layers MMA- --vocab 32768``:
  ``drafters_8b_width_cpu_divergence.json``). A random model does not continue the motif
  (on the smoke shape 0.6% of its drafts were accepted), so the n-gram row measures
  the cost of drafting and of verifying rejected drafts; ``--target default`` gives
  its real acceptance. At batch 64 the row of the target as draft holds about 106 GiB
  (15 GiB of weights, 520 target state pages and 429 draft-model pages of 97 MiB: the
  recurrent states in float32; a second copy of the weights would add 15 GiB). On an
  H200, ``--batch 1 16 64 --k 3 --prompts 64 --max-tokens 64`` took 56 s with drafter
  graphs on (``drafters_8b_h200.json``), most of it the first rows' kernel compiles and
  each row's graph captures.

Every row runs its prompts through one ``LLM`` at the given batch (``max_num_seqs``),
greedy, once to warm up and once timed, and checks its outputs against no speculation
(``matches_no_speculation``, ``token_agreement``, ``sequences_identical``).
``--temperature T`` samples instead (one seed per prompt, the same in every row): the
outputs then follow the target's distribution, not its tokens, so the three checks are
left out (None) and the rows measure speculative sampling's acceptance and speed. Per row: ``acceptance_rate`` =
accepted / drafted tokens; ``accepted_per_verify_step`` = accepted drafts per target row
that carried drafts; ``tokens_per_verify_step`` = 1 + that; ``tokens_per_target_step`` =
generated tokens / target rows that emitted them (steps without drafts included);
``drafter_share`` = the drafter's seconds over the timed run's; ``draft_weights_shared``
(draft-model rows) whether the draft model's parameters are the target's tensors.
``--dtype`` takes several: each dtype's rows in turn (one model of the same weights per
dtype), each row naming its ``dtype``.

Greedy rows get a ``divergence`` section (:mod:`divergence`), telling rounding from a
defect where a row's tokens differ from no speculation's: its ``token_agreement`` beside
``baseline_agreement``, the same prompts without speculation at ``--baseline-batch``
(1) against no speculation at the row's batch (the batch's composition alone; the no
speculation row holds the full ``baseline`` comparison); and, at each request's first
divergent position, the gap between the two tokens' logits in a precise forward of the
same weights from the common prefix (``--reference-dtype``: float64 on the CPU, float32
on CUDA; a converted copy of the weights, made once a batch's rows have run), in units
of the logits' standard deviation, next to the top-1 / top-2 gap over every position
(``reference``). Rounding parts runs at near-ties (small gaps, low ``gap_percentile``,
the precise forward picking either run's token); a defect at any gap. ``--no-warm-up``
runs each row once (for divergence runs, whose times do not matter).

    python benchmarks/bench_drafters.py --target default --k 1 3 5 --batch 32 \
        --methods ngram draft_model --out benchmarks/results/drafters_trained_cpu.json
    python benchmarks/bench_drafters.py --target default --device cuda --dtype bfloat16 \
        --k 3 --batch 1 16 64 --prompts 64 --out drafters_trained_h200.json
    python benchmarks/bench_drafters.py --device cuda --hidden 1024 --layers MMMAMMMA \
        --batch 1 16 64 --out drafters.json
    python benchmarks/bench_drafters.py --target nemotron --device cuda --dtype bfloat16 \
        --hidden 1024 --layers MEMAMEMA --batch 1 16 64 --out drafters_nemotron_h200.json
    python benchmarks/bench_drafters.py --target 8b --device cuda --dtype bfloat16 \
        --batch 1 16 64 --k 3 --prompts 64 --max-tokens 64 \
        --out benchmarks/results/drafters_8b_h200.json
    python benchmarks/bench_drafters.py --target 8b --layers MMA- --vocab 32768 \
        --dtype bfloat16 float32 --batch 1 16 --k 3 --prompts 16 --prompt-len 32 \
        --max-tokens 24 --methods ngram draft_model=target --no-warm-up \
        --out benchmarks/results/drafters_8b_width_cpu_divergence.json

The report records the commit, the device, torch / triton / Python versions and the
arguments; with ``--out`` it is rewritten after every row (``wall_s``: seconds so far),
so a run stopped early keeps the rows it measured.
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
from divergence import agreement, model_logits  # noqa: E402
from provenance import git_commit, portable_path, result_writer  # noqa: E402


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


def random_prompts(rng: random.Random, batch: int, length: int, vocab: int = 4096) -> list[list[int]]:
    """Half random ids, half a repeated 8-token motif (something for the n-gram drafter),
    each its own motif (no two prompts alike: each is a sample of the divergence
    figures): ids in ``[3, vocab)``, the random ones at even indices."""
    prompts = []
    for i in range(batch):
        if i % 2:
            motif = [rng.randrange(3, vocab) for _ in range(8)]
            prompts.append((motif * (length // 8 + 1))[:length])
        else:
            prompts.append([rng.randrange(3, vocab) for _ in range(length)])
    return prompts


LAYER_CODES = {"M": "M", "A": "*", "-": "-"}


def shape_8b(args) -> dict:
    """The ``--target 8b`` shape: ``bench_gpu.NEMOTRON_8B`` (``TINY`` under ``--smoke``),
    with ``--layers`` (codes ``M`` Mamba2, ``A`` attention, ``-`` MLP) as its layer
    pattern and ``--vocab`` as its vocabulary where given: the 8B width at a depth
    (and vocabulary) the CPU can run."""
    import bench_gpu

    shape = dict(bench_gpu.TINY if args.smoke else bench_gpu.NEMOTRON_8B)
    if args.layers is not None:
        bad = sorted(set(args.layers) - set(LAYER_CODES))
        if bad or not args.layers:
            raise SystemExit(f"--layers {args.layers!r}: the 8b target's codes are M (Mamba2), "
                             "A (attention) and - (MLP)")
        shape["pattern"] = "".join(LAYER_CODES[c] for c in args.layers)
    if args.vocab is not None:
        if args.vocab < 256:
            raise SystemExit(f"--vocab {args.vocab}: give at least 256")
        shape["vocab_size"] = args.vocab
    return shape


def nemotron_8b(root: Path, args, dtype: str):
    """The ``--target 8b`` model: ``bench_gpu``'s random-weight Nemotron-H of
    :func:`shape_8b` built on ``args.device`` in ``dtype`` (the same float32 draws for
    every dtype: a bf16 model's weights are the float32 one's rounded). Returns
    ``(path, model, shape)``: ``path`` holds only its ``config.json`` (``LLM`` and the
    draft model get ``model`` itself: :func:`run_row`)."""
    import bench_gpu

    from hybridserve.config import resolve_dtype

    shape = shape_8b(args)
    model, _, _, path = bench_gpu.build_models(shape, args.device, resolve_dtype(dtype),
                                                root, with_hf=False)
    return path, model, shape


def make_llm(target, spec, args, batch: int, dtype: str, model=None, others=None):
    """An ``LLM`` over ``target`` in ``dtype`` with ``spec`` at ``max_num_seqs=batch``,
    prefix caching off. ``model``: a built model whose ``config.json`` is ``target``'s:
    the target and a draft model of that directory take its weights instead of loading
    them (shared, not copied); ``others`` maps further directories to built models (a
    draft model of its own)."""
    from hybridserve import LLM
    from hybridserve.config import KernelPolicy
    from hybridserve.models import loader

    policy = KernelPolicy(drafter_graphs=args.drafter_graphs, logq_graphs=args.logq_graphs)
    build = dict(dtype=dtype, device=args.device, max_num_seqs=batch,
                 speculative_config=spec, enable_prefix_caching=False, kernel_policy=policy)
    if model is None:
        return LLM(target, **build)
    import bench_gpu

    def policed(m):
        return bench_gpu.with_policy(m, drafter_graphs=args.drafter_graphs,
                                     logq_graphs=args.logq_graphs)

    by_path = {Path(target).resolve(): policed(model)}
    by_path.update({Path(path).resolve(): policed(m) for path, m in (others or {}).items()})
    original = loader.load_model
    loader.load_model = lambda path, *a, **k: by_path[Path(path).resolve()]
    try:
        return LLM(target, **build)
    finally:
        loader.load_model = original


def release_memory(device: str) -> None:
    """Free a dropped engine's caches and graph pools before the next one allocates
    its own (at the 8B shape a row's state pages alone are tens of GiB). On CUDA only:
    the CPU runs (the smoke's tiny models) leave the collector to its own schedule, where
    a full collection a row cost more than the row's decode."""
    import gc

    import torch

    if device.startswith("cuda"):
        gc.collect()
        torch.cuda.empty_cache()


def run_row(target, spec, prompts, params, args, batch: int, model=None,
            dtype: str | None = None, others=None) -> tuple[dict, list[list[int]]]:
    """One ``LLM`` (:func:`make_llm`) with ``spec`` at ``max_num_seqs=batch`` in
    ``dtype`` (default: the first of ``args.dtype``): its measurements and tokens."""
    import torch

    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    llm = make_llm(target, spec, args, batch, dtype or args.dtype[0], model, others)
    # Warm-up: the same workload once, so that kernel compiles and graph captures of this
    # (drafter, batch) land here, not in the timed run.
    if args.warm_up:
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
    if spec is not None and spec["method"] == "draft_model":
        mine, theirs = list(drafter.model.parameters()), list(llm.model.parameters())
        row["draft_weights_shared"] = len(mine) == len(theirs) and all(
            a.data_ptr() == b.data_ptr() for a, b in zip(mine, theirs))
    if cuda:
        # The target's caches, and the draft model's (the target as draft: as many
        # state pages again), with the weights.
        row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del llm
    drafter = graphs = None  # noqa: F841 (the closure's cells: nothing keeps the engine)
    release_memory(args.device)
    return row, tokens


def divergence_sections(batch_runs, logits_fn, reference_dtype: str) -> None:
    """Fill in the ``divergence`` section of every row of ``batch_runs`` (one entry per
    batch of one dtype: its prompts, the no-speculation row and tokens, the baseline's
    tokens or None, and each speculative row with its tokens), against the row without
    speculation of the same batch (:func:`divergence.compare`, one precise forward of
    each request)."""
    from divergence import compare

    for run in batch_runs:
        others = {str(j): tokens for j, (_, tokens) in enumerate(run["rows"])}
        if run["baseline"] is not None:
            others["baseline"] = run["baseline"]
        typical, figures = compare(logits_fn, run["prompts"], run["reference"], others)
        typical = dict(reference_dtype=reference_dtype, **typical)
        base = figures.get("baseline")
        if base is not None:
            base = dict(max_num_seqs=run["baseline_max_num_seqs"], **base)
        run["none"]["divergence"] = dict(baseline=base, reference=typical)
        for j, (row, _) in enumerate(run["rows"]):
            mine = figures[str(j)]
            row["divergence"] = dict(
                against="none", token_agreement=mine.pop("token_agreement"),
                # The same prompts without speculation at another max_num_seqs: how far
                # the batch's composition alone moves the tokens.
                baseline_agreement=base["token_agreement"] if base else None,
                baseline_max_num_seqs=run["baseline_max_num_seqs"] if base else None,
                baseline_gap_percentile_median=base["gap_percentile_median"] if base else None,
                **mine, reference=typical)


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=("random", "nemotron", "default", "8b"), default="random")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", nargs="+", default=None,
                    help="one or more; the rows of each in turn (default: bfloat16 for the "
                         "8b target on CUDA, else float32)")
    ap.add_argument("--hidden", type=int, default=256, help="random target only")
    ap.add_argument("--layers", default=None,
                    help="random and nemotron targets: their layer codes (default MMMA); 8b "
                         "target: its layer pattern in M (Mamba2), A (attention), - (MLP) "
                         "(default: the shape's own)")
    ap.add_argument("--vocab", type=int, default=None, help="8b target only: its vocabulary")
    ap.add_argument("--batch", type=int, nargs="+", default=None,
                    help="max_num_seqs per row (random target: also the number of prompts)")
    ap.add_argument("--k", type=int, nargs="+", default=[3], help="num_speculative_tokens")
    ap.add_argument("--prompts", type=int, default=None,
                    help="default target: held-out prompts (32); 8b target: the prompt set, "
                         "at least the largest batch (the default)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--methods", nargs="+", default=None,
                    help="drafters to run besides none (default: all of the target's)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy, outputs checked against no speculation; > 0: sampled "
                         "with one seed per prompt (speculative sampling)")
    ap.add_argument("--baseline-batch", type=int, default=1,
                    help="greedy: each batch's prompts without speculation at this "
                         "max_num_seqs too, against no speculation at the row's batch")
    ap.add_argument("--reference-dtype", default=None,
                    help="the precise forward of the divergence sections (default: float64 "
                         "on the CPU, float32 on CUDA)")
    ap.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                    help="each row's workload once before the timed run (--no-warm-up: "
                         "for divergence runs, whose times do not matter)")
    ap.add_argument("--logq-graphs", choices=("auto", "on", "off"), default="auto",
                    help="KernelPolicy.logq_graphs: sampled verify steps of a drafter's "
                         "distribution drafts from the target's graphs")
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
        if args.target != "8b":
            args.hidden, args.layers = min(args.hidden, 128), "MAE" if args.target == "nemotron" else "MA"
    if args.dtype is None:
        args.dtype = ["bfloat16" if args.target == "8b" and args.device.startswith("cuda") else "float32"]
    if args.reference_dtype is None:
        args.reference_dtype = "float32" if args.device.startswith("cuda") else "float64"
    if args.target == "8b":
        args.hidden = None  # its shape is bench_gpu's (target_shape)
    else:
        if args.vocab is not None:
            raise SystemExit("--vocab: the 8b target's only")
        args.layers = args.layers or "MMMA"
    if args.prompts is None:
        args.prompts = max(*args.batch, 2) if args.target == "8b" else 32
    if args.target == "8b" and args.prompts < max(*args.batch, 2):
        raise SystemExit(f"--prompts {args.prompts}: the 8b target's rows at batch b run the "
                         f"first max(b, 2) prompts of the set; give at least {max(*args.batch, 2)}")
    if args.baseline_batch < 1:
        raise SystemExit(f"--baseline-batch {args.baseline_batch}: give at least 1")
    if args.target == "8b":
        shape_8b(args)  # bad --layers / --vocab: refused before anything is built

    import torch
    import triton

    from hybridserve import SamplingParams

    results = []
    sampled = args.temperature > 0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            ignore_eos=True)
    meta = {}
    config = {**vars(args), "out": portable_path(args.out) if args.out else None}
    report = dict(benchmark="drafters", commit=git_commit(), torch=torch.__version__,
                  triton=triton.__version__, python=platform.python_version(),
                  device=torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.machine(),
                  args=config)
    save = result_writer(report, Path(args.out), started) if args.out else (lambda: None)
    ngram = {"ngram": lambda k: {"method": "ngram", "num_speculative_tokens": k}}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtype:
            # Every dtype draws the same prompts (and, for the random targets, the same
            # checkpoints).
            torch.manual_seed(0)
            rng = random.Random(0)
            model = others = None
            if args.target == "default":
                from hybridserve.default_model import DRAFT_PATH, PATH

                target = PATH
                prompts, matches = heldout_prompts(args.prompts, args.prompt_len)
                meta = {"corpus_matches_manifest": matches, "draft_model": portable_path(DRAFT_PATH)}
                drafters = {**ngram,
                            "draft_model": lambda k: {"method": "draft_model", "model": "default-draft",
                                                      "num_speculative_tokens": k},
                            "draft_model=target": lambda k: {"method": "draft_model", "model": str(PATH),
                                                             "num_speculative_tokens": k}}
            elif args.target == "8b":
                target, model, shape = nemotron_8b(Path(tmp) / dtype, args, dtype)
                prompt_set = random_prompts(rng, args.prompts, args.prompt_len, shape["vocab_size"])
                meta = {"target_shape": shape,
                        "target_parameters": sum(p.numel() for p in model.parameters())}
                drafters = {**ngram,
                            "draft_model=target": lambda k, t=target: {"method": "draft_model", "model": str(t),
                                                                       "num_speculative_tokens": k}}
                if args.methods and "draft_model=other" in args.methods:
                    # Another random model of the shape (other weights): its drafts are
                    # rejected, so every verify step rolls the target's state back.
                    import bench_gpu

                    other, other_model, _ = nemotron_8b(Path(tmp) / dtype / "other", args, dtype)
                    bench_gpu.randomize_(other_model, seed=1)
                    others = {other: other_model}
                    drafters["draft_model=other"] = lambda k, o=other: {
                        "method": "draft_model", "model": str(o), "num_speculative_tokens": k}
            else:
                arch = "nemotron_h" if args.target == "nemotron" else "qwen3_5"
                target, draft = _checkpoints(Path(tmp) / dtype, args.hidden, args.layers, arch)
                drafters = {**ngram,
                            "mtp": lambda k: {"method": "mtp", "num_speculative_tokens": k},
                            "draft_model": lambda k, d=draft: {"method": "draft_model", "model": str(d),
                                                               "num_speculative_tokens": k},
                            "draft_model=target": lambda k, t=target: {"method": "draft_model", "model": str(t),
                                                                       "num_speculative_tokens": k}}
            report.update(meta, results=results)
            if args.methods:
                unknown = sorted(set(args.methods) - set(drafters))
                if unknown:
                    raise SystemExit(f"--methods: unknown {unknown}; known: {sorted(drafters)}")
                drafters = {name: make for name, make in drafters.items() if name in args.methods}
            for batch in args.batch:
                if args.target == "8b":
                    prompts = prompt_set[:max(batch, 2)]
                elif args.target != "default":
                    prompts = random_prompts(rng, batch, args.prompt_len)
                rows = [("none", None, None)] + [(name, k, make(k)) for k in args.k
                                                 for name, make in drafters.items()]
                run = dict(prompts=prompts, rows=[], baseline=None,
                           baseline_max_num_seqs=args.baseline_batch)
                reference = None
                for name, k, spec in rows:
                    row_params = ([SamplingParams(max_tokens=args.max_tokens,
                                                  temperature=args.temperature, seed=i,
                                                  ignore_eos=True) for i in range(len(prompts))]
                                  if sampled else params)
                    row, tokens = run_row(target, spec, prompts, row_params, args, batch, model, dtype,
                                          others)
                    ref = reference if reference is not None else tokens
                    row = dict(batch=batch, method=name, k=k, dtype=dtype, requests=len(prompts), **row,
                               matches_no_speculation=None if sampled else tokens == ref,
                               # Positions equal to the run without speculation (greedy; in
                               # bf16 a verify step's products may round differently: the
                               # divergence section tells rounding from a defect).
                               token_agreement=None if sampled else agreement(ref, tokens),
                               sequences_identical=None if sampled else sum(
                                   x == y for x, y in zip(tokens, ref)))
                    results.append(row)
                    if reference is None:
                        reference, run["none"], run["reference"] = tokens, row, tokens
                        if not sampled and args.baseline_batch != batch:
                            run["baseline"] = generate_once(target, prompts, params, args,
                                                            args.baseline_batch, dtype, model)
                    else:
                        run["rows"].append((row, tokens))
                    print(json.dumps(row), flush=True)
                    save()
                if not sampled:
                    # Each batch's sections as soon as its rows have run (a later row that
                    # fails keeps them), the engines gone.
                    precise = precise_model(model, target, dtype, args)
                    divergence_sections([run], model_logits(precise), args.reference_dtype)
                    precise = None
                    release_memory(args.device)
                    save()
            model = others = None
            release_memory(args.device)
    save()
    return report


def precise_model(model, target, dtype: str, args):
    """The precise forward's model (``--reference-dtype``) of the same weights: ``model``
    itself where it is in that dtype already, else a converted copy of it (the run's
    rounded weights, computed precisely), or, for the checkpoint targets, the
    checkpoint loaded in ``dtype`` and converted."""
    import torch

    from hybridserve.config import resolve_dtype

    ref = resolve_dtype(args.reference_dtype)
    if model is None:
        from hybridserve.models.loader import load_model

        return load_model(target, dtype=dtype, device=args.device).to(ref)
    if next(model.parameters()).dtype == ref:
        return model
    with torch.device("meta"):
        copy = type(model)(model.config, model.kernel_policy)
    copy.load_state_dict({k: v.to(ref) for k, v in model.state_dict().items()},
                         strict=True, assign=True)
    return copy.eval().requires_grad_(False)


def generate_once(target, prompts, params, args, batch: int, dtype: str, model=None):
    """The tokens of ``prompts`` without speculation at ``max_num_seqs=batch`` (one
    untimed run: the divergence sections' baseline)."""
    llm = make_llm(target, None, args, batch, dtype, model)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    release_memory(args.device)
    return tokens


if __name__ == "__main__":
    main()
