"""Pipeline-parallel training on ``torch.distributed.pipelining``: Block AttnRes with the
cross-stage cache, and the other rules it carries.

Full AttnRes and mixing (their sources are Block's with ``S = 1``), PreNorm and mHC-lite (one
tensor per hop) ride the same runtime, so that the baseline is trained and timed as AttnRes is
(:data:`.pipeline.PIPELINE_STATE`).

The model is cut as in :class:`.pipeline.PipelineLayout`: ``C = P * V`` contiguous chunks of
sublayers, chunk ``c`` on rank ``c % P`` as its virtual stage ``c // P``. Each chunk is a
:class:`StageModule` handed to a ``PipelineStage``; the schedule is PyTorch's own
(``ScheduleGPipe``, ``Schedule1F1B``, or ``ScheduleInterleaved1F1B`` for ``V > 1``), so the
ordering of microbatches, the sends/receives and the backward are torch's. A rank keeps only the
modules of its chunks (plus the depth-mixing module, which every chunk reads: a few vectors per
sublayer for the attention rules; mHC-lite's projections, ``[L, m d, 2m + m!]``, are whole on every
rank too and their gradients all-reduced like the queries').

What a stage sends. A Block AttnRes layer reads all completed blocks ``b_0, b_1, ...`` plus the
open partial sum, so the state between chunks is that list. A stage's output is the stacked tensor
``[k, B, T, d]`` of the blocks the *next* chunk does not hold yet (and the partial):

``naive``   every block and the partial, on every hop;
``cached``  the report's scheme (section 4.1): a rank keeps, for its later virtual stage, the
            blocks its earlier virtual stage held as input (received, or ``b_0`` computed by chunk
            0), so a hop into chunk ``c >= P`` sends only the blocks that appeared since chunk
            ``c - P`` ran. Bytes per token: :func:`.pipeline.derived_transfers` (the report's
            ``P(P-1)/2 N_p + (V-1) P^2 N_p`` for aligned chunks, plus ``b_0``), against
            ``C(C-1)/2 N_p`` naive.

The cache inside a rank and autograd. Chunk ``c - P`` puts a detached copy of each of its input
blocks (a fresh leaf) in a per-rank FIFO (one entry per microbatch: every schedule runs a stage's
forwards in microbatch order), chunk ``c`` takes it out. The backward of chunk ``c`` runs before
that of chunk ``c - P`` for the same microbatch (``c`` depends on ``c - P``'s outputs), and
accumulates the blocks' gradient into the leaves; chunk ``c - P`` reads its blocks through
:class:`_Tap`, whose backward adds those accumulated gradients, so a block's gradient is complete
(every use, on every stage) when it is sent back over the hop it arrived on.

The depth-attention parameters (every sublayer's pseudo-query and key norm live in one module) and
a tied embedding are used by several ranks: :meth:`PipelinedGPT.sync_shared_grads` sums their
gradients over the pipeline group after the schedule ran.

FSDP on the data-parallel dimension (``shard_mesh``). Each chunk is sharded over the replicas of
its stage as :mod:`.fsdp` shards a whole model (a group per sublayer, the chunk's embedding,
norms and head in its root group); ``PipelineStage`` defers the reduce-scatter to the end of the
schedule. The depth-mixing module stays whole on every rank (``ignored_params``: the two chunks
of an interleaved rank share it, and it is a few vectors per sublayer); its gradients are summed
over the pipeline here and averaged over the replicas by the caller
(:meth:`PipelinedGPT.replicated_parameters`). A tied embedding is sharded like the others on the
ranks of the first and last chunk, whose shards line up, so their gradients are summed shard by
shard.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor

from ..connections import ResidualState
from ..model import GPT, Sublayer
from .dist import DistributedError, guarded
from .fsdp import shard_units
from .pipeline import PIPELINE_HIDDEN, PIPELINE_STATE, PipelineLayout

__all__ = ["PP_SCHEDULES", "PP_SCHEMES", "PipelinedGPT", "StageModule"]

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved")
PP_SCHEMES = ("naive", "cached")


class _Tap(torch.autograd.Function):
    """Identity on ``x``; its backward adds the gradient later chunks of this rank accumulated
    into ``leaf`` (the cached copy of ``x`` they read)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
        ctx.leaf = leaf
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        extra = ctx.leaf.grad
        ctx.leaf = None
        return (grad if extra is None else grad + extra), None


@dataclass
class _Shared:
    """What the chunks of one rank share: the cache FIFOs and the bytes each chunk sent."""

    cache: dict[int, collections.deque]
    sent_elements: dict[int, int]


class StageModule(nn.Module):
    """Chunk ``chunk`` of a :class:`GPT`: its sublayers and their norms, the embedding on chunk 0,
    the final norm and LM head on the last chunk.

    ``forward``: chunk 0 takes token ids ``[B, T]``; the others the stacked state the hop into
    them carries, ``[k, B, T, d]`` (:meth:`.PipelineLayout.hop`; ``[1, B, T, m, d]`` for mHC's
    streams). The last chunk returns logits ``[B, T, vocab]``; the others the stacked state of
    the hop out of them.
    """

    def __init__(self, model: GPT, layout: PipelineLayout, chunk: int, scheme: str, shared: _Shared) -> None:
        super().__init__()
        self.layout, self.chunk, self.scheme, self._shared = layout, chunk, scheme, shared
        self.first_layer = layout.bounds[chunk]
        layers = layout.layers(chunk)
        self.layers = nn.ModuleList(model.layers[l] for l in layers)
        self.norms = nn.ModuleList(model.norms[l] for l in layers)
        self.residual = model.residual
        self.field = PIPELINE_STATE[model.residual.rule]
        self.embed = model.embed if chunk == 0 else None
        last = chunk == layout.chunks - 1
        self.norm_f = model.norm_f if last else None
        self.lm_head = model.lm_head if last else None
        self.activation_checkpointing = model.activation_checkpointing  # as GPT recomputes
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def _carried(self, state: ResidualState) -> list[torch.Tensor]:
        """The tensors of ``state`` that cross a hop (blocks, sources, or the one hidden state)."""
        value = getattr(state, self.field)
        return [value] if self.layout.hidden else list(value)

    def _set_carried(self, state: ResidualState, tensors: list[torch.Tensor]) -> None:
        setattr(state, self.field, tensors[0] if self.layout.hidden else list(tensors))

    def _input_state(self, x: torch.Tensor) -> tuple[ResidualState, list[torch.Tensor]]:
        """The state (cached tensors first, then the received ones, then the partial) and its
        carried tensors."""
        if self.chunk == 0:  # the rule's own start, as GPT's forward makes it
            state = self.residual.init_state(self.embed(x))
            return state, self._carried(state)
        first, n, partial = self.layout.hop(self.chunk, self.scheme)
        cached = self._shared.cache[self.chunk].popleft() if first else []
        if len(cached) != first:
            raise RuntimeError(
                f"pipeline cache of chunk {self.chunk}: {len(cached)} blocks, the hop needs {first}"
            )
        got = list(x.unbind(0))
        carried = cached + got[: n - first]
        state = ResidualState(partial=got[-1] if partial else None)
        self._set_carried(state, carried)
        return state, carried

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state, carried = self._input_state(x)
        later = self.chunk + self.layout.stages  # this rank's next virtual stage
        if (
            self.scheme == "cached"
            and later < self.layout.chunks
            and self.layout.known_before(later, "cached")
        ):
            leaves = [b.detach().requires_grad_(True) for b in carried]
            self._set_carried(state, [_Tap.apply(b, leaf) for b, leaf in zip(carried, leaves, strict=True)])
            self._shared.cache[later].append(leaves)
        T = carried[0].shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for i, (layer, norm) in enumerate(zip(self.layers, self.norms, strict=True)):
            l = self.first_layer + i
            if self.activation_checkpointing and torch.is_grad_enabled():
                v = self.residual.read_checkpointed(state, l, Sublayer(layer, norm, cos, sin))
            else:
                v = layer(self.residual.read_normed(state, l, norm), cos, sin)
            self.residual.write(state, l, v)
        if self.lm_head is not None:
            return self.lm_head(self.residual.final_normed(state, self.norm_f))
        first, n, partial = self.layout.hop(self.chunk + 1, self.scheme)
        carried = self._carried(state)
        if len(carried) != n or (state.partial is not None) != partial:
            raise RuntimeError(f"pipeline layout mismatch after chunk {self.chunk}")  # a bug, not input
        out = torch.stack(carried[first:n] + ([state.partial] if partial else []))
        self._shared.sent_elements[self.chunk] += out.numel()
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: its shard for a DTensor, else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def _shard_shape(shape: torch.Size, mesh: DeviceMesh | None) -> torch.Size:
    """The shape of this rank's FSDP2 shard of a ``shape`` parameter (dim 0 chunked over ``mesh``,
    as ``torch.chunk`` splits it)."""
    if mesh is None:
        return shape
    rows = torch.empty(shape[0], device="meta").chunk(mesh.size())
    r = mesh.get_local_rank()
    return torch.Size((rows[r].shape[0] if r < len(rows) else 0, *shape[1:]))


def _check_options(model: GPT, virtual: int, schedule: str, scheme: str) -> None:
    """The options :class:`PipelinedGPT` refuses by name, then a missing process group."""
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"schedule: expected one of {PP_SCHEDULES}, got {schedule!r}")
    if scheme not in PP_SCHEMES:
        raise ValueError(f"scheme: expected one of {PP_SCHEMES}, got {scheme!r}")
    if model.residual.rule not in PIPELINE_STATE:
        raise ValueError(
            f"model: pipelining carries the states of {', '.join(PIPELINE_STATE)}; "
            f"got residual={model.residual.rule!r}"
        )
    if (schedule == "interleaved") != (virtual > 1):
        raise ValueError(f"virtual: the interleaved schedule needs virtual > 1 (and only it), got {virtual}")
    if not dist.is_initialized():
        raise DistributedError("pipelining needs a process group: run under torchrun (or spawn)")


def _check_microbatches(microbatches: int, schedule: str, stages: int) -> None:
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches: expected a positive integer, got {microbatches!r}")
    if schedule != "gpipe" and microbatches < stages:
        raise ValueError(
            f"microbatches: {schedule} needs at least {stages} (one per stage) to fill the pipeline, got {microbatches}"
        )


class PipelinedGPT:
    """This rank's part of a :class:`GPT` (a rule of :data:`.pipeline.PIPELINE_STATE`) pipelined over ``group`` (default: the
    world; ``P`` = its size) with ``virtual`` stages per rank.

    Every rank builds the same ``model`` (same seed) and passes it here; the chunks of the other
    ranks are dropped from this object (let ``model`` go out of scope to free them). ``step``
    runs one batch through the schedule and leaves the gradients in ``.grad``.
    """

    def __init__(
        self,
        model: GPT,
        *,
        virtual: int = 1,
        schedule: str = "1f1b",
        scheme: str = "cached",
        microbatches: int = 2,
        group=None,
        shard_mesh: DeviceMesh | None = None,
        dtype: str = "float32",
    ) -> None:
        _check_options(model, virtual, schedule, scheme)
        stages = dist.get_world_size(group)
        _check_microbatches(microbatches, schedule, stages)
        self.group, self.scheme, self.microbatches = group, scheme, microbatches
        self.rank = dist.get_rank(group)
        rule = model.residual.rule
        self.layout = PipelineLayout.build(
            model.residual.n_layers,
            model.residual.block_size if rule == "block" else 1,  # Full's sources: blocks of one
            stages,
            virtual,
            hidden=rule in PIPELINE_HIDDEN,
        )
        self._shared = _Shared(
            cache={c: collections.deque() for c in range(self.layout.chunks)},
            sent_elements=collections.Counter(),
        )
        device = model.lm_head.weight.device
        self.modules = [
            StageModule(model, self.layout, c, scheme, self._shared) for c in self.layout.chunks_of(self.rank)
        ]
        self.shard_mesh = shard_mesh
        if shard_mesh is not None:
            self._shard(model, shard_mesh, dtype)
        self.stages = [
            PipelineStage(m, c, self.layout.chunks, device, group=group)
            for m, c in zip(self.modules, self.layout.chunks_of(self.rank), strict=True)
        ]
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[
            schedule
        ]
        target = self.stages if schedule == "interleaved" else self.stages[0]
        # the loss is scaled here (1 / microbatches, times the caller's scale): torch's own
        # per-stage gradient scaling would divide a module two stages of this rank share (the
        # depth-mixing one) twice, and could not leave gradients accumulated by earlier calls alone
        self._scale = 1.0
        self.schedule = kind(target, n_microbatches=microbatches, loss_fn=self._loss, scale_grads=False)
        tied = model.lm_head.weight.shape if model.config.tie_embeddings else None
        self._tied_shape = _shard_shape(tied, shard_mesh) if tied is not None else None
        owned = {id(p) for p in self.parameters()}
        for p in model.parameters():  # the other ranks' chunks: not trained, not checkpointed here
            if id(p) not in owned:
                p.requires_grad_(False)

    def _shard(self, model: GPT, mesh: DeviceMesh, dtype: str) -> None:
        """FSDP2 over ``mesh`` for each chunk of this rank (see the module docstring)."""
        for m in self.modules:
            shard_units(m, m.layers, dtype, mesh=mesh, ignored=set(model.residual.parameters()))

    def compile(self) -> None:
        """``torch.compile`` each sublayer of this rank's chunks in place (as torchtitan compiles
        its blocks): the chunk's own forward, with its cache FIFO and byte counts, stays eager."""
        for m in self.modules:
            for layer in m.layers:
                layer.compile()

    def replicated_parameters(self) -> list[nn.Parameter]:
        """This rank's parameters that are whole on every replica of its stage (all of them
        without ``shard_mesh``): the caller averages their gradients over the replicas."""
        return [p for p in self.parameters() if not isinstance(p, DTensor)]

    def parameters(self) -> list[nn.Parameter]:
        """The parameters of this rank's chunks (give these to its optimizer), each once."""
        seen: dict[int, nn.Parameter] = {}
        for m in self.modules:
            for p in m.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def _shared_parameters(self) -> list[tuple[nn.Parameter | None, torch.Size]]:
        """Parameters used on several ranks, the same list on every rank (None where this rank does
        not hold it): the depth-mixing module's, and the embedding tied to the LM head."""
        shared: list[tuple[nn.Parameter | None, torch.Size]] = [
            (p, p.shape) for p in self.modules[0].residual.parameters()
        ]
        if self._tied_shape is not None:
            mine = [m.embed.weight for m in self.modules if m.embed is not None]
            mine += [m.lm_head.weight for m in self.modules if m.lm_head is not None]
            shared.append((mine[0] if mine else None, self._tied_shape))
        return shared

    def sync_shared_grads(self) -> None:
        """Sum the shared parameters' gradients over the pipeline ranks (one all-reduce)."""
        if self.layout.stages == 1:
            return
        shared = self._shared_parameters()
        if not shared:  # PreNorm, untied: every parameter lives on one rank
            return
        device = self.modules[0].rope_cos.device
        flat = torch.cat(
            [
                (
                    _local(p.grad)
                    if p is not None and p.grad is not None
                    else torch.zeros(shape, device=device)
                ).flatten()
                for p, shape in shared
            ]
        )
        with guarded("all-reduce of the shared parameters' gradients"):
            dist.all_reduce(flat, group=self.group)
        offset = 0
        for p, shape in shared:
            n = shape.numel()
            if p is not None:
                grad = flat[offset : offset + n].view(shape).clone()
                p.grad = (
                    DTensor.from_local(grad, p.device_mesh, p.placements) if isinstance(p, DTensor) else grad
                )
            offset += n

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)
        return ce * self._scale

    def _run(self, run, idx: torch.Tensor | None, targets: torch.Tensor | None, scale: float) -> torch.Tensor:
        """``run`` (the schedule's ``step`` or ``eval``) over one batch; the mean loss, on every rank."""
        given = idx if idx is not None else targets
        if given is not None and given.shape[0] % self.microbatches:
            raise ValueError(
                f"idx: the batch of {given.shape[0]} does not split into microbatches={self.microbatches}"
            )
        self._shared.sent_elements.clear()
        self._scale = scale / self.microbatches
        losses: list[torch.Tensor] = []
        last = self.layout.rank_of(self.layout.chunks - 1)
        kwargs = {"target": targets, "losses": losses} if last == self.rank else {}
        args = (idx,) if self.layout.rank_of(0) == self.rank else ()
        with guarded(f"pipeline schedule (rank {self.rank})"):
            run(*args, **kwargs)
        if any(self._shared.cache.values()):
            raise RuntimeError("pipeline cache not drained after the step")  # a bug, not input
        device = self.modules[0].rope_cos.device
        loss = (
            torch.stack([l.detach().float() for l in losses]).sum() / scale
            if losses
            else torch.zeros((), device=device)
        )
        with guarded("loss broadcast from the last stage"):
            dist.broadcast(
                loss,
                dist.get_global_rank(self.group, last) if self.group is not None else last,
                group=self.group,
            )
        return loss

    def step(
        self,
        idx: torch.Tensor | None,
        targets: torch.Tensor | None,
        *,
        scale: float = 1.0,
        sync: bool = True,
        scaler: torch.amp.GradScaler | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one batch split into ``microbatches``: ``idx`` ``[B, T]`` on the
        rank of chunk 0, ``targets`` on the rank of the last chunk (None elsewhere allowed). The
        gradient of ``scale`` times the mean loss is added to ``.grad`` (gradient accumulation:
        ``scale = 1 / micro-batches``), times ``scaler``'s loss scale (float16: the caller unscales);
        ``sync`` (the last of them) sums the shared parameters' gradients over the ranks. Returns
        the (unscaled) mean loss on every rank."""
        if scaler is not None:  # every rank asks (the scaler starts its scale on first use)
            scale *= float(scaler.scale(torch.ones((), device=self.modules[0].rope_cos.device)))
        loss = self._run(self.schedule.step, idx, targets, scale)
        if sync:
            self.sync_shared_grads()
        return loss

    @torch.no_grad()
    def evaluate(self, idx: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor:
        """The mean loss of one batch, forward only (the schedule's ``eval``), on every rank."""
        return self._run(self.schedule.eval, idx, targets, 1.0)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The total gradient norm over every rank's parameters (shared ones counted once), and
        the gradients scaled to ``max_norm`` when it is above (``max_norm > 0``), as
        ``torch.nn.utils.clip_grad_norm_`` does for one process."""
        counted = [p for p in self.parameters() if p.grad is not None]
        if self.rank != self.layout.rank_of(0):  # the shared ones are counted on chunk 0's rank
            shared = {id(p) for p, _ in self._shared_parameters() if p is not None}
            counted = [p for p in counted if id(p) not in shared]
        device = self.modules[0].rope_cos.device
        # [sharded over the replicas, whole on each]: both summed over the stages, the first over
        # the replicas too
        sq = torch.zeros(2, device=device)
        for p in counted:
            sq[int(not isinstance(p, DTensor))] += _local(p.grad).detach().float().pow(2).sum()
        with guarded("all-reduce of the gradient norm"):
            dist.all_reduce(sq, group=self.group)
            if self.shard_mesh is not None:
                dist.all_reduce(sq[0], group=self.shard_mesh.get_group())
        total = sq.sum().sqrt()
        if max_norm and max_norm > 0:
            for sharded in (True, False):  # foreach kernels take one tensor kind at a time
                grads = [
                    p for p in self.parameters() if p.grad is not None and isinstance(p, DTensor) == sharded
                ]
                torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total)
        return total

    def sent_elements(self) -> dict[int, int]:
        """Elements each of this rank's chunks sent forward in the last step (its output tensors)."""
        return dict(self._shared.sent_elements)
