"""``attnres bench``: timings side by side in one run, JSON to stdout (and ``--json PATH``), a table on stderr.

Sub-commands (the table :data:`SUBCOMMANDS`; add one by adding a line), one module each::

    attnres bench op       depth attention vs the memory roofline, torch.compile, the peers (.op)
    attnres bench model    training step and prefill of Block / Full AttnRes over the PreNorm baseline (.model)
    attnres bench memory   activation memory of a training step per rule; per-layer I/O, report's table 1 (.memory)
    attnres bench peers    the PyPI packages' ops and steps beside ours, skipped with the reason (.peers)
    attnres bench dist     distributed figures (.dist)
    attnres bench data     the data pipeline's tokens/s and peak memory at two corpus sizes (.data)
    attnres bench report   the JSONs of a folder as README.md with plots (.report)

Shared by them: the timing harness, machine description and output (:mod:`.harness`) and the
PyPI peers behind our call signatures (:mod:`.adapters`). The method: every case is warmed up, then
the repeats are interleaved (one of each case per round, the round order rotated) and the best of
the repeats is reported beside the median and the paired ratio (see :mod:`.harness`, :mod:`.op`).
"""

from __future__ import annotations

import sys

from ..commands import dispatch
from .memory import bench_memory
from .model import bench_model
from .op import bench_op
from .peers import bench_peers

__all__ = ["main", "SUBCOMMANDS", "bench_op", "bench_model", "bench_memory", "bench_peers"]

# name -> ("module:function", help). The function takes argv (list[str]) and returns an exit code.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "op": (
        "attention_residuals.bench.op:bench_op",
        "depth attention vs the memory roofline, torch.compile, peers",
    ),
    "model": (
        "attention_residuals.bench.model:bench_model",
        "train step / prefill of Block and Full AttnRes vs PreNorm",
    ),
    "memory": (
        "attention_residuals.bench.memory:bench_memory",
        "activation memory per rule; per-layer I/O in units of d",
    ),
    "peers": (
        "attention_residuals.bench.peers:bench_peers",
        "PyPI peers' ops and training steps beside ours",
    ),
    "dist": ("attention_residuals.bench.dist:main", "distributed (pipeline / sharded prefill) figures"),
    "data": (
        "attention_residuals.bench.data:bench_data",
        "data pipeline: tokens/s and peak RSS at two corpus sizes",
    ),
    "report": ("attention_residuals.bench.report:main", "the JSONs of a folder as README.md with plots"),
}


def main(argv: list[str] | None = None) -> int:
    return dispatch(
        "attnres bench",
        SUBCOMMANDS,
        list(sys.argv[1:] if argv is None else argv),
        "JSON goes to stdout, the table to stderr.",
    )
