"""GPU benchmark: decode throughput, time to first token, state postprocess share, bf16 agreement.

One run measures, on a random-weight Nemotron-H-8B-shaped model (52 layers: 24 Mamba2 with
128 heads x 64 x d_state 128 in 8 groups, 4 attention, 24 MLP; d_model 4096; vocab
131072; bf16; built in the script, nothing downloaded):

(a) decode throughput of our engine at several batch sizes (full-batch decode steps only,
    prompts of ``--prompt`` tokens), with decode steps replayed from CUDA graphs and
    eagerly (alternating steps of one engine), against, in the same run: the engine
    with its per-row reference paths (the fast paths off), Hugging Face
    ``transformers``' ``generate`` on the same weights (its torch Mamba path), and the
    roofline: the bytes a decode step must read and write (weights once, every
    request's KV and its recurrent state read plus the new state written) over the
    device-to-device copy bandwidth measured here;
(b) time to first token of a long prompt whose prefix is cached (a checkpoint on the
    state grid) against the same prompt cold;
(c) the share of a decode step spent in the state postprocess;
(d) prefill throughput (``--prefill-prompts`` prompts of ``--prefill-len`` tokens in one
    ``generate``) against the FLOP roofline: 2 x weights x tokens plus the attention
    products, over the bf16 matrix-product rate measured here, and the same batch once
    more under ``torch.profiler`` (``profile``: its 30 costliest kernels);
(e) where the time of one graph-replayed decode step goes (``--profile-batch``): the
    replay alone timed with CUDA events against the engine's whole ``step()``, and the
    GPU time of the step's kernels by kind (Mamba state update, conv, attention, matrix
    products, other) from ``torch.profiler``, with the attention on the Triton kernel
    and on its torch twin (a second graph captured for the comparison);
plus the batched Mamba decode kernels against their torch twins on one layer, the
paged-attention decode kernel against its twin (error, time, bandwidth), every Triton
kernel of ``hybridserve.kernels`` and fla-core's scan behind ``ssd_prefill`` against its
torch twin on fresh random inputs at the model's shapes (``kernel_checks``: relative
errors against the twin and against float64, the kernel's time, pass or fail against a
stated tolerance; the seed is recorded, ``--kernel-seed`` repeats it), and
greedy token agreement between the GPU bf16 path and the CPU float32 path on a tiny
model (and between decode graphs and eager steps). Writes ``--out`` (JSON) and a PNG of throughput against batch size beside it.

``--smoke`` runs every section on the CPU with tiny shapes (the check before spending
device time; a test runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import triton  # noqa: E402
from provenance import git_commit, portable_path  # noqa: E402

import hybridserve.models.loader as loader  # noqa: E402
from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.config import KernelPolicy, runs_triton  # noqa: E402
from hybridserve.engine.engine_core import EngineCore, prefill_flops  # noqa: E402
from hybridserve.kernels import (  # noqa: E402
    activations,
    conv_varlen,
    gdn_decode,
    gdn_varlen,
    mamba_decode,
    moe,
    norms,
    paged_attention,
    paged_attention_prefill,
    sampling,
    ssd_chunk_states,
    ssd_chunked,
    ssd_tails,
    ssd_two_pass,
    ssd_varlen,
    state_postprocess,
)
from hybridserve.models.batch import ForwardBatch  # noqa: E402
from hybridserve.models.config import ModelConfig  # noqa: E402
from hybridserve.models.loader import with_kernel_policy  # noqa: E402
from hybridserve.models.registry import model_class  # noqa: E402
from hybridserve.runner import sampler  # noqa: E402
from hybridserve.runner.cuda_graph import StepShape  # noqa: E402

# --------------------------------------------------------------------------------------
# Model shapes
# --------------------------------------------------------------------------------------

NEMOTRON_8B = dict(
    vocab_size=131072,
    hidden_size=4096,
    intermediate_size=21504,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    mamba_num_heads=128,
    mamba_head_dim=64,
    n_groups=8,
    ssm_state_size=128,
    conv_kernel=4,
    chunk_size=128,
    # 24 M, 4 *, 24 -: "M-M-M-M*-" four times, then "M-" eight times.
    pattern="M-M-M-M*-" * 4 + "M-" * 8,
)
NEMOTRON_1B = dict(
    NEMOTRON_8B,
    hidden_size=2048,
    intermediate_size=8192,
    num_attention_heads=16,
    num_key_value_heads=4,
    mamba_num_heads=64,
    n_groups=4,
    pattern="M-M-M-M*-" * 2 + "M-" * 4,
)
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    mamba_num_heads=8,
    mamba_head_dim=16,
    n_groups=2,
    ssm_state_size=16,
    conv_kernel=4,
    chunk_size=16,
    pattern="M-M*-M-",
)


def hf_config(shape: dict):
    import transformers

    kinds = {"M": "mamba", "*": "attention", "-": "mlp"}
    kw = {k: v for k, v in shape.items() if k != "pattern"}
    return transformers.NemotronHConfig(
        architectures=["NemotronHForCausalLM"],
        layers_block_type=[kinds[c] for c in shape["pattern"]],
        max_position_embeddings=16384,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        **kw,
    )


def random_weight(name: str, shape, device, generator: torch.Generator) -> torch.Tensor:
    """A float32 random value for the parameter ``name`` of ``shape``, well spread as the
    tiny test checkpoints are: logits of a few units, dt in a realistic range, stable
    decays (``A_log``), unit-scale norms and skip terms."""
    leaf = name.rsplit(".", 1)[-1]
    r = torch.empty(shape, device=device, dtype=torch.float32)
    if "embed" in name:
        r.normal_(0.0, 1.0, generator=generator)
    elif name.startswith("lm_head"):
        r.normal_(0.0, 2.5 / math.sqrt(shape[1]), generator=generator)
    elif leaf == "A_log":
        r.uniform_(0.0, 1.0, generator=generator).mul_(7.0).add_(1.0).log_()
    elif leaf == "dt_bias":
        r.uniform_(-1.0, 0.5, generator=generator)
    elif leaf == "D":
        r.normal_(1.0, 0.3, generator=generator)
    elif "conv1d.weight" in name:
        r.normal_(0.0, 0.5, generator=generator)
    elif leaf == "bias":
        r.normal_(0.0, 0.1, generator=generator)
    elif len(shape) == 1:
        r.normal_(1.0, 0.1, generator=generator)
    else:
        r.normal_(0.0, 1.0 / math.sqrt(shape[-1]), generator=generator)
    return r


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Well-spread random weights in place (on the model's device): :func:`random_weight`."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        p.copy_(random_weight(name, p.shape, p.device, g))


def build_models(shape: dict, device: str, dtype: torch.dtype, workdir: Path, with_hf: bool):
    """(ours, hf or None, ModelConfig): both models share the same weight tensors."""
    cfg = hf_config(shape)
    path = workdir / "model"
    cfg.save_pretrained(path)
    mcfg = ModelConfig.from_pretrained(path)
    cls = model_class(mcfg.architecture)
    hf = None
    if with_hf:
        import transformers

        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                hf = transformers.NemotronHForCausalLM(cfg)
        finally:
            torch.set_default_dtype(prev)
        hf.eval().requires_grad_(False)
        randomize_(hf, seed=0)
        state = {}
        for k, v in hf.state_dict().items():
            for disk, mem in cls.checkpoint_prefixes:
                if k.startswith(disk):
                    k = mem + k[len(disk):]
            state[k] = v
        with torch.device("meta"):
            ours = cls(mcfg)
        ours.load_state_dict(state, strict=True, assign=True)
    else:
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                ours = cls(mcfg)
        finally:
            torch.set_default_dtype(prev)
        randomize_(ours, seed=0)
    ours.eval().requires_grad_(False)
    return ours, hf, mcfg, path


def policy_overrides(pairs: list[str]) -> dict:
    """``--policy FIELD=VALUE ...`` as :class:`KernelPolicy` fields, each value parsed as
    its field's type (``true`` / ``false`` for flags); a clear error on an unknown field
    or a value the policy refuses."""
    defaults = KernelPolicy()
    out = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not hasattr(defaults, name):
            known = ", ".join(f.name for f in dataclasses.fields(KernelPolicy))
            raise SystemExit(f"--policy {pair!r}: give FIELD=VALUE, FIELD one of {known}")
        kind = type(getattr(defaults, name))
        if kind is bool:
            if raw.lower() not in ("true", "false"):
                raise SystemExit(f"--policy {pair!r}: {name} takes true or false")
            out[name] = raw.lower() == "true"
        else:
            try:
                out[name] = kind(raw)
            except ValueError:
                raise SystemExit(f"--policy {pair!r}: {name} takes a {kind.__name__}") from None
    try:
        dataclasses.replace(defaults, **out)
    except ValueError as e:
        raise SystemExit(f"--policy: {e}") from None
    return out


@contextlib.contextmanager
def engine_with(model):
    """Make ``LLM(...)`` use ``model`` instead of loading weights from the directory."""
    original = loader.load_model
    loader.load_model = lambda *a, **k: model
    try:
        yield
    finally:
        loader.load_model = original


def with_policy(model, **fields):
    """``model``'s weights (shared, not copied) under its kernel policy with ``fields``
    changed: how a comparison picks other paths. No gradients (``load_state_dict``'s
    ``assign`` keeps the new module's ``requires_grad``): a forward outside inference
    mode on the engine's inference-mode buffers would otherwise fail."""
    other = with_kernel_policy(model, dataclasses.replace(model.kernel_policy, **fields))
    return other.requires_grad_(False)


@contextlib.contextmanager
def host_sampling():
    """Host-side sampling for every step (the batched sampler, no greedy argmax)."""
    saved = sampler.samples_by_argmax
    sampler.samples_by_argmax = lambda params: False
    try:
        yield
    finally:
        sampler.samples_by_argmax = saved


def reference_paths(model):
    """The decode fast paths off: per-row Mamba and attention (with host sampling)."""
    return with_policy(model, uniform_decode=False)


def per_row_prefill(model):
    """Prefill and mixed steps on the per-row reference paths (Mamba and attention)."""
    return with_policy(model, packed_prefill="off", prefill_attention="reference")


def torch_norms(model):
    """RMS norms, residual adds and the gated norm on their torch twins."""
    return with_policy(model, norms="reference")


# --------------------------------------------------------------------------------------
# Timing helpers
# --------------------------------------------------------------------------------------


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def wall(fn, device: str) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def copy_bandwidth(device: str, nbytes: int) -> dict:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        t = wall(lambda: dst.copy_(src), device)
        if i >= 5:
            times.append(t)
    med = statistics.median(times)
    src = dst = None  # noqa: F841 (release before emptying the allocator cache)
    free_memory(device)
    return {"bytes_per_copy": nbytes, "median_s": med, "bytes_per_s": 2 * nbytes / med}


def model_bytes(model: torch.nn.Module) -> dict:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed.weight
    return {"parameters": sum(p.numel() for p in model.parameters()), "total": total,
            "embedding": embed.numel() * embed.element_size()}


def decode_step_bytes(model, batch: int, context: int, ssm_bytes: int) -> int:
    """Fewest bytes one decode step moves: every weight once (the embedding table only
    for the rows looked up), every request's KV read, its recurrent state read and the
    new state written."""
    mb = model_bytes(model)
    spec = model.cache_spec
    hidden = model.config.hidden_size
    elem = next(model.parameters()).element_size()
    weights = mb["total"] - mb["embedding"] + batch * hidden * elem
    kv = batch * context * spec.kv_block_bytes(1, next(model.parameters()).dtype)
    state_dtype = {4: torch.float32, 2: torch.bfloat16}[ssm_bytes]
    state = 2 * batch * spec.state_page_bytes(next(model.parameters()).dtype, state_dtype)
    return weights + kv + state


# --------------------------------------------------------------------------------------
# (a) + (c): decode throughput of the engine, postprocess share
# --------------------------------------------------------------------------------------


def make_llm(model, path, device, dtype, batch, max_len, enforce_eager=None, **kw):
    """``LLM`` over ``model``; ``enforce_eager`` None keeps the engine's default (decode
    graphs on CUDA), True or False rebuilds the engine that way (False on the CPU: the
    graph path's static-buffer step without capture)."""
    with engine_with(model):
        llm = LLM(
            str(path), dtype=dtype, device=device, max_num_seqs=batch,
            max_model_len=max_len, kernel_policy=model.kernel_policy, **kw,
        )
    return with_engine(llm, enforce_eager, device)


def with_engine(llm, enforce_eager, device):
    """``llm`` with its engine rebuilt for ``enforce_eager`` (None: left as it is)."""
    eng = llm.engine
    if enforce_eager is not None and (eng.runner.graphs is None) != enforce_eager:
        vocab, eos = eng.vocab_size, eng.eos_token_ids
        llm.engine = eng = None  # release its caches before allocating the new ones
        free_memory(device)
        llm.engine = EngineCore(llm.config, llm.model, llm.tokenizer, vocab, eos,
                                enforce_eager=enforce_eager)
    return llm


def engine_decode(model, path, device, dtype, batch, prompt_len, warmup, steps, vocab, seed,
                  enforce_eager=None, profile=False, temperature=0.0, llm_kw=None):
    """Median wall time of full-batch decode steps (every request decoding).

    ``llm_kw``: ``LLM`` arguments that replace this function's cache sizing (e.g.
    ``num_state_pages``, ``ssm_state_dtype`` where large state pages would not fit).

    ``temperature > 0``: every request samples (seeded, top-p 0.95), drawn by the batched
    sampler, inside the graph when graphs are on.

    With decode graphs on, the steps alternate between graph replay and the eager fast
    path on the same engine and requests (``warmup`` + ``steps`` of each), so both modes
    see the same contexts; ``modes`` holds one result per mode. With ``profile`` (and
    graphs on) the step's graph is then profiled (:func:`profile_graph_step`).
    """
    max_len = prompt_len + 3 * (warmup + steps) + batch // 4 + 64
    kw = dict(enable_prefix_caching=False, num_state_pages=3 * batch + 8, max_checkpoint_pages=1,
              max_num_batched_tokens=max(8192, batch),
              num_kv_blocks=batch * (-(-max_len // 16)) + 8)
    kw.update(llm_kw or {})
    llm = make_llm(model, path, device, dtype, batch, max_len, enforce_eager, **kw)
    eng = llm.engine
    runner = eng.runner
    graphs = runner.graphs
    modes = ("graph", "eager") if graphs is not None else ("eager",)
    # Alternating modes step by step needs every step read back before the next: async
    # scheduling is measured on its own afterwards ("graph_async").
    with_async = eng.async_scheduling
    eng.async_scheduling = False
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=temperature, max_tokens=max_len - prompt_len - 1,
                            ignore_eos=True, top_p=0.95 if temperature > 0 else 1.0, seed=seed)
    for i in range(batch):
        ids = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        # Finished-only outputs, as the offline LLM.generate asks for (no per-step
        # RequestOutput per request).
        eng.add_request(f"r{i}", ids, params, final_only=True)
    # The postprocess of a step: its launch (inside the runner, once the choices exist
    # on the device) plus the host's commit of the decisions read back with them.
    post_times: list[float] = []
    launch_s = [0.0]
    original_launch, original_commit = runner._postprocess, eng._commit_postprocess

    def timed_launch(*args):
        t = time.perf_counter()
        out = original_launch(*args)
        launch_s[0] += time.perf_counter() - t
        return out

    def timed_commit(*args):
        t = time.perf_counter()
        original_commit(*args)
        post_times.append(launch_s[0] + time.perf_counter() - t)
        launch_s[0] = 0.0

    runner._postprocess = timed_launch
    eng._commit_postprocess = timed_commit
    times = {m: [] for m in modes}
    post = {m: [] for m in modes}
    seen = {m: 0 for m in modes}
    replayed = 0  # graph-mode timed steps that did replay a graph
    prefill_time, decoding = 0.0, 0
    while min(len(times[m]) for m in modes) < steps:
        sched = eng.scheduler
        full = (not sched.waiting and len(sched.running) == batch
                and not any(r.is_prefill for r in sched.running))
        runner.graphs = graphs
        if not full:
            prefill_time += wall(eng.step, device)
            continue
        mode = modes[decoding % len(modes)]
        decoding += 1
        runner.graphs = graphs if mode == "graph" else None
        n_post = len(post_times)
        before = graphs.counters["graph_steps"] if graphs is not None else 0
        t = wall(eng.step, device)
        seen[mode] += 1
        if seen[mode] > warmup:
            times[mode].append(t)
            post[mode].append(post_times[-1] if len(post_times) > n_post else 0.0)
            if mode == "graph":
                replayed += graphs.counters["graph_steps"] - before
    runner.graphs = graphs
    async_result = None
    if with_async and graphs is not None:
        # Consecutive pipelined steps: each call launches the next step and commits the
        # one before, so a step's time is the whole loop's over its count (one device
        # sync before and after, none in between: that would undo the overlap).
        eng.async_scheduling = True
        for _ in range(warmup):
            eng.step()
        n_post = len(post_times)
        before = graphs.counters["graph_steps"]
        sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync(device)
        total = time.perf_counter() - t
        async_result = {
            "median_step_s": total / steps, "tokens_per_s": batch * steps / total,
            "steps_timed": steps, "step_times_s": [total / steps],
            "postprocess_median_s": statistics.median(post_times[n_post:] or [0.0]),
            "graph_steps_launched": graphs.counters["graph_steps"] - before,
        }
        async_result["postprocess_share"] = (
            async_result["postprocess_median_s"] / async_result["median_step_s"])
    counters = dict(graphs.counters) if graphs is not None else None
    profiled = None
    if profile and graphs is not None and times.get("graph"):
        try:
            profiled = profile_graph_step(graphs, device, statistics.median(times["graph"]))
        except Exception as e:  # keep the decode numbers
            profiled = {"error": f"{type(e).__name__}: {e}",
                        "traceback": _portable_traceback()}
    stats = llm.stats()
    for i in range(batch):
        eng.abort_request(f"r{i}")
    llm = eng = runner = None  # noqa: F841
    out = {"batch": batch, "prefill_and_ramp_s": prefill_time,
           "num_preemptions": stats.get("num_preemptions", stats.get("preemptions", None)),
           "modes": {}}
    if graphs is not None:
        out["graphs"] = {"counters": counters, "keys": [list(k) for k in graphs._graphs],
                         "capture_errors": list(graphs.capture_errors),
                         "timed_graph_steps_replayed": replayed}
    if profiled is not None:
        out["profile"] = profiled
    graphs = None
    free_memory(device)
    for m in modes:
        med = statistics.median(times[m])
        pmed = statistics.median(post[m])
        out["modes"][m] = {"median_step_s": med, "tokens_per_s": batch / med,
                           "steps_timed": len(times[m]), "step_times_s": times[m],
                           "postprocess_median_s": pmed, "postprocess_share": pmed / med}
    if async_result is not None:
        out["modes"]["graph_async"] = async_result
    # The engine's default mode's figures at the top level (pipelined graph replay where
    # it is on).
    default = "graph_async" if async_result is not None else modes[0]
    out.update(out["modes"][default])
    out["mode"] = default
    return out


# --------------------------------------------------------------------------------------
# (e): where the time of one graph-replayed decode step goes
# --------------------------------------------------------------------------------------

KERNEL_KINDS = ("mamba_state_update", "conv", "attention", "matmul", "other")


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel, by its name."""
    n = name.lower()
    if "ssm_decode" in n:
        return "mamba_state_update"
    if "conv_decode" in n:
        return "conv"
    if "paged_attention" in n:
        return "attention"
    if any(k in n for k in ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "matmul",
                            "splitk", "sm90_", "sm80_")):
        return "matmul"
    return "other"


def _profile_kernels(fn, reps: int, device: str) -> dict:
    """GPU time per call of the kernels ``fn`` runs, by kind (``torch.profiler``)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        acts.append(ProfilerActivity.CUDA)
    sync(device)
    with profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        sync(device)
    by_kind = dict.fromkeys(KERNEL_KINDS, 0.0)
    top = []
    for e in prof.key_averages():
        if device.startswith("cuda"):
            if getattr(e, "device_type", None) is None or "CUDA" not in str(e.device_type):
                continue
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = e.self_cuda_time_total
        else:  # the smoke run: CPU operator time stands in
            if "aten::" not in e.key:
                continue
            us = e.self_cpu_time_total
        if us <= 0:
            continue
        by_kind[kernel_kind(e.key)] += us / 1e6 / reps
        top.append((us / 1e6 / reps, e.count // reps, e.key[:120]))
    top.sort(reverse=True)
    total = sum(by_kind.values())
    return {"kernel_s_by_kind": by_kind, "kernel_s_total": total,
            "top_kernels": [{"s": t, "calls": c, "name": k} for t, c, k in top[:15]]}


def _event_time(fn, reps: int, device: str) -> float:
    """Median device time of ``fn`` (CUDA events; the host clock on the CPU)."""
    fn()
    if not device.startswith("cuda"):
        return statistics.median(wall(fn, device) for _ in range(reps))
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def profile_graph_step(graphs, device: str, step_s: float, reps: int = 20) -> dict:
    """Where the time of the engine's last graph step goes.

    Replays the captured graph of that step's key on the static buffer as the last graph
    step left it (it rewrites that step's keys, values and output states: idempotent for
    timing), timed with CUDA events, and profiles its kernels by kind. Then captures the
    same step again with the attention on its torch twin (a graph of its own, in its
    own memory pool) and does the same; the engine's graphs are restored afterwards.
    ``step_s`` is the median wall time of the engine's whole graph ``step()``.
    """
    keys = [k for k in graphs._graphs if graphs._graphs[k][0] is not None
            or not graphs.capture]
    if not keys:
        return {"error": "no graph captured"}
    # On the CPU (the smoke run) the times are the interpreter's: they only show that
    # every part of the profile runs, so each is taken over one or two calls.
    cuda = device.startswith("cuda")
    reps, prof_reps, eager_reps = (reps, 3, 5) if cuda else (min(reps, 2), 1, 1)
    key = max(keys)  # (batch, q, width): the step's own key when one batch size ran
    b, q, w = key
    st = graphs._static[q]
    shape = StepShape(rows=b, batch=b, q=q, width=w)

    def measure(entry):
        graph = entry[0]
        fn = graph.replay if graph is not None else (lambda: graphs._forward(st, shape))
        replay = _event_time(fn, reps, device)
        kernels = _profile_kernels(fn, prof_reps, device)
        return {"replay_s": replay, **kernels,
                "gaps_in_replay_s": replay - kernels["kernel_s_total"]}

    out = {"key": list(key), "engine_step_s": step_s}
    out["triton_attention"] = measure(graphs._graphs[key])
    out["host_and_rest_s"] = step_s - out["triton_attention"]["replay_s"]
    # Eager, the same static forward: the kernels once more without the graph.
    eager = _profile_kernels(lambda: graphs._forward(st, shape), prof_reps, device)
    out["static_forward_eager"] = {
        "wall_s": statistics.median(wall(lambda: graphs._forward(st, shape), device)
                                    for _ in range(eager_reps)), **eager}
    saved_entry, saved_pool, saved_model = graphs._graphs.pop(key), graphs._pool, graphs.model
    saved_counters, saved_enabled = dict(graphs.counters), graphs.enabled
    try:
        graphs._pool = None
        graphs.model = with_policy(saved_model, decode_attention="reference")
        entry = graphs._capture(st, shape)
        if entry is None:
            out["twin_attention"] = {"error": "; ".join(graphs.capture_errors[-1:])}
        else:
            out["twin_attention"] = measure(entry)
            graphs._graphs.pop(key, None)
            entry = None
    finally:
        graphs.model = saved_model
        graphs._graphs[key] = saved_entry
        graphs._pool = saved_pool
        graphs.counters.clear()
        graphs.counters.update(saved_counters)
        graphs.enabled = saved_enabled
        free_memory(device)
    return out


def attention_kernel(model, device, batches, context, block_size=16, reps=3):
    """The paged-attention decode kernel against its torch twin at the model's attention
    shape: ``batch`` rows of one token over ``context`` keys each in scattered blocks
    (bf16 cache, block tables ``-1`` padded to twice the needed width). Relative error
    against the twin and against a float64 evaluation, time, and the bandwidth over the
    bytes it must read (each row's keys and values once, plus queries and outputs)."""
    from hybridserve.models.layers.attention import Attention

    attn = next(m for m in model.modules() if isinstance(m, Attention))
    p = attn.p
    dtype = next(model.parameters()).dtype
    fast = device.startswith("cuda") or triton.knobs.runtime.interpret
    out = []
    for b in batches:
        g = torch.Generator(device=device).manual_seed(b)
        n_blocks = -(-context // block_size)
        total = b * n_blocks + 1
        sets = []
        # Several input sets so repeated runs do not read from the L2 cache.
        for _ in range(reps):
            k = torch.randn(total, block_size, p.num_kv_heads, p.head_dim, device=device,
                            generator=g).to(dtype)
            v = torch.randn_like(k)
            perm = torch.randperm(total, device=device, generator=g)[: b * n_blocks]
            tables = torch.full((b, 2 * n_blocks), -1, dtype=torch.int32, device=device)
            tables[:, :n_blocks] = perm.view(b, n_blocks).to(torch.int32)
            lens = torch.randint(context // 2, context + 1, (b,), device=device, generator=g)
            lens[0] = context
            positions = lens - 1
            qs = torch.randn(b, p.num_heads, p.head_dim, device=device, generator=g).to(dtype)
            sets.append((qs, k, v, tables, positions, lens))
        rec = {"batch": b, "context": context, "heads": p.num_heads,
               "kv_heads": p.num_kv_heads, "head_dim": p.head_dim}
        kv_bytes = sum(int(x[5].sum()) for x in sets) / reps * 2 * p.num_kv_heads \
            * p.head_dim * k.element_size()
        rec["bytes"] = kv_bytes + 2 * qs.numel() * qs.element_size()
        ctx_host = [context] * b

        def twin(x, ctx_host=ctx_host):
            return paged_attention.paged_attention_decode_reference(
                x[0], x[1], x[2], x[3], ctx_host, x[4], p.scale)

        # The keys split across programs where (row, KV head) programs are too few
        # (paged_attention.decode_splits), timed against one program per (row, KV head);
        # the CPU smoke run forces two splits so that it runs that path too.
        rec["splits"] = (paged_attention.decode_splits(
            b, p.num_kv_heads, sets[0][3].shape[1] * block_size, sets[0][0].device)
            if device.startswith("cuda") else 2)

        def kern(x, splits=rec["splits"]):
            return paged_attention.paged_attention_decode_triton(
                x[0], x[1], x[2], x[3], x[4], p.scale, splits=splits)

        def unsplit(x):
            return kern(x, splits=1)

        def rotate(fn, sets=sets, it={"i": 0}):  # noqa: B006 (one counter per call)
            def call():
                it["i"] = (it["i"] + 1) % reps
                return fn(sets[it["i"]])
            return call

        want = twin(sets[0]).float()
        rec["twin_s"] = bench_fn(rotate(twin), device)
        if fast:
            got = kern(sets[0]).float()
            rec["triton_vs_twin_rel_err"] = float((got - want).norm() / want.norm())
            x = sets[0]
            ref = paged_attention.paged_attention_decode_reference(
                x[0].double(), x[1].double(), x[2].double(), x[3], ctx_host, x[4], p.scale)
            rec["triton_vs_float64_rel_err"] = float((got.double() - ref).norm() / ref.norm())
            rec["twin_vs_float64_rel_err"] = float((want.double() - ref).norm() / ref.norm())
            rec["triton_s"] = bench_fn(rotate(kern), device)
            rec["triton_bytes_per_s"] = rec["bytes"] / rec["triton_s"]
            rec["twin_over_triton"] = rec["twin_s"] / rec["triton_s"]
            if rec["splits"] > 1:
                one = unsplit(sets[0]).float()
                rec["unsplit_vs_twin_rel_err"] = float((one - want).norm() / want.norm())
                rec["unsplit_s"] = bench_fn(rotate(unsplit), device)
                rec["unsplit_over_triton"] = rec["unsplit_s"] / rec["triton_s"]
            else:  # what the rule gives up where it does not split: two splits' time
                rec["split2_s"] = bench_fn(rotate(lambda x: kern(x, splits=2)), device)
                rec["split2_over_triton"] = rec["split2_s"] / rec["triton_s"]
        out.append(rec)
        sets = None
        free_memory(device)
    return out


# --------------------------------------------------------------------------------------
# (a) baseline: transformers generate on the same weights
# --------------------------------------------------------------------------------------


def hf_decode(hf, device, batch, prompt_len, new_tokens, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, prompt_len), generator=g).to(device)
    mask = torch.ones_like(ids)

    def gen(n):
        with torch.no_grad():
            return hf.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=0, eos_token_id=None,
            )

    gen(2)  # warm-up
    # Best of two: one-off host hiccups only ever add time.
    t1 = min(wall(lambda: gen(1), device) for _ in range(2))
    tn = min(wall(lambda: gen(new_tokens), device) for _ in range(2))
    per_step = (tn - t1) / (new_tokens - 1)
    free_memory(device)
    return {"batch": batch, "new_tokens": new_tokens, "generate_1_s": t1,
            "generate_n_s": tn, "median_step_s": per_step, "tokens_per_s": batch / per_step}


# --------------------------------------------------------------------------------------
# (b): time to first token, cached prefix vs cold
# --------------------------------------------------------------------------------------


def ttft(model, path, device, dtype, prompt_len, cached_len, interval, vocab, seed,
         tails=(64, 128, 256, 512), target=20.0):
    """First token of a ``prompt_len`` prompt, cold and with ``cached_len`` tokens cached,
    then, over the same cached prefix, tails of ``tails`` new tokens through the short-row
    path, walked token by token and in 16-token chunks (``KernelPolicy.short_row_chunks``),
    and through the chunked scan (``KernelPolicy.short_rows`` "off"), each warmed once
    first.

    ``cached_split``: where the cached first token's time goes: the device time of its
    kernels (``torch.profiler``, one profiled run) against its wall time, unprofiled
    (the median) and profiled; the rest is the host's (admission, the prefix lookup,
    metadata, launches or the graph replay, the read-back, the commit). With decode
    graphs on (CUDA) the cached step replays a short-row graph: ``short_graph_steps``
    counts the cached runs that did. ``target``: the speedup the cached first token is
    held to (``meets_target``).

    ``cached_profile`` profiles a cached run that follows a cached run, while the headline's
    runs each follow a cold one: ``first_cached_profile`` profiles one that follows a cold
    run (its own kernel time; ``cached_split``'s ``first_run_kernel_s``), and
    ``cached_after_idle`` times cached runs that wait ``idle_s`` after their cold run, so
    that device time only a run right after a cold prefill pays (the GPU's clocks after
    a long prefill) is not read as the host's share."""
    max_len = max(prompt_len, cached_len + max(tails, default=0)) + 16
    pages = cached_len // interval + 16 + 4 * len(tails)
    llm = make_llm(
        model, path, device, dtype, 2, max_len,
        enable_prefix_caching=True, state_interval=interval,
        checkpoint_policies=("grid", "prompt_end"), max_checkpoint_pages=pages,
        num_state_pages=pages + 24, max_num_batched_tokens=prompt_len,
        num_kv_blocks=4 * (-(-max_len // 16)) + 8,
    )
    g = torch.Generator().manual_seed(seed)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prompt(prefix, tail=prompt_len - cached_len):
        return prefix + torch.randint(3, vocab, (tail,), generator=g).tolist()

    def run(ids):
        out = {}
        out["s"] = wall(lambda: out.setdefault("r", llm.generate([ids], one, use_tqdm=False)),
                        device)
        return out["s"], out["r"][0].num_cached_tokens

    # Warm-up at full size and at the cached run's size (kernels compile or tune per
    # shape on first use: an unwarmed first cached run measured about 60 ms more), then
    # drop every checkpoint.
    warm_prefix = torch.randint(3, vocab, (cached_len,), generator=g).tolist()
    run(prompt(warm_prefix))
    run(prompt(warm_prefix))
    llm.reset_prefix_cache()
    graphs = llm.engine.runner.graphs
    counters = graphs.counters if graphs is not None else {}
    cold, warm = [], []
    replayed = 0
    for _ in range(2):
        prefix = torch.randint(3, vocab, (cached_len,), generator=g).tolist()
        llm.reset_prefix_cache()
        t, hit = run(prompt(prefix))
        cold.append((t, hit))
        before = counters.get("short_graph_steps", 0)
        t, hit = run(prompt(prefix))  # same prefix, new tail: served from the checkpoint
        replayed += counters.get("short_graph_steps", 0) > before
        warm.append((t, hit))
    # One more cached run (the last prefix is still cached) under the profiler: where
    # the time of a cached-prefix first token goes.
    cached_profile = _profile_call(lambda: run(prompt(prefix)), device)
    # And once more with CUDA's sync debug mode: which lines still make the host wait.
    cached_syncs = _sync_sites(lambda: run(prompt(prefix)), device)
    by_tail = []
    # "short": every tail on the short-row path (its length limit lifted for the sweep),
    # the recurrence walking token by token (KernelPolicy.short_row_chunks "off");
    # "chunks": the same walking 16-token chunks ("on"); "off": every tail on the
    # chunked scan. The headline runs above take the defaults.
    runner = llm.engine.runner
    base = runner.model
    limit = max(base.kernel_policy.max_short_tokens, *tails)
    modes = {"short": dict(short_rows="auto", short_row_chunks="off"),
             "chunks": dict(short_rows="auto", short_row_chunks="on"),
             "off": dict(short_rows="off")}
    off_profile = None
    for mode, fields in modes.items():
        runner.model = with_policy(base, **fields, max_short_tokens=limit)
        try:
            for tail in tails:
                run(prompt(prefix, tail))  # warm-up: first use of this shape and path
                runs = [run(prompt(prefix, tail)) for _ in range(3)]
                by_tail.append({"short_rows": mode, "tail": tail, "runs": runs,
                                "s": statistics.median(t for t, _ in runs)})
            if mode == "off":
                # Where an eager packed step's time goes (kernels, host ops, syncs).
                at = 128 if 128 in tails else tails[0]
                off_profile = {"tail": at, **_profile_call(lambda at=at: run(prompt(prefix, at)),
                                                           device)}
        finally:
            runner.model = base
    # The headline's pair (a cold run, then a cached run at once), with the cached run
    # under the profiler; then with an idle gap between the two.
    llm.reset_prefix_cache()
    run(prompt(prefix))
    first_profile = _profile_call(lambda: run(prompt(prefix)), device)
    after_idle = []
    for idle_s in (0.1, 1.0) if device.startswith("cuda") else (0.01,):
        runs = []
        for _ in range(2 if device.startswith("cuda") else 1):
            llm.reset_prefix_cache()
            run(prompt(prefix))
            sync(device)
            time.sleep(idle_s)
            runs.append(run(prompt(prefix)))
        after_idle.append({"idle_s": idle_s, "runs": runs,
                           "s": statistics.median(t for t, _ in runs)})
    llm = None  # noqa: F841
    free_memory(device)
    cold_s = statistics.median(t for t, _ in cold)
    warm_s = statistics.median(t for t, _ in warm)
    kernel_s = cached_profile["kernel_s_total"]
    split = {
        "wall_s": warm_s, "kernel_s": kernel_s, "host_s": warm_s - kernel_s,
        "kernel_share": kernel_s / warm_s,
        "profiled_wall_s": cached_profile["wall_s"],
        "profiled_host_s": cached_profile["wall_s"] - kernel_s,
        # The kernels of a cached run right after a cold run (the headline's kind).
        "first_run_kernel_s": first_profile["kernel_s_total"],
        "first_run_host_s": warm_s - first_profile["kernel_s_total"],
        # The speedup if the host took no time at all: the kernels' bound.
        "kernel_bound_speedup": cold_s / kernel_s if kernel_s > 0 else None,
        "short_graph_steps": replayed, "cached_runs": len(warm),
        "graph_capture_errors": list(graphs.capture_errors) if graphs is not None else [],
    }
    return {"prompt_len": prompt_len, "cached_len": cached_len, "state_interval": interval,
            "max_short_tokens": limit,
            "cold_s": cold_s, "cached_s": warm_s, "speedup": cold_s / warm_s,
            "target_speedup": target, "meets_target": cold_s / warm_s >= target,
            "cached_split": split,
            "cold_runs": cold, "cached_runs": warm, "cached_profile": cached_profile,
            "cached_syncs": cached_syncs, "cached_by_tail": by_tail,
            "off_profile": off_profile,
            "first_cached_profile": first_profile, "cached_after_idle": after_idle}


def _sync_sites(fn, device: str) -> list[dict]:
    """Run ``fn`` under CUDA's sync debug mode: every operation that makes the host wait
    for the device warns from the Python line that called it. Returns those lines (the
    last frame inside this repository) with counts, most frequent first; empty off CUDA."""
    if not device.startswith("cuda"):
        return []
    import traceback as tb
    import warnings

    sites: dict[tuple[str, str], int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in tb.extract_stack()[:-1]
                  if portable_path(f.filename) != Path(f.filename).name]
        where = (f"{portable_path(frames[-1].filename)}:{frames[-1].lineno}"
                 if frames else f"{Path(filename).name}:{lineno}")
        key = (where, str(message).splitlines()[0][:120])
        sites[key] = sites.get(key, 0) + 1

    saved = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = saved
    return [{"site": w, "message": m, "count": c}
            for (w, m), c in sorted(sites.items(), key=lambda kv: -kv[1])]


def _profile_call(fn, device: str, top: int = 15) -> dict:
    """One call of ``fn`` under ``torch.profiler``: its wall time, the device time of its
    kernels (the CPU operators' time on the CPU), the ``top`` kernels and host operators,
    and how many host-device synchronisations and copies it made."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    cuda = device.startswith("cuda")
    if cuda:
        acts.append(ProfilerActivity.CUDA)
    sync(device)
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        fn()
        sync(device)
        wall_s = time.perf_counter() - t
    kernels, host = [], []
    counts = {"synchronize": 0, "memcpy": 0, "item": 0}
    for e in prof.key_averages():
        key = e.key
        low = key.lower()
        if "synchronize" in low:
            counts["synchronize"] += e.count
        if "memcpy" in low:
            counts["memcpy"] += e.count
        if key in ("aten::item", "aten::_local_scalar_dense"):
            counts["item"] += e.count
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(e, "self_cuda_time_total", 0)
        if cuda and device_us > 0 and "CUDA" in str(getattr(e, "device_type", "")):
            kernels.append((device_us / 1e6, e.count, key[:120]))
        elif e.self_cpu_time_total > 0:
            host.append((e.self_cpu_time_total / 1e6, e.count, key[:120]))
    kernels.sort(reverse=True)
    host.sort(reverse=True)
    return {
        "wall_s": wall_s,
        "kernel_s_total": sum(k[0] for k in kernels),
        "host_op_s_total": sum(h[0] for h in host),
        "counts": counts,
        "top_kernels": [{"s": t, "calls": c, "name": k} for t, c, k in kernels[:top]],
        "top_host_ops": [{"s": t, "calls": c, "name": k} for t, c, k in host[:top]],
    }


# --------------------------------------------------------------------------------------
# Prefill throughput against the FLOP roofline
# --------------------------------------------------------------------------------------


def matmul_rate(device, dtype, n):
    """FLOP/s of one ``n x n x n`` matrix product (median), random inputs."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=g).to(dtype)
    b = torch.randn(n, n, device=device, generator=g).to(dtype)
    t = bench_fn(lambda: a @ b, device)
    a = b = None  # noqa: F841
    free_memory(device)
    return {"n": n, "dtype": str(dtype), "median_s": t, "flops_per_s": 2 * n**3 / t}


def prefill_throughput(model, path, device, dtype, prompts, prompt_len, vocab, seed,
                       flops_per_s, max_s):
    """Wall time of prefilling ``prompts`` prompts of ``prompt_len`` tokens in one
    ``generate`` (one token each), against the FLOP roofline: 2 x weights x tokens plus
    the attention products (the engine's ``prefill_flops``) over the matrix rate.

    A warm-up prefills one prompt first; if ``prompts`` of them, twice, would take longer
    than ``max_s`` at that rate, fewer are run (``prompts_run`` says how many). The timed
    batch runs once untimed first.
    """
    max_len = prompt_len + 8
    llm = make_llm(
        model, path, device, dtype, prompts, max_len,
        enable_prefix_caching=False, num_state_pages=3 * prompts + 8, max_checkpoint_pages=1,
        max_num_batched_tokens=prompts * prompt_len,
        num_kv_blocks=prompts * (-(-max_len // 16)) + 8,
    )
    g = torch.Generator().manual_seed(seed)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def batch(n):
        return [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(n)]

    warm = wall(lambda: llm.generate(batch(1), one, use_tqdm=False), device)
    run = max(1, min(prompts, int(max_s / (2 * warm))))
    # Kernels that tune or compile per packed length (fla-core's autotuner keys on it)
    # see the timed batch's shapes once before it is timed.
    llm.generate(batch(run), one, use_tqdm=False)
    t = wall(lambda: llm.generate(batch(run), one, use_tqdm=False), device)
    # Where the time goes: the same batch once more under the profiler, its kernels by
    # name (the matrix products against the scan, the conv, the norms and the rest).
    profiled = _profile_call(lambda: llm.generate(batch(run), one, use_tqdm=False), device,
                             top=30)
    llm = None  # noqa: F841
    free_memory(device)
    flops = run * prefill_flops(model)(prompt_len)
    roof = flops / flops_per_s
    return {"prompts_asked": prompts, "prompts_run": run, "prompt_len": prompt_len,
            "tokens": run * prompt_len, "warmup_one_prompt_s": warm, "wall_s": t,
            "tokens_per_s": run * prompt_len / t, "flops": flops,
            "achieved_flops_per_s": flops / t, "matmul_flops_per_s": flops_per_s,
            "roofline_s": roof, "roofline_tokens_per_s": run * prompt_len / roof,
            "fraction_of_roofline": roof / t, "profile": profiled}


# --------------------------------------------------------------------------------------
# Kernels on one layer: Triton vs twin vs the per-row reference mixer
# --------------------------------------------------------------------------------------


def bench_fn(fn, device, reps=20):
    if device.startswith("cuda"):
        return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median") / 1e3
    fn()
    return statistics.median(wall(fn, device) for _ in range(reps))


def layer_kernels(model, device, batches):
    """ssm/conv decode update alone at 8B shapes: time and achieved bandwidth."""
    spec = model.cache_spec
    mixer_layer = spec.mamba_layers[0]
    mixer = model.model.layers[mixer_layer].mixer
    p = mixer.p
    dtype = next(model.parameters()).dtype
    out = []
    for b in batches:
        pages = 2 * b + 2
        g = torch.Generator(device=device).manual_seed(b)
        ssm_cache = torch.randn(pages, p.n_heads, p.head_dim, p.d_state, device=device,
                                generator=g)
        conv_cache = torch.randn(pages, p.conv_dim, p.d_conv - 1, device=device,
                                 generator=g).to(dtype)
        in_pages = torch.arange(b, dtype=torch.int32, device=device)
        out_pages = (torch.arange(b, dtype=torch.int32, device=device) + b)[:, None]
        x = torch.randn(b, p.n_heads, p.head_dim, device=device, generator=g).to(dtype)
        # Raw dt (the projection's); the kernel discretises it with the layer's dt_bias.
        dt = (torch.randn(b, p.n_heads, device=device, generator=g) * 0.5).to(dtype)
        dt_kw = {"dt_bias": mixer.dt_bias.detach()}
        A = -torch.rand(p.n_heads, device=device, generator=g) - 0.5
        B = torch.randn(b, p.n_groups, p.d_state, device=device, generator=g).to(dtype)
        C = torch.randn_like(B)
        xbc = torch.randn(b, p.conv_dim, device=device, generator=g).to(dtype)
        w = mixer.conv1d.weight[:, 0, :].contiguous()
        ssm_bytes = 2 * b * p.n_heads * p.head_dim * p.d_state * 4
        conv_bytes = b * p.conv_dim * (2 * (p.d_conv - 1) + 2) * xbc.element_size()
        rec = {"batch": b, "ssm_state_bytes": ssm_bytes, "conv_bytes": conv_bytes}
        fast = device.startswith("cuda")
        for name, ssm, conv in (
            ("triton", mamba_decode.ssm_update, mamba_decode.conv_decode_update),
            ("torch_twin", mamba_decode.ssm_update_reference,
             mamba_decode.conv_decode_update_reference),
        ):
            if name == "triton" and not fast:
                continue
            ssm_args = (x, dt, A, B, C, mixer.D, ssm_cache, in_pages, out_pages)
            conv_args = (xbc, w, mixer.conv1d.bias, conv_cache, in_pages, out_pages, p.activation)
            ts = bench_fn(lambda s=ssm, a=ssm_args, k=dt_kw: s(*a, **k), device)
            tc = bench_fn(lambda c=conv, a=conv_args: c(*a), device)
            rec[name] = {"ssm_s": ts, "ssm_bytes_per_s": ssm_bytes / ts,
                         "conv_s": tc, "conv_bytes_per_s": conv_bytes / tc}
        if fast:
            want_cache = ssm_cache.clone()
            want = mamba_decode.ssm_update_reference(
                x, dt, A, B, C, mixer.D, want_cache, in_pages, out_pages, **dt_kw)
            got = mamba_decode.ssm_update(
                x, dt, A, B, C, mixer.D, ssm_cache, in_pages, out_pages, **dt_kw)
            rec["triton_vs_twin_rel_err"] = float((got - want).norm() / want.norm())
        out.append(rec)
        free_memory(device)
    return out


# --------------------------------------------------------------------------------------
# Every Triton kernel against its torch twin on fresh random inputs
# --------------------------------------------------------------------------------------

# The step sizes of the kernel checks; the layer shapes come from the model's shape dict
# (NEMOTRON_8B on CUDA, TINY in the smoke run). On CUDA: decode and verify steps of 64
# rows over contexts of a few hundred to a few thousand keys, prefill rows of a few
# hundred to a few thousand tokens, the engine's default state interval, 16-token KV
# blocks, a state copy of 16 rows over every Mamba layer, a short-row step with a cached
# prompt's 128-token tail and a 37-token fresh prompt (24 and 9 in the smoke run: the
# interpreter steps through every token in turn, and the kernel tests cover long rows).
CHECK_STEPS = {
    "cuda": dict(rows=64, verify_q=4, context=(256, 4096), prefill=(256, 2048),
                 kv_block=16, state_interval=64, copy_rows=16,
                 short_rows=(128, 1, 1, 37, 0, 5)),
    "smoke": dict(rows=4, verify_q=3, context=(3, 24), prefill=(6, 20),
                  kv_block=4, state_interval=4, copy_rows=4,
                  short_rows=(24, 1, 1, 9, 0, 5)),
}
# An int32 output cannot hold NaN: this value marks what the kernel has not written.
INT_POISON = -123456


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` (Frobenius norms, float64); NaN when ``got`` holds a NaN
    (an output the kernel left unwritten)."""
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm())


def kernel_time(fn, device: str) -> float:
    """Median seconds of one call of ``fn``: ``triton.testing.do_bench`` on CUDA; on the
    CPU one timed call (the interpreter's time, not the kernel's; the interpreter compiles
    nothing, so there is no first call to discard)."""
    if device.startswith("cuda"):
        return bench_fn(fn, device)
    return wall(fn, device)


def _tol(dtype: torch.dtype, float32: float, half: float) -> float:
    return float32 if dtype == torch.float32 else half


def _compared(got, want, tol, ref=None, tol_ref=None) -> dict:
    """One output of a kernel: its relative error against the twin's output and, with
    ``ref`` (the twin evaluated in float64), against that, with the twin's own error
    against it; and the tolerances the kernel's errors are held to."""
    out = {"rel_err_vs_twin": rel_err(got, want), "tolerance_vs_twin": tol}
    if ref is not None:
        out["rel_err_vs_float64"] = rel_err(got, ref)
        out["twin_rel_err_vs_float64"] = rel_err(want, ref)
        out["tolerance_vs_float64"] = tol_ref
    return out


def _generators(seed: int, device: str) -> tuple[torch.Generator, torch.Generator]:
    """(device generator for the data, host generator for the step's layout), one seed."""
    return torch.Generator(device=device).manual_seed(seed), torch.Generator().manual_seed(seed)


def _randn(g, *shape, device, dtype=torch.float32, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=g, device=device) * scale + shift).to(dtype)


def _mamba_shapes(shape: dict) -> dict:
    heads, head_dim = shape["mamba_num_heads"], shape["mamba_head_dim"]
    groups, d_state = shape["n_groups"], shape["ssm_state_size"]
    return {"heads": heads, "head_dim": head_dim, "groups": groups, "d_state": d_state,
            "conv_dim": heads * head_dim + 2 * groups * d_state, "d_conv": shape["conv_kernel"]}


def _mamba_dt_A(g, tokens, heads, device):
    """Discretised dt log-uniform in [1e-3, 1e-1] and A uniform in [-16, -1]: the ranges
    of Mamba2's initialisation."""
    dt = torch.empty(tokens, heads, device=device).uniform_(
        math.log(1e-3), math.log(1e-1), generator=g).exp()
    A = -torch.empty(heads, device=device).uniform_(1.0, 16.0, generator=g)
    return dt, A


def _mamba_raw_dt_A(g, tokens, heads, device, dtype):
    """The recurrence's raw dt operands: dt as the projection gives it (``dtype``) and
    ``dt_bias`` per head, such that ``softplus(dt + dt_bias)`` spreads over about
    [1e-3, 1e-1] (``dt_bias`` the inverse softplus of a log-uniform draw, as Mamba2
    initialises it), and A as :func:`_mamba_dt_A`'s."""
    target, A = _mamba_dt_A(g, 1, heads, device)
    dt_bias = (target[0] + torch.log(-torch.expm1(-target[0]))).float()
    dt = _randn(g, tokens, heads, device=device, dtype=dtype, scale=0.5)
    return dt, dt_bias, A


def _decode_pages(h, rows, q, pages, device):
    """Distinct input and output pages of a uniform step. In a verify step some states
    before a row's last token are not asked for (-1): the kernel must skip them."""
    perm = torch.randperm(pages, generator=h)
    in_pages = perm[:rows].to(torch.int32)
    out_pages = perm[rows: rows + rows * q].view(rows, q).to(torch.int32).clone()
    if q > 1:
        drop = torch.rand(rows, q, generator=h) < 0.25
        drop[:, -1] = False
        out_pages[drop] = -1
    return in_pages.to(device), out_pages.to(device)


def _pages_except(pages: int, taken: torch.Tensor) -> torch.Tensor:
    keep = torch.ones(pages, dtype=torch.bool, device=taken.device)
    keep[taken] = False
    return keep.nonzero().flatten()


def check_conv_decode(shape, step, dtype, device, seed, verify):
    """``conv_decode_update`` against its twin on a decode (one token a row) or verify
    step: outputs, and the windows written to the output pages (copies of inputs: exact)."""
    g, h = _generators(seed, device)
    q = step["verify_q"] if verify else 1
    m = _mamba_shapes(shape)
    rows, channels, k = step["rows"], m["conv_dim"], m["d_conv"]
    pages = rows * (q + 1) + 2
    xbc = _randn(g, rows * q, channels, device=device, dtype=dtype)
    weight = _randn(g, channels, k, device=device, dtype=dtype, scale=0.5)
    bias = _randn(g, channels, device=device, dtype=dtype, scale=0.1)
    cache = _randn(g, pages, channels, k - 1, device=device, dtype=dtype)
    in_pages, out_pages = _decode_pages(h, rows, q, pages, device)
    written = out_pages[out_pages >= 0].long()
    cache[written] = float("nan")  # every window the kernel must write starts as NaN
    others = _pages_except(pages, written)
    untouched = cache[others].clone()
    twin_cache, cache64 = cache.clone(), cache.double()
    want = mamba_decode.conv_decode_update_reference(
        xbc, weight, bias, twin_cache, in_pages, out_pages, "silu")
    ref = mamba_decode.conv_decode_update_reference(
        xbc.double(), weight.double(), bias.double(), cache64, in_pages, out_pages, "silu")
    args = (xbc, weight, bias, cache, in_pages, out_pages, "silu")
    got = mamba_decode.conv_decode_update(*args)
    tol = _tol(dtype, 1e-5, 1e-2)
    return {
        "kernel": "conv_decode_update", "twin": "conv_decode_update_reference",
        "shapes": {"rows": rows, "q": q, "conv_dim": channels, "d_conv": k, "pages": pages,
                   "windows_written": int(written.numel())},
        "outputs": {"out": _compared(got, want, tol, ref, tol),
                    "windows": _compared(cache[written], twin_cache[written], 0.0)},
        "invariants": {"windows_written": not bool(cache[written].isnan().any()),
                       "other_pages_unchanged": torch.equal(cache[others], untouched)},
        "kernel_s": kernel_time(lambda: mamba_decode.conv_decode_update(*args), device),
    }


def check_ssm_decode(shape, step, dtype, device, seed, verify):
    """``ssm_update`` (uniform rows) against its twin on a decode or verify step: outputs and the
    float32 states written to the output pages."""
    g, h = _generators(seed, device)
    q = step["verify_q"] if verify else 1
    m = _mamba_shapes(shape)
    rows, heads, head_dim, groups, d_state = (
        step["rows"], m["heads"], m["head_dim"], m["groups"], m["d_state"])
    pages = rows * (q + 1) + 2
    tokens = rows * q
    x = _randn(g, tokens, heads, head_dim, device=device, dtype=dtype)
    dt, dt_bias, A = _mamba_raw_dt_A(g, tokens, heads, device, dtype)
    B = _randn(g, tokens, groups, d_state, device=device, dtype=dtype)
    C = _randn(g, tokens, groups, d_state, device=device, dtype=dtype)
    D = _randn(g, heads, device=device, shift=1.0, scale=0.3)
    cache = _randn(g, pages, heads, head_dim, d_state, device=device)
    in_pages, out_pages = _decode_pages(h, rows, q, pages, device)
    written = out_pages[out_pages >= 0].long()
    cache[written] = float("nan")  # every state the kernel must write starts as NaN
    others = _pages_except(pages, written)
    untouched = cache[others].clone()
    twin_cache = cache.clone()
    want = mamba_decode.ssm_update_reference(
        x, dt, A, B, C, D, twin_cache, in_pages, out_pages, dt_bias=dt_bias)
    cache64 = cache.double()
    ref = mamba_decode.ssm_update_reference(
        *(t.double() for t in (x, dt, A, B, C, D)), cache64, in_pages, out_pages,
        dt_bias=dt_bias.double())
    args = (x, dt, A, B, C, D, cache, in_pages, out_pages)
    got = mamba_decode.ssm_update(*args, dt_bias=dt_bias)
    out = {
        "kernel": "ssm_update", "twin": "ssm_update_reference",
        "shapes": {"rows": rows, "q": q, "heads": heads, "head_dim": head_dim,
                   "groups": groups, "d_state": d_state, "pages": pages,
                   "states_written": int(written.numel()), "state_dtype": "torch.float32"},
        # Both run the recurrence in float32: only the order of the sums differs.
        "outputs": {"y": _compared(got, want, 1e-4, ref, 1e-4),
                    "states": _compared(cache[written], twin_cache[written], 1e-4,
                                        cache64[written], 1e-4)},
        "invariants": {"states_written": not bool(cache[written].isnan().any()),
                       "other_pages_unchanged": torch.equal(cache[others], untouched)},
        "kernel_s": kernel_time(lambda: mamba_decode.ssm_update(*args, dt_bias=dt_bias),
                                device),
    }
    out["state_bytes_per_s"] = 2 * tokens * heads * head_dim * d_state * 4 / out["kernel_s"]
    return out


def check_conv_ssm_decode(shape, step, dtype, device, seed, verify):
    """``conv_ssm_update`` (the conv and the recurrence of a uniform step in one launch)
    against its twin on a decode or verify step: outputs, the windows (exact) and the float32
    states written to the output pages; xBC and dt are column views of one projection, as
    the mixer passes them."""
    g, h = _generators(seed, device)
    q = step["verify_q"] if verify else 1
    m = _mamba_shapes(shape)
    rows, heads, head_dim, groups, d_state, channels, k = (
        step["rows"], m["heads"], m["head_dim"], m["groups"], m["d_state"], m["conv_dim"],
        m["d_conv"])
    pages = rows * (q + 1) + 2
    tokens = rows * q
    dt0, dt_bias, A = _mamba_raw_dt_A(g, tokens, heads, device, dtype)
    proj = _randn(g, tokens, channels + heads, device=device, dtype=dtype)
    proj[:, channels:] = dt0
    xbc, dt = proj[:, :channels], proj[:, channels:]
    weight = _randn(g, channels, k, device=device, dtype=dtype, scale=0.5)
    bias = _randn(g, channels, device=device, dtype=dtype, scale=0.1)
    D = _randn(g, heads, device=device, shift=1.0, scale=0.3)
    conv_cache = _randn(g, pages, channels, k - 1, device=device, dtype=dtype)
    ssm_cache = _randn(g, pages, heads, head_dim, d_state, device=device)
    in_pages, out_pages = _decode_pages(h, rows, q, pages, device)
    written = out_pages[out_pages >= 0].long()
    conv_cache[written] = float("nan")  # every page the kernel must write starts as NaN
    ssm_cache[written] = float("nan")
    others = _pages_except(pages, written)
    untouched = (conv_cache[others].clone(), ssm_cache[others].clone())
    twin_conv, twin_ssm = conv_cache.clone(), ssm_cache.clone()
    want = mamba_decode.conv_ssm_update_reference(
        xbc, dt, weight, bias, A, D, twin_conv, twin_ssm, in_pages, out_pages, "silu",
        dt_bias=dt_bias)
    conv64, ssm64 = conv_cache.double(), ssm_cache.double()
    ref = mamba_decode.conv_ssm_update_reference(
        *(t.double() for t in (xbc, dt, weight, bias, A, D)), conv64, ssm64, in_pages,
        out_pages, "silu", dt_bias=dt_bias.double())
    args = (xbc, dt, weight, bias, A, D, conv_cache, ssm_cache, in_pages, out_pages, "silu")
    got = mamba_decode.conv_ssm_update(*args, dt_bias=dt_bias)
    # The conv output is rounded to the activations' dtype before the recurrence (as the
    # separate conv stores it): kernel and twin sum the taps in different orders, so a
    # bf16 x, B or C can round one ulp apart (the conv check's 1e-2); against float64,
    # bf16's rounding of x, B and C.
    tol = _tol(dtype, 1e-4, 1e-2)
    tol64 = _tol(dtype, 1e-4, 2e-2)
    return {
        "kernel": "conv_ssm_update", "twin": "conv_ssm_update_reference",
        "shapes": {"rows": rows, "q": q, "heads": heads, "head_dim": head_dim,
                   "groups": groups, "d_state": d_state, "conv_dim": channels, "d_conv": k,
                   "pages": pages, "pages_written": int(written.numel()),
                   "state_dtype": "torch.float32"},
        "outputs": {"y": _compared(got, want, tol, ref, tol64),
                    "windows": _compared(conv_cache[written], twin_conv[written], 0.0),
                    "states": _compared(ssm_cache[written], twin_ssm[written], tol,
                                        ssm64[written], tol64)},
        "invariants": {
            "pages_written": not bool(conv_cache[written].isnan().any()
                                      or ssm_cache[written].isnan().any()),
            "other_pages_unchanged": torch.equal(conv_cache[others], untouched[0])
            and torch.equal(ssm_cache[others], untouched[1])},
        "kernel_s": kernel_time(lambda: mamba_decode.conv_ssm_update(*args, dt_bias=dt_bias),
                                device),
    }


def _kv_step(g, h, specs, shape, step, dtype, device):
    """A packed step over a fresh paged KV cache; ``specs`` lists ``(cached, new)`` tokens
    per row. Every key and value of a row's context is random, every other slot is NaN.
    Blocks are drawn shuffled from a pool twice the size needed; tables are two blocks
    wider than the longest row needs, and past a row's own blocks every other entry names
    a block no row owns (NaN), the rest are -1: a kernel that reads past a row's context
    returns NaN. Returns ``(queries [T, H, D], k_cache, v_cache, ForwardBatch)``."""
    bs, kv, dim = step["kv_block"], shape["num_key_value_heads"], shape["head_dim"]
    need = [-(-(c + n) // bs) for c, n in specs]
    width = max(need) + 2
    num_blocks = 2 * sum(need) + width + 1
    k_cache = torch.full((num_blocks, bs, kv, dim), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    pool = torch.randperm(num_blocks, generator=h)
    tables = torch.full((len(specs), width), -1, dtype=torch.int64)
    owned, positions, slots, query_start = [], [], [], [0]
    used = 0
    for r, ((c, n), nb) in enumerate(zip(specs, need)):
        blocks = pool[used: used + nb]
        used += nb
        tables[r, :nb] = blocks
        pos = torch.arange(c + n)
        row_slots = blocks[pos // bs] * bs + pos % bs
        owned.append(row_slots)
        positions.append(pos[c:])
        slots.append(row_slots[c:])
        query_start.append(query_start[-1] + n)
    unowned = pool[used:]
    for r, nb in enumerate(need):
        tables[r, nb::2] = unowned[torch.arange(nb, width, 2) % unowned.numel()]
    owned = torch.cat(owned).to(device)
    k_cache.view(-1, kv, dim)[owned] = _randn(g, owned.numel(), kv, dim, device=device,
                                              dtype=dtype)
    v_cache.view(-1, kv, dim)[owned] = _randn(g, owned.numel(), kv, dim, device=device,
                                              dtype=dtype)
    batch = ForwardBatch(
        query_start=query_start,
        num_computed=[c for c, _ in specs],
        positions=torch.cat(positions).to(device),
        context_lens=[c + n for c, n in specs],
        block_tables=tables.to(torch.int32).to(device),
        slot_mapping=torch.cat(slots).to(device),
        state_in_page=[-1] * len(specs),
        state_out_row=[],
        state_out_offset=[],
        state_out_page=[],
    )
    queries = _randn(g, query_start[-1], shape["num_attention_heads"], dim, device=device,
                     dtype=dtype)
    return queries, k_cache, v_cache, batch


def check_attention_decode(shape, step, dtype, device, seed, verify):
    """``paged_attention_decode_triton`` against its twin on a decode or verify step over
    contexts of random lengths, into a NaN-poisoned output."""
    g, h = _generators(seed, device)
    q = step["verify_q"] if verify else 1
    rows = step["rows"]
    lo, hi = step["context"]
    contexts = torch.randint(max(lo, q), hi + 1, (rows,), generator=h)
    contexts[0] = hi
    specs = [(int(c) - q, q) for c in contexts]
    queries, k_cache, v_cache, batch = _kv_step(g, h, specs, shape, step, dtype, device)
    scale = shape["head_dim"] ** -0.5
    tables, positions, ctx = batch.block_tables, batch.positions, batch.context_lens
    want = paged_attention.paged_attention_decode_reference(
        queries, k_cache, v_cache, tables, ctx, positions, scale)
    ref = paged_attention.paged_attention_decode_reference(
        queries.double(), k_cache.double(), v_cache.double(), tables, ctx, positions, scale)
    out = torch.full_like(queries, float("nan"))

    def kern():
        return paged_attention.paged_attention_decode_triton(
            queries, k_cache, v_cache, tables, positions, scale, out=out)

    got = kern()
    tol = _tol(dtype, 1e-5, 1e-2)
    res = {
        "kernel": "paged_attention_decode_triton", "twin": "paged_attention_decode_reference",
        "shapes": {"rows": rows, "q": q, "heads": shape["num_attention_heads"],
                   "kv_heads": shape["num_key_value_heads"], "head_dim": shape["head_dim"],
                   "kv_block": step["kv_block"], "contexts": [min(ctx), max(ctx)],
                   "table_width": tables.shape[1]},
        "outputs": {"out": _compared(got, want, tol, ref, tol)},
        "invariants": {"outputs_written": not bool(got.isnan().any())},
        "kernel_s": kernel_time(kern, device),
    }
    kv_bytes = sum(ctx) * 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    res["bytes_per_s"] = (kv_bytes + 2 * queries.numel() * queries.element_size()) \
        / res["kernel_s"]
    return res


def _prefill_specs(h, step):
    """``(cached, new)`` tokens of the rows of a mixed prefill step, in random order: a
    fresh prompt, a long chunk over a cached prefix, a short chunk over a prefix, a
    decode row, a row without tokens and a short fresh prompt."""
    lo, hi = step["prefill"]

    def draw(a, b):
        return int(torch.randint(a, b + 1, (), generator=h))

    specs = [(0, draw(lo, hi)), (draw(1, hi), draw(lo, hi)), (draw(1, hi), draw(2, lo)),
             (draw(1, hi), 1), (draw(1, hi), 0), (0, draw(2, lo))]
    return [specs[i] for i in torch.randperm(len(specs), generator=h).tolist()]


def check_attention_prefill(shape, step, dtype, device, seed):
    """``paged_attention_prefill_triton`` (its default precision for the cache dtype)
    against the per-row twin on a mixed step, into a NaN-poisoned output."""
    g, h = _generators(seed, device)
    specs = _prefill_specs(h, step)
    queries, k_cache, v_cache, batch = _kv_step(g, h, specs, shape, step, dtype, device)
    scale = shape["head_dim"] ** -0.5
    ref_fn = paged_attention_prefill.paged_attention_reference
    rows = (batch.query_start, batch.context_lens, batch.block_tables, batch.positions)
    want = ref_fn(queries, k_cache, v_cache, *rows, scale)
    ref = ref_fn(queries.double(), k_cache.double(), v_cache.double(), *rows, scale)
    out = torch.full_like(queries, float("nan"))

    def kern():
        return paged_attention_prefill.paged_attention_prefill_triton(
            queries, k_cache, v_cache, batch.query_start, batch.num_computed,
            batch.block_tables, batch.positions, scale, out=out)

    got = kern()
    # bf16 caches: probabilities rounded to bf16 before the value product (flash
    # attention's choice), an error of the order of the output's own rounding.
    tol = _tol(dtype, 1e-5, 1e-2)
    return {
        "kernel": "paged_attention_prefill_triton", "twin": "paged_attention_reference",
        "shapes": {"rows": [list(s) for s in specs], "tokens": batch.num_tokens,
                   "heads": shape["num_attention_heads"],
                   "kv_heads": shape["num_key_value_heads"], "head_dim": shape["head_dim"],
                   "kv_block": step["kv_block"]},
        "outputs": {"out": _compared(got, want, tol, ref, tol)},
        "invariants": {"outputs_written": not bool(got.isnan().any())},
        "kernel_s": kernel_time(kern, device),
    }


def check_conv_varlen(shape, step, dtype, device, seed):
    """``conv_varlen`` against its per-row twin on a mixed step (rows with and without an
    initial window page; every page no row reads is NaN), into a NaN-poisoned output."""
    g, h = _generators(seed, device)
    m = _mamba_shapes(shape)
    channels, k = m["conv_dim"], m["d_conv"]
    specs = _prefill_specs(h, step)
    rows = len(specs)
    query_start = [0]
    for _, n in specs:
        query_start.append(query_start[-1] + n)
    pages = 2 * rows + 2
    # A row continuing after cached tokens reads its window's page; a fresh prompt
    # starts from zeros (-1).
    perm = torch.randperm(pages, generator=h)[:rows]
    in_pages = torch.tensor([int(p) if c > 0 else -1 for p, (c, _) in zip(perm, specs)],
                            dtype=torch.int64, device=device)
    cache = torch.full((pages, channels, k - 1), float("nan"), dtype=dtype, device=device)
    read = in_pages[in_pages >= 0]
    cache[read] = _randn(g, read.numel(), channels, k - 1, device=device, dtype=dtype)
    xbc = _randn(g, query_start[-1], channels, device=device, dtype=dtype)
    weight = _randn(g, channels, k, device=device, dtype=dtype, scale=0.5)
    bias = _randn(g, channels, device=device, dtype=dtype, scale=0.1)
    qs = torch.tensor(query_start, dtype=torch.int64, device=device)
    want = conv_varlen.conv_varlen_reference(xbc, weight, bias, cache, qs, in_pages, "silu")
    ref = conv_varlen.conv_varlen_reference(
        xbc.double(), weight.double(), bias.double(), cache.double(), qs, in_pages, "silu")
    out = torch.full_like(xbc, float("nan"))

    def kern():
        return conv_varlen.conv_varlen(xbc, weight, bias, cache, qs, in_pages, "silu", out=out)

    got = kern()
    tol = _tol(dtype, 1e-5, 1e-2)
    return {
        "kernel": "conv_varlen", "twin": "conv_varlen_reference",
        "shapes": {"rows": [list(s) for s in specs], "tokens": query_start[-1],
                   "conv_dim": channels, "d_conv": k, "pages": pages},
        "outputs": {"out": _compared(got, want, tol, ref, tol)},
        "invariants": {"outputs_written": not bool(got.isnan().any())},
        "kernel_s": kernel_time(kern, device),
    }


def _short_step(h, device, lens, interval=None):
    """The rows of a step of short rows of lengths ``lens`` (a cached prompt's tail, two
    decode rows, a fresh short prompt, an empty row, a continuation) and its pages:
    ``(lens, query_start, in_pages, out_pages, pages)``. Rows 0 and 3 start from zeros;
    every row's last token requests its state on a page of its own, and so do about a
    third of the others, or with ``interval`` every ``interval``-th token of a row (the
    engine's checkpoint grid)."""
    lens = list(lens)
    qs = [0, *torch.tensor(lens).cumsum(0).tolist()]
    tokens = qs[-1]
    pages = len(lens) + tokens + 2
    perm = torch.randperm(pages, generator=h).tolist()
    in_pages = [perm.pop() if i % 3 else -1 for i in range(len(lens))]
    if interval is None:
        want_page = (torch.rand(tokens, generator=h) < 0.3).tolist()
    else:
        want_page = [(t - qs[r] + 1) % interval == 0
                     for r in range(len(lens)) for t in range(qs[r], qs[r + 1])]
    for e in qs[1:]:
        if e:
            want_page[e - 1] = True
    out_pages = [perm.pop() if w else -1 for w in want_page]
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return lens, as_tensor(qs), as_tensor(in_pages), as_tensor(out_pages), pages


def check_conv_varlen_windows(shape, step, dtype, device, seed):
    """``conv_varlen`` with ``out_pages``: the short-row step's conv, which also writes the
    window after every token that has a page. Rows of a cached prompt's tail, decode rows
    and a short fresh prompt; windows must equal the twin's bit for bit."""
    g, h = _generators(seed, device)
    m = _mamba_shapes(shape)
    channels, k = m["conv_dim"], m["d_conv"]
    lens, qs, in_pages, out_pages, pages = _short_step(h, device, step["short_rows"])
    tokens = int(qs[-1])
    cache = torch.full((pages, channels, k - 1), float("nan"), dtype=dtype, device=device)
    read = in_pages[in_pages >= 0]
    cache[read] = _randn(g, read.numel(), channels, k - 1, device=device, dtype=dtype)
    xbc = _randn(g, tokens, channels, device=device, dtype=dtype)
    weight = _randn(g, channels, k, device=device, dtype=dtype, scale=0.5)
    bias = _randn(g, channels, device=device, dtype=dtype, scale=0.1)
    twin_cache = cache.clone()
    want = conv_varlen.conv_varlen_reference(xbc, weight, bias, twin_cache, qs, in_pages,
                                             "silu", out_pages=out_pages)
    written = out_pages[out_pages >= 0]
    others = _pages_except(pages, written)

    def kern():
        return conv_varlen.conv_varlen(xbc, weight, bias, cache, qs, in_pages, "silu",
                                       out_pages=out_pages)

    got = kern()
    tol = _tol(dtype, 1e-5, 1e-2)
    return {
        "kernel": "conv_varlen (windows)", "twin": "conv_varlen_reference",
        "shapes": {"rows": lens, "conv_dim": channels, "d_conv": k,
                   "windows_written": int(written.numel())},
        "outputs": {"out": _compared(got, want, tol)},
        "invariants": {"windows_bit_identical": torch.equal(cache[written], twin_cache[written]),
                       "other_pages_unchanged": torch.equal(cache[others].nan_to_num(7.0),
                                                            twin_cache[others].nan_to_num(7.0))},
        "kernel_s": kernel_time(kern, device),
    }


def check_ssm_short(shape, step, dtype, device, seed, prefetch=False, chunk=0, interval=None):
    """``ssm_update`` (rows of any length) against its twin on a step of short rows (a cached prompt's
    tail, decode rows, fresh short prompts): outputs and float32 states. ``prefetch``:
    the loop that loads each token's operands one token ahead
    (``KernelPolicy.token_prefetch``); ``chunk``: the walk in chunks of that many tokens
    (``KernelPolicy.short_row_chunks``); ``interval``: states on the engine's grid (else
    a third of the tokens', which cut the chunks short)."""
    g, h = _generators(seed, device)
    m = _mamba_shapes(shape)
    heads, head_dim, groups, d_state = m["heads"], m["head_dim"], m["groups"], m["d_state"]
    lens, qs, in_pages, out_pages, pages = _short_step(h, device, step["short_rows"], interval)
    tokens = int(qs[-1])
    x = _randn(g, tokens, heads, head_dim, device=device, dtype=dtype)
    dt, dt_bias, A = _mamba_raw_dt_A(g, tokens, heads, device, dtype)
    B = _randn(g, tokens, groups, d_state, device=device, dtype=dtype)
    C = _randn(g, tokens, groups, d_state, device=device, dtype=dtype)
    D = _randn(g, heads, device=device, shift=1.0, scale=0.3)
    cache = torch.full((pages, heads, head_dim, d_state), float("nan"), device=device)
    read = in_pages[in_pages >= 0].long()
    cache[read] = _randn(g, read.numel(), heads, head_dim, d_state, device=device)
    written = out_pages[out_pages >= 0].long()
    others = _pages_except(pages, written)
    twin_cache = cache.clone()
    want = mamba_decode.ssm_update_reference(
        x, dt, A, B, C, D, twin_cache, in_pages, out_pages, qs, dt_bias=dt_bias)
    cache64 = cache.double()
    ref = mamba_decode.ssm_update_reference(
        *(t.double() for t in (x, dt, A, B, C, D)), cache64, in_pages, out_pages, qs,
        dt_bias=dt_bias.double())
    args = (x, dt, A, B, C, D, cache, in_pages, out_pages, qs)
    walk = {"prefetch": prefetch, "chunk": chunk}
    got = mamba_decode.ssm_update(*args, dt_bias=dt_bias, **walk)
    return {
        "kernel": "ssm_update", "twin": "ssm_update_reference", **walk,
        "state_interval": interval,
        "shapes": {"rows": lens, "heads": heads, "head_dim": head_dim, "groups": groups,
                   "d_state": d_state, "states_written": int(written.numel()),
                   "state_dtype": "torch.float32"},
        "outputs": {"y": _compared(got, want, 1e-4, ref, 1e-4),
                    "states": _compared(cache[written], twin_cache[written], 1e-4,
                                        cache64[written], 1e-4)},
        "invariants": {"states_written": not bool(cache[written].isnan().any()),
                       "other_pages_unchanged": torch.equal(cache[others].nan_to_num(7.0),
                                                            twin_cache[others].nan_to_num(7.0))},
        "kernel_s": kernel_time(
            lambda: mamba_decode.ssm_update(*args, dt_bias=dt_bias, **walk), device),
    }


def _ssd_inputs(g, h, shape, step, device):
    """A mixed step's scan inputs in float32 (x, B and C rounded through bf16, as the
    mixer's projections make them), random initial states for every row."""
    m = _mamba_shapes(shape)
    specs = _prefill_specs(h, step)
    tokens = sum(n for _, n in specs)
    heads, head_dim, groups, d_state = m["heads"], m["head_dim"], m["groups"], m["d_state"]
    bf16 = torch.bfloat16
    x = _randn(g, tokens, heads, head_dim, device=device, dtype=bf16).float()
    dt, A = _mamba_dt_A(g, tokens, heads, device)
    B = _randn(g, tokens, groups, d_state, device=device, dtype=bf16).float()
    C = _randn(g, tokens, groups, d_state, device=device, dtype=bf16).float()
    D = _randn(g, heads, device=device, shift=1.0, scale=0.3)
    init = _randn(g, len(specs), heads, head_dim, d_state, device=device)
    shapes = {"rows": [list(s) for s in specs], "tokens": tokens, "heads": heads,
              "head_dim": head_dim, "groups": groups, "d_state": d_state}
    return specs, (x, dt, A, B, C, D, init), shapes


def _fla_unusable(device: str) -> str | None:
    if not ssd_varlen.fla_available():
        return "fla-core not importable"
    if not device.startswith("cuda"):
        return "fla-core's scan runs on CUDA only"
    return None


def check_ssd_scan(shape, step, dtype, device, seed):
    """fla-core's varlen scan (``ssd_scan_varlen_fla``) against the twin scan: outputs
    and final states of every non-empty row, from random initial states."""
    reason = _fla_unusable(device)
    if reason:
        return {"kernel": "ssd_scan_varlen_fla", "twin": "ssd_scan_varlen_reference",
                "skipped": reason}
    g, h = _generators(seed, device)
    specs, (x, dt, A, B, C, _, init), shapes = _ssd_inputs(g, h, shape, step, device)
    filled = [i for i, (_, n) in enumerate(specs) if n > 0]
    cu_cpu = torch.tensor([0] + [n for _, n in specs if n > 0]).cumsum(0)
    cu = cu_cpu.to(device)
    init = init[filled].contiguous()
    args = (x, dt, A, B, C, cu, init)
    y, final = ssd_varlen.ssd_scan_varlen_fla(*args, cu_seqlens_cpu=cu_cpu)
    y_twin, final_twin = ssd_varlen.ssd_scan_varlen_reference(*args, cu_seqlens_cpu=cu_cpu)
    y64, final64 = ssd_varlen.ssd_scan_varlen_reference(
        *(t.double() for t in (x, dt, A, B, C)), cu, init.double(), cu_seqlens_cpu=cu_cpu)
    # fla-core multiplies in tf32.
    return {
        "kernel": "ssd_scan_varlen_fla", "twin": "ssd_scan_varlen_reference",
        "dtype": "torch.float32", "shapes": shapes,
        "outputs": {"y": _compared(y, y_twin, 5e-3, y64, 5e-3),
                    "final_states": _compared(final, final_twin, 5e-3, final64, 5e-3)},
        "invariants": {},
        "kernel_s": kernel_time(
            lambda: ssd_varlen.ssd_scan_varlen_fla(*args, cu_seqlens_cpu=cu_cpu), device),
    }


def _grid_requests(specs, interval: int) -> tuple[list[int], list[int], list[int]]:
    """Packed rows of ``specs`` (``(cached, new)`` per row): their query starts and the
    state requests of a prefill step, every ``interval`` grid point and each row's end."""
    query_start, rows, offsets = [0], [], []
    for r, (c, n) in enumerate(specs):
        query_start.append(query_start[-1] + n)
        for off in range(n):
            if (c + off + 1) % interval == 0 or off == n - 1:
                rows.append(r)
                offsets.append(off)
    return query_start, rows, offsets


def check_ssd_prefill(shape, step, dtype, device, seed, chunk_states=False):
    """``ssd_prefill`` on fla-core's scan against ``ssd_prefill`` on the twin scan: outputs
    and the states at every grid point and row end of a mixed step. Without
    ``chunk_states`` every requested state cuts its row (two scans and the chain between
    them); with it, as the engine plans, states on a row's chunk grid come from the scan's
    chunk states and only the others cut."""
    reason = _fla_unusable(device)
    if chunk_states and not reason and not ssd_varlen.fla_chunk_states_available():
        reason = "this fla-core does not expose the forward pieces"
    if reason:
        return {"kernel": "ssd_prefill (fla-core scan)", "twin": "ssd_prefill (twin scan)",
                "skipped": reason}
    g, h = _generators(seed, device)
    specs, (x, dt, A, B, C, D, init), shapes = _ssd_inputs(g, h, shape, step, device)
    interval = step["state_interval"]
    query_start, rows, offsets = _grid_requests(specs, interval)
    chunk = ssd_varlen.SCAN_CHUNK if chunk_states else None
    segments = ssd_varlen.plan_segments(query_start, rows, offsets, device, chunk=chunk)
    args = (x, dt, A, B, C, D, init, segments)
    y, states = ssd_varlen.ssd_prefill(*args, ssd_varlen.ssd_scan_varlen_fla)
    y_twin, states_twin = ssd_varlen.ssd_prefill(*args, ssd_varlen.ssd_scan_varlen_reference)
    y64, states64 = ssd_varlen.ssd_prefill(
        *(t.double() for t in (x, dt, A, B, C, D, init)), segments,
        ssd_varlen.ssd_scan_varlen_reference)
    return {
        "kernel": "ssd_prefill (fla-core scan)", "twin": "ssd_prefill (twin scan)",
        "dtype": "torch.float32",
        "shapes": {**shapes, "state_interval": interval, "chunk_states": chunk_states,
                   "states": len(rows), "segments": segments.num_segments,
                   "scans": 1 if segments.single_scan else 2},
        "outputs": {"y": _compared(y, y_twin, 5e-3, y64, 5e-3),
                    "states": _compared(states, states_twin, 5e-3, states64, 5e-3)},
        "invariants": {},
        "kernel_s": kernel_time(
            lambda: ssd_varlen.ssd_prefill(*args, ssd_varlen.ssd_scan_varlen_fla), device),
    }


# The fused scans that check_ssd_fused takes: name -> (scan, label).
FUSED_SCANS = {
    "fused": (ssd_chunked.ssd_scan_fused, "fused scan"),
    "two_pass": (ssd_two_pass.ssd_scan_two_pass, "two-pass scan"),
    "chunk_states": (ssd_chunk_states.ssd_scan_chunk_states, "chunk-state scan"),
}


def check_ssd_fused(shape, step, dtype, device, seed, scan="fused"):
    """``ssd_prefill`` on a fused scan (``FUSED_SCANS[scan]``: the one-launch
    ``ssd_chunked.ssd_scan_fused``, the default ``ssd_two_pass.ssd_scan_two_pass`` or
    ``ssd_chunk_states.ssd_scan_chunk_states``; bf16 x / B / C and the raw dt as the mixer
    passes them) against the same on its torch twin, states at every grid point and row
    end of a mixed step."""
    scan, label = FUSED_SCANS[scan]
    g, h = _generators(seed, device)
    specs, (x, _, A, B, C, D, init), shapes = _ssd_inputs(g, h, shape, step, device)
    dt, dt_bias, _ = _mamba_raw_dt_A(g, x.shape[0], x.shape[1], device, torch.bfloat16)
    x, B, C = (t.to(torch.bfloat16) for t in (x, B, C))  # exact: drawn through bf16
    interval = step["state_interval"]
    query_start, rows, offsets = _grid_requests(specs, interval)
    segments = ssd_varlen.plan_segments(query_start, rows, offsets, device,
                                        chunk=ssd_varlen.SCAN_CHUNK)
    kw = dict(dt_bias=dt_bias, time_step_limit=(0.0, float("inf")))

    def kern():
        return ssd_varlen.ssd_prefill(x, dt, A, B, C, D, init, segments, scan, **kw)

    y, states = kern()
    y_twin, states_twin = ssd_varlen.ssd_prefill(
        x.float(), dt.float(), A, B.float(), C.float(), D, init, segments,
        ssd_chunked.ssd_scan_fused_reference, **kw)
    y64, states64 = ssd_varlen.ssd_prefill(
        *(t.double() for t in (x, dt, A, B, C, D, init)), segments,
        ssd_chunked.ssd_scan_fused_reference, dt_bias=dt_bias.double(),
        time_step_limit=kw["time_step_limit"])
    return {
        "kernel": f"ssd_prefill ({label})", "twin": "ssd_prefill (fused scans' twin)",
        "dtype": "torch.bfloat16",
        "shapes": {**shapes, "state_interval": interval, "states": len(rows)},
        "outputs": {"y": _compared(y, y_twin, 1e-4, y64, 1e-4),
                    "states": _compared(states, states_twin, 1e-4, states64, 1e-4)},
        "invariants": {"outputs_written": not bool(y.isnan().any() or states.isnan().any())},
        "kernel_s": kernel_time(kern, device),
    }


def check_ssd_tails(shape, step, dtype, device, seed):
    """``ssd_tail_states`` against its torch twin: the states a few tokens past chunk
    states (the off-grid checkpoints of a packed prefill), tails of 1 to 63 tokens."""
    g, h = _generators(seed, device)
    m = _mamba_shapes(shape)
    heads, head_dim, groups, d_state = m["heads"], m["head_dim"], m["groups"], m["d_state"]
    lengths = torch.randint(1, 64, (step["rows"] // 4,), generator=h).tolist()
    tokens_n = sum(lengths)
    bf16 = torch.bfloat16
    x = _randn(g, tokens_n, heads, head_dim, device=device, dtype=bf16).float()
    B = _randn(g, tokens_n, groups, d_state, device=device, dtype=bf16).float()
    dt, A = _mamba_dt_A(g, tokens_n, heads, device)
    start = _randn(g, len(lengths), heads, head_dim, d_state, device=device)
    width = max(lengths)
    perm = torch.randperm(tokens_n, generator=h)
    tokens = torch.zeros(len(lengths), width, dtype=torch.int64)
    used = 0
    for i, n in enumerate(lengths):
        tokens[i, :n] = perm[used : used + n]
        used += n
    tokens = tokens.to(device)
    lens = torch.tensor(lengths, dtype=torch.int64, device=device)
    args = (x, dt, A, B, start, tokens, lens)
    want = ssd_tails.ssd_tail_states_reference(*args)
    ref = ssd_tails.ssd_tail_states_reference(*(t.double() for t in args[:5]), tokens, lens)

    def kern():
        return ssd_tails.ssd_tail_states(*args)

    got = kern()
    return {
        "kernel": "ssd_tail_states", "twin": "ssd_tail_states_reference",
        "dtype": "torch.float32",
        "shapes": {"tails": len(lengths), "lengths": lengths, "heads": heads,
                   "head_dim": head_dim, "groups": groups, "d_state": d_state},
        "outputs": {"states": _compared(got, want, 1e-4, ref, 1e-4)},
        "invariants": {"outputs_written": not bool(got.isnan().any())},
        "kernel_s": kernel_time(kern, device),
    }


def _rms_norm64(h, weight, eps):
    h = h.double()
    return weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def check_rms_norm(shape, step, dtype, device, seed):
    """``rms_norm`` (the weight in float32, as Nemotron-H) against its twin, into a
    NaN-poisoned output."""
    g, _ = _generators(seed, device)
    rows, hidden, eps = step["rows"], shape["hidden_size"], 1e-5
    x = _randn(g, rows, hidden, device=device, dtype=dtype, scale=4.0)
    weight = _randn(g, hidden, device=device, dtype=dtype, shift=1.0, scale=0.2)
    out = torch.full_like(x, float("nan"))

    def kern():
        return norms.rms_norm(x, weight, eps, True, out=out)

    got = kern()
    want = norms.rms_norm_reference(x, weight, eps, True)
    # The twins round once to the output dtype, as the kernels do.
    tol = _tol(dtype, 1e-6, torch.finfo(dtype).eps)
    return {
        "kernel": "rms_norm", "twin": "rms_norm_reference",
        "shapes": {"rows": rows, "hidden": hidden, "weight_in_fp32": True},
        "outputs": {"out": _compared(got, want, tol, _rms_norm64(x, weight, eps), tol)},
        "invariants": {"outputs_written": not bool(got.isnan().any())},
        "kernel_s": kernel_time(kern, device),
    }


def check_add_rms_norm(shape, step, dtype, device, seed):
    """``add_rms_norm`` against its twin: the new residual (bit-identical by contract) and
    its norm, into NaN-poisoned outputs."""
    g, _ = _generators(seed, device)
    rows, hidden, eps = step["rows"], shape["hidden_size"], 1e-5
    residual = _randn(g, rows, hidden, device=device, dtype=dtype, scale=4.0)
    x = _randn(g, rows, hidden, device=device, dtype=dtype)
    weight = _randn(g, hidden, device=device, dtype=dtype, shift=1.0, scale=0.2)
    residual_out = torch.full_like(x, float("nan"))
    out = torch.full_like(x, float("nan"))

    def kern():
        return norms.add_rms_norm(residual, x, weight, eps, 1.0, True,
                                  residual_out=residual_out, out=out)

    h_got, y_got = kern()
    h_want, y_want = norms.add_rms_norm_reference(residual, x, weight, eps, 1.0, True)
    tol = _tol(dtype, 1e-6, torch.finfo(dtype).eps)
    return {
        "kernel": "add_rms_norm", "twin": "add_rms_norm_reference",
        "shapes": {"rows": rows, "hidden": hidden, "weight_in_fp32": True},
        "outputs": {"residual": _compared(h_got, h_want, 0.0),
                    "out": _compared(y_got, y_want, tol, _rms_norm64(h_want, weight, eps),
                                     tol)},
        "invariants": {"outputs_written": not bool(h_got.isnan().any() | y_got.isnan().any())},
        "kernel_s": kernel_time(kern, device),
    }


def check_gated_rms_norm(shape, step, dtype, device, seed):
    """``gated_rms_norm`` as the mixer calls it (float32 scan output, the gate a strided
    slice of the input projection, grouped, cast to the model dtype) against its twin,
    into a NaN-poisoned output."""
    g, _ = _generators(seed, device)
    m = _mamba_shapes(shape)
    rows, channels, groups, eps = step["rows"], m["heads"] * m["head_dim"], m["groups"], 1e-5
    y = _randn(g, rows, channels, device=device)
    zxbcdt = _randn(g, rows, channels + m["conv_dim"] + m["heads"], device=device, dtype=dtype)
    z = zxbcdt[:, :channels]
    weight = _randn(g, channels, device=device, dtype=dtype, shift=1.0, scale=0.2)
    out = torch.full((rows, channels), float("nan"), dtype=dtype, device=device)

    def kern():
        return norms.gated_rms_norm(y, z, weight, groups, eps, dtype, out=out)

    got = kern()
    want = norms.gated_rms_norm_reference(y, z, weight, groups, eps, dtype)
    z64 = z.double()
    gated = (y.double() * z64 * torch.sigmoid(z64)).view(rows, groups, -1)
    ref = weight.double() * (gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + eps)
                             ).view(rows, channels)
    tol = _tol(dtype, 1e-6, torch.finfo(dtype).eps)
    return {
        "kernel": "gated_rms_norm", "twin": "gated_rms_norm_reference",
        "shapes": {"rows": rows, "channels": channels, "groups": groups,
                   "x_dtype": "torch.float32", "out_dtype": str(dtype)},
        "outputs": {"out": _compared(got, want, tol, ref, tol)},
        "invariants": {"outputs_written": not bool(got.isnan().any())},
        "kernel_s": kernel_time(kern, device),
    }


def check_relu_square(shape, step, dtype, device, seed):
    """``relu_square_`` (relu2 in place) over an MLP activation of the step's rows against
    its twin: the twin's bits by contract, every entry written."""
    g, _ = _generators(seed, device)
    rows, width = step["rows"], shape["intermediate_size"]
    x = _randn(g, rows, width, device=device, dtype=dtype)
    buf = torch.full_like(x, float("nan"))

    def kern():
        buf.copy_(x)
        return activations.relu_square_(buf)

    got = kern()
    want = activations.relu_square_reference(x)
    return {
        "kernel": "relu_square_", "twin": "relu_square_reference",
        "shapes": {"rows": rows, "width": width},
        "outputs": {"out": _compared(got, want, 0.0, torch.square(torch.relu(x.double())),
                                     _tol(dtype, 1e-7, torch.finfo(dtype).eps))},
        "invariants": {"outputs_written": not bool(got.isnan().any())},
        "kernel_s": kernel_time(kern, device),
    }


def check_state_postprocess(shape, step, dtype, device, seed):
    """``state_postprocess`` against its twin on a verify step (rows of 1 to ``verify_q``
    tokens over non-contiguous slots, about half of them crossing a grid point), into
    outputs poisoned with ``INT_POISON``. Integer outputs: the relative error is the
    fraction of entries that differ."""
    _, h = _generators(seed, device)
    rows, q_max, interval = step["rows"], step["verify_q"], step["state_interval"]
    num_slots = 4 * rows + 3
    slots = torch.randperm(num_slots, generator=h)[:rows]
    num_computed = torch.randint(1, 64 * interval, (num_slots,), generator=h)
    q = torch.randint(1, q_max + 1, (rows,), generator=h)
    near = torch.rand(rows, generator=h) < 0.5
    grid = torch.randint(1, 64, (rows,), generator=h) * interval
    back = torch.randint(0, q_max, (rows,), generator=h)
    num_computed[slots[near]] = (grid - 1 - back)[near].clamp(min=0)
    accepted = (torch.rand(rows, generator=h) * q).long() + 1
    pages = torch.randperm(rows * q_max + num_slots + 8, generator=h)
    cols = torch.arange(q_max)[None, :]
    out_pages = torch.where(cols < q[:, None], pages[: rows * q_max].view(rows, q_max), -1)
    state_page = pages[rows * q_max: rows * q_max + num_slots].clone()
    state_page[torch.rand(num_slots, generator=h) < 0.1] = -1
    step_args = dict(
        idx_mapping=slots.to(torch.int32).to(device),
        num_computed=num_computed.to(torch.int32).to(device),
        num_accepted=accepted.to(torch.int32).to(device),
        out_pages=out_pages.to(torch.int32).to(device),
        state_page=state_page.to(torch.int32).to(device),
        release_prev=(torch.rand(rows, generator=h) < 0.7).to(device),
        boundary_interval=interval,
    )
    want = state_postprocess.state_postprocess_reference(**step_args)
    out = state_postprocess.PostprocessResult(
        *(torch.full_like(getattr(want, f.name), INT_POISON)
          for f in dataclasses.fields(state_postprocess.PostprocessResult)))

    def kern():
        return state_postprocess.state_postprocess(**step_args, out=out)

    got = kern()
    in_batch = torch.zeros(num_slots, dtype=torch.bool, device=device)
    in_batch[step_args["idx_mapping"].long()] = True
    differ = total = 0
    untouched = True
    for f in dataclasses.fields(state_postprocess.PostprocessResult):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if f.name in ("new_state_page", "new_num_computed"):
            # Slots outside the batch are the caller's: the kernel must leave them alone.
            untouched &= bool((a[~in_batch] == INT_POISON).all())
            a, b = a[in_batch], b[in_batch]
        differ += int((a != b).sum())
        total += a.numel()
    return {
        "kernel": "state_postprocess", "twin": "state_postprocess_reference",
        "dtype": "torch.int32",
        "shapes": {"rows": rows, "max_q": q_max, "slots": num_slots,
                   "state_interval": interval,
                   "rows_crossing": int((want.ckpt_page[:, 0] >= 0).sum())},
        "outputs": {"decisions": {"rel_err_vs_twin": differ / total,
                                  "tolerance_vs_twin": 0.0}},
        "invariants": {"other_slots_untouched": untouched},
        "kernel_s": kernel_time(kern, device),
    }


def check_state_copy(shape, step, dtype, device, seed):
    """``state_copy`` against its twin over every Mamba layer (conv windows in the model
    dtype, float32 SSM states): ``copy_rows`` page pairs, one row skipped on each side
    (-1), every destination page NaN before the copy. Copies: exact."""
    g, h = _generators(seed, device)
    m = _mamba_shapes(shape)
    layers, rows = shape["pattern"].count("M"), step["copy_rows"]
    pages = 2 * rows + 4
    conv = [_randn(g, pages, m["conv_dim"], m["d_conv"] - 1, device=device, dtype=dtype)
            for _ in range(layers)]
    ssm = [_randn(g, pages, m["heads"], m["head_dim"], m["d_state"], device=device)
           for _ in range(layers)]
    perm = torch.randperm(pages, generator=h).to(torch.int32)
    src, dst = perm[:rows].clone(), perm[rows: 2 * rows].clone()
    src[0], dst[-1] = -1, -1
    active = (src >= 0) & (dst >= 0)
    written = dst[active].long().to(device)
    for t in (*conv, *ssm):
        t[written] = float("nan")
    src, dst = src.to(device), dst.to(device)
    twin_conv, twin_ssm = [t.clone() for t in conv], [t.clone() for t in ssm]
    state_postprocess.state_copy_reference(src, dst, twin_conv, twin_ssm)
    state_postprocess.state_copy(src, dst, conv, ssm)
    got, want = conv + ssm, twin_conv + twin_ssm
    err = max(rel_err(a[written], b[written]) for a, b in zip(got, want))
    plan = state_postprocess.StateCopyPlan(conv, ssm)
    res = {
        "kernel": "state_copy", "twin": "state_copy_reference",
        "shapes": {"layers": layers, "rows": rows, "rows_copied": int(active.sum()),
                   "pages": pages, "page_bytes": plan.page_bytes,
                   "conv_dtype": str(dtype), "ssm_dtype": "torch.float32"},
        "outputs": {"pages": {"rel_err_vs_twin": err, "tolerance_vs_twin": 0.0}},
        "invariants": {"same_as_twin": all(torch.equal(a, b) for a, b in zip(got, want))},
        # The launch alone: a hot path builds the page table once (StateCopyPlan).
        "kernel_s": kernel_time(lambda: plan(src, dst), device),
    }
    res["bytes_per_s"] = 2 * int(active.sum()) * plan.page_bytes / res["kernel_s"]
    return res


def _gdn_shapes(device: str) -> dict:
    """One Qwen3.6-27B Gated DeltaNet layer on CUDA (16 key heads, 48 value heads, head
    dims 128); a tiny one under the CPU interpreter."""
    if device.startswith("cuda"):
        return {"hk": 16, "hv": 48, "dk": 128, "dv": 128}
    return {"hk": 2, "hv": 4, "dk": 8, "dv": 8}


def _gdn_inputs(g, tokens, s, dtype, device):
    """``(q, k, v, a, b)`` as the mixer hands them to the recurrence: q, k L2-normalised
    (q scaled by ``dk ** -0.5``), v, and the projections' raw gate inputs ``a, b`` (in
    ``dtype``); and the gate parameters ``{A_log, dt_bias}`` (float32) that make the
    decays exp(g) span about (0.05, 1)."""
    q = torch.nn.functional.normalize(_randn(g, tokens, s["hk"], s["dk"], device=device), dim=-1)
    k = torch.nn.functional.normalize(_randn(g, tokens, s["hk"], s["dk"], device=device), dim=-1)
    q = (q * s["dk"] ** -0.5).to(dtype)
    k = k.to(dtype)
    v = _randn(g, tokens, s["hv"], s["dv"], device=device, dtype=dtype)
    a = _randn(g, tokens, s["hv"], device=device, dtype=dtype, scale=1.5)
    b = _randn(g, tokens, s["hv"], device=device, dtype=dtype, scale=2.0)
    gate = {"A_log": _randn(g, s["hv"], device=device, scale=0.5),
            "dt_bias": _randn(g, s["hv"], device=device, scale=0.5)}
    return (q, k, v, a, b), gate


def _gdn_result(kernel, twin, shapes, got, want, ref, cache, twin_cache, cache64, written,
                others, run, device) -> dict:
    """A GDN check's record: outputs and written states against the twin and float64,
    every requested state written, no other page touched, the kernel's time."""
    return {
        "kernel": kernel, "twin": twin, "shapes": {**shapes, "state_dtype": "torch.float32"},
        "outputs": {"o": _compared(got, want, 1e-4, ref, 1e-4),
                    "states": _compared(cache[written], twin_cache[written], 1e-4,
                                        cache64[written], 1e-4)},
        "invariants": {"states_written": not bool(cache[written].isnan().any()),
                       "other_pages_unchanged": torch.equal(cache[others].nan_to_num(7.0),
                                                            twin_cache[others].nan_to_num(7.0))},
        "kernel_s": kernel_time(run, device),
    }


def check_gdn_decode(shape, step, dtype, device, seed, verify):
    """``gdn_decode_update`` against its twin on a decode or verify step of one Gated
    DeltaNet layer: outputs and the float32 states written to the output pages."""
    g, h = _generators(seed, device)
    s = _gdn_shapes(device)
    q_len = step["verify_q"] if verify else 1
    rows = step["rows"]
    pages = rows * (q_len + 1) + 2
    inputs, gate = _gdn_inputs(g, rows * q_len, s, dtype, device)
    gate64 = {k: t.double() for k, t in gate.items()}
    perm = torch.randperm(pages, generator=h)
    in_pages = perm[:rows].to(torch.int32).to(device)
    out_pages = perm[rows : rows + rows * q_len].view(rows, q_len).to(torch.int32).to(device)
    cache = torch.full((pages, s["hv"], s["dk"], s["dv"]), float("nan"), device=device)
    cache[in_pages.long()] = _randn(g, rows, s["hv"], s["dk"], s["dv"], device=device)
    written = out_pages.flatten().long()
    twin_cache, cache64 = cache.clone(), cache.double()
    want = gdn_decode.gdn_decode_update_reference(*inputs, twin_cache, in_pages, out_pages,
                                                  **gate)
    ref = gdn_decode.gdn_decode_update_reference(
        *(t.double() for t in inputs), cache64, in_pages, out_pages, **gate64)
    args = (*inputs, cache, in_pages, out_pages)
    got = gdn_decode.gdn_decode_update(*args, **gate)
    return _gdn_result("gdn_decode_update", "gdn_decode_update_reference",
                       {"rows": rows, "q": q_len, **s}, got, want, ref, cache, twin_cache,
                       cache64, written, _pages_except(pages, written),
                       lambda: gdn_decode.gdn_decode_update(*args, **gate), device)


def check_gdn_varlen(shape, step, dtype, device, seed):
    """``gdn_varlen_update`` against its twin on a step of rows of mixed lengths (the
    short-row step's layout): outputs and the states written at requested offsets."""
    g, h = _generators(seed, device)
    s = _gdn_shapes(device)
    lens, qs, in_pages, out_pages, pages = _short_step(h, device, step["short_rows"])
    inputs, gate = _gdn_inputs(g, int(qs[-1]), s, dtype, device)
    gate64 = {k: t.double() for k, t in gate.items()}
    cache = torch.full((pages, s["hv"], s["dk"], s["dv"]), float("nan"), device=device)
    read = in_pages[in_pages >= 0].long()
    cache[read] = _randn(g, read.numel(), s["hv"], s["dk"], s["dv"], device=device)
    written = out_pages[out_pages >= 0].long()
    twin_cache, cache64 = cache.clone(), cache.double()
    want = gdn_varlen.gdn_varlen_update_reference(*inputs, twin_cache, qs, in_pages, out_pages,
                                                  **gate)
    ref = gdn_varlen.gdn_varlen_update_reference(
        *(t.double() for t in inputs), cache64, qs, in_pages, out_pages, **gate64)
    args = (*inputs, cache, qs, in_pages, out_pages)
    got = gdn_varlen.gdn_varlen_update(*args, **gate)
    return _gdn_result("gdn_varlen_update", "gdn_varlen_update_reference",
                       {"rows": lens, **s, "states_written": int(written.numel())}, got, want,
                       ref, cache, twin_cache, cache64, written, _pages_except(pages, written),
                       lambda: gdn_varlen.gdn_varlen_update(*args, **gate), device)

def check_moe_experts(shape, step, dtype, device, seed):
    """``moe_experts`` (sort by expert + the two grouped launches) against its twin on
    ``rows`` tokens routed top-k over the experts of a Nemotron 3 Nano MoE layer on CUDA
    (a tiny one on the CPU), and against the twin in float64."""
    g, h = _generators(seed, device)
    tokens = step["rows"]
    if device.startswith("cuda"):
        hidden, inter, experts, top_k = 2688, 1856, 128, 6
    else:
        hidden, inter, experts, top_k = 40, 24, 8, 2
    x = _randn(g, tokens, hidden, device=device, dtype=dtype)
    w1 = _randn(g, experts, inter, hidden, device=device, dtype=dtype, scale=hidden**-0.5)
    w2 = _randn(g, experts, hidden, inter, device=device, dtype=dtype, scale=inter**-0.5)
    ids = torch.stack([torch.randperm(experts, generator=h)[:top_k] for _ in range(tokens)])
    ids = ids.to(device)
    weights = torch.rand(tokens, top_k, generator=h).to(device)
    args = dict(gated=False, activation="relu2")

    def kern():
        return moe.moe_experts(x, w1, w2, ids, weights, **args)

    got = kern()
    if device.startswith("cuda"):
        # The gathered twin would hold tokens * top_k expert matrices: use a slice.
        few = min(tokens, 8)
        got_few = moe.moe_experts(x[:few], w1, w2, ids[:few], weights[:few], **args)
    else:
        few, got_few = tokens, got
    want = moe.moe_experts_reference(x[:few], w1, w2, ids[:few], weights[:few], **args)
    ref = moe.moe_experts_reference(x[:few].double(), w1.double(), w2.double(), ids[:few],
                                    weights[:few].double(), **args)
    tol = _tol(dtype, 1e-5, 2e-2)
    touched = int(ids.unique().numel())
    res = {
        "kernel": "moe_experts", "twin": "moe_experts_reference",
        "shapes": {"tokens": tokens, "hidden": hidden, "intermediate": inter,
                   "experts": experts, "top_k": top_k, "experts_touched": touched,
                   "compared_tokens": few},
        "outputs": {"y": _compared(got_few, want, tol, ref, tol)},
        "invariants": {"outputs_finite": bool(got.isfinite().all())},
        "kernel_s": kernel_time(kern, device),
    }
    res["bytes_per_s"] = touched * (w1[0].nbytes + w2[0].nbytes) / res["kernel_s"]
    return res


def check_sampling_draw(shape, step, dtype, device, seed):
    """The sampled draw as one pass (``sampling.draw``) against the torch draw
    (``sampler.draw``) at the model's vocabulary: rows at temperature 1 with a top-p-like
    cut (``-inf`` past each row's 200 best tokens), every other row greedy. The output
    is tokens: the check holds the kernel to the same token and the same winning key in
    every row (the keys are float64 on both sides)."""
    g, _ = _generators(seed, device)
    rows, vocab = step["rows"], shape["vocab_size"]
    logits = _randn(g, rows, vocab, device=device, scale=3.0)
    kth = logits.topk(min(200, vocab), dim=-1).values[:, -1:]
    logp = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
    greedy = torch.arange(rows, device=device) % 2 == 1
    seed_lo = torch.randint(0, 2**31 - 1, (rows,), generator=g, device=device)
    seed_hi = torch.randint(0, 2**31 - 1, (rows,), generator=g, device=device)
    index = torch.randint(0, 2**20, (rows,), generator=g, device=device)

    def kern():
        return sampling.draw(logp, greedy, seed_lo, seed_hi, index, return_keys=True)

    got, keys = kern()
    want = sampler.draw(logp, greedy, seed_lo, seed_hi, index, kernels="reference")
    u = sampler.uniforms(seed_lo, seed_hi, index, vocab)
    twin_keys = torch.where(greedy[:, None], logp.double(), logp.double() - torch.log(-torch.log(u)))
    twin_keys = twin_keys.gather(1, want[:, None])[:, 0]
    return {
        "kernel": "sampling.draw", "twin": "sampler.draw",
        "shapes": {"rows": rows, "vocab": vocab, "splits": sampling.num_splits(rows, vocab)},
        "outputs": {"tokens": {"rel_err_vs_twin": float((got != want).float().mean()),
                               "tolerance_vs_twin": 0.0},
                    "keys": _compared(keys, twin_keys, 0.0)},
        "invariants": {"tokens_in_vocab": bool(((got >= 0) & (got < vocab)).all())},
        "kernel_s": kernel_time(kern, device),
    }


# (name, module of hybridserve.kernels, check, keyword arguments). Every module with a
# Triton kernel has at least one check (the smoke test holds the script to it).
KERNEL_CHECKS = [
    ("conv_decode_update (decode)", "mamba_decode", check_conv_decode, {"verify": False}),
    ("conv_decode_update (verify)", "mamba_decode", check_conv_decode, {"verify": True}),
    ("ssm_update (decode)", "mamba_decode", check_ssm_decode, {"verify": False}),
    ("ssm_update (verify)", "mamba_decode", check_ssm_decode, {"verify": True}),
    # Verify rows only (the unrolled row length covers q = 1 too; the interpreter's smoke
    # run is slow on this kernel): bench_decode_kernels.py times decode and verify.
    ("conv_ssm_update (verify)", "mamba_decode", check_conv_ssm_decode, {"verify": True}),
    ("paged_attention_decode (decode)", "paged_attention", check_attention_decode,
     {"verify": False}),
    ("paged_attention_decode (verify)", "paged_attention", check_attention_decode,
     {"verify": True}),
    ("paged_attention_prefill", "paged_attention_prefill", check_attention_prefill, {}),
    ("conv_varlen", "conv_varlen", check_conv_varlen, {}),
    ("conv_varlen (windows)", "conv_varlen", check_conv_varlen_windows, {}),
    ("ssm_update (short rows)", "mamba_decode", check_ssm_short, {}),
    ("ssm_update (short rows, prefetch)", "mamba_decode", check_ssm_short, {"prefetch": True}),
    ("ssm_update (short rows, chunks of 16)", "ssm_chunks", check_ssm_short, {"chunk": 16}),
    # States on the engine's 64-token grid (and at row ends), where chunks are full.
    ("ssm_update (short rows, grid)", "mamba_decode", check_ssm_short,
     {"prefetch": True, "interval": 64}),
    ("ssm_update (short rows, grid, chunks of 16)", "ssm_chunks", check_ssm_short,
     {"chunk": 16, "interval": 64}),
    ("ssm_update (short rows, grid, chunks of 32)", "ssm_chunks", check_ssm_short,
     {"chunk": 32, "interval": 64}),
    ("ssd_scan_varlen_fla", "ssd_varlen", check_ssd_scan, {}),
    ("ssd_prefill", "ssd_varlen", check_ssd_prefill, {}),
    ("ssd_prefill (chunk states)", "ssd_varlen", check_ssd_prefill, {"chunk_states": True}),
    ("ssd_prefill (fused scan)", "ssd_chunked", check_ssd_fused, {}),
    ("ssd_prefill (two-pass scan)", "ssd_two_pass", check_ssd_fused, {"scan": "two_pass"}),
    ("ssd_prefill (chunk-state scan)", "ssd_chunk_states", check_ssd_fused,
     {"scan": "chunk_states"}),
    ("ssd_tail_states", "ssd_tails", check_ssd_tails, {}),
    ("rms_norm", "norms", check_rms_norm, {}),
    ("add_rms_norm", "norms", check_add_rms_norm, {}),
    ("gated_rms_norm", "norms", check_gated_rms_norm, {}),
    ("relu_square_", "activations", check_relu_square, {}),
    ("state_postprocess", "state_postprocess", check_state_postprocess, {}),
    ("state_copy", "state_postprocess", check_state_copy, {}),
    ("gdn_decode_update (decode)", "gdn_decode", check_gdn_decode, {"verify": False}),
    ("gdn_decode_update (verify)", "gdn_decode", check_gdn_decode, {"verify": True}),
    ("gdn_varlen_update", "gdn_varlen", check_gdn_varlen, {}),
    ("moe_experts", "moe", check_moe_experts, {}),
    ("sampling.draw", "sampling", check_sampling_draw, {}),
]


def _worst(values) -> float | None:
    """The largest of ``values`` (NaN when any is NaN; None when there are none)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    if any(math.isnan(v) for v in values):
        return float("nan")
    return max(values)


def _failures(entry: dict) -> list[str]:
    """What holds a check back from passing: an error over its tolerance (NaN fails), a
    broken invariant."""
    out = []
    for name, o in entry["outputs"].items():
        for key in ("vs_twin", "vs_float64"):
            err, tol = o.get(f"rel_err_{key}"), o.get(f"tolerance_{key}")
            if err is not None and tol is not None and not err <= tol:
                out.append(f"{name}: rel_err_{key} {err:.3g} > {tol:.3g}")
    out += [f"{k} is false" for k, v in entry["invariants"].items() if not v]
    return out


def kernel_checks(shape: dict, step: dict, device: str, dtype: torch.dtype, seed: int) -> dict:
    """Every Triton kernel of ``hybridserve.kernels`` (and fla-core's scan behind
    ``ssd_prefill``) against its torch twin on fresh random inputs drawn from ``seed``.

    Per check: the shapes, the dtype, each output's relative error against the twin's,
    against the twin evaluated in float64 where that is cheap, and the twin's own error
    against float64; the kernel's median time (``triton.testing.do_bench`` on CUDA);
    pass or fail against the stated tolerances and invariants (every output written:
    outputs into caller buffers start as NaN; nothing else changed). A check that raises
    is recorded as an error and the others run.
    """
    checks = []
    interpretable = device.startswith("cuda") or triton.knobs.runtime.interpret
    for name, module, fn, kw in KERNEL_CHECKS:
        if not interpretable:
            checks.append({"name": name, "module": module, "status": "skipped",
                           "reason": "Triton kernels on the CPU need TRITON_INTERPRET=1"})
            continue
        entry = {"name": name, "module": module, "dtype": str(dtype), "seed": seed}
        t = time.perf_counter()
        try:
            entry.update(fn(shape, step, dtype, device, seed, **kw))
            if "skipped" in entry:
                entry["status"], entry["reason"] = "skipped", entry.pop("skipped")
            else:
                for key in ("rel_err_vs_twin", "rel_err_vs_float64", "twin_rel_err_vs_float64"):
                    entry[key] = _worst(o.get(key) for o in entry["outputs"].values())
                entry["failures"] = _failures(entry)
                entry["status"] = "fail" if entry["failures"] else "pass"
        except Exception as e:  # record it and check the other kernels
            entry["status"] = "error"
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["traceback"] = _portable_traceback()
        entry["check_s"] = time.perf_counter() - t
        if entry["status"] in ("fail", "error"):
            print(f"[{entry['status']}] kernel check {name}: "
                  f"{entry.get('error') or '; '.join(entry['failures'])}", flush=True)
        checks.append(entry)
        free_memory(device)
    counts = {s: sum(c["status"] == s for c in checks)
              for s in ("pass", "fail", "error", "skipped")}
    return {"seed": seed, "device": device, "dtype": str(dtype), "counts": counts,
            "checks": checks}


def print_kernel_checks(kc: dict) -> None:
    """One line per kernel check: its largest relative errors, time and status."""
    counts = kc.get("counts") or {}
    print(f"kernel checks (seed {kc['seed']}, {kc['device']}, {kc['dtype']}): "
          + ", ".join(f"{v} {k}" for k, v in counts.items()))
    print(f"{'kernel':<32} {'vs twin':>9} {'vs f64':>9} {'twin f64':>9} {'us':>9}  status")

    def num(v, fmt=".1e"):
        return f"{v:>9{fmt}}" if v is not None else f"{'-':>9}"

    for c in kc["checks"]:
        status = c["status"]
        if status == "skipped":
            status = f"skipped: {c['reason']}"
        elif status == "error":
            status = f"error: {c['error'][:60]}"
        elif status == "fail":
            status = f"FAIL: {'; '.join(c['failures'])[:80]}"
        us = 1e6 * c["kernel_s"] if "kernel_s" in c else None
        print(f"{c['name']:<32} {num(c.get('rel_err_vs_twin'))} "
              f"{num(c.get('rel_err_vs_float64'))} {num(c.get('twin_rel_err_vs_float64'))} "
              f"{num(us, '.1f')}  {status}")


# --------------------------------------------------------------------------------------
# Numerics: state error against float64 at bf16 activations' rounding
# --------------------------------------------------------------------------------------


def numerics(device, shape, decode_steps=256, decode_rows=2, prefill_rows=(4096, 4096),
             seed=0):
    """One Mamba2 layer of ``shape`` with bfloat16 activations (x, B, C, the raw dt, the
    dt_bias and D weights rounded to bfloat16; A and the state pages float32): the state's
    relative error against a float64 recurrence of the same rounded inputs

    - after 1 and ``decode_steps`` decode steps through the engine's decode recurrence
      (``ssm_update``: the Triton kernel on CUDA, its twin elsewhere), each step from the
      page the previous one wrote (:mod:`hybridserve.testing.numerics`, the drift test's
      driver), and
    - at the end of prefill rows of ``prefill_rows`` tokens through the engine's prefill
      path (dt discretised as the mixer does, then ``ssd_prefill`` on the packed path's
      scan: fla-core's on CUDA, the twin's elsewhere).

    ``bf16_dt`` rows repeat each with dt discretised in bfloat16 (the arithmetic before
    the decode kernels took the raw dt; float32 recurrence otherwise), for comparison. The
    bf16-vs-float32 greedy agreement is the ``agreement`` section's (not repeated here)."""
    from hybridserve.kernels.ssd import discretize_dt
    from hybridserve.models.step_plan import packed_scan
    from hybridserve.testing import numerics as nm

    m = _mamba_shapes(shape)
    heads, head_dim, groups, d_state = m["heads"], m["head_dim"], m["groups"], m["d_state"]
    g = torch.Generator(device=device).manual_seed(seed)
    _rel = nm.rel_err

    # Decode: one launch per step, page to page (the engine's single-token step: no clamp).
    on_gpu = device.startswith("cuda")
    keep = (1, decode_steps)
    v = nm.decode_at_bf16_rounding(g, decode_steps, decode_rows, heads, head_dim, groups,
                                   d_state, device)
    after = nm.decode_states(
        mamba_decode.ssm_update if on_gpu else mamba_decode.ssm_update_reference, v,
        decode_steps, keep)
    want = nm.reference_states(
        v, discretize_dt(v["dt"].double(), v["dt_bias"].double(), None), keep)
    old = nm.reference_states(v, discretize_dt(v["dt"], v["dt_bias"], None), keep,
                              torch.float32)
    decode = {
        "kernel": "ssm_update" if on_gpu else "ssm_update_reference",
        "rows": decode_rows, "steps": decode_steps,
        **{f"state_rel_err_after_{t}": _rel(after[t], want[t]) for t in keep},
        "bf16_dt": {f"state_rel_err_after_{t}": _rel(old[t], want[t]) for t in keep},
    }
    del want, old, after
    free_memory(device)

    # Prefill: the packed path's scan from zero states, the final state of every row.
    lens = list(prefill_rows)
    qs = [0]
    for n in lens:
        qs.append(qs[-1] + n)
    v = nm.decode_at_bf16_rounding(g, qs[-1], 1, heads, head_dim, groups, d_state, device)
    # The engine's packed scan: the fused Triton scan on CUDA, its fused twin elsewhere
    # (the same call, raw dt and dt_bias, so the CPU smoke run takes the GPU's branch).
    on_cpu_policy = KernelPolicy(packed_prefill="auto" if on_gpu else "reference")
    scan = packed_scan(on_cpu_policy, torch.device(device), torch.float32)
    # The previous arithmetic: dt discretised in bf16, then a plain scan (fla-core's on
    # CUDA where importable, the reference elsewhere).
    plain = (ssd_varlen.ssd_scan_varlen_fla if on_gpu and ssd_varlen.fla_available()
             else ssd_varlen.ssd_scan_varlen_reference)
    ends = [n - 1 for n in lens]

    def plan(scan_fn):
        chunk = ssd_varlen.SCAN_CHUNK if ssd_varlen.chunk_states_supported(scan_fn) else None
        return ssd_varlen.plan_segments(qs, list(range(len(lens))), ends, device, chunk)

    zeros = torch.zeros(len(lens), heads, head_dim, d_state, device=device)
    x, B, C = v["x"], v["B"], v["C"]
    limit = (0.0, math.inf)
    # Raw dt: the fused scan discretises it in float32 inside its kernel; x, B, C bf16.
    _, got = ssd_varlen.ssd_prefill(x, v["dt"], v["A"], B, C, v["D"], zeros, plan(scan), scan,
                                    dt_bias=v["dt_bias"], time_step_limit=limit)
    dt64 = ssd_varlen.discretize_dt_varlen(v["dt"].double(), v["dt_bias"].double(), limit)
    ref = ssd_varlen.ssd_scan_varlen_reference
    _, want = ssd_varlen.ssd_prefill(
        x.double(), dt64, v["A"].double(), B.double(), C.double(), v["D"].double(),
        zeros.double(), plan(ref), ref)
    dt_bf16 = ssd_varlen.discretize_dt_varlen(v["dt"], v["dt_bias"], limit).float()
    _, old = ssd_varlen.ssd_prefill(x, dt_bf16, v["A"], B, C, v["D"], zeros, plan(plain),
                                    plain)
    prefill = {
        "scan": getattr(scan, "func", scan).__name__, "rows": lens,
        "final_state_rel_err": _rel(got, want),
        "bf16_dt": {"scan": getattr(plain, "func", plain).__name__,
                    "final_state_rel_err": _rel(old, want)},
    }
    free_memory(device)
    return {
        "layer": {"heads": heads, "head_dim": head_dim, "groups": groups, "d_state": d_state,
                  "activations": "torch.bfloat16", "state_dtype": "torch.float32"},
        "decode": decode,
        "prefill": prefill,
        "bf16_vs_float32_greedy_agreement": "see the agreement section",
    }


# --------------------------------------------------------------------------------------
# bf16 GPU vs float32 CPU agreement on a tiny model
# --------------------------------------------------------------------------------------


def agreement(device, dtype, workdir: Path, prompts=8, prompt_len=24, new_tokens=32,
              arch="nemotron_h", layers="M*-M-M*-", **overrides):
    """Greedy tokens of a tiny random ``arch`` checkpoint (``layers``, ``overrides`` as in
    :func:`~hybridserve.testing.tiny_models.make_tiny_checkpoint`) on ``device`` in
    ``dtype`` against the CPU's float32 run, decode graphs on and off; ``transformers``:
    the reference implementation's own greedy tokens in ``dtype`` on ``device`` against
    the same float32 run (the baseline: what the dtype alone costs) and against ours."""
    from hybridserve.testing.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(arch, workdir / f"tiny_{arch}", seed=5, layers=layers,
                                **overrides)
    g = torch.Generator().manual_seed(11)
    ids = [torch.randint(3, 256, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in
           LLM(str(path), device="cpu", dtype="float32").generate(ids, params, use_tqdm=False)]

    def generate(dt, enforce_eager):
        llm = with_engine(LLM(str(path), device=device, dtype=dt), enforce_eager, device)
        got = [o.outputs[0].token_ids for o in llm.generate(ids, params, use_tqdm=False)]
        graphs = llm.engine.runner.graphs
        return got, (dict(graphs.counters) if graphs is not None else None)

    def agree(want, got):
        first_div, same = [], 0
        for a, b in zip(want, got):
            same += sum(x == y for x, y in zip(a, b))
            first_div.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None))
        return {"positional_agreement": same / (prompts * new_tokens),
                "identical_sequences": sum(d is None for d in first_div),
                "first_divergence": first_div}

    def compare(dt):
        # Decode graphs on (replayed on CUDA; the static-buffer step on the CPU) and off.
        got, counters = generate(dt, False)
        eager, _ = generate(dt, True)
        return {"dtype": dt, **agree(ref, got), "graph_counters": counters,
                "eager_vs_cpu": agree(ref, eager), "graphs_vs_eager": agree(eager, got),
                "_tokens": got}

    def transformers_agreement(dt):
        # The reference implementation in the same dtype on the same device, against the
        # same float32 tokens (ours on the CPU, equal to transformers' by the parity
        # tests): how far the dtype alone moves greedy tokens of this model.
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=getattr(torch, dt)).to(device).eval()
        got = []
        with torch.no_grad():
            for row in ids:
                x = torch.tensor([row], device=device)
                y = hf.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=0, eos_token_id=None)
                got.append(y[0, prompt_len:].tolist())
        del hf
        return {"dtype": dt, **agree(ref, got), "ours_vs_transformers": agree(ours, got)}

    out = {"prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens,
           "reference": "cpu float32", "device": device, **compare(dtype)}
    ours = out.pop("_tokens")
    try:
        out["transformers"] = transformers_agreement(dtype)
    except Exception as e:  # a baseline that cannot run is recorded, not fatal
        out["transformers"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    if dtype != "float32":
        # Same device, float32: isolates the fast kernels from bf16 rounding.
        out["float32_on_device"] = compare("float32")
        out["float32_on_device"].pop("_tokens")
    return out


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def _portable_traceback() -> str:
    """The current exception's traceback (its last 2,000 characters), with this
    repository's folder left out of file names."""
    return traceback.format_exc()[-2000:].replace(str(ROOT) + "/", "")


def plot(result: dict, png: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    fig, ax = plt.subplots(figsize=(6, 4))
    ours = result.get("decode", {}).get("ours", [])
    if ours:
        ax.plot([r["batch"] for r in ours], [r["tokens_per_s"] for r in ours], "o-",
                label="hybridserve (fast paths, CUDA graphs)")
        ax.plot([r["batch"] for r in ours], [r["roofline_tokens_per_s"] for r in ours], "k--",
                label="roofline (bytes / copy bandwidth)")
    for key, label in (("ours_eager", "hybridserve (fast paths, eager)"),
                       ("reference_paths", "hybridserve (per-row paths)"),
                       ("transformers", "transformers generate")):
        rows = result.get("decode", {}).get(key, [])
        if rows:
            ax.plot([r["batch"] for r in rows], [r["tokens_per_s"] for r in rows], "s-",
                    label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (requests decoding)")
    ax.set_ylabel("decode tokens / s")
    ax.set_title(f"{result['model']['name']} ({result['env']['device']})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return portable_path(png)


def print_ttft(t: dict, label: str = "") -> None:
    """The TTFT section's summary lines."""
    print(f"TTFT{label} {t['prompt_len']} tokens: cold {t['cold_s']:.3f}s, "
          f"{t['cached_len']} cached {t['cached_s']:.3f}s ({t['speedup']:.1f}x)")
    sp = t.get("cached_split")
    if sp:
        print(f"  cached step: wall {1e3 * sp['wall_s']:.1f} ms = kernels "
              f"{1e3 * sp['kernel_s']:.1f} ms + host {1e3 * sp['host_s']:.1f} ms "
              f"(kernel bound {sp['kernel_bound_speedup'] or float('nan'):.1f}x; target "
              f"{t['target_speedup']:.0f}x {'met' if t['meets_target'] else 'NOT met'}; "
              f"short-row graph in {sp['short_graph_steps']} of {sp['cached_runs']} runs)")
    for row in t.get("cached_syncs", [])[:12]:
        print(f"  sync x{row['count']} at {row['site']}: {row['message']}")
    for row in t.get("cached_by_tail", []):
        print(f"  cached + {row['tail']} new tokens, short_rows={row['short_rows']}: "
              f"{1e3 * row['s']:.1f} ms")
    cp = t.get("cached_profile")
    if cp:
        print(f"  profiled cached run: wall {1e3 * cp['wall_s']:.1f} ms, kernels "
              f"{1e3 * cp['kernel_s_total']:.1f} ms, {cp['counts']}")
        for k in cp["top_kernels"][:5] or cp["top_host_ops"][:5]:
            print(f"    {1e3 * k['s']:.2f} ms x{k['calls']} {k['name']}")
    fp = t.get("first_cached_profile")
    if fp:
        print(f"  profiled cached run right after a cold run: wall {1e3 * fp['wall_s']:.1f} ms, "
              f"kernels {1e3 * fp['kernel_s_total']:.1f} ms")
        for k in fp["top_kernels"][:5]:
            print(f"    {1e3 * k['s']:.2f} ms x{k['calls']} {k['name']}")
    for row in t.get("cached_after_idle", []):
        print(f"  cached run {1e3 * row['idle_s']:.0f} ms after its cold run: "
              f"{1e3 * row['s']:.1f} ms")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/gpu_bench.json")
    ap.add_argument("--budget-s", type=float, default=270.0,
                    help="skip sections that would start after this many seconds")
    ap.add_argument("--batches", type=str, default="1,16,64,256")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hf-batches", type=str, default="1,16")
    ap.add_argument("--hf-new-tokens", type=int, default=24)
    ap.add_argument("--ref-batches", type=str, default="1,16")
    ap.add_argument("--ttft-prompt", type=int, default=8192)
    ap.add_argument("--ttft-cached", type=int, default=8064)
    ap.add_argument("--ttft-tails", type=str, default="64,128,256,512,1024",
                    help="new-token counts after the cached prefix, each timed on the "
                         "short-row path (token walk and 16-token chunks) and on the chunked scan")
    ap.add_argument("--prefill-prompts", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--prefill-max-s", type=float, default=60.0,
                    help="run fewer prompts if the warm-up says all would take longer")
    ap.add_argument("--matmul-n", type=int, default=8192)
    ap.add_argument("--with-1b", action="store_true", help="also decode on a ~1B shape")
    ap.add_argument("--profile-batch", type=int, default=64,
                    help="profile one graph-replayed decode step at this batch (0: none)")
    ap.add_argument("--skip", type=str, default="",
                    help="comma-separated section names (or name prefixes) not to run")
    ap.add_argument("--kernel-seed", type=int, default=None,
                    help="seed of the kernel checks' inputs (default: a fresh one, recorded)")
    ap.add_argument("--policy", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="KernelPolicy fields changed for every engine section (a path "
                         "not yet the default, e.g. short_row_chunks=on); recorded in config")
    args = ap.parse_args(argv)
    overrides = policy_overrides(args.policy)

    start = time.perf_counter()
    if args.smoke:
        device, dtype, shape, name = "cpu", torch.float32, TINY, "tiny Nemotron-H (smoke)"
        args.batches, args.hf_batches, args.ref_batches = "1,4", "1,2", "2"
        args.profile_batch = 4
        args.prompt, args.warmup_steps, args.steps, args.hf_new_tokens = 16, 1, 3, 4
        args.ttft_prompt, args.ttft_cached = 96, 64
        args.prefill_prompts, args.prefill_len, args.matmul_n = 2, 48, 256
        bw_bytes = 64 << 20
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --smoke for the CPU check", file=sys.stderr)
            return 2
        device, dtype, shape, name = "cuda", torch.bfloat16, NEMOTRON_8B, "Nemotron-H-8B-shaped"
        bw_bytes = 4 << 30
    batches = [int(b) for b in args.batches.split(",")]
    result: dict = {
        "benchmark": "bench_gpu",
        "env": {
            "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor()
            or platform.machine(),
            "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "commit": git_commit(),
            "fla_core": ssd_varlen.fla_version(), "smoke": args.smoke,
        },
        "config": {k: (portable_path(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": {"name": name, "shape": shape, "dtype": str(dtype), "random_weights": True},
        "errors": {},
        "skipped": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        result["elapsed_s"] = time.perf_counter() - start
        args.out.write_text(json.dumps(result, indent=2, default=str))

    skip = [k for k in args.skip.split(",") if k]

    def section(key, fn):
        if any(key.startswith(k) for k in skip):
            result["skipped"].append(key)
            return None
        if time.perf_counter() - start > args.budget_s:
            result["skipped"].append(key)
            print(f"[skip] {key}: over the time budget", flush=True)
            return None
        t = time.perf_counter()
        try:
            value = fn()
        except Exception as e:  # keep every other section's numbers
            result["errors"][key] = f"{type(e).__name__}: {e}\n{_portable_traceback()}"
            print(f"[error] {key}: {type(e).__name__}: {e}", flush=True)
            free_memory(device)
            value = None
        print(f"[done] {key} in {time.perf_counter() - t:.1f}s", flush=True)
        save()
        return value

    torch.manual_seed(0)
    bw = section("copy_bandwidth", lambda: copy_bandwidth(device, bw_bytes))
    result["copy_bandwidth"] = bw
    mm = section("matmul", lambda: matmul_rate(device, dtype, args.matmul_n))
    result["matmul"] = mm
    workdir = Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    # transformers' model is built when some transformers section will run.
    with_hf = any(
        not any(f"decode_transformers_b{b}".startswith(k) for k in skip)
        for b in (int(v) for v in args.hf_batches.split(",") if v))
    built = section("build_model", lambda: build_models(shape, device, dtype, workdir, with_hf))
    if built is None:
        save()
        return 1
    model, hf, mcfg, path = built
    if overrides:
        model = with_policy(model, **overrides)
    result["model"]["bytes"] = model_bytes(model)
    result["model"]["state_page_bytes"] = model.cache_spec.state_page_bytes(dtype, torch.float32)
    vocab = mcfg.vocab_size

    result["kernels"] = section(
        "kernels", lambda: layer_kernels(model, device, [b for b in batches if b > 1] or [1]))

    def attention():
        r = attention_kernel(model, device, batches, args.prompt + args.warmup_steps + args.steps)
        bad = [x for x in r if x.get("triton_vs_twin_rel_err", 0.0) > 2e-2]
        if bad:  # a wrong kernel must not time the decode steps: back to the twin
            result["attention_kernel_disabled"] = f"relative error {bad[0]}"
        return r

    result["attention_kernel"] = section("attention_kernel", attention)
    # Long contexts at small batches (an agent's conversation): where splitting a row's
    # keys across programs matters.
    # (The CPU smoke run: one small case, the same code; the interpreter is slow.)
    result["attention_kernel_long"] = section("attention_kernel_long", lambda: [
        r for ctx in ((40,) if args.smoke else (8192, 32768))
        for r in attention_kernel(model, device, [2] if args.smoke else [1, 8, 16, 32], ctx,
                                  reps=2)])
    if "attention_kernel_disabled" in result:
        model = with_policy(model, decode_attention="reference")
    result["attention_decode_path"] = (
        "triton" if runs_triton(model.kernel_policy.decode_attention, device) else "torch twin")
    # Fresh inputs every run unless a seed is given (to rerun a failure).
    kernel_seed = (args.kernel_seed if args.kernel_seed is not None
                   else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF)
    result["kernel_checks"] = section("kernel_checks", lambda: kernel_checks(
        shape, CHECK_STEPS["smoke" if args.smoke else "cuda"], device, dtype, kernel_seed))

    decode = result.setdefault(
        "decode", {"ours": [], "ours_eager": [], "reference_paths": [], "transformers": []})
    bandwidth = bw["bytes_per_s"] if bw else float("nan")
    # Decode graphs: the engine's default on CUDA; on the CPU the smoke run takes the same
    # static-buffer path without capture.
    graphs_mode = None if device == "cuda" else False
    for b in [int(x) for x in args.hf_batches.split(",") if x]:
        r = section(f"decode_transformers_b{b}",
                    lambda b=b: hf_decode(hf, device, b, args.prompt, args.hf_new_tokens, vocab, b))
        if r:
            decode["transformers"].append(r)
    for b in batches:
        def ours(b=b):
            r = engine_decode(model, path, device, dtype, b, args.prompt, args.warmup_steps,
                              args.steps, vocab, seed=b, enforce_eager=graphs_mode,
                              profile=b == args.profile_batch)
            # The two modes alternate, so both see contexts around the middle.
            context = args.prompt + args.warmup_steps + args.steps
            r["roofline_bytes_per_step"] = decode_step_bytes(model, b, context, 4)
            r["roofline_step_s"] = r["roofline_bytes_per_step"] / bandwidth
            r["roofline_tokens_per_s"] = b / r["roofline_step_s"]
            for m in [r, *r["modes"].values()]:
                m["fraction_of_roofline"] = m["tokens_per_s"] / r["roofline_tokens_per_s"]
            return r
        r = section(f"decode_ours_b{b}", ours)
        if r:
            decode["ours"].append(r)
            if "eager" in r["modes"] and r["mode"] != "eager":
                decode["ours_eager"].append(
                    {"batch": b, **r["modes"]["eager"],
                     "roofline_tokens_per_s": r["roofline_tokens_per_s"]})

    def prefill(m=None):
        rate = mm["flops_per_s"] if mm else float("nan")
        return prefill_throughput(m or model, path, device, dtype, args.prefill_prompts,
                                  args.prefill_len, vocab, 3, rate, args.prefill_max_s)

    result["prefill"] = section("prefill", prefill)
    result["prefill_paths"] = {
        "mamba": "packed (fused Triton scan)" if device == "cuda" else "per-row",
        "attention": "triton" if runs_triton(model.kernel_policy.prefill_attention, device)
        else "per-row",
    }

    def prefill_per_row():
        return prefill(per_row_prefill(model))

    result["prefill_per_row"] = section("prefill_per_row", prefill_per_row)
    if result["prefill"] and result["prefill_per_row"]:
        result["prefill_packed_over_per_row"] = (
            result["prefill"]["tokens_per_s"] / result["prefill_per_row"]["tokens_per_s"])

    def decode_torch_norms():
        b = args.profile_batch
        return engine_decode(torch_norms(model), path, device, dtype, b, args.prompt,
                             args.warmup_steps, args.steps, vocab, seed=b,
                             enforce_eager=graphs_mode)

    result["decode_torch_norms"] = section(
        f"decode_torch_norms_b{args.profile_batch}", decode_torch_norms)

    def decode_sampled():
        b = args.profile_batch
        return engine_decode(model, path, device, dtype, b, args.prompt, args.warmup_steps,
                             args.steps, vocab, seed=b, enforce_eager=graphs_mode,
                             temperature=0.8)

    # Sampled decode (temperature 0.8, top-p 0.95), graphs and eager alternating as above.
    result["decode_sampled"] = section(f"decode_sampled_b{args.profile_batch}", decode_sampled)

    def decode_sampled_twin():
        b = args.profile_batch
        return engine_decode(with_policy(model, sampler="reference"), path, device, dtype, b,
                             args.prompt, args.warmup_steps, args.steps, vocab, seed=b,
                             enforce_eager=graphs_mode, temperature=0.8)

    # The same with the torch twin's draw (the default on CUDA is one Triton pass over
    # the vocabulary, hybridserve.kernels.sampling; files before 28159ac have the
    # opposite pair: decode_sampled the twin, decode_sampled_kernel the pass).
    result["decode_sampled_twin"] = section(
        f"decode_sampled_twin_b{args.profile_batch}", decode_sampled_twin)
    result["agreement"] = section(
        "agreement", lambda: agreement(device, "bfloat16" if device == "cuda" else "float32",
                                       workdir, prompts=8 if args.smoke else 32))
    # The numerics always at the 8B layer's shape (the CPU smoke run too: one row, fewer
    # decode steps and a shorter prefill row, to stay within its time).
    result["numerics"] = section("numerics", lambda: numerics(
        device, NEMOTRON_8B, decode_steps=32 if args.smoke else 256,
        decode_rows=1 if args.smoke else 2, prefill_rows=(128,) if args.smoke else (4096, 4096)))
    if result["numerics"] and result.get("agreement"):
        result["numerics"]["bf16_vs_float32_greedy_agreement"] = (
            result["agreement"]["positional_agreement"])
    for b in [int(x) for x in args.ref_batches.split(",") if x]:
        def ref(b=b):
            with host_sampling():
                return engine_decode(reference_paths(model), path, device, dtype, b,
                                     args.prompt, 1, max(2, args.steps // 4), vocab, seed=b,
                                     enforce_eager=True)
        r = section(f"decode_reference_paths_b{b}", ref)
        if r:
            decode["reference_paths"].append(r)
    ours_by_b = {r["batch"]: r for r in decode["ours"]}
    result["ratios"] = {
        "ours_over_transformers": {r["batch"]: ours_by_b[r["batch"]]["tokens_per_s"]
                                   / r["tokens_per_s"]
                                   for r in decode["transformers"] if r["batch"] in ours_by_b},
        "fast_over_reference_paths": {r["batch"]: ours_by_b[r["batch"]]["tokens_per_s"]
                                      / r["tokens_per_s"] for r in decode["reference_paths"]
                                      if r["batch"] in ours_by_b},
        "graphs_over_eager": {r["batch"]: ours_by_b[r["batch"]]["tokens_per_s"]
                              / r["tokens_per_s"] for r in decode["ours_eager"]
                              if r["batch"] in ours_by_b},
    }
    hf = None  # noqa: F841
    free_memory(device)

    tails = (16,) if args.smoke else tuple(int(x) for x in args.ttft_tails.split(",") if x)
    result["ttft"] = section("ttft", lambda: ttft(model, path, device, dtype, args.ttft_prompt,
                                                  args.ttft_cached, 64, vocab, seed=7,
                                                  tails=tails))
    model = None  # noqa: F841
    free_memory(device)
    built_1b = None
    if args.with_1b and not args.smoke:
        built_1b = section("build_1b", lambda: build_models(
            NEMOTRON_1B, device, dtype, workdir / "1b", False))
    if built_1b is not None:
        # The second configuration: decode, prefill and the cached first token, each a
        # section of its own so that one failing keeps the others.
        m, _, c, pth = built_1b
        if overrides:
            m = with_policy(m, **overrides)

        def decode_1b():
            rows = []
            for b in (1, 64):
                r = engine_decode(m, pth, device, dtype, b, args.prompt, args.warmup_steps,
                                  args.steps, c.vocab_size, seed=b)
                r["roofline_tokens_per_s"] = b / (decode_step_bytes(
                    m, b, args.prompt + args.steps, 4) / bandwidth)
                r["fraction_of_roofline"] = r["tokens_per_s"] / r["roofline_tokens_per_s"]
                rows.append(r)
            return rows

        rate = mm["flops_per_s"] if mm else float("nan")
        result["model_1b"] = {
            "shape": NEMOTRON_1B, "bytes": model_bytes(m),
            "decode": section("decode_1b", decode_1b),
            "prefill": section("prefill_1b", lambda: prefill_throughput(
                m, pth, device, dtype, args.prefill_prompts, args.prefill_len, c.vocab_size,
                3, rate, args.prefill_max_s)),
            "ttft": section("ttft_1b", lambda: ttft(
                m, pth, device, dtype, args.ttft_prompt, args.ttft_cached, 64, c.vocab_size,
                seed=7, tails=(128,), target=10.0)),
        }
        m = built_1b = None  # noqa: F841
        free_memory(device)
    result["plot"] = plot(result, args.out.with_suffix(".png"))
    save()

    print(f"\n{name} on {result['env']['device']}, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    if bw:
        print(f"copy bandwidth {bw['bytes_per_s'] / 1e12:.2f} TB/s (read + write)")
    if mm:
        print(f"matmul {mm['n']}^3 {mm['dtype']}: {mm['flops_per_s'] / 1e12:.0f} TFLOP/s")
    print(f"{'batch':>6} {'mode':>11} {'tok/s':>9} {'ms/step':>8} {'graph':>9} {'eager':>9} "
          f"{'x':>5} {'roofline':>9} {'frac':>5} {'post %':>7} replayed")
    for r in decode["ours"]:
        e = r["modes"].get("eager", {})
        g = r["modes"].get("graph", {})
        gr = r.get("graphs", {})
        print(f"{r['batch']:>6} {r['mode']:>11} {r['tokens_per_s']:>9.1f} "
              f"{1e3 * r['median_step_s']:>8.2f} {g.get('tokens_per_s', float('nan')):>9.1f} "
              f"{e.get('tokens_per_s', float('nan')):>9.1f} "
              f"{r['tokens_per_s'] / e.get('tokens_per_s', float('nan')):>5.2f} "
              f"{r['roofline_tokens_per_s']:>9.1f} {r['fraction_of_roofline']:>5.2f} "
              f"{100 * r['postprocess_share']:>6.1f}% "
              f"{gr.get('timed_graph_steps_replayed')} {gr.get('capture_errors') or ''}")
    for r in (result.get("attention_kernel") or []) + (result.get("attention_kernel_long") or []):
        print(f"attention b{r['batch']} x {r['context']}: twin {1e6 * r['twin_s']:.0f} us, "
              f"triton {1e6 * r.get('triton_s', float('nan')):.0f} us "
              f"({r.get('triton_bytes_per_s', float('nan')) / 1e12:.2f} TB/s, "
              f"{r.get('splits')} splits; unsplit {1e6 * r.get('unsplit_s', float('nan')):.0f} us), "
              f"rel err {r.get('triton_vs_twin_rel_err', float('nan')):.1e}")
    for r in decode["ours"]:
        prof = r.get("profile")
        if not prof:
            continue
        if "error" in prof:
            print(f"profile b{r['batch']}: {prof['error']}")
            continue
        print(f"profile b{r['batch']} key {prof['key']}: engine step "
              f"{1e3 * prof['engine_step_s']:.2f} ms")
        for name in ("triton_attention", "twin_attention"):
            m = prof.get(name, {})
            if "replay_s" not in m:
                print(f"  {name}: {m}")
                continue
            kinds = " ".join(f"{k} {1e3 * v:.2f}" for k, v in m["kernel_s_by_kind"].items())
            print(f"  {name}: replay {1e3 * m['replay_s']:.2f} ms, kernels "
                  f"{1e3 * m['kernel_s_total']:.2f} ms ({kinds})")
    for key in ("transformers", "reference_paths"):
        for r in decode[key]:
            print(f"{key} b{r['batch']}: {r['tokens_per_s']:.1f} tok/s")
    if result.get("prefill"):
        p = result["prefill"]
        print(f"prefill {p['prompts_run']} x {p['prompt_len']}: {p['wall_s']:.2f}s, "
              f"{p['tokens_per_s']:.0f} tok/s, roofline {p['roofline_tokens_per_s']:.0f} tok/s "
              f"({100 * p['fraction_of_roofline']:.1f}%)")
    if result.get("prefill_per_row"):
        p = result["prefill_per_row"]
        print(f"prefill per-row paths: {p['tokens_per_s']:.0f} tok/s "
              f"({100 * p['fraction_of_roofline']:.1f}%)")
    if result.get("decode_torch_norms"):
        r = result["decode_torch_norms"]
        print(f"decode b{r['batch']} with torch norms: {r['tokens_per_s']:.1f} tok/s")
    for key, name in (("decode_sampled", "sampled"), ("decode_sampled_twin", "sampled, torch draw")):
        if result.get(key):
            r = result[key]
            e = r["modes"].get("eager", {})
            print(f"decode b{r['batch']} {name}: {r['tokens_per_s']:.1f} tok/s ({r['mode']}), "
                  f"eager {e.get('tokens_per_s', float('nan')):.1f} tok/s")
    if result.get("ttft"):
        print_ttft(result["ttft"])
    if (result.get("model_1b") or {}).get("ttft"):
        print_ttft(result["model_1b"]["ttft"], " (~1B)")
    if result.get("agreement"):
        a = result["agreement"]
        for f in (a, a.get("float32_on_device")):
            if f:
                print(f"agreement {f['dtype']} vs cpu float32: {f['positional_agreement']:.3f}, "
                      f"first divergence {f['first_divergence']}; graphs vs eager "
                      f"{f['graphs_vs_eager']['identical_sequences']}/{a['prompts']} identical")
        t = a.get("transformers") or {}
        if "positional_agreement" in t:
            print(f"transformers {t['dtype']} vs cpu float32: {t['positional_agreement']:.3f} "
                  f"(ours against it: {t['ours_vs_transformers']['positional_agreement']:.3f})")
    if result.get("numerics"):
        n = result["numerics"]
        d, p = n["decode"], n["prefill"]
        last = f"state_rel_err_after_{d['steps']}"
        print(f"numerics (bf16 activations, {d['kernel']}): decode state error vs float64 "
              f"after 1 step {d['state_rel_err_after_1']:.2e}, after {d['steps']} "
              f"{d[last]:.2e} (bf16 dt: {d['bf16_dt']['state_rel_err_after_1']:.2e}, "
              f"{d['bf16_dt'][last]:.2e}); prefill {p['rows']} final states "
              f"{p['final_state_rel_err']:.2e} (bf16 dt: "
              f"{p['bf16_dt']['final_state_rel_err']:.2e}); greedy agreement "
              f"{n['bf16_vs_float32_greedy_agreement']}")
    if result.get("kernel_checks"):
        print_kernel_checks(result["kernel_checks"])
    if result["errors"]:
        print("errors in:", ", ".join(result["errors"]))
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
