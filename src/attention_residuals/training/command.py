"""``attnres train``: parse the flags, train, print the summary's headline as JSON."""

from __future__ import annotations

import json
import sys

import torch

from ..commands import fail
from ..parallel import data_parallel as _dp
from .args import config_from_args
from .checkpoint import CheckpointError
from .loop import train
from .run import RunError

__all__ = ["main", "out_of_memory"]


def out_of_memory(e: BaseException) -> bool:
    """True for an allocation failure (torch's CPU allocator raises a plain RuntimeError)."""
    return isinstance(e, MemoryError | torch.OutOfMemoryError) or "can't allocate memory" in str(e)


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 (trained), 2 (bad input or a file that cannot be written: one line naming it),
    130 (stopped by Ctrl-C, resumable)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        summary = train(config_from_args(argv))
    except (ValueError, OSError, RunError, CheckpointError) as e:
        return fail("attnres train", e)
    except (MemoryError, RuntimeError) as e:  # a model too big for the machine: say so in one line
        if not out_of_memory(e):
            raise
        return fail("attnres train", f"out of memory building or training the model (smaller sizes?): {e}")
    if not _dp.is_main():
        return 0
    print(
        json.dumps(
            {
                k: summary[k]
                for k in (
                    "run_dir",
                    "done",
                    "step",
                    "final_val_loss",
                    "final_train_loss",
                    "params",
                    "tokens_per_s",
                    "wall_s",
                )
            }
        )
    )
    return 130 if summary.get("interrupted") else 0
