"""Where a Block AttnRes training step's time goes beyond PreNorm's, at the budget study's shape.

    python scripts/profile_read.py [--d-model 64] [--steps 15]

Times one AdamW training step (forward, backward, step) of PreNorm and Block AttnRes side by side,
interleaved, best of ``--steps``, one thread, with the reads of the depth-attention rules done:

    fused    ``depth_attention_normed``: one call per read, its backward recomputing (the default)
    unfused  depth attention, then the sublayer's RMSNorm, under ``torch.utils.checkpoint``
    stub     unfused, the depth attention replaced by a free op (the last source plus the query):
             what is left is the cost around the op (checkpointing, norms, partial sums, queries)

and prints one JSON line per mode with the two best times (ms) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import attention_residuals.connections as connections
from attention_residuals.bench.model import make_gpt, train_step


def _ratio(args: argparse.Namespace, mode: str) -> dict:
    original = connections.depth_attention, connections.DepthAttentionResidual._fuses_read
    if mode in ("unfused", "stub"):
        connections.DepthAttentionResidual._fuses_read = lambda self, norm: False
    if mode == "stub":
        connections.depth_attention = lambda q, srcs, *a, **k: srcs[-1] + q
    try:
        shape = argparse.Namespace(
            d_model=args.d_model,
            n_layer=6,
            n_head=4,
            seq=128,
            batch=16,
            n_blocks=6,
            device="cpu",
            dtype="float32",
        )
        gen = torch.Generator().manual_seed(0)
        idx, tgt = (torch.randint(0, 256, (16, 128), generator=gen) for _ in range(2))
        steps = {rule: train_step(make_gpt(shape, rule), idx, tgt) for rule in ("prenorm", "block")}
        times: dict[str, list[float]] = {rule: [] for rule in steps}
        for _ in range(3):
            for step in steps.values():
                step()
        for _ in range(args.steps):
            for rule, step in steps.items():
                t = time.perf_counter()
                step()
                times[rule].append(time.perf_counter() - t)
    finally:
        connections.depth_attention, connections.DepthAttentionResidual._fuses_read = original
    best = {rule: round(min(ts) * 1e3, 2) for rule, ts in times.items()}
    return {"mode": mode, "d_model": args.d_model, **best, "ratio": round(best["block"] / best["prenorm"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for mode in ("fused", "unfused", "stub"):
        print(json.dumps(_ratio(args, mode)))


if __name__ == "__main__":
    main()
