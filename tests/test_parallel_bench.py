"""`attnres bench dist` figures: measured traffic equals the derived counts, prefill memory as derived."""

import json

import pytest

from attention_residuals import bench_dist
from attention_residuals.bench import SUBCOMMANDS


def test_bench_dispatch_points_here():
    assert SUBCOMMANDS["dist"][0] == "attention_residuals.bench_dist:main"


def test_pipeline_rows():
    rows = bench_dist.bench_pipeline([(2, 2, 2)])
    (row,) = rows
    s = row["schemes"]
    assert all(v["matches_derived"] for v in s.values())
    assert s["cached_all"]["bytes_forward"] < s["cached"]["bytes_forward"] < s["naive"]["bytes_forward"]
    # aligned (N_p = 2 whole blocks per chunk): the report's formulas plus b_0 on the hops
    assert s["naive"]["tensors_per_token_derived"] == s["naive"]["report_formula"] + (row["C"] - 1)
    assert s["cached"]["tensors_per_token_derived"] == s["cached"]["report_formula"] + (row["P"] - 1)
    for v in s.values():
        assert v["loss"] == pytest.approx(v["ref_loss"], rel=1e-5)
        assert v["max_grad_abs_diff"] < 1e-5


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
