"""Mixture-of-experts block: router, routed experts, shared expert.

One module for the three routing families of :class:`~hybridserve.models.config.MoEParams`
(``routing`` picks the arithmetic and the module names, which equal the family's
in-memory ``transformers`` names so ``state_dict()`` keys line up with the loader's):

============================  =================  ================  ==========================
routing                       router             shared expert     extras
============================  =================  ================  ==========================
``topk_then_softmax``         ``router``         (Granite's layer  --
(Granite ``block_sparse_moe``)                   ``shared_mlp``)
``sigmoid_grouped``           ``gate`` (+        ``shared_experts``  ``fc1/fc2_latent_proj``
(Nemotron-H ``mixer``)        ``e_score_correction_bias``)            (latent MoE)
``softmax_then_topk``         ``gate``           ``shared_expert``   ``shared_expert_gate``
(Qwen3-Next / 3.5-MoE ``mlp``)
============================  =================  ================  ==========================

Routed experts live in ``experts``: ``gate_up_proj [E, 2I, H]`` (gate rows, then up rows)
or ``up_proj [E, I, H]`` for plain experts, and ``down_proj [E, H, I]``; checkpoints that
store one tensor per expert are stacked into these at load (:func:`checkpoint_slot`).

Router numerics follow each reference exactly, since which experts a token reaches is
discrete: Granite takes the top-k of the float32 logits of a product in the activation
dtype and softmaxes those k; Nemotron-H computes the product in float32, ranks groups and
experts by ``sigmoid + bias`` with ``torch.topk`` as the reference calls it (so ties fall
the same way) and weights by the unbiased scores; Qwen softmaxes all logits in float32
and renormalises the top k. Routing weights then come in the activation dtype (Granite,
Qwen) or float32 (Nemotron-H), and the CPU path (:func:`~hybridserve.kernels.moe.
moe_experts_loop`) sums the experts' outputs in that same dtype, as the references do.

Where :func:`hybridserve.kernels.moe.triton_enabled` says so (CUDA by default) the routed
experts run as the grouped kernels of :mod:`hybridserve.kernels.moe` (tokens sorted by
expert on the device, two launches, no host sync); everything else takes the loop.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.config import KernelPolicy
from hybridserve.kernels import moe as moe_kernels
from hybridserve.models.config import (
    SIGMOID_GROUPED,
    SOFTMAX_THEN_TOPK,
    TOPK_THEN_SOFTMAX,
    MLPParams,
    MoEParams,
)
from hybridserve.models.layers.mlp import GatedMLP, PlainMLP, activation_fn

ROUTER_NAMES = {TOPK_THEN_SOFTMAX: "router", SIGMOID_GROUPED: "gate", SOFTMAX_THEN_TOPK: "gate"}
SHARED_NAMES = {SIGMOID_GROUPED: "shared_experts", SOFTMAX_THEN_TOPK: "shared_expert"}

# Weights the loader keeps in float32 whatever the model dtype (transformers does too):
# the correction bias only ranks experts, and bf16 would reorder near-equal scores.
FLOAT32_WEIGHTS = ("e_score_correction_bias",)


class Router(nn.Module):
    """``x [T, H]`` -> ``(topk_ids [T, k] int64, topk_weights [T, k])`` (module docstring)."""

    def __init__(self, hidden_size: int, p: MoEParams) -> None:
        super().__init__()
        self.p = p
        self.weight = nn.Parameter(torch.empty(p.num_experts, hidden_size))
        if p.routing == SIGMOID_GROUPED:
            self.register_buffer(
                "e_score_correction_bias", torch.zeros(p.num_experts, dtype=torch.float32)
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.p
        if p.routing == TOPK_THEN_SOFTMAX:
            logits = F.linear(x, self.weight).float()
            top, ids = logits.topk(p.top_k, dim=-1)
            return ids, torch.softmax(top, dim=-1).to(x.dtype)
        if p.routing == SOFTMAX_THEN_TOPK:
            logits = F.linear(x, self.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            top, ids = torch.topk(probs, p.top_k, dim=-1)
            if p.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return ids, top.to(logits.dtype)
        return self._sigmoid_grouped(x)

    def _sigmoid_grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.p
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        per_group = p.num_experts // p.n_group
        # A group scores the sum of its two best biased scores (the reference does this
        # even with one group, where it selects everything; skip the no-op there).
        if p.topk_group < p.n_group:
            group_scores = choice.view(-1, p.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=p.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
            keep = group_mask.bool()[:, :, None].expand(-1, -1, per_group).reshape_as(choice)
            choice = choice.masked_fill(~keep, float("-inf"))
        ids = torch.topk(choice, k=p.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if p.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * p.routed_scaling_factor


class Experts(nn.Module):
    """The routed experts, stacked: ``gate_up_proj`` or ``up_proj``, and ``down_proj``.

    ``forward(x, ids, weights, add)`` returns the routed sum plus ``add`` (the shared
    expert's output): the kernels add it in float32 before their one rounding, the loop
    after its own. Subclasses whose output is not the final sum (one rank's share, summed
    over the ranks afterwards) set :attr:`takes_add` False and the block adds it itself.
    """

    takes_add = True

    def __init__(self, input_size: int, p: MoEParams) -> None:
        super().__init__()
        self.kernels = "auto"  # KernelPolicy.moe (the owning MoEBlock sets it)
        self.gated = p.gated
        self.activation = p.activation
        self.act = activation_fn(p.activation)
        # Nemotron-H sums the weighted experts in the weights' dtype (float32).
        self.accumulate_fp32 = p.routing == SIGMOID_GROUPED
        e, i = p.num_experts, p.intermediate_size
        if p.gated:
            self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, input_size))
        else:
            self.up_proj = nn.Parameter(torch.empty(e, i, input_size))
        self.down_proj = nn.Parameter(torch.empty(e, input_size, i))

    @property
    def w1(self) -> torch.Tensor:
        return self.gate_up_proj if self.gated else self.up_proj

    def grouped(self, dtype: torch.dtype, mode: str | None = None) -> bool:
        """Whether activations of ``dtype`` take the grouped kernels in inference (routing
        and sorting on the device, no host sync: what a CUDA graph can capture) rather
        than the per-expert loop (which reads the experts present back), under
        ``KernelPolicy.moe`` = ``mode`` (default this module's)."""
        x = self.down_proj.new_empty((0, self.down_proj.shape[1]), dtype=dtype)
        with torch.no_grad():
            return moe_kernels.triton_enabled(mode or self.kernels, x, self.w1,
                                              self.down_proj, self.activation)

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        add: torch.Tensor | None = None,
    ) -> torch.Tensor:
        w1, w2 = self.w1, self.down_proj
        if moe_kernels.triton_enabled(self.kernels, x, w1, w2, self.activation):
            return moe_kernels.moe_experts(
                x.contiguous(), w1, w2, topk_ids, topk_weights,
                gated=self.gated, activation=self.activation,
                add=None if add is None else add.contiguous(),
            )
        acc = torch.float32 if self.accumulate_fp32 else x.dtype
        y = moe_kernels.moe_experts_loop(
            x, w1, w2, topk_ids, topk_weights, gated=self.gated, act=self.act,
            accumulate_dtype=torch.promote_types(acc, x.dtype),
        )
        return y if add is None else y + add


class MoEBlock(nn.Module):
    """``x [T, H]`` -> ``[T, H]``: routed experts plus the shared expert (module docstring)."""

    def __init__(
        self, hidden_size: int, p: MoEParams, policy: KernelPolicy | None = None
    ) -> None:
        super().__init__()
        self.p = p
        self._router = ROUTER_NAMES[p.routing]
        self.add_module(self._router, Router(hidden_size, p))
        self.experts = Experts(p.latent_size or hidden_size, p)
        # KernelPolicy.moe: where the routed experts take the grouped kernels.
        self.experts.kernels = (policy or KernelPolicy()).moe
        self.latent = p.latent_size is not None
        if self.latent:
            self.fc1_latent_proj = nn.Linear(hidden_size, p.latent_size, bias=p.bias)
            self.fc2_latent_proj = nn.Linear(p.latent_size, hidden_size, bias=p.bias)
        self._shared = SHARED_NAMES.get(p.routing) if p.shared_intermediate_size else None
        if self._shared is not None:
            sp = MLPParams(
                "gated" if p.gated else "plain", p.shared_intermediate_size, p.activation, p.bias
            )
            self.add_module(
                self._shared, (GatedMLP if p.gated else PlainMLP)(hidden_size, sp)
            )
        if p.shared_gate:
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output, plus ``add [T, H]`` when given (a dense MLP beside the
        block, Granite's ``shared_mlp``): like the shared expert, the kernels add it in
        their final float32 sum."""
        ids, weights = getattr(self, self._router)(x)
        s = add
        if self._shared is not None:
            s = getattr(self, self._shared)(x)
            if self.p.shared_gate:
                s = torch.sigmoid(self.shared_expert_gate(x)) * s
            if add is not None:
                s = s + add
        if self.latent:
            y = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(x), ids, weights))
            return y if s is None else y + s
        if s is not None and self.experts.takes_add:
            # The kernels add it inside their final sum (one launch less).
            return self.experts(x, ids, weights, s)
        y = self.experts(x, ids, weights)
        return y if s is None else y + s


# --------------------------------------------------------------------------------------
# Checkpoint names -> stacked parameters
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightSlot:
    """Where one checkpoint tensor goes: all of ``param`` (``expert`` None), or expert
    ``expert`` of a stacked ``param``, rows ``rows`` of it (None: all its rows)."""

    param: str
    expert: int | None = None
    rows: tuple[int, int] | None = None


_FUSED = (  # Granite's published names for its fused experts and router
    (re.compile(r"(.*\.block_sparse_moe)\.input_linear\.weight"), r"\1.experts.gate_up_proj"),
    (re.compile(r"(.*\.block_sparse_moe)\.output_linear\.weight"), r"\1.experts.down_proj"),
    (re.compile(r"(.*\.block_sparse_moe)\.router\.layer\.weight"), r"\1.router.weight"),
)
_PER_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def checkpoint_slot(name: str, expected: Mapping[str, tuple[int, ...]]) -> WeightSlot | None:
    """The slot of checkpoint tensor ``name`` (already in the model's prefix) that is not a
    ``state_dict()`` name itself: Granite's fused ``input_linear`` / ``output_linear`` /
    ``router.layer``, or one expert's ``gate_proj`` / ``up_proj`` / ``down_proj``
    (Nemotron-H, Qwen) stacked into ``experts.*``. None: not an expert weight we know.
    ``expected`` maps the model's state_dict names to shapes."""
    for pattern, target in _FUSED:
        if pattern.fullmatch(name):
            param = pattern.sub(target, name)
            return WeightSlot(param) if param in expected else None
    m = _PER_EXPERT.fullmatch(name)
    if m is None:
        return None
    base, j, proj = m.group(1), int(m.group(2)), m.group(3)
    if proj == "down_proj":
        param = f"{base}.down_proj"
        return WeightSlot(param, j) if param in expected else None
    if proj == "up_proj" and f"{base}.up_proj" in expected:
        return WeightSlot(f"{base}.up_proj", j)
    fused = f"{base}.gate_up_proj"
    if fused not in expected:
        return None
    half = expected[fused][1] // 2
    return WeightSlot(fused, j, (0, half) if proj == "gate_proj" else (half, 2 * half))
