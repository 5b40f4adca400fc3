"""Floor 6: what the report's section 5.4 looks at, measured on a trained model.

- :func:`magnitudes`: RMS of every sublayer's input ``h_l`` and output ``v_l`` (the PreNorm
  dilution: the baseline's hidden state grows with depth, AttnRes stays bounded).
- :func:`gradient_norms`: gradient norm of every sublayer's parameters on a batch (how evenly
  the loss reaches each depth).
- :func:`depth_weights`: the learned ``alpha_{i->l}`` split into pre-attention and pre-MLP rows
  (the report's figure 8).
"""

from __future__ import annotations

import torch

from ..model import GPT

__all__ = ["magnitudes", "gradient_norms", "depth_weights"]


def _rms(x: torch.Tensor) -> float:
    return x.detach().float().pow(2).mean().sqrt().item()


@torch.no_grad()
def magnitudes(model: GPT, idx: torch.Tensor) -> dict[str, list[float]]:
    """RMS over batch, tokens and channels of each sublayer's input ``h_l`` and output ``v_l``."""
    inputs: dict[int, float] = {}
    outputs: dict[int, float] = {}
    handles = []
    for l, (norm, layer) in enumerate(zip(model.norms, model.layers)):
        handles.append(norm.register_forward_hook(lambda m, a, o, l=l: inputs.__setitem__(l, _rms(a[0]))))
        handles.append(layer.register_forward_hook(lambda m, a, o, l=l: outputs.__setitem__(l, _rms(o))))
    try:
        model.eval()
        model(idx)
    finally:
        for h in handles:
            h.remove()
    n = len(model.layers)
    return {"input_rms": [inputs[l] for l in range(n)], "output_rms": [outputs[l] for l in range(n)]}


def gradient_norms(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> list[float]:
    """L2 norm of the loss gradient w.r.t. each sublayer's parameters (its input norm included)."""
    model.zero_grad(set_to_none=True)
    model.train()
    _, loss = model(idx, targets)
    loss.backward()
    norms = []
    for norm, layer in zip(model.norms, model.layers):
        grads = [
            p.grad.float().pow(2).sum()
            for p in [*norm.parameters(), *layer.parameters()]
            if p.grad is not None
        ]
        norms.append(torch.stack(grads).sum().sqrt().item())
    model.zero_grad(set_to_none=True)
    return norms


@torch.no_grad()
def depth_weights(model: GPT, idx: torch.Tensor) -> dict[str, list[list[float]]]:
    """Depth weights averaged over tokens: pre-attention rows (even sublayers), pre-MLP rows
    (odd sublayers) and the final readout, NaN where a layer has no such source."""
    model.eval()
    w = model.depth_weights(idx)
    return {"pre_attn": w[0:-1:2].tolist(), "pre_mlp": w[1:-1:2].tolist(), "final": w[-1].tolist()}
