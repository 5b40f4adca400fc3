"""``attnres experiment <name>``: the command line of the experiments."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .report import write_report
from .runner import BudgetClash, run_experiment
from .specs import BUDGETS, DEFAULT_ROOTS, REPORT_ROOT, SUBCOMMANDS

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    width = max(map(len, SUBCOMMANDS)) + 2
    roots = ", ".join(f"{b}: {r}" for b, r in DEFAULT_ROOTS.items())
    epilog = "\n".join(
        ["experiments:"]
        + [f"  {name:<{width}}{help_}" for name, help_ in SUBCOMMANDS.items()]
        + [
            "",
            "examples:",
            "  attnres experiment blocksize                  # quick pipeline check, into runs/experiments",
            "  attnres experiment blocksize --budget full    # the committed tables, into results",
            "  attnres experiment report                     # results/README.md from results/*/results.json",
        ]
    )
    p = argparse.ArgumentParser(
        prog="attnres experiment",
        description="The experiments of the AttnRes report (its section 5) at small scale, "
        "one command each: resumable training runs, then tables and plots.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("experiment", choices=tuple(SUBCOMMANDS), help="which experiment to run (or `report`)")
    p.add_argument(
        "--budget",
        default=None,
        choices=tuple(BUDGETS),
        help="size preset; quick: a pipeline check in seconds, full: hours (default: quick)",
    )
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
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads of this process (default: torch's)"
    )
    return p


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
        root = args.root or (DEFAULT_ROOTS[args.budget] if args.budget else REPORT_ROOT)
        try:
            print(write_report(root))
        except FileNotFoundError as exc:
            print(f"attnres experiment report: error: {exc}", file=sys.stderr)
            return 2
        return 0
    budget = args.budget or "quick"
    root = args.root or DEFAULT_ROOTS[budget]
    try:
        result = run_experiment(
            args.experiment, budget, root, args.only, shard, force=args.force, partial=args.partial
        )
    except BudgetClash as exc:
        print(f"attnres experiment: error: {exc}", file=sys.stderr)
        return 2
    if result is not None:
        print((Path(root) / args.experiment / "table.md").read_text())
        print(
            f"wrote {Path(root) / args.experiment}; gather with `attnres experiment report --root {root}`",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
