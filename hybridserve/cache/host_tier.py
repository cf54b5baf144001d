"""The host tier of state checkpoints: evicted checkpoints move to host memory, losslessly.

A device state page is expensive (a Nemotron-H-8B page is ~100 MB), so the device
checkpoint budget is small; a checkpoint it evicts is not dropped but copied, byte for
byte, into a host page (pinned memory on CUDA; a second pool of CPU tensors on a machine
without one, so the same code runs in the CPU suite). A later prefix hit on a host
checkpoint copies it back into a *fresh* device page, never into a page another step
reads (docs/state-lifecycle.md), and the checkpoint is a device checkpoint again.

Two halves, one per layer of the engine
----------------------------------------
- :class:`HostCheckpointIndex` (the scheduler's): host page ids, the host checkpoints
  under their chained block hashes, eviction, and the queue of copies the next step must
  run. It never touches a tensor.
- :class:`HostStatePool` (the runner's): per recurrent layer, a host copy of every state
  tensor the layer's family declares (``ModelCaches.states``: Mamba2's and Gated
  DeltaNet's ``conv`` and ``ssm``, or any other family's; same shapes after the page
  dimension, same dtypes), and :meth:`HostStatePool.run`, which performs a step's copies
  before that step's forward. The copies of a step are described by
  :class:`~hybridserve.step.Transfers` (the step contract, which the scheduler hands the
  runner).

Rules
-----
- **KV stays on the device.** A host checkpoint of prefix length h is usable only while
  every KV block of [0, h) is still in the KV prefix cache, exactly as for a device
  checkpoint: the index listens to KV block evictions and drops every host checkpoint
  whose prefix lost a block. A hit needs the KV blocks *and* a checkpoint at h, on either
  tier.
- **Tiers are exclusive.** A key is a device checkpoint or a host checkpoint, never both:
  an offload moves it down, a restore moves it up.
- **Eviction** on the host tier follows the device tier's policy (``lru``, or
  ``flop_aware`` with the same score: recency plus ``alpha`` times the FLOPs a hit saves,
  normalised). A checkpoint evicted from the host is dropped.
- **Order of copies.** The scheduler records copies in the order it decides them; a step
  carries the copies decided since the previous step (:meth:`HostCheckpointIndex.drain`).
  The runner runs all offloads (device -> host) first, then all restores (host -> device).
  This is safe because (a) an offload reads a page whose data was final before the
  scheduler freed it, and the freed page is written, at the earliest, by the forward of
  the step that carries the offload; (b) a host page that a restore reads is not handed
  out again until the step that carries the restore is drained (a freed host page waits
  in quarantine), so no offload of the same step overwrites it; (c) a restore may read a
  host page an offload of the same step wrote: restores run after offloads (on CUDA the
  side stream waits for an event recorded after the offloads).
- **Overlap.** On CUDA restores run on a side stream behind an event. A request whose hit
  is on the host waits one step (its restore overlaps that step's forward, which neither
  reads nor writes the fresh page); a forward waits for the event only if one of its rows
  reads a page being restored, and every later batch of copies waits for it before it
  starts (so a restored page is complete before it can be offloaded again or reused).
- **Bit-exact.** Copies are plain tensor copies between tensors of the same dtype: a
  restored state equals the evicted one in every layer and every state tensor.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hybridserve.cache.dependents import PrefixDependents
from hybridserve.cache.events import CacheEvent, EventSink
from hybridserve.cache.state_cache import eviction_victim
from hybridserve.step import Transfers

__all__ = ["HostCheckpoint", "HostCheckpointIndex", "HostStatePool", "Transfers", "host_pages_for"]


@dataclass(slots=True)
class HostCheckpoint:
    host_page: int
    length: int
    prefix_hashes: tuple[int, ...]


class HostCheckpointIndex:
    """Host page ids and the host checkpoints (see the module docstring)."""

    def __init__(
        self,
        num_pages: int,
        eviction_policy: str = "lru",
        flops_saved: Callable[[int], float] | None = None,
        alpha: float = 2.0,
    ) -> None:
        if num_pages < 0:
            raise ValueError(f"checkpoint_offload_pages must be >= 0, got {num_pages}")
        if eviction_policy not in ("lru", "flop_aware"):
            raise ValueError(f"eviction_policy={eviction_policy!r}; use 'lru' or 'flop_aware'")
        self.num_pages = num_pages
        self.eviction_policy = eviction_policy
        self.flops_saved = flops_saved or (lambda length: float(length))
        self.alpha = alpha
        self.free: list[int] = list(range(num_pages - 1, -1, -1))
        # Host pages whose restore is still queued: free once the queue is drained.
        self.quarantine: list[int] = []
        self.checkpoints: OrderedDict[int, HostCheckpoint] = OrderedDict()
        self._dependents = PrefixDependents()
        self._pending = Transfers()
        # Publishes host_checkpoint_stored / _removed (hybridserve.cache.events); None: off.
        self.event_sink: EventSink | None = None
        self.num_offloaded = 0
        self.num_restored = 0
        self.num_evicted = 0
        self.num_dropped = 0

    @property
    def enabled(self) -> bool:
        return self.num_pages > 0

    def has(self, key: int) -> bool:
        return key in self.checkpoints

    def offload(self, key: int, length: int, device_page: int, prefix_hashes: Sequence[int]) -> bool:
        """Take the checkpoint ``key`` evicted from device page ``device_page`` (its data
        final) into a host page, evicting a host checkpoint if none is free; queue the
        copy. Returns False (queuing nothing) when the tier is off or holds ``key``."""
        if not self.enabled or key in self.checkpoints:
            return False
        if not self.free:
            if not self.checkpoints:
                return False  # every host page waits in quarantine this step
            self._evict()
        host_page = self.free.pop()
        self.checkpoints[key] = HostCheckpoint(host_page, length, tuple(prefix_hashes))
        if self.event_sink is not None:
            self.event_sink(CacheEvent("host_checkpoint_stored", key, length))
        self._dependents.add(key, prefix_hashes)
        self._pending.offloads.append((device_page, host_page))
        self.num_offloaded += 1
        return True

    def restore(self, key: int, allocate_device_page: Callable[[], int]) -> tuple[HostCheckpoint, int]:
        """Remove host checkpoint ``key`` from the tier and queue its copy into a fresh
        device page taken from ``allocate_device_page`` (called after the removal, so an
        eviction that the allocation causes cannot pick ``key``). Returns the checkpoint
        and the device page; the caller makes it a device checkpoint."""
        ckpt = self._remove(key, quarantine=True)
        device_page = allocate_device_page()
        self._pending.restores.append((ckpt.host_page, device_page))
        self.num_restored += 1
        return ckpt, device_page

    def restoring_into(self) -> set[int]:
        """Device pages that queued restores will write (not yet drained)."""
        return {page for _, page in self._pending.restores}

    def touch(self, key: int) -> None:
        self.checkpoints.move_to_end(key)

    def drain(self) -> Transfers:
        """The copies queued since the last drain (for the step being built); host pages
        freed by its restores become available again."""
        out, self._pending = self._pending, Transfers()
        self.free += self.quarantine
        self.quarantine = []
        return out

    def _remove(self, key: int, quarantine: bool = False) -> HostCheckpoint:
        ckpt = self.checkpoints.pop(key)
        if self.event_sink is not None:
            self.event_sink(CacheEvent("host_checkpoint_removed", key, ckpt.length))
        self._dependents.remove(key)
        # A page whose offload is still queued may be reused at once: a later offload
        # into it in the same batch runs after the first (both on one stream, in order).
        (self.quarantine if quarantine else self.free).append(ckpt.host_page)
        return ckpt

    def _evict(self) -> None:
        keys = list(self.checkpoints)
        key = eviction_victim(keys, [self.checkpoints[k].length for k in keys],
                              self.eviction_policy, self.flops_saved, self.alpha)
        self._remove(key)
        self.num_evicted += 1

    def on_block_evicted(self, block_hash: int) -> None:
        """A KV block left the prefix index: drop every host checkpoint that needed it."""
        for key in self._dependents.dependents(block_hash):
            self._remove(key)
            self.num_dropped += 1

    def drop(self, key: int) -> None:
        """Forget host checkpoint ``key`` (its copy failed)."""
        self._remove(key)
        self.num_dropped += 1

    def clear(self) -> None:
        for key in list(self.checkpoints):
            self._remove(key)

    def check_integrity(self) -> None:
        """Raise AssertionError unless every host page is exactly one of: free, in
        quarantine, or a host checkpoint's; and the dependency map matches."""
        used = [c.host_page for c in self.checkpoints.values()]
        every = self.free + self.quarantine + used
        if sorted(every) != list(range(self.num_pages)):
            raise AssertionError(
                f"host checkpoint pages are lost or shared: free {sorted(self.free)}, "
                f"quarantine {sorted(self.quarantine)}, held {sorted(used)}"
            )
        self._dependents.check({k: c.prefix_hashes for k, c in self.checkpoints.items()},
                               what="host checkpoint")


class HostStatePool:
    """Host copies of the device state tensors, and the copies between them.

    ``device_states``: ``ModelCaches.states``, per recurrent layer ``{name: [pages,
    *shape]}`` as the layer's family declares
    (:class:`~hybridserve.models.layers.recurrent.StateTensor`). ``states`` mirrors it on
    the host: ``[num_pages, *shape]`` in the device tensor's dtype, for every layer and
    every named tensor; pinned when the device tensors are on CUDA.
    """

    def __init__(self, device_states: dict[int, dict[str, torch.Tensor]], num_pages: int) -> None:
        self.device_states = device_states
        some = next((t for s in device_states.values() for t in s.values()), None)
        self.cuda = some is not None and some.is_cuda
        pin = self.cuda

        def host_like(t: torch.Tensor) -> torch.Tensor:
            return torch.empty((num_pages, *t.shape[1:]), dtype=t.dtype, device="cpu", pin_memory=pin)

        self.states = {
            layer: {name: host_like(t) for name, t in tensors.items()}
            for layer, tensors in device_states.items()
        }
        self.num_pages = num_pages
        self.stream = torch.cuda.Stream(device=some.device) if self.cuda else None
        # Recorded on the side stream after the last batch of restores.
        self.restore_done: torch.cuda.Event | None = None
        self.restoring: set[int] = set()

    @staticmethod
    def page_bytes(device_states: dict[int, dict[str, torch.Tensor]]) -> int:
        """Bytes of one page over every layer's state tensors."""
        return sum(
            t[0].numel() * t.element_size() for s in device_states.values() for t in s.values()
        )

    def _pairs(self):
        for layer, tensors in self.device_states.items():
            for name, dev in tensors.items():
                yield dev, self.states[layer][name]

    def run(self, transfers: Transfers) -> None:
        """Run one step's copies: offloads, then restores (module docstring). On CUDA the
        offloads go on the current stream (ordered after every earlier forward and before
        this step's) and the restores on the side stream."""
        if self.cuda and self.restore_done is not None:
            # Earlier restores complete before any page they wrote or read is touched.
            torch.cuda.current_stream().wait_event(self.restore_done)
            self.restore_done = None
            self.restoring = set()
        if not transfers:
            return
        for dev, host in self._pairs():
            for page, hpage in transfers.offloads:
                host[hpage].copy_(dev[page], non_blocking=self.cuda)
        if not transfers.restores:
            return
        if not self.cuda:
            for dev, host in self._pairs():
                for hpage, page in transfers.restores:
                    dev[page].copy_(host[hpage])
            return
        offloaded = torch.cuda.Event()
        offloaded.record()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(offloaded)
            for dev, host in self._pairs():
                for hpage, page in transfers.restores:
                    dev[page].copy_(host[hpage], non_blocking=True)
            self.restore_done = torch.cuda.Event()
            self.restore_done.record(self.stream)
        self.restoring = {page for _, page in transfers.restores}

    def before_forward(self, pages_read: Sequence[int]) -> None:
        """Make the current stream wait for the restores if the forward reads one of
        their pages (otherwise the restores keep overlapping it)."""
        if self.restore_done is not None and self.restoring.intersection(pages_read):
            torch.cuda.current_stream().wait_event(self.restore_done)
            self.restore_done = None
            self.restoring = set()


def host_pages_for(cache, page_bytes: int) -> int:
    """Host pages for a :class:`~hybridserve.config.CacheConfig`: its
    ``checkpoint_offload_pages`` when set, else ``checkpoint_offload_gib`` worth of pages
    of ``page_bytes`` each (0 when prefix caching is off)."""
    if not cache.enable_prefix_caching:
        return 0
    if cache.checkpoint_offload_pages is not None:
        return cache.checkpoint_offload_pages
    if page_bytes <= 0:
        return 0
    return int(cache.checkpoint_offload_gib * 2**30 // page_bytes)
