"""The fused depth-attention ``torch.autograd.Function`` and its eager (pure torch) backend.

One Function serves every fused backend (``fused`` = eager torch ops, ``compiled`` = the C kernel,
``triton`` = the GPU kernels); a backend is a :class:`Kernels` record of functions on flattened,
contiguous tensors::

    forward(q, vs, eps, heads, key_norm) -> (out [M, d] in the sources' dtype, lse [M, H] in acc dtype)
    backward(q, vs, lse, g, eps, heads, key_norm, need_dq, need_dv, one_buffer)
        -> (dq like q, [dv_i like v_i] or None; with one_buffer, the dv_i are consecutive slices of one tensor)

with ``vs`` the N sources as a list of ``[M, d]`` tensors (the C kernel reads them where they are,
through a table of pointers: no stacked copy in forward, none saved for backward), ``q`` the query
``[d]`` (static) or ``[M, d]`` (one per token) already in the accumulation dtype (float32; float64
for float64 sources), and ``lse`` the log-sum-exp of the logits over the sources. Saved for
backward: the sources themselves (already alive as the model's activations), the query and
``lse`` -- one float32 scalar per token and head. Keys, logits and weights are recomputed.
Backends written for one ``[N, M, d]`` tensor are wrapped by :func:`stacking`.

Precision (the contract of :mod:`attention_residuals.functional`): the dispatcher hands every
backend sources of one dtype, the activation dtype (it casts the others first). A backend reads
them in that dtype, computes the logits, ``lse``, the weighted sum and every gradient in the
accumulation dtype, and rounds once: ``out`` and ``dv_i`` to the sources' dtype. The Function runs
its backward with autocast off for the sources' device (the forward is already called so).

Gradient, per token and head (``dh`` channels), with ``r_i = rsqrt(mean(v_i^2) + eps)``,
``z_i = r_i q.v_i``, ``alpha_i = exp(z_i - lse)``, ``s_i = g.v_i``, ``delta = sum_i alpha_i s_i``::

    dz_i = alpha_i (s_i - delta)
    dv_i = alpha_i g + dz_i r_i q - (dz_i z_i r_i^2 / dh) v_i       (last term only with key_norm)
    dq   = sum_i dz_i r_i v_i
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from ..functional import accumulation_dtype as acc_dtype
from ..functional import autocast_disabled

__all__ = [
    "DepthAttentionFunction",
    "DepthAttentionNormFunction",
    "Kernels",
    "EAGER",
    "eager_forward",
    "eager_backward",
    "acc_dtype",
    "stacked",
    "stacking",
]


def _heads_view(v: torch.Tensor, q: torch.Tensor, heads: int):
    n, m, d = v.shape
    vh = v.reshape(n, m, heads, d // heads)
    qh = q.reshape(heads, d // heads) if q.ndim == 1 else q.reshape(m, heads, d // heads)
    return vh, qh


def _scalars(vh: torch.Tensor, qh: torch.Tensor, eps: float, key_norm: bool):
    """(r, z) per source, token and head: ``[N, M, H]`` each (r is None without key_norm)."""
    if qh.ndim == 2:
        qv = torch.einsum("nmhc,hc->nmh", vh, qh)
    else:
        qv = torch.einsum("nmhc,mhc->nmh", vh, qh)
    if not key_norm:
        return None, qv
    dh = vh.shape[-1]
    r = torch.rsqrt(torch.linalg.vector_norm(vh, dim=-1).square() / dh + eps)
    return r, qv * r


def eager_forward(q: torch.Tensor, v: torch.Tensor, eps: float, heads: int, key_norm: bool):
    """Eager backend: logits in one batched pass, then the weighted sum (same contract as the kernels)."""
    acc = acc_dtype(v.dtype)
    n, m, d = v.shape
    vh, qh = _heads_view(v.to(acc), q, heads)
    _, z = _scalars(vh, qh, eps, key_norm)
    lse = torch.logsumexp(z, dim=0)  # [M, H]
    alpha = torch.exp(z - lse)
    out = torch.einsum("nmh,nmhc->mhc", alpha, vh).reshape(m, d)
    return out.to(v.dtype), lse


def eager_backward(q, v, lse, g, eps, heads, key_norm, need_dq=True, need_dv=True):
    acc = acc_dtype(v.dtype)
    n, m, d = v.shape
    vh, qh = _heads_view(v.to(acc), q, heads)
    gh = g.to(acc).reshape(m, heads, d // heads)
    r, z = _scalars(vh, qh, eps, key_norm)
    alpha = torch.exp(z - lse)
    s = torch.einsum("nmhc,mhc->nmh", vh, gh)
    delta = (alpha * s).sum(0)
    dz = alpha * (s - delta)
    a = dz if r is None else dz * r  # coefficient of q in dv, and of v in dq
    dq = dv = None
    if need_dv:
        if r is None:
            dvh = alpha.unsqueeze(-1) * gh
        else:
            dvh = vh * (-dz * z * r * r / vh.shape[-1]).unsqueeze(-1)
            dvh.addcmul_(alpha.unsqueeze(-1), gh)
        qb = qh if qh.ndim == 2 else qh.unsqueeze(0)
        dvh.addcmul_(a.unsqueeze(-1), qb)
        dv = dvh.reshape(n, m, d).to(v.dtype)
    if need_dq:
        if q.ndim == 1:
            dq = torch.einsum("nmh,nmhc->hc", a, vh).reshape(d)
        else:
            dq = torch.einsum("nmh,nmhc->mhc", a, vh).reshape(m, d)
    return dq, dv


def stacked(vs: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(vs)``, without the copy when ``vs`` are the consecutive slices of one tensor
    (a stacked ``[N, ...]`` input the dispatcher unbound). Under ``torch.compile``: plain stack
    (the compiler fuses it; storage pointers are not traceable)."""
    if torch.compiler.is_compiling():
        return torch.stack(vs)
    first = vs[0]
    step = first.numel()
    storage = first.untyped_storage().data_ptr()
    if first.is_contiguous() and all(
        v.untyped_storage().data_ptr() == storage
        and v.storage_offset() == first.storage_offset() + i * step
        and v.shape == first.shape
        and v.is_contiguous()
        for i, v in enumerate(vs)
    ):
        return first.as_strided((len(vs), *first.shape), (step, *first.stride()))
    return torch.stack(vs)


def stacking(forward, backward):
    """Adapt a backend pair written for one stacked ``[N, M, d]`` tensor to the list contract."""

    def fwd(q, vs, eps, heads, key_norm):
        return forward(q, stacked(vs), eps, heads, key_norm)

    def bwd(q, vs, lse, g, eps, heads, key_norm, need_dq=True, need_dv=True, one_buffer=False):
        dq, dv = backward(q, stacked(vs), lse, g, eps, heads, key_norm, need_dq, need_dv)
        return dq, (list(dv.unbind(0)) if dv is not None else None)

    return fwd, bwd


@dataclass(frozen=True)
class Kernels:
    """The functions of one fused backend (signatures in the module docstring).

    ``states`` / ``merge``: the forward-only two-phase kernels on lists of ``[M, d]`` sources
    (``states(qs, vs, eps, heads, key_norm) -> (lse [Q, M, H], out [Q, M, d])`` and
    ``merge(q, vs, st_max, st_sum, st_out, eps, heads, key_norm) -> [M, d]``), None when the
    backend has none (the functional formulas run instead).
    """

    forward: Callable
    backward: Callable
    states: Callable | None = None
    merge: Callable | None = None
    #: the fused read (depth attention, then the sublayer's RMSNorm), signatures as
    #: :func:`~.cpu.read_forward` / :func:`~.cpu.read_backward`; None: composed from
    #: ``forward``/``backward`` and ``F.rms_norm`` by :func:`read_kernels`
    read_forward: Callable | None = None
    read_backward: Callable | None = None


def read_kernels(kernels: Kernels) -> tuple[Callable, Callable]:
    """The backend's fused read, or one composed of its depth-attention kernels and ``F.rms_norm``
    in the accumulation dtype: the backward recomputes the depth attention's output from the
    saved ``lse`` (what ``torch.utils.checkpoint`` would do, without its bookkeeping)."""
    if kernels.read_forward is not None:
        return kernels.read_forward, kernels.read_backward

    def fwd(q, w, vs, eps, heads, key_norm, norm_eps):
        out, lse = kernels.forward(q, vs, eps, heads, key_norm)
        y = torch.nn.functional.rms_norm(out.to(q.dtype), (out.shape[-1],), w, norm_eps)
        return y.to(out.dtype), lse

    def bwd(q, w, vs, lse, gy, eps, heads, key_norm, norm_eps, need_dq, need_dw, need_dv):
        out, _ = kernels.forward(q, vs, eps, heads, key_norm)
        x = out.to(q.dtype).requires_grad_()
        wr = w.detach().requires_grad_(need_dw)
        with torch.enable_grad():
            y = torch.nn.functional.rms_norm(x, (x.shape[-1],), wr, norm_eps)
        grads = torch.autograd.grad(y, [x, wr] if need_dw else [x], gy.to(q.dtype))
        g = grads[0].to(vs[0].dtype).contiguous()
        dq, dvs = kernels.backward(q, vs, lse, g, eps, heads, key_norm, need_dq, need_dv)
        return dq, (grads[1] if need_dw else None), dvs

    return fwd, bwd


class DepthAttentionNormFunction(torch.autograd.Function):
    """``apply(query, weight, eps, norm_eps, heads, key_norm, kernels, *sources)``: the read of a
    sublayer, ``rms_norm(depth_attention(query, sources), weight)``, in one forward and one backward
    kernel. ``query`` ``[d]`` or ``[M, d]``, ``weight`` ``[d]`` (the sublayer norm's gain),
    ``sources`` N tensors ``[M, d]`` of one dtype -> ``[M, d]`` in their dtype. The depth
    attention's output is never rounded before the norm. Saved: the sources (alive anyway as the
    model's activations), the query, the gain and ``lse`` (one float32 per token and head); the
    backward recomputes the rest, so the read saves as much as PreNorm's residual stream does."""

    @staticmethod
    def forward(ctx, query, weight, eps, norm_eps, heads, key_norm, kernels, *sources):
        acc = acc_dtype(sources[0].dtype)
        q = query.detach().to(acc).contiguous()
        w = weight.detach().to(acc).contiguous()
        vs = [v.detach().contiguous() for v in sources]
        fwd, _ = read_kernels(kernels)
        y, lse = fwd(q, w, vs, eps, heads, key_norm, norm_eps)
        ctx.save_for_backward(q, w, lse, *vs)
        ctx.config = (eps, norm_eps, heads, key_norm, kernels, query.dtype, weight.dtype)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        q, w, lse, *vs = ctx.saved_tensors
        eps, norm_eps, heads, key_norm, kernels, q_dtype, w_dtype = ctx.config
        need_dq, need_dw, need_v = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[7:]
        _, bwd = read_kernels(kernels)
        gy = grad_y.to(vs[0].dtype).contiguous()
        with autocast_disabled(q.device.type):
            dq, dw, dvs = bwd(
                q, w, vs, lse, gy, eps, heads, key_norm, norm_eps, need_dq, need_dw, any(need_v)
            )
        dvs = [dv if need else None for dv, need in zip(dvs, need_v)] if dvs is not None else [None] * len(vs)
        return (
            dq.to(q_dtype) if need_dq else None,
            dw.to(w_dtype) if need_dw else None,
            None, None, None, None, None,
            *dvs,
        )  # fmt: skip


#: the ``fused`` backend: eager torch ops, any device and dtype
EAGER = Kernels(*stacking(eager_forward, eager_backward))


class DepthAttentionFunction(torch.autograd.Function):
    """``apply(query, eps, heads, key_norm, kernels, one_tensor, *sources)``.

    ``query``: ``[d]`` or ``[M, d]``; ``kernels``: the backend's :class:`Kernels`; ``sources``: N
    tensors ``[M, d]`` of one dtype, or with ``one_tensor`` a single ``[N, M, d]`` tensor (a
    stacked input: its gradient is then written as one tensor, not N that autograd would have to
    stack, a copy of all of them) -> ``[M, d]`` in the sources' dtype. Validation, the cast to the
    activation dtype and the flattening of batch dims happen in the dispatcher.
    """

    @staticmethod
    def forward(ctx, query, eps, heads, key_norm, kernels, one_tensor, *sources):
        q = query.detach().to(acc_dtype(sources[0].dtype)).contiguous()
        saved = [v.detach().contiguous() for v in sources]
        vs = list(saved[0].unbind(0)) if one_tensor else saved
        out, lse = kernels.forward(q, vs, eps, heads, key_norm)
        ctx.save_for_backward(q, lse, *saved)
        ctx.config = (eps, heads, key_norm, kernels, query.dtype, one_tensor)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, lse, *saved = ctx.saved_tensors
        eps, heads, key_norm, kernels, q_dtype, one_tensor = ctx.config
        vs = list(saved[0].unbind(0)) if one_tensor else saved
        need_dq, need_v = ctx.needs_input_grad[0], ctx.needs_input_grad[6:]
        g = grad_out.to(vs[0].dtype).contiguous()
        with autocast_disabled(q.device.type):
            dq, dvs = kernels.backward(q, vs, lse, g, eps, heads, key_norm, need_dq, any(need_v), one_tensor)
        if dvs is not None and one_tensor:
            dvs = [stacked(dvs)]
        dvs = (
            [dv if need else None for dv, need in zip(dvs, need_v)]
            if dvs is not None
            else [None] * len(saved)
        )
        return (dq.to(q_dtype) if need_dq else None, None, None, None, None, None, *dvs)
