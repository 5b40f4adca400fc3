"""Hugging Face ``transformers`` integration: our GPT as a self-contained ``PreTrainedModel``.

The model classes live in :mod:`.hf_export` (``configuration_attnres.py``, ``modeling_attnres.py``),
which import only torch and transformers: ``save_pretrained`` writes both files next to the
weights and an ``auto_map`` into ``config.json``, so the folder loads where this package is not
installed::

    model = AutoModelForCausalLM.from_pretrained("out_dir", trust_remote_code=True)

With the package installed, ``import attention_residuals`` alone registers the classes
(``model_type="attnres"``) and no remote code is needed. Parameter names are the GPT's under
``model.``: :func:`from_gpt` / :func:`to_gpt` convert, and a run checkpoint (``model/<name>``) is a
rename away. The HF model computes the GPT's reference formulas (no fused kernels): its logits equal
``GPT``'s exactly under ``attention_residuals.kernels.use_backend("reference")``, within float
rounding with the GPT's default kernels. It takes ``attention_mask`` (left or right padding,
batched ``generate``), ``output_hidden_states`` / ``output_attentions``, gradient checkpointing,
``labels`` (``-100`` ignored) and positions past the training context (RoPE extrapolates).

Command line::

    attnres export-hf RUN_DIR OUT_DIR [--dtype float32|bfloat16|float16]
    attnres export-hf --import HF_DIR RUN_DIR [--force]   # back: an HF folder -> a run directory

The export writes config + modeling files + ``model.safetensors`` + ``generation_config.json``
(eos / pad ids of the tokenizer) and the run's tokenizer (else a byte-level tokenizer matching the
default byte tokens, padding with byte 0 on the left), into a new or empty ``OUT_DIR`` only, all
at once (a temporary folder renamed into place). ``--import`` writes into a new or empty
``RUN_DIR``; ``--force`` lets it write into a folder holding other files, but it never replaces a
``checkpoint.safetensors`` (a run's resumable state): that is always an error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import fields
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from ..files import atomic_write, fsync_dir, read_text
from ..model import GPT, GPTConfig
from ..training import tokenizer as tok
from ..training.checkpoint import CheckpointError, save_checkpoint
from ..training.data import BYTE_TOKENIZER
from ..training.run import checkpoints_in, load_run_checkpoint, newest_checkpoint
from .hf_export.configuration_attnres import AttnResConfig
from .hf_export.modeling_attnres import AttnResForCausalLM

__all__ = [
    "AttnResConfig",
    "AttnResForCausalLM",
    "config_from_gpt",
    "export_hf",
    "from_gpt",
    "gpt_config_of",
    "import_hf",
    "main",
    "register",
    "to_gpt",
]

EXPORT_FILE = "attnres_export.json"  # beside an exported model: where it came from
CHECKPOINT = "checkpoint.safetensors"
_GPT_FIELDS = tuple(f.name for f in fields(GPTConfig))
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def register() -> None:
    """Register ``model_type="attnres"`` with ``AutoConfig`` / ``AutoModelForCausalLM`` (idempotent;
    ``import attention_residuals`` does it already, see :mod:`.autoregister`)."""
    AutoConfig.register("attnres", AttnResConfig, exist_ok=True)
    AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)


register()


# --------------------------------------------------------------------------- conversion


def config_from_gpt(config: GPTConfig, **kwargs) -> AttnResConfig:
    """The HF config of a :class:`GPTConfig` (validated first: errors name the field)."""
    return AttnResConfig(**config.validate().to_dict(), **kwargs)


def gpt_config_of(config: AttnResConfig) -> GPTConfig:
    """The :class:`GPTConfig` an HF config describes (validated)."""
    return GPTConfig.from_dict({name: getattr(config, name) for name in _GPT_FIELDS}).validate()


def from_gpt(model: GPT, **config_kwargs) -> AttnResForCausalLM:
    """An :class:`AttnResForCausalLM` holding a copy of ``model``'s weights (same dtype/device)."""
    p = next(model.parameters())
    with torch.device(p.device):
        hf = AttnResForCausalLM(config_from_gpt(model.config, **config_kwargs))
    hf.to(p.dtype)
    hf.model.load_state_dict(model.state_dict(), strict=True)
    return hf.train(model.training)


def to_gpt(model: AttnResForCausalLM) -> GPT:
    """A plain :class:`GPT` holding a copy of ``model``'s weights."""
    p = next(model.parameters())
    with torch.device(p.device):
        gpt = GPT(gpt_config_of(model.config))
    gpt.to(p.dtype)
    gpt.load_state_dict(model.model.state_dict(), strict=True)
    return gpt.train(model.training)


def _read_run(run_dir: Path) -> tuple[GPTConfig, dict[str, torch.Tensor], dict, int]:
    """Model config, model weights, run config and step of a run directory, read as ``eval``
    reads it (:func:`..training.run.load_run_checkpoint`: the newest checkpoint, single-file or
    sharded, verified, falling back to the previous one)."""
    if not run_dir.is_dir():
        raise CheckpointError(f"RUN_DIR {str(run_dir)!r} does not exist (or is not a run directory)")
    _, head = newest_checkpoint(run_dir)
    if not head:  # nothing readable: the loader names what is missing or damaged
        load_run_checkpoint(run_dir, restore_rng=False)
    config_json = run_dir / "config.json"
    record = json.loads(read_text(config_json)) if config_json.is_file() else {}
    saved = head.get("config") or {}
    run_config = {**record, **saved}  # the checkpoint's own config wins, section by section
    for key, section in saved.items():
        if isinstance(section, dict) and isinstance(record.get(key), dict):
            run_config[key] = {**record[key], **section}
    model_cfg = _model_config_of(run_config, where=str(run_dir))
    gpt = GPT(model_cfg)
    info, warnings = load_run_checkpoint(run_dir, model=gpt, restore_rng=False)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    return model_cfg, gpt.state_dict(), run_config, info["step"]


def _model_config_of(run_config: dict, where: str) -> GPTConfig:
    """The :class:`GPTConfig` inside a run config (``{"model": {...}}`` or flat fields)."""
    section = run_config.get("model", run_config)
    if not isinstance(section, dict):
        raise ValueError(f"{where}: run config has no model section")
    known = {k: v for k, v in section.items() if k in _GPT_FIELDS}
    if not known:
        raise ValueError(f"{where}: run config holds no GPTConfig fields")
    return GPTConfig.from_dict(known).validate()


def _require_empty(folder: Path, what: str) -> None:
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"{what} {str(folder)!r}: not an empty folder; write into a new or empty one")


def export_hf(
    run_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype | str | None = None
) -> Path:
    """Convert a run directory (``config.json`` + its newest checkpoint, single-file or sharded)
    to a self-contained HF model folder. ``out_dir`` must be new or empty; it appears complete or
    not at all. ``dtype``: the weights' dtype; ``"run"`` (the CLI's default): the precision the run
    trained in (:func:`run_dtype`); None: as stored (float32)."""
    if dtype is not None and dtype != "run" and not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype: expected a torch.dtype, 'run' or None, got {dtype!r}")
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    _require_empty(out_dir, "OUT_DIR")
    gpt_cfg, weights, run_config, step = _read_run(run_dir)
    model = AttnResForCausalLM(config_from_gpt(gpt_cfg, architectures=["AttnResForCausalLM"]))
    model.model.load_state_dict(weights, strict=True)
    dtype = run_dtype(run_config) if dtype == "run" else dtype
    if dtype is not None:
        model.to(dtype)
    tokenizer, note = _export_tokenizer(run_config, gpt_cfg)
    _set_special_tokens(model, tokenizer)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        # the run's training config and corpus identity travel along, so that --import gives back a
        # run that `attnres eval` reads on its own corpus (an HF loader ignores this file)
        run = {key: run_config[key] for key in ("train", "data") if isinstance(run_config.get(key), dict)}
        record = {
            "run_dir": str(run_dir.resolve()),
            "step": step,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "tokenizer": note,
            "run": run,
        }
        (tmp / EXPORT_FILE).write_text(json.dumps(record, indent=1))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(out_dir.parent)
    return out_dir


def run_dtype(run_config: dict) -> torch.dtype:
    """The precision a run trained in (its recorded ``--dtype``: bf16/fp16 autocast, else float32),
    what ``export-hf`` writes the weights in by default so that an HF user computes as it trained."""
    name = (run_config.get("train") or {}).get("dtype", "float32")
    return _DTYPES.get(name, torch.float32)


def _export_tokenizer(run_config: dict, gpt_cfg: GPTConfig):
    """The run's tokenizer (or the byte tokenizer) and what was done (for the CLI)."""
    path = tok.tokenizer_path_of(run_config)
    used = (run_config.get("data") or {}).get("tokenizer", BYTE_TOKENIZER)
    if path is not None:
        tokenizer, note = tok.load_tokenizer(path), f"tokenizer from {path}"
    elif used == BYTE_TOKENIZER and gpt_cfg.vocab_size >= 256:
        tokenizer, note = tok.byte_tokenizer(), "byte tokenizer"
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(0)  # byte 0: masked out by attention_mask
    else:
        return None, f"no tokenizer (the run used {used!r} but its config records no tokenizer path)"
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # batched generation continues every row at its end
    tokenizer.init_kwargs["padding_side"] = "left"  # what save_pretrained writes
    return tokenizer, note


def _set_special_tokens(model: AttnResForCausalLM, tokenizer) -> None:
    """eos / pad / bos ids of the tokenizer into the config and the generation config."""
    ids = {}
    for name in ("eos", "pad", "bos"):
        value = getattr(tokenizer, f"{name}_token_id", None) if tokenizer is not None else None
        ids[f"{name}_token_id"] = value
        setattr(model.config, f"{name}_token_id", value)
    model.generation_config = GenerationConfig(**ids)


def import_hf(hf_dir: str | os.PathLike, run_dir: str | os.PathLike, *, force: bool = False) -> Path:
    """Convert an HF folder written by :func:`export_hf` back to a run directory.

    Writes ``checkpoint.safetensors`` (weights only: no optimizer state) and ``config.json`` with
    the model config under ``"model"`` and, when the folder came from :func:`export_hf`, the run's
    ``"train"`` and ``"data"`` sections; returns the checkpoint path. ``run_dir`` must be new or
    empty unless ``force``; an existing ``checkpoint.safetensors`` is never replaced.
    """
    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    live = checkpoints_in(run_dir)
    if live:
        raise ValueError(
            f"RUN_DIR {str(run_dir)!r}: holds a run's resumable {', '.join(live)}, which --import "
            "never replaces; import into a new folder"
        )
    if not force:
        _require_empty(run_dir, "RUN_DIR")
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"HF_DIR {str(hf_dir)!r}: no config.json (not a Hugging Face model folder)")
    hf = AttnResForCausalLM.from_pretrained(hf_dir, local_files_only=True)
    gpt = to_gpt(hf)
    exported = json.loads((hf_dir / EXPORT_FILE).read_text()) if (hf_dir / EXPORT_FILE).is_file() else {}
    run_config = {**exported.get("run", {}), "model": gpt.config.to_dict(), "imported_from": str(hf_dir)}
    ckpt = save_checkpoint(run_dir / CHECKPOINT, model=gpt, config=run_config, rng=False)
    atomic_write(run_dir / "config.json", json.dumps(run_config, indent=1, sort_keys=True).encode())
    return ckpt


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="attnres export-hf",
        description="Convert a run directory (config.json + checkpoint.safetensors) to a self-contained Hugging "
        "Face model folder (AutoModelForCausalLM.from_pretrained(OUT_DIR, trust_remote_code=True), or without "
        "remote code after `import attention_residuals`), or back with --import.",
    )
    parser.add_argument("src", help="RUN_DIR (or HF_DIR with --import)")
    parser.add_argument("dst", help="OUT_DIR, new or empty (or RUN_DIR with --import)")
    parser.add_argument(
        "--dtype",
        choices=["run", *sorted(_DTYPES)],
        default="run",
        help="the weights' dtype (default run: the precision the run trained in, float32 for a "
        "float32 run, bfloat16 for a bf16-autocast run)",
    )
    parser.add_argument(
        "--import", dest="reverse", action="store_true", help="convert HF_DIR back to RUN_DIR"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="--import into a folder that holds other files (never over a checkpoint.safetensors)",
    )
    args = parser.parse_args(argv)
    try:
        if args.force and not args.reverse:
            raise ValueError("--force: only with --import (an export always goes to a new or empty OUT_DIR)")
        if args.reverse:
            print(f"wrote {import_hf(args.src, args.dst, force=args.force)}")
        else:
            out = export_hf(args.src, args.dst, dtype=_DTYPES.get(args.dtype, args.dtype))
            record = json.loads((out / EXPORT_FILE).read_text())
            print(
                f"wrote {out} ({record['dtype']} weights, step {record['step']}) with {record['tokenizer']}"
            )
            print(f"load it with: AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")
    except (OSError, ValueError, RuntimeError) as e:
        message = " ".join(str(e).split())  # one line
        print(f"attnres export-hf: error: {message}", file=sys.stderr)
        return 2
    return 0
