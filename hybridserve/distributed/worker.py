"""Starting the ranks of a tensor-parallel engine, and the loop of ranks 1 .. tp-1.

:func:`start_tensor_parallel` (called by :class:`~hybridserve.LLM` with
``tensor_parallel_size > 1``) spawns ``tp - 1`` worker processes (``torch.multiprocessing``,
the ``spawn`` start method: no forked CUDA or thread state), joins the group as rank 0
and loads rank 0's shard while the workers load theirs; every rank then reports whether
its load succeeded (one handshake), so a checkpoint that cannot be sharded fails the
constructor on rank 0 with the worker's message instead of leaving ranks waiting.

A worker (:func:`worker_main`) then runs the sizing profile when rank 0 asks (the
forward of ``gpu_memory_utilization``'s profile, its peak gathered to rank 0), waits for
the cache sizes, allocates its shard of every cache, and runs what rank 0 broadcasts (:mod:`hybridserve.distributed.runner`):
``step`` (host-tier copies, then the forward up to the gathered logits), ``transfers``
(host-tier copies alone), ``read_pages`` (its shard of some state pages, gathered to rank
0), ``stop``. A worker exits when told to stop, when rank 0's process ends (workers are
daemonic), or when a collective times out.

Devices: ``cpu`` puts every rank on the CPU (gloo); ``cuda`` / ``cuda:k`` puts rank ``r``
on ``cuda:k+r`` (NCCL for the forward's collectives).
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridserve.config import KernelPolicy
from hybridserve.distributed.group import TensorGroup, free_port

log = logging.getLogger("hybridserve.distributed")


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank needs to load its shard (picklable)."""

    path: str
    world_size: int
    port: int
    dtype: torch.dtype
    device: str  # rank 0's; rank r adds r to a CUDA index
    policy: KernelPolicy
    num_threads: int | None
    timeout_s: float = 600.0


def rank_device(device: str, rank: int) -> str:
    d = torch.device(device)
    if d.type != "cuda":
        return str(d)
    return f"cuda:{(d.index or 0) + rank}"


def _load(spec: WorkerSpec, group: TensorGroup):
    from hybridserve.distributed.shard import load_model_shard

    return load_model_shard(
        Path(spec.path), group, spec.dtype, rank_device(spec.device, group.rank), spec.policy
    )


def _handshake(group: TensorGroup, error: str | None) -> None:
    """Every rank's load result; raises on every rank if any failed."""
    errors = group.all_gather_object(error)
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        rank, text = bad[0]
        raise RuntimeError(f"tensor-parallel rank {rank} failed to load its shard: {text}")


def start_tensor_parallel(spec_kwargs: dict):
    """Spawn the workers, join as rank 0, load rank 0's shard. Returns ``(model, group,
    processes)``; raises (after stopping the workers) if any rank failed to load."""
    import torch.multiprocessing as mp

    port = free_port()
    spec = WorkerSpec(port=port, **spec_kwargs)
    if torch.device(spec.device).type == "cuda":
        base = torch.device(spec.device).index or 0
        if base + spec.world_size > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={spec.world_size} needs CUDA devices {base}.."
                f"{base + spec.world_size - 1} but this machine has {torch.cuda.device_count()}"
            )
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, spec.world_size):
        proc = ctx.Process(target=worker_main, args=(rank, spec), daemon=True,
                           name=f"hybridserve-tp{rank}")
        proc.start()
        procs.append(proc)
    try:
        def check_peers() -> str | None:
            for rank, proc in enumerate(procs, start=1):
                if not proc.is_alive():
                    return (
                        f"tensor-parallel rank {rank} exited (code {proc.exitcode}) before "
                        "joining; its error is on standard error. If the main module builds "
                        "the LLM at its top level, guard that with "
                        "if __name__ == '__main__': (every rank re-imports the main module)"
                    )
            return None

        group = TensorGroup(0, spec.world_size, port, rank_device(spec.device, 0),
                            spec.timeout_s, check_peers)
        error = None
        try:
            model = _load(spec, group)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            failure = e
        try:
            _handshake(group, error)
        except RuntimeError:
            if error is not None:
                raise failure from None
            raise
    except BaseException:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
        raise
    return model, group, procs


def worker_main(rank: int, spec: WorkerSpec) -> None:
    """Rank ``rank``'s process: load, allocate, then run rank 0's messages until ``stop``."""
    from hybridserve.cache.host_tier import HostStatePool
    from hybridserve.distributed.runner import decode_step, read_pages
    from hybridserve.runner.model_runner import ModelRunner
    from hybridserve.step import SchedulerOutput, Transfers

    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    device = rank_device(spec.device, rank)
    group = TensorGroup(rank, spec.world_size, spec.port, device, spec.timeout_s)
    error = None
    try:
        model = _load(spec, group)
    except Exception as e:
        error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    try:
        _handshake(group, error)
    except RuntimeError:
        return
    while True:
        # Before the engine exists: the sizing profile (gpu_memory_utilization), then the
        # cache sizes.
        kind, sizes = group.broadcast_object()
        if kind == "stop":
            return
        if kind == "caches":
            break
        if kind == "profile":
            from hybridserve.engine.sizing import profile_activation_peak

            group.all_gather_object(profile_activation_peak(model, *sizes, device))
    caches = model.cache_spec.allocate(**sizes["allocate"], device=device)
    runner = ModelRunner(model, caches, sizes["kv_block_size"], sizes["max_num_seqs"], device)
    if sizes["host_pages"]:
        runner.host_pool = HostStatePool(caches.states, sizes["host_pages"])
    with torch.inference_mode():
        while True:
            kind, body = group.broadcast_object()
            if kind == "step":
                sched = decode_step(body)
                runner.run_transfers(sched)
                runner.forward_logits(sched)
            elif kind == "transfers":
                sched = SchedulerOutput([], transfers=Transfers(
                    [tuple(x) for x in body["offloads"]], [tuple(x) for x in body["restores"]]))
                runner.run_transfers(sched)
            elif kind == "read_pages":
                group.all_gather_object(read_pages(caches, body))
            elif kind == "stop":
                group.close()
                return
            else:
                raise RuntimeError(f"tensor-parallel worker {rank}: unknown message {kind!r}")
