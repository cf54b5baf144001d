"""``generation_config.json``: a checkpoint's EOS ids and default sampling, as vLLM
reads it (``--generation-config auto``).

Contract: :func:`load_generation_config` returns an empty config when the file is
absent, and raises ValueError naming the file and the field when it is unreadable or a
field has the wrong type. ``eos_token_ids`` are added to the model config's own (a
chat model often ends its turns with a token its ``config.json`` does not list);
``sampling`` holds the defaults a server applies to a request that does not set them:
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` (vLLM's set).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()
    sampling: dict[str, float | int] = field(default_factory=dict)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def load_generation_config(path: str | Path) -> GenerationConfig:
    """The checkpoint directory's ``generation_config.json`` (see the module docstring)."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return GenerationConfig()
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {file}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object")
    eos = data.get("eos_token_id")
    if eos is None:
        eos_ids: tuple[int, ...] = ()
    elif _is_int(eos):
        eos_ids = (eos,)
    elif isinstance(eos, list) and all(_is_int(e) for e in eos):
        eos_ids = tuple(eos)
    else:
        raise ValueError(f"{file}: eos_token_id must be an integer or a list of integers, got {eos!r}")
    sampling: dict[str, float | int] = {}
    for key in SAMPLING_KEYS:
        value = data.get(key)
        if value is None:
            continue
        if key == "top_k" and not _is_int(value):
            raise ValueError(f"{file}: top_k must be an integer, got {value!r}")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{file}: {key} must be a number, got {value!r}")
        sampling[key] = value
    return GenerationConfig(eos_ids, sampling)
