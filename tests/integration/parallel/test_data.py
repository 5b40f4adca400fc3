"""Data parallel training (DDP over gloo processes) equals the single-process run; resumes on any world size."""

import json
import os
import time

import pytest
import torch
from testkit import PARALLEL_RUN, tiny_config

from attention_residuals.parallel import DistributedError, spawn
from attention_residuals.training import RunLockedError, loop, main, read_metrics, train
from attention_residuals.training.checkpoint import read_checkpoint
from attention_residuals.training.data import Corpus
from attention_residuals.training.run import LOCK_FILE, run_lock

TEXT = "".join(f"def f{i}(x):\n    return x * {i % 13} + {i % 7}\n\n" for i in range(300))


def tiny(out, **kw):
    return tiny_config(out, **{**PARALLEL_RUN, **kw})


def _train(rank, world, out, kw):
    torch.set_num_threads(1)
    summary = train(tiny(out, **kw), corpus=Corpus.from_text(TEXT, val_fraction=0.1))
    return summary["final_train_loss"]


def losses(run):
    return [(r["step"], r["train_loss"], r["val_loss"]) for r in read_metrics(run)]


def assert_same_run(a, b):
    ra, rb = losses(a), losses(b)
    assert [r[0] for r in ra] == [r[0] for r in rb]  # one row per step: rank 0 alone wrote metrics
    for (_, ta, va), (_, tb, vb) in zip(ra, rb, strict=True):
        assert ta == pytest.approx(tb, rel=1e-5, abs=1e-6) if ta is not None else tb is None
        assert va == pytest.approx(vb, rel=1e-5, abs=1e-6) if va is not None else vb is None
    wa, ia = read_checkpoint(a / "checkpoint.safetensors")
    wb, ib = read_checkpoint(b / "checkpoint.safetensors")
    assert ia["step"] == ib["step"]
    for k in wa:
        if k.startswith("model/"):
            torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(tiny(out, progress=False), corpus=Corpus.from_text(TEXT, val_fraction=0.1))
    finally:
        torch.set_num_threads(n)
    return out


def test_ddp_equals_single_process(tmp_path, single):
    out = tmp_path / "ddp"
    finals = spawn(_train, 2, str(out), {}, timeout_s=120)
    assert finals[0] == finals[1]  # every rank reports the global mean loss
    assert_same_run(out, single)
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in single.iterdir())


def test_resume_with_another_world_size(tmp_path, single):
    """4 ranks train 3 steps (checkpoint written once, by rank 0); 2 ranks, then 1, resume."""
    out = tmp_path / "run"
    spawn(_train, 4, str(out), {"stop_at": 3}, timeout_s=120)
    spawn(_train, 2, str(out), {"stop_at": 5, "resume": True}, timeout_s=120)
    train(tiny(out, resume=True), corpus=Corpus.from_text(TEXT, val_fraction=0.1))
    assert_same_run(out, single)


def _cli(rank, world, argv):
    return main(argv)


def test_attnres_train_detects_the_launcher(tmp_path, single):
    """RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT as torchrun sets them: `attnres train` runs DDP."""
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    out = tmp_path / "cli"
    argv = [
        "--data",
        str(data),
        "--out",
        str(out),
        "--n-layer",
        "2",
        "--n-head",
        "2",
        "--d-model",
        "32",
        "--seq-len",
        "16",
        "--batch-size",
        "4",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--eval-interval",
        "2",
        "--eval-batches",
        "1",
        "--residual",
        "block",
        "--block-size",
        "2",
        "--no-progress",
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    assert spawn(_cli, 2, argv, timeout_s=120, launcher=True) == [0, 0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["done"] and summary["world_size"] == 2


def test_batch_must_split_over_ranks(tmp_path):
    with pytest.raises(DistributedError, match="does not split over 3 data-parallel ranks"):
        spawn(_train, 3, str(tmp_path / "bad"), {}, timeout_s=60)


def _train_refused(rank, world, out):
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    try:
        train(tiny(out), corpus=Corpus.from_text(TEXT, val_fraction=0.1))
    except RunLockedError as e:
        return type(e).__name__, str(e).split(" (")[0], time.perf_counter() - t0
    return None


def test_every_rank_fails_fast_when_the_run_directory_is_in_use(tmp_path):
    """Another training holds the lock: rank 0 is refused, and so is every other rank at once
    (not after the distributed timeout), with the same named error; nothing is written."""
    out = tmp_path / "busy"
    with run_lock(out):
        outcomes = spawn(_train_refused, 2, str(out), timeout_s=60, group_timeout_s=30)
        assert os.listdir(out) == [LOCK_FILE]
    assert [o[:2] for o in outcomes] == [("RunLockedError", f"{out} is in use by another training")] * 2
    assert max(o[2] for o in outcomes) < 20  # well before the 30 s group timeout


def _train_rank1_dies(rank, world, out):
    """Rank 1 is killed (os._exit) in the middle of step 5, after the step-3 checkpoint."""
    real = loop.get_batch

    def dying(*args, **kw):
        if rank == 1 and kw["step"] == 4 * 2 + 1:  # step 4 (0-based), second micro-batch
            os._exit(9)
        return real(*args, **kw)

    loop.get_batch = dying
    return _train(rank, world, out, {})


def test_a_rank_killed_mid_step_fails_the_run_fast_and_it_resumes_exactly(tmp_path, single):
    out = tmp_path / "run"
    t0 = time.perf_counter()
    with pytest.raises(DistributedError, match="rank 1: exited with code 9"):
        spawn(_train_rank1_dies, 2, str(out), timeout_s=60, group_timeout_s=10)
    assert time.perf_counter() - t0 < 50
    assert read_checkpoint(out / "checkpoint.safetensors")[1]["step"] == 3
    train(tiny(out, resume=True), corpus=Corpus.from_text(TEXT, val_fraction=0.1))
    assert_same_run(out, single)
