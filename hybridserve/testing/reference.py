"""Reference states for checkpoint tests: what a fresh, uncached run computes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridserve.models.batch import ForwardBatch


@torch.inference_mode()
def reference_state(
    model: torch.nn.Module, token_ids: Sequence[int], length: int, ssm_dtype: torch.dtype = torch.float32
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Every Mamba layer's (conv window, SSM state) after ``token_ids[:length]``.

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
