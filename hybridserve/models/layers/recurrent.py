"""The contract of a recurrent layer family (Mamba2 today; Gated DeltaNet next).

A recurrent family is a mixer that carries a fixed-size state from token to token. The
engine never sees the family: the scheduler, the state cache, the state postprocess, the
CUDA graphs and the page accounting deal only in *state pages* (one page id names one
logical state of one sequence, for every recurrent layer of the model at once). What a
family must provide is written in :class:`RecurrentLayer`; what it gets is a planned
step (:mod:`hybridserve.models.step_plan`) and its layer's page tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

__all__ = ["STATE_DTYPE_ROLES", "RecurrentLayer", "StateTensor"]

# Which dtype a state tensor is allocated in: the model's (``config.dtype``) or the
# recurrent state's (``CacheConfig.ssm_state_dtype``, float32 by default).
STATE_DTYPE_ROLES = ("model", "state")


@dataclass(frozen=True)
class StateTensor:
    """One named tensor of a layer's state, per page: ``shape`` (without the page axis)
    in the dtype ``dtype_role`` names (:data:`STATE_DTYPE_ROLES`)."""

    name: str
    shape: tuple[int, ...]
    dtype_role: str

    def __post_init__(self) -> None:
        if self.dtype_role not in STATE_DTYPE_ROLES:
            raise ValueError(
                f"StateTensor {self.name!r}: dtype_role={self.dtype_role!r}, choose from "
                f"{STATE_DTYPE_ROLES}"
            )
        if not self.shape or any(d < 1 for d in self.shape):
            raise ValueError(f"StateTensor {self.name!r}: shape {self.shape} must be positive")

    def dtype(self, model_dtype: torch.dtype, state_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.dtype_role == "model" else state_dtype

    def page_bytes(self, model_dtype: torch.dtype, state_dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=self.dtype(model_dtype, state_dtype)).element_size()
        n = 1
        for d in self.shape:
            n *= d
        return n * elem


class RecurrentLayer(nn.Module):
    """Base class of a recurrent mixer; its subclasses are the families.

    **State, per page.** :meth:`state_tensors` declares the named tensors one page of
    this layer holds (shapes without the page axis, and the dtype role of each). The
    model's :class:`~hybridserve.models.base.CacheSpec` collects the declarations and
    ``CacheSpec.allocate`` creates ``[num_state_pages, *shape]`` for each, so the page
    size, the memory check and the CUDA graphs' scratch page follow from it. Mamba2:
    ``conv [conv_dim, d_conv - 1]`` (model dtype: the conv window, oldest input first)
    and ``ssm [heads, head_dim, d_state]`` (state dtype). Every page's contents are
    undefined until a step writes them; a layer reads only the pages the plan names.

    **The step.** ``forward(h, batch, states) -> out``: ``h [T, hidden]`` packed rows,
    ``batch`` a planned :class:`~hybridserve.models.batch.ForwardBatch`, ``states`` this
    layer's ``{name: [pages, *shape]}``. Row ``i`` starts from page
    ``batch.states.in_pages[i]`` (``-1``: the zero state, a sequence's first token) and the
    state after packed token ``t`` goes to page ``batch.states.token_out_pages[t]`` when it
    is ``>= 0`` (host lists: ``state_in_page`` and ``state_out_*``). So one op covers:

    - prefill, with states at requested offsets (grid checkpoints, junctions, row ends);
    - decode and verify, writing each position's state to its own page (the postprocess
      later keeps the accepted one: no copy, docs/state-lifecycle.md).

    ``batch.states.kind`` says how the step runs, decided once for every recurrent layer
    (``DECODE``: uniform rows, the row length unrolled, what CUDA graphs capture;
    ``SHORT``: token by token over rows of any length; ``PACKED``: a chunked scan over
    all rows; ``ROWS``: row by row, the oracle) and ``batch.states.triton`` whether its
    launches take the Triton kernels or the twins. A family that has no fast form of a
    kind computes it by its row-by-row path: every kind has the same result.

    **Rules.** Never write a page the step reads (no output page is an input page, and
    none repeats: the plan guarantees it, docs/state-lifecycle.md), so layers and rows run in
    any order; write nothing but the requested pages; keep no state between steps; no
    host read inside ``DECODE`` (CUDA graphs replay it). Kernels take tensors: the layer
    turns the plan into kernel arguments, the kernels import nothing from ``models``.
    """

    #: The family's name (``"mamba2"``), as the model config's layer kinds spell it.
    family: ClassVar[str]

    def state_tensors(self) -> tuple[StateTensor, ...]:
        """The state one page of this layer holds (see the class docstring)."""
        raise NotImplementedError

    def forward(
        self, h: torch.Tensor, batch, states: dict[str, torch.Tensor]
    ) -> torch.Tensor:  # pragma: no cover - the contract
        raise NotImplementedError
