"""The experiments' runs: budgets (presets of shared hyper-parameters), the variants of each
experiment and :func:`specs`, the list of :class:`RunSpec` an experiment trains. A run's directory
name (:func:`run_key`) spells out its config, so experiments that need the same run share it.

Compute is counted as ``C = flops_per_token * tokens`` with ``flops_per_token = 6 N + 12 n_layer d T``
(N non-embedding parameters, T the context), in PFLOP/s-days (8.64e19 FLOPs) as in the report.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..model import GPT, GPTConfig

__all__ = [
    "BUDGETS",
    "DEFAULT_ROOTS",
    "EXPERIMENTS",
    "REPORT_ROOT",
    "SUBCOMMANDS",
    "Budget",
    "RunSpec",
    "ablation_variants",
    "baseline_params",
    "block_size_for",
    "long_ablation_variants",
    "run_dir_of",
    "run_key",
    "specs",
    "queries_variants",
    "study_variants",
]

PFLOPS_DAY = 8.64e19

# The sub-commands of `attnres experiment`, name -> one line. `attnres --help` and
# `attnres experiment --help` list them from here; add an experiment by adding a line (and its specs).
SUBCOMMANDS: dict[str, str] = {
    "scaling": "loss vs compute over several model sizes (PreNorm, Full, Block AttnRes, mHC), power-law fits",
    "long-scaling": "the scaling fit and compute advantage again, every size at 20 tokens/param (PreNorm, Full, Block, multi-head Block)",
    "ablation": "the report's ablation rows (and two of ours) on one model, against the PreNorm baseline",
    "long-ablation": "the ablation rows, and what could explain a shrinking lead, on the budget study's model at 20 tokens/param",
    "blocksize": "Block AttnRes loss against the block size S (S = 1 is Full AttnRes)",
    "analysis": "hidden-state magnitudes, gradient norms and depth weights of three trained models",
    "shape": "width vs depth (d_model / n_layer) at about fixed parameters, PreNorm and Block AttnRes",
    "budget": "the AttnRes advantage vs training tokens per parameter (1 to 20), two depths, code and prose corpora",
    "lr": "at the largest budget: each variant at its own best learning rate (a sweep) beside the shared one",
    "queries": "whether the pseudo-queries learn: depth weights and query steps over training, and a 10x query lr",
    "evidence": "the configuration to recommend: chosen on code and prose (3 seeds, whole-split losses), confirmed on Shakespeare and the State of the Union addresses",
    "report": "gather the finished experiments under --root into <root>/README.md",
}
EXPERIMENTS = tuple(name for name in SUBCOMMANDS if name != "report")
# where an experiment writes when no --root is given: quick runs are scratch, full runs the committed results
DEFAULT_ROOTS = {"quick": "runs/experiments", "full": "results", "report": "runs/report"}
REPORT_ROOT = "results"  # `attnres experiment report` without --root (and without --budget)

# Values of the report (Kimi Linear 48B/3B scale), for side-by-side tables.
REPORT_ABLATION = {
    "baseline": 1.766,
    "denseformer": 1.767,
    "mhc": 1.747,
    "full": 1.737,
    "block_s4": 1.746,
    "swa_w8": 1.764,
    "input_query": 1.731,
    "mixing": 1.749,
    "sigmoid": 1.741,
    "multihead": 1.752,
    "full_no_keynorm": 1.743,
    "block_no_keynorm": 1.750,
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
    shapes: tuple[
        tuple[int, int, int], ...
    ] = ()  # (d_model, n_layer, n_head) at ~ the mid model's parameters
    lr: float = 3e-3
    warmup: int = 50
    # the budget study: model shapes (d_model, n_layer, n_head), tokens per parameter, corpora, lr sweep
    study_shapes: tuple[tuple[int, int, int], ...] = ()
    # the scaling sweep at the study's largest budget (long-scaling), smallest first
    long_sizes: tuple[tuple[int, int, int], ...] = ()
    tokens_per_param: tuple[float, ...] = ()
    corpora: tuple[str, ...] = ("stdlib",)
    lrs: tuple[float, ...] = ()
    # the evidence study: its candidates compared on ``choice_corpora``, the chosen one then reported
    # on ``confirm_corpora`` (the confirmation), which played no part in the choice; its seeds
    choice_corpora: tuple[str, ...] = ()
    confirm_corpora: tuple[str, ...] = ()
    evidence_seeds: int = 1


BUDGETS: dict[str, Budget] = {
    # seconds in all: checks the pipeline end to end, not the numbers
    "quick": Budget(
        steps=12,
        batch_size=4,
        seq_len=32,
        eval_interval=12,
        eval_batches=2,
        seeds=1,
        sizes=((32, 2, 2, 10), (48, 2, 2, 12)),
        mid=(32, 4, 2),
        shapes=((32, 4, 2), (48, 2, 2)),
        warmup=2,
        study_shapes=((16, 1, 2), (16, 2, 2)),
        long_sizes=((16, 1, 2), (24, 1, 2)),
        tokens_per_param=(0.02, 0.05),
        corpora=("stdlib", "stdlib-docs"),
        lrs=(1e-3, 3e-3),
        choice_corpora=("stdlib",),
        confirm_corpora=("stdlib-docs",),
    ),
    # the real runs: ~4 CPU-hours (scaling), ~3 CPU-hours (ablation) on 2 cores
    "full": Budget(
        steps=500,
        batch_size=16,
        seq_len=128,
        eval_interval=100,
        eval_batches=20,
        seeds=2,
        sizes=((64, 4, 4, 400), (96, 6, 4, 500), (128, 8, 4, 600), (160, 10, 4, 700)),
        mid=(96, 8, 4),
        # ~0.8-1.0 M non-embedding parameters each (12 L d^2), d_model / L from 3.6 to 32
        shapes=((64, 18, 4), (80, 12, 4), (96, 8, 4), (112, 6, 4), (128, 4, 4)),
        # 12 and 24 sublayers at matched parameters (d 64: 353,088; d 48: 357,552), so depth is what
        # differs; 20 tokens/param ~ 7.1M tokens each. (d 64 at 24 sublayers, 0.67M parameters,
        # would cost an estimated ~4x the 12-sublayer runs: ~2x the tokens at ~2x the FLOPs a token.)
        study_shapes=((64, 6, 4), (48, 12, 4)),
        # 49k-739k parameters, 2.1-2.8x apart; (64, 6, 4) is the study's model (its runs are shared)
        long_sizes=((32, 2, 4), (48, 4, 4), (64, 6, 4), (80, 8, 4)),
        tokens_per_param=(1.0, 4.0, 20.0),
        corpora=("stdlib", "stdlib-docs"),
        lrs=(1e-3, 3e-3, 1e-2),
        choice_corpora=("stdlib", "stdlib-docs"),
        confirm_corpora=("shakespeare", "sotu"),
        evidence_seeds=3,
    ),
}


def _model(d: int, n_layer: int, n_head: int) -> dict:
    return {"d_model": d, "n_layer": n_layer, "n_head": n_head}


def block_size_for(n_layer: int, n_blocks: int = 8) -> int:
    """S for N ~ 8 blocks, never 1 (S = 1 would be Full AttnRes itself)."""
    return max(2, math.ceil(2 * n_layer / n_blocks))


def ablation_variants(n_layer: int, d_model: int, block_size: int = 4) -> dict[str, dict]:
    """The rows of the report's table 4 (plus two of ours from the critique's open problems), the
    Block rows at ``block_size``."""
    heads = 16 if d_model % 16 == 0 else 8
    block = {"residual": "block", "block_size": block_size}
    return {
        "baseline": {"residual": "prenorm"},
        "denseformer": {"residual": "denseformer"},
        "mhc": {"residual": "mhc"},
        "full": {"residual": "full"},
        f"block_s{block_size}": block,
        "swa_w8": {"residual": "swa", "window": 8},
        "input_query": {"residual": "full", "query": "input"},
        "mixing": {"residual": "mixing"},
        "sigmoid": {"residual": "full", "normalize": "sigmoid"},
        "multihead": {**block, "depth_heads": heads},
        "full_no_keynorm": {"residual": "full", "key_norm": False},
        "block_no_keynorm": {**block, "key_norm": False},
        "ours_lowrank_query": {**block, "query": "lowrank", "query_rank": 8},
        "ours_intra_gate": {**block, "intra_gate": True},
    }


def long_ablation_variants(n_layer: int, d_model: int, n_head: int) -> dict[str, dict]:
    """The ablation rows on the budget study's model, its Block at the study's block size, plus
    the knobs that could explain a lead shrinking with budget, each one change from Block and from
    Full: the pseudo-queries drawn at std 1/sqrt(d) instead of zero (logits of std ~1 at step 0:
    the mix starts away from uniform), a learnable key-norm gain (production AttnRes has one) and
    the depth-mixing parameters decayed like the matrices (0.1, towards zero: a uniform mix) where
    they are not decayed at all. The study's multi-head rows (``depth_heads = n_head``) stand
    beside the report's 16-head row."""
    block = {"residual": "block", "block_size": block_size_for(n_layer)}
    knobs = {
        "query_init": {"query_init_std": round(d_model**-0.5, 4)},
        "key_gain": {"key_norm_gain": True},
        "query_decay": {"depth_weight_decay": 0.1},
    }
    return {
        **ablation_variants(n_layer, d_model, block["block_size"]),
        **{v: o for v, o in study_variants(n_layer, n_head).items() if v.endswith(f"_h{n_head}")},
        **{
            f"{name}_{k}": {**rule, **o}
            for name, rule in (("block", block), ("full", {"residual": "full"}))
            for k, o in knobs.items()
        },
    }


def study_variants(n_layer: int, n_head: int) -> dict[str, dict]:
    """The budget study's variants: the baseline, Block (N ~ 8) and Full AttnRes, each with one
    pseudo-query and with one per attention head (``heads = n_head``: d / H as in attention)."""
    block = {"residual": "block", "block_size": block_size_for(n_layer)}
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
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, d_model=d)).num_params(
            non_embedding=False
        )


def study_steps(d: int, n_layer: int, n_head: int, tokens_per_param: float, budget: Budget) -> int:
    """Optimizer steps that train ``tokens_per_param`` tokens per (baseline) parameter."""
    tokens = tokens_per_param * baseline_params(d, n_layer, n_head)
    return max(1, round(tokens / (budget.batch_size * budget.seq_len)))


def _at_tokens_per_param(
    shapes: tuple[tuple[int, int, int], ...], tokens_per_param: float, batch_size: int, seq_len: int
) -> tuple[tuple[int, int, int, int], ...]:
    """``(d_model, n_layer, n_head, steps)`` with the steps that train ``tokens_per_param`` tokens
    per (PreNorm) parameter at ``batch_size`` x ``seq_len`` tokens a step."""
    return tuple(
        (d, n, h, max(1, round(tokens_per_param * baseline_params(d, n, h) / (batch_size * seq_len))))
        for d, n, h in shapes
    )


# The GPU-scale recipe (`attnres experiment scaling --preset report --data PATH`): the scaling sweep at
# 20 tokens per parameter, 3M-49M parameters (0.06B-1B tokens a run, ~1.8B tokens a variant), sized
# for one H200 in hours at bf16 autocast. lr 2e-3 / warmup 200 are an untuned start for these widths:
# `--override lr=...` to sweep. Byte tokens (vocab 256) on the user's text.
BUDGETS["report"] = Budget(
    steps=1000,
    batch_size=64,
    seq_len=512,
    eval_interval=1000,
    eval_batches=50,
    seeds=1,
    sizes=_at_tokens_per_param(((256, 4, 4), (384, 6, 6), (512, 8, 8), (640, 10, 10)), 20.0, 64, 512),
    mid=(384, 6, 6),
    lr=2e-3,
    warmup=200,
)


def _study_schedule(steps: int, budget: Budget) -> dict:
    """Per-run schedule of a study run: its own full cosine over ``steps``, warmup 5 % (>= 2 steps),
    about ten evaluations and checkpoints."""
    return {
        "steps": steps,
        "warmup": max(2, steps // 20),
        "eval_interval": max(1, steps // 10),
        "log_interval": max(1, steps // 50),
    }


def corpus_tag(data: str) -> str:
    return "code" if data == "stdlib" else "prose" if data == "stdlib-docs" else data


def _study_spec(
    budget: Budget,
    data: str,
    shape: tuple[int, int, int],
    tpp: float,
    variant: str,
    o: dict,
    seed: int,
    lr: float | None = None,
) -> RunSpec:
    d, n_layer, n_head = shape
    steps = study_steps(d, n_layer, n_head, tpp, budget)
    cfg = {**_model(d, n_layer, n_head), **_study_schedule(steps, budget), **o}
    if data != "stdlib":
        cfg["data"] = data
    if lr is not None and lr != budget.lr:  # the shared lr keeps the budget study's key: one run, not two
        cfg.update(lr=lr, min_lr=lr / 10)
    group = f"{corpus_tag(data)}_L{2 * n_layer}"
    lr_tag = f"_lr{lr:g}" if lr is not None else ""
    return RunSpec(f"{group}_tpp{tpp:g}_{variant}{lr_tag}_s{seed}", variant, cfg, seed, group)


def _scaling_specs(budget: Budget) -> list[RunSpec]:
    out = []
    for d, n_layer, n_head, steps in budget.sizes:
        size = f"d{d}_l{n_layer}"
        variants = {
            "prenorm": {"residual": "prenorm"},
            "full": {"residual": "full"},
            "block": {"residual": "block", "block_size": block_size_for(n_layer)},
            "mhc": {"residual": "mhc"},
        }
        for seed in range(budget.seeds):
            for v, o in variants.items():
                cfg = {**_model(d, n_layer, n_head), "steps": steps, **o}
                out.append(RunSpec(f"{size}_{v}_s{seed}", v, cfg, seed, size))
    return out


def _long_scaling_specs(budget: Budget) -> list[RunSpec]:
    # each size at the study's largest budget with the study's schedule, so its model's runs are the
    # budget study's; the baseline and the two AttnRes rules of the report's scaling figure, and
    # Block with one depth head per attention head (multi-head across width)
    if not budget.long_sizes:
        return []
    tpp = max(budget.tokens_per_param)
    out = []
    for d, n_layer, n_head in budget.long_sizes:
        size = f"d{d}_l{n_layer}"
        for seed in range(budget.seeds):
            for v, o in study_variants(n_layer, n_head).items():
                if v in ("prenorm", "block", "full", f"block_h{n_head}"):
                    spec = _study_spec(budget, budget.corpora[0], (d, n_layer, n_head), tpp, v, o, seed)
                    out.append(dataclasses.replace(spec, name=f"{size}_tpp{tpp:g}_{v}_s{seed}", group=size))
    return out


def _ablation_specs(budget: Budget) -> list[RunSpec]:
    d, n_layer, n_head = budget.mid
    return [
        RunSpec(f"{v}_s{seed}", v, {**_model(d, n_layer, n_head), **o}, seed)
        for seed in range(budget.seeds)
        for v, o in ablation_variants(n_layer, d).items()
    ]


def _long_ablation_specs(budget: Budget) -> list[RunSpec]:
    # the budget study's first model and corpus at its largest budget: the baseline, Full, Block and
    # the multi-head rows are the budget study's own runs (same keys: trained once)
    if not budget.study_shapes:
        return []
    shape, tpp = budget.study_shapes[0], max(budget.tokens_per_param)
    variants = long_ablation_variants(shape[1], shape[0], shape[2])
    return [
        _study_spec(budget, budget.corpora[0], shape, tpp, v, o, seed)
        for seed in range(budget.seeds)
        for v, o in variants.items()
    ]


def _blocksize_specs(budget: Budget) -> list[RunSpec]:
    d, n_layer, n_head = budget.mid
    L = 2 * n_layer
    out = []
    for seed in range(budget.seeds):
        out.append(
            RunSpec(
                f"baseline_s{seed}", "baseline", {**_model(d, n_layer, n_head), "residual": "prenorm"}, seed
            )
        )
        for s in sorted({s for s in (1, 2, 4, 8, 16, L) if s <= L}):
            o = {**_model(d, n_layer, n_head), "residual": "block", "block_size": s}
            out.append(RunSpec(f"S{s}_s{seed}", f"S={s}", o, seed))
    return out


def _analysis_specs(budget: Budget) -> list[RunSpec]:
    d, n_layer, n_head = budget.mid
    block = {"residual": "block", "block_size": block_size_for(n_layer)}
    variants = {"baseline": {"residual": "prenorm"}, "full": {"residual": "full"}, "block": block}
    return [RunSpec(v, v, {**_model(d, n_layer, n_head), **o}, 0) for v, o in variants.items()]


def _shape_specs(budget: Budget) -> list[RunSpec]:
    out = []
    for d, n_layer, n_head in budget.shapes:
        block = {"residual": "block", "block_size": block_size_for(n_layer)}
        for v, o in {"prenorm": {"residual": "prenorm"}, "block": block}.items():
            group = f"d{d}_l{n_layer}"
            out.append(RunSpec(f"{group}_{v}", v, {**_model(d, n_layer, n_head), **o}, 0, group))
    return out


def _budget_specs(budget: Budget) -> list[RunSpec]:
    # ordered so that finished runs answer the first question first: the shallow model on code,
    # then on prose, budgets ascending, seeds in turn; then the deeper model
    return [
        _study_spec(budget, data, shape, tpp, v, o, seed)
        for shape in budget.study_shapes
        for data in budget.corpora
        for tpp in budget.tokens_per_param
        for seed in range(budget.seeds)
        for v, o in study_variants(shape[1], shape[2]).items()
    ]


def _lr_specs(budget: Budget) -> list[RunSpec]:
    if not budget.study_shapes:
        return []
    shape, tpp = budget.study_shapes[0], max(budget.tokens_per_param)
    return [
        _study_spec(budget, data, shape, tpp, v, o, seed, lr)
        for data in budget.corpora
        for seed in range(budget.seeds)
        for lr in budget.lrs
        for v, o in study_variants(shape[1], shape[2]).items()
    ]


#: the query learning-rate multiples of the queries study (at its smaller budget; 1 at both)
QUERY_LR_SCALES = (0.3, 10.0)


def queries_variants(n_layer: int, scales: tuple[float, ...] = QUERY_LR_SCALES) -> dict[str, dict]:
    """The queries study: the baseline, and Block and Full AttnRes logging their depth mixing
    (``log_depth``, which leaves training bit-identical) at the shared query lr and at ``scales``
    times it (variant ``<rule>_qlr<scale>``)."""
    block = {"residual": "block", "block_size": block_size_for(n_layer)}
    out: dict[str, dict] = {"prenorm": {"residual": "prenorm"}}
    for name, rule in (("block", block), ("full", {"residual": "full"})):
        out[name] = {**rule, "log_depth": True}
        for scale in scales:
            out[f"{name}_qlr{scale:g}"] = {**rule, "log_depth": True, "depth_lr_scale": scale}
    return out


def _queries_specs(budget: Budget) -> list[RunSpec]:
    # the shallow model on code: the query lr multiples at the second-largest budget, then the
    # trajectories at the shared query lr at the largest
    if not budget.study_shapes:
        return []
    shape = budget.study_shapes[0]
    *_, lower, top = (0.0, *budget.tokens_per_param)
    return [
        _study_spec(budget, budget.corpora[0], shape, tpp, v, o, seed)
        for tpp, scales in ((lower, QUERY_LR_SCALES), (top, ()))
        if tpp > 0
        for seed in range(budget.seeds)
        for v, o in queries_variants(shape[1], scales).items()
    ]


#: the candidate the choice rule picked (:func:`evidence_variants`); None until the choice runs are
#: all finished and `attnres experiment evidence --partial` has applied the rule
EVIDENCE_CHOSEN: str | None = None


def evidence_variants(n_layer: int, n_head: int) -> dict[str, dict]:
    """The evidence study's candidates: the budget study's five (PreNorm, the report's Block, Full,
    and both with one depth head per attention head), the two best ablation rows of the long
    ablation (Full with sigmoid weights, DenseFormer), and 4-head Block combined with each of the
    two ablation rows that help it independently there (sigmoid weights, an input-dependent query).

    The choice rule, fixed before any confirmation run: the AttnRes candidate with the lowest
    mean whole-split validation loss over the choice corpora and seeds is chosen if its paired
    lead over the report's Block (per corpus and seed) is more than twice that lead's standard
    error; otherwise the report's Block stays the recommendation."""
    block = {"residual": "block", "block_size": block_size_for(n_layer)}
    heads = {**block, "depth_heads": n_head}
    return {
        **study_variants(n_layer, n_head),
        "sigmoid": {"residual": "full", "normalize": "sigmoid"},
        "denseformer": {"residual": "denseformer"},
        f"block_h{n_head}_sigmoid": {**heads, "normalize": "sigmoid"},
        f"block_h{n_head}_input": {**heads, "query": "input"},
    }


def _evidence_specs(budget: Budget) -> list[RunSpec]:
    # the budget study's first model at its largest budget, every final loss on the whole
    # validation split; seeds outermost so that a stopped study has whole seeds; the choice
    # corpora first, then the confirmation's PreNorm and Block (and the chosen one once chosen)
    if not budget.study_shapes or not budget.confirm_corpora:
        return []
    shape, tpp = budget.study_shapes[0], max(budget.tokens_per_param)
    variants = evidence_variants(shape[1], shape[2])
    confirm = ["prenorm", "block"] + [EVIDENCE_CHOSEN] * (EVIDENCE_CHOSEN not in (None, "prenorm", "block"))
    pairs = [(data, v) for data in budget.choice_corpora for v in variants]
    pairs += [(data, v) for data in budget.confirm_corpora for v in confirm]
    return [
        _study_spec(budget, data, shape, tpp, v, {**variants[v], "final_eval": "split"}, seed)
        for seed in range(budget.evidence_seeds)
        for data, v in pairs
    ]


_SPECS = {
    "scaling": _scaling_specs,
    "long-scaling": _long_scaling_specs,
    "ablation": _ablation_specs,
    "long-ablation": _long_ablation_specs,
    "blocksize": _blocksize_specs,
    "analysis": _analysis_specs,
    "shape": _shape_specs,
    "budget": _budget_specs,
    "lr": _lr_specs,
    "queries": _queries_specs,
    "evidence": _evidence_specs,
}


def specs(experiment: str, budget: Budget) -> list[RunSpec]:
    """The runs of ``experiment`` under ``budget``."""
    if experiment not in _SPECS:
        raise ValueError(f"experiment: expected one of {EXPERIMENTS}, got {experiment!r}")
    return _SPECS[experiment](budget)


def with_overrides(spec: RunSpec, overrides: dict) -> RunSpec:
    """``spec`` with ``overrides`` on top of its config (``attnres experiment --override``)."""
    return dataclasses.replace(spec, overrides={**spec.overrides, **overrides})


# options renamed since runs were first keyed: a key keeps the first spelling, so committed runs are found
_KEY_SPELLING = {"depth_heads": "heads"}


def _key_value(value: object) -> object:
    """A path (``--data``) as its last part plus a hash of the whole: a key is one folder name."""
    if isinstance(value, str) and ("/" in value or "\\" in value):
        return f"{Path(value).name}~{hashlib.sha256(value.encode()).hexdigest()[:8]}"
    return value


def run_key(spec: RunSpec, budget_name: str) -> str:
    """Directory name of a run: its budget, config overrides and seed, spelled out."""
    named = {_KEY_SPELLING.get(k, k): _key_value(v) for k, v in spec.overrides.items()}
    parts = [budget_name] + [f"{k}={named[k]}" for k in sorted(named)] + [f"seed={spec.seed}"]
    return ",".join(parts).replace("=", "-").replace(",", "_")


def run_dir_of(root: str | Path, spec: RunSpec, budget_name: str) -> Path:
    """Where a run of the ``budget_name`` preset lives under an experiments root."""
    return Path(root) / "runs" / run_key(spec, budget_name)
