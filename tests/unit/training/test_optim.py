"""Gradient clipping: the norm reported is the one before clipping, and clipping scales every
gradient to the limit (the same as ``torch.nn.utils.clip_grad_norm_``)."""

import pytest
import torch

from attention_residuals.training.optim import clip_grad_norm


def params_with_grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((3, 4), (5,), (2, 2, 2))]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 3
    return ps


@pytest.mark.parametrize("max_norm", [0.5, 1e6, 0.0])
def test_clip_grad_norm_clips_like_torch(max_norm):
    ours, theirs = params_with_grads(), params_with_grads()
    before = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ours]))
    norm = clip_grad_norm(ours, max_norm)
    torch.testing.assert_close(norm, before)
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    after = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ours]))
    assert after <= max_norm * (1 + 1e-5) if 0 < max_norm < before else after == pytest.approx(float(before))


def test_clip_grad_norm_skips_parameters_without_gradients():
    ps = params_with_grads()
    ps.append(torch.nn.Parameter(torch.ones(4)))  # no .grad
    assert float(clip_grad_norm(ps, 1.0)) > 1.0
    assert ps[-1].grad is None
    assert float(clip_grad_norm([torch.nn.Parameter(torch.ones(2))], 1.0)) == 0.0
