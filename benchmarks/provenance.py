"""What every benchmark result records about where it came from.

Shared by the benchmark scripts (run as ``python benchmarks/<script>.py``, so this
module is importable as ``provenance``).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """The commit measured: ``HYBRIDSERVE_COMMIT`` when set (a copy of the tree without
    its history), else ``git rev-parse HEAD``, else ``"unknown"``."""
    env = os.environ.get("HYBRIDSERVE_COMMIT")
    if env:
        return env
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def portable_path(value) -> str:
    """A path as results record it: relative to the repository when inside it, else
    its file name (results name no machine's folders)."""
    path = Path(value)
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return path.name


def device_label(device: str) -> str:
    """The measured device as results name it: the GPU's name, or the CPU interpreter."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    return "cpu (interpreter)"


def result_writer(result: dict, out: Path, started: float) -> Callable[[], None]:
    """A function writing ``result`` to ``out`` as indented JSON, its ``wall_s`` the
    seconds since ``started`` (called after every case, so a time limit keeps what was
    measured)."""

    def save() -> None:
        result["wall_s"] = time.time() - started
        out.write_text(json.dumps(result, indent=1) + "\n")

    return save
