"""Shared fixtures: tiny random checkpoints (built once per test session), a
byte-level tokenizer so text prompts and stop strings can be exercised, the suite's
random seeds, and the census of kernel launches under the race checker.

Seeds
-----
One session seed: ``HYBRIDSERVE_TEST_SEED`` if set, else drawn fresh (so every run
still sees new random inputs), printed in the report header. Before each test, torch's,
Python's and numpy's global generators are seeded with a seed derived from the session
seed and the test's id (:func:`derived_seed`), so a test's inputs do not depend on which
tests ran before it, and a failure's report names the session seed that reproduces it.
Tests that want a seed of their own take the ``test_seed`` fixture (or draw from the
seeded global generator); nothing reseeds from the OS.

Race-checker census
-------------------
Every interpreted launch of a Triton kernel, and every device-function call inside
one, is noted with the race checker's recording at the time (whether it recorded
accesses, and the program order). ``tests/kernels/test_every_kernel_is_racechecked.py``
reads the census at the end of the session (:data:`RUNS_LAST` moves it there) and
asserts that every kernel of the package ran under the checker and in more than one
program order. Its verdict means something only when every test that could launch a
kernel under the checker ran, so it asserts only when the whole ``tests/kernels``
directory was collected (deselecting only ``slow`` / ``gpu`` tests) and none of its
tests failed; otherwise (a single file, ``-k``) it skips and says why.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridserve.testing.tiny_models import make_tiny_checkpoint

# Tiny models: thread start-up costs more than the matrix products it would split.
torch.set_num_threads(1)

SEED_ENV = "HYBRIDSERVE_TEST_SEED"
RUNS_LAST = "runs_last"
KERNEL_TESTS = Path(__file__).resolve().parent / "kernels"
_SEED = pytest.StashKey[int]()
_CENSUS = pytest.StashKey["KernelCensus"]()
_TEST_SEED = pytest.StashKey[int]()
_DESELECTED = pytest.StashKey[list]()


def derived_seed(session_seed: int, test_id: str) -> int:
    """The seed of one test: a hash of the session seed and the test's node id."""
    digest = hashlib.sha256(f"{session_seed}:{test_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**31 - 1)


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


@dataclass
class KernelCensus:
    """Which Triton functions ran under the race checker, and how (see module docstring).

    ``runs[key]``: the ``(records accesses, program order)`` pairs of the recordings a
    launch of (or a device call to) the function ``key`` (``module.qualname``) ran in;
    ``(False, None)`` for a run outside any recording."""

    installed: bool = False
    runs: dict[str, set[tuple[bool, str | None]]] = field(default_factory=dict)
    kernel_tests_complete: bool = False
    why_incomplete: str = ""
    kernel_tests_failed: list[str] = field(default_factory=list)

    def note(self, fn) -> None:
        from hybridserve.testing import racecheck

        rec = racecheck.active_recorder()
        how = (rec.record, rec.order) if rec is not None else (False, None)
        self.runs.setdefault(f"{fn.__module__}.{fn.__qualname__}", set()).add(how)


def _install_census(census: KernelCensus) -> None:
    """Wrap the interpreter's launch and device-call entry points (session-wide)."""
    from triton.runtime.interpreter import InterpretedFunction

    run, call = InterpretedFunction.run, InterpretedFunction.__call__

    def counted_run(self, *args, **kwargs):
        if not kwargs.get("warmup"):
            census.note(self.fn)
        return run(self, *args, **kwargs)

    def counted_call(self, *args, **kwargs):
        census.note(self.fn)
        return call(self, *args, **kwargs)

    InterpretedFunction.run = counted_run
    InterpretedFunction.__call__ = counted_call
    census.installed = True


def pytest_configure(config):
    raw = os.environ.get(SEED_ENV)
    if raw:
        try:
            seed = int(raw)
        except ValueError:
            raise pytest.UsageError(f"{SEED_ENV}={raw!r}: give an integer") from None
    else:
        seed = secrets.randbelow(2**31 - 1)
    config.stash[_SEED] = seed
    # Session fixtures that draw from the global generators see the session seed.
    _seed_everything(seed)
    config.addinivalue_line(
        "markers", f"{RUNS_LAST}: run after every other test (session-wide checks)"
    )
    census = KernelCensus()
    if os.environ.get("TRITON_INTERPRET") == "1":
        _install_census(census)
    config.stash[_CENSUS] = census


def pytest_report_header(config):
    seed = config.stash[_SEED]
    return f"hybridserve test seed: {seed} (reproduce with {SEED_ENV}={seed})"


def pytest_deselected(items):
    if items:
        items[0].config.stash.setdefault(_DESELECTED, []).extend(items)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    # trylast: after -m / -k deselection, so ``items`` is what will run.
    items.sort(key=lambda item: item.get_closest_marker(RUNS_LAST) is not None)
    census = config.stash[_CENSUS]
    files = {Path(str(item.path)) for item in items}
    deselected = config.stash.get(_DESELECTED, [])

    def marked(item) -> bool:
        return bool(item.get_closest_marker("slow") or item.get_closest_marker("gpu"))

    # A file whose tests are all GPU or slow ones was collected; only its marks kept it out.
    marked_out = {Path(str(item.path)) for item in deselected if marked(item)}
    missing = sorted(p.name for p in KERNEL_TESTS.glob("test_*.py")
                     if p not in files and p not in marked_out)
    dropped = [
        item.nodeid
        for item in deselected
        if Path(str(item.path)).parent == KERNEL_TESTS and not marked(item)
    ]
    census.kernel_tests_complete = not missing and not dropped
    if missing:
        census.why_incomplete = f"kernel test files not collected: {', '.join(missing)}"
    elif dropped:
        census.why_incomplete = f"{len(dropped)} kernel test(s) deselected, e.g. {dropped[0]}"


@pytest.fixture(autouse=True)
def _seed_each_test(request):
    seed = derived_seed(request.config.stash[_SEED], request.node.nodeid)
    request.node.stash[_TEST_SEED] = seed
    _seed_everything(seed)


@pytest.fixture
def test_seed(request) -> int:
    """This test's seed (the global generators were seeded with it before the test)."""
    return request.node.stash[_TEST_SEED]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        seed = item.config.stash[_SEED]
        report.sections.append(
            ("hybridserve seed", f"session seed {seed}: rerun with {SEED_ENV}={seed}")
        )
        if Path(str(item.path)).parent == KERNEL_TESTS:
            item.config.stash[_CENSUS].kernel_tests_failed.append(item.nodeid)


@pytest.fixture
def kernel_census(request) -> KernelCensus:
    return request.config.stash[_CENSUS]


def write_byte_tokenizer(path: Path, eos_id: int = 2) -> None:
    """A tokenizer whose 256 ids are the 256 bytes (matching the tiny models' vocab)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    eos = sorted(alphabet)[eos_id]
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))


@pytest.fixture(scope="session")
def tiny_granite(tmp_path_factory) -> Path:
    path = make_tiny_checkpoint("granitemoehybrid", tmp_path_factory.mktemp("granite"), seed=1)
    write_byte_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_nemotron(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("nemotron_h", tmp_path_factory.mktemp("nemotron"), seed=2)


@pytest.fixture(scope="session")
def tiny_bamba(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("bamba", tmp_path_factory.mktemp("bamba"), seed=3)


@pytest.fixture(scope="session")
def tiny_qwen3_5(tmp_path_factory) -> Path:
    """A Gated DeltaNet hybrid (Qwen3.5: GDN, GDN, attention, GDN)."""
    return make_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen3_5"), seed=4)


@pytest.fixture
def count_calls(monkeypatch):
    """``count_calls(owner, name)`` wraps ``owner.name`` for the test and returns the list
    it appends to on every call (its length is the call count)."""

    def spy(owner, name: str) -> list:
        calls: list = []
        real = getattr(owner, name)

        def counted(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
        return calls

    return spy


@pytest.fixture
def mixer_paths(monkeypatch):
    """Which path each Mamba mixer call took, counted for the test: a Counter with
    ``decode`` (the uniform decode kernels), ``short`` (short rows), ``packed`` (the
    packed prefill scan) and ``per_row`` (the per-row reference; one count per row).
    Tests that compare two paths clear it before each side and assert what ran."""
    from collections import Counter

    from hybridserve.models.layers import mamba2

    seen: Counter = Counter()
    mixer = mamba2.Mamba2Mixer
    for name, key in (("_decode_rows", "decode"), ("_short_rows", "short"),
                      ("_prefill_rows", "packed")):
        real = getattr(mixer, name)

        def counted(self, *args, _real=real, _key=key, **kwargs):
            seen[_key] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(mixer, name, counted)
    conv = mamba2.causal_conv1d_reference

    def per_row(*args, **kwargs):
        seen["per_row"] += 1
        return conv(*args, **kwargs)

    monkeypatch.setattr(mamba2, "causal_conv1d_reference", per_row)
    return seen
