"""Tensor-parallel inference: Megatron-style sharded layers with the depth state sharded by token.

The report's section 4.2 layout, over the ``P`` ranks of a process group, for every
depth-mixing rule:

* **layer weights** (Megatron column/row parallel): attention sublayer ``l`` keeps the query,
  key and value rows of heads ``[r H/P, (r+1) H/P)`` and the matching columns of its output
  projection; an MLP keeps rows ``[r h/P, (r+1) h/P)`` of its gate and up projections and those
  columns of its down projection. Each rank's ``f_l`` then yields a partial sum of the full
  output. Embedding, RMSNorms, depth-mixing parameters and the LM head are replicated.
* **KV cache**: the local heads only (``1/P`` of it, :class:`~..model.KVCache` of ``H/P`` heads).
* **depth state** (Block: ``b_0 .. b_n`` and the partial sum; Full: every ``v_i``): sharded over
  the tokens of each chunk, rank ``r`` holding tokens ``[r T/P, (r+1) T/P)``. Depth mixing is per
  token, so the rule runs on those tokens unchanged, with its fastest exact schedule (two-phase
  kernels where it has them): ``N T d / P`` elements of block states per rank.
* per sublayer (the report's "reduce-scatter, merge locally, all-gather"): the local tokens'
  ``RMSNorm_l(h_l)`` is all-gathered over the sequence, ``f_l``'s partial sums are
  reduce-scattered back to the local tokens, and the rule merges that ``v_l`` into its state on
  each rank alone.

A chunk whose tokens do not split over the ranks (decode's single token, an uneven prompt)
keeps the depth state on every rank and all-reduces the partial sums instead. Exact: logits
equal the one-process model to float rounding (the partial sums are added in another order).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ..model import GPT, CausalSelfAttention, KVCache, SwiGLU, check_sampling, sample_token
from ..typed import check_number
from .dist import guarded

__all__ = ["TPStats", "TensorParallelGPT", "tensor_parallel_generate"]


@dataclass
class TPStats:
    """What one rank holds and sends (bytes)."""

    tp: int
    rank: int
    layer_weight_bytes: int = 0  # this rank's shard of the sublayers' weights
    kv_cache_bytes: int = 0  # this rank's heads of the KV cache
    peak_state_bytes: int = 0  # the depth state of this rank's tokens, at its largest
    allgather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    allreduce_bytes: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _rows(weight: torch.Tensor, groups: int, rank: int, world: int) -> torch.Tensor:
    """Rows of shard ``rank`` in each of the ``groups`` stacked blocks of ``weight`` [out, in]
    (fused q|k|v: 3 blocks; gate|up: 2), kept block by block so the fused layout survives."""
    return weight.view(groups, world, -1, weight.shape[1])[:, rank].reshape(-1, weight.shape[1]).clone()


def _columns(weight: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return weight.view(weight.shape[0], world, -1)[:, rank].clone()


def _set_weight(linear: nn.Linear, weight: torch.Tensor) -> None:
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.out_features, linear.in_features = weight.shape


def _shard_layer(layer: nn.Module, rank: int, world: int) -> nn.Module:
    """A copy of sublayer ``layer`` holding shard ``rank`` of ``world`` of its weights."""
    local = copy.deepcopy(layer)
    if isinstance(layer, CausalSelfAttention):
        local.n_head = layer.n_head // world
        _set_weight(local.qkv, _rows(layer.qkv.weight, 3, rank, world))
        _set_weight(local.proj, _columns(layer.proj.weight, rank, world))
    elif isinstance(layer, SwiGLU):
        _set_weight(local.gate_up, _rows(layer.gate_up.weight, 2, rank, world))
        _set_weight(local.down, _columns(layer.down.weight, rank, world))
    else:
        raise TypeError(f"tensor parallelism: no sharding for sublayer {type(layer).__name__}")
    return local


def _state_bytes(state) -> int:
    tensors = [state.h, state.partial, state.streams, *state.values, *state.blocks]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class TensorParallelGPT(nn.Module):
    """``model``'s inference over the ranks of ``group`` (module docstring); every rank builds it
    from the same model. The sublayers are sharded copies; the other modules are ``model``'s own,
    so dropping ``model`` afterwards frees the full sublayer weights."""

    def __init__(self, model: GPT, group=None) -> None:
        super().__init__()
        c = model.config
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        if c.n_head % self.world or c.hidden % self.world:
            raise ValueError(
                f"tp: n_head={c.n_head} and the MLP width {c.hidden} must split evenly over {self.world} ranks"
            )
        self.config, self.group = c, group
        self.embed, self.norms, self.residual = model.embed, model.norms, model.residual
        self.norm_f, self.lm_head = model.norm_f, model.lm_head
        self.layers = nn.ModuleList(_shard_layer(layer, self.rank, self.world) for layer in model.layers)
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        self.schedule = model.inference_schedule()
        self.stats = TPStats(tp=self.world, rank=self.rank)
        self.stats.layer_weight_bytes = sum(p.numel() * p.element_size() for p in self.layers.parameters())

    def new_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        """A KV cache of this rank's ``n_head / P`` heads."""
        c, p = self.config, self.lm_head.weight
        cache = KVCache(
            c.n_layer,
            batch,
            c.n_head // self.world,
            max_len or c.seq_len,
            c.d_model // c.n_head,
            p.device,
            p.dtype,
        )
        self.stats.kv_cache_bytes = (cache.k.numel() + cache.v.numel()) * cache.k.element_size()
        return cache

    @torch.no_grad()
    def forward_hidden(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Final normalised hidden states ``[B, T, d]`` of ``idx`` ``[B, T]`` (every rank passes
        the same ids; every rank gets all ``T`` rows), continuing and filling ``cache``."""
        B, T = idx.shape
        limit = min(self.config.seq_len, cache.max_len)
        if cache.length + T > limit:
            raise ValueError(
                f"idx: {cache.length + T} tokens exceed the cache's capacity of {limit} tokens "
                f"(seq_len={self.config.seq_len}, max_len={cache.max_len})"
            )
        split = self.world > 1 and T % self.world == 0
        a, b = (self.rank * T // self.world, (self.rank + 1) * T // self.world) if split else (0, T)
        cos, sin = (
            self.rope_cos[cache.length : cache.length + T],
            self.rope_sin[cache.length : cache.length + T],
        )
        state = self.residual.init_state(self.embed(idx[:, a:b]), schedule=self.schedule)
        for l, (layer, norm) in enumerate(zip(self.layers, self.norms, strict=True)):
            h = self.residual.read_normed(state, l, norm)  # local tokens, normalised
            partial = layer(self._gather(h) if split else h, cos, sin, cache)  # [B, T, d] partial sum
            self.residual.write(
                state, l, self._reduce_scatter(partial) if split else self._all_reduce(partial)
            )
            self.stats.peak_state_bytes = max(self.stats.peak_state_bytes, _state_bytes(state))
        out = self.residual.final_normed(state, self.norm_f)
        cache.advance(T)
        return self._gather(out) if split else out

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """All-gather ``[B, T/P, d]`` over the sequence -> ``[B, T, d]``."""
        out = x.new_empty((self.world * x.shape[1], x.shape[0], x.shape[2]))
        with guarded("tensor-parallel all-gather over the sequence"):
            dist.all_gather_single(out, x.transpose(0, 1).contiguous(), group=self.group)
        self.stats.allgather_bytes += x.numel() * x.element_size() * (self.world - 1)
        return out.transpose(0, 1)

    def _reduce_scatter(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' ``[B, T, d]`` partial outputs, keeping this rank's ``T/P`` tokens."""
        T = partial.shape[1]
        out = partial.new_empty((T // self.world, partial.shape[0], partial.shape[2]))
        with guarded("tensor-parallel reduce-scatter of a sublayer's partial output"):
            dist.reduce_scatter_single(out, partial.transpose(0, 1).contiguous(), group=self.group)
        self.stats.reduce_scatter_bytes += out.numel() * out.element_size() * (self.world - 1)
        return out.transpose(0, 1)

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return partial
        with guarded("tensor-parallel all-reduce of a sublayer's partial output"):
            dist.all_reduce(partial, group=self.group)
        self.stats.allreduce_bytes += (
            2 * partial.numel() * partial.element_size() * (self.world - 1) // self.world
        )
        return partial


@torch.no_grad()
def tensor_parallel_generate(
    model: TensorParallelGPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, KVCache]:
    """``GPT.generate`` over the ranks of ``model.group``: ``idx`` ``[B, T]`` (the same on every
    rank) -> ``(ids [B, T + max_new_tokens], this rank's cache)``. The prompt is prefilled in
    chunks of ``chunk_size`` tokens (default: all at once); rank 0's sampled token is broadcast."""
    check_number("max_new_tokens", max_new_tokens, integer=True, ge=0)
    check_sampling(temperature, top_k)
    check_number("chunk_size", chunk_size, integer=True, optional=True, ge=1)
    if idx.ndim != 2 or idx.shape[1] < 1:
        raise ValueError(f"idx: expected token ids of shape [B, T] with T >= 1, got {tuple(idx.shape)}")
    T = idx.shape[1]
    if T + max_new_tokens > model.config.seq_len:
        raise ValueError(
            f"max_new_tokens: prompt ({T}) + {max_new_tokens} new tokens exceed seq_len={model.config.seq_len}"
        )
    cache = model.new_cache(idx.shape[0], max_len=T + max_new_tokens)
    chunk = chunk_size or T
    for t0 in range(0, T, chunk):
        hidden = model.forward_hidden(idx[:, t0 : t0 + chunk], cache)
    logits = model.lm_head(hidden[:, -1])
    src = dist.get_global_rank(model.group, 0) if model.group is not None else 0
    for i in range(max_new_tokens):
        nxt = sample_token(logits, temperature, top_k, generator)
        if model.group is not None:
            with guarded("tensor-parallel broadcast of the sampled token"):
                dist.broadcast(nxt, src=src, group=model.group)
        idx = torch.cat([idx, nxt], dim=1)
        if i + 1 < max_new_tokens:
            logits = model.lm_head(model.forward_hidden(nxt, cache)[:, -1])
    return idx, cache
