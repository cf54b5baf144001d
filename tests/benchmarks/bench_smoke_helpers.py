"""Helpers the benchmark smoke tests share: load a benchmark script as a module and run
its CPU smoke mode."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``name`` (registered in ``sys.modules``
    before it runs: dataclasses resolve their module there while the class is built)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def smoke_record(name: str, tmp_path: Path) -> dict:
    """Run ``benchmarks/<name>.py --smoke --out <tmp>`` (skipped where CUDA is: the smoke
    mode is the CPU interpreter's) and return its record, checked to be what it wrote."""
    if torch.cuda.is_available():
        pytest.skip("the smoke mode is the CPU interpreter's")
    out = tmp_path / "smoke.json"
    record = load_benchmark(name).main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    return record
