"""``attnres eval RUN_DIR``: the validation loss of a run's checkpoint, as JSON.

The corpus is the run's own (``config.json`` names it and records its sha256; a mismatch, e.g.
another Python's standard library, is reported in the output and warned about) unless ``--data``
points elsewhere, read with the run's tokenizer (bytes, or the BPE it trained with). The loss is
the mean cross-entropy over fixed validation windows — the same windows ``attnres train``
evaluates on, so the numbers agree with ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from ..model import GPT
from .checkpoint import CheckpointError, load_checkpoint
from .config import TrainConfig
from .data import BYTE_TOKENIZER
from .loop import estimate_loss, load_corpus_for, resolve_device
from .run import CHECKPOINT_FILE, CONFIG_FILE

__all__ = ["evaluate_run", "load_run", "main"]


def load_run(
    run_dir: str | Path, *, checkpoint: str | Path | None = None, device: str = "cpu"
) -> tuple[GPT, TrainConfig, dict[str, Any]]:
    """``(model in eval mode, config, info)`` of a run directory.

    ``info`` has the checkpoint's ``step``, ``path`` and ``extra`` and the run's ``config.json``
    as ``record``.

    Raises ``FileNotFoundError`` when ``run_dir`` holds no run and :class:`CheckpointError`
    when its checkpoint is missing, truncated or corrupt.
    """
    run_dir = Path(run_dir)
    cfg_path = run_dir / CONFIG_FILE
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no {CONFIG_FILE})")
    record = json.loads(cfg_path.read_text())
    cfg = TrainConfig.from_dict({"model": record.get("model", {}), "train": record.get("train", {})})
    model = GPT(cfg.model)
    info = load_checkpoint(
        Path(checkpoint) if checkpoint else run_dir / CHECKPOINT_FILE, model=model, restore_rng=False
    )
    info["record"] = record
    return model.to(resolve_device(device)).eval(), cfg, info


def evaluate_run(
    run_dir: str | Path,
    *,
    batches: int | None = None,
    batch_size: int | None = None,
    split: str = "val",
    data: str | None = None,
    checkpoint: str | Path | None = None,
    device: str = "auto",
    cache_dir: str | None = None,
) -> dict[str, Any]:
    """Loss of a run's checkpoint on its validation (or training) split; a JSON-able dict."""
    if split not in ("val", "train"):
        raise ValueError(f"split: expected 'val' or 'train', got {split!r}")
    for name, value in (("batches", batches), ("batch_size", batch_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    model, cfg, info = load_run(run_dir, checkpoint=checkpoint, device=device)
    recorded = info["record"].get("data", {})
    source = data if data is not None else cfg.data
    # the run's tokenizer (bytes, or its BPE) on the run's corpus or on --data
    corpus = load_corpus_for(dataclasses.replace(cfg, data=source, cache_dir=cache_dir))
    corpus.check_fits(cfg.model.seq_len)
    # the same source, and (runs that recorded it) the same token stream: a cache rebuilt
    # otherwise or another tokenization does not match
    matches = corpus.sha256 == recorded.get("sha256") and recorded.get("tokens_sha256") in (
        None,
        corpus.digest(),
    )
    if not matches and data is None:
        print(
            f"warning: the corpus (sha256 {corpus.sha256[:12]}..., tokens {corpus.digest()[:12]}...) "
            f"differs from the run's ({str(recorded.get('sha256'))[:12]}..., "
            f"{str(recorded.get('tokens_sha256'))[:12]}...; another machine or Python?)",
            file=sys.stderr,
        )
    n = batches or cfg.eval_batches
    bs = batch_size or cfg.batch_size
    dev = next(model.parameters()).device
    loss = estimate_loss(
        model,
        corpus.val if split == "val" else corpus.train,
        n_batches=n,
        batch_size=bs,
        seq_len=cfg.model.seq_len,
        device=dev,
        dtype=cfg.dtype,
    )
    out: dict[str, Any] = {
        "run_dir": str(run_dir),
        "checkpoint": str(info["path"]),
        "step": info["step"],
        "split": split,
        "loss": loss,
        f"{split}_loss": loss,
        "bits_per_token": loss / math.log(2),
        "perplexity": math.exp(loss) if loss < 700 else float("inf"),
        "batches": n,
        "batch_size": bs,
        "seq_len": cfg.model.seq_len,
        "tokens": n * bs * cfg.model.seq_len,  # windows drawn at random: they may overlap
        "split_tokens": len(corpus.val if split == "val" else corpus.train),
        "corpus": corpus.source,
        "corpus_sha256": corpus.sha256,
        "corpus_matches_run": matches,
        "tokenizer": corpus.tokenizer,
    }
    if corpus.tokenizer == BYTE_TOKENIZER:
        out["bits_per_byte"] = out["bits_per_token"]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="attnres eval",
        description="Evaluate a run's checkpoint: mean cross-entropy (nats/token) on fixed validation "
        "windows of the run's corpus, printed as JSON (also bits per token/byte and perplexity).",
        epilog="example:\n  attnres eval runs/demo/block --batches 50",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", help="run directory written by `attnres train`")
    p.add_argument(
        "--batches", type=int, default=None, help="number of batches (default: the run's --eval-batches)"
    )
    p.add_argument("--batch-size", type=int, default=None, help="sequences per batch (default: the run's)")
    p.add_argument("--split", choices=("val", "train"), default="val", help="which split (default: val)")
    p.add_argument(
        "--data", default=None, help="evaluate on this text file/folder/glob instead of the run's corpus"
    )
    p.add_argument(
        "--checkpoint", default=None, help="checkpoint file (default: RUN_DIR/checkpoint.safetensors)"
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    p.add_argument("--cache-dir", default=None, help="token cache folder for --data")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = evaluate_run(
            args.run_dir,
            batches=args.batches,
            batch_size=args.batch_size,
            split=args.split,
            data=args.data,
            checkpoint=args.checkpoint,
            device=args.device,
            cache_dir=args.cache_dir,
        )
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        print(f"attnres eval: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
