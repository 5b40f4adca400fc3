"""The built-in corpora: the standard library's ``.py`` files (``stdlib``) and their prose (``stdlib-docs``).

* ``stdlib`` — the ``.py`` files of the Python standard library on this machine
  (``sysconfig.get_paths()["stdlib"]``, ``site-packages`` skipped). It needs no download, its file
  order is deterministic (sorted relative paths) and its sha256 is recorded in every run so that a
  number can be traced back to the exact bytes it was measured on.
* ``stdlib-docs`` — their docstrings and comments (:func:`stdlib_prose`), English prose.

Both are split by file (:func:`.files.split_files`) and tokenised in memory (tens of MB). Their
token streams are pinned (``tests/unit/training/test_builtin_pins.py``): committed results depend
on them, so **no end-of-text token** is put between their files unless asked for (``eot_id``:
``--eot on``; byte tokens then need a vocabulary of 257).
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import re
import tempfile
import tokenize
from collections.abc import Callable

import numpy as np

from .base import (
    BYTE_TOKENIZER,
    DEFAULT_VAL_FRACTION,
    STDLIB,
    STDLIB_DOCS,
    Corpus,
    callable_id,
    check_ids,
    default_cache_dir,
    token_dtype,
)
from .files import corpus_sha, split_files, stdlib_files

__all__ = ["files_corpus", "load_stdlib_corpus", "stdlib_prose"]

Encode = Callable[[str], list[int]]

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


def _tokens(
    blobs: list[bytes], idx: list[int], encode: Encode | None, vocab_size: int, eot_id: int | None
) -> np.ndarray:
    """The tokens of the files ``idx`` in order: raw bytes (no decoding) or ``encode`` of each file
    decoded as UTF-8 (undecodable bytes replaced); ``eot_id`` after each file when given."""
    dtype = token_dtype(vocab_size)
    if encode is None:
        if vocab_size < 256:
            raise ValueError(f"byte tokens need vocab_size >= 256, got {vocab_size}")
        if eot_id is None:
            return np.frombuffer(b"".join(blobs[i] for i in idx), dtype=np.uint8).astype(dtype)
    parts = []
    for i in idx:
        if encode is None:
            ids = np.frombuffer(blobs[i], dtype=np.uint8)
        else:
            ids = np.asarray(encode(blobs[i].decode("utf-8", errors="replace")), dtype=np.int64)
        parts += [ids, np.asarray([] if eot_id is None else [eot_id], dtype=np.int64)]
        check_ids(parts[-1], vocab_size)
        check_ids(ids, vocab_size)
    return np.concatenate([p.astype(dtype) for p in parts]) if parts else np.zeros(0, dtype)


def files_corpus(
    rels: list[str],
    blobs: list[bytes],
    *,
    source: str,
    encode: Encode | None,
    vocab_size: int,
    tokenizer_id: str,
    val_fraction: float,
    eot_id: int | None,
) -> Corpus:
    """A corpus of named files (``rels`` in order, their bytes ``blobs``), split by file
    (:func:`.files.split_files`); its sha256 covers every file's path, size and content."""
    entries = [(rel, hashlib.sha256(b).hexdigest(), len(b)) for rel, b in zip(rels, blobs)]
    tr, va = split_files(rels, val_fraction)
    return Corpus(
        train=_tokens(blobs, tr, encode, vocab_size, eot_id),
        val=_tokens(blobs, va, encode, vocab_size, eot_id),
        vocab_size=vocab_size,
        sha256=corpus_sha(entries),
        source=source,
        tokenizer=tokenizer_id,
        train_files=[rels[i] for i in tr],
        val_files=[rels[i] for i in va],
        eot_id=eot_id,
        documents=(len(tr), len(va)),
        format="builtin",
    )


def load_stdlib_corpus(
    *,
    encode: Encode | None = None,
    vocab_size: int = 256,
    tokenizer_id: str | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    root: str | os.PathLike | None = None,
    prose: bool = False,
    eot_id: int | None = None,
) -> Corpus:
    """The built-in corpora: this Python's standard-library ``.py`` files (``stdlib``: code) or
    their docstrings and comments (``prose=True``, ``stdlib-docs``: English, :func:`stdlib_prose`),
    split by file; files without prose are left out.

    Byte tokens are the raw bytes (no decoding); a custom ``encode`` sees each file decoded
    as UTF-8 (undecodable bytes replaced). ``eot_id`` (default none) follows each file.
    Memoised per process.
    """
    base, rels = stdlib_files(root)
    tok = tokenizer_id or (BYTE_TOKENIZER if encode is None else callable_id(encode))
    memo_key = (str(base), tok, vocab_size, val_fraction, prose, eot_id)
    if memo_key in _STDLIB_MEMO:
        return _STDLIB_MEMO[memo_key]
    blobs = [(base / rel).read_bytes() for rel in rels]
    if prose:
        blobs = _cached_prose(rels, blobs)
        rels, blobs = [r for r, b in zip(rels, blobs) if b], [b for b in blobs if b]
    if len(rels) < 2:
        raise FileNotFoundError(
            f"standard library at {base} has fewer than 2 .py files{' with prose' * prose}"
        )
    corpus = files_corpus(
        rels,
        blobs,
        source=STDLIB_DOCS if prose else STDLIB,
        encode=encode,
        vocab_size=vocab_size,
        tokenizer_id=tok,
        val_fraction=val_fraction,
        eot_id=eot_id,
    )
    _STDLIB_MEMO[memo_key] = corpus
    return corpus
