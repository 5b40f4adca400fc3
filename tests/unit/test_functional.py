"""The depth-attention op and the softmax-state merge against a plain float64 formula."""

import pytest
import torch

from attention_residuals import depth_attention, depth_state, depth_state_batched, merge_states
from attention_residuals.functional import depth_attention_reference


def plain(query, sources, eps=1e-6, heads=1, key_norm=True):
    """Independent float64 loop: one source, one head at a time."""
    n, d = sources.shape[0], sources.shape[-1]
    hd = d // heads
    out = torch.zeros(sources.shape[1:], dtype=torch.float64)
    for h in range(heads):
        sl = slice(h * hd, (h + 1) * hd)
        v = sources[..., sl].double()
        k = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) if key_norm else v
        z = torch.stack([(k[i] * query[..., sl].double()).sum(-1) for i in range(n)])
        a = torch.exp(z - z.max(0).values) / torch.exp(z - z.max(0).values).sum(0)
        out[..., sl] = sum(a[i].unsqueeze(-1) * v[i] for i in range(n))
    return out


@pytest.mark.parametrize("heads,key_norm", [(1, True), (2, True), (1, False), (3, True)])
@pytest.mark.parametrize("query_shape", ["static", "per_token"])
@pytest.mark.parametrize("backend", ["reference", "auto"])  # auto: what the dispatcher picks
def test_matches_plain_float64(heads, key_norm, query_shape, backend):
    d = 12
    sources = torch.randn(5, 2, 3, d, dtype=torch.float64)
    query = torch.randn(d if query_shape == "static" else (2, 3, d), dtype=torch.float64)
    got = depth_attention(query, sources, heads=heads, key_norm=key_norm, backend=backend)
    torch.testing.assert_close(got, plain(query, sources, heads=heads, key_norm=key_norm))


@pytest.mark.parametrize("query_shape", ["static", "per_token"])
def test_gradcheck(query_shape):
    d = 6
    sources = torch.randn(4, 3, d, dtype=torch.float64, requires_grad=True)
    query = torch.randn(d if query_shape == "static" else (3, d), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, s: depth_attention(q, s), (query, sources))
    assert torch.autograd.gradcheck(lambda q, s: depth_attention(q, s, heads=2), (query, sources))


def test_zero_query_is_mean_and_dtype_kept():
    sources = torch.randn(7, 4, 5, 16).to(torch.bfloat16)
    out = depth_attention(torch.zeros(16), sources)
    assert out.dtype == torch.bfloat16 and out.shape == (4, 5, 16)
    torch.testing.assert_close(out.float(), sources.float().mean(0), atol=1e-2, rtol=1e-2)


def test_softmax_is_per_token_not_across_tokens():
    sources = torch.randn(3, 4, 8)
    query = torch.randn(8)
    full = depth_attention(query, sources)
    for t in range(4):
        torch.testing.assert_close(full[t], depth_attention(query, sources[:, t]))


def test_sigmoid_gates_each_source():
    sources = torch.randn(3, 2, 8, dtype=torch.float64)
    query = torch.randn(8, dtype=torch.float64)
    k = sources / sources.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    expect = (torch.sigmoid((k * query).sum(-1)).unsqueeze(-1) * sources).sum(0)
    torch.testing.assert_close(depth_attention(query, sources, normalize="sigmoid"), expect)


def test_state_merge_is_exact():
    sources = torch.randn(9, 2, 5, 8, dtype=torch.float64)
    query = torch.randn(8, dtype=torch.float64) * 3
    whole = depth_state(query, sources)
    for cut in (1, 4, 8):
        merged = merge_states(depth_state(query, sources[:cut]), depth_state(query, sources[cut:]))
        torch.testing.assert_close(merged.out, whole.out)
        torch.testing.assert_close(merged.max, whole.max)
        torch.testing.assert_close(merged.sum, whole.sum)
    torch.testing.assert_close(whole.out, depth_attention(query, sources))


@pytest.mark.parametrize("heads", [1, 4])
def test_batched_states_equal_single(heads):
    sources = torch.randn(4, 3, 2, 8, dtype=torch.float64)
    queries = torch.randn(5, 8, dtype=torch.float64)
    batched = depth_state_batched(queries, sources, heads=heads)
    for i in range(5):
        single = depth_state(queries[i], sources, heads=heads)
        torch.testing.assert_close(batched[i].out, single.out)
        torch.testing.assert_close(batched[i].max, single.max)
        torch.testing.assert_close(batched[i].sum, single.sum)


def test_reference_equals_dispatcher():
    sources, query = torch.randn(3, 4, 8), torch.randn(8)
    torch.testing.assert_close(depth_attention(query, sources), depth_attention_reference(query, sources))


@pytest.mark.parametrize(
    "query,sources,exc,match",
    [
        (torch.zeros(8), torch.zeros(0, 2, 8), ValueError, "sources"),
        (torch.zeros(7), torch.zeros(3, 2, 8), ValueError, "query"),
        (torch.zeros(5, 8), torch.zeros(3, 2, 8), ValueError, "query"),
        (torch.zeros(8), torch.zeros(3, 2, 8, dtype=torch.int64), TypeError, "sources"),
        (torch.zeros(8, dtype=torch.int64), torch.zeros(3, 2, 8), TypeError, "query"),
        (torch.zeros(8), torch.zeros(8), ValueError, "sources"),
    ],
)
def test_bad_inputs(query, sources, exc, match):
    with pytest.raises(exc, match=match):
        depth_attention(query, sources)


def test_bad_heads_and_normalize():
    with pytest.raises(ValueError, match="heads"):
        depth_attention(torch.zeros(8), torch.zeros(2, 8), heads=3)
    with pytest.raises(ValueError, match="normalize"):
        depth_attention(torch.zeros(8), torch.zeros(2, 8), normalize="relu")


@pytest.mark.parametrize("eps", [-1.0, -1e-12, float("nan"), float("inf")])
@pytest.mark.parametrize(
    "fn",
    [
        lambda q, v, eps: depth_attention(q, v, eps),
        lambda q, v, eps: depth_attention_reference(q, v, eps),
        lambda q, v, eps: depth_state(q, v, eps),
        lambda q, v, eps: depth_state_batched(q.expand(2, -1), v, eps),
    ],
    ids=["dispatcher", "reference", "state", "state_batched"],
)
def test_bad_eps_is_an_error_not_nan(fn, eps):
    with pytest.raises(ValueError, match=r"eps: expected a finite number >= 0"):
        fn(torch.randn(8), torch.randn(3, 2, 8), eps)


def test_eps_type_and_zero():
    with pytest.raises(TypeError, match="eps"):
        depth_attention(torch.randn(8), torch.randn(3, 2, 8), "1e-6")
    with pytest.raises(TypeError, match="eps"):
        depth_attention(torch.randn(8), torch.randn(3, 2, 8), True)
    # eps = 0 is allowed: the exact RMSNorm, finite for non-zero sources
    q, v = torch.randn(8, dtype=torch.float64), torch.randn(3, 2, 8, dtype=torch.float64)
    torch.testing.assert_close(depth_attention(q, v, 0.0), plain(q, v, eps=0.0).to(v.dtype))


@pytest.mark.parametrize("as_list", [False, True])
def test_zero_channels_is_an_error(as_list):
    sources = [torch.zeros(2, 0)] * 3 if as_list else torch.zeros(3, 2, 0)
    with pytest.raises(ValueError, match=r"sources: the channel dimension d must be > 0"):
        depth_attention(torch.zeros(0), sources)
    if not as_list:
        with pytest.raises(ValueError, match=r"sources: the channel dimension d must be > 0"):
            depth_attention_reference(torch.zeros(0), sources)
