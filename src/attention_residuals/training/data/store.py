"""A prepared corpus on disk: ``train.bin`` + ``val.bin`` (memory-mapped tokens) + ``manifest.json``.

The manifest records where the tokens came from (the source's content hash, its format), how
they were made (the tokenizer's id, the end-of-text id, the dtype), the split (method, fraction,
documents per split) and, per split, its token count and the sha256 of every block of
``BLOCK_TOKENS`` tokens. Reusing a cache verifies every block (a full read: about 1 GB/s of
sha256; a block that does not match names itself), so a cache corrupted in place — even at the
same size — is never trained on.

:func:`finalize` turns the shards of a prepare (``work/``, see :mod:`.readers`) into the two
split files: it ranks the documents, picks the validation documents and copies each document's
tokens to its split, streaming shard by shard. The split is **by document**: the
``max(1, round(n * val_fraction))`` documents with the smallest key (the first 8 bytes of the
sha256 of their text; ties by position) are the validation split — deterministic, independent of
the file format and of listing order, stable when documents are added, and exact duplicates
land on the same side. A source with given splits (``train``/``val`` files, a ``DatasetDict``)
keeps them; a single document is cut at a line boundary (:func:`.sources.line_cut`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .base import BLOCK_TOKENS, stream_digest
from .readers import INDEX_DTYPE, shard_paths, write_atomic

try:  # POSIX: serialise two processes preparing the same cache
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = [
    "FORMAT_NAME",
    "MANIFEST",
    "SPLITS",
    "CorruptCacheError",
    "finalize",
    "is_prepared",
    "locked",
    "open_split",
    "read_manifest",
    "verify",
    "write_manifest",
]

MANIFEST = "manifest.json"
FORMAT_NAME = "attnres-tokens"
VERSION = 2
SPLITS = ("train", "val")
WORK = "work"


class CorruptCacheError(ValueError):
    """A prepared corpus whose files do not match its manifest."""


def is_prepared(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``attnres data prepare`` (it holds a manifest)."""
    return path.is_dir() and (path / MANIFEST).is_file()


def read_manifest(entry: Path) -> dict | None:
    """The manifest of ``entry``; None when absent, unreadable or of another format."""
    try:
        m = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME or m.get("version") != VERSION:
        return None
    return m


def write_manifest(entry: Path, manifest: dict) -> None:
    write_atomic(entry / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


@contextlib.contextmanager
def locked(entry: Path) -> Iterator[None]:
    """Hold ``entry/.lock`` (another process preparing the same corpus waits, then reuses it)."""
    entry.mkdir(parents=True, exist_ok=True)
    with open(entry / ".lock", "a") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_UN)


def open_split(entry: Path, manifest: dict, split: str) -> np.ndarray:
    """The memory-mapped tokens of one split (no verification: see :func:`verify`)."""
    info, dtype = manifest[split], np.dtype(manifest["dtype"])
    if info["tokens"] == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(entry / info["file"], dtype=dtype, mode="r", shape=(info["tokens"],))


def verify(entry: Path, manifest: dict) -> None:
    """Check the split files against the manifest: sizes, then the sha256 of every block.
    Raises :class:`CorruptCacheError` naming the file and the first block that differs."""
    dtype = np.dtype(manifest["dtype"])
    for split in SPLITS:
        info = manifest[split]
        path = entry / info["file"]
        want = info["tokens"] * dtype.itemsize
        try:
            size = path.stat().st_size
        except OSError:
            raise CorruptCacheError(f"{path} is missing") from None
        if size != want:
            raise CorruptCacheError(f"{path} has {size} bytes, its manifest says {want}")
        step = info["block_tokens"]
        with open(path, "rb") as f:  # read, not mapped: verifying a large cache keeps memory flat
            for i, expected in enumerate(info["blocks"]):
                if hashlib.sha256(f.read(step * dtype.itemsize)).hexdigest() != expected:
                    lo, hi = i * step, min(info["tokens"], (i + 1) * step)
                    raise CorruptCacheError(
                        f"{path}: block {i} (tokens {lo}-{hi}) does not match its sha256 in {MANIFEST}"
                    )


class BlockWriter:
    """A split's tokens appended to its file (through a temporary one), hashed per block."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path, self.dtype = path, dtype
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self.file = open(self.tmp, "wb")  # closed by finish()
        self.blocks: list[str] = []
        self.sha = hashlib.sha256()
        self.in_block = self.tokens = 0

    def write(self, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, dtype=self.dtype)
        self.file.write(memoryview(arr).cast("B"))  # no copy
        self.tokens += arr.size
        while arr.size:
            take = min(BLOCK_TOKENS - self.in_block, arr.size)
            self.sha.update(memoryview(arr[:take]).cast("B"))
            self.in_block += take
            arr = arr[take:]
            if self.in_block == BLOCK_TOKENS:
                self.blocks.append(self.sha.hexdigest())
                self.sha, self.in_block = hashlib.sha256(), 0

    def finish(self) -> dict:
        if self.in_block:
            self.blocks.append(self.sha.hexdigest())
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        return {
            "file": self.path.name,
            "tokens": self.tokens,
            "block_tokens": BLOCK_TOKENS,
            "blocks": self.blocks,
        }


def _load_index(work: Path, shards: int) -> tuple[np.ndarray, np.ndarray]:
    """Every piece's index row, in order, and the number of pieces per shard."""
    rows = [np.load(shard_paths(work, i)[1], allow_pickle=False) for i in range(shards)]
    counts = np.array([len(r) for r in rows], dtype=np.int64)
    return (np.concatenate(rows) if rows else np.zeros(0, INDEX_DTYPE)), counts


def choose_val(index: np.ndarray, val_fraction: float, what: str) -> tuple[np.ndarray, str]:
    """Per document: True for the validation split; and the split method (see the module)."""
    ends = index["last"]
    keys, force = index["key"][ends], index["force"][ends]
    n = len(keys)
    if n and (force >= 0).any():
        return force == 1, "given"
    if n < 2:
        raise ValueError(f"{what}: splitting by document needs at least 2 documents, got {n}")
    k = min(n - 1, max(1, round(n * val_fraction)))
    order = np.lexsort((np.arange(n), keys))
    val = np.zeros(n, dtype=bool)
    val[order[:k]] = True
    return val, "document"


def finalize(
    work: Path, entry: Path, shards: int, dtype: np.dtype, val_fraction: float, what: str
) -> tuple[dict, np.ndarray]:
    """Write ``train.bin`` and ``val.bin`` from the shards in ``work`` (see the module docstring);
    returns the manifest's ``split``, ``train`` and ``val`` entries, and per document whether it
    went to the validation split."""
    index, counts = _load_index(work, shards)
    val_doc, method = choose_val(index, val_fraction, what)
    doc_of_piece = np.concatenate([[0], np.cumsum(index["last"][:-1])]).astype(np.int64) if len(index) else []
    piece_val = val_doc[doc_of_piece] if len(index) else np.zeros(0, dtype=bool)
    writers = {s: BlockWriter(entry / f"{s}.bin", dtype) for s in SPLITS}
    try:
        start = 0
        for i in range(shards):
            rows = slice(start, start + counts[i])
            start += counts[i]
            tokens = np.fromfile(shard_paths(work, i)[0], dtype=dtype)
            mask = np.repeat(piece_val[rows], index["ntok"][rows])
            writers["train"].write(tokens[~mask])
            writers["val"].write(tokens[mask])
        out = {s: w.finish() for s, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.file.close()
            w.tmp.unlink(missing_ok=True)
        raise
    out["train"]["documents"] = int((~val_doc).sum())
    out["val"]["documents"] = int(val_doc.sum())
    for s in SPLITS:
        if out[s]["tokens"] == 0:
            raise ValueError(f"{what}: the {s} split is empty")
    out["split"] = {"method": method, "val_fraction": val_fraction if method == "document" else None}
    out["tokens_sha256"] = stream_digest(out["train"]["blocks"], out["val"]["blocks"], dtype)
    return out, val_doc


def clear_work(entry: Path) -> None:
    shutil.rmtree(entry / WORK, ignore_errors=True)


def stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
