"""Every depth-attention backend against the plain float64 reference, forward and backward.

The triton backend runs on CUDA when there is one, otherwise through ``TRITON_INTERPRET=1`` on CPU
with tiny shapes (skipped when triton is not installed).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON and not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

from attention_residuals import kernels  # noqa: E402
from attention_residuals.functional import depth_attention_reference  # noqa: E402
from attention_residuals.kernels import (  # noqa: E402
    BACKENDS,
    autograd,
    backend_status,
    cpu,
    depth_attention,
    select_backend,
)

COMPILED_REASON = cpu.unavailable_reason("cpu", torch.float32)
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"


def _device(backend: str) -> str:
    return TRITON_DEVICE if backend == "triton" else "cpu"


def _skip_unavailable(backend: str, dtype: torch.dtype = torch.float32) -> None:
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    reason = backend_status(_device(backend), dtype)[backend]
    if reason is not None:
        pytest.skip(reason)


def _reference_grads(query, sources, grad, **kw):
    """Forward and gradients of the float64 reference on float64 copies of the inputs."""
    q = query.detach().double().requires_grad_()
    v = sources.detach().double().requires_grad_()
    out = depth_attention_reference(q, v, **kw)
    dq, dv = torch.autograd.grad(out, (q, v), grad.double())
    return out, dq, dv


def _backend_grads(query, sources, grad, backend, **kw):
    q = query.detach().clone().requires_grad_()
    v = sources.detach().clone().requires_grad_()
    out = depth_attention(q, v, backend=backend, **kw)
    dq, dv = torch.autograd.grad(out, (q, v), grad)
    return out, dq, dv


def _inputs(n, batch, d, query_shape, dtype, device, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sources = (torch.randn(n, *batch, d, generator=gen, dtype=torch.float64) * 2 + 0.5).to(dtype)
    query = (torch.randn(*query_shape, generator=gen, dtype=torch.float64) * scale).to(
        dtype if dtype != torch.bfloat16 else torch.float32
    )
    grad = torch.randn(*batch, d, generator=gen, dtype=torch.float64).to(dtype)
    return query.to(device), sources.to(device), grad.to(device)


def _assert_close(got, want, tol):
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), atol=tol, rtol=tol)


QUERY_SHAPES = {
    "static": lambda b, d: (d,),
    "input": lambda b, d: (*b, d),
    "broadcast": lambda b, d: (b[0], 1, d),
}


@pytest.mark.parametrize("backend", ["fused", "compiled", "triton"])
@pytest.mark.parametrize("query_kind", list(QUERY_SHAPES))
@pytest.mark.parametrize("heads,key_norm", [(1, True), (3, True), (1, False), (3, False)])
def test_float32_matches_float64_reference(backend, query_kind, heads, key_norm):
    _skip_unavailable(backend)
    batch, d = (2, 3), 12  # d not a power of two
    q, v, g = _inputs(4, batch, d, QUERY_SHAPES[query_kind](batch, d), torch.float32, _device(backend))
    kw = dict(heads=heads, key_norm=key_norm)
    want = _reference_grads(q, v, g, **kw)
    got = _backend_grads(q, v, g, backend, **kw)
    assert got[0].dtype == torch.float32 and got[0].shape == (*batch, d)
    for a, b in zip(got, want, strict=True):
        _assert_close(a, b, 2e-5)


@pytest.mark.parametrize("backend", ["fused", "compiled"])
@pytest.mark.parametrize("query_kind", list(QUERY_SHAPES))
@pytest.mark.parametrize("heads,key_norm", [(1, True), (2, True), (1, False)])
def test_float64_exact(backend, query_kind, heads, key_norm):
    _skip_unavailable(backend, torch.float64)
    batch, d = (2, 3), 10
    q, v, g = _inputs(5, batch, d, QUERY_SHAPES[query_kind](batch, d), torch.float64, "cpu", scale=3.0)
    kw = dict(heads=heads, key_norm=key_norm)
    for a, b in zip(_backend_grads(q, v, g, backend, **kw), _reference_grads(q, v, g, **kw), strict=True):
        _assert_close(a, b, 1e-10)


@pytest.mark.parametrize("backend", ["fused", "compiled"])
@pytest.mark.parametrize("query_kind", ["static", "broadcast"])
@pytest.mark.parametrize("heads,key_norm", [(1, True), (2, False)])
def test_gradcheck(backend, query_kind, heads, key_norm):
    _skip_unavailable(backend, torch.float64)
    batch, d = (2, 2), 6
    q, v, _ = _inputs(3, batch, d, QUERY_SHAPES[query_kind](batch, d), torch.float64, "cpu", scale=2.0)
    q.requires_grad_()
    v.requires_grad_()

    def f(q, v):
        return depth_attention(q, v, heads=heads, key_norm=key_norm, backend=backend)

    assert torch.autograd.gradcheck(f, (q, v), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    "backend,dtype",
    [
        ("fused", torch.bfloat16),
        ("compiled", torch.bfloat16),
        ("triton", torch.bfloat16),
        ("fused", torch.float16),
        ("triton", torch.float16),
    ],
)  # the compiled kernel has no float16
@pytest.mark.parametrize("query_kind", ["static", "input"])
def test_half_precision(backend, dtype, query_kind):
    _skip_unavailable(backend, dtype)
    batch, d = (3, 2), 20
    q, v, g = _inputs(5, batch, d, QUERY_SHAPES[query_kind](batch, d), dtype, _device(backend))
    q = q.float()  # the query is held in the accumulation type
    # The reference sees the same rounded inputs (in float64): only the kernel's own rounding is left.
    want = _reference_grads(q, v, g)
    got = _backend_grads(q, v, g, backend)
    assert got[0].dtype == dtype and got[2].dtype == dtype
    assert got[1].dtype == torch.float32  # the query keeps its dtype
    for a, b in zip(got, want, strict=True):
        scale = b.abs().max().item()
        assert (a.double().cpu() - b.cpu()).abs().max().item() <= 1e-2 * scale + 1e-3


@pytest.mark.parametrize("backend", ["fused", "compiled", "triton"])
def test_single_source_is_identity_and_zero_query_is_mean(backend):
    _skip_unavailable(backend)
    dev = _device(backend)
    q, v, g = _inputs(1, (2, 3), 7, (7,), torch.float32, dev)
    out, dq, dv = _backend_grads(q, v, g, backend)
    _assert_close(out, v[0], 1e-6)
    _assert_close(dq, torch.zeros(7), 1e-6)  # one source: the weight is 1 whatever the query
    _assert_close(dv[0], g, 1e-6)
    v = torch.randn(5, 2, 3, 7, device=dev)
    _assert_close(depth_attention(torch.zeros(7, device=dev), v, backend=backend), v.mean(0), 1e-5)


@pytest.mark.parametrize("backend", ["fused", "compiled", "triton"])
def test_unbatched_and_empty_batch(backend):
    _skip_unavailable(backend)
    dev = _device(backend)
    q, v, g = _inputs(3, (), 5, (5,), torch.float32, dev)  # sources [N, d]: one token
    for a, b in zip(_backend_grads(q, v, g, backend), _reference_grads(q, v, g), strict=True):
        _assert_close(a, b, 2e-5)
    v = torch.randn(3, 0, 5, device=dev, requires_grad=True)
    qq = torch.randn(5, device=dev, requires_grad=True)
    out = depth_attention(qq, v, backend=backend)
    assert out.shape == (0, 5)
    dq, dv = torch.autograd.grad(out.sum(), (qq, v))
    assert dv.shape == v.shape and torch.equal(dq, torch.zeros_like(dq))


def test_compiled_online_softmax_across_tiles_and_threads(monkeypatch):
    """The one-pass forward's accumulators rescaled when the max moves, over several token tiles
    per thread (float64 rows of 32 KiB: 16 tokens a tile) on two threads; the two-pass backward
    with one token per tile (9 + 1 rows exceed its 256 KiB tile)."""
    _skip_unavailable("compiled", torch.float64)
    monkeypatch.setattr(cpu, "_ELEMS_PER_THREAD", 1)  # force the multi-threaded split on tiny work
    torch.set_num_threads(2)
    d, m = 4096, 60
    q, v, g = _inputs(9, (m,), d, (d,), torch.float64, "cpu", scale=0.5)
    # make the max move late: the last source is the most aligned with the query
    v[-1] = q * 40
    for heads in (1, 2):
        got = _backend_grads(q, v, g, "compiled", heads=heads)
        want = _reference_grads(q, v, g, heads=heads)
        _assert_close(got[0], want[0], 1e-10)
        _assert_close(got[2], want[2], 1e-10)
        # The last source takes all the weight, so dq = sum_i dz_i r_i v_i cancels to 0 in the
        # reference; allow float64 rounding of its terms, |g . v_i| r_i |v_i| ~ 6e3 here.
        rows = v.view(9, m, heads, d // heads)
        r = (rows.pow(2).mean(-1) + 1e-6).rsqrt()
        terms = (g.view(m, heads, -1) * rows).sum(-1).abs() * r * rows.abs().amax(-1)
        torch.testing.assert_close(got[1], want[1], atol=1e-12 * terms.max().item(), rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_nan_stays_in_its_token(dtype):
    """A NaN in one token's source makes that token's output NaN and no other: accumulators reused
    from token to token and tile to tile are overwritten, never scaled by 0 (0 * NaN = NaN)."""
    _skip_unavailable("compiled", dtype)
    d, m = 4096, 100  # several tiles per thread
    q, v, _ = _inputs(3, (m,), d, (d,), dtype, "cpu", scale=0.5)
    v = v.detach().clone()
    v[0, 7, 5] = float("nan")
    with torch.no_grad():
        got = depth_attention(q.detach(), v, backend="compiled")
        want = depth_attention_reference(q.detach().double(), v.double())
    bad = torch.isnan(got).any(-1)
    assert bad.tolist() == [t == 7 for t in range(m)]
    _assert_close(got[~bad], want[~bad], 2e-4 if dtype == torch.float32 else 1e-10)  # d = 4096 in float32


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("query_kind", ["static", "input"])
@pytest.mark.parametrize("heads,key_norm", [(1, True), (2, True), (2, False)])
def test_compiled_vector_loops(dtype, tol, query_kind, heads, key_norm):
    """Rows long enough for the kernels' vector loops: blocks of four vectors, single vectors and a
    scalar tail (d = 170: per head 170 or 85 channels), several threads, against float64."""
    _skip_unavailable("compiled", dtype)
    torch.set_num_threads(2)
    batch, d = (2, 40), 170
    q, v, g = _inputs(9, batch, d, QUERY_SHAPES[query_kind](batch, d), dtype, "cpu", scale=0.3)
    kw = dict(heads=heads, key_norm=key_norm)
    for a, b in zip(_backend_grads(q, v, g, "compiled", **kw), _reference_grads(q, v, g, **kw), strict=True):
        # sums of 9 x 80 terms with cancellation: the error is measured against the tensor's scale
        assert (a.double() - b).abs().max().item() <= tol * b.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("d", [13, 170])
def test_compiled_streaming_stores(dtype, d):
    """Large outputs are written with non-temporal stores: same numbers (forced on a tiny shape)."""
    _skip_unavailable("compiled", dtype)
    q, v, g = _inputs(3, (5,), d, (5, d), dtype, "cpu")  # odd row sizes: unaligned heads and tails
    want = _backend_grads(q, v, g, "compiled", heads=1)
    old = cpu.set_stream_threshold(0)
    try:
        got = _backend_grads(q, v, g, "compiled", heads=1)
    finally:
        cpu.set_stream_threshold(old)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("query_kind", ["static", "input"])
@pytest.mark.parametrize("heads,key_norm", [(1, True), (2, False)])
def test_triton_chunked_kernels(query_kind, heads, key_norm):
    """Channel chunks smaller than a head: the two-pass forward and chunked backward."""
    _skip_unavailable("triton")
    from attention_residuals.kernels import triton_kernels

    batch, d = (5,), 20
    q, v, g = _inputs(4, batch, d, QUERY_SHAPES[query_kind](batch, d), torch.float32, TRITON_DEVICE)
    out, lse = triton_kernels.forward(q.contiguous(), v.contiguous(), 1e-6, heads, key_norm, block_d=4)
    dq, dv = triton_kernels.backward(q, v, lse, g, 1e-6, heads, key_norm, block_d=4)
    want = _reference_grads(q, v, g, heads=heads, key_norm=key_norm)
    for a, b in zip((out, dq, dv), want, strict=True):
        _assert_close(a, b, 2e-5)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("query_kind", ["static", "input"])
@pytest.mark.parametrize("block_d", [None, 2])
def test_triton_many_token_blocks(query_kind, block_d):
    """150 tokens: three programs of 64 along the tokens, the last one ragged, and the static
    query's gradient summed over the programs; with block_d = 2 the chunked kernels do the same."""
    _skip_unavailable("triton")
    from attention_residuals.kernels import triton_kernels

    batch, d, heads = (150,), 8, 2
    q, v, g = _inputs(3, batch, d, QUERY_SHAPES[query_kind](batch, d), torch.float32, TRITON_DEVICE)
    assert triton_kernels._blocks(d // heads, batch[0], block_d)[0] < batch[0] / 2
    out, lse = triton_kernels.forward(q.contiguous(), v.contiguous(), 1e-6, heads, True, block_d=block_d)
    dq, dv = triton_kernels.backward(q, v, lse, g, 1e-6, heads, True, block_d=block_d)
    for a, b in zip((out, dq, dv), _reference_grads(q, v, g, heads=heads), strict=True):
        _assert_close(a, b, 2e-5)


@pytest.mark.skipif(
    not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA device (the interpreter runs tiny shapes only)"
)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("n,m,d,heads", [(9, 4096, 1024, 1), (3, 1000, 4096, 1), (17, 512, 768, 4)])
def test_triton_cuda_shapes(dtype, tol, n, m, d, heads):
    """The GPU kernels at model sizes (several channel chunks, ragged token tiles), against float64:
    relative error ||got - ref|| / ||ref|| of the output and both gradients. The caching allocator
    is handed NaN-filled blocks first, so outputs it reuses start as NaN: an unwritten element fails."""
    _skip_unavailable("triton", dtype)
    q, v, g = _inputs(n, (m,), d, (d,), dtype, "cuda", scale=0.1, seed=m)
    poison = [torch.full((m, d), float("nan"), dtype=dtype, device="cuda") for _ in range(n + 4)]
    del poison
    got = _backend_grads(q, v, g, "triton", heads=heads)
    want = _reference_grads(q, v, g, heads=heads)
    for name, a, b in zip(("out", "dq", "dv"), got, want, strict=True):
        a = a.double().cpu()
        assert torch.isfinite(a).all(), name
        rel = ((a - b.cpu()).norm() / b.norm()).item()
        assert rel < tol, f"{name}: relative error {rel:.2e} >= {tol}"


def test_triton_kernels_compile_for_hopper(tmp_path):
    """The interpreter never compiles a kernel: scripts/triton_aot.py takes every kernel and each
    value of each constexpr flag, float32 and bfloat16, through Triton's compiler and the wheel's
    ptxas to an sm_90 cubin, on this CPU."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not all(os.path.exists(os.path.join(tools, t)) for t in ("ptxas", "cuobjdump")):
        pytest.skip("this triton wheel has no NVIDIA backend with ptxas and cuobjdump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from an earlier run's cache
    script = os.path.join(
        os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "scripts", "triton_aot.py"
    )
    json_path = tmp_path / "aot.json"
    proc = subprocess.run(
        [sys.executable, script, "--arch", "90", "--quick", "--json", str(json_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(json_path.read_text())
    assert report["failures"] == []
    rows = report["rows"]
    assert {r["kernel"] for r in rows} == {"_fwd_onepass", "_fwd_chunked", "_bwd", "_merge"}
    from attention_residuals.kernels import triton_kernels

    assert all(r["arch"] == "sm_90" and r["num_warps"] == triton_kernels._NUM_WARPS for r in rows)
    assert all("regs" in r for r in rows)  # cuobjdump read every cubin: none spills to the stack
    assert [r for r in rows if r["stack"] > 0] == []


@pytest.mark.parametrize("as_list", [False, True])
def test_backward_saves_only_sources_query_and_scalars(as_list):
    """What the Function keeps for backward: the inputs themselves (views of their storage, no
    stacked copy) and one float32 scalar per token and head."""
    q = torch.randn(8, requires_grad=True)
    v = torch.randn(4, 2, 3, 8, requires_grad=True)
    sources = [torch.randn(2, 3, 8, requires_grad=True) for _ in range(4)] if as_list else v
    inputs = {t.untyped_storage().data_ptr() for t in ([q, *sources] if as_list else [q, v])}
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for backend in ("fused",) + (("compiled",) if COMPILED_REASON is None else ()):
            saved.clear()
            depth_attention(q, sources, heads=2, backend=backend)
            extra = [t for t in saved if t.untyped_storage().data_ptr() not in inputs]
            assert [tuple(t.shape) for t in extra] == [(6, 2)] and extra[0].dtype == torch.float32
            assert len(saved) == 2 + (
                4 if as_list else 1
            )  # query, lse, the four sources (or their one tensor)


@pytest.mark.parametrize("backend", ["fused", "compiled"])
def test_stacked_sources_get_one_gradient_tensor(backend):
    """A stacked [N, ...] input gets its gradient as one tensor written in place by the backend:
    no stack of N per-source gradients (a copy of all of them) in backward."""
    _skip_unavailable(backend)
    q, v, g = _inputs(4, (2, 3), 8, (8,), torch.float32, "cpu")
    got = _backend_grads(q, v, g, backend)
    for a, b in zip(got, _reference_grads(q, v, g), strict=True):
        _assert_close(a, b, 2e-5)
    vg = v.clone().requires_grad_()
    out = depth_attention(q, vg, backend=backend)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out.backward(g)
    ops = {e.key for e in prof.key_averages()}
    assert not ops & {"aten::stack", "aten::cat"}, ops
    assert vg.grad.shape == v.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_list_of_sources_equals_stacked(backend):
    """A list of [*batch, d] sources gives the stacked tensor's output and gradients."""
    if backend_status()[backend]:
        pytest.skip(backend_status()[backend])
    q = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(4, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    if backend == "triton":
        q, v = (t.detach().float().requires_grad_() for t in (q, v))
    parts = [s.detach().clone().requires_grad_() for s in v]
    g = torch.randn(2, 3, 8, dtype=v.dtype)
    out = depth_attention(q, v, heads=2, backend=backend)
    out_list = depth_attention(q, parts, heads=2, backend=backend)
    torch.testing.assert_close(out_list, out)
    dv = torch.autograd.grad(out, v, g)[0]
    dparts = torch.autograd.grad(out_list, parts, g)
    torch.testing.assert_close(torch.stack(dparts), dv)


@pytest.mark.parametrize(
    "sources, match",
    [
        ([], "empty"),
        ([torch.randn(2, 8), torch.randn(3, 8)], r"sources\[1\]"),
        ([torch.randn(2, 8), torch.randint(0, 3, (2, 8))], r"sources\[1\]: expected a floating-point"),
        ([torch.randn(2, 8), "x"], r"sources\[1\]"),
    ],
)
def test_bad_source_lists(sources, match):
    """Shapes and devices must match; dtypes may differ (tests/test_precision.py), but not be integers."""
    with pytest.raises((ValueError, TypeError), match=match):
        depth_attention(torch.randn(8), sources)


BAD_INPUTS = [
    (lambda: (torch.randn(4), torch.randn(0, 2, 4)), ValueError, "sources"),
    (lambda: (torch.randn(5), torch.randn(3, 2, 4)), ValueError, "query"),
    (lambda: (torch.randn(3, 4), torch.randn(3, 2, 4)), ValueError, "query"),
    (lambda: (torch.randn(4), torch.randint(0, 3, (3, 2, 4))), TypeError, "sources"),
    (lambda: (torch.randint(0, 3, (4,)), torch.randn(3, 2, 4)), TypeError, "query"),
    (lambda: (torch.randn(4), torch.randn(4)), ValueError, "sources"),
]


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)))
@pytest.mark.parametrize("backend", ("auto",) + BACKENDS)
def test_bad_inputs_raise_like_the_reference(case, backend):
    make, exc, word = BAD_INPUTS[case]
    with pytest.raises(exc, match=word) as ref_err:
        depth_attention_reference(*make())
    with pytest.raises(exc, match=word) as err:
        depth_attention(*make(), backend=backend)
    assert str(err.value) == str(ref_err.value)
    with pytest.raises(ValueError, match="heads"):
        depth_attention(torch.randn(6), torch.randn(2, 3, 6), heads=4, backend=backend)


def test_dispatcher_choices(monkeypatch):
    v32 = torch.randn(3, 2, 4)
    assert select_backend(v32, "sigmoid") == "reference"
    assert select_backend(v32, "sigmoid", "compiled") == "reference"
    assert select_backend(v32, backend="fused") == "fused"
    assert select_backend(v32) == ("compiled" if COMPILED_REASON is None else "fused")
    assert select_backend(v32.half()) == "fused"  # no CPU half kernel
    with pytest.raises(ValueError, match="backend"):
        select_backend(v32, backend="cuda")
    with pytest.raises(RuntimeError, match="compiled"):
        select_backend(v32.half(), backend="compiled")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="triton"):
        select_backend(v32, backend="triton")
    with pytest.raises(RuntimeError, match="float64"):
        select_backend(v32.double(), backend="triton")
    # sigmoid runs the reference formula on every backend
    q = torch.randn(4)
    for backend in ("auto", "fused", "compiled"):
        got = depth_attention(q, v32, normalize="sigmoid", backend=backend)
        _assert_close(got, depth_attention_reference(q, v32, normalize="sigmoid"), 1e-6)
    with pytest.raises(ValueError, match="normalize"):
        depth_attention(q, v32, normalize="relu")


def test_dtype_mix_and_noncontiguous():
    """A float64 query with float32 sources, and transposed (non-contiguous) sources."""
    base = torch.randn(2, 3, 4, 6).transpose(1, 2)  # [N=2, 4, 3, d=6], not contiguous
    q = torch.randn(6, dtype=torch.float64, requires_grad=True)
    v = base.clone().requires_grad_()
    for backend in ("fused", "compiled") if COMPILED_REASON is None else ("fused",):
        out = depth_attention(q, base, backend=backend)
        assert out.dtype == torch.float32
        _assert_close(out, depth_attention_reference(q, base), 1e-5)
        dq, dv = torch.autograd.grad(depth_attention(q, v, backend=backend).square().sum(), (q, v))
        rq, rv = torch.autograd.grad(depth_attention_reference(q, v).square().sum(), (q, v))
        assert dq.dtype == torch.float64 and dv.dtype == torch.float32
        _assert_close(dq, rq, 1e-5)
        _assert_close(dv, rv, 1e-5)


def test_compiled_backend_builds_where_there_is_a_compiler():
    """The compiled tests skip themselves when the kernel cannot be built; on Linux with gcc it must
    build, or a broken kernel would only turn those tests into skips."""
    if sys.platform != "linux" or not shutil.which(os.environ.get("CC") or "gcc"):
        pytest.skip("no gcc here")
    if os.environ.get("ATTNRES_NO_COMPILE"):
        pytest.skip("ATTNRES_NO_COMPILE is set")
    assert COMPILED_REASON is None, COMPILED_REASON


def test_no_compiler_falls_back_to_fused():
    code = (
        "import torch; from attention_residuals.kernels import select_backend, depth_attention\n"
        "v = torch.randn(3, 2, 4)\n"
        "assert select_backend(v) == 'fused', select_backend(v)\n"
        "depth_attention(torch.randn(4), v)\n"
        "try:\n    select_backend(v, backend='compiled')\nexcept RuntimeError as e:\n    print(e)\n"
        # inside torch.compile the build is settled when the operator runs: auto computes the
        # eager formulas there, a forced backend='compiled' raises
        "q = torch.randn(4, requires_grad=True)\n"
        "f = torch.compile(lambda q, v, b: depth_attention(q, v, backend=b), backend='aot_eager', fullgraph=True)\n"
        "out = f(q, v, 'auto'); torch.autograd.grad(out.sum(), q)\n"
        "torch.testing.assert_close(out, depth_attention(q, v))\n"
        "try:\n    f(q, v, 'compiled')\nexcept Exception as e:\n    assert 'ATTNRES_NO_COMPILE' in str(e), e\n"
        "else:\n    raise AssertionError('no error')\n"
    )
    env = dict(os.environ, ATTNRES_NO_COMPILE="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ATTNRES_NO_COMPILE" in proc.stdout


def test_pthreads_build_matches():
    """The POSIX-threads build (no OpenMP) gives the same numbers, on several threads."""
    if COMPILED_REASON is not None:
        pytest.skip(COMPILED_REASON)
    code = (
        "import torch; from attention_residuals.kernels import cpu, depth_attention\n"
        "from attention_residuals.functional import depth_attention_reference as ref\n"
        "assert cpu.threading_model() == 'pthreads', cpu.threading_model()\n"
        "cpu._ELEMS_PER_THREAD = 1; torch.set_num_threads(2)\n"
        "q = torch.randn(8, dtype=torch.float64, requires_grad=True)\n"
        "v = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)\n"
        "a = torch.autograd.grad(depth_attention(q, v, backend='compiled').sum(), (q, v))\n"
        "b = torch.autograd.grad(ref(q, v).sum(), (q, v))\n"
        "assert all(torch.allclose(x, y, atol=1e-12) for x, y in zip(a, b))\n"
    )
    env = dict(os.environ, ATTNRES_NO_OPENMP="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set flags")
@pytest.mark.parametrize("cflags", ["-mno-avx512f", "-mno-avx512f -mno-avx2 -mno-avx -mno-fma"])
def test_narrower_vector_builds_match(cflags, tmp_path):
    """The kernels built for 32-byte vectors (AVX2) and for SSE only (no non-temporal stores), as
    on machines without AVX-512: the same numbers as the float64 reference at vector-loop sizes."""
    if COMPILED_REASON is not None:
        pytest.skip(COMPILED_REASON)
    code = (
        "import torch; from attention_residuals.kernels import cpu, depth_attention, depth_states_batched\n"
        "from attention_residuals.functional import depth_attention_reference as ref\n"
        "assert cpu.vector_bytes() == 32, cpu.vector_bytes()  # the narrower build is the one tested\n"
        "cpu._ELEMS_PER_THREAD = 1; torch.set_num_threads(2); cpu.set_stream_threshold(0)\n"
        "for dt, tol in ((torch.float64, 1e-10), (torch.float32, 1e-4), (torch.bfloat16, 5e-2)):\n"
        "    q = torch.randn(170, dtype=torch.float64).mul(0.3).requires_grad_()\n"
        "    v = torch.randn(9, 40, 170, dtype=torch.float64).to(dt).requires_grad_()\n"
        "    for heads in (1, 2):\n"
        "        qq = q if dt == torch.float64 else q.float()\n"
        "        a = torch.autograd.grad(depth_attention(qq, v, heads=heads, backend='compiled').pow(2).sum(), (q, v))\n"
        "        b = torch.autograd.grad(ref(q, v.double(), heads=heads).pow(2).sum(), (q, v))\n"
        "        for x, y in zip(a, b):\n"
        "            assert (x.double() - y.double()).abs().max() <= tol * y.abs().max(), (dt, heads)\n"
        "    with torch.no_grad():\n"
        "        qs = q.detach()[None] if dt == torch.float64 else q.detach().float()[None]\n"
        "        st = depth_states_batched(qs, v.detach(), backend='compiled')\n"
        "        want = ref(q.detach(), v.detach().double())\n"
        "        assert (st.out[0].double() - want).abs().max() <= tol * want.abs().max()\n"
    )
    env = dict(os.environ, ATTNRES_CFLAGS=cflags, ATTNRES_CACHE=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


# ----------------------------------------------------------------------------------------------
# two-phase inference kernels


@pytest.mark.parametrize("backend", ["reference", "compiled", "triton"])
@pytest.mark.parametrize("heads,key_norm", [(1, True), (3, True), (1, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [12, 174])  # 174: the compiled kernels' vector loops and a scalar tail
def test_two_phase_states_and_merge(backend, heads, key_norm, dtype, d):
    """Phase 1 (Q queries over the known sources) + phase 2 (merge the rest) == one pass over all."""
    from attention_residuals.functional import depth_state, depth_state_batched, merge_states

    if backend != "reference":
        _skip_unavailable(backend, dtype)
    dev = _device(backend)
    gen = torch.Generator().manual_seed(1)
    known, rest = 4, 2
    sources = (torch.randn(known + rest, 3, 5, d, generator=gen) * 2).to(dtype).to(dev)
    queries = torch.randn(3, d, generator=gen).to(dev)
    kw = dict(heads=heads, key_norm=key_norm)
    got = kernels.depth_states_batched(queries, sources[:known], backend=backend, **kw)
    want = depth_state_batched(queries, sources[:known], **kw)
    assert got.out.shape == want.out.shape and got.max.shape == want.max.shape
    _assert_close(got.out, want.out, 2e-5)
    _assert_close(got.max + got.sum.log(), want.max + want.sum.log(), 2e-5)  # same log-normaliser
    for k in range(3):
        out = kernels.depth_attention_merged(got[k], queries[k], sources[known:], backend=backend, **kw)
        assert out.dtype == dtype and out.shape == (3, 5, d)
        full = depth_attention_reference(queries[k], sources.double(), **kw)
        tol = 2e-5 if dtype == torch.float32 else 1e-2 * full.abs().max().item()
        _assert_close(out, full, tol)
        via_functional = merge_states(want[k], depth_state(queries[k], sources[known:], **kw))
        _assert_close(out, via_functional.output(dtype), tol)


@pytest.mark.parametrize(
    "backend,dtype,tol",
    [("compiled", torch.float32, 2e-5), ("compiled", torch.float64, 1e-12), ("triton", torch.float32, 2e-5)],
)  # triton has no float64
@pytest.mark.parametrize("rest", [1, 3])
@pytest.mark.parametrize("d", [12, 174])
def test_merge_of_any_state(backend, dtype, tol, rest, d):
    """Phase 2 from a state whose sum is not 1 (made by the functional formula, not by phase 1),
    with one new source (the kernels' own branch) or several, in float32 and float64."""
    from attention_residuals.functional import depth_state

    _skip_unavailable(backend, dtype)
    dev = _device(backend)
    gen = torch.Generator().manual_seed(2)
    sources = (torch.randn(3 + rest, 2, 5, d, generator=gen, dtype=torch.float64) * 2).to(dtype).to(dev)
    query = torch.randn(d, generator=gen, dtype=torch.float64).to(dtype).to(dev)
    state = depth_state(query, sources[:3], heads=2)
    assert not torch.allclose(state.sum, torch.ones_like(state.sum))
    got = kernels.depth_attention_merged(state, query, sources[3:], heads=2, backend=backend)
    _assert_close(got, depth_attention_reference(query.double(), sources.double(), heads=2), tol)


def test_compiled_states_float64():
    """Phase 1 in float64: every query's output and log-normaliser, to float64 rounding."""
    from attention_residuals.functional import depth_state

    _skip_unavailable("compiled", torch.float64)
    v = torch.randn(4, 3, 5, 40, dtype=torch.float64)
    queries = torch.randn(3, 40, dtype=torch.float64)
    got = kernels.depth_states_batched(queries, v, heads=2, backend="compiled")
    for k in range(3):
        want = depth_state(queries[k], v, heads=2)
        _assert_close(got.out[k], depth_attention_reference(queries[k], v, heads=2), 1e-12)
        _assert_close(got.max[k] + got.sum[k].log(), want.max + want.sum.log(), 1e-12)


def test_two_phase_kernels_fall_back_under_autograd():
    q = torch.randn(2, 6, requires_grad=True)
    v = torch.randn(3, 4, 6)
    state = kernels.depth_states_batched(q, v)
    assert state.out.requires_grad  # the functional formula ran, with a graph
    out = kernels.depth_attention_merged(state[0], q[0], torch.randn(1, 4, 6))
    (g,) = torch.autograd.grad(out.sum(), q)
    assert g.shape == q.shape
    with pytest.raises(ValueError, match="queries"):
        kernels.depth_states_batched(torch.randn(6), v)
    with pytest.raises(ValueError, match="query"):
        kernels.depth_attention_merged(state[0], torch.randn(5), v)


def test_stacked_reuses_the_slices_of_one_tensor():
    """The eager and Triton backends stack a list of sources; slices of one tensor are not copied."""
    v = torch.randn(4, 6, 8)
    again = autograd.stacked(list(v.unbind(0)))
    assert again.data_ptr() == v.data_ptr() and torch.equal(again, v)
    parts = [torch.randn(6, 8) for _ in range(3)]
    torch.testing.assert_close(autograd.stacked(parts), torch.stack(parts))
    assert autograd.stacked(list(v.unbind(0))[::-1]).data_ptr() != v.data_ptr()  # out of order: a copy


@pytest.mark.parametrize("as_list", [False, True])
def test_traces_under_torch_compile(as_list):
    """Inside torch.compile (fullgraph: no graph break) the dispatcher takes the C kernel as a custom
    operator, or the fused eager path where it does not build; output and gradients hold."""
    torch._dynamo.reset()
    q = torch.randn(8, requires_grad=True)
    v = torch.randn(3, 2, 4, 8, requires_grad=True)
    sources = list(v.unbind(0)) if as_list else v
    f = torch.compile(lambda q, s: depth_attention(q, s, heads=2), backend="aot_eager", fullgraph=True)
    out = f(q, sources)
    dq, dv = torch.autograd.grad(out.square().sum(), (q, v))
    ref = depth_attention_reference(q, v, heads=2)
    rq, rv = torch.autograd.grad(ref.square().sum(), (q, v))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close((dq, dv), (rq, rv))


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_rejects_bad_eps_and_zero_channels(backend):
    """Checked before dispatch: no backend returns NaN for a negative eps or reshapes d = 0."""
    q, v = torch.randn(8), torch.randn(3, 2, 8)
    for sources in (v, list(v.unbind(0))):
        with pytest.raises(ValueError, match="eps: expected a finite number >= 0"):
            depth_attention(q, sources, -1.0, backend=backend)
        with pytest.raises(ValueError, match="sources: the channel dimension d must be > 0"):
            depth_attention(
                torch.zeros(0),
                [torch.zeros(2, 0)] * 3 if isinstance(sources, list) else torch.zeros(3, 2, 0),
                backend=backend,
            )
    state = kernels.depth_states_batched(q.expand(2, -1), v)
    with pytest.raises(ValueError, match="eps"):
        kernels.depth_states_batched(q.expand(2, -1), v, -1.0, backend=backend)
    with pytest.raises(ValueError, match="eps"):
        kernels.depth_attention_merged(state[0], q, v, float("nan"), backend=backend)


def _graph_ops(fn, *args):
    """The call_function targets of the graphs torch.compile(fullgraph=True) makes of ``fn(*args)``,
    and its output (the graph run through AOTAutograd, as inductor would get it)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    targets = []

    def record(gm, inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    out = torch.compile(fn, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)(
        *args
    )
    return targets, out


@pytest.mark.parametrize("as_list", [False, True])
@pytest.mark.parametrize("amp", [False, True])
def test_compiled_kernel_inside_torch_compile(as_list, amp):
    """The C kernel as custom operators in the compiled graph, forward and backward (fake tensors
    for the shapes, register_autograd for the gradient): the same numbers as eager mode. With
    autocast, a mixed list (float32 first, bfloat16 after) as a model under autocast has."""
    _skip_unavailable("compiled", torch.bfloat16 if amp else torch.float32)
    q = torch.randn(8, requires_grad=True)
    first = torch.randn(2, 4, 8, requires_grad=True)
    rest = torch.randn(2, 2, 4, 8).to(torch.bfloat16 if amp else torch.float32).requires_grad_()
    sources = [first, *rest.unbind(0)] if as_list else torch.cat([first[None], rest.float()])

    def f(q, s):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            return depth_attention(q, s, heads=2)

    targets, out = _graph_ops(f, q, sources)
    assert "attention_residuals.depth_attention_cpu.default" in targets
    want = f(q, sources)
    assert out.dtype == want.dtype == (torch.bfloat16 if amp else torch.float32)
    leaves = [q, first, rest]
    g = torch.randn_like(want)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    got = torch.autograd.grad(out, leaves, g)  # compiles the backward graph
    assert "attention_residuals.depth_attention_cpu_backward.default" in targets
    for a, b in zip(got, torch.autograd.grad(want, leaves, g), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)  # the stacked input: a sum in another order


def test_compiled_custom_ops_pass_opcheck():
    """torch.library.opcheck: schema, fake implementation, autograd registration and AOT dispatch."""
    _skip_unavailable("compiled")
    for q, dtype in (
        (torch.randn(8), torch.float32),
        (torch.randn(5, 8), torch.float32),
        (torch.randn(8), torch.bfloat16),
    ):
        vs = [torch.randn(5, 8).to(dtype).requires_grad_() for _ in range(3)]
        torch.library.opcheck(cpu.depth_attention_op, (q.requires_grad_(), vs, 1e-6, 2, True, True))


def test_two_phase_inside_torch_compile():
    """The forward-only two-phase kernels are not traced: the functional formulas run in the graph."""
    q = torch.randn(3, 8)
    v = torch.randn(4, 2, 8)
    targets, out = _graph_ops(lambda q, v: kernels.depth_states_batched(q, v, heads=2).out, q, v)
    assert not any("attention_residuals" in t for t in targets)
    torch.testing.assert_close(out, kernels.depth_states_batched(q, v, heads=2).out)


def test_registry_is_explicit_and_lazy():
    """The registry is filled at import, read-only, in the order of BACKENDS; importing builds and
    imports nothing (no C compile, no triton); availability is computed on first ask and cached."""
    code = (
        "import sys, torch\n"
        "from attention_residuals import kernels\n"
        "from attention_residuals.kernels import cpu\n"
        "assert 'triton' not in sys.modules and cpu._state == {}, (sorted(m for m in sys.modules if 'triton' in m), cpu._state)\n"
        "assert tuple(kernels._REGISTRY) == kernels.BACKENDS == ('reference', 'fused', 'compiled', 'triton')\n"
        "try:\n    kernels._REGISTRY['x'] = None\nexcept TypeError:\n    pass\nelse:\n    raise AssertionError('registry is writable')\n"
        "status = kernels.backend_status('cpu')\n"
        "assert status['reference'] is None and status['fused'] is None, status\n"
        "assert ('lib' in cpu._state) == (status['compiled'] is None)\n"
        "assert kernels._triton_import.cache_info().misses == 1\n"
        "kernels.backend_status('cpu', torch.bfloat16); kernels.select_backend(torch.randn(2, 3))\n"
        "assert kernels._triton_import.cache_info().misses == 1  # the import is tried once\n"
        "print(status)\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
