"""The contract between the runner and a model implementation.

A model is a ``torch.nn.Module`` with:

- ``config``: its :class:`hybridserve.models.config.ModelConfig`;
- ``cache_spec``: a :class:`CacheSpec` saying which layers need which cache;
- ``forward(input_ids, batch, caches) -> hidden``: ``input_ids`` is ``[T]`` int64
  (packed rows, see :mod:`hybridserve.models.batch`), ``hidden`` is ``[T, hidden_size]``
  (after the final norm). It writes K/V to ``caches.kv`` at ``batch.slot_mapping`` and
  the requested states to ``caches.conv`` / ``caches.ssm`` pages; nothing else.
- ``compute_logits(hidden) -> logits``: ``[N, hidden_size] -> [N, vocab_size]`` float32,
  with any architecture scaling applied (Granite's ``logits_scaling``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from hybridserve.models.batch import ForwardBatch, ModelCaches


@dataclass(frozen=True)
class CacheSpec:
    """Which decoder layers hold which cache, and the shapes of one entry."""

    attention_layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    mamba_layers: tuple[int, ...]
    conv_dim: int
    d_conv: int
    num_ssm_heads: int
    ssm_head_dim: int
    d_state: int
    # Gated DeltaNet layers: conv window [gdn_conv_dim, gdn_d_conv - 1] and recurrent
    # state [gdn_value_heads, gdn_key_head_dim, gdn_value_head_dim] per page, in the same
    # conv / ssm dicts (and page ids) as the Mamba layers'.
    gdn_layers: tuple[int, ...] = ()
    gdn_conv_dim: int = 0
    gdn_d_conv: int = 1
    gdn_value_heads: int = 0
    gdn_key_head_dim: int = 0
    gdn_value_head_dim: int = 0

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """Every layer that keeps state in state pages (Mamba2 and GDN), in order."""
        return tuple(sorted(self.mamba_layers + self.gdn_layers))

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

    def state_page_bytes(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
        """Bytes of one state page across all recurrent layers (conv window + SSM state)."""
        conv_elem = torch.empty((), dtype=conv_dtype).element_size()
        ssm_elem = torch.empty((), dtype=ssm_dtype).element_size()
        conv = self.conv_dim * (self.d_conv - 1) * conv_elem
        ssm = self.num_ssm_heads * self.ssm_head_dim * self.d_state * ssm_elem
        gdn_conv = self.gdn_conv_dim * (self.gdn_d_conv - 1) * conv_elem
        gdn_ssm = (
            self.gdn_value_heads * self.gdn_key_head_dim * self.gdn_value_head_dim * ssm_elem
        )
        return len(self.mamba_layers) * (conv + ssm) + len(self.gdn_layers) * (gdn_conv + gdn_ssm)

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
        kv = {
            layer: (
                torch.empty(
                    num_kv_blocks,
                    kv_block_size,
                    self.num_kv_heads,
                    self.head_dim,
                    dtype=dtype,
                    device=device,
                ),
                torch.empty(
                    num_kv_blocks,
                    kv_block_size,
                    self.num_kv_heads,
                    self.head_dim,
                    dtype=dtype,
                    device=device,
                ),
            )
            for layer in self.attention_layers
        }
        conv = {
            layer: torch.empty(
                num_state_pages, self.conv_dim, self.d_conv - 1, dtype=dtype, device=device
            )
            for layer in self.mamba_layers
        }
        ssm = {
            layer: torch.empty(
                num_state_pages,
                self.num_ssm_heads,
                self.ssm_head_dim,
                self.d_state,
                dtype=ssm_dtype,
                device=device,
            )
            for layer in self.mamba_layers
        }
        for layer in self.gdn_layers:
            conv[layer] = torch.empty(
                num_state_pages, self.gdn_conv_dim, self.gdn_d_conv - 1, dtype=dtype,
                device=device,
            )
            ssm[layer] = torch.empty(
                num_state_pages, self.gdn_value_heads, self.gdn_key_head_dim,
                self.gdn_value_head_dim, dtype=ssm_dtype, device=device,
            )
        return ModelCaches(kv=kv, conv=conv, ssm=ssm)


class HybridModel(Protocol):
    """Structural type of every model class in :mod:`hybridserve.models`."""

    cache_spec: CacheSpec

    def forward(
        self, input_ids: torch.Tensor, batch: ForwardBatch, caches: ModelCaches
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
