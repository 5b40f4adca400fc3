"""``attnres bench``: timings side by side in one run, JSON to stdout (and ``--json PATH``), a table on stderr.

Sub-commands (the table :data:`SUBCOMMANDS`; add one by adding a line)::

    attnres bench op       depth attention vs the memory roofline, torch.compile, the peers
    attnres bench model    training step and prefill of Block / Full AttnRes over the PreNorm baseline
    attnres bench memory   activation memory of a training step per rule; per-layer I/O (report's table 1)
    attnres bench peers    the PyPI packages' ops and steps beside ours (skipped with the reason)
    attnres bench dist     distributed figures (lives in attention_residuals.bench_dist)
    attnres bench report   the JSONs of a folder as README.md with plots (attention_residuals.bench_report)

Method: every case is warmed up, then the repeats are interleaved (one of each case per round,
the round order rotated) and the best of the repeats is reported beside the median. The memory
roofline is measured in the same run: the best time of one streaming read of the sources
(``sources.sum()``) for the forward, 3x that for forward+backward (read the sources, read them
again and write their gradient). Ratio = roofline time / time (1.0 = at the roofline). Beside it
the paired ratio: the median over rounds of the ratio within one round, whose two timings ran
seconds apart under the same memory speed and load (a VM's memory drifts between rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .cli import dispatch
from .functional import depth_attention_reference
from .kernels import backend_status, depth_attention, use_backend

__all__ = ["main", "SUBCOMMANDS", "bench_op", "bench_model", "bench_memory", "bench_peers"]

# name -> ("module:function", help). The function takes argv (list[str]) and returns an exit code.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "op": (
        "attention_residuals.bench:bench_op",
        "depth attention vs the memory roofline, torch.compile, peers",
    ),
    "model": (
        "attention_residuals.bench:bench_model",
        "train step / prefill of Block and Full AttnRes vs PreNorm",
    ),
    "memory": (
        "attention_residuals.bench:bench_memory",
        "activation memory per rule; per-layer I/O in units of d",
    ),
    "peers": ("attention_residuals.bench:bench_peers", "PyPI peers' ops and training steps beside ours"),
    "dist": ("attention_residuals.bench_dist:main", "distributed (pipeline / sharded prefill) figures"),
    "report": ("attention_residuals.bench_report:main", "the JSONs of a folder as README.md with plots"),
}

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
TARGETS = {"fwd_ratio": 0.8, "fwdbwd_ratio": 0.5, "train_overhead": 1.04, "prefill_overhead": 1.02}


# ----------------------------------------------------------------------------------------------
# timing and reporting helpers


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


def _ms(seconds: list[float]) -> dict[str, float]:
    return {
        "best_ms": round(min(seconds) * 1e3, 6),
        "median_ms": round(statistics.median(seconds) * 1e3, 6),
        "all_ms": [round(s * 1e3, 4) for s in seconds],
    }


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median over the rounds of ``num[r] / den[r]``: the two cases of a round ran seconds apart, under
    the same memory and load, so this ratio moves less with a drifting machine than best / best."""
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


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


def _finish(result: dict, args: argparse.Namespace, table: list[list[str]], header: list[str]) -> int:
    with contextlib.suppress(OSError, AttributeError):
        result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    _print_table(header, table)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return 0


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(line.format(*header), file=sys.stderr)
    print(line.format(*["-" * w for w in widths]), file=sys.stderr)
    for r in rows:
        print(line.format(*[str(x) for x in r]), file=sys.stderr)
    print(file=sys.stderr)


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _common(parser: argparse.ArgumentParser, repeats: int = 5) -> None:
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


def _setup(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    info = machine_info(device)
    info["allocator"] = (
        "default" if args.no_malloc_cache or device.type != "cpu" else cache_large_allocations()
    )
    return info


def bench_command(name: str, argv: list[str]) -> str:
    """The command line that made a benchmark's JSON, recorded in it."""
    return shlex.join(["attnres", "bench", name, *argv])


# ----------------------------------------------------------------------------------------------
# op


def _peer_ops(q: torch.Tensor, v: torch.Tensor, eps: float):
    """``name -> (fwd(q, v), reason)``: the PyPI packages' depth-attention ops where they import.

    Each ``fwd`` returns the output ``[*batch, d]`` and is differentiable in ``q`` and ``v``.
    """
    peers: dict[str, tuple[Callable | None, str | None]] = {}
    try:
        from attn_res import AttnResOperator

        op = AttnResOperator(v.shape[-1], eps=eps).to(device=v.device, dtype=v.dtype)
        fwd = _module_param_op(op, "pseudo_query")
        peers["attn-res (AttnResOperator)"] = (lambda q, v: fwd(q.to(v.dtype), v), None)
    except Exception as exc:
        peers["attn-res (AttnResOperator)"] = (None, f"does not import: {type(exc).__name__}: {exc}")
    try:
        import attnres as fast_attnres  # the fast-attnres distribution installs the module `attnres`

        peers["fast-attnres (attnres.attnres)"] = (
            lambda q, v: fast_attnres.attnres(v, q.to(v.dtype), eps=eps),
            None,
        )
    except Exception as exc:
        peers["fast-attnres (attnres.attnres)"] = (None, f"does not import: {type(exc).__name__}: {exc}")
    try:
        from flash_attn_res import phase_1_batched_attention_triton_op

        def flash(q, v):
            out, _lse = phase_1_batched_attention_triton_op(v, q.to(v.dtype).unsqueeze(0), eps)
            return out[0]

        peers["flash-attn-res (phase 1, one query)"] = (flash, None)
    except Exception as exc:
        peers["flash-attn-res (phase 1, one query)"] = (
            None,
            f"does not import: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
        )
    # GPU-only Triton ops (each raises on CPU tensors; the bench reports the error as the reason)
    ones = torch.ones(v.shape[-1], device=v.device, dtype=v.dtype)  # their RMSNorm weight: the identity
    try:
        from fla.ops.attnres import fused_attnres

        peers["flash-linear-attention (fused_attnres)"] = (
            lambda q, v: fused_attnres(q.to(v.dtype), list(v.unbind(0)), ones, rms_eps=eps),
            None,
        )
    except Exception as exc:
        peers["flash-linear-attention (fused_attnres)"] = (None, f"does not import: {type(exc).__name__}: {exc}")
    try:
        from liger_kernel.transformers.functional import liger_attn_res

        peers["Liger-Kernel (liger_attn_res)"] = (lambda q, v: liger_attn_res(v, q.to(v.dtype), ones, eps), None)
    except Exception as exc:
        peers["Liger-Kernel (liger_attn_res)"] = (None, f"does not import: {type(exc).__name__}: {exc}")
    return peers


def _module_param_op(module: torch.nn.Module, param: str) -> Callable:
    """Call ``module(v)`` with its parameter ``param`` replaced by the tensor ``q`` (gradients flow to q)."""

    def fwd(q, v):
        saved = module._parameters.pop(param)
        try:
            setattr(module, param, q)
            return module(v)
        finally:
            delattr(module, param)
            module._parameters[param] = saved

    return fwd


def _op_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=9, help="number of sources N")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the plain formula")


def _run_op(
    args: argparse.Namespace, include_ours: bool = True, include_peers: bool = True
) -> tuple[dict, list]:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.quick:
        args.n, args.batch, args.seq, args.dim, args.repeats = 3, 2, 8, 24, min(args.repeats, 2)
    n, b, t, d = args.n, args.batch, args.seq, args.dim
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(n, b, t, d, generator=gen).to(device=device, dtype=dtype)
    q = (torch.randn(d, generator=gen) * 0.1).to(device)  # a trained-looking, non-zero query
    g = torch.randn(b, t, d, generator=gen).to(device=device, dtype=dtype)
    vg, qg = v.clone().requires_grad_(), q.clone().requires_grad_()
    eps, heads = 1e-6, args.heads

    # (name, kind, fwd(q, v) -> out, reason if unavailable)
    ops: list[tuple[str, str, Callable | None, str | None]] = []
    if include_ours:
        status = backend_status(device, dtype)
        for backend in ("compiled", "triton", "fused", "reference"):
            fn = lambda q, v, _b=backend: depth_attention(q, v, eps, heads=heads, backend=_b)
            ops.append(
                (
                    f"attention_residuals[{backend}]",
                    "ours",
                    fn if status[backend] is None else None,
                    status[backend],
                )
            )
        if args.no_compile or args.quick:
            ops.append(("torch.compile(plain formula)", "baseline", None, "skipped (--no-compile / --quick)"))
        else:
            compiled = torch.compile(
                lambda q, v: depth_attention_reference(q, v, eps, heads=heads), dynamic=False
            )
            ops.append(("torch.compile(plain formula)", "baseline", compiled, None))
    if include_peers:
        for name, (fn, reason) in _peer_ops(q, v, eps).items():
            ops.append(
                (name, "peer", fn if heads == 1 else None, reason if heads == 1 else "heads > 1 unsupported")
            )
        ops.append(
            (
                "hyper-connections (mHC)",
                "peer",
                None,
                "not a depth-attention op (mHC mixes m residual streams): see `attnres bench peers`",
            )
        )

    cases: dict[str, Callable] = {"roofline: sources.sum()": lambda: v.sum()}
    compile_s: dict[str, float] = {}
    for name, _kind, fn, _reason in ops:
        if fn is None:
            continue

        def fwd(fn=fn):
            with torch.no_grad():
                return fn(q, v)

        def fwdbwd(fn=fn):
            out = fn(qg, vg)
            return torch.autograd.grad(out, (qg, vg), g)

        if name.startswith("torch.compile"):  # compile outside the timed loop
            t0 = time.perf_counter()
            try:
                fwd()
                fwdbwd()
            except Exception as exc:
                ops[[o[0] for o in ops].index(name)] = (
                    name,
                    "baseline",
                    None,
                    f"torch.compile failed: {exc}",
                )
                continue
            compile_s[name] = round(time.perf_counter() - t0, 2)
        cases[f"{name}|fwd"] = fwd
        cases[f"{name}|fwdbwd"] = fwdbwd

    # correctness beside speed: every forward against the float64 reference
    want = depth_attention_reference(q.double(), v.double(), eps, heads=heads)
    errors: dict[str, float] = {}
    for name, _kind, fn, _reason in ops:
        if fn is not None:
            with contextlib.suppress(Exception), torch.no_grad():
                errors[name] = float((fn(q, v).double() - want).abs().max())

    times, failed = interleaved(cases, args.repeats, device)
    sums = times["roofline: sources.sum()"]
    roof = min(sums)
    bytes_read = v.numel() * v.element_size()
    result = {
        "bench": "op",
        "config": {
            "N": n,
            "B": b,
            "T": t,
            "d": d,
            "heads": heads,
            "dtype": args.dtype,
            "repeats": args.repeats,
        },
        "roofline": {
            "bytes_read": bytes_read,
            "fwd_ms": round(roof * 1e3, 6),
            "fwdbwd_ms": round(3 * roof * 1e3, 6),
            "bandwidth_GBps": round(bytes_read / roof / 1e9, 2),
            "sum_times": _ms(sums),
        },
        "targets": {"fwd_ratio": TARGETS["fwd_ratio"], "fwdbwd_ratio": TARGETS["fwdbwd_ratio"]},
        "results": [],
        "skipped": [],
    }
    rows = []
    for name, kind, fn, reason in ops:
        if fn is None or f"{name}|fwd" in failed or f"{name}|fwdbwd" in failed:
            why = reason or failed.get(f"{name}|fwd") or failed.get(f"{name}|fwdbwd")
            result["skipped"].append({"name": name, "kind": kind, "reason": why})
            rows.append([name, "-", "-", "-", "-", "-", f"skipped: {why}"[:90]])
            continue
        f, fb = min(times[f"{name}|fwd"]), min(times[f"{name}|fwdbwd"])
        entry = {
            "name": name,
            "kind": kind,
            "fwd": _ms(times[f"{name}|fwd"]),
            "fwdbwd": _ms(times[f"{name}|fwdbwd"]),
            "fwd_ratio": round(roof / f, 6),
            "fwdbwd_ratio": round(3 * roof / fb, 6),
            "fwd_ratio_paired": round(paired_ratio(sums, times[f"{name}|fwd"]), 6),
            "fwdbwd_ratio_paired": round(3 * paired_ratio(sums, times[f"{name}|fwdbwd"]), 6),
            "max_abs_err_vs_float64": errors.get(name),
        }
        if name in compile_s:
            entry["compile_s"] = compile_s[name]
        result["results"].append(entry)
        rows.append(
            [
                name,
                _fmt(f * 1e3),
                _fmt(roof / f),
                _fmt(fb * 1e3),
                _fmt(3 * roof / fb),
                f"{entry['fwd_ratio_paired']:.3f} / {entry['fwdbwd_ratio_paired']:.3f}",
                _fmt(errors.get(name), 8),
            ]
        )
    rows.insert(
        0,
        [
            "roofline (sources.sum(); x3 fwd+bwd)",
            _fmt(roof * 1e3),
            "1.000",
            _fmt(3 * roof * 1e3),
            "1.000",
            "",
            "",
        ],
    )
    return result, rows


OP_HEADER = ["op", "fwd ms", "fwd ratio", "fwd+bwd ms", "fwd+bwd ratio", "paired fwd / fwd+bwd", "max |err| / note"]


def bench_op(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="attnres bench op", description=bench_op.__doc__)
    _common(parser)
    _op_args(parser)
    args = parser.parse_args(argv)
    info = _setup(args)
    result, rows = _run_op(args)
    result = {"bench": "op", "command": bench_command("op", argv), "machine": info, **result}
    return _finish(result, args, rows, OP_HEADER)


bench_op.__doc__ = (
    "Forward and forward+backward time of depth_attention (each backend), torch.compile of the plain "
    "formula, the plain reference and the PyPI peers, against the memory roofline of the same run."
)


# ----------------------------------------------------------------------------------------------
# model


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=8, help="transformer layers (2 sublayers each)")
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n-blocks", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def _gpt(args, residual: str, **extra):
    from .model import GPT, GPTConfig

    kw = dict(
        vocab_size=256,
        n_layer=args.n_layer,
        n_head=args.n_head,
        d_model=args.d_model,
        seq_len=args.seq,
        residual=residual,
        **extra,
    )
    if residual == "block":
        kw["n_blocks"] = args.n_blocks
    torch.manual_seed(0)
    model = GPT(GPTConfig(**kw)).to(device=args.device, dtype=DTYPES[args.dtype])
    with torch.no_grad():  # trained-looking queries: zero-init ones make every weight uniform
        for name, p in model.named_parameters():
            if "quer" in name:
                p.normal_(0, 0.02)
    return model


def _quick_model(args) -> None:
    if args.quick:
        args.d_model, args.n_layer, args.n_head, args.seq, args.batch = 32, 2, 2, 16, 2
        args.n_blocks, args.repeats = min(args.n_blocks, 2), min(args.repeats, 2)


MODEL_VARIANTS = {  # label -> (residual, op backend or None for auto)
    "prenorm": ("prenorm", None),
    "block": ("block", None),
    "block (reference op)": ("block", "reference"),
    "full": ("full", None),
}


def _train_step(model: torch.nn.Module, idx: torch.Tensor, tgt: torch.Tensor,
                ctx: Callable = contextlib.nullcontext) -> Callable[[], None]:
    """One AdamW training step of ``model(idx, tgt) -> (logits, loss)`` (ours and attn-res' alike)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with ctx():
            _, loss = model(idx, tgt)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def bench_model(argv: list[str]) -> int:
    """Training step (forward, backward, AdamW) and prefill (forward, no grad) time of Block and Full
    AttnRes over the PreNorm baseline on the same model, plain and two-phase schedules."""
    parser = argparse.ArgumentParser(prog="attnres bench model", description=bench_model.__doc__)
    _common(parser)
    _model_args(parser)
    args = parser.parse_args(argv)
    info = _setup(args)
    _quick_model(args)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (args.batch, args.seq), generator=gen).to(device)
    tgt = torch.randint(0, 256, (args.batch, args.seq), generator=gen).to(device)

    cases: dict[str, Callable] = {}
    for label, (residual, backend) in MODEL_VARIANTS.items():
        model = _gpt(args, residual)
        ctx = (lambda b=backend: use_backend(b)) if backend else contextlib.nullcontext
        cases[f"train|{label}"] = _train_step(model, idx, tgt, ctx)
        schedules = (
            ("plain", "two_phase") if residual in ("block", "full") and backend is None else ("plain",)
        )
        for schedule in schedules:

            def prefill(model=model, schedule=schedule, ctx=ctx):
                with torch.no_grad(), ctx():
                    return model(idx, schedule=schedule)

            cases[f"prefill|{label}|{schedule}"] = prefill
    times, failed = interleaved(cases, args.repeats, device)
    base_name = {"train": "train|prenorm", "prefill": "prefill|prenorm|plain"}
    base = {kind: min(times[name]) for kind, name in base_name.items()}
    result = {
        "bench": "model",
        "command": bench_command("model", argv),
        "machine": info,
        "config": {
            "d_model": args.d_model,
            "sublayers": 2 * args.n_layer,
            "n_head": args.n_head,
            "T": args.seq,
            "B": args.batch,
            "n_blocks": args.n_blocks,
            "dtype": args.dtype,
            "repeats": args.repeats,
        },
        "targets": {"train_ratio": TARGETS["train_overhead"], "prefill_ratio": TARGETS["prefill_overhead"]},
        "results": [],
        "failed": failed,
    }
    rows = []
    for name, ts in times.items():
        kind, label, *sched = name.split("|")
        ratio, paired = min(ts) / base[kind], paired_ratio(ts, times[base_name[kind]])
        result["results"].append(
            {
                "kind": kind,
                "variant": label,
                "schedule": sched[0] if sched else None,
                **_ms(ts),
                "ratio_vs_prenorm": round(ratio, 4),
                "ratio_vs_prenorm_paired": round(paired, 4),
            }
        )
        rows.append([kind, label, sched[0] if sched else "", _fmt(min(ts) * 1e3, 1), _fmt(ratio), _fmt(paired)])
    header = ["step", "variant", "schedule", "best ms", "x prenorm", "x prenorm (paired)"]
    return _finish(result, args, rows, header)


# ----------------------------------------------------------------------------------------------
# memory


def saved_activation_bytes(fn: Callable[[], torch.Tensor], exclude: list[torch.Tensor]) -> int:
    """Bytes autograd keeps for backward while ``fn()`` builds its graph: unique storages of the
    saved tensors, not counting ``exclude`` (the parameters)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def io_per_layer(L: int, N: int, m: int = 4) -> dict[str, dict]:
    """Per-token, per-layer memory traffic of the residual mechanism in units of d (reads, writes).

    ``plain`` schedules read every source once per layer (keys are recomputed from the values).
    Two-phase numbers follow the report (section 4 and appendix B): Block ``(N/S + 3)`` reads and
    2 writes; Full ``(S + N - 2)`` reads and 2 writes. mHC with ``m`` streams: the report's 34d at m=4.
    """
    S = math.ceil(L / N)
    # Block, plain: layer i of block n (0-based) reads the embedding, n finished blocks and the
    # partial sum (when i > 0), writes its input h; the partial-sum update reads it and v, writes it.
    block_reads = []
    for layer in range(L):
        n, i = divmod(layer, S)
        block_reads.append(1 + n + (1 if i > 0 else 0) + 2)
    full_reads = [layer + 1 for layer in range(L)]  # embedding and every earlier output
    out = {
        "prenorm": {"reads": 2.0, "writes": 1.0, "note": "h + v -> h"},
        "block_plain": {"reads": sum(block_reads) / L, "writes": 2.0},
        "block_two_phase": {"reads": N / S + 3, "writes": 2.0, "note": "report, table 1"},
        "full_plain": {"reads": sum(full_reads) / L, "writes": 1.0},
        "full_two_phase": {"reads": S + N - 2, "writes": 2.0, "note": "report, appendix B"},
    }
    if m == 4:
        out["mhc_m4"] = {"reads": None, "writes": None, "total": 34.0, "note": "report, table 1 (m = 4)"}
    for v in out.values():
        if "total" not in v:
            v["total"] = round(v["reads"] + v["writes"], 4)
            v["reads"] = round(v["reads"], 4)
    return {"L": L, "N": N, "S": S, "m": m, "per_layer_d": out}


def bench_memory(argv: list[str]) -> int:
    """Activation memory of one training step per residual rule (bytes autograd saves; on CUDA also
    the peak allocated), and the per-layer I/O in units of d beside the report's table 1."""
    parser = argparse.ArgumentParser(prog="attnres bench memory", description=bench_memory.__doc__)
    _common(parser, repeats=1)
    _model_args(parser)
    args = parser.parse_args(argv)
    _quick_model(args)
    device = torch.device(args.device)
    info = machine_info(device)  # the default allocator: memory is what is measured here
    idx = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    variants = {**MODEL_VARIANTS, "mhc": ("mhc", None), "full (reference op)": ("full", "reference")}
    results, rows = [], []
    for label, (residual, backend) in variants.items():
        model = _gpt(args, residual)
        params = list(model.parameters())
        ctx = use_backend(backend) if backend else contextlib.nullcontext()
        with ctx:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            saved = saved_activation_bytes(lambda model=model: model(idx, idx)[1], params)
            peak = None
            if device.type == "cuda":
                _, loss = model(idx, idx)
                loss.backward()
                torch.cuda.synchronize(device)
                peak = torch.cuda.max_memory_allocated(device) - before
        results.append(
            {
                "variant": label,
                "saved_activation_MiB": round(saved / 2**20, 2),
                "cuda_peak_MiB": peak and round(peak / 2**20, 2),
            }
        )
        rows.append([label, _fmt(saved / 2**20, 1), _fmt(peak / 2**20, 1) if peak else "-"])
        del model
    base = next(r["saved_activation_MiB"] for r in results if r["variant"] == "prenorm")
    for r in results:
        r["ratio_vs_prenorm"] = round(r["saved_activation_MiB"] / base, 4) if base else None
    L = 2 * args.n_layer
    result = {
        "bench": "memory",
        "command": bench_command("memory", argv),
        "machine": info,
        "config": {
            "d_model": args.d_model,
            "sublayers": L,
            "T": args.seq,
            "B": args.batch,
            "n_blocks": args.n_blocks,
            "dtype": args.dtype,
        },
        "activation_memory": results,
        "io_this_model": io_per_layer(L, args.n_blocks),
        "io_report_typical": io_per_layer(128, 8),
    }
    _print_table(["variant", "saved for backward MiB", "CUDA peak MiB"], rows)
    io_rows = [
        [
            k,
            _fmt(v["reads"], 2) if v["reads"] is not None else "-",
            _fmt(v["writes"], 0) if v["writes"] is not None else "-",
            _fmt(v["total"], 2),
            _fmt(result["io_report_typical"]["per_layer_d"][k]["total"], 2),
        ]
        for k, v in result["io_this_model"]["per_layer_d"].items()
    ]
    return _finish(
        result, args, io_rows, ["I/O per layer (d)", "reads", "writes", f"total L={L}", "total L=128,N=8"]
    )


# ----------------------------------------------------------------------------------------------
# peers


def _attn_res_model(args, mode: str):
    from attn_res import AttnResMode, AttnResTransformer, TransformerConfig

    cfg = TransformerConfig(
        d_model=args.d_model,
        n_layers=2 * args.n_layer,
        n_heads=args.n_head,
        n_kv_heads=args.n_head,
        vocab_size=256,
        max_seq_len=args.seq,
        attn_res_mode=AttnResMode(mode),
        n_blocks=args.n_blocks,
    )
    if args.dtype != "float32":  # .to(dtype) would cast its complex RoPE table to real
        raise TypeError(f"attn-res' model is run in float32 only here, got --dtype {args.dtype}")
    torch.manual_seed(0)
    return AttnResTransformer(cfg).to(device=args.device)


def _mhc_cases(args, device) -> tuple[dict[str, Callable], dict[str, str]]:
    """One mHC residual (m = 4 streams) around an identity branch, ours and hyper-connections'."""
    from .connections import make_connection

    b, t, d, m = args.batch, args.seq, args.d_model, 4
    x = torch.randn(b, t, d, device=device, requires_grad=True)
    cases, skipped = {}, {}
    ours = make_connection("mhc", 2, d, streams=m).to(device)

    def our_step():
        state = ours.init_state(x)
        h = ours.read(state, 0)
        ours.write(state, 0, h)
        out = ours.final(state)
        return torch.autograd.grad(out.sum(), x)

    cases["mhc|attention_residuals (mhc-lite)"] = our_step
    try:
        from hyper_connections import get_init_and_expand_reduce_stream_functions

        init_hc, expand, reduce = get_init_and_expand_reduce_stream_functions(m, dim=d)
        hc = init_hc(branch=torch.nn.Identity()).to(device)

        def their_step():
            out = reduce(hc(expand(x)))
            return torch.autograd.grad(out.sum(), x)

        cases["mhc|hyper-connections (mHC, sinkhorn)"] = their_step
    except Exception as exc:
        skipped["hyper-connections (mHC, sinkhorn)"] = f"{type(exc).__name__}: {exc}"
    return cases, skipped


def bench_peers(argv: list[str]) -> int:
    """The PyPI peers beside ours: the depth-attention op (as ``bench op``), one mHC residual
    (hyper-connections vs our mHC-lite) and a training step of attn-res' own model vs ours."""
    parser = argparse.ArgumentParser(prog="attnres bench peers", description=bench_peers.__doc__)
    _common(parser)
    _op_args(parser)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--model-seq", type=int, default=512, dest="model_seq")
    parser.add_argument("--model-batch", type=int, default=8, dest="model_batch")
    parser.add_argument("--n-blocks", type=int, default=8)
    args = parser.parse_args(argv)
    info = _setup(args)
    device = torch.device(args.device)
    args.no_compile = True
    op_result, op_rows = _run_op(argparse.Namespace(**vars(args)), include_ours=True, include_peers=True)
    margs = argparse.Namespace(**vars(args))
    margs.seq, margs.batch = args.model_seq, args.model_batch
    _quick_model(margs)
    cases, skipped = _mhc_cases(margs, device)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (margs.batch, margs.seq), generator=gen).to(device)
    for label, residual in (("prenorm", "prenorm"), ("block", "block")):
        cases[f"train|attention_residuals {label}"] = _train_step(_gpt(margs, residual), idx, idx)
    for label, mode in (("prenorm", "none"), ("block", "block")):
        try:
            model = _attn_res_model(margs, mode)
        except Exception as exc:
            skipped[f"attn-res {label}"] = f"{type(exc).__name__}: {exc}"
            continue
        cases[f"train|attn-res {label}"] = _train_step(model, idx, idx)
    times, failed = interleaved(cases, margs.repeats, device)
    skipped.update(failed)
    steps = []
    rows = []
    for name, ts in times.items():
        kind, label = name.split("|")
        steps.append({"kind": kind, "name": label, **_ms(ts)})
        rows.append([kind, label, _fmt(min(ts) * 1e3, 2)])
    for pkg in ("attn-res", "attention_residuals"):
        pre, blk = (times.get(f"train|{pkg} {v}") for v in ("prenorm", "block"))
        if pre and blk:
            paired = paired_ratio(blk, pre)
            steps.append(
                {
                    "kind": "train_overhead",
                    "name": pkg,
                    "block_over_prenorm": round(min(blk) / min(pre), 4),
                    "block_over_prenorm_paired": round(paired, 4),
                }
            )
            rows.append(["train block/prenorm (best; paired)", pkg, f"{_fmt(min(blk) / min(pre))}; {_fmt(paired)}"])
    result = {
        "bench": "peers",
        "command": bench_command("peers", argv),
        "machine": info,
        "op": op_result,
        "steps": steps,
        "model_config": {
            "d_model": margs.d_model,
            "sublayers": 2 * margs.n_layer,
            "T": margs.seq,
            "B": margs.batch,
        },
        "skipped": [{"name": k, "reason": v} for k, v in skipped.items()],
    }
    _print_table(OP_HEADER, op_rows)
    return _finish(result, args, rows, ["figure", "who", "best ms"])


# ----------------------------------------------------------------------------------------------
# entry point


def main(argv: list[str] | None = None) -> int:
    return dispatch(
        "attnres bench", SUBCOMMANDS, list(sys.argv[1:] if argv is None else argv),
        "JSON goes to stdout, the table to stderr.",
    )


if __name__ == "__main__":
    sys.exit(main())
