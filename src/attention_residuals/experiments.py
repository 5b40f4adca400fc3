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

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .report import new_figure
from .training import load_summary, make_config, train
from .training.checkpoint import load_latest
from .training.data import eval_batches, load_corpus

__all__ = ["RunSpec", "BUDGETS", "DEFAULT_ROOTS", "EXPERIMENTS", "SUBCOMMANDS", "specs", "run_experiment",
           "fit_power_law", "compute_advantage", "write_report", "main"]

PFLOPS_DAY = 8.64e19

# The sub-commands of `attnres experiment`, name -> one line. `attnres --help` and
# `attnres experiment --help` list them from here; add an experiment by adding a line (and its specs).
SUBCOMMANDS: dict[str, str] = {
    "scaling": "loss vs compute over several model sizes (PreNorm, Full, Block AttnRes, mHC), power-law fits",
    "ablation": "the report's ablation rows (and two of ours) on one model, against the PreNorm baseline",
    "blocksize": "Block AttnRes loss against the block size S (S = 1 is Full AttnRes)",
    "analysis": "hidden-state magnitudes, gradient norms and depth weights of three trained models",
    "shape": "width vs depth (d_model / n_layer) at about fixed parameters, PreNorm and Block AttnRes",
    "budget": "the AttnRes advantage vs training tokens per parameter (1 to 20), two depths, code and prose corpora",
    "lr": "at the largest budget: each variant at its own best learning rate (a sweep) beside the shared one",
    "report": "gather the finished experiments under --root into <root>/README.md",
}
EXPERIMENTS = tuple(name for name in SUBCOMMANDS if name != "report")
# where an experiment writes when no --root is given: quick runs are scratch, full runs the committed results
DEFAULT_ROOTS = {"quick": "runs/experiments", "full": "results"}
REPORT_ROOT = "results"  # `attnres experiment report` without --root (and without --budget)

# Values of the report (Kimi Linear 48B/3B scale), for side-by-side tables.
REPORT_ABLATION = {
    "baseline": 1.766, "denseformer": 1.767, "mhc": 1.747, "full": 1.737, "block_s4": 1.746,
    "swa_w8": 1.764, "input_query": 1.731, "mixing": 1.749, "sigmoid": 1.741, "multihead": 1.752,
    "full_no_keynorm": 1.743, "block_no_keynorm": 1.750,
}
REPORT_SCALING = {"prenorm": (1.891, 0.057), "block": (1.870, 0.058), "full": (1.865, 0.057)}


@dataclass(frozen=True)
class RunSpec:
    """One training run of an experiment: a name, a variant label and config overrides."""

    name: str
    variant: str
    overrides: dict = field(hash=False)
    seed: int = 0
    group: str = ""  # e.g. the model size of a scaling run


@dataclass(frozen=True)
class Budget:
    """Shared training hyper-parameters of a budget preset (chosen for the baseline)."""

    steps: int
    batch_size: int
    seq_len: int
    eval_interval: int
    eval_batches: int
    seeds: int
    sizes: tuple[tuple[int, int, int, int], ...]  # (d_model, n_layer, n_head, steps)
    mid: tuple[int, int, int]  # (d_model, n_layer, n_head) of the ablation / blocksize model
    shapes: tuple[tuple[int, int, int], ...] = ()  # (d_model, n_layer, n_head) at ~ the mid model's parameters
    lr: float = 3e-3
    warmup: int = 50
    # the budget study: model shapes (d_model, n_layer, n_head), tokens per parameter, corpora, lr sweep
    study_shapes: tuple[tuple[int, int, int], ...] = ()
    tokens_per_param: tuple[float, ...] = ()
    corpora: tuple[str, ...] = ("stdlib",)
    lrs: tuple[float, ...] = ()


BUDGETS: dict[str, Budget] = {
    # seconds in all: checks the pipeline end to end, not the numbers
    "quick": Budget(steps=12, batch_size=4, seq_len=32, eval_interval=12, eval_batches=2, seeds=1,
                    sizes=((32, 2, 2, 10), (48, 2, 2, 12)), mid=(32, 4, 2), shapes=((32, 4, 2), (48, 2, 2)), warmup=2,
                    study_shapes=((16, 1, 2), (16, 2, 2)), tokens_per_param=(0.02, 0.05),
                    corpora=("stdlib", "stdlib-docs"), lrs=(1e-3, 3e-3)),
    # the real runs: ~4 CPU-hours (scaling), ~3 CPU-hours (ablation) on 2 cores
    "full": Budget(steps=500, batch_size=16, seq_len=128, eval_interval=100, eval_batches=20, seeds=2,
                   sizes=((64, 4, 4, 400), (96, 6, 4, 500), (128, 8, 4, 600), (160, 10, 4, 700)),
                   mid=(96, 8, 4),
                   # ~0.8-1.0 M non-embedding parameters each (12 L d^2), d_model / L from 3.6 to 32
                   shapes=((64, 18, 4), (80, 12, 4), (96, 8, 4), (112, 6, 4), (128, 4, 4)),
                   # d 64 at 12 and 24 sublayers (0.34M / 0.64M parameters); 20 tokens/param ~ 6.7M / 13M tokens
                   study_shapes=((64, 6, 4), (64, 12, 4)), tokens_per_param=(1.0, 4.0, 20.0),
                   corpora=("stdlib", "stdlib-docs"), lrs=(1e-3, 3e-3, 1e-2)),
}


def _model(d: int, n_layer: int, n_head: int) -> dict:
    return {"d_model": d, "n_layer": n_layer, "n_head": n_head}


def _block_size_for(n_layer: int, n_blocks: int = 8) -> int:
    """S for N ~ 8 blocks, never 1 (S = 1 would be Full AttnRes itself)."""
    return max(2, math.ceil(2 * n_layer / n_blocks))


def ablation_variants(n_layer: int, d_model: int) -> dict[str, dict]:
    """The rows of the report's table 4 (plus two of ours from the critique's open problems)."""
    heads = 16 if d_model % 16 == 0 else 8
    return {
        "baseline": {"residual": "prenorm"},
        "denseformer": {"residual": "denseformer"},
        "mhc": {"residual": "mhc"},
        "full": {"residual": "full"},
        "block_s4": {"residual": "block", "block_size": 4},
        "swa_w8": {"residual": "swa", "window": 8},
        "input_query": {"residual": "full", "query": "input"},
        "mixing": {"residual": "mixing"},
        "sigmoid": {"residual": "full", "normalize": "sigmoid"},
        "multihead": {"residual": "block", "block_size": 4, "depth_heads": heads},
        "full_no_keynorm": {"residual": "full", "key_norm": False},
        "block_no_keynorm": {"residual": "block", "block_size": 4, "key_norm": False},
        "ours_lowrank_query": {"residual": "block", "block_size": 4, "query": "lowrank", "query_rank": 8},
        "ours_intra_gate": {"residual": "block", "block_size": 4, "intra_gate": True},
    }


def study_variants(n_layer: int, n_head: int) -> dict[str, dict]:
    """The budget study's variants: the baseline, Block (N ~ 8) and Full AttnRes, each with one
    pseudo-query and with one per attention head (``heads = n_head``: d / H as in attention)."""
    block = {"residual": "block", "block_size": _block_size_for(n_layer)}
    return {
        "prenorm": {"residual": "prenorm"},
        "block": block,
        "full": {"residual": "full"},
        f"block_h{n_head}": {**block, "depth_heads": n_head},
        f"full_h{n_head}": {"residual": "full", "depth_heads": n_head},
    }


def baseline_params(d: int, n_layer: int, n_head: int, vocab_size: int = 256) -> int:
    """All parameters of the PreNorm model of this shape: the N of tokens per parameter (every
    variant of a shape trains on the same tokens; AttnRes adds d per sublayer)."""
    from .model import GPT, GPTConfig

    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, d_model=d)).num_params(
            non_embedding=False
        )


def study_steps(d: int, n_layer: int, n_head: int, tokens_per_param: float, budget: Budget) -> int:
    """Optimizer steps that train ``tokens_per_param`` tokens per (baseline) parameter."""
    tokens = tokens_per_param * baseline_params(d, n_layer, n_head)
    return max(1, round(tokens / (budget.batch_size * budget.seq_len)))


def _study_schedule(steps: int, budget: Budget) -> dict:
    """Per-run schedule of a study run: its own full cosine over ``steps``, warmup 5 % (>= 2 steps),
    about ten evaluations and checkpoints."""
    return {"steps": steps, "warmup": max(2, steps // 20), "eval_interval": max(1, steps // 10),
            "log_interval": max(1, steps // 50)}


def _corpus_tag(data: str) -> str:
    return "code" if data == "stdlib" else "prose" if data == "stdlib-docs" else data


def _study_spec(budget: Budget, data: str, shape: tuple[int, int, int], tpp: float, variant: str, o: dict,
                seed: int, lr: float | None = None) -> RunSpec:
    d, n_layer, n_head = shape
    steps = study_steps(d, n_layer, n_head, tpp, budget)
    cfg = {**_model(d, n_layer, n_head), **_study_schedule(steps, budget), **o}
    if data != "stdlib":
        cfg["data"] = data
    if lr is not None and lr != budget.lr:  # the shared lr keeps the budget study's key: one run, not two
        cfg.update(lr=lr, min_lr=lr / 10)
    group = f"{_corpus_tag(data)}_L{2 * n_layer}"
    lr_tag = f"_lr{lr:g}" if lr is not None else ""
    return RunSpec(f"{group}_tpp{tpp:g}_{variant}{lr_tag}_s{seed}", variant, cfg, seed, group)


def specs(experiment: str, budget: Budget) -> list[RunSpec]:
    """The runs of ``experiment`` under ``budget``."""
    out: list[RunSpec] = []
    if experiment == "scaling":
        for d, n_layer, n_head, steps in budget.sizes:
            size = f"d{d}_l{n_layer}"
            variants = {
                "prenorm": {"residual": "prenorm"},
                "full": {"residual": "full"},
                "block": {"residual": "block", "block_size": _block_size_for(n_layer)},
                "mhc": {"residual": "mhc"},
            }
            for seed in range(budget.seeds):
                for v, o in variants.items():
                    cfg = {**_model(d, n_layer, n_head), "steps": steps, **o}
                    out.append(RunSpec(f"{size}_{v}_s{seed}", v, cfg, seed, size))
    elif experiment == "ablation":
        d, n_layer, n_head = budget.mid
        for seed in range(budget.seeds):
            for v, o in ablation_variants(n_layer, d).items():
                out.append(RunSpec(f"{v}_s{seed}", v, {**_model(d, n_layer, n_head), **o}, seed))
    elif experiment == "blocksize":
        d, n_layer, n_head = budget.mid
        L = 2 * n_layer
        sizes = sorted({s for s in (1, 2, 4, 8, 16, L) if s <= L})
        for seed in range(budget.seeds):
            out.append(RunSpec(f"baseline_s{seed}", "baseline", {**_model(d, n_layer, n_head), "residual": "prenorm"}, seed))
            for s in sizes:
                o = {**_model(d, n_layer, n_head), "residual": "block", "block_size": s}
                out.append(RunSpec(f"S{s}_s{seed}", f"S={s}", o, seed))
    elif experiment == "analysis":
        d, n_layer, n_head = budget.mid
        for v, o in {"baseline": {"residual": "prenorm"}, "full": {"residual": "full"},
                     "block": {"residual": "block", "block_size": _block_size_for(n_layer)}}.items():
            out.append(RunSpec(v, v, {**_model(d, n_layer, n_head), **o}, 0))
    elif experiment == "shape":
        for d, n_layer, n_head in budget.shapes:
            for v, o in {"prenorm": {"residual": "prenorm"},
                         "block": {"residual": "block", "block_size": _block_size_for(n_layer)}}.items():
                out.append(RunSpec(f"d{d}_l{n_layer}_{v}", v, {**_model(d, n_layer, n_head), **o}, 0, f"d{d}_l{n_layer}"))
    elif experiment == "budget":
        # ordered so that finished runs answer the first question first: the shallow model on code,
        # then on prose, budgets ascending, seeds in turn; then the deeper model
        for shape in budget.study_shapes:
            for data in budget.corpora:
                for tpp in budget.tokens_per_param:
                    for seed in range(budget.seeds):
                        for v, o in study_variants(shape[1], shape[2]).items():
                            out.append(_study_spec(budget, data, shape, tpp, v, o, seed))
    elif experiment == "lr":
        shape, tpp = budget.study_shapes[0], max(budget.tokens_per_param)
        for data in budget.corpora:
            for seed in range(budget.seeds):
                for lr in budget.lrs:
                    for v, o in study_variants(shape[1], shape[2]).items():
                        out.append(_study_spec(budget, data, shape, tpp, v, o, seed, lr))
    else:
        raise ValueError(f"experiment: expected one of {EXPERIMENTS}, got {experiment!r}")
    return out


# options renamed since runs were first keyed: a key keeps the first spelling, so committed runs are found
_KEY_SPELLING = {"depth_heads": "heads"}


def run_key(spec: RunSpec, budget_name: str) -> str:
    """Directory name of a run: its budget, config overrides and seed, spelled out."""
    named = {_KEY_SPELLING.get(k, k): v for k, v in spec.overrides.items()}
    parts = [budget_name] + [f"{k}={named[k]}" for k in sorted(named)] + [f"seed={spec.seed}"]
    return ",".join(parts).replace("=", "-").replace(",", "_")


def _train_config(spec: RunSpec, budget: Budget, run_dir: Path):
    base = {
        "steps": budget.steps, "batch_size": budget.batch_size, "seq_len": budget.seq_len,
        "eval_interval": budget.eval_interval, "eval_batches": budget.eval_batches, "lr": budget.lr,
        "min_lr": budget.lr / 10, "warmup": budget.warmup, "log_interval": max(1, budget.eval_interval // 5),
    }
    return make_config(**{**base, **spec.overrides, "seed": spec.seed, "out": str(run_dir), "resume": True,
                          "progress": False})


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
        raise BudgetClash(f"{path} holds results of the {old!r} budget; a {budget_name!r} run would replace "
                          f"them. Use another --root (the default for {budget_name!r} is "
                          f"{DEFAULT_ROOTS.get(budget_name, 'runs/experiments')}), --budget {old}, or --force")


def run_experiment(experiment: str, budget_name: str = "quick", root: str | Path | None = None,
                   only: list[str] | None = None, shard: tuple[int, int] | None = None,
                   force: bool = False, partial: bool = False) -> dict | None:
    """Train every run of ``experiment`` (skipping finished ones), then tabulate and plot.

    ``root`` defaults to ``DEFAULT_ROOTS[budget_name]`` (quick: ``runs/experiments``, full:
    ``results``). Results of a bigger budget already in ``<root>/<experiment>`` are not replaced
    (:class:`BudgetClash`) unless ``force``. ``shard=(i, n)`` trains only every n-th run starting
    at i (for n parallel processes) and skips the tables; a final call without ``shard`` finds
    every run done and tabulates. ``partial`` trains nothing and tabulates the runs finished so far
    (a long study's interim tables; their meta counts the finished and the planned runs)."""
    if budget_name not in BUDGETS:
        raise ValueError(f"--budget: expected one of {tuple(BUDGETS)}, got {budget_name!r}")
    if experiment not in EXPERIMENTS:
        raise ValueError(f"experiment: expected one of {EXPERIMENTS}, got {experiment!r}")
    only = set(only) if only else None
    root = DEFAULT_ROOTS[budget_name] if root is None else root
    budget = BUDGETS[budget_name]
    exp_dir = Path(root) / experiment
    if not force:
        check_budget(exp_dir, budget_name)

    from tqdm.auto import tqdm

    todo = [s for s in specs(experiment, budget) if not only or only & {s.variant, s.name, s.group}]
    train_list = todo if shard is None else todo[shard[0]::shard[1]]
    corpora: dict[str, Any] = {}

    def corpus_of(spec: RunSpec):
        data = spec.overrides.get("data", "stdlib")
        if data not in corpora:
            corpora[data] = load_corpus(data, vocab_size=256)
        return corpora[data]

    t0 = time.time()
    summaries: dict[str, dict] = {}
    if partial:
        train_list, shard = [], None
        for spec in todo:
            done = load_summary(Path(root) / "runs" / run_key(spec, budget_name))
            if done and done.get("done"):
                summaries[spec.name] = done
        planned, todo = len(todo), [s for s in todo if s.name in summaries]
        if not todo:
            print(f"--partial: no run of {experiment} is finished yet", file=sys.stderr)
            return None
    bar = tqdm(train_list, desc=f"{experiment} ({budget_name})", unit="run", file=sys.stderr)
    for spec in bar:
        run_dir = Path(root) / "runs" / run_key(spec, budget_name)
        bar.set_postfix_str(spec.name)
        done = load_summary(run_dir)
        if done and done.get("done"):
            summaries[spec.name] = done
            continue
        summaries[spec.name] = train(_train_config(spec, budget, run_dir), corpus=corpus_of(spec))
    bar.close()
    if shard is not None:
        return None
    if only and not partial:  # the tables cover the whole experiment: only once every one of its runs is finished
        for spec in specs(experiment, budget):
            if spec.name not in summaries:
                done = load_summary(Path(root) / "runs" / run_key(spec, budget_name))
                if not (done and done.get("done")):
                    print(f"--only: trained {len(todo)} run(s); no tables until every run of {experiment} is "
                          f"finished ({spec.name} is not)", file=sys.stderr)
                    return None
                summaries[spec.name] = done
        todo = specs(experiment, budget)
    meta = {
        "experiment": experiment, "budget": budget_name, "budget_config": budget.__dict__,
        "command": f"attnres experiment {experiment} --budget {budget_name} --root {root}",
        "corpus_sha256": corpus_of(RunSpec("", "", {})).info()["sha256"],
        "corpora_sha256": {_corpus_tag(d): corpus_of(RunSpec("", "", {"data": d})).info()["sha256"]
                           for d in sorted({s.overrides.get("data", "stdlib") for s in todo})},
        "wall_s_this_invocation": round(time.time() - t0, 1),
        "train_s_total": round(sum(s.get("train_s", 0.0) for s in summaries.values()), 1),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "python": platform.python_version(),
    }
    if partial:
        meta.update(command=meta["command"] + " --partial", runs_finished=len(todo), runs_planned=planned)
    analyse = {"scaling": _scaling, "ablation": _ablation, "blocksize": _blocksize, "analysis": _analysis,
               "shape": _shape, "budget": _budget, "lr": _lr}[experiment]
    exp_dir.mkdir(parents=True, exist_ok=True)
    results = analyse(todo, summaries, exp_dir, budget, meta)
    results["run_dirs"] = {spec.name: summaries[spec.name]["run_dir"] for spec in todo}
    results["meta"] = meta
    (exp_dir / "results.json").write_text(json.dumps(results, indent=2, default=float))
    return results


# ---------------------------------------------------------------- fits

def fit_power_law(compute: list[float], loss: list[float]) -> tuple[float, float]:
    """Least squares in log space of ``loss = A * compute^-alpha``; returns ``(A, alpha)``."""
    if len(compute) < 2:
        raise ValueError("compute: need at least two points to fit a power law")
    slope, intercept = np.polyfit(np.log(compute), np.log(loss), 1)
    return float(math.exp(intercept)), float(-slope)


def compute_advantage(base: tuple[float, float], other: tuple[float, float], compute: float) -> float:
    """How much more compute the baseline needs to reach ``other``'s loss at ``compute``."""
    a_b, alpha_b = base
    a_o, alpha_o = other
    target = a_o * compute ** -alpha_o
    return (target / a_b) ** (-1.0 / alpha_b) / compute


def _final(s: dict) -> float:
    return float(s["final_val_loss"])


def _mean_std(values: list[float]) -> tuple[float, float]:
    arr = np.asarray(values, dtype=float)
    return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else 0.0


def _scaling(todo, summaries, exp_dir, budget, meta) -> dict:
    points: dict[tuple[str, str], list[dict]] = {}  # (size, variant) -> the summaries of its seeds
    for spec in todo:
        points.setdefault((spec.group, spec.variant), []).append(summaries[spec.name])
    rows, by_variant = [], {}
    for (size, variant), runs in points.items():
        s = runs[0]
        c = s["flops_per_token"] * s["tokens"] / PFLOPS_DAY
        losses = [_final(r) for r in runs]
        mean, std = _mean_std(losses)
        rows.append({"size": size, "variant": variant, "params": s["params"], "tokens": s["tokens"],
                     "compute_pfs_days": c, "val_loss": mean, "val_loss_std": std, "val_losses": losses,
                     "seeds": len(runs), "train_s": sum(r["train_s"] for r in runs)})
        by_variant.setdefault(variant, []).append((c, mean))
    fits = {v: fit_power_law(*zip(*pts)) for v, pts in by_variant.items() if len(pts) >= 2}
    cmax = max(r["compute_pfs_days"] for r in rows)
    advantage = {v: compute_advantage(fits["prenorm"], f, cmax) for v, f in fits.items() if "prenorm" in fits}
    from matplotlib import ticker

    fig = new_figure((6, 4.2))
    ax = fig.subplots()
    for v, pts in by_variant.items():
        cs, ls = zip(*sorted(pts))
        line = ax.plot(cs, ls, "o", label=None)[0]
        for r in rows:  # the seeds behind a mean, as small dots
            if r["variant"] == v and r["seeds"] > 1:
                ax.plot([r["compute_pfs_days"]] * r["seeds"], r["val_losses"], ".", color=line.get_color(), alpha=0.4)
        if v in fits:
            a, alpha = fits[v]
            grid = np.geomspace(min(cs), max(cs), 50)
            ax.plot(grid, a * grid ** -alpha, "-", color=line.get_color(),
                    label=f"{v}: {a:.3f}·C^-{alpha:.3f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    # a loss range of ~1.3x spans no decade: label the minor ticks with plain numbers instead
    ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%.1f"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel("compute C (PFLOP/s-days)")
    ax.set_ylabel("validation loss")
    ax.set_title("Scaling: loss vs compute")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(exp_dir / "scaling.png", dpi=120)
    lines = ["| size | variant | params | tokens | C (PFLOP/s-days) | val loss | seeds | per seed |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['size']} | {r['variant']} | {r['params']:,} | {r['tokens']:,} | {r['compute_pfs_days']:.3e} | "
              f"{r['val_loss']:.4f} | {r['seeds']} | {', '.join(f'{x:.4f}' for x in r['val_losses'])} |" for r in rows]
    lines += ["", "C = (6 N + 12 n_layer d T) × tokens, N = non-embedding parameters (LM head included), "
              f"T = context; val loss: the mean over {budget.seeds} seed(s); fit: least squares of log mean loss "
              "on log C.", "",
              "| variant | A | α | compute advantage over baseline at largest C | report A, α |", "|---|---|---|---|---|"]
    for v, (a, alpha) in fits.items():
        rep = REPORT_SCALING.get(v)
        rep_s = f"{rep[0]}, {rep[1]}" if rep else "—"
        lines.append(f"| {v} | {a:.4f} | {alpha:.4f} | {advantage.get(v, float('nan')):.2f}× | {rep_s} |")
    (exp_dir / "table.md").write_text("\n".join(lines) + "\n")
    return {"rows": rows, "fits": {v: {"A": a, "alpha": al} for v, (a, al) in fits.items()},
            "advantage_at_max_compute": advantage, "max_compute_pfs_days": cmax}


def _seeded_table(todo, summaries) -> dict[str, dict]:
    groups: dict[str, list[float]] = {}
    for spec in todo:
        groups.setdefault(spec.variant, []).append(_final(summaries[spec.name]))
    return {v: {"losses": ls, "mean": _mean_std(ls)[0], "std": _mean_std(ls)[1]} for v, ls in groups.items()}


def _verdict(delta: float, spread: float) -> str:
    if spread == 0.0:
        return "one seed"
    return "within noise" if abs(delta) <= spread else ("better" if delta < 0 else "worse")


def _ablation(todo, summaries, exp_dir, budget, meta) -> dict:
    table = _seeded_table(todo, summaries)
    base = table["baseline"]
    lines = ["| variant | val loss (mean ± std) | Δ vs baseline | verdict | report | report Δ |",
             "|---|---|---|---|---|---|"]
    for v, r in table.items():
        delta = r["mean"] - base["mean"]
        spread = max(r["std"], base["std"])
        rep = REPORT_ABLATION.get(v)
        rep_s = f"{rep:.3f}" if rep else "—"
        rep_d = f"{rep - REPORT_ABLATION['baseline']:+.3f}" if rep else "—"
        r.update(delta=delta, verdict="reference" if v == "baseline" else _verdict(delta, spread))
        lines.append(f"| {v} | {r['mean']:.4f} ± {r['std']:.4f} | {delta:+.4f} | {r['verdict']} | {rep_s} | {rep_d} |")
    (exp_dir / "table.md").write_text("\n".join(lines) + "\n")
    return {"table": table}


def _blocksize(todo, summaries, exp_dir, budget, meta) -> dict:
    table = _seeded_table(todo, summaries)
    points = sorted((int(v.split("=")[1]), r) for v, r in table.items() if v.startswith("S="))
    fig = new_figure((5.5, 4))
    ax = fig.subplots()
    ax.errorbar([s for s, _ in points], [r["mean"] for _, r in points], yerr=[r["std"] for _, r in points],
                fmt="o-", capsize=3, label="Block AttnRes")
    base = table.get("baseline")
    if base:
        ax.axhline(base["mean"], color="gray", ls="--", label="PreNorm baseline")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size S (sublayers); S=1 is Full AttnRes")
    ax.set_ylabel("validation loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(exp_dir / "blocksize.png", dpi=120)
    lines = ["| S | val loss (mean ± std) |", "|---|---|"]
    lines += [f"| {s} | {r['mean']:.4f} ± {r['std']:.4f} |" for s, r in points]
    if base:
        lines.append(f"| baseline | {base['mean']:.4f} ± {base['std']:.4f} |")
    (exp_dir / "table.md").write_text("\n".join(lines) + "\n")
    return {"table": table}


def _analysis(todo, summaries, exp_dir, budget, meta) -> dict:

    from . import analysis
    from .model import GPT, GPTConfig

    corpus = load_corpus(None, vocab_size=256)
    x, y = next(iter(eval_batches(corpus.val, n_batches=1, batch_size=8, seq_len=budget.seq_len)))
    out: dict[str, Any] = {}
    for spec in todo:
        run_dir = Path(summaries[spec.name]["run_dir"])
        cfg = json.loads((run_dir / "config.json").read_text())
        model = GPT(GPTConfig.from_dict(cfg["model"]))
        load_latest(run_dir / "checkpoint.safetensors", model=model, restore_rng=False)
        entry = {"magnitudes": analysis.magnitudes(model, x), "grad_norms": analysis.gradient_norms(model, x, y)}
        if model.residual.has_depth_weights:
            entry["depth_weights"] = analysis.depth_weights(model, x)
        out[spec.name] = entry
    fig = new_figure((14, 3.8))
    axes = fig.subplots(1, 3)
    for name, e in out.items():
        axes[0].plot(e["magnitudes"]["input_rms"], "o-", ms=3, label=name)
        axes[1].plot(e["magnitudes"]["output_rms"], "o-", ms=3, label=name)
        axes[2].plot(e["grad_norms"], "o-", ms=3, label=name)
    for ax, title in zip(axes, ["RMS of layer input h_l", "RMS of layer output v_l", "gradient norm per sublayer"]):
        ax.set_title(title)
        ax.set_xlabel("sublayer l (even: attention, odd: MLP)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(exp_dir / "dynamics.png", dpi=120)
    heat = [(n, e["depth_weights"]) for n, e in out.items() if "depth_weights" in e]
    if heat:
        fig = new_figure((10, 4 * len(heat)))
        axes = fig.subplots(len(heat), 2, squeeze=False)
        for row, (name, w) in zip(axes, heat):
            for ax, key in zip(row, ["pre_attn", "pre_mlp"]):
                m = np.asarray(w[key], dtype=float)
                im = ax.imshow(np.ma.masked_invalid(m), cmap="viridis", vmin=0, vmax=np.nanmax(m), aspect="auto")
                ax.set_title(f"{name}: {key.replace('_', '-')} layers")
                ax.set_xlabel("source (0 = embedding)")
                ax.set_ylabel("layer")
                fig.colorbar(im, ax=ax)
        fig.tight_layout()
        fig.savefig(exp_dir / "depth_weights.png", dpi=120)
    lines = ["| run | val loss | max/min RMS of h_l | max/min grad norm |", "|---|---|---|---|"]
    for name, e in out.items():
        hin, g = e["magnitudes"]["input_rms"], e["grad_norms"]
        lines.append(f"| {name} | {_final(summaries[name]):.4f} | {max(hin) / min(hin):.2f} | {max(g) / min(g):.2f} |")
    (exp_dir / "table.md").write_text("\n".join(lines) + "\n")
    return {"runs": out}


def _shape(todo, summaries, exp_dir, budget, meta) -> dict:
    """The report's architecture sweep (its figure 7) in one dimension: at about fixed parameters
    and tokens, loss against d_model / L_b (L_b = n_layer, the Transformer blocks)."""
    rows = []
    for spec in todo:
        s, o = summaries[spec.name], spec.overrides
        rows.append({"shape": spec.group, "variant": spec.variant, "d_model": o["d_model"], "n_layer": o["n_layer"],
                     "d_over_L": o["d_model"] / o["n_layer"], "params": s["params"], "val_loss": _final(s)})
    fig = new_figure((5.5, 4))
    ax = fig.subplots()
    best = {}
    for v in dict.fromkeys(r["variant"] for r in rows):
        pts = sorted((r["d_over_L"], r["val_loss"]) for r in rows if r["variant"] == v)
        line = ax.plot(*zip(*pts), "o-", label=v)[0]
        best[v] = min(pts, key=lambda p: p[1])
        ax.plot(*best[v], "*", ms=14, color=line.get_color())
    ax.set_xscale("log")
    ax.set_xlabel("d_model / L_b (L_b = Transformer blocks), ~fixed parameters")
    ax.set_ylabel("validation loss")
    ax.set_title("Width / depth trade-off (star: best)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(exp_dir / "shape.png", dpi=120)
    by = {(r["shape"], r["variant"]): r for r in rows}
    lines = ["| d_model | L_b | d_model / L_b | params | prenorm | block | Δ (block − prenorm) |", "|---|---|---|---|---|---|---|"]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        p, b = by.get((shape, "prenorm")), by.get((shape, "block"))
        ref = p or b
        cells = [f"{x['val_loss']:.4f}" if x else "—" for x in (p, b)]
        delta = f"{b['val_loss'] - p['val_loss']:+.4f}" if p and b else "—"
        lines.append(f"| {ref['d_model']} | {ref['n_layer']} | {ref['d_over_L']:.1f} | {ref['params']:,} | "
                     f"{cells[0]} | {cells[1]} | {delta} |")
    lines += ["", "Best d_model / L_b: " + ", ".join(f"{v} {x:.1f} ({y:.4f})" for v, (x, y) in best.items())
              + " (the report: baseline 60, AttnRes 45, at 2.3e8 active parameters)."]
    (exp_dir / "table.md").write_text("\n".join(lines) + "\n")
    return {"rows": rows, "best_d_over_L": {v: x for v, (x, _) in best.items()}}


def _paired_deltas(todo, summaries, key) -> dict:
    """``{key(spec): {variant: {seed: val loss}}}`` over the finished runs."""
    out: dict = {}
    for spec in todo:
        out.setdefault(key(spec), {}).setdefault(spec.variant, {})[spec.seed] = _final(summaries[spec.name])
    return out


def _delta_cell(losses: dict[int, float], base: dict[int, float]) -> dict:
    """Δ = variant − baseline, paired by seed: mean, the per-seed values, and their spread."""
    deltas = [losses[s] - base[s] for s in sorted(losses) if s in base]
    return {"mean": float(np.mean(deltas)) if deltas else float("nan"), "per_seed": deltas,
            "spread": float(max(deltas) - min(deltas)) if len(deltas) > 1 else 0.0}


def _budget(todo, summaries, exp_dir, budget, meta) -> dict:
    """Final val loss per (corpus and depth, tokens/param, variant); Δ vs PreNorm paired by seed."""
    tpp_of = {spec.name: float(spec.name.split("_tpp")[1].split("_")[0]) for spec in todo}
    cells = _paired_deltas(todo, summaries, lambda sp: (sp.group, tpp_of[sp.name]))
    rows = []
    for (group, tpp), by_var in sorted(cells.items()):
        base = by_var.get("prenorm", {})
        some = next(s for s in todo if s.group == group and tpp_of[s.name] == tpp)
        row = {"group": group, "tokens_per_param": tpp, "tokens": summaries[some.name]["tokens"],
               "steps": some.overrides["steps"], "prenorm": _mean_std(list(base.values())) if base else None,
               "deltas": {v: _delta_cell(ls, base) for v, ls in by_var.items() if v != "prenorm" and base}}
        rows.append(row)
    groups = list(dict.fromkeys(r["group"] for r in rows))
    fig = new_figure((5.2 * len(groups), 4))
    axes = fig.subplots(1, len(groups), squeeze=False)[0]
    for ax, group in zip(axes, groups):
        variants = list(dict.fromkeys(v for r in rows if r["group"] == group for v in r["deltas"]))
        for v in variants:
            pts = [(r["tokens_per_param"], r["deltas"][v]) for r in rows if r["group"] == group and v in r["deltas"]]
            line = ax.plot([t for t, _ in pts], [c["mean"] for _, c in pts], "o-", label=v)[0]
            for t, c in pts:
                ax.plot([t] * len(c["per_seed"]), c["per_seed"], ".", color=line.get_color(), alpha=0.5)
        ax.axhline(0.0, color="gray", ls="--", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel("training tokens per parameter")
        ax.set_ylabel("Δ val loss vs PreNorm (nats; < 0: better)")
        ax.set_title(group.replace("_", ", ").replace("L", "L = ", 1))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(exp_dir / "budget.png", dpi=120)
    variants = list(dict.fromkeys(v for r in rows for v in r["deltas"]))
    lines = ["| corpus, sublayers | tokens/param | tokens | steps | PreNorm val loss | "
             + " | ".join(f"Δ {v}" for v in variants) + " |", "|---" * (5 + len(variants)) + "|"]
    for r in rows:
        pre = f"{r['prenorm'][0]:.4f} ± {r['prenorm'][1]:.4f}" if r["prenorm"] else "—"
        cell = [(f"{c['mean']:+.4f} ({', '.join(f'{d:+.4f}' for d in c['per_seed'])})" if (c := r["deltas"].get(v))
                 else "—") for v in variants]
        lines.append(f"| {r['group']} | {r['tokens_per_param']:g} | {r['tokens']:,} | {r['steps']} | {pre} | "
                     + " | ".join(cell) + " |")
    lines += ["", "Δ = variant − PreNorm final validation loss, paired by seed: the mean, then each seed's Δ in "
              "brackets. Every budget is its own run with its own cosine schedule (warmup 5 %), lr "
              f"{budget.lr:g} for every variant; tokens/param counts all parameters of the PreNorm model."]
    if "runs_planned" in meta:
        lines += ["", f"Interim: {meta['runs_finished']} of {meta['runs_planned']} planned runs finished."]
    (exp_dir / "table.md").write_text("\n".join(lines) + "\n")
    return {"rows": rows}


def _lr(todo, summaries, exp_dir, budget, meta) -> dict:
    """Per corpus: every variant's mean val loss at each lr, its best lr, and Δ vs PreNorm at the
    shared lr and at each one's best lr."""
    lr_of = {s.name: float(s.overrides.get("lr", budget.lr)) for s in todo}
    table: dict = {}
    for spec in todo:
        t = table.setdefault(spec.group, {}).setdefault(spec.variant, {}).setdefault(lr_of[spec.name], {})
        t[spec.seed] = _final(summaries[spec.name])
    out, lines = {}, []
    for group, by_var in table.items():
        lrs = sorted({lr for v in by_var.values() for lr in v})
        best = {v: min(per_lr, key=lambda lr: np.mean(list(per_lr[lr].values()))) for v, per_lr in by_var.items()}
        base = by_var.get("prenorm", {})
        lines += [f"**{group}**", "", "| variant | " + " | ".join(f"lr {lr:g}" for lr in lrs)
                  + " | best lr | Δ at shared lr | Δ at own best lr |", "|---" * (4 + len(lrs)) + "|"]
        out[group] = {}
        for v, per_lr in by_var.items():
            cells = [f"{np.mean(list(per_lr[lr].values())):.4f} ± {_mean_std(list(per_lr[lr].values()))[1]:.4f}"
                     if lr in per_lr else "—" for lr in lrs]
            shared = _delta_cell(per_lr.get(budget.lr, {}), base.get(budget.lr, {})) if base else None
            own = _delta_cell(per_lr[best[v]], base[best["prenorm"]]) if base else None
            fmt = [("—" if v == "prenorm" or c is None or not c["per_seed"] else f"{c['mean']:+.4f}")
                   for c in (shared, own)]
            lines.append(f"| {v} | " + " | ".join(cells) + f" | {best[v]:g} | {fmt[0]} | {fmt[1]} |")
            out[group][v] = {"per_lr": {str(lr): per_lr[lr] for lr in per_lr}, "best_lr": best[v],
                             "delta_shared_lr": shared, "delta_best_lr": own}
        lines.append("")
    lines += [f"Val loss mean ± std over seeds; the shared lr is {budget.lr:g}. Δ = variant − PreNorm paired by "
              "seed, at the shared lr and with each variant (PreNorm included) at its own best lr."]
    if "runs_planned" in meta:
        lines += ["", f"Interim: {meta['runs_finished']} of {meta['runs_planned']} planned runs finished."]
    (exp_dir / "table.md").write_text("\n".join(lines) + "\n")
    return {"table": out}


# ---------------------------------------------------------------- report

def write_report(root: str | Path = "results") -> Path:
    """Gather every finished experiment's table and plots into ``<root>/README.md``."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"--root: no such directory: {root} (run an experiment into it first)")
    parts = ["# Results", "",
             "Generated by `attnres experiment report` from the experiments' `results.json`; nothing here is edited "
             "by hand. Each section names the command that produced it.", ""]
    for exp in EXPERIMENTS:
        res_path = root / exp / "results.json"
        if not res_path.exists():
            continue
        res = json.loads(res_path.read_text())
        meta = res["meta"]
        parts += [f"## {exp}", "", f"Command: `{meta['command']}` — budget `{meta['budget']}`, corpus sha256 "
                  f"`{meta['corpus_sha256'][:16]}…`, total training time {meta['train_s_total'] / 60:.1f} min "
                  f"({meta['machine']}).", ""]
        parts += [(root / exp / "table.md").read_text(), ""]
        for png in sorted((root / exp).glob("*.png")):
            parts += [f"![{png.stem}]({exp}/{png.name})", ""]
    path = root / "README.md"
    path.write_text("\n".join(parts))
    return path


def build_parser() -> argparse.ArgumentParser:
    width = max(map(len, SUBCOMMANDS)) + 2
    roots = ", ".join(f"{b}: {r}" for b, r in DEFAULT_ROOTS.items())
    epilog = "\n".join(
        ["experiments:"] + [f"  {name:<{width}}{help_}" for name, help_ in SUBCOMMANDS.items()]
        + ["", "examples:",
           "  attnres experiment blocksize                  # quick pipeline check, into runs/experiments",
           "  attnres experiment blocksize --budget full    # the committed tables, into results",
           "  attnres experiment report                     # results/README.md from results/*/results.json"]
    )
    p = argparse.ArgumentParser(prog="attnres experiment",
                                description="The experiments of the AttnRes report (its section 5) at small scale, "
                                            "one command each: resumable training runs, then tables and plots.",
                                epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", choices=tuple(SUBCOMMANDS), help="which experiment to run (or `report`)")
    p.add_argument("--budget", default=None, choices=tuple(BUDGETS),
                   help="size preset; quick: a pipeline check in seconds, full: hours (default: quick)")
    p.add_argument("--root", default=None,
                   help=f"where runs, tables and plots go (default by budget: {roots}; for `report`: "
                        f"{REPORT_ROOT}, or the budget's root when --budget is given)")
    p.add_argument("--force", action="store_true",
                   help="replace results made with a bigger budget (default: refuse)")
    p.add_argument("--only", nargs="*", help="restrict to these variants, run names or groups (default: all)")
    p.add_argument("--shard", help="I/N: train only every N-th run from the I-th (N processes in parallel); "
                                   "no tables (default: all runs, then the tables)")
    p.add_argument("--partial", action="store_true",
                   help="train nothing; tabulate the runs finished so far (interim tables of a long study)")
    p.add_argument("--threads", type=int, default=None, help="torch threads of this process (default: torch's)")
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
        import torch

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
        result = run_experiment(args.experiment, budget, root, args.only, shard, force=args.force,
                                partial=args.partial)
    except BudgetClash as exc:
        print(f"attnres experiment: error: {exc}", file=sys.stderr)
        return 2
    if result is not None:
        print((Path(root) / args.experiment / "table.md").read_text())
        print(f"wrote {Path(root) / args.experiment}; gather with `attnres experiment report --root {root}`",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
