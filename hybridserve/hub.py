"""Where a ``model`` argument points: a local checkpoint directory or a Hugging Face hub id.

:func:`resolve_model` turns what a user passes as ``model`` (``LLM(model=...)``,
``--model``, ``hybridserve serve MODEL``) into a local directory:

- an existing path is used as is;
- anything else shaped like a hub id (``org/name``) is looked up in the local
  Hugging Face cache first (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
  ``~/.cache/huggingface/hub``), with no network access; only when it is not
  there, and ``$HF_HUB_OFFLINE`` is not set, are its files downloaded into that
  cache (``huggingface_hub.snapshot_download``). Only the files the engine reads are
  fetched: JSON (config, tokenizer, index), safetensors weights and Jinja chat
  templates;
- anything else raises ValueError saying which of the two it is not.

Errors are :class:`ModelNotFoundError` (a ValueError) and name the id, the cache
directory and what to do.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# Files the engine reads from a checkpoint; everything else in a repository (other
# weight formats, ONNX exports, images) is never downloaded.
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.jinja")

# huggingface_hub's rule for repository ids: "name" or "namespace/name", each part of
# letters, digits, "-", "_" and ".", not starting or ending with "-" or ".", no "--"
# or "..". Only "namespace/name" is taken here, so a bare name stays a local path.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HUB_ID = re.compile(rf"{_PART}/{_PART}")


class ModelNotFoundError(ValueError):
    """A ``model`` is neither a local directory nor a hub id that can be found."""


def is_hub_id(model: str) -> bool:
    """True when ``model`` has the shape of a hub id ``org/name`` (it may also be a path)."""
    return _HUB_ID.fullmatch(model) is not None and "--" not in model and ".." not in model


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    """Whether ``$HF_HUB_OFFLINE`` (or ``$TRANSFORMERS_OFFLINE``) forbids downloads, read
    now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    env = _truthy(os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE"))
    return env or constants.HF_HUB_OFFLINE


def hub_cache_dir() -> Path:
    """The hub cache huggingface_hub uses, from the environment as it is now."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expandvars(os.environ["HF_HUB_CACHE"])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def _has_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    )


def resolve_model(model: str | os.PathLike, revision: str | None = None) -> Path:
    """The local directory for ``model``: an existing path, or a hub id's snapshot in
    the local cache (downloaded there first when missing and downloads are allowed).

    Raises :class:`ModelNotFoundError` naming the id and the cache when it cannot be
    found, and for a string that is neither an existing path nor a hub id.
    """
    path = Path(model).expanduser()
    if path.exists():
        return path
    name = str(model)
    if not is_hub_id(name):
        raise ModelNotFoundError(
            f"model {name!r}: no such file or directory, and not a Hugging Face hub id "
            "(org/name); give a checkpoint directory or a hub id"
        )
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError as e:  # pragma: no cover - a pinned dependency
        raise ModelNotFoundError(
            f"model {name!r} is not a local directory, and huggingface_hub (needed for hub "
            "ids) is not installed: pip install huggingface_hub"
        ) from e
    cache = hub_cache_dir()
    common = {"revision": revision, "cache_dir": str(cache), "allow_patterns": list(ALLOW_PATTERNS)}
    try:
        local = Path(snapshot_download(name, local_files_only=True, **common))
        if _has_checkpoint(local):
            return local
    except LocalEntryNotFoundError:
        local = None
    where = f"the Hugging Face cache ({cache})"
    if hub_offline():
        missing = "is not in" if local is None else "is incomplete in"
        raise ModelNotFoundError(
            f"model {name!r} {missing} {where} and HF_HUB_OFFLINE is set, so it cannot be "
            f"downloaded: unset HF_HUB_OFFLINE (with network access), download it with "
            f"`hf download {name}`, or give a checkpoint directory"
        )
    try:
        downloaded = Path(snapshot_download(name, **common))
    except (RepositoryNotFoundError, GatedRepoError) as e:
        # GatedRepoError is a RepositoryNotFoundError: private, gated or absent.
        raise ModelNotFoundError(
            f"model {name!r}: the hub has no such repository, or it is private or gated "
            f"(log in with `hf auth login` or set HF_TOKEN): {type(e).__name__}"
        ) from e
    except RevisionNotFoundError as e:
        raise ModelNotFoundError(f"model {name!r}: revision {revision!r} not found on the hub") from e
    except LocalEntryNotFoundError as e:
        raise ModelNotFoundError(
            f"model {name!r} is not in {where} and the hub cannot be reached (no network?): "
            f"connect, or download it elsewhere with `hf download {name}` and copy the cache, "
            "or give a checkpoint directory"
        ) from e
    except (HfHubHTTPError, OSError) as e:
        raise ModelNotFoundError(f"model {name!r}: download failed: {e}") from e
    if not _has_checkpoint(downloaded):
        raise ModelNotFoundError(
            f"model {name!r}: the repository has no config.json with safetensors weights "
            f"(model.safetensors or model.safetensors.index.json) at {downloaded}; "
            "hybridserve loads safetensors checkpoints only"
        )
    return downloaded
