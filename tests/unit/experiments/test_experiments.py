"""The experiment pipeline end to end on the quick budget (checks plumbing, not the numbers)."""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from attention_residuals import experiments as ex
from attention_residuals.experiments import analyses, runner
from attention_residuals.experiments.specs import ablation_variants, baseline_params


def test_fit_power_law_recovers_parameters():
    cs = [1e-3, 1e-2, 1e-1, 1.0]
    a, alpha = ex.fit_power_law(cs, [1.9 * c**-0.057 for c in cs])
    assert math.isclose(a, 1.9, rel_tol=1e-9) and math.isclose(alpha, 0.057, rel_tol=1e-9)
    with pytest.raises(ValueError, match="compute"):
        ex.fit_power_law([1.0], [2.0])


def test_compute_advantage_matches_report():
    """The report's fits give ~1.25x at 5.6 PFLOP/s-days for Block over the baseline."""
    adv = ex.compute_advantage((1.891, 0.057), (1.870, 0.058), 5.6)
    assert 1.2 < adv < 1.35
    assert math.isclose(ex.compute_advantage((1.891, 0.057), (1.891, 0.057), 5.6), 1.0)


def test_compute_for_loss_inverts_the_power_law():
    assert math.isclose(ex.compute_for_loss((1.9, 0.057), 1.9 * 3.0**-0.057), 3.0, rel_tol=1e-12)


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_scaling_advantage_is_read_at_each_variants_largest_compute_and_flagged_as_extrapolated(
    tmp_path, factor
):
    """A variant whose every loss equals PreNorm's at ``factor`` times the compute is worth that much,
    from its fit and from its measured loss; reaching it at 2x takes PreNorm's fit past PreNorm's
    largest run, and the table says so (at 0.5x it says the fit is read within PreNorm's range)."""
    budget = ex.BUDGETS["full"]
    todo = [s for s in ex.specs("scaling", budget) if s.variant in ("prenorm", "block")]
    sizes = sorted({s.group for s in todo}, key=[s.group for s in todo].index)
    law = (2.0, 0.05)

    def summary(s):
        flops = 1e6 * 10 ** sizes.index(s.group)
        c = flops * 1e6 / analyses.PFLOPS_DAY * (factor if s.variant == "block" else 1.0)
        loss = law[0] * c ** -law[1]
        return {"flops_per_token": flops, "tokens": 1e6, "params": 1, "final_val_loss": loss, "train_s": 1.0}

    out = analyses._scaling(todo, {s.name: summary(s) for s in todo}, tmp_path, budget, {})
    assert out["advantage_at_largest_compute"]["block"] == pytest.approx(factor, rel=1e-9)
    assert out["advantage_from_measured_loss"]["block"] == pytest.approx(factor, rel=1e-9)
    table = (tmp_path / "table.md").read_text()
    assert f"| {factor:.2f}× | {factor:.2f}× |" in table
    if factor > 1:
        assert f"up to 2.00× past it): an extrapolation of slopes fitted to {len(sizes)} points" in table
    else:
        assert f"PreNorm's fit ({len(sizes)} points) within the compute PreNorm was run at" in table


def test_interim_scaling_fits_every_variant_over_the_same_sizes(tmp_path):
    """PreNorm finished at a size Block has not: the row is listed, the fits (and so the advantage)
    use only the sizes both have, and the note names the size left out."""
    budget = ex.BUDGETS["full"]
    every = [s for s in ex.specs("scaling", budget) if s.variant in ("prenorm", "block")]
    sizes = sorted({s.group for s in every}, key=[s.group for s in every].index)
    todo = [s for s in every if s.variant == "prenorm" or s.group != sizes[-1]]

    def summary(s):  # PreNorm's largest point well off its law: fitted, it would move PreNorm's fit
        flops = 1e6 * 10 ** sizes.index(s.group)
        loss = 2.0 * (flops * 1e6 / analyses.PFLOPS_DAY) ** -0.05 * (0.8 if s.group == sizes[-1] else 1.0)
        return {"flops_per_token": flops, "tokens": 1e6, "params": 1, "final_val_loss": loss, "train_s": 1.0}

    out = analyses._scaling(todo, {s.name: summary(s) for s in todo}, tmp_path, budget, {})
    assert out["fits"]["prenorm"]["alpha"] == pytest.approx(0.05, rel=1e-9)
    assert out["advantage_at_largest_compute"]["block"] == pytest.approx(1.0, rel=1e-9)
    table = (tmp_path / "table.md").read_text()
    assert f"| {sizes[-1]} | prenorm |" in table
    assert f"over the sizes every variant has finished ({sizes[-1]} listed, not fitted)" in table


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
        s.name: {
            "flops_per_token": 1e6 * 10 ** sizes.index(s.group),
            "tokens": 1e6,
            "params": 1,
            "final_val_loss": 2.0 * 0.9 ** sizes.index(s.group) + 0.01 * s.seed,
            "train_s": 1.0,
        }
        for s in todo
    }
    out = analyses._scaling(todo, summaries, tmp_path, budget, {})
    first = {r["variant"]: r for r in out["rows"] if r["size"] == sizes[0]}
    assert first["prenorm"]["seeds"] == 2 and first["prenorm"]["val_losses"] == [2.0, 2.01]
    assert first["prenorm"]["val_loss"] == pytest.approx(2.005)
    # the means lie on 0.005 + 2 * 0.9^i: the fit of the means, not of the first seed
    assert out["fits"]["prenorm"]["alpha"] != pytest.approx(-math.log(0.9) / math.log(10), rel=1e-6)
    assert out["fits"]["prenorm"]["alpha"] == pytest.approx(
        ex.fit_power_law(
            *zip(*[(r["compute_pfs_days"], r["val_loss"]) for r in out["rows"] if r["variant"] == "prenorm"])
        )[1]
    )
    assert "| 2 | 2.0000, 2.0100 |" in (tmp_path / "table.md").read_text()


def test_specs_cover_the_report_tables():
    full = ex.BUDGETS["full"]
    scaling = ex.specs("scaling", full)
    assert len({s.group for s in scaling}) >= 4 and {s.variant for s in scaling} == {
        "prenorm",
        "full",
        "block",
        "mhc",
    }
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


def test_queries_study_reuses_the_budget_study_baseline():
    """The queries study's PreNorm runs are the budget study's (same keys: trained once); its
    AttnRes runs differ from the budget study's only by ``log_depth`` (and the 10x query lr)."""
    full = ex.BUDGETS["full"]
    budget = {s.name: s for s in ex.specs("budget", full)}
    queries = ex.specs("queries", full)
    scaled = {f"{r}_qlr{k:g}" for r in ("block", "full") for k in (0.3, 10)}
    by_tpp = {tpp: {s.variant for s in queries if f"_tpp{tpp}_" in s.name} for tpp in (4, 20)}
    assert by_tpp == {4: {"prenorm", "block", "full"} | scaled, 20: {"prenorm", "block", "full"}}
    for s in queries:
        rule, _, scale = s.name.partition("_qlr")
        twin = budget[rule + s.name[s.name.rindex("_s") :] if scale else s.name]
        if s.variant == "prenorm":
            assert ex.run_key(s, "full") == ex.run_key(twin, "full")
        else:
            extra = {
                "log_depth": True,
                **({"depth_lr_scale": s.overrides["depth_lr_scale"]} if scale else {}),
            }
            assert s.overrides == {**twin.overrides, **extra}


def test_long_ablation_shares_the_budget_study_runs():
    """The long ablation's baseline, Full, Block and multi-head rows are the budget study's runs at
    its largest budget (same keys: trained once); every other row is the ablation's, at the study's
    model and budget, and each knob row is one option away from Block."""
    full = ex.BUDGETS["full"]
    budget = {ex.run_key(s, "full") for s in ex.specs("budget", full) if "_tpp20_" in s.name}
    rows = ex.specs("long-ablation", full)
    shared = {s.variant for s in rows if ex.run_key(s, "full") in budget}
    assert shared == {"baseline", "full", "block_s2", "block_h4", "full_h4"}
    assert set(ablation_variants(6, 64, 2)) <= {s.variant for s in rows}
    assert {s.seed for s in rows} == {0, 1} and len({ex.run_key(s, "full") for s in rows}) == len(rows)
    for rule, twin in (("block", "block_s2"), ("full", "full")):
        base = next(s for s in rows if s.variant == twin).overrides
        for knob, extra in (
            ("query_init", {"query_init_std": 0.125}),
            ("key_gain", {"key_norm_gain": True}),
            ("query_decay", {"depth_weight_decay": 0.1}),
        ):
            assert next(s for s in rows if s.variant == f"{rule}_{knob}").overrides == {**base, **extra}


@pytest.mark.parametrize("preset", ["quick", "full"])
def test_every_run_of_an_experiment_has_its_own_name_and_directory(preset):
    for name in ex.EXPERIMENTS:
        runs = ex.specs(name, ex.BUDGETS[preset])
        assert len({s.name for s in runs}) == len(runs), name
        assert len({ex.run_key(s, preset) for s in runs}) == len(runs), name


def test_long_scaling_is_every_size_at_the_largest_budget():
    """long-scaling: PreNorm, Full, Block and 4-head Block at every size, each at 20 tokens/param; the sizes
    grow in parameters and the budget study's model is one of them (its runs shared)."""
    full = ex.BUDGETS["full"]
    rows = ex.specs("long-scaling", full)
    assert {s.variant for s in rows} == {"prenorm", "full", "block", "block_h4"} and {
        s.seed for s in rows
    } == {0, 1}
    sizes = list(dict.fromkeys(s.group for s in rows))
    assert len(sizes) >= 4
    params = []
    for size in sizes:
        o = next(s for s in rows if s.group == size).overrides
        params.append(baseline_params(o["d_model"], o["n_layer"], o["n_head"]))
        tokens = o["steps"] * full.batch_size * full.seq_len
        assert tokens / params[-1] == pytest.approx(20.0, rel=0.01)
    assert params == sorted(params) and params[-1] / params[0] > 10
    budget = {ex.run_key(s, "full") for s in ex.specs("budget", full)}
    assert {s.group for s in rows if ex.run_key(s, "full") in budget} == {"d64_l6"}


def test_long_ablation_interim_table(tmp_path):
    """``--partial``: the rows finished so far, Δ paired by seed and judged by its sign on each seed, a one-seed row marked as such,
    the report's Block row beside ours at the study's S, and the interim line; before the baseline
    finished, the losses alone."""
    budget = dataclasses.replace(ex.BUDGETS["quick"], seeds=2)
    rows = {"baseline": (0, 1), "mhc": (0, 1), "block_s2": (0, 1), "denseformer": (0,), "full": (0, 1)}
    rows["block_query_init"] = (0, 1)
    todo = [s for s in ex.specs("long-ablation", budget) if s.seed in rows.get(s.variant, ())]
    summaries = {
        s.name: {
            "final_val_loss": 3.0
            - 0.1 * s.seed
            - 0.05 * (s.variant == "mhc")
            - 0.2 * (s.variant == "block_s2")
            + (0.01 - 0.04 * s.seed) * (s.variant == "full")
            + 0.1 * (s.variant == "block_query_init"),
            "tokens": 10,
            "run_dir": "",
        }
        for s in todo
    }
    meta = {"runs_planned": 36, "runs_finished": len(todo)}
    out = analyses.ANALYSES["long-ablation"](todo, summaries, tmp_path, budget, meta)
    table = (tmp_path / "table.md").read_text()
    assert (
        "| mhc | 2.9000 ± 0.0707 | -0.0500 | -0.0500, -0.0500 | better on every seed | 1.747 | -0.019 |"
        in table
    )
    assert (
        "| block_s2 | 2.7500 ± 0.0707 | -0.2000 | -0.2000, -0.2000 | better on every seed | 1.746 | -0.020 |"
        in table
    )
    assert "| denseformer | 3.0000 (1 seed) | +0.0000 | +0.0000 | one seed |" in table
    assert "| full | 2.9400 ± 0.0990 | -0.0100 | +0.0100, -0.0300 | seeds disagree |" in table
    assert (
        "| block_query_init | 3.0500 ± 0.0707 | +0.1000 | +0.1000, +0.1000 | worse on every seed |" in table
    )
    assert "Interim: 11 of 36" in table and out["table"]["mhc"]["per_seed"] == pytest.approx([-0.05, -0.05])
    no_base = [s for s in todo if s.variant != "baseline"]
    analyses.ANALYSES["long-ablation"](no_base, summaries, tmp_path, budget, meta)
    assert "| mhc | 2.9000 ± 0.0707 | — | — | — |" in (tmp_path / "table.md").read_text()


def test_an_experiment_a_preset_does_not_define_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"--preset report: defines no runs of long-ablation; it has \("):
        ex.run_experiment("long-ablation", "report", tmp_path)
    assert not any(tmp_path.iterdir())


def test_partial_with_only_is_refused_before_anything_is_written(tmp_path):
    """``--partial`` tabulates every finished run: an ``--only`` beside it would be silently ignored."""
    with pytest.raises(ValueError, match=r"--only full: --partial tabulates every finished run of ablation"):
        ex.run_experiment("ablation", "quick", tmp_path, only=["full"], partial=True)
    assert not any(tmp_path.iterdir())


def test_budget_interim_table_marks_one_seed_and_a_delta_with_no_shared_seed(tmp_path):
    """``--partial`` with PreNorm's seed 0 and Full's seed 1 finished: PreNorm's loss is marked as one
    seed (not ``± 0``), Full's Δ is "—" (no seed to pair), never NaN; the plot spans the planned budgets."""
    budget = dataclasses.replace(ex.BUDGETS["quick"], seeds=2)
    todo = [
        s
        for s in ex.specs("budget", budget)
        if (s.variant, s.seed) in {("prenorm", 0), ("full", 1)} and s.group.endswith("L2")
    ]
    summaries = {s.name: {"final_val_loss": 3.0, "tokens": 10, "run_dir": ""} for s in todo}
    analyses._budget(todo, summaries, tmp_path, budget, {"runs_planned": 40, "runs_finished": len(todo)})
    table = (tmp_path / "table.md").read_text()
    assert "3.0000 (1 seed)" in table and "± 0.0000" not in table
    assert "nan" not in table and "Δ full" not in table
    assert (tmp_path / "budget.png").exists()


def test_queries_interim_table_with_only_the_baseline_finished(tmp_path):
    """``--partial`` before any ``--log-depth`` run finished: a table of the baseline, no plot."""
    budget = ex.BUDGETS["quick"]
    todo = [s for s in ex.specs("queries", budget) if s.variant == "prenorm"]
    summaries = {s.name: {"final_val_loss": 5.0 + s.seed, "run_dir": str(tmp_path)} for s in todo}
    analyses._queries(todo, summaries, tmp_path, budget, {"runs_planned": 10, "runs_finished": len(todo)})
    table = (tmp_path / "table.md").read_text()
    assert "| prenorm |" in table and "Interim" in table and not (tmp_path / "queries.png").exists()


def test_quick_pipeline_end_to_end(tmp_path):
    for name in ex.EXPERIMENTS:
        ex.run_experiment(name, "quick", tmp_path)
        res = json.loads((tmp_path / name / "results.json").read_text())
        assert res["meta"]["budget"] == "quick" and len(res["meta"]["corpus_sha256"]) == 64
        assert (tmp_path / name / "table.md").read_text().count("|") > 10
    for png in (
        "scaling/scaling.png",
        "blocksize/blocksize.png",
        "analysis/dynamics.png",
        "analysis/depth_weights.png",
        "shape/shape.png",
        "queries/queries.png",
        "evidence/evidence.png",
    ):
        assert (tmp_path / png).stat().st_size > 1000
    budget = (tmp_path / "budget" / "table.md").read_text()
    assert "At equal training time" in budget and "| block: ×tok/s, Δ |" in budget
    assert all(
        c["speed"] > 0
        for r in json.loads((tmp_path / "budget" / "results.json").read_text())["equal_time"]
        for c in r["cells"].values()
    )
    scaling = json.loads((tmp_path / "scaling" / "results.json").read_text())
    assert set(scaling["fits"]) == {"prenorm", "full", "block", "mhc"}
    # a second invocation skips every finished run
    before = {p: p.stat().st_mtime for p in (tmp_path / "runs").glob("*/metrics.jsonl")}
    ex.run_experiment("ablation", "quick", tmp_path)
    assert before == {p: p.stat().st_mtime for p in (tmp_path / "runs").glob("*/metrics.jsonl")}
    report = ex.write_report(tmp_path).read_text()
    assert all(f"## {name}" in report for name in ex.EXPERIMENTS)
    assert "![scaling](scaling/scaling.png)" in report
    assert report.count("Training budget: ") == len(ex.EXPERIMENTS)  # every section states its tokens/param


@pytest.mark.parametrize(("tokens", "early"), [(2_000, True), (25_000, False)])
def test_report_states_tokens_per_param_and_labels_the_early_regime(tmp_path, tokens, early):
    """A section gives its runs' tokens per parameter; below 10 it is labelled early regime."""
    (tmp_path / "ablation").mkdir()
    (tmp_path / "ablation" / "table.md").write_text("| a |\n")
    meta = {"budget": "quick", "command": "attnres experiment ablation", "corpus_sha256": "0" * 64}
    meta |= {"train_s_total": 1.0, "machine": "x86_64"}
    (tmp_path / "ablation" / "results.json").write_text(json.dumps({"meta": meta}))
    run = ex.run_dir_of(tmp_path, ex.specs("ablation", ex.BUDGETS["quick"])[0], "quick")
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"done": True, "tokens": tokens, "params_total": 1_000}))
    report = ex.write_report(tmp_path).read_text()
    assert f"Training budget: {tokens // 1000} tokens per parameter" in report
    assert ("**Early regime**" in report) is early


def test_identical_runs_are_shared_between_experiments():
    quick = ex.BUDGETS["quick"]
    abl = {ex.run_key(s, "quick") for s in ex.specs("ablation", quick)}
    bs = {ex.run_key(s, "quick") for s in ex.specs("blocksize", quick)}
    shared = abl & bs
    assert any("prenorm" in k for k in shared) and any("block_size-4" in k for k in shared)
    assert len(abl) == len(ex.specs("ablation", quick))  # distinct runs get distinct directories


@pytest.fixture
def fake_training(monkeypatch, tmp_path):
    """Every run counts as finished (no training): run_experiment only tabulates, in seconds. Works
    from ``tmp_path`` so the default roots land there."""
    monkeypatch.setattr(
        runner,
        "load_summary",
        lambda run_dir: {
            "done": True,
            "final_val_loss": 2.0,
            "run_dir": str(run_dir),
            "train_s": 1.0,
            "tokens": 1000,
            "params_total": 1000,
        },
    )
    monkeypatch.setattr(runner, "train", lambda *a, **k: pytest.fail("nothing should train here"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_partial_once_every_run_finished_is_the_whole_table(fake_training):
    """``--partial`` after the last run finished writes the table the plain command would: its
    command without ``--partial`` and no interim line; while runs are missing it counts them."""
    assert ex.main(["blocksize", "--preset", "full", "--partial"]) == 0
    whole = json.loads((fake_training / "results" / "blocksize" / "results.json").read_text())
    assert whole["meta"]["command"] == "attnres experiment blocksize --preset full --root results"
    assert "runs_planned" not in whole["meta"]
    assert "Interim" not in (fake_training / "results" / "blocksize" / "table.md").read_text()
    meta = {"command": "attnres experiment budget"}
    runner._note_options(meta, None, True, 3, 5)
    assert meta == {"command": "attnres experiment budget --partial", "runs_finished": 3, "runs_planned": 5}


def test_default_root_is_scratch_for_quick_and_results_for_full(fake_training, capsys):
    """`attnres experiment blocksize` (quick) leaves results/ alone; `--budget full` writes there with
    the command the committed README quotes."""
    tmp = fake_training
    assert ex.DEFAULT_ROOTS == {"quick": "runs/experiments", "full": "results", "report": "runs/report"}
    assert ex.main(["blocksize", "--budget", "full"]) == 0
    full = json.loads((tmp / "results" / "blocksize" / "results.json").read_text())
    assert full["meta"]["command"] == "attnres experiment blocksize --preset full --root results"
    before = (tmp / "results" / "blocksize" / "results.json").read_text()
    assert ex.main(["blocksize"]) == 0
    quick = json.loads((tmp / "runs" / "experiments" / "blocksize" / "results.json").read_text())
    assert quick["meta"]["budget"] == "quick"
    assert quick["meta"]["command"] == "attnres experiment blocksize --preset quick --root runs/experiments"
    assert (tmp / "results" / "blocksize" / "results.json").read_text() == before
    assert not any((tmp / "results" / "runs").glob("quick*"))
    assert "experiment report --root runs/experiments" in capsys.readouterr().err
    # report: results/ by default, the budget's root when --budget is given
    assert ex.main(["report"]) == 0
    assert "preset `full`" in (tmp / "results" / "README.md").read_text()
    assert ex.main(["report", "--budget", "quick"]) == 0
    assert "preset `quick`" in (tmp / "runs" / "experiments" / "README.md").read_text()
    assert ex.main(["report", "--root", str(tmp / "nowhere")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_smaller_budget_does_not_replace_bigger_results(fake_training, capsys):
    tmp = fake_training
    assert ex.main(["blocksize", "--budget", "full"]) == 0
    path = tmp / "results" / "blocksize" / "results.json"
    before = path.read_text()
    assert ex.main(["blocksize", "--budget", "quick", "--root", "results"]) == 2
    err = capsys.readouterr().err
    assert "'full' budget" in err and "--force" in err and "runs/experiments" in err
    assert path.read_text() == before and not any((tmp / "results" / "runs").glob("quick*"))
    with pytest.raises(ex.BudgetClash):
        ex.run_experiment("blocksize", "quick", "results", shard=(0, 2))  # shards are refused too
    ex.check_budget(tmp / "results" / "blocksize", "full")  # same budget: fine
    ex.check_budget(tmp / "results" / "nothing-here", "quick")  # nothing to protect
    assert ex.main(["blocksize", "--budget", "quick", "--root", "results", "--force"]) == 0
    assert json.loads(path.read_text())["meta"]["budget"] == "quick"
    ex.check_budget(tmp / "results" / "blocksize", "full")  # a bigger budget may replace a smaller one


def test_experiment_help_shows_defaults_and_every_experiment(capsys):
    with pytest.raises(SystemExit) as e:
        ex.main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: quick)" in text and "quick: runs/experiments, full: results" in text
    assert "--force" in text
    listed = {
        line.split()[0] for line in ex.build_parser().format_help().splitlines() if line.startswith("  ")
    }
    assert set(ex.SUBCOMMANDS) <= listed  # the epilog lists each experiment with its line
    assert set(ex.EXPERIMENTS) | {"report"} == set(ex.SUBCOMMANDS)
    assert "Floor" not in text


def test_only_tabulates_the_whole_experiment_or_nothing(monkeypatch, tmp_path, capsys):
    """`--only S=2` must not replace an experiment's tables by a table of one run: the tables come
    once every run is finished, and then cover them all."""
    finished = {"S2"}

    def summary(run_dir):
        name = Path(run_dir).name
        done = (
            any(f"block_size-{v[1:]}" in name for v in finished)
            if "residual-block" in name
            else "prenorm" in finished
        )
        return (
            {"done": done, "final_val_loss": 2.0, "run_dir": str(run_dir), "train_s": 1.0} if done else None
        )

    monkeypatch.setattr(runner, "load_summary", summary)
    monkeypatch.setattr(runner, "train", lambda *a, **k: pytest.fail("nothing should train here"))
    assert ex.run_experiment("blocksize", "quick", tmp_path, only=["S=2"]) is None
    assert "no tables until every run" in capsys.readouterr().err
    assert not (tmp_path / "blocksize" / "results.json").exists()
    finished |= {"S1", "S4", "S8", "prenorm"}
    result = ex.run_experiment("blocksize", "quick", tmp_path, only=["S=2"])
    assert set(result["run_dirs"]) == {s.name for s in ex.specs("blocksize", ex.BUDGETS["quick"])}


def test_committed_runs_are_found_under_the_current_run_keys():
    """Every run of the committed full-budget experiments is found where run_key says (renamed
    options keep their first spelling in keys), so re-running an experiment trains nothing."""
    root = Path(__file__).resolve().parents[3] / "results"
    for name in ("scaling", "ablation", "blocksize", "analysis", "shape"):
        for spec in ex.specs(name, ex.BUDGETS["full"]):
            run = root / "runs" / ex.run_key(spec, "full")
            assert (run / "summary.json").is_file(), (name, spec.name, run.name)


def test_committed_runs_name_no_path_of_the_machine_that_ran_them():
    """A committed run's config and summary hold repo-relative paths only: a fresh clone reads them."""
    root = Path(__file__).resolve().parents[3] / "results" / "runs"
    absolute = [
        str(f.relative_to(root))
        for f in sorted(root.glob("*/*.json"))
        if any(part in f.read_text() for part in ('": "/', " /work/", " /tmp/", " /home/"))
    ]
    assert not absolute


def test_report_preset_is_20_tokens_per_param_and_smokes_on_cpu(tmp_path):
    """The GPU-scale recipe, shrunk by --override so one CPU runs it in seconds: the same sizes
    (depths), the user's --data, the scaling tables at the end."""

    preset = ex.BUDGETS["report"]
    for d, n_layer, n_head, steps in preset.sizes:
        tokens = steps * preset.batch_size * preset.seq_len
        assert tokens / baseline_params(d, n_layer, n_head) == pytest.approx(20.0, rel=0.01)
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(800)))
    overrides = [
        "d_model=16",
        "n_head=2",
        "seq_len=16",
        "batch_size=2",
        "eval_batches=1",
        "steps=2",
        "warmup=1",
        "eval_interval=2",
        "device=cpu",
    ]
    argv = [
        "scaling",
        "--preset",
        "report",
        "--data",
        str(text),
        "--root",
        str(tmp_path / "r"),
        "--only",
        "prenorm",
        "block",
        "--override",
        *overrides,
    ]
    assert ex.main(argv) == 0  # --only: the tables wait until every run is done
    res_dir = tmp_path / "r" / "runs"
    runs = sorted(res_dir.iterdir())
    assert len(runs) == 8 and all("data-corpus.txt~" in r.name for r in runs)
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["corpus"]["source"] == str(text) and summary["steps"] == 2


def test_override_errors_name_the_flag(capsys):
    for bad in (["lr"], ["nope=1"], ["out=x"]):
        with pytest.raises(SystemExit) as e:
            ex.main(["scaling", "--override", *bad])
        assert e.value.code == 2 and "--override" in capsys.readouterr().err


def test_demo_runs_are_the_budget_studys_runs():
    """The demo is a point of the committed study: its configs equal the study's, so it reproduces them."""
    from attention_residuals.experiments.demo import DEMO_CONFIG, DEMO_RUNS, DEMO_SEEDS
    from attention_residuals.training import make_config

    full = ex.BUDGETS["full"]
    study = {s.name: s for s in ex.specs("budget", full)}
    for seed in DEMO_SEEDS:
        for name, _, overrides in DEMO_RUNS:
            spec = study[f"code_L12_tpp4_{name}_s{seed}"]
            want = runner._train_config(spec, full, Path("x")).identity()
            got = make_config(**DEMO_CONFIG, **overrides, seed=seed, out="x").identity()
            assert got == want, name


def test_demo_quotes_the_committed_study_tables_from_a_checkout(tmp_path, monkeypatch):
    """In a checkout the demo report quotes the budget table and the lr sweep; elsewhere nothing."""
    from attention_residuals.experiments import demo

    monkeypatch.chdir(Path(__file__).resolve().parents[3])
    lines = demo._study_tables()
    assert [line for line in lines if line.startswith("## ")] == [f"## {h}" for h in demo.STUDY_TABLES]
    assert any("best lr" in line for line in lines) and any("tokens/param" in line for line in lines)
    monkeypatch.chdir(tmp_path)
    assert demo._study_tables() == []
