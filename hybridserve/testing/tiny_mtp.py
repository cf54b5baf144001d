"""Tiny random MTP heads for tests: ``mtp.*`` weights added to a tiny checkpoint.

``transformers`` builds no MTP modules for Qwen3.5 / Qwen3-Next / Nemotron-H, so the
tests' heads are written here: every tensor the head of
:mod:`hybridserve.drafters.mtp` expects, under the names the published checkpoints use
(routed experts one tensor per expert: Nemotron-H's
``mtp.layers.i.mixer.experts.N.up_proj.weight``, the Qwen MoE heads'
``mtp.layers.0.mlp.experts.N.gate_proj.weight`` / ``up_proj`` / ``down_proj``; or, with
``fused_experts``, the stacked ``mtp.layers.0.mlp.experts.gate_up_proj`` ``[E, 2I, H]``
and ``experts.down_proj`` ``[E, H, I]`` some Qwen3.5-MoE files carry), drawn from a
seeded generator, and the config fields that declare the head
(``mtp_num_hidden_layers``; Nemotron-H: ``num_nextn_predict_layers`` and
``mtp_layers_block_type``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch

_STACKED_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|up_proj|down_proj)")


def add_mtp_head(
    path: str | os.PathLike[str],
    seed: int = 0,
    std: float = 0.1,
    block_types: Sequence[str] = ("attention", "moe"),
    fused_experts: bool = False,
) -> Path:
    """Add a random one-step MTP head to the tiny Qwen3.5 / Qwen3-Next / Nemotron-H
    checkpoint at ``path`` (rewriting its single ``model.safetensors``); returns ``path``.
    ``block_types``: the Nemotron-H MTP stack (``mtp_layers_block_type``);
    ``fused_experts``: write routed experts stacked rather than one tensor per expert."""
    from safetensors.torch import load_file, save_file

    from hybridserve.drafters.mtp import build_mtp_head
    from hybridserve.models.loader import load_model

    path = Path(path)
    cfg_file = path / "config.json"
    raw = json.loads(cfg_file.read_text())
    text = raw.get("text_config") or raw
    nemotron = "NemotronHForCausalLM" in raw.get("architectures", [])
    if nemotron:
        text["num_nextn_predict_layers"] = 1
        text["mtp_layers_block_type"] = list(block_types)
    else:
        text["mtp_num_hidden_layers"] = 1
    cfg_file.write_text(json.dumps(raw, indent=2))
    target = load_model(path)
    with torch.device("meta"):
        head = build_mtp_head(path, target)
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(str(path / "model.safetensors"))
    for name, t in head.state_dict().items():
        if not nemotron:
            # Qwen's norms are zero-centred (the scale is 1 + weight).
            scale = 0.05 if name.endswith("norm.weight") or "_norm" in name else std
            value = torch.randn(t.shape, generator=g) * scale
        elif t.dim() == 1:
            # Norm weights near 1; the router's selection bias near 0.
            mean = 0.0 if name.endswith("e_score_correction_bias") else 1.0
            value = torch.randn(t.shape, generator=g) * 0.05 + mean
        else:  # matrices [out, in] and stacked experts [E, out, in]
            value = torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5
        m = _STACKED_EXPERTS.fullmatch(name)
        if t.dim() == 3 and m is not None and not fused_experts:
            # Published checkpoints keep one tensor per expert; a stacked gate_up_proj
            # is each expert's gate_proj rows, then its up_proj rows.
            base, proj = m.group(1), m.group(2)
            parts = {"gate_proj": value[:, : t.shape[1] // 2],
                     "up_proj": value[:, t.shape[1] // 2 :]} if proj == "gate_up_proj" else {proj: value}
            for part, v in parts.items():
                for j in range(t.shape[0]):
                    tensors[f"mtp.{base}.{j}.{part}.weight"] = v[j].contiguous()
            continue
        tensors["mtp." + name] = value.contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def dense_hidden(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """The target's final hidden states of ``tokens`` in one cold forward."""
    from hybridserve.models.batch import ForwardBatch

    n = len(tokens)
    bs = 16
    nblocks = -(-n // bs)
    caches = model.cache_spec.allocate(nblocks, bs, 2, torch.float32, torch.float32, "cpu")
    batch = ForwardBatch(
        query_start=[0, n], num_computed=[0], positions=torch.arange(n), context_lens=[n],
        block_tables=torch.arange(nblocks, dtype=torch.int32)[None], slot_mapping=torch.arange(n),
        state_in_page=[-1], state_out_row=[], state_out_offset=[], state_out_page=[],
    )
    return model.forward(torch.tensor(tokens), batch, caches)


def dense_mtp_drafts(drafter, tokens: list[int], hidden: torch.Tensor, k: int) -> list[int]:
    """The MTP drafter's head's ``k`` greedy drafts after ``tokens`` from scratch, on the
    target's ``hidden`` states of them (:func:`dense_hidden`): slots ``0 .. L - 2`` in one
    row, then one slot per draft, each fed the slot before's output."""
    from hybridserve.models.batch import ForwardBatch

    head, target = drafter.head, drafter.target
    length = len(tokens)
    bs = 16
    nblocks = -(-(length + k) // bs)
    caches = head.cache_spec.allocate(nblocks, bs, 1, torch.float32, torch.float32, "cpu")
    tables = torch.arange(nblocks, dtype=torch.int32)[None]

    def run(first, toks, h):
        q = len(toks)
        batch = ForwardBatch(
            query_start=[0, q], num_computed=[first], positions=torch.arange(first, first + q),
            context_lens=[first + q], block_tables=tables, slot_mapping=torch.arange(first, first + q),
            state_in_page=[-1], state_out_row=[], state_out_offset=[], state_out_page=[],
        )
        y = head(target.model.embed(torch.tensor(toks)), h, batch, caches)[-1:]
        return y, int(torch.argmax(target.compute_logits(y), -1))

    y, d = run(0, tokens[1:], hidden[: length - 1])
    drafts = [d]
    for i in range(1, k):
        y, d = run(length - 2 + i, [drafts[-1]], y)
        drafts.append(d)
    return drafts
