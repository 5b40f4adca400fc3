"""Training: ``attnres train`` and everything a run needs, one component per module.

* :mod:`.config` — :class:`TrainConfig` (each option's default, help and choices in its field),
  its flat view over nested dataclasses, type checks and validation;
* :mod:`.args` — the command line built from the config dataclasses (``build_parser``,
  ``read_config``, ``config_from_args``);
* :mod:`.run` — the run directory: file names and formats, the resume policy;
* :mod:`.loop` — ``train(cfg)``: context, state, step, metrics, evaluation, checkpoints;
* :mod:`.command` — ``main(argv)``, the ``attnres train`` command;
* :mod:`.data`, :mod:`.tokenizer`, :mod:`.optim`, :mod:`.checkpoint` — corpora and batches,
  BPE tokenizers, optimizers and schedules, safetensors checkpoints;
* :mod:`.evaluate`, :mod:`.sample` — ``attnres eval`` and ``attnres sample`` on a run directory;
* :mod:`.depth` — whether the depth mixing learns (``--log-depth``, the budget study's summaries).
"""

from .args import build_parser, config_from_args, read_config
from .command import main
from .config import TrainConfig, check_field_types, make_config
from .loop import estimate_loss, load_corpus_for, resolve_device, train
from .run import (
    ConfigMismatchError,
    RunError,
    RunLockedError,
    command_line,
    config_diff,
    is_done,
    load_summary,
    read_metrics,
)

__all__ = [
    "ConfigMismatchError",
    "RunError",
    "RunLockedError",
    "TrainConfig",
    "build_parser",
    "check_field_types",
    "command_line",
    "config_diff",
    "config_from_args",
    "estimate_loss",
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
