"""Whether the depth mixing learns, piece by piece: the optimizer group of ``--depth-lr-scale`` and
``--depth-weight-decay``, the per-step parameter statistics, the summary reading each head on its
own. The training runs with ``--log-depth`` / ``--depth-lr-scale`` are in ``test_train.py``."""

from __future__ import annotations

import math

import pytest
import torch

from attention_residuals import GPT, GPTConfig
from attention_residuals.training.depth import depth_parameters, depth_weight_summary, parameter_step
from attention_residuals.training.optim import build_optimizer


def test_depth_lr_scale_gives_the_depth_parameters_their_own_rate():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, vocab_size=32, residual="block"))
    depth = {id(p) for p in depth_parameters(model)}
    assert depth and depth == {id(p) for p in model.residual.parameters()}
    same = build_optimizer(model, lr=1e-3)
    scaled = build_optimizer(model, lr=1e-3, depth_lr_scale=10.0)
    assert len(scaled.param_groups) == len(same.param_groups) + 1
    (group,) = [g for g in scaled.param_groups if {id(p) for p in g["params"]} & depth]
    assert {id(p) for p in group["params"]} == depth and group["lr"] == pytest.approx(1e-2)
    assert group["weight_decay"] == 0.0
    others = [g for g in scaled.param_groups if g is not group]
    assert all(g["lr"] == 1e-3 for g in others)
    muon = build_optimizer(model, "muon", lr=1e-3, depth_lr_scale=3.0)
    assert sorted(g["lr"] for g in muon.param_groups) == pytest.approx([1e-3, 1e-3, 1e-3, 3e-3])


def test_depth_weight_decay_decays_the_depth_parameters_only():
    """With a zero gradient AdamW's step is its decoupled decay alone, p <- p (1 - lr wd): the
    depth-mixing parameters shrink by exactly that, every other no-decay parameter stays."""
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, vocab_size=32, residual="block"))
    depth = {id(p) for p in depth_parameters(model)}
    opt = build_optimizer(model, lr=1e-2, depth_weight_decay=0.5)
    (group,) = [g for g in opt.param_groups if {id(p) for p in g["params"]} & depth]
    assert {id(p) for p in group["params"]} == depth
    assert group["weight_decay"] == 0.5 and group["lr"] == pytest.approx(1e-2)
    with torch.no_grad():
        for p in model.residual.parameters():
            p.fill_(1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        if id(p) in depth:
            torch.testing.assert_close(p, before[n] * (1 - 1e-2 * 0.5), msg=n)
        elif p.dim() < 2:
            assert torch.equal(p, before[n]), n


def test_parameter_step_measures_the_update():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 2.0)
    opt = torch.optim.SGD([p], lr=0.5)
    stats = parameter_step([p], opt.step)
    assert stats == pytest.approx({"param_rms": 1.0, "grad_rms": 2.0, "update_rms": 1.0})


def test_summary_reads_each_head_on_its_own():
    """Two heads with their own queries: the entropy ratio is the mean of the heads' entropies,
    below that of the head-averaged weights (entropy is concave: averaging heads reads as more
    uniform than any head is, which is what the per-head summary avoids)."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, vocab_size=32, residual="full", depth_heads=2)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for p in model.residual.parameters():
            p.copy_(torch.randn_like(p) * 3)
    idx = torch.randint(0, 32, (2, 8))
    w = model.depth_weights(idx, per_head=True)
    assert w.shape == (5, 5, 2)
    torch.testing.assert_close(model.depth_weights(idx), w.mean(-1), equal_nan=True)
    s = depth_weight_summary(model, idx)
    entropies = []
    for l in range(2, 5):
        for h in range(2):
            p = w[l, :, h][~torch.isnan(w[l, :, h])]
            p = p / p.sum()
            entropies.append(float(-(p * p.log()).sum()) / math.log(p.numel()))
    assert s["entropy_ratio"] == pytest.approx(sum(entropies) / len(entropies))
    assert s["per_head"] is True
    averaged = []
    for l in range(2, 5):
        p = w[l].mean(-1)[~torch.isnan(w[l].mean(-1))]
        p = p / p.sum()
        averaged.append(float(-(p * p.log()).sum()) / math.log(p.numel()))
    assert s["entropy_ratio"] < sum(averaged) / len(averaged) - 0.01
