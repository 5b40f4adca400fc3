"""``attnres bench model``: training step, prefill and per-token decode of Block / Full AttnRes over
the PreNorm baseline; ``--widths`` sweeps the model width (one JSON, a table and a plot of the ratios).

Also the model helpers the other model-sized benchmarks (``bench memory``, ``bench peers``) share:
the shape options, the GPT they build, ``--quick`` shapes and one training step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from collections.abc import Callable
from pathlib import Path

import torch

from ..kernels import use_backend
from ..model import GPT, GPTConfig
from ..plotting import new_figure
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
DECODE_PROMPT = 64  # tokens in the cache before the timed decode steps (at most seq / 2)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=8, help="transformer layers (2 sublayers each)")
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n-blocks", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}"
        ) from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def heads_for(width: int) -> int:
    """Attention heads at a swept width: head dimension 16 up to d 64 (the studies' 4 heads at d 64),
    then 64 (d 1024: 16 heads), as models of those widths are built."""
    return max(4, width // 64) if width >= 64 else max(1, width // 16)


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


def _prompt_len(seq: int) -> int:
    return min(DECODE_PROMPT, seq // 2)


def _decode_len(seq: int, tokens: int) -> int:
    """Decode steps that fit after the prompt in the context."""
    return min(tokens, seq - _prompt_len(seq))


def _decode(model: GPT, batch: int, tokens: int, seq: int, ctx: Callable) -> Callable[[], None]:
    """``tokens`` decode steps of ``batch`` sequences, one position each through the KV cache, after
    a prompt prefilled once (the cache is rewound to it every call: later positions are overwritten)."""
    gen = torch.Generator().manual_seed(1)
    device = model.lm_head.weight.device
    prompt = torch.randint(0, 256, (batch, _prompt_len(seq)), generator=gen).to(device)
    step_ids = torch.randint(0, 256, (_decode_len(seq, tokens), batch, 1), generator=gen).to(device)
    cache = model.new_cache(batch)
    with torch.no_grad(), ctx():
        model.forward_hidden(prompt, cache)
    start = cache.length

    def decode() -> None:
        cache.length = start
        with torch.no_grad(), ctx():
            for ids in step_ids:
                model.lm_head(model.forward_hidden(ids, cache)[:, -1])

    return decode


def _cases(args: argparse.Namespace, idx: torch.Tensor, tgt: torch.Tensor) -> dict[str, Callable]:
    """``train|label``, ``prefill|label|schedule`` (two-phase where it applies) and
    ``decode|label|b<batch>`` per variant; ``--compile``: the training step and prefill compiled."""
    cases: dict[str, Callable] = {}
    for label, (residual, backend, options) in MODEL_VARIANTS.items():
        model = make_gpt(args, residual, **options)
        ctx = (lambda b=backend: use_backend(b)) if backend else contextlib.nullcontext
        run = torch.compile(model) if args.compile else model
        cases[f"train|{label}"] = train_step(run, idx, tgt, ctx)
        schedules = (
            ("plain", "two_phase") if residual in ("block", "full") and backend is None else ("plain",)
        )
        for schedule in schedules:

            def prefill(run=run, schedule=schedule, ctx=ctx):
                with torch.no_grad(), ctx():
                    return run(idx, schedule=schedule)

            cases[f"prefill|{label}|{schedule}"] = prefill
        for batch in args.decode_batches:
            cases[f"decode|{label}|b{batch}"] = _decode(model, batch, args.decode_tokens, args.seq, ctx)
    return cases


def _baseline(name: str) -> str:
    """The PreNorm case a case is timed against: the same step (plain schedule for prefill, the
    same batch for decode)."""
    kind, _, *sched = name.split("|")
    tail = {"train": [], "prefill": ["plain"]}.get(kind, sched)
    return "|".join([kind, "prenorm", *tail])


def _assemble(times: dict[str, list[float]], **fields) -> tuple[list[dict], list[list[str]]]:
    """Each case's times and ratios over the PreNorm case of its kind: (JSON results, table rows)."""
    results, rows = [], []
    for name, ts in times.items():
        kind, label, *sched = name.split("|")
        if _baseline(name) not in times:  # the baseline failed: reported with it in "failed"
            continue
        base = times[_baseline(name)]
        ratio, paired = min(ts) / min(base), paired_ratio(ts, base)
        results.append(
            {
                **fields,
                "kind": kind,
                "variant": label,
                "schedule": sched[0] if sched else None,
                **ms_stats(ts),
                "ratio_vs_prenorm": round(ratio, 4),
                "ratio_vs_prenorm_paired": round(paired, 4),
            }
        )
        cells = [kind, label, sched[0] if sched else "", fmt(min(ts) * 1e3, 1), fmt(ratio), fmt(paired)]
        rows.append([str(v) for v in fields.values()] + cells)
    return results, rows


def plot_sweep(results: list[dict], path: str | Path, targets: dict) -> None:
    """Time / PreNorm against the width: a panel per step (train, prefill, decode), a line per
    variant and schedule, the report's targets dashed."""
    kinds = list(dict.fromkeys(r["kind"] for r in results))
    fig = new_figure((4.6 * len(kinds), 3.8))
    for i, kind in enumerate(kinds):
        ax = fig.add_subplot(1, len(kinds), i + 1)
        rows = [r for r in results if r["kind"] == kind and r["variant"] != "prenorm"]
        for key in dict.fromkeys((r["variant"], r["schedule"]) for r in rows):
            line = sorted(
                (r["d_model"], r["ratio_vs_prenorm_paired"])
                for r in rows
                if (r["variant"], r["schedule"]) == key
            )
            ax.plot(*zip(*line), "o-", ms=3, label=key[0] + (f" ({key[1]})" if key[1] else ""))
        target = targets["train_ratio"] if kind == "train" else targets["prefill_ratio"]
        ax.axhline(target, color="grey", ls="--", lw=1)
        ax.axhline(1.0, color="black", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("d_model")
        ax.set_ylabel("time / PreNorm (paired)")
        ax.set_title(kind)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)


def bench_model(argv: list[str]) -> int:
    """Training step (forward, backward, AdamW), prefill (forward, no grad) and per-token decode
    (KV cache) of Block and Full AttnRes over the PreNorm baseline on the same model, plain and
    two-phase schedules; ``--widths`` at each of several widths."""
    parser = argparse.ArgumentParser(prog="attnres bench model", description=bench_model.__doc__)
    add_common_args(parser)
    add_model_args(parser)
    parser.add_argument(
        "--widths",
        type=_ints,
        default=None,
        help="comma-separated d_model values: a sweep (heads: d / 64, at least 4)",
    )
    parser.add_argument(
        "--decode-batches", type=_ints, default=[1, 16], help="batch sizes of the decode rows (default 1,16)"
    )
    parser.add_argument(
        "--decode-tokens", type=int, default=16, help="decode steps timed per call (default 16)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the training step and prefill (decode stays eager)",
    )
    parser.add_argument("--plot", metavar="PATH", help="with --widths: the ratio-vs-width plot (PNG)")
    args = parser.parse_args(argv)
    info = setup(args)
    quick_model(args)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (args.batch, args.seq), generator=gen).to(device)
    tgt = torch.randint(0, 256, (args.batch, args.seq), generator=gen).to(device)
    results, rows, failed = [], [], {}
    for width in args.widths or [args.d_model]:
        shape = copy.copy(args)
        if args.widths:
            shape.d_model, shape.n_head = width, heads_for(width)
        times, broke = interleaved(_cases(shape, idx, tgt), args.repeats, device)
        fields = {"d_model": width, "n_head": shape.n_head} if args.widths else {}
        got, table = _assemble(times, **fields)
        results += got
        rows += table
        failed.update({f"d{width}|{k}" if args.widths else k: v for k, v in broke.items()})
    targets = {"train_ratio": TARGETS["train_overhead"], "prefill_ratio": TARGETS["prefill_overhead"]}
    config = {
        "sublayers": 2 * args.n_layer,
        "T": args.seq,
        "B": args.batch,
        "n_blocks": args.n_blocks,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "decode": {
            "batches": args.decode_batches,
            "tokens": _decode_len(args.seq, args.decode_tokens),
            "prompt": _prompt_len(args.seq),
        },
        "compile": args.compile,
    }
    config.update(
        {"widths": args.widths} if args.widths else {"d_model": args.d_model, "n_head": args.n_head}
    )
    result = {
        "bench": "model_sweep" if args.widths else "model",
        "command": bench_command("model", argv),
        "machine": info,
        "config": config,
        "targets": targets,
        "results": results,
        "failed": failed,
    }
    if args.widths and args.plot:
        plot_sweep(results, args.plot, targets)
    header = ["step", "variant", "schedule", "best ms", "x prenorm", "x prenorm (paired)"]
    return finish(result, args, rows, (["d_model", "heads"] if args.widths else []) + header)
