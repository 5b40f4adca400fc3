"""The experiment pipeline end to end on the quick budget (checks plumbing, not the numbers)."""

import json
import math

import pytest

from attention_residuals import experiments as ex


def test_fit_power_law_recovers_parameters():
    cs = [1e-3, 1e-2, 1e-1, 1.0]
    a, alpha = ex.fit_power_law(cs, [1.9 * c ** -0.057 for c in cs])
    assert math.isclose(a, 1.9, rel_tol=1e-9) and math.isclose(alpha, 0.057, rel_tol=1e-9)
    with pytest.raises(ValueError, match="compute"):
        ex.fit_power_law([1.0], [2.0])


def test_compute_advantage_matches_report():
    """The report's fits give ~1.25x at 5.6 PFLOP/s-days for Block over the baseline."""
    adv = ex.compute_advantage((1.891, 0.057), (1.870, 0.058), 5.6)
    assert 1.2 < adv < 1.35
    assert math.isclose(ex.compute_advantage((1.891, 0.057), (1.891, 0.057), 5.6), 1.0)


def test_scaling_averages_the_seeds_of_a_point(tmp_path):
    """Every variant runs every seed of the budget; a point's loss is the mean of its seeds, the fit
    runs on the means and the table lists each seed."""
    budget = ex.BUDGETS["full"]
    todo = ex.specs("scaling", budget)
    counts = {}
    for s in todo:
        counts[s.group, s.variant] = counts.get((s.group, s.variant), 0) + 1
    assert budget.seeds >= 2 and set(counts.values()) == {budget.seeds}
    sizes = sorted({s.group for s in todo}, key=[s.group for s in todo].index)
    summaries = {
        s.name: {"flops_per_token": 1e6 * 10 ** sizes.index(s.group), "tokens": 1e6, "params": 1,
                 "final_val_loss": 2.0 * 0.9 ** sizes.index(s.group) + 0.01 * s.seed, "train_s": 1.0}
        for s in todo
    }
    out = ex._scaling(todo, summaries, tmp_path, budget, {})
    first = {r["variant"]: r for r in out["rows"] if r["size"] == sizes[0]}
    assert first["prenorm"]["seeds"] == 2 and first["prenorm"]["val_losses"] == [2.0, 2.01]
    assert first["prenorm"]["val_loss"] == pytest.approx(2.005)
    # the means lie on 0.005 + 2 * 0.9^i: the fit of the means, not of the first seed
    assert out["fits"]["prenorm"]["alpha"] != pytest.approx(-math.log(0.9) / math.log(10), rel=1e-6)
    assert out["fits"]["prenorm"]["alpha"] == pytest.approx(ex.fit_power_law(*zip(*[
        (r["compute_pfs_days"], r["val_loss"]) for r in out["rows"] if r["variant"] == "prenorm"]))[1])
    assert "| 2 | 2.0000, 2.0100 |" in (tmp_path / "table.md").read_text()


def test_specs_cover_the_report_tables():
    full = ex.BUDGETS["full"]
    scaling = ex.specs("scaling", full)
    assert len({s.group for s in scaling}) >= 4 and {s.variant for s in scaling} == {"prenorm", "full", "block", "mhc"}
    ablation = ex.specs("ablation", full)
    assert set(ex.REPORT_ABLATION) <= {s.variant for s in ablation}
    assert len({s.seed for s in ablation}) >= 2
    assert len({s.variant for s in ablation}) == len(ex.REPORT_ABLATION) + 2  # plus two of ours
    sizes = {s.variant for s in ex.specs("blocksize", full)}
    L = 2 * full.mid[1]
    assert {f"S={s}" for s in (1, 2, 4, 8, L)} <= sizes
    shape = ex.specs("shape", full)
    assert {s.variant for s in shape} == {"prenorm", "block"} and len({s.group for s in shape}) >= 4
    params = [12 * s.overrides["n_layer"] * s.overrides["d_model"] ** 2 for s in shape]
    assert max(params) / min(params) < 1.3  # about fixed parameters: only the shape changes
    with pytest.raises(ValueError, match="experiment"):
        ex.specs("nope", full)


def test_quick_pipeline_end_to_end(tmp_path):
    for name in ex.EXPERIMENTS:
        ex.run_experiment(name, "quick", tmp_path)
        res = json.loads((tmp_path / name / "results.json").read_text())
        assert res["meta"]["budget"] == "quick" and len(res["meta"]["corpus_sha256"]) == 64
        assert (tmp_path / name / "table.md").read_text().count("|") > 10
    for png in ("scaling/scaling.png", "blocksize/blocksize.png", "analysis/dynamics.png", "analysis/depth_weights.png",
                "shape/shape.png"):
        assert (tmp_path / png).stat().st_size > 1000
    scaling = json.loads((tmp_path / "scaling" / "results.json").read_text())
    assert set(scaling["fits"]) == {"prenorm", "full", "block", "mhc"}
    # a second invocation skips every finished run
    before = {p: p.stat().st_mtime for p in (tmp_path / "runs").glob("*/metrics.jsonl")}
    ex.run_experiment("ablation", "quick", tmp_path)
    assert before == {p: p.stat().st_mtime for p in (tmp_path / "runs").glob("*/metrics.jsonl")}
    report = ex.write_report(tmp_path).read_text()
    assert all(f"## {name}" in report for name in ex.EXPERIMENTS)
    assert "![scaling](scaling/scaling.png)" in report


def test_identical_runs_are_shared_between_experiments():
    quick = ex.BUDGETS["quick"]
    abl = {ex.run_key(s, "quick") for s in ex.specs("ablation", quick)}
    bs = {ex.run_key(s, "quick") for s in ex.specs("blocksize", quick)}
    shared = abl & bs
    assert any("prenorm" in k for k in shared) and any("block_size-4" in k for k in shared)
    assert len(abl) == len(ex.specs("ablation", quick))  # distinct runs get distinct directories
