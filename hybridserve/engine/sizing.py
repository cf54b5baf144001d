"""Cache sizes from the device's memory, as vLLM users set them (``gpu_memory_utilization``).

The rule (:func:`plan_memory`)
------------------------------
Let ``C = capacity * gpu_memory_utilization - weights - activation_peak`` be the cache
memory (the activation peak comes from a profile forward at the largest step the
scheduler can build: :func:`profile_activation_peak`). Then, in this order:

1. **Live state**: every seat (``max_num_seqs``) gets ``pages_per_seq`` state pages (its
   state, its kept block-boundary state and the pages one step writes), plus a little
   slack. This is a fixed need: if it does not fit, lower ``max_num_seqs``.
2. **Checkpoints**: ``checkpoint_memory_fraction`` of what is left after live state
   becomes checkpoint pages (the device checkpoint budget; evicted ones go to the host
   tier, :mod:`hybridserve.cache.host_tier`).
3. **KV**: the rest becomes attention KV blocks. It must hold at least one sequence of
   ``max_model_len`` tokens, else the configuration is refused naming the knobs.

State memory is live pages plus checkpoint pages; both share one page pool.
:func:`plan_memory` is pure arithmetic (the CPU tests give it a fake capacity).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GiB = 2**30


@dataclass(frozen=True)
class MemoryPlan:
    """The split :func:`plan_memory` decided, in pages/blocks and bytes."""

    capacity_bytes: int
    usable_bytes: int
    weights_bytes: int
    activation_bytes: int
    num_kv_blocks: int
    num_state_pages: int
    max_checkpoint_pages: int
    kv_bytes: int
    state_bytes: int
    checkpoint_bytes: int
    max_model_len: int
    max_len_requests: int  # requests of max_model_len tokens the KV blocks hold at once

    def log_line(self) -> str:
        return (
            f"memory: {_fmt(self.usable_bytes)} usable of {_fmt(self.capacity_bytes)}; "
            f"weights {_fmt(self.weights_bytes)}, activations {_fmt(self.activation_bytes)}, "
            f"KV {_fmt(self.kv_bytes)} ({self.num_kv_blocks} blocks), "
            f"state {_fmt(self.state_bytes)} ({self.num_state_pages} pages, of which "
            f"checkpoints {_fmt(self.checkpoint_bytes)} = {self.max_checkpoint_pages} pages); "
            f"{self.max_len_requests} requests of max_model_len={self.max_model_len} fit"
        )


def _fmt(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def plan_memory(
    *,
    capacity_bytes: int,
    gpu_memory_utilization: float,
    weights_bytes: int,
    activation_peak_bytes: int,
    kv_block_bytes: int,
    kv_block_size: int,
    state_page_bytes: int,
    max_model_len: int,
    max_num_seqs: int,
    pages_per_seq: int,
    checkpoint_memory_fraction: float = 0.2,
    checkpoint_pages: int | None = None,
    slack_pages: int = 8,
) -> MemoryPlan:
    """Split the device memory by the module's rule; ValueError naming the knob when
    the configuration cannot work. ``checkpoint_pages`` (an explicit
    ``max_checkpoint_pages``) replaces step 2's share: that many checkpoint pages, and the
    memory the share would have taken goes to KV."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
        )
    if not 0.0 <= checkpoint_memory_fraction < 1.0:
        raise ValueError(
            f"checkpoint_memory_fraction must be in [0, 1), got {checkpoint_memory_fraction}"
        )
    usable = int(capacity_bytes * gpu_memory_utilization)
    cache = usable - weights_bytes - activation_peak_bytes
    if cache <= 0:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} gives {usable / GiB:.2f} GiB, but the "
            f"weights take {weights_bytes / GiB:.2f} GiB and the largest step's activations "
            f"{activation_peak_bytes / GiB:.2f} GiB: raise gpu_memory_utilization or lower "
            "max_num_batched_tokens"
        )
    live_pages = max_num_seqs * pages_per_seq + slack_pages
    live_bytes = live_pages * state_page_bytes
    if live_bytes >= cache:
        raise ValueError(
            f"max_num_seqs={max_num_seqs} needs {live_pages} state pages ({live_bytes / GiB:.2f} GiB) "
            f"but only {cache / GiB:.2f} GiB are left for caches: lower max_num_seqs or raise "
            "gpu_memory_utilization"
        )
    rest = cache - live_bytes
    if checkpoint_pages is not None:
        if checkpoint_pages < 0:
            raise ValueError(f"max_checkpoint_pages must be >= 0, got {checkpoint_pages}")
        if checkpoint_pages * state_page_bytes > rest:
            raise ValueError(
                f"max_checkpoint_pages={checkpoint_pages} needs "
                f"{checkpoint_pages * state_page_bytes / GiB:.2f} GiB but {rest / GiB:.2f} GiB are "
                "left after live state: lower max_checkpoint_pages or raise gpu_memory_utilization"
            )
        ckpt_pages = checkpoint_pages
    else:
        ckpt_pages = int(rest * checkpoint_memory_fraction) // state_page_bytes if state_page_bytes else 0
    kv_left = rest - ckpt_pages * state_page_bytes
    num_blocks = kv_left // kv_block_bytes if kv_block_bytes else 0
    blocks_per_seq = -(-max_model_len // kv_block_size)
    if kv_block_bytes and num_blocks < blocks_per_seq:
        raise ValueError(
            f"one sequence of max_model_len={max_model_len} needs {blocks_per_seq} KV blocks "
            f"({blocks_per_seq * kv_block_bytes / GiB:.2f} GiB) but {kv_left / GiB:.2f} GiB are left "
            "for KV: lower max_model_len (or max_num_seqs, checkpoint_memory_fraction) or raise "
            "gpu_memory_utilization"
        )
    if not kv_block_bytes:
        num_blocks = blocks_per_seq * max_num_seqs  # no attention layer: blocks cost nothing
    state_pages = live_pages + ckpt_pages
    return MemoryPlan(
        capacity_bytes=capacity_bytes,
        usable_bytes=usable,
        weights_bytes=weights_bytes,
        activation_bytes=activation_peak_bytes,
        num_kv_blocks=int(num_blocks),
        num_state_pages=state_pages,
        max_checkpoint_pages=ckpt_pages,
        kv_bytes=int(num_blocks) * kv_block_bytes,
        state_bytes=state_pages * state_page_bytes,
        checkpoint_bytes=ckpt_pages * state_page_bytes,
        max_model_len=max_model_len,
        max_len_requests=int(num_blocks) // blocks_per_seq,
    )


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


@torch.inference_mode()
def profile_forward(
    model: torch.nn.Module, num_tokens: int, kv_block_size: int, dtype: torch.dtype,
    ssm_dtype: torch.dtype, device: torch.device | str,
) -> torch.Tensor:
    """One prefill row of ``num_tokens`` tokens from the zero state through the model
    and its logits head (for the last token), on caches of its own; returns the logits."""
    from hybridserve.models.batch import ForwardBatch

    device = torch.device(device)
    blocks = -(-num_tokens // kv_block_size)
    caches = model.cache_spec.allocate(blocks, kv_block_size, 2, dtype, ssm_dtype, device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    batch = ForwardBatch(
        query_start=[0, num_tokens], num_computed=[0],
        positions=torch.arange(num_tokens, device=device), context_lens=[num_tokens],
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        slot_mapping=torch.arange(num_tokens, device=device), state_in_page=[-1],
        state_out_row=[0], state_out_offset=[num_tokens - 1], state_out_page=[0],
    )
    hidden = model.forward(ids, batch, caches)
    return model.compute_logits(hidden[-1:])


def profile_activation_peak(
    model: torch.nn.Module, num_tokens: int, kv_block_size: int, dtype: torch.dtype,
    ssm_dtype: torch.dtype, device: torch.device | str,
) -> int:
    """Peak bytes :func:`profile_forward` (the largest step the scheduler builds: one
    prefill row of ``num_tokens``) allocates beyond what was allocated before, measured on
    CUDA with the allocator's peak counter; 0 elsewhere (CPU memory is not budgeted this
    way). The profile's own caches (one sequence's KV, two state pages) count in the peak,
    a slight overestimate."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    logits = profile_forward(model, num_tokens, kv_block_size, dtype, ssm_dtype, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del logits
    torch.cuda.empty_cache()
    return int(peak)


def check_free_memory(device: torch.device | str, gpu_memory_utilization: float) -> None:
    """Refuse to start when the device's free memory is below the share asked for
    (memory held by other processes counts against it), naming the knob. A no-op off
    CUDA: RAM is not measured this way."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    free, total = (int(x) for x in torch.cuda.mem_get_info(device))
    want = int(total * gpu_memory_utilization)
    if free < want:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} asks for {want / GiB:.2f} GiB of "
            f"{device} ({total / GiB:.2f} GiB), but only {free / GiB:.2f} GiB are free at start "
            f"(other processes hold {(total - free) / GiB:.2f} GiB): lower "
            "gpu_memory_utilization or free the device"
        )


def device_capacity_bytes(device: torch.device | str) -> int:
    """Total memory of ``device``: the GPU's on CUDA, the machine's RAM elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
