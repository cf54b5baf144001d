"""The tensor-parallel process group: one process per rank, collectives by rank index.

:class:`TensorGroup` wraps two ``torch.distributed`` backends built directly over one
``TCPStore`` (no default process group is created, so an :class:`~hybridserve.LLM` with
tensor parallelism leaves the caller's ``torch.distributed`` state alone, and two of them
can live in one process one after the other):

- ``tensor``: the collectives of the forward (:meth:`all_reduce` after every row-parallel
  projection, :meth:`all_gather` of the vocabulary-parallel logits): NCCL when the ranks'
  tensors live on CUDA devices, gloo on the CPU;
- ``control``: always gloo over the host, for the step plan rank 0 broadcasts
  (:meth:`broadcast_object`) and the start-up handshake (:meth:`all_gather_object`). Host
  objects never travel through device memory, so sending a plan costs no device sync.

Rank 0 hosts the store and waits for every rank to count itself in (``check_peers``
reports a rank whose process died first, instead of waiting out ``timeout``).
Every rank must call every collective in the same order; a rank that stops calling them
leaves the others waiting until ``timeout`` (the error then names the collective).

``reduce_seconds`` accumulates the host time spent in :meth:`all_reduce` when
``timed`` is set (benchmarks; on CUDA it synchronises around each call, so leave it off
when serving).
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
import socket
import time

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorGroup:
    """Rank ``rank`` of ``world_size`` ranks meeting at ``127.0.0.1:port`` (rank 0 hosts
    the store). ``device``: where this rank's tensors live (picks NCCL for CUDA)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        port: int,
        device: torch.device | str = "cpu",
        timeout_s: float = 600.0,
        check_peers=None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside tensor_parallel_size={world_size}")
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(
            "127.0.0.1", port, world_size, rank == 0, timeout=timeout, wait_for_workers=False
        )
        self._join(timeout_s, check_peers)
        self.control = dist.ProcessGroupGloo(
            dist.PrefixStore("control", self._store), rank, world_size, timeout
        )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            options = dist.ProcessGroupNCCL.Options()
            # Older torch has no such field: NCCL then keeps its default timeout.
            with contextlib.suppress(AttributeError):
                options._timeout = timeout
            self.tensor = dist.ProcessGroupNCCL(
                dist.PrefixStore("tensor", self._store), rank, world_size, options
            )
        else:
            self.tensor = dist.ProcessGroupGloo(
                dist.PrefixStore("tensor", self._store), rank, world_size, timeout
            )
        self.timed = False
        self.reduce_seconds = 0.0
        self.num_reduces = 0

    def _join(self, timeout_s: float, check_peers) -> None:
        """Every rank counts itself in; rank 0 waits for the others, calling
        ``check_peers()`` (None, or why a peer cannot come: a process that died) while it
        waits, so a rank that dies at start-up fails rank 0 at once, not at the timeout."""
        self._store.add("joined", 1)
        if self.rank != 0:
            return
        deadline = time.monotonic() + timeout_s
        while self._store.add("joined", 0) < self.world_size:
            problem = check_peers() if check_peers is not None else None
            if problem:
                raise RuntimeError(problem)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor-parallel ranks did not all start within {timeout_s:.0f} s"
                )
            time.sleep(0.05)

    def close(self) -> None:
        """Release the forward's communicators (NCCL's; gloo needs nothing). The group
        cannot be used afterwards."""
        shutdown = getattr(self.tensor, "shutdown", None)
        if self.device.type == "cuda" and shutdown is not None:
            with contextlib.suppress(Exception):
                shutdown()

    # ---- tensors ---------------------------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``."""
        if self.world_size == 1:
            return t
        if self.timed:
            if t.is_cuda:
                torch.cuda.synchronize(t.device)
            started = time.perf_counter()
        self.tensor.allreduce([t]).wait()
        if self.timed:
            if t.is_cuda:
                torch.cuda.synchronize(t.device)
            self.reduce_seconds += time.perf_counter() - started
        self.num_reduces += 1
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape and dtype on every rank), in rank order."""
        t = t.contiguous()
        if self.world_size == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self.tensor.allgather([out], [t]).wait()
        return out

    # ---- host objects ----------------------------------------------------------------

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's ``obj`` on every rank (the others pass nothing)."""
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=5)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast(size, 0).wait()
        if self.rank != 0:
            payload = torch.empty(int(size), dtype=torch.uint8)
        if int(size):
            self.control.broadcast(payload, 0).wait()
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's ``obj``, in rank order."""
        data = pickle.dumps(obj)
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self.control.allgather([sizes], [size]).wait()
        width = max(int(s) for s in sizes)
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world_size)]
        self.control.allgather([out], [buf]).wait()
        return [pickle.loads(o[: int(s)].numpy().tobytes()) for o, s in zip(out, sizes)]
