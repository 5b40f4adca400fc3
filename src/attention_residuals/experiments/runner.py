"""Running an experiment: train its runs (resumable, finished ones skipped, ``--shard`` for
several processes), then hand the finished summaries to its analysis (:mod:`.analyses`) and write
``results.json`` beside the tables and plots. Results of a bigger budget are never replaced
unless ``force``.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..training import load_summary, make_config, train
from ..training.config import TrainConfig
from ..training.data import Corpus, load_corpus
from ..training.prepare import data_vocab_size, load_corpus_for
from .analyses import ANALYSES
from .specs import (
    BUDGETS,
    DEFAULT_ROOTS,
    EXPERIMENTS,
    Budget,
    RunSpec,
    corpus_tag,
    run_dir_of,
    specs,
    with_overrides,
)

__all__ = ["BudgetClash", "check_budget", "finished_summary", "run_experiment"]


def _train_config(spec: RunSpec, budget: Budget, run_dir: Path):
    base = {
        "steps": budget.steps,
        "batch_size": budget.batch_size,
        "seq_len": budget.seq_len,
        "eval_interval": budget.eval_interval,
        "eval_batches": budget.eval_batches,
        "lr": budget.lr,
        "min_lr": budget.lr / 10,
        "warmup": budget.warmup,
        "log_interval": max(1, budget.eval_interval // 5),
    }
    return make_config(
        **{
            **base,
            **spec.overrides,
            "seed": spec.seed,
            "out": str(run_dir),
            "resume": True,
            "progress": False,
        }
    )


class BudgetClash(ValueError):
    """An experiment would replace results that were made with a bigger budget."""


def check_budget(exp_dir: str | Path, budget_name: str) -> None:
    """Raise :class:`BudgetClash` when ``exp_dir/results.json`` was made with a bigger budget than
    ``budget_name`` (the order of :data:`BUDGETS`), so a quick check cannot replace real results."""
    path = Path(exp_dir) / "results.json"
    try:
        old = json.loads(path.read_text())["meta"]["budget"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # nothing there (or nothing readable): nothing to protect
    order = list(BUDGETS)
    if old in order and order.index(old) > order.index(budget_name):
        raise BudgetClash(
            f"{path} holds results of the {old!r} budget; a {budget_name!r} run would replace "
            f"them. Use another --root (the default for {budget_name!r} is "
            f"{DEFAULT_ROOTS.get(budget_name, 'runs/experiments')}), --preset {old}, or --force"
        )


class _Corpora:
    """The corpora of an experiment's runs, each loaded once: the built-in ones by name, a
    ``--data`` source through the run's own config (its end-of-text and tokenizer options)."""

    def __init__(self) -> None:
        self.loaded: dict[str, Corpus] = {}

    def __call__(self, data: str = "stdlib") -> Corpus:
        if data not in self.loaded:
            self.loaded[data] = load_corpus(data, vocab_size=256)
        return self.loaded[data]

    def of(self, spec: RunSpec, cfg: TrainConfig) -> Corpus:
        data = spec.overrides.get("data", "stdlib")
        if data not in self.loaded:
            self.loaded[data] = load_corpus_for(cfg)
        return self.loaded[data]


def finished_summary(root: str | Path, spec: RunSpec, budget_name: str) -> dict | None:
    """The summary of a run that trained to its end under ``root``; ``None`` otherwise."""
    done = load_summary(run_dir_of(root, spec, budget_name))
    return done if done and done.get("done") else None


def _train_all(
    runs: list[RunSpec], budget: Budget, budget_name: str, root: str | Path, corpora: _Corpora, desc: str
) -> dict[str, dict]:
    """Train (or resume) every run not finished yet, with a progress bar; their summaries by name."""
    summaries: dict[str, dict] = {}
    bar = tqdm(runs, desc=desc, unit="run", file=sys.stderr)
    for spec in bar:
        bar.set_postfix_str(spec.name)
        done = finished_summary(root, spec, budget_name)
        run_dir = run_dir_of(root, spec, budget_name)
        if done is None:
            cfg = _train_config(spec, budget, run_dir)
            done = train(cfg, corpus=corpora.of(spec, cfg))
        summaries[spec.name] = done
    bar.close()
    return summaries


def _meta(
    experiment: str,
    budget_name: str,
    budget: Budget,
    root: str | Path,
    todo: list[RunSpec],
    summaries: dict[str, dict],
    corpora: _Corpora,
    t0: float,
) -> dict[str, Any]:
    """Provenance of an experiment's tables: command, budget, corpus hashes, time, machine."""
    return {
        "experiment": experiment,
        "budget": budget_name,
        "budget_config": budget.__dict__,
        "command": f"attnres experiment {experiment} --preset {budget_name} --root {root}",
        "corpus_sha256": corpora().info()["sha256"],
        "corpora_sha256": {
            corpus_tag(d): corpora(d).info()["sha256"]
            for d in sorted({s.overrides.get("data", "stdlib") for s in todo})
        },
        "wall_s_this_invocation": round(time.time() - t0, 1),
        "train_s_total": round(sum(s.get("train_s", 0.0) for s in summaries.values()), 1),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(),
    }


def _planned_runs(
    experiment: str, budget: Budget, overrides: dict[str, Any] | None
) -> tuple[list[RunSpec], dict[str, Any] | None]:
    """Every run of the experiment with ``overrides`` set, and the overrides (a ``--data`` source's
    vocabulary size added)."""
    if overrides and "data" in overrides and "vocab_size" not in overrides:  # e.g. 257: bytes + end-of-text
        vocab = data_vocab_size(make_config(**overrides))
        overrides = {**overrides, **({"vocab_size": vocab} if vocab is not None else {})}
    every = (
        [with_overrides(s, overrides) for s in specs(experiment, budget)]
        if overrides
        else specs(experiment, budget)
    )
    return every, overrides


def _finished_so_far(
    experiment: str, every: list[RunSpec], root: str | Path, budget_name: str
) -> tuple[list[RunSpec], dict[str, dict]] | None:
    """``--partial``: the runs finished so far and their summaries (None, said, when there is none)."""
    summaries = {s.name: done for s in every if (done := finished_summary(root, s, budget_name))}
    todo = [s for s in every if s.name in summaries]
    if not todo:
        print(f"--partial: no run of {experiment} is finished yet", file=sys.stderr)
        return None
    return todo, summaries


def _train_experiment(
    experiment: str,
    every: list[RunSpec],
    todo: list[RunSpec],
    shard: tuple[int, int] | None,
    budget: Budget,
    budget_name: str,
    root: str | Path,
    corpora: _Corpora,
) -> dict[str, dict] | None:
    """Train the wanted runs (this shard's); every run's summary, or None while some run of the
    experiment is not finished (the tables cover the whole experiment) or for a shard."""
    runs = todo if shard is None else todo[shard[0] :: shard[1]]
    summaries = _train_all(runs, budget, budget_name, root, corpora, f"{experiment} ({budget_name})")
    if shard is not None:
        return None
    earlier = {s.name: finished_summary(root, s, budget_name) for s in every if s.name not in summaries}
    missing = [name for name, summary in earlier.items() if not summary]
    if missing:
        print(
            f"--only: trained {len(todo)} run(s); no tables until every run of {experiment} is "
            f"finished ({missing[0]} is not)",
            file=sys.stderr,
        )
        return None
    return summaries | earlier


def _note_options(
    meta: dict[str, Any], overrides: dict[str, Any] | None, partial: bool, finished: int, planned: int
) -> None:
    """Add ``--override`` and ``--partial`` to the meta's command (a partial table also counts its
    runs); once every planned run is finished the table is whole, so ``--partial`` is not named."""
    if overrides:
        meta["command"] += " --override " + " ".join(
            f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in overrides.items()
        )
    if partial and finished < planned:
        meta.update(command=meta["command"] + " --partial", runs_finished=finished, runs_planned=planned)


def run_experiment(
    experiment: str,
    budget_name: str = "quick",
    root: str | Path | None = None,
    only: list[str] | None = None,
    shard: tuple[int, int] | None = None,
    force: bool = False,
    partial: bool = False,
    overrides: dict[str, Any] | None = None,
) -> dict | None:
    """Train every run of ``experiment`` (skipping finished ones), then tabulate and plot.

    ``root`` defaults to ``DEFAULT_ROOTS[budget_name]`` (quick: ``runs/experiments``, full:
    ``results``). Results of a bigger budget already in ``<root>/<experiment>`` are not replaced
    (:class:`BudgetClash`) unless ``force``. ``only`` restricts to variants, run names or groups;
    the tables still wait until every run of the experiment is finished. ``shard=(i, n)`` trains
    only every n-th run starting at i (for n parallel processes) and skips the tables.
    ``partial`` trains nothing and tabulates the runs finished so far (a long study's interim
    tables; their meta counts the finished and the planned runs). ``overrides`` set options of
    every run (``{"data": PATH, "lr": 1e-3}``); they join its key, so such runs are their own."""
    if budget_name not in BUDGETS:
        raise ValueError(f"--budget: expected one of {tuple(BUDGETS)}, got {budget_name!r}")
    if experiment not in EXPERIMENTS:
        raise ValueError(f"experiment: expected one of {EXPERIMENTS}, got {experiment!r}")
    if partial and only:
        raise ValueError(
            f"--only {' '.join(only)}: --partial tabulates every finished run of {experiment}; "
            "expected --only or --partial, not both"
        )
    root = DEFAULT_ROOTS[budget_name] if root is None else root
    budget, exp_dir = BUDGETS[budget_name], Path(root) / experiment
    if not force:
        check_budget(exp_dir, budget_name)
    every, overrides = _planned_runs(experiment, budget, overrides)
    if not every:
        defined = tuple(name for name in EXPERIMENTS if specs(name, budget))
        raise ValueError(f"--preset {budget_name}: defines no runs of {experiment}; it has {defined}")
    wanted = set(only or ())
    todo = [s for s in every if not wanted or wanted & {s.variant, s.name, s.group}]
    corpora, t0 = _Corpora(), time.time()
    if partial:
        if (finished := _finished_so_far(experiment, every, root, budget_name)) is None:
            return None
        todo, summaries = finished
    else:
        summaries = _train_experiment(experiment, every, todo, shard, budget, budget_name, root, corpora)
        if summaries is None:
            return None
        todo = every
    meta = _meta(experiment, budget_name, budget, root, todo, summaries, corpora, t0)
    _note_options(meta, overrides, partial, len(todo), len(every))
    exp_dir.mkdir(parents=True, exist_ok=True)
    results = ANALYSES[experiment](todo, summaries, exp_dir, budget, meta)
    results["run_dirs"] = {spec.name: summaries[spec.name]["run_dir"] for spec in todo}
    results["meta"] = meta
    (exp_dir / "results.json").write_text(json.dumps(results, indent=2, default=float))
    return results
