"""The math of Attention Residuals as pure functions (floor 1: imports only torch).

Depth attention lets layer ``l`` read a softmax-weighted mix of earlier representations::

    k_i     = RMSNorm(v_i)                      (no gain: it would be redundant with the query)
    z_i     = q_l . k_i                         (one logit per source, per token, per head)
    alpha_i = softmax_i(z_i)                    (over the source / depth axis only, in float32)
    h_l     = sum_i alpha_i v_i

``sources`` are stacked on dim 0: ``[N, *batch, d]``. Everything here is the plain reference the
fused kernels are tested against; it favours clarity over speed.

The partial-softmax :class:`DepthState` (running max, normaliser, normalised output) makes the
softmax decomposable over disjoint source sets, which is what exact two-phase inference needs:
``merge_states(state(A), state(B)) == state(A ∪ B)``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "DepthState",
    "rms_norm",
    "check_depth_inputs",
    "check_eps",
    "stack_sources",
    "depth_logits",
    "depth_attention_reference",
    "depth_state",
    "depth_state_batched",
    "merge_states",
]


def rms_norm(x: torch.Tensor, eps: float = 1e-6, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, via ``F.rms_norm``."""
    return F.rms_norm(x, (x.shape[-1],), weight=weight, eps=eps)


def check_eps(eps: float) -> None:
    """``eps`` (the RMSNorm epsilon of the keys) must be a finite real number ``>= 0``.

    ``eps = 0`` is allowed (the exact RMSNorm, e.g. for float64 gradchecks), but a source whose
    channels are all zero then has no defined key (0 / 0) and gives NaN: use ``eps > 0`` unless
    the sources are known to be non-zero. A negative ``eps`` can make ``mean(v^2) + eps``
    negative and its square root NaN, so it is rejected here rather than discovered in the output.
    """
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps: expected a real number >= 0, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")


def check_depth_inputs(
    query: torch.Tensor, sources: torch.Tensor, heads: int = 1, eps: float | None = None
) -> None:
    """Validate the arguments of depth attention; every error names the argument at fault.

    ``eps``, when given, is checked by :func:`check_eps`.
    """
    if not isinstance(sources, torch.Tensor):
        raise TypeError(f"sources: expected a torch.Tensor, got {type(sources).__name__}")
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"query: expected a torch.Tensor, got {type(query).__name__}")
    if not sources.is_floating_point():
        raise TypeError(f"sources: expected a floating-point dtype, got {sources.dtype}")
    if not query.is_floating_point():
        raise TypeError(f"query: expected a floating-point dtype, got {query.dtype}")
    if sources.ndim < 2:
        raise ValueError(f"sources: expected shape [N, *batch, d] with at least 2 dims, got {tuple(sources.shape)}")
    if sources.shape[0] == 0:
        raise ValueError("sources: need at least one source (N = 0 along dim 0)")
    d = sources.shape[-1]
    if d == 0:
        raise ValueError(
            f"sources: the channel dimension d must be > 0, got sources of shape {tuple(sources.shape)}"
        )
    if query.ndim == 0 or query.shape[-1] != d:
        raise ValueError(
            f"query: last dim must equal the sources' hidden size d={d}, got query shape {tuple(query.shape)}"
        )
    batch, query_batch = tuple(sources.shape[1:-1]), tuple(query.shape[:-1])
    # broadcasts to exactly `batch`: plain integers, no torch call (this runs on every op, often
    # right after a kernel has flushed the caches)
    if len(query_batch) > len(batch) or any(q not in (1, b) for q, b in zip(query_batch[::-1], batch[::-1])):
        raise ValueError(
            f"query: shape {tuple(query.shape)} does not broadcast to the sources' batch shape "
            f"{tuple(batch)} + (d={d},)"
        )
    if heads < 1 or d % heads != 0:
        raise ValueError(f"heads: must be a positive divisor of d={d}, got {heads}")
    if eps is not None:
        check_eps(eps)


def stack_sources(sources: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``sources`` as one ``[N, *batch, d]`` tensor: a tensor is returned as is, a list or tuple of
    ``[*batch, d]`` tensors (the fast paths take them without copying) is checked and stacked."""
    if isinstance(sources, torch.Tensor):
        return sources
    check_source_list(sources)
    return torch.stack(list(sources))


def check_source_list(sources: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
    """A sequence of sources must hold tensors of one shape, dtype and device."""
    if not isinstance(sources, (list, tuple)):
        raise TypeError(f"sources: expected a torch.Tensor or a list of tensors, got {type(sources).__name__}")
    if not sources:
        raise ValueError("sources: need at least one source (got an empty list)")
    first = sources[0]
    for i, s in enumerate(sources):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"sources[{i}]: expected a torch.Tensor, got {type(s).__name__}")
        if s.shape != first.shape or s.dtype != first.dtype or s.device != first.device:
            raise ValueError(
                f"sources[{i}]: every source must match sources[0] (shape {tuple(first.shape)}, {first.dtype}, "
                f"{first.device}), got shape {tuple(s.shape)}, {s.dtype}, {s.device}"
            )


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float32 for half types, float64 kept (so gradcheck is exact)."""
    return torch.promote_types(dtype, torch.float32)


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.unflatten(-1, (heads, x.shape[-1] // heads))


def depth_logits(
    query: torch.Tensor,
    sources: torch.Tensor,
    eps: float = 1e-6,
    *,
    heads: int = 1,
    key_norm: bool = True,
) -> torch.Tensor:
    """Logits ``z = q . RMSNorm(v)`` in float32 (float64 for float64 inputs), shape ``[N, *batch, heads]``.

    With ``heads = H`` the hidden dim is split into H groups; each group's key is RMSNorm'd on
    its own and gets its own logit (the report's multi-head depth-attention ablation).
    """
    keys = _split_heads(sources.to(_acc(sources.dtype)), heads)
    if key_norm:
        keys = rms_norm(keys, eps)
    return (keys * _split_heads(query.to(_acc(sources.dtype)), heads)).sum(-1)


def _expand_heads(weights: torch.Tensor, d: int) -> torch.Tensor:
    """``[..., H]`` per-head weights -> ``[..., d]`` per-channel weights."""
    heads = weights.shape[-1]
    return weights.repeat_interleave(d // heads, dim=-1) if heads > 1 else weights


def depth_attention_reference(
    query: torch.Tensor,
    sources: torch.Tensor,
    eps: float = 1e-6,
    *,
    heads: int = 1,
    key_norm: bool = True,
    normalize: str = "softmax",
) -> torch.Tensor:
    """Plain depth attention: ``sum_i softmax_i(q . RMSNorm(v_i)) v_i`` (see module docstring).

    ``normalize="sigmoid"`` replaces the softmax by an independent gate ``sigmoid(z_i)`` per
    source (the report's ablation; no competition between sources, weights need not sum to 1).
    Computed in float32, returned in ``sources.dtype``.
    """
    check_depth_inputs(query, sources, heads, eps)
    z = depth_logits(query, sources, eps, heads=heads, key_norm=key_norm)
    if normalize == "softmax":
        weights = torch.softmax(z, dim=0)
    elif normalize == "sigmoid":
        weights = torch.sigmoid(z)
    else:
        raise ValueError(f"normalize: expected 'softmax' or 'sigmoid', got {normalize!r}")
    out = (_expand_heads(weights, sources.shape[-1]) * sources.to(_acc(sources.dtype))).sum(0)
    return out.to(sources.dtype)


@dataclass
class DepthState:
    """Partial softmax over a subset of sources, per token and head (all float32).

    ``max``: running max of the logits ``[*batch, H]``; ``sum``: ``sum_i exp(z_i - max)``
    ``[*batch, H]``; ``out``: the normalised output over the subset ``[*batch, d]``.
    """

    max: torch.Tensor
    sum: torch.Tensor
    out: torch.Tensor

    def output(self, dtype: torch.dtype) -> torch.Tensor:
        return self.out.to(dtype)

    def __getitem__(self, index: int) -> DepthState:
        """One query's state out of a batched (leading-``Q``) state."""
        return DepthState(self.max[index], self.sum[index], self.out[index])


def depth_state(
    query: torch.Tensor,
    sources: torch.Tensor,
    eps: float = 1e-6,
    *,
    heads: int = 1,
    key_norm: bool = True,
) -> DepthState:
    """Softmax state of ``query`` (broadcastable to ``[*batch, d]``) over ``sources``."""
    check_depth_inputs(query, sources, heads, eps)
    z = depth_logits(query, sources, eps, heads=heads, key_norm=key_norm)  # [N, *batch, H]
    m = z.amax(dim=0)
    p = torch.exp(z - m)
    s = p.sum(0)
    out = (_expand_heads(p / s, sources.shape[-1]) * sources.to(_acc(sources.dtype))).sum(0)
    return DepthState(m, s, out)


def depth_state_batched(
    queries: torch.Tensor,
    sources: torch.Tensor,
    eps: float = 1e-6,
    *,
    heads: int = 1,
    key_norm: bool = True,
) -> DepthState:
    """States of ``Q`` static queries ``[Q, d]`` over the same ``sources`` in one pass.

    Phase 1 of two-phase inference: the keys are normalised once and shared by all ``Q``
    queries, so the sources are read once instead of ``Q`` times. Returns a state whose
    tensors carry a leading ``Q`` dim: ``max``/``sum`` ``[Q, *batch, H]``, ``out`` ``[Q, *batch, d]``.
    """
    if queries.ndim != 2:
        raise ValueError(f"queries: expected shape [Q, d], got {tuple(queries.shape)}")
    check_depth_inputs(queries[0], sources, heads, eps)
    n, d = sources.shape[0], sources.shape[-1]
    batch = sources.shape[1:-1]
    keys = _split_heads(sources.to(_acc(sources.dtype)), heads)  # [N, *batch, H, dh]
    if key_norm:
        keys = rms_norm(keys, eps)
    q = _split_heads(queries.to(_acc(sources.dtype)), heads)  # [Q, H, dh]
    k = keys.reshape(n, -1, heads, d // heads)  # [N, M, H, dh]
    z = torch.einsum("qhc,nmhc->qnmh", q, k)  # [Q, N, M, H]
    m = z.amax(dim=1)
    p = torch.exp(z - m.unsqueeze(1))
    s = p.sum(1)
    v = sources.to(_acc(sources.dtype)).reshape(n, -1, heads, d // heads)
    out = torch.einsum("qnmh,nmhc->qmhc", p / s.unsqueeze(1), v)
    qn = queries.shape[0]
    return DepthState(
        m.reshape(qn, *batch, heads), s.reshape(qn, *batch, heads), out.reshape(qn, *batch, d)
    )


def merge_states(a: DepthState, b: DepthState) -> DepthState:
    """Exact merge of two partial softmaxes over disjoint source sets (online softmax)."""
    m = torch.maximum(a.max, b.max)
    sa = a.sum * torch.exp(a.max - m)
    sb = b.sum * torch.exp(b.max - m)
    s = sa + sb
    d = a.out.shape[-1]
    out = _expand_heads(sa / s, d) * a.out + _expand_heads(sb / s, d) * b.out
    return DepthState(m, s, out)
