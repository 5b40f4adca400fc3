"""A KV cache sharded over the ranks by token: each rank keeps ``1/P`` of the keys and values.

Attention over keys held by ``P`` ranks is exact without gathering them: every rank attends the
queries over its own keys only and keeps, per query, the output ``o_r`` and the log-sum-exp
``lse_r`` of its scores; the global softmax is their log-sum-exp merge

    lse = log sum_r exp(lse_r),    y = sum_r exp(lse_r - lse) o_r

(the online-softmax identity of FlashAttention's split-KV decoding). Two ways the rows arrive:

* **sequence rows** (:meth:`ShardedKVCache.rows`, set by the sequence-sharded prefill): each rank
  passes its slice ``[a, b)`` of the chunk's tokens. It stores their keys, the queries are
  all-gathered (every rank's keys must see every query), and an all-to-all returns to each rank
  the partial results of its own rows, which it merges locally.
* **replicated rows** (decoding): every rank passes the same tokens; the token at position ``p``
  is stored by rank ``p mod P``, and one all-gather of the small ``(o_r, lse_r)`` per query lets
  every rank merge the same result.

Precision: scores, softmax statistics and the merge in float32; the output in the query's dtype.
Every rank must make the same calls (they are collective). ``group=None``: one rank, no
communication (the cache then equals :class:`~attention_residuals.model.KVCache`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .dist import guarded

__all__ = ["ShardedKVCache"]


class ShardedKVCache:
    """Keys and values of every attention sublayer, this rank's tokens only.

    The interface of :class:`~attention_residuals.model.KVCache` (``length``, ``max_len``,
    ``attend``, ``advance``), so ``GPT.forward_hidden(idx, cache)`` decodes with it unchanged.
    ``k``, ``v``: ``[n_attn, B, H, capacity, hd]`` with ``capacity = ceil(max_len / P) + 1``;
    ``positions[:n_local]``: the absolute positions of the stored tokens.
    """

    def __init__(
        self, n_attn: int, batch: int, n_head: int, max_len: int, head_dim: int, device, dtype, group=None
    ) -> None:
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        capacity = math.ceil(max_len / self.world) + 1
        shape = (n_attn, batch, n_head, capacity, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.positions = torch.zeros(capacity, dtype=torch.long, device=device)
        self.length = 0  # tokens cached over all ranks
        self.max_len = max_len
        self.n_local = 0  # tokens this rank stores
        self._pending = 0  # stored by the current step, committed by advance()
        self._rows: tuple[int, int] | None = None
        self.sent_bytes = 0  # what this rank's collectives sent

    @classmethod
    def for_model(cls, model, batch: int, max_len: int, group=None) -> ShardedKVCache:
        c, p = model.config, model.lm_head.weight
        return cls(c.n_layer, batch, c.n_head, max_len, c.d_model // c.n_head, p.device, p.dtype, group)

    def nbytes(self) -> int:
        """Bytes of this rank's key and value storage."""
        return (self.k.numel() + self.v.numel()) * self.k.element_size()

    @contextlib.contextmanager
    def rows(self, a: int, b: int) -> Iterator[None]:
        """Inside: ``attend`` receives this rank's tokens ``[a, b)`` of a chunk that starts at
        ``length`` (the sequence-sharded prefill; every rank's slice the same size)."""
        self._rows = (a, b)
        try:
            yield
        finally:
            self._rows = None

    def advance(self, tokens: int) -> None:
        self.length += tokens
        self.n_local += self._pending
        self._pending = 0

    def attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q``, ``k``, ``v`` ``[B, H, T, hd]`` of the new rows -> attention output ``[B, H, T, hd]``
        over every cached token and the causal part of the new ones."""
        new = q.shape[2] * (self.world if self._rows is not None else 1)  # tokens over all ranks
        if self.length + new > self.max_len:
            raise ValueError(f"ShardedKVCache: {self.length + new} tokens exceed max_len={self.max_len}")
        if self._rows is None:
            return self._attend_replicated(index, q, k, v)
        return self._attend_rows(index, q, k, v, *self._rows)

    def _attend_replicated(self, index, q, k, v) -> torch.Tensor:
        """Every rank has the same rows: the owner stores each token, the partials are gathered."""
        pos = torch.arange(self.length, self.length + q.shape[2], device=q.device)
        mine = pos % self.world == self.rank
        self._store(index, k[:, :, mine], v[:, :, mine], pos[mine])
        part = self._partial(index, q, pos)
        return _merge(self._all_gather(part, "decode all-gather of partial attention"), q.dtype)

    def _attend_rows(self, index, q, k, v, a: int, b: int) -> torch.Tensor:
        """This rank's rows ``[a, b)`` of a chunk: every query meets the local keys, each rank
        merges the partials of its own rows."""
        self._store(index, k, v, torch.arange(self.length + a, self.length + b, device=q.device))
        queries = torch.cat(self._all_gather(q, "sharded-KV all-gather of the queries"), dim=2)
        pos = torch.arange(self.length, self.length + queries.shape[2], device=q.device)
        part = self._partial(index, queries, pos)  # [B, H, T_chunk, hd + 1]
        return _merge(self._all_to_all(part), q.dtype)

    def _store(self, index: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        n, lo = k.shape[2], self.n_local
        self.k[index, :, :, lo : lo + n] = k
        self.v[index, :, :, lo : lo + n] = v
        self.positions[lo : lo + n] = pos
        self._pending = n

    def _partial(self, index: int, q: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
        """This rank's softmax over its keys: ``[B, H, T, hd + 1]``, the output ``o_r`` and, in
        the last channel, ``lse_r`` (``-inf`` where a query sees none of its keys)."""
        n = self.n_local + self._pending
        keys = self.k[index, :, :, :n].float()
        vals = self.v[index, :, :, :n].float()
        scores = q.float() @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])
        visible = self.positions[:n][None, :] <= qpos[:, None]  # [T, n]
        scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # [B, H, T, 1]
        weights = torch.exp(scores - lse.clamp_min(torch.finfo(torch.float32).min))
        out = weights @ vals
        return torch.cat([out, lse], dim=-1)

    def _all_gather(self, x: torch.Tensor, what: str) -> list[torch.Tensor]:
        if self.group is None:
            return [x]
        parts = [torch.empty_like(x) for _ in range(self.world)]
        with guarded(what):
            dist.all_gather(parts, x.contiguous(), group=self.group)
        self.sent_bytes += x.numel() * x.element_size() * (self.world - 1)
        return parts

    def _all_to_all(self, part: torch.Tensor) -> list[torch.Tensor]:
        """Rank ``s`` receives every rank's partial results for its own rows."""
        if self.group is None:
            return [part]
        send = torch.stack(part.chunk(self.world, dim=2)).contiguous()  # [P, B, H, T/P, hd + 1]
        recv = torch.empty_like(send)
        with guarded("sharded-KV all-to-all of partial attention"):
            dist.all_to_all_single(recv, send, group=self.group)
        self.sent_bytes += send[0].numel() * send.element_size() * (self.world - 1)
        return list(recv.unbind(0))


def _merge(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Log-sum-exp merge of per-rank ``[..., hd + 1]`` partials (module docstring)."""
    stacked = torch.stack(parts)  # [P, B, H, T, hd + 1]
    out, lse = stacked[..., :-1], stacked[..., -1:]
    total = torch.logsumexp(lse, dim=0)  # finite: every query sees itself on some rank
    return (torch.exp(lse - total) * out).sum(0).to(dtype)
