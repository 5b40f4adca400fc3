"""Floor 0: writing files safely (run files, exports): atomic replacement, no symlink following, stale temp files.

Every file of a run directory (``config.json``, ``metrics.jsonl`` when rewritten,
``summary.json``, the checkpoints) is written by :func:`atomic_write`: the bytes go to a fresh
temporary file in the same folder (``tempfile.mkstemp``: ``O_CREAT | O_EXCL``, so a planted file
or symlink under that name is never opened), are fsync'ed, and ``os.replace`` moves them over the
destination, which replaces a symlink planted there instead of writing through it. A crash
leaves the old file or the new one, never half of one, plus at worst a temporary file named
``.<name>.tmp-*``: :func:`sweep_temp_files` removes those once the run's lock is held (no writer
is left to finish them). :func:`open_append` opens ``metrics.jsonl`` for its rows with
``O_NOFOLLOW``: a symlink there is an error, not a way to write outside the run directory;
:func:`read_text` reads run files the same way.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
from pathlib import Path
from typing import TextIO

__all__ = [
    "TEMP_MARK",
    "atomic_write",
    "fsync_dir",
    "open_append",
    "read_text",
    "sweep_temp_files",
    "temp_prefix",
]

TEMP_MARK = ".tmp-"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_UMASK = os.umask(0)  # read once (os.umask is the only way to read it); new files get 0o666 & ~umask
os.umask(_UMASK)


def temp_prefix(path: Path) -> str:
    """The name prefix of :func:`atomic_write`'s temporary files for ``path``."""
    return f".{path.name}{TEMP_MARK}"


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, data: bytes | str, *, keep_previous: Path | None = None) -> Path:
    """Write ``data`` to ``path`` atomically (see the module docstring); with ``keep_previous``
    the file at ``path`` is first moved there (the newest one is then always complete, the one
    before it too)."""
    path = Path(path)
    blob = data.encode() if isinstance(data, str) else data
    fd, name = tempfile.mkstemp(prefix=temp_prefix(path), dir=path.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            if hasattr(
                os, "fchmod"
            ):  # mkstemp makes 0o600; a run file is as readable as a plain open makes it
                os.fchmod(f.fileno(), 0o666 & ~_UMASK)
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous is not None and os.path.lexists(path):
            os.replace(path, keep_previous)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)
    return path


def open_append(path: str | os.PathLike) -> TextIO:
    """``path`` opened for appending text, created if missing; ``OSError`` (ELOOP) when it is a
    symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o666)
    return os.fdopen(fd, "a")


def read_text(path: str | os.PathLike) -> str:
    """The text of ``path``, not followed when it is a symlink (``OSError`` ELOOP): a run file that
    is a link was planted, and reading through it would show another file's content as the run's."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    with os.fdopen(fd, encoding="utf-8") as f:
        return f.read()


def sweep_temp_files(folder: Path, names: tuple[str, ...]) -> list[Path]:
    """Remove the temporary files :func:`atomic_write` left for the files ``names`` in ``folder``
    (a writer killed mid-write), and the temporary folders of sharded checkpoints named the same
    way; returns them. Call it only while no writer can be at work there (the run's lock is held)."""
    removed = []
    for name in names:
        for p in folder.glob(f"{glob.escape(temp_prefix(Path(name)))}*"):
            with contextlib.suppress(FileNotFoundError):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
                removed.append(p)
    return removed
