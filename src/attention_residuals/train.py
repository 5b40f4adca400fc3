"""Training loop and the ``attnres train`` command.

A run lives in one directory::

    config.json             model + training config, corpus provenance, the command line
    metrics.jsonl           one JSON row per log step: step, train_loss, val_loss, lr, tokens,
                            tokens_per_s, wall_s (+ grad_norm)
    checkpoint.safetensors  weights, optimizer, scheduler, RNG, step (atomic; previous one kept
                            as checkpoint.prev.safetensors)
    summary.json            final numbers and ``"done": true`` once all steps ran

``train(cfg)`` is the Python entry point (sweeps call it; it returns the summary dict) and
``main(argv)`` the command. ``--resume`` continues a run exactly: training ``N`` steps with
``--stop-at N`` then resuming gives bit-for-bit the losses of ``2N`` steps in one go (batches
are a function of ``(seed, step)``, and every piece of state is in the checkpoint). Resuming with
a config that differs from the run's ``config.json`` is an error listing the differing fields;
resuming a finished run returns its summary without training (so sweeps skip done runs).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import shlex
import signal
import sys
import threading
import time
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoint import CheckpointError, load_latest, previous_path, save_checkpoint
from .connections import RESIDUALS
from .data import Corpus, eval_batches, get_batch, load_corpus
from .model import GPT, GPTConfig
from .optim import OPTIMIZERS, SCHEDULES, LRSchedule, build_optimizer, build_scheduler, clip_grad_norm
from .parallel import data_parallel as _dp

__all__ = [
    "ConfigMismatchError",
    "RunError",
    "TrainConfig",
    "build_parser",
    "command_line",
    "config_diff",
    "estimate_loss",
    "check_field_types",
    "is_done",
    "load_corpus_for",
    "load_summary",
    "main",
    "make_config",
    "read_config",
    "read_metrics",
    "resolve_device",
    "train",
]

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_FILE = "checkpoint.safetensors"
SUMMARY_FILE = "summary.json"
RUN_FORMAT = 1


class RunError(RuntimeError):
    """The run directory is not in a state the request fits (finished, occupied...)."""


class ConfigMismatchError(RunError, ValueError):
    """``--resume`` with a config that differs from the run's ``config.json``."""


def _f(default: Any, help: str, run_control: bool = False, **kw: Any) -> Any:
    meta = {"help": help, "run_control": run_control, **kw}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    """Everything a run depends on. ``model`` is a :class:`GPTConfig`; the rest is training.

    Fields marked run-control (``out``, ``resume``, ``overwrite``, ``stop_at``, ``progress``,
    ``device``, ``cache_dir``) steer this invocation and are not part of the run's identity:
    they are not compared on ``--resume``.
    """

    model: GPTConfig = field(default_factory=GPTConfig)
    # optimisation
    steps: int = _f(1000, "optimizer steps in the whole run")
    batch_size: int = _f(16, "sequences per micro-batch (global: torchrun ranks each take batch_size / world_size)")
    grad_accum: int = _f(1, "micro-batches accumulated per optimizer step")
    optimizer: str = _f("adamw", "adamw, or muon (Muon on sublayer matrices, AdamW on the rest)", choices=OPTIMIZERS)
    lr: float = _f(3e-3, "peak learning rate")
    min_lr: float = _f(3e-4, "learning rate at the end of the cosine / WSD decay")
    warmup: int = _f(100, "linear warmup steps")
    schedule: str = _f("cosine", "learning-rate schedule", choices=SCHEDULES)
    decay_frac: float = _f(0.2, "WSD: fraction of the steps spent decaying")
    weight_decay: float = _f(0.1, "decoupled weight decay of 2-D weights (never on norms or residual.*)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0: no clipping)")
    dtype: str = _f("float32", "autocast dtype of the forward pass", choices=("float32", "bfloat16", "float16"))
    seed: int = _f(0, "seed of the initialisation and of the training batches")
    # data
    data: str | None = _f(None, "text file, folder or glob (default: the Python standard library's .py files)")
    val_fraction: float = _f(0.05, "fraction of files held out for validation (split by file)")
    tokenizer: str | None = _f(None, "Hugging Face tokenizer folder (attnres tokenizer train); default: bytes")
    # logging / evaluation / checkpoints
    eval_interval: int = _f(100, "evaluate the validation loss every this many steps (and at the end)")
    eval_batches: int = _f(20, "validation batches per evaluation (fixed windows, same for every run)")
    log_interval: int = _f(10, "write a metrics row every this many steps")
    ckpt_interval: int = _f(0, "save a checkpoint every this many steps (0: at every evaluation)")
    # run control: not part of the run's identity
    out: str = _f("runs/train", "run directory", run_control=True)
    resume: bool = _f(False, "continue the run in --out from its checkpoint (starts fresh if there is none)", True)
    overwrite: bool = _f(False, "delete the run files in --out and start again", True)
    stop_at: int | None = _f(None, "stop (checkpointed, resumable) after this step; the schedule still spans --steps", True)
    progress: bool = _f(True, "show a progress bar", True)
    device: str = _f("auto", "cpu, cuda, cuda:N or auto", True)
    cache_dir: str | None = _f(None, "token cache folder (default $ATTNRES_CACHE or ~/.cache/attention_residuals)", True)

    @classmethod
    def run_control_fields(cls) -> set[str]:
        return {f.name for f in fields(cls) if f.metadata.get("run_control")}

    def identity(self) -> dict:
        """The part of the config that defines the run: model + non-run-control training fields."""
        rc = self.run_control_fields()
        train = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model" and f.name not in rc}
        return {"model": self.model.to_dict(), "train": train}

    def to_dict(self) -> dict:
        d = self.identity()
        d["run"] = {name: getattr(self, name) for name in sorted(self.run_control_fields())}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """From :meth:`to_dict` / a run's ``config.json`` (unknown training keys are an error)."""
        known = {f.name for f in fields(cls)} - {"model"}
        flat = dict(d.get("train", {}))
        flat.update(d.get("run", {}))
        unknown = set(flat) - known
        if unknown:
            raise ValueError(f"TrainConfig: unknown fields {sorted(unknown)}")
        return cls(model=GPTConfig.from_dict(d.get("model", {})), **flat)

    def replace(self, **overrides: Any) -> TrainConfig:
        """A copy with flat overrides routed to the model or training fields (see make_config)."""
        model_names = {f.name for f in fields(GPTConfig)}
        train_names = {f.name for f in fields(TrainConfig)} - {"model"}
        m, t = {}, {}
        for k, v in overrides.items():
            if k in train_names:
                t[k] = v
            elif k in model_names:
                m[k] = v
            elif k == "model":
                t[k] = v
            else:
                raise TypeError(f"unknown config field {k!r}")
        new = dataclasses.replace(self, **t)
        if m:
            new = dataclasses.replace(new, model=dataclasses.replace(new.model, **m))
        return new

    def validate(self) -> TrainConfig:
        """Raise ``ValueError`` naming the field."""
        check_field_types(self.model)
        check_field_types(self)
        self.model.validate()
        for name in ("steps", "batch_size", "grad_accum", "eval_interval", "eval_batches", "log_interval"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected a positive integer, got {v!r}")
        if self.ckpt_interval < 0:
            raise ValueError(f"ckpt_interval: expected >= 0, got {self.ckpt_interval}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer: expected one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: expected float32, bfloat16 or float16, got {self.dtype!r}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr: expected 0 <= min_lr <= lr={self.lr}, got {self.min_lr}")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip: expected >= 0, got {self.grad_clip}")
        if self.stop_at is not None and not 0 <= self.stop_at:
            raise ValueError(f"stop_at: expected >= 0, got {self.stop_at}")
        if self.resume and self.overwrite:
            raise ValueError("resume and overwrite: give at most one of them")
        LRSchedule(self.schedule, self.steps, self.warmup, self.min_lr / self.lr, self.decay_frac)
        return self


def _optional(tp: Any) -> tuple[Any, bool]:
    """``(inner type, True)`` for ``X | None`` (``Any`` when several types remain), else ``(tp, False)``."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return (inner[0] if len(inner) == 1 else Any), True
    return tp, False


# the values each annotated field type accepts (an int passes for a float; a bool is no number)
_TYPE_CHECKS = {
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
}


def check_field_types(config: Any) -> None:
    """Every field of the dataclass ``config`` holds a value of its annotated type: a JSON
    ``"key_norm": "false"`` or ``"lr": "fast"`` fails here, naming the field, instead of being
    taken as true or failing deep inside."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        tp, optional = _optional(hints[f.name])
        if optional and value is None:
            continue
        ok = _TYPE_CHECKS.get(tp)
        if ok is not None and not ok(value):
            article = "an" if tp.__name__[0] in "aeiou" else "a"
            raise ValueError(f"{f.name}: expected {article} {tp.__name__}{' or None' if optional else ''}, "
                             f"got {value!r}")


def make_config(**overrides: Any) -> TrainConfig:
    """``TrainConfig`` from flat keywords: model fields (``residual=``, ``d_model=``...) go to
    ``cfg.model``, the others to the training config. ``make_config(residual="block", n_blocks=4,
    steps=300, out="runs/b4")``."""
    return TrainConfig().replace(**overrides)


# --------------------------------------------------------------------------- helpers


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected cpu, cuda, cuda:N or auto, got {name!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} requested but CUDA is not available")
    return dev


def _autocast(device: torch.device, dtype: str):
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, dtype))


@torch.no_grad()
def estimate_loss(
    model: torch.nn.Module,
    tokens: np.ndarray,
    *,
    n_batches: int,
    batch_size: int,
    seq_len: int,
    device: torch.device | str = "cpu",
    dtype: str = "float32",
) -> float:
    """Mean cross-entropy (nats/token) over the fixed validation windows of ``tokens``."""
    was_training = model.training
    model.eval()
    dev = torch.device(device)
    total = 0.0
    try:
        for x, y in eval_batches(tokens, n_batches, batch_size, seq_len, device=dev):
            with _autocast(dev, dtype):
                _, loss = model(x, y)
            total += float(loss)
    finally:
        model.train(was_training)
    return total / n_batches


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


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def command_line(cfg: TrainConfig, run_control: tuple[str, ...] = ("out",)) -> str:
    """An ``attnres train`` command reproducing ``cfg``: its non-default fields plus the listed
    run-control fields."""
    parts = ["attnres", "train"]
    base_m, base_t = GPTConfig(), TrainConfig()
    pairs = [(f.name, getattr(cfg.model, f.name), getattr(base_m, f.name)) for f in fields(GPTConfig)]
    rc = TrainConfig.run_control_fields()
    pairs += [
        (f.name, getattr(cfg, f.name), getattr(base_t, f.name))
        for f in fields(TrainConfig)
        if f.name != "model" and (f.name not in rc or f.name in run_control)
    ]
    for name, value, default in pairs:
        if value == default and name not in run_control:
            continue
        if isinstance(value, bool):
            if value or name not in _SWITCHES:
                parts.append(_flag(name) if value else "--no-" + name.replace("_", "-"))
        else:
            parts += [_flag(name), "none" if value is None else str(value)]
    return shlex.join(parts)


# --------------------------------------------------------------------------- the loop


def _clear_run(out: Path) -> None:
    for name in (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, CHECKPOINT_FILE, previous_path(out / CHECKPOINT_FILE).name):
        with contextlib.suppress(FileNotFoundError):
            (out / name).unlink()


def _truncate_metrics(out: Path, step: int) -> None:
    rows = [r for r in read_metrics(out) if r.get("step", 0) <= step]
    tmp = out / f".{METRICS_FILE}.tmp-{os.getpid()}"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, out / METRICS_FILE)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def train(cfg: TrainConfig, corpus: Corpus | None = None) -> dict:
    """Train (or resume, or skip) the run ``cfg`` describes; returns its summary dict.

    ``corpus`` overrides ``cfg.data`` (sweeps load a corpus once and share it). Raises
    ``ValueError`` for a bad config, ``FileNotFoundError``/``ValueError`` for bad ``--data``,
    :class:`RunError` for an occupied run directory, :class:`ConfigMismatchError` when resuming
    with another config, and ``CheckpointError`` when no good checkpoint is left.
    """
    cfg = _absolute_paths(cfg.validate())
    env = _dp.setup(cfg.device)  # torchrun / any launcher: data parallel over its ranks
    try:
        return _train(cfg, corpus, env)
    finally:
        _dp.teardown()


_PATH_FIELDS = ("data", "tokenizer")  # recorded as absolute paths


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """``data`` and ``tokenizer`` as absolute paths: the run directory records them, and ``eval`` or
    ``--resume`` may read it from another working directory."""
    return dataclasses.replace(cfg, **{k: _absolute(v) for k in _PATH_FIELDS if (v := getattr(cfg, k))})


class _StopRequest:
    """Ctrl-C during training: the first finishes the step, checkpoints and stops (resumable with
    ``--resume``, exactly); a second aborts at once. Only in the main thread of a single process
    (under torchrun the launcher owns the signal)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested = False
        self._previous = None

    def __enter__(self) -> _StopRequest:
        if self.enabled:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        _log("\ninterrupted: stopping after this step with a checkpoint (Ctrl-C again to abort)")

    def __exit__(self, *exc) -> None:
        if self.enabled:
            signal.signal(signal.SIGINT, self._previous)


def load_corpus_for(cfg: TrainConfig) -> Corpus:
    """The corpus a run trains on: ``cfg.data`` in bytes, or through ``cfg.tokenizer``."""
    if cfg.tokenizer is None:
        return load_corpus(cfg.data, vocab_size=cfg.model.vocab_size, val_fraction=cfg.val_fraction,
                           cache_dir=cfg.cache_dir)
    from .tokenizer import load_tokenized_corpus

    corpus, _ = load_tokenized_corpus(cfg.tokenizer, cfg.data, vocab_size=cfg.model.vocab_size,
                                      val_fraction=cfg.val_fraction, cache_dir=cfg.cache_dir)
    return corpus


def _train(cfg: TrainConfig, corpus: Corpus | None, env) -> dict:
    out = Path(cfg.out)
    device = _dp.device_for(env, resolve_device(cfg.device))
    main = env.is_main  # only rank 0 writes the run directory
    if corpus is None:  # rank 0 first: it fills the token cache the other ranks then read
        corpus = _dp.main_first(env, lambda: load_corpus_for(cfg))
    if corpus.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"vocab_size: the corpus needs {corpus.vocab_size}, the model has {cfg.model.vocab_size}")
    corpus.check_fits(cfg.model.seq_len)
    data_id = {k: corpus.info()[k] for k in ("source", "sha256", "tokenizer", "vocab_size")}
    identity = {**cfg.identity(), "data": data_id}

    ckpt_path = out / CHECKPOINT_FILE
    cfg_path = out / CONFIG_FILE
    resuming = clear = False
    if cfg_path.exists():
        if cfg.overwrite:
            clear = True
        elif not cfg.resume:
            summary = load_summary(out)
            state = "a finished run" if summary and summary.get("done") else "a run"
            raise RunError(
                f"{out} already holds {state} ({CONFIG_FILE} exists); pass --resume to continue it "
                f"or --overwrite to start again"
            )
        else:
            saved = json.loads(cfg_path.read_text())
            saved_train = dict(saved.get("train", {}))
            for key in _PATH_FIELDS:  # runs recorded before paths were made absolute
                if isinstance(saved_train.get(key), str):
                    saved_train[key] = _absolute(saved_train[key])
            saved_id = {
                "model": saved.get("model", {}),
                "train": saved_train,
                "data": {k: saved.get("data", {}).get(k) for k in data_id},
            }
            diff = config_diff(saved_id, identity)
            if diff:
                raise ConfigMismatchError(
                    f"--resume: the config differs from {cfg_path}:\n  " + "\n  ".join(diff)
                )
            summary = load_summary(out)
            if summary and summary.get("done") and summary.get("step") == cfg.steps:
                _log(f"{out}: already finished ({cfg.steps} steps), nothing to do")
                return summary
            resuming = ckpt_path.exists() or previous_path(ckpt_path).exists()
            clear = not resuming  # config written but no checkpoint yet: start over
    elif cfg.resume:
        _log(f"{out}: nothing to resume, starting a new run")
    _dp.barrier(env)  # every rank has decided before rank 0 touches the run directory
    if clear and main:
        _clear_run(out)

    _seed_everything(cfg.seed)
    model = GPT(cfg.model).to(device)
    optimizer = build_optimizer(
        model, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2)
    )
    scheduler = build_scheduler(
        optimizer, cfg.schedule, steps=cfg.steps, warmup=cfg.warmup, lr=cfg.lr, min_lr=cfg.min_lr,
        decay_frac=cfg.decay_frac,
    )
    extra: dict[str, Any] = {}
    start = 0
    if resuming:
        info, warnings = load_latest(ckpt_path, model=model, optimizer=optimizer, scheduler=scheduler)
        for w in warnings:
            _log(f"warning: {w}")
        start, extra = info["step"], info["extra"]
        if main:
            _truncate_metrics(out, start)
        _log(f"{out}: resuming at step {start}/{cfg.steps}")
    elif main:
        out.mkdir(parents=True, exist_ok=True)
        record = {"format": RUN_FORMAT, **cfg.to_dict(), "data": corpus.info(), "command": command_line(cfg)}
        _write_json(cfg_path, record)
        (out / METRICS_FILE).write_text("")
        with contextlib.suppress(FileNotFoundError):
            (out / SUMMARY_FILE).unlink()

    T, B, A = cfg.model.seq_len, _dp.local_batch(cfg.batch_size, env), cfg.grad_accum
    rank, world_size = env.rank, env.world_size
    net = _dp.wrap(model, env)
    tokens_per_step = B * T * A * world_size
    tokens = int(extra.get("tokens", 0))
    wall0 = float(extra.get("wall_s", 0.0))
    train_s = float(extra.get("train_s", 0.0))
    window_tokens = int(extra.get("window_tokens", 0))
    window_s = float(extra.get("window_s", 0.0))
    last_train = extra.get("last_train_loss")
    last_val = extra.get("last_val_loss")
    best_val = extra.get("best_val_loss")
    t_start = time.perf_counter()

    def wall() -> float:
        return wall0 + time.perf_counter() - t_start

    metrics_f = open(out / METRICS_FILE, "a") if main else contextlib.nullcontext()

    def write_row(row: dict) -> None:
        if main:
            metrics_f.write(json.dumps(row) + "\n")
            metrics_f.flush()

    def evaluate() -> float:
        return estimate_loss(
            model, corpus.val, n_batches=cfg.eval_batches, batch_size=cfg.batch_size, seq_len=T, device=device, dtype=cfg.dtype
        )

    def checkpoint(step: int) -> None:
        if not main:
            return
        save_checkpoint(
            ckpt_path, model=model, optimizer=optimizer, scheduler=scheduler, step=step,
            config=identity, keep_previous=True,
            extra={
                "tokens": tokens, "wall_s": wall(), "train_s": train_s, "window_tokens": window_tokens,
                "window_s": window_s, "last_train_loss": last_train, "last_val_loss": last_val,
                "best_val_loss": best_val,
            },
        )

    end = cfg.steps if cfg.stop_at is None else min(cfg.steps, cfg.stop_at)
    ckpt_every = cfg.ckpt_interval or cfg.eval_interval
    stopped = None  # the step a Ctrl-C stopped the run at
    with _StopRequest(world_size == 1) as stop:
        try:
            if start == 0 and not resuming:
                last_val = best_val = evaluate()
                write_row({"step": 0, "train_loss": None, "val_loss": last_val, "lr": scheduler.get_last_lr()[0],
                           "tokens": 0, "tokens_per_s": None, "wall_s": round(wall(), 3)})
            bar = _progress(cfg, start, end, out) if main else None
            model.train()
            for step in range(start, end):
                lr = scheduler.get_last_lr()[0]
                t0 = time.perf_counter()
                loss_sum = torch.zeros((), device=device)
                for micro in range(A):
                    x, y = get_batch(corpus.train, B, T, seed=cfg.seed, step=step * A + micro, rank=rank,
                                     world_size=world_size, device=device)
                    with _dp.sync_context(net, micro == A - 1):  # DDP: all-reduce on the last one only
                        with _autocast(device, cfg.dtype):
                            _, loss = net(x, y)
                        (loss / A).backward()
                    loss_sum += loss.detach()
                grad_norm = clip_grad_norm(model.parameters(), cfg.grad_clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                last_train = float(_dp.mean(loss_sum, env)) / A
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0
                done = step + 1
                train_s += dt
                window_s += dt
                tokens += tokens_per_step
                window_tokens += tokens_per_step
                if not math.isfinite(last_train):
                    raise RunError(f"{out}: the training loss became {last_train} at step {done}; lower --lr?")
                val = None
                if done % cfg.eval_interval == 0 or done == cfg.steps:
                    val = last_val = evaluate()
                    best_val = val if best_val is None else min(best_val, val)
                if done % cfg.log_interval == 0 or val is not None or done == cfg.steps:
                    tps = window_tokens / window_s if window_s > 0 else None
                    write_row({"step": done, "train_loss": last_train, "val_loss": val, "lr": lr, "tokens": tokens,
                               "tokens_per_s": None if tps is None else round(tps, 1), "wall_s": round(wall(), 3),
                               "grad_norm": float(grad_norm)})
                    window_tokens, window_s = 0, 0.0
                if done % ckpt_every == 0 or done == end or stop.requested:
                    checkpoint(done)
                if bar is not None:
                    post = {"loss": f"{last_train:.4f}", "tok/s": f"{tokens_per_step / dt:,.0f}"}
                    if last_val is not None:
                        post["val"] = f"{last_val:.4f}"
                    bar.set_postfix(post, refresh=False)
                    bar.update(1)
                if stop.requested:  # checkpointed above
                    stopped = done
                    _log(f"{out}: stopped at step {done}/{cfg.steps}; continue with --resume")
                    break
            if bar is not None:
                bar.close()
        finally:
            if main:
                metrics_f.close()

    final_step = max(start, end) if stopped is None else stopped
    summary = {
        "done": final_step >= cfg.steps,
        "interrupted": stopped is not None,
        "step": final_step,
        "steps": cfg.steps,
        "run_dir": str(out),
        "residual": cfg.model.residual,
        "final_train_loss": last_train,
        "final_val_loss": last_val,
        "best_val_loss": best_val,
        "params": model.num_params(),
        "params_total": model.num_params(non_embedding=False),
        "flops_per_token": model.flops_per_token(),
        "tokens": tokens,
        "tokens_per_s": tokens / train_s if train_s > 0 else None,
        "train_s": round(train_s, 3),
        "wall_s": round(wall(), 3),
        "device": str(device),
        "corpus": corpus.info(),
        "command": command_line(cfg),
    }
    if main:
        summary["world_size"] = world_size
        _write_json(out / SUMMARY_FILE, summary)
    _dp.barrier(env)
    return summary


def _progress(cfg: TrainConfig, start: int, end: int, out: Path):
    if not cfg.progress or end <= start:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=end, initial=start, desc=out.name, unit="step", dynamic_ncols=True, file=sys.stderr)


# --------------------------------------------------------------------------- command line

_MODEL_HELP = {
    "vocab_size": "vocabulary size (256 for byte tokens)",
    "n_layer": "transformer blocks (L = 2 * n_layer sublayers: attention and MLP)",
    "n_head": "attention heads",
    "d_model": "model width",
    "seq_len": "context length in tokens",
    "residual": "depth-mixing rule",
    "block_size": "Block AttnRes block size S, in sublayers",
    "n_blocks": "Block AttnRes number of blocks N (instead of --block-size)",
    "query": "depth-attention query: static (learned vector per layer), input (projection of the hidden state), lowrank",
    "normalize": "depth-attention normalisation: softmax or sigmoid",
    "heads": "depth-attention heads (d_model split into groups, a softmax each)",
    "key_norm": "RMSNorm the depth-attention keys",
    "window": "swa: number of most recent sources attended",
    "streams": "mhc: number of residual streams m",
    "query_rank": "lowrank query: rank",
    "intra_gate": "gate the intra-block partial sum",
    "mlp_hidden": "SwiGLU hidden width (default 8/3 d_model rounded up to 64)",
    "rope_theta": "RoPE base",
    "norm_eps": "RMSNorm epsilon",
    "init_std": "std of the normal initialisation",
    "tie_embeddings": "tie the LM head to the token embedding",
}
_MODEL_CHOICES = {"residual": RESIDUALS, "normalize": ("softmax", "sigmoid")}


def _none_or(conv):
    def parse(s: str):
        return None if s.lower() in ("none", "null") else conv(s)

    parse.__name__ = getattr(conv, "__name__", "value")
    return parse


def _arg_type(tp: Any):
    """(argparse type, is_bool) for a resolved dataclass field type."""
    inner, optional = _optional(tp)
    if optional:
        base, is_bool = (json.loads, False) if inner is Any else _arg_type(inner)
        return _none_or(base), is_bool
    if tp is bool:
        return None, True
    if tp in (int, float, str):
        return tp, False
    return json.loads, False


def _add_fields(group_for, cls, defaults, help_for, choices_for) -> None:
    """One flag per dataclass field of ``cls`` (``--d-model``; bools get ``--x/--no-x``).

    Defaults are suppressed so that only the flags actually given override a base config.
    """
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.name == "model":
            continue
        conv, is_bool = _arg_type(hints[f.name])
        default = getattr(defaults, f.name)
        text = help_for(f) or f"{cls.__name__}.{f.name}"
        group = group_for(f)
        flag = _flag(f.name)
        if is_bool and f.name in _SWITCHES:
            group.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=text)
        elif is_bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=f"{text} (default: {default})")
        else:
            choices = choices_for(f)
            kw: dict[str, Any] = {"type": conv, "default": argparse.SUPPRESS, "dest": f.name}
            if choices:
                kw["choices"] = list(choices)
                kw["metavar"] = "{" + ",".join(choices) + "}"
            else:
                kw["metavar"] = f.name.upper()
            group.add_argument(flag, help=f"{text} (default: {default})", **kw)


_SWITCHES = ("resume", "overwrite")  # plain on-switches, no --no-x form


def build_parser(prog: str = "attnres train") -> argparse.ArgumentParser:
    """The ``attnres train`` parser: one flag per GPTConfig and TrainConfig field."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train a GPT whose depth mixing is any residual rule (PreNorm baseline, Full / Block "
        "AttnRes, DenseFormer, mHC, depth-SWA, mixing). The run directory holds config.json, "
        "metrics.jsonl, checkpoint.safetensors and, when done, summary.json.",
        epilog="examples:\n"
        "  attnres train --out runs/base --steps 2000\n"
        "  attnres train --residual block --n-blocks 4 --d-model 128 --out runs/block\n"
        "  attnres train --out runs/x --steps 2000 --stop-at 1000   # later: the same with --resume\n"
        "  attnres train --data corpus/ --seq-len 512 --optimizer muon --schedule wsd --out runs/wsd",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="JSON", default=None,
                   help="start from this config (e.g. a run's config.json); the other flags override it")
    mg = p.add_argument_group("model")
    _add_fields(lambda f: mg, GPTConfig, GPTConfig(), lambda f: _MODEL_HELP.get(f.name),
                lambda f: _MODEL_CHOICES.get(f.name))
    tg = p.add_argument_group("training")
    rg = p.add_argument_group("run control (not part of the run's identity)")
    _add_fields(lambda f: rg if f.metadata.get("run_control") else tg, TrainConfig, TrainConfig(),
                lambda f: f.metadata.get("help"), lambda f: f.metadata.get("choices"))
    return p


def read_config(path: str | os.PathLike) -> tuple[TrainConfig, set[str]]:
    """A config file: a run's ``config.json`` (sections ``model``, ``train``, ``run``) or one flat
    object of fields (``{"d_model": 64, "steps": 500}``). Returns it and the model fields it sets;
    ``ValueError`` / ``FileNotFoundError`` name the file and what is wrong."""
    try:
        d = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"--config {str(path)!r}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {str(path)!r}: not a JSON file ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"--config {str(path)!r}: expected a JSON object, got a {type(d).__name__}")
    sections = {"model", "train", "run"}
    try:
        if sections & set(d):
            other = set(d) - sections - {"format", "data", "command"}  # the rest of a run's config.json
            if other:
                raise ValueError(f"unknown sections {sorted(other)} beside {sorted(sections & set(d))}")
            return TrainConfig.from_dict(d), set(d.get("model", {}))
        return TrainConfig().replace(**d), set(d) & {f.name for f in fields(GPTConfig)}
    except (TypeError, ValueError) as e:
        raise ValueError(f"--config {str(path)!r}: {e}") from None


def config_from_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse ``attnres train`` arguments into a :class:`TrainConfig` (argparse errors exit 2).

    With ``--tokenizer`` and no vocabulary size given, the model's is the tokenizer's."""
    ns = vars(build_parser().parse_args(argv))
    base, given = TrainConfig(), set(ns)
    path = ns.pop("config", None)
    if path:
        base, in_file = read_config(path)
        given |= in_file
    cfg = base.replace(**ns)
    if cfg.tokenizer is not None and "vocab_size" not in given:
        from .tokenizer import load_tokenizer

        cfg = cfg.replace(vocab_size=len(load_tokenizer(cfg.tokenizer)))
    return cfg


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 (trained), 2 (bad input: the message names it), 130 (stopped by Ctrl-C, resumable)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        summary = train(config_from_args(argv))
    except (ValueError, FileNotFoundError, RunError, CheckpointError) as e:
        print(f"attnres train: error: {e}", file=sys.stderr)
        return 2
    if not _dp.is_main():
        return 0
    print(json.dumps({k: summary[k] for k in ("run_dir", "done", "step", "final_val_loss", "final_train_loss",
                                              "params", "tokens_per_s", "wall_s")}))
    return 130 if summary.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())
