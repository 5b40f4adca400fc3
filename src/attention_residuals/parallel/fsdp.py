"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the bundled GPT.

``attnres train --fsdp`` under ``torchrun``: every parameter is sharded over the data-parallel
ranks (dim 0, a ``DTensor``), gathered for the forward and backward of the module that owns it and
freed again after, with gradients reduce-scattered. The shard groups follow the model's units:

* one group per sublayer (``model.layers[l]``: an attention or an MLP; the bulk of the weights),
  gathered just before the sublayer runs and resharded after its forward
  (``reshard_after_forward=True``, gathered again in backward: ZeRO-3);
* the root group holds the rest: the embedding (tied with the LM head), the per-sublayer RMSNorms,
  the final norm and the depth-mixing rule (``model.residual``: the AttnRes pseudo-queries and
  key norms). These are read by *every* sublayer's depth attention, so they are gathered once at
  the start of the forward and kept until the backward ends (``reshard_after_forward=False`` for
  the root, as FSDP2 does for its root by default) rather than gathered ``2 L`` times.

The AttnRes pseudo-queries are ordinary parameters here: sharded on dim 0 like any other, gathered
whole before a depth attention reads them (a ``[d]`` query is never used in pieces), and their
gradients reduce-scattered in float32 like the others.

Mixed precision (:func:`precision_policy`): with ``--dtype bfloat16`` / ``float16`` the gathered
parameters are cast to that dtype for the compute, the sharded master weights and the optimizer
state stay float32, and gradients are reduced in float32. The forward still runs under autocast
(``training.loop.autocast``) so that float32 buffers (RoPE tables) and the depth attention's
float32 statistics follow the same contract as the unsharded run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ..model import GPT
from .dist import guarded

__all__ = ["is_sharded", "precision_policy", "shard_model", "shard_units", "sync_gradients"]


def precision_policy(dtype: str) -> MixedPrecisionPolicy:
    """Compute in ``dtype`` (float32 / bfloat16 / float16), reduce gradients in float32."""
    if dtype == "float32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)


def shard_units(
    root: torch.nn.Module,
    layers: Iterable[torch.nn.Module],
    dtype: str = "float32",
    *,
    mesh: DeviceMesh | None = None,
    ignored: set[torch.nn.Parameter] | None = None,
) -> None:
    """One FSDP2 group per sublayer of ``layers`` (resharded after its forward), the rest of
    ``root`` in the root group (kept gathered until the backward ends), over ``mesh`` (default:
    every rank); ``ignored`` parameters stay whole on every rank (their gradients not reduced)."""
    policy = precision_policy(dtype)
    with guarded("FSDP2 sharding (fully_shard)"):
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
        fully_shard(root, mesh=mesh, mp_policy=policy, reshard_after_forward=False, ignored_params=ignored)


def shard_model(model: GPT, dtype: str = "float32") -> GPT:
    """Shard ``model`` in place over the default process group (one group per sublayer, the rest
    at the root, see the module docstring); returns it. Build the optimizer *after* this call:
    its parameters are the ``DTensor`` shards."""
    if not isinstance(model, GPT):
        raise TypeError(f"model: --fsdp shards the bundled GPT, got {type(model).__name__}")
    shard_units(model, model.layers, dtype)
    return model


def is_sharded(module: torch.nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def sync_gradients(module: torch.nn.Module, sync: bool):
    """Gradient accumulation under FSDP2: reduce-scatter on the last micro-batch only (the
    gradients of the others accumulate unsharded); a context manager like DDP's ``no_sync``."""
    if not isinstance(module, FSDPModule):
        return contextlib.nullcontext()
    module.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()
