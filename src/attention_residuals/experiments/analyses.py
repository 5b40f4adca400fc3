"""The analyses: each experiment's finished runs -> its table (``table.md``), plots (PNG) and the
numbers of ``results.json``. One function per experiment, registered in :data:`ANALYSES`; the
power-law fit and the compute advantage of the scaling experiment.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..files import atomic_write
from ..model import GPT, GPTConfig
from ..plotting import matplotlib_module, new_figure
from ..training.data import eval_batches, load_corpus
from ..training.depth import depth_weight_summary
from ..training.run import checkpoints_in, load_run_checkpoint, read_metrics
from . import dynamics
from .evidence import equal_time_loss, evidence_analysis, interim_lines
from .specs import (
    PFLOPS_DAY,
    REPORT_ABLATION,
    REPORT_SCALING,
    baseline_params,
    block_size_for,
    corpus_tag,
    long_ablation_variants,
)

__all__ = ["ANALYSES", "DEPTH_FILE", "compute_advantage", "compute_for_loss", "fit_power_law"]

DEPTH_FILE = "depth_weights.json"  # a trained run's depth-weight summary, kept beside its summary.json

# ---------------------------------------------------------------- fits


def fit_power_law(compute: list[float], loss: list[float]) -> tuple[float, float]:
    """Least squares in log space of ``loss = A * compute^-alpha``; returns ``(A, alpha)``."""
    if len(compute) < 2:
        raise ValueError("compute: need at least two points to fit a power law")
    slope, intercept = np.polyfit(np.log(compute), np.log(loss), 1)
    return float(math.exp(intercept)), float(-slope)


def compute_for_loss(fit: tuple[float, float], loss: float) -> float:
    """The compute at which the power law ``fit`` = (A, α), L = A·C^-α, reaches ``loss``."""
    a, alpha = fit
    return (loss / a) ** (-1.0 / alpha)


def compute_advantage(base: tuple[float, float], other: tuple[float, float], compute: float) -> float:
    """How much more compute the baseline needs to reach ``other``'s loss at ``compute``."""
    a_o, alpha_o = other
    return compute_for_loss(base, a_o * compute**-alpha_o) / compute


def _final(s: dict) -> float:
    return float(s["final_val_loss"])


def _mean_std(values: list[float]) -> tuple[float, float]:
    arr = np.asarray(values, dtype=float)
    return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else 0.0


def _scaling_rows(todo, summaries) -> list[dict]:
    """One row per (size, variant): compute, mean and spread of the final val loss over seeds."""
    points: dict[tuple[str, str], list[dict]] = {}  # (size, variant) -> the summaries of its seeds
    for spec in todo:
        points.setdefault((spec.group, spec.variant), []).append(summaries[spec.name])
    rows = []
    for (size, variant), runs in points.items():
        s = runs[0]
        losses = [_final(r) for r in runs]
        mean, std = _mean_std(losses)
        rows.append(
            {
                "size": size,
                "variant": variant,
                "params": s["params"],
                "tokens": s["tokens"],
                "compute_pfs_days": s["flops_per_token"] * s["tokens"] / PFLOPS_DAY,
                "val_loss": mean,
                "val_loss_std": std,
                "val_losses": losses,
                "seeds": len(runs),
                "train_s": sum(r["train_s"] for r in runs),
            }
        )
    return rows


def _plot_scaling(rows: list[dict], fits: dict, path: Path) -> None:
    """Loss vs compute on log-log axes: the means, their seeds as small dots, the fitted laws."""
    ticker = matplotlib_module("matplotlib.ticker")

    fig = new_figure((6, 4.2))
    ax = fig.subplots()
    for v in dict.fromkeys(r["variant"] for r in rows):
        mine = sorted((r for r in rows if r["variant"] == v), key=lambda r: r["compute_pfs_days"])
        cs = [r["compute_pfs_days"] for r in mine]
        line = ax.plot(cs, [r["val_loss"] for r in mine], "o", label=None)[0]
        for r in mine:
            if r["seeds"] > 1:
                ax.plot(
                    [r["compute_pfs_days"]] * r["seeds"],
                    r["val_losses"],
                    ".",
                    color=line.get_color(),
                    alpha=0.4,
                )
        if v in fits:
            a, alpha = fits[v]
            grid = np.geomspace(min(cs), max(cs), 50)
            ax.plot(grid, a * grid**-alpha, "-", color=line.get_color(), label=f"{v}: {a:.3f}·C^-{alpha:.3f}")
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
    fig.savefig(path, dpi=120)


def _scaling(todo, summaries, exp_dir, budget, meta) -> dict:
    out, lines = _scaling_tables(todo, summaries, exp_dir, budget)
    (exp_dir / "table.md").write_text("\n".join(lines) + "\n")
    return out


def _long_scaling(todo, summaries, exp_dir, budget, meta) -> dict:
    """The scaling tables with every size at the study's largest budget, where the early-regime
    sweep (``scaling``) trains ~0.4-3.3 tokens/param."""
    out, lines = _scaling_tables(todo, summaries, exp_dir, budget)
    tpp = sorted(set(_tokens_per_param(todo).values()))
    sizes = dict.fromkeys((s.group, s.overrides["n_layer"]) for s in todo)
    blocks = ", ".join(
        f"{g}: S = {block_size_for(n)} (N = {_n_blocks(n, block_size_for(n))})" for g, n in sizes
    )
    shared = f"d{budget.study_shapes[0][0]}_l{budget.study_shapes[0][1]}"
    lines += [
        "",
        f"Every size trains {', '.join(f'{t:g}' for t in tpp)} tokens per (PreNorm) parameter with its own "
        f"cosine schedule (warmup 5 %), lr {budget.lr:g}, on the {corpus_tag(budget.corpora[0])} corpus. "
        f"Block: {blocks}; block_hH: Block with one depth head per attention head (H of them)."
        + (f" The {shared} runs are the budget study's." if any(g == shared for g, _ in sizes) else ""),
    ]
    lines += interim_lines(meta)
    (exp_dir / "table.md").write_text("\n".join(lines) + "\n")
    return out


def _scaling_tables(todo, summaries, exp_dir, budget) -> tuple[dict, list[str]]:
    """The per-point table, the power-law fits and compute advantages, and the plot."""
    rows = _scaling_rows(todo, summaries)
    # fit every variant over the same sizes: an interim table's sizes that not every variant has
    # finished are listed but not fitted (a longer fit range alone would move a variant's advantage)
    sizes_of: dict[str, set[str]] = {}
    for r in rows:
        sizes_of.setdefault(r["variant"], set()).add(r["size"])
    common = set.intersection(*sizes_of.values()) if sizes_of else set()
    unfitted = [size for size in dict.fromkeys(r["size"] for r in rows) if size not in common]
    by_variant: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r["size"] in common:
            by_variant.setdefault(r["variant"], []).append((r["compute_pfs_days"], r["val_loss"]))
    fits = {v: fit_power_law(*zip(*pts)) for v, pts in by_variant.items() if len(pts) >= 2}
    # each variant at its own largest compute: its fit read inside its range; and its measured loss
    # against PreNorm's measured loss at its largest compute, through PreNorm's fitted exponent only
    # (PreNorm's own fit residual there cancels)
    last = {v: max(pts) for v, pts in by_variant.items()}
    advantage, measured = {}, {}
    if "prenorm" in fits:
        own = compute_for_loss(fits["prenorm"], last["prenorm"][1]) / last["prenorm"][0]
        for v, f in fits.items():
            c, loss = last[v]
            advantage[v] = compute_advantage(fits["prenorm"], f, c)
            measured[v] = compute_for_loss(fits["prenorm"], loss) / c / own
    _plot_scaling(rows, fits, exp_dir / "scaling.png")
    lines = [
        "| size | variant | params | tokens | C (PFLOP/s-days) | val loss | seeds | per seed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['size']} | {r['variant']} | {r['params']:,} | {r['tokens']:,} | {r['compute_pfs_days']:.3e} | "
        f"{r['val_loss']:.4f} | {r['seeds']} | {', '.join(f'{x:.4f}' for x in r['val_losses'])} |"
        for r in rows
    ]
    lines += [
        "",
        "C = (6 N + 12 n_layer d T) × tokens, N = non-embedding parameters (LM head included), "
        "T = context; val loss: the mean over the row's seeds; fit: least squares of log mean loss "
        "on log C"
        + (
            f", over the sizes every variant has finished ({', '.join(unfitted)} listed, not fitted)."
            if unfitted
            else "."
        ),
        "",
        "| variant | A | α | its largest C | compute advantage: from the fits | from the measured losses "
        "| report A, α |",
        "|---|---|---|---|---|---|---|",
    ]
    for v, (a, alpha) in fits.items():
        rep = REPORT_SCALING.get(v)
        rep_s = f"{rep[0]}, {rep[1]}" if rep else "—"
        adv = [f"{d[v]:.2f}×" if v in d else "—" for d in (advantage, measured)]
        lines.append(f"| {v} | {a:.4f} | {alpha:.4f} | {last[v][0]:.3e} | {adv[0]} | {adv[1]} | {rep_s} |")
    if "prenorm" in fits:
        n = len(by_variant["prenorm"])
        # how far past PreNorm's largest fitted run its fit is read (above 1: extrapolated)
        past = max(
            (
                x[v] * last[v][0] / last["prenorm"][0]
                for x in (advantage, measured)
                for v in x
                if v != "prenorm"
            ),
            default=1.0,
        )
        reach = (
            "An advantage above 1 reads PreNorm's fit beyond PreNorm's largest fitted run (here up to "
            f"{past:.2f}× past it): an extrapolation of slopes fitted to {n} points, not a measured "
            "comparison."
            if past > 1
            else f"Every advantage reads PreNorm's fit ({n} points) within the compute PreNorm was run at."
        )
        lines += [
            "",
            "Compute advantage: how much more compute PreNorm needs to reach the variant's loss at the "
            "variant's largest C — from the fits (PreNorm's fit against the variant's fit there), or from "
            "the measured mean losses at the two largest runs, converted to compute with PreNorm's fitted "
            f"exponent alone. {reach} A depends on the loss's and C's units, so only α compares with the "
            "report's.",
        ]
    return {
        "rows": rows,
        "fits": {v: {"A": a, "alpha": al} for v, (a, al) in fits.items()},
        "advantage_at_largest_compute": advantage,
        "advantage_from_measured_loss": measured,
        "largest_compute_pfs_days": {v: c for v, (c, _) in last.items()},
    }, lines


def _seeded_table(todo, summaries) -> dict[str, dict]:
    groups: dict[str, list[float]] = {}
    for spec in todo:
        groups.setdefault(spec.variant, []).append(_final(summaries[spec.name]))
    return {v: {"losses": ls, "mean": _mean_std(ls)[0], "std": _mean_std(ls)[1]} for v, ls in groups.items()}


def _paired_verdict(per_seed: list[float]) -> str:
    """The sign of Δ on each seed: with two seeds a direction, not a significance test — the paired
    Δs share the baseline's seed, so they are judged against each other, not the unpaired seed std."""
    if len(per_seed) < 2:
        return "one seed"
    if all(d < 0 for d in per_seed):
        return "better on every seed"
    if all(d > 0 for d in per_seed):
        return "worse on every seed"
    return "seeds disagree"


def _seeds_cell(losses: list[float]) -> str:
    """``mean ± std`` over seeds (the sample std, n − 1), or the one seed's loss marked as such (a std
    of one is no spread)."""
    if len(losses) == 1:
        return f"{losses[0]:.4f} (1 seed)"
    mean, std = _mean_std(losses)
    return f"{mean:.4f} ± {std:.4f}"


def _n_blocks(n_layer: int, block_size: int) -> int:
    """Block AttnRes's number of blocks N over the 2 n_layer sublayers (the last may be partial)."""
    return math.ceil(2 * n_layer / block_size)


def _ablation_table(todo, summaries) -> tuple[dict, list[str]]:
    """Each variant's loss over seeds, Δ vs the baseline paired by seed (the mean of the per-seed
    differences, listed too), a verdict from the sign on each seed, and the report's number beside
    it (its Block row for ours at any S)."""
    table = _seeded_table(todo, summaries)
    base = table.get("baseline")  # absent in an interim table before the baseline finished
    by_seed = _paired_deltas(todo, summaries, lambda spec: "all")["all"]
    lines = [
        "| variant | val loss (mean ± std) | Δ vs baseline | Δ per seed | verdict | report | report Δ |",
        "|---" * 7 + "|",
    ]
    for v, r in table.items():
        rep = REPORT_ABLATION.get("block_s4" if v.startswith("block_s") else v)
        rep_s = f"{rep:.3f}" if rep else "—"
        rep_d = f"{rep - REPORT_ABLATION['baseline']:+.3f}" if rep else "—"
        cell = _delta_cell(by_seed[v], by_seed["baseline"]) if base else None
        r["per_seed"] = cell["per_seed"] if cell else []
        if cell is None:
            r.update(delta=None, verdict="—")
        else:
            r["delta"] = cell["mean"]
            if v == "baseline":
                r["verdict"] = "reference"
            else:
                r["verdict"] = _paired_verdict(r["per_seed"])
        delta = "—" if r["delta"] is None else f"{r['delta']:+.4f}"
        per = ", ".join(f"{d:+.4f}" for d in r["per_seed"]) if v != "baseline" and r["per_seed"] else "—"
        lines.append(
            f"| {v} | {_seeds_cell(r['losses'])} | {delta} | {per} | {r['verdict']} | {rep_s} | {rep_d} |"
        )
    return table, lines


def _ablation(todo, summaries, exp_dir, budget, meta) -> dict:
    table, lines = _ablation_table(todo, summaries)
    lines += [
        "",
        "Val loss: mean ± sample std (n − 1) over seeds; Δ: paired by seed (mean, then each seed); "
        "verdict: the sign of Δ on each seed (two seeds give a direction, not a significance test). "
        "The report column is its 48B ablation: a different scale, for direction only.",
    ]
    lines += interim_lines(meta)
    (exp_dir / "table.md").write_text("\n".join(lines) + "\n")
    return {"table": table}


def _long_ablation(todo, summaries, exp_dir, budget, meta) -> dict:
    """The ablation at the budget study's largest budget, Δ paired by seed, and what it was run at."""
    table, lines = _ablation_table(todo, summaries)
    d, n_layer, n_head = budget.study_shapes[0]
    S = block_size_for(n_layer)
    H = long_ablation_variants(n_layer, d, n_head)["multihead"]["depth_heads"]
    some = todo[0]
    lines += [
        "",
        f"{corpus_tag(budget.corpora[0]).capitalize()} corpus; the budget study's model: {2 * n_layer} "
        f"sublayers (n_layer {n_layer}), d {d}, {n_head} attention heads, "
        f"{baseline_params(d, n_layer, n_head):,} parameters; {_tokens_per_param(todo)[some.name]:g} "
        f"tokens/param ({some.overrides['steps']} steps, {summaries[some.name]['tokens']:,} tokens), its "
        f"own cosine schedule (warmup 5 %), lr {budget.lr:g} for every variant; the Block rows at "
        f"S = {S} (N = {_n_blocks(n_layer, S)} blocks). baseline, full, block_s{S} and the _h{n_head} rows "
        f"are the budget study's runs; multihead: Block with {H} depth heads (d/H = {d // H}), the "
        f"report's row, where _h{n_head} has one per attention head. _query_init: the pseudo-queries "
        "drawn from N(0, 1/d) instead of zero (the rest of the start is its zero-init twin's); "
        "_key_gain: a learnable gain in the key RMSNorm; _query_decay: the depth-mixing parameters "
        "under the matrices' weight decay (0.1, towards a uniform mix) where the rest are not decayed. "
        "Val loss: mean ± sample std (n − 1). "
        "Δ: paired by seed (mean, then each seed); "
        "verdict: the sign of Δ on each seed (two seeds give a direction, not a significance test). "
        "The report column is its 48B ablation (its Block row, at S = 4 of its depth, beside our "
        f"block_s{S}): a different scale, for direction only.",
    ]
    lines += interim_lines(meta)
    (exp_dir / "table.md").write_text("\n".join(lines) + "\n")
    return {"table": table}


def _blocksize(todo, summaries, exp_dir, budget, meta) -> dict:
    table = _seeded_table(todo, summaries)
    points = sorted((int(v.split("=")[1]), r) for v, r in table.items() if v.startswith("S="))
    fig = new_figure((5.5, 4))
    ax = fig.subplots()
    ax.errorbar(
        [s for s, _ in points],
        [r["mean"] for _, r in points],
        yerr=[r["std"] for _, r in points],
        fmt="o-",
        capsize=3,
        label="Block AttnRes",
    )
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
    lines += [f"| {s} | {_seeds_cell(r['losses'])} |" for s, r in points]
    if base:
        lines.append(f"| baseline | {_seeds_cell(base['losses'])} |")
    (exp_dir / "table.md").write_text("\n".join(lines) + "\n")
    return {"table": table}


def _trained_model(run_dir: Path) -> GPT | None:
    """The final model of a run directory, or ``None`` when its checkpoint is not there (the
    committed runs keep only their config, metrics and summary)."""
    if not checkpoints_in(run_dir):
        return None
    cfg = json.loads((run_dir / "config.json").read_text())
    model = GPT(GPTConfig.from_dict(cfg["model"]))
    load_run_checkpoint(run_dir, model=model, restore_rng=False)
    return model.eval()


def _depth_rows(todo, summaries, tpp_of, seq_len: int) -> list[dict]:
    """:func:`depth_weight_summary` of every finished AttnRes run whose checkpoint is
    here, on one fixed batch of its own corpus's validation split."""
    batches: dict[str, torch.Tensor] = {}
    out = []
    for spec in todo:
        if spec.overrides.get("residual") == "prenorm":
            continue
        run_dir = Path(summaries[spec.name]["run_dir"])
        cached = run_dir / DEPTH_FILE  # beside the run: the checkpoints are not committed, this is
        if cached.is_file():
            stats = json.loads(cached.read_text())
        else:
            model = _trained_model(run_dir)
            if model is None:
                continue
            data = spec.overrides.get("data", "stdlib")
            if data not in batches:
                val = load_corpus(data, vocab_size=256).val
                batches[data] = next(iter(eval_batches(val, n_batches=1, batch_size=8, seq_len=seq_len)))[0]
            stats = depth_weight_summary(model, batches[data])
            atomic_write(cached, json.dumps(stats, indent=1))
        out.append(
            {
                "group": spec.group,
                "tokens_per_param": tpp_of[spec.name],
                "variant": spec.variant,
                "seed": spec.seed,
                **stats,
            }
        )
    return out


def _depth_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = [
        "",
        "Depth weights of the trained models (deeper half of the sublayers and the final readout; "
        "mean over seeds): entropy H/log n (1 = the uniform mix they start at), weight on the embedding "
        "and on the most recent source, and the pseudo-queries' logit scale mean ||w_l||·sqrt(d) (0 at "
        "init). Multi-head rows: each head's numbers averaged; a multi-head run summarised before the "
        "weights were recorded per head shows only its logit scale (the average of the heads would "
        "read as uniform).",
        "",
        "| corpus, sublayers | tokens/param | variant | entropy ratio | on embedding | on latest | logit scale |",
        "|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["group"], r["tokens_per_param"], r["variant"]) for r in rows})
    for group, tpp, variant in keys:
        mine = [r for r in rows if (r["group"], r["tokens_per_param"], r["variant"]) == (group, tpp, variant)]
        mean = {
            k: float(np.mean([r[k] if r[k] is not None else math.nan for r in mine]))
            for k in ("entropy_ratio", "embedding_weight", "latest_weight", "query_logit_scale")
        }
        multi = "_h" in variant and not all(r.get("per_head") for r in mine)
        cells = (
            ["—"] * 3
            if multi
            else [
                f"{mean['entropy_ratio']:.3f}",
                f"{mean['embedding_weight']:.3f}",
                f"{mean['latest_weight']:.3f}",
            ]
        )
        scale = mean["query_logit_scale"]
        lines.append(
            f"| {group} | {tpp:g} | {variant} | "
            + " | ".join(cells)
            + (f" | {scale:.2f} |" if math.isfinite(scale) else " | — |")
        )
    return lines


def _analysis(todo, summaries, exp_dir, budget, meta) -> dict:
    corpus = load_corpus(None, vocab_size=256)
    x, y = next(iter(eval_batches(corpus.val, n_batches=1, batch_size=8, seq_len=budget.seq_len)))
    out: dict[str, Any] = {}
    for spec in todo:
        run_dir = Path(summaries[spec.name]["run_dir"])
        model = _trained_model(run_dir)
        if model is None:
            raise FileNotFoundError(f"analysis: {run_dir} has no checkpoint.safetensors to analyse")
        entry = {
            "magnitudes": dynamics.magnitudes(model, x),
            "grad_norms": dynamics.gradient_norms(model, x, y),
        }
        if model.residual.has_depth_weights:
            entry["depth_weights"] = dynamics.depth_weights(model, x)
        out[spec.name] = entry
    fig = new_figure((14, 3.8))
    axes = fig.subplots(1, 3)
    for name, e in out.items():
        axes[0].plot(e["magnitudes"]["input_rms"], "o-", ms=3, label=name)
        axes[1].plot(e["magnitudes"]["output_rms"], "o-", ms=3, label=name)
        axes[2].plot(e["grad_norms"], "o-", ms=3, label=name)
    for ax, title in zip(
        axes, ["RMS of layer input h_l", "RMS of layer output v_l", "gradient norm per sublayer"]
    ):
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
                im = ax.imshow(
                    np.ma.masked_invalid(m), cmap="viridis", vmin=0, vmax=np.nanmax(m), aspect="auto"
                )
                ax.set_title(f"{name}: {key.replace('_', '-')} layers")
                ax.set_xlabel("source (0 = embedding)")
                ax.set_ylabel("layer")
                fig.colorbar(im, ax=ax)
        fig.tight_layout()
        fig.savefig(exp_dir / "depth_weights.png", dpi=120)
    lines = ["| run | val loss | max/min RMS of h_l | max/min grad norm |", "|---|---|---|---|"]
    for name, e in out.items():
        hin, g = e["magnitudes"]["input_rms"], e["grad_norms"]
        lines.append(
            f"| {name} | {_final(summaries[name]):.4f} | {max(hin) / min(hin):.2f} | {max(g) / min(g):.2f} |"
        )
    (exp_dir / "table.md").write_text("\n".join(lines) + "\n")
    return {"runs": out}


def _shape(todo, summaries, exp_dir, budget, meta) -> dict:
    """The report's architecture sweep (its figure 7) in one dimension: at about fixed parameters
    and tokens, loss against d_model / L_b (L_b = n_layer, the Transformer blocks)."""
    rows = []
    for spec in todo:
        s, o = summaries[spec.name], spec.overrides
        rows.append(
            {
                "shape": spec.group,
                "variant": spec.variant,
                "d_model": o["d_model"],
                "n_layer": o["n_layer"],
                "d_over_L": o["d_model"] / o["n_layer"],
                "params": s["params"],
                "val_loss": _final(s),
            }
        )
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
    lines = [
        "| d_model | L_b | d_model / L_b | params | prenorm | block | Δ (block − prenorm) |",
        "|---|---|---|---|---|---|---|",
    ]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        p, b = by.get((shape, "prenorm")), by.get((shape, "block"))
        ref = p or b
        cells = [f"{x['val_loss']:.4f}" if x else "—" for x in (p, b)]
        delta = f"{b['val_loss'] - p['val_loss']:+.4f}" if p and b else "—"
        lines.append(
            f"| {ref['d_model']} | {ref['n_layer']} | {ref['d_over_L']:.1f} | {ref['params']:,} | "
            f"{cells[0]} | {cells[1]} | {delta} |"
        )
    lines += [
        "",
        "Best d_model / L_b: "
        + ", ".join(f"{v} {x:.1f} ({y:.4f})" for v, (x, y) in best.items())
        + " (the report: baseline 60, AttnRes 45, at 2.3e8 active parameters).",
    ]
    (exp_dir / "table.md").write_text("\n".join(lines) + "\n")
    return {"rows": rows, "best_d_over_L": {v: x for v, (x, _) in best.items()}}


def _paired_deltas(todo, summaries, key) -> dict:
    """``{key(spec): {variant: {seed: val loss}}}`` over the finished runs."""
    out: dict = {}
    for spec in todo:
        out.setdefault(key(spec), {}).setdefault(spec.variant, {})[spec.seed] = _final(summaries[spec.name])
    return out


def _delta_cell(losses: dict[int, float], base: dict[int, float]) -> dict | None:
    """Δ = variant − baseline, paired by seed: mean, the per-seed values, and their spread; ``None``
    when the two share no finished seed (an interim table)."""
    deltas = [losses[s] - base[s] for s in sorted(losses) if s in base]
    if not deltas:
        return None
    return {
        "mean": float(np.mean(deltas)),
        "per_seed": deltas,
        "spread": float(max(deltas) - min(deltas)) if len(deltas) > 1 else 0.0,
    }


def _budget_rows(todo, summaries, tpp_of) -> list[dict]:
    """One row per (corpus and depth, tokens/param): PreNorm's loss and each variant's paired Δ."""
    cells = _paired_deltas(todo, summaries, lambda sp: (sp.group, tpp_of[sp.name]))
    rows = []
    for (group, tpp), by_var in sorted(cells.items()):
        base = by_var.get("prenorm", {})
        some = next(s for s in todo if s.group == group and tpp_of[s.name] == tpp)
        row = {
            "group": group,
            "tokens_per_param": tpp,
            "tokens": summaries[some.name]["tokens"],
            "steps": some.overrides["steps"],
            "prenorm": base,  # {seed: val loss}
            "deltas": {
                v: cell for v, ls in by_var.items() if v != "prenorm" and (cell := _delta_cell(ls, base))
            },
        }
        rows.append(row)
    return rows


def _plot_budget(rows: list[dict], path: Path, planned_tpp: list[float]) -> None:
    """One panel per (corpus, depth) group ``<corpus>_L<sublayers>``: a row per corpus, a column per
    depth, all on the x range of the planned budgets so a panel still running reads against the rest."""
    place = {g: (c, int(L)) for g in dict.fromkeys(r["group"] for r in rows) for c, L in [g.rsplit("_L", 1)]}
    corpora = list(dict.fromkeys(c for c, _ in place.values()))
    depths = sorted({L for _, L in place.values()})
    fig = new_figure((5.2 * len(depths), 4 * len(corpora)))
    grid = fig.subplots(len(corpora), len(depths), squeeze=False, sharex=True)
    axes = {g: grid[corpora.index(c)][depths.index(L)] for g, (c, L) in place.items()}
    for ax in grid.flat:  # a (corpus, depth) pair with no runs yet: no empty panel
        ax.set_visible(any(ax is used for used in axes.values()))
    for group, ax in axes.items():
        variants = list(dict.fromkeys(v for r in rows if r["group"] == group for v in r["deltas"]))
        for v in variants:
            pts = [
                (r["tokens_per_param"], r["deltas"][v])
                for r in rows
                if r["group"] == group and v in r["deltas"]
            ]
            line = ax.plot([t for t, _ in pts], [c["mean"] for _, c in pts], "o-", label=v)[0]
            for t, c in pts:
                ax.plot([t] * len(c["per_seed"]), c["per_seed"], ".", color=line.get_color(), alpha=0.5)
        ax.axhline(0.0, color="gray", ls="--", lw=1)
        ax.set_xscale("log")
        ax.set_xlim(min(planned_tpp) / 1.25, max(planned_tpp) * 1.25)
        ax.set_xlabel("training tokens per parameter")
        ax.set_ylabel("Δ val loss vs PreNorm (nats; < 0: better)")
        ax.set_title(group.replace("_", ", ").replace("L", "L = ", 1))
        if variants:  # an interim table may have no Δ yet
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _budget_table(rows: list[dict], budget, meta) -> list[str]:
    variants = list(dict.fromkeys(v for r in rows for v in r["deltas"]))
    lines = [
        "| corpus, sublayers | tokens/param | tokens | steps | PreNorm val loss | "
        + " | ".join(f"Δ {v}" for v in variants)
        + " |",
        "|---" * (5 + len(variants)) + "|",
    ]
    for r in rows:
        pre = _seeds_cell(list(r["prenorm"].values())) if r["prenorm"] else "—"
        cell = [
            (
                f"{c['mean']:+.4f} ({', '.join(f'{d:+.4f}' for d in c['per_seed'])})"
                if (c := r["deltas"].get(v))
                else "—"
            )
            for v in variants
        ]
        lines.append(
            f"| {r['group']} | {r['tokens_per_param']:g} | {r['tokens']:,} | {r['steps']} | {pre} | "
            + " | ".join(cell)
            + " |"
        )
    lines += [
        "",
        "PreNorm val loss: mean ± sample std (n − 1) over seeds. Δ = variant − PreNorm final validation "
        "loss, paired by seed: the mean, then each seed's Δ in brackets. Every budget is its own run "
        "with its own cosine schedule (warmup 5 %), lr "
        f"{budget.lr:g} for every variant; tokens/param counts all parameters of the PreNorm model. "
        + "; ".join(
            f"L{2 * n}: d {d}, n_layer {n}, {h} attention heads, {baseline_params(d, n, h):,} parameters, "
            f"Block S = {block_size_for(n)} (N = {_n_blocks(n, block_size_for(n))})"
            for d, n, h in budget.study_shapes
        )
        + ".",
    ]
    lines += interim_lines(meta)
    return lines


def _budget_time_table(todo, summaries, tpp_of) -> tuple[list[dict], list[str]]:
    """Loss per second beside loss per token: per row and variant, the throughput over PreNorm's
    (the median over seeds of PreNorm's training seconds over the variant's) and Δ at PreNorm's
    training time (:func:`.evidence.equal_time_loss`, mean over seeds)."""
    runs: dict = {}
    for spec in todo:
        runs.setdefault((spec.group, tpp_of[spec.name]), {}).setdefault(spec.variant, {})[spec.seed] = (
            summaries[spec.name]
        )
    out, variants = [], list(dict.fromkeys(s.variant for s in todo if s.variant != "prenorm"))
    for (group, tpp), by_var in sorted(runs.items()):
        base, row = by_var.get("prenorm", {}), {"group": group, "tokens_per_param": tpp, "cells": {}}
        for v in variants:
            seeds = sorted(set(by_var.get(v, {})) & set(base))
            if not seeds:
                continue
            speed = float(np.median([base[k]["train_s"] / by_var[v][k]["train_s"] for k in seeds]))
            timed = [equal_time_loss(by_var[v][k], speed) for k in seeds]
            delta = (
                float(np.mean([t - _final(base[k]) for t, k in zip(timed, seeds)]))
                if all(t is not None for t in timed)
                else None
            )
            row["cells"][v] = {"speed": speed, "delta_equal_time": delta}
        out.append(row)
    lines = [
        "",
        "At equal training time: tokens/s × PreNorm's and Δ at PreNorm's training time per variant.",
        "",
        "| corpus, sublayers | tokens/param | " + " | ".join(f"{v}: ×tok/s, Δ" for v in variants) + " |",
        "|---" * (2 + len(variants)) + "|",
    ]
    for r in out:
        cells = [
            f"{c['speed']:.3f}, {'—' if c['delta_equal_time'] is None else format(c['delta_equal_time'], '+.4f')}"
            if (c := r["cells"].get(v))
            else "—"
            for v in variants
        ]
        lines.append(f"| {r['group']} | {r['tokens_per_param']:g} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "×tok/s: the median over seeds of PreNorm's training seconds over the variant's (same tokens), as the "
        "runs were trained (two runs at a time, one thread each, with the code of their day: before the fused "
        "read, so AttnRes pays more here than it does now; `results/bench` has today's step times). Δ: the "
        "variant's validation loss at the step it reached in PreNorm's training time (steps × ×tok/s), "
        "interpolated between its evaluations, minus PreNorm's final loss; its schedule has not annealed "
        "there, so this favours PreNorm.",
    ]
    return out, lines


def _tokens_per_param(todo) -> dict[str, float]:
    """Each study run's tokens per parameter, read off its name (``..._tpp<x>_...``)."""
    return {spec.name: float(spec.name.split("_tpp")[1].split("_")[0]) for spec in todo}


def _budget(todo, summaries, exp_dir, budget, meta) -> dict:
    """Final val loss per (corpus and depth, tokens/param, variant); Δ vs PreNorm paired by seed."""
    tpp_of = _tokens_per_param(todo)
    rows = _budget_rows(todo, summaries, tpp_of)
    _plot_budget(rows, exp_dir / "budget.png", list(budget.tokens_per_param))
    depth = _depth_rows(todo, summaries, tpp_of, budget.seq_len)
    timed, time_lines = _budget_time_table(todo, summaries, tpp_of)
    lines = _budget_table(rows, budget, meta) + time_lines + _depth_table(depth)
    (exp_dir / "table.md").write_text("\n".join(lines) + "\n")
    return {"rows": rows, "equal_time": timed, "depth_weights": depth}


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
        best = {
            v: min(per_lr, key=lambda lr: np.mean(list(per_lr[lr].values()))) for v, per_lr in by_var.items()
        }
        base = by_var.get("prenorm", {})
        lines += [
            f"**{group}**",
            "",
            "| variant | "
            + " | ".join(f"lr {lr:g}" for lr in lrs)
            + " | best lr | Δ at shared lr | Δ at own best lr |",
            "|---" * (4 + len(lrs)) + "|",
        ]
        out[group] = {}
        for v, per_lr in by_var.items():
            cells = [_seeds_cell(list(per_lr[lr].values())) if lr in per_lr else "—" for lr in lrs]
            shared = _delta_cell(per_lr.get(budget.lr, {}), base.get(budget.lr, {})) if base else None
            own = _delta_cell(per_lr[best[v]], base[best["prenorm"]]) if base else None
            fmt = [("—" if v == "prenorm" or c is None else f"{c['mean']:+.4f}") for c in (shared, own)]
            lines.append(f"| {v} | " + " | ".join(cells) + f" | {best[v]:g} | {fmt[0]} | {fmt[1]} |")
            out[group][v] = {
                "per_lr": {str(lr): per_lr[lr] for lr in per_lr},
                "best_lr": best[v],
                "delta_shared_lr": shared,
                "delta_best_lr": own,
            }
        lines.append("")
    lines += [
        f"Val loss mean ± sample std (n − 1) over seeds; the shared lr is {budget.lr:g}. Δ = variant − "
        "PreNorm paired by seed, at the shared lr and with each variant (PreNorm included) at its own best "
        "lr — the lr with the lowest mean of these same final losses, a choice that favours every variant "
        "alike (no held-out selection)."
    ]
    lines += interim_lines(meta)
    (exp_dir / "table.md").write_text("\n".join(lines) + "\n")
    return {"table": out}


_TRACKED = ("entropy_ratio", "embedding_weight", "query_logit_scale", "step_over_lr")


def _trajectory(run_dir: Path, scale: float) -> dict[str, list[tuple[float, float]]]:
    """``--log-depth`` rows of a run as ``(fraction of training, value)`` series: the evaluations'
    depth-weight summary, and each logged step's update RMS over the depth group's lr."""
    rows = [r for r in read_metrics(run_dir) if r.get("depth")]
    end = max((r["step"] for r in rows), default=1)
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in _TRACKED}
    for r in rows:
        d, t = r["depth"], r["step"] / end
        for k in _TRACKED[:3]:
            if k in d:
                out[k].append((t, d[k]))
        if "update_rms" in d and r["lr"]:
            out["step_over_lr"].append((t, d["update_rms"] / (r["lr"] * scale)))
    return out


def _plot_queries(curves: dict[tuple[float, str], list[dict]], path: Path) -> None:
    labels = {
        "entropy_ratio": "depth-weight entropy / log n (1 = uniform)",
        "embedding_weight": "weight on the embedding",
        "query_logit_scale": "query logit scale ||w||·sqrt(d)",
        "step_over_lr": "query update RMS / its lr",
    }
    budgets = sorted({tpp for tpp, _ in curves})
    fig = new_figure((4.2 * len(_TRACKED), 3.6 * len(budgets)))
    axes = fig.subplots(len(budgets), len(_TRACKED), squeeze=False)
    for row, tpp in enumerate(budgets):
        for col, key in enumerate(_TRACKED):
            ax = axes[row][col]
            for (t, variant), runs in curves.items():
                if t != tpp:
                    continue
                color = None
                for i, series in enumerate(runs):
                    pts = series[key]
                    if pts:
                        line = ax.plot(
                            [x for x, _ in pts],
                            [y for _, y in pts],
                            "-" if i == 0 else "--",
                            color=color,
                            label=variant if i == 0 else None,
                        )[0]
                        color = line.get_color()
            ax.set_title(f"{tpp:g} tokens/param: {labels[key]}", fontsize=8)
            ax.set_xlabel("fraction of training")
            if key == "step_over_lr":
                ax.set_yscale("log")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _queries(todo, summaries, exp_dir, budget, meta) -> dict:
    """Final loss, Δ vs PreNorm and vs the same rule at 1x query lr (paired by seed), the depth
    mixing at the end, and its trajectory over training (seed 0 solid, seed 1 dashed)."""
    tpp_of = _tokens_per_param(todo)
    cells = _paired_deltas(todo, summaries, lambda sp: tpp_of[sp.name])
    curves: dict[tuple[float, str], list[dict]] = {}
    ends: dict[tuple[float, str], list[dict]] = {}
    for spec in todo:
        if spec.overrides.get("log_depth"):
            run_dir = Path(summaries[spec.name]["run_dir"])
            series = _trajectory(run_dir, float(spec.overrides.get("depth_lr_scale", 1.0)))
            curves.setdefault((tpp_of[spec.name], spec.variant), []).append(series)
            last = [
                r["depth"]
                for r in read_metrics(run_dir)
                if r.get("depth", {}).get("entropy_ratio") is not None
            ]
            if last:
                ends.setdefault((tpp_of[spec.name], spec.variant), []).append(last[-1])
    if curves:  # an interim table may have only the (shared) PreNorm runs finished
        _plot_queries(curves, exp_dir / "queries.png")
    lines = [
        "| tokens/param | variant | val loss | Δ vs PreNorm | Δ vs 1x query lr | entropy ratio | on embedding "
        "| logit scale |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for tpp, by_var in sorted(cells.items()):
        base = by_var.get("prenorm", {})
        for v, losses in by_var.items():
            mean, std = _mean_std(list(losses.values()))
            vs_base = _delta_cell(losses, base) if v != "prenorm" and base else None
            plain = by_var.get(v.split("_qlr")[0], {}) if "_qlr" in v else None
            vs_plain = _delta_cell(losses, plain) if plain else None
            end = {
                k: float(np.mean([e[k] for e in ends.get((tpp, v), [])])) if ends.get((tpp, v)) else None
                for k in ("entropy_ratio", "embedding_weight", "query_logit_scale")
            }
            rows.append(
                {
                    "tokens_per_param": tpp,
                    "variant": v,
                    "val_loss": (mean, std),
                    "vs_prenorm": vs_base,
                    "vs_1x": vs_plain,
                    "end": end,
                    "seeds": sorted(losses),
                }
            )
            fmt = [
                f"{c['mean']:+.4f} ({', '.join(f'{d:+.4f}' for d in c['per_seed'])})" if c else "—"
                for c in (vs_base, vs_plain)
            ]
            stats = [f"{end[k]:.3f}" if end[k] is not None else "—" for k in end]
            lines.append(
                f"| {tpp:g} | {v} | {_seeds_cell(list(losses.values()))} | " + " | ".join(fmt + stats) + " |"
            )
    lines += [
        "",
        f"{corpus_tag(budget.corpora[0]).capitalize()} corpus, {2 * budget.study_shapes[0][1]} sublayers "
        f"(d {budget.study_shapes[0][0]}), lr {budget.lr:g}, each budget its own cosine schedule. `_qlrK`: the "
        "depth-mixing parameters (pseudo-queries) at K times the lr (`--depth-lr-scale K`). Δ paired by "
        "seed (mean, then each seed). Depth columns: the last evaluation's summary (deeper half and "
        "final readout; mean over seeds), as in the budget table. The AttnRes runs log with "
        "`--log-depth`, which leaves training bit-identical (tested), so their losses are the budget "
        "study's. Trajectories: queries.png.",
    ]
    lines += interim_lines(meta)
    (exp_dir / "table.md").write_text("\n".join(lines) + "\n")
    return {"rows": rows}


ANALYSES = {
    "scaling": _scaling,
    "long-scaling": _long_scaling,
    "ablation": _ablation,
    "long-ablation": _long_ablation,
    "blocksize": _blocksize,
    "analysis": _analysis,
    "shape": _shape,
    "budget": _budget,
    "lr": _lr,
    "queries": _queries,
    "evidence": evidence_analysis,
}
