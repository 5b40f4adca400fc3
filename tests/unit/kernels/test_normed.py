"""The fused read ``depth_attention_normed`` (depth attention, then the sublayer's RMSNorm) on every
backend against the plain float64 formula, forward and backward; and in a model, against the two
ops in turn."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON and not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

from attention_residuals.functional import depth_attention_reference  # noqa: E402
from attention_residuals.kernels import backend_status, depth_attention_normed  # noqa: E402
from attention_residuals.model import GPT, GPTConfig  # noqa: E402


def _skip_unavailable(backend: str, dtype: torch.dtype) -> str:
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    device = "cuda" if backend == "triton" and HAS_CUDA else "cpu"
    reason = backend_status(device, dtype)[backend]
    if reason is not None:
        pytest.skip(reason)
    return device


def _inputs(n, m, d, static, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    sources = [(torch.randn(m, d, generator=gen, dtype=torch.float64) * 2 + 0.5).to(dtype) for _ in range(n)]
    query = torch.randn(*((d,) if static else (m, d)), generator=gen, dtype=torch.float64).to(acc)
    weight = (1 + 0.5 * torch.randn(d, generator=gen, dtype=torch.float64)).to(acc)
    grad = torch.randn(m, d, generator=gen, dtype=torch.float64).to(dtype)
    return query, sources, weight, grad


def _grads(fn, query, sources, weight, grad, dtype=None):
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (query, weight, *sources)]
    q, w, *vs = leaves
    y = fn(q, vs, w)
    return (y, *torch.autograd.grad(y, leaves, grad.to(dtype or grad.dtype)))


def _reference(q, vs, w, heads, key_norm):
    out = depth_attention_reference(q, torch.stack(vs), 1e-6, heads=heads, key_norm=key_norm)
    return F.rms_norm(out, (out.shape[-1],), w, 1e-5)


CASES = [  # sources N, tokens M, width d, depth heads, key norm, static query
    (3, 37, 12, 1, True, True),
    (5, 50, 64, 4, True, False),
    (1, 20, 24, 3, True, True),
    (7, 33, 40, 1, False, True),
    (4, 19, 20, 2, False, False),
    (2, 1, 8, 1, True, False),  # one token: a tile of one lane (decode)
    (3, 16, 32, 2, True, True),  # exactly one tile of the C kernels
]


@pytest.mark.parametrize("backend", ["fused", "compiled", "triton"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("n,m,d,heads,key_norm,static", CASES)
def test_matches_the_float64_formula(backend, dtype, tol, n, m, d, heads, key_norm, static):
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the triton backend has no float64")
    _skip_unavailable(backend, dtype)
    query, sources, weight, grad = _inputs(n, m, d, static, dtype)
    want = _grads(
        lambda q, vs, w: _reference(q, vs, w, heads, key_norm), query, sources, weight, grad, torch.float64
    )
    got = _grads(
        lambda q, vs, w: depth_attention_normed(
            q, vs, w, 1e-6, 1e-5, heads=heads, key_norm=key_norm, backend=backend
        ),
        query,
        sources,
        weight,
        grad,
    )
    assert got[0].dtype == dtype and got[1].dtype == query.dtype and got[2].dtype == weight.dtype
    for a, b in zip(got, want, strict=True):
        scale = max(b.abs().max().item(), 1.0)
        assert (a.double() - b).abs().max().item() <= tol * scale


@pytest.mark.parametrize("backend", ["fused", "compiled"])
@pytest.mark.parametrize("static", [True, False])
def test_gradcheck(backend, static):
    _skip_unavailable(backend, torch.float64)
    query, sources, weight, _ = _inputs(3, 5, 6, static, torch.float64)
    leaves = [t.requires_grad_() for t in (query, weight, *sources)]

    def f(q, w, *vs):
        return depth_attention_normed(q, list(vs), w, 1e-6, 1e-5, heads=2, backend=backend)

    assert torch.autograd.gradcheck(f, tuple(leaves), eps=1e-6, atol=1e-8)


def test_bfloat16_rounds_once():
    _skip_unavailable("compiled", torch.bfloat16)
    query, sources, weight, grad = _inputs(4, 30, 32, True, torch.bfloat16)
    want = _grads(lambda q, vs, w: _reference(q, vs, w, 1, True), query, sources, weight, grad, torch.float64)
    got = _grads(
        lambda q, vs, w: depth_attention_normed(q, vs, w, 1e-6, 1e-5, backend="compiled"),
        query,
        sources,
        weight,
        grad,
    )
    assert got[0].dtype == torch.bfloat16 and got[3].dtype == torch.bfloat16
    for a, b in zip(got, want, strict=True):
        assert (a.double() - b).abs().max().item() <= 1e-2 * b.abs().max().item() + 1e-3


def test_bad_weight_and_norm_eps_are_named():
    query, sources, weight, _ = _inputs(2, 3, 8, True, torch.float32)
    with pytest.raises(ValueError, match="weight: expected a floating-point tensor of shape \\(8,\\)"):
        depth_attention_normed(query, sources, weight[:4])
    with pytest.raises(ValueError, match="norm_eps: expected a finite number >= 0"):
        depth_attention_normed(query, sources, weight, norm_eps=-1.0)


@pytest.mark.parametrize(
    "residual,extra", [("block", {"n_blocks": 2}), ("full", {}), ("block", {"depth_heads": 4})]
)
def test_a_model_reads_the_same_fused_or_not(residual, extra, monkeypatch):
    """A training step of a model whose reads are fused gives the loss and gradients of the same
    model reading with the two ops in turn (under ``torch.utils.checkpoint``)."""
    from attention_residuals.connections import DepthAttentionResidual

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=16, seq_len=12, residual=residual, **extra)
    model = GPT(cfg).double()
    with torch.no_grad():
        model.residual.queries.normal_(0, 0.5)
    idx = torch.randint(0, 64, (3, 12))

    def step():
        model.zero_grad()
        _, loss = model(idx, idx)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    fused = step()
    monkeypatch.setattr(DepthAttentionResidual, "_fuses_read", lambda self, norm: False)
    apart = step()
    torch.testing.assert_close(fused[0], apart[0], rtol=1e-12, atol=1e-12)
    for a, b in zip(fused[1], apart[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("static", [True, False])
def test_the_read_kernels_without_a_norm_are_the_depth_attention_kernels(static):
    """``w = None`` (no output norm): the read kernels compute what ``cpu.forward``/``backward`` do."""
    from attention_residuals.kernels import cpu

    _skip_unavailable("compiled", torch.float64)
    query, sources, _, grad = _inputs(4, 23, 16, static, torch.float64)
    y, lse = cpu.read_forward(query, None, sources, 1e-6, 2, True, 1e-5)
    out, lse_plain = cpu.forward(query, sources, 1e-6, 2, True)
    dq, dw, dvs = cpu.read_backward(query, None, sources, lse, grad, 1e-6, 2, True, 1e-5)
    dq_plain, dvs_plain = cpu.backward(query, sources, lse_plain, grad, 1e-6, 2, True)
    assert dw is None
    torch.testing.assert_close(y, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dq, dq_plain, rtol=1e-10, atol=1e-12)
    for a, b in zip(dvs, dvs_plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("static", [True, False])
def test_under_torch_compile_the_fused_read_is_one_custom_op_each_way(static, monkeypatch):
    """Inside torch.compile the read runs the C kernels as operators (registered fake and autograd:
    `torch.library.opcheck`), and gives eager's values and gradients."""
    _skip_unavailable("compiled", torch.float32)
    from attention_residuals.kernels import cpu

    query, sources, weight, grad = _inputs(3, 10, 16, static, torch.float32)
    torch.library.opcheck(cpu.read_normed_op, (query, weight, sources, 1e-6, 2, True, 1e-5, True))

    def read(q, w, *vs):
        return depth_attention_normed(q, list(vs), w, 1e-6, 1e-5, heads=2)

    def run(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (query, weight, *sources)]
        y = fn(*leaves)
        y.backward(grad)
        return y.detach(), [t.grad for t in leaves]

    calls = []
    real = cpu.read_forward
    monkeypatch.setattr(cpu, "read_forward", lambda *a: calls.append(1) or real(*a))
    y_eager, g_eager = run(read)
    calls.clear()  # (eager mode reaches the kernel through its backend's table, not this name)
    y_comp, g_comp = run(torch.compile(read, backend="aot_eager", fullgraph=True))
    assert len(calls) == 1  # the compiled graph ran the fused kernel, once
    torch.testing.assert_close(y_comp, y_eager, rtol=1e-6, atol=1e-6)
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
