"""Cross-program global-memory race detector for Triton kernels (docs/racecheck.md).

The race rule: within one kernel launch, no memory location is written by one program
and read or written by another program, except through atomics designed for it.
GPU tools check shared memory only; this module checks global memory, by running a
kernel through Triton's CPU interpreter and recording, per program id, every byte each
program loads, stores, or touches atomically (masked-off lanes excluded).

Two modes:

- :func:`check` / :func:`assert_race_free`: one launch, every access recorded; a
  :class:`RaceReport` lists each :class:`Conflict` by argument name, element index,
  the two programs and the kind (``write-write``, ``write-read``, ``atomic-write``,
  ``atomic-read``; atomic against atomic is not a conflict).
- :func:`run_in_orders`: the same launch on fresh copies of the inputs with the grid
  run forward, reversed and shuffled; an :class:`OrderReport` says which outputs differ.
  :func:`run_launcher_in_orders` does the same for a function that launches kernels.

:func:`record_launches` does either for every launch inside a ``with`` block (for
launchers that build their own arguments). Memory a kernel reaches through raw
addresses rather than tensor arguments (pointer tables) can be named with
``named_memory`` so reports still say what was hit.

Requirements: ``TRITON_INTERPRET=1`` in the environment before any kernel is defined
(importing this module without it raises ``RuntimeError``). The checker patches the
interpreter's module-level builder and grid executor only inside a recording and
restores them on exit, exceptions included. Interpreter quirk handled here: masks
of integer type (which the interpreter rejects) are coerced to bool while recording.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton

if not triton.knobs.runtime.interpret:
    raise RuntimeError(
        "hybridserve.testing.racecheck runs kernels through Triton's CPU interpreter: "
        "set TRITON_INTERPRET=1 in the environment before Triton kernels are defined "
        "(before importing the modules that define them)."
    )

from triton.runtime import interpreter as _interp  # noqa: E402

__all__ = [
    "Conflict",
    "OrderDifference",
    "OrderReport",
    "RaceReport",
    "Recorder",
    "active_recorder",
    "assert_race_free",
    "check",
    "record_launches",
    "run_in_orders",
    "run_launcher_in_orders",
]

ProgramId = tuple[int, int, int]

_READ, _WRITE, _ATOMIC = 0, 1, 2
_ORDERS = ("forward", "reversed", "shuffled")
_UNMAPPED = "<unmapped>"
_lock = threading.Lock()
# The recording in progress (at most one: ``_lock``), for :func:`active_recorder`.
_active: list[Recorder] = []


# --------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Conflict:
    """One pair of programs of one launch touching one element in a racy way.

    ``kind`` names ``first``'s access, then ``second``'s: ``write-write``,
    ``write-read`` (first stores, second loads), ``atomic-write`` / ``atomic-read``
    (first uses an atomic, second a plain store / load). ``argument`` is the kernel
    argument (or named memory) holding the element, ``element`` its offset in elements
    from the tensor's ``data_ptr`` and ``index`` the matching multi-dimensional index
    (None when the tensor's strides do not determine one). Unmapped memory is
    reported with ``argument="<unmapped>"`` and the raw byte address as ``element``.
    """

    kind: str
    argument: str
    element: int
    index: tuple[int, ...] | None
    first: ProgramId
    second: ProgramId

    def __str__(self) -> str:
        where = f"{self.argument}[{', '.join(map(str, self.index))}]" if self.index else None
        where = where or f"{self.argument} element {self.element}"
        return f"{self.kind}: {where} by program {self.first} and program {self.second}"


@dataclass
class RaceReport:
    """Result of checking one launch. ``clean`` is True when no conflict was found.

    ``conflicts`` holds at most ``max_conflicts`` records (``truncated`` says whether
    some were left out); ``num_conflicting_elements`` counts every element involved.
    ``bytes_loaded`` / ``bytes_stored`` / ``bytes_atomic`` count distinct bytes touched.
    """

    kernel: str
    grid: ProgramId
    conflicts: list[Conflict]
    num_conflicting_elements: int
    truncated: bool
    bytes_loaded: int
    bytes_stored: int
    bytes_atomic: int

    @property
    def clean(self) -> bool:
        return self.num_conflicting_elements == 0

    def arguments(self) -> set[str]:
        """Names of the arguments with at least one listed conflict."""
        return {c.argument for c in self.conflicts}

    def __str__(self) -> str:
        head = (
            f"racecheck {self.kernel} grid={self.grid}: "
            f"{self.bytes_loaded} B loaded, {self.bytes_stored} B stored, "
            f"{self.bytes_atomic} B atomic"
        )
        if self.clean:
            return f"{head}: clean"
        lines = [f"{head}: {self.num_conflicting_elements} conflicting element(s)"]
        by_arg: dict[str, list[Conflict]] = {}
        for c in self.conflicts:
            by_arg.setdefault(c.argument, []).append(c)
        for arg, cs in by_arg.items():
            lines.append(f"  {arg}: {len(cs)} conflict(s)")
            lines.extend(f"    {c}" for c in cs[:10])
            if len(cs) > 10:
                lines.append(f"    ... {len(cs) - 10} more")
        if self.truncated:
            lines.append("  (list truncated)")
        return "\n".join(lines)


@dataclass(frozen=True)
class OrderDifference:
    """Output ``argument`` after running the grid in ``order`` differs from the baseline
    (the first order) in ``num_differing`` elements, the first at ``first_index``."""

    order: str
    argument: str
    num_differing: int
    first_index: tuple[int, ...]


@dataclass
class OrderReport:
    """Outputs of one launch under several program orders.

    ``outputs[order][name]`` is every tensor argument after the run in that order.
    ``differences`` compares each order bitwise against the first one.
    """

    kernel: str
    orders: tuple[str, ...]
    outputs: dict[str, dict[str, torch.Tensor]]
    differences: list[OrderDifference]

    @property
    def consistent(self) -> bool:
        return not self.differences

    def differing_arguments(self) -> set[str]:
        return {d.argument for d in self.differences}

    def __str__(self) -> str:
        head = f"program orders {', '.join(self.orders)} for {self.kernel}"
        if self.consistent:
            return f"{head}: identical outputs"
        lines = [f"{head}: outputs differ"]
        lines += [
            f"  {d.order}: {d.argument} differs in {d.num_differing} element(s), first at "
            f"{d.first_index}"
            for d in self.differences
        ]
        return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Memory regions: addresses back to argument names
# --------------------------------------------------------------------------------------


@dataclass
class _Region:
    name: str
    start: int
    end: int
    itemsize: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    def index_of(self, element: int) -> tuple[int, ...] | None:
        # Unravel by strides, largest first; only exact when the layout is one-to-one.
        dims = sorted(
            ((st, sz, d) for d, (sz, st) in enumerate(zip(self.shape, self.strides)) if sz > 1),
            reverse=True,
        )
        index = [0] * len(self.shape)
        rest = element
        for st, sz, d in dims:
            index[d], rest = divmod(rest, st) if st > 0 else (0, rest)
            if index[d] >= sz:
                return None
        return tuple(index) if rest == 0 else None


def _region(name: str, t: torch.Tensor) -> _Region | None:
    t = _interp._unwrap_tensor(t)
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return None
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return _Region(name, start, start + extent * t.element_size(), t.element_size(),
                   tuple(t.shape), tuple(t.stride()))


def _regions_of(names_values: Mapping[str, Any]) -> list[_Region]:
    out: list[_Region] = []

    def visit(name: str, value: Any) -> None:
        if isinstance(value, tuple):
            for i, v in enumerate(value):
                visit(f"{name}[{i}]", v)
        elif isinstance(value, triton.tools.tensor_descriptor.TensorDescriptor):
            visit(name, value.base)
        elif hasattr(value, "data_ptr"):
            r = _region(name, value)
            if r is not None:
                out.append(r)

    for name, value in names_values.items():
        visit(name, value)
    return out


# --------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------


class _Launch:
    """Accesses of one launch, kept as per-access chunks until analysis."""

    def __init__(self, kernel: str) -> None:
        self.kernel = kernel
        self.grid: ProgramId = (1, 1, 1)
        self.regions: list[_Region] = []
        self.program = 0
        self.chunks: list[tuple[np.ndarray, int, int]] = []
        self.order: np.ndarray | None = None

    def linear(self, pid: ProgramId) -> int:
        _, ny, nz = self.grid
        return (pid[0] * ny + pid[1]) * nz + pid[2]

    def unravel(self, lin: int) -> ProgramId:
        _, ny, nz = self.grid
        return (lin // (ny * nz), (lin // nz) % ny, lin % nz)


def _program_order(total: int, order: str, seed: int) -> np.ndarray:
    if order == "forward":
        return np.arange(total)
    if order == "reversed":
        return np.arange(total)[::-1].copy()
    if order == "shuffled":
        return np.random.default_rng(seed).permutation(total)
    raise ValueError(f"unknown program order {order!r}; expected one of {_ORDERS}")


class _Patch:
    """Attribute patches undone in reverse order, restoring instance vs class lookup."""

    def __init__(self) -> None:
        self._undo: list[tuple[object, str, bool, Any]] = []

    def set(self, obj: object, name: str, value: Any) -> None:
        had_own = name in vars(obj)
        self._undo.append((obj, name, had_own, vars(obj).get(name)))
        setattr(obj, name, value)

    def restore(self) -> None:
        while self._undo:
            obj, name, had_own, old = self._undo.pop()
            if had_own:
                setattr(obj, name, old)
            else:
                delattr(obj, name)


class Recorder:
    """Hooks into the interpreter for the duration of :func:`record_launches`.

    ``reports`` holds one :class:`RaceReport` per launch (empty when recording is off);
    ``launches`` counts launches seen.
    """

    def __init__(
        self,
        *,
        record: bool = True,
        order: str = "forward",
        seed: int = 0,
        named_memory: Mapping[str, torch.Tensor] | None = None,
        max_conflicts: int = 1000,
    ) -> None:
        if order not in _ORDERS:
            raise ValueError(f"unknown program order {order!r}; expected one of {_ORDERS}")
        self.record = record
        self.order = order
        self.seed = seed
        self.named_memory = dict(named_memory or {})
        self.max_conflicts = max_conflicts
        self.reports: list[RaceReport] = []
        self.launches = 0
        self._launch: _Launch | None = None
        self._atomic_depth = 0

    # -- hooks -------------------------------------------------------------------------

    def _install(self, patch: _Patch) -> None:
        builder = _interp.interpreter_builder
        executor = _interp.GridExecutor
        orig_call = executor.__call__
        orig_init_args = executor._init_args_hst
        orig_set_dim = builder.set_grid_dim
        orig_set_idx = builder.set_grid_idx
        orig_load = builder.create_masked_load
        orig_store = builder.create_masked_store
        orig_rmw = builder.create_atomic_rmw
        orig_cas = builder.create_atomic_cas
        orig_atomic_load = builder.create_atomic_load
        orig_atomic_store = builder.create_atomic_store
        rec = self

        def call(ex, *args, **kwargs):
            if rec._launch is not None:
                raise RuntimeError("racecheck: nested kernel launches are not supported")
            rec._launch = _Launch(getattr(ex.fn, "__name__", "kernel"))
            try:
                out = orig_call(ex, *args, **kwargs)
                launch = rec._launch
            finally:
                rec._launch = None
            rec.launches += 1
            if rec.record:
                rec.reports.append(rec._analyse(launch))
            return out

        def init_args(ex, args_dev, kwargs):
            args_hst, kwargs_hst = orig_init_args(ex, args_dev, kwargs)
            # Host copies are what the interpreter addresses (the same memory for CPU
            # tensors); name them after the kernel's parameters.
            named = inspect.getcallargs(ex.fn, *args_hst, **kwargs_hst)
            regions = _regions_of(named) + _regions_of(rec.named_memory)
            rec._launch.regions = regions
            return args_hst, kwargs_hst

        def set_grid_dim(nx, ny, nz):
            orig_set_dim(nx, ny, nz)
            launch = rec._launch
            launch.grid = (nx, ny, nz)
            launch.order = _program_order(nx * ny * nz, rec.order, rec.seed)

        def set_grid_idx(x, y, z):
            launch = rec._launch
            lin = launch.linear((x, y, z))
            # The executor walks the grid forward; run the program the order puts there.
            lin = int(launch.order[lin])
            launch.program = lin
            orig_set_idx(*launch.unravel(lin))

        def masked_load(ptrs, mask, other, cache_policy, is_volatile):
            mask = _bool_mask(mask)
            rec._note(ptrs, mask, _ATOMIC if rec._atomic_depth else _READ)
            return orig_load(ptrs, mask, other, cache_policy, is_volatile)

        def masked_store(ptrs, value, mask, cache_policy):
            mask = _bool_mask(mask)
            rec._note(ptrs, mask, _ATOMIC if rec._atomic_depth else _WRITE)
            return orig_store(ptrs, value, mask, cache_policy)

        def atomic_rmw(op, ptr, val, mask, sem, scope):
            mask = _bool_mask(mask)
            rec._note(ptr, mask, _ATOMIC)
            return orig_rmw(op, ptr, val, mask, sem, scope)

        def atomic_cas(ptr, cmp, val, sem, scope):
            rec._note(ptr, None, _ATOMIC)
            return orig_cas(ptr, cmp, val, sem, scope)

        def atomic_load(ptr, mask, sem, scope):
            rec._atomic_depth += 1
            try:
                return orig_atomic_load(ptr, mask, sem, scope)
            finally:
                rec._atomic_depth -= 1

        def atomic_store(ptr, val, mask, sem, scope):
            rec._atomic_depth += 1
            try:
                return orig_atomic_store(ptr, val, mask, sem, scope)
            finally:
                rec._atomic_depth -= 1

        patch.set(executor, "__call__", call)
        patch.set(executor, "_init_args_hst", init_args)
        for name, fn in (
            ("set_grid_dim", set_grid_dim),
            ("set_grid_idx", set_grid_idx),
            ("create_masked_load", masked_load),
            ("create_masked_store", masked_store),
            ("create_atomic_rmw", atomic_rmw),
            ("create_atomic_cas", atomic_cas),
            ("create_atomic_load", atomic_load),
            ("create_atomic_store", atomic_store),
        ):
            patch.set(builder, name, fn)

    def _note(self, ptrs: Any, mask: Any, kind: int) -> None:
        launch = self._launch
        if not self.record or launch is None:
            return
        addrs = np.asarray(ptrs.data).astype(np.uint64, copy=False)
        if mask is not None:
            addrs = addrs[np.broadcast_to(np.asarray(mask.data, dtype=bool), addrs.shape)]
        else:
            addrs = addrs.reshape(-1)
        if addrs.size == 0:
            return
        itemsize = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        if itemsize > 1:
            addrs = (addrs[:, None] + np.arange(itemsize, dtype=np.uint64)).reshape(-1)
        launch.chunks.append((addrs, launch.program, kind))

    # -- analysis ------------------------------------------------------------------------

    def _analyse(self, launch: _Launch) -> RaceReport:
        if launch.chunks:
            byte = np.concatenate([c[0] for c in launch.chunks])
            prog = np.concatenate([np.full(c[0].size, c[1], np.int64) for c in launch.chunks])
            kind = np.concatenate([np.full(c[0].size, c[2], np.int8) for c in launch.chunks])
        else:
            byte = np.zeros(0, np.uint64)
            prog = np.zeros(0, np.int64)
            kind = np.zeros(0, np.int8)
        launch.chunks = []
        # Sort by (byte, program, kind) and keep one entry per triple.
        order = np.lexsort((kind, prog, byte))
        byte, prog, kind = byte[order], prog[order], kind[order]
        if byte.size:
            keep = np.ones(byte.size, bool)
            keep[1:] = (byte[1:] != byte[:-1]) | (prog[1:] != prog[:-1]) | (kind[1:] != kind[:-1])
            byte, prog, kind = byte[keep], prog[keep], kind[keep]
        counts = {k: int(np.unique(byte[kind == k]).size) for k in (_READ, _WRITE, _ATOMIC)}

        bad_bytes = _conflicting_bytes(byte, prog, kind)
        elements = self._elements_of(bad_bytes, launch.regions)
        conflicts: list[Conflict] = []
        truncated = False
        for region, element in elements:
            if len(conflicts) >= self.max_conflicts:
                truncated = True
                break
            lo = region.start + element * region.itemsize if region.name != _UNMAPPED else element
            hi = lo + region.itemsize
            a, b = np.searchsorted(byte, [lo, hi])
            index = region.index_of(element) if region.name != _UNMAPPED else None
            for kind_name, first, second in _pairs(prog[a:b], kind[a:b]):
                conflicts.append(
                    Conflict(kind_name, region.name, element, index,
                             launch.unravel(first), launch.unravel(second))
                )
        if len(conflicts) > self.max_conflicts:
            conflicts = conflicts[: self.max_conflicts]
            truncated = True
        return RaceReport(
            kernel=launch.kernel,
            grid=launch.grid,
            conflicts=conflicts,
            num_conflicting_elements=len(elements),
            truncated=truncated,
            bytes_loaded=counts[_READ],
            bytes_stored=counts[_WRITE],
            bytes_atomic=counts[_ATOMIC],
        )

    @staticmethod
    def _elements_of(bad: np.ndarray, regions: list[_Region]) -> list[tuple[_Region, int]]:
        out: list[tuple[_Region, int]] = []
        unassigned = np.ones(bad.size, bool)
        for region in regions:
            inside = unassigned & (bad >= region.start) & (bad < region.end)
            if inside.any():
                elems = np.unique((bad[inside] - np.uint64(region.start)) // region.itemsize)
                out.extend((region, int(e)) for e in elems)
                unassigned &= ~inside
        if unassigned.any():
            loose = _Region(_UNMAPPED, 0, 0, 1, (), ())
            out.extend((loose, int(b)) for b in np.unique(bad[unassigned]))
        return out


def _bool_mask(mask: Any) -> Any:
    if mask is None or mask.data.dtype == np.bool_:
        return mask
    return _interp.TensorHandle(mask.data != 0, triton.language.int1)


def _conflicting_bytes(byte: np.ndarray, prog: np.ndarray, kind: np.ndarray) -> np.ndarray:
    """Bytes (sorted, unique entries per (byte, program, kind)) that break the race rule."""
    if byte.size == 0:
        return byte
    starts = np.flatnonzero(np.r_[True, byte[1:] != byte[:-1]])
    big = np.iinfo(np.int64).max

    def group_min(values: np.ndarray) -> np.ndarray:
        return np.minimum.reduceat(values, starts)

    def group_max(values: np.ndarray) -> np.ndarray:
        return np.maximum.reduceat(values, starts)

    is_w, is_a, is_r = kind == _WRITE, kind == _ATOMIC, kind == _READ
    several = group_min(prog) != group_max(prog)
    # A plain store shared with any other program conflicts.
    bad = several & (group_max(is_w.astype(np.int8)) > 0)
    # An atomic conflicts with a plain load by another program (atomic vs atomic is fine).
    r_min = group_min(np.where(is_r, prog, big))
    r_max = group_max(np.where(is_r, prog, -1))
    a_min = group_min(np.where(is_a, prog, big))
    a_max = group_max(np.where(is_a, prog, -1))
    has_r, has_a = r_max >= 0, a_max >= 0
    same_single = (r_min == r_max) & (a_min == a_max) & (r_min == a_min)
    bad |= has_r & has_a & ~same_single
    return byte[starts[bad]]


def _pairs(prog: np.ndarray, kind: np.ndarray) -> Iterator[tuple[str, int, int]]:
    """Conflicting (kind, first, second) program pairs among one element's accesses."""
    w = sorted(set(prog[kind == _WRITE].tolist()))
    r = sorted(set(prog[kind == _READ].tolist()) - set(w))
    a = sorted(set(prog[kind == _ATOMIC].tolist()))
    for i, p in enumerate(w):
        for q in w[i + 1:]:
            yield "write-write", p, q
    for p in w:
        for q in r:
            yield "write-read", p, q
    for p in a:
        for q in w:
            if q != p:
                yield "atomic-write", p, q
        for q in r:
            if q != p:
                yield "atomic-read", p, q


# --------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------


@contextmanager
def record_launches(
    *,
    record: bool = True,
    order: str = "forward",
    seed: int = 0,
    named_memory: Mapping[str, torch.Tensor] | None = None,
    max_conflicts: int = 1000,
) -> Iterator[Recorder]:
    """Record (``record=True``) and/or reorder every interpreted launch in the block.

    ``order`` is the program order every launch runs in (``forward``, ``reversed``,
    ``shuffled`` with ``seed``). One recording at a time per process; the interpreter
    is restored on exit, also when the block raises.
    """
    recorder = Recorder(record=record, order=order, seed=seed, named_memory=named_memory,
                        max_conflicts=max_conflicts)
    if not _lock.acquire(blocking=False):
        raise RuntimeError("racecheck: a recording is already active")
    patch = _Patch()
    try:
        recorder._install(patch)
        _active.append(recorder)
        yield recorder
    finally:
        _active.clear()
        patch.restore()
        _lock.release()


def active_recorder() -> Recorder | None:
    """The :class:`Recorder` of the recording in progress, or None.

    Lets a test harness note which kernels ran under the checker and in which program
    orders (the suite's guard that every kernel is race-checked reads it)."""
    return _active[0] if _active else None


def _require_interpreted(kernel: Any) -> None:
    fn = kernel
    for _ in range(8):
        if isinstance(fn, _interp.InterpretedFunction):
            return
        fn = getattr(fn, "fn", None)
        if fn is None:
            break
    raise TypeError(
        f"racecheck: {getattr(kernel, '__name__', kernel)!r} is not an interpreted Triton "
        "kernel; it must be defined (its module imported) after TRITON_INTERPRET=1 is set"
    )


def check(
    kernel: Any,
    grid: Sequence[int] | Callable[[dict], Sequence[int]],
    *args: Any,
    named_memory: Mapping[str, torch.Tensor] | None = None,
    max_conflicts: int = 1000,
    **kwargs: Any,
) -> RaceReport:
    """Launch ``kernel[grid](*args, **kwargs)`` once under the checker and report.

    ``grid`` is anything Triton accepts (1 to 3 ints, or a callable of the meta-
    parameters). ``named_memory`` names tensors the kernel reaches without taking them
    as arguments. The launch really runs: outputs are written as usual.
    """
    _require_interpreted(kernel)
    grid = tuple(grid) if not callable(grid) else grid
    with record_launches(named_memory=named_memory, max_conflicts=max_conflicts) as rec:
        kernel[grid](*args, **kwargs)
    if len(rec.reports) != 1:
        raise RuntimeError(f"racecheck: expected one launch, saw {len(rec.reports)}")
    return rec.reports[0]


def assert_race_free(
    kernel: Any,
    grid: Sequence[int] | Callable[[dict], Sequence[int]],
    *args: Any,
    **kwargs: Any,
) -> RaceReport:
    """:func:`check`, raising ``AssertionError`` with the readable report on a conflict."""
    report = check(kernel, grid, *args, **kwargs)
    if not report.clean:
        raise AssertionError(str(report))
    return report


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    return value


def _tensors(names_values: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, value in names_values.items():
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, (tuple, list)):
            out.update(_tensors({f"{name}[{i}]": v for i, v in enumerate(value)}))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {f"{name}.{f.name}": getattr(value, f.name) for f in dataclasses.fields(value)}
            out.update(_tensors(fields))
    return out


def _diff(a: torch.Tensor, b: torch.Tensor) -> tuple[int, tuple[int, ...]] | None:
    if a.shape != b.shape or a.dtype != b.dtype:
        return a.numel(), ()
    # Bitwise: a race shows up as any change, NaN payloads and signed zeros included.
    wa = a.detach().contiguous().reshape(-1, 1).view(torch.uint8)
    wb = b.detach().contiguous().reshape(-1, 1).view(torch.uint8)
    differs = (wa != wb).any(dim=1)
    num = int(differs.sum())
    if num == 0:
        return None
    first = int(differs.nonzero()[0, 0])
    return num, tuple(int(i) for i in np.unravel_index(first, tuple(a.shape)))


def _compare(kernel: str, orders: Sequence[str],
             outputs: dict[str, dict[str, torch.Tensor]]) -> OrderReport:
    base = outputs[orders[0]]
    differences = []
    for order in orders[1:]:
        for name, tensor in outputs[order].items():
            d = _diff(base[name], tensor)
            if d is not None:
                differences.append(OrderDifference(order, name, d[0], d[1]))
    return OrderReport(kernel, tuple(orders), outputs, differences)


def _split(made: Sequence[Any] | Mapping[str, Any]) -> tuple[tuple, dict[str, Any]]:
    if isinstance(made, Mapping):
        return (), {k: _clone(v) for k, v in made.items()}
    return tuple(_clone(v) for v in made), {}


def run_in_orders(
    kernel: Any,
    grid: Sequence[int] | Callable[[dict], Sequence[int]],
    make_args: Callable[[], Sequence[Any] | Mapping[str, Any]],
    orders: Sequence[str] = _ORDERS,
    seed: int = 0,
    **constants: Any,
) -> OrderReport:
    """Run one launch with the grid in each program order, on fresh copies of the inputs.

    ``make_args()`` is called once and returns the positional arguments (a sequence) or
    keyword arguments (a mapping); every order gets clones of its tensors, and
    ``constants`` (constexprs and the like) are passed to every launch as keywords.
    Each tensor argument after the run is compared bitwise against the first order's.
    """
    _require_interpreted(kernel)
    if not orders:
        raise ValueError("run_in_orders: need at least one order")
    grid = tuple(grid) if not callable(grid) else grid
    made = make_args()
    names = list(getattr(_innermost(kernel), "arg_names", []))
    outputs: dict[str, dict[str, torch.Tensor]] = {}
    for order in orders:
        args, kwargs = _split(made)
        with record_launches(record=False, order=order, seed=seed):
            kernel[grid](*args, **kwargs, **constants)
        named = dict(zip(names, args)) if names else {f"arg{i}": v for i, v in enumerate(args)}
        named.update(kwargs)
        outputs[order] = _tensors(named)
    return _compare(getattr(kernel, "__name__", "kernel"), orders, outputs)


def run_launcher_in_orders(
    launcher: Callable[..., Any],
    make_args: Callable[[], Sequence[Any] | Mapping[str, Any]],
    orders: Sequence[str] = _ORDERS,
    seed: int = 0,
) -> OrderReport:
    """:func:`run_in_orders` for a Python function that launches kernels itself.

    Every launch inside ``launcher`` runs its grid in the given order. Compared
    outputs: the launcher's tensor arguments (lists, tuples and dataclasses of tensors
    included, named ``arg[i]`` / ``arg.field``) and its return value (``return``...).
    """
    if not orders:
        raise ValueError("run_launcher_in_orders: need at least one order")
    made = make_args()
    signature = inspect.signature(launcher)
    outputs: dict[str, dict[str, torch.Tensor]] = {}
    for order in orders:
        args, kwargs = _split(made)
        with record_launches(record=False, order=order, seed=seed) as rec:
            result = launcher(*args, **kwargs)
        if rec.launches == 0:
            raise RuntimeError("run_launcher_in_orders: the launcher launched no kernel")
        named = dict(signature.bind(*args, **kwargs).arguments)
        named["return"] = result
        outputs[order] = _tensors(named)
    return _compare(getattr(launcher, "__name__", "launcher"), orders, outputs)


def _innermost(kernel: Any) -> Any:
    fn = kernel
    while not isinstance(fn, _interp.InterpretedFunction) and getattr(fn, "fn", None) is not None:
        fn = fn.fn
    return fn

