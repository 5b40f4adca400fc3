"""The PyPI peers behind our call signatures, for ``bench op`` and ``bench peers``.

Each peer package is imported here, when its adapter is built, and only here: one that is missing
or does not run on this device becomes a reason to skip it, not an error. A module of its own
(below :mod:`.op` and :mod:`.peers`): ``bench op`` times the peers' ops and ``bench peers`` runs
``bench op``, so neither of the two could hold these for the other without a cycle.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from ..connections import make_connection

__all__ = ["peer_ops", "attn_res_model", "mhc_cases"]


def peer_ops(q: torch.Tensor, v: torch.Tensor, eps: float):
    """``name -> (fwd(q, v), reason)``: the PyPI packages' depth-attention ops where they import.

    Each ``fwd`` returns the output ``[*batch, d]`` and is differentiable in ``q`` and ``v``.
    """
    peers: dict[str, tuple[Callable | None, str | None]] = {}
    try:
        from attn_res import AttnResOperator

        op = AttnResOperator(v.shape[-1], eps=eps).to(device=v.device, dtype=v.dtype)
        fwd = _module_param_op(op, "pseudo_query")
        peers["attn-res (AttnResOperator)"] = (lambda q, v: fwd(q.to(v.dtype), v), None)
    except Exception as exc:
        peers["attn-res (AttnResOperator)"] = (None, f"does not import: {type(exc).__name__}: {exc}")
    try:
        import attnres as fast_attnres  # the fast-attnres distribution installs the module `attnres`

        peers["fast-attnres (attnres.attnres)"] = (
            lambda q, v: fast_attnres.attnres(v, q.to(v.dtype), eps=eps),
            None,
        )
    except Exception as exc:
        peers["fast-attnres (attnres.attnres)"] = (None, f"does not import: {type(exc).__name__}: {exc}")
    try:
        from flash_attn_res import phase_1_batched_attention_triton_op

        def flash(q, v):
            out, _lse = phase_1_batched_attention_triton_op(v, q.to(v.dtype).unsqueeze(0), eps)
            return out[0]

        peers["flash-attn-res (phase 1, one query)"] = (flash, None)
    except Exception as exc:
        peers["flash-attn-res (phase 1, one query)"] = (
            None,
            f"does not import: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
        )
    # GPU-only Triton ops (each raises on CPU tensors; the bench reports the error as the reason)
    ones = torch.ones(v.shape[-1], device=v.device, dtype=v.dtype)  # their RMSNorm weight: the identity
    try:
        from fla.ops.attnres import fused_attnres

        peers["flash-linear-attention (fused_attnres)"] = (
            lambda q, v: fused_attnres(q.to(v.dtype), list(v.unbind(0)), ones, rms_eps=eps),
            None,
        )
    except Exception as exc:
        peers["flash-linear-attention (fused_attnres)"] = (
            None,
            f"does not import: {type(exc).__name__}: {exc}",
        )
    try:
        from liger_kernel.transformers.functional import liger_attn_res

        peers["Liger-Kernel (liger_attn_res)"] = (
            lambda q, v: liger_attn_res(v, q.to(v.dtype), ones, eps),
            None,
        )
    except Exception as exc:
        peers["Liger-Kernel (liger_attn_res)"] = (None, f"does not import: {type(exc).__name__}: {exc}")
    return peers


def _module_param_op(module: torch.nn.Module, param: str) -> Callable:
    """Call ``module(v)`` with its parameter ``param`` replaced by the tensor ``q`` (gradients flow to q)."""

    def fwd(q, v):
        saved = module._parameters.pop(param)
        try:
            setattr(module, param, q)
            return module(v)
        finally:
            delattr(module, param)
            module._parameters[param] = saved

    return fwd


def attn_res_model(args: argparse.Namespace, mode: str) -> torch.nn.Module:
    """attn-res' own transformer in ``mode`` (``none`` or ``block``) at the shape of ``args``."""
    from attn_res import AttnResMode, AttnResTransformer, TransformerConfig

    cfg = TransformerConfig(
        d_model=args.d_model,
        n_layers=2 * args.n_layer,
        n_heads=args.n_head,
        n_kv_heads=args.n_head,
        vocab_size=256,
        max_seq_len=args.seq,
        attn_res_mode=AttnResMode(mode),
        n_blocks=args.n_blocks,
    )
    if args.dtype != "float32":  # .to(dtype) would cast its complex RoPE table to real
        raise TypeError(f"attn-res' model is run in float32 only here, got --dtype {args.dtype}")
    torch.manual_seed(0)
    return AttnResTransformer(cfg).to(device=args.device)


def mhc_cases(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, Callable], dict[str, str]]:
    """One mHC residual (m = 4 streams) around an identity branch, ours and hyper-connections'."""
    b, t, d, m = args.batch, args.seq, args.d_model, 4
    x = torch.randn(b, t, d, device=device, requires_grad=True)
    cases, skipped = {}, {}
    ours = make_connection("mhc", 2, d, streams=m).to(device)

    def our_step():
        state = ours.init_state(x)
        h = ours.read(state, 0)
        ours.write(state, 0, h)
        out = ours.final(state)
        return torch.autograd.grad(out.sum(), x)

    cases["mhc|attention_residuals (mhc-lite)"] = our_step
    try:
        from hyper_connections import get_init_and_expand_reduce_stream_functions

        init_hc, expand, reduce = get_init_and_expand_reduce_stream_functions(m, dim=d)
        hc = init_hc(branch=torch.nn.Identity()).to(device)

        def their_step():
            out = reduce(hc(expand(x)))
            return torch.autograd.grad(out.sum(), x)

        cases["mhc|hyper-connections (mHC, sinkhorn)"] = their_step
    except Exception as exc:
        skipped["hyper-connections (mHC, sinkhorn)"] = f"{type(exc).__name__}: {exc}"
    return cases, skipped
