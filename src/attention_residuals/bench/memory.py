"""``attnres bench memory``: activation memory of a training step per residual rule, and the
per-layer I/O of the residual mechanism in units of d beside the report's table 1."""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable

import torch

from ..kernels import use_backend
from .harness import add_common_args, bench_command, finish, fmt, machine_info, print_table
from .model import MODEL_VARIANTS, add_model_args, make_gpt, quick_model

__all__ = ["saved_activation_bytes", "io_per_layer", "bench_memory"]

MEMORY_VARIANTS = {
    **MODEL_VARIANTS,
    "mhc": ("mhc", None, {}),
    "full (reference op)": ("full", "reference", {}),
}


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


def _measure(
    model: torch.nn.Module, idx: torch.Tensor, backend: str | None, device: torch.device
) -> tuple[int, int | None]:
    """Bytes saved for backward by one forward of ``model``; on CUDA also the peak allocated over a
    forward and backward (None elsewhere)."""
    params = list(model.parameters())
    ctx = use_backend(backend) if backend else contextlib.nullcontext()
    with ctx:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        saved = saved_activation_bytes(lambda: model(idx, idx)[1], params)
        peak = None
        if device.type == "cuda":
            _, loss = model(idx, idx)
            loss.backward()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - before
    return saved, peak


def _activation_memory(
    args: argparse.Namespace, idx: torch.Tensor, device: torch.device
) -> tuple[list[dict], list[list[str]]]:
    """Per variant its activation memory, in MiB and over PreNorm's: (JSON results, table rows)."""
    results, rows = [], []
    for label, (residual, backend, options) in MEMORY_VARIANTS.items():
        model = make_gpt(args, residual, **options)
        saved, peak = _measure(model, idx, backend, device)
        results.append(
            {
                "variant": label,
                "saved_activation_MiB": round(saved / 2**20, 2),
                "cuda_peak_MiB": peak and round(peak / 2**20, 2),
            }
        )
        rows.append([label, fmt(saved / 2**20, 1), fmt(peak / 2**20, 1) if peak else "-"])
        del model
    base = next(r["saved_activation_MiB"] for r in results if r["variant"] == "prenorm")
    for r in results:
        r["ratio_vs_prenorm"] = round(r["saved_activation_MiB"] / base, 4) if base else None
    return results, rows


def _io_rows(result: dict) -> list[list[str]]:
    """The I/O table: this model's reads, writes and total per schedule, and the total at L=128, N=8."""
    typical = result["io_report_typical"]["per_layer_d"]
    return [
        [
            k,
            fmt(v["reads"], 2) if v["reads"] is not None else "-",
            fmt(v["writes"], 0) if v["writes"] is not None else "-",
            fmt(v["total"], 2),
            fmt(typical[k]["total"], 2),
        ]
        for k, v in result["io_this_model"]["per_layer_d"].items()
    ]


def bench_memory(argv: list[str]) -> int:
    """Activation memory of one training step per residual rule (bytes autograd saves; on CUDA also
    the peak allocated), and the per-layer I/O in units of d beside the report's table 1."""
    parser = argparse.ArgumentParser(prog="attnres bench memory", description=bench_memory.__doc__)
    add_common_args(parser, repeats=1)
    add_model_args(parser)
    args = parser.parse_args(argv)
    quick_model(args)
    device = torch.device(args.device)
    info = machine_info(device)  # the default allocator: memory is what is measured here
    idx = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    results, rows = _activation_memory(args, idx, device)
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
    print_table(["variant", "saved for backward MiB", "CUDA peak MiB"], rows)
    return finish(
        result,
        args,
        _io_rows(result),
        ["I/O per layer (d)", "reads", "writes", f"total L={L}", "total L=128,N=8"],
    )
