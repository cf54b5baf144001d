"""Guard: every module under hybridserve/kernels that defines a Triton kernel has a test
module that runs its kernels under the race checker (DESIGN.md section 6)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _triton_kernels(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if ast.unparse(target) in ("triton.jit", "jit"):
                    names.append(node.name)
    return names


def test_every_triton_kernel_module_has_a_racecheck_test():
    missing = []
    found = 0
    for module in sorted((ROOT / "hybridserve" / "kernels").glob("*.py")):
        kernels = _triton_kernels(module)
        if not kernels:
            continue
        found += len(kernels)
        test = ROOT / "tests" / "kernels" / f"test_{module.stem}.py"
        text = test.read_text() if test.exists() else ""
        if "racecheck." not in text:  # a call into the checker, not just a mention
            missing.append(f"{module.name} ({', '.join(kernels)})")
    assert found >= 4, "the scan found fewer Triton kernels than the project has"
    assert not missing, f"Triton kernels without a race-checker test: {missing}"
