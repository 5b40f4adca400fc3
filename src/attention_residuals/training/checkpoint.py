"""Safetensors checkpoints holding everything needed to resume a run exactly.

One ``.safetensors`` file holds

* the model weights under ``model/<name>``,
* every tensor of the optimizer, scheduler and RNG states under ``state/<n>``; the nested
  structure of those states (dicts with int keys, tuples, floats, ``None``...) is JSON in the
  file's metadata, with each tensor replaced by a reference to its key,
* ``step``, the run ``config`` and any ``extra`` JSON (tokens seen, wall time...),
* one sha256 over the whole file — the 8-byte header length, the header (every tensor's dtype,
  shape and offsets, the metadata, the padding) and the data — stored in the header's metadata
  as ``sha256_file``, computed with those 64 hex digits as zeros. It is verified on load, so a
  truncated or bit-flipped file anywhere (a tensor's dtype in the header included) raises
  :class:`CheckpointError` naming the file instead of resuming from garbage. Files of format
  version 1 (a checksum of the data section and one of the metadata, not of the tensor table)
  still load; their tensors' dtypes and shapes are then covered by the check against the model.

Before anything is loaded into a model, every tensor's dtype and shape are compared with the
model's (:class:`CheckpointError` naming the first ones that differ: ``load_state_dict`` would
silently cast a dtype), and ``check_config`` can compare the run identity the checkpoint records
with the run it is loaded into (:class:`CheckpointMismatchError` naming the differing fields).

Writes are atomic (:func:`.files.atomic_write`: a fresh temporary file in the same folder,
fsync'ed, then ``os.replace``). A crash or error mid-write leaves the previous checkpoint
untouched. :func:`save_checkpoint` with ``keep_previous=True`` also keeps the last checkpoint as
``<name>.prev.safetensors``, so a run directory always holds one good checkpoint even if the
newest file is later damaged on disk or the write was killed between the two renames:
:func:`load_latest`, the one loading path of ``train --resume``, ``eval`` and ``sample``, falls
back to it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..files import atomic_write

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "capture_rng_state",
    "flatten_state",
    "load_checkpoint",
    "load_latest",
    "peek_checkpoint",
    "previous_path",
    "read_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
    "unflatten_state",
    "verify_checkpoint",
]

FORMAT = "attention_residuals.checkpoint"
VERSION = 2  # 2: one sha256 over the whole file; 1 (still read): data and metadata checksums
_MAX_HEADER = 100 * 1024 * 1024
_DIGEST_KEY = "sha256_file"
_DIGEST_MARK = b'"sha256_file":"'  # as serde writes it: unique, a string value cannot hold it unescaped
_ZEROS = b"0" * 64

ConfigCheck = Callable[[dict], list[str]]  # the differing fields of a checkpoint's recorded config


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupt or does not fit the model it is loaded into."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A sound checkpoint written by another run (other config, seed, corpus...): never replaced
    by the previous checkpoint silently, the differing fields are named."""


# --------------------------------------------------------------------------- nested state <-> (json, tensors)


def flatten_state(obj: Any, prefix: str = "state/") -> tuple[Any, dict[str, torch.Tensor]]:
    """Split a nested state (``optimizer.state_dict()``...) into JSON-able structure and tensors.

    Tensors become ``{"__tensor__": key}``; dicts become ``{"__dict__": [[key, value], ...]}`` so
    int keys survive; tuples ``{"__tuple__": [...]}``; numpy arrays ``{"__ndarray__": key}``.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            key = f"{prefix}{len(tensors)}"
            tensors[key] = x.detach().cpu().contiguous()
            return {"__tensor__": key}
        if isinstance(x, np.ndarray):
            key = f"{prefix}{len(tensors)}"
            tensors[key] = torch.from_numpy(np.ascontiguousarray(x).astype(_np_safe(x.dtype)))
            return {"__ndarray__": key, "dtype": x.dtype.str}
        if isinstance(x, dict):
            return {"__dict__": [[walk_key(k), walk(v)] for k, v in x.items()]}
        if isinstance(x, tuple):
            return {"__tuple__": [walk(v) for v in x]}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, np.generic):
            return x.item()
        if x is None or isinstance(x, bool | int | float | str):
            return x
        if isinstance(x, torch.dtype):
            return {"__dtype__": str(x).removeprefix("torch.")}
        raise TypeError(f"cannot checkpoint a value of type {type(x).__name__}: {x!r}")

    def walk_key(k: Any) -> Any:
        if k is None or isinstance(k, bool | int | float | str):
            return k
        if isinstance(k, tuple):
            return {"__tuple__": [walk_key(v) for v in k]}
        raise TypeError(f"cannot checkpoint a dict key of type {type(k).__name__}: {k!r}")

    return walk(obj), tensors


def _np_safe(dtype: np.dtype) -> np.dtype:
    # safetensors/torch lack some unsigned types; widen losslessly (restored from the stored dtype)
    return {np.dtype(np.uint32): np.dtype(np.int64), np.dtype(np.uint16): np.dtype(np.int32)}.get(
        np.dtype(dtype), np.dtype(dtype)
    )


def unflatten_state(structure: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`flatten_state`."""

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if "__tensor__" in x:
                return tensors[x["__tensor__"]]
            if "__ndarray__" in x:
                return tensors[x["__ndarray__"]].numpy().astype(np.dtype(x["dtype"]))
            if "__dict__" in x:
                return {walk(k): walk(v) for k, v in x["__dict__"]}
            if "__tuple__" in x:
                return tuple(walk(v) for v in x["__tuple__"])
            if "__dtype__" in x:
                return getattr(torch, x["__dtype__"])
            raise ValueError(f"unknown structure node {sorted(x)}")
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(structure)


# --------------------------------------------------------------------------- RNG


def capture_rng_state() -> dict:
    """torch (CPU and every CUDA device), numpy and python ``random`` states."""
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(legacy=True),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of :func:`capture_rng_state` (accepts the lists/tuples JSON gives back)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"].to(torch.uint8))
    if "numpy" in state:
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(gauss)))
    if "python" in state:
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        cuda = list(state["cuda"])[: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all([t.to(torch.uint8) for t in cuda])


# --------------------------------------------------------------------------- file format


def _meta_digest(meta: dict[str, str]) -> str:
    """Version 1's checksum of the metadata."""
    body = {k: v for k, v in meta.items() if k != "sha256_meta"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _digest_at(blob: bytes | bytearray, name: str) -> int:
    """Offset of the 64 hex digits of ``sha256_file`` in a safetensors blob."""
    (n,) = struct.unpack("<Q", blob[:8])
    header = bytes(blob[8 : 8 + n])
    i = header.find(_DIGEST_MARK)
    if i < 0 or header.find(_DIGEST_MARK, i + 1) >= 0:
        raise CheckpointError(f"checkpoint {name} is corrupt (no single {_DIGEST_KEY} in its header)")
    return 8 + i + len(_DIGEST_MARK)


def _file_digest(blob: bytes | bytearray, at: int) -> str:
    """sha256 of the blob with its 64 digest digits at ``at`` read as zeros (no copy)."""
    view = memoryview(blob)
    h = hashlib.sha256(view[:at])
    h.update(_ZEROS)
    h.update(view[at + 64 :])
    return h.hexdigest()


def _encode(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> bytes:
    """Serialise with a zero ``sha256_file``, then write the file's digest over the zeros (same
    length: nothing moves)."""
    blob = bytearray(st_save(tensors, metadata={**meta, _DIGEST_KEY: _ZEROS.decode()}))
    at = _digest_at(blob, "<memory>")
    blob[at : at + 64] = _file_digest(blob, at).encode()
    return bytes(blob)


def _verify(blob: bytes, header: dict, data: memoryview, name: str) -> dict[str, str]:
    """The metadata of a checkpoint blob once its checksums hold; :class:`CheckpointError` naming
    the file and what is wrong otherwise."""
    meta = header.get("__metadata__") or {}
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{name} is not an attention_residuals checkpoint (format={meta.get('format')!r})"
        )
    if _DIGEST_KEY in meta:
        at = _digest_at(blob, name)
        if (
            blob[at : at + 64] != str(meta[_DIGEST_KEY]).encode()
            or _file_digest(blob, at) != meta[_DIGEST_KEY]
        ):
            raise CheckpointError(
                f"checkpoint {name} is truncated or corrupt (file checksum mismatch: sha256 of the file differs from the one recorded)"
            )
        return meta
    if "sha256_data" not in meta or "sha256_meta" not in meta:
        raise CheckpointError(f"checkpoint {name} has no checksums")
    if _meta_digest(meta) != meta["sha256_meta"]:
        raise CheckpointError(f"checkpoint {name} is corrupt (metadata checksum mismatch)")
    if hashlib.sha256(data).hexdigest() != meta["sha256_data"]:
        raise CheckpointError(f"checkpoint {name} is truncated or corrupt (data checksum mismatch)")
    return meta


def _split(blob: bytes, name: str) -> tuple[dict, memoryview]:
    """(header JSON, data section) of a safetensors blob; CheckpointError when malformed."""
    if len(blob) < 8:
        raise CheckpointError(f"checkpoint {name} is truncated ({len(blob)} bytes, no header)")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > _MAX_HEADER or 8 + n > len(blob):
        raise CheckpointError(
            f"checkpoint {name} is truncated or corrupt (header of {n} bytes, file of {len(blob)})"
        )
    try:
        header = json.loads(bytes(blob[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {name} is corrupt (unreadable header: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"checkpoint {name} is corrupt (header is not a JSON object)")
    return header, memoryview(blob)[8 + n :]


def previous_path(path: str | os.PathLike) -> Path:
    """Where ``save_checkpoint(..., keep_previous=True)`` keeps the checkpoint it replaced."""
    p = Path(path)
    stem = p.name.removesuffix(".safetensors")
    return p.with_name(f"{stem}.prev.safetensors")


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    step: int = 0,
    config: dict | None = None,
    extra: dict | None = None,
    rng: bool = True,
    keep_previous: bool = False,
) -> Path:
    """Write a checkpoint atomically; returns its path.

    ``keep_previous`` moves an existing file at ``path`` to :func:`previous_path` just before the
    new one takes its place.
    """
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for name, t in model.state_dict().items():
        # tied weights share storage; safetensors refuses shared tensors, so store a copy each
        t = t.detach().cpu()
        ptr = t.untyped_storage().data_ptr() if t.numel() else -1
        tensors[f"model/{name}"] = t.clone().contiguous() if ptr in seen else t.contiguous()
        if ptr >= 0:
            seen.setdefault(ptr, name)
    state = {
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": capture_rng_state() if rng else None,
    }
    structure, state_tensors = flatten_state(state)
    tensors.update(state_tensors)
    meta = {
        "format": FORMAT,
        "version": str(VERSION),
        "step": str(int(step)),
        "config": json.dumps(config or {}, sort_keys=True),
        "extra": json.dumps(extra or {}, sort_keys=True),
        "state": json.dumps(structure),
        "torch": torch.__version__,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(
        path, _encode(tensors, meta), keep_previous=previous_path(path) if keep_previous else None
    )


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read and verify a checkpoint: ``(tensors, info)`` where info has step, config, extra, state.

    Raises :class:`CheckpointError` (naming the file) when it is missing, truncated or corrupt.
    """
    path = Path(path)
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be read: {e}") from None
    header, data = _split(blob, str(path))
    meta = _verify(blob, header, data, str(path))
    try:
        tensors = st_load(blob)
        info = {
            "step": int(meta["step"]),
            "config": json.loads(meta["config"]),
            "extra": json.loads(meta["extra"]),
            "state": unflatten_state(
                json.loads(meta["state"]), {k: v for k, v in tensors.items() if k.startswith("state/")}
            ),
            "version": int(meta["version"]),
        }
    except CheckpointError:
        raise
    except Exception as e:  # a checksum-valid but malformed file: still name it
        raise CheckpointError(f"checkpoint {path} is malformed: {type(e).__name__}: {e}") from None
    return tensors, info


def peek_checkpoint(path: str | os.PathLike) -> dict[str, Any] | None:
    """``{"step", "config"}`` as a checkpoint's header records them, read without verifying the
    file (None when there is no readable header): enough to tell which of two checkpoints is
    newer and which model to build before the verified load."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            meta = json.loads(f.read(n))["__metadata__"] if n <= _MAX_HEADER else {}
        return {"step": int(meta["step"]), "config": json.loads(meta.get("config", "{}"))}
    except (OSError, struct.error, ValueError, KeyError, TypeError):
        return None


def verify_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a complete, uncorrupted checkpoint."""
    try:
        read_checkpoint(path)
    except CheckpointError:
        return False
    return True


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def check_fits(
    model: torch.nn.Module, weights: dict[str, torch.Tensor], name: str, strict: bool = True
) -> None:
    """Every weight has the dtype and shape of the model's tensor of that name (and, when
    ``strict``, the names are the model's): :class:`CheckpointError` naming the first that differ
    otherwise. ``load_state_dict`` checks shapes but casts dtypes silently."""
    expected = model.state_dict()
    problems = []
    if strict:
        for what, names in (
            ("missing", sorted(expected.keys() - weights.keys())),
            ("unexpected", sorted(weights.keys() - expected.keys())),
        ):
            if names:
                problems.append(f"{what} tensors {names[:3]}{' ...' if len(names) > 3 else ''}")
    for key in sorted(expected.keys() & weights.keys()):
        want, got = expected[key], weights[key]
        if want.dtype != got.dtype or want.shape != got.shape:
            problems.append(f"{key}: {_describe(got)} in the file, {_describe(want)} in the model")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"checkpoint {name} does not fit the model: {'; '.join(problems[:3])}{more}")


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    restore_rng: bool = True,
    strict: bool = True,
    check_config: ConfigCheck | None = None,
) -> dict[str, Any]:
    """Load a checkpoint into the given objects; returns ``{"step", "config", "extra", "path"}``.

    Nothing is loaded unless the file is sound, its recorded config passes ``check_config``
    (which returns the differing fields: :class:`CheckpointMismatchError`; a checkpoint that
    records no config is not compared) and its weights fit ``model`` (:func:`check_fits`)."""
    path = Path(path)
    tensors, info = read_checkpoint(path)
    state = info["state"]
    if check_config is not None and info["config"]:
        diff = check_config(info["config"])
        if diff:
            raise CheckpointMismatchError(f"checkpoint {path} was written by another run: " + "; ".join(diff))
    try:
        if model is not None:
            weights = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
            check_fits(model, weights, str(path), strict)
            model.load_state_dict(weights, strict=strict)
        if optimizer is not None:
            if state.get("optimizer") is None:
                raise CheckpointError(f"checkpoint {path} holds no optimizer state")
            optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            if state.get("scheduler") is None:
                raise CheckpointError(f"checkpoint {path} holds no scheduler state")
            scheduler.load_state_dict(state["scheduler"])
    except (RuntimeError, ValueError, KeyError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"checkpoint {path} does not fit: {e}") from None
    if restore_rng and state.get("rng") is not None:
        restore_rng_state(state["rng"])
    return {"step": info["step"], "config": info["config"], "extra": info["extra"], "path": path}


def load_latest(path: str | os.PathLike, **kwargs: Any) -> tuple[dict[str, Any], list[str]]:
    """Load ``path`` (keywords of :func:`load_checkpoint`), falling back to its previous
    checkpoint if ``path`` is missing, truncated or corrupt — not if it belongs to another run
    (:class:`CheckpointMismatchError`). The one loading path of ``train --resume``, ``eval`` and
    ``sample``.

    Returns ``(info, warnings)``. Raises :class:`CheckpointError` naming both files when neither
    is good.
    """
    path = Path(path)
    prev = previous_path(path)
    try:
        return load_checkpoint(path, **kwargs), []
    except CheckpointMismatchError:
        raise
    except CheckpointError as err:
        if not os.path.lexists(prev):
            raise
        try:
            info = load_checkpoint(prev, **kwargs)
        except CheckpointMismatchError:
            raise
        except CheckpointError as err2:
            raise CheckpointError(f"{err}; the previous checkpoint is unusable too: {err2}") from None
        return info, [f"{err}; loaded the previous good checkpoint {prev} (step {info['step']}) instead"]
