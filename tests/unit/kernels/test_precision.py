"""The precision contract (see :mod:`attention_residuals.functional`) on every backend that runs here.

Under ``torch.autocast`` (and with plain half-precision sources) every backend must read the sources
in the activation dtype, compute logits, softmax statistics and the weighted sum in float32, and
round once: the output (and each source's gradient) in its own dtype. Two checks per result:

* **tight** -- against the float64 formula on the inputs *as the contract reads them* (each source
  cast to the activation dtype): only the final rounding is allowed, one ulp per element,
  ``|got - want| <= eps(dtype) |want| + 1e-5 max|want|`` (``eps`` = 2^-7 for bfloat16, 2^-10 for
  float16: one ulp, not half, because the Triton interpreter casts float32 to bfloat16 by
  truncation where a GPU rounds to nearest; the 1e-5 covers float32 accumulation). A backend
  that accumulated in bfloat16 would miss this by several ulps.
* **end to end** -- against the float32 computation on the unrounded float32 inputs: the cost of
  mixed precision, input rounding included. Norm-wise relative error ``<= 5 u`` with the unit
  roundoff ``u`` = 2^-8 (bfloat16: 1.95e-2, the usual 2e-2) or 2^-11 (float16: 2.4e-3): each
  input and output is rounded once (``u`` each) and the softmax passes a logit's relative error
  on scaled by the logit (kept O(1) here by the query's scale), a few ``u`` in all.

The backends are those :func:`backend_status` reports runnable on this machine, for each dtype they
have a kernel for (the C kernel has no float16), computed at collection: nothing is skipped at run
time. Triton runs on CUDA when there is one, else under ``TRITON_INTERPRET=1`` on CPU (set by
conftest.py before the kernels are imported).
"""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

from attention_residuals.functional import (  # noqa: E402
    activation_dtype,
    depth_attention_reference,
    depth_logits,
    depth_state,
    merge_states,
)
from attention_residuals.kernels import (  # noqa: E402
    BACKENDS,
    backend_status,
    depth_attention,
    depth_attention_merged,
    depth_states_batched,
    select_backend,
)

HALF = (torch.bfloat16, torch.float16)


def _device(backend: str) -> str:
    return "cuda" if backend == "triton" and HAS_CUDA else "cpu"


def _autocast_supports(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.autocast(device_type, dtype)`` really enables autocast (torch warns and
    disables it for a dtype the device type does not support)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast(device_type, dtype=dtype):
            return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == dtype


def _runs(backend: str, dtype: torch.dtype) -> bool:
    return backend_status(_device(backend), dtype)[backend] is None


#: (backend, half dtype) pairs that run on this machine, under autocast and without
CASES = [
    pytest.param(b, dt, id=f"{b}-{str(dt).removeprefix('torch.')}")
    for b in BACKENDS
    for dt in HALF
    if _runs(b, dt) and _autocast_supports(_device(b), dt)
]
FLOAT32_BACKENDS = [b for b in BACKENDS if _runs(b, torch.float32)]
FLOAT64_BACKENDS = [b for b in BACKENDS if _runs(b, torch.float64)]
FUSED_BACKENDS = [b for b in FLOAT32_BACKENDS if b != "reference"]  # the ones on DepthAttentionFunction


def _autocast(device: str, dtype: torch.dtype, on: bool = True):
    return torch.autocast(torch.device(device).type, dtype=dtype) if on else contextlib.nullcontext()


def _unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _assert_tight(
    got: torch.Tensor, want: torch.Tensor, name: str, rounded: torch.dtype | None = None
) -> None:
    """One rounding to ``rounded`` (default ``got.dtype``) from the float64 value: within one ulp
    per element. (A float32 source's gradient is float32 but went through its bfloat16 copy.)"""
    eps = torch.finfo(rounded or got.dtype).eps
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    err = (got - want).abs() - eps * torch.maximum(got.abs(), want.abs())
    slack = 1e-5 * want.abs().max().item()
    assert err.max().item() <= slack, f"{name}: {err.max().item():.3e} beyond one ulp (slack {slack:.1e})"


def _assert_end_to_end(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    rel = ((got - want).norm() / want.norm()).item()
    tol = 5 * _unit_roundoff(dtype)
    assert rel <= tol, f"{name}: relative error {rel:.2e} > 5 u = {tol:.2e}"


def _master(n, batch, d, query_shape, seed=0):
    """float32 master values: sources, a query with O(1) logits, an upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    sources = torch.randn(n, *batch, d, generator=gen) * 1.5 + 0.3
    query = torch.randn(*query_shape, generator=gen) * (1.5 / d**0.5)
    grad = torch.randn(*batch, d, generator=gen)
    return query, list(sources.unbind(0)), grad


def _reference(query, sources, grad, **kw):
    """float64 forward and gradients (query, each source) of the formula."""
    q = query.detach().double().requires_grad_()
    vs = [s.detach().double().requires_grad_() for s in sources]
    out = depth_attention_reference(q, torch.stack(vs), **kw)
    return (out, *torch.autograd.grad(out, [q, *vs], grad.double()))


QUERY_SHAPES = {"static": lambda b, d: (d,), "input": lambda b, d: (*b, d)}
HEADS = [(1, True), (2, True), (2, False)]


def test_activation_dtype_rules():
    f32, bf16 = torch.randn(2, 4), torch.randn(2, 4).bfloat16()
    assert activation_dtype([f32, bf16, bf16]) == torch.float32  # promoted, never an error
    assert activation_dtype([bf16, bf16]) == torch.bfloat16
    assert activation_dtype(torch.stack([bf16, bf16])) == torch.bfloat16
    assert activation_dtype([bf16], extra=[torch.float32]) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert activation_dtype([f32, bf16]) == torch.bfloat16
        assert activation_dtype([f32, f32]) == torch.bfloat16
        assert (
            activation_dtype([f32.double(), f32.double()]) == torch.float64
        )  # autocast leaves float64 alone
        with torch.autocast("cpu", enabled=False):
            assert activation_dtype([f32, bf16]) == torch.float32


@pytest.mark.parametrize("backend,dtype", CASES)
@pytest.mark.parametrize("mode", ["autocast", "plain"])
@pytest.mark.parametrize("heads,key_norm", HEADS)
@pytest.mark.parametrize("query_kind", list(QUERY_SHAPES))
def test_forward_and_gradients(backend, dtype, mode, heads, key_norm, query_kind):
    """(a) a list whose first source is float32 (the embedding) and the rest half precision, under
    autocast; or all half without autocast: output in the activation dtype, each gradient in its
    source's dtype; (b) both checks of the module docstring, forward and every gradient."""
    dev = _device(backend)
    batch, d = (3, 4), 16
    query, master, grad = _master(5, batch, d, QUERY_SHAPES[query_kind](batch, d))
    grad = grad.to(dtype)  # what autograd hands back: the output's dtype
    if mode == "autocast":
        sources = [master[0]] + [s.to(dtype) for s in master[1:]]  # the embedding stays float32
        # an input-dependent query comes out of a linear layer: in the autocast dtype
        q_in = query.to(dtype) if query_kind == "input" else query
    else:
        sources = [s.to(dtype) for s in master]
        q_in = query
    q = q_in.to(dev).requires_grad_()
    vs = [s.to(dev).requires_grad_() for s in sources]
    with _autocast(dev, dtype, on=mode == "autocast"):
        out = depth_attention(q, vs, heads=heads, key_norm=key_norm, backend=backend)
    grads = torch.autograd.grad(out, [q, *vs], grad.to(dev))
    assert out.dtype == dtype and out.shape == (*batch, d)
    assert grads[0].dtype == q.dtype
    assert [g.dtype for g in grads[1:]] == [s.dtype for s in vs]

    names = ["out", "dq"] + [f"dv[{i}]" for i in range(len(vs))]
    as_read = [s.to(dtype) for s in sources]  # the contract casts the float32 source once
    rounded = [dtype, q.dtype] + [dtype] * len(vs)  # dv of the float32 source: its bfloat16 copy's
    want = _reference(q_in, as_read, grad, heads=heads, key_norm=key_norm)
    for name, a, b, r in zip(names, (out, *grads), want, rounded):
        _assert_tight(a, b, name, r)
    for name, a, b in zip(
        names, (out, *grads), _reference(query, master, grad, heads=heads, key_norm=key_norm)
    ):
        _assert_end_to_end(a, b, dtype, name)


@pytest.mark.parametrize("backend", FLOAT32_BACKENDS)
def test_mixed_list_without_autocast_is_promoted(backend):
    """Without autocast a [float32, bfloat16, ...] list is promoted to float32 (as torch ops promote):
    exact bfloat16 values in float32, so float32 accuracy; each gradient in its source's dtype."""
    dev = _device(backend)
    query, master, grad = _master(4, (2, 3), 12, (12,))
    vs = [master[0].to(dev).requires_grad_()] + [s.bfloat16().to(dev).requires_grad_() for s in master[1:]]
    q = query.to(dev).requires_grad_()
    out = depth_attention(q, vs, heads=2, backend=backend)
    assert out.dtype == torch.float32
    grads = torch.autograd.grad(out, [q, *vs], grad.to(dev))
    assert [g.dtype for g in grads] == [torch.float32, torch.float32] + [torch.bfloat16] * 3
    want = _reference(query, vs, grad, heads=2)
    torch.testing.assert_close(out.double().cpu(), want[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(grads[0].double().cpu(), want[1], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(grads[1].double().cpu(), want[2], atol=2e-5, rtol=2e-5)
    for i in range(3):  # bfloat16 gradients: the one rounding
        _assert_tight(grads[2 + i], want[3 + i], f"dv[{i + 1}]")


@pytest.mark.parametrize("backend", FLOAT64_BACKENDS)
def test_float64_ignores_autocast(backend):
    """Autocast never touches float64 (as torch's own autocast ops): the same bits as without it."""
    q = torch.randn(8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
    plain = depth_attention(q, v, heads=2, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = depth_attention(q, v, heads=2, backend=backend)
    assert under.dtype == torch.float64
    assert torch.equal(under, plain)
    g = torch.randn_like(plain)
    assert all(
        torch.equal(a, b)
        for a, b in zip(torch.autograd.grad(under, (q, v), g), torch.autograd.grad(plain, (q, v), g))
    )


def test_auto_backend_follows_the_activation_dtype():
    """``auto`` chooses for the activation dtype: the C kernel for bfloat16 autocast (when it builds),
    the eager path for float16 (no CPU half kernel)."""
    srcs = [torch.randn(2, 8), torch.randn(2, 8).bfloat16()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert select_backend(srcs) == ("compiled" if _runs("compiled", torch.bfloat16) else "fused")
    if _autocast_supports("cpu", torch.float16):
        with torch.autocast("cpu", dtype=torch.float16):
            assert select_backend(srcs) == "fused"
            assert depth_attention(torch.randn(8), srcs).dtype == torch.float16
            with pytest.raises(RuntimeError, match="compiled"):
                depth_attention(torch.randn(8), srcs, backend="compiled")


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_backward_inside_autocast_stays_float32(backend):
    """A backward run inside the autocast block (the Function turns autocast off for it) gives the
    same gradients as one outside: autocast would otherwise run the eager einsums in bfloat16."""
    dev = _device(backend)
    query, master, grad = _master(4, (3,), 16, (16,))
    q = query.to(dev).requires_grad_()
    vs = [s.bfloat16().to(dev).requires_grad_() for s in master]
    g = grad.bfloat16().to(dev)
    with torch.autocast(torch.device(dev).type, dtype=torch.bfloat16):
        out = depth_attention(q, vs, heads=2, backend=backend)
        inside = torch.autograd.grad(out, [q, *vs], g, retain_graph=True)
    outside = torch.autograd.grad(out, [q, *vs], g)
    assert all(torch.equal(a, b) for a, b in zip(inside, outside))


@pytest.mark.parametrize("backend,dtype", CASES)
@pytest.mark.parametrize("heads,key_norm", HEADS)
def test_two_phase_statistics_and_merge(backend, dtype, heads, key_norm):
    """(c) phase-1 states under autocast keep max, sum and out in float32 and remember the activation
    dtype; (d) phase 1 over the known sources (the float32 embedding among them) + phase 2 over the
    rest equals the plain op on all of them: both round once from float32, so within one ulp."""
    dev = _device(backend)
    batch, d, known = (2, 5), 16, 3
    gen = torch.Generator().manual_seed(3)
    master = list((torch.randn(5, *batch, d, generator=gen) * 1.5).unbind(0))
    sources = [master[0].to(dev)] + [s.to(dtype).to(dev) for s in master[1:]]
    queries = (torch.randn(3, d, generator=gen) / d**0.5).to(dev)
    kw = dict(heads=heads, key_norm=key_norm)
    with torch.no_grad(), _autocast(dev, dtype):
        states = depth_states_batched(queries, sources[:known], backend=backend, **kw)
        assert (states.max.dtype, states.sum.dtype, states.out.dtype) == (torch.float32,) * 3
        assert states.dtype == dtype and states[0].output().dtype == dtype
        for k in range(3):
            merged = depth_attention_merged(states[k], queries[k], sources[known:], backend=backend, **kw)
            plain = depth_attention(queries[k], sources, backend=backend, **kw)
            assert merged.dtype == plain.dtype == dtype
            _assert_tight(merged, plain.double(), f"query {k}: two-phase vs plain")
            want = depth_attention_reference(
                queries[k].double(), torch.stack([s.to(dtype).double() for s in sources]), **kw
            )
            _assert_tight(merged, want, f"query {k}: two-phase vs float64")
        # a phase-1 state that covers every source: its output, rounded once
        full = depth_states_batched(queries, sources, backend=backend, **kw)
        for k in range(3):
            _assert_tight(
                full[k].output(),
                depth_attention(queries[k], sources, backend=backend, **kw).double(),
                "state",
            )


def test_functional_states_and_logits_are_float32():
    """The functional floor under autocast: logits and states in float32, the activation dtype recorded."""
    q = torch.randn(8)
    v = torch.stack([torch.randn(2, 8), torch.randn(2, 8)])  # float32, read as bfloat16 under autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert depth_logits(q, v).dtype == torch.float32
        # the float32 sources are read as bfloat16: the same as handing them over in bfloat16
        assert torch.equal(depth_logits(q, v), depth_logits(q, v.bfloat16()))
        assert torch.equal(depth_attention_reference(q, v), depth_attention_reference(q, v.bfloat16()))
        a, b = depth_state(q, v[:1]), depth_state(q, v[1:].bfloat16())
        assert (a.max.dtype, a.sum.dtype, a.out.dtype, a.dtype) == (torch.float32,) * 3 + (torch.bfloat16,)
        merged = merge_states(a, b)
        assert merged.dtype == torch.bfloat16 and merged.out.dtype == torch.float32
        _assert_tight(merged.output(), depth_attention_reference(q.double(), v.bfloat16().double()), "merged")
    assert (
        merge_states(depth_state(q, v[:1]), depth_state(q, v[1:].bfloat16())).output().dtype == torch.float32
    )


@pytest.mark.parametrize("backend,dtype", CASES)
def test_two_phase_under_autograd(backend, dtype):
    """With a graph the two-phase ops run the functional formulas: gradients reach each source in its dtype."""
    dev = _device(backend)
    query, master, grad = _master(4, (3,), 8, (8,))
    vs = [master[0].to(dev).requires_grad_()] + [s.to(dtype).to(dev).requires_grad_() for s in master[1:]]
    q = query.to(dev).requires_grad_()
    with _autocast(dev, dtype):
        state = depth_states_batched(q[None], vs[:2], backend=backend)
        out = depth_attention_merged(state[0], q, vs[2:], backend=backend)
        plain = depth_attention(q, vs, backend=backend)
    assert out.dtype == dtype
    g = grad.to(dtype).to(dev)
    got = torch.autograd.grad(out, [q, *vs], g)
    want = torch.autograd.grad(plain, [q, *vs], g)
    assert [t.dtype for t in got] == [torch.float32, torch.float32] + [dtype] * 3
    for i, (a, b) in enumerate(zip(got, want)):
        _assert_tight(a, b.double(), f"grad {i}", torch.float32 if i == 0 else dtype)


@pytest.mark.parametrize("backend,dtype", CASES)
def test_sigmoid_under_autocast(backend, dtype):
    """(e) ``normalize="sigmoid"`` (the reference formula on every backend) follows the contract too."""
    dev = _device(backend)
    query, master, grad = _master(4, (3, 2), 12, (12,))
    vs = [master[0].to(dev).requires_grad_()] + [s.to(dtype).to(dev).requires_grad_() for s in master[1:]]
    q = query.to(dev).requires_grad_()
    with _autocast(dev, dtype):
        out = depth_attention(q, vs, heads=3, normalize="sigmoid", backend=backend)
    assert out.dtype == dtype
    grads = torch.autograd.grad(out, [q, *vs], grad.to(dtype).to(dev))
    assert [t.dtype for t in grads] == [torch.float32, torch.float32] + [dtype] * 3
    as_read = [s.detach().to(dtype) for s in vs]
    want = _reference(query, as_read, grad.to(dtype), heads=3, normalize="sigmoid")
    for i, (a, b) in enumerate(zip((out, *grads), want)):
        _assert_tight(a, b, f"result {i}", torch.float32 if i == 1 else dtype)
