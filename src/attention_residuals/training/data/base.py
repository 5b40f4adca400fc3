"""What every part of the data package shares: names, byte tokens, the token dtype, :class:`Corpus`.

Floor 0 of :mod:`attention_residuals.training.data`: imports nothing of the project.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "BLOCK_TOKENS",
    "BUILTIN_CORPORA",
    "BYTE_EOT",
    "BYTE_TOKENIZER",
    "DATA_FORMATS",
    "DEFAULT_VAL_FRACTION",
    "EOT_MODES",
    "EOT_TEXT",
    "PRETOKENIZED",
    "STDLIB",
    "STDLIB_DOCS",
    "SHAKESPEARE",
    "SOTU",
    "TOKEN_DTYPES",
    "Corpus",
    "DataOptions",
    "block_hashes",
    "builtin_name",
    "byte_decode",
    "byte_encode",
    "check_ids",
    "default_cache_dir",
    "stream_digest",
    "token_dtype",
]

BYTE_TOKENIZER = "bytes"
PRETOKENIZED = "pretokenized"  # the tokenizer id of pre-tokenized data read without --tokenizer
BYTE_EOT = 256  # the end-of-text id of byte tokens: reserved past the 256 byte values (vocab 257)
EOT_TEXT = "<|endoftext|>"  # how byte_decode shows it (as the BPE tokenizers name it)
DEFAULT_VAL_FRACTION = 0.05
STDLIB = "stdlib"
STDLIB_DOCS = "stdlib-docs"
SHAKESPEARE = "shakespeare"  # the packaged corpora (:mod:`.packaged`): fetched once, then read as built-in
SOTU = "sotu"
BUILTIN_CORPORA = (STDLIB, STDLIB_DOCS, SHAKESPEARE, SOTU)
DATA_FORMATS = ("auto", "text", "jsonl", "parquet", "datasets", "tokens")
EOT_MODES = ("auto", "on", "off")
TOKEN_DTYPES = ("uint16", "uint32")  # of a raw pre-tokenized .bin (nanoGPT writes uint16)
BLOCK_TOKENS = 1 << 22  # tokens per verified block of a token file (4 Mi: a few ms of sha256)


def byte_encode(text: str) -> list[int]:
    """The default tokenizer: UTF-8 bytes, vocab 256."""
    return list(text.encode("utf-8"))


def byte_decode(tokens: Iterable[int]) -> str:
    """Inverse of :func:`byte_encode`; invalid UTF-8 (a sample cut mid-character) is replaced and
    the end-of-text id (256, byte tokens with ``eot``) reads as ``<|endoftext|>``."""
    out, run = [], bytearray()
    for t in tokens:
        t = int(t)
        if t < 256:
            run.append(t)
            continue
        out += [run.decode("utf-8", errors="replace"), EOT_TEXT]
        run = bytearray()
    out.append(run.decode("utf-8", errors="replace"))
    return "".join(out)


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


def check_ids(arr: np.ndarray, vocab_size: int) -> None:
    """``ValueError`` when a token id falls outside ``[0, vocab_size)``."""
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"the tokenizer produced id {bad}, outside [0, vocab_size={vocab_size})")


def default_cache_dir() -> Path:
    """``$ATTNRES_CACHE`` or ``~/.cache/attention_residuals``."""
    env = os.environ.get("ATTNRES_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "attention_residuals"


def builtin_name(data: str | os.PathLike | None) -> str | None:
    """The built-in corpus ``data`` names, else None. ``None`` is ``stdlib``; so is a recorded absolute
    path ending in a built-in name that does not exist (older runs recorded ``--data stdlib-docs``
    resolved against their working directory)."""
    if data is None:
        return STDLIB
    spec = os.fspath(data)
    if spec in BUILTIN_CORPORA:
        return spec
    path = Path(spec)
    if path.is_absolute() and path.name in BUILTIN_CORPORA and not path.exists():
        return path.name
    return None


def block_hashes(tokens: np.ndarray, block: int = BLOCK_TOKENS) -> list[str]:
    """sha256 of each run of ``block`` tokens (the last one shorter): what a token cache verifies."""
    return [
        hashlib.sha256(np.ascontiguousarray(tokens[i : i + block]).tobytes()).hexdigest()
        for i in range(0, len(tokens), block)
    ]


def stream_digest(train_blocks: list[str], val_blocks: list[str], dtype: np.dtype | str) -> str:
    """One sha256 for the token streams of both splits, from their block hashes."""
    blob = json.dumps({"dtype": np.dtype(dtype).name, "train": train_blocks, "val": val_blocks})
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class DataOptions:
    """How ``--data`` is read: its format, the record field holding text, end-of-text tokens, the
    dtype of raw token files. The defaults read every format by its extension."""

    format: str = "auto"  # DATA_FORMATS: auto = by extension / folder content
    text_field: str = "text"  # the text of a JSONL / parquet / datasets record
    eot: str = "auto"  # EOT_MODES: auto = after each document of --data, none in the built-in corpora
    eot_id: int | None = None  # default: the tokenizer's end-of-text id (256 for bytes)
    bin_dtype: str = "uint16"  # TOKEN_DTYPES: of raw .bin token files

    def validate(self) -> DataOptions:
        """``ValueError`` naming the option."""
        checks = (
            ("data_format", self.format, DATA_FORMATS),
            ("eot", self.eot, EOT_MODES),
            ("bin_dtype", self.bin_dtype, TOKEN_DTYPES),
        )
        for name, value, allowed in checks:
            if value not in allowed:
                raise ValueError(f"{name}: expected one of {', '.join(allowed)}, got {value!r}")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ValueError(f"text_field: expected a field name, got {self.text_field!r}")
        if self.eot_id is not None and (isinstance(self.eot_id, bool) or self.eot_id < 0):
            raise ValueError(f"eot_id: expected a non-negative token id, got {self.eot_id!r}")
        return self


@dataclass
class Corpus:
    """Token arrays of the two splits plus the provenance recorded in a run's ``config.json``."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int = 256
    sha256: str = ""  # of the source's content (files, their sizes and paths)
    source: str = STDLIB
    tokenizer: str = BYTE_TOKENIZER
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    cached: bool = False  # True when the tokens came from a token cache already there
    eot_id: int | None = None  # the id after each document (None: no end-of-text tokens)
    documents: tuple[int | None, int | None] = (None, None)  # of (train, val), when known
    tokens_sha256: str | None = None  # stream_digest of the two splits (see :meth:`digest`)
    format: str = "text"

    def digest(self) -> str:
        """:func:`stream_digest` of the splits (computed once; a prepared cache has it already)."""
        if self.tokens_sha256 is None:
            self.tokens_sha256 = stream_digest(
                block_hashes(self.train), block_hashes(self.val), self.train.dtype
            )
        return self.tokens_sha256

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
            "format": self.format,
            "eot_id": self.eot_id,
            "train_documents": self.documents[0],
            "val_documents": self.documents[1],
            "tokens_sha256": self.digest(),
        }

    @classmethod
    def from_text(
        cls,
        text: str,
        *,
        val_fraction: float = 0.1,
        encode=None,
        vocab_size: int = 256,
        source: str = "text",
    ) -> Corpus:
        """An in-memory corpus from one string (tests, notebooks): split at a line boundary."""
        train_text, val_text = split_text(text, val_fraction, source)
        enc = encode or byte_encode
        dtype = token_dtype(vocab_size)
        return cls(
            train=np.asarray(enc(train_text), dtype=dtype),
            val=np.asarray(enc(val_text), dtype=dtype),
            vocab_size=vocab_size,
            sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
            source=source,
            tokenizer=BYTE_TOKENIZER if encode is None else callable_id(encode),
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


def callable_id(encode) -> str:
    """A tokenizer id for a plain ``encode`` function: its qualified name."""
    mod = getattr(encode, "__module__", "") or ""
    name = getattr(encode, "__qualname__", None) or type(encode).__qualname__
    return f"{mod}.{name}"


def split_text(text: str, val_fraction: float, what: str) -> tuple[str, str]:
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
