"""The run directory: its files, their formats, and what to do with one that exists.

A run lives in one directory::

    config.json             model + training config, corpus provenance, the command line
    metrics.jsonl           one JSON row per log step: step, train_loss, val_loss, lr, tokens,
                            tokens_per_s, wall_s (+ grad_norm)
    checkpoint.safetensors  weights, optimizer, scheduler, RNG, step (atomic; previous one kept
                            as checkpoint.prev.safetensors)
    summary.json            final numbers and ``"done": true`` once all steps ran

The resume policy (:func:`plan_run`): a directory holding a run is an error unless ``--resume``
(continue it: its config must equal the run's ``config.json``, the differing fields are listed;
a finished run is returned as is) or ``--overwrite`` (delete the run files and start again).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..model import GPTConfig
from .args import to_flags
from .checkpoint import previous_path
from .config import PATH_FIELDS, TrainConfig, absolute
from .data import builtin_name

__all__ = [
    "CHECKPOINT_FILE",
    "CONFIG_FILE",
    "METRICS_FILE",
    "RUN_FORMAT",
    "SUMMARY_FILE",
    "ConfigMismatchError",
    "RunError",
    "RunPlan",
    "clear_run",
    "command_line",
    "config_diff",
    "is_done",
    "load_summary",
    "plan_run",
    "read_metrics",
    "run_identity",
    "run_record",
    "start_run_files",
    "truncate_metrics",
    "write_json",
]

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_FILE = "checkpoint.safetensors"
SUMMARY_FILE = "summary.json"
RUN_FORMAT = 1
# the corpus fields a resume must match (those a run recorded: tokens_sha256 came later)
DATA_IDENTITY = ("source", "sha256", "tokenizer", "vocab_size", "tokens_sha256")


class RunError(RuntimeError):
    """The run directory is not in a state the request fits (finished, occupied...)."""


class ConfigMismatchError(RunError, ValueError):
    """``--resume`` with a config that differs from the run's ``config.json``."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- files


def write_json(path: Path, obj: Any) -> None:
    """Atomically: a crash leaves the previous file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """Rows of a run's ``metrics.jsonl`` (a torn last line from a crash is ignored)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return rows


def load_summary(run_dir: str | os.PathLike) -> dict | None:
    path = Path(run_dir) / SUMMARY_FILE
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def is_done(run_dir: str | os.PathLike) -> bool:
    """True when the run in ``run_dir`` ran all its steps."""
    s = load_summary(run_dir)
    return bool(s and s.get("done"))


def command_line(cfg: TrainConfig, run_control: tuple[str, ...] = ("out",)) -> str:
    """An ``attnres train`` command reproducing ``cfg``: its non-default fields plus the listed
    run-control fields."""
    flags = to_flags(cfg, always=run_control, skip=lambda ff: bool(ff.meta.get("run_control")))
    return shlex.join(["attnres", "train", *flags])


def run_identity(cfg: TrainConfig, corpus_info: dict) -> dict:
    """What a resume must match: the config's identity and the corpus it trains on."""
    return {**cfg.identity(), "data": {k: corpus_info[k] for k in DATA_IDENTITY}}


def run_record(cfg: TrainConfig, corpus_info: dict) -> dict:
    """The content of ``config.json``."""
    return {"format": RUN_FORMAT, **cfg.to_dict(), "data": corpus_info, "command": command_line(cfg)}


def start_run_files(out: Path, record: dict) -> None:
    """A new run: ``config.json`` written, ``metrics.jsonl`` empty, no ``summary.json``."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / CONFIG_FILE, record)
    (out / METRICS_FILE).write_text("")
    with contextlib.suppress(FileNotFoundError):
        (out / SUMMARY_FILE).unlink()


def clear_run(out: Path) -> None:
    """Delete the run files of ``out`` (and nothing else there)."""
    for name in (
        CONFIG_FILE,
        METRICS_FILE,
        SUMMARY_FILE,
        CHECKPOINT_FILE,
        previous_path(out / CHECKPOINT_FILE).name,
    ):
        with contextlib.suppress(FileNotFoundError):
            (out / name).unlink()


def truncate_metrics(out: Path, step: int) -> None:
    """Drop the metrics rows past ``step`` (written after the checkpoint a resume starts from)."""
    rows = [r for r in read_metrics(out) if r.get("step", 0) <= step]
    tmp = out / f".{METRICS_FILE}.tmp-{os.getpid()}"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, out / METRICS_FILE)


# --------------------------------------------------------------------------- the resume policy


def config_diff(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """Fields that differ between two nested config dicts, as ``"model.d_model: 128 -> 64"``."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, f"{name}.")
        elif a != b:
            out.append(f"{name}: {a!r} (run) != {b!r} (now)")
    return out


@dataclass(frozen=True)
class RunPlan:
    """What :func:`plan_run` decided for the run directory."""

    resume: bool = False  # continue from its checkpoint
    clear: bool = False  # delete its run files first
    finished: dict | None = None  # the summary of a run already done: nothing to train


def _saved_identity(saved: dict, current: dict) -> dict:
    """The identity recorded in a run's ``config.json``, comparable with :func:`run_identity`
    (``current``): the training fields and corpus fields a run recorded before they existed take
    their defaults / the current values (``eot``: ``off`` for ``--data``, which had no end-of-text
    tokens then, so such a run resumes with ``--eot off``); a built-in corpus recorded as a path is
    its name."""
    train = {**TrainConfig().identity()["train"], **saved.get("train", {})}
    for key in PATH_FIELDS:  # runs recorded before paths were made absolute
        if isinstance(train.get(key), str):
            train[key] = absolute(train[key])
    if train["data"] is not None:
        train["data"] = builtin_name(train["data"]) or train["data"]
    if "eot" not in saved.get("train", {}):  # recorded before end-of-text tokens: --data had none
        train["eot"] = "auto" if builtin_name(train["data"]) is not None else "off"
    data = saved.get("data", {})
    return {
        # through GPTConfig: runs recorded with the flat rule options ("residual": "block", "heads")
        "model": GPTConfig.from_dict(saved.get("model", {})).to_dict(),
        "train": train,
        "data": {k: data.get(k) if k in data else current["data"][k] for k in current["data"]},
    }


def plan_run(cfg: TrainConfig, identity: dict) -> RunPlan:
    """Decide what to do with ``cfg.out`` (see the module docstring); touches no file. Raises
    :class:`RunError` for an occupied directory without ``--resume`` / ``--overwrite`` and
    :class:`ConfigMismatchError` when resuming with another config."""
    out = Path(cfg.out)
    cfg_path, ckpt_path = out / CONFIG_FILE, out / CHECKPOINT_FILE
    if not cfg_path.exists():
        if cfg.resume:
            log(f"{out}: nothing to resume, starting a new run")
        return RunPlan()
    if cfg.overwrite:
        return RunPlan(clear=True)
    if not cfg.resume:
        summary = load_summary(out)
        state = "a finished run" if summary and summary.get("done") else "a run"
        raise RunError(
            f"{out} already holds {state} ({CONFIG_FILE} exists); pass --resume to continue it "
            f"or --overwrite to start again"
        )
    saved = _saved_identity(json.loads(cfg_path.read_text()), identity)
    diff = config_diff(saved, identity)
    if diff:
        raise ConfigMismatchError(f"--resume: the config differs from {cfg_path}:\n  " + "\n  ".join(diff))
    summary = load_summary(out)
    if summary and summary.get("done") and summary.get("step") == cfg.steps:
        log(f"{out}: already finished ({cfg.steps} steps), nothing to do")
        return RunPlan(finished=summary)
    resuming = ckpt_path.exists() or previous_path(ckpt_path).exists()
    return RunPlan(resume=resuming, clear=not resuming)  # config written but no checkpoint yet: start over
