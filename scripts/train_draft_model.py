"""Train the default model's draft model: a 3-layer hybrid distilled from the default model.

The draft model proposes tokens that the default model (the *teacher* here, the target
when serving) verifies, so what it should learn is the default model's next-token
distribution, not the corpus': the loss is the forward KL divergence
``KL(p_teacher || q_draft)`` at temperature 1 over the whole vocabulary, on windows of the
train split, with the teacher's logits computed on the fly (no cache). Greedy acceptance
is the rate at which the draft's argmax equals the teacher's, and full-distribution
targets carry far more of that per token than one-hot next tokens; on one CPU thread the
teacher forward costs about 60% of a step, which this trades for the better target.

Architecture: transformers' ``GraniteMoeHybridForCausalLM`` (the default model's class,
so the engine loads it as it loads the default model), layers ``mamba attention mamba``,
hidden 128, dense SwiGLU MLP 320, Mamba2 with 4 heads of 64 and state 64, attention 2
query heads and 1 KV head of 64 with no positional encoding, embeddings tied with the
output head: 1.18M parameters. The tokenizer and vocabulary (4,096 ids) are the default
model's. The embedding matrix starts as the teacher's projected on its 128 leading
principal directions (``--init-embeddings pca``): the output head is tied to it, so the
draft starts in the teacher's output space; everything else uses transformers' init.

Data: the ``train`` files of the default model's ``data_manifest.json``, read from this
interpreter's standard library, checked against the manifest's split sha256 (a
mismatch aborts: on another Python patch release the corpus differs), tokenized with the
shipped tokenizer into the manifest's stream format ``EOS f1 EOS ... fN EOS``. Each step
draws ``--batch`` windows of ``--ctx + 1`` tokens at uniformly random offsets (seeded).
The ``dev`` split is scored (KL to the teacher, cross-entropy, and the rate at which the
draft's argmax equals the teacher's) at every ``--eval-every`` steps and at the end on
``--dev-windows`` fixed windows; the val split is never read here.

Unless ``--steps`` is given, the step count is planned at step 10 from the measured step
time to fit ``--time-budget`` seconds; the log records it and ``--steps N`` replays it.
Everything runs on the CPU in float32 with ``torch.set_num_threads(--threads)``.

Outputs in ``--out`` (default: the shipped folder ``hybridserve/default_model/draft``):
``config.json``, ``generation_config.json``, ``model.safetensors`` (bf16, by
``save_pretrained``), the tokenizer files (copied from the default model, so the folder
is a complete checkpoint) and ``metrics.json`` (configuration, loss curve, dev results).

Usage: ``python scripts/train_draft_model.py [--time-budget 2400] [--steps N] [--out DIR]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import shutil
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from train_default_model import finalize

REPO = Path(__file__).resolve().parent.parent
TEACHER_DIR = REPO / "hybridserve" / "default_model"
DEFAULT_OUT = TEACHER_DIR / "draft"
LAYER_TYPES = ("mamba", "attention", "mamba")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class CorpusMismatch(RuntimeError):
    """The local standard library is not the corpus of the manifest."""


def build_config(teacher_config) -> transformers.GraniteMoeHybridConfig:
    """The draft model's architecture; the only place it is defined."""
    return transformers.GraniteMoeHybridConfig(
        vocab_size=teacher_config.vocab_size,
        hidden_size=128,
        intermediate_size=320,
        shared_intermediate_size=320,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES),
        num_attention_heads=2,
        num_key_value_heads=1,
        position_embedding_type="nope",
        max_position_embeddings=teacher_config.max_position_embeddings,
        num_local_experts=0,
        num_experts_per_tok=0,
        mamba_n_heads=4,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=64,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=128,
        tie_word_embeddings=True,
        bos_token_id=teacher_config.bos_token_id,
        eos_token_id=teacher_config.eos_token_id,
        pad_token_id=teacher_config.pad_token_id,
    )


def split_stream(tokenizer, split: str, manifest: dict) -> torch.Tensor:
    """The token stream of one manifest split, rebuilt from the local standard library.

    Raises :class:`CorpusMismatch` when a file is missing or the split's sha256 (of the
    files' contents concatenated in manifest order) differs from the manifest's.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    digest = hashlib.sha256()
    texts = []
    for rel, file_split in manifest["files"]:
        if file_split != split:
            continue
        try:
            raw = (root / rel).read_bytes()
        except OSError as exc:
            raise CorpusMismatch(f"{split} file missing: {rel}") from exc
        digest.update(raw)
        texts.append(raw.decode("utf-8"))
    if digest.hexdigest() != manifest["splits"][split]["sha256"]:
        raise CorpusMismatch(
            f"the {split} files differ from the manifest's (Python {manifest['python_version']}; "
            f"this is {platform.python_version()})"
        )
    eos = tokenizer.eos_token_id
    ids = [eos]
    for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    stream = torch.tensor(ids, dtype=torch.int64)
    expected = manifest["splits"][split]["tokens"]
    if stream.numel() != expected:
        raise CorpusMismatch(f"the {split} stream has {stream.numel()} tokens, the manifest {expected}")
    return stream


def pca_embeddings(teacher_embed: torch.Tensor, dim: int) -> torch.Tensor:
    """``teacher_embed [V, H]`` projected on its ``dim`` leading principal directions
    (centred), rescaled to the teacher's mean row norm."""
    centred = teacher_embed - teacher_embed.mean(0, keepdim=True)
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)
    proj = centred @ vh[:dim].T
    return proj * (teacher_embed.norm(dim=1).mean() / proj.norm(dim=1).mean())


def lr_at(step: int, steps: int, warmup: int, peak: float, floor_frac: float) -> float:
    """Linear warm-up, then cosine decay from ``peak`` to ``floor_frac * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (floor_frac + (1 - floor_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of ``KL(softmax(teacher) || softmax(student))`` in nats."""
    logq = F.log_softmax(student_logits.float(), -1).flatten(0, -2)
    logp = F.log_softmax(teacher_logits.float(), -1).flatten(0, -2)
    return F.kl_div(logq, logp, log_target=True, reduction="batchmean")


@torch.no_grad()
def dev_scores(student, teacher, windows: torch.Tensor, batch: int) -> dict:
    """KL to the teacher, cross-entropy of the true next tokens (nats/token), and the
    share of positions where the draft's argmax is the teacher's, over ``windows``."""
    student.eval()
    kl = ce = agree = 0.0
    n = 0
    for i in range(0, windows.shape[0], batch):
        chunk = windows[i : i + batch]
        inputs, targets = chunk[:, :-1], chunk[:, 1:]
        s = student(input_ids=inputs, use_cache=False).logits.float()
        t = teacher(input_ids=inputs, use_cache=False).logits.float()
        count = targets.numel()
        kl += distill_loss(s, t).item() * count
        ce += F.cross_entropy(s.flatten(0, 1), targets.flatten()).item() * count
        agree += (s.argmax(-1) == t.argmax(-1)).sum().item()
        n += count
    student.train()
    return {"kl": round(kl / n, 4), "ce": round(ce / n, 4), "top1_agreement": round(agree / n, 4),
            "tokens": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--floor-frac", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=None, help="replay a planned step count")
    ap.add_argument("--time-budget", type=float, default=2400.0, help="seconds of training")
    ap.add_argument("--eval-every", type=int, default=150)
    ap.add_argument("--dev-windows", type=int, default=16)
    ap.add_argument("--init-embeddings", choices=("pca", "random"), default="pca")
    ap.add_argument("--log-every", type=int, default=10)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    transformers.logging.set_verbosity_error()
    tokenizer = transformers.AutoTokenizer.from_pretrained(TEACHER_DIR)
    teacher = transformers.AutoModelForCausalLM.from_pretrained(TEACHER_DIR, dtype=torch.float32).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    manifest = json.loads((TEACHER_DIR / "data_manifest.json").read_text())
    train = split_stream(tokenizer, "train", manifest)
    dev = split_stream(tokenizer, "dev", manifest)
    dev_windows = torch.stack([dev[i * args.ctx : i * args.ctx + args.ctx + 1]
                               for i in range(args.dev_windows)])

    config = build_config(teacher.config)
    student = transformers.GraniteMoeHybridForCausalLM(config)
    if args.init_embeddings == "pca":
        with torch.no_grad():
            student.model.embed_tokens.weight.copy_(
                pca_embeddings(teacher.model.embed_tokens.weight, config.hidden_size))
    student.train()
    params = sum(p.numel() for p in student.parameters())
    decay = [p for p in student.parameters() if p.ndim >= 2]
    no_decay = [p for p in student.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    print(f"draft {params} params; train {train.numel()} tokens; dev {dev_windows.numel()} tokens",
          flush=True)

    steps = args.steps
    planned_at = None
    curve: list[list] = []
    evals: list[dict] = []
    start = time.perf_counter()
    calib_start = None
    step = 0
    while steps is None or step < steps:
        if steps is None and step == 2:
            calib_start = time.perf_counter()
        if steps is None and step == 10:
            per_step = (time.perf_counter() - calib_start) / 8
            steps = step + int(max(0.0, args.time_budget - (time.perf_counter() - start)) / per_step)
            planned_at = step
            print(f"planned {steps} steps at {per_step:.2f} s/step", flush=True)
        lr = lr_at(step, steps or 10**9, args.warmup, args.lr, args.floor_frac)
        for group in opt.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, train.numel() - args.ctx - 1, (args.batch,), generator=gen)
        chunk = torch.stack([train[o : o + args.ctx + 1] for o in offsets.tolist()])
        inputs = chunk[:, :-1]
        with torch.no_grad():
            t_logits = teacher(input_ids=inputs, use_cache=False).logits
        loss = distill_loss(student(input_ids=inputs, use_cache=False).logits, t_logits)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0:
            curve.append([step, round(loss.item(), 4)])
            print(f"step {step} kl {loss.item():.4f} lr {lr:.2e} "
                  f"{time.perf_counter() - start:.0f}s", flush=True)
        step += 1
        if step % args.eval_every == 0 and step < steps:
            evals.append({"step": step, **dev_scores(student, teacher, dev_windows, args.batch)})
            print(json.dumps(evals[-1]), flush=True)
    train_time = time.perf_counter() - start
    evals.append({"step": step, **dev_scores(student, teacher, dev_windows, args.batch)})
    print(json.dumps(evals[-1]), flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    student.to(torch.bfloat16).save_pretrained(args.out)
    finalize(args.out)  # the default model's config spelling (layer types, no time_step_limit)
    for name in TOKENIZER_FILES:
        shutil.copyfile(TEACHER_DIR / name, args.out / name)
    metrics = {
        "train": {
            "hardware": f"CPU, {args.threads} thread(s)",
            "software": f"transformers {transformers.__version__}, torch {torch.__version__}",
            "params": params,
            "layer_types": list(LAYER_TYPES),
            "teacher": "hybridserve/default_model",
            "objective": "forward KL(teacher || draft), temperature 1, full vocabulary, "
                         "teacher logits on the fly",
            "data": f"train split of data_manifest.json ({train.numel()} tokens), random windows",
            "seed": args.seed,
            "batch_sequences": args.batch,
            "ctx": args.ctx,
            "optimizer": f"AdamW betas (0.9, 0.95), weight decay {args.weight_decay} on matrices, "
                         "grad clip 1.0",
            "lr_schedule": f"linear warm-up {args.warmup} steps to {args.lr}, cosine to "
                           f"{args.floor_frac:.0%} over {steps} steps",
            "init_embeddings": args.init_embeddings,
            "steps": steps,
            "planned_at_step": planned_at,
            "tokens_seen": steps * args.batch * args.ctx,
            "train_time_s": round(train_time, 1),
            "loss_curve": curve,
            "dev_evals": evals,
            "command": f"train_draft_model.py --steps {steps}"
                       + ("" if args.init_embeddings == "pca" else " --init-embeddings random"),
        },
    }
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(f"saved to {args.out} after {train_time:.0f}s", flush=True)


if __name__ == "__main__":
    main()
