"""The timing harness and the helpers every ``attnres bench`` benchmark shares.

Method: every case is warmed up, then the repeats are interleaved (one of each case per round,
the round order rotated) and the best of the repeats is reported beside the median
(:func:`interleaved`, :func:`ms_stats`); the paired ratio (:func:`paired_ratio`) is the median
over rounds of the ratio within one round. Also here: the machine description recorded in each
JSON, the allocator setting, the options common to the benchmarks and the table/JSON output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = [
    "DTYPES",
    "TARGETS",
    "interleaved",
    "ms_stats",
    "paired_ratio",
    "cache_large_allocations",
    "machine_info",
    "add_common_args",
    "setup",
    "finish",
    "print_table",
    "fmt",
    "bench_command",
]

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
TARGETS = {"fwd_ratio": 0.8, "fwdbwd_ratio": 0.5, "train_overhead": 1.04, "prefill_overhead": 1.02}


# ----------------------------------------------------------------------------------------------
# timing


def _time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call; on CUDA between two events on the stream (the GPU's time, which a
    host clock around a synchronize would inflate by the launch and sync latency)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(
    cases: dict[str, Callable[[], object]], repeats: int, device: torch.device, warmup: int = 1
) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Times in seconds per case (``repeats`` each, interleaved); cases that fail in warm-up are
    returned in the second dict with the error instead."""
    failed: dict[str, str] = {}
    live = {}
    for name, fn in cases.items():
        try:
            for _ in range(warmup):
                _time_once(fn, device)
            live[name] = fn
        except Exception as exc:  # a peer's op that does not run here: report, don't crash
            failed[name] = (
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            )
    times: dict[str, list[float]] = {name: [] for name in live}
    names = list(live)
    for r in range(repeats):
        for name in names[r % max(len(names), 1) :] + names[: r % max(len(names), 1)]:
            times[name].append(_time_once(live[name], device))
    return times, failed


def ms_stats(seconds: list[float]) -> dict[str, float]:
    """Best, median and every time of a case, in milliseconds (the JSON's ``*_ms`` fields)."""
    return {
        "best_ms": round(min(seconds) * 1e3, 6),
        "median_ms": round(statistics.median(seconds) * 1e3, 6),
        "all_ms": [round(s * 1e3, 4) for s in seconds],
    }


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median over the rounds of ``num[r] / den[r]``: the two cases of a round ran seconds apart, under
    the same memory and load, so this ratio moves less with a drifting machine than best / best."""
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


# ----------------------------------------------------------------------------------------------
# the machine


def cache_large_allocations() -> str:
    """Let glibc keep freed large blocks (like CUDA's caching allocator does) instead of unmapping
    them: otherwise every fresh gradient of the sources costs a page fault per 4 KiB, which on a
    VM can take longer than the op itself. Process-wide; applied before any case runs, so every
    case gets the same allocator. Returns a description for the JSON."""
    if sys.platform != "linux":
        return "default"
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 2**31 - 1)
    except (OSError, AttributeError):
        return "default"
    return "glibc mallopt(M_MMAP_THRESHOLD=1 GiB, M_TRIM_THRESHOLD=2 GiB)" if ok else "default"


def machine_info(device: torch.device) -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    with contextlib.suppress(ImportError):
        import triton

        info["triton"] = triton.__version__
    with contextlib.suppress(OSError, AttributeError):
        info["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# ----------------------------------------------------------------------------------------------
# options and output


def add_common_args(parser: argparse.ArgumentParser, repeats: int = 5) -> None:
    """The options every benchmark but ``dist`` and ``report`` takes."""
    parser.add_argument(
        "--repeats", type=int, default=repeats, help="timed repeats per case (best of); >= 5 for results"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON here")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 repeats (for tests)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (CPU)")
    parser.add_argument(
        "--no-malloc-cache",
        action="store_true",
        help="keep glibc's default of unmapping large freed blocks (page faults on every fresh gradient)",
    )


def setup(args: argparse.Namespace) -> dict:
    """Apply ``--threads`` and the allocator setting; the machine description for the JSON."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    info = machine_info(device)
    info["allocator"] = (
        "default" if args.no_malloc_cache or device.type != "cpu" else cache_large_allocations()
    )
    return info


def finish(result: dict, args: argparse.Namespace, table: list[list[str]], header: list[str]) -> int:
    """The table on stderr, the JSON on stdout (and in ``--json PATH``); the exit code."""
    with contextlib.suppress(OSError, AttributeError):
        result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print_table(header, table)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return 0


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(line.format(*header), file=sys.stderr)
    print(line.format(*["-" * w for w in widths]), file=sys.stderr)
    for r in rows:
        print(line.format(*[str(x) for x in r]), file=sys.stderr)
    print(file=sys.stderr)


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def bench_command(name: str, argv: list[str]) -> str:
    """The command line that made a benchmark's JSON, recorded in it."""
    return shlex.join(["attnres", "bench", name, *argv])
