"""Floor 2: fast implementations of the functional ops behind one dispatcher.

Every backend computes exactly what :func:`attention_residuals.functional.depth_attention_reference`
computes and is tested against it; :func:`depth_attention` picks one.
"""

from __future__ import annotations

import torch

from ..functional import check_depth_inputs, depth_attention_reference

__all__ = ["depth_attention", "BACKENDS"]

BACKENDS = ("reference",)


def depth_attention(
    query: torch.Tensor,
    sources: torch.Tensor,
    eps: float = 1e-6,
    *,
    heads: int = 1,
    key_norm: bool = True,
    normalize: str = "softmax",
    backend: str = "auto",
) -> torch.Tensor:
    """Softmax attention over depth: ``sum_i softmax_i(query . RMSNorm(sources_i)) sources_i``.

    ``sources``: ``[N, *batch, d]`` (the depth axis first); ``query``: ``[d]`` (a static
    pseudo-query) or broadcastable to ``[*batch, d]`` (input-dependent). Softmax over dim 0 in
    float32; the output ``[*batch, d]`` has the dtype of ``sources``. A zero query gives the
    mean of the sources.
    """
    check_depth_inputs(query, sources, heads)
    if backend not in ("auto",) + BACKENDS:
        raise ValueError(f"backend: expected one of {('auto',) + BACKENDS}, got {backend!r}")
    return depth_attention_reference(query, sources, eps, heads=heads, key_norm=key_norm, normalize=normalize)
