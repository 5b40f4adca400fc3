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


def dispatch(prog: str, commands: dict[str, tuple[str, str]], argv: list[str], epilog: str = "") -> int:
    """Run ``prog <name> [options]``: ``commands`` maps name -> (target, one-line help), the target
    ``"module"`` (its ``main``) or ``"module:function"``, imported only when chosen; the function
    takes the remaining argv and returns an exit code."""
    width = max(map(len, commands)) + 2
    usage = "\n".join(
        [f"usage: {prog} <command> [options]", "", "commands:"]
        + [f"  {name:<{width}}{help_}" for name, (_, help_) in commands.items()]
        + ["", f"Run `{prog} <command> --help` for the options of one command.{' ' + epilog if epilog else ''}"]
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in commands:
        print(f"{prog}: unknown command {name!r}\n\n{usage}", file=sys.stderr)
        return 2
    module_name, _, func_name = commands[name][0].partition(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name or "main")
    except (ImportError, AttributeError) as exc:
        print(f"{prog} {name}: not available ({commands[name][0]}: {exc})", file=sys.stderr)
        return 2
    return int(func(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    return dispatch("attnres", COMMANDS, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
