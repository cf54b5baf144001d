"""Train the embedded default model: a small Granite 4.0-H style hybrid on stdlib Python.

The model is transformers' own ``GraniteMoeHybridForCausalLM`` with no routed experts
(``num_local_experts = 0``: every layer's MLP is the dense ``shared_mlp``), so the saved
checkpoint is a Hugging Face checkpoint by construction. Eight Mamba2 layers and two
attention layers (no positional encoding in attention, as in Granite 4.0-H: the Mamba
layers carry position), hidden size 256, tied embeddings, about 9.3M parameters.

Data: ``.data/{train,dev}.bin`` from ``scripts/prepare_default_data.py``. Each step draws
``batch`` windows of ``ctx + 1`` tokens at uniformly random offsets of the train stream
(seeded). The dev split (held out from training, distinct from the validation split) is
scored every ``--eval-every`` steps; the weights with the lowest dev loss are the ones
saved, so the validation split is never looked at during training.

Unless ``--steps`` is given, the step count is planned once, at step 30, from the measured
step time so that training fits ``--time-budget``; the log records it, and passing it as
``--steps`` replays the same schedule.

``--scan`` picks how the Mamba2 layers' SSD runs in training: ``torch`` (default)
leaves transformers' PyTorch path as it is; ``fla`` routes it through fla-core's
``chunk_simple_gla`` (``scripts/fast_mamba_train.py``, CUDA and fla-core needed) and
``reference`` through that module's plain torch scan (a CPU check of the patch). With
``fla`` or ``reference`` the first training batch is scored by both paths before training
(:func:`scan_self_check`), and the run aborts if they disagree. fla-core 0.6.0 refuses
the backward of its gated scan under Triton 3.4 to 3.7.0 on Hopper GPUs (a known wrong
result in those Triton releases), so ``fla`` needs Triton 3.7.1 or later there.

Outputs in ``--out``: ``config.json``, ``generation_config.json``, bf16 safetensors
shards, ``train_log.json``. ``--finalize`` then turns that folder into the shipped
layout (one ``model.safetensors``, Granite's layer-type names).

Usage: ``python scripts/train_default_model.py --out OUT --compile [--time-budget 400]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

REPO = Path(__file__).resolve().parent.parent
NUM_LAYERS = 10
ATTENTION_LAYERS = (3, 7)


def build_config(vocab_size: int, eos_id: int, pad_id: int, ctx: int) -> GraniteMoeHybridConfig:
    """The default model's architecture; the only place it is defined."""
    layer_types = ["attention" if i in ATTENTION_LAYERS else "mamba" for i in range(NUM_LAYERS)]
    return GraniteMoeHybridConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=576,
        shared_intermediate_size=576,
        num_hidden_layers=NUM_LAYERS,
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        position_embedding_type="nope",
        max_position_embeddings=ctx,
        num_local_experts=0,
        num_experts_per_tok=0,
        mamba_n_heads=8,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=64,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=128,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )


def add_dropout(model, p: float) -> None:
    """Dropout on every mixer's and MLP's output, before it joins the residual stream.

    transformers' Granite 4.0-H layers have no hidden dropout; with about five passes
    over a corpus this small the train loss keeps falling while the dev loss flattens,
    so the runs that regularise add it through forward hooks (training mode only; the
    saved checkpoint is unchanged by them).
    """
    if p <= 0:
        return

    def hook(module, inputs, output):
        if isinstance(output, tuple):  # attention returns (output, weights)
            return (F.dropout(output[0], p, module.training),) + tuple(output[1:])
        return F.dropout(output, p, module.training)

    for layer in model.model.layers:
        mixer = layer.mamba if layer.mamba is not None else layer.self_attn
        mixer.register_forward_hook(hook)
        layer.shared_mlp.register_forward_hook(hook)


def load_stream(path: Path, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64)).to(device)


def lr_at(step: int, steps: int, warmup: int, peak: float, floor_frac: float) -> float:
    """Linear warm-up, then cosine decay from ``peak`` to ``floor_frac * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (floor_frac + (1 - floor_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def next_token_loss(model, tokens: torch.Tensor, use_cache: bool | None = None) -> torch.Tensor:
    """Mean cross-entropy (nats) of ``tokens[:, 1:]`` given ``tokens[:, :-1]``.

    ``use_cache=None`` is transformers' default (it builds a cache it never reads back);
    the patched mixers of ``--scan fla`` need ``False``.
    """
    logits = model(input_ids=tokens[:, :-1], use_cache=use_cache).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@torch.no_grad()
def stream_loss(
    model, stream: torch.Tensor, ctx: int, batch: int, max_windows: int | None,
    use_cache: bool | None = None,
) -> float:
    """Mean loss over non-overlapping windows (stride ``ctx``) of a held-out stream."""
    n = (stream.numel() - 1) // ctx
    if max_windows is not None:
        n = min(n, max_windows)
    windows = torch.stack([stream[i * ctx : i * ctx + ctx + 1] for i in range(n)])
    total = 0.0
    model.eval()
    for i in range(0, n, batch):
        chunk = windows[i : i + batch]
        with torch.autocast(stream.device.type, dtype=torch.bfloat16):
            total += next_token_loss(model, chunk, use_cache).item() * chunk.shape[0]
    model.train()
    return total / n


def load_fast_mamba_train():
    """``scripts/fast_mamba_train.py`` by path (``scripts`` is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "fast_mamba_train", Path(__file__).resolve().parent / "fast_mamba_train.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


SELF_CHECK_LOSS_RTOL = 2e-2
SELF_CHECK_MIN_GRAD_COSINE = 0.98


def scan_self_check(model, tokens: torch.Tensor, fast, scan) -> dict:
    """Patch ``model``'s Mamba mixers with ``scan`` after checking them against transformers.

    Scores ``tokens`` (the first training batch) with transformers' own path and then with
    the patched one: same weights, bf16 autocast as in training, eval mode (so dropout
    draws nothing and the run's random stream is untouched). The losses must agree to
    ``SELF_CHECK_LOSS_RTOL`` (relative) and the gradients of all parameters, flattened,
    must have a cosine of at least ``SELF_CHECK_MIN_GRAD_COSINE`` (a wrong backward can
    leave the loss right); otherwise the run stops with SystemExit. Leaves the model
    patched, in training mode, with no gradients. Returns the measured numbers.
    """
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_and_grad(use_cache):
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
            loss = next_token_loss(model, tokens, use_cache)
        loss.backward()
        # float64: a float32 cosine over ~10M entries is off by more than the check's margin.
        grad = torch.cat([p.grad.detach().double().flatten() for p in params])
        model.zero_grad(set_to_none=True)
        return loss.item(), grad

    model.eval()
    ref_loss, ref_grad = loss_and_grad(None)
    fast.patch_mamba_mixers(model, scan)
    loss, grad = loss_and_grad(False)
    model.train()
    rel = abs(loss - ref_loss) / abs(ref_loss)
    cosine = F.cosine_similarity(grad, ref_grad, dim=0).item()
    result = {"reference_loss": ref_loss, "loss": loss, "loss_rel_diff": rel,
              "grad_cosine": cosine, "grad_norm_ratio": (grad.norm() / ref_grad.norm()).item()}
    print(f"scan self-check: transformers loss {ref_loss:.5f}, patched {loss:.5f} "
          f"(rel {rel:.2e}), gradient cosine {cosine:.5f}", flush=True)
    if not rel <= SELF_CHECK_LOSS_RTOL or not cosine >= SELF_CHECK_MIN_GRAD_COSINE:
        raise SystemExit(
            f"scan self-check failed: the patched Mamba mixers disagree with transformers on "
            f"the first batch (loss {loss:.5f} vs {ref_loss:.5f}, relative difference "
            f"{rel:.2e} > {SELF_CHECK_LOSS_RTOL:g}, or gradient cosine {cosine:.5f} < "
            f"{SELF_CHECK_MIN_GRAD_COSINE:g}); not training with it"
        )
    return result


def plan_steps(args, step: int, train_time: float, calib_time: float, calib_steps: int) -> int:
    """Total steps that fit ``--time-budget`` at the measured post-warm-up step time."""
    per_step = calib_time / calib_steps
    return step + 1 + int(max(0.0, args.time_budget - train_time) / per_step)


def finalize(out: Path) -> None:
    """Turn a training output folder into the shipped layout, in place.

    Merges the safetensors shards (written small so each can travel on its own) into
    one ``model.safetensors``, and writes the layer types with the names Granite 4.0-H
    checkpoints use (``mamba`` / ``attention``), which every transformers 5 release
    reads. ``time_step_limit`` is dropped: it is the default ``(0, inf)``, and newer
    transformers would store the infinity as a tagged object other readers reject.
    """
    from safetensors.torch import load_file, save_file

    index_path = out / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(index["weight_map"].values())):
            tensors.update(load_file(out / shard))
            (out / shard).unlink()
        save_file(dict(sorted(tensors.items())), out / "model.safetensors", metadata={"format": "pt"})
        index_path.unlink()
    config = json.loads((out / "config.json").read_text())
    names = {"linear_attention": "mamba", "full_attention": "attention"}
    config["layer_types"] = [names.get(t, t) for t in config["layer_types"]]
    limit = config.pop("time_step_limit", None)
    if limit is not None and (limit[0] != 0.0 or not isinstance(limit[1], dict)):
        raise ValueError(f"unexpected time_step_limit {limit}")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=REPO / ".data")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=None,
                        help="total optimizer steps (cosine horizon); default: fit --time-budget")
    parser.add_argument("--time-budget", type=float, default=400.0,
                        help="seconds of training to plan the step count for, when --steps "
                             "is not given; measured over steps 10..30")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="dropout on mixer and MLP outputs (see add_dropout)")
    parser.add_argument("--function-docs", action="store_true",
                        help="also train on .data/train_functions.bin (the train split's "
                             "functions as documents of their own)")
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--dev-windows", type=int, default=None,
                        help="score only this many dev windows (default: all)")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--scan", choices=("torch", "fla", "reference"), default="torch",
                        help="the Mamba2 SSD in training: transformers' PyTorch path (torch), "
                             "fla-core's chunk_simple_gla (fla; CUDA), or the patched mixer "
                             "with a plain torch scan (reference; a CPU check of the patch)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--finalize", action="store_true",
                        help="only rewrite an existing --out folder into the shipped layout")
    args = parser.parse_args()
    if args.finalize:
        finalize(args.out)
        return

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    meta = json.loads((args.data / "meta.json").read_text())
    train = load_stream(args.data / "train.bin", device)
    if args.function_docs:
        # The train split's functions as documents of their own, after its files.
        train = torch.cat([train, load_stream(args.data / "train_functions.bin", device)])
    dev = load_stream(args.data / "dev.bin", device)

    config = build_config(meta["vocab_size"], meta["eos_id"], meta["pad_id"], args.ctx)
    model = GraniteMoeHybridForCausalLM(config).to(device)
    assert all(layer.block_sparse_moe is None for layer in model.model.layers)
    add_dropout(model, args.dropout)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"transformers {transformers.__version__} torch {torch.__version__} "
          f"params {num_params} train tokens {train.numel()}", flush=True)

    # No weight decay on norms, biases and the SSM's per-head scalars (A_log, D, dt_bias).
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True,
    )
    span = args.ctx + 1
    offsets_range = train.numel() - span
    arange = torch.arange(span, device=device)
    log: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "params": num_params,
                 "transformers": transformers.__version__, "torch": torch.__version__,
                 "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "scan": args.scan, "steps": [], "evals": []}

    # None: transformers' default call, unchanged; the patched mixers refuse its cache.
    use_cache = None
    if args.scan != "torch":
        fast = load_fast_mamba_train()
        scan = fast.fla_scan if args.scan == "fla" else fast.reference_scan
        # The first training batch, drawn from a generator of its own with the same seed,
        # so the run's batches are the same as without the check.
        first_gen = torch.Generator(device=device).manual_seed(args.seed)
        first = train[torch.randint(0, offsets_range, (args.batch, 1), device=device,
                                    generator=first_gen) + arange]
        # Patches the model (before compiling) once it has passed.
        log["scan_check"] = scan_self_check(model, first, fast, scan)
        use_cache = False
    step_fn = torch.compile(next_token_loss) if args.compile else next_token_loss

    gen = torch.Generator(device=device).manual_seed(args.seed)
    # The warm-up ramp does not depend on the total, so planning the total at step 30
    # leaves the run identical to one started with --steps set to the planned value.
    steps = args.steps if args.steps is not None else 10**9
    best = (float("inf"), -1, None)
    wall_start = time.perf_counter()
    eval_time = 0.0
    calib_start = 0.0
    model.train()
    step = 0
    while step < steps:
        lr = lr_at(step, steps, args.warmup, args.lr, 0.1)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, offsets_range, (args.batch, 1), device=device, generator=gen)
        tokens = train[starts + arange]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = step_fn(model, tokens, use_cache)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps - 1:
            loss_v = loss.item()  # synchronizes, so the times below are device times
            train_time = time.perf_counter() - wall_start - eval_time
            log["steps"].append({"step": step, "loss": loss_v, "lr": lr,
                                 "grad_norm": grad_norm.item(), "time_s": round(train_time, 2)})
            if step % 50 == 0:
                print(f"step {step} loss {loss_v:.4f} lr {lr:.2e} t {train_time:.1f}s", flush=True)
            if step == 10:
                calib_start = train_time
            if step == 30 and args.steps is None:
                steps = plan_steps(args, step, train_time, train_time - calib_start, 20)
                log["planned_steps"] = steps
                print(f"planned {steps} steps", flush=True)
        step += 1
        if step % args.eval_every == 0 or step == steps:
            t0 = time.perf_counter()
            dev_loss = stream_loss(model, dev, args.ctx, 32, args.dev_windows, use_cache)
            eval_time += time.perf_counter() - t0
            log["evals"].append({"step": step, "dev_loss": dev_loss,
                                 "tokens_seen": step * args.batch * args.ctx})
            print(f"eval step {step} dev {dev_loss:.4f}", flush=True)
            if dev_loss < best[0]:
                state = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
                best = (dev_loss, step, state)
    log["train_time_s"] = time.perf_counter() - wall_start - eval_time
    log["eval_time_s"] = eval_time
    log["steps_done"] = step
    log["tokens_seen"] = step * args.batch * args.ctx
    log["best_dev_loss"], log["best_step"] = best[0], best[1]

    model.load_state_dict(best[2])
    model = model.to(torch.bfloat16)
    args.out.mkdir(parents=True, exist_ok=True)
    # Shards under 16 MB each, merged again by --finalize.
    model.save_pretrained(args.out, max_shard_size="12MB")
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"done: {step} steps, {log['train_time_s']:.1f}s, best dev {best[0]:.4f} at {best[1]}")


if __name__ == "__main__":
    main()
