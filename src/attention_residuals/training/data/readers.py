"""A shard's work, in a worker process (or the main one): read its documents, tokenise them in
batches, write the shard's token file and its index.

Documents are read as *pieces* of at most ``piece_bytes`` (a longer document is cut where the cut
cannot change its tokens, :func:`.sources.cut_in`) and handed to the tokenizer's batch encoder
``batch_bytes`` at a time, so a worker's memory is bounded by the shard's input, one batch and the
tokenizer's working memory for it — whatever the size of the corpus or of one document. The
end-of-text id follows the last piece of each document.

A shard's outputs (``shard-NNNNNN.tok``, ``.idx.npy``, then ``.json``, each written atomically)
are what a rerun finds: a shard whose ``.json`` is there and whose files match it is not redone.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import resource
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...extras import require
from .base import check_ids
from .encoders import BatchEncode, Encoder
from .sources import Shard, cut_in, open_dataset

__all__ = ["INDEX_DTYPE", "WorkContext", "encode_shard", "peak_rss_bytes", "shard_paths", "write_atomic"]

# one row per piece: the document's key (split rank), its tokens here, whether the document ends
# here, and its forced split (-1: by key, 0: train, 1: val)
INDEX_DTYPE = np.dtype([("key", "<u8"), ("ntok", "<i8"), ("last", "?"), ("force", "i1")])
ROWS_PER_READ = 1024  # dataset / parquet rows read at a time


@dataclass(frozen=True)
class WorkContext:
    """Everything a worker needs besides its shard (picklable)."""

    encoder: Encoder
    text_field: str
    eot_id: int | None  # put after each document of text (None: none)
    vocab_size: int  # every id must be below it
    dtype: str  # of the token files
    what: str  # "--data '...'" for messages
    dataset: tuple | None = None
    piece_bytes: int = 1 << 16
    batch_bytes: int = 1 << 20


_CACHE: dict = {}  # per process: the batch encoder and the opened dataset


def _batch_encoder(ctx: WorkContext) -> BatchEncode:
    key = ("encoder", ctx.encoder.id)
    if key not in _CACHE:
        _CACHE[key] = ctx.encoder.factory()
    return _CACHE[key]


def _dataset(ctx: WorkContext):
    key = ("dataset", ctx.dataset)
    if key not in _CACHE:
        _CACHE[key] = open_dataset(*ctx.dataset)
    return _CACHE[key]


def doc_key(text: str) -> int:
    """The split rank of a document: the first 8 bytes of the sha256 of its UTF-8 text (a text
    file's is its content hash: the same document gets the same key in every format)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


# --------------------------------------------------------------------------- pieces


def _cut_bytes(blob: bytes, piece_bytes: int) -> Iterator[bytes]:
    start = 0
    while len(blob) - start > piece_bytes:
        cut = start + cut_in(blob[start : start + 2 * piece_bytes], piece_bytes)
        yield blob[start:cut]
        start = cut
    yield blob[start:]


def _doc_pieces(text: str, key: int, force: int, ctx: WorkContext, last: bool = True) -> Iterator[tuple]:
    """``(text, key, last, force)`` pieces of one document (one piece unless it is long)."""
    if len(text) <= ctx.piece_bytes // 4:  # surely within piece_bytes of UTF-8
        yield text, key, last, force
        return
    pieces = list(_cut_bytes(text.encode("utf-8"), ctx.piece_bytes))
    for i, piece in enumerate(pieces):
        yield piece.decode("utf-8"), key, last and i == len(pieces) - 1, force


def _text_pieces(part: tuple, ctx: WorkContext) -> Iterator[tuple]:
    _, path, a, b, key, last, force = part
    with open(path, "rb") as f:
        f.seek(a)
        blob = f.read(b - a)
    pieces = list(_cut_bytes(blob, ctx.piece_bytes))
    for i, piece in enumerate(pieces):
        yield piece.decode("utf-8"), key, last and i == len(pieces) - 1, force


def _record_text(value, where: str, ctx: WorkContext) -> str:
    if not isinstance(value, str):
        got = "null" if value is None else type(value).__name__
        raise ValueError(f"{ctx.what}: {where}: field {ctx.text_field!r} is {got}, not a string")
    return value


def _jsonl_pieces(part: tuple, ctx: WorkContext) -> Iterator[tuple]:
    _, path, a, b, rel = part
    with open(path, "rb") as f:
        f.seek(a)
        blob = f.read(b - a)
    offset = a
    for line in blob.split(b"\n"):
        where, offset = f"{rel}, the record at byte {offset}", offset + len(line) + 1
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{ctx.what}: {where} is not JSON ({exc})") from None
        if not isinstance(record, dict) or ctx.text_field not in record:
            fields = ", ".join(record) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
            raise ValueError(
                f"{ctx.what}: {where} has no field {ctx.text_field!r} ({fields}); pass --text-field"
            )
        text = _record_text(record[ctx.text_field], where, ctx)
        if text:
            yield from _doc_pieces(text, doc_key(text), -1, ctx)


def _parquet_pieces(part: tuple, ctx: WorkContext) -> Iterator[tuple]:
    _, path, groups, rel = part
    pq = require("pyarrow.parquet", "data", "reading parquet")
    pf = pq.ParquetFile(path)
    row = sum(pf.metadata.row_group(g).num_rows for g in range(groups[0]))
    for batch in pf.iter_batches(batch_size=ROWS_PER_READ, row_groups=list(groups), columns=[ctx.text_field]):
        for value in batch.column(0).to_pylist():
            text = _record_text(value, f"{rel}, row {row}", ctx)
            row += 1
            if text:
                yield from _doc_pieces(text, doc_key(text), -1, ctx)


def _dataset_pieces(part: tuple, ctx: WorkContext) -> Iterator[tuple]:
    _, split, a, b, force = part
    obj = _dataset(ctx)
    ds = (obj if split is None else obj[split]).select_columns([ctx.text_field])
    for lo in range(a, b, ROWS_PER_READ):
        hi = min(b, lo + ROWS_PER_READ)
        for row, value in enumerate(ds[lo:hi][ctx.text_field], start=lo):
            text = _record_text(value, f"{split or 'the dataset'}, row {row}", ctx)
            if text:
                yield from _doc_pieces(text, doc_key(text), force, ctx)


def _token_pieces(part: tuple, ctx: WorkContext) -> Iterator[tuple]:
    """The documents of a pre-tokenized range (cut after each ``eot_id``), as token arrays."""
    _, path, dtype, offset, n, a, b, force, rel = part
    tokens = np.array(np.memmap(path, dtype=np.dtype(dtype), mode="r", offset=offset, shape=(n,))[a:b])
    if tokens.size and int(tokens.max()) >= ctx.vocab_size:
        raise ValueError(
            f"{ctx.what}: {rel} holds token id {int(tokens.max())}, outside the vocabulary "
            f"[0, {ctx.vocab_size}); give --vocab-size {int(tokens.max()) + 1} or more"
        )
    ends = [] if ctx.eot_id is None else (np.flatnonzero(tokens == ctx.eot_id) + 1).tolist()
    if not ends or ends[-1] != len(tokens):
        ends.append(len(tokens))  # the range's end ends a document (a file's end, or no EOT known)
    start = 0
    for end in ends:
        doc = tokens[start:end]
        key = int.from_bytes(hashlib.sha256(doc.astype("<u4").tobytes()).digest()[:8], "big")
        yield doc, key, True, force
        start = end


READERS = {
    "text": _text_pieces,
    "jsonl": _jsonl_pieces,
    "parquet": _parquet_pieces,
    "datasets": _dataset_pieces,
    "tokens": _token_pieces,
}


# --------------------------------------------------------------------------- a shard


def shard_paths(work: Path, index: int) -> tuple[Path, Path, Path]:
    """``(tokens, index, done record)`` of shard ``index`` in the work folder."""
    stem = work / f"shard-{index:06d}"
    return stem.with_suffix(".tok"), stem.with_suffix(".idx.npy"), stem.with_suffix(".json")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsynced then renamed."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def peak_rss_bytes() -> int:
    """This process's peak resident memory (``VmHWM``; ``ru_maxrss`` where there is no /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _ShardWriter:
    """The tokens of a shard, appended to its temporary file and hashed; its index rows."""

    def __init__(self, path: Path, ctx: WorkContext) -> None:
        self.path, self.ctx = path, ctx
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self.file = open(self.tmp, "wb")  # closed by finish()
        self.sha = hashlib.sha256()
        self.rows: list[tuple[int, int, bool, int]] = []
        self.tokens = self.documents = 0
        self.max_id = -1
        self.texts: list[str] = []
        self.meta: list[tuple[int, bool, int]] = []
        self.pending = 0

    def write(self, arrays: list[np.ndarray], meta: list[tuple[int, bool, int]], eot: int | None) -> None:
        """Append pieces (``eot`` after those that end a document) and their index rows."""
        parts = []
        for arr, (key, last, force) in zip(arrays, meta):
            add = int(last and eot is not None)
            parts += [arr, np.asarray([eot] * add, dtype=np.int64)]
            self.rows.append((key, len(arr) + add, last, force))
            self.documents += last
        out = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if parts else np.zeros(0)
        check_ids(out, self.ctx.vocab_size)
        if out.size:
            self.max_id = max(self.max_id, int(out.max()))
        blob = memoryview(np.ascontiguousarray(out, dtype=self.ctx.dtype)).cast("B")
        self.sha.update(blob)
        self.file.write(blob)
        self.tokens += out.size

    def add_text(self, text: str, key: int, last: bool, force: int) -> None:
        self.texts.append(text)
        self.meta.append((key, last, force))
        self.pending += len(text)
        if self.pending >= self.ctx.batch_bytes:
            self.flush()

    def flush(self) -> None:
        if self.texts:
            ids = _batch_encoder(self.ctx)(self.texts)
            self.write([np.asarray(i, dtype=np.int64) for i in ids], self.meta, self.ctx.eot_id)
            self.texts, self.meta, self.pending = [], [], 0

    def finish(self) -> str:
        self.flush()
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        return self.sha.hexdigest()


def encode_shard(shard: Shard, work: Path, ctx: WorkContext) -> dict:
    """Tokenise one shard into ``work`` (atomic files); returns its done record (also written as
    its ``.json``), with this process's peak memory."""
    tok_path, idx_path, done_path = shard_paths(work, shard.index)
    writer = _ShardWriter(tok_path, ctx)
    try:
        for part in shard.parts:
            for payload, key, last, force in READERS[part[0]](part, ctx):
                if isinstance(payload, str):
                    writer.add_text(payload, key, last, force)
                else:
                    writer.flush()  # pre-tokenized: its end-of-text ids are in the tokens already
                    writer.write([payload.astype(np.int64)], [(key, last, force)], None)
        sha = writer.finish()
    except BaseException:
        writer.file.close()
        writer.tmp.unlink(missing_ok=True)
        raise
    index = np.array(writer.rows, dtype=INDEX_DTYPE)
    write_atomic(idx_path, _npy_bytes(index))
    record = {
        "index": shard.index,
        "tokens": writer.tokens,
        "pieces": len(writer.rows),
        "documents": writer.documents,
        "max_id": writer.max_id,
        "bytes": shard.nbytes,
        "sha256": sha,
        "idx_sha256": hashlib.sha256(idx_path.read_bytes()).hexdigest(),
    }
    write_atomic(done_path, json.dumps(record).encode())
    return {**record, "peak_rss": peak_rss_bytes()}


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()
