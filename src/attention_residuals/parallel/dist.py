"""Process-group setup on ``torch.distributed``: launcher detection, timeouts, clear errors.

Every distributed feature of the package (data parallel training, pipeline parallel, sharded
prefill) goes through :func:`init_distributed`, which

* reads the launcher's environment (``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``), or takes ``rank`` / ``world_size`` / ``init_method``
  explicitly (tests spawn processes and rendezvous through a file);
* always passes a **timeout** to the process group (``ATTNRES_DIST_TIMEOUT`` seconds, default
  300), so a rank that dies or never arrives makes the others raise instead of hanging: gloo
  raises at once when a peer's socket closes and after the timeout when a peer stalls;
* turns the backend's errors into :class:`DistributedError` messages naming this rank, the world
  size and the likely cause (a rendezvous that times out with ``k/N`` ranks joined means a
  mismatched ``--nproc-per-node`` / ``WORLD_SIZE``);
* checks, with one small ``all_gather_object``, that every rank agrees on the world size and
  on whatever fingerprint the caller gives (:func:`check_consistent`).

:func:`spawn` runs a function on ``K`` local processes (``torch.multiprocessing``; forked where
the platform allows), each with its own gloo process group, and returns every rank's result or raises the
first rank's error with its traceback; tests and ``attnres bench dist`` use it.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistEnv",
    "DistributedError",
    "check_consistent",
    "default_timeout",
    "destroy_distributed",
    "guarded",
    "init_distributed",
    "launcher_env",
    "spawn",
]

DEFAULT_TIMEOUT_S = 300.0
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE")


class DistributedError(RuntimeError):
    """A distributed setup or communication failure, with the rank and the likely cause."""


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands: ``rank`` of ``world_size``, ``local_rank`` on its node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = "gloo"
    launched: bool = False  # True when a launcher (torchrun) or init_distributed set it up
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.launched

    def device(self) -> torch.device:
        """``cuda:<local_rank>`` for NCCL, else the CPU."""
        if self.backend == "nccl":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")


def default_timeout() -> float:
    """``$ATTNRES_DIST_TIMEOUT`` seconds, else :data:`DEFAULT_TIMEOUT_S`."""
    raw = os.environ.get("ATTNRES_DIST_TIMEOUT")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise DistributedError(f"ATTNRES_DIST_TIMEOUT: expected seconds, got {raw!r}") from None
    if value <= 0:
        raise DistributedError(f"ATTNRES_DIST_TIMEOUT: expected a positive number of seconds, got {raw!r}")
    return value


def _int_env(name: str) -> int:
    raw = os.environ[name]
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"{name}: expected an integer from the launcher, got {raw!r}") from None


def launcher_env() -> DistEnv | None:
    """The launcher's view (``torchrun`` or any launcher setting ``RANK`` and ``WORLD_SIZE``),
    or ``None`` when this process was started on its own."""
    if not all(v in os.environ for v in _LAUNCHER_VARS):
        return None
    rank, world = _int_env("RANK"), _int_env("WORLD_SIZE")
    local = _int_env("LOCAL_RANK") if "LOCAL_RANK" in os.environ else rank
    if world < 1 or not 0 <= rank < world:
        raise DistributedError(f"launcher environment: RANK={rank} is not in [0, WORLD_SIZE={world})")
    return DistEnv(rank=rank, world_size=world, local_rank=local, launched=True, backend=_default_backend())


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _create_group(
    backend: str, rank: int, world_size: int, local_rank: int, init_method: str | None, timeout: float
) -> None:
    """The default process group; a failed rendezvous is a :class:`DistributedError` that says
    what usually causes it."""
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    kwargs: dict[str, Any] = dict(
        backend=backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
    )
    if init_method is not None:
        kwargs["init_method"] = init_method
    started = time.monotonic()
    try:
        dist.init_process_group(**kwargs)
    except Exception as exc:  # DistStoreError (a subclass of RuntimeError), ValueError, ...
        waited = time.monotonic() - started
        raise DistributedError(
            f"rank {rank}: process-group rendezvous failed after {waited:.1f}s (world_size={world_size}, "
            f"backend={backend}, timeout={timeout:g}s): {_first_line(exc)}. A rendezvous that times out "
            f"usually means fewer processes started than world_size says (check --nproc-per-node / "
            f"WORLD_SIZE) or a rank crashed before joining"
        ) from exc


def init_distributed(
    backend: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    timeout_s: float | None = None,
    expected_world_size: int | None = None,
) -> DistEnv:
    """Create the default process group (with a timeout) and return this process's :class:`DistEnv`.

    Without arguments it reads the launcher's environment (``torchrun``); ``rank``,
    ``world_size`` and ``init_method`` (``"file:///path"`` or ``"tcp://host:port"``) override
    it. ``expected_world_size`` raises :class:`DistributedError` when the launch does not
    match what the job needs (e.g. pipeline stages). Already initialised: returns the current
    group's view. A single process that was not launched gets ``DistEnv()`` and no group.
    """
    timeout = default_timeout() if timeout_s is None else float(timeout_s)
    if dist.is_available() and dist.is_initialized():
        env = DistEnv(
            dist.get_rank(), dist.get_world_size(), _local_rank(), dist.get_backend(), True, timeout
        )
        _check_expected(env, expected_world_size)
        return env
    launched = launcher_env()
    if rank is None and world_size is None and launched is None:
        env = DistEnv(timeout_s=timeout)
        _check_expected(env, expected_world_size)
        return env
    if not dist.is_available():
        raise DistributedError("torch.distributed is not available in this build of torch")
    rank = launched.rank if rank is None and launched else (rank or 0)
    world_size = launched.world_size if world_size is None and launched else (world_size or 1)
    local_rank = launched.local_rank if launched else rank
    backend = backend or _default_backend()
    if expected_world_size is not None and world_size != expected_world_size:
        raise DistributedError(
            f"rank {rank}: this job needs world_size={expected_world_size} processes but was launched "
            f"with world_size={world_size}; fix --nproc-per-node (or WORLD_SIZE)"
        )
    _create_group(backend, rank, world_size, local_rank, init_method, timeout)
    env = DistEnv(rank, world_size, local_rank, backend, True, timeout)
    check_consistent({"world_size": world_size}, "world size")
    return env


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))


def _check_expected(env: DistEnv, expected: int | None) -> None:
    if expected is not None and env.world_size != expected:
        raise DistributedError(
            f"rank {env.rank}: this job needs world_size={expected} processes but runs with "
            f"world_size={env.world_size}; launch it with torchrun --nproc-per-node {expected}"
        )


def destroy_distributed() -> None:
    """Tear down the default process group if there is one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


@contextlib.contextmanager
def guarded(what: str, peer: int | None = None) -> Iterator[None]:
    """Translate a backend failure inside the block into a :class:`DistributedError` saying
    which rank, which operation and the likely cause (a dead or stalled peer)."""
    try:
        yield
    except DistributedError:
        raise
    except RuntimeError as exc:
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        who = f"rank {peer}" if peer is not None else "a peer rank"
        msg = str(exc)
        cause = "timed out" if "imed out" in msg or "imeout" in msg else "failed"
        raise DistributedError(
            f"rank {rank}/{world}: {what} {cause} ({_first_line(exc)}); {who} probably died, stalled "
            f"or runs a different program; see that rank's log"
        ) from exc


def _flat_items(value: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, Any] = {}
    for k, v in value.items():
        out.update(_flat_items(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def check_consistent(value: Any, what: str, group=None) -> None:
    """Raise :class:`DistributedError` on every rank unless all ranks pass an equal ``value``
    (for dicts, e.g. a run config, the message names the differing fields)."""
    if not dist.is_initialized():
        return
    values: list[Any] = [None] * dist.get_world_size(group)
    with guarded(f"consistency check of {what}"):
        dist.all_gather_object(values, value, group=group)
    if all(v == values[0] for v in values):
        return
    if all(isinstance(v, dict) for v in values):
        ref = _flat_items(values[0])
        diffs = []
        for i, v in enumerate(values[1:], start=1):
            mine = _flat_items(v)
            for key in sorted(ref.keys() | mine.keys()):
                if ref.get(key) != mine.get(key):
                    diffs.append(f"rank {i} has {key}={mine.get(key)!r} where rank 0 has {ref.get(key)!r}")
        more = f" (and {len(diffs) - 5} more)" if len(diffs) > 5 else ""
        raise DistributedError(f"ranks disagree on {what}: " + "; ".join(diffs[:5]) + more)
    listing = ", ".join(f"rank {i}: {v!r}" for i, v in enumerate(values))
    raise DistributedError(f"ranks disagree on {what}: {listing}")


# --------------------------------------------------------------------------- local multi-process runs


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    init: str,
    backend: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
    results,
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        if init.startswith("env:"):  # what torchrun does: the group is left to the program
            os.environ.update(
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=init.removeprefix("env:"),
                ATTNRES_DIST_TIMEOUT=str(timeout_s),
            )
        else:
            init_distributed(
                backend, rank=rank, world_size=world_size, init_method=f"file://{init}", timeout_s=timeout_s
            )
        out = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(out, buf)  # plain bytes: no shared-memory handles that die with this process
        results.put((rank, "ok", buf.getvalue()))
    except BaseException as exc:  # report everything, including SystemExit, to the parent
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        with contextlib.suppress(Exception):
            destroy_distributed()


def _fresh_init_file() -> str:
    """A path for the file rendezvous that does not exist yet: FileStore creates it, and a stale
    file would confuse the rendezvous."""
    fd, init_file = tempfile.mkstemp(prefix="attnres_pg_")
    os.close(fd)
    os.remove(init_file)
    return init_file


def _await_results(
    results: Any,
    started: list[int],
    procs: list[Any],
    got: dict[int, tuple[str, Any]],
    deadline: float,
    group_timeout: float,
) -> float:
    """Fill ``got`` with the ranks' reports until every rank reported, the deadline passed or every
    rank is dead; returns the deadline (shortened once a rank exited without reporting)."""
    while len(got) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, status, payload = results.get(timeout=min(remaining, 0.5))
            got[rank] = (status, payload)
        except queue_mod.Empty:
            dead = [
                r
                for r, p in zip(started, procs, strict=True)
                if not p.is_alive() and r not in got and p.exitcode not in (None, 0)
            ]
            if dead and all(not p.is_alive() for p in procs):
                break
            # a rank that exited without reporting: give the others their process-group timeout
            if dead:
                deadline = min(deadline, time.monotonic() + group_timeout + 5.0)
    return deadline


def _stop_ranks(procs: list[Any], all_reported: bool, deadline: float) -> None:
    """Join the ranks (until the deadline when all reported, briefly otherwise); kill stragglers."""
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()) if all_reported else 0.5)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _rank_errors(started: list[int], procs: list[Any], got: dict[int, tuple[str, Any]]) -> list[str]:
    errors = []
    for r, p in zip(started, procs, strict=True):
        if r not in got:
            errors.append(f"rank {r}: exited with code {p.exitcode} without a result")
        elif got[r][0] == "error":
            errors.append(f"rank {r}: {got[r][1]}")
    return errors


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    group_timeout_s: float | None = None,
    ranks: list[int] | None = None,
    start_method: str | None = None,
    launcher: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new local processes, each inside a
    ``backend`` process group (file rendezvous, so no port is needed), and return the results
    ordered by rank. ``fn`` must be importable (module level) and its result picklable.

    Raises :class:`DistributedError` with the failing ranks' tracebacks if any rank raised or
    exited without a result, or if the whole run exceeds ``timeout_s`` (stragglers are killed).
    ``group_timeout_s`` is the process-group timeout (default: ``timeout_s / 2``). ``ranks``
    starts only those ranks (to test what a missing rank does). ``start_method``: ``"fork"``
    where available (no second import of torch: a rank starts in milliseconds), else ``"spawn"``;
    with ``"spawn"`` ``fn`` must be importable by module path. ``launcher=True`` does what
    ``torchrun`` does instead of creating the group: it sets ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` and leaves :func:`init_distributed` to ``fn``.
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    if start_method is None:
        start_method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    ctx = torch.multiprocessing.get_context(start_method)
    results = ctx.Queue()
    group_timeout = group_timeout_s if group_timeout_s is not None else max(1.0, timeout_s / 2)
    init_file = _fresh_init_file()
    started = list(range(world_size) if ranks is None else ranks)
    init = f"env:{_free_port()}" if launcher else init_file
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, init, backend, group_timeout, fn, args, results), daemon=True
        )
        for r in started
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    got: dict[int, tuple[str, Any]] = {}
    try:
        deadline = _await_results(results, started, procs, got, deadline, group_timeout)
    finally:
        _stop_ranks(procs, len(got) == len(procs), deadline)
        with contextlib.suppress(FileNotFoundError):
            os.remove(init_file)
    errors = _rank_errors(started, procs, got)
    if errors:
        raise DistributedError(f"{len(errors)} of {len(started)} ranks failed:\n" + "\n".join(errors))
    return [torch.load(io.BytesIO(got[r][1]), weights_only=False) for r in started]
