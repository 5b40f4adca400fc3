"""``attnres experiment <name>``: the command line of the experiments."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from ..training import TrainConfig
from ..training.config import flat_fields
from .report import write_report
from .runner import BudgetClash, run_experiment
from .specs import BUDGETS, DEFAULT_ROOTS, REPORT_ROOT, SUBCOMMANDS

__all__ = ["build_parser", "main"]


def _epilog() -> str:
    width = max(map(len, SUBCOMMANDS)) + 2
    return "\n".join(
        ["experiments:"]
        + [f"  {name:<{width}}{help_}" for name, help_ in SUBCOMMANDS.items()]
        + [
            "",
            "examples:",
            "  attnres experiment blocksize                  # quick pipeline check, into runs/experiments",
            "  attnres experiment blocksize --preset full    # the committed tables, into results",
            "  attnres experiment report                     # results/README.md from results/*/results.json",
            "  attnres experiment scaling --preset report --data corpus/   # the GPU-scale sweep",
        ]
    )


def _add_config_args(p: argparse.ArgumentParser) -> None:
    """What every run trains: the size preset and options set on every run."""
    p.add_argument(
        "--preset",
        "--budget",  # its first name, kept so the commands recorded in results/ still run
        dest="preset",
        default=None,
        choices=tuple(BUDGETS),
        help="size preset; quick: a pipeline check in seconds, full: the committed CPU runs (hours), "
        "report: the GPU-scale scaling sweep (H200-hours, with --data) (default: quick)",
    )
    p.add_argument(
        "--data",
        default=None,
        help="train every run on this text file/folder/glob instead of the built-in corpus "
        "(the same as --override data=PATH)",
    )
    p.add_argument(
        "--override",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="set a training/model option of every run (value parsed as JSON, else a string), e.g. "
        "lr=1e-3 device=cuda; the runs are keyed by it, so they never mix with runs without it",
    )


def _add_selection_args(p: argparse.ArgumentParser) -> None:
    """Where the results go and which runs this invocation trains or tabulates."""
    roots = ", ".join(f"{b}: {r}" for b, r in DEFAULT_ROOTS.items())
    p.add_argument(
        "--root",
        default=None,
        help=f"where runs, tables and plots go (default by budget: {roots}; for `report`: "
        f"{REPORT_ROOT}, or the budget's root when --budget is given)",
    )
    p.add_argument(
        "--force", action="store_true", help="replace results made with a bigger budget (default: refuse)"
    )
    p.add_argument("--only", nargs="*", help="restrict to these variants, run names or groups (default: all)")
    p.add_argument(
        "--shard",
        help="I/N: train only every N-th run from the I-th (N processes in parallel); "
        "no tables (default: all runs, then the tables)",
    )
    p.add_argument(
        "--partial",
        action="store_true",
        help="train nothing; tabulate the runs finished so far (interim tables of a long study)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="attnres experiment",
        description="The experiments of the AttnRes report (its section 5) at small scale, "
        "one command each: resumable training runs, then tables and plots.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("experiment", choices=tuple(SUBCOMMANDS), help="which experiment to run (or `report`)")
    _add_config_args(p)
    _add_selection_args(p)
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads of this process (default: torch's)"
    )
    return p


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["lr=1e-3", "device=cuda"]`` -> ``{"lr": 0.001, "device": "cuda"}`` (JSON values, else
    strings). Raises ``ValueError`` naming ``--override`` for an item without ``=`` or a key that
    is no training/model option."""
    known = {ff.name for ff in flat_fields(TrainConfig)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--override: expected KEY=VALUE, got {item!r}")
        if key not in known or key in ("out", "resume", "seed"):
            raise ValueError(f"--override: {key!r} is not an option a run of an experiment can set")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    shard = None
    if args.shard:
        try:
            i, n = (int(x) for x in args.shard.split("/"))
            assert 0 <= i < n
        except (ValueError, AssertionError):
            p.error(f"--shard: expected I/N with 0 <= I < N, got {args.shard!r}")
        shard = (i, n)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.experiment == "report":
        root = args.root or (DEFAULT_ROOTS[args.preset] if args.preset else REPORT_ROOT)
        try:
            print(write_report(root))
        except FileNotFoundError as exc:
            print(f"attnres experiment report: error: {exc}", file=sys.stderr)
            return 2
        return 0
    budget = args.preset or "quick"
    root = args.root or DEFAULT_ROOTS[budget]
    try:
        overrides = parse_overrides(args.override + ([f"data={args.data}"] if args.data else []))
        result = run_experiment(
            args.experiment,
            budget,
            root,
            args.only,
            shard,
            force=args.force,
            partial=args.partial,
            overrides=overrides,
        )
    except BudgetClash as exc:
        print(f"attnres experiment: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        p.error(str(exc))
    if result is not None:
        print((Path(root) / args.experiment / "table.md").read_text())
        print(
            f"wrote {Path(root) / args.experiment}; gather with `attnres experiment report --root {root}`",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
