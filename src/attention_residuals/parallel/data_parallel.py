"""Data parallel training under ``torchrun``: the hooks ``train.py`` calls.

``torchrun --nproc-per-node K -m attention_residuals.train ...`` (or ``attnres train`` started
by any launcher that sets ``RANK`` / ``WORLD_SIZE``) makes :func:`setup` create the process group
(gloo on CPU, NCCL on CUDA; with a timeout, see :mod:`.dist`). Then:

* ``--batch-size`` stays the **global** micro-batch: each rank reads its own
  ``batch_size / K`` rows of it (:func:`local_batch`; ``data.get_batch(..., rank, world_size)``
  draws the global batch from ``(seed, step)`` and slices it), so a ``K``-rank run sees exactly
  the batches of the single-process run, and its config (the run's identity) does not depend
  on ``K``: a checkpoint resumes with any world size that divides the batch.
* the model is wrapped in ``DistributedDataParallel`` (:func:`wrap`), which averages the
  gradients: with equal shards the average of the ranks' mean losses is the global mean, so
  losses and updates equal the single-process run's to float tolerance. Gradient accumulation
  skips the all-reduce on all but the last micro-batch (:func:`sync_context`).
* with ``--pp-stages P`` on ``W = D * P`` ranks the ranks form the 2-D mesh ``("dp", "pp")``
  (:func:`pipeline_mesh`): ``D`` replicas of a ``P``-stage pipeline, replica ``r`` on ranks
  ``r P .. r P + P - 1``. Each replica reads ``batch_size / D`` rows; after the schedule, each
  stage's gradients are averaged over its ``D`` copies (:func:`average_gradients`: DDP's
  all-reduce, as one flat bucket, for modules a pipeline schedule runs).
* the logged loss is the mean over ranks (:func:`mean`); only rank 0 writes the run directory
  (config, metrics, checkpoints, summary: saved once); every rank reads the checkpoint to resume.
  With ``--fsdp`` the model is sharded instead of wrapped (:mod:`.fsdp`) and every rank writes its
  shards of the checkpoint (``training.sharded``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from .dist import DistEnv, destroy_distributed, guarded, init_distributed, launcher_env
from .fsdp import is_sharded, sync_gradients

__all__ = [
    "average_gradients",
    "barrier",
    "device_for",
    "from_main",
    "is_main",
    "local_batch",
    "main_first",
    "mean",
    "pipeline_mesh",
    "setup",
    "sync_context",
    "teardown",
    "wrap",
]

T = TypeVar("T")


def setup(device: str = "auto") -> DistEnv:
    """Join the launcher's process group (creating it if needed), or ``DistEnv()`` for a single
    process. ``device`` (``"cpu"``, ``"cuda"``, ``"auto"``) picks NCCL or gloo."""
    if dist.is_available() and dist.is_initialized():
        return init_distributed()
    env = launcher_env()
    if env is None:
        return DistEnv()
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    backend = "nccl" if cuda and dist.is_nccl_available() else "gloo"
    created = init_distributed(backend)
    _created.append(True)
    return created


_created: list[bool] = []  # setup() created the default group: teardown() destroys it


def teardown() -> None:
    """Destroy the process group if :func:`setup` created it."""
    if _created:
        _created.clear()
        destroy_distributed()


def device_for(env: DistEnv, resolved: torch.device) -> torch.device:
    """``cuda:<local_rank>`` for a CUDA run with several local ranks, else ``resolved``."""
    if env.distributed and resolved.type == "cuda" and resolved.index is None:
        return torch.device("cuda", env.local_rank)
    return resolved


def local_batch(batch_size: int, replicas: int) -> int:
    """This rank's rows of the global micro-batch ``batch_size`` over ``replicas`` data-parallel
    ranks (must divide evenly)."""
    if batch_size % replicas:
        raise ValueError(
            f"batch_size: the global batch of {batch_size} sequences does not split over "
            f"{replicas} data-parallel ranks; use a multiple of {replicas}"
        )
    return batch_size // replicas


def pipeline_mesh(env: DistEnv, stages: int, device_type: str) -> DeviceMesh:
    """The mesh ``("dp", "pp")`` of shape ``(world / stages, stages)``: rank ``r`` is stage
    ``r % stages`` of replica ``r // stages`` (a collective: every rank calls it)."""
    with guarded("creating the (dp, pp) device mesh"):
        mesh = init_device_mesh(device_type, (env.world_size // stages, stages), mesh_dim_names=("dp", "pp"))
    assert mesh.get_local_rank("dp") == env.rank // stages  # the layout data slicing assumes
    return mesh


def average_gradients(params: list[torch.nn.Parameter], group) -> None:
    """Average ``params``' gradients over ``group`` in one all-reduce (a missing gradient counts
    as zero, as in DDP); every rank of ``group`` passes the same parameter list."""
    size = dist.get_world_size(group)
    if size == 1:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
    with guarded("data-parallel all-reduce of the pipeline stages' gradients"):
        dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def wrap(model: torch.nn.Module, env: DistEnv) -> torch.nn.Module:
    """``DistributedDataParallel(model)`` when there are several ranks, else ``model``."""
    if env.world_size == 1:
        return model
    ids = [model.lm_head.weight.device.index] if model.lm_head.weight.device.type == "cuda" else None
    with guarded("DistributedDataParallel setup (parameter broadcast)"):
        return DistributedDataParallel(model, device_ids=ids)


def sync_context(net: torch.nn.Module, sync: bool):
    """Skip the gradient reduction unless ``sync`` (the last micro-batch of an accumulated step):
    DDP's ``net.no_sync()``; FSDP2 (:func:`.fsdp.sync_gradients`) reduce-scatters on the last only."""
    inner = getattr(net, "_orig_mod", net)  # torch.compile's wrapper
    if is_sharded(inner):
        return sync_gradients(inner, sync)
    if sync or not isinstance(net, DistributedDataParallel):
        return contextlib.nullcontext()
    return net.no_sync()


def mean(value: torch.Tensor, env: DistEnv, group=None) -> torch.Tensor:
    """The mean of ``value`` over the ranks of ``group`` (default: all; the value itself for a
    single process)."""
    size = dist.get_world_size(group) if env.world_size > 1 else 1
    if size == 1:
        return value
    out = value.detach().clone().float()
    with guarded("all-reduce of the training loss"):
        dist.all_reduce(out, group=group)
    return out / size


def barrier(env: DistEnv) -> None:
    if env.world_size > 1:
        with guarded("barrier"):
            dist.barrier()


def from_main(env: DistEnv, value: T) -> T:
    """Rank 0's ``value`` on every rank (e.g. whether rank 0 could take the run's lock, so that
    a refusal fails every rank at once instead of leaving the others waiting for a timeout)."""
    if env.world_size == 1:
        return value
    box = [value]
    with guarded("broadcast from rank 0"):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def main_first(env: DistEnv, fn: Callable[[], T]) -> T:
    """``fn()`` on rank 0, then on the other ranks (e.g. rank 0 fills a cache the others read).
    Rank 0 reaches the barrier even when ``fn`` raises, so the others do not wait for nothing."""
    if env.world_size == 1:
        return fn()
    if env.is_main:
        try:
            return fn()
        finally:
            barrier(env)
    barrier(env)
    return fn()


def is_main() -> bool:
    """True on rank 0 (and in a single process), also after the group is gone."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    env = launcher_env()
    return env is None or env.rank == 0
