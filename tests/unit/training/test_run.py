"""Run directories: non-run folders, one writer per folder (the lock), atomic run files, symlinks."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from testkit import tiny_config as tiny

from attention_residuals.files import sweep_temp_files
from attention_residuals.training import (
    RunError,
    RunLockedError,
    load_summary,
    read_metrics,
    train,
)
from attention_residuals.training.data import Corpus
from attention_residuals.training.run import LOCK_FILE, run_lock

TEXT = "".join(f"def f{i}(x):\n    return x + {i % 17}\n\n" for i in range(300))
RUN_FILES = {
    "config.json",
    "metrics.jsonl",
    "checkpoint.safetensors",
    "checkpoint.prev.safetensors",
    "summary.json",
}


@pytest.fixture(scope="module")
def corpus():
    return Corpus.from_text(TEXT, val_fraction=0.1)


def _user_folder(path):
    path.mkdir()
    (path / "notes.txt").write_text("my notes")
    (path / "data").mkdir()
    return path


# --------------------------------------------------------------------------- folders that hold no run


def test_non_empty_folder_without_a_run_is_refused_and_left_untouched(tmp_path, corpus):
    out = _user_folder(tmp_path / "mine")
    before = sorted(os.listdir(out))
    with pytest.raises(RunError, match=r"not empty and holds no run.*notes.txt.*--overwrite"):
        train(tiny(out), corpus=corpus)
    assert sorted(os.listdir(out)) == before  # no lock file, no run file left behind
    with pytest.raises(RunError, match="holds no run"):  # --resume is no way around it
        train(tiny(out, resume=True), corpus=corpus)
    s = train(tiny(out, overwrite=True), corpus=corpus)  # asked for: the run is written beside
    assert s["done"] and (out / "notes.txt").read_text() == "my notes" and (out / "data").is_dir()
    assert RUN_FILES <= set(os.listdir(out))


def test_a_foreign_config_json_is_not_taken_for_a_run(tmp_path, corpus):
    out = tmp_path / "other"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"learning_rate": 1}))  # another program's
    with pytest.raises(RunError, match=r"config.json is not a run's config.json"):
        train(tiny(out), corpus=corpus)
    (out / "config.json").write_text("{torn")
    with pytest.raises(RunError, match="JSONDecodeError"):
        train(tiny(out, resume=True), corpus=corpus)
    assert (out / "config.json").read_text() == "{torn"
    (out / "config.json").unlink()
    (out / "metrics.jsonl").write_text("my rows\n")  # a run file's name taken by a user's file
    with pytest.raises(RunError, match="would replace metrics.jsonl"):
        train(tiny(out), corpus=corpus)
    assert (out / "metrics.jsonl").read_text() == "my rows\n"


def test_out_that_is_a_file_or_cannot_be_created(tmp_path, corpus):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(RunError, match="exists and is not a folder"):
        train(tiny(f), corpus=corpus)
    assert f.read_text() == "x"
    with pytest.raises(RunError, match="cannot create the folder"):
        train(tiny(f / "below"), corpus=corpus)


def test_a_refused_run_leaves_no_folder_behind(tmp_path, corpus):
    out = tmp_path / "a" / "b" / "run"
    with pytest.raises(ValueError, match="seq_len"):  # refused after the lock was taken
        train(tiny(out, seq_len=100_000), corpus=corpus)
    assert not (tmp_path / "a").exists()


# --------------------------------------------------------------------------- one writer per folder


def test_second_writer_fails_fast_naming_the_holder(tmp_path, corpus):
    out = tmp_path / "r"
    with run_lock(out):
        t0 = time.perf_counter()
        with pytest.raises(RunLockedError, match=rf"in use by another training \(pid {os.getpid()} on "):
            train(tiny(out), corpus=corpus)
        assert time.perf_counter() - t0 < 10  # fails at once, does not wait
        assert os.listdir(out) == [LOCK_FILE]  # nothing of the second writer
    assert not out.exists()  # the lock's folder was created by it, and is removed with it
    assert train(tiny(out), corpus=corpus)["done"]
    assert LOCK_FILE not in os.listdir(out)


def test_stale_lock_of_a_killed_process_is_detected_and_taken_over(tmp_path, corpus, capsys):
    out = tmp_path / "r"
    out.mkdir()
    pid = os.fork()
    if pid == 0:  # a writer that takes the lock and is killed with it held
        try:
            with run_lock(out):
                os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(1)
    os.waitpid(pid, 0)
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == pid  # left behind by kill -9
    assert train(tiny(out), corpus=corpus)["done"]
    assert f"stale lock of pid {pid}" in capsys.readouterr().err


# --------------------------------------------------------------------------- atomic files, symlinks, temps


def test_symlinked_run_files_are_replaced_not_written_through(tmp_path, corpus):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "r"
    out.mkdir()
    for name in ("metrics.jsonl", "summary.json"):
        (out / name).symlink_to(victim)  # planted: a run must not write outside --out
    with pytest.raises(RunError, match="holds no run"):
        train(tiny(out), corpus=corpus)
    train(tiny(out, overwrite=True), corpus=corpus)
    assert victim.read_text() == "precious"
    assert not (out / "metrics.jsonl").is_symlink() and len(read_metrics(out)) == 5
    # planted while a run continues: --resume refuses to read or write through the link, naming it
    train(tiny(out, steps=8, stop_at=4, overwrite=True), corpus=corpus)
    rows = (out / "metrics.jsonl").read_text()
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(RunError, match=r"metrics.jsonl: a symlink \(run files are never links\)"):
        train(tiny(out, resume=True), corpus=corpus)
    with pytest.raises(RunError, match="a symlink"):
        read_metrics(out)  # readers do not show another file's content as the run's
    assert victim.read_text() == "precious"
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").write_text(rows)
    assert train(tiny(out, resume=True), corpus=corpus)["done"]
    (out / "summary.json").unlink()
    (out / "summary.json").symlink_to(victim)
    with pytest.raises(RunError, match="summary.json: a symlink"):
        load_summary(out)


def test_stale_temp_files_are_swept_only_for_run_files(tmp_path, corpus):
    out = tmp_path / "r"
    train(tiny(out, stop_at=4), corpus=corpus)
    stale = [
        out / ".checkpoint.safetensors.tmp-abc123",
        out / ".config.json.tmp-x",
        out / ".summary.json.tmp-y",
    ]
    for p in stale:
        p.write_bytes(b"half a file")
    mine = out / ".my.tmp-keep"
    mine.write_text("not a run file's temp")
    assert train(tiny(out, resume=True), corpus=corpus)["done"]
    assert not any(p.exists() for p in stale) and mine.exists()
    assert sweep_temp_files(out, ("config.json",)) == []
