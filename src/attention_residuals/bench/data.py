"""``attnres bench data``: the data pipeline's throughput and peak memory at two corpus sizes,
beside the tokenizer's own batch encode of the whole corpus in one call (the reference).

Each size is a folder of documents generated into a temporary folder (the standard library's
``.py`` files, repeated with a numbered first line so no two are equal; deleted afterwards).
Every measurement runs in a fresh subprocess: its peak RSS is that process's ``VmHWM``, and the
pipeline's worker processes report theirs. Prepared with ``--workers`` worker processes (one by
default: the machine's other core may be busy) and one tokenizer thread each
(``RAYON_NUM_THREADS=1``); the reference also encodes on one thread, with every document in one
``encode_batch`` call, as a loader that reads the corpus whole would. Its token count is checked
against the pipeline's. The reference runs only up to ``--reference-max-mb`` (the whole
corpus's token lists must fit in memory: at 20 MB it peaked at 911 MiB, so ~6 GiB at 200 MB);
the byte reference runs at every size.

What it shows: the pipeline's peak memory does not grow with the corpus (the main process holds
the plan, one shard's tokens and an 18-byte index row per document while splitting; a worker one shard and
one encoder batch), while the reference's grows with it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ..training.data import Encoder, prepare_source
from ..training.data.readers import peak_rss_bytes
from ..training.prepare import tokenizer_encoder
from ..training.tokenizer import train_bpe
from .harness import bench_command, finish, machine_info

__all__ = ["bench_data", "child", "make_corpus"]

MB = 1_000_000


def make_corpus(root: Path, target_bytes: int) -> tuple[int, int]:
    """Write documents totalling about ``target_bytes`` under ``root`` (1000 per folder):
    the standard library's ``.py`` files in order, again and again, each under a first line
    naming its copy. Returns ``(documents, bytes)``."""
    base = Path(sysconfig.get_paths()["stdlib"])
    sources = []
    for path in sorted(base.glob("**/*.py")):
        if "site-packages" in path.parts or "__pycache__" in path.parts:
            continue
        text = path.read_bytes().decode("utf-8", errors="replace").replace("\0", "")
        if text:
            sources.append((path.relative_to(base).as_posix(), text))
    written = docs = 0
    while written < target_bytes:
        rel, text = sources[docs % len(sources)]
        blob = f"# copy {docs // len(sources)} of {rel}\n{text}".encode()
        folder = root / f"{docs // 1000:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{docs:07d}.txt").write_bytes(blob)
        written += len(blob)
        docs += 1
    return docs, written


def _train_tokenizer(out: Path) -> Path:
    """A 4096-token byte-level BPE trained on the first 150 top-level stdlib files (seconds)."""
    base = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="replace") for p in sorted(base.glob("*.py"))[:150]]
    train_bpe(texts, vocab_size=4096).save_pretrained(out)
    return out


def child() -> None:
    """One measurement (``sys.argv[1]``: a JSON job), its result as JSON on stdout."""
    job = json.loads(sys.argv[1])
    encoder = tokenizer_encoder(job["tokenizer"]) if job["tokenizer"] else Encoder()
    t0 = time.perf_counter()
    if job["method"] == "reference":
        out = _reference(job["corpus"], encoder)
    else:
        corpus, manifest, stats = prepare_source(
            job["corpus"], encoder, out=job["out"], cache_dir=job["out"] + "-cache", workers=job["workers"]
        )
        seconds, peak = time.perf_counter() - t0, peak_rss_bytes()
        t1 = time.perf_counter()
        prepare_source(job["corpus"], encoder, out=job["out"], cache_dir=job["out"] + "-cache")
        out = {
            "seconds": seconds,
            "peak_rss_prepare": peak,  # before the reuse below
            "reuse_seconds": time.perf_counter() - t1,  # the source's content hash + every block
            "tokens": len(corpus.train) + len(corpus.val),
            "documents": sum(corpus.documents),
            "text_tokens": len(corpus.train) + len(corpus.val) - sum(corpus.documents),
            "shards": stats.shards,
            "workers": stats.workers,
            "peak_rss_worker": stats.peak_rss_worker,
            "cache_bytes": sum(p.stat().st_size for p in Path(job["out"]).iterdir() if p.is_file()),
        }
    out["peak_rss_main"] = peak_rss_bytes()
    print(json.dumps(out))


def _reference(folder: str, encoder) -> dict:
    """Every document read, then the tokenizer's batch encode of all of them in one call."""
    t0 = time.perf_counter()
    texts = [p.read_bytes().decode("utf-8") for p in sorted(Path(folder).rglob("*.txt"))]
    ids = encoder.factory()(texts)
    n = sum(len(i) for i in ids)
    tokens = np.concatenate([np.asarray(i, dtype=np.uint16) for i in ids])  # one stream, as a cache holds
    return {
        "seconds": time.perf_counter() - t0,
        "tokens": int(tokens.size),
        "text_tokens": n,
        "documents": len(texts),
    }


def _run(job: dict) -> dict:
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    code = "from attention_residuals.bench.data import child; child()"
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(job)], capture_output=True, text=True, env=env, check=False
    )
    if proc.returncode:
        raise RuntimeError(f"bench data: {job['method']} failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _row(size_mb: float, nbytes: int, tokenizer: str, method: str, r: dict) -> dict:
    worker = r.get("peak_rss_worker", 0)
    return {
        "size_MB": size_mb,
        "input_bytes": nbytes,
        "tokenizer": tokenizer,
        "method": method,
        "seconds": round(r["seconds"], 2),
        "input_MB_per_s": round(nbytes / MB / r["seconds"], 2),
        "tokens_per_s": round(r["text_tokens"] / r["seconds"]),
        "text_tokens": r["text_tokens"],
        "documents": r["documents"],
        "peak_rss_MiB": {
            "main": round(r.get("peak_rss_prepare", r["peak_rss_main"]) / 2**20, 1),
            "main_after_reuse": round(r["peak_rss_main"] / 2**20, 1),
            "worker": round(worker / 2**20, 1) if worker else None,
            "sum": round((r["peak_rss_main"] + worker * r.get("workers", 0)) / 2**20, 1),  # an upper bound
        },
        **{k: r[k] for k in ("reuse_seconds", "shards", "workers", "cache_bytes") if k in r},
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnres bench data", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[20.0, 200.0], help="corpus sizes (MB)")
    p.add_argument("--tokenizer", help="a tokenizer folder (default: a 4096-token BPE trained here)")
    p.add_argument("--bpe-max-mb", type=float, default=1e9, help="measure the BPE only up to this size")
    p.add_argument(
        "--reference-max-mb", type=float, default=50.0, help="run the reference only up to this size"
    )
    p.add_argument("--workers", type=int, default=1, help="worker processes of the pipeline (default 1)")
    p.add_argument("--tmp", default=None, help="where the corpora are generated (default: the system's)")
    p.add_argument("--json", metavar="PATH", help="also write the JSON here")
    p.add_argument("--quick", action="store_true", help="tiny sizes (for tests)")
    return p


def bench_data(argv: list[str]) -> int:
    """Throughput and peak RSS of ``prepare`` beside the tokenizer's batch encode (see the module)."""
    args = _parser().parse_args(argv)
    if args.quick:
        args.sizes_mb, args.reference_max_mb = [0.2, 0.6], 1.0
    if any(s <= 0 for s in args.sizes_mb) or args.workers < 0:
        print("attnres bench data: error: --sizes-mb must be > 0 and --workers >= 0", file=sys.stderr)
        return 2
    info = machine_info(torch.device("cpu"))  # its load average: before the runs
    work = Path(tempfile.mkdtemp(prefix="attnres-bench-data-", dir=args.tmp))
    results = []
    try:
        bpe = any(size <= args.bpe_max_mb for size in args.sizes_mb)
        tok = args.tokenizer or (str(_train_tokenizer(work / "tok")) if bpe else None)
        for size in args.sizes_mb:
            corpus = work / f"corpus-{size:g}MB"
            docs, nbytes = make_corpus(corpus, int(size * MB))
            for name, path in (("bytes", None), ("bpe", tok)):
                if name == "bpe" and size > args.bpe_max_mb:
                    continue
                ref = name == "bytes" or size <= args.reference_max_mb
                methods = ["attnres prepare"] + (["reference"] if ref else [])
                for method in methods:
                    out = str(work / f"out-{size:g}-{name}")
                    job = {
                        "method": method,
                        "corpus": str(corpus),
                        "tokenizer": path,
                        "out": out,
                        "workers": args.workers,
                    }
                    results.append(_row(size, nbytes, name, method, _run(job)))
                    if method == "reference":  # the same tokens as the pipeline's (less its EOTs)
                        results[-1]["same_token_count"] = (
                            results[-1]["text_tokens"] == results[-2]["text_tokens"]
                        )
                    shutil.rmtree(out, ignore_errors=True)
                    shutil.rmtree(out + "-cache", ignore_errors=True)
                    print(f"{size:g} MB {name} {method}: {results[-1]}", file=sys.stderr)
            shutil.rmtree(corpus, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _finish(args, argv, results, info)


def _finish(args: argparse.Namespace, argv: list[str], results: list[dict], info: dict) -> int:
    result = {
        "bench": "data",
        "command": bench_command("data", argv),
        "machine": info,
        "config": {
            "sizes_MB": args.sizes_mb,
            "workers": args.workers,
            "tokenizer_threads": 1,
            "bpe": "4096-token byte-level BPE trained on 150 stdlib files"
            if not args.tokenizer
            else args.tokenizer,
        },
        "results": results,
    }
    header = ["MB", "tokens", "method", "s", "MB/s", "tok/s", "RSS main MiB", "RSS worker MiB"]
    rows = [
        [
            r["size_MB"],
            r["tokenizer"],
            r["method"],
            r["seconds"],
            r["input_MB_per_s"],
            r["tokens_per_s"],
            r["peak_rss_MiB"]["main"],
            r["peak_rss_MiB"]["worker"] or "-",
        ]
        for r in results
    ]
    return finish(result, args, rows, header)
