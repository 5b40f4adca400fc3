"""Fault injection: ``kill -9`` at chosen and at random points of a training, concurrent writers.

A training runs in a forked child that ``SIGKILL``s itself at the k-th call of one of the writes a
run makes (before or after an ``os.replace``, before an ``fsync``, in the middle of a temporary
file or of a ``metrics.jsonl`` row), or is killed by the parent after a random delay. The parent
then resumes the run (``--resume``) and checks it ends exactly as an uninterrupted run does —
the same metrics rows bit for bit and the same weights — with no temporary file or lock left.
SIGKILL leaves no ``except``/``finally`` to clean up, as a power cut would not (the page cache does
survive it, so this is no test of fsync against power loss).

``ATTNRES_SOAK=N`` (N >= 1) is the long variant: every injection point of every kind, N times as
many random-time kills and chains of kills.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
import traceback

import pytest
import torch
from testkit import tiny_config

from attention_residuals.training import RunError, RunLockedError, read_metrics, train
from attention_residuals.training import loop as loop_module
from attention_residuals.training.checkpoint import read_checkpoint
from attention_residuals.training.data import Corpus
from attention_residuals.training.run import LOCK_FILE

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

SOAK = int(os.environ.get("ATTNRES_SOAK", "0") or 0)
TEXT = "".join(f"def h{i}(z):\n    return z - {i % 11}\n\n" for i in range(300))
KINDS = ("replace-before", "replace-after", "fsync-before", "fsync-torn", "metrics-torn")
EXIT = {"done": 0, "locked": 3, "refused": 4, "error": 1}


CHECKPOINTED_RUN = dict(steps=12, warmup=2, ckpt_interval=3)  # several checkpoints to break


def tiny(out, **kw):
    return tiny_config(out, **{**CHECKPOINTED_RUN, **kw})


@pytest.fixture(scope="module")
def corpus():
    return Corpus.from_text(TEXT, val_fraction=0.1)


def _rows(out):
    return [(r["step"], r["train_loss"], r["val_loss"], r["lr"], r["tokens"]) for r in read_metrics(out)]


def _weights(out):
    return {
        k: v for k, v in read_checkpoint(out / "checkpoint.safetensors")[0].items() if k.startswith("model/")
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    """An uninterrupted run, and how many calls of each kind it makes."""
    out = tmp_path_factory.mktemp("ref") / "run"
    with _counting() as counts:
        train(tiny(out), corpus=corpus)
    return {"rows": _rows(out), "weights": _weights(out), "counts": counts}


def assert_like_reference(out, reference):
    assert _rows(out) == reference["rows"]  # bit for bit, no duplicate or missing step
    w = _weights(out)
    assert w.keys() == reference["weights"].keys()
    assert all(torch.equal(w[k], reference["weights"][k]) for k in w)
    left = sorted(n for n in os.listdir(out) if ".tmp-" in n or n == LOCK_FILE)
    assert left == [], left


# --------------------------------------------------------------------------- injection


@contextlib.contextmanager
def _counting():
    counts = dict.fromkeys(("replace", "fsync", "metrics"), 0)
    real_replace, real_fsync, real_write = os.replace, os.fsync, loop_module.MetricsWriter.write

    def replace(*a, **k):
        counts["replace"] += 1
        return real_replace(*a, **k)

    def fsync(fd):
        counts["fsync"] += 1
        return real_fsync(fd)

    def write(self, row):
        counts["metrics"] += 1
        return real_write(self, row)

    os.replace, os.fsync, loop_module.MetricsWriter.write = replace, fsync, write
    try:
        yield counts
    finally:
        os.replace, os.fsync, loop_module.MetricsWriter.write = real_replace, real_fsync, real_write


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _inject(kind: str, k: int) -> None:
    """In the child: SIGKILL at the k-th (1-based) call of the kind's operation."""
    n = [0]
    real_replace, real_fsync, real_write = os.replace, os.fsync, loop_module.MetricsWriter.write

    def hit() -> bool:
        n[0] += 1
        return n[0] == k

    if kind.startswith("replace"):

        def replace(src, dst, **kw):
            if kind == "replace-before" and hit():
                _die()
            real_replace(src, dst, **kw)
            if kind == "replace-after" and hit():
                _die()

        os.replace = replace
    elif kind.startswith("fsync"):

        def fsync(fd):
            if hit():
                if kind == "fsync-torn" and os.path.isfile(f"/proc/self/fd/{fd}"):
                    os.ftruncate(fd, os.fstat(fd).st_size // 2)  # half of the temporary file
                _die()
            real_fsync(fd)

        os.fsync = fsync
    else:

        def write(self, row):
            if hit() and self._file is not None:
                line = __import__("json").dumps(row) + "\n"
                self._file.write(line[: len(line) // 2])  # half a row
                self._file.flush()
                _die()
            real_write(self, row)

        loop_module.MetricsWriter.write = write


def in_child(fn, timeout: float = 120.0) -> int:
    """Run ``fn`` in a forked child; its wait status (a signal, or an exit code of :data:`EXIT`)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns into pytest
        code = EXIT["error"]
        try:
            fn()
            code = EXIT["done"]
        except RunLockedError:
            code = EXIT["locked"]
        except RunError:
            code = EXIT["refused"]
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return wait(pid, timeout)


def wait(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"child {pid} did not finish in {timeout} s")


def killed(status: int) -> bool:
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def _points(reference) -> list[tuple[str, int]]:
    counts = reference["counts"]
    total = {"replace": counts["replace"], "fsync": counts["fsync"], "metrics": counts["metrics"]}
    every = [(kind, k) for kind in KINDS for k in range(1, total[kind.split("-")[0]] + 1)]
    if SOAK:
        return every
    rng = random.Random(0)
    return [p for kind in KINDS for p in rng.sample([q for q in every if q[0] == kind], 2)]


# --------------------------------------------------------------------------- the tests


def test_kill_at_each_kind_of_write_then_resume_exactly(tmp_path, corpus, reference):
    points = _points(reference)
    assert len(points) >= 2 * len(KINDS)
    for i, (kind, k) in enumerate(points):
        out = tmp_path / f"run{i}"

        def victim(kind=kind, k=k, out=out):
            _inject(kind, k)
            train(tiny(out), corpus=corpus)

        status = in_child(victim)
        assert killed(status), (kind, k, status)  # the injection point was reached
        s = train(tiny(out, resume=True), corpus=corpus)
        assert s["done"], (kind, k)
        assert_like_reference(out, reference)


def test_kill_after_random_delays_then_resume_exactly(tmp_path, corpus, reference):
    t0 = time.monotonic()
    assert in_child(lambda: train(tiny(tmp_path / "timing"), corpus=corpus)) == 0
    span = time.monotonic() - t0
    rng = random.Random(1)
    for i in range(3 + 30 * SOAK):
        out = tmp_path / f"run{i}"
        pid = os.fork()
        if pid == 0:  # pragma: no cover
            try:
                train(tiny(out), corpus=corpus)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0, span))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        assert train(tiny(out, resume=True), corpus=corpus)["done"]
        assert_like_reference(out, reference)


def test_chains_of_kills_then_resume_exactly(tmp_path, corpus, reference):
    """Killed, resumed and killed again, at random points of random kinds, until a resume ends."""
    rng = random.Random(2)
    for chain in range(1 + 5 * SOAK):
        out = tmp_path / f"run{chain}"
        kills = 0
        for _ in range(12):
            kind = rng.choice(KINDS)
            k = rng.randint(1, 4)

            def victim(kind=kind, k=k, out=out):
                _inject(kind, k)
                train(tiny(out, resume=True), corpus=corpus)

            status = in_child(victim)
            if not killed(status):
                assert status == 0, status
                break
            kills += 1
        assert kills >= 1
        assert train(tiny(out, resume=True), corpus=corpus)["done"]
        assert_like_reference(out, reference)


def test_two_trainings_started_on_one_folder(tmp_path, corpus, reference):
    """One trains, the other fails at once (locked, or refused: the run is there); no row twice."""
    for i in range(2 + 10 * SOAK):
        out = tmp_path / f"run{i}"
        pids = []
        for _ in range(2):
            pid = os.fork()
            if pid == 0:  # pragma: no cover
                code = EXIT["error"]
                try:
                    train(tiny(out), corpus=corpus)
                    code = EXIT["done"]
                except RunLockedError:
                    code = EXIT["locked"]
                except RunError:
                    code = EXIT["refused"]
                finally:
                    os._exit(code)
            pids.append(pid)
        codes = sorted(os.waitstatus_to_exitcode(wait(p, 120)) for p in pids)
        assert codes in ([EXIT["done"], EXIT["locked"]], [EXIT["done"], EXIT["refused"]]), codes
        assert_like_reference(out, reference)


def test_a_second_writer_meets_a_live_holder_then_takes_over_when_it_dies(
    tmp_path, corpus, reference, capsys
):
    out = tmp_path / "run"
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - holds the lock mid-training, then waits to be killed
        real = loop_module.MetricsWriter.write
        n = [0]

        def write(self, row):
            real(self, row)
            n[0] += 1
            if n[0] == 3:
                os.write(ready_w, b"x")
                time.sleep(120)

        loop_module.MetricsWriter.write = write
        try:
            train(tiny(out), corpus=corpus)
        finally:
            os._exit(1)
    assert os.read(ready_r, 1) == b"x"
    before = {n: (out / n).read_bytes() for n in ("config.json", "metrics.jsonl", "checkpoint.safetensors")}
    for cfg in (tiny(out), tiny(out, resume=True), tiny(out, overwrite=True)):
        with pytest.raises(RunLockedError, match=rf"pid {pid} on "):
            train(cfg, corpus=corpus)
    assert {n: (out / n).read_bytes() for n in before} == before  # the holder's files untouched
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert train(tiny(out, resume=True), corpus=corpus)["done"]
    assert f"stale lock of pid {pid}" in capsys.readouterr().err
    assert_like_reference(out, reference)


def fault_counts(reference_counts: dict[str, int]) -> dict[str, int]:
    """How many faults each test injects (for the record), given a reference run's call counts."""
    every = sum(reference_counts[kind.split("-")[0]] for kind in KINDS)
    return {
        "kill at a write": every if SOAK else 2 * len(KINDS),
        "kill after a random delay": 3 + 30 * SOAK,
        "chains of kills": 1 + 5 * SOAK,
        "two trainings at once": 2 + 10 * SOAK,
        "second writer vs live holder": 3,
    }
