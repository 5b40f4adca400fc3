"""``attnres data`` and ``--data`` end to end: prepare / info / verify, runs from pre-tokenized files
that resume exactly, prepared folders, older run records, missing extras."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from attention_residuals import cli
from attention_residuals.training.run import read_metrics

TINY = [
    *("--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16", "--batch-size", "2"),
    *("--steps", "6", "--warmup", "1", "--eval-interval", "3", "--eval-batches", "1"),
    *("--log-interval", "1", "--no-progress"),
]
DOCS = [f"doc {i}: " + "".join(f"print('line {j} of {i}')\n" for j in range(8 + i)) for i in range(10)]


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    for i, doc in enumerate(DOCS):
        (root / f"d{i}.txt").write_text(doc)
    return root


def _json(capsys):
    return json.loads(capsys.readouterr().out)


def test_prepare_info_verify_and_train_on_the_folder(folder, tmp_path, capsys):
    out = tmp_path / "prepared"
    assert cli.main(["data", "prepare", str(folder), "--out", str(out), "--no-progress"]) == 0
    got = _json(capsys)
    assert (
        got["documents"] == [9, 1] and got["vocab_size"] == 257 and got["eot_id"] == 256 and not got["cached"]
    )
    assert cli.main(["data", "prepare", str(folder), "--out", str(out), "--no-progress"]) == 0
    assert _json(capsys)["cached"]  # verified and reused
    assert cli.main(["data", "info", str(out)]) == 0
    info = _json(capsys)
    assert info["split"]["method"] == "document" and info["train"]["documents"] == 9 and info["sha256"]
    assert cli.main(["data", "verify", str(out)]) == 0 and _json(capsys)["ok"]
    run = tmp_path / "run"
    assert cli.main(["train", *TINY, "--data", str(out), "--out", str(run)]) == 0  # vocab 257 from it
    capsys.readouterr()
    record = json.loads((run / "config.json").read_text())
    assert record["model"]["vocab_size"] == 257 and record["data"]["eot_id"] == 256
    blob = bytearray((out / "train.bin").read_bytes())  # damaged in place, same size
    blob[10] ^= 1
    (out / "train.bin").write_bytes(bytes(blob))
    assert cli.main(["data", "verify", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "train.bin: block 0" in err and len(err.splitlines()) == 1
    assert cli.main(["eval", str(run)]) == 2  # the run's corpus is damaged: refused, not evaluated
    assert "prepare it again" in capsys.readouterr().err


def test_prepare_refuses_a_foreign_out_folder(folder, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert cli.main(["data", "prepare", str(folder), "--out", str(other), "--no-progress"]) == 2
    assert "holds no prepared corpus" in capsys.readouterr().err and (other / "notes.txt").exists()


def test_pretokenized_run_resumes_exactly_and_evaluates(tmp_path, capsys):
    """nanoGPT-style uint16 tokens, documents ended by --eot-id: train, stop, --resume from the
    command line = one uninterrupted run; eval finds the same corpus."""
    ids = np.concatenate([np.append(np.frombuffer(d.encode(), np.uint8), 256) for d in DOCS]).astype(
        np.uint16
    )
    ids.tofile(tmp_path / "tokens.bin")
    common = [*TINY, "--data", str(tmp_path / "tokens.bin"), "--eot-id", "256", "--vocab-size", "257"]
    common += ["--cache-dir", str(tmp_path / "cache")]
    assert cli.main(["train", *common, "--out", str(tmp_path / "straight")]) == 0
    assert cli.main(["train", *common, "--out", str(tmp_path / "split"), "--stop-at", "3"]) == 0
    record = json.loads((tmp_path / "split" / "config.json").read_text())
    assert "--eot-id 256" in record["command"] and record["data"]["tokenizer"] == "pretokenized"
    assert cli.main(["train", *common, "--out", str(tmp_path / "split"), "--resume"]) == 0
    capsys.readouterr()
    straight, split = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    assert [r["train_loss"] for r in straight] == [r["train_loss"] for r in split] and len(split) == 7
    assert [r["val_loss"] for r in straight] == [r["val_loss"] for r in split]
    assert cli.main(["eval", str(tmp_path / "split"), "--cache-dir", str(tmp_path / "cache")]) == 0
    assert _json(capsys)["corpus_matches_run"] is True


def test_a_run_recorded_before_the_data_options_resumes(folder, tmp_path, capsys):
    """config.json of an older version (no data_format / eot / ... fields, no tokens_sha256): its
    --data had no end-of-text tokens, so it resumes with --eot off, and says so without it."""
    run = tmp_path / "run"
    args = [*TINY, "--data", str(folder), "--cache-dir", str(tmp_path / "cache"), "--out", str(run)]
    assert cli.main(["train", *args, "--eot", "off", "--stop-at", "3"]) == 0
    record = json.loads((run / "config.json").read_text())
    for name in ("data_format", "text_field", "eot", "eot_id", "bin_dtype"):
        del record["train"][name]
    del record["data"]["tokens_sha256"]
    (run / "config.json").write_text(json.dumps(record))
    assert cli.main(["train", *args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert (
        "train.eot: 'off' (run) != 'auto' (now)" in err and "model.vocab_size: 256 (run) != 257 (now)" in err
    )
    assert cli.main(["train", *args, "--eot", "off", "--resume"]) == 0
    assert _json(capsys)["done"]


def test_builtin_name_is_kept_and_an_old_absolute_one_read(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "docs"
    assert (
        cli.main(
            [
                "train",
                *TINY,
                "--steps",
                "1",
                "--eval-interval",
                "1",
                "--data",
                "stdlib-docs",
                "--out",
                str(run),
            ]
        )
        == 0
    )
    capsys.readouterr()
    record = json.loads((run / "config.json").read_text())
    assert record["train"]["data"] == "stdlib-docs" and record["data"]["source"] == "stdlib-docs"
    record["train"]["data"] = str(tmp_path / "stdlib-docs")  # how older versions recorded it
    for name in ("data_format", "text_field", "eot", "eot_id", "bin_dtype"):  # and without these
        del record["train"][name]
    del record["data"]["tokens_sha256"]
    (run / "config.json").write_text(json.dumps(record))
    assert cli.main(["eval", str(run)]) == 0 and _json(capsys)["corpus_matches_run"] is True
    again = [
        "train",
        *TINY,
        "--steps",
        "1",
        "--eval-interval",
        "1",
        "--data",
        "stdlib-docs",
        "--out",
        str(run),
    ]
    assert cli.main([*again, "--resume"]) == 0 and _json(capsys)["done"]  # the same run: nothing to do


def test_a_missing_extra_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    rc = cli.main(["train", *TINY, "--data", str(tmp_path / "d.parquet"), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and 'pip install "attention-residuals[data]"' in err and len(err.splitlines()) == 1


def test_bench_data_measures_both_and_cleans_up(tmp_path, capsys):
    """``attnres bench data`` at a tiny size, byte tokens only: the pipeline and the reference,
    the same token count, peak RSS of both processes; its corpora are deleted afterwards."""
    out = tmp_path / "data.json"
    argv = [
        "bench",
        "data",
        "--sizes-mb",
        "0.3",
        "--bpe-max-mb",
        "0",
        "--tmp",
        str(tmp_path),
        "--json",
        str(out),
    ]
    assert cli.main(argv) == 0
    capsys.readouterr()
    result = json.loads(out.read_text())
    prepared, reference = result["results"]
    assert (
        result["bench"] == "data"
        and prepared["method"] == "attnres prepare"
        and reference["same_token_count"]
    )
    assert prepared["peak_rss_MiB"]["main"] > 0 and prepared["documents"] == reference["documents"] > 1
    assert [p.name for p in tmp_path.iterdir()] == ["data.json"]
