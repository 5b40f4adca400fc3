"""``attnres bench op``: depth attention against the memory roofline of the same run.

Cases: :func:`~attention_residuals.kernels.depth_attention` with each backend, torch.compile of the
plain formula and the PyPI peers' ops (:mod:`.adapters`), forward and forward+backward. The memory
roofline is measured in the same run: the best time of one streaming read of the sources
(``sources.sum()``) for the forward, 3x that for forward+backward (read the sources, read them
again and write their gradient). Ratio = roofline time / time (1.0 = at the roofline). Beside it
the paired ratio: the median over rounds of the ratio within one round, whose two timings ran
seconds apart under the same memory speed and load (a VM's memory drifts between rounds). Every
forward is also checked against the float64 reference.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..functional import depth_attention_reference
from ..kernels import backend_status, depth_attention
from .adapters import peer_ops
from .harness import (
    DTYPES,
    TARGETS,
    add_common_args,
    bench_command,
    finish,
    fmt,
    interleaved,
    ms_stats,
    paired_ratio,
    setup,
)

__all__ = ["OP_HEADER", "add_op_args", "run_op", "bench_op"]

OP_HEADER = [
    "op",
    "fwd ms",
    "fwd ratio",
    "fwd+bwd ms",
    "fwd+bwd ratio",
    "paired fwd / fwd+bwd",
    "max |err| / note",
]
ROOFLINE = "roofline: sources.sum()"  # the name of the roofline's case


class Op(NamedTuple):
    """One op of the table: ``fn(q, v) -> out``, or ``fn=None`` and the reason it is not run."""

    name: str
    kind: str  # "ours", "baseline" or "peer"
    fn: Callable | None
    reason: str | None


class OpInputs(NamedTuple):
    """What every op runs on: the sources ``v [N, B, T, d]``, the query ``q [d]``, the gradient
    ``g`` of the output, and copies ``qg``, ``vg`` that require grad (for forward+backward)."""

    q: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    qg: torch.Tensor
    vg: torch.Tensor
    eps: float
    heads: int


def add_op_args(parser: argparse.ArgumentParser) -> None:
    """The shape options of ``bench op`` (also taken by ``bench peers``)."""
    parser.add_argument("--n", type=int, default=9, help="number of sources N")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the plain formula")


def _inputs(args: argparse.Namespace) -> OpInputs:
    """The tensors of the shape in ``args`` (``--quick`` shrinks it, and the repeats, in place)."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.quick:
        args.n, args.batch, args.seq, args.dim, args.repeats = 3, 2, 8, 24, min(args.repeats, 2)
    n, b, t, d = args.n, args.batch, args.seq, args.dim
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(n, b, t, d, generator=gen).to(device=device, dtype=dtype)
    q = (torch.randn(d, generator=gen) * 0.1).to(device)  # a trained-looking, non-zero query
    g = torch.randn(b, t, d, generator=gen).to(device=device, dtype=dtype)
    return OpInputs(q, v, g, q.clone().requires_grad_(), v.clone().requires_grad_(), 1e-6, args.heads)


def _our_ops(args: argparse.Namespace, x: OpInputs) -> list[Op]:
    """Each backend of ours (or why it does not run here), then torch.compile of the plain formula."""
    status = backend_status(torch.device(args.device), DTYPES[args.dtype])
    ops = []
    for backend in ("compiled", "triton", "fused", "reference"):
        fn = lambda q, v, _b=backend: depth_attention(q, v, x.eps, heads=x.heads, backend=_b)
        ops.append(
            Op(
                f"attention_residuals[{backend}]",
                "ours",
                fn if status[backend] is None else None,
                status[backend],
            )
        )
    if args.no_compile or args.quick:
        ops.append(Op("torch.compile(plain formula)", "baseline", None, "skipped (--no-compile / --quick)"))
    else:
        compiled = torch.compile(
            lambda q, v: depth_attention_reference(q, v, x.eps, heads=x.heads), dynamic=False
        )
        ops.append(Op("torch.compile(plain formula)", "baseline", compiled, None))
    return ops


def _peer_ops(x: OpInputs) -> list[Op]:
    """The peers' ops (single-head only), and the peer that has none to time here."""
    ops = []
    for name, (fn, reason) in peer_ops(x.q, x.v, x.eps).items():
        single = x.heads == 1
        ops.append(Op(name, "peer", fn if single else None, reason if single else "heads > 1 unsupported"))
    ops.append(
        Op(
            "hyper-connections (mHC)",
            "peer",
            None,
            "not a depth-attention op (mHC mixes m residual streams): see `attnres bench peers`",
        )
    )
    return ops


def _timed_cases(ops: list[Op], x: OpInputs) -> tuple[dict[str, Callable], dict[str, float]]:
    """The cases to time (the roofline, then ``name|fwd`` and ``name|fwdbwd`` per runnable op) and
    the compile seconds of torch.compile, compiled here outside the timed loop; an op whose compile
    fails is replaced in ``ops`` by one that says why."""
    cases: dict[str, Callable] = {ROOFLINE: lambda: x.v.sum()}
    compile_s: dict[str, float] = {}
    for i, op in enumerate(ops):
        if op.fn is None:
            continue

        def fwd(fn=op.fn):
            with torch.no_grad():
                return fn(x.q, x.v)

        def fwdbwd(fn=op.fn):
            out = fn(x.qg, x.vg)
            return torch.autograd.grad(out, (x.qg, x.vg), x.g)

        if op.name.startswith("torch.compile"):
            t0 = time.perf_counter()
            try:
                fwd()
                fwdbwd()
            except Exception as exc:
                ops[i] = op._replace(fn=None, reason=f"torch.compile failed: {exc}")
                continue
            compile_s[op.name] = round(time.perf_counter() - t0, 2)
        cases[f"{op.name}|fwd"] = fwd
        cases[f"{op.name}|fwdbwd"] = fwdbwd
    return cases, compile_s


def _errors(ops: list[Op], x: OpInputs) -> dict[str, float]:
    """Correctness beside speed: max |error| of every forward against the float64 reference (an op
    that raises here is left out; its timing case reports the error)."""
    want = depth_attention_reference(x.q.double(), x.v.double(), x.eps, heads=x.heads)
    errors: dict[str, float] = {}
    for op in ops:
        if op.fn is not None:
            with contextlib.suppress(Exception), torch.no_grad():
                errors[op.name] = float((op.fn(x.q, x.v).double() - want).abs().max())
    return errors


def _header(args: argparse.Namespace, x: OpInputs, sums: list[float]) -> dict:
    """The JSON before the per-op results: the shape, the roofline and the targets."""
    roof = min(sums)
    bytes_read = x.v.numel() * x.v.element_size()
    return {
        "bench": "op",
        "config": {
            "N": args.n,
            "B": args.batch,
            "T": args.seq,
            "d": args.dim,
            "heads": x.heads,
            "dtype": args.dtype,
            "repeats": args.repeats,
        },
        "roofline": {
            "bytes_read": bytes_read,
            "fwd_ms": round(roof * 1e3, 6),
            "fwdbwd_ms": round(3 * roof * 1e3, 6),
            "bandwidth_GBps": round(bytes_read / roof / 1e9, 2),
            "sum_times": ms_stats(sums),
        },
        "targets": {"fwd_ratio": TARGETS["fwd_ratio"], "fwdbwd_ratio": TARGETS["fwdbwd_ratio"]},
        "results": [],
        "skipped": [],
    }


def _entry(op: Op, times: dict[str, list[float]], error: float | None) -> tuple[dict, list[str]]:
    """The JSON result and the table row of an op that ran."""
    sums, fwd, fwdbwd = times[ROOFLINE], times[f"{op.name}|fwd"], times[f"{op.name}|fwdbwd"]
    roof, f, fb = min(sums), min(fwd), min(fwdbwd)
    entry = {
        "name": op.name,
        "kind": op.kind,
        "fwd": ms_stats(fwd),
        "fwdbwd": ms_stats(fwdbwd),
        "fwd_ratio": round(roof / f, 6),
        "fwdbwd_ratio": round(3 * roof / fb, 6),
        "fwd_ratio_paired": round(paired_ratio(sums, fwd), 6),
        "fwdbwd_ratio_paired": round(3 * paired_ratio(sums, fwdbwd), 6),
        "max_abs_err_vs_float64": error,
    }
    row = [
        op.name,
        fmt(f * 1e3),
        fmt(roof / f),
        fmt(fb * 1e3),
        fmt(3 * roof / fb),
        f"{entry['fwd_ratio_paired']:.3f} / {entry['fwdbwd_ratio_paired']:.3f}",
        fmt(error, 8),
    ]
    return entry, row


def _assemble(
    args: argparse.Namespace,
    x: OpInputs,
    ops: list[Op],
    times: dict[str, list[float]],
    failed: dict[str, str],
    errors: dict[str, float],
    compile_s: dict[str, float],
) -> tuple[dict, list]:
    """The JSON (without command and machine) and the table rows, the roofline's first."""
    result = _header(args, x, times[ROOFLINE])
    roof = min(times[ROOFLINE])
    rows = [
        [
            "roofline (sources.sum(); x3 fwd+bwd)",
            fmt(roof * 1e3),
            "1.000",
            fmt(3 * roof * 1e3),
            "1.000",
            "",
            "",
        ]
    ]
    for op in ops:
        if op.fn is None or f"{op.name}|fwd" in failed or f"{op.name}|fwdbwd" in failed:
            why = op.reason or failed.get(f"{op.name}|fwd") or failed.get(f"{op.name}|fwdbwd")
            result["skipped"].append({"name": op.name, "kind": op.kind, "reason": why})
            rows.append([op.name, "-", "-", "-", "-", "-", f"skipped: {why}"[:90]])
            continue
        entry, row = _entry(op, times, errors.get(op.name))
        if op.name in compile_s:
            entry["compile_s"] = compile_s[op.name]
        result["results"].append(entry)
        rows.append(row)
    return result, rows


def run_op(
    args: argparse.Namespace, include_ours: bool = True, include_peers: bool = True
) -> tuple[dict, list]:
    """Build the cases, time them interleaved, check them against float64: (JSON, table rows)."""
    x = _inputs(args)
    ops = (_our_ops(args, x) if include_ours else []) + (_peer_ops(x) if include_peers else [])
    cases, compile_s = _timed_cases(ops, x)
    errors = _errors(ops, x)
    times, failed = interleaved(cases, args.repeats, torch.device(args.device))
    return _assemble(args, x, ops, times, failed, errors, compile_s)


def bench_op(argv: list[str]) -> int:
    """Forward and forward+backward time of depth_attention (each backend), torch.compile of the plain
    formula, the plain reference and the PyPI peers, against the memory roofline of the same run."""
    parser = argparse.ArgumentParser(prog="attnres bench op", description=bench_op.__doc__)
    add_common_args(parser)
    add_op_args(parser)
    args = parser.parse_args(argv)
    info = setup(args)
    result, rows = run_op(args)
    result = {"bench": "op", "command": bench_command("op", argv), "machine": info, **result}
    return finish(result, args, rows, OP_HEADER)
