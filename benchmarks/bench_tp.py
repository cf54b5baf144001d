"""Tensor-parallel benchmark: TP=2 against TP=1 on one host (issue 22's two-GPU run).

Sections, each run for every ``--tp`` size (default ``1,2``):

(a) **agreement**: greedy tokens of a tiny random Nemotron-H checkpoint under TP against
    TP=1 in the same dtype (on CUDA: bf16, where summing partial products over ranks
    changes roundings, so agreement is a fraction; on the CPU in float32 they must be
    identical);
(b) **decode**: tokens per second of full-batch decode steps at ``--batches`` (every
    request decoding, prompts of ``--prompt`` tokens) on the Nemotron-H-8B-shaped random
    model (written once as a safetensors checkpoint, so every rank loads its slices
    from disk as in serving), against the byte roofline **of one rank**: the bytes that
    rank must move per step (its weight shard once, its KV heads' blocks of every
    request, its heads' recurrent state read and written) over the device-to-device copy
    bandwidth measured on its GPU in the same run;
(c) **ttft**: time to first token of a ``--ttft-prompt`` prompt whose first
    ``--ttft-cached`` tokens are cached (a checkpoint on the state grid), and cold;
(d) **all-reduce share**: of a decode step at each batch, the time rank 0 spends in the
    forward's all-reduces (timed with a device sync around each, so the timed steps run
    slower than (b)'s: the share is of the timed step) and the all-reduces per step.

Steps run eagerly under TP (decode graphs are not captured with collectives yet), so
TP=1 is measured eagerly too (``enforce_eager``), for a like-for-like ratio; on CUDA the
decode rates of TP=1 with decode graphs (its serving default) are recorded beside them
(``tp1_graphs_decode``).

``--smoke``: the CPU with gloo, a tiny model for every section, TP=1 and 2 (minutes at
most). ``--tp 1``: the one-GPU mode. Writes ``--out`` (JSON).

Issue 22's run (two H200s)::

    python benchmarks/bench_tp.py --device cuda --tp 1,2 --workdir /tmp/tp-bench \
        --out benchmarks/results/tp_h200x2.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_gpu import random_weight  # noqa: E402
from provenance import git_commit, portable_path  # noqa: E402

from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.models.config import ModelConfig  # noqa: E402
from hybridserve.models.registry import model_class  # noqa: E402

NEMOTRON_8B = dict(
    vocab_size=131072, hidden_size=4096, intermediate_size=21504, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, mamba_num_heads=128, mamba_head_dim=64, n_groups=8,
    ssm_state_size=128, conv_kernel=4, chunk_size=128,
    pattern="M-M-M-M*-" * 4 + "M-" * 8,
)
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
    ssm_state_size=16, conv_kernel=4, chunk_size=16, pattern="M-M*-M-",
)


def hf_config(shape: dict):
    import transformers

    kinds = {"M": "mamba", "*": "attention", "-": "mlp"}
    kw = {k: v for k, v in shape.items() if k != "pattern"}
    return transformers.NemotronHConfig(
        architectures=["NemotronHForCausalLM"], layers_block_type=[kinds[c] for c in shape["pattern"]],
        max_position_embeddings=16384, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, **kw,
    )


@torch.no_grad()
def write_checkpoint(shape: dict, path: Path, dtype: torch.dtype, device: str, seed: int = 0) -> Path:
    """A random-weight checkpoint of ``shape`` (Nemotron-H names, ``dtype``) at ``path``,
    generated on ``device`` one tensor at a time, well spread as the tiny test
    checkpoints are (logits of a few units, dt in a realistic range, stable decays)."""

    from safetensors.torch import save_file

    cfg = hf_config(shape)
    cfg.save_pretrained(path)
    mcfg = ModelConfig.from_pretrained(path)
    cls = model_class(mcfg.architecture)
    with torch.device("meta"):
        model = cls(mcfg)
    g = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, p in model.named_parameters():
        r = random_weight(name, p.shape, device, g)
        disk = "backbone." + name[len("model."):] if name.startswith("model.") else name
        state[disk] = r.to(dtype).cpu().contiguous()
    save_file(state, str(path / "model.safetensors"))
    return path


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        if i >= 5:
            times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times)


def rank_step_bytes(model, batch: int, context: int, state_dtype: torch.dtype) -> int:
    """Fewest bytes one rank moves in a decode step: its weight shard once (the
    replicated embedding only for the rows looked up), its KV blocks of every request's
    context read, its state page read and a new one written per request."""
    params = list(model.parameters())
    dtype = params[0].dtype
    elem = params[0].element_size()
    embed = model.model.embed.weight
    weights = sum(p.numel() * p.element_size() for p in params) - embed.numel() * elem
    weights += batch * model.config.hidden_size * elem
    spec = model.cache_spec
    kv = batch * context * spec.kv_block_bytes(1, dtype)
    state = 2 * batch * spec.state_page_bytes(dtype, state_dtype)
    return weights + kv + state


def make_llm(path, tp: int, device: str, dtype: str, enforce_eager: bool | None = True,
             **kw) -> LLM:
    return LLM(str(path), dtype=dtype, device=device, tensor_parallel_size=tp,
               enforce_eager=enforce_eager, **kw)


def agreement(path, tps, device, dtype, prompts: int, new_tokens: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, 256, (int(n),), generator=g).tolist()
           for n in torch.randint(8, 48, (prompts,), generator=g)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = {}
    for tp in tps:
        llm = make_llm(path, tp, device, dtype, max_num_seqs=prompts, max_model_len=256)
        try:
            outs[tp] = [o.outputs[0].token_ids for o in llm.generate(ids, params, use_tqdm=False)]
        finally:
            llm.shutdown()
    base = outs[tps[0]]
    result = {"prompts": prompts, "new_tokens": new_tokens, "dtype": dtype}
    for tp in tps[1:]:
        same = sum(a == b for x, y in zip(base, outs[tp]) for a, b in zip(x, y))
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                 for x, y in zip(base, outs[tp])]
        result[f"tp{tp}"] = {
            "token_agreement": same / (prompts * new_tokens),
            "identical_sequences": sum(f is None for f in first),
            "first_divergence": first,
        }
    return result


def decode(llm: LLM, batch: int, prompt_len: int, warmup: int, steps: int, vocab: int,
           seed: int, time_reduces: bool) -> dict:
    """Median wall time of full-batch decode steps (every request decoding); with
    ``time_reduces``, the same steps again with the all-reduces timed."""
    eng = llm.engine
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=warmup + 2 * steps + 8, ignore_eos=True)
    rids = []
    for i in range(batch):
        rid = f"b{batch}-{i}-{time.monotonic_ns()}"
        eng.add_request(rid, torch.randint(3, vocab, (prompt_len,), generator=g).tolist(),
                        params, final_only=True)
        rids.append(rid)
    sched = eng.scheduler
    for _ in range(100 * batch):
        if not sched.waiting and not any(r.is_prefill for r in sched.running):
            break
        eng.step()
    if sched.waiting or len(sched.running) != batch:
        raise RuntimeError(f"batch {batch} did not fit: {len(sched.running)} running, "
                           f"{len(sched.waiting)} waiting (raise the cache sizes)")
    for _ in range(warmup):
        eng.step()
    device = llm.config.device

    def timed(n):
        out = []
        for _ in range(n):
            sync(device)
            t = time.perf_counter()
            eng.step()
            sync(device)
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    step_s = timed(steps)
    result = {"batch": batch, "step_s": step_s, "tok_per_s": batch / step_s}
    group = getattr(eng.runner, "group", None)
    if time_reduces and group is not None:
        group.timed = True
        group.reduce_seconds, n0 = 0.0, group.num_reduces
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync(device)
        total = time.perf_counter() - t
        group.timed = False
        result["allreduce"] = {
            "share_of_timed_step": group.reduce_seconds / total,
            "timed_step_s": total / steps,
            "allreduce_s_per_step": group.reduce_seconds / steps,
            "allreduces_per_step": (group.num_reduces - n0) / steps,
        }
    for rid in rids:
        eng.abort_request(rid)
    return result


def ttft(llm: LLM, prompt_len: int, cached_len: int, vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    device = llm.config.device

    def run(ids):
        sync(device)
        t = time.perf_counter()
        out = llm.generate([ids], one, use_tqdm=False)[0]
        sync(device)
        return time.perf_counter() - t, out.num_cached_tokens

    def prompt(prefix):
        return prefix + torch.randint(3, vocab, (prompt_len - cached_len,), generator=g).tolist()

    warm = torch.randint(3, vocab, (cached_len,), generator=g).tolist()
    run(prompt(warm))
    run(prompt(warm))
    cold, cached = [], []
    for _ in range(2):
        prefix = torch.randint(3, vocab, (cached_len,), generator=g).tolist()
        llm.reset_prefix_cache()
        cold.append(run(prompt(prefix)))
        cached.append(run(prompt(prefix)))
    return {"prompt": prompt_len, "cached": cached_len,
            "cold_s": statistics.median(t for t, _ in cold),
            "cached_s": statistics.median(t for t, _ in cached),
            "cached_hits": [h for _, h in cached]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU, gloo")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes, the first the baseline")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ttft-prompt", type=int, default=8192)
    ap.add_argument("--ttft-cached", type=int, default=8064)
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where the random checkpoints are written (default: a temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-graphs-baseline", action="store_true",
                    help="skip TP=1 with decode graphs (CUDA only; TP runs eagerly)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/tp.json")
    args = ap.parse_args(argv)
    # NVLink multicast (NVLS) stays off on the shared two-GPU machines; the workers
    # inherit the setting.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.smoke:
        args.device, args.dtype = "cpu", "float32"
        args.batches, args.prompt, args.steps, args.warmup_steps = "1,4", 24, 3, 1
        args.ttft_prompt, args.ttft_cached = 96, 64
        if args.out == ROOT / "benchmarks/results/tp.json":
            args.out = ROOT / "benchmarks/results/tp_smoke.json"
    tps = [int(x) for x in args.tp.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    shape = TINY if args.smoke else NEMOTRON_8B
    dtype = getattr(torch, args.dtype)
    gen_device = "cpu" if args.device == "cpu" else "cuda:0"
    tmp = tempfile.TemporaryDirectory() if args.workdir is None else None
    work = Path(tmp.name) if tmp else args.workdir
    result = {
        "bench": "tp", "commit": git_commit(), "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor() or "cpu",
        "devices": torch.cuda.device_count() if args.device.startswith("cuda") else 0,
        "config": {k: (portable_path(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "shape": shape,
    }
    started = time.perf_counter()
    try:
        tiny = write_checkpoint(TINY, work / "tiny", dtype, gen_device, args.seed)
        result["agreement"] = agreement(tiny, tps, args.device, args.dtype, 8, 32, args.seed)
        print("agreement", json.dumps(result["agreement"]))
        big = work / ("tiny" if args.smoke else "nemotron_8b")
        if not args.smoke and not (big / "model.safetensors").exists():
            t = time.perf_counter()
            write_checkpoint(shape, big, dtype, gen_device, args.seed)
            result["checkpoint_write_s"] = time.perf_counter() - t
        result["copy_bytes_per_s"] = copy_bandwidth(gen_device, 1 << 30 if not args.smoke else 1 << 24)
        longest = max(args.prompt + 2 * args.steps + args.warmup_steps + 16, args.ttft_prompt + 16)
        runs = {}
        for tp in tps:
            bmax = max(batches)
            t = time.perf_counter()
            llm = make_llm(
                big, tp, args.device, args.dtype, max_num_seqs=bmax, max_model_len=longest,
                num_kv_blocks=bmax * (-(-(args.prompt + 2 * args.steps + 32) // 16)) + 8
                + 2 * (-(-longest // 16)),
                num_state_pages=3 * bmax + 48, max_checkpoint_pages=32,
                max_num_batched_tokens=max(8192, bmax), state_interval=64,
            )
            load_s = time.perf_counter() - t
            try:
                rows = []
                for b in batches:
                    row = decode(llm, b, args.prompt, args.warmup_steps, args.steps,
                                 shape["vocab_size"], args.seed, time_reduces=tp > 1)
                    ctx = args.prompt + args.warmup_steps + args.steps
                    need = rank_step_bytes(llm.model, b, ctx, torch.float32)
                    row["rank_bytes_per_step"] = need
                    row["roofline_tok_per_s"] = b * result["copy_bytes_per_s"] / need
                    row["of_roofline"] = row["tok_per_s"] / row["roofline_tok_per_s"]
                    rows.append(row)
                    print(f"tp={tp} batch={b}: {row['tok_per_s']:.1f} tok/s "
                          f"({100 * row['of_roofline']:.0f}% of the rank roofline)"
                          + (f", all-reduce {100 * row['allreduce']['share_of_timed_step']:.0f}%"
                             if "allreduce" in row else ""))
                tt = ttft(llm, args.ttft_prompt, args.ttft_cached, shape["vocab_size"], args.seed)
                print(f"tp={tp} ttft: cold {tt['cold_s'] * 1e3:.1f} ms, cached {tt['cached_s'] * 1e3:.1f} ms")
                if args.device.startswith("cuda"):
                    tt["rank0_peak_gib"] = torch.cuda.max_memory_allocated(0) / 2**30
                runs[tp] = {"load_s": load_s, "decode": rows, "ttft": tt,
                            "rank0_weight_bytes": sum(p.numel() * p.element_size()
                                                      for p in llm.model.parameters())}
            finally:
                llm.shutdown()
                del llm
                gc.collect()  # the engine's caches, before the next engine allocates its own
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
        if args.device.startswith("cuda") and tps[0] == 1 and not args.no_graphs_baseline:
            # The one-GPU engine as it serves by default: decode replayed from CUDA graphs
            # (not available under TP yet), for the cost of running eagerly.
            try:
                llm = make_llm(big, 1, args.device, args.dtype, enforce_eager=None,
                               max_num_seqs=max(batches), max_model_len=longest,
                               num_kv_blocks=max(batches) * (-(-(args.prompt + 2 * args.steps + 32) // 16)) + 8,
                               num_state_pages=3 * max(batches) + 48, max_checkpoint_pages=32,
                               max_num_batched_tokens=max(8192, max(batches)))
                llm.engine.async_scheduling = False
                result["tp1_graphs_decode"] = [
                    decode(llm, b, args.prompt, args.warmup_steps, args.steps,
                           shape["vocab_size"], args.seed, time_reduces=False)
                    for b in batches
                ]
                llm.shutdown()
                del llm
                gc.collect()
                torch.cuda.empty_cache()
            except Exception as e:  # a baseline: the TP results above stand without it
                result["tp1_graphs_error"] = f"{type(e).__name__}: {e}"
        result["runs"] = {str(k): v for k, v in runs.items()}
        base = runs[tps[0]]
        for tp in tps[1:]:
            result.setdefault("speedup", {})[str(tp)] = {
                "decode": {str(a["batch"]): b["tok_per_s"] / a["tok_per_s"]
                           for a, b in zip(base["decode"], runs[tp]["decode"])},
                "ttft_cached": base["ttft"]["cached_s"] / runs[tp]["ttft"]["cached_s"],
            }
    finally:
        result["seconds"] = time.perf_counter() - started
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        if tmp:
            tmp.cleanup()
    print("wrote", args.out)
    if args.smoke:
        # On the CPU in float32 TP must match one rank exactly.
        for tp in tps[1:]:
            if result["agreement"][f"tp{tp}"]["token_agreement"] != 1.0:
                print(f"tp={tp} disagrees with tp={tps[0]} in float32", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
