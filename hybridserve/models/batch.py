"""The per-step inputs a model forward needs beyond token ids.

The runner builds one :class:`ForwardBatch` per step and passes it explicitly to
``model.forward``; no layer reads step state from a module global.

Layout of a step (packed, variable length)::

    row i owns tokens [query_start[i], query_start[i + 1]) of the packed input;
    those tokens sit at absolute positions [num_computed[i], num_computed[i] + q_i)
    of request i's sequence, where q_i = query_start[i + 1] - query_start[i].

Attention (paged KV): every attention layer owns ``k_cache`` / ``v_cache`` of shape
``[num_blocks, kv_block_size, num_kv_heads, head_dim]``. Token t of the step writes
its key and value to flat slot ``slot_mapping[t]`` (``block * kv_block_size + offset``)
before attending; row i attends over the first ``context_lens[i]`` tokens described
by ``block_tables[i]`` (causally for its own new tokens).

Recurrent state (state pages): every Mamba layer owns ``conv_state`` of shape
``[num_state_pages, conv_dim, d_conv - 1]`` and ``ssm_state`` of shape
``[num_state_pages, num_heads, head_dim, d_state]``. All Mamba layers use the same
page id for the same logical state. Row i reads its initial state from page
``state_in_page[i]`` (-1 means the zero state: a sequence that starts at token 0)
and, for every k with ``state_out_row[k] == i``, writes the state *after* the
row's token at offset ``state_out_offset[k]`` (0-based within the row, so offset
q_i - 1 is the state after the row's last token) to page ``state_out_page[k]``.
A forward never writes a page it reads in the same step (docs/state-lifecycle.md),
so the order in which rows or layers are processed cannot matter.

Gated DeltaNet layers (Qwen3.5 / Qwen3-Next) keep the same contract in the same page ids,
with their own shapes: ``conv_state [num_state_pages, conv_dim, d_conv - 1]`` and
``ssm_state [num_state_pages, value_heads, key_head_dim, value_head_dim]``
(:mod:`hybridserve.models.layers.gated_deltanet`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.models.step_plan import StatePlan


@dataclass
class ForwardBatch:
    """Per-step metadata for one packed forward (see the module docstring)."""

    # Packing. Host lists mirror the tensors so CPU reference code can loop
    # without device syncs; GPU kernels use the tensors. None only in a graph step.
    query_start: list[int] | None  # len B + 1, query_start[0] == 0
    num_computed: list[int] | None  # len B, tokens already in the caches before this step
    positions: torch.Tensor  # [T] int64, absolute position of every packed token

    # Attention.
    context_lens: list[int] | None  # len B, num_computed[i] + q_i
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    slot_mapping: torch.Tensor  # [T] int64

    # Recurrent state.
    state_in_page: list[int] | None  # len B, -1 = zero state
    state_out_row: list[int] | None  # len K
    state_out_offset: list[int] | None  # len K
    state_out_page: list[int] | None  # len K

    # The plan (module docstring).
    planned: bool = False
    uniform_q: int = 0  # every row runs this many tokens (attention's decode path); 0: not
    states: StatePlan | None = None  # None: the model has no recurrent layers, or unplanned
    max_context: int = 0  # a graph step's key-axis size (no host context_lens)
    # The prefill attention's tile maps by tokens a tile, computed by the step's first
    # attention layer and reused by the others (None: each layer computes its own). A
    # short-row graph's static step fills them on its warm-up run and its capture reuses
    # them (nothing is uploaded inside a capture).
    attention_tiles: dict[int, torch.Tensor] | None = None

    @property
    def num_rows(self) -> int:
        if self.query_start is None:
            return self.block_tables.shape[0]
        return len(self.query_start) - 1

    @property
    def num_tokens(self) -> int:
        if self.query_start is None:
            return self.positions.numel()
        return self.query_start[-1]

    @property
    def longest_context(self) -> int:
        """The longest row context: what sizes a padded gather of keys."""
        if self.context_lens is None:
            return self.max_context
        return max(self.context_lens, default=0)

    def query_len(self, row: int) -> int:
        return self.query_start[row + 1] - self.query_start[row]

    def state_outputs_of(self, row: int) -> list[tuple[int, int]]:
        """``(offset, page)`` pairs row ``row`` must write, sorted by offset."""
        out = [
            (off, page)
            for r, off, page in zip(self.state_out_row, self.state_out_offset, self.state_out_page)
            if r == row
        ]
        out.sort()
        return out

    def writes_only_unread_pages(self) -> bool:
        """No state output page repeats or is any row's input page (the page rule,
        docs/state-lifecycle.md): what lets a launch read input pages while it writes
        output pages."""
        pages = self.state_out_page
        return len(set(pages)) == len(pages) and not set(pages) & set(self.state_in_page)

    def token_out_pages(self) -> list[int]:
        """``[T]``: the page the state after each packed token goes to, -1 for none."""
        out = [-1] * self.num_tokens
        for r, off, page in zip(self.state_out_row, self.state_out_offset, self.state_out_page):
            if not 0 <= off < self.query_len(r):
                raise ValueError(f"state request (row {r}, offset {off}) out of range")
            out[self.query_start[r] + off] = page
        return out

    def validate(self) -> None:
        """Check internal consistency; raises ValueError naming the field."""
        b = self.num_rows
        if self.query_start[0] != 0 or any(
            self.query_start[i + 1] < self.query_start[i] for i in range(b)
        ):
            raise ValueError("ForwardBatch.query_start must start at 0 and be non-decreasing")
        for name in ("num_computed", "context_lens", "state_in_page"):
            if len(getattr(self, name)) != b:
                raise ValueError(f"ForwardBatch.{name} must have one entry per row ({b})")
        if self.positions.numel() != self.num_tokens:
            raise ValueError("ForwardBatch.positions must have one entry per packed token")
        if self.slot_mapping.numel() != self.num_tokens:
            raise ValueError("ForwardBatch.slot_mapping must have one entry per packed token")
        k = len(self.state_out_row)
        if len(self.state_out_offset) != k or len(self.state_out_page) != k:
            raise ValueError("ForwardBatch.state_out_* lists must have the same length")
        for r, off, page in zip(self.state_out_row, self.state_out_offset, self.state_out_page):
            if not 0 <= r < b or not 0 <= off < self.query_len(r):
                raise ValueError(f"ForwardBatch state output (row {r}, offset {off}) out of range")
            if page == self.state_in_page[r]:
                raise ValueError(f"ForwardBatch row {r} writes page {page} it also reads")
        if len(set(self.state_out_page)) != k:
            raise ValueError("ForwardBatch.state_out_page must not repeat a page")


@dataclass
class ModelCaches:
    """The cache tensors a forward reads and writes, indexed by decoder layer index.

    ``kv[layer] = (k_cache, v_cache)`` for attention layers; ``states[layer]`` for
    recurrent layers, ``{name: [num_state_pages, *shape]}`` as the layer's family declares
    (:class:`~hybridserve.models.layers.recurrent.StateTensor`; Mamba2: ``conv`` and
    ``ssm``, shapes in the module docstring). The runner allocates them from the model's
    :class:`~hybridserve.models.base.CacheSpec`.
    """

    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
    states: dict[int, dict[str, torch.Tensor]]

    @property
    def conv(self) -> dict[int, torch.Tensor]:
        """Mamba2's conv windows by layer (``states[layer]["conv"]``)."""
        return {layer: s["conv"] for layer, s in self.states.items() if "conv" in s}

    @property
    def ssm(self) -> dict[int, torch.Tensor]:
        """Mamba2's SSM states by layer (``states[layer]["ssm"]``)."""
        return {layer: s["ssm"] for layer, s in self.states.items() if "ssm" in s}

    def state_tensors(self) -> list[torch.Tensor]:
        """Every state tensor of every recurrent layer."""
        return [t for s in self.states.values() for t in s.values()]
