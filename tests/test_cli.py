"""The ``attnres`` commands: help texts, error reporting, train -> eval -> sample, the demo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attention_residuals import cli

TINY = [
    "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16", "--batch-size", "2", "--steps", "6",
    "--warmup", "1", "--eval-interval", "3", "--eval-batches", "1", "--log-interval", "3", "--no-progress",
]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "corpus.txt"
    p.write_text("".join(f"print('hello {i}')\n" for i in range(300)))
    return p


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, text_file):
    root = tmp_path_factory.mktemp("run")
    out = root / "r"
    rc = cli.main(["train", *TINY, "--data", str(text_file), "--cache-dir", str(root / "cache"), "--out", str(out)])
    assert rc == 0
    return out


@pytest.mark.parametrize("command,flags", [
    ("train", ["--residual", "--block-size", "--n-blocks", "--resume", "--stop-at", "--data", "--optimizer"]),
    ("eval", ["run_dir", "--batches", "--split"]),
    ("sample", ["--prompt", "--max-new-tokens", "--temperature", "--top-k", "--seed"]),
    ("demo", ["--out", "--report", "--steps"]),
])
def test_help(capsys, command, flags):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert f"attnres {command}" in text
    for flag in flags:
        assert flag in text


def test_python_dash_m_train_help():
    r = subprocess.run([sys.executable, "-m", "attention_residuals.train", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--residual" in r.stdout


def test_train_data_errors(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    binary = tmp_path / "x.bin"
    binary.write_bytes(b"\x00\x01\x02" * 100)
    cases = [(tmp_path / "missing.txt", "no such file"), (empty, "empty"), (binary, "not text")]
    for path, words in cases:
        rc = cli.main(["train", *TINY, "--data", str(path), "--out", str(tmp_path / "o"), "--cache-dir", str(tmp_path)])
        err = capsys.readouterr().err
        assert rc == 2 and "--data" in err and words in err, err
    assert not (tmp_path / "o").exists()


def test_train_bad_residual_and_block_size(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", *TINY, "--residual", "nope", "--out", str(tmp_path / "a")])
    assert e.value.code == 2 and "--residual" in capsys.readouterr().err
    rc = cli.main(["train", *TINY, "--residual", "block", "--block-size", "5", "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert rc == 2 and "block_size" in err  # L = 2 sublayers


def test_resume_with_other_config_and_rerun_errors(run_dir, text_file, capsys):
    common = [*TINY, "--data", str(text_file), "--cache-dir", str(run_dir.parent / "cache"), "--out", str(run_dir)]
    rc = cli.main(["train", *common, "--resume", "--d-model", "32", "--seed", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and "model.d_model" in err and "train.seed" in err
    rc = cli.main(["train", *common])
    assert rc == 2 and "--overwrite" in capsys.readouterr().err
    rc = cli.main(["train", *common, "--resume"])  # finished: nothing to do, still success
    assert rc == 0 and json.loads(capsys.readouterr().out)["done"]


def test_eval_and_sample(run_dir, capsys):
    assert cli.main(["eval", str(run_dir)]) == 0
    result = json.loads(capsys.readouterr().out)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert result["step"] == 6 and result["val_loss"] == pytest.approx(metrics[-1]["val_loss"], rel=1e-6)
    assert result["corpus_matches_run"] is True
    assert cli.main(["sample", str(run_dir), "--prompt", "print", "--max-new-tokens", "40", "--seed", "1", "--json"]) == 0
    (a,) = json.loads(capsys.readouterr().out)
    assert a.startswith("print") and len(a.encode("utf-8", errors="surrogatepass")) >= 5
    assert cli.main(["sample", str(run_dir), "--prompt", "print", "--max-new-tokens", "40", "--seed", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [a]  # same seed, same sample
    # longer than the context: generation slides
    assert cli.main(["sample", str(run_dir), "--max-new-tokens", "50", "--temperature", "0", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)[0]) > 16


def test_eval_corrupt_checkpoint(run_dir, tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((run_dir / "checkpoint.safetensors").read_bytes()[:500])
    assert cli.main(["eval", str(run_dir), "--checkpoint", str(bad)]) == 2
    assert "bad.safetensors" in capsys.readouterr().err
    assert cli.main(["eval", str(tmp_path / "nowhere")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_demo_tiny_writes_report_and_skips_finished(tmp_path, capsys):
    out, report = tmp_path / "runs", tmp_path / "rep" / "report.md"
    assert cli.main(["demo", "--tiny", "--out", str(out), "--report", str(report), "--no-progress"]) == 0
    text = report.read_text()
    assert "| PreNorm baseline |" in text and "| Block AttnRes" in text and "sha256 `" in text
    assert "![loss curves](report_loss.png)" in text and "attnres demo --tiny" in text
    png = report.with_name("report_loss.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ck = out / "block" / "checkpoint.safetensors"
    before = ck.stat().st_mtime_ns
    capsys.readouterr()
    assert cli.main(["demo", "--tiny", "--out", str(out), "--report", str(report), "--no-progress"]) == 0
    assert ck.stat().st_mtime_ns == before and "already finished" in capsys.readouterr().err
