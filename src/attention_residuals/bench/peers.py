"""``attnres bench peers``: the PyPI packages' ops and steps beside ours (skipped with the reason).

Three figures: the depth-attention op as ``bench op`` times it, one mHC residual (hyper-connections
vs our mHC-lite) and a training step of attn-res' own model vs ours, with each package's Block over
PreNorm step ratio. The peers themselves are wrapped in :mod:`.adapters`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from .adapters import attn_res_model, mhc_cases
from .harness import (
    add_common_args,
    bench_command,
    finish,
    fmt,
    interleaved,
    ms_stats,
    paired_ratio,
    print_table,
    setup,
)
from .model import make_gpt, quick_model, train_step
from .op import OP_HEADER, add_op_args, run_op

__all__ = ["bench_peers"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnres bench peers", description=bench_peers.__doc__)
    add_common_args(parser)
    add_op_args(parser)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--model-seq", type=int, default=512, dest="model_seq")
    parser.add_argument("--model-batch", type=int, default=8, dest="model_batch")
    parser.add_argument("--n-blocks", type=int, default=8)
    return parser


def _step_cases(
    margs: argparse.Namespace, device: torch.device
) -> tuple[dict[str, Callable], dict[str, str]]:
    """The mHC residuals and the training steps, ours and attn-res' (Block and PreNorm each), with
    the reason for each peer that cannot run."""
    cases, skipped = mhc_cases(margs, device)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (margs.batch, margs.seq), generator=gen).to(device)
    for label, residual in (("prenorm", "prenorm"), ("block", "block")):
        cases[f"train|attention_residuals {label}"] = train_step(make_gpt(margs, residual), idx, idx)
    for label, mode in (("prenorm", "none"), ("block", "block")):
        try:
            model = attn_res_model(margs, mode)
        except Exception as exc:
            skipped[f"attn-res {label}"] = f"{type(exc).__name__}: {exc}"
            continue
        cases[f"train|attn-res {label}"] = train_step(model, idx, idx)
    return cases, skipped


def _steps(times: dict[str, list[float]]) -> tuple[list[dict], list[list[str]]]:
    """Each step's times, then each package's Block / PreNorm training-step ratio: (JSON, table rows)."""
    steps, rows = [], []
    for name, ts in times.items():
        kind, label = name.split("|")
        steps.append({"kind": kind, "name": label, **ms_stats(ts)})
        rows.append([kind, label, fmt(min(ts) * 1e3, 2)])
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
            rows.append(
                ["train block/prenorm (best; paired)", pkg, f"{fmt(min(blk) / min(pre))}; {fmt(paired)}"]
            )
    return steps, rows


def bench_peers(argv: list[str]) -> int:
    """The PyPI peers beside ours: the depth-attention op (as ``bench op``), one mHC residual
    (hyper-connections vs our mHC-lite) and a training step of attn-res' own model vs ours."""
    args = _parser().parse_args(argv)
    info = setup(args)
    device = torch.device(args.device)
    args.no_compile = True
    op_result, op_rows = run_op(argparse.Namespace(**vars(args)), include_ours=True, include_peers=True)
    margs = argparse.Namespace(**vars(args))
    margs.seq, margs.batch = args.model_seq, args.model_batch
    quick_model(margs)
    cases, skipped = _step_cases(margs, device)
    times, failed = interleaved(cases, margs.repeats, device)
    skipped.update(failed)
    steps, rows = _steps(times)
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
    print_table(OP_HEADER, op_rows)
    return finish(result, args, rows, ["figure", "who", "best ms"])
