"""Floor 2: fast implementations of the functional ops behind one dispatcher.

Every backend computes exactly what :func:`attention_residuals.functional.depth_attention_reference`
computes and is tested against it; :func:`depth_attention` picks one from the registry
(:data:`BACKENDS`, in this order):

``reference``  the plain formula of ``functional`` (autograd through every intermediate).
``fused``      :class:`~.autograd.DepthAttentionFunction` on eager torch ops: any device and
               dtype; saves only the sources, the query and one float32 scalar per token and head.
``compiled``   the same Function on a C kernel (one pass over the sources, online softmax), built
               with the system compiler at first use: CPU, float32 / bfloat16 / float64.
``triton``     the same Function on Triton kernels: CUDA, float32 / bfloat16 / float16 (CPU tensors
               too under ``TRITON_INTERPRET=1``, for tests).

``backend="auto"`` takes ``triton`` for CUDA tensors, ``compiled`` for CPU tensors, and ``fused``
otherwise or when those are unavailable (no triton, no C compiler). While ``torch.compile`` traces
the call, only backends it can trace: ``compiled`` (the C kernel registered as the custom operators
``attention_residuals::depth_attention_cpu`` and its backward, see :mod:`.cpu`) for CPU tensors,
``fused`` otherwise; the two-phase ops run the functional formulas there. Tracing cannot build the C
kernel, so there only its device and dtype are checked; where it cannot be built, the operator
computes the eager formulas instead (``auto``) or raises (a forced ``backend="compiled"``). ``normalize="sigmoid"`` always runs the reference formula. A forced backend that cannot
run raises ``RuntimeError`` saying why; :func:`backend_status` lists what can run and why not.
``with use_backend(name):`` changes what ``"auto"`` means inside a block (e.g. a whole model on
the reference formula).

Precision: every op and backend follows the contract of :mod:`attention_residuals.functional`.
The dispatcher settles the activation dtype first (under autocast: the autocast dtype; otherwise
the promoted dtype of the sources), chooses the backend for it, and casts any source of another
dtype to it (a copy of that source; autograd takes its gradient back through the cast), so a
backend always sees sources of one dtype; it runs the backend with autocast off. The query goes
to float32 (float64 for float64 activations), the outputs come back in the activation dtype, the
two-phase states in float32.

``sources`` may be one ``[N, *batch, d]`` tensor or a list of N ``[*batch, d]`` tensors: the
``compiled`` kernels read a list in place (a table of pointers), so a model need not stack its
sources -- a copy of all of them per layer, and in training one more saved for backward.

Two-phase inference: :func:`depth_states_batched` (phase 1: Q static queries over the known
sources, one read of them) and :func:`depth_attention_merged` (phase 2: merge the sources added
since), forward-only kernels on the same backends, the functional formulas under autograd.

The registry (``_REGISTRY`` below) is filled in one place at import time, cheaply: it holds, per
backend, a function saying whether it can run on a (device, dtype) and one returning its kernels.
Nothing is imported or built until a backend is first asked for: the C kernel's build and the
``import triton`` happen then, once, and their outcome (the kernels or the reason) is cached.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..functional import (
    DepthState,
    accumulation_dtype,
    activation_dtype,
    autocast_disabled,
    check_depth_inputs,
    check_eps,
    check_source_list,
    depth_attention_reference,
    depth_state,
    depth_state_batched,
    merge_states,
    stack_sources,
)
from . import autograd as _autograd
from . import cpu as _cpu
from .autograd import Kernels

__all__ = [
    "depth_attention",
    "depth_attention_normed",
    "depth_states_batched",
    "depth_attention_merged",
    "Backend",
    "BACKENDS",
    "backend_status",
    "select_backend",
    "use_backend",
]


@dataclass(frozen=True)
class Backend:
    """One entry of the registry.

    ``unavailable(device, dtype)``: None when the backend can run on tensors of that device and
    (activation) dtype, else the reason; cheap after its first call (what is expensive -- a
    build, an import -- is done once and cached by the function). ``kernels()``: the backend's
    :class:`~.autograd.Kernels`, None for the reference formula; called only once ``unavailable``
    said None. ``auto_devices``: the device types ``backend="auto"`` prefers it for.
    """

    name: str
    unavailable: Callable[[torch.device, torch.dtype], str | None]
    kernels: Callable[[], Kernels | None]
    auto_devices: tuple[str, ...] = ()
    #: whether ``auto`` may take it while ``torch.compile`` traces (its ops are traceable)
    traceable: bool = False


def _always(device: torch.device, dtype: torch.dtype) -> str | None:
    return None


_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _triton_import() -> tuple[types.ModuleType | None, str | None]:
    """``(triton_kernels, None)``, or ``(None, why not)``: the lazy ``import triton``, done once."""
    try:
        from . import triton_kernels
    except Exception as exc:  # ImportError, or a triton too old / broken
        return None, f"triton is not importable ({type(exc).__name__}: {exc}); pip install triton"
    return triton_kernels, None


def _triton_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    if dtype not in _TRITON_DTYPES:
        return f"the triton backend supports float32, bfloat16 and float16, got {dtype}"
    if device.type != "cuda" and not (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return f"the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got device {device}"
    return _triton_import()[1]


@functools.cache
def _triton_kernels() -> Kernels:
    tk, reason = _triton_import()
    if tk is None:
        raise RuntimeError(f"backend='triton' is unavailable: {reason}")
    fwd, bwd = _autograd.stacking(tk.forward, tk.backward)
    return Kernels(
        fwd,
        bwd,
        states=lambda qs, vs, *a: tk.states(qs, _autograd.stacked(vs), *a),
        merge=lambda q, vs, *a: tk.merge(q, _autograd.stacked(vs), *a),
    )


_COMPILED = Kernels(
    _cpu.forward, _cpu.backward, _cpu.states, _cpu.merge, _cpu.read_forward, _cpu.read_backward
)  # functions only: nothing is built here

#: name -> backend, filled here and only here (read-only: a query never registers anything)
_REGISTRY: types.MappingProxyType[str, Backend] = types.MappingProxyType(
    {
        b.name: b
        for b in (
            Backend("reference", _always, lambda: None, traceable=True),
            Backend("fused", _always, lambda: _autograd.EAGER, traceable=True),
            Backend(
                "compiled", _cpu.unavailable_reason, lambda: _COMPILED, auto_devices=("cpu",), traceable=True
            ),
            Backend("triton", _triton_reason, _triton_kernels, auto_devices=("cuda",)),
        )
    }
)
BACKENDS = tuple(_REGISTRY)


def backend_status(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> dict[str, str | None]:
    """``{backend: None if it can run on (device, dtype) else the reason}`` (``dtype``: the
    activation dtype, e.g. the autocast dtype under autocast)."""
    device = torch.device(device)
    return {name: b.unavailable(device, dtype) for name, b in _REGISTRY.items()}


_override = threading.local()


@contextlib.contextmanager
def use_backend(backend: str) -> Iterator[None]:
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


def _requested(backend: str) -> str:
    """``backend`` checked, with ``"auto"`` replaced by the :func:`use_backend` override if any."""
    if backend not in ("auto",) + BACKENDS:
        raise ValueError(f"backend: expected one of {('auto',) + BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = getattr(_override, "backend", None) or "auto"
    return backend


def _select(device: torch.device, dtype: torch.dtype, normalize: str, backend: str) -> str:
    backend = _requested(backend)
    if normalize != "softmax" or backend == "reference":
        return "reference"
    compiling = torch.compiler.is_compiling()

    def unavailable(name: str) -> str | None:
        if compiling and name == "compiled":  # tracing cannot build: the operator settles that when it runs
            return _cpu.unsupported_reason(device, dtype)
        return _REGISTRY[name].unavailable(device, dtype)

    if backend == "auto":
        for b in _REGISTRY.values():
            if (
                device.type in b.auto_devices
                and (b.traceable or not compiling)
                and unavailable(b.name) is None
            ):
                return b.name
        return "fused"
    reason = unavailable(backend)
    if reason is not None:
        raise RuntimeError(f"backend={backend!r} is unavailable: {reason}")
    return backend


#: what the ops accept as sources: one ``[N, *batch, d]`` tensor or N ``[*batch, d]`` tensors
Sources = torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]


def select_backend(sources: Sources, normalize: str = "softmax", backend: str = "auto") -> str:
    """The backend :func:`depth_attention` would run for these arguments (raises if forced and
    unavailable), for the sources' device and :func:`~attention_residuals.functional.activation_dtype`
    (their dtype; under autocast the autocast dtype)."""
    first = sources if isinstance(sources, torch.Tensor) else sources[0]
    return _select(first.device, activation_dtype(sources), normalize, backend)


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


def _flat(sources: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The sources as N contiguous ``[M, d]`` tensors in ``dtype``, without autograd (forward-only kernels)."""
    d = sources[0].shape[-1]
    return [s.detach().to(dtype).reshape(-1, d).contiguous() for s in sources]


def _flat_query(query: torch.Tensor, batch: torch.Size, d: int) -> torch.Tensor:
    """``[d]`` for one query for every token (``[d]``, ``[1, d]``, ``[1, 1, d]``), else ``[M, d]``."""
    if query.shape[:-1].numel() == 1:
        return query.reshape(d)
    return query.expand(*batch, d).reshape(-1, d)


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

    ``sources``: ``[N, *batch, d]`` (the depth axis first) or a list of N ``[*batch, d]`` tensors
    (their dtypes may differ); ``query``: ``[d]`` (a static pseudo-query) or broadcastable to
    ``[*batch, d]`` (input-dependent). Logits, softmax and weighted sum in float32; the output
    ``[*batch, d]`` is in the activation dtype (the sources' promoted dtype, or under autocast the
    autocast dtype: see :mod:`attention_residuals.functional`). A zero query gives the mean of the
    sources. ``heads=H`` splits d into H groups with a softmax each; ``key_norm=False`` uses the
    raw sources as keys; ``normalize="sigmoid"`` gates each source independently. ``backend``:
    ``"auto"`` or one of :data:`BACKENDS` (see the module docstring). ``eps``: the keys' RMSNorm
    epsilon, a finite number ``>= 0``; ``0`` is the exact RMSNorm (NaN for a source that is all
    zeros), a negative ``eps`` is rejected (see :func:`~attention_residuals.functional.check_eps`).
    """
    srcs = _checked(query, sources, heads, eps)
    if normalize not in ("softmax", "sigmoid"):
        raise ValueError(f"normalize: expected 'softmax' or 'sigmoid', got {normalize!r}")
    act = activation_dtype(srcs)
    device = srcs[0].device
    name = _select(device, act, normalize, backend)
    if name == "reference":
        return depth_attention_reference(
            query, stack_sources(sources, act), eps, heads=heads, key_norm=key_norm, normalize=normalize
        )
    batch, d = srcs[0].shape[:-1], srcs[0].shape[-1]
    one_tensor = isinstance(sources, torch.Tensor)
    # the cast to the activation dtype: a no-op for the sources already in it
    vs = (
        [sources.to(act).reshape(len(srcs), -1, d)]
        if one_tensor
        else [s.to(act).reshape(-1, d) for s in srcs]
    )
    q = _flat_query(query, batch, d)
    if name == "compiled" and torch.compiler.is_compiling():
        # inside torch.compile: the C kernel as a custom operator (autograd by register_autograd)
        flat = list(vs[0].unbind(0)) if one_tensor else vs
        q = q.to(accumulation_dtype(act)).contiguous()
        strict = (
            _requested(backend) == "compiled"
        )  # forced: raise if the kernel cannot be built; auto: eager math
        with autocast_disabled(device.type):
            out, _ = _cpu.depth_attention_op(
                q, [v.contiguous() for v in flat], float(eps), int(heads), bool(key_norm), strict
            )
        return out.reshape(*batch, d)
    kernels = _REGISTRY[name].kernels()
    with autocast_disabled(device.type):
        out = _autograd.DepthAttentionFunction.apply(
            q, float(eps), int(heads), bool(key_norm), kernels, one_tensor, *vs
        )
    return out.reshape(*batch, d)


def depth_attention_normed(
    query: torch.Tensor,
    sources: Sources,
    weight: torch.Tensor,
    eps: float = 1e-6,
    norm_eps: float = 1e-6,
    *,
    heads: int = 1,
    key_norm: bool = True,
    normalize: str = "softmax",
    backend: str = "auto",
) -> torch.Tensor:
    """The read of a sublayer in one call: ``rms_norm(depth_attention(query, sources), weight)``.

    ``query``, ``sources``, ``eps``, ``heads``, ``key_norm``, ``normalize``, ``backend`` as in
    :func:`depth_attention`; ``weight`` ``[d]``: the gain of the RMSNorm over the whole ``d`` (the
    sublayer's input norm), ``norm_eps`` its epsilon. Returns ``[*batch, d]`` in the activation
    dtype, like ``nn.RMSNorm`` applied to :func:`depth_attention`'s output. Why one call: at small
    widths a read is a handful of small ops, and their fixed costs (dispatch, allocations, the
    norm's own passes, ``torch.utils.checkpoint``'s bookkeeping) outweighed the arithmetic. The
    backward saves only ``lse`` beside the sources and recomputes the rest (saved activations as
    PreNorm's). On the ``compiled`` backend one C kernel each way (the depth attention's output
    stays in float32 until the norm); on the others the depth-attention kernels with ``F.rms_norm``
    in float32; under ``torch.compile`` the C kernels as custom operators (the others: the two ops
    in turn), and for ``reference``/``sigmoid`` the two ops in turn.
    """
    srcs = _checked(query, sources, heads, eps)
    d = srcs[0].shape[-1]
    if not isinstance(weight, torch.Tensor) or weight.shape != (d,) or not weight.is_floating_point():
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight: expected a floating-point tensor of shape ({d},), got {got}")
    check_eps(norm_eps, "norm_eps")
    if normalize not in ("softmax", "sigmoid"):
        raise ValueError(f"normalize: expected 'softmax' or 'sigmoid', got {normalize!r}")
    act = activation_dtype(srcs)
    device = srcs[0].device
    name = _select(device, act, normalize, backend)
    compiling = torch.compiler.is_compiling()
    if name == "reference" or (compiling and name != "compiled"):
        out = depth_attention(
            query, sources, eps, heads=heads, key_norm=key_norm, normalize=normalize, backend=backend
        )
        return torch.nn.functional.rms_norm(out, (d,), weight, norm_eps)
    batch = srcs[0].shape[:-1]
    vs = [s if s.dtype == act and s.dim() == 2 else s.to(act).reshape(-1, d) for s in srcs]
    q = _flat_query(query, batch, d)
    acc = accumulation_dtype(act)
    scalars = (float(eps), int(heads), bool(key_norm), float(norm_eps))

    def kernel_args():  # called on the paths without autograd.Function (which casts for itself)
        return q.to(acc).contiguous(), weight.to(acc).contiguous(), [v.contiguous() for v in vs]

    if compiling:  # the C kernels as custom operators (autograd by register_autograd)
        with autocast_disabled(device.type):
            y, _ = _cpu.read_normed_op(*kernel_args(), *scalars, _requested(backend) == "compiled")
        return y.reshape(*batch, d)
    kernels = _REGISTRY[name].kernels()
    with autocast_disabled(device.type):
        if torch.is_grad_enabled() and (
            query.requires_grad or weight.requires_grad or any(v.requires_grad for v in vs)
        ):
            y = _autograd.DepthAttentionNormFunction.apply(
                q, weight, float(eps), float(norm_eps), int(heads), bool(key_norm), kernels, *vs
            )
        else:  # no graph to record (inference, decode): the kernel itself, without autograd's cost
            y, _ = _autograd.read_kernels(kernels)[0](*kernel_args(), *scalars)
    return y.reshape(*batch, d)


# ----------------------------------------------------------------------------------------------
# two-phase inference: forward-only kernels (autograd falls back to the functional formulas)


def _two_phase_kernels(
    device: torch.device, dtype: torch.dtype, backend: str, needs_grad: bool
) -> Kernels | None:
    """The backend's kernels when it has two-phase ones and no graph is needed, else None (the
    functional formulas run; also inside torch.compile, which cannot trace the kernels' calls)."""
    kernels = _REGISTRY[_select(device, dtype, "softmax", backend)].kernels()
    if needs_grad or kernels is None or kernels.states is None or torch.compiler.is_compiling():
        return None
    return kernels


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
    as the log-sum-exp and ``sum`` as 1, an equivalent state): statistics and ``out``
    (``[Q, *batch, H]``, ``[Q, *batch, d]``) in float32, the activation dtype recorded for
    :meth:`DepthState.output`. The ``compiled`` and ``triton`` kernels are forward-only: when
    autograd needs a graph, the functional formula runs instead.
    """
    if queries.ndim != 2:
        raise ValueError(f"queries: expected shape [Q, d], got {tuple(queries.shape)}")
    srcs = _checked(queries[0], sources, heads, eps)
    act = activation_dtype(srcs)
    needs_grad = torch.is_grad_enabled() and (queries.requires_grad or any(s.requires_grad for s in srcs))
    kernels = _two_phase_kernels(srcs[0].device, act, backend, needs_grad)
    if kernels is None:
        return depth_state_batched(queries, stack_sources(sources, act), eps, heads=heads, key_norm=key_norm)
    batch, d, nq = srcs[0].shape[:-1], srcs[0].shape[-1], queries.shape[0]
    qs = queries.detach().to(accumulation_dtype(act)).contiguous()
    with autocast_disabled(srcs[0].device.type):
        lse, out = kernels.states(qs, _flat(srcs, act), float(eps), heads, key_norm)
    lse = lse.reshape(nq, *batch, heads)
    return DepthState(lse, torch.ones_like(lse), out.reshape(nq, *batch, d), act)


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
    returns the output ``[*batch, d]`` in the activation dtype of all the sources (those of
    ``state``, as ``state.dtype`` records, and these; under autocast the autocast dtype). Equals
    ``merge_states(state, depth_state(query, sources)).output()`` in one pass (forward-only
    kernels; the functional formulas when autograd needs a graph or the query is not static)."""
    srcs = _checked(query, sources, heads, eps)
    act = activation_dtype(srcs, () if state.dtype is None else (state.dtype,))
    tensors = (query, state.max, state.sum, state.out, *srcs)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    static = query.shape[:-1].numel() == 1
    kernels = _two_phase_kernels(srcs[0].device, act, backend, needs_grad) if static else None
    if kernels is None:
        intra = depth_state(query, stack_sources(sources, act), eps, heads=heads, key_norm=key_norm)
        return merge_states(state, intra).output(act)
    batch, d = srcs[0].shape[:-1], srcs[0].shape[-1]
    acc = accumulation_dtype(act)

    def flat(t: torch.Tensor, last: int) -> torch.Tensor:
        return t.detach().to(acc).expand(*batch, last).reshape(-1, last).contiguous()

    with autocast_disabled(srcs[0].device.type):
        out = kernels.merge(
            query.detach().to(acc).reshape(d).contiguous(),
            _flat(srcs, act),
            flat(state.max, heads),
            flat(state.sum, heads),
            flat(state.out, d),
            float(eps),
            heads,
            key_norm,
        )
    return out.reshape(*batch, d)
