"""Serving under load: ``hybridserve serve`` over HTTP with open-loop Poisson arrivals.

For every engine configuration (prefix caching off / on / on with the host checkpoint
tier / the last with n-gram speculation), the script starts ``hybridserve serve`` as a
subprocess on loopback, replays two generated traces at every request rate, and reads
``/metrics`` before and after each run:

- **agentic**: conversations arrive as a Poisson process at the rate; each starts from one
  shared system prompt with tool definitions, then runs several turns; every turn's
  prompt is the previous turn's prompt, the model's answer and a tool result, sent after a
  think time (exponential) once the previous answer is in. Reusable tokens: a turn's
  whole previous prompt and answer, and the system prompt.
- **chat**: independent requests arrive as a Poisson process with mixed prompt lengths
  (some sharing a short system preamble) and mixed output lengths.

Per run it reports throughput (requests/s, output tokens/s), TTFT, inter-token latency
(ITL: per request, (last token time - first token time) / (output tokens - 1)) and
end-to-end latency at p50/p90/p99, goodput (requests/s meeting both SLOs:
``--slo-ttft-ms`` and ``--slo-itl-ms``), the prefix-hit rate (tokens the server reported
cached over prompt tokens, from each response's ``usage.prompt_tokens_details``, and
from ``/metrics``), the share of the trace's reusable tokens that hit, preemptions and
host-tier restores (``/metrics`` deltas).

The profile section measures, in-process, the host time of a mixed step (a prefill chunk
beside ``--profile-batch`` decode rows) against a pure decode step at the same batch: the
step's wall time minus the model's forward and logits (synchronised on CUDA).

Results: ``benchmarks/results/serve.json`` (``serve_smoke.json`` with ``--smoke``), with
the device, versions, commit, the full configuration and every configuration measured in
the same run; a plot of latency against rate when matplotlib is installed.

Usage: ``python benchmarks/bench_serve.py --smoke`` (CPU, the embedded model, ~2 minutes)
or, on a GPU, ``python benchmarks/bench_serve.py --random-model nemotron_8b --device cuda
--dtype bfloat16 --rates 1,2,4,8 --gpu-memory-utilization 0.9 --checkpoint-offload-gib 64``
(or ``--model PATH`` for a real checkpoint).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import platform
import random
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from provenance import git_commit, portable_path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

WORDS = ["search", "file", "query", "result", "weather", "city", "price", "stock", "order", "user", "account", "email", "calendar", "meeting", "note", "task", "status", "update", "report", "list", "item", "value", "error", "retry", "open", "close", "read", "write", "send", "fetch", "parse", "check", "count", "total", "average", "latest", "first"]


# ---- traces ------------------------------------------------------------------------


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_prompt(rng: random.Random, num_tools: int, words_per_tool: int) -> str:
    tools = []
    for i in range(num_tools):
        tools.append(json.dumps({
            "name": f"tool_{i}_{rng.choice(WORDS)}",
            "description": _words(rng, words_per_tool),
            "parameters": {"type": "object", "properties": {rng.choice(WORDS): {"type": "string"}}},
        }))
    return "You are an agent. You can call these tools:\n" + "\n".join(tools) + "\n"


@dataclass
class Conversation:
    """An agentic conversation: its opening prompt and the tool results of later turns."""

    arrival: float
    opening: str
    tool_results: list[str]
    think_times: list[float]
    max_tokens: int


def agentic_trace(rng: random.Random, rate: float, n: int, turns: int, system: str,
                  max_tokens: int, think_s: float, tool_words: int) -> list[Conversation]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        opening = system + "User: " + _words(rng, 12) + "\nAssistant:"
        results = [f"\nTool result: {_words(rng, tool_words)}\nAssistant:" for _ in range(turns - 1)]
        thinks = [rng.expovariate(1.0 / think_s) if think_s > 0 else 0.0 for _ in range(turns - 1)]
        out.append(Conversation(t, opening, results, thinks, max_tokens))
    return out


@dataclass
class ChatRequest:
    arrival: float
    prompt: str
    max_tokens: int


def chat_trace(rng: random.Random, rate: float, n: int, short: tuple[int, int],
               long: tuple[int, int], out_lens: tuple[int, ...]) -> list[ChatRequest]:
    preamble = (
        "You are a helpful assistant. Answer briefly and plainly; say so when you do not know. "
        "Keep answers short unless the user asks for detail.\n"
    )
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        lo, hi = long if rng.random() < 0.3 else short
        head = preamble if rng.random() < 0.5 else ""
        out.append(ChatRequest(t, head + "User: " + _words(rng, rng.randint(lo, hi)) + "\nAssistant:",
                               rng.choice(out_lens)))
    return out


# ---- the client --------------------------------------------------------------------


@dataclass
class Record:
    sent: float
    first: float | None = None
    end: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reusable_tokens: int = 0
    text: str = ""
    error: str | None = None


def complete(port: int, prompt: str, max_tokens: int, model: str, timeout: float) -> Record:
    """One streamed ``/v1/completions`` request (greedy, EOS ignored so lengths hold)."""
    rec = Record(sent=time.perf_counter())
    body = json.dumps({
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    })
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            rec.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return rec
        parts = []
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                rec.error = str(chunk["error"])[:200]
                break
            for choice in chunk.get("choices") or ():
                if choice.get("text"):
                    if rec.first is None:
                        rec.first = time.perf_counter()
                    parts.append(choice["text"])
            usage = chunk.get("usage")
            if usage:
                rec.prompt_tokens = usage["prompt_tokens"]
                rec.completion_tokens = usage["completion_tokens"]
                rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        rec.end = time.perf_counter()
        rec.text = "".join(parts)
    except (OSError, http.client.HTTPException) as e:
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return rec


def run_agentic(port: int, model: str, convs: list[Conversation], system_tokens: int,
                timeout: float) -> list[Record]:
    records: list[Record] = []
    lock = threading.Lock()
    start = time.perf_counter()

    def converse(conv: Conversation) -> None:
        time.sleep(max(0.0, start + conv.arrival - time.perf_counter()))
        prompt, reusable = conv.opening, system_tokens
        for turn in range(len(conv.tool_results) + 1):
            rec = complete(port, prompt, conv.max_tokens, model, timeout)
            rec.reusable_tokens = min(reusable, rec.prompt_tokens)
            with lock:
                records.append(rec)
            if rec.error or turn == len(conv.tool_results):
                return
            reusable = rec.prompt_tokens + rec.completion_tokens
            prompt = prompt + rec.text + conv.tool_results[turn]
            time.sleep(conv.think_times[turn])

    threads = [threading.Thread(target=converse, args=(c,)) for c in convs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return records


def run_chat(port: int, model: str, reqs: list[ChatRequest], timeout: float) -> list[Record]:
    records: list[Record | None] = [None] * len(reqs)
    start = time.perf_counter()

    def one(i: int, r: ChatRequest) -> None:
        time.sleep(max(0.0, start + r.arrival - time.perf_counter()))
        records[i] = complete(port, r.prompt, r.max_tokens, model, timeout)

    threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(reqs)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return [r for r in records if r is not None]


# ---- the server --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.read().decode()
    finally:
        conn.close()


def metrics(port: int) -> dict[str, float]:
    out = {}
    for line in http_get(port, "/metrics").splitlines():
        if line.startswith("hybridserve_") and " " in line and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("hybridserve_")] = float(value)
    return out


class Server:
    """``hybridserve serve`` in a subprocess on a free loopback port."""

    def __init__(self, flags: list[str], log_path: Path, startup_timeout: float = 300.0) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-c", "import sys; from hybridserve.cli import main; sys.exit(main())",
               "serve", "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
               *flags]
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        # Open for the life of the server process (closed in stop()).
        self.log = open(log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.time() + startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {log_path}")
            try:
                http_get(self.port, "/health")
                break
            except OSError:
                time.sleep(0.25)
        else:
            self.stop()
            raise RuntimeError(f"server did not come up in {startup_timeout} s; see {log_path}")
        self.model = json.loads(http_get(self.port, "/v1/models"))["data"][0]["id"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ---- statistics --------------------------------------------------------------------


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def dist(values: list[float]) -> dict[str, float | None]:
    return {"p50": pct(values, 0.5), "p90": pct(values, 0.9), "p99": pct(values, 0.99),
            "mean": statistics.fmean(values) if values else None}


def summarize(records: list[Record], wall: float, before: dict, after: dict,
              slo_ttft: float, slo_itl: float) -> dict:
    ok = [r for r in records if r.error is None and r.first is not None and r.end is not None]
    ttft = [(r.first - r.sent) * 1e3 for r in ok]
    e2e = [(r.end - r.sent) * 1e3 for r in ok]
    itl = [(r.end - r.first) * 1e3 / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    good = [
        r for r in ok
        if (r.first - r.sent) * 1e3 <= slo_ttft
        and (r.completion_tokens <= 1 or (r.end - r.first) * 1e3 / (r.completion_tokens - 1) <= slo_itl)
    ]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    reusable = sum(r.reusable_tokens for r in ok)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    q = delta("prefix_query_tokens_total")
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "first_error": next((r.error for r in records if r.error), None),
        "wall_s": wall,
        "throughput_rps": len(ok) / wall if wall else 0.0,
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / wall if wall else 0.0,
        "ttft_ms": dist(ttft),
        "itl_ms": dist(itl),
        "e2e_ms": dist(e2e),
        "goodput_rps": len(good) / wall if wall else 0.0,
        "slo_attainment": len(good) / len(records) if records else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "token_hit_rate": cached / prompt if prompt else 0.0,
        "reusable_tokens": reusable,
        "reusable_hit_rate": min(1.0, cached / reusable) if reusable else None,
        "metrics_hit_rate": delta("prefix_hit_tokens_total") / q if q else 0.0,
        "preemptions": delta("preemptions_total"),
        "host_restores": delta("host_checkpoints_restored_total"),
        "host_offloads": delta("host_checkpoints_offloaded_total"),
        "spec_accepted_tokens": delta("spec_accepted_tokens_total"),
    }


# ---- mixed-step profile ------------------------------------------------------------


def profile_mixed_steps(model: str | None, device: str, dtype: str, batch: int, chunk: int,
                        steps: int, max_model_len: int) -> dict:
    """Host time per step (wall minus forward and logits) of pure decode steps at
    ``batch`` rows vs mixed steps (the same rows plus one prefill chunk of ``chunk``
    tokens), in-process and eager (mixed steps never replay a graph)."""
    import torch

    from hybridserve import LLM, SamplingParams

    llm = LLM(model, device=device, dtype=dtype, max_num_seqs=batch + 2, max_model_len=max_model_len,
              max_num_batched_tokens=batch + chunk, enforce_eager=True)
    engine = llm.engine
    net = engine.runner.model
    spent = [0.0]
    cuda = device.startswith("cuda")

    def timed(fn):
        def wrapper(*a, **k):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn(*a, **k)
            if cuda:
                torch.cuda.synchronize()
            spent[0] += time.perf_counter() - t
            return out
        return wrapper

    net.forward = timed(net.forward)
    net.compute_logits = timed(net.compute_logits)
    rng = random.Random(0)
    long = SamplingParams(max_tokens=max_model_len // 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", [rng.randrange(3, 200) for _ in range(8)], long)
    while any(r.is_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()

    def measure(mixed: bool) -> dict:
        host, wall = [], []
        for s in range(steps):
            if mixed:
                engine.add_request(f"p{mixed}{s}", [rng.randrange(3, 200) for _ in range(chunk)],
                                   SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            spent[0] = 0.0
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            wall.append(dt * 1e3)
            host.append((dt - spent[0]) * 1e3)
        return {"host_ms_p50": statistics.median(host), "step_ms_p50": statistics.median(wall)}

    measure(False)  # warm up
    decode = measure(False)
    mixed = measure(True)
    return {
        "batch": batch, "prefill_chunk": chunk, "steps": steps,
        "pure_decode": decode, "mixed": mixed,
        "host_ratio_mixed_over_decode": mixed["host_ms_p50"] / decode["host_ms_p50"],
    }


# ---- a random-weight model at a real shape -------------------------------------------


def byte_tokenizer(vocab_size: int):
    """A byte-level tokenizer for a random model of ``vocab_size`` ids: ids 0-255 are the
    bytes (all a prompt encodes to); returns it and its byte alphabet."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    # Random weights pick ids across the whole vocabulary: every id past the bytes decodes
    # to three ASCII letters (no merge ever produces them), so each generated token streams
    # visible text and the client's first-token time is the server's.
    letters = string.ascii_letters
    for i in range(len(alphabet), vocab_size):
        k = i - len(alphabet)
        vocab[letters[k % 52] + letters[k // 52 % 52] + letters[k // 2704 % 52]] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok, alphabet


def write_random_model(shape_name: str, dtype: str, device: str, path: Path) -> Path:
    """A Nemotron-H checkpoint of ``bench_gpu``'s shapes (``tiny``, ``nemotron_1b``,
    ``nemotron_8b``) with random weights, saved with :func:`byte_tokenizer`, so the server
    takes text prompts. Its answers do not survive re-encoding (three letters become three
    byte ids), so on this model a turn can reuse its previous prompt but not the answer:
    the reusable-hit rate counts both and is a lower bound. Returns ``path``."""
    import torch
    import transformers
    from bench_gpu import NEMOTRON_1B, NEMOTRON_8B, TINY, hf_config, randomize_

    from hybridserve.config import resolve_dtype

    shape = {"tiny": TINY, "nemotron_1b": NEMOTRON_1B, "nemotron_8b": NEMOTRON_8B}[shape_name]
    cfg = hf_config(shape)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(resolve_dtype(dtype))
    try:
        with torch.device(device):
            model = transformers.NemotronHForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    randomize_(model, seed=0)
    model.save_pretrained(path)
    del model
    # The servers this script starts size their caches from the device's free memory.
    torch.cuda.empty_cache()
    tok, alphabet = byte_tokenizer(cfg.vocab_size)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": alphabet[2]}))
    return path


# ---- main --------------------------------------------------------------------------


CONFIGS = {
    "caching_off": ["--no-prefix-caching"],
    "caching_on": [],
    "caching_host_tier": ["HOST"],
    "caching_host_tier_spec": ["HOST", "--num-speculative-tokens", "3"],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, embedded model, tiny rates")
    ap.add_argument("--model", default=None)
    ap.add_argument("--random-model", choices=("tiny", "nemotron_1b", "nemotron_8b"), default=None,
                    help="serve a random-weight Nemotron-H of this shape (written to --log-dir)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="passed to every server (cache sizing from the device's memory)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rates", default="0.5,1,2,4", help="requests (conversations) per second")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--traces", default="agentic,chat")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--chat-requests", type=int, default=64)
    ap.add_argument("--tools", type=int, default=24, help="tool definitions in the system prompt")
    ap.add_argument("--think-s", type=float, default=1.0, help="mean think time between turns")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-itl-ms", type=float, default=100.0)
    ap.add_argument("--checkpoint-offload-gib", type=float, default=16.0)
    ap.add_argument("--server-args", default="", help="extra flags for every server, space-separated")
    ap.add_argument("--profile-batch", type=int, default=64)
    ap.add_argument("--profile-chunk", type=int, default=256)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--out", default=None)
    ap.add_argument("--log-dir", default=tempfile.gettempdir(), help="where the servers' logs go")
    args = ap.parse_args()

    server_args = args.server_args.split()
    if args.smoke:
        args.rates = "2,4"
        args.conversations, args.turns, args.chat_requests = 3, 3, 5
        args.tools, args.think_s, args.max_tokens = 4, 0.1, 5
        args.profile_batch, args.profile_chunk = 64, 64
        args.slo_ttft_ms, args.slo_itl_ms = 3000.0, 500.0
        # A device checkpoint budget below the traces' working set, so the host tier counts.
        server_args += ["--max-num-seqs", "8", "--max-checkpoint-pages", "4", "--state-interval", "16",
                        "--num-threads", "1"]
        args.checkpoint_offload_gib = 0.25
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    if args.random_model:
        target = Path(args.log_dir) / f"random_{args.random_model}"
        if not (target / "config.json").exists():
            write_random_model(args.random_model, args.dtype, args.device, target)
        args.model = str(target)
    if args.model:
        server_args += ["--model", args.model]
    if args.gpu_memory_utilization is not None:
        server_args += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    server_args += ["--device", args.device, "--dtype", args.dtype]
    rates = [float(r) for r in args.rates.split(",")]
    configs = [c for c in args.configs.split(",") if c]
    traces = [t for t in args.traces.split(",") if t]
    out_path = Path(args.out) if args.out else RESULTS / ("serve_smoke.json" if args.smoke else "serve.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)

    import torch

    def write(results: dict, profile: dict | None, complete: bool) -> dict:
        # Written after every configuration, so a run cut short by a time limit keeps
        # what it measured (``complete`` says whether every configuration ran).
        doc = {
            "benchmark": "bench_serve",
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "commit": git_commit(),
            "config": {**{k: v for k, v in vars(args).items() if k != "out"}, "server_args": server_args,
                       "model": portable_path(args.model) if args.model else "embedded default model"},
            "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms},
            "complete": complete,
            "results": results,
            "profile": profile,
        }
        try:
            import triton

            doc["triton"] = triton.__version__
        except ImportError:
            pass
        out_path.write_text(json.dumps(doc, indent=1))
        return doc

    results: dict = {}
    for name in configs:
        flags = []
        for f in CONFIGS[name]:
            flags += ["--checkpoint-offload-gib", str(args.checkpoint_offload_gib)] if f == "HOST" else [f]
        log_path = Path(args.log_dir) / f"{out_path.stem}_{name}.log"
        server = Server(server_args + flags, log_path)
        try:
            results[name] = {"flags": flags}
            for trace in traces:
                for rate in rates:
                    # The same trace for every configuration; another per rate and trace.
                    rng = random.Random(f"{trace}-{rate}")
                    before = metrics(server.port)
                    t0 = time.perf_counter()
                    if trace == "agentic":
                        system = system_prompt(rng, args.tools, 24)
                        probe = complete(server.port, system, 1, server.model, args.timeout)
                        convs = agentic_trace(rng, rate, args.conversations, args.turns, system,
                                              args.max_tokens, args.think_s, 20)
                        before = metrics(server.port)
                        t0 = time.perf_counter()
                        recs = run_agentic(server.port, server.model, convs, probe.prompt_tokens, args.timeout)
                    else:
                        reqs = chat_trace(rng, rate, args.chat_requests, (8, 40), (80, 200),
                                          (args.max_tokens // 4 or 1, args.max_tokens))
                        recs = run_chat(server.port, server.model, reqs, args.timeout)
                    wall = time.perf_counter() - t0
                    after = metrics(server.port)
                    s = summarize(recs, wall, before, after, args.slo_ttft_ms, args.slo_itl_ms)
                    results[name].setdefault(trace, {})[str(rate)] = s
                    print(f"{name:24s} {trace:8s} rate {rate:5.2f}  ok {s['requests'] - s['errors']:3d}/"
                          f"{s['requests']:3d}  ttft p50 {s['ttft_ms']['p50'] or 0:8.1f} ms  "
                          f"itl p50 {s['itl_ms']['p50'] or 0:7.1f} ms  e2e p99 {s['e2e_ms']['p99'] or 0:8.1f} ms  "
                          f"hit {s['token_hit_rate']:.2f}  reusable hit {s['reusable_hit_rate'] or 0:.2f}  "
                          f"goodput {s['goodput_rps']:.2f}/s  preempt {s['preemptions']:.0f}  "
                          f"restores {s['host_restores']:.0f}", flush=True)
        finally:
            server.stop()
        write(results, None, complete=False)

    profile = None
    if not args.no_profile:
        profile = profile_mixed_steps(args.model, args.device, args.dtype, args.profile_batch,
                                      args.profile_chunk, 8 if args.smoke else 32, 512 if args.smoke else 4096)
        print(f"profile: batch {profile['batch']}: host per step, pure decode "
              f"{profile['pure_decode']['host_ms_p50']:.2f} ms, mixed (+{profile['prefill_chunk']}-token "
              f"chunk) {profile['mixed']['host_ms_p50']:.2f} ms: ratio {profile['host_ratio_mixed_over_decode']:.2f}")

    doc = write(results, profile, complete=True)
    print(f"wrote {portable_path(out_path)}")
    plot(doc, out_path.with_suffix(".png"))
    return 0


def plot(doc: dict, path: Path) -> None:
    """TTFT p50 and e2e p99 against rate, per trace and configuration (if matplotlib is
    installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    traces = sorted({t for r in doc["results"].values() for t in r if t != "flags"})
    fig, axes = plt.subplots(2, len(traces), figsize=(6 * len(traces), 8), squeeze=False)
    for j, trace in enumerate(traces):
        for name, res in doc["results"].items():
            runs = res.get(trace, {})
            rates = sorted(runs, key=float)
            for i, (metric, q) in enumerate((("ttft_ms", "p50"), ("e2e_ms", "p99"))):
                axes[i][j].plot([float(r) for r in rates], [runs[r][metric][q] for r in rates], "o-", label=name)
                axes[i][j].set_title(f"{trace}: {metric} {q}")
                axes[i][j].set_xlabel("request rate (1/s)")
                axes[i][j].set_ylabel("ms")
                axes[i][j].set_yscale("log")
        axes[0][j].legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {portable_path(path)}")


if __name__ == "__main__":
    raise SystemExit(main())
