"""The ``attnres`` command: a thin dispatcher, each sub-command lives in its own module.

Sub-commands are imported lazily so a missing optional extra (transformers, triton) only matters
for the sub-command that needs it. ``attnres --help`` imports only the modules whose sub-command
lists it shows (``bench``, ``experiment``), so those lists come from their tables and cannot drift.
The dispatch itself (shared with ``attnres bench``) is :mod:`.commands`.
"""

from __future__ import annotations

import sys

from .commands import Help, dispatch, listing

# name -> (module, one-line help: a string, or a function that makes it when the usage is shown).
# Each module exposes ``main(argv: list[str]) -> int``.
COMMANDS: dict[str, tuple[str, Help]] = {
    "train": ("attention_residuals.train", "train a GPT with any residual rule; resumable run directory"),
    "eval": ("attention_residuals.training.evaluate", "validation loss of a run's checkpoint"),
    "sample": (
        "attention_residuals.training.sample",
        "generate text from a run's checkpoint (KV-cache decoding)",
    ),
    "demo": (
        "attention_residuals.experiments.demo",
        "train baseline and Block AttnRes on the default corpus, write a report",
    ),
    "bench": (
        "attention_residuals.bench",
        listing("attention_residuals.bench", "SUBCOMMANDS", "benchmarks ({}); JSON out"),
    ),
    "experiment": (
        "attention_residuals.experiments",
        listing(
            "attention_residuals.experiments", "SUBCOMMANDS", "the report's experiments at small scale ({})"
        ),
    ),
    "export-hf": (
        "attention_residuals.integrations.hf",
        "convert a run directory to a Hugging Face model folder",
    ),
    "tokenizer": ("attention_residuals.training.tokenizer", "train a BPE tokenizer on local text"),
    "data": (
        "attention_residuals.training.datacmd",
        "prepare a corpus (streamed, resumable, verified); info, verify",
    ),
}


def main(argv: list[str] | None = None) -> int:
    return dispatch("attnres", COMMANDS, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
