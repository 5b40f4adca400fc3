"""Memory-efficient prefill: block states sharded over the sequence (or the hidden dim), in chunks.

Prefilling ``T`` tokens with Block AttnRes keeps the block representations ``b_0 ... b_N`` of
every token alive until the final readout: ``(N + 1) T d`` elements (the report's section 4.2
counts ``N T d``: 128K tokens, 8 blocks, d = 7168 in bf16 -> 15 GB). Two exact reductions, sharding
and chunking:

**Sequence sharding** (``shard="sequence"``, the default: what the report's section 4.2 describes):
rank ``r`` stores every block for its ``1/P`` of each chunk's tokens; depth attention needs no
communication at all (it is per token), MLP sublayers run on the local tokens, attention
sublayers all-gather their input over the sequence. Block-state memory per rank:
``(N + 1) T d / P``.

**Hidden-dim sharding** (``shard="hidden"``) over ``P`` tensor-parallel ranks: rank ``r`` stores channels
``[r d/P, (r+1) d/P)`` of every block. Depth attention only needs per-token scalars across
the shards: for each source ``i`` (and depth head), the partial sums ``sum_c x_ic^2`` (the key's
RMSNorm) and ``sum_c q_c x_ic`` (the logit) over the local channels; one all-reduce of those
``[N, 2, B, T, H]`` float32 partials per layer gives every rank the exact logits
``z_i = (q . x_i) / sqrt(mean(x_i^2) + eps)``, the softmax is computed redundantly, and each
rank mixes its own channels. The layer itself needs the full ``h``: an all-gather of the mixed
shards (the usual TP activation traffic); its output is sliced back to the local channels
before it is added to the partial block. Memory of the block states per rank: ``(N + 1) T d / P``.

**Sequence chunks** of ``chunk_size`` tokens go through the whole model one after another with
a KV cache (depth attention is per token, so a chunk never needs another chunk's block states;
sequence attention reads the cached keys and values). Block-state memory with either sharding:
``(N + 1) chunk d / P``.

The layers' weights are replicated on every rank here: this module shards only the depth state.
:mod:`.tp` shards the weights too (Megatron tensor parallelism with the depth state split by
token, the report's reduce-scatter / local merge / all-gather path). :class:`PrefillStats`
reports the bytes actually held (tracked on the live tensors) next to the closed form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..connections import BlockAttnRes
from ..model import CausalSelfAttention, KVCache
from .dist import guarded
from .kv import ShardedKVCache

__all__ = ["SHARDS", "PrefillResult", "PrefillStats", "applies", "block_state_bytes", "prefill"]


def block_state_bytes(
    n_tensors: int, batch: int, tokens: int, d_model: int, element_size: int, shards: int = 1
) -> int:
    """Closed form: ``n_tensors`` block states of ``batch x tokens x d_model / shards`` elements."""
    return n_tensors * batch * tokens * (d_model // shards) * element_size


@dataclass
class PrefillStats:
    """What one rank held and sent during :func:`prefill`."""

    tp: int
    rank: int
    batch: int
    seq_len: int
    chunk_size: int
    d_shard: int
    element_size: int
    peak_block_bytes: int = 0  # max over time of the block states stored (blocks + partial)
    peak_block_tensors: int = 0
    formula_block_bytes: int = 0  # (N + 1) * batch * chunk * d / P * element size
    transient_bytes: int = 0  # per-layer full-width activations (h, f_l(h)) and one output shard
    kv_cache_bytes: int = 0  # this rank's keys and values (shard="sequence": 1/P of them)
    allreduce_bytes: int = 0
    allgather_bytes: int = 0
    attention_bytes: int = 0  # shard="sequence": queries all-gathered + partial softmaxes sent

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [B, T, vocab] (last_only: [B, 1, vocab])
    cache: KVCache | ShardedKVCache  # filled, ready for decoding
    stats: PrefillStats


class _Sharded:
    """Depth attention over hidden-dim shards of the sources (static softmax queries)."""

    def __init__(self, residual: BlockAttnRes, lo: int, hi: int, group, stats: PrefillStats) -> None:
        self.res, self.lo, self.hi, self.group, self.stats = residual, lo, hi, group, stats
        d, H = residual.d_model, residual.heads
        self.head_dim = d // H
        heads_of = torch.arange(lo, hi) // self.head_dim
        self.onehot = torch.nn.functional.one_hot(heads_of, H)  # [d_local, H]

    def attend(self, layer: int, sources: list[torch.Tensor]) -> torch.Tensor:
        res = self.res
        x0 = sources[0]
        acc = torch.promote_types(x0.dtype, torch.float32)
        onehot = self.onehot.to(device=x0.device, dtype=acc)
        q = res.static_queries(layer)[self.lo : self.hi].to(acc)
        parts = []
        for x in sources:
            xa = x.to(acc)
            parts.append(torch.stack([(xa * q) @ onehot, (xa * xa) @ onehot]))  # [2, B, T, H]
        partial = torch.stack(parts)  # [N, 2, B, T, H]
        if self.group is not None:
            with guarded("sharded prefill all-reduce of depth-logit partial sums"):
                dist.all_reduce(partial, group=self.group)
            self.stats.allreduce_bytes += partial.numel() * partial.element_size()
        dot, sq = partial[:, 0], partial[:, 1]
        z = dot / torch.sqrt(sq / self.head_dim + res.eps) if res.key_norm else dot
        w = torch.softmax(z, dim=0) @ onehot.T  # [N, B, T, d_local]
        out = torch.zeros_like(x0, dtype=acc)
        for i, x in enumerate(sources):
            out += w[i] * x.to(acc)
        return out.to(x0.dtype)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return local
        world = dist.get_world_size(self.group)
        parts = [torch.empty_like(local) for _ in range(world)]
        with guarded("sharded prefill all-gather of the layer input"):
            dist.all_gather(parts, local.contiguous(), group=self.group)
        self.stats.allgather_bytes += local.numel() * local.element_size() * (world - 1)
        return torch.cat(parts, dim=-1)


class _BlockStates:
    """One chunk's block states: ``[b_0 = embedding, b_1, ...]`` and the open partial sum, with the
    peak bytes they hold together (what the report's prefill memory figures count)."""

    def __init__(self, embedding: torch.Tensor, res: BlockAttnRes, stats: PrefillStats) -> None:
        self.blocks, self.partial, self.res, self.stats = [embedding], None, res, stats
        self.gates = 2 * torch.sigmoid(res.gate_logits) if res.intra_gate else None

    def sources(self) -> list[torch.Tensor]:
        return self.blocks + ([self.partial] if self.partial is not None else [])

    def add(self, layer: int, out: torch.Tensor) -> None:
        """Add sublayer ``layer``'s output (owned by the states from now on) to the partial sum."""
        if self.gates is not None:
            out.mul_(self.gates[layer].to(out.dtype))
        if self.partial is None:
            self.partial = out
        else:
            self.partial.add_(out)  # in place: the block state never exists twice
        live = self.blocks + [self.partial]
        nbytes = sum(t.numel() * t.element_size() for t in live)
        if nbytes > self.stats.peak_block_bytes:
            self.stats.peak_block_bytes, self.stats.peak_block_tensors = nbytes, len(live)
        if (layer + 1) % self.res.block_size == 0:
            self.blocks.append(self.partial)
            self.partial = None


def applies(model) -> bool:
    """Whether ``model`` can take this prefill: Block AttnRes with static softmax queries."""
    res = model.residual
    return isinstance(res, BlockAttnRes) and res.query_mode == "static" and res.normalize == "softmax"


def _check_model(model) -> BlockAttnRes:
    res = model.residual
    if not isinstance(res, BlockAttnRes):
        raise ValueError(f"sharded prefill: expected residual='block', got {model.config.residual.rule!r}")
    if res.query_mode != "static" or res.normalize != "softmax":
        raise ValueError(
            "sharded prefill needs static softmax queries (query='static', normalize='softmax'), got "
            f"query={res.query_mode!r}, normalize={res.normalize!r}"
        )
    return res


SHARDS = ("sequence", "hidden")


def _hidden_sharded_chunk(
    model, ids: torch.Tensor, t0: int, sharded: _Sharded, cache, stats: PrefillStats
) -> torch.Tensor:
    """One chunk through the model with channel-sharded block states; its final hidden states."""
    res, lo, hi = sharded.res, sharded.lo, sharded.hi
    tc = ids.shape[1]
    cos, sin = model.rope_cos[t0 : t0 + tc], model.rope_sin[t0 : t0 + tc]
    states = _BlockStates(model.embed(ids)[..., lo:hi].clone(), res, stats)  # b_0, local channels only
    for l in range(res.n_layers):
        h = sharded.gather(sharded.attend(l, states.sources()))
        v = model.layers[l](model.norms[l](h), cos, sin, cache)
        out = v[..., lo:hi].clone()
        stats.transient_bytes = max(
            stats.transient_bytes, (h.numel() + v.numel() + out.numel()) * h.element_size()
        )
        del h, v
        states.add(l, out)
        del out
    final = sharded.attend(res.n_layers, states.sources())
    return model.norm_f(sharded.gather(final))


def _prefill_hidden(model, idx, group, chunk_size, last_only, max_len) -> PrefillResult:
    """Block states sharded over the channels (see :func:`prefill`)."""
    res = _check_model(model)
    B, T = _check_idx(model, idx)
    chunk = _check_chunk(T, chunk_size)
    tp = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    d = res.d_model
    if d % tp:
        raise ValueError(f"sharded prefill: d_model={d} must split evenly over {tp} ranks")
    lo, hi = rank * d // tp, (rank + 1) * d // tp
    p = model.lm_head.weight
    stats = PrefillStats(
        tp=tp, rank=rank, batch=B, seq_len=T, chunk_size=chunk, d_shard=hi - lo, element_size=p.element_size()
    )
    sharded = _Sharded(res, lo, hi, group, stats)
    cache = model.new_cache(B, max_len=_check_max_len(model, T, max_len))
    stats.kv_cache_bytes = (cache.k.numel() + cache.v.numel()) * cache.k.element_size()
    n_sources = 1 + res.n_layers // res.block_size + int(res.n_layers % res.block_size != 0)
    stats.formula_block_bytes = block_state_bytes(n_sources, B, stats.chunk_size, d, stats.element_size, tp)
    logits_out = []
    for t0 in range(0, T, chunk):
        ids = idx[:, t0 : t0 + chunk]
        tc = ids.shape[1]
        hidden = _hidden_sharded_chunk(model, ids, t0, sharded, cache, stats)
        if last_only:
            hidden = hidden[:, -1:] if t0 + tc == T else None
        if hidden is not None:
            logits_out.append(model.lm_head(hidden))
        cache.advance(tc)
    return PrefillResult(torch.cat(logits_out, dim=1), cache, stats)


@torch.no_grad()
def prefill(
    model,
    idx: torch.Tensor,
    *,
    group=None,
    chunk_size: int | None = None,
    last_only: bool = False,
    shard: str = "sequence",
    max_len: int | None = None,
) -> PrefillResult:
    """Prefill ``idx`` ``[B, T]`` through a Block AttnRes GPT; exact (to float rounding).

    ``group``: a process group whose ranks shard the block states (every rank passes the same
    ``idx`` and an identical model); ``None``: one rank holds them all. ``shard="sequence"``
    (the default, as in the report) splits each chunk's tokens: depth attention is per token,
    so it runs locally without any communication, MLP sublayers run on the local tokens only,
    and attention sublayers keep the keys and values of the local tokens only
    (:class:`~.kv.ShardedKVCache`: the queries are all-gathered, the per-rank softmaxes merged;
    each chunk must split evenly over the ranks). ``shard="hidden"`` splits the channels (module
    docstring) and keeps the whole KV cache on every rank. ``chunk_size``: tokens per sequence
    chunk (``None``: the whole sequence at once). ``max_len``: the cache's capacity in tokens
    (default ``T``; more leaves room to decode). Returns the logits (``last_only``: of the last
    position), the filled KV cache and this rank's :class:`PrefillStats`.
    """
    if shard not in SHARDS:
        raise ValueError(f"shard: expected one of {SHARDS}, got {shard!r}")
    if shard == "sequence":
        return _prefill_sequence(model, idx, group, chunk_size, last_only, max_len)
    return _prefill_hidden(model, idx, group, chunk_size, last_only, max_len)


def _prefill_sequence(model, idx, group, chunk_size, last_only, max_len) -> PrefillResult:
    """Block states and keys/values sharded over the tokens of each chunk (see :func:`prefill`)."""
    res = _check_model(model)
    B, T = _check_idx(model, idx)
    chunk = _check_chunk(T, chunk_size)
    tp = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    d = res.d_model
    p = model.lm_head.weight
    stats = PrefillStats(
        tp=tp, rank=rank, batch=B, seq_len=T, chunk_size=chunk, d_shard=d, element_size=p.element_size()
    )
    local = _Sharded(res, 0, d, None, stats)  # full channels, local tokens: no all-reduce
    cache = ShardedKVCache.for_model(model, B, _check_max_len(model, T, max_len), group)
    stats.kv_cache_bytes = cache.nbytes()
    n_sources = 1 + res.n_layers // res.block_size + int(res.n_layers % res.block_size != 0)
    stats.formula_block_bytes = n_sources * B * (chunk // tp) * d * stats.element_size
    L = res.n_layers

    def gather_tokens(x: torch.Tensor) -> torch.Tensor:
        if group is None:
            return x
        parts = [torch.empty_like(x) for _ in range(tp)]
        with guarded("sequence-sharded prefill all-gather over the tokens"):
            dist.all_gather(parts, x.contiguous(), group=group)
        stats.allgather_bytes += x.numel() * x.element_size() * (tp - 1)
        return torch.cat(parts, dim=1)

    logits_out = []
    for t0 in range(0, T, chunk):
        ids = idx[:, t0 : t0 + chunk]
        tc = ids.shape[1]
        if tc % tp:
            raise ValueError(f"shard='sequence': a chunk of {tc} tokens does not split over {tp} ranks")
        a, b = rank * tc // tp, (rank + 1) * tc // tp
        cos, sin = model.rope_cos[t0 + a : t0 + b], model.rope_sin[t0 + a : t0 + b]
        states = _BlockStates(model.embed(ids[:, a:b]), res, stats)
        for l in range(L):
            h = model.norms[l](local.attend(l, states.sources()))
            layer = model.layers[l]
            if isinstance(layer, CausalSelfAttention):  # keys of the local tokens, every query
                with cache.rows(a, b):
                    out = layer(h, cos, sin, cache)
            else:  # per token: local tokens only
                out = layer(h, cos, sin)
            del h
            states.add(l, out)
            del out
        final = local.attend(L, states.sources())
        hidden = gather_tokens(model.norm_f(final))
        if last_only:
            hidden = hidden[:, -1:] if t0 + tc == T else None
        if hidden is not None:
            logits_out.append(model.lm_head(hidden))
        cache.advance(tc)
        del states
    stats.attention_bytes = cache.sent_bytes
    return PrefillResult(torch.cat(logits_out, dim=1), cache, stats)


def _check_idx(model, idx: torch.Tensor) -> tuple[int, int]:
    if idx.ndim != 2:
        raise ValueError(f"idx: expected token ids of shape [B, T], got {tuple(idx.shape)}")
    B, T = idx.shape
    if T > model.config.seq_len:
        raise ValueError(f"idx: {T} tokens exceed the context length seq_len={model.config.seq_len}")
    return B, T


def _check_chunk(T: int, chunk_size: int | None) -> int:
    chunk = T if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise ValueError(f"chunk_size: expected a positive number of tokens, got {chunk_size}")
    return min(chunk, T)


def _check_max_len(model, T: int, max_len: int | None) -> int:
    if max_len is None:
        return T
    if isinstance(max_len, bool) or not isinstance(max_len, int) or not T <= max_len <= model.config.seq_len:
        raise ValueError(
            f"max_len: expected an int from the prompt length {T} to seq_len={model.config.seq_len}, got {max_len!r}"
        )
    return max_len
