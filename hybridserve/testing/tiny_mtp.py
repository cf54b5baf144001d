"""Tiny random MTP heads for tests: ``mtp.*`` weights added to a tiny checkpoint.

``transformers`` builds no MTP modules for Qwen3.5 / Qwen3-Next, so the tests' heads
are written here: every tensor :class:`~hybridserve.drafters.mtp.MtpHead` expects, drawn
from a seeded generator (norm weights near zero: the Qwen norms are zero-centred), and
``mtp_num_hidden_layers`` in ``config.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def add_mtp_head(path: str | os.PathLike[str], seed: int = 0, std: float = 0.1) -> Path:
    """Add a random one-layer MTP head to the tiny Qwen3.5 / Qwen3-Next checkpoint at
    ``path`` (rewriting its single ``model.safetensors``); returns ``path``."""
    from safetensors.torch import load_file, save_file

    from hybridserve.drafters.mtp import MtpHead
    from hybridserve.models.loader import load_model

    path = Path(path)
    target = load_model(path)
    with torch.device("meta"):
        head = MtpHead(target)
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(str(path / "model.safetensors"))
    for name, t in head.state_dict().items():
        scale = 0.05 if name.endswith("norm.weight") or "_norm" in name else std
        tensors["mtp." + name] = (torch.randn(t.shape, generator=g) * scale).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg_file = path / "config.json"
    raw = json.loads(cfg_file.read_text())
    (raw.get("text_config") or raw)["mtp_num_hidden_layers"] = 1
    cfg_file.write_text(json.dumps(raw, indent=2))
    return path
