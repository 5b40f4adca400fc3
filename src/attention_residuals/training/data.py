"""Training data: the built-in standard-library corpus, ``--data PATH`` corpora, deterministic batches.

Two sources of text:

* the **default corpus** — the ``.py`` files of the Python standard library on this machine
  (``sysconfig.get_paths()["stdlib"]``, ``site-packages`` skipped). It needs no download, its file
  order is deterministic (sorted relative paths) and its sha256 is recorded in every run so that a
  number can be traced back to the exact bytes it was measured on.
* ``--data PATH`` — a text file, a folder (every non-hidden file below it) or a glob. The files are
  validated (exist, non-empty, UTF-8 text), read through the Hugging Face ``datasets`` "text"
  builder (offline, local files), tokenised and cached as memory-mapped token files keyed by the
  sha256 of the inputs and of the tokenizer, so a second run starts instantly.

Train and validation are split **by file** (a validation file never leaks into training): the
``val_fraction`` of files whose path hash is smallest form the validation split — deterministic and
stable when files are added. A single-file corpus is split at the line boundary nearest to
``1 - val_fraction`` of its length.

Tokens are bytes (vocab 256) by default; ``encode: Callable[[str], list[int]]`` plugs in any other
tokenizer (give it a ``tokenizer_id`` so its token cache is not confused with another's).

Batches are a pure function of ``(seed, step, rank, world_size)``: resuming at step ``s`` sees
exactly the batches an uninterrupted run would, and a data-parallel rank reads its own slice of
the global batch (the union over ranks is the same whatever the world size).
"""

from __future__ import annotations

import ast
import codecs
import glob as globlib
import hashlib
import io
import json
import os
import re
import shutil
import sysconfig
import tempfile
import tokenize
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "BUILTIN_CORPORA",
    "BYTE_TOKENIZER",
    "Corpus",
    "byte_decode",
    "byte_encode",
    "default_cache_dir",
    "eval_batches",
    "get_batch",
    "load_corpus",
    "load_stdlib_corpus",
    "resolve_data_files",
    "split_files",
    "stdlib_files",
    "stdlib_prose",
    "token_dtype",
]

BYTE_TOKENIZER = "bytes"
DEFAULT_VAL_FRACTION = 0.05
STDLIB = "stdlib"
STDLIB_DOCS = "stdlib-docs"
BUILTIN_CORPORA = (STDLIB, STDLIB_DOCS)
_CACHE_FORMAT = 1  # bump when the token-cache layout changes
_CHUNK = 1 << 20
TRAIN_STREAM, VAL_STREAM = 0, 1
EVAL_SEED = 0  # validation windows are the same for every run, whatever its training seed

Encode = Callable[[str], list[int]]


def byte_encode(text: str) -> list[int]:
    """The default tokenizer: UTF-8 bytes, vocab 256."""
    return list(text.encode("utf-8"))


def byte_decode(tokens: Iterable[int]) -> str:
    """Inverse of :func:`byte_encode`; invalid UTF-8 (a sample cut mid-character) is replaced."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding ids ``< vocab_size``: uint8, uint16 or uint32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32")


def default_cache_dir() -> Path:
    """``$ATTNRES_CACHE`` or ``~/.cache/attention_residuals``."""
    env = os.environ.get("ATTNRES_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "attention_residuals"


@dataclass
class Corpus:
    """Token arrays of the two splits plus the provenance recorded in a run's ``config.json``."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int = 256
    sha256: str = ""
    source: str = STDLIB
    tokenizer: str = BYTE_TOKENIZER
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    cached: bool = False  # True when the tokens came from the memory-mapped cache

    def info(self) -> dict:
        """JSON-able summary (no file lists: the sha256 pins them)."""
        return {
            "source": self.source,
            "sha256": self.sha256,
            "tokenizer": self.tokenizer,
            "vocab_size": self.vocab_size,
            "train_tokens": int(len(self.train)),
            "val_tokens": int(len(self.val)),
            "train_files": len(self.train_files),
            "val_files": len(self.val_files),
        }

    @classmethod
    def from_text(
        cls,
        text: str,
        *,
        val_fraction: float = 0.1,
        encode: Encode | None = None,
        vocab_size: int = 256,
        source: str = "text",
    ) -> Corpus:
        """An in-memory corpus from one string (tests, notebooks): split at a line boundary."""
        train_text, val_text = _split_text(text, val_fraction, source)
        enc = encode or byte_encode
        dtype = token_dtype(vocab_size)
        return cls(
            train=np.asarray(enc(train_text), dtype=dtype),
            val=np.asarray(enc(val_text), dtype=dtype),
            vocab_size=vocab_size,
            sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
            source=source,
            tokenizer=BYTE_TOKENIZER if encode is None else _tokenizer_id(encode, None),
            train_files=[source],
            val_files=[source],
        )

    def check_fits(self, seq_len: int, what: str = "--data") -> None:
        """Raise ``ValueError`` when a split is too short for one ``seq_len`` window."""
        for name, arr in (("train", self.train), ("val", self.val)):
            if len(arr) < seq_len + 1:
                raise ValueError(
                    f"{what} {self.source!r}: the {name} split has {len(arr)} tokens, fewer than "
                    f"seq_len + 1 = {seq_len + 1}; give more text or a shorter --seq-len"
                )


# --------------------------------------------------------------------------- file selection


def _path_rank(rel: str) -> str:
    return hashlib.sha256(rel.encode("utf-8")).hexdigest()


def split_files(
    rel_paths: list[str], val_fraction: float = DEFAULT_VAL_FRACTION
) -> tuple[list[int], list[int]]:
    """Indices of the train and validation files, split by file.

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


def _scan_file(path: Path, what: str, *, check_text: bool) -> tuple[str, int]:
    """sha256 and size of one file; with ``check_text`` also validate it is UTF-8 text."""
    h = hashlib.sha256()
    size = 0
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if check_text:
                nul = chunk.find(b"\0")
                if nul >= 0:
                    raise ValueError(
                        f"{what}: {path} is not text (NUL byte at offset {size + nul}; a binary file?)"
                    )
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as e:
                    raise ValueError(
                        f"{what}: {path} is not UTF-8 text (invalid byte at offset {size + e.start})"
                    ) from None
            size += len(chunk)
    if check_text:
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise ValueError(f"{what}: {path} is not UTF-8 text (truncated character at its end)") from None
    return h.hexdigest(), size


def _corpus_sha(entries: list[tuple[str, str, int]]) -> str:
    """sha256 over (relative path, size, content sha256) of every file, in order."""
    h = hashlib.sha256()
    for rel, sha, size in entries:
        h.update(f"{rel}\0{size}\0{sha}\n".encode())
    return h.hexdigest()


def _tokenizer_id(encode: Encode | None, tokenizer_id: str | None) -> str:
    if tokenizer_id:
        return tokenizer_id
    if encode is None:
        return BYTE_TOKENIZER
    mod = getattr(encode, "__module__", "") or ""
    name = getattr(encode, "__qualname__", None) or type(encode).__qualname__
    return f"{mod}.{name}"


def _split_text(text: str, val_fraction: float, what: str) -> tuple[str, str]:
    """Split one document at the line boundary nearest below ``(1 - val_fraction) * len``."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(len(text) * (1.0 - val_fraction))
    nl = text.rfind("\n", 0, cut)
    if nl >= 0 and nl + 1 >= len(text) // 2:
        cut = nl + 1
    train, val = text[:cut], text[cut:]
    if not train or not val:
        raise ValueError(f"{what}: too little text to split into train and validation")
    return train, val


# --------------------------------------------------------------------------- token cache


def _check_ids(arr: np.ndarray, vocab_size: int) -> None:
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"the tokenizer produced id {bad}, outside [0, vocab_size={vocab_size})")


def _write_tokens(
    path: Path, chunks: Iterable[Iterable[int] | bytes], dtype: np.dtype, vocab_size: int
) -> int:
    n = 0
    with open(path, "wb") as f:
        for chunk in chunks:
            if isinstance(chunk, bytes | bytearray):
                arr = np.frombuffer(chunk, dtype=np.uint8)
            else:
                arr = np.asarray(
                    chunk if isinstance(chunk, list | np.ndarray) else list(chunk), dtype=np.int64
                )
                _check_ids(arr, vocab_size)
            arr.astype(dtype, copy=False).tofile(f)
            n += arr.size
        f.flush()
        os.fsync(f.fileno())
    return n


def _open_tokens(path: Path, dtype: np.dtype, n: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,))


def _load_cached(entry: Path) -> tuple[np.ndarray, np.ndarray, dict] | None:
    meta_path = entry / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        dtype = np.dtype(meta["dtype"])
        train_n, val_n = int(meta["train_tokens"]), int(meta["val_tokens"])
        for name, n in (("train.bin", train_n), ("val.bin", val_n)):
            if (entry / name).stat().st_size != n * dtype.itemsize:
                return None
        return (
            _open_tokens(entry / "train.bin", dtype, train_n),
            _open_tokens(entry / "val.bin", dtype, val_n),
            meta,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _datasets_rows(files: list[Path], cache_dir: Path) -> Iterator[str]:
    """Each file's text as one row, through the Hugging Face ``datasets`` "text" builder."""
    import datasets  # local: slow to import, needed only to tokenize a --data corpus not cached yet

    bars_were_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(
            "text",
            data_files={"train": [str(f) for f in files]},
            split="train",
            sample_by="document",
            keep_linebreaks=True,
            cache_dir=str(cache_dir / "hf"),
        )
    finally:
        if not bars_were_off:
            datasets.enable_progress_bars()
    if len(ds) != len(files):  # one row per file is what splitting by file relies on
        raise RuntimeError(f"datasets returned {len(ds)} documents for {len(files)} files")
    for row in ds:
        yield row["text"]


def _tokenize_docs(docs: Iterable[str], encode: Encode | None) -> Iterator[list[int] | bytes]:
    for text in docs:
        yield text.encode("utf-8") if encode is None else encode(text)


def load_corpus(
    data: str | os.PathLike | None = None,
    *,
    encode: Encode | None = None,
    vocab_size: int = 256,
    tokenizer_id: str | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    cache_dir: str | os.PathLike | None = None,
) -> Corpus:
    """Load (and cache) a corpus. ``data=None`` is the standard-library corpus.

    Errors name ``--data``: ``FileNotFoundError`` for a missing path, ``ValueError`` for an empty
    file/folder or a file that is not UTF-8 text.
    """
    if data is None or os.fspath(data) in BUILTIN_CORPORA:
        return load_stdlib_corpus(
            encode=encode,
            vocab_size=vocab_size,
            tokenizer_id=tokenizer_id,
            val_fraction=val_fraction,
            prose=data is not None and os.fspath(data) == STDLIB_DOCS,
        )
    spec = os.fspath(data)
    what = f"--data {spec!r}"
    if encode is None and vocab_size < 256:
        raise ValueError(f"byte tokens need vocab_size >= 256, got {vocab_size}")
    root, rels = resolve_data_files(spec)
    entries = []
    for rel in rels:
        sha, size = _scan_file(root / rel, what, check_text=True)
        if size:
            entries.append((rel, sha, size))
    if not entries:
        raise ValueError(f"{what} is empty (no text in {len(rels)} file{'s' * (len(rels) != 1)})")
    tok = _tokenizer_id(encode, tokenizer_id)
    corpus_sha = _corpus_sha(entries)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    key = hashlib.sha256(
        json.dumps(
            {
                "corpus": corpus_sha,
                "tokenizer": tok,
                "vocab": vocab_size,
                "val": val_fraction,
                "fmt": _CACHE_FORMAT,
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()
    entry = cache / "tokens" / key[:24]
    files = [rel for rel, _, _ in entries]
    hit = _load_cached(entry)
    if hit is not None:
        train, val, meta = hit
        return Corpus(
            train, val, vocab_size, corpus_sha, spec, tok, meta["train_files"], meta["val_files"], True
        )

    dtype = token_dtype(vocab_size)
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "tokens").mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key[:24]}-", dir=cache / "tokens"))
    try:
        paths = [root / rel for rel in files]
        if len(files) == 1:
            (text,) = list(_datasets_rows(paths, cache))
            train_text, val_text = _split_text(text, val_fraction, what)
            train_files, val_files = files, files
            train_n = _write_tokens(
                tmp / "train.bin", _tokenize_docs([train_text], encode), dtype, vocab_size
            )
            val_n = _write_tokens(tmp / "val.bin", _tokenize_docs([val_text], encode), dtype, vocab_size)
        else:
            tr, va = split_files(files, val_fraction)
            train_files, val_files = [files[i] for i in tr], [files[i] for i in va]
            train_n = _write_tokens(
                tmp / "train.bin",
                _tokenize_docs(_datasets_rows([paths[i] for i in tr], cache), encode),
                dtype,
                vocab_size,
            )
            val_n = _write_tokens(
                tmp / "val.bin",
                _tokenize_docs(_datasets_rows([paths[i] for i in va], cache), encode),
                dtype,
                vocab_size,
            )
        meta = {
            "source": spec,
            "sha256": corpus_sha,
            "tokenizer": tok,
            "vocab_size": vocab_size,
            "dtype": dtype.name,
            "train_tokens": train_n,
            "val_tokens": val_n,
            "val_fraction": val_fraction,
            "train_files": train_files,
            "val_files": val_files,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if entry.exists():  # a stale or concurrent entry: replace it
            shutil.rmtree(entry, ignore_errors=True)
        try:
            os.replace(tmp, entry)
        except OSError:  # another process won the race; use its entry
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    hit = _load_cached(entry)
    if hit is None:
        raise RuntimeError(f"token cache {entry} unreadable right after writing it")
    train, val, meta = hit
    return Corpus(
        train, val, vocab_size, corpus_sha, spec, tok, meta["train_files"], meta["val_files"], False
    )


_STDLIB_MEMO: dict[tuple, Corpus] = {}
_PRAGMA = re.compile(r"^(-\*-|!|noqa|type:|pragma|fmt:|pylint|isort)", re.IGNORECASE)


def _doctest_free(text: str) -> str:
    """``text`` without its doctest paragraphs (a blank-line separated paragraph holding ``>>>``)."""
    paragraphs = re.split(r"\n\s*\n", text)
    return "\n\n".join(p for p in paragraphs if ">>>" not in p).strip()


def stdlib_prose(source: bytes) -> bytes:
    """The English of one Python file: its docstrings (module, class, function; ``ast``, cleaned,
    doctest paragraphs dropped) then its comments (``tokenize``; consecutive comment lines joined
    into one paragraph; pragmas, coding lines and lines without a letter dropped), as UTF-8.

    A file that does not parse gives ``b""``. Why this corpus: natural language that every Python
    installation carries (no download), deterministic for a given Python version, and written by
    many hands about many subjects — the prose counterpart of the code corpus."""
    try:
        tree = ast.parse(source)
        toks = list(tokenize.tokenize(io.BytesIO(source).readline))
    except (SyntaxError, ValueError, tokenize.TokenError, UnicodeDecodeError):
        return b""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=True)
            doc = _doctest_free(doc) if doc else ""
            if doc:
                parts.append(doc)
    paragraph: list[str] = []
    last_row = -2
    for tok in toks:
        if tok.type != tokenize.COMMENT:
            continue
        text = tok.string.lstrip("#").strip()
        if not re.search(r"[A-Za-z]", text) or _PRAGMA.match(text):
            continue
        if tok.start[0] != last_row + 1 and paragraph:
            parts.append(" ".join(paragraph))
            paragraph = []
        paragraph.append(text)
        last_row = tok.start[0]
    if paragraph:
        parts.append(" ".join(paragraph))
    return ("\n\n".join(parts) + "\n").encode("utf-8") if parts else b""


_PROSE_FORMAT = 1  # bump when stdlib_prose changes what it extracts


def _cached_prose(rels: list[str], sources: list[bytes]) -> list[bytes]:
    """:func:`stdlib_prose` of every file, cached under the token cache keyed by the sources' hash
    (extracting takes tens of seconds; the cache is written atomically and re-extracted if unreadable)."""
    key = hashlib.sha256(f"prose{_PROSE_FORMAT}".encode())
    for rel, src in zip(rels, sources):
        key.update(f"{rel}\0{hashlib.sha256(src).hexdigest()}\n".encode())
    path = default_cache_dir() / "prose" / f"{key.hexdigest()[:24]}.json"
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))
        if len(cached) == len(rels):
            return [c.encode("utf-8") for c in cached]
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    out = [stdlib_prose(src) for src in sources]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".prose-", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump([b.decode("utf-8") for b in out], f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return out


def load_stdlib_corpus(
    *,
    encode: Encode | None = None,
    vocab_size: int = 256,
    tokenizer_id: str | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    root: str | os.PathLike | None = None,
    prose: bool = False,
) -> Corpus:
    """The built-in corpora: this Python's standard-library ``.py`` files (``stdlib``: code) or
    their docstrings and comments (``prose=True``, ``stdlib-docs``: English, :func:`stdlib_prose`),
    split by file; files without prose are left out.

    Byte tokens are the raw bytes (no decoding); a custom ``encode`` sees each file decoded
    as UTF-8 (undecodable bytes replaced). Memoised per process.
    """
    base, rels = stdlib_files(root)
    tok = _tokenizer_id(encode, tokenizer_id)
    memo_key = (str(base), tok, vocab_size, val_fraction, prose)
    if memo_key in _STDLIB_MEMO:
        return _STDLIB_MEMO[memo_key]
    blobs = [(base / rel).read_bytes() for rel in rels]
    if prose:
        blobs = _cached_prose(rels, blobs)
        rels, blobs = [r for r, b in zip(rels, blobs) if b], [b for b in blobs if b]
    entries = [(rel, hashlib.sha256(b).hexdigest(), len(b)) for rel, b in zip(rels, blobs)]
    if len(rels) < 2:
        raise FileNotFoundError(
            f"standard library at {base} has fewer than 2 .py files{' with prose' * prose}"
        )
    tr, va = split_files(rels, val_fraction)
    dtype = token_dtype(vocab_size)

    def tokens(idx: list[int]) -> np.ndarray:
        if encode is None:
            if vocab_size < 256:
                raise ValueError(f"byte tokens need vocab_size >= 256, got {vocab_size}")
            return np.frombuffer(b"".join(blobs[i] for i in idx), dtype=np.uint8).astype(dtype)
        out = []
        for i in idx:
            out.extend(encode(blobs[i].decode("utf-8", errors="replace")))
        arr = np.asarray(out, dtype=np.int64)
        _check_ids(arr, vocab_size)
        return arr.astype(dtype)

    corpus = Corpus(
        train=tokens(tr),
        val=tokens(va),
        vocab_size=vocab_size,
        sha256=_corpus_sha(entries),
        source=STDLIB_DOCS if prose else STDLIB,
        tokenizer=tok,
        train_files=[rels[i] for i in tr],
        val_files=[rels[i] for i in va],
    )
    _STDLIB_MEMO[memo_key] = corpus
    return corpus


# --------------------------------------------------------------------------- batches


def get_batch(
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    *,
    seed: int,
    step: int,
    rank: int = 0,
    world_size: int = 1,
    stream: int = TRAIN_STREAM,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, each ``[batch_size, seq_len]`` int64.

    The global batch of ``batch_size * world_size`` windows is drawn from a generator seeded by
    ``(seed, step, stream)`` alone; ``rank`` takes rows ``[rank * batch_size, (rank + 1) * batch_size)``.
    So a batch is the same on resume, and the data-parallel union is independent of ``world_size``.
    """
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if min(seed, step, stream) < 0:
        raise ValueError(f"seed, step and stream must be non-negative, got {seed}, {step}, {stream}")
    n = len(tokens)
    if n < seq_len + 1:
        raise ValueError(f"{n} tokens are fewer than seq_len + 1 = {seq_len + 1}")
    rng = np.random.default_rng([seed, step, stream])
    starts = rng.integers(0, n - seq_len, size=batch_size * world_size)[
        rank * batch_size : (rank + 1) * batch_size
    ]
    window = starts[:, None] + np.arange(seq_len + 1)[None, :]
    chunk = torch.from_numpy(np.asarray(tokens[window], dtype=np.int64))
    x, y = chunk[:, :-1], chunk[:, 1:]
    if device is not None and torch.device(device).type != "cpu":
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return x.contiguous(), y.contiguous()


def eval_batches(
    tokens: np.ndarray,
    n_batches: int,
    batch_size: int,
    seq_len: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation windows: the same for every run and seed, so val losses compare."""
    for i in range(n_batches):
        yield get_batch(
            tokens,
            batch_size,
            seq_len,
            seed=EVAL_SEED,
            step=i,
            rank=rank,
            world_size=world_size,
            stream=VAL_STREAM,
            device=device,
        )
