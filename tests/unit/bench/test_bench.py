"""`attnres bench` in --quick mode: the JSON it writes and the table it prints."""

from __future__ import annotations

import json

import pytest

from attention_residuals import bench, cli
from attention_residuals.bench.harness import paired_ratio
from attention_residuals.bench.memory import io_per_layer


def _run(capsys, tmp_path, *argv):
    path = tmp_path / "out.json"
    assert cli.main(["bench", *argv, "--quick", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data == json.loads(path.read_text())
    return data, captured.err


def test_bench_op_quick(capsys, tmp_path):
    data, table = _run(capsys, tmp_path, "op", "--no-malloc-cache")  # leave the test process' malloc alone
    assert data["bench"] == "op" and data["command"].startswith("attnres bench op")
    assert data["roofline"]["fwd_ms"] > 0
    assert data["roofline"]["fwdbwd_ms"] == pytest.approx(3 * data["roofline"]["fwd_ms"], rel=1e-2)
    assert "loadavg_start" in data["machine"] and "loadavg_end" in data["machine"]
    names = {r["name"] for r in data["results"]}
    assert {"attention_residuals[fused]", "attention_residuals[reference]"} <= names
    for r in data["results"]:
        assert r["fwd"]["best_ms"] > 0 and r["fwdbwd"]["best_ms"] > 0
        assert len(r["fwd"]["all_ms"]) == data["config"]["repeats"]
        assert r["fwd_ratio"] == pytest.approx(data["roofline"]["fwd_ms"] / r["fwd"]["best_ms"], rel=1e-2)
        sums = data["roofline"]["sum_times"]["all_ms"]
        within = sorted(s / f for s, f in zip(sums, r["fwd"]["all_ms"]))  # quick: 2 rounds, median = mean
        assert r["fwd_ratio_paired"] == pytest.approx(sum(within) / len(within), rel=1e-2)
        if r["kind"] == "ours":
            assert r["max_abs_err_vs_float64"] < 1e-4
    for s in data["skipped"]:  # every skipped case says why
        assert s["reason"]
    assert "roofline" in table and "fwd ratio" in table
    assert data["machine"]["allocator"] == "default"


def test_bench_model_and_memory_quick(capsys, tmp_path):
    data, table = _run(capsys, tmp_path, "model", "--no-malloc-cache")
    kinds = {(r["kind"], r["variant"], r["schedule"]) for r in data["results"]}
    assert ("train", "block", None) in kinds and ("prefill", "block", "two_phase") in kinds
    assert not data["failed"]
    base = [r for r in data["results"] if r["variant"] == "prenorm"]
    assert all(r["ratio_vs_prenorm"] == 1.0 and r["ratio_vs_prenorm_paired"] == 1.0 for r in base)
    data, table = _run(capsys, tmp_path, "memory")
    assert {r["variant"] for r in data["activation_memory"]} >= {"prenorm", "block", "full", "mhc"}
    assert all(r["saved_activation_MiB"] > 0 for r in data["activation_memory"])
    typical = data["io_report_typical"]["per_layer_d"]
    assert typical["block_two_phase"]["total"] == pytest.approx(5.5)  # the report's table 1
    assert typical["full_two_phase"]["total"] == pytest.approx(24.0)  # (S + N) d, appendix B


def test_bench_usage_and_unknown(capsys):
    assert bench.main([]) == 0
    out = capsys.readouterr().out
    for name in bench.SUBCOMMANDS:
        assert name in out
    assert bench.main(["nope"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_paired_ratio_is_the_median_of_within_round_ratios():
    # the rounds' memory speed drifts 2x; the op is 0.8x the roofline in every round
    roof = [2.0, 4.0, 2.0, 4.0, 3.0]
    ours = [r / 0.8 for r in roof]
    assert paired_ratio(roof, ours) == pytest.approx(0.8)
    assert min(roof) / min(ours) == pytest.approx(0.8)
    ours[0] = 9.0  # one disturbed round moves the median by nothing
    assert paired_ratio(roof, ours) == pytest.approx(0.8)
    with pytest.raises(ValueError):
        paired_ratio(roof, ours[:-1])


def test_io_per_layer_formulas():
    io = io_per_layer(128, 8)["per_layer_d"]
    assert io["block_two_phase"]["reads"] == pytest.approx(8 / 16 + 3)
    assert io["full_two_phase"]["reads"] == pytest.approx(16 + 8 - 2)
    assert io["mhc_m4"]["total"] == 34.0


def test_bench_model_width_sweep_quick(capsys, tmp_path):
    """`--widths`: every step (train, prefill, decode at each batch) at every width, over the PreNorm
    of its own width and kind; the report renders a table per width and the plot."""
    png = tmp_path / "sweep.png"
    args = ("model", "--no-malloc-cache", "--widths", "16,32", "--decode-batches", "1,2", "--plot", str(png))
    data, table = _run(capsys, tmp_path, *args)
    assert data["bench"] == "model_sweep" and data["config"]["widths"] == [16, 32] and not data["failed"]
    assert data["config"]["decode"] == {"batches": [1, 2], "tokens": 8, "prompt": 8}  # fits seq 16
    cases = {(r["d_model"], r["kind"], r["variant"], r["schedule"]) for r in data["results"]}
    for w in (16, 32):
        assert {
            (w, "decode", "block", "b1"),
            (w, "decode", "full", "b2"),
            (w, "train", "block", None),
        } <= cases
    for r in data["results"]:
        base = next(
            b
            for b in data["results"]
            if (b["d_model"], b["kind"], b["variant"]) == (r["d_model"], r["kind"], "prenorm")
            and b["schedule"] == {"train": None, "prefill": "plain"}.get(r["kind"], r["schedule"])
        )
        assert r["ratio_vs_prenorm"] == pytest.approx(r["best_ms"] / base["best_ms"], rel=1e-3)
    assert png.stat().st_size > 0 and "d_model" in table
    (tmp_path / "out.json").rename(tmp_path / "sweep_q.json")
    assert cli.main(["bench", "report", str(tmp_path)]) == 0
    page = (tmp_path / "README.md").read_text()
    assert "| step | variant | schedule | d 16 | d 32 |" in page and "| decode | block | b2 |" in page
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "model", "--quick", "--widths", "16,x"])
    assert exit_.value.code == 2 and "comma-separated positive integers" in capsys.readouterr().err


def test_bench_report_from_quick_runs(capsys, tmp_path):
    """`attnres bench report`: every JSON of the folder becomes a section with its tables and plots."""
    for name in ("op", "model", "memory"):
        assert (
            cli.main(
                ["bench", name, "--quick", "--no-malloc-cache", "--json", str(tmp_path / f"{name}_q.json")]
            )
            == 0
        )
    capsys.readouterr()
    (tmp_path / "notes.json").write_text('{"not": "a bench"}')  # other JSON is left alone
    assert cli.main(["bench", "report", str(tmp_path)]) == 0
    page = (tmp_path / "README.md").read_text()
    for stem in ("op_q", "model_q", "memory_q"):
        assert f"## {stem}" in page
    assert "notes" not in page
    assert "attention_residuals[fused]" in page and "| train | block |" in page
    assert "block_two_phase | 3.50 | 2.00 | 5.50" in page  # the report's table 1 row, typical setting
    for png in ("op_q.png", "model_q.png"):
        assert (tmp_path / png).stat().st_size > 0 and f"]({png})" in page


def test_bench_report_errors(capsys, tmp_path):
    assert cli.main(["bench", "report", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert cli.main(["bench", "report", str(tmp_path)]) == 2
    assert "no `attnres bench" in capsys.readouterr().err
    (tmp_path / "op.json").write_text('{"bench": "op", ')
    assert cli.main(["bench", "report", str(tmp_path)]) == 2
    assert "op.json: not valid JSON" in capsys.readouterr().err


def test_bench_package_never_imports_the_cli():
    """bench sits below the CLI: its dispatch comes from `commands`, and no module of it imports `cli`."""
    import ast
    from pathlib import Path

    for path in Path(bench.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + ([a.name for a in node.names] if not node.module else [])
                assert not any(n == "cli" or n.endswith(".cli") for n in names), path
