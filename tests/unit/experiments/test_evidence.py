"""The evidence study: its runs, its paired intervals, the choice rule and the equal-time reading."""

from __future__ import annotations

import json
import math
import sys

import pytest

from attention_residuals.experiments import evidence
from attention_residuals.experiments.specs import BUDGETS, RunSpec

specs = sys.modules["attention_residuals.experiments.specs"]  # the package exports a function of that name


def test_the_full_study_is_three_seeds_of_every_candidate_on_the_choice_corpora_then_the_confirmation():
    runs = specs.specs("evidence", BUDGETS["full"])
    variants = specs.evidence_variants(6, 4)
    assert len(runs) == 3 * (2 * len(variants) + 2 * 2)
    assert [r.seed for r in runs] == sorted(r.seed for r in runs)  # seeds outermost: whole seeds first
    first = runs[: 2 * len(variants)]
    assert {r.overrides.get("data", "stdlib") for r in first} == {"stdlib", "stdlib-docs"}
    confirm = runs[2 * len(variants) : 2 * len(variants) + 4]
    assert [(r.overrides["data"], r.variant) for r in confirm] == [
        ("shakespeare", "prenorm"),
        ("shakespeare", "block"),
        ("sotu", "prenorm"),
        ("sotu", "block"),
    ]
    assert all(r.overrides["final_eval"] == "split" and r.overrides["steps"] == 3448 for r in runs)
    # the budget study's Block at the same settings, but its own runs (keyed by final_eval)
    keys = {specs.run_key(r, "full") for r in runs}
    assert len(keys) == len(runs)
    assert not keys & {specs.run_key(r, "full") for r in specs.specs("budget", BUDGETS["full"])}


def test_the_chosen_candidate_joins_the_confirmation(monkeypatch):
    monkeypatch.setattr(specs, "EVIDENCE_CHOSEN", "block_h4")
    runs = specs.specs("evidence", BUDGETS["full"])
    assert {(r.overrides["data"], r.variant) for r in runs if r.overrides.get("data") == "sotu"} == {
        ("sotu", "prenorm"),
        ("sotu", "block"),
        ("sotu", "block_h4"),
    }


def test_paired_interval_is_the_student_t_interval():
    mean, lo, hi = evidence.paired_interval([-0.01, -0.02, -0.03])
    assert mean == pytest.approx(-0.02)
    assert hi - mean == pytest.approx(4.302652729749462 * 0.01 / math.sqrt(3))  # t(0.975, 2)
    assert math.isnan(evidence.paired_interval([0.5])[1])


def _summary(loss: float, train_s: float = 100.0, run_dir: str = "", **kw) -> dict:
    return {
        "split_val": {"loss": loss, "se": 0.001, "tokens": 1000, "windows": 10},
        "train_s": train_s,
        "steps": 100,
        "final_val_loss": loss,
        "run_dir": run_dir,
        **kw,
    }


def _study(losses: dict[str, dict[str, list[float]]]):
    todo, summaries = [], {}
    for corpus, variants in losses.items():
        for v, per_seed in variants.items():
            for seed, loss in enumerate(per_seed):
                spec = RunSpec(f"{corpus}_{v}_s{seed}", v, {"data": corpus}, seed)
                todo.append(spec)
                summaries[spec.name] = _summary(loss)
    return todo, summaries


def test_the_choice_rule_keeps_block_unless_a_candidate_leads_it_by_more_than_two_standard_errors():
    base = {"prenorm": [1.30, 1.31, 1.29], "block": [1.28, 1.29, 1.27]}
    clear = {c: {**base, "block_h4": [1.26, 1.27, 1.25]} for c in ("stdlib", "stdlib-docs")}
    todo, summaries = _study(clear)
    decision = evidence.apply_choice_rule(evidence._by_corpus(todo, summaries), ["code", "prose"])
    assert decision["chosen"] == "block_h4" and decision["lead_over_block"] == pytest.approx(0.02)
    noisy = {c: {**base, "block_h4": [1.24, 1.30, 1.27]} for c in ("stdlib", "stdlib-docs")}
    todo, summaries = _study(noisy)
    decision = evidence.apply_choice_rule(evidence._by_corpus(todo, summaries), ["code", "prose"])
    assert decision["best"] == "block_h4" and decision["chosen"] == "block"
    assert "not more than 2 SE" in decision["why"]
    todo, summaries = _study({"stdlib": base})
    assert (
        evidence.apply_choice_rule(evidence._by_corpus(todo, summaries), ["code", "prose"])["chosen"]
        == "block"
    )
    assert evidence.apply_choice_rule({}, ["code"])["chosen"] is None  # nothing finished yet


def test_equal_time_reads_the_slower_runs_curve_at_the_baselines_time(tmp_path):
    rows = [{"step": s, "val_loss": 2.0 - s / 100} for s in (0, 50, 100)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    slow = _summary(1.0, run_dir=str(tmp_path))
    # 0.8x PreNorm's throughput: step 80 of 100 in its time, between the evaluations at 50 and 100
    assert evidence.equal_time_loss(slow, 0.8) == pytest.approx(1.2)
    assert evidence.equal_time_loss(_summary(0.9), 1.1) == 0.9  # faster: its final loss
    # the throughput ratio is the median over corpora and seeds: one disturbed run does not move it
    by_corpus = {
        "code": {
            "prenorm": {k: _summary(1.0, train_s=100.0) for k in range(3)},
            "block": {
                0: _summary(1.0, train_s=125.0),
                1: _summary(1.0, train_s=125.0),
                2: _summary(1.0, train_s=400.0),
            },
        }
    }
    assert evidence.speeds(by_corpus) == {"prenorm": 1.0, "block": 0.8}


def test_the_analysis_writes_tables_and_a_plot(tmp_path):
    base = {"prenorm": [1.30, 1.31, 1.29], "block": [1.28, 1.29, 1.27], "block_h4": [1.26, 1.27, 1.25]}
    todo, summaries = _study({c: base for c in ("stdlib", "stdlib-docs", "shakespeare", "sotu")})
    out = evidence.evidence_analysis(todo, summaries, tmp_path, BUDGETS["full"], {})
    assert out["choice"]["chosen"] == "block_h4"
    assert set(out["confirmation"]) == {"shakespeare", "sotu"}
    assert out["confirmation"]["sotu"]["chosen_vs_block"]["delta"] == pytest.approx(-0.02)
    table = (tmp_path / "table.md").read_text()
    assert "block_h4 leads Block by +0.0200" in table and "chosen − Block" in table
    assert (tmp_path / "evidence.png").stat().st_size > 1000
