"""Files: ``--data`` to a sorted file list, content hashes, the standard library's files, split by file."""

from __future__ import annotations

import codecs
import glob as globlib
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from .base import DEFAULT_VAL_FRACTION

__all__ = [
    "ScannedFile",
    "corpus_sha",
    "resolve_data_files",
    "scan_file",
    "split_files",
    "stdlib_files",
]

READ_CHUNK = 1 << 20


def _path_rank(rel: str) -> str:
    return hashlib.sha256(rel.encode("utf-8")).hexdigest()


def split_files(
    rel_paths: list[str], val_fraction: float = DEFAULT_VAL_FRACTION
) -> tuple[list[int], list[int]]:
    """Indices of the train and validation files, split by file (the built-in corpora's split).

    The ``max(1, round(n * val_fraction))`` files with the smallest sha256 of their relative path
    are validation files: deterministic, independent of listing order, and stable when files are
    added. Both lists come back in the input order. Needs ``n >= 2``.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n = len(rel_paths)
    if n < 2:
        raise ValueError(f"splitting by file needs at least 2 files, got {n}")
    k = min(n - 1, max(1, round(n * val_fraction)))
    ranked = sorted(range(n), key=lambda i: (_path_rank(rel_paths[i]), rel_paths[i]))
    val = set(ranked[:k])
    return [i for i in range(n) if i not in val], sorted(val)


def stdlib_files(root: str | os.PathLike | None = None) -> tuple[Path, list[str]]:
    """The standard library's ``.py`` files as ``(root, sorted relative posix paths)``.

    ``site-packages``, ``dist-packages`` and ``__pycache__`` are skipped.
    """
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    rels = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for name in filenames:
            if name.endswith(".py"):
                p = Path(dirpath, name)
                if p.is_file():
                    rels.append(p.relative_to(base).as_posix())
    rels.sort()
    return base, rels


def _is_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def resolve_data_files(data: str | os.PathLike) -> tuple[Path, list[str]]:
    """``--data`` to ``(root, sorted relative paths)``: a file, a folder (recursive) or a glob.

    Hidden files and folders are skipped. Raises ``FileNotFoundError`` for a missing path or a
    glob matching nothing, ``ValueError`` for a folder without files.
    """
    spec = os.fspath(data)
    path = Path(spec).expanduser()
    if path.is_file():
        return path.parent, [path.name]
    if path.is_dir():
        rels = sorted(
            p.relative_to(path).as_posix()
            for p in path.rglob("*")
            if p.is_file() and not _hidden(p.relative_to(path))
        )
        if not rels:
            raise ValueError(f"--data {spec!r}: the folder contains no files")
        return path, rels
    if path.exists():
        raise ValueError(f"--data {spec!r}: not a regular file or folder")
    if _is_glob(spec):
        matches = sorted(Path(m) for m in globlib.glob(os.path.expanduser(spec), recursive=True))
        files = [m.resolve() for m in matches if m.is_file()]
        if not files:
            raise FileNotFoundError(f"--data {spec!r}: the glob matches no files")
        root = Path(os.path.commonpath([f.parent for f in files]))
        return root, sorted(f.relative_to(root).as_posix() for f in files)
    raise FileNotFoundError(f"--data {spec!r}: no such file or folder")


@dataclass(frozen=True)
class ScannedFile:
    """One input file: where it is, its content hash and size."""

    root: Path
    rel: str
    sha256: str
    size: int

    @property
    def path(self) -> Path:
        return self.root / self.rel


def _check_text(chunk: bytes, offset: int, decoder, path: Path, what: str) -> None:
    nul = chunk.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{what}: {path} is not text (NUL byte at offset {offset + nul}; a binary file?)")
    try:
        decoder.decode(chunk)
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{what}: {path} is not UTF-8 text (invalid byte at offset {offset + e.start})"
        ) from None


def scan_file(path: Path, what: str, *, check_text: bool) -> tuple[str, int]:
    """sha256 and size of one file, read in chunks; with ``check_text`` also validate that it is
    UTF-8 text without NUL bytes (``ValueError`` naming ``what``, the file and the offset)."""
    h = hashlib.sha256()
    size = 0
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            h.update(chunk)
            if check_text:
                _check_text(chunk, size, decoder, path, what)
            size += len(chunk)
    if check_text:
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise ValueError(f"{what}: {path} is not UTF-8 text (truncated character at its end)") from None
    return h.hexdigest(), size


def corpus_sha(entries: list[tuple[str, str, int]]) -> str:
    """sha256 over (relative path, size, content sha256) of every file, in order."""
    h = hashlib.sha256()
    for rel, sha, size in entries:
        h.update(f"{rel}\0{size}\0{sha}\n".encode())
    return h.hexdigest()
