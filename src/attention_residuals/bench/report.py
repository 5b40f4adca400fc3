"""``attnres bench report``: the benchmark JSONs of a folder as one markdown page with plots.

Every ``*.json`` written by ``attnres bench op|model|memory|peers|dist --json`` in the folder
(``results/bench`` by default) becomes a section of ``README.md`` beside them: its command, the
machine and load it ran under, and its numbers as tables; the op and model ratios also as PNG bar
charts. Nothing is measured here and nothing in the page is typed by hand, so the page can be
regenerated after any benchmark rerun.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..plotting import markdown_table, new_figure
from .model import plot_sweep

__all__ = ["main", "write_report"]


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    """Rows of cells under ``header`` as markdown lines (through :func:`report.markdown_table`)."""
    table = markdown_table([dict(zip(header, row)) for row in rows], [(h, h, None) for h in header])
    return table.split("\n") + [""]


def _f(x: float | None, digits: int = 2) -> str | None:
    return None if x is None else f"{x:.{digits}f}"


def _machine(m: dict) -> str:
    load = f", load average {m['loadavg_start']} → {m.get('loadavg_end')}" if "loadavg_start" in m else ""
    where = m.get("gpu") or f"{m.get('cpu')} × {m.get('cpu_count')} cores, {m.get('torch_threads')} threads"
    alloc = f", allocator: {m['allocator']}" if m.get("allocator") else ""
    return f"{where}; torch {m.get('torch')}, Python {m.get('python')}{load}{alloc}"


def _bars(
    path: Path,
    labels: list[str],
    series: dict[str, list[float | None]],
    targets: dict[str, float],
    xlabel: str,
    title: str,
    xmin: float = 0.0,
) -> None:
    fig = new_figure((7, 0.45 * len(labels) + 1.4))
    ax = fig.subplots()
    height = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        ys = [i + (k - (len(series) - 1) / 2) * height for i in range(len(labels))]
        bars = ax.barh(ys, [(v or xmin) - xmin for v in values], height=height, left=xmin, label=name)
        for bar, v in zip(bars, values):
            if v is not None:
                ax.text(
                    xmin + bar.get_width(),
                    bar.get_y() + bar.get_height() / 2,
                    f" {v:.3f}",
                    va="center",
                    fontsize=7,
                )
    for (name, x), style in zip(targets.items(), ("--", ":")):
        ax.axvline(x, color="grey", linestyle=style, linewidth=1, label=f"{name} {x}")
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _op_table(d: dict, with_error: bool = False) -> list[str]:
    """The op results: best times and ratios, and the paired ratios (median of within-round ratios)."""
    header = ["op", "fwd ms", "fwd ratio", "fwd+bwd ms", "fwd+bwd ratio", "paired fwd", "paired fwd+bwd"]
    rows = [
        [
            r["name"],
            _f(r["fwd"]["best_ms"]),
            _f(r["fwd_ratio"], 3),
            _f(r["fwdbwd"]["best_ms"]),
            _f(r["fwdbwd_ratio"], 3),
            _f(r.get("fwd_ratio_paired"), 3),
            _f(r.get("fwdbwd_ratio_paired"), 3),
        ]
        + ([f"{r['max_abs_err_vs_float64']:.1e}"] if with_error else [])
        for r in d["results"]
    ]
    return _table(header + (["max abs err vs float64"] if with_error else []), rows)


def _op_section(d: dict, stem: str, folder: Path) -> list[str]:
    c, roof = d["config"], d["roofline"]
    lines = [
        f"Shape N = {c['N']}, B = {c['B']}, T = {c['T']}, d = {c['d']}, heads {c['heads']}, {c['dtype']}; best of "
        f"{c['repeats']} interleaved repeats. Roofline: one streaming read of the sources (`sources.sum()`), "
        f"{roof['fwd_ms']:.2f} ms ({roof['bandwidth_GBps']:.1f} GB/s); forward+backward 3× that, "
        f"{roof['fwdbwd_ms']:.2f} ms. Ratio = roofline time / time (1.0 = at the roofline); paired: the median "
        f"over rounds of that ratio within one round (both ran seconds apart, under the same memory speed). Targets, "
        f"as fractions of the roofline: forward ≥ {d['targets']['fwd_ratio']}, forward+backward ≥ "
        f"{d['targets']['fwdbwd_ratio']}.",
        "",
    ]
    lines += _op_table(d, with_error=True)
    if d.get("skipped"):
        lines += ["Not run here:", ""] + [f"- {s['name']}: {s['reason']}" for s in d["skipped"]] + [""]
    png = f"{stem}.png"
    names = [r["name"] for r in d["results"]]
    _bars(
        folder / png,
        names,
        {
            "forward": [r["fwd_ratio"] for r in d["results"]],
            "forward+backward": [r["fwdbwd_ratio"] for r in d["results"]],
        },
        {"fwd target": d["targets"]["fwd_ratio"], "fwd+bwd target": d["targets"]["fwdbwd_ratio"]},
        "roofline time / time (higher is faster)",
        "depth attention vs the memory roofline",
    )
    return lines + [f"![{stem}]({png})", ""]


def _model_section(d: dict, stem: str, folder: Path) -> list[str]:
    c = d["config"]
    lines = [
        f"Model d = {c['d_model']}, {c['sublayers']} sublayers, T = {c['T']}, B = {c['B']}, {c['n_blocks']} blocks, "
        f"{c['dtype']}; best of {c['repeats']} interleaved repeats. Ratio = time / the PreNorm baseline's (best "
        f"over best; paired: the median over rounds of the ratio within one round). "
        f"Targets, from the overheads the AttnRes report gives for Block AttnRes over its baseline (training "
        f"< 4 %, inference < 2 %): training ≤ {d['targets']['train_ratio']}, prefill ≤ {d['targets']['prefill_ratio']}.",
        "",
    ]
    rows = [
        [
            r["kind"],
            r["variant"],
            r.get("schedule") or "—",
            _f(r["best_ms"], 1),
            _f(r["ratio_vs_prenorm"], 3),
            _f(r.get("ratio_vs_prenorm_paired"), 3),
        ]
        for r in d["results"]
    ]
    lines += _table(["step", "variant", "schedule", "best ms", "ratio vs prenorm", "paired ratio"], rows)
    png = f"{stem}.png"
    labels = [
        f"{r['kind']} {r['variant']}" + (f" ({r['schedule']})" if r.get("schedule") else "")
        for r in d["results"]
    ]
    _bars(
        folder / png,
        labels,
        {"time / prenorm": [r["ratio_vs_prenorm"] for r in d["results"]]},
        {"train target": d["targets"]["train_ratio"], "prefill target": d["targets"]["prefill_ratio"]},
        "time / PreNorm (lower is faster)",
        "model step overhead over the PreNorm baseline",
        xmin=0.9,
    )
    return lines + [f"![{stem}]({png})", ""]


def _sweep_section(d: dict, stem: str, folder: Path) -> list[str]:
    """``bench model --widths``: per step, each variant's paired ratio over PreNorm at every width."""
    c = d["config"]
    widths = c["widths"]
    dec = c["decode"]
    lines = [
        f"Width sweep: d = {', '.join(map(str, widths))} (heads: d / 64, at least 4; d / 16 below d 64), {c['sublayers']} sublayers, "
        f"T = {c['T']}, B = {c['B']}, {c['n_blocks']} blocks, {c['dtype']}"
        + (", training step and prefill under torch.compile" if c.get("compile") else ", eager")
        + f"; decode: {dec['tokens']} tokens a call after a {dec['prompt']}-token prompt, batch "
        f"{', '.join(map(str, dec['batches']))}; best of {c['repeats']} interleaved repeats. Cells: time / PreNorm "
        "at that width, paired (the median over rounds of the ratio within one round); targets: training ≤ "
        f"{d['targets']['train_ratio']}, prefill and decode ≤ {d['targets']['prefill_ratio']}.",
        "",
    ]
    cell = {(r["d_model"], r["kind"], r["variant"], r["schedule"]): r for r in d["results"]}
    order = {"train": 0, "prefill": 1, "decode": 2}
    keys = sorted(
        dict.fromkeys(
            (r["kind"], r["variant"], r["schedule"]) for r in d["results"] if r["variant"] != "prenorm"
        ),
        key=lambda k: order.get(k[0], 3),
    )
    rows = [
        [kind, variant, schedule or "—"]
        + [
            _f(cell[(w, kind, variant, schedule)]["ratio_vs_prenorm_paired"], 3)
            if (w, kind, variant, schedule) in cell
            else None
            for w in widths
        ]
        for kind, variant, schedule in keys
    ]
    base = [
        ["PreNorm ms", "", ""]
        + [
            "/".join(
                _f(cell[(w, kind, "prenorm", sched)]["best_ms"], 1)
                for kind, sched in (("train", None), ("prefill", "plain"))
                if (w, kind, "prenorm", sched) in cell
            )
            for w in widths
        ]
    ]
    lines += _table(["step", "variant", "schedule"] + [f"d {w}" for w in widths], rows + base)
    lines += ["PreNorm ms: its training step / prefill, best of the repeats.", ""]
    png = f"{stem}.png"
    plot_sweep(d["results"], folder / png, d["targets"])
    return lines + [f"![{stem}]({png})", ""]


def _memory_section(d: dict, stem: str, folder: Path) -> list[str]:
    c = d["config"]
    lines = [
        f"Model d = {c['d_model']}, {c['sublayers']} sublayers, T = {c['T']}, B = {c['B']}: bytes autograd "
        "saves for one training step (and the CUDA peak on a GPU).",
        "",
    ]
    lines += _table(
        ["variant", "saved for backward MiB", "ratio vs prenorm", "CUDA peak MiB"],
        [
            [
                r["variant"],
                _f(r["saved_activation_MiB"], 1),
                _f(r["ratio_vs_prenorm"], 3),
                _f(r["cuda_peak_MiB"], 1),
            ]
            for r in d["activation_memory"]
        ],
    )
    for key, what in (("io_this_model", "this model"), ("io_report_typical", "the report's typical setting")):
        io = d[key]
        lines += [
            f"Per-layer I/O in units of d, {what} (L = {io['L']}, N = {io['N']}, S = {io['S']}, m = {io['m']}):",
            "",
        ]
        lines += _table(
            ["schedule", "reads", "writes", "total", "note"],
            [
                [name, _f(r["reads"]), _f(r["writes"]), _f(r["total"]), r.get("note")]
                for name, r in io["per_layer_d"].items()
            ],
        )
    return lines


def _peers_section(d: dict, stem: str, folder: Path) -> list[str]:
    mc = d["model_config"]
    lines = [
        "The depth-attention op as in `bench op` (the peers that import), then training steps "
        f"(d = {mc['d_model']}, {mc['sublayers']} sublayers, T = {mc['T']}, B = {mc['B']}).",
        "",
    ]
    op = d["op"]
    lines += _op_table(op)
    rows = []
    for s in d["steps"]:
        if s["kind"] == "train_overhead":
            paired = _f(s.get("block_over_prenorm_paired"), 3)
            rows.append(
                [
                    "training step Block / PreNorm",
                    s["name"],
                    _f(s["block_over_prenorm"], 3) + (f" (paired {paired})" if paired else ""),
                ]
            )
        else:
            rows.append([s["kind"], s["name"], _f(s["best_ms"], 1) + " ms"])
    lines += _table(["figure", "who", "value"], rows)
    skipped = d.get("skipped", []) + op.get("skipped", [])
    if skipped:
        lines += ["Not run here:", ""] + [f"- {s['name']}: {s['reason']}" for s in skipped]
    return lines + [""]


def _pipeline_lines(pipeline: list[dict]) -> list[str]:
    rows = []
    for p in pipeline:
        runs = list(p["schemes"].items()) + ([("PreNorm", p["prenorm"])] if "prenorm" in p else [])
        for name, s in runs:
            ratio = s.get("step_vs_prenorm", 1.0 if name == "PreNorm" else None)
            one = s.get("one_process_step_vs_prenorm", 1.0 if name == "PreNorm" else None)
            rows.append(
                [
                    p["P"],
                    p["V"],
                    p["L"],
                    p["S"] if name != "PreNorm" else "—",
                    p.get("schedule", "—"),
                    name,
                    s["bytes_forward"],
                    s["tensors_per_token_measured"],
                    s["tensors_per_token_derived"],
                    s.get("report_formula", "—") if name != "PreNorm" else "—",
                    f"{s['max_grad_abs_diff']:.1e}",
                    _f(ratio, 2) if ratio is not None else "—",
                    _f(one, 2) if one is not None else "—",
                ]
            )
    return _table(
        [
            "P",
            "V",
            "L",
            "S",
            "schedule",
            "scheme",
            "bytes fwd",
            "tensors/token measured",
            "derived",
            "report formula",
            "max grad diff vs 1 process",
            "step / PreNorm",
            "same, 1 process",
        ],
        rows,
    )


def _prefill_lines(prefill: dict) -> list[str]:
    pm = prefill["model"]
    return [
        f"Prefill of T = {pm['seq_len']} tokens (d = {pm['d_model']}, {pm['n_blocks']} blocks): block-state "
        "memory per rank by tensor-parallel degree, sharding and chunk size.",
        "",
    ] + _table(
        ["ranks", "shard", "chunk", "block states MiB / rank", "formula MiB", "max logit diff"],
        [
            [
                r["tp"],
                r["shard"],
                r["chunk_size"],
                _f(r["peak_block_bytes_per_rank"] / 2**20, 2),
                _f(r["formula_block_bytes"] / 2**20, 2),
                f"{r['max_abs_logit_diff']:.1e}",
            ]
            for r in prefill["runs"]
        ],
    )


def _dist_section(d: dict, stem: str, folder: Path) -> list[str]:
    missing = [
        k for k in ("pipeline", "prefill") if k not in d
    ]  # a run with --skip-pipeline / --skip-prefill
    head = f"torch.distributed ({d['backend']}, {d['device']})" + (
        ", a --quick smoke run" if d.get("quick") else ""
    )
    lines = [head + (f"; not run: {', '.join(missing)}." if missing else "."), ""]
    if "pipeline" in d:
        lines[0] += (
            " Pipeline: one training step of `PipelinedGPT` on torch.distributed.pipelining (the"
            " schedule named per row); bytes each stage sends forward, counted on the send path, beside"
            " our derived count and the report's formula (tensors per token); gradients against one"
            " process; the PreNorm baseline on the same runtime and layout, and each scheme's step"
            " time as a ratio to it (slowest rank, best of the timed steps, same processes) beside the same"
            " ratio in one process."
        )
        lines += _pipeline_lines(d["pipeline"])
        p = d["pipeline"][0]
        if "prenorm" in p:
            lines += [
                f"Step times come from a toy model (d = {p['d_model']}, L = {p['L']}, "
                f"{p['tokens_per_step']} tokens per step) whose sublayers are so small that depth "
                "attention's fixed per-sublayer cost dominates (the one-process column), with up to 4 "
                "ranks sharing this machine's cores: they check that the baseline runs on the same "
                "runtime, not the report's < 4 % overhead at d = 7168 on GPUs, which these numbers "
                "cannot test. The bytes are exact.",
                "",
            ]
    if "prefill" in d:
        lines += _prefill_lines(d["prefill"])
    return lines


SECTIONS = {
    "op": _op_section,
    "model": _model_section,
    "model_sweep": _sweep_section,
    "memory": _memory_section,
    "peers": _peers_section,
    "dist": _dist_section,
}


def write_report(folder: str | Path = "results/bench") -> Path:
    """Write ``<folder>/README.md`` (and its PNGs) from the benchmark JSONs in ``folder``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"folder: no such directory: {folder}")
    found = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
        if isinstance(data, dict) and data.get("bench") in SECTIONS:
            found.append((list(SECTIONS).index(data["bench"]), path, data))
    if not found:
        raise FileNotFoundError(f"folder: no `attnres bench ... --json` output in {folder}")
    lines = [
        "# Benchmarks",
        "",
        "Generated by `attnres bench report` from the JSON files beside it; nothing here is typed by hand. "
        "Each section names the command that produced it and the machine it ran on.",
        "",
    ]
    for _, path, data in sorted(found, key=lambda f: (f[0], f[1].name)):
        lines += [
            f"## {path.stem}",
            "",
            f"Command: `{data.get('command', 'attnres bench ' + data['bench'])}`"
            + (f" — {_machine(data['machine'])}" if "machine" in data else ""),
            "",
        ]
        lines += SECTIONS[data["bench"]](data, path.stem, folder)
    out = folder / "README.md"
    out.write_text("\n".join(lines).rstrip() + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnres bench report", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "folder", nargs="?", default="results/bench", help="folder of the JSONs (default results/bench)"
    )
    args = parser.parse_args(argv)
    try:
        print(write_report(args.folder))
    except (FileNotFoundError, ValueError) as exc:
        print(f"attnres bench report: {exc}", file=sys.stderr)
        return 2
    return 0
