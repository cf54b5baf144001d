"""Guard: the package's layer rules, read from its imports (docs/architecture.md).

Lower layers never import higher ones: ``kernels`` (tensors in, tensors out) imports
nothing from ``models``, ``runner`` or ``engine``; ``models`` nothing from ``runner`` or
``engine``; ``runner`` nothing from ``engine``; ``cache`` nothing from ``engine``. The step
contract (``hybridserve.step``) is the bottom: it imports only the structured-outputs
value type.

And no mutable module-level switches: no module binds an ALL_CAPS name to a bool or to a
mode word such as ``"auto"`` or ``"off"`` (which paths run is the engine's ``KernelPolicy``, handed to the model at
load), no module rebinds a module-level name through ``global``, and no test or benchmark
assigns an ALL_CAPS attribute of a package module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridserve"

# package -> subpackages (or modules) it must not import
FORBIDDEN = {
    "kernels": ("models", "runner", "engine", "cache", "server", "llm", "drafters"),
    "models": ("runner", "engine", "server", "llm"),
    "runner": ("engine", "server", "llm"),
    "cache": ("engine", "runner", "models", "server", "llm"),
    # The step contract is the bottom: only the structured-outputs value type below it.
    "step": ("kernels", "models", "runner", "engine", "cache", "server", "llm", "drafters",
             "config", "tokenizer", "detokenizer", "cli", "hub", "testing"),
}


def _module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """Every ``hybridserve...`` module ``path`` imports (any scope, TYPE_CHECKING blocks
    included), absolute or relative, with its line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            # ``from hybridserve import engine`` imports the subpackage itself.
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return [(line, m) for line, m in found if m == "hybridserve" or m.startswith("hybridserve.")]


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _violations(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / "hybridserve").rglob("*.py")):
        layer = _layer(_module_name(path, root))
        rules = FORBIDDEN.get(layer)
        if not rules:
            continue
        for line, module in _imports(path, root):
            target = _layer(module)
            if target is None or target == layer:
                continue
            where = f"{path.relative_to(root)}:{line}"
            if ("*" in rules or target in rules) and not any(b.startswith(where + " ") for b in bad):
                bad.append(f"{where} imports {module}")
    return bad


def test_layers_import_only_downwards():
    assert not _violations(), "layer rule broken:\n" + "\n".join(_violations())


def test_the_guard_sees_a_planted_upward_import(tmp_path):
    """The checker itself: upward imports written into a kernel module are reported."""
    kernels = tmp_path / "hybridserve" / "kernels"
    kernels.mkdir(parents=True)
    (tmp_path / "hybridserve" / "__init__.py").write_text("")
    (kernels / "__init__.py").write_text("")
    (kernels / "bad.py").write_text(
        "from hybridserve.models.batch import ForwardBatch\n"
        "from ..runner import sampler\n"
        "from hybridserve.kernels import ssd\n"
    )
    found = _violations(tmp_path)
    assert len(found) == 2, found
    assert "bad.py:1 imports hybridserve.models.batch" in found[0]
    assert "bad.py:2 imports hybridserve.runner" in found[1]


# A string constant spelled like one of these is a path switch, not a name or a format.
MODE_WORDS = {"auto", "off", "on", "reference", "triton", "always", "never", "cuda", "torch"}


def _switches(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in tree.body:
        targets = []
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for t in targets:
            if (
                isinstance(t, ast.Name)
                and t.id.isupper()
                and isinstance(value, ast.Constant)
                and (
                    isinstance(value.value, bool)
                    or (isinstance(value.value, str) and value.value in MODE_WORDS)
                )
            ):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {t.id} = {value.value!r}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno} global {', '.join(node.names)}")
    return bad


def test_no_module_level_switches():
    bad = [b for path in sorted(PACKAGE.rglob("*.py")) for b in _switches(path)]
    assert not bad, "module-level switches (use KernelPolicy):\n" + "\n".join(bad)


@pytest.mark.parametrize("folder", ["tests", "benchmarks", "scripts"])
def test_no_one_sets_a_package_constant(folder):
    """No ``monkeypatch.setattr(module, "NAME", ...)`` or ``module.NAME = ...`` of an
    ALL_CAPS name: the constants of the package are not switches."""
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        # Names bound to the package's modules (or their members) in this file.
        ours = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hybridserve"):
                ours.update(alias.asname or alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                ours.update(
                    alias.asname or alias.name.split(".")[0]
                    for alias in node.names if alias.name.startswith("hybridserve")
                )
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "setattr"
                and len(node.args) >= 2
                and ast.unparse(node.args[0]).split(".")[0] in ours
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and node.args[1].value.isupper()
            ):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} setattr {node.args[1].value}")
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if (
                        isinstance(t, ast.Attribute)
                        and t.attr.isupper()
                        and ast.unparse(t.value).split(".")[0] in ours
                    ):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} assigns {t.attr}")
    assert not bad, "\n".join(bad)


def test_the_switch_guard_sees_a_planted_switch(tmp_path):
    planted = ROOT / "hybridserve" / "kernels" / "_planted_switch_for_test.py"
    planted.write_text('TRITON_THING = True\nMODE = "auto"\nBLOCK = 64\n')
    try:
        found = _switches(planted)
    finally:
        planted.unlink()
    assert len(found) == 2 and "TRITON_THING" in found[0] and "MODE" in found[1], found
