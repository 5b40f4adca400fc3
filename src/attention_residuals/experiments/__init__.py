"""Floor 6: the report's section-5 experiments at small scale, one command each.

``attnres experiment <name> [--budget quick|full]`` (the names: :data:`SUBCOMMANDS`)

Every experiment is a list of runs; each run is an ordinary training run directory under
``<root>/runs/<key>`` (the key spells out its config and seed, so experiments that need the same
run share it: the ablation's baseline is the block-size sweep's baseline) that resumes if
interrupted and is skipped once finished, so a sweep can span several sessions and several
processes (``--shard i/n``). Each experiment writes ``results.json``, ``table.md`` and its
plots beside the runs; ``report`` gathers them into ``<root>/README.md``.

The root defaults by budget (:data:`DEFAULT_ROOTS`): a ``quick`` run (a pipeline check) goes to
``runs/experiments``, a ``full`` run to ``results`` (the committed tables). An experiment never
replaces results made with a bigger budget unless ``--force``.

Compute is counted as ``C = flops_per_token * tokens`` with ``flops_per_token = 6 N + 12 n_layer d T``
(N non-embedding parameters, T the context), in PFLOP/s-days (8.64e19 FLOPs) as in the report.
"""

from .analyses import compute_advantage, compute_for_loss, fit_power_law
from .command import build_parser, main
from .report import write_report
from .runner import BudgetClash, check_budget, run_experiment
from .specs import (
    BUDGETS,
    DEFAULT_ROOTS,
    EXPERIMENTS,
    REPORT_ABLATION,
    SUBCOMMANDS,
    Budget,
    RunSpec,
    run_dir_of,
    run_key,
    specs,
)

__all__ = [
    "BUDGETS",
    "DEFAULT_ROOTS",
    "EXPERIMENTS",
    "REPORT_ABLATION",
    "SUBCOMMANDS",
    "Budget",
    "BudgetClash",
    "RunSpec",
    "build_parser",
    "check_budget",
    "compute_advantage",
    "compute_for_loss",
    "fit_power_law",
    "main",
    "run_experiment",
    "run_dir_of",
    "run_key",
    "specs",
    "write_report",
]
