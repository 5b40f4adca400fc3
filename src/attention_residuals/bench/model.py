"""``attnres bench model``: training step and prefill of Block / Full AttnRes over the PreNorm baseline.

Also the model helpers the other model-sized benchmarks (``bench memory``, ``bench peers``) share:
the shape options, the GPT they build, ``--quick`` shapes and one training step.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable

import torch

from ..kernels import use_backend
from ..model import GPT, GPTConfig
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

__all__ = ["MODEL_VARIANTS", "add_model_args", "make_gpt", "quick_model", "train_step", "bench_model"]

MODEL_VARIANTS = {  # label -> (residual, op backend or None for auto, rule options)
    "prenorm": ("prenorm", None, {}),
    "block": ("block", None, {}),
    "block (4 depth heads)": ("block", None, {"depth_heads": 4}),
    "block (reference op)": ("block", "reference", {}),
    "full": ("full", None, {}),
}
BASELINES = {"train": "train|prenorm", "prefill": "prefill|prenorm|plain"}  # kind -> the case it is over


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=8, help="transformer layers (2 sublayers each)")
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n-blocks", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def make_gpt(args: argparse.Namespace, residual: str, **extra) -> GPT:
    """Our GPT at the shape of ``args`` with the residual rule ``residual``, seeded, its depth
    queries drawn non-zero."""
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


def quick_model(args: argparse.Namespace) -> None:
    """``--quick``: tiny model shapes and 2 repeats, in place."""
    if args.quick:
        args.d_model, args.n_layer, args.n_head, args.seq, args.batch = 32, 2, 2, 16, 2
        args.n_blocks, args.repeats = min(args.n_blocks, 2), min(args.repeats, 2)


def train_step(
    model: torch.nn.Module, idx: torch.Tensor, tgt: torch.Tensor, ctx: Callable = contextlib.nullcontext
) -> Callable[[], None]:
    """One AdamW training step of ``model(idx, tgt) -> (logits, loss)`` (ours and attn-res' alike)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with ctx():
            _, loss = model(idx, tgt)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _cases(args: argparse.Namespace, idx: torch.Tensor, tgt: torch.Tensor) -> dict[str, Callable]:
    """``train|label`` and ``prefill|label|schedule`` per variant (two-phase where it applies)."""
    cases: dict[str, Callable] = {}
    for label, (residual, backend, options) in MODEL_VARIANTS.items():
        model = make_gpt(args, residual, **options)
        ctx = (lambda b=backend: use_backend(b)) if backend else contextlib.nullcontext
        cases[f"train|{label}"] = train_step(model, idx, tgt, ctx)
        schedules = (
            ("plain", "two_phase") if residual in ("block", "full") and backend is None else ("plain",)
        )
        for schedule in schedules:

            def prefill(model=model, schedule=schedule, ctx=ctx):
                with torch.no_grad(), ctx():
                    return model(idx, schedule=schedule)

            cases[f"prefill|{label}|{schedule}"] = prefill
    return cases


def _assemble(times: dict[str, list[float]]) -> tuple[list[dict], list[list[str]]]:
    """Each case's times and ratios over the PreNorm case of its kind: (JSON results, table rows)."""
    base = {kind: min(times[name]) for kind, name in BASELINES.items()}
    results, rows = [], []
    for name, ts in times.items():
        kind, label, *sched = name.split("|")
        ratio, paired = min(ts) / base[kind], paired_ratio(ts, times[BASELINES[kind]])
        results.append(
            {
                "kind": kind,
                "variant": label,
                "schedule": sched[0] if sched else None,
                **ms_stats(ts),
                "ratio_vs_prenorm": round(ratio, 4),
                "ratio_vs_prenorm_paired": round(paired, 4),
            }
        )
        rows.append([kind, label, sched[0] if sched else "", fmt(min(ts) * 1e3, 1), fmt(ratio), fmt(paired)])
    return results, rows


def bench_model(argv: list[str]) -> int:
    """Training step (forward, backward, AdamW) and prefill (forward, no grad) time of Block and Full
    AttnRes over the PreNorm baseline on the same model, plain and two-phase schedules."""
    parser = argparse.ArgumentParser(prog="attnres bench model", description=bench_model.__doc__)
    add_common_args(parser)
    add_model_args(parser)
    args = parser.parse_args(argv)
    info = setup(args)
    quick_model(args)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (args.batch, args.seq), generator=gen).to(device)
    tgt = torch.randint(0, 256, (args.batch, args.seq), generator=gen).to(device)
    times, failed = interleaved(_cases(args, idx, tgt), args.repeats, device)
    results, rows = _assemble(times)
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
        "results": results,
        "failed": failed,
    }
    header = ["step", "variant", "schedule", "best ms", "x prenorm", "x prenorm (paired)"]
    return finish(result, args, rows, header)
