"""The evidence study's tables (``attnres experiment evidence``): which configuration to recommend.

Every run's final loss is on the whole validation split (``final_eval=split``: every token once,
with its standard error). Per corpus, each candidate's Δ vs PreNorm is paired by seed, with a
two-sided 95 % paired-t interval over the seeds (n − 1 degrees of freedom). The choice rule of
:func:`.specs.evidence_variants` is applied to the choice corpora only; the confirmation corpora
then report the chosen candidate and the report's Block against PreNorm. Beside Δ at equal tokens
stand the throughput ratio and Δ at PreNorm's training time (see :func:`equal_time_loss`).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from ..extras import require
from ..files import atomic_write
from ..plotting import new_figure
from ..training.run import read_metrics
from .specs import Budget, RunSpec, corpus_tag

__all__ = ["apply_choice_rule", "equal_time_loss", "evidence_analysis", "interim_lines", "paired_interval"]

BASELINE, REPORT = "prenorm", "block"


def interim_lines(meta: dict) -> list[str]:
    """The line that marks a ``--partial`` table (none when every planned run finished)."""
    if "runs_planned" not in meta:
        return []
    return ["", f"Interim: {meta['runs_finished']} of {meta['runs_planned']} planned runs finished."]


def paired_interval(deltas: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """Mean of paired differences and its two-sided ``level`` Student-t interval (n − 1 df);
    the interval is NaN for a single pair."""
    stats = require("scipy.stats", "plots", "the studies' confidence intervals")
    mean = statistics.fmean(deltas)
    if len(deltas) < 2:
        return mean, math.nan, math.nan
    half = stats.t.ppf(0.5 + level / 2, len(deltas) - 1) * statistics.stdev(deltas) / math.sqrt(len(deltas))
    return mean, mean - half, mean + half


def _curve(run_dir: str) -> list[tuple[int, float]]:
    """The run's evaluations ``(step, val loss on the sampled windows)`` from its metrics."""
    return [
        (int(r["step"]), float(r["val_loss"])) for r in read_metrics(run_dir) if r.get("val_loss") is not None
    ]


def equal_time_loss(run: dict, speed: float) -> float | None:
    """The run's validation loss (sampled windows) at the training time PreNorm took, for a variant
    whose throughput is ``speed`` times PreNorm's: at step ``speed * steps``, interpolated linearly
    between its evaluations; a variant as fast or faster gives its final loss. Its cosine schedule
    has not finished at that step, so a run planned for that time would do at least as well: for
    the slower variant this is a bound in PreNorm's favour."""
    if speed >= 1.0:
        return run["final_val_loss"]
    step = run["steps"] * speed
    curve = _curve(run["run_dir"])
    for (s0, l0), (s1, l1) in zip(curve, curve[1:]):
        if s0 <= step <= s1:
            return l0 + (l1 - l0) * (step - s0) / (s1 - s0)
    return None


def speeds(by_corpus: dict) -> dict[str, float]:
    """Each variant's throughput over PreNorm's: the median over every (corpus, seed) pair of
    PreNorm's training seconds over the variant's (same tokens). The median, because a run that
    shared the machine with other work for a while is slower for reasons of its own."""
    ratios: dict[str, list[float]] = {}
    for runs in by_corpus.values():
        for v, seeds in runs.items():
            for k, s in seeds.items():
                if k in runs.get(BASELINE, {}):
                    ratios.setdefault(v, []).append(runs[BASELINE][k]["train_s"] / s["train_s"])
    return {v: statistics.median(r) for v, r in ratios.items()}


def _by_corpus(todo: list[RunSpec], summaries: dict) -> dict[str, dict[str, dict[int, dict]]]:
    """``{corpus: {variant: {seed: summary}}}`` of the finished runs with a whole-split loss."""
    out: dict[str, dict[str, dict[int, dict]]] = {}
    for spec in todo:
        s = summaries.get(spec.name)
        if s and "split_val" in s:
            data = corpus_tag(spec.overrides.get("data", "stdlib"))
            out.setdefault(data, {}).setdefault(spec.variant, {})[spec.seed] = s
    return out


def _loss(s: dict) -> float:
    return s["split_val"]["loss"]


def _row(runs: dict[int, dict], base: dict[int, dict], speed: float | None) -> dict:
    """A candidate's numbers on one corpus: losses, Δ vs PreNorm paired by seed with its interval,
    the throughput ratio (:func:`speeds`) and Δ at PreNorm's training time."""
    seeds = sorted(set(runs) & set(base))
    losses = [_loss(runs[k]) for k in sorted(runs)]
    row = {
        "seeds": sorted(runs),
        "loss": statistics.fmean(losses),
        "loss_std": statistics.stdev(losses) if len(losses) > 1 else math.nan,
        "loss_se": max(runs[k]["split_val"]["se"] for k in runs),
        "tokens": runs[min(runs)]["split_val"]["tokens"],
        "speed": speed,
    }
    if seeds:
        deltas = [_loss(runs[k]) - _loss(base[k]) for k in seeds]
        mean, lo, hi = paired_interval(deltas)
        timed = [equal_time_loss(runs[k], speed) for k in seeds] if speed is not None else [None]
        row.update(
            delta=mean,
            delta_ci=(lo, hi),
            delta_per_seed=deltas,
            delta_equal_time=(
                statistics.fmean(t - base[k]["final_val_loss"] for t, k in zip(timed, seeds))
                if all(t is not None for t in timed)
                else None
            ),
        )
    return row


def apply_choice_rule(by_corpus: dict, choice: list[str]) -> dict:
    """The rule of :func:`.specs.evidence_variants` on the ``choice`` corpora: the AttnRes candidate
    with the lowest mean loss over every (corpus, seed) they share is chosen when its paired lead
    over the report's Block is more than twice that lead's standard error, else Block."""
    pairs = [(c, k) for c in choice for k in by_corpus.get(c, {}).get(REPORT, {})]
    names = {v for c in choice for v in by_corpus.get(c, {})} - {BASELINE}
    scores = {}
    for v in sorted(names):
        shared = [(c, k) for c, k in pairs if k in by_corpus[c].get(v, {})]
        if shared and len(shared) == len(pairs):
            scores[v] = [_loss(by_corpus[c][v][k]) - _loss(by_corpus[c][REPORT][k]) for c, k in shared]
    if REPORT not in scores or len(pairs) < 2:
        return {"chosen": None, "why": "the choice runs are not finished", "pairs": len(pairs)}
    best = min(scores, key=lambda v: statistics.fmean(scores[v]))
    lead = -statistics.fmean(scores[best])
    se = statistics.stdev(scores[best]) / math.sqrt(len(scores[best])) if best != REPORT else 0.0
    chosen = best if best != REPORT and lead > 2 * se else REPORT
    return {
        "chosen": chosen,
        "best": best,
        "lead_over_block": lead,
        "lead_se": se,
        "pairs": len(pairs),
        "candidates": {v: statistics.fmean(d) for v, d in scores.items()},
        "why": (
            f"Block itself has the lowest mean loss over {len(pairs)} corpus-seed pairs: Block stays"
            if best == REPORT
            else f"{best} leads Block by {lead:+.4f} ± {se:.4f} (mean ± SE over {len(pairs)} corpus-seed "
            "pairs): " + ("more than 2 SE, chosen" if chosen == best else "not more than 2 SE: Block stays")
        ),
    }


def _fmt(x: float | None, digits: int = 4, sign: bool = True) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def _corpus_table(name: str, rows: dict[str, dict]) -> list[str]:
    out = [
        f"**{name}**",
        "",
        "| variant | seeds | val loss (whole split) | run SE | Δ vs PreNorm [95 % CI] | Δ per seed "
        "| tokens/s × PreNorm | Δ at PreNorm's time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v, r in rows.items():
        ci = r.get("delta_ci", (math.nan, math.nan))
        delta = "—" if v == BASELINE else f"{_fmt(r.get('delta'))} [{_fmt(ci[0])}, {_fmt(ci[1])}]"
        per_seed = ", ".join(_fmt(d) for d in r.get("delta_per_seed", [])) if v != BASELINE else "—"
        out.append(
            f"| {v} | {len(r['seeds'])} | {r['loss']:.4f} ± {_fmt(r['loss_std'], sign=False)} "
            f"| {r['loss_se']:.4f} | {delta} | {per_seed} "
            f"| {'1' if v == BASELINE else _fmt(r.get('speed'), 3, sign=False)} "
            f"| {'—' if v == BASELINE else _fmt(r.get('delta_equal_time'))} |"
        )
    return out + [""]


def evidence_analysis(
    todo: list[RunSpec], summaries: dict, exp_dir: Path, budget: Budget, meta: dict
) -> dict:
    """Per corpus every candidate against PreNorm, the choice on the choice corpora and what the
    confirmation corpora say of it; ``table.md`` and ``results.json`` content."""
    by_corpus = _by_corpus(todo, summaries)
    choice = [corpus_tag(c) for c in budget.choice_corpora]
    confirm = [corpus_tag(c) for c in budget.confirm_corpora]
    tables: dict[str, dict[str, dict]] = {}
    speed = speeds(by_corpus)
    for corpus in choice + confirm:
        runs = by_corpus.get(corpus, {})
        if BASELINE in runs:
            tables[corpus] = {v: _row(runs[v], runs[BASELINE], speed.get(v)) for v in runs}
    decision = apply_choice_rule(by_corpus, choice)
    (d, n_layer, n_head), tpp = budget.study_shapes[0], max(budget.tokens_per_param)
    steps = max((s.overrides.get("steps", 0) for s in todo), default=0)
    lines = [
        "# Evidence: which configuration to recommend",
        "",
        f"The budget study's first model (d {d}, {2 * n_layer} sublayers, {n_head} attention heads) at "
        f"{tpp:g} tokens/param ({steps} steps of {budget.batch_size} x {budget.seq_len} tokens, lr "
        f"{budget.lr:g} for every variant, each run its own cosine schedule). Chosen on {', '.join(choice)}; confirmed on {', '.join(confirm)}, which played no part "
        "in the choice. Final losses on the whole validation split (every token once, disjoint windows); "
        "run SE: the largest standard error of one run's loss (spread of its windows' means). Δ = variant − "
        "PreNorm paired by seed, with a two-sided 95 % paired-t interval over the seeds (n − 1 df). "
        "tokens/s × PreNorm: the median over every corpus and seed of PreNorm's training seconds over the "
        "variant's (same tokens, one thread; other work shared the machine at times, hence the median). Δ at "
        "PreNorm's time: the variant's loss (sampled validation windows) at the step it reaches in PreNorm's "
        "training time (steps × that ratio), interpolated between its evaluations, minus PreNorm's final loss "
        "on the same windows; the variant's schedule has not annealed there, so this favours PreNorm.",
        "",
    ]
    for corpus, rows in tables.items():
        lines += _corpus_table(corpus, rows)
    lines += [
        "## The choice",
        "",
        f"Rule (fixed before the confirmation runs): {_RULE}",
        "",
        f"Result: {decision['why']}",
        "",
    ]
    if decision.get("candidates"):
        lines += ["| candidate | mean Δ vs Block on the choice corpora |", "|---|---|"]
        lines += [
            f"| {v} | {_fmt(d)} |" for v, d in sorted(decision["candidates"].items(), key=lambda x: x[1])
        ]
        lines.append("")
    confirmation = _confirmation(by_corpus, confirm, decision.get("chosen"), speed)
    lines += _confirmation_lines(confirmation)
    _plot(tables, exp_dir / "evidence.png")
    lines += ["![Δ vs PreNorm per corpus](evidence.png)", *interim_lines(meta), ""]
    atomic_write(exp_dir / "table.md", "\n".join(lines))
    return {
        "tables": tables,
        "choice": decision,
        "confirmation": confirmation,
        "choice_corpora": choice,
        "confirm_corpora": confirm,
    }


def _confirmation(by_corpus: dict, confirm: list[str], chosen: str | None, speed: dict[str, float]) -> dict:
    """On each confirmation corpus: Block and the chosen candidate vs PreNorm, and chosen − Block,
    paired by seed (``chosen`` None: Block only, until the choice is made)."""
    out = {}
    for corpus in confirm:
        runs = by_corpus.get(corpus, {})
        if BASELINE not in runs:
            continue
        row = {
            v: _row(runs[v], runs[BASELINE], speed.get(v))
            for v in dict.fromkeys([REPORT, chosen])
            if v in runs
        }
        if chosen not in (None, REPORT) and chosen in runs and REPORT in runs:
            seeds = sorted(set(runs[chosen]) & set(runs[REPORT]))
            deltas = [_loss(runs[chosen][k]) - _loss(runs[REPORT][k]) for k in seeds]
            if deltas:
                mean, lo, hi = paired_interval(deltas)
                row["chosen_vs_block"] = {"delta": mean, "delta_ci": (lo, hi), "seeds": seeds}
        out[corpus] = row
    return out


def _confirmation_lines(confirmation: dict) -> list[str]:
    if not confirmation:
        return []
    out = [
        "## The confirmation",
        "",
        "| corpus | variant | seeds | Δ vs PreNorm [95 % CI] | Δ at PreNorm's time |",
        "|---|---|---|---|---|",
    ]
    for corpus, rows in confirmation.items():
        for v, r in rows.items():
            lo, hi = r.get("delta_ci", (math.nan, math.nan))
            label = "chosen − Block" if v == "chosen_vs_block" else v
            timed = "—" if v == "chosen_vs_block" else _fmt(r.get("delta_equal_time"))
            out.append(
                f"| {corpus} | {label} | {len(r['seeds'])} | {_fmt(r.get('delta'))} [{_fmt(lo)}, {_fmt(hi)}] "
                f"| {timed} |"
            )
    return out + [""]


def _plot(tables: dict[str, dict[str, dict]], path: Path) -> None:
    """One panel per corpus: each candidate's Δ vs PreNorm, its seeds as dots and the 95 % interval."""
    if not tables:
        return
    fig = new_figure((4.2 * len(tables), 3.8))
    for i, (corpus, rows) in enumerate(tables.items()):
        ax = fig.add_subplot(1, len(tables), i + 1)
        names = [v for v in rows if v != BASELINE and "delta" in rows[v]]
        for y, v in enumerate(names):
            r = rows[v]
            lo, hi = r["delta_ci"]
            if math.isfinite(lo):
                ax.plot([lo, hi], [y, y], color="tab:blue", lw=2, alpha=0.5)
            ax.plot(r["delta_per_seed"], [y] * len(r["delta_per_seed"]), "o", color="tab:blue", ms=3)
            ax.plot([r["delta"]], [y], "D", color="black", ms=5)
        ax.axvline(0.0, color="grey", lw=1)
        ax.set_yticks(range(len(names)), names if i == 0 else [""] * len(names))
        ax.invert_yaxis()
        ax.set_title(corpus)
        ax.set_xlabel("Δ val loss vs PreNorm (nats/token)")
    fig.tight_layout()
    fig.savefig(path)


_RULE = (
    "the AttnRes candidate with the lowest mean whole-split loss over the choice corpora and seeds is "
    "chosen if its paired lead over the report's Block is more than twice that lead's standard error; "
    "otherwise the report's Block stays the recommendation."
)
