"""Sharded checkpoints on ``torch.distributed.checkpoint`` (DCP): what a ``--fsdp`` run saves.

A checkpoint is a folder, ``checkpoint.dcp/``, holding

* DCP's files: ``.metadata`` (the global index) and one ``__<rank>_0.distcp`` per rank with that
  rank's shards of the model weights (``model.<name>``) and of the optimizer's per-parameter state
  (``optim.<name>.exp_avg`` ...); the replicated tensors of the scheduler / RNG state
  (``state/<n>``) are written once;
* ``attnres.json``, the manifest: format, step, the run identity (``config``), the counters
  (``extra``), the JSON structure of the optimizer's param groups, the scheduler and the RNG
  (tensor leaves referenced by key, as in the single-file format of :mod:`.checkpoint`), the size
  and sha256 of every other file of the folder, and a sha256 of the manifest itself.

DCP maps the saved shards onto whatever layout the loading model has, so a checkpoint written by
``N`` ranks resumes on ``M`` ranks, with or without ``--fsdp``, or loads into a plain model in one
process without a process group (``attnres eval | sample | export-hf`` on a ``--fsdp`` run).

The guarantees of the single-file checkpoint carry over:

* **atomic**: every rank writes into a fresh ``.checkpoint.dcp.tmp-save/``; once DCP has finished
  (its metadata is written last), rank 0 hashes the files, writes the manifest, then renames
  ``checkpoint.dcp`` to ``checkpoint.prev.dcp`` and the new folder to ``checkpoint.dcp``. A crash
  at any point leaves the last good checkpoint under one of the two names;
* **verified**: before anything is loaded, every file's size and sha256 are compared with the
  manifest (on rank 0, its verdict broadcast), the recorded identity with the run's
  (:class:`.checkpoint.CheckpointMismatchError`), and each tensor's dtype and global shape with the
  model's; :func:`load_latest_sharded` falls back to ``checkpoint.prev.dcp`` like
  :func:`.checkpoint.load_latest`;
* **no code from data**: DCP's ``.metadata`` is a pickle. It is read with an unpickler that builds
  only DCP's metadata classes, ``torch.Size``, dtypes and paths, and a checkpoint with non-tensor
  entries (which DCP would ``torch.load`` with ``weights_only=False``) is refused; the tensors
  themselves are read by DCP with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ..files import atomic_write, fsync_dir, read_text
from .checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    ConfigCheck,
    capture_rng_state,
    flatten_state,
    restore_rng_state,
    unflatten_state,
)

__all__ = [
    "DCP_DIR",
    "DCP_PREV_DIR",
    "MANIFEST",
    "load_latest_sharded",
    "load_sharded",
    "peek_sharded",
    "save_sharded",
    "verify_sharded",
]

DCP_DIR = "checkpoint.dcp"
DCP_PREV_DIR = "checkpoint.prev.dcp"
MANIFEST = "attnres.json"
FORMAT = "attention_residuals.dcp_checkpoint"
VERSION = 1
_TMP = f".{DCP_DIR}.tmp-save"
_DIGEST_KEY = "sha256_manifest"
_CHUNK = 1 << 20


# --------------------------------------------------------------------------- rank helpers


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_main() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _main_verdict(fn) -> Any:
    """``fn()`` run on rank 0 only, its result or its :class:`CheckpointError` on every rank."""
    box: list[Any] = [None]
    if _is_main():
        try:
            box[0] = ("ok", fn())
        except CheckpointError as e:
            box[0] = ("mismatch" if isinstance(e, CheckpointMismatchError) else "error", str(e))
    if _distributed():
        dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "mismatch":
        raise CheckpointMismatchError(value)
    if kind == "error":
        raise CheckpointError(value)
    return value


# --------------------------------------------------------------------------- the manifest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != _DIGEST_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _write_manifest(folder: Path, body: dict) -> None:
    files = {}
    for path in sorted(folder.iterdir()):
        if path.name != MANIFEST:
            files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {"format": FORMAT, "version": VERSION, **body, "files": files}
    manifest[_DIGEST_KEY] = _manifest_digest(manifest)
    atomic_write(folder / MANIFEST, json.dumps(manifest, sort_keys=True))


def _read_manifest(folder: Path) -> dict:
    """The manifest of ``folder``, unverified against the other files; CheckpointError if unusable."""
    if os.path.islink(folder) or not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} does not exist (or is not a folder)")
    try:
        manifest = json.loads(read_text(folder / MANIFEST))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder} is incomplete (no {MANIFEST})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} is unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{folder} is not an attention_residuals sharded checkpoint")
    if manifest.get(_DIGEST_KEY) != _manifest_digest(manifest):
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} is corrupt (its checksum differs)")
    return manifest


def verify_sharded(folder: str | os.PathLike) -> dict:
    """The manifest of ``folder`` once every file it lists has its recorded size and sha256 and
    no other file is there; :class:`CheckpointError` naming the first problem otherwise."""
    folder = Path(folder)
    manifest = _read_manifest(folder)
    listed = manifest.get("files", {})
    present = {p.name for p in folder.iterdir()} - {MANIFEST}
    unlisted = sorted(present - listed.keys())
    if unlisted:
        raise CheckpointError(f"checkpoint {folder}: {unlisted[0]} is not part of it (planted or left over)")
    for name, want in sorted(listed.items()):
        path = folder / name
        if os.path.islink(path) or not path.is_file():
            raise CheckpointError(f"checkpoint {folder} is incomplete ({name} is missing)")
        if path.stat().st_size != want["bytes"] or _sha256(path) != want["sha256"]:
            raise CheckpointError(f"checkpoint {folder} is truncated or corrupt ({name}: sha256 differs)")
    return manifest


def peek_sharded(folder: str | os.PathLike) -> dict[str, Any] | None:
    """``{"step", "config"}`` of ``folder``'s manifest, its files not verified (None when there
    is no usable manifest): the counterpart of :func:`.checkpoint.peek_checkpoint`."""
    try:
        manifest = _read_manifest(Path(folder))
        return {"step": int(manifest["step"]), "config": dict(manifest.get("config") or {})}
    except (CheckpointError, KeyError, TypeError, ValueError):
        return None


# --------------------------------------------------------------------------- DCP's metadata, safely


_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "ChunkStorageMetadata",
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes only: a ``.metadata`` naming anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


class _SafeReader(FileSystemReader):
    """DCP's file reader with :class:`_MetadataUnpickler` for ``.metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        return _read_metadata(path)


def _read_metadata(path: Path) -> Metadata:
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path.parent}: its index {path.name} is unusable ({e})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {path.parent}: {path.name} is not a DCP index")
    others = [k for k, v in metadata.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata)]
    if others:
        raise CheckpointError(
            f"checkpoint {path.parent} holds non-tensor entries {others[:3]} (they would be unpickled)"
        )
    return metadata


def _check_fits(folder: Path, metadata: Metadata, expected: dict[str, torch.Tensor]) -> None:
    """Every tensor the model/optimizer expects is in the checkpoint with its dtype and global
    shape (``load_state_dict`` would cast a dtype silently)."""
    problems = []
    for key, want in sorted(expected.items()):
        got = metadata.state_dict_metadata.get(key)
        if got is None:
            problems.append(f"missing {key}")
        elif got.properties.dtype != want.dtype or tuple(got.size) != tuple(want.shape):
            problems.append(
                f"{key}: {str(got.properties.dtype).removeprefix('torch.')} {list(got.size)} in the file, "
                f"{str(want.dtype).removeprefix('torch.')} {list(want.shape)} in the model"
            )
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"checkpoint {folder} does not fit the model: {'; '.join(problems[:3])}{more}")


# --------------------------------------------------------------------------- save / load


def _flat(prefix: str, tree: dict) -> dict[str, torch.Tensor]:
    """DCP's key for each tensor of a nested dict (``prefix.a.b``)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(f"{prefix}.{k}", v))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}.{k}"] = v
    return out


_OPTIONS = StateDictOptions(ignore_frozen_params=True)


def _optim_layout(optimizer: torch.optim.Optimizer | None, model: torch.nn.Module) -> tuple[dict, dict]:
    """(model state dict, optimizer state dict) by parameter name: DTensor shards under FSDP;
    under pipelining only this rank's stages (the others' parameters are frozen here)."""
    if optimizer is None:
        return get_model_state_dict(model, options=_OPTIONS), {}
    return get_state_dict(model, optimizer, options=_OPTIONS)


def save_sharded(
    folder: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    step: int = 0,
    config: dict | None = None,
    extra: dict | None = None,
    rng: bool = True,
) -> Path:
    """Write a sharded checkpoint at ``folder`` (a collective: every rank calls it), keeping the
    one it replaces as ``checkpoint.prev.dcp`` beside it; returns ``folder``."""
    folder = Path(folder)
    tmp, prev = folder.with_name(_TMP), folder.with_name(DCP_PREV_DIR)
    if _is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
    _barrier()
    model_sd, optim_sd = _optim_layout(optimizer, model)
    small = {
        "param_groups": optim_sd.get("param_groups"),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": capture_rng_state() if rng else None,
    }
    structure, small_tensors = flatten_state(small)
    state = {"model": model_sd, **small_tensors}
    if optim_sd:
        state["optim"] = optim_sd["state"]
    dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True))
    if _is_main():
        body = {
            "step": int(step),
            "config": config or {},
            "extra": extra or {},
            "state": structure,
            "torch": torch.__version__,
        }
        _write_manifest(tmp, body)
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(prev, ignore_errors=True)
            os.replace(folder, prev)
        os.replace(tmp, folder)
        fsync_dir(folder.parent)
    _barrier()
    return folder


def _placeholders(metadata: Metadata, keys: list[str]) -> dict[str, torch.Tensor]:
    """Empty tensors to load the replicated ``state/<n>`` entries into."""
    out = {}
    for key in keys:
        md = metadata.state_dict_metadata.get(key)
        if md is None:
            raise CheckpointError(f"checkpoint is incomplete ({key} is missing)")
        out[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    return out


def _verified_manifest(folder: Path, check_config: ConfigCheck | None) -> dict:
    """The manifest, once every file verifies and the recorded identity passes ``check_config``."""
    manifest = verify_sharded(folder)
    if check_config is not None and manifest.get("config"):
        diff = check_config(manifest["config"])
        if diff:
            raise CheckpointMismatchError(
                f"checkpoint {folder} was written by another run: " + "; ".join(diff)
            )
    _read_metadata(folder / ".metadata")
    return manifest


def _set_loaded_state(
    folder: Path,
    state: dict[str, Any],
    small: dict[str, Any],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    restore_rng: bool,
) -> None:
    """Put the read tensors and small state into the model, optimizer, scheduler and RNGs."""
    options = StateDictOptions(strict=True, ignore_frozen_params=True)
    if optimizer is not None:
        if small.get("param_groups") is None:
            raise CheckpointError(f"checkpoint {folder} holds no optimizer state")
        optim_full = {"state": state["optim"], "param_groups": small["param_groups"]}
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=optim_full, options=options
        )
    else:
        set_model_state_dict(model, state["model"], options=options)
    if scheduler is not None:
        if small.get("scheduler") is None:
            raise CheckpointError(f"checkpoint {folder} holds no scheduler state")
        scheduler.load_state_dict(small["scheduler"])
    if restore_rng and small.get("rng") is not None:
        restore_rng_state(small["rng"])


def load_sharded(
    folder: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    restore_rng: bool = True,
    check_config: ConfigCheck | None = None,
) -> dict[str, Any]:
    """Load a sharded checkpoint into ``model`` (plain or FSDP-sharded, any number of ranks) and
    the optimizer / scheduler; returns ``{"step", "config", "extra", "path"}``. Nothing is loaded
    unless every file verifies, the recorded identity passes ``check_config`` and every tensor fits."""
    folder = Path(folder)
    manifest = _main_verdict(lambda: _verified_manifest(folder, check_config))
    metadata = _read_metadata(folder / ".metadata")  # every rank: DCP plans its reads from it
    model_sd, optim_sd = _optim_layout(optimizer, model)
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd["state"]
    expected = {**_flat("model", model_sd), **_flat("optim", state.get("optim", {}))}
    _main_verdict(lambda: _check_fits(folder, metadata, expected))
    small_keys = sorted(k for k in metadata.state_dict_metadata if k.startswith("state/"))
    state.update(_placeholders(metadata, small_keys))
    try:
        dcp.load(state, storage_reader=_SafeReader(folder))
    except Exception as e:  # DCP wraps rank failures in its own exception types
        raise CheckpointError(f"checkpoint {folder} could not be read: {type(e).__name__}: {e}") from None
    small = unflatten_state(manifest["state"], {k: state[k] for k in small_keys})
    _set_loaded_state(
        folder, state, small, model=model, optimizer=optimizer, scheduler=scheduler, restore_rng=restore_rng
    )
    return {
        "step": manifest["step"],
        "config": manifest["config"],
        "extra": manifest["extra"],
        "path": folder,
    }


def load_latest_sharded(folder: str | os.PathLike, **kwargs: Any) -> tuple[dict[str, Any], list[str]]:
    """:func:`load_sharded` of ``folder``, falling back to ``checkpoint.prev.dcp`` beside it when
    ``folder`` is missing or damaged (never when it is another run's); ``(info, warnings)``."""
    folder = Path(folder)
    prev = folder.with_name(DCP_PREV_DIR)
    try:
        return load_sharded(folder, **kwargs), []
    except CheckpointMismatchError:
        raise
    except CheckpointError as err:
        if not prev.is_dir():
            raise
        try:
            info = load_sharded(prev, **kwargs)
        except CheckpointMismatchError:
            raise
        except CheckpointError as err2:
            raise CheckpointError(f"{err}; the previous checkpoint is unusable too: {err2}") from None
        return info, [f"{err}; loaded the previous good checkpoint {prev} (step {info['step']}) instead"]
