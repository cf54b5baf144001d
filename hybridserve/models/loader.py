"""Load a Hugging Face checkpoint directory into a model of :mod:`hybridserve.models`.

Reads ``config.json`` (through :class:`~hybridserve.models.config.ModelConfig`) and either a
single ``model.safetensors`` or the shards listed in ``model.safetensors.index.json``.
Weight names must be exactly those ``transformers`` writes for the architecture, so
``save_pretrained`` output loads as is. Every expected weight must be present with the
expected shape and nothing unknown may be present, except names a checkpoint may carry
that the model does not use: ``lm_head.weight`` when embeddings are tied, and the prefixes
a model class lists in ``ignored_weight_prefixes`` (multi-token-prediction ``mtp.*`` heads
of Nemotron-H, Qwen3.5 and Qwen3-Next; the vision tower ``model.visual.*`` of the Qwen3.5
vision-language checkpoints), each skipped with a note in the log. Expert weights are
accepted as the families publish them, fused (Granite's ``block_sparse_moe.input_linear``)
or one tensor per expert (Nemotron-H's ``mixer.experts.N.up_proj``), as well as already
stacked under the model's own names, and end up stacked ``[E, ...]`` for the grouped
kernels.


Before the model is built, the decoder layers the config describes are counted against
the layers the weight names hold (a config claiming more is refused, however many it
claims). Shard files named by the index must lie inside the checkpoint directory
(relative names without ``..``), and every weight must be finite once converted to
the load dtype (checked per tensor as it is read).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from safetensors import safe_open

from hybridserve.config import KernelPolicy, resolve_dtype
from hybridserve.models.config import ModelConfig
from hybridserve.models.hybrid import HybridForCausalLM
from hybridserve.models.layers.moe import FLOAT32_WEIGHTS, WeightSlot, checkpoint_slot
from hybridserve.models.registry import model_class

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

class CheckpointError(ValueError):
    """The weights of a checkpoint cannot be loaded; the message names the file and weight."""


log = logging.getLogger("hybridserve.models")


def _ignored(config: ModelConfig, cls: type[HybridForCausalLM], name: str) -> bool:
    if config.tie_word_embeddings and name == "lm_head.weight":
        return True
    return name.startswith(cls.ignored_weight_prefixes)


def _model_name(cls: type[HybridForCausalLM], name: str) -> str:
    for on_disk, in_model in cls.checkpoint_prefixes:
        if name.startswith(on_disk):
            return in_model + name[len(on_disk) :]
    return name


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Map every weight name of the checkpoint at ``path`` to the file that holds it."""
    index = path / INDEX_FILE
    single = path / SINGLE_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{index}: unreadable shard index ({e}); expected a 'weight_map' object"
            ) from e
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' must map weight names to shard files")
        files: dict[str, Path] = {}
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(_shard_name(index, name, shard), []).append(name)
        for shard, names in shards.items():
            f = path / shard
            actual = set(_keys(f))
            for name in names:
                if name not in actual:
                    raise CheckpointError(
                        f"{f}: weight {name!r} listed in {INDEX_FILE} is not in the shard"
                    )
                files[name] = f
        return files
    if single.exists():
        return dict.fromkeys(_keys(single), single)
    raise CheckpointError(
        f"{path}: no weights found; expected {SINGLE_FILE} or {INDEX_FILE} "
        "in the checkpoint directory"
    )


def _shard_name(index: Path, weight: str, shard: object) -> str:
    """``shard`` as named for ``weight`` in the index, if it names a file inside the
    checkpoint directory; symlinks are not resolved (hub caches link shards to blobs
    elsewhere), only the name is checked."""
    if not isinstance(shard, str) or not shard:
        raise CheckpointError(f"{index}: weight {weight!r} maps to {shard!r}, not a file name")
    parts = PurePosixPath(shard.replace("\\", "/"))
    if parts.is_absolute() or PureWindowsPath(shard).is_absolute() or ".." in parts.parts:
        raise CheckpointError(
            f"{index}: weight {weight!r} maps to {shard!r}, outside the checkpoint directory; "
            "shard files must be named relative to it"
        )
    return shard


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layers_in_weights(names: list[str]) -> int:
    """Decoder layers the weight names hold: one more than the highest layer index."""
    found = [int(m.group(1)) for n in names if (m := _LAYER_INDEX.search(n))]
    return max(found) + 1 if found else 0


def _keys(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return list(f.keys())
    except FileNotFoundError as e:
        raise CheckpointError(f"{file}: shard file is missing") from e
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{file}: unreadable or truncated safetensors file ({e})") from e


# Bytes: the CPU allocator's alignment.
WEIGHT_ALIGNMENT = 64


def _finite(
    file: Path, name: str, raw: torch.Tensor, device: torch.device | str, dtype: torch.dtype
) -> torch.Tensor:
    """``raw`` on ``device`` in ``dtype``, or CheckpointError if a value is NaN or Inf
    there: such weights load silently and make every output empty."""
    t = raw.to(device=device, dtype=dtype)
    if t.data_ptr() % WEIGHT_ALIGNMENT:
        # A tensor read in place sits wherever the file put it. The CPU's matmul kernels
        # round differently on differently aligned operands, so the same weights written
        # in another layout (stacked names, other shards) gave other logits in the last
        # bits; a fresh allocation is aligned the same whatever the file.
        t = t.clone()
    # One reduction: NaN and Inf propagate into the sum. A finite sum that overflows
    # is a false alarm, settled by the exact count.
    if not t.is_floating_point() or bool(torch.isfinite(t.sum())):
        return t
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        if raw.is_floating_point() and bool(torch.isfinite(raw).all()):
            why = f"overflows {dtype} ({bad} values become Inf); load in a wider dtype"
        else:
            why = f"holds {bad} NaN or Inf values; the checkpoint is corrupt"
        raise CheckpointError(f"{file}: weight {name!r} {why}")
    return t


@dataclass(frozen=True)
class LoadStats:
    """What one :func:`load_model` read: bytes of tensors on disk, files, seconds."""

    bytes_read: int
    files: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / 1e9 / max(self.seconds, 1e-9)


def _slots(
    cls: type[HybridForCausalLM],
    config: ModelConfig,
    files: dict[str, Path],
    expected: dict[str, tuple[int, ...]],
) -> tuple[dict[str, tuple[Path, WeightSlot]], list[str], list[str]]:
    """Map every used checkpoint tensor to its slot; also return the unknown names and
    the (model-side) names skipped as not used."""
    slots: dict[str, tuple[Path, WeightSlot]] = {}
    unexpected: list[str] = []
    skipped: list[str] = []
    for disk_name, file in files.items():
        name = _model_name(cls, disk_name)
        slot = WeightSlot(name) if name in expected else checkpoint_slot(name, expected)
        if slot is None:
            if _ignored(config, cls, name):
                skipped.append(name)
            else:
                unexpected.append(disk_name)
            continue
        if slot.expert is not None and not 0 <= slot.expert < expected[slot.param][0]:
            raise CheckpointError(
                f"{file}: weight {disk_name!r} names expert {slot.expert}, but config.json has "
                f"{expected[slot.param][0]} experts"
            )
        slots[disk_name] = (file, slot)
    return slots, sorted(unexpected), skipped


def check_coverage(
    slots: dict[str, tuple[Path, WeightSlot]], expected: dict[str, tuple[int, ...]], where: Path,
    architecture: str,
) -> None:
    """Every parameter of ``expected`` filled exactly once by ``slots``: whole, or each
    expert's rows once; CheckpointError naming ``where`` otherwise."""
    whole: dict[str, list[str]] = {}
    parts: dict[str, dict[int, list[tuple[int, int]]]] = {}
    for disk_name, (_, slot) in slots.items():
        if slot.expert is None:
            whole.setdefault(slot.param, []).append(disk_name)
        else:
            rows = slot.rows or (0, expected[slot.param][1])
            parts.setdefault(slot.param, {}).setdefault(slot.expert, []).append(rows)
    missing = []
    for param, shape in expected.items():
        if len(whole.get(param, [])) + (param in parts) > 1:
            raise CheckpointError(
                f"{where}: weight {param!r} is given more than once "
                f"({', '.join(whole.get(param, []))}{' and per expert' if param in parts else ''})"
            )
        if param in whole:
            continue
        if param not in parts:
            missing.append(param)
            continue
        for expert in range(shape[0]):
            rows = sorted(parts[param].get(expert, []))
            covered = 0
            for lo, hi in rows:
                if lo != covered:
                    break
                covered = hi
            if covered != shape[1]:
                raise CheckpointError(
                    f"{where}: expert {expert} of {param!r} is "
                    + ("missing" if not rows else "incomplete or given twice")
                    + f" (rows {rows} of {shape[1]}) for {architecture}"
                )
    if missing:
        missing.sort()
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(
            f"{where}: missing weight(s) {missing[:5]}{more} required by {architecture}"
        )


def read_weights(
    slots: dict[str, tuple[Path, WeightSlot]],
    expected: dict[str, tuple[int, ...]],
    device: torch.device | str,
    dtype: torch.dtype,
) -> tuple[dict[str, torch.Tensor], int]:
    """Read every slotted tensor (``disk name -> (file, slot)``, checked by
    :func:`check_coverage`) into a state dict of the ``expected`` shapes: whole tensors
    as they are, per-expert ones copied into their stacked ``[E, ...]`` parameter. Each
    shard is memory-mapped once; each tensor is checked for shape and finiteness as it
    is read and converted to ``dtype`` (float32 for :data:`FLOAT32_WEIGHTS`). Returns
    the state and the bytes read."""

    def dtype_of(param: str) -> torch.dtype:
        return torch.float32 if param.rsplit(".", 1)[-1] in FLOAT32_WEIGHTS else dtype

    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[tuple[str, WeightSlot]]] = {}
    for disk_name, (file, slot) in slots.items():
        by_file.setdefault(file, []).append((disk_name, slot))
    nbytes = 0
    for file, names in by_file.items():
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for disk_name, slot in names:
                    shape = tuple(f.get_slice(disk_name).get_shape())
                    full = expected[slot.param]
                    want = full if slot.expert is None else full[1:]
                    if slot.rows is not None:
                        want = (slot.rows[1] - slot.rows[0], *want[1:])
                    if shape != want:
                        raise CheckpointError(
                            f"{file}: weight {disk_name!r} has shape {list(shape)}, expected "
                            f"{list(want)} from config.json"
                        )
                    tensor = f.get_tensor(disk_name)
                    nbytes += tensor.nbytes
                    if slot.expert is None:
                        state[slot.param] = _finite(
                            file, disk_name, tensor, device, dtype_of(slot.param)
                        )
                        continue
                    dest = state.get(slot.param)
                    if dest is None:
                        dest = torch.empty(full, dtype=dtype_of(slot.param), device=device)
                        state[slot.param] = dest
                    lo, hi = slot.rows or (0, full[1])
                    dest[slot.expert, lo:hi].copy_(
                        _finite(file, disk_name, tensor, device, dtype_of(slot.param))
                    )
                    del tensor
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{file}: unreadable or truncated safetensors file ({e})") from e
    return state, nbytes


def load_model(
    path: str | os.PathLike[str],
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    config: ModelConfig | None = None,
    policy: KernelPolicy | None = None,
) -> HybridForCausalLM:
    """Build the model described by ``path/config.json`` and load its weights.

    Shards are read one after another, each memory-mapped (``safe_open``) and each tensor
    moved to ``device`` (and ``dtype``) as it is read, so host memory beyond the model
    itself stays at one tensor. Per-expert tensors are copied straight into their stacked
    ``[E, ...]`` parameters (:func:`~hybridserve.models.layers.moe.checkpoint_slot`).
    The load rate is logged (``hybridserve.models``, INFO) and kept as
    ``model.load_stats`` (:class:`LoadStats`).

    Args:
        path: checkpoint directory.
        dtype: parameter dtype (weights are converted on load; the few named in
            :data:`~hybridserve.models.layers.moe.FLOAT32_WEIGHTS` stay float32).
        device: where the parameters live.
        config: use this config instead of reading ``config.json`` (e.g. one changed
            with :meth:`ModelConfig.with_overrides`); it must describe the same weights.
        policy: which kernels the model's ops take (the engine's
            :class:`~hybridserve.config.KernelPolicy`; default: its defaults).

    Returns:
        The model in eval mode with gradients disabled.

    Raises:
        ConfigError: the config is unsupported or invalid.
        CheckpointError: a weight is missing, unexpected, misshapen, or a file is unreadable.
    """
    started = time.perf_counter()
    path = Path(path)
    dtype = resolve_dtype(dtype)
    if config is None:
        config = ModelConfig.from_pretrained(path)
    cls = model_class(config.architecture)
    files = checkpoint_files(path)
    where = path / INDEX_FILE if (path / INDEX_FILE).exists() else path / SINGLE_FILE
    # Counted before the model is built: a config claiming 10**9 layers must not allocate.
    used = (_model_name(cls, n) for n in files)
    present = _layers_in_weights([n for n in used if not _ignored(config, cls, n)])
    if config.num_layers > present:
        raise CheckpointError(
            f"{where}: config.json describes {config.num_layers} decoder layers "
            f"(num_hidden_layers / the layer list) but the weights hold {present}; "
            "fix num_hidden_layers or the layer list"
        )
    with torch.device("meta"):
        model = cls(config, policy)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    slots, unexpected, skipped = _slots(cls, config, files, expected)
    check_coverage(slots, expected, where, config.architecture)
    for prefix in cls.ignored_weight_prefixes:
        count = sum(1 for n in skipped if n.startswith(prefix))
        if count:
            log.info("%s: %d '%s*' weight(s) not used by this engine, skipped", where, count,
                     prefix)
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise CheckpointError(
            f"{files[unexpected[0]]}: unexpected weight(s) {unexpected[:5]}{more}, unknown to "
            f"{config.architecture} with this config.json (wrong architecture or layer layout?)"
        )

    state, nbytes = read_weights(slots, expected, device, dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    # Where the weights came from: drafters that read more of the checkpoint (an MTP head).
    model.checkpoint_path = path
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    stats = LoadStats(nbytes, len({f for f, _ in slots.values()}), time.perf_counter() - started)
    model.load_stats = stats
    log.info(
        "loaded %s: %.2f GB from %d file(s) in %.2f s (%.2f GB/s)",
        path, nbytes / 1e9, stats.files, stats.seconds, stats.gb_per_s,
    )
    return model.eval()


def with_kernel_policy(model: HybridForCausalLM, policy: KernelPolicy) -> HybridForCausalLM:
    """The same model (sharing every parameter tensor: nothing is copied) built with
    another :class:`~hybridserve.config.KernelPolicy`, for tests and benchmarks that
    compare paths on one set of weights."""
    with torch.device("meta"):
        other = type(model)(model.config, policy)
    other.load_state_dict(model.state_dict(keep_vars=True), strict=True, assign=True)
    other.eval()
    return other
