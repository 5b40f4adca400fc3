"""The ``attnres`` commands: help texts, error reporting, train -> eval -> sample, the demo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attention_residuals import cli, commands

TINY = [
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--d-model",
    "16",
    "--seq-len",
    "16",
    "--batch-size",
    "2",
    "--steps",
    "6",
    "--warmup",
    "1",
    "--eval-interval",
    "3",
    "--eval-batches",
    "1",
    "--log-interval",
    "3",
    "--no-progress",
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
    rc = cli.main(
        ["train", *TINY, "--data", str(text_file), "--cache-dir", str(root / "cache"), "--out", str(out)]
    )
    assert rc == 0
    return out


@pytest.mark.parametrize(
    "command,flags",
    [
        (
            "train",
            ["--residual", "--block-size", "--n-blocks", "--resume", "--stop-at", "--data", "--optimizer"],
        ),
        ("eval", ["run_dir", "--batches", "--split"]),
        ("sample", ["--prompt", "--max-new-tokens", "--temperature", "--top-k", "--seed"]),
        ("demo", ["--out", "--report", "--steps"]),
    ],
)
def test_help(capsys, command, flags):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert f"attnres {command}" in text
    for flag in flags:
        assert flag in text


def test_python_dash_m_train_help():
    r = subprocess.run(
        [sys.executable, "-m", "attention_residuals.train", "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "--residual" in r.stdout


def test_train_data_errors(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    binary = tmp_path / "x.dat"
    binary.write_bytes(b"\x00\x01\x02" * 100)
    tokens = tmp_path / "x.bin"  # pre-tokenized: needs the id its documents end with to be split
    tokens.write_bytes(b"\x00\x01" * 100)
    cases = [
        (tmp_path / "missing.txt", "no such file"),
        (empty, "empty"),
        (binary, "not text"),
        (tokens, "--eot-id"),
    ]
    for path, words in cases:
        rc = cli.main(
            ["train", *TINY, "--data", str(path), "--out", str(tmp_path / "o"), "--cache-dir", str(tmp_path)]
        )
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
    common = [
        *TINY,
        "--data",
        str(text_file),
        "--cache-dir",
        str(run_dir.parent / "cache"),
        "--out",
        str(run_dir),
    ]
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
    assert (
        cli.main(
            ["sample", str(run_dir), "--prompt", "print", "--max-new-tokens", "40", "--seed", "1", "--json"]
        )
        == 0
    )
    (a,) = json.loads(capsys.readouterr().out)
    assert a.startswith("print") and len(a.encode("utf-8", errors="surrogatepass")) >= 5
    assert (
        cli.main(
            ["sample", str(run_dir), "--prompt", "print", "--max-new-tokens", "40", "--seed", "1", "--json"]
        )
        == 0
    )
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
    assert "per seed" in text and "spread" in text and text.count("| Block AttnRes (S=2) |") == 2  # two seeds
    assert "× PreNorm's tokens/s" in text and "at PreNorm's training time Δ = " in text
    png = report.with_name("report_loss.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ck = out / "block_s1" / "checkpoint.safetensors"
    before = ck.stat().st_mtime_ns
    capsys.readouterr()
    assert cli.main(["demo", "--tiny", "--out", str(out), "--report", str(report), "--no-progress"]) == 0
    assert ck.stat().st_mtime_ns == before and "already finished" in capsys.readouterr().err


def test_top_level_help_lists_the_subcommand_tables(capsys):
    """`attnres --help` lists the experiments and benchmarks from their own tables (shape included)."""
    from attention_residuals import bench, experiments

    assert cli.main(["--help"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert ", ".join(experiments.SUBCOMMANDS) in lines["experiment"] and "shape" in lines["experiment"]
    assert ", ".join(bench.SUBCOMMANDS) in lines["bench"]
    # a help given as a function is made when shown; a missing table falls back instead of failing
    assert (
        commands.usage_text(
            "p", {"x": ("m", commands.listing("attention_residuals", "NO_SUCH_TABLE", "things ({})"))}
        ).splitlines()[3]
        == "  x  things (...)"
    )


def test_sample_top_k_message_matches_help(run_dir, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["sample", "--help"])
    assert e.value.code == 0 and "0 = all tokens" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as e:
        cli.main(["sample", str(run_dir), "--top-k", "-3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--top-k: expected >= 0 (0 = all tokens), got -3" in err
    assert cli.main(["sample", str(run_dir), "--top-k", "0", "--max-new-tokens", "5", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 1
    with pytest.raises(SystemExit):
        cli.main(["sample", str(run_dir), "--num-samples", "0"])
    assert "--num-samples: expected >= 1, got 0" in capsys.readouterr().err
    # a tokenizer folder for a byte-level run is refused with what to do
    assert cli.main(["sample", str(run_dir), "--tokenizer", str(run_dir)]) == 2
    assert "trained on bytes" in capsys.readouterr().err


def test_sample_decodes_a_bpe_run_with_its_tokenizer(tmp_path, text_file, capsys):
    """A run of `attnres train --tokenizer DIR` samples through that tokenizer; a moved folder or a
    different tokenizer is refused with what to do, and --tokenizer points to the moved one."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from attention_residuals.training.tokenizer import load_encoder, train_bpe

    tok_dir, other_dir = tmp_path / "tok", tmp_path / "other"
    train_bpe([text_file.read_text()], vocab_size=300, min_frequency=2).save_pretrained(tok_dir)
    train_bpe([text_file.read_text()[:2000] + "xyz" * 50], vocab_size=290, min_frequency=2).save_pretrained(
        other_dir
    )
    hook = load_encoder(tok_dir)
    run = tmp_path / "run"
    args = [
        "train",
        *TINY,
        "--tokenizer",
        str(tok_dir),
        "--vocab-size",
        str(hook.vocab_size),
        "--data",
        str(text_file),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--out",
        str(run),
    ]
    assert cli.main(args) == 0
    capsys.readouterr()
    sample = [
        "sample",
        str(run),
        "--prompt",
        "print('hello",
        "--max-new-tokens",
        "12",
        "--seed",
        "3",
        "--json",
    ]
    assert cli.main(sample) == 0
    (text,) = json.loads(capsys.readouterr().out)
    assert text.startswith("print('hello") and len(text) > len("print('hello")
    # the same ids through bytes would be a different string: the BPE tokenizer did the decoding
    ids = hook.encode(text)
    assert hook.decode(ids) == text and len(ids) < len(text.encode())
    moved = tmp_path / "moved"
    tok_dir.rename(moved)
    assert cli.main(sample) == 2
    err = capsys.readouterr().err
    assert str(tok_dir) in err and "--tokenizer DIR" in err
    assert cli.main([*sample, "--tokenizer", str(moved)]) == 0
    assert json.loads(capsys.readouterr().out) == [text]
    assert cli.main([*sample, "--tokenizer", str(other_dir)]) == 2
    assert "not the 'bpe-" in capsys.readouterr().err
