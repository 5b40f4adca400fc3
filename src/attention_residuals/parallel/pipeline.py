"""Pipeline parallelism for Block AttnRes with cross-stage caching of block representations.

Layout (the report's section 4.1): the ``L`` sublayers are cut into ``C = P * V`` contiguous
chunks; chunk ``c`` runs on physical rank ``c % P`` as its virtual stage ``c // P``
(interleaved assignment). Chunk 0 also computes the embedding ``b_0``; chunk ``C - 1`` the final
readout, norm, LM head and loss.

What travels. Block AttnRes has no single hidden state: a layer's input is depth attention over
the completed blocks ``[b_0, b_1, ...]`` plus the open partial sum. So the state handed from
chunk ``c - 1`` to chunk ``c`` is those blocks plus the partial (when the boundary falls inside
a block). Three schemes decide which of them go on the wire at each hop:

``naive``       every hop sends every completed block and the partial.
``cached``      the report's scheme: a rank keeps the blocks it **received** (and ``b_0`` on rank
                0, which it computes as chunk 0's input) for its later virtual stages, so a hop
                sends only the blocks the receiver has not received before, plus the partial.
``cached_all``  also keeps the blocks a rank **computed** itself (they are in its memory for the
                backward pass anyway), so a later-stage hop skips those too.

The sender knows what the receiver holds from the static layout alone (no handshake); the
receiver checks that its cache and the message fit together. Backward sends, on every hop, the
gradients of exactly the tensors that hop sent forward, so backward traffic equals forward
traffic. A cached block is used by several chunks of its rank and may be forwarded again; its
gradient is accumulated over every use and every forward before it is sent back over the hop
it arrived on (reverse order of the forward guarantees completeness).

Schedule: GPipe-style, all microbatches forward then all backward, each rank visiting its
chunks in order (forward ascending, backward descending); sends are ``isend`` so the chain of
hops cannot deadlock. Bytes of every message are counted in :class:`PipelineStats`.

Traffic per token in units of ``d`` elements (:func:`derived_transfers`), with
``e_j`` = sublayers in the first ``j`` chunks and ``S`` the block size::

    naive       sum_{j=1}^{C-1} (1 + ceil(e_j / S))
    cached      sum_{j=1}^{P-1} (1 + ceil(e_j / S)) + sum_{j=P}^{C-1} (ceil(e_j / S) - floor(e_{j-P} / S))
    cached_all  sum_{j=1}^{P-1} (1 + ceil(e_j / S)) + sum_{j=P}^{C-1} (ceil(e_j / S) - floor(e_{j-P+1} / S))

(the ``1`` is ``b_0``; ``ceil`` counts the partial). When every chunk holds ``N_p`` whole blocks
(``e_j = j N_p S``) these are the report's formulas plus ``b_0``::

    naive       C(C-1)/2 N_p + (C-1)
    cached      P(P-1)/2 N_p + (V-1) P^2 N_p + (P-1)
    cached_all  P(P-1)/2 N_p + (V-1) P(P-1) N_p + (P-1)

(:func:`report_transfers` gives the report's two formulas).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..connections import BlockAttnRes, ResidualState
from .dist import DistributedError, guarded

__all__ = [
    "SCHEMES",
    "PipelineLayout",
    "PipelineParallel",
    "PipelineStats",
    "aligned_transfers",
    "derived_transfers",
    "report_transfers",
]

SCHEMES = ("naive", "cached", "cached_all")


def _check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: expected one of {SCHEMES}, got {scheme!r}")


@dataclass(frozen=True)
class PipelineLayout:
    """Which sublayers each chunk runs and which blocks each hop carries.

    ``bounds[c] : bounds[c + 1]`` are the sublayers of chunk ``c``; chunk ``c`` lives on rank
    ``c % stages`` as virtual stage ``c // stages``.
    """

    n_layers: int
    block_size: int
    stages: int
    virtual: int
    bounds: tuple[int, ...]

    @classmethod
    def build(
        cls,
        n_layers: int,
        block_size: int,
        stages: int,
        virtual: int = 1,
        chunk_layers: list[int] | None = None,
    ) -> PipelineLayout:
        """Even split (the first ``L mod C`` chunks get one more sublayer) or ``chunk_layers``."""
        for name, value in (
            ("n_layers", n_layers),
            ("block_size", block_size),
            ("stages", stages),
            ("virtual", virtual),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        C = stages * virtual
        if chunk_layers is None:
            if n_layers < C:
                raise ValueError(
                    f"stages * virtual = {C} chunks need at least {C} sublayers, the model has L={n_layers}"
                )
            base, extra = divmod(n_layers, C)
            chunk_layers = [base + (1 if c < extra else 0) for c in range(C)]
        if len(chunk_layers) != C or any(n < 1 for n in chunk_layers) or sum(chunk_layers) != n_layers:
            raise ValueError(
                f"chunk_layers: expected {C} positive sizes summing to L={n_layers}, got {chunk_layers}"
            )
        bounds = [0]
        for n in chunk_layers:
            bounds.append(bounds[-1] + n)
        return cls(n_layers, block_size, stages, virtual, tuple(bounds))

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def rank_of(self, chunk: int) -> int:
        return chunk % self.stages

    def chunks_of(self, rank: int) -> list[int]:
        return [rank + v * self.stages for v in range(self.virtual)]

    def layers(self, chunk: int) -> range:
        return range(self.bounds[chunk], self.bounds[chunk + 1])

    def state_after(self, j: int) -> tuple[int, bool]:
        """``(completed blocks including b_0, partial open?)`` once the first ``j`` chunks ran."""
        e = self.bounds[j]
        return 1 + e // self.block_size, e % self.block_size != 0

    def known_before(self, chunk: int, scheme: str) -> int:
        """How many leading blocks ``b_0 ...`` the rank of ``chunk`` holds before receiving its input."""
        _check_scheme(scheme)
        if scheme == "naive" or chunk < self.stages:
            return 0
        prev = chunk - self.stages  # the same rank's previous virtual stage
        return self.state_after(prev if scheme == "cached" else prev + 1)[0]

    def hop(self, chunk: int, scheme: str) -> tuple[int, int, bool]:
        """Hop into ``chunk`` (``1 <= chunk < C``): ``(first block sent, blocks in the state, partial sent?)``;
        blocks ``first .. n - 1`` travel."""
        if not 1 <= chunk < self.chunks:
            raise ValueError(f"chunk: hops go into chunks 1..{self.chunks - 1}, got {chunk}")
        n, partial = self.state_after(chunk)
        return self.known_before(chunk, scheme), n, partial

    def tensors_sent(self, chunk: int, scheme: str) -> int:
        first, n, partial = self.hop(chunk, scheme)
        return n - first + int(partial)

    def transfers(self, scheme: str) -> int:
        """``[*, d]`` tensors sent per token over all hops of one forward pass."""
        return sum(self.tensors_sent(c, scheme) for c in range(1, self.chunks))

    def aligned_blocks_per_chunk(self) -> int | None:
        """``N_p`` when every chunk holds the same whole number of blocks (the report's setting)."""
        sizes = {self.bounds[c + 1] - self.bounds[c] for c in range(self.chunks)}
        if len(sizes) != 1:
            return None
        size = sizes.pop()
        return size // self.block_size if size % self.block_size == 0 else None


def derived_transfers(bounds: list[int] | tuple[int, ...], block_size: int, stages: int, scheme: str) -> int:
    """Closed form of the tensors per token sent in one forward pass (see the module docstring)."""
    _check_scheme(scheme)
    S, P = block_size, stages
    C = len(bounds) - 1
    e = list(bounds)
    total = 0
    for j in range(1, C):
        if scheme == "naive" or j < P:
            total += 1 + math.ceil(e[j] / S)
        elif scheme == "cached":
            total += math.ceil(e[j] / S) - e[j - P] // S
        else:
            total += math.ceil(e[j] / S) - e[j - P + 1] // S
    return total


def aligned_transfers(stages: int, virtual: int, blocks_per_chunk: int, scheme: str) -> int:
    """The closed forms when every chunk holds ``N_p`` whole blocks: the report's formulas plus ``b_0``."""
    _check_scheme(scheme)
    P, V, Np = stages, virtual, blocks_per_chunk
    C = P * V
    if scheme == "naive":
        return C * (C - 1) // 2 * Np + (C - 1)
    if scheme == "cached":
        return P * (P - 1) // 2 * Np + (V - 1) * P * P * Np + (P - 1)
    return P * (P - 1) // 2 * Np + (V - 1) * P * (P - 1) * Np + (P - 1)


def report_transfers(stages: int, virtual: int, blocks_per_chunk: float) -> dict[str, float]:
    """The report's per-token counts (units of ``d``): ``C(C-1)/2 N_p`` and ``P(P-1)/2 N_p + (V-1) P^2 N_p``."""
    P, V, Np = stages, virtual, blocks_per_chunk
    C = P * V
    return {"naive": C * (C - 1) / 2 * Np, "cached": P * (P - 1) / 2 * Np + (V - 1) * P * P * Np}


@dataclass
class PipelineStats:
    """One :meth:`PipelineParallel.step` on this rank: loss and the bytes this rank sent."""

    loss: float
    bytes_forward: int = 0
    bytes_backward: int = 0
    messages: int = 0
    bytes_local: int = 0  # hops between chunks of the same rank (P = 1): handed over, not sent
    bytes_grad_sync: int = 0
    tokens: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class _Holder:
    """One block (or partial) tensor on this rank, with the gradient accumulated over its uses."""

    __slots__ = ("value", "grad")

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value
        self.grad: torch.Tensor | None = None

    def add_grad(self, g: torch.Tensor | None) -> None:
        if g is not None:
            self.grad = g if self.grad is None else self.grad + g


@dataclass
class _Record:
    """What the backward of one (chunk, microbatch) needs."""

    inputs: list[tuple[torch.Tensor, _Holder]] = field(default_factory=list)
    outputs: list[_Holder] = field(default_factory=list)
    received: list[_Holder] = field(default_factory=list)  # created by the hop into this chunk
    sent: list[_Holder] = field(default_factory=list)  # sent by the hop out of this chunk
    loss: torch.Tensor | None = None


class PipelineParallel:
    """Run a Block AttnRes :class:`~attention_residuals.model.GPT` as ``stages`` pipeline ranks.

    Every rank of ``group`` (default: the world) constructs the same model (same seed) and
    this wrapper; each rank only runs, and only gets gradients for, its chunks' modules (plus
    the depth-attention parameters, which every chunk uses: :meth:`sync_grads` sums them).
    ``scheme`` is one of :data:`SCHEMES`. ``step`` runs forward and backward of one batch
    split into ``microbatches`` and leaves the gradients in ``.grad``.
    """

    def __init__(
        self,
        model,
        stages: int | None = None,
        virtual: int = 1,
        scheme: str = "cached",
        group=None,
        chunk_layers: list[int] | None = None,
    ) -> None:
        _check_scheme(scheme)
        if not isinstance(model.residual, BlockAttnRes):
            raise ValueError(
                f"pipeline parallel: expected a model with residual='block', got {model.config.residual.rule!r}"
            )
        if not dist.is_initialized():
            raise DistributedError("pipeline parallel needs a process group: call init_distributed() first")
        world = dist.get_world_size(group)
        stages = world if stages is None else stages
        if world != stages:
            raise DistributedError(
                f"rank {dist.get_rank()}: pipeline with stages={stages} needs a process group of "
                f"{stages} ranks, this one has {world}; launch with torchrun --nproc-per-node {stages}"
            )
        self.model, self.scheme, self.group = model, scheme, group
        self.layout = PipelineLayout.build(
            model.residual.n_layers, model.residual.block_size, stages, virtual, chunk_layers
        )
        self.rank = dist.get_rank(group)
        self._peers = [dist.get_global_rank(group, r) if group is not None else r for r in range(stages)]
        self._stats = PipelineStats(loss=float("nan"))
        self._pending: list = []
        self._local: list[torch.Tensor] = []

    # ----------------------------------------------------------------- ownership

    def chunks(self) -> list[int]:
        return self.layout.chunks_of(self.rank)

    def owned_modules(self, rank: int | None = None) -> list[torch.nn.Module]:
        """Modules run by ``rank``'s chunks (the depth-attention module is run by every rank)."""
        rank = self.rank if rank is None else rank
        m = self.model
        mods: list[torch.nn.Module] = [m.residual]
        for c in self.layout.chunks_of(rank):
            if c == 0:
                mods.append(m.embed)
            mods += [m.layers[l] for l in self.layout.layers(c)] + [m.norms[l] for l in self.layout.layers(c)]
            if c == self.layout.chunks - 1:
                mods += [m.norm_f, m.lm_head]
        return mods

    def owned_parameters(self, rank: int | None = None) -> list[torch.nn.Parameter]:
        """Parameters this rank computes gradients for (give these to its optimizer)."""
        seen: dict[int, torch.nn.Parameter] = {}
        for mod in self.owned_modules(rank):
            for p in mod.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def shared_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters used by more than one rank (depth queries; a tied embedding): summed by :meth:`sync_grads`."""
        count: dict[int, int] = {}
        params: dict[int, torch.nn.Parameter] = {}
        for r in range(self.layout.stages):
            for p in self.owned_parameters(r):
                count[id(p)] = count.get(id(p), 0) + 1
                params[id(p)] = p
        return [params[k] for k, n in count.items() if n > 1]

    def sync_grads(self) -> int:
        """All-reduce (sum) the gradients of the shared parameters; returns the bytes reduced."""
        shared = self.shared_parameters()
        if not shared or self.layout.stages == 1:
            return 0
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in shared])
        with guarded("gradient all-reduce of the shared parameters"):
            dist.all_reduce(flat, group=self.group)
        offset = 0
        for p in shared:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n
        nbytes = flat.numel() * flat.element_size()
        self._stats.bytes_grad_sync += nbytes
        return nbytes

    # ----------------------------------------------------------------- communication

    def _send(self, tensor: torch.Tensor, chunk_to: int, backward: bool) -> None:
        dst = self._peers[self.layout.rank_of(chunk_to)]
        nbytes = tensor.numel() * tensor.element_size()
        if self.layout.rank_of(chunk_to) == self.rank:  # only with one stage: no wire to self
            self._stats.bytes_local += nbytes
            self._local.append(tensor)
            return
        if backward:
            self._stats.bytes_backward += nbytes
        else:
            self._stats.bytes_forward += nbytes
        self._stats.messages += 1
        with guarded("pipeline isend", peer=dst):
            self._pending.append(dist.isend(tensor.contiguous(), dst, group=self.group))

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, device, chunk_from: int) -> torch.Tensor:
        if self.layout.rank_of(chunk_from) == self.rank:
            return self._local.pop(0)  # FIFO: the schedule receives in the order it sent
        src = self._peers[self.layout.rank_of(chunk_from)]
        buf = torch.empty(shape, dtype=dtype, device=device)
        with guarded(f"pipeline receive from chunk {chunk_from}", peer=src):
            dist.irecv(buf, src, group=self.group).wait()
        return buf

    def _flush(self) -> None:
        with guarded("pipeline isend completion"):
            for work in self._pending:
                work.wait()
        self._pending.clear()

    # ----------------------------------------------------------------- one chunk

    def _forward_chunk(
        self, c: int, idx: torch.Tensor, targets: torch.Tensor | None, cache: dict[int, _Holder]
    ) -> tuple[_Record, dict[int, _Holder]]:
        m, L = self.model, self.layout
        res = m.residual
        B, T = idx.shape
        cos, sin = m.rope_cos[:T], m.rope_sin[:T]
        rec = _Record()
        if c == 0:
            emb = m.embed(idx)
            holders = {0: _Holder(emb)}
            rec.outputs.append(holders[0])
            state = ResidualState(blocks=[emb])
            n_in, partial_holder = 1, None
            kept = dict(holders) if self.scheme != "naive" else {}  # b_0: chunk 0's own input
        else:
            first, n_in, has_partial = L.hop(c, self.scheme)
            k = n_in - first + int(has_partial)
            d = res.d_model
            p = next(m.parameters())
            # k = 0 only on one stage: the rank already holds every block and no partial is open
            got = (
                [_Holder(t) for t in self._recv((k, B, T, d), p.dtype, p.device, c - 1).unbind(0)]
                if k
                else []
            )
            rec.received = got
            if self.scheme == "naive":
                cache = {}
            if sorted(cache) != list(range(first)):
                raise RuntimeError(
                    f"pipeline cache out of sync on rank {self.rank}, chunk {c}: holds blocks {sorted(cache)}, "
                    f"the hop sends blocks {first}..{n_in - 1}"
                )
            cache = dict(cache)
            for i in range(first, n_in):
                cache[i] = got[i - first]
            partial_holder = got[-1] if has_partial else None
            kept = dict(cache)  # what this rank keeps for its later stages under "cached"
            leaves = []
            for i in range(n_in):
                leaf = cache[i].value.detach().requires_grad_(True)
                rec.inputs.append((leaf, cache[i]))
                leaves.append(leaf)
            partial_leaf = None
            if partial_holder is not None:
                partial_leaf = partial_holder.value.detach().requires_grad_(True)
                rec.inputs.append((partial_leaf, partial_holder))
            state = ResidualState(blocks=leaves, partial=partial_leaf)
            holders = dict(cache)
        for l in L.layers(c):
            h = res.read(state, l)
            res.write(state, l, m.layers[l](m.norms[l](h), cos, sin))
        for i in range(n_in, len(state.blocks)):
            holders[i] = _Holder(state.blocks[i])
            rec.outputs.append(holders[i])
        out_partial = _Holder(state.partial) if state.partial is not None else None
        if out_partial is not None:
            rec.outputs.append(out_partial)
        if c == L.chunks - 1:
            if targets is None:
                raise ValueError(f"targets: the last pipeline stage (rank {self.rank}) needs the targets")
            hidden = m.norm_f(res.final(state))
            logits = m.lm_head(hidden)
            rec.loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)
        else:
            first, n_out, has_partial = L.hop(c + 1, self.scheme)
            if len(state.blocks) != n_out or (out_partial is not None) != has_partial:
                raise RuntimeError(f"pipeline layout mismatch after chunk {c}")  # a bug, not a user error
            rec.sent = [holders[i] for i in range(first, n_out)] + ([out_partial] if out_partial else [])
            if rec.sent:
                self._send(torch.stack([h.value.detach() for h in rec.sent]), c + 1, backward=False)
        if self.scheme == "cached_all":
            kept = {i: holders[i] for i in range(len(state.blocks))}
        return rec, kept

    def _backward_chunk(self, c: int, rec: _Record, scale: float) -> None:
        if rec.sent:
            ref = rec.sent[0].value
            grads = self._recv((len(rec.sent), *ref.shape), ref.dtype, ref.device, c + 1)
            for holder, g in zip(rec.sent, grads.unbind(0), strict=True):
                holder.add_grad(g)
        outs, grads_out = [], []
        for h in rec.outputs:
            if h.grad is not None:
                outs.append(h.value)
                grads_out.append(h.grad)
        if rec.loss is not None:
            outs.append(rec.loss * scale)
            grads_out.append(torch.ones_like(rec.loss))
        if outs:
            torch.autograd.backward(outs, grads_out)
        for leaf, holder in rec.inputs:
            holder.add_grad(leaf.grad)
        if rec.received:
            g = torch.stack(
                [h.grad if h.grad is not None else torch.zeros_like(h.value) for h in rec.received]
            )
            self._send(g, c - 1, backward=True)

    # ----------------------------------------------------------------- one step

    def step(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, microbatches: int = 1
    ) -> PipelineStats:
        """Forward and backward of one batch ``idx`` ``[B, T]`` (needed on every rank, for the
        shapes; the embedding uses it on rank 0) with ``targets`` (needed on the last stage's
        rank), split into ``microbatches``. Accumulates into ``.grad`` (call ``zero_grad``
        first), then sums the shared parameters' gradients (:meth:`sync_grads`). Returns this
        rank's :class:`PipelineStats`; ``loss`` (mean over all tokens) is the same on every rank.
        """
        if idx.ndim != 2:
            raise ValueError(f"idx: expected token ids of shape [B, T], got {tuple(idx.shape)}")
        B, T = idx.shape
        if microbatches < 1 or B % microbatches:
            raise ValueError(f"microbatches: must divide the batch size {B}, got {microbatches}")
        self._stats = PipelineStats(loss=float("nan"), tokens=B * T)
        idx_mb = idx.chunk(microbatches)
        tgt_mb = targets.chunk(microbatches) if targets is not None else [None] * microbatches
        records: dict[tuple[int, int], _Record] = {}
        caches: list[dict[int, _Holder]] = [{} for _ in range(microbatches)]
        for c in self.chunks():
            for mb in range(microbatches):
                records[c, mb], caches[mb] = self._forward_chunk(c, idx_mb[mb], tgt_mb[mb], caches[mb])
        last = self.layout.chunks - 1
        losses = [records[last, mb].loss.detach() for mb in range(microbatches) if (last, mb) in records]
        scale = 1.0 / microbatches
        for c in reversed(self.chunks()):
            for mb in range(microbatches):
                self._backward_chunk(c, records.pop((c, mb)), scale)
        self._flush()
        loss = torch.zeros((), dtype=torch.float64)
        for value in losses:
            loss += float(value) * scale
        self._stats.loss = self._broadcast_loss(loss)
        self.sync_grads()
        return self._stats

    def _broadcast_loss(self, loss: torch.Tensor) -> float:
        src = self._peers[self.layout.rank_of(self.layout.chunks - 1)]
        with guarded("loss broadcast", peer=src):
            dist.broadcast(loss, src, group=self.group)
        return float(loss)
