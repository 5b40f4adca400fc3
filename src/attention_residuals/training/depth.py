"""Whether the depth mixing learns: what ``--log-depth`` writes while a run trains, and what the
budget study reads off trained models.

Every pseudo-query starts at zero, so at step 0 each depth read is the uniform mean of its
sources. Two kinds of numbers say how far it has moved from there:

* :func:`depth_weight_summary` (a forward on a fixed batch): over the deeper half of the
  sublayers and the final readout, the normalised entropy ``H(alpha_l) / log n_l`` of each head's
  weights (1 = uniform), the weight on the embedding and on the most recent source, and the
  queries' logit scale ``mean_l ||w_l|| sqrt(d)`` (what a key-normed logit can reach);
* :func:`parameter_step` (per optimizer step, no forward): the RMS of the depth-mixing
  parameters, of their gradient (after clipping) and of the update the optimizer applied. Adam
  moves each entry by about ``lr`` per step whatever the gradient's size, so
  ``update_rms / lr`` near 1 with a small ``param_rms`` is a query that learns at its pace limit.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from ..model import GPT

__all__ = ["depth_parameters", "depth_weight_summary", "parameter_step"]


@torch.no_grad()
def depth_weight_summary(model: GPT, idx: torch.Tensor) -> dict[str, float | bool | None]:
    """The depth weights of ``model`` on ``idx`` ``[B, T]`` in four numbers that compare across
    budgets and head counts (means over the deeper-half sublayers, the final readout and the
    heads; ``per_head`` marks that each head was summarised on its own). The logit scale is None
    for a rule without static pseudo-queries (mixing)."""
    w = model.depth_weights(idx, per_head=True)  # [L + 1, n_columns, heads], NaN: no such source
    L = w.shape[0] - 1
    rows = []
    for l in range(L // 2, L + 1):
        for h in range(w.shape[-1]):
            valid = w[l, :, h][~torch.isnan(w[l, :, h])]
            if valid.numel() < 2:
                continue
            p = valid / valid.sum()
            entropy = float(-(p * p.clamp_min(1e-12).log()).sum()) / math.log(p.numel())
            rows.append((entropy, float(p[0]), float(p[-1])))
    queries = (
        model.residual.static_queries(slice(None)) if hasattr(model.residual, "static_queries") else None
    )
    scale = float(queries.norm(dim=-1).mean() * model.config.d_model**0.5) if queries is not None else None
    n = max(len(rows), 1)
    return {
        "entropy_ratio": sum(r[0] for r in rows) / n,
        "embedding_weight": sum(r[1] for r in rows) / n,
        "latest_weight": sum(r[2] for r in rows) / n,
        "query_logit_scale": scale,
        "per_head": True,
    }


def depth_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters of ``model.residual`` (pseudo-queries, key-norm gains, mixing
    logits...): what ``--depth-lr-scale`` scales and :func:`parameter_step` watches."""
    residual = getattr(model, "residual", None)
    return [p for p in residual.parameters() if p.requires_grad] if isinstance(residual, nn.Module) else []


def _rms(tensors: list[torch.Tensor]) -> float:
    n = sum(t.numel() for t in tensors)
    return math.sqrt(sum(float(t.detach().float().pow(2).sum()) for t in tensors) / n) if n else 0.0


def parameter_step(params: list[nn.Parameter], step: Callable[[], None]) -> dict[str, float]:
    """Run ``step`` (the optimizer's) and return the RMS of ``params``, of their gradients before
    it and of the update it made."""
    before = [p.detach().clone() for p in params]
    grad_rms = _rms([p.grad for p in params if p.grad is not None])
    step()
    return {
        "param_rms": _rms(list(params)),
        "grad_rms": grad_rms,
        "update_rms": _rms([p.detach() - b for p, b in zip(params, before, strict=True)]),
    }
