"""Sources of ``--data``: which format each input is, its content hash, and its plan of shards.

Formats (``--data-format``, by default from each file's extension or the folder's content):

* ``text`` — any other file: one document per file (UTF-8, validated).
* ``jsonl`` — ``.jsonl`` / ``.ndjson``: one document per record, its ``--text-field``.
* ``parquet`` — ``.parquet``: one document per row, its ``--text-field`` column (``[data]`` extra).
* ``datasets`` — a Hugging Face ``datasets`` folder written by ``save_to_disk`` (detected by its
  ``state.json`` / ``dataset_dict.json``), or with ``--data-format datasets`` any local path
  ``datasets.load_dataset`` reads offline: a folder of data files, or one CSV / JSON / parquet /
  text / arrow file through its packaged builder (datasets 4 runs no dataset scripts). A
  ``DatasetDict`` with ``train`` and ``validation`` splits keeps them (``[data]`` extra).
* ``tokens`` — pre-tokenized ``.bin`` (raw, ``--bin-dtype``: nanoGPT's uint16, or uint32) and
  ``.npy`` files. A folder holding ``train.bin`` and ``val.bin`` (nanoGPT's layout) keeps that
  split; otherwise the stream is split by document at ``--eot-id`` (nanoGPT's GPT-2 files end
  documents with 50256). A file's end ends a document.

Text formats may be mixed in one folder; pre-tokenized files may not be mixed with text.

A plan cuts the source into shards of about ``shard_bytes`` each (a shard is the unit of work
of one worker and of resuming): whole small files, byte ranges of large text files cut where the
cut cannot change the tokens (:func:`safe_cut`), byte ranges of JSONL at line ends, row groups
of parquet, row ranges of a dataset, token ranges cut after an end-of-text id. Planning reads
only the few bytes around each cut.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...extras import require
from .base import DataOptions
from .files import ScannedFile, corpus_sha, resolve_data_files, scan_file

__all__ = [
    "DATASET_MARKERS",
    "Shard",
    "Source",
    "line_cut",
    "open_dataset",
    "open_source",
    "plan_shards",
    "cut_in",
    "safe_cut",
    "split_pair",
    "token_file",
]

TEXT_KINDS = ("text", "jsonl", "parquet")
EXTENSIONS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".bin": "tokens",
    ".npy": "tokens",
}
DATASET_MARKERS = ("state.json", "dataset_dict.json")  # what save_to_disk writes
VAL_SPLITS = ("validation", "val", "valid", "dev")
BUILDERS = {
    ".csv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".arrow": "arrow",
}
WINDOW = 1 << 16  # bytes read around a cut
TOKEN_WINDOW = 1 << 20  # tokens read at a time when looking for an end-of-text id


@dataclass(frozen=True)
class Source:
    """A resolved ``--data``: its files (hashed), their formats and what reading them needs."""

    spec: str
    files: tuple[ScannedFile, ...]
    kinds: tuple[str, ...]  # per file: text, jsonl, parquet or tokens; "datasets" for a dataset
    sha256: str
    options: DataOptions
    dataset: tuple | None = None  # open_dataset's arguments for a datasets source
    given: dict[str, int] = field(default_factory=dict)  # tokens: file rel -> 0 (train) / 1 (val)

    @property
    def format(self) -> str:
        return "+".join(sorted(set(self.kinds)))

    @property
    def what(self) -> str:
        return f"--data {self.spec!r}"


@dataclass(frozen=True)
class Shard:
    """One unit of work: ``parts`` are read by :mod:`.readers` (their layout depends on ``kind``)."""

    index: int
    kind: str
    parts: tuple[tuple, ...]
    nbytes: int  # input bytes, for progress


# --------------------------------------------------------------------------- sources


def _kind_of(rel: str, options: DataOptions) -> str:
    if options.format != "auto":
        return options.format
    return EXTENSIONS.get(Path(rel).suffix.lower(), "text")


def _is_dataset_dir(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in DATASET_MARKERS)


def open_source(spec: str, options: DataOptions, cache_dir: Path) -> Source:
    """Resolve and hash ``--data`` (a full read of every file, validated as it goes). Raises
    ``FileNotFoundError`` / ``ValueError`` naming ``--data``."""
    what = f"--data {spec!r}"
    path = Path(spec).expanduser()
    if options.format == "datasets" or (options.format == "auto" and _is_dataset_dir(path)):
        return _dataset_source(spec, path, options, cache_dir)
    pair = split_pair(path) if options.format in ("auto", "tokens") else None
    root, rels = (path, pair) if pair else resolve_data_files(spec)
    kinds = [_kind_of(rel, options) for rel in rels]
    if "tokens" in kinds and set(kinds) != {"tokens"}:
        odd = next(r for r, k in zip(rels, kinds) if k != "tokens")
        raise ValueError(f"{what} mixes pre-tokenized .bin/.npy files with text ({odd}); give them apart")
    files, kept = [], []
    for rel, kind in zip(rels, kinds):
        sha, size = scan_file(root / rel, what, check_text=kind in ("text", "jsonl"))
        if size:
            files.append(ScannedFile(root, rel, sha, size))
            kept.append(kind)
    if not files:
        raise ValueError(f"{what} is empty (no text in {len(rels)} file{'s' * (len(rels) != 1)})")
    entries = [(f.rel, f.sha256, f.size) for f in files]
    given = _given_splits([f.rel for f in files]) if kept[0] == "tokens" else {}
    return Source(spec, tuple(files), tuple(kept), corpus_sha(entries), options, given=given)


def split_pair(path: Path) -> list[str] | None:
    """A folder's pre-tokenized ``train.bin`` and ``val.bin`` (or ``.npy``; nanoGPT's layout, its
    ``meta.pkl``, ``input.txt``... beside them are ignored), else None."""
    if not path.is_dir():
        return None
    found = [
        next((f"{s}{e}" for e in (".bin", ".npy") if (path / f"{s}{e}").is_file()), None)
        for s in ("train", "val")
    ]
    return found if all(found) else None


def _given_splits(rels: list[str]) -> dict[str, int]:
    """Pre-tokenized ``train.*`` and ``val.*`` (see :func:`split_pair`): their split; else none."""
    stems = {Path(r).stem: r for r in rels}
    if len(rels) == 2 and "train" in stems and "val" in stems:
        return {stems["train"]: 0, stems["val"]: 1}
    return {}


def _dataset_source(spec: str, path: Path, options: DataOptions, cache_dir: Path) -> Source:
    what = f"--data {spec!r}"
    if not path.exists():
        raise FileNotFoundError(f"{what}: no such file or folder")
    root, rels = resolve_data_files(spec)
    files = tuple(ScannedFile(root, rel, *scan_file(root / rel, what, check_text=False)) for rel in rels)
    how = "disk" if _is_dataset_dir(path) else "load"
    opener = (how, str(path.resolve()), str(cache_dir / "hf"))
    entries = [(f.rel, f.sha256, f.size) for f in files]
    return Source(spec, files, ("datasets",), corpus_sha(entries), options, dataset=opener)


def token_file(path: Path, bin_dtype: str, what: str) -> tuple[np.dtype, int, int]:
    """``(dtype, header bytes, tokens)`` of a ``.npy`` (its own dtype, 1-D integers) or raw ``.bin``."""
    if path.suffix.lower() == ".npy":
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise ValueError(f"{what}: {path} is not a .npy array ({exc})") from None
        if arr.ndim != 1 or arr.dtype.kind not in "ui":
            raise ValueError(
                f"{what}: {path} holds a {arr.dtype} array of shape {arr.shape}; expected 1-D integers"
            )
        return arr.dtype, int(arr.offset), int(arr.shape[0])
    dtype = np.dtype(bin_dtype)
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ValueError(
            f"{what}: {path} has {size} bytes, not a whole number of {dtype.name} tokens (--bin-dtype)"
        )
    return dtype, 0, size // dtype.itemsize


# --------------------------------------------------------------------------- cuts


_NL_CUT = re.compile(rb"[!-~]\n(?=[!-~])")  # after a newline between two printable ASCII characters
_SP_CUT = re.compile(rb"[!-~](?= [!-~])")  # before a single space between two of them


def cut_in(buf: bytes, target: int) -> int:
    """An index in ``(0, len(buf))`` near ``target`` where a long document is cut into pieces that
    are tokenised apart. Preferred: right after a newline that sits between two printable ASCII
    characters, then before a single space between two; for the regex-based byte-level BPEs
    (GPT-2's, Llama 3's pre-tokenizer) neither changes a token, since no pre-token crosses
    them. Else a UTF-8 character boundary (a line longer than the window, without spaces)."""
    lo, hi = max(0, target - WINDOW), min(len(buf), target + WINDOW)
    window = buf[lo:hi]
    for pattern, shift in ((_NL_CUT, 2), (_SP_CUT, 1)):
        cuts = [lo + m.start() + shift for m in pattern.finditer(window)]
        cuts = [c for c in cuts if 0 < c < len(buf)]
        if cuts:
            return min(cuts, key=lambda c: abs(c - target))
    pos = min(max(target, 1), len(buf) - 1)
    while pos > 1 and (buf[pos] & 0xC0) == 0x80:
        pos -= 1
    return pos


def safe_cut(f, target: int, lo: int, hi: int) -> int:
    """:func:`cut_in` on the bytes of the open file ``f`` around ``target``: an offset in ``(lo, hi)``."""
    start = max(lo, target - WINDOW)
    f.seek(start)
    buf = f.read(min(hi, target + WINDOW + 1) - start)
    return start + cut_in(buf, target - start)


def line_cut(path: Path, size: int, val_fraction: float, what: str) -> int:
    """Where a corpus of a single document is split: the line boundary nearest below
    ``(1 - val_fraction) * size`` when in its second half, else there (at a character boundary)."""
    cut = int(size * (1.0 - val_fraction))
    with open(path, "rb") as f:
        end = cut
        while end > size // 2:
            start = max(size // 2, end - (1 << 20))
            f.seek(start)
            nl = f.read(end - start).rfind(b"\n")
            if nl >= 0:
                cut = start + nl + 1
                break
            end = start
        else:
            f.seek(cut)
            while cut < size and (f.read(1)[0] & 0xC0) == 0x80:
                cut += 1
    if not 0 < cut < size:
        raise ValueError(f"{what}: too little text to split into train and validation")
    return cut


# --------------------------------------------------------------------------- plans


def plan_shards(source: Source, shard_bytes: int, val_fraction: float, eot_id: int | None) -> list[Shard]:
    """The shards of ``source`` in order (deterministic: the same source gives the same plan)."""
    if source.dataset is not None:
        return _plan_dataset(source, shard_bytes)
    if source.kinds[0] == "tokens":
        return _plan_tokens(source, shard_bytes, eot_id)
    single = len(source.files) == 1 and source.kinds[0] == "text"
    shards: list[Shard] = []
    group: list[tuple] = []
    group_bytes = 0

    def flush() -> None:
        nonlocal group, group_bytes
        if group:
            shards.append(Shard(len(shards), "records", tuple(group), group_bytes))
            group, group_bytes = [], 0

    for f, kind in zip(source.files, source.kinds):
        parts = _file_parts(f, kind, shard_bytes, val_fraction if single else None, source)
        for part, nbytes in parts:
            if group_bytes and group_bytes + nbytes > shard_bytes:
                flush()
            group.append(part)
            group_bytes += nbytes
    flush()
    return shards


def _file_parts(
    f: ScannedFile, kind: str, shard_bytes: int, line_split: float | None, source: Source
) -> list[tuple[tuple, int]]:
    """``(part, input bytes)`` of one file: parts are ``(kind, path, ...)`` tuples."""
    if kind == "parquet":
        return _parquet_parts(f, shard_bytes, source)
    key = int(f.sha256[:16], 16)
    bounds = [0, f.size]
    force = [-1]
    if line_split is not None:  # one document: split at a line, both parts forced
        bounds = [0, line_cut(f.path, f.size, line_split, source.what), f.size]
        force = [0, 1]
    out = []
    for doc, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        cuts = _cuts(f.path, lo, hi, shard_bytes, kind)
        for a, b in zip(cuts, cuts[1:]):
            if kind == "jsonl":
                out.append((("jsonl", str(f.path), a, b, f.rel), b - a))
            else:
                out.append((("text", str(f.path), a, b, key, b == hi, force[doc]), b - a))
    return out


def _cuts(path: Path, lo: int, hi: int, shard_bytes: int, kind: str) -> list[int]:
    """``lo``, the cut points of ``[lo, hi)`` every ``shard_bytes``, ``hi``: JSONL at line ends,
    text at :func:`safe_cut` points."""
    cuts = [lo]
    with open(path, "rb") as f:
        while hi - cuts[-1] > shard_bytes:
            target = cuts[-1] + shard_bytes
            if kind == "jsonl":
                f.seek(target)
                f.readline()
                nxt = min(f.tell(), hi)
            else:
                nxt = safe_cut(f, target, cuts[-1], hi)
            if nxt >= hi:
                break
            cuts.append(nxt)
    return cuts + [hi]


def _parquet_parts(f: ScannedFile, shard_bytes: int, source: Source) -> list[tuple[tuple, int]]:
    """Runs of whole row groups of about ``shard_bytes`` (uncompressed); the column is checked."""
    pq = require("pyarrow.parquet", "data", "reading parquet")
    pa = require("pyarrow", "data", "reading parquet")
    pf = pq.ParquetFile(f.path)
    name = source.options.text_field
    schema = pf.schema_arrow
    if name not in schema.names:
        raise ValueError(
            f"{source.what}: {f.rel} has no column {name!r} (columns: {', '.join(schema.names)}); "
            "pass --text-field"
        )
    kind = schema.field(name).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f"{source.what}: {f.rel}: column {name!r} holds {kind}, not strings")
    out, run, run_bytes = [], [], 0
    for g in range(pf.metadata.num_row_groups):
        nbytes = pf.metadata.row_group(g).total_byte_size
        if run and run_bytes + nbytes > shard_bytes:
            out.append((("parquet", str(f.path), tuple(run), f.rel), run_bytes))
            run, run_bytes = [], 0
        run.append(g)
        run_bytes += nbytes
    if run:
        out.append((("parquet", str(f.path), tuple(run), f.rel), run_bytes))
    return out


def open_dataset(how: str, path: str, cache_dir: str) -> Any:
    """The ``datasets`` object of a source: ``load_from_disk`` or an offline ``load_dataset``."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # local data only: never the network
        os.environ.setdefault(var, "1")
    datasets = require("datasets", "data", "reading a Hugging Face dataset")
    was_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        if how == "disk":
            return datasets.load_from_disk(path)
        builder = BUILDERS.get(Path(path).suffix.lower()) if Path(path).is_file() else None
        if builder is not None:  # one data file: its packaged builder
            return datasets.load_dataset(builder, data_files=path, cache_dir=cache_dir)
        return datasets.load_dataset(path, cache_dir=cache_dir)
    finally:
        if not was_off:
            datasets.enable_progress_bars()


def dataset_splits(obj: Any, what: str) -> list[tuple[str | None, int]]:
    """``(split name, force)`` of a dataset: a ``Dataset`` is split by document (force -1); a
    ``DatasetDict`` with ``train`` and a validation split keeps them (0, 1); one split alone, or
    ``train`` when there are others, is split by document."""
    if not hasattr(obj, "keys"):
        return [(None, -1)]
    names = list(obj.keys())
    val = next((v for v in VAL_SPLITS if v in names), None)
    if "train" in names and val:
        return [("train", 0), (val, 1)]
    if len(names) == 1:
        return [(names[0], -1)]
    if "train" in names:
        return [("train", -1)]
    raise ValueError(f"{what}: the dataset has splits {names}, none of them 'train'")


def _plan_dataset(source: Source, shard_bytes: int) -> list[Shard]:
    obj = open_dataset(*source.dataset)
    name = source.options.text_field
    shards = []
    for split, force in dataset_splits(obj, source.what):
        ds = obj if split is None else obj[split]
        if name not in ds.column_names:
            raise ValueError(
                f"{source.what}: the dataset{f' split {split!r}' if split else ''} has no field "
                f"{name!r} (fields: {', '.join(ds.column_names)}); pass --text-field"
            )
        n = len(ds)
        per_row = max(1, ds.data.nbytes // max(n, 1))
        rows = max(1, shard_bytes // per_row)
        for a in range(0, n, rows):
            b = min(n, a + rows)
            shards.append(
                Shard(len(shards), "datasets", (("datasets", split, a, b, force),), (b - a) * per_row)
            )
    return shards


def _plan_tokens(source: Source, shard_bytes: int, eot_id: int | None) -> list[Shard]:
    if not source.given and eot_id is None:
        raise ValueError(
            f"{source.what}: pre-tokenized data is split into train and validation by document; "
            "give the id its documents end with (--eot-id; nanoGPT's GPT-2 files: 50256), or a "
            "folder holding train.bin and val.bin"
        )
    shards = []
    for f in source.files:
        dtype, offset, n = token_file(f.path, source.options.bin_dtype, source.what)
        force = source.given.get(f.rel, -1)
        step = max(1, shard_bytes // dtype.itemsize)
        mm = np.memmap(f.path, dtype=dtype, mode="r", offset=offset, shape=(n,)) if n else None
        a = 0
        while a < n:
            b = min(n, a + step)
            if b < n and eot_id is not None:
                b = _after_eot(mm, b, n, eot_id)
            part = ("tokens", str(f.path), dtype.str, offset, n, a, b, force, f.rel)
            shards.append(Shard(len(shards), "tokens", (part,), (b - a) * dtype.itemsize))
            a = b
    return shards


def _after_eot(mm: np.ndarray, start: int, n: int, eot_id: int) -> int:
    """The index just past the first ``eot_id`` at or after ``start`` (``n`` when none)."""
    while start < n:
        hits = np.flatnonzero(mm[start : start + TOKEN_WINDOW] == eot_id)
        if hits.size:
            return start + int(hits[0]) + 1
        start += TOKEN_WINDOW
    return n
