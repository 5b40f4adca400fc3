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

Precision contract (every function here and every backend of :mod:`attention_residuals.kernels`
follows it, as production mixed-precision implementations do: sources stay in the activation
dtype, the softmax and the weighted sum never round to it until the output):

* **activation dtype** (:func:`activation_dtype`): when autocast is enabled for the sources' device
  type, the autocast dtype (``torch.get_autocast_dtype``) -- unless a source is float64, which
  autocast never touches; otherwise ``torch.result_type`` over the sources (a mixed list is
  promoted, like any torch op: ``[float32, bfloat16]`` -> float32, never an error).
* **sources**: read in the activation dtype. A source in another floating dtype (e.g. the float32
  token embedding among bfloat16 sublayer outputs under autocast) is cast to it once per call,
  as autocast casts the inputs of a matmul; its gradient flows back through that cast, so each
  source gets its gradient in its own dtype (with the activation dtype's precision). The cast is a copy of that source (and, in
  training, one more saved for backward): a model should keep its sources in one dtype (cast the
  embedding once per forward) to pay nothing.
* **accumulation dtype** (:func:`accumulation_dtype`): float32 (float64 for float64 activations).
  The query is cast to it; the keys' RMSNorm, the logits, the softmax statistics (max, sum,
  log-sum-exp), the weighted sum and every gradient are computed in it, with autocast disabled
  (autocast would otherwise run the einsums in bfloat16).
* **output**: the weighted sum rounded once to the activation dtype. :class:`DepthState` keeps
  ``max``, ``sum`` and ``out`` in the accumulation dtype and remembers the activation dtype for
  :meth:`DepthState.output`. The query's gradient is in the query's dtype.

float64 inputs (without autocast) are computed in float64 throughout, so gradchecks stay exact.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "DepthState",
    "rms_norm",
    "activation_dtype",
    "accumulation_dtype",
    "autocast_disabled",
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


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (e.g. meta)
        return False


def activation_dtype(
    sources: torch.Tensor | Sequence[torch.Tensor], extra: Sequence[torch.dtype] = ()
) -> torch.dtype:
    """The dtype the sources are read in and the output is returned in (see the module docstring).

    ``sources``: one ``[N, *batch, d]`` tensor or a sequence of ``[*batch, d]`` tensors; ``extra``:
    the dtypes of more sources (e.g. those a :class:`DepthState` was made from). Under autocast for
    their device type, the autocast dtype (float64 excepted: autocast leaves float64 alone);
    otherwise the promoted dtype of them all.
    """
    tensors = [sources] if isinstance(sources, torch.Tensor) else sources
    dtypes = [t.dtype for t in tensors] + list(extra)
    if torch.float64 not in dtypes and _autocast_enabled(tensors[0].device.type):
        return torch.get_autocast_dtype(tensors[0].device.type)
    return functools.reduce(torch.promote_types, dtypes)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where logits, softmax statistics and sums live: float32 for half types and float32, float64
    kept (so float64 gradchecks are exact)."""
    return torch.promote_types(dtype, torch.float32)


def autocast_disabled(device_type: str) -> contextlib.AbstractContextManager:
    """A context with autocast off for ``device_type`` (a ``nullcontext`` when it is off already):
    the float32 parts of the contract must not be rounded by autocast's bfloat16 einsums. A plain
    context manager, not a generator, so ``torch.compile`` traces it."""
    if _autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def check_eps(eps: float, name: str = "eps") -> None:
    """``eps`` (the RMSNorm epsilon of the keys; ``name`` says which argument it is in the errors)
    must be a finite real number ``>= 0``.

    ``eps = 0`` is allowed (the exact RMSNorm, e.g. for float64 gradchecks), but a source whose
    channels are all zero then has no defined key (0 / 0) and gives NaN: use ``eps > 0`` unless
    the sources are known to be non-zero. A negative ``eps`` can make ``mean(v^2) + eps``
    negative and its square root NaN, so it is rejected here rather than discovered in the output.
    """
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{name}: expected a real number >= 0, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{name}: expected a finite number >= 0, got {eps!r}")


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
        raise ValueError(
            f"sources: expected shape [N, *batch, d] with at least 2 dims, got {tuple(sources.shape)}"
        )
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


def stack_sources(
    sources: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...], dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``sources`` as one ``[N, *batch, d]`` tensor in ``dtype`` (default: their
    :func:`activation_dtype`): a tensor is returned as is when it has that dtype, a list or tuple of
    ``[*batch, d]`` tensors (the fast paths take them without copying) is checked and stacked, each
    source cast to the activation dtype on the way (autograd flows back through the cast)."""
    if isinstance(sources, torch.Tensor):
        return sources.to(dtype or activation_dtype(sources))
    check_source_list(sources)
    dtype = dtype or activation_dtype(sources)
    return torch.stack([s.to(dtype) for s in sources])


def check_source_list(sources: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
    """A sequence of sources must hold floating-point tensors of one shape and device; their
    dtypes may differ (they are read in the :func:`activation_dtype`)."""
    if not isinstance(sources, (list, tuple)):
        raise TypeError(
            f"sources: expected a torch.Tensor or a list of tensors, got {type(sources).__name__}"
        )
    if not sources:
        raise ValueError("sources: need at least one source (got an empty list)")
    first = sources[0]
    for i, s in enumerate(sources):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"sources[{i}]: expected a torch.Tensor, got {type(s).__name__}")
        if not s.is_floating_point():
            raise TypeError(f"sources[{i}]: expected a floating-point dtype, got {s.dtype}")
        if s.shape != first.shape or s.device != first.device:
            raise ValueError(
                f"sources[{i}]: every source must match sources[0] (shape {tuple(first.shape)}, {first.device}), "
                f"got shape {tuple(s.shape)}, {s.device}"
            )


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.unflatten(-1, (heads, x.shape[-1] // heads))


def _upcast(sources: torch.Tensor, act: torch.dtype) -> torch.Tensor:
    """``sources`` read in the activation dtype ``act`` (settled by the caller *before* it turns
    autocast off), then widened to the accumulation dtype -- once: the keys and the weighted sum
    use the same widened tensor, so autograd sums their gradients in float32 and rounds the sum
    once (two casts would round each part, then add in bfloat16)."""
    return sources.to(act).to(accumulation_dtype(act))


def _logits(query: torch.Tensor, v: torch.Tensor, eps: float, heads: int, key_norm: bool) -> torch.Tensor:
    """Logits of sources ``v`` already widened by :func:`_upcast`, in their (accumulation) dtype."""
    keys = _split_heads(v, heads)
    if key_norm:
        keys = rms_norm(keys, eps)
    return (keys * _split_heads(query.to(v.dtype), heads)).sum(-1)


def depth_logits(
    query: torch.Tensor,
    sources: torch.Tensor,
    eps: float = 1e-6,
    *,
    heads: int = 1,
    key_norm: bool = True,
) -> torch.Tensor:
    """Logits ``z = q . RMSNorm(v)`` in float32 (float64 for float64 inputs), shape ``[N, *batch, heads]``.

    ``sources`` ``[N, *batch, d]`` are read in their :func:`activation_dtype` (under autocast: the
    autocast dtype), as every depth-attention op reads them. With ``heads = H`` the hidden dim is
    split into H groups; each group's key is RMSNorm'd on its own and gets its own logit (the
    report's multi-head depth-attention ablation).
    """
    act = activation_dtype(sources)
    with autocast_disabled(sources.device.type):
        return _logits(query, _upcast(sources, act), eps, heads, key_norm)


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

    ``query`` broadcastable to ``[*batch, d]``, ``sources`` ``[N, *batch, d]`` -> ``[*batch, d]``.
    ``normalize="sigmoid"`` replaces the softmax by an independent gate ``sigmoid(z_i)`` per
    source (the report's ablation; no competition between sources, weights need not sum to 1).
    Sources read in the activation dtype, computed in float32, returned in the activation dtype
    (the precision contract of the module docstring).
    """
    check_depth_inputs(query, sources, heads, eps)
    if normalize not in ("softmax", "sigmoid"):
        raise ValueError(f"normalize: expected 'softmax' or 'sigmoid', got {normalize!r}")
    act = activation_dtype(sources)
    with autocast_disabled(sources.device.type):
        v = _upcast(sources, act)
        z = _logits(query, v, eps, heads, key_norm)
        weights = torch.softmax(z, dim=0) if normalize == "softmax" else torch.sigmoid(z)
        out = (_expand_heads(weights, v.shape[-1]) * v).sum(0)
    return out.to(act)


@dataclass
class DepthState:
    """Partial softmax over a subset of sources, per token and head.

    ``max``: running max of the logits ``[*batch, H]``; ``sum``: ``sum_i exp(z_i - max)``
    ``[*batch, H]``; ``out``: the normalised output over the subset ``[*batch, d]`` -- all three in
    the accumulation dtype (float32; float64 for float64 sources), never rounded to the
    activation dtype, so merges stay exact. ``dtype``: the activation dtype of the sources the
    state was made from (None for a state built by hand), the default of :meth:`output`.
    """

    max: torch.Tensor
    sum: torch.Tensor
    out: torch.Tensor
    dtype: torch.dtype | None = None

    def output(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The output ``[*batch, d]`` rounded once to ``dtype``, by default the activation dtype
        recorded in the state (the accumulation dtype when none was)."""
        return self.out.to(dtype or self.dtype or self.out.dtype)

    def __getitem__(self, index: int) -> DepthState:
        """One query's state out of a batched (leading-``Q``) state."""
        return DepthState(self.max[index], self.sum[index], self.out[index], self.dtype)


def depth_state(
    query: torch.Tensor,
    sources: torch.Tensor,
    eps: float = 1e-6,
    *,
    heads: int = 1,
    key_norm: bool = True,
) -> DepthState:
    """Softmax state of ``query`` (broadcastable to ``[*batch, d]``) over ``sources``
    ``[N, *batch, d]`` (read in their activation dtype; statistics in float32)."""
    check_depth_inputs(query, sources, heads, eps)
    act = activation_dtype(sources)
    with autocast_disabled(sources.device.type):
        v = _upcast(sources, act)
        z = _logits(query, v, eps, heads, key_norm)  # [N, *batch, H]
        m = z.amax(dim=0)
        p = torch.exp(z - m)
        s = p.sum(0)
        out = (_expand_heads(p / s, v.shape[-1]) * v).sum(0)
    return DepthState(m, s, out, act)


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
    tensors carry a leading ``Q`` dim: ``max``/``sum`` ``[Q, *batch, H]``, ``out`` ``[Q, *batch, d]``
    (accumulation dtype; the sources are read in their activation dtype).
    """
    if queries.ndim != 2:
        raise ValueError(f"queries: expected shape [Q, d], got {tuple(queries.shape)}")
    check_depth_inputs(queries[0], sources, heads, eps)
    act = activation_dtype(sources)
    n, d = sources.shape[0], sources.shape[-1]
    batch = sources.shape[1:-1]
    with autocast_disabled(sources.device.type):
        v = _upcast(sources, act)
        keys = _split_heads(v, heads)  # [N, *batch, H, dh]
        if key_norm:
            keys = rms_norm(keys, eps)
        q = _split_heads(queries.to(v.dtype), heads)  # [Q, H, dh]
        k = keys.reshape(n, -1, heads, d // heads)  # [N, M, H, dh]
        z = torch.einsum("qhc,nmhc->qnmh", q, k)  # [Q, N, M, H]
        m = z.amax(dim=1)
        p = torch.exp(z - m.unsqueeze(1))
        s = p.sum(1)
        out = torch.einsum("qnmh,nmhc->qmhc", p / s.unsqueeze(1), v.reshape(n, -1, heads, d // heads))
    qn = queries.shape[0]
    return DepthState(
        m.reshape(qn, *batch, heads), s.reshape(qn, *batch, heads), out.reshape(qn, *batch, d), act
    )


def merge_states(a: DepthState, b: DepthState) -> DepthState:
    """Exact merge of two partial softmaxes over disjoint source sets (online softmax), in the
    states' accumulation dtype; the activation dtype is the promotion of the two (as
    :func:`activation_dtype` of the union of their sources would be)."""
    m = torch.maximum(a.max, b.max)
    sa = a.sum * torch.exp(a.max - m)
    sb = b.sum * torch.exp(b.max - m)
    s = sa + sb
    d = a.out.shape[-1]
    out = _expand_heads(sa / s, d) * a.out + _expand_heads(sb / s, d) * b.out
    if a.dtype is None or b.dtype is None:
        dtype = a.dtype or b.dtype
    else:
        dtype = torch.promote_types(a.dtype, b.dtype)
    return DepthState(m, s, out, dtype)
