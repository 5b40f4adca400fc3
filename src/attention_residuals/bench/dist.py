"""``attnres bench dist``: pipeline block traffic and prefill block-state memory, measured.

Two sections, JSON to stdout and, for a complete run, ``results/bench/dist.json`` (a ``--quick``
smoke run or a run with ``--skip-*`` writes no file unless ``--out`` names one, so it cannot
replace the committed figures):

``pipeline``  for several (P stages, V virtual stages, block size S) a Block AttnRes model trains
              on P gloo processes with ``parallel.pipelining`` (torch.distributed.pipelining:
              1F1B, interleaved 1F1B for V > 1) in each scheme (naive, cached). Reported per
              scheme, for the second step (the first also runs torch's metadata inference): the
              elements every stage sent forward (its output tensors, which the schedule puts on
              the wire; backward sends the gradient of each, the same bytes), the same as
              ``[*, d]`` tensors per token, the exact count derived for our layout
              (``parallel.pipeline.derived_transfers``), and the report's formula with
              ``N_p = N / C``. Loss and gradients are checked against the single-process model.
              The PreNorm baseline runs on the same runtime and layout beside it (one hidden
              state per hop): its bytes, and each scheme's step time as a ratio to it (the
              slowest rank, best of ``PIPE_TIMED`` steps, measured in the same processes),
              beside the same ratio in one process (what the pipeline adds is their quotient).
``prefill``   T = 8192 tokens, 8 blocks: the peak block-state bytes one rank holds (tracked on
              the live tensors) sharded over tp = 1, 2, 4, 8 ranks (over the hidden dim, and
              over the sequence as the report's text has it), with and without sequence chunks
              of T / 8, beside the closed form and the report's
              example (128K tokens, 8 blocks, d = 7168 bf16: 15 GB -> 1.9 GB over 8 -> < 0.3 GB
              with 16K chunks) computed by the same formula; the chunk ratio 16K / 128K = 1/8 is
              the one used here. Logits are checked against the plain forward.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..model import GPT, GPTConfig
from ..parallel.dist import spawn
from ..parallel.pipeline import PipelineLayout, derived_transfers, report_transfers
from ..parallel.pipelining import PP_SCHEMES, PipelinedGPT
from ..parallel.prefill import block_state_bytes, prefill
from .harness import bench_command

__all__ = ["main", "bench_pipeline", "bench_prefill", "report_prefill_example"]

DEFAULT_OUT = "results/bench/dist.json"

PIPE_MODEL = dict(vocab_size=256, n_layer=8, n_head=2, d_model=64, seq_len=32, residual="block")
# (P, V, S): L = 16 sublayers. S = 2 gives N = 8 blocks; the last two cut chunk boundaries inside blocks
PIPE_CASES = [(2, 1, 2), (2, 2, 2), (2, 4, 2), (4, 1, 2), (4, 2, 2), (4, 2, 4), (2, 2, 3)]
PIPE_QUICK = [(2, 2, 2), (2, 2, 3)]
PIPE_BATCH, PIPE_MICRO = 4, 2
PIPE_TIMED = 5  # timed steps per configuration (the best is kept)

PREFILL_MODEL = dict(
    vocab_size=256, n_layer=4, n_head=4, d_model=256, residual="block", block_size=1
)  # N = 8
REPORT_EXAMPLE = dict(tokens=128 * 1024, blocks=8, d_model=7168, bytes_per_elem=2, tp=8, chunk=16 * 1024)


def _pipe_model(S: int, residual: str = "block"):
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(**{**PIPE_MODEL, "residual": residual}, block_size=S if residual == "block" else None)
    )
    with torch.no_grad():  # trained-looking (non-zero) depth queries, so every path matters
        for p in model.residual.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model


def _pipe_batch():
    g = torch.Generator().manual_seed(1)
    shape = (PIPE_BATCH, PIPE_MODEL["seq_len"])
    return torch.randint(0, 256, shape, generator=g), torch.randint(0, 256, shape, generator=g)


def _pipe_worker(rank: int, world: int, V: int, S: int) -> dict:
    """Block AttnRes in each scheme, then the PreNorm baseline on the same runtime: the bytes sent,
    loss and gradients of one step, and the best of ``PIPE_TIMED`` step times."""
    idx, targets = _pipe_batch()
    out = {}
    for residual, scheme in [("block", s) for s in PP_SCHEMES] + [("prenorm", "cached")]:
        model = _pipe_model(S, residual)
        names = {id(p): n for n, p in model.named_parameters()}
        schedule = "interleaved" if V > 1 else "1f1b"
        pp = PipelinedGPT(
            model, virtual=V, schedule=schedule, scheme=scheme, microbatches=max(PIPE_MICRO, world)
        )
        pp.step(idx, targets)  # the first step also runs torch's metadata inference
        times = []
        for _ in range(PIPE_TIMED):
            for p in pp.parameters():
                p.grad = None
            dist.barrier()
            t0 = time.perf_counter()
            loss = pp.step(idx, targets)
            times.append(time.perf_counter() - t0)
        grads = {names[id(p)]: p.grad.clone() for p in pp.parameters() if p.grad is not None}
        out[scheme if residual == "block" else residual] = dict(
            sent=pp.sent_elements(), loss=float(loss), grads=grads, step_s=times, schedule=schedule
        )
    return out


def _reference(S: int, residual: str) -> tuple[float, dict[str, torch.Tensor], float]:
    """One process: the loss of the batch, every gradient, and the best of ``PIPE_TIMED`` step
    times (forward and backward of the whole batch, after one untimed step)."""
    ref = _pipe_model(S, residual)
    idx, targets = _pipe_batch()
    times = []
    for _ in range(PIPE_TIMED + 1):
        ref.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        _, loss = ref(idx, targets)
        loss.backward()
        times.append(time.perf_counter() - t0)
    return float(loss.detach()), {n: p.grad for n, p in ref.named_parameters()}, min(times[1:])


def _measured(results: list[dict], key: str, ref: tuple[float, dict], tokens: int, d: int) -> dict:
    """One scheme's (or the baseline's) figures over the ranks: bytes, tensors per token, the
    gradient error against one process, and the step time (the slowest rank, best step)."""
    P = len(results)
    fwd = 4 * sum(n for r in range(P) for n in results[r][key]["sent"].values())
    merged: dict[str, torch.Tensor] = {}
    for r in range(P):
        merged.update(results[r][key]["grads"])
    ref_loss, ref_grads, ref_step_s = ref
    return dict(
        bytes_forward=fwd,
        tensors_per_token_measured=fwd / (tokens * d * 4),
        loss=results[0][key]["loss"],
        ref_loss=ref_loss,
        max_grad_abs_diff=max(float((merged[n] - g).abs().max()) for n, g in ref_grads.items()),
        step_s=min(max(results[r][key]["step_s"][i] for r in range(P)) for i in range(PIPE_TIMED)),
        one_process_step_s=ref_step_s,
    )


def bench_pipeline(cases=PIPE_CASES) -> list[dict]:
    rows = []
    d, T = PIPE_MODEL["d_model"], PIPE_MODEL["seq_len"]
    L = 2 * PIPE_MODEL["n_layer"]
    tokens = PIPE_BATCH * T
    for P, V, S in cases:
        results = spawn(_pipe_worker, P, V, S, timeout_s=300)
        layout = PipelineLayout.build(L, S, P, V)
        C = P * V
        n_blocks = -(-L // S)  # N, the last one possibly partial; b_0 comes on top
        report = report_transfers(P, V, n_blocks / C)
        baseline = _measured(results, "prenorm", _reference(S, "prenorm"), tokens, d)
        baseline["tensors_per_token_derived"] = C - 1  # one hidden state per hop
        row = dict(
            P=P,
            V=V,
            C=C,
            L=L,
            S=S,
            N=n_blocks,
            N_p=n_blocks / C,
            aligned=layout.aligned_blocks_per_chunk() is not None,
            chunk_bounds=list(layout.bounds),
            d_model=d,
            tokens_per_step=tokens,
            microbatches=max(PIPE_MICRO, P),
            schedule=results[0][PP_SCHEMES[0]]["schedule"],
            bytes_per_elem=4,
            timed_steps=PIPE_TIMED,
            prenorm=baseline,
            schemes={},
        )
        ref = _reference(S, "block")
        for scheme in PP_SCHEMES:
            m = _measured(results, scheme, ref, tokens, d)
            derived = derived_transfers(layout.bounds, S, P, scheme)
            m.update(
                tensors_per_token_derived=derived,
                matches_derived=m["tensors_per_token_measured"] == derived,
                report_formula=report.get(scheme),
                step_vs_prenorm=m["step_s"] / baseline["step_s"],
                one_process_step_vs_prenorm=m["one_process_step_s"] / baseline["one_process_step_s"],
            )
            row["schemes"][scheme] = m
        rows.append(row)
    return rows


def _prefill_model(seq_len: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**PREFILL_MODEL, seq_len=seq_len)).eval()
    with torch.no_grad():
        for p in model.residual.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model


def _prefill_worker(rank: int, world: int, seq_len: int, chunk: int | None, shard: str = "hidden") -> dict:
    model = _prefill_model(seq_len)
    idx = torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(2))
    t0 = time.perf_counter()
    out = prefill(
        model,
        idx,
        group=dist.group.WORLD if world > 1 else None,
        chunk_size=chunk,
        last_only=True,
        shard=shard,
    )
    return dict(stats=out.stats.to_dict(), logits=out.logits, wall_s=time.perf_counter() - t0)


def report_prefill_example(
    tokens: int, blocks: int, d_model: int, bytes_per_elem: int, tp: int, chunk: int
) -> dict:
    """The report's N T d block-state memory, sharded over ``tp`` and with ``chunk``-token chunks."""
    full = blocks * tokens * d_model * bytes_per_elem
    return dict(full_bytes=full, sharded_bytes=full // tp, sharded_chunked_bytes=full // tp * chunk // tokens)


def _prefill_row(
    tp: int, shard: str, chunk_size: int, res: list[dict], ref: torch.Tensor, N: int, d: int
) -> dict:
    """One configuration's row: per-rank memory and traffic, the logits' error, the wall time."""
    st = [r["stats"] for r in res]
    return dict(
        tp=tp,
        shard=shard,
        chunk_size=chunk_size,
        peak_block_bytes_per_rank=max(s["peak_block_bytes"] for s in st),
        peak_block_tensors=st[0]["peak_block_tensors"],
        formula_block_bytes=st[0]["formula_block_bytes"],
        report_formula_bytes=block_state_bytes(N, 1, chunk_size, d, 4, tp),  # N T d / P (no b_0)
        kv_cache_bytes_per_rank=st[0]["kv_cache_bytes"],
        transient_bytes_per_rank=st[0]["transient_bytes"],
        allreduce_bytes_per_rank=st[0]["allreduce_bytes"],
        allgather_bytes_per_rank=st[0]["allgather_bytes"],
        max_abs_logit_diff=max(float((r["logits"] - ref).abs().max()) for r in res),
        wall_s=max(r["wall_s"] for r in res),
    )


def bench_prefill(seq_len: int = 8192, tps=(1, 2, 4, 8), chunk_div: int = 8) -> dict:
    model = _prefill_model(seq_len)
    idx = torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(idx)[:, -1:]
    d, L = PREFILL_MODEL["d_model"], 2 * PREFILL_MODEL["n_layer"]
    N = L // PREFILL_MODEL["block_size"]
    chunk = seq_len // chunk_div
    runs = []
    plan = [
        (tp, ch, shard)
        for tp in tps
        for shard in (("hidden", "sequence") if tp > 1 else ("none",))
        for ch in (None, chunk)
    ]
    for tp, ch, shard in plan:
        if tp > 1:
            res = spawn(_prefill_worker, tp, seq_len, ch, shard, timeout_s=600)
        else:
            res = [_prefill_worker(0, 1, seq_len, ch)]
        runs.append(_prefill_row(tp, shard, ch or seq_len, res, ref, N, d))
    rep = REPORT_EXAMPLE
    example = report_prefill_example(
        rep["tokens"], rep["blocks"], rep["d_model"], rep["bytes_per_elem"], rep["tp"], rep["chunk"]
    )
    ours = report_prefill_example(seq_len, N, d, 4, rep["tp"], chunk)
    return dict(
        model={**PREFILL_MODEL, "seq_len": seq_len, "n_blocks": N, "dtype": "float32", "batch": 1},
        runs=runs,
        report_example={
            **rep,
            **example,
            "note": "report: 15 GB -> ~1.9 GB over 8 TP devices -> < 0.3 GB with 16K chunks",
        },
        report_formula_at_our_shapes={
            "tokens": seq_len,
            "blocks": N,
            "d_model": d,
            "bytes_per_elem": 4,
            "tp": rep["tp"],
            "chunk": chunk,
            **ours,
        },
        notes=(
            "peak_block_bytes counts b_0 (the embedding) and every block stored until the final readout: "
            "(N + 1) T d / P; the report counts N T d / P. Layers are replicated on every TP rank here, so the "
            "KV cache and the per-layer full-width activations (transient_bytes) are not divided by tp."
        ),
    )


def default_out(args: argparse.Namespace) -> str:
    """Where the JSON goes without ``--out``: the committed file for a complete run, nowhere ('-') for
    a smoke run (``--quick``) or a partial one (``--skip-*``), which would replace it with less."""
    return "-" if args.quick or args.skip_pipeline or args.skip_prefill else DEFAULT_OUT


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="attnres bench dist", description=__doc__.split("\n\n")[0].replace("``", "")
    )
    p.add_argument(
        "--out",
        default=None,
        help=f"JSON file to write; '-' for none (default: {DEFAULT_OUT} for a complete run; none "
        "with --quick or --skip-*, whose JSON goes to stdout only)",
    )
    p.add_argument("--seq-len", type=int, default=8192, help="prefill tokens T (default: 8192)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="two pipeline cases, T = 512, tp in (1, 2): a smoke run, not written to a file by default",
    )
    p.add_argument("--skip-pipeline", action="store_true", help="leave out the pipeline section")
    p.add_argument("--skip-prefill", action="store_true", help="leave out the prefill section")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    out_path = default_out(args) if args.out is None else args.out
    torch.set_num_threads(1)  # every rank is one process on one core
    t0 = time.perf_counter()
    result: dict = dict(
        bench="dist",
        command=bench_command("dist", argv),
        torch=torch.__version__,
        python=platform.python_version(),
        backend="gloo",
        device="cpu",
    )
    if args.quick:
        result["quick"] = True
    if not args.skip_pipeline:
        result["pipeline"] = bench_pipeline(PIPE_QUICK if args.quick else PIPE_CASES)
    if not args.skip_prefill:
        seq = 512 if args.quick else args.seq_len
        result["prefill"] = bench_prefill(seq, (1, 2) if args.quick else (1, 2, 4, 8))
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    text = json.dumps(result, indent=1)
    print(text)
    if out_path != "-":
        out = Path(out_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        print(f"wrote {out}", file=sys.stderr)
    elif args.out is None:
        print(
            f"not written to a file (a {'smoke' if args.quick else 'partial'} run leaves {DEFAULT_OUT} as it "
            "is); pass --out FILE to keep it",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
