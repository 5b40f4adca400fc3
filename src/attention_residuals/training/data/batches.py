"""Deterministic batches: a pure function of ``(seed, step, rank, world_size)``.

Resuming at step ``s`` sees exactly the batches an uninterrupted run would, and a data-parallel
rank reads its own slice of the global batch (the union over ranks is the same whatever the world
size). Validation windows use a fixed seed: the same for every run, so validation losses compare.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["EVAL_SEED", "TRAIN_STREAM", "VAL_STREAM", "eval_batches", "get_batch", "split_windows"]

TRAIN_STREAM, VAL_STREAM = 0, 1
EVAL_SEED = 0  # validation windows are the same for every run, whatever its training seed


def get_batch(
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    *,
    seed: int,
    step: int,
    rank: int = 0,
    world_size: int = 1,
    stream: int = TRAIN_STREAM,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, each ``[batch_size, seq_len]`` int64.

    The global batch of ``batch_size * world_size`` windows is drawn from a generator seeded by
    ``(seed, step, stream)`` alone; ``rank`` takes rows ``[rank * batch_size, (rank + 1) * batch_size)``.
    So a batch is the same on resume, and the data-parallel union is independent of ``world_size``.
    """
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if min(seed, step, stream) < 0:
        raise ValueError(f"seed, step and stream must be non-negative, got {seed}, {step}, {stream}")
    n = len(tokens)
    if n < seq_len + 1:
        raise ValueError(f"{n} tokens are fewer than seq_len + 1 = {seq_len + 1}")
    rng = np.random.default_rng([seed, step, stream])
    starts = rng.integers(0, n - seq_len, size=batch_size * world_size)[
        rank * batch_size : (rank + 1) * batch_size
    ]
    window = starts[:, None] + np.arange(seq_len + 1)[None, :]
    chunk = torch.from_numpy(np.asarray(tokens[window], dtype=np.int64))
    x, y = chunk[:, :-1], chunk[:, 1:]
    if device is not None and torch.device(device).type != "cpu":
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return x.contiguous(), y.contiguous()


def eval_batches(
    tokens: np.ndarray,
    n_batches: int,
    batch_size: int,
    seq_len: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation windows: the same for every run and seed, so val losses compare."""
    for i in range(n_batches):
        yield get_batch(
            tokens,
            batch_size,
            seq_len,
            seed=EVAL_SEED,
            step=i,
            rank=rank,
            world_size=world_size,
            stream=VAL_STREAM,
            device=device,
        )


def split_windows(
    tokens: np.ndarray, batch_size: int, seq_len: int, *, device: torch.device | str | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The whole split in order as non-overlapping windows (window ``i`` predicts tokens
    ``i * seq_len + 1 .. (i + 1) * seq_len``), ``batch_size`` windows a batch, the last batch
    shorter: every token but the first and the final ``< seq_len`` remainder is scored once."""
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        raise ValueError(f"{len(tokens)} tokens are fewer than seq_len + 1 = {seq_len + 1}")
    for lo in range(0, n, batch_size):
        starts = np.arange(lo, min(n, lo + batch_size)) * seq_len
        chunk = torch.from_numpy(np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64))
        x, y = chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
        if device is not None and torch.device(device).type != "cpu":
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        yield x, y
