"""``attnres sample RUN_DIR``: generate text from a run's checkpoint with KV-cache decoding.

Byte-level runs decode their samples as UTF-8 (a character cut at the end is replaced). A run
trained with ``attnres train --tokenizer DIR`` (BPE) records that folder in its ``config.json``
and its tokenizer's content id; the samples are encoded and decoded with it (the ``hf`` extra),
after checking that the folder still holds the very tokenizer the run was trained with
(``--tokenizer DIR`` points elsewhere when the folder moved). When more tokens are asked for
than the context holds, generation slides: the last half-context of tokens is kept as the
prompt for the next stretch.

Under ``torchrun --nproc-per-node N`` (rank 0 prints):

* ``--tp N``: tensor parallelism (``parallel.tp``, the report's section 4.2): each rank holds
  ``1/N`` of every sublayer's weights (attention heads, MLP width) and of the KV cache (its
  heads), and the depth state (block states) of ``1/N`` of the tokens; any rule.
* ``--cp N``: context parallelism (``parallel.generate``): every rank holds the whole model; the
  KV cache is sharded by token, and Block AttnRes takes the sequence-sharded block-state prefill.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from ..commands import Parser, fail
from ..model import GPT, check_sampling
from ..parallel import DistributedError, check_consistent, destroy_distributed, init_distributed
from ..parallel.generate import sharded_generate
from ..parallel.prefill import applies as prefill_applies
from ..parallel.tp import TensorParallelGPT, tensor_parallel_generate
from ..typed import check_number
from . import tokenizer as tok
from .checkpoint import CheckpointError
from .data import BYTE_TOKENIZER, byte_decode, byte_encode
from .evaluate import add_trust_flag, load_run
from .loop import autocast, resolve_dtype

__all__ = ["generate_text", "run_codec", "main"]


@torch.no_grad()
def generate_text(
    model: GPT | TensorParallelGPT,
    prompt: str = "",
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
    num_samples: int = 1,
    encode: Callable[[str], list[int]] = byte_encode,
    decode: Callable[[list[int]], str] = byte_decode,
    group=None,
    chunk_size: int | None = None,
) -> list[str]:
    """``num_samples`` continuations of ``prompt`` (the prompt included), as strings.

    ``temperature=0`` is greedy. The same seed gives the same samples. An empty prompt starts
    from a newline. A :class:`~attention_residuals.parallel.tp.TensorParallelGPT` generates over
    its ranks; ``group`` (with a :class:`GPT`): over that group's ranks with the KV cache sharded
    by token (:func:`~attention_residuals.parallel.generate.sharded_generate`). Either way every
    rank calls this alike and gets the same texts; ``chunk_size``: prefill tokens per chunk.
    """
    check_number("max_new_tokens", max_new_tokens, integer=True, ge=0)
    check_sampling(temperature, top_k)
    check_number("num_samples", num_samples, integer=True, ge=1)
    check_number("seed", seed, integer=True, ge=0, lt=2**63)
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
            if isinstance(model, TensorParallelGPT):
                grown, _ = tensor_parallel_generate(
                    model,
                    window,
                    step,
                    temperature=temperature,
                    top_k=top_k,
                    generator=gen,
                    chunk_size=chunk_size,
                )
            elif group is None:
                grown = model.generate(window, step, temperature=temperature, top_k=top_k, generator=gen)
            else:
                grown, _ = sharded_generate(
                    model,
                    window,
                    step,
                    temperature=temperature,
                    top_k=top_k,
                    generator=gen,
                    group=group,
                    chunk_size=chunk_size,
                )
            seqs = torch.cat([seqs, grown[:, window.shape[1] :]], dim=1)
            remaining -= step
    finally:
        model.train(was_training)
    return [decode(row.tolist()) for row in seqs]


def run_codec(
    record: dict, tokenizer: str | Path | None = None, *, trust_remote_code: bool = False
) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str]]:
    """``(encode, decode)`` of a run from its ``config.json`` record: bytes, or the BPE tokenizer
    of ``attnres train --tokenizer DIR`` (that folder, or ``tokenizer`` when given), checked
    against the content id the run recorded and loaded without running code from the folder
    unless ``trust_remote_code``. Raises ``ValueError`` / ``FileNotFoundError`` with what to do
    when the tokenizer cannot be found, is not the run's, or asks to run code."""
    used = (record.get("data") or {}).get("tokenizer", BYTE_TOKENIZER)
    if tokenizer is None and used == BYTE_TOKENIZER:
        return byte_encode, byte_decode
    hint = "pass --tokenizer DIR, the folder given to `attnres train --tokenizer` (it holds tokenizer.json)"
    if used == BYTE_TOKENIZER:
        raise ValueError(
            f"--tokenizer {tokenizer}: the run was trained on bytes, not with a tokenizer; "
            "leave --tokenizer out"
        )
    path = Path(tokenizer) if tokenizer is not None else tok.tokenizer_path_of(record)
    if path is None:
        raise ValueError(
            f"the run was trained with tokenizer {used!r} but its config.json records no "
            f"tokenizer folder; {hint}"
        )
    if not (path / tok.TOKENIZER_FILE).is_file():
        where = "--tokenizer" if tokenizer is not None else "the run's tokenizer folder"
        raise FileNotFoundError(
            f"{where} {str(path)!r}: no {tok.TOKENIZER_FILE} there"
            + ("" if tokenizer is not None else f" (moved or deleted?); {hint}")
        )
    found = tok.tokenizer_id(path)
    if found != used:
        raise ValueError(
            f"tokenizer {str(path)!r} is {found!r}, not the {used!r} the run was trained with; {hint}"
        )
    try:
        hook = tok.load_encoder(path, trust_remote_code=trust_remote_code)
    except ImportError as exc:
        raise ValueError(
            f"decoding a BPE run needs the hf extra (pip install 'attention-residuals[hf]'): {exc}"
        ) from exc
    return hook.encode, hook.decode


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="attnres sample",
        description="Generate text from a run's checkpoint (KV-cache decoding). Prints the samples, "
        "prompt included, separated by a rule; --json prints a JSON list instead. Byte-level runs and runs "
        "trained with `attnres train --tokenizer DIR` (BPE, decoded with that tokenizer) both work.",
        epilog="example:\n  attnres sample runs/demo/block --prompt 'def ' --max-new-tokens 300 --temperature 0.7",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", help="run directory written by `attnres train`")
    p.add_argument("--prompt", default="", help="text to continue (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate (default: 256)")
    p.add_argument(
        "--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (default: 0.8)"
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=50,
        help="sample among the k most likely tokens, k >= 0; 0 = all tokens (default: 50)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--num-samples", type=int, default=1, help="independent samples (default: 1)")
    p.add_argument(
        "--checkpoint", default=None, help="checkpoint file (default: RUN_DIR/checkpoint.safetensors)"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder of a BPE run, when the one it records has moved (default: the folder "
        "the run was trained with; none for byte-level runs)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda, cuda:N or auto (default: auto; with --tp/--cp: cuda:LOCAL_RANK under NCCL, else cpu)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks, under torchrun --nproc-per-node TP: layer weights and KV cache split "
        "by head, depth state (block states) by token (default: 1)",
    )
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel ranks, under torchrun --nproc-per-node CP: whole model on every rank, KV "
        "cache split by token, sequence-sharded block-state prefill for Block AttnRes (default: 1)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="with --tp or --cp: prefill tokens per chunk (with --cp a multiple of CP; default: the whole prompt)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list of strings")
    add_trust_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag, value, low, note in (
        ("--max-new-tokens", args.max_new_tokens, 0, ""),
        ("--temperature", args.temperature, 0, " (finite; 0 = greedy)"),
        ("--top-k", args.top_k, 0, " (0 = all tokens)"),
        ("--num-samples", args.num_samples, 1, ""),
        ("--seed", args.seed, 0, ""),
        ("--tp", args.tp, 1, ""),
        ("--cp", args.cp, 1, ""),
        ("--prefill-chunk", args.prefill_chunk if args.prefill_chunk is not None else args.cp, args.cp, ""),
    ):
        if not (math.isfinite(value) and value >= low):
            parser.error(f"{flag}: expected >= {low}{note}, got {value}")
    if args.tp > 1 and args.cp > 1:
        parser.error(f"--tp {args.tp} and --cp {args.cp}: one kind of parallelism at a time")
    if args.prefill_chunk is not None and args.prefill_chunk % args.cp:
        parser.error(f"--prefill-chunk: expected a multiple of --cp {args.cp}, got {args.prefill_chunk}")
    ranks = max(args.tp, args.cp)
    try:
        texts = _sample(args, ranks)
    except (ValueError, OSError, CheckpointError, DistributedError) as e:
        return fail("attnres sample", e)
    finally:
        if ranks > 1:
            destroy_distributed()
    if texts is None:  # not rank 0
        return 0
    if args.json:
        print(json.dumps(texts))
    else:
        print(("\n" + "-" * 72 + "\n").join(texts))
    return 0


def _sample(args: argparse.Namespace, ranks: int) -> list[str] | None:
    """Load the run, generate, and return the texts (``None`` on ranks other than 0)."""
    group, device, env = None, args.device, None
    if ranks > 1:
        env = init_distributed(expected_world_size=ranks)
        group = dist.group.WORLD
        device = str(env.device()) if args.device == "auto" else args.device
        check_consistent(
            {k: getattr(args, k) for k in ("run_dir", "prompt", "seed", "max_new_tokens")}, "sample"
        )
    model, cfg, info = load_run(Path(args.run_dir), checkpoint=args.checkpoint, device=device)
    encode, decode = run_codec(info["record"], args.tokenizer, trust_remote_code=args.trust_remote_code)
    device = next(model.parameters()).device
    dtype = resolve_dtype(cfg.dtype, device)  # the precision the run trained in
    if env is None or env.is_main:
        print(f"attnres sample: {_schedule_line(model, args.tp, args.cp)}, {dtype}", file=sys.stderr)
    if args.tp > 1:
        model, group = TensorParallelGPT(model, group), None  # the full sublayer weights are freed
    with autocast(device, dtype):
        texts = generate_text(
            model,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k or None,
            seed=args.seed,
            num_samples=args.num_samples,
            encode=encode,
            decode=decode,
            group=group,
            chunk_size=args.prefill_chunk,
        )
    return texts if env is None or env.is_main else None


def _schedule_line(model: GPT, tp: int, cp: int) -> str:
    """Which exact schedule runs, for the log."""
    if tp > 1:
        return (
            f"tensor-parallel over {tp} ranks (layer weights and KV cache split by head, depth state by "
            f"token), {model.inference_schedule()} depth mixing"
        )
    if cp == 1:
        return f"{model.inference_schedule()} prefill, KV-cache decode"
    prefill = "sequence-sharded block-state prefill" if prefill_applies(model) else "replicated prefill"
    return f"context-parallel over {cp} ranks: {prefill}, KV cache sharded by token"


if __name__ == "__main__":
    sys.exit(main())
