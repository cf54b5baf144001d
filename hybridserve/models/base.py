"""The contract between the runner and a model implementation.

A model is a ``torch.nn.Module`` with:

- ``config``: its :class:`hybridserve.models.config.ModelConfig`;
- ``cache_spec``: a :class:`CacheSpec` saying which layers need which cache;
- ``forward(input_ids, batch, caches) -> hidden``: ``input_ids`` is ``[T]`` int64
  (packed rows, see :mod:`hybridserve.models.batch`), ``hidden`` is ``[T, hidden_size]``
  (after the final norm). It writes K/V to ``caches.kv`` at ``batch.slot_mapping`` and
  the requested states to their pages of ``caches.states``; nothing else.
- ``plan_step(batch) -> batch``: the step plan, once per step
  (:mod:`hybridserve.models.step_plan`).
- ``compute_logits(hidden) -> logits``: ``[N, hidden_size] -> [N, vocab_size]`` float32,
  with any architecture scaling applied (Granite's ``logits_scaling``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from hybridserve.models.batch import ForwardBatch, ModelCaches
from hybridserve.models.layers.recurrent import StateTensor


@dataclass(frozen=True)
class CacheSpec:
    """Which decoder layers hold which cache, and the shapes of one entry.

    Attention: ``attention_layers`` each hold K and V blocks of ``[kv_block_size,
    num_kv_heads, head_dim]``. Recurrent layers: ``recurrent_layers`` each hold, per
    state page, the tensors their family declares (``state_tensors``, one declaration a
    layer; :class:`~hybridserve.models.layers.recurrent.RecurrentLayer`), all in the same
    page ids.
    """

    attention_layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    recurrent_layers: tuple[int, ...]
    # One declaration per recurrent layer, in the order of recurrent_layers.
    state_tensors: tuple[tuple[StateTensor, ...], ...] = ()
    # The recurrent layers of each family (for reports and family-specific plans).
    mamba_layers: tuple[int, ...] = ()
    gdn_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.state_tensors) != len(self.recurrent_layers):
            raise ValueError("CacheSpec.state_tensors needs one declaration per recurrent layer")

    def kv_block_bytes(self, kv_block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one KV block across all attention layers (keys and values)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return (
            2
            * len(self.attention_layers)
            * kv_block_size
            * self.num_kv_heads
            * self.head_dim
            * elem
        )

    def state_page_bytes(self, dtype: torch.dtype, state_dtype: torch.dtype) -> int:
        """Bytes of one state page across all recurrent layers (every declared tensor;
        ``dtype`` the model's, ``state_dtype`` the recurrent state's)."""
        return sum(
            t.page_bytes(dtype, state_dtype) for layer in self.state_tensors for t in layer
        )

    def allocate(
        self,
        num_kv_blocks: int,
        kv_block_size: int,
        num_state_pages: int,
        dtype: torch.dtype,
        ssm_dtype: torch.dtype,
        device: torch.device | str,
    ) -> ModelCaches:
        """Allocate every cache tensor. Contents are undefined until written."""

        def blocks() -> torch.Tensor:
            return torch.empty(
                num_kv_blocks, kv_block_size, self.num_kv_heads, self.head_dim,
                dtype=dtype, device=device,
            )

        kv = {layer: (blocks(), blocks()) for layer in self.attention_layers}
        states = {
            layer: {
                t.name: torch.empty(
                    num_state_pages, *t.shape, dtype=t.dtype(dtype, ssm_dtype), device=device
                )
                for t in tensors
            }
            for layer, tensors in zip(self.recurrent_layers, self.state_tensors)
        }
        return ModelCaches(kv=kv, states=states)


class HybridModel(Protocol):
    """Structural type of every model class in :mod:`hybridserve.models`."""

    cache_spec: CacheSpec

    def forward(
        self, input_ids: torch.Tensor, batch: ForwardBatch, caches: ModelCaches
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
