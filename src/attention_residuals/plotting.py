"""Report helpers: loss-curve plots (matplotlib, Agg, no display needed) and markdown tables.

matplotlib is the ``[plots]`` extra (``pip install "attention-residuals[plots]"``): it is imported
when a figure is made, and its absence is a one-line error naming the extra.

Used by ``attnres demo`` and by the experiment reports::

    curves = {"PreNorm": read_metrics("runs/demo/prenorm"), "Block": read_metrics("runs/demo/block")}
    plot_loss_curves(curves, "report_loss.png")
    print(markdown_table(rows, [("name", "run", None), ("final_val_loss", "val loss", "{:.4f}")]))
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .extras import require

__all__ = [
    "ema",
    "format_count",
    "format_duration",
    "markdown_table",
    "matplotlib_module",
    "new_figure",
    "plot_loss_curves",
    "relpath",
]

Formatter = str | Callable[[Any], str] | None


def format_count(n: float | int | None) -> str:
    """``1234567`` -> ``"1.23M"``; ``None`` -> ``"–"``."""
    if n is None:
        return "–"
    n = float(n)
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def format_duration(seconds: float | None) -> str:
    """``333.2`` -> ``"5m 33s"``."""
    if seconds is None or not math.isfinite(seconds):
        return "–"
    s = int(round(seconds))
    if s < 60:
        return f"{seconds:.1f}s"
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h {m:02d}m" if h else f"{m}m {sec:02d}s"


def _fmt(value: Any, fmt: Formatter) -> str:
    if value is None:
        return "–"
    if callable(fmt):
        return fmt(value)
    if isinstance(fmt, str):
        try:
            return fmt.format(value)
        except (ValueError, TypeError):
            return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, Formatter]]) -> str:
    """A GitHub markdown table: one line per row, ``columns`` = ``(key, header, format)``.

    ``format`` is a ``str.format`` pattern, a callable or ``None`` (plain ``str``); missing values
    print as ``–``. Numeric-looking columns are right-aligned. Pipes in cells are escaped.
    """
    cells = [[_fmt(r.get(k), f).replace("|", "\\|") for k, _, f in columns] for r in rows]
    numeric = [
        all(isinstance(r.get(k), int | float) or r.get(k) is None for r in rows)
        and any(r.get(k) is not None for r in rows)
        for k, _, _ in columns
    ]
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|" + "|".join("---:" if num else "---" for num in numeric) + "|"
    body = ["| " + " | ".join(c) + " |" for c in cells]
    return "\n".join([head, rule, *body])


def ema(values: Sequence[float], alpha: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average (as TensorBoard's smoothing)."""
    out, acc, w = [], 0.0, 0.0
    for v in values:
        acc = alpha * acc + (1 - alpha) * v
        w = alpha * w + (1 - alpha)
        out.append(acc / w)
    return out


def relpath(path: str | os.PathLike, start: str | os.PathLike) -> str:
    """``path`` relative to the folder ``start`` (posix separators), for links in a report."""
    return Path(os.path.relpath(Path(path).resolve(), Path(start).resolve())).as_posix()


def matplotlib_module(name: str = "matplotlib"):
    """``matplotlib`` or one of its modules (the ``[plots]`` extra); a clear error naming the extra
    when it is not installed (:class:`..extras.MissingExtraError`)."""
    return require(name, "plots", "plotting")


def new_figure(figsize: tuple[float, float], dpi: int = 120):
    """A matplotlib ``Figure`` on the Agg canvas: no display, no pyplot global state to close."""
    agg = matplotlib_module("matplotlib.backends.backend_agg")
    fig = matplotlib_module("matplotlib.figure").Figure(figsize=figsize, dpi=dpi)
    agg.FigureCanvasAgg(fig)
    return fig


def _loss_points(rows: Sequence[Mapping[str, Any]], x: str, key: str) -> list[tuple[Any, Any]]:
    return [(r[x], r[key]) for r in rows if r.get(key) is not None and r.get(x) is not None]


def _plot_run(axes, label: str, tr: list, va: list, color: str, smooth: float) -> None:
    """One run on both panels: smoothed training loss (faint) and validation loss (markers)."""
    for ax in axes:
        if tr:
            ax.plot(
                [p[0] for p in tr],
                ema([p[1] for p in tr], smooth),
                color=color,
                alpha=0.35,
                lw=1.2,
                label=f"{label} train (EMA)",
            )
        if va:
            ax.plot(
                [p[0] for p in va],
                [p[1] for p in va],
                color=color,
                lw=2,
                marker="o",
                ms=3.5,
                label=f"{label} val",
            )


def _label_axes(axes, zoom_lo: float, zoom_hi: float, xmax: float, x: str, ylabel: str) -> None:
    """Titles, labels, grids and legend; the right panel zoomed on the validation losses' second half."""
    axes[0].set_title("loss")
    axes[1].set_title("second half (val)")
    if math.isfinite(zoom_lo):
        pad = max(0.02, 0.15 * (zoom_hi - zoom_lo))
        axes[1].set_ylim(zoom_lo - pad, zoom_hi + pad)
        axes[1].set_xlim(0.5 * xmax, xmax * 1.01 if xmax else 1)
    for ax in axes:
        ax.set_xlabel(x)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)


def plot_loss_curves(
    curves: Mapping[str, Sequence[Mapping[str, Any]]],
    path: str | os.PathLike,
    *,
    title: str | None = None,
    x: str = "step",
    smooth: float = 0.9,
    ylabel: str = "loss (nats / token)",
) -> Path:
    """Plot validation loss (lines with markers) and smoothed training loss (faint) per run.

    ``curves`` maps a label to metrics rows (``metrics.jsonl``). Two panels: the whole run, and a
    zoom on its second half where the differences between runs live. Writes a PNG; returns its path.
    """
    fig = new_figure((11, 4.2))
    axes = fig.subplots(1, 2)
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f"]
    zoom_lo, zoom_hi = math.inf, -math.inf
    xmax = 0.0
    for i, (label, rows) in enumerate(curves.items()):
        tr, va = _loss_points(rows, x, "train_loss"), _loss_points(rows, x, "val_loss")
        if tr:
            xmax = max(xmax, tr[-1][0])
        if va:
            xmax = max(xmax, va[-1][0])
        _plot_run(axes, label, tr, va, colors[i % len(colors)], smooth)
        half = [v for s, v in va if s >= 0.5 * (va[-1][0] if va else 0)]
        if half:
            zoom_lo, zoom_hi = min(zoom_lo, min(half)), max(zoom_hi, max(half))
    _label_axes(axes, zoom_lo, zoom_hi, xmax, x, ylabel)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
