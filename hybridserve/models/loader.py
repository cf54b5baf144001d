"""Load a Hugging Face checkpoint directory into a model of :mod:`hybridserve.models`.

Reads ``config.json`` (through :class:`~hybridserve.models.config.ModelConfig`) and either a
single ``model.safetensors`` or the shards listed in ``model.safetensors.index.json``.
Weight names must be exactly those ``transformers`` writes for the architecture, so
``save_pretrained`` output loads as is. Every expected weight must be present with the
expected shape and nothing unknown may be present, except names a checkpoint may carry
that the model does not use: ``lm_head.weight`` when embeddings are tied, and the prefixes
a model class lists in ``ignored_weight_prefixes`` (multi-token-prediction ``mtp.*`` heads
of Nemotron-H, Qwen3.5 and Qwen3-Next; the vision tower ``model.visual.*`` of the Qwen3.5
vision-language checkpoints), each skipped with a note in the log.

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
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from safetensors import safe_open

from hybridserve.config import KernelPolicy, resolve_dtype
from hybridserve.models.config import ModelConfig
from hybridserve.models.hybrid import HybridForCausalLM
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


def _finite(
    file: Path, name: str, raw: torch.Tensor, device: torch.device | str, dtype: torch.dtype
) -> torch.Tensor:
    """``raw`` on ``device`` in ``dtype``, or CheckpointError if a value is NaN or Inf
    there: such weights load silently and make every output empty."""
    t = raw.to(device=device, dtype=dtype)
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


def load_model(
    path: str | os.PathLike[str],
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    config: ModelConfig | None = None,
    policy: KernelPolicy | None = None,
) -> HybridForCausalLM:
    """Build the model described by ``path/config.json`` and load its weights.

    Args:
        path: checkpoint directory.
        dtype: parameter dtype (weights are converted on load).
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
    path = Path(path)
    dtype = resolve_dtype(dtype)
    if config is None:
        config = ModelConfig.from_pretrained(path)
    cls = model_class(config.architecture)
    files: dict[str, tuple[Path, str]] = {}
    for disk_name, file in checkpoint_files(path).items():
        files[_model_name(cls, disk_name)] = (file, disk_name)
    where = path / INDEX_FILE if (path / INDEX_FILE).exists() else path / SINGLE_FILE
    present = _layers_in_weights([n for n in files if not _ignored(config, cls, n)])
    if config.num_layers > present:
        raise CheckpointError(
            f"{where}: config.json describes {config.num_layers} decoder layers "
            f"(num_hidden_layers / the layer list) but the weights hold {present}; "
            "fix num_hidden_layers or the layer list"
        )
    with torch.device("meta"):
        model = cls(config, policy)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}

    missing = sorted(set(expected) - set(files))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(
            f"{where}: missing weight(s) {missing[:5]}{more} required by {config.architecture}"
        )
    skipped = sorted(n for n in files if n not in expected and _ignored(config, cls, n))
    for prefix in cls.ignored_weight_prefixes:
        count = sum(1 for n in skipped if n.startswith(prefix))
        if count:
            log.info("%s: %d '%s*' weight(s) not used by this engine, skipped", where, count,
                     prefix)
    unexpected = sorted(n for n in files if n not in expected and not _ignored(config, cls, n))
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise CheckpointError(
            f"{files[unexpected[0]][0]}: unexpected weight(s) "
            f"{[files[n][1] for n in unexpected[:5]]}{more}, unknown to "
            f"{config.architecture} with this config.json (wrong architecture or layer layout?)"
        )

    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name][0], []).append(name)
    for file, names in by_file.items():
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in names:
                    disk_name = files[name][1]
                    shape = tuple(f.get_slice(disk_name).get_shape())
                    if shape != expected[name]:
                        raise CheckpointError(
                            f"{file}: weight {disk_name!r} has shape {list(shape)}, expected "
                            f"{list(expected[name])} from config.json"
                        )
                    state[name] = _finite(file, disk_name, f.get_tensor(disk_name), device, dtype)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{file}: unreadable or truncated safetensors file ({e})") from e
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
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
