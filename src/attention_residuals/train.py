"""``attnres train`` and ``torchrun -m attention_residuals.train``: the entry point of
:mod:`attention_residuals.training`, where the config, the run directory and the loop live."""

from __future__ import annotations

import sys

from .training import TrainConfig, load_summary, main, make_config, read_metrics, train

__all__ = ["TrainConfig", "load_summary", "main", "make_config", "read_metrics", "train"]

if __name__ == "__main__":
    sys.exit(main())
