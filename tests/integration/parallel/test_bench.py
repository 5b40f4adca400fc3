"""`attnres bench dist` figures: measured traffic equals the derived counts, prefill memory as derived."""

import json

import pytest

from attention_residuals.bench import SUBCOMMANDS
from attention_residuals.bench import dist as bench_dist


def test_bench_dispatch_points_here():
    assert SUBCOMMANDS["dist"][0] == "attention_residuals.bench.dist:main"


def test_pipeline_rows():
    rows = bench_dist.bench_pipeline([(2, 2, 2)])
    (row,) = rows
    s = row["schemes"]
    assert sorted(s) == ["cached", "naive"] and row["schedule"] == "interleaved"
    assert all(v["matches_derived"] for v in s.values())
    assert s["cached"]["bytes_forward"] < s["naive"]["bytes_forward"]
    # aligned (N_p = 2 whole blocks per chunk): the report's formulas plus b_0 on the hops
    assert s["naive"]["tensors_per_token_derived"] == s["naive"]["report_formula"] + (row["C"] - 1)
    assert s["cached"]["tensors_per_token_derived"] == s["cached"]["report_formula"] + (row["P"] - 1)
    # the PreNorm baseline on the same runtime: one hidden state per hop, equal to one process
    base = row["prenorm"]
    assert base["tensors_per_token_measured"] == base["tensors_per_token_derived"] == row["C"] - 1
    for v in [*s.values(), base]:
        assert v["loss"] == pytest.approx(v["ref_loss"], rel=1e-5)
        assert v["max_grad_abs_diff"] < 1e-5
        assert v["step_s"] > 0 and v["one_process_step_s"] > 0
    for v in s.values():
        assert v["step_vs_prenorm"] == pytest.approx(v["step_s"] / base["step_s"])


def test_prefill_rows_and_cli(tmp_path, monkeypatch):
    out = bench_dist.bench_prefill(seq_len=64, tps=(1, 2), chunk_div=4)
    by = {(r["tp"], r["shard"], r["chunk_size"]): r for r in out["runs"]}
    full = by[(1, "none", 64)]["peak_block_bytes_per_rank"]
    assert by[(2, "hidden", 64)]["peak_block_bytes_per_rank"] == full // 2
    assert by[(2, "sequence", 16)]["peak_block_bytes_per_rank"] == full // 8
    for r in out["runs"]:
        assert r["peak_block_bytes_per_rank"] == r["formula_block_bytes"]
        assert r["max_abs_logit_diff"] < 1e-4
    ex = out["report_example"]
    assert round(ex["full_bytes"] / 1e9, 1) == 15.0  # the report's 15 GB ...
    assert round(ex["sharded_bytes"] / 1e9, 1) == 1.9  # ... 1.9 GB over 8 ...
    assert ex["sharded_chunked_bytes"] < 0.3e9  # ... < 0.3 GB with 16K chunks
    dest = tmp_path / "dist.json"
    monkeypatch.setattr(bench_dist, "PIPE_QUICK", [(2, 1, 2)])
    monkeypatch.setattr(bench_dist, "bench_prefill", lambda *a, **k: {"stub": True})
    assert bench_dist.main(["--quick", "--out", str(dest)]) == 0
    data = json.loads(dest.read_text())
    assert data["bench"] == "dist" and data["pipeline"][0]["P"] == 2 and data["prefill"] == {"stub": True}


def _stub_dist(monkeypatch):
    monkeypatch.setattr(bench_dist, "bench_pipeline", lambda cases: [{"stub": list(cases)}])
    monkeypatch.setattr(bench_dist, "bench_prefill", lambda *a, **k: {"stub": True})


def test_smoke_and_partial_runs_leave_the_committed_json_alone(tmp_path, monkeypatch, capsys):
    """`attnres bench dist --quick` (or --skip-*) writes no file unless --out says so; a complete run
    writes results/bench/dist.json as before, and the JSON says which command made it."""
    _stub_dist(monkeypatch)
    monkeypatch.chdir(tmp_path)
    committed = tmp_path / bench_dist.DEFAULT_OUT
    for argv in (["--quick"], ["--skip-pipeline"], ["--skip-prefill"], ["--quick", "--out", "-"]):
        assert bench_dist.main(argv) == 0
        assert not committed.exists(), argv
        captured = capsys.readouterr()
        assert json.loads(captured.out)["bench"] == "dist"
        assert ("pass --out FILE" in captured.err) == ("--out" not in argv)
    assert bench_dist.main(["--quick", "--out", "smoke.json"]) == 0
    smoke = json.loads((tmp_path / "smoke.json").read_text())
    assert smoke["quick"] is True and smoke["command"] == "attnres bench dist --quick --out smoke.json"
    assert bench_dist.main([]) == 0
    full = json.loads(committed.read_text())
    assert full["command"] == "attnres bench dist" and "quick" not in full
    assert full["pipeline"] == [{"stub": [list(c) for c in bench_dist.PIPE_CASES]}]


def test_dist_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        bench_dist.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"default: {bench_dist.DEFAULT_OUT} for a complete run" in text and "--quick" in text
    assert "``" not in text


def test_bench_page_says_where_targets_come_from(tmp_path):
    """The generated page names its targets in user terms (no internal issue numbers), and a partial
    dist JSON (a --skip-* run written with --out) renders instead of failing."""
    from pathlib import Path

    from attention_residuals.bench.report import write_report

    committed = Path(__file__).resolve().parents[3] / "results" / "bench"
    for name in ("op_cpu_float32.json", "model_cpu.json", "dist.json"):
        (tmp_path / name).write_text((committed / name).read_text())
    partial = json.loads((committed / "dist.json").read_text())
    del partial["pipeline"]
    (tmp_path / "dist_partial.json").write_text(json.dumps({**partial, "quick": True}))
    page = write_report(tmp_path).read_text()
    assert "issue" not in page.lower()
    assert "Targets, as fractions of the roofline: forward ≥ 0.8, forward+backward ≥ 0.5." in page
    assert "Targets, from the overheads the AttnRes report gives for Block AttnRes" in page
    assert "training ≤ 1.04, prefill ≤ 1.02" in page
    assert "a --quick smoke run; not run: pipeline." in page
    assert page.count("Pipeline: one training step of `PipelinedGPT`") == 1  # the complete dist.json only
