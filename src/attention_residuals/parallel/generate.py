"""Generation over ``P`` ranks: sharded prefill, then decoding with the KV cache sharded by token.

``attnres sample --cp P`` under ``torchrun`` (context parallelism). Every rank holds the whole model and runs the
same loop; what is split is the memory that grows with the context:

* **prefill**: Block AttnRes with static softmax queries takes the report's sequence-sharded
  prefill (:func:`.prefill.prefill`, ``shard="sequence"``): each rank keeps the block states and
  the keys/values of ``1/P`` of the prompt's tokens. Other rules prefill every token on every
  rank and keep ``1/P`` of the keys/values. The ``T mod P`` tokens left over by an uneven split
  go through the second path.
* **decode**: one token at a time through ``GPT.forward_hidden`` with the
  :class:`~.kv.ShardedKVCache` (the token at position ``p`` is stored on rank ``p mod P``); the
  depth attention is per token, so it needs no communication; attention merges the per-rank
  softmaxes. Rank 0's sampled token is broadcast, so every rank continues the same sequence.

Exact: the ids equal ``GPT.generate`` (to float rounding of the logits; tested greedy).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..model import GPT, check_sampling, sample_token
from ..typed import check_number
from .dist import guarded
from .kv import ShardedKVCache
from .prefill import applies as prefill_applies
from .prefill import prefill

__all__ = ["sharded_generate"]


@torch.no_grad()
def sharded_generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    group=None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, ShardedKVCache]:
    """``GPT.generate`` with the context's memory split over the ranks of ``group``.

    ``idx`` ``[B, T]`` (the same on every rank) -> ``(ids [B, T + max_new_tokens], cache)``;
    ``cache`` holds this rank's keys and values (``cache.nbytes()``, ``cache.sent_bytes``).
    ``chunk_size``: prefill tokens per chunk, a multiple of the number of ranks.
    """
    check_number("max_new_tokens", max_new_tokens, integer=True, ge=0)
    check_sampling(temperature, top_k)
    world = dist.get_world_size(group) if group is not None else 1
    check_number("chunk_size", chunk_size, integer=True, optional=True, ge=1)
    if chunk_size is not None and chunk_size % world:
        raise ValueError(f"chunk_size: expected a multiple of the {world} ranks, got {chunk_size}")
    if idx.ndim != 2 or idx.shape[1] < 1:
        raise ValueError(f"idx: expected token ids of shape [B, T] with T >= 1, got {tuple(idx.shape)}")
    T = idx.shape[1]
    if T + max_new_tokens > model.config.seq_len:
        raise ValueError(
            f"max_new_tokens: prompt ({T}) + {max_new_tokens} new tokens exceed seq_len={model.config.seq_len}"
        )
    was_training = model.training
    model.eval()
    try:
        logits, cache = _prefill(model, idx, T + max_new_tokens, group, chunk_size)
        src = dist.get_global_rank(group, 0) if group is not None else 0
        for i in range(max_new_tokens):
            nxt = sample_token(logits, temperature, top_k, generator)
            if group is not None:
                with guarded("sharded generation broadcast of the sampled token"):
                    dist.broadcast(nxt, src=src, group=group)
            idx = torch.cat([idx, nxt], dim=1)
            if i + 1 < max_new_tokens:
                logits = model.lm_head(model.forward_hidden(nxt, cache)[:, -1])
    finally:
        model.train(was_training)
    return idx, cache


def _prefill(
    model: GPT, idx: torch.Tensor, max_len: int, group, chunk_size
) -> tuple[torch.Tensor, ShardedKVCache]:
    """The last position's logits ``[B, vocab]`` and the filled sharded cache."""
    world = dist.get_world_size(group) if group is not None else 1
    T = idx.shape[1]
    even = T - T % world if prefill_applies(model) else 0
    if even:
        out = prefill(
            model, idx[:, :even], group=group, chunk_size=chunk_size, max_len=max_len, last_only=True
        )
        cache = out.cache
        if even == T:
            return out.logits[:, -1], cache
    else:
        cache = ShardedKVCache.for_model(model, idx.shape[0], max_len, group)
    hidden = model.forward_hidden(idx[:, even:], cache)
    return model.lm_head(hidden[:, -1]), cache
