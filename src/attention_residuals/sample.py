"""``attnres sample RUN_DIR``: generate text from a run's checkpoint with KV-cache decoding.

Byte-level runs decode their samples as UTF-8 (a character cut at the end is replaced). When
more tokens are asked for than the context holds, generation slides: the last half-context of
tokens is kept as the prompt for the next stretch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from .checkpoint import CheckpointError
from .data import BYTE_TOKENIZER, byte_decode, byte_encode
from .evaluate import load_run
from .model import GPT

__all__ = ["generate_text", "main"]


@torch.no_grad()
def generate_text(
    model: GPT,
    prompt: str = "",
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
    num_samples: int = 1,
    encode: Callable[[str], list[int]] = byte_encode,
    decode: Callable[[list[int]], str] = byte_decode,
) -> list[str]:
    """``num_samples`` continuations of ``prompt`` (the prompt included), as strings.

    ``temperature=0`` is greedy. The same seed gives the same samples. An empty prompt starts
    from a newline.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature: expected >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k: expected >= 1, got {top_k}")
    if num_samples < 1:
        raise ValueError(f"num_samples: expected >= 1, got {num_samples}")
    ids = encode(prompt) or encode("\n")
    device = next(model.parameters()).device
    ctx = model.config.seq_len
    seqs = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        remaining = max_new_tokens
        while remaining > 0:
            keep = max(1, ctx // 2) if seqs.shape[1] >= ctx else min(seqs.shape[1], ctx - 1)
            step = min(remaining, ctx - keep)
            window = seqs[:, -keep:]
            grown = model.generate(window, step, temperature=temperature, top_k=top_k, generator=gen)
            seqs = torch.cat([seqs, grown[:, window.shape[1]:]], dim=1)
            remaining -= step
    finally:
        model.train(was_training)
    return [decode(row.tolist()) for row in seqs]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="attnres sample",
        description="Generate text from a run's checkpoint (KV-cache decoding). Prints the samples, "
        "prompt included, separated by a rule; --json prints a JSON list instead.",
        epilog="example:\n  attnres sample runs/demo/block --prompt 'def ' --max-new-tokens 300 --temperature 0.7",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", help="run directory written by `attnres train`")
    p.add_argument("--prompt", default="", help="text to continue (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate (default: 256)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens; 0 = all (default: 50)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--num-samples", type=int, default=1, help="independent samples (default: 1)")
    p.add_argument("--checkpoint", default=None, help="checkpoint file (default: RUN_DIR/checkpoint.safetensors)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    p.add_argument("--json", action="store_true", help="print a JSON list of strings")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        model, cfg, info = load_run(Path(args.run_dir), checkpoint=args.checkpoint, device=args.device)
        tokenizer = info["record"].get("data", {}).get("tokenizer", BYTE_TOKENIZER)
        if tokenizer != BYTE_TOKENIZER:
            raise ValueError(f"the run uses tokenizer {tokenizer!r}; `attnres sample` decodes byte-level runs only")
        texts = generate_text(
            model, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k or None, seed=args.seed, num_samples=args.num_samples,
        )
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        print(f"attnres sample: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(texts))
    else:
        print(("\n" + "-" * 72 + "\n").join(texts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
