"""The training loop: ``train(cfg)`` trains, resumes or skips the run ``cfg`` describes.

:func:`train` is the Python entry point (sweeps call it; it returns the summary dict).
``--resume`` continues a run exactly: training ``N`` steps with ``--stop-at N`` then resuming
gives bit-for-bit the losses of ``2N`` steps in one go (batches are a function of
``(seed, step)``, and every piece of state is in the checkpoint). What to do with an existing run
directory is :func:`.run.plan_run`'s decision.

The pieces, in the order a run uses them: a :class:`RunContext` (what stays fixed: config,
device, corpus, identity), a :class:`TrainState` (what changes: model, optimizer, scheduler,
step, counters; all of it checkpointed), :func:`train_step` (one optimizer step), a
:class:`MetricsWriter` (the rows of ``metrics.jsonl``), :func:`evaluate`, :func:`save_state` /
:func:`resume_state` (checkpoints) and :func:`summarize` (``summary.json``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from tqdm.auto import tqdm

from ..files import open_append
from ..model import GPT
from ..parallel import data_parallel as _dp
from ..parallel.dist import DistEnv, check_consistent
from ..parallel.fsdp import shard_model
from ..parallel.pipelining import PipelinedGPT
from .checkpoint import save_checkpoint
from .config import TrainConfig, absolute_paths, flat_values
from .data import Corpus, eval_batches, get_batch, split_windows
from .depth import depth_parameters, depth_weight_summary, parameter_step
from .optim import build_optimizer, build_scheduler, clip_grad_norm
from .prepare import load_corpus_for
from .run import (
    CHECKPOINT_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    RunError,
    RunLockedError,
    checkpoint_check,
    clear_run,
    command_line,
    load_run_checkpoint,
    log,
    plan_run,
    run_identity,
    run_lock,
    run_record,
    start_run_files,
    truncate_metrics,
    write_json,
)
from .sharded import DCP_DIR, save_sharded

__all__ = [
    "MetricsWriter",
    "RunContext",
    "StepResult",
    "TrainState",
    "autocast",
    "estimate_loss",
    "evaluate",
    "load_corpus_for",
    "resolve_device",
    "resume_state",
    "save_state",
    "summarize",
    "train",
    "train_step",
]


# --------------------------------------------------------------------------- devices, data, losses


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected cpu, cuda, cuda:N or auto, got {name!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} requested but CUDA is not available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device: {name!r} requested but there are {torch.cuda.device_count()} CUDA devices")
    return dev


def autocast(device: torch.device, dtype: str):
    """The forward pass's autocast context (none for float32)."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, dtype))


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """``--dtype auto``: bfloat16 autocast on CUDA (what GPU training uses), float32 on CPU (where
    bf16 matmuls are slower than float32 on most CPUs). A run records the resolved name, so resume,
    eval, sample and export use the precision it trained in."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.type == "cuda" else "float32"


def grad_scaler(dtype: str, device: torch.device, pipelined: bool = False) -> torch.amp.GradScaler | None:
    """float16 needs loss scaling (its exponent range underflows small gradients); bf16 does not.
    A pipeline's ranks hold different gradients, so there an overflow on any rank skips the step
    on every rank (``ShardedGradScaler`` all-reduces the overflow flag); FSDP's DTensor gradients
    reduce it themselves."""
    if dtype != "float16":
        return None
    return ShardedGradScaler(device.type) if pipelined else torch.amp.GradScaler(device.type)


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
            with autocast(dev, dtype):
                _, loss = model(x, y)
            total += float(loss)
    finally:
        model.train(was_training)
    return total / n_batches


SPLIT_TOKENS = 1 << 16  # tokens per forward of the whole-split evaluation, at most
SPLIT_LOGITS = 1 << 28  # float32 logits per forward, at most (1 GiB)


def split_batch(batch_size: int, seq_len: int, vocab_size: int) -> int:
    """Windows per forward of the whole-split evaluation: the training batch, or more where the
    tokens (at most ``SPLIT_TOKENS``) and their logits (at most ``SPLIT_LOGITS``) stay small — the
    loss does not depend on the grouping, and a small model's split is scored in fewer calls."""
    tokens = min(SPLIT_TOKENS, SPLIT_LOGITS // vocab_size)
    return max(batch_size, tokens // seq_len)


@torch.no_grad()
def split_loss(
    model: torch.nn.Module,
    tokens: np.ndarray,
    *,
    batch_size: int,
    seq_len: int,
    device: torch.device | str = "cpu",
    dtype: str = "float32",
) -> dict[str, float | int]:
    """Cross-entropy (nats/token) over the whole split in disjoint windows (:func:`.split_windows`):
    ``loss`` the mean over every scored token, ``se`` its standard error from the spread of the
    windows' means (disjoint windows: nearly independent), ``tokens`` and ``windows`` scored."""
    was_training = model.training
    model.eval()
    dev = torch.device(device)
    means = []
    try:
        for x, y in split_windows(tokens, batch_size, seq_len, device=dev):
            with autocast(dev, dtype):
                logits = model(x)
            ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
            means.append(ce.view_as(y).double().mean(1).cpu())
    finally:
        model.train(was_training)
    w = torch.cat(means)
    n = w.numel()
    se = float(w.std() / math.sqrt(n)) if n > 1 else float("nan")
    return {"loss": float(w.mean()), "se": se, "tokens": n * seq_len, "windows": n}


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


# --------------------------------------------------------------------------- the run's pieces


@dataclass(frozen=True)
class RunContext:
    """What stays fixed while a run trains."""

    cfg: TrainConfig
    env: DistEnv  # data-parallel rank and world size (a single process: rank 0 of 1)
    device: torch.device
    corpus: Corpus
    identity: dict  # what a resume must match (config identity + corpus)
    micro_batch: int  # this rank's rows of each global micro-batch
    mesh: DeviceMesh | None = None  # --pp-stages: ("dp", "pp"), made once the ranks agree on the config

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)

    @property
    def is_main(self) -> bool:  # only rank 0 writes the run directory
        return self.env.is_main

    @property
    def data_ranks(self) -> tuple[int, int]:
        """``(rank, world size)`` of the data-parallel dimension: every rank of a pipeline
        replica reads the same rows (the first stage its ids, the last its targets)."""
        P = self.cfg.pp_stages
        return (self.env.rank // P, self.env.world_size // P)

    def group(self, dim: str):
        """The process group of mesh dimension ``dim`` (``None``: no mesh, the default group)."""
        return self.mesh.get_group(dim) if self.mesh is not None else None

    @property
    def sharded(self) -> bool:
        """Whether checkpoints are sharded (each rank holds part of the state)."""
        return self.cfg.fsdp or self.cfg.pp_stages > 1

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.cfg.model.seq_len * self.cfg.grad_accum * self.data_ranks[1]

    @property
    def end(self) -> int:
        """The step this invocation stops after (``--stop-at``, else the last one)."""
        return self.cfg.steps if self.cfg.stop_at is None else min(self.cfg.steps, self.cfg.stop_at)


def make_context(cfg: TrainConfig, corpus: Corpus | None, env: DistEnv) -> RunContext:
    """The device, the corpus (loaded here unless given; rank 0 first: it fills the token cache
    the other ranks then read), checked against the model, and the run's identity."""
    device = _dp.device_for(env, resolve_device(cfg.device))
    if corpus is None:
        corpus = _dp.main_first(env, lambda: load_corpus_for(cfg))
    if corpus.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"vocab_size: the corpus needs {corpus.vocab_size}, the model has {cfg.model.vocab_size} "
            f"(pass --vocab-size {corpus.vocab_size})"
        )
    corpus.check_fits(cfg.model.seq_len)
    P = cfg.pp_stages
    if env.world_size % P:
        raise ValueError(
            f"pp_stages: {P} pipeline stages need a multiple of {P} ranks (world_size / pp_stages "
            f"data-parallel replicas of the pipeline), the job has world_size={env.world_size}; "
            f"run torchrun --nproc-per-node {P} (or {2 * P}, ...)"
        )
    micro_batch = _dp.local_batch(cfg.batch_size, env.world_size // P)
    if P > 1 and micro_batch % cfg.pipeline_microbatches:
        raise ValueError(
            f"pp_microbatches: {cfg.pipeline_microbatches} does not divide a replica's micro-batch of "
            f"{micro_batch} (batch_size={cfg.batch_size} over {env.world_size // P} replicas)"
        )
    return RunContext(cfg, env, device, corpus, run_identity(cfg, corpus.info()), micro_batch)


# the counters a checkpoint's ``extra`` holds, with their defaults
_COUNTERS = {
    "tokens": 0,
    "wall_s": 0.0,
    "train_s": 0.0,
    "window_tokens": 0,
    "window_s": 0.0,
    "last_train_loss": None,
    "last_val_loss": None,
    "best_val_loss": None,
}


@dataclass
class TrainState:
    """Everything that changes while training; a checkpoint holds all of it (weights, optimizer,
    scheduler and RNG, and the counters as its ``extra``)."""

    model: GPT
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    net: torch.nn.Module | None = None  # what the forward pass calls: the model, compiled, DDP-wrapped
    scaler: torch.amp.GradScaler | None = None  # float16's loss scaling (its state is checkpointed)
    pp: PipelinedGPT | None = None  # --pp-stages: this rank's stages (the model's others are frozen)
    step: int = 0  # optimizer steps done
    tokens: int = 0  # training tokens seen, all ranks
    train_s: float = 0.0  # seconds spent in train_step
    window_tokens: int = 0  # tokens / seconds since the last metrics row (its tokens_per_s)
    window_s: float = 0.0
    last_train_loss: float | None = None
    last_val_loss: float | None = None
    best_val_loss: float | None = None
    wall_offset: float = 0.0  # wall seconds of the earlier invocations of this run
    clock: float = field(default_factory=time.perf_counter)  # when this invocation's clock started

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def wall(self) -> float:
        return self.wall_offset + time.perf_counter() - self.clock

    def counters(self) -> dict[str, Any]:
        """The checkpoint's ``extra``."""
        out = {name: self.wall() if name == "wall_s" else getattr(self, name) for name in _COUNTERS}
        if self.scaler is not None:
            out["grad_scaler"] = self.scaler.state_dict()
        return out

    def restore_counters(self, extra: dict[str, Any]) -> None:
        if self.scaler is not None and "grad_scaler" in extra:
            self.scaler.load_state_dict(extra["grad_scaler"])
        for name, default in _COUNTERS.items():
            value = extra.get(name, default)
            if name == "wall_s":
                self.wall_offset = float(value)
            else:
                setattr(self, name, value if default is None else type(default)(value))

    def advance(self, loss: float, tokens: int, seconds: float) -> None:
        """Account for one optimizer step."""
        self.step += 1
        self.last_train_loss = loss
        self.train_s += seconds
        self.window_s += seconds
        self.tokens += tokens
        self.window_tokens += tokens

    def record_val(self, loss: float) -> None:
        self.last_val_loss = loss
        self.best_val_loss = loss if self.best_val_loss is None else min(self.best_val_loss, loss)

    def take_window_rate(self) -> float | None:
        """Tokens per second since the last call (the last metrics row); starts a new window."""
        rate = self.window_tokens / self.window_s if self.window_s > 0 else None
        self.window_tokens, self.window_s = 0, 0.0
        return rate


def build_state(cfg: TrainConfig, device: torch.device, mesh: DeviceMesh | None = None) -> TrainState:
    """A freshly initialised model (seeded by ``cfg.seed``; with ``--fsdp`` sharded over the
    ranks before the optimizer sees its parameters; with ``--pp-stages`` cut into the stages of
    ``mesh``'s pp dimension, and with ``--fsdp`` too each stage sharded over its dp dimension),
    its optimizer and its schedule."""
    seed_everything(cfg.seed)
    model = GPT(cfg.model).to(device)
    model.activation_checkpointing = cfg.activation_checkpointing
    if cfg.fsdp and cfg.pp_stages == 1:
        shard_model(model, cfg.dtype)
    pp = None
    if cfg.pp_stages > 1:  # before the optimizer: it takes only this rank's (unfrozen) parameters
        pp = PipelinedGPT(
            model,
            virtual=cfg.pp_virtual,
            schedule=cfg.pp_schedule,
            scheme="cached",
            microbatches=cfg.pipeline_microbatches,
            group=mesh.get_group("pp") if mesh is not None else None,
            shard_mesh=mesh["dp"] if mesh is not None and cfg.fsdp else None,
            dtype=cfg.dtype,
        )
    optimizer = build_optimizer(
        model,
        cfg.optimizer,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        betas=(cfg.beta1, cfg.beta2),
        depth_lr_scale=cfg.depth_lr_scale,
        depth_weight_decay=cfg.depth_weight_decay,
    )
    scheduler = build_scheduler(
        optimizer,
        cfg.schedule,
        steps=cfg.steps,
        warmup=cfg.warmup,
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        decay_frac=cfg.decay_frac,
    )
    scaler = grad_scaler(cfg.dtype, device, pipelined=pp is not None)
    return TrainState(model, optimizer, scheduler, scaler=scaler, pp=pp)


@dataclass(frozen=True)
class StepResult:
    lr: float  # the learning rate the step used
    loss: float  # mean training loss of its micro-batches, over all ranks
    grad_norm: torch.Tensor  # total gradient norm before clipping
    seconds: float
    depth: dict[str, float] | None = None  # --log-depth: depth-mixing parameter, gradient, update RMS


def micro_batch(ctx: RunContext, state: TrainState, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of micro-batch ``micro`` of the current step (a function of the seed,
    the step and the data-parallel rank)."""
    rank, world = ctx.data_ranks
    return get_batch(
        ctx.corpus.train,
        ctx.micro_batch,
        ctx.cfg.model.seq_len,
        seed=ctx.cfg.seed,
        step=state.step * ctx.cfg.grad_accum + micro,
        rank=rank,
        world_size=world,
        device=ctx.device,
    )


def backward(
    ctx: RunContext, state: TrainState, x: torch.Tensor, y: torch.Tensor, micro: int
) -> torch.Tensor:
    """Forward and backward of one micro-batch (its gradient scaled by ``1 / grad_accum``, the
    reductions over ranks on the last one only); its mean loss (this rank's rows; a pipeline's:
    the whole micro-batch's)."""
    A, last = ctx.cfg.grad_accum, micro == ctx.cfg.grad_accum - 1
    if state.pp is not None:  # the schedule runs the pipeline's own microbatches
        with autocast(ctx.device, ctx.cfg.dtype):
            loss = state.pp.step(x, y, scale=1.0 / A, sync=last, scaler=state.scaler)
        if last:  # the replicas of each stage average their gradients (FSDP's: reduce-scattered)
            _dp.average_gradients(state.pp.replicated_parameters(), ctx.group("dp"))
        return loss
    with _dp.sync_context(state.net, last):  # DDP / FSDP: reduce on the last micro-batch only
        with autocast(ctx.device, ctx.cfg.dtype):
            _, loss = state.net(x, y)
        scaled = loss / A
        (state.scaler.scale(scaled) if state.scaler is not None else scaled).backward()
    return loss.detach()


def train_step(ctx: RunContext, state: TrainState) -> StepResult:
    """One optimizer step over ``grad_accum`` micro-batches; advances ``state``."""
    cfg = ctx.cfg
    lr = state.lr
    t0 = time.perf_counter()
    loss_sum = torch.zeros((), device=ctx.device)
    for micro in range(cfg.grad_accum):
        loss_sum += backward(ctx, state, *micro_batch(ctx, state, micro), micro)
    if state.scaler is not None:
        state.scaler.unscale_(state.optimizer)  # clip the true gradients
    if state.pp is not None:  # the norm over every stage's gradients
        grad_norm = state.pp.clip_grad_norm_(cfg.grad_clip)
    else:
        grad_norm = clip_grad_norm(state.model.parameters(), cfg.grad_clip)
    depth = None
    if cfg.log_depth and _logged(cfg, state.step + 1):  # the optimizer step of a row to be written
        depth = parameter_step(depth_parameters(state.model), partial(_optimizer_step, state))
    else:
        _optimizer_step(state)
    state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
    # a pipeline's ranks all hold their replica's loss: the mean over the replicas
    mean_loss = float(_dp.mean(loss_sum, ctx.env, ctx.group("dp"))) / cfg.grad_accum
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    seconds = time.perf_counter() - t0
    state.advance(mean_loss, ctx.tokens_per_step, seconds)
    return StepResult(lr, mean_loss, grad_norm, seconds, depth)


def _optimizer_step(state: TrainState) -> None:
    if state.scaler is not None:
        state.scaler.step(state.optimizer)  # skipped when a gradient overflowed
        state.scaler.update()
    else:
        state.optimizer.step()


class MetricsWriter:
    """Appends the rows of ``metrics.jsonl`` (on rank 0; elsewhere it writes nothing)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self._file = open_append(path) if enabled else None  # closed by __exit__; never via a symlink

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._file is not None:
            self._file.close()

    def write(self, row: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()

    def first_row(self, state: TrainState) -> None:
        """Step 0: the validation loss of the initial model."""
        self.write(
            {
                "step": 0,
                "train_loss": None,
                "val_loss": state.last_val_loss,
                "lr": state.lr,
                "tokens": 0,
                "tokens_per_s": None,
                "wall_s": round(state.wall(), 3),
            }
        )

    def step_row(
        self, state: TrainState, result: StepResult, val_loss: float | None, depth: dict | None = None
    ) -> None:
        """A step's row; ``depth`` (``--log-depth``): the depth-weight summary of an evaluation
        step and the step's depth-mixing parameter statistics."""
        tps = state.take_window_rate()
        row = {
            "step": state.step,
            "train_loss": result.loss,
            "val_loss": val_loss,
            "lr": result.lr,
            "tokens": state.tokens,
            "tokens_per_s": None if tps is None else round(tps, 1),
            "wall_s": round(state.wall(), 3),
            "grad_norm": float(result.grad_norm),
        }
        if result.depth is not None or depth is not None:
            row["depth"] = {**(result.depth or {}), **(depth or {})}
        self.write(row)


def evaluate(ctx: RunContext, state: TrainState) -> float:
    """The validation loss (fixed windows of the global batch size), recorded in ``state``."""
    cfg = ctx.cfg
    if state.pp is not None:
        loss = _pipeline_loss(ctx, state.pp)
        state.record_val(loss)
        return loss
    loss = estimate_loss(
        state.model,
        ctx.corpus.val,
        n_batches=cfg.eval_batches,
        batch_size=cfg.batch_size,
        seq_len=cfg.model.seq_len,
        device=ctx.device,
        dtype=cfg.dtype,
    )
    state.record_val(loss)
    return loss


def depth_summary(ctx: RunContext, state: TrainState) -> dict:
    """``--log-depth``: :func:`.depth.depth_weight_summary` on the first validation batch (the
    same fixed windows every evaluation starts with; no random numbers drawn). Rank 0 only: it
    writes the row, and the replicas hold the same weights."""
    x, _ = next(
        iter(eval_batches(ctx.corpus.val, 1, ctx.cfg.batch_size, ctx.cfg.model.seq_len, device=ctx.device))
    )
    model = state.model
    was_training = model.training
    try:
        with autocast(ctx.device, ctx.cfg.dtype):
            return depth_weight_summary(model.eval(), x)
    finally:
        model.train(was_training)


@torch.no_grad()
def _pipeline_loss(ctx: RunContext, pp: PipelinedGPT) -> float:
    """:func:`estimate_loss` through the pipeline (forward only): the same windows."""
    cfg = ctx.cfg
    total = 0.0
    for x, y in eval_batches(
        ctx.corpus.val, cfg.eval_batches, cfg.batch_size, cfg.model.seq_len, device=ctx.device
    ):
        with autocast(ctx.device, cfg.dtype):
            total += float(pp.evaluate(x, y))
    return total / cfg.eval_batches


def save_state(ctx: RunContext, state: TrainState) -> None:
    """Checkpoint ``state``, the previous checkpoint kept beside it: sharded by every rank with
    ``--fsdp`` or ``--pp-stages`` (:func:`.sharded.save_sharded`), else one file written by rank 0."""
    if ctx.sharded:
        save_sharded(
            ctx.out / DCP_DIR,
            model=state.model,
            optimizer=state.optimizer,
            scheduler=state.scheduler,
            step=state.step,
            config=ctx.identity,
            extra=state.counters(),
        )
    elif ctx.is_main:
        save_checkpoint(
            ctx.out / CHECKPOINT_FILE,
            model=state.model,
            optimizer=state.optimizer,
            scheduler=state.scheduler,
            step=state.step,
            config=ctx.identity,
            keep_previous=True,
            extra=state.counters(),
        )


def resume_state(ctx: RunContext, state: TrainState) -> None:
    """Load the newest good checkpoint (either format, any world size) into ``state`` (RNG
    included) and drop the metrics rows written after it."""
    info, warnings = load_run_checkpoint(
        ctx.out,
        model=state.model,
        optimizer=state.optimizer,
        scheduler=state.scheduler,
        check_config=checkpoint_check(ctx.identity),  # a checkpoint copied from another run is refused
    )
    for w in warnings:
        log(f"warning: {w}")
    state.step = info["step"]
    state.restore_counters(info["extra"])
    if ctx.is_main:
        truncate_metrics(ctx.out, state.step)
    log(f"{ctx.out}: resuming at step {state.step}/{ctx.cfg.steps}")


class ProgressBar:
    """The tqdm bar of rank 0 (none with ``--no-progress`` or nothing to train)."""

    def __init__(self, ctx: RunContext, start: int) -> None:
        shown = ctx.is_main and ctx.cfg.progress and ctx.end > start
        self._bar = (
            tqdm(
                total=ctx.end,
                initial=start,
                desc=ctx.out.name,
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )
            if shown
            else None
        )

    def update(self, state: TrainState, result: StepResult, tokens_per_step: int) -> None:
        if self._bar is None:
            return
        post = {"loss": f"{result.loss:.4f}", "tok/s": f"{tokens_per_step / result.seconds:,.0f}"}
        if state.last_val_loss is not None:
            post["val"] = f"{state.last_val_loss:.4f}"
        self._bar.set_postfix(post, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class StopRequest:
    """Ctrl-C during training: the first finishes the step, checkpoints and stops (resumable with
    ``--resume``, exactly); a second aborts at once. Only in the main thread of a single process
    (under torchrun the launcher owns the signal)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested = False
        self._previous = None

    def __enter__(self) -> StopRequest:
        if self.enabled:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log("\ninterrupted: stopping after this step with a checkpoint (Ctrl-C again to abort)")

    def __exit__(self, *exc) -> None:
        if self.enabled:
            signal.signal(signal.SIGINT, self._previous)


# --------------------------------------------------------------------------- the loop


def _due(step: int, every: int) -> bool:
    return step % every == 0


def _logged(cfg: TrainConfig, step: int) -> bool:
    """Whether step ``step`` (1-based, done) writes a metrics row."""
    return _due(step, cfg.log_interval) or _due(step, cfg.eval_interval) or step == cfg.steps


def after_step(
    ctx: RunContext, state: TrainState, result: StepResult, metrics: MetricsWriter, stopping: bool
) -> None:
    """The bookkeeping of a step: check the loss, evaluate, log, checkpoint, each when due."""
    cfg, done = ctx.cfg, state.step
    if not math.isfinite(result.loss):
        raise RunError(f"{ctx.out}: the training loss became {result.loss} at step {done}; lower --lr?")
    last = done == cfg.steps
    val = evaluate(ctx, state) if _due(done, cfg.eval_interval) or last else None
    depth = depth_summary(ctx, state) if val is not None and cfg.log_depth and ctx.is_main else None
    if _logged(cfg, done):
        metrics.step_row(state, result, val, depth)
    if _due(done, cfg.ckpt_interval or cfg.eval_interval) or done == ctx.end or stopping:
        save_state(ctx, state)


def run_steps(ctx: RunContext, state: TrainState, metrics: MetricsWriter, stop: StopRequest) -> bool:
    """Train from ``state.step`` to ``ctx.end``; True when a Ctrl-C stopped it (checkpointed)."""
    bar = ProgressBar(ctx, state.step)
    state.model.train()
    interrupted = False
    while state.step < ctx.end and not interrupted:
        result = train_step(ctx, state)
        interrupted = stop.requested  # read once: a step that stops is a step that checkpoints
        after_step(ctx, state, result, metrics, interrupted)
        bar.update(state, result, ctx.tokens_per_step)
    if interrupted:
        log(f"{ctx.out}: stopped at step {state.step}/{ctx.cfg.steps}; continue with --resume")
    bar.close()
    return interrupted


def summarize(ctx: RunContext, state: TrainState, interrupted: bool) -> dict:
    """The content of ``summary.json`` (``world_size`` is added on rank 0)."""
    cfg, model = ctx.cfg, state.model
    return {
        "done": state.step >= cfg.steps,
        "interrupted": interrupted,
        "step": state.step,
        "steps": cfg.steps,
        "run_dir": str(ctx.out),
        "residual": flat_values(cfg)["residual"],
        "final_train_loss": state.last_train_loss,
        "final_val_loss": state.last_val_loss,
        "best_val_loss": state.best_val_loss,
        "params": model.num_params(),
        "params_total": model.num_params(non_embedding=False),
        "flops_per_token": model.flops_per_token(),
        "tokens": state.tokens,
        "tokens_per_s": state.tokens / state.train_s if state.train_s > 0 else None,
        "train_s": round(state.train_s, 3),
        "wall_s": round(state.wall(), 3),
        "device": str(ctx.device),
        "corpus": ctx.corpus.info(),
        "command": command_line(cfg),
    }


def train(cfg: TrainConfig, corpus: Corpus | None = None) -> dict:
    """Train (or resume, or skip) the run ``cfg`` describes; returns its summary dict.

    ``corpus`` overrides ``cfg.data`` (sweeps load a corpus once and share it). Raises
    ``ValueError`` for a bad config, ``FileNotFoundError``/``ValueError`` for bad ``--data``,
    :class:`RunError` for an occupied run directory (:class:`RunLockedError`: another training
    writes it), :class:`ConfigMismatchError` when resuming with another config, and
    ``CheckpointError`` when no good checkpoint is left (``CheckpointMismatchError``: the
    checkpoint is another run's).
    """
    cfg = absolute_paths(cfg.validate())
    cfg = dataclasses.replace(cfg, dtype=resolve_dtype(cfg.dtype, resolve_device(cfg.device)))
    env = _dp.setup(cfg.device)  # torchrun / any launcher: data parallel over its ranks
    try:
        if cfg.fsdp and not env.launched:
            raise ValueError(
                "fsdp: FSDP2 shards over the ranks of a process group; start the run with "
                "`torchrun --nproc-per-node N -m attention_residuals.train ...` (or drop --fsdp)"
            )
        with _locked(cfg.out, env):  # one writer per run directory
            return _train(cfg, corpus, env)
    finally:
        _dp.teardown()


@contextlib.contextmanager
def _locked(out: Path, env: DistEnv):
    """Rank 0 holds ``out``'s lock for the body; every rank learns whether it got it, so a run
    directory in use (or not usable) fails all ranks at once with the same named error."""
    with contextlib.ExitStack() as stack:
        error: RunError | None = None
        if env.is_main:
            try:
                stack.enter_context(run_lock(out))
            except RunError as e:
                error = e
        refusal = _dp.from_main(
            env, None if error is None else (isinstance(error, RunLockedError), str(error))
        )
        if error is not None:
            raise error
        if refusal is not None:
            raise (RunLockedError if refusal[0] else RunError)(refusal[1])
        yield


def _train(cfg: TrainConfig, corpus: Corpus | None, env: DistEnv) -> dict:
    ctx = make_context(cfg, corpus, env)
    # a rank started with other flags would hang the others in a collective, or train another run
    check_consistent({**ctx.identity, "run": cfg.to_dict()["run"]}, "the run's config")
    plan = plan_run(cfg, ctx.identity)
    if plan.finished is not None:
        return plan.finished
    _dp.barrier(env)  # every rank has decided before rank 0 touches the run directory
    if cfg.pp_stages > 1:
        ctx = dataclasses.replace(ctx, mesh=_dp.pipeline_mesh(env, cfg.pp_stages, ctx.device.type))
    # built before any file is deleted: a model that fails to build loses nothing
    state = build_state(cfg, ctx.device, ctx.mesh)
    if plan.clear and ctx.is_main:
        clear_run(ctx.out)
    if plan.resume:
        resume_state(ctx, state)
    elif ctx.is_main:
        start_run_files(ctx.out, run_record(cfg, ctx.corpus.info()))
    state.net = state.model if ctx.sharded else _dp.wrap(state.model, env)
    if cfg.compile and state.pp is not None:
        state.pp.compile()
    elif cfg.compile:  # one graph for the bundled GPT; DDP splits its graph at bucket boundaries
        state.net = torch.compile(state.net, fullgraph=env.world_size == 1)
    state.clock = time.perf_counter()
    with (
        MetricsWriter(ctx.out / METRICS_FILE, ctx.is_main) as metrics,
        StopRequest(env.world_size == 1) as stop,
    ):
        if state.step == 0 and not plan.resume:
            evaluate(ctx, state)
            metrics.first_row(state)
        interrupted = run_steps(ctx, state, metrics, stop)
    summary = summarize(ctx, state, interrupted)
    if cfg.final_eval == "split" and summary["done"]:
        summary["split_val"] = split_loss(
            state.model,
            ctx.corpus.val,
            batch_size=split_batch(cfg.batch_size, cfg.model.seq_len, cfg.model.vocab_size),
            seq_len=cfg.model.seq_len,
            device=ctx.device,
            dtype=cfg.dtype,
        )
    if ctx.is_main:
        summary["world_size"] = env.world_size
        write_json(ctx.out / SUMMARY_FILE, summary)
    _dp.barrier(env)
    return summary
