"""``prepare``: a source to a prepared corpus, streamed shard by shard through worker processes.

1. plan the shards (:func:`.sources.plan_shards`; ``work/plan.json`` pins the plan);
2. tokenise every shard not done yet (:func:`.readers.encode_shard`) — in ``workers`` processes
   (``forkserver``: forked from a clean server that imported this module once, so each worker
   shares its pages) or in this process; a progress bar shows bytes/s, tokens/s and the ETA;
3. split and write ``train.bin`` / ``val.bin`` and the manifest (:func:`.store.finalize`).

Interrupting (Ctrl-C, a crash, a kill) keeps the finished shards: a rerun with the same source
and settings redoes only the others. Memory: each worker holds one shard's input (``shard_bytes``)
plus one encoder batch (``batch_bytes``, with the tokenizer's working memory for it, ~30 bytes per
input byte for the Rust BPE); the main process holds the plan and, when splitting, an 18-byte index
row per document and one shard's tokens — none of it grows with the corpus's bytes (``attnres bench data``).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from .base import PRETOKENIZED
from .readers import WorkContext, encode_shard, peak_rss_bytes, shard_paths, write_atomic
from .sources import Shard, Source, plan_shards
from .store import (
    FORMAT_NAME,
    VERSION,
    WORK,
    CorruptCacheError,
    clear_work,
    finalize,
    locked,
    read_manifest,
    stamp,
    verify,
    write_manifest,
)

__all__ = ["DEFAULT_SHARD_BYTES", "PrepareStats", "Settings", "cache_key", "prepare"]

DEFAULT_SHARD_BYTES = 16 << 20
MAX_AUTO_WORKERS = 8
MIN_POOL_BYTES = 32 << 20  # less input than this is tokenised in this process


@dataclass(frozen=True)
class Settings:
    """How a source is tokenised: what the cache key holds (plus the sizes, which do not change
    the tokens but do change the shard plan)."""

    tokenizer: str
    eot_id: int | None
    dtype: str
    val_fraction: float | None  # None: the source's own split (train / val files)
    shard_bytes: int = DEFAULT_SHARD_BYTES
    piece_bytes: int = 1 << 16
    batch_bytes: int = 1 << 20


@dataclass
class PrepareStats:
    """What a prepare did (returned to the caller, printed by ``attnres data prepare``)."""

    cached: bool = False  # the manifest was there and verified: nothing to do
    seconds: float = 0.0
    input_bytes: int = 0
    tokens: int = 0  # tokenised in this call (not counting reused shards)
    shards: int = 0
    reused: int = 0  # shards found done by an earlier, interrupted call
    workers: int = 0
    peak_rss_main: int = 0
    peak_rss_worker: int = 0
    rebuilt: str | None = None  # why a cache found corrupt was rebuilt
    events: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def cache_key(source: Source, settings: Settings) -> dict:
    """What identifies a prepared corpus: the source's content and how it was tokenised."""
    tokens = source.kinds[0] == "tokens"
    return {
        "version": VERSION,
        "sha256": source.sha256,
        "format": source.format,
        "text_field": None if tokens else source.options.text_field,
        "bin_dtype": source.options.bin_dtype if tokens else None,
        "tokenizer": settings.tokenizer,
        "eot_id": settings.eot_id,
        "dtype": settings.dtype,
        "val_fraction": settings.val_fraction,
    }


def _plan_id(key: dict, settings: Settings, plan: list[Shard]) -> str:
    blob = json.dumps([key, asdict(settings), [(s.kind, s.parts) for s in plan]], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _shard_done(work: Path, shard: Shard, dtype: np.dtype) -> dict | None:
    """The done record of a shard whose files are all there and match it, else None."""
    tok, idx, done = shard_paths(work, shard.index)
    try:
        record = json.loads(done.read_text())
        if tok.stat().st_size != record["tokens"] * dtype.itemsize:
            return None
        if hashlib.sha256(idx.read_bytes()).hexdigest() != record["idx_sha256"]:
            return None
        if hashlib.sha256(tok.read_bytes()).hexdigest() != record["sha256"]:
            return None
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _init_worker() -> None:
    """A worker: Ctrl-C is the main process's to handle; one tokenizer thread (the processes are
    the parallelism)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"


def _mp_context():
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        return ctx
    return mp.get_context("spawn")


def _run_shards(
    todo: list[Shard], work: Path, ctx: WorkContext, workers: int, on_done: Callable[[dict], None]
) -> None:
    """Every shard of ``todo``, ``on_done`` called with each done record (in completion order)."""
    if workers == 0:
        for shard in todo:
            on_done(encode_shard(shard, work, ctx))
        return
    pool = ProcessPoolExecutor(workers, mp_context=_mp_context(), initializer=_init_worker)
    pending: set = set()
    queue = iter(todo)
    try:
        for shard in queue:
            pending.add(pool.submit(encode_shard, shard, work, ctx))
            if len(pending) >= 2 * workers:
                break
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                on_done(fut.result())
                nxt = next(queue, None)
                if nxt is not None:
                    pending.add(pool.submit(encode_shard, nxt, work, ctx))
    finally:  # on an error or Ctrl-C: drop the queued shards, let the running ones finish
        pool.shutdown(wait=True, cancel_futures=True)


def _workers(requested: int | None, todo: list[Shard], settings: Settings, picklable: bool) -> int:
    """``requested``, else ``$ATTNRES_DATA_WORKERS``, else one per CPU (at most 8) when there are
    several shards and 32 MiB to do; 0 (this process) for less, or for an encoder that does not
    pickle."""
    if not picklable or not todo:
        return 0
    if requested is None and os.environ.get("ATTNRES_DATA_WORKERS", "").strip():
        requested = int(os.environ["ATTNRES_DATA_WORKERS"])
    if requested is not None:
        return max(0, min(requested, len(todo)))
    if len(todo) < 2 or sum(s.nbytes for s in todo) < max(4 * settings.shard_bytes, MIN_POOL_BYTES):
        return 0  # starting the pool would take longer than the work
    return min(os.cpu_count() or 1, MAX_AUTO_WORKERS, len(todo))


class _Progress:
    """bytes/s, tokens/s and the ETA on stderr (tqdm), and the counters of :class:`PrepareStats`."""

    def __init__(self, stats: PrepareStats, total: int, done: int, show: bool, what: str) -> None:
        self.stats, self.t0 = stats, time.perf_counter()
        self.bar = tqdm(
            total=total,
            initial=done,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"tokenizing {what}",
            disable=not show,
            dynamic_ncols=True,
            file=sys.stderr,
        )

    def __call__(self, record: dict) -> None:
        self.stats.tokens += record["tokens"]
        self.stats.peak_rss_worker = max(self.stats.peak_rss_worker, record.get("peak_rss", 0))
        rate = self.stats.tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix({"tok/s": f"{rate:,.0f}"}, refresh=False)
        self.bar.update(record["bytes"])

    def close(self) -> None:
        self.bar.close()


def prepare(
    source: Source,
    entry: Path,
    settings: Settings,
    ctx: WorkContext,
    *,
    workers: int | None = None,
    progress: bool = False,
    on_shard: Callable[[dict], None] | None = None,
) -> tuple[dict, PrepareStats]:
    """Prepare ``source`` into ``entry`` (see the module docstring); ``(manifest, stats)``. A
    verified manifest with the same key is reused as is; one that fails verification is rebuilt.
    ``on_shard`` sees each done record (tests interrupt a prepare through it)."""
    stats = PrepareStats(input_bytes=sum(f.size for f in source.files))
    t0 = time.perf_counter()
    key = cache_key(source, settings)
    with locked(entry):
        manifest = read_manifest(entry)
        if manifest is not None and manifest.get("key") == key:
            try:
                verify(entry, manifest)
                stats.cached, stats.seconds = True, time.perf_counter() - t0
                stats.peak_rss_main = peak_rss_bytes()
                return manifest, stats
            except CorruptCacheError as exc:
                stats.rebuilt = str(exc)
                print(f"warning: {source.what}: token cache {exc}; rebuilding it", file=sys.stderr)
        (entry / "manifest.json").unlink(missing_ok=True)
        manifest = _build(source, entry, settings, ctx, key, stats, workers, progress, on_shard)
    stats.seconds = time.perf_counter() - t0
    stats.peak_rss_main = peak_rss_bytes()
    manifest["seconds"] = round(stats.seconds, 3)
    return manifest, stats


def _build(
    source: Source,
    entry: Path,
    settings: Settings,
    ctx: WorkContext,
    key: dict,
    stats: PrepareStats,
    workers: int | None,
    progress: bool,
    on_shard: Callable[[dict], None] | None,
) -> dict:
    """Plan, tokenise the shards not done yet, split, write the manifest (under the lock)."""
    plan = plan_shards(source, settings.shard_bytes, settings.val_fraction or 0.0, settings.eot_id)
    work = entry / WORK
    plan_file = work / "plan.json"
    plan_id = _plan_id(key, settings, plan)
    try:
        same = json.loads(plan_file.read_text()).get("id") == plan_id
    except (OSError, ValueError):
        same = False
    if not same:  # another source or settings (or nothing yet): start the work afresh
        clear_work(entry)
        work.mkdir(parents=True)
        write_atomic(plan_file, json.dumps({"id": plan_id, "shards": len(plan)}).encode())
    dtype = np.dtype(settings.dtype)
    done = {s.index: r for s in plan if (r := _shard_done(work, s, dtype)) is not None}
    todo = [s for s in plan if s.index not in done]
    stats.shards, stats.reused = len(plan), len(done)
    stats.workers = _workers(workers, todo, settings, ctx.encoder.picklable())
    bar = _Progress(
        stats, sum(s.nbytes for s in plan), sum(r["bytes"] for r in done.values()), progress, source.spec
    )

    def on_done(record: dict) -> None:
        done[record["index"]] = record
        bar(record)
        if on_shard is not None:
            on_shard(record)

    try:
        _run_shards(todo, work, ctx, stats.workers, on_done)
    finally:
        bar.close()
    split, val_doc = finalize(work, entry, len(plan), dtype, settings.val_fraction or 0.0, source.what)
    if set(source.kinds) == {"text"} and len(val_doc) == len(source.files):  # one document per file
        split["val"]["files"] = [f.rel for f, v in zip(source.files, val_doc) if v]
    manifest = _manifest(source, settings, key, split, list(done.values()), ctx.encoder.vocab_size)
    write_manifest(entry, manifest)
    clear_work(entry)
    return manifest


def _manifest(
    source: Source, settings: Settings, key: dict, split: dict, records: list[dict], encoder_vocab: int
) -> dict:
    """The manifest (see :mod:`.store`): ``vocab_size`` is the least vocabulary its ids need."""
    tokens = source.kinds[0] == "tokens"
    max_id = max((r.get("max_id", -1) for r in records), default=-1)
    vocab = max(
        0 if settings.tokenizer == PRETOKENIZED else encoder_vocab,
        max_id + 1,
        0 if settings.eot_id is None else settings.eot_id + 1,
    )
    if split["split"]["method"] == "given" and source.kinds == ("text",):
        split["split"]["method"] = "line"  # one document, cut at a line boundary
    docs_known = not tokens or settings.eot_id is not None
    for s in ("train", "val"):
        if not docs_known:
            split[s]["documents"] = None
    return {
        "format": FORMAT_NAME,
        "version": VERSION,
        "key": key,
        "source": source.spec,
        "data_format": source.format,
        "sha256": source.sha256,
        "files": len(source.files),
        "file_list": [f.rel for f in source.files] if set(source.kinds) == {"text"} else None,
        "input_bytes": sum(f.size for f in source.files),
        "tokenizer": settings.tokenizer,
        "vocab_size": vocab,
        "pretokenized": tokens,
        "text_field": key["text_field"],
        "eot_id": settings.eot_id,
        "dtype": settings.dtype,
        "max_id": max_id,
        "shards": len(records),
        **split,
        "created": stamp(),
    }
