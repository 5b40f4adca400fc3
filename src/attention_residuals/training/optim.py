"""Optimizers and learning-rate schedules.

* ``adamw`` — AdamW with two groups: weight decay on the 2-D weights (sublayer matrices,
  embedding, LM head); no decay on 1-D parameters (norm gains, biases) and on every parameter of
  the depth-mixing module ``model.residual`` (pseudo-queries, mixing logits...: decaying a
  zero-initialised query towards zero would fight the very thing AttnRes learns). With
  ``depth_lr_scale != 1`` or ``depth_weight_decay != 0`` the depth-mixing parameters get a third
  group of their own (the ablation of that choice).
* ``muon`` — ``torch.optim.Muon`` for the 2-D weight matrices of the sublayers (attention and
  MLP projections), AdamW for everything else (embedding, LM head, norms, ``residual.*``). Muon
  uses ``adjust_lr_fn="match_rms_adamw"`` (Moonshot's scaling), so one ``lr`` and one
  ``weight_decay`` serve both halves.

Schedules are multiplicative factors on each group's base lr, applied through
``torch.optim.lr_scheduler.LambdaLR``: ``cosine`` (linear warmup, cosine to ``min_lr``),
``wsd`` (warmup, stable, then a linear decay to ``min_lr`` over the last ``decay_frac`` of
training) and ``constant`` (warmup then flat). The factor for step ``s`` (0-based) is
``schedule(s)``; warmup starts at ``1 / warmup`` so no step has lr 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.optim.lr_scheduler import LambdaLR

__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "LRSchedule",
    "MuonAdamW",
    "build_optimizer",
    "build_scheduler",
    "clip_grad_norm",
    "split_params",
]

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd", "constant")


@dataclass
class ParamSplit:
    """Named parameters by optimizer role."""

    matrices: list[tuple[str, nn.Parameter]]  # sublayer 2-D weights (Muon candidates)
    decay: list[tuple[str, nn.Parameter]]  # other 2-D weights: embedding, LM head
    no_decay: list[tuple[str, nn.Parameter]]  # 1-D params, norm gains, residual.*

    def names(self) -> dict[str, list[str]]:
        return {k: [n for n, _ in getattr(self, k)] for k in ("matrices", "decay", "no_decay")}


def split_params(model: nn.Module) -> ParamSplit:
    """Sort trainable parameters into sublayer matrices, other decayed weights and no-decay ones.

    Sublayer matrices are the 2-D weights of ``nn.Linear`` modules under ``model.layers`` (all
    ``nn.Linear`` 2-D weights except ``lm_head`` when the model has no ``layers``); everything of
    ``model.residual`` and every parameter with fewer than 2 dims is no-decay. Tied parameters
    are counted once.
    """
    residual = getattr(model, "residual", None)
    residual_ids = {id(p) for p in residual.parameters()} if isinstance(residual, nn.Module) else set()
    norm_ids = {
        id(p)
        for m in model.modules()
        if isinstance(m, nn.LayerNorm | nn.RMSNorm | nn.GroupNorm) or "norm" in type(m).__name__.lower()
        for p in m.parameters(recurse=False)
    }
    scope = getattr(model, "layers", None)
    matrix_ids: set[int] = set()
    linear_root = scope if isinstance(scope, nn.Module) else model
    for name, m in linear_root.named_modules():
        if isinstance(m, nn.Linear) and (scope is not None or not name.endswith("lm_head")):
            if m.weight.ndim == 2:
                matrix_ids.add(id(m.weight))
    if hasattr(model, "lm_head") and isinstance(model.lm_head, nn.Module):
        matrix_ids -= {id(p) for p in model.lm_head.parameters()}
    emb_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    matrix_ids -= emb_ids
    split = ParamSplit([], [], [])
    for name, p in model.named_parameters():  # de-duplicates tied parameters
        if not p.requires_grad:
            continue
        if id(p) in residual_ids or id(p) in norm_ids or p.ndim < 2:
            split.no_decay.append((name, p))
        elif id(p) in matrix_ids:
            split.matrices.append((name, p))
        else:
            split.decay.append((name, p))
    return split


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the sublayer matrices, AdamW on the rest, behind one Optimizer.

    ``param_groups`` is the Muon groups followed by the AdamW groups (the same dict objects the
    inner optimizers hold), so ``LambdaLR`` and ``group["lr"]`` edits reach both.
    ``state_dict()`` is ``{"muon": ..., "adamw": ...}``.
    """

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.muon, self.adamw = muon, adamw
        super().__init__(list(muon.param_groups) + list(adamw.param_groups), defaults={})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # only used by __init__, with the inner optimizers' own group dicts: keep them shared
        self.param_groups.append(param_group)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError(f"MuonAdamW state: expected keys 'muon' and 'adamw', got {sorted(state_dict)}")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        # load_state_dict swaps in new group dicts: share them again
        self.param_groups[:] = list(self.muon.param_groups) + list(self.adamw.param_groups)

    @property
    def state(self):  # type: ignore[override]
        merged: dict = {}
        merged.update(self.muon.state)
        merged.update(self.adamw.state)
        return merged

    @state.setter
    def state(self, value) -> None:  # Optimizer.__init__ assigns an empty state
        pass


def _groups(named: Iterable[tuple[str, nn.Parameter]], **opts: Any) -> dict[str, Any]:
    named = list(named)
    return {"params": [p for _, p in named], "param_names": [n for n, _ in named], **opts}


def build_optimizer(
    model: nn.Module,
    name: str = "adamw",
    *,
    lr: float = 3e-3,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    momentum: float = 0.95,
    fused: bool | None = None,
    depth_lr_scale: float = 1.0,
    depth_weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """AdamW (``name="adamw"``) or Muon + AdamW (``name="muon"``) over ``model``'s parameters;
    ``depth_lr_scale != 1`` or ``depth_weight_decay != 0`` puts ``model.residual``'s parameters in
    a group of their own at ``lr * depth_lr_scale`` and that decoupled decay (at the defaults they
    stay in the no-decay group: the same groups as ever)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {OPTIMIZERS}, got {name!r}")
    split = split_params(model)
    adam_kw: dict[str, Any] = {"lr": lr, "betas": betas, "eps": eps}
    if fused is not None:
        adam_kw["fused"] = fused
    no_decay = [_groups(split.no_decay, weight_decay=0.0)]
    if depth_lr_scale != 1.0 or depth_weight_decay != 0.0:
        residual = getattr(model, "residual", None)
        depth = {id(p) for p in residual.parameters()} if isinstance(residual, nn.Module) else set()
        no_decay = [
            _groups([(n, p) for n, p in split.no_decay if id(p) not in depth], weight_decay=0.0),
            _groups(
                [(n, p) for n, p in split.no_decay if id(p) in depth],
                weight_decay=depth_weight_decay,
                lr=lr * depth_lr_scale,
            ),
        ]
    if name == "adamw":
        groups = [_groups(split.matrices + split.decay, weight_decay=weight_decay), *no_decay]
        return torch.optim.AdamW([g for g in groups if g["params"]], **adam_kw)
    if not split.matrices:
        raise ValueError("optimizer: muon found no 2-D sublayer weight matrices in the model")
    muon = torch.optim.Muon(
        [_groups(split.matrices, weight_decay=weight_decay)],
        lr=lr,
        momentum=momentum,
        adjust_lr_fn="match_rms_adamw",
    )
    groups = [_groups(split.decay, weight_decay=weight_decay), *no_decay]
    adamw = torch.optim.AdamW([g for g in groups if g["params"]], **adam_kw)
    return MuonAdamW(muon, adamw)


@dataclass
class LRSchedule:
    """lr factor per step. A plain object (not a closure) so LambdaLR checkpoints its fields."""

    kind: str = "cosine"
    steps: int = 1000
    warmup: int = 0
    min_ratio: float = 0.1  # min_lr / lr
    decay_frac: float = 0.2  # WSD: fraction of steps spent decaying

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {SCHEDULES}, got {self.kind!r}")
        if self.steps < 1:
            raise ValueError(f"steps: expected >= 1, got {self.steps}")
        if not 0 <= self.warmup <= self.steps:
            raise ValueError(f"warmup: expected 0 <= warmup <= steps={self.steps}, got {self.warmup}")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"min_lr: expected 0 <= min_lr <= lr, got min_lr/lr = {self.min_ratio}")
        if not 0.0 <= self.decay_frac <= 1.0:
            raise ValueError(f"decay_frac: expected a fraction in [0, 1], got {self.decay_frac}")

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        lo = self.min_ratio
        if self.kind == "cosine":
            span = max(1, self.steps - self.warmup - 1)  # the last step lands on min_lr
            t = min(1.0, (step - self.warmup) / span)
            return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * t))
        # wsd: stable at 1 until the decay phase, then linear to min_ratio at the last step
        n_decay = round(self.decay_frac * self.steps)
        start = self.steps - n_decay
        if n_decay == 0 or step < start:
            return 1.0
        t = min(1.0, (step - start + 1) / n_decay)
        return 1.0 + (lo - 1.0) * t


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    kind: str = "cosine",
    *,
    steps: int,
    warmup: int = 0,
    lr: float | None = None,
    min_lr: float = 0.0,
    decay_frac: float = 0.2,
) -> LambdaLR:
    """A ``LambdaLR`` applying :class:`LRSchedule` to every param group."""
    base = lr if lr is not None else optimizer.param_groups[0]["lr"]
    ratio = (min_lr / base) if base > 0 else 0.0
    sched = LRSchedule(kind, steps, warmup, ratio, decay_frac)
    return LambdaLR(optimizer, sched)


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Total gradient norm (before clipping); clips in place when ``max_norm > 0``. FSDP's
    sharded gradients (``DTensor``) give the norm over all shards, returned as a plain tensor."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if max_norm and max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)  # scales each p.grad
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
