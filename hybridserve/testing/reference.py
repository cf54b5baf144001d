"""Reference states for checkpoint tests: what a fresh, uncached run computes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridserve.cache.block_pool import block_hashes
from hybridserve.models.batch import ForwardBatch


@torch.inference_mode()
def reference_state(
    model: torch.nn.Module, token_ids: Sequence[int], length: int, ssm_dtype: torch.dtype = torch.float32
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Every recurrent layer's (conv window, SSM state) after ``token_ids[:length]``.

    Runs one cold prefill of ``length`` tokens in private caches (nothing shared with
    any engine) and returns ``(conv[layer], ssm[layer])``.
    """
    if not 1 <= length <= len(token_ids):
        raise ValueError(f"length {length} outside [1, {len(token_ids)}]")
    spec = model.cache_spec
    block_size = 16
    num_blocks = -(-length // block_size)
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    caches = spec.allocate(num_blocks, block_size, 1, dtype, ssm_dtype, device)
    positions = torch.arange(length, device=device)
    batch = ForwardBatch(
        query_start=[0, length],
        num_computed=[0],
        positions=positions,
        context_lens=[length],
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        slot_mapping=positions.clone(),
        state_in_page=[-1],
        state_out_row=[0],
        state_out_offset=[length - 1],
        state_out_page=[0],
    )
    model.forward(torch.tensor(list(token_ids[:length]), device=device), batch, caches)
    conv = {layer: t[0].clone() for layer, t in caches.conv.items()}
    ssm = {layer: t[0].clone() for layer, t in caches.ssm.items()}
    return conv, ssm


def assert_checkpoints_exact(llm, sequences: Sequence[Sequence[int]], atol: float = 1e-5) -> int:
    """Assert every live checkpoint of ``llm`` equals a cold run's state at its position
    (the cold run keeps its states in the engine's ``ssm_state_dtype``).

    ``sequences`` must include the token sequence each checkpoint was taken from (its
    prefix is recovered through the chained block hashes). Returns how many were checked.
    """
    sched = llm.engine.scheduler
    caches = llm.engine.runner.caches
    by_key = {}
    for seq in sequences:
        for i, h in enumerate(block_hashes(seq, sched.block_size)):
            by_key.setdefault(h, seq[: (i + 1) * sched.block_size])
    checked = 0
    for key, ckpt in sched.states.checkpoints.items():
        prefix = by_key[key]  # KeyError: a checkpoint from no sequence given
        assert len(prefix) == ckpt.length
        conv, ssm = reference_state(
            llm.model, prefix, ckpt.length, llm.config.cache.ssm_state_dtype
        )
        for layer in conv:
            assert (caches.conv[layer][ckpt.page] - conv[layer]).abs().max() <= atol
            assert (caches.ssm[layer][ckpt.page] - ssm[layer]).abs().max() <= atol
        checked += 1
    return checked
