"""Guard: every Triton kernel of the package runs under the race checker, recording its
accesses, and in more than one program order, somewhere in the suite
(docs/racecheck.md).

Two checks:

- :func:`test_every_triton_function_is_found` (runs anywhere): every Triton function
  the package defines is a module-level object, found by importing every module and
  looking for Triton function objects (``@triton.jit``, ``@triton.jit(...)``,
  ``triton.jit(fn)``, wrapped by ``autotune`` / ``heuristics`` or not), and an AST scan
  of every source file finds no Triton function that this enumeration misses (one made
  inside a function could not be checked below).
- :func:`test_every_kernel_ran_under_the_race_checker` (marked ``runs_last``, so it runs
  after every other test): the suite's conftest notes every interpreted launch and
  every device-function call with the race checker's recording at the time
  (``racecheck.active_recorder()``). Each function found must have run in a recording
  that checked its accesses and in at least two program orders. A device function
  (called from kernels, never launched itself) counts through the launches that call
  it. The verdict needs every kernel test to have run, so it asserts only when the
  whole ``tests/kernels`` directory was collected (only ``slow`` / ``gpu`` tests
  deselected) and none of those tests failed; otherwise it skips and says why. Run
  ``pytest tests/kernels`` (or the whole suite) to get it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

import hybridserve

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hybridserve"
_JIT_NAMES = {"triton.jit", "jit", "triton.autotune", "autotune", "triton.heuristics",
              "heuristics"}


def _innermost(obj):
    """The Python function behind a Triton function object (through autotune /
    heuristics wrappers), or None if ``obj`` is not one."""
    from triton.runtime.jit import KernelInterface

    if not isinstance(obj, KernelInterface):
        return None
    fn = obj
    for _ in range(8):
        inner = getattr(fn, "fn", None)
        if inner is None:
            break
        fn = inner
    return fn if callable(fn) and not isinstance(fn, KernelInterface) else None


# Modules that need an optional extra of pyproject.toml (module -> the package it needs).
OPTIONAL_EXTRAS = {"hybridserve.routing.ray_app": "ray"}


def triton_functions() -> dict[str, object]:
    """``module.qualname`` -> Triton function object, for every one the package's
    modules hold at module level (each once, under the module that defines it)."""
    found: dict[str, object] = {}
    for info in pkgutil.walk_packages(hybridserve.__path__, "hybridserve."):
        if info.name.endswith(".__main__"):
            continue  # importing it would run the command line
        extra = OPTIONAL_EXTRAS.get(info.name)
        if extra is not None and importlib.util.find_spec(extra) is None:
            continue  # an optional extra that is not installed; it defines no kernels
        try:
            module = importlib.import_module(info.name)
        except RuntimeError:
            if info.name == "hybridserve.testing.racecheck":
                continue  # needs TRITON_INTERPRET=1; it defines no kernels of its own
            raise
        for obj in vars(module).values():
            fn = _innermost(obj)
            if fn is not None:
                found[f"{fn.__module__}.{fn.__qualname__}"] = obj
    return found


def _ast_triton_functions() -> set[str]:
    """``module.name`` of every function the source marks as a Triton function: a
    decorator of ``_JIT_NAMES`` (called or not), or ``name = triton.jit(fn)``."""
    out: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                for dec in node.decorator_list:
                    target = dec.func if isinstance(dec, ast.Call) else dec
                    if ast.unparse(target) in _JIT_NAMES:
                        out.add(f"{module}.{node.name}")
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in _JIT_NAMES:
                for arg in node.args:
                    if isinstance(arg, ast.Name):
                        out.add(f"{module}.{arg.id}")
    return out


def test_every_triton_function_is_found():
    found = triton_functions()
    assert len(found) >= 10, "the scan found fewer Triton functions than the project has"
    missing = sorted(_ast_triton_functions() - set(found))
    assert not missing, (
        f"Triton functions the enumeration cannot see (define them at module level): {missing}"
    )


@pytest.mark.runs_last
def test_every_kernel_ran_under_the_race_checker(kernel_census):
    if not kernel_census.installed:
        pytest.skip("needs TRITON_INTERPRET=1 (the census hooks the interpreter)")
    if not kernel_census.kernel_tests_complete:
        pytest.skip(f"the verdict needs the whole tests/kernels directory: "
                    f"{kernel_census.why_incomplete}")
    if kernel_census.kernel_tests_failed:
        pytest.skip(f"kernel tests failed ({kernel_census.kernel_tests_failed[0]}, ...): "
                    "their kernels' coverage is not known")
    problems = []
    for key in sorted(triton_functions()):
        runs = kernel_census.runs.get(key, set())
        recorded = any(record for record, _ in runs)
        orders = {order for _, order in runs if order is not None}
        if not recorded:
            problems.append(f"{key}: never run with the race checker recording its accesses")
        if len(orders) < 2:
            problems.append(f"{key}: run in program orders {sorted(orders)}; needs two or more")
    assert not problems, "\n".join(problems)
