"""The run directory: its files, their formats, and what to do with one that exists.

A run lives in one directory::

    config.json             model + training config, corpus provenance, the command line
    metrics.jsonl           one JSON row per log step: step, train_loss, val_loss, lr, tokens,
                            tokens_per_s, wall_s (+ grad_norm)
    checkpoint.safetensors  weights, optimizer, scheduler, RNG, step (atomic; previous one kept
                            as checkpoint.prev.safetensors)
    checkpoint.dcp/         instead, for a ``--fsdp`` run: the same state sharded over the ranks
                            (:mod:`.sharded`; previous one kept as checkpoint.prev.dcp/)
    summary.json            final numbers and ``"done": true`` once all steps ran
    .lock                   held by the one training writing the folder (removed when it ends)

The resume policy (:func:`plan_run`): a directory holding a run is an error unless ``--resume``
(continue it: its config must equal the run's ``config.json``, the differing fields are listed;
a finished run is returned as is) or ``--overwrite`` (delete the run files and start again). A
non-empty folder that holds no run of this project (no ``config.json`` of a run: a user's files)
is an error too unless ``--overwrite``, which writes the run beside them and replaces only the
run files' names.

One writer per folder (:func:`run_lock`): ``train`` takes an exclusive ``flock`` on ``.lock``
and records its pid, host and start time there; a second training on the same ``--out`` fails at
once with :class:`RunLockedError` naming the holder. The kernel drops the lock of a process that
died (``kill -9`` included), so a lock left behind is detected as stale, reported and taken
over; with the lock held, the temporary files of killed writes are swept.

Every run file is written by :func:`.files.atomic_write` (temporary file, fsync, rename; a
symlink planted at a run file's name is replaced, never written through) and ``metrics.jsonl``
is appended to without following a symlink (:func:`.files.open_append`).

Which checkpoint a resume (or ``eval`` / ``sample`` / ``export-hf``) reads is
:func:`load_run_checkpoint`'s choice: the newer of the two formats (a run may switch between
``--fsdp`` and DDP across resumes), each with its fallback to its previous checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock, no lock
    fcntl = None

from ..files import atomic_write, read_text, sweep_temp_files, temp_prefix
from ..model import GPTConfig
from .args import to_flags
from .checkpoint import ConfigCheck, load_latest, peek_checkpoint, previous_path
from .config import PATH_FIELDS, TrainConfig, absolute
from .data import builtin_name
from .sharded import DCP_DIR, DCP_PREV_DIR, load_latest_sharded, peek_sharded

__all__ = [
    "CHECKPOINT_FILE",
    "CONFIG_FILE",
    "LOCK_FILE",
    "METRICS_FILE",
    "RUN_FORMAT",
    "SUMMARY_FILE",
    "ConfigMismatchError",
    "RunError",
    "RunLockedError",
    "RunPlan",
    "checkpoint_check",
    "clear_run",
    "command_line",
    "config_diff",
    "checkpoints_in",
    "is_done",
    "is_run_record",
    "load_run_checkpoint",
    "load_summary",
    "newest_checkpoint",
    "plan_run",
    "read_metrics",
    "read_run_record",
    "run_identity",
    "run_lock",
    "run_record",
    "start_run_files",
    "truncate_metrics",
    "write_json",
]

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_FILE = "checkpoint.safetensors"
SUMMARY_FILE = "summary.json"
LOCK_FILE = ".lock"
RUN_FORMAT = 1
# the corpus fields a resume must match (those a run recorded: tokens_sha256 came later)
DATA_IDENTITY = ("source", "sha256", "tokenizer", "vocab_size", "tokens_sha256")


class RunError(RuntimeError):
    """The run directory is not in a state the request fits (finished, occupied...)."""


class ConfigMismatchError(RunError, ValueError):
    """``--resume`` with a config that differs from the run's ``config.json``."""


class RunLockedError(RunError):
    """Another training holds the run directory's lock."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- files


def run_files(out: Path) -> tuple[Path, ...]:
    """The files a run writes in ``out`` (all that :func:`clear_run` deletes, config last)."""
    return (
        out / SUMMARY_FILE,
        out / CHECKPOINT_FILE,
        previous_path(out / CHECKPOINT_FILE),
        out / METRICS_FILE,
        out / CONFIG_FILE,
    )


def run_folders(out: Path) -> tuple[Path, ...]:
    """The folders a run writes in ``out`` (the sharded checkpoints), deleted by :func:`clear_run`."""
    return (out / DCP_DIR, out / DCP_PREV_DIR)


def checkpoints_in(out: Path) -> list[str]:
    """The names of the checkpoints (either format, newest or previous) present in ``out``."""
    single = out / CHECKPOINT_FILE
    return [p.name for p in (single, previous_path(single), *run_folders(out)) if os.path.lexists(p)]


def newest_checkpoint(out: Path) -> tuple[bool, dict]:
    """``(sharded, {"step", "config"})`` of ``out``'s newest checkpoint by the step each records
    (headers read unverified: the load that follows verifies): a run may switch between
    ``--fsdp`` and DDP across resumes. ``(False, {})`` when there is no readable one."""
    single = out / CHECKPOINT_FILE
    found = [(peek_checkpoint(p), False) for p in (single, previous_path(single))]
    found += [(peek_sharded(p), True) for p in run_folders(out)]
    found = [(head["step"], sharded, head) for head, sharded in found if head is not None]
    if not found:
        return (out / DCP_DIR).is_dir() and not os.path.lexists(single), {}  # say what is damaged
    _, sharded, head = max(found, key=lambda f: (f[0], not f[1]))  # a tie: the single file
    return sharded, head


def load_run_checkpoint(out: Path, **kwargs: Any) -> tuple[dict[str, Any], list[str]]:
    """Load ``out``'s newest checkpoint (:func:`newest_checkpoint`), single-file
    (:func:`.checkpoint.load_latest`) or sharded (:func:`.sharded.load_latest_sharded`), with its
    fallback to the previous one; keywords as theirs."""
    if newest_checkpoint(out)[0]:
        kwargs.pop("strict", None)
        return load_latest_sharded(out / DCP_DIR, **kwargs)
    return load_latest(out / CHECKPOINT_FILE, **kwargs)


def write_json(path: Path, obj: Any) -> None:
    """Atomically (:func:`.files.atomic_write`): a crash leaves the previous file or the new one."""
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """Rows of a run's ``metrics.jsonl`` (a torn last line from a crash is ignored)."""
    path = Path(run_dir) / METRICS_FILE
    if not os.path.lexists(path):
        return []
    rows = []
    for line in _read_run_file(path).splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return rows


def is_run_record(record: Any) -> bool:
    """True for the content of a run's ``config.json`` (written by ``train`` or by
    ``export-hf --import``): an object with a ``model`` section (and ``train`` when present)."""
    return (
        isinstance(record, dict)
        and isinstance(record.get("model"), dict)
        and isinstance(record.get("train", {}), dict)
    )


def read_run_record(out: Path) -> dict | None:
    """The run's ``config.json``; None when there is none. :class:`RunError` naming the file when
    it exists but is not a run's (unreadable, not JSON, another program's JSON)."""
    path = out / CONFIG_FILE
    if not os.path.lexists(path):
        return None
    try:
        record = json.loads(read_text(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunError(f"{path} is not a run's config.json ({type(e).__name__}: {e})") from None
    if not is_run_record(record):
        raise RunError(f"{path} is not a run's config.json (no model section)")
    return record


def load_summary(run_dir: str | os.PathLike) -> dict | None:
    path = Path(run_dir) / SUMMARY_FILE
    if not os.path.lexists(path):
        return None
    try:
        return json.loads(_read_run_file(path))
    except json.JSONDecodeError:
        return None


def _read_run_file(path: Path) -> str:
    """``path``'s text; :class:`RunError` naming it when it is a symlink or unreadable."""
    try:
        return read_text(path)
    except (OSError, UnicodeDecodeError) as e:
        why = "a symlink (run files are never links)" if os.path.islink(path) else f"unreadable ({e})"
        raise RunError(f"{path}: {why}") from None


def is_done(run_dir: str | os.PathLike) -> bool:
    """True when the run in ``run_dir`` ran all its steps."""
    s = load_summary(run_dir)
    return bool(s and s.get("done"))


def command_line(cfg: TrainConfig, run_control: tuple[str, ...] = ("out",)) -> str:
    """An ``attnres train`` command reproducing ``cfg``: its non-default fields plus the listed
    run-control fields."""
    flags = to_flags(cfg, always=run_control, skip=lambda ff: bool(ff.meta.get("run_control")))
    return shlex.join(["attnres", "train", *flags])


def run_identity(cfg: TrainConfig, corpus_info: dict) -> dict:
    """What a resume must match: the config's identity and the corpus it trains on."""
    return {**cfg.identity(), "data": {k: corpus_info[k] for k in DATA_IDENTITY}}


def run_record(cfg: TrainConfig, corpus_info: dict) -> dict:
    """The content of ``config.json``."""
    return {"format": RUN_FORMAT, **cfg.to_dict(), "data": corpus_info, "command": command_line(cfg)}


def start_run_files(out: Path, record: dict) -> None:
    """A new run: ``config.json`` written, ``metrics.jsonl`` empty, no ``summary.json``."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / CONFIG_FILE, record)
    atomic_write(out / METRICS_FILE, "")
    with contextlib.suppress(FileNotFoundError):
        (out / SUMMARY_FILE).unlink()


def clear_run(out: Path) -> None:
    """Delete the run files of ``out`` (and nothing else there); ``config.json`` last, so that a
    clear cut short still leaves a folder recognised as a run."""
    for folder in run_folders(out):
        if folder.is_symlink():
            folder.unlink()
        elif folder.is_dir():
            shutil.rmtree(folder)
    for path in run_files(out):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def truncate_metrics(out: Path, step: int) -> None:
    """Drop the metrics rows past ``step`` (written after the checkpoint a resume starts from) and
    a torn last line, atomically."""
    rows = [r for r in read_metrics(out) if r.get("step", 0) <= step]
    atomic_write(out / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in rows))


# --------------------------------------------------------------------------- one writer per folder


def _holder(fd: int) -> str:
    """What a lock file says about its holder (``pid 12 on host since ...``)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on {info['host']} since {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "an unknown process"


def _make_dirs(out: Path) -> list[Path]:
    """Create ``out`` and its missing parents; returns the folders created, deepest first."""
    missing = []
    p = out
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    out.mkdir(parents=True, exist_ok=True)
    return missing


def _acquire(out: Path) -> int:
    """An fd of ``out/.lock`` holding its exclusive flock (see the module docstring)."""
    path = out / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunLockedError(
                f"{out} is in use by another training ({holder}; lock {path}): wait for it to end "
                "or choose another --out"
            ) from None
        # a holder ending unlinks the file after we opened it: lock the one at the path
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
                break
        os.close(fd)
    if os.fstat(fd).st_size:
        log(f"warning: {path}: a stale lock of {_holder(fd)}, which no longer runs; taken over")
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    return fd


@contextlib.contextmanager
def run_lock(out: str | os.PathLike, enabled: bool = True) -> Iterator[None]:
    """Hold ``out``'s lock for the body (creating ``out``); :class:`RunLockedError` at once when
    another training holds it. Stale temporary files of killed writes are swept once it is held.
    On the way out the lock file is removed, and so are the folders this call created if they
    are still empty (a refused run leaves nothing behind)."""
    out = Path(out)
    if not enabled or fcntl is None:
        yield
        return
    if os.path.lexists(out) and not out.is_dir():
        raise RunError(f"--out {out}: exists and is not a folder")
    try:
        created = _make_dirs(out)
    except OSError as e:
        raise RunError(f"--out {out}: cannot create the folder ({e.strerror})") from None
    try:
        fd = _acquire(out)
    except BaseException:
        _remove_empty(created)
        raise
    try:
        for p in sweep_temp_files(out, tuple(f.name for f in (*run_files(out), *run_folders(out)))):
            log(f"{out}: removed {p.name}, left by a write that was cut short")
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            (out / LOCK_FILE).unlink()
        os.close(fd)
        _remove_empty(created)


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (the run was written), or gone
            return


# --------------------------------------------------------------------------- the resume policy


def config_diff(
    saved: dict, current: dict, prefix: str = "", labels: tuple[str, str] = ("run", "now")
) -> list[str]:
    """Fields that differ between two nested config dicts, as
    ``"model.d_model: 128 (run) != 64 (now)"``."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, f"{name}.", labels)
        elif a != b:
            out.append(f"{name}: {a!r} ({labels[0]}) != {b!r} ({labels[1]})")
    return out


@dataclass(frozen=True)
class RunPlan:
    """What :func:`plan_run` decided for the run directory."""

    resume: bool = False  # continue from its checkpoint
    clear: bool = False  # delete its run files first
    finished: dict | None = None  # the summary of a run already done: nothing to train


def _saved_identity(saved: dict, current: dict) -> dict:
    """The identity recorded in a run's ``config.json``, comparable with :func:`run_identity`
    (``current``): the training fields and corpus fields a run recorded before they existed take
    their defaults / the current values (``eot``: ``off`` for ``--data``, which had no end-of-text
    tokens then, so such a run resumes with ``--eot off``); a built-in corpus recorded as a path is
    its name."""
    train = {**TrainConfig().identity()["train"], **saved.get("train", {})}
    for key in PATH_FIELDS:  # runs recorded before paths were made absolute
        if isinstance(train.get(key), str):
            train[key] = absolute(train[key])
    if train["data"] is not None:
        train["data"] = builtin_name(train["data"]) or train["data"]
    if "eot" not in saved.get("train", {}):  # recorded before end-of-text tokens: --data had none
        train["eot"] = "auto" if builtin_name(train["data"]) is not None else "off"
    data = saved.get("data", {})
    return {
        # through GPTConfig: runs recorded with the flat rule options ("residual": "block", "heads")
        "model": GPTConfig.from_dict(saved.get("model", {})).to_dict(),
        "train": train,
        "data": {k: data.get(k) if k in data else current["data"][k] for k in current["data"]},
    }


def checkpoint_check(expected: dict, sections: tuple[str, ...] = ("model", "train", "data")) -> ConfigCheck:
    """The ``check_config`` of :func:`.checkpoint.load_checkpoint`: the fields in which a
    checkpoint's recorded identity differs from ``expected`` (:func:`run_identity`, or a run's
    ``config.json``), both read through :func:`_saved_identity`; only ``sections`` compared."""
    full = _saved_identity(expected, {"data": {k: expected.get("data", {}).get(k) for k in DATA_IDENTITY}})
    unrecorded = [
        k for k in DATA_IDENTITY if k not in expected.get("data", {})
    ]  # a record older than the field

    def check(recorded: dict) -> list[str]:
        got = _saved_identity(recorded, full)  # fields a checkpoint predates take the run's values
        want = {k: dict(full[k]) for k in sections}
        if "data" in want:  # and fields the run's record predates are not compared
            want["data"].update({k: got["data"].get(k) for k in unrecorded})
        return config_diff({k: got[k] for k in sections}, want, labels=("checkpoint", "run"))

    return check


def _foreign_entries(out: Path) -> list[str]:
    """The names in ``out`` a run did not write (the lock and temporary files of run files aside)."""
    if not out.is_dir():
        return []
    ours = {p.name for p in (*run_files(out), *run_folders(out))} | {LOCK_FILE}
    prefixes = tuple(temp_prefix(p) for p in (*run_files(out), *run_folders(out)))
    return sorted(n for n in os.listdir(out) if n not in ours and not n.startswith(prefixes))


def _plan_non_run(cfg: TrainConfig, out: Path) -> RunPlan:
    """A folder without a run's ``config.json``: empty (or absent) is a new run; one holding
    other files only with ``--overwrite`` (the run files' names are replaced, nothing else)."""
    taken = [p.name for p in (*run_files(out), *run_folders(out)) if os.path.lexists(p)]
    other = _foreign_entries(out) + taken
    if other and not cfg.overwrite:
        shown = ", ".join(other[:5]) + (" ..." if len(other) > 5 else "")
        replaced = f"; it would replace {', '.join(taken)}" if taken else ""
        raise RunError(
            f"--out {out} is not empty and holds no run of this project ({shown}): choose an empty "
            f"or new folder, or pass --overwrite to write the run beside these files{replaced}"
        )
    if cfg.resume:
        log(f"{out}: nothing to resume, starting a new run")
    return RunPlan(clear=bool(taken))


def plan_run(cfg: TrainConfig, identity: dict) -> RunPlan:
    """Decide what to do with ``cfg.out`` (see the module docstring); touches no file. Raises
    :class:`RunError` for an occupied directory without ``--resume`` / ``--overwrite`` (or a
    non-empty one that holds no run, without ``--overwrite``) and :class:`ConfigMismatchError`
    when resuming with another config."""
    out = Path(cfg.out)
    cfg_path = out / CONFIG_FILE
    if os.path.lexists(out) and not out.is_dir():
        raise RunError(f"--out {out}: exists and is not a folder")
    try:
        saved_record = read_run_record(out)
    except RunError:
        if not cfg.overwrite:
            raise
        saved_record = None
    if saved_record is None:
        return _plan_non_run(cfg, out)
    if cfg.overwrite:
        return RunPlan(clear=True)
    if not cfg.resume:
        summary = load_summary(out)
        state = "a finished run" if summary and summary.get("done") else "a run"
        raise RunError(
            f"{out} already holds {state} ({CONFIG_FILE} exists); pass --resume to continue it "
            f"or --overwrite to start again"
        )
    saved = _saved_identity(saved_record, identity)
    diff = config_diff(saved, identity)
    if diff:
        raise ConfigMismatchError(f"--resume: the config differs from {cfg_path}: " + "; ".join(diff))
    summary = load_summary(out)
    if summary and summary.get("done") and summary.get("step") == cfg.steps:
        log(f"{out}: already finished ({cfg.steps} steps), nothing to do")
        return RunPlan(finished=summary)
    resuming = bool(checkpoints_in(out))
    return RunPlan(resume=resuming, clear=not resuming)  # config written but no checkpoint yet: start over
