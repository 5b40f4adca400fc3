"""Floor 2: fast implementations of the functional ops behind one dispatcher.

Every backend computes exactly what :func:`attention_residuals.functional.depth_attention_reference`
computes and is tested against it; :func:`depth_attention` picks one:

``reference``  the plain formula of ``functional`` (autograd through every intermediate).
``fused``      :class:`~.autograd.DepthAttentionFunction` on eager torch ops: any device and
               dtype; saves only the sources, the query and one float32 scalar per token and head.
``compiled``   the same Function on a C kernel (one pass over the sources, online softmax), built
               with the system compiler at first use: CPU, float32 / bfloat16 / float64.
``triton``     the same Function on Triton kernels: CUDA, float32 / bfloat16 / float16 (CPU tensors
               too under ``TRITON_INTERPRET=1``, for tests).

``backend="auto"`` takes ``triton`` for CUDA tensors, ``compiled`` for CPU tensors, and ``fused``
otherwise or when those are unavailable (no triton, no C compiler) or while ``torch.compile`` traces
the call. ``normalize="sigmoid"`` always runs the reference formula. A forced backend that cannot
run raises ``RuntimeError`` saying why; :func:`backend_status` lists what can run and why not.
``with use_backend(name):`` changes what ``"auto"`` means inside a block (e.g. a whole model on
the reference formula).

``sources`` may be one ``[N, *batch, d]`` tensor or a list of N ``[*batch, d]`` tensors: the
``compiled`` kernels read a list in place (a table of pointers), so a model need not stack its
sources -- a copy of all of them per layer, and in training one more saved for backward.

Two-phase inference: :func:`depth_states_batched` (phase 1: Q static queries over the known
sources, one read of them) and :func:`depth_attention_merged` (phase 2: merge the sources added
since), forward-only kernels on the same backends, the functional formulas under autograd.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence

import torch

from ..functional import (
    DepthState,
    check_depth_inputs,
    check_source_list,
    depth_attention_reference,
    depth_state,
    depth_state_batched,
    merge_states,
    stack_sources,
)
from . import autograd as _autograd
from . import cpu as _cpu

__all__ = [
    "depth_attention",
    "depth_states_batched",
    "depth_attention_merged",
    "BACKENDS",
    "backend_status",
    "select_backend",
    "use_backend",
]

BACKENDS = ("reference", "fused", "compiled", "triton")
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_triton_error: list[str | None] = []  # memo of the lazy import: [None] ok, [msg] failed


def _triton_import_error() -> str | None:
    if not _triton_error:
        try:
            from . import triton_kernels

            _autograd.register_backend("triton", *_autograd.stacking(triton_kernels.forward, triton_kernels.backward))
            _triton_error.append(None)
        except Exception as exc:  # ImportError, or a triton too old / broken
            _triton_error.append(
                f"triton is not importable ({type(exc).__name__}: {exc}); pip install triton"
            )
    return _triton_error[0]


def _compiled_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    reason = _cpu.unavailable_reason(device, dtype)
    if reason is None:
        _autograd.register_backend("compiled", _cpu.forward, _cpu.backward)
    return reason


def _triton_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    if dtype not in _TRITON_DTYPES:
        return f"the triton backend supports float32, bfloat16 and float16, got {dtype}"
    if device.type != "cuda" and not (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return f"the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got device {device}"
    return _triton_import_error()


def backend_status(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> dict[str, str | None]:
    """``{backend: None if it can run on (device, dtype) else the reason}``."""
    device = torch.device(device)
    return {
        "reference": None,
        "fused": None,
        "compiled": _compiled_reason(device, dtype),
        "triton": _triton_reason(device, dtype),
    }


_override = threading.local()


@contextlib.contextmanager
def use_backend(backend: str):
    """Within the block, ``backend="auto"`` calls run ``backend`` instead (this thread only).

    For models that call :func:`depth_attention` internally, e.g. to benchmark or debug a whole
    model on the reference formula: ``with use_backend("reference"): model(idx)``.
    """
    if backend not in ("auto",) + BACKENDS:
        raise ValueError(f"backend: expected one of {('auto',) + BACKENDS}, got {backend!r}")
    previous = getattr(_override, "backend", None)
    _override.backend = None if backend == "auto" else backend
    try:
        yield
    finally:
        _override.backend = previous


def select_backend(sources: torch.Tensor, normalize: str = "softmax", backend: str = "auto") -> str:
    """The backend :func:`depth_attention` would run for these arguments (raises if forced and unavailable)."""
    if backend not in ("auto",) + BACKENDS:
        raise ValueError(f"backend: expected one of {('auto',) + BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = getattr(_override, "backend", None) or "auto"
    if normalize != "softmax" or backend == "reference":
        return "reference"
    device, dtype = sources.device, sources.dtype
    if backend == "auto":
        if torch.compiler.is_compiling():
            return "fused"
        if device.type == "cuda" and _triton_reason(device, dtype) is None:
            return "triton"
        if device.type == "cpu" and _compiled_reason(device, dtype) is None:
            return "compiled"
        return "fused"
    if backend == "fused":
        return "fused"
    reason = _compiled_reason(device, dtype) if backend == "compiled" else _triton_reason(device, dtype)
    if reason is not None:
        raise RuntimeError(f"backend={backend!r} is unavailable: {reason}")
    return backend


#: what the ops accept as sources: one ``[N, *batch, d]`` tensor or N ``[*batch, d]`` tensors
Sources = torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]


def _checked(query: torch.Tensor, sources: Sources, heads: int, eps: float) -> Sequence[torch.Tensor]:
    """Validate ``(query, sources, heads, eps)`` and return the sources as a sequence of N
    ``[*batch, d]`` tensors: a stacked tensor is returned as it is (indexing and iterating it give
    its slices, without making N views on every call)."""
    if isinstance(sources, torch.Tensor):
        check_depth_inputs(query, sources, heads, eps)
        srcs = sources
    else:
        check_source_list(sources)
        srcs = list(sources)
        check_depth_inputs(query, srcs[0].expand(len(srcs), *srcs[0].shape), heads, eps)
    if query.device != srcs[0].device:
        raise ValueError(f"query: on {query.device} but sources are on {srcs[0].device}")
    return srcs


def _flat(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    d = sources[0].shape[-1]
    return [s.detach().reshape(-1, d).contiguous() for s in sources]


def depth_attention(
    query: torch.Tensor,
    sources: Sources,
    eps: float = 1e-6,
    *,
    heads: int = 1,
    key_norm: bool = True,
    normalize: str = "softmax",
    backend: str = "auto",
) -> torch.Tensor:
    """Softmax attention over depth: ``sum_i softmax_i(query . RMSNorm(sources_i)) sources_i``.

    ``sources``: ``[N, *batch, d]`` (the depth axis first) or a list of N ``[*batch, d]`` tensors;
    ``query``: ``[d]`` (a static pseudo-query) or broadcastable to ``[*batch, d]``
    (input-dependent). Softmax over the sources in float32; the output ``[*batch, d]`` has the
    dtype of the sources. A zero query gives the mean of the sources. ``heads=H`` splits d into H
    groups with a softmax each; ``key_norm=False`` uses the raw sources as keys;
    ``normalize="sigmoid"`` gates each source independently. ``backend``: ``"auto"`` or one of
    :data:`BACKENDS` (see the module docstring). ``eps``: the keys' RMSNorm epsilon, a finite
    number ``>= 0``; ``0`` is the exact RMSNorm (NaN for a source that is all zeros), a negative
    ``eps`` is rejected (see :func:`~attention_residuals.functional.check_eps`).
    """
    srcs = _checked(query, sources, heads, eps)
    if normalize not in ("softmax", "sigmoid"):
        raise ValueError(f"normalize: expected 'softmax' or 'sigmoid', got {normalize!r}")
    name = select_backend(srcs[0], normalize, backend)
    if name == "reference":
        return depth_attention_reference(
            query, stack_sources(sources), eps, heads=heads, key_norm=key_norm, normalize=normalize
        )
    batch, d = srcs[0].shape[:-1], srcs[0].shape[-1]
    one_tensor = isinstance(sources, torch.Tensor)
    vs = [sources.reshape(len(srcs), -1, d)] if one_tensor else [s.reshape(-1, d) for s in srcs]
    if query.shape[:-1].numel() == 1:  # [d], [1, d], [1, 1, d]: one query for every token
        q = query.reshape(d)
    else:
        q = query.expand(*batch, d).reshape(-1, d)
    out = _autograd.DepthAttentionFunction.apply(q, float(eps), int(heads), bool(key_norm), name, one_tensor, *vs)
    return out.reshape(*batch, d)


# ----------------------------------------------------------------------------------------------
# two-phase inference: forward-only kernels (autograd falls back to the functional formulas)


def _two_phase_impl(source: torch.Tensor, backend: str, needs_grad: bool):
    """``(states, merge)`` kernels on lists of ``[M, d]`` sources for a two-phase step, or None
    for the functional formulas."""
    name = select_backend(source, "softmax", backend)
    if needs_grad or name in ("reference", "fused"):
        return None
    if name == "compiled":
        return _cpu.states, _cpu.merge
    _triton_import_error()
    from . import triton_kernels

    return (
        lambda qs, vs, *a: triton_kernels.states(qs, _autograd.stacked(vs), *a),
        lambda q, vs, *a: triton_kernels.merge(q, _autograd.stacked(vs), *a),
    )


def depth_states_batched(
    queries: torch.Tensor,
    sources: Sources,
    eps: float = 1e-6,
    *,
    heads: int = 1,
    key_norm: bool = True,
    backend: str = "auto",
) -> DepthState:
    """Phase 1 of two-phase inference: the states of ``Q`` static queries ``[Q, d]`` over the same
    ``sources`` (``[N, *batch, d]`` or a list of N ``[*batch, d]``), reading the sources once.

    Same states as :func:`attention_residuals.functional.depth_state_batched` (``max`` is returned
    as the log-sum-exp and ``sum`` as 1, an equivalent state). The ``compiled`` and ``triton``
    kernels are forward-only: when autograd needs a graph, the functional formula runs instead.
    """
    if queries.ndim != 2:
        raise ValueError(f"queries: expected shape [Q, d], got {tuple(queries.shape)}")
    srcs = _checked(queries[0], sources, heads, eps)
    needs_grad = torch.is_grad_enabled() and (queries.requires_grad or any(s.requires_grad for s in srcs))
    impl = _two_phase_impl(srcs[0], backend, needs_grad)
    if impl is None:
        return depth_state_batched(queries, stack_sources(sources), eps, heads=heads, key_norm=key_norm)
    batch, d, nq = srcs[0].shape[:-1], srcs[0].shape[-1], queries.shape[0]
    qs = queries.detach().to(_autograd.acc_dtype(srcs[0].dtype)).contiguous()
    lse, out = impl[0](qs, _flat(srcs), float(eps), heads, key_norm)
    lse = lse.reshape(nq, *batch, heads)
    return DepthState(lse, torch.ones_like(lse), out.reshape(nq, *batch, d))


def depth_attention_merged(
    state: DepthState,
    query: torch.Tensor,
    sources: Sources,
    eps: float = 1e-6,
    *,
    heads: int = 1,
    key_norm: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """Phase 2 of two-phase inference: ``state`` (of ``query`` over earlier sources) merged with
    ``query`` over ``sources`` (``[R, *batch, d]`` or a list of R ``[*batch, d]``) by online softmax;
    returns the output ``[*batch, d]`` in the sources' dtype. Equals
    ``merge_states(state, depth_state(query, sources)).output(dtype)`` in one pass (forward-only
    kernels; the functional formulas when autograd needs a graph or the query is not static)."""
    srcs = _checked(query, sources, heads, eps)
    tensors = (query, state.max, state.sum, state.out, *srcs)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    static = query.shape[:-1].numel() == 1
    impl = _two_phase_impl(srcs[0], backend, needs_grad) if static else None
    if impl is None:
        intra = depth_state(query, stack_sources(sources), eps, heads=heads, key_norm=key_norm)
        return merge_states(state, intra).output(srcs[0].dtype)
    batch, d = srcs[0].shape[:-1], srcs[0].shape[-1]
    acc = _autograd.acc_dtype(srcs[0].dtype)

    def flat(t: torch.Tensor, last: int) -> torch.Tensor:
        return t.detach().to(acc).expand(*batch, last).reshape(-1, last).contiguous()

    out = impl[1](
        query.detach().to(acc).reshape(d).contiguous(),
        _flat(srcs),
        flat(state.max, heads),
        flat(state.sum, heads),
        flat(state.out, d),
        float(eps),
        heads,
        key_norm,
    )
    return out.reshape(*batch, d)
