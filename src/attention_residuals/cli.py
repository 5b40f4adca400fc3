"""The ``attnres`` command: a thin dispatcher, each sub-command lives in its own module.

Sub-commands are imported lazily so ``attnres --help`` is instant and a missing optional extra
(transformers, triton) only matters for the sub-command that needs it.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, one-line help). Each module exposes ``main(argv: list[str]) -> int``.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("attention_residuals.train", "train a GPT with any residual rule; resumable run directory"),
    "eval": ("attention_residuals.evaluate", "validation loss of a run's checkpoint"),
    "sample": ("attention_residuals.sample", "generate text from a run's checkpoint (KV-cache decoding)"),
    "demo": ("attention_residuals.demo", "train baseline and Block AttnRes on the default corpus, write a report"),
    "bench": ("attention_residuals.bench", "benchmarks (op, model, memory, peers, dist); JSON out"),
    "experiment": ("attention_residuals.experiments", "scaling, ablation, blocksize, analysis, report"),
    "export-hf": ("attention_residuals.hf", "convert a run directory to a Hugging Face model folder"),
    "tokenizer": ("attention_residuals.tokenizer", "train a BPE tokenizer on local text"),
}


def _usage() -> str:
    lines = ["usage: attnres <command> [options]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `attnres <command> --help` for the options of one command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"attnres: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
