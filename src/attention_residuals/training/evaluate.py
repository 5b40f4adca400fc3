"""``attnres eval RUN_DIR``: the validation loss of a run's checkpoint, as JSON.

The corpus is the run's own (``config.json`` names it and records its sha256; a mismatch, e.g.
another Python's standard library, is reported in the output and warned about) unless ``--data``
points elsewhere, read with the run's tokenizer (bytes, or the BPE it trained with). The loss is
the mean cross-entropy over fixed validation windows — the same windows ``attnres train``
evaluates on, so the numbers agree with ``metrics.jsonl``.

The checkpoint is read as ``train --resume`` reads it (:func:`.run.load_run_checkpoint`: the newest
of the single-file and the sharded ``--fsdp`` checkpoints, read in one process): verified whole,
falling back to the previous checkpoint with a warning when the newest one is damaged, and refused when it records another run's identity than the run's ``config.json``
(``--checkpoint FILE``: its model config must be the run's). The run's tokenizer folder is
loaded without running code from it unless ``--trust-remote-code``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from ..commands import Parser, fail
from ..model import GPT
from .checkpoint import CheckpointError, load_checkpoint
from .config import TrainConfig
from .data import BYTE_TOKENIZER, Corpus
from .loop import estimate_loss, load_corpus_for, resolve_device, resolve_dtype, split_loss
from .run import CONFIG_FILE, RunError, checkpoint_check, load_run_checkpoint, log, read_run_record

__all__ = ["evaluate_run", "load_run", "main"]


def load_run(
    run_dir: str | Path, *, checkpoint: str | Path | None = None, device: str = "cpu"
) -> tuple[GPT, TrainConfig, dict[str, Any]]:
    """``(model in eval mode, config, info)`` of a run directory.

    ``info`` has the checkpoint's ``step``, ``path`` and ``extra`` and the run's ``config.json``
    as ``record``. The run's checkpoint is loaded through :func:`.run.load_run_checkpoint` (the
    fallback of ``train --resume``; its warnings go to stderr) and must record the run's identity;
    an explicit ``checkpoint`` file is loaded as is and must record the run's model.

    Raises ``FileNotFoundError`` when ``run_dir`` holds no run, ``ValueError`` naming the file when
    its ``config.json`` is not a valid run config, and :class:`CheckpointError` when no good
    checkpoint is left (``CheckpointMismatchError``: it is another run's).
    """
    run_dir = Path(run_dir)
    cfg_path = run_dir / CONFIG_FILE
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no {CONFIG_FILE})")
    try:
        record = read_run_record(run_dir)
        sections = {"model": record.get("model", {}), "train": record.get("train", {})}
        cfg = TrainConfig.from_dict(sections).validate()
    except (RunError, TypeError, ValueError) as e:
        raise ValueError(f"{cfg_path}: {e}") from None
    model = GPT(cfg.model)
    if checkpoint:
        check = checkpoint_check(record, sections=("model",))
        info = load_checkpoint(Path(checkpoint), model=model, restore_rng=False, check_config=check)
    else:
        info, warnings = load_run_checkpoint(
            run_dir, model=model, restore_rng=False, check_config=checkpoint_check(record)
        )
        for w in warnings:
            log(f"warning: {w}")
    info["record"] = record
    return model.to(resolve_device(device)).eval(), cfg, info


def _check_eval_args(split: str, batches: int | None, batch_size: int | None, whole: bool) -> None:
    if split not in ("val", "train"):
        raise ValueError(f"split: expected 'val' or 'train', got {split!r}")
    if whole and batches is not None:
        raise ValueError(f"batches: --whole scores the whole split; expected no --batches, got {batches}")
    for name, value in (("batches", batches), ("batch_size", batch_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")


def _corpus_matches_run(corpus: Corpus, recorded: dict, *, warn: bool) -> bool:
    """Whether the corpus is the run's: the same source, and (runs that recorded it) the same token
    stream, so a cache rebuilt otherwise or another tokenization does not match; ``warn``: say so."""
    matches = corpus.sha256 == recorded.get("sha256") and recorded.get("tokens_sha256") in (
        None,
        corpus.digest(),
    )
    if not matches and warn:
        print(
            f"warning: the corpus (sha256 {corpus.sha256[:12]}..., tokens {corpus.digest()[:12]}...) "
            f"differs from the run's ({str(recorded.get('sha256'))[:12]}..., "
            f"{str(recorded.get('tokens_sha256'))[:12]}...; another machine or Python?)",
            file=sys.stderr,
        )
    return matches


def evaluate_run(
    run_dir: str | Path,
    *,
    batches: int | None = None,
    batch_size: int | None = None,
    split: str = "val",
    whole: bool = False,
    data: str | None = None,
    checkpoint: str | Path | None = None,
    device: str = "auto",
    cache_dir: str | None = None,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Loss of a run's checkpoint on its validation (or training) split; a JSON-able dict.
    ``whole``: every token of the split once (disjoint windows), with the loss's standard error;
    else ``batches`` fixed random windows (the run's evaluations).
    ``trust_remote_code`` lets the run's tokenizer folder run code of its own (off: refused)."""
    _check_eval_args(split, batches, batch_size, whole)
    model, cfg, info = load_run(run_dir, checkpoint=checkpoint, device=device)
    recorded = info["record"].get("data", {})
    source = data if data is not None else cfg.data
    # the run's tokenizer (bytes, or its BPE) on the run's corpus or on --data
    corpus = load_corpus_for(
        dataclasses.replace(cfg, data=source, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
    )
    corpus.check_fits(cfg.model.seq_len)
    matches = _corpus_matches_run(corpus, recorded, warn=data is None)
    bs = batch_size or cfg.batch_size
    dev = next(model.parameters()).device
    tokens = corpus.val if split == "val" else corpus.train
    kw = {
        "batch_size": bs,
        "seq_len": cfg.model.seq_len,
        "device": dev,
        "dtype": resolve_dtype(cfg.dtype, dev),
    }
    if whole:
        scored = split_loss(model, tokens, **kw)
        loss, n, counted = scored["loss"], math.ceil(scored["windows"] / bs), scored["tokens"]
    else:
        n = batches or cfg.eval_batches
        loss, counted = estimate_loss(model, tokens, n_batches=n, **kw), n * bs * cfg.model.seq_len
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
        # --whole: every token of the split scored once; else windows drawn at random (they may overlap)
        "windows": "whole split, disjoint" if whole else "fixed random draws",
        "tokens": counted,
        "split_tokens": len(tokens),
        "corpus": corpus.source,
        "corpus_sha256": corpus.sha256,
        "corpus_matches_run": matches,
        "tokenizer": corpus.tokenizer,
    }
    if whole:
        out["loss_se"] = scored["se"]
    if corpus.tokenizer == BYTE_TOKENIZER:
        out["bits_per_byte"] = out["bits_per_token"]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
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
    p.add_argument(
        "--whole",
        action="store_true",
        help="score every token of the split once (disjoint windows), with the standard error; "
        "not with --batches",
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
    add_trust_flag(p)
    return p


def add_trust_flag(p: argparse.ArgumentParser) -> None:
    """``--trust-remote-code`` (shared with ``attnres sample``)."""
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let the run's tokenizer folder run Python code of its own (default: such a folder is refused)",
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = evaluate_run(
            args.run_dir,
            batches=args.batches,
            batch_size=args.batch_size,
            split=args.split,
            whole=args.whole,
            data=args.data,
            checkpoint=args.checkpoint,
            device=args.device,
            cache_dir=args.cache_dir,
            trust_remote_code=args.trust_remote_code,
        )
    except (ValueError, OSError, CheckpointError) as e:
        return fail("attnres eval", e)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
