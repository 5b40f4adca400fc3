"""The LM with every depth-mixing rule: exact rewrites, causality, caching, depth weights."""

import pytest
import torch

from attention_residuals.connections import RESIDUALS, make_connection
from attention_residuals.kernels import backend_status, use_backend
from attention_residuals.model import GPT, GPTConfig


def tiny(residual="prenorm", **kw):
    base = dict(vocab_size=64, n_layer=3, n_head=2, d_model=32, seq_len=48, residual=residual)
    base.update(kw)
    return GPTConfig(**base)


def randomize_depth_params(model, scale=0.5):
    """Zero-init queries make many rewrites trivially equal; perturb them for the tests."""
    with torch.no_grad():
        for p in model.residual.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


@pytest.fixture
def idx():
    return torch.randint(0, 64, (2, 20))


def test_block_with_block_size_one_equals_full(idx):
    full = randomize_depth_params(GPT(tiny("full")))
    block = GPT(tiny("block", block_size=1))
    block.load_state_dict(full.state_dict())
    torch.testing.assert_close(block(idx), full(idx), rtol=0, atol=0)


def test_block_size_equal_to_L_sees_embedding_and_partial(idx):
    """S = L: one block; every layer attends over [embedding, partial sum]."""
    conn = make_connection("block", 4, 8, block_size=4)
    emb = torch.randn(3, 8)
    state = conn.init_state(emb)
    outs = []
    for l in range(4):
        srcs, _ = conn.sources(state, l)
        assert len(srcs) == (1 if l == 0 else 2)
        conn.read(state, l)
        v = torch.randn(3, 8)
        outs.append(v)
        conn.write(state, l, v)
    srcs, _ = conn.sources(state, 4)
    assert len(srcs) == 2
    torch.testing.assert_close(srcs[1], sum(outs))


def test_non_divisible_block_structure():
    """L = 6, S = 4: blocks [0..3], [4, 5]; the last partial block is the final readout's source."""
    conn = make_connection("block", 6, 8, block_size=4)
    state = conn.init_state(torch.randn(2, 8))
    seen = []
    vs = []
    for l in range(6):
        seen.append(len(conn.sources(state, l)[0]))
        conn.read(state, l)
        vs.append(torch.randn(2, 8))
        conn.write(state, l, vs[-1])
    assert seen == [1, 2, 2, 2, 2, 3]
    final_srcs, cols = conn.sources(state, 6)
    assert cols == [0, 1, 2]
    torch.testing.assert_close(final_srcs[1], sum(vs[:4]))
    torch.testing.assert_close(final_srcs[2], vs[4] + vs[5])


def test_n_blocks_resolves_block_size():
    model = GPT(tiny("block", n_blocks=3))  # L = 6
    assert model.residual.block_size == 2


def test_zero_init_full_is_depth_mean():
    conn = make_connection("full", 4, 8)
    state = conn.init_state(torch.randn(2, 8))
    vs = [state.values[0]]
    for l in range(4):
        h = conn.read(state, l)
        torch.testing.assert_close(h, torch.stack(vs).mean(0))
        vs.append(torch.randn(2, 8))
        conn.write(state, l, vs[-1])


def test_mhc_lite_matches_its_formula_per_token():
    """mHC-lite with trained-looking (non-zero) weights against the docstring's formula, written
    token by token with explicit permutation matrices, in float64."""
    import itertools

    m, d, L = 3, 5, 2
    conn = make_connection("mhc", L, d, streams=m).double()
    with torch.no_grad():
        conn.proj.normal_(std=0.3)
        conn.bias.normal_()
    emb, outs = (
        torch.randn(2, 4, d, dtype=torch.float64),
        [torch.randn(2, 4, d, dtype=torch.float64) for _ in range(L)],
    )
    state = conn.init_state(emb)
    got = []
    for l in range(L):
        got.append(conn.read(state, l))
        conn.write(state, l, outs[l])
    got.append(conn.final(state))
    perms = [torch.eye(m, dtype=torch.float64)[list(p)] for p in itertools.permutations(range(m))]
    for b, t in itertools.product(range(2), range(4)):
        H = emb[b, t].expand(m, d).clone()  # streams [m, d] of this token
        for l in range(L):
            flat = H.flatten()
            coef = (flat / flat.pow(2).mean().add(1e-6).sqrt()) @ conn.proj[l].detach() + conn.bias[
                l
            ].detach()
            pre, post = torch.sigmoid(coef[:m]), 2 * torch.sigmoid(coef[m : 2 * m])
            mix = torch.softmax(coef[2 * m :].float(), 0).double()  # the mix softmax runs in float32
            A = sum(w * P for w, P in zip(mix, perms))
            torch.testing.assert_close(got[l][b, t], pre @ H)
            H = A.T @ H + post[:, None] * outs[l][b, t]
        torch.testing.assert_close(got[L][b, t], H.mean(0))


@pytest.mark.parametrize("residual", ["prenorm", "denseformer", "mhc"])
def test_rules_that_start_as_prenorm(residual, idx):
    base = GPT(tiny("prenorm"))
    other = GPT(tiny(residual))
    missing, _ = other.load_state_dict(base.state_dict(), strict=False)
    assert all(k.startswith("residual.") for k in missing)
    torch.testing.assert_close(other(idx), base(idx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kw",
    [
        dict(residual="full"),
        dict(residual="full", block_size=4),
        dict(residual="block", block_size=2),
        dict(residual="block", block_size=4),
        dict(residual="block", block_size=6),
        dict(residual="block", n_blocks=2),
        dict(residual="block", block_size=2, depth_heads=4),
        dict(residual="full", key_norm=False),
        dict(residual="block", block_size=2, intra_gate=True),
    ],
)
def test_two_phase_equals_plain(kw, idx):
    model = randomize_depth_params(GPT(tiny(**kw)), scale=1.0)
    torch.testing.assert_close(model(idx, schedule="two_phase"), model(idx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kw",
    [
        dict(residual="full", block_size=4),
        dict(residual="block", block_size=2),
        dict(residual="block", block_size=3, depth_heads=2),
    ],
)
def test_two_phase_gradients_equal_plain(kw, idx):
    """Training through the two-phase schedule: every parameter's gradient as the plain schedule's."""
    model = randomize_depth_params(GPT(tiny(**kw)), scale=1.0)
    grads = []
    for schedule in ("plain", "two_phase"):
        model.zero_grad()
        model(idx, idx, schedule=schedule)[1].backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("quer" in n for n in grads[0])
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("backend", ["compiled", "triton"])
@pytest.mark.parametrize(
    "kw",
    [
        dict(residual="full", block_size=4),
        dict(residual="block", block_size=2, depth_heads=4),
        dict(residual="block", block_size=4, key_norm=False),
    ],
)
def test_two_phase_inference_kernels_equal_plain(kw, backend, idx):
    """Without autograd the two-phase schedule runs the forward-only phase-1 / merge kernels."""
    reason = backend_status()[backend]
    if reason:
        pytest.skip(reason)
    model = randomize_depth_params(GPT(tiny(**kw)), scale=1.0)
    with torch.no_grad():
        plain = model(idx)
        with use_backend(backend):
            two_phase = model(idx, schedule="two_phase")
    torch.testing.assert_close(two_phase, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kw",
    [
        dict(residual="block", query="input"),
        dict(residual="block", query="lowrank"),
        dict(residual="full", normalize="sigmoid"),
        dict(residual="prenorm"),
        dict(residual="swa"),
        dict(residual="mhc"),
    ],
)
def test_two_phase_needs_static_softmax_queries(kw, idx):
    with pytest.raises(ValueError, match="two_phase"):
        GPT(tiny(**kw))(idx, schedule="two_phase")


@pytest.mark.parametrize("residual", RESIDUALS)
def test_causality(residual, idx):
    model = randomize_depth_params(GPT(tiny(residual, block_size=2 if residual == "block" else None)))
    other = idx.clone()
    other[:, 12:] = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(model(other)[:, :12], model(idx)[:, :12])


@pytest.mark.parametrize("residual", RESIDUALS)
def test_cached_decoding_equals_recomputation(residual):
    model = randomize_depth_params(GPT(tiny(residual))).eval()
    prompt = torch.randint(0, 64, (2, 7))
    cached = model.generate(prompt, 25, temperature=0)
    plain = model.generate(prompt, 25, temperature=0, use_cache=False)
    assert torch.equal(cached, plain)
    # and the cached logits themselves match a full forward
    cache = model.new_cache(2)
    seq = cached[:, :20]
    hidden = torch.cat(
        [model._run(seq[:, :9], cache=cache)[0]]
        + [model._run(seq[:, t : t + 1], cache=cache)[0] for t in range(9, 20)],
        1,
    )
    torch.testing.assert_close(model.lm_head(hidden), model(seq), rtol=1e-4, atol=1e-4)


def test_sampling_top_k_and_seed():
    model = GPT(tiny("block", block_size=2)).eval()
    prompt = torch.randint(0, 64, (1, 4))
    a = model.generate(prompt, 10, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(1))
    b = model.generate(prompt, 10, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.shape == (1, 14)


def test_depth_weights_rows_and_nan(idx):
    model = randomize_depth_params(GPT(tiny("full")))
    w = model.depth_weights(idx)
    L = 6
    assert w.shape == (L + 1, L + 1)
    for l in range(L + 1):
        assert torch.isfinite(w[l, : l + 1]).all() and torch.isnan(w[l, l + 1 :]).all()
        torch.testing.assert_close(w[l, : l + 1].sum(), torch.tensor(1.0))
    block = GPT(tiny("block", block_size=4)).eval()  # zero queries -> uniform over sources
    wb = block.depth_weights(idx)
    assert wb.shape == (L + 1, 3)
    torch.testing.assert_close(wb[1, :2], torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="depth weights"):
        GPT(tiny("prenorm")).depth_weights(idx)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(residual="nope"), "residual"),
        (dict(residual="block", block_size=7), "block_size"),
        (dict(residual="block", n_blocks=0), "n_blocks"),
        (dict(residual="block", block_size=2, n_blocks=2), "n_blocks"),
        (dict(residual="block", n_blocks=4), r"n_blocks: 4 blocks do not fit L=6 .* fit: \[1, 2, 3, 6\]"),
        (dict(d_model=30), "n_head"),
        (dict(residual="full", depth_heads=5), "depth_heads"),
        (dict(residual="full", query="x"), "query"),
        (dict(n_layer=0), "n_layer"),
        (dict(residual="full", intra_gate=True), "intra_gate"),
        (dict(residual="block", query="lowrank", query_rank=0), "query_rank"),
        (dict(mlp_hidden=-4), "mlp_hidden: expected a positive integer, or None"),
        (dict(mlp_hidden=0), "mlp_hidden: expected a positive integer, or None"),
        (dict(init_std=-1), "init_std: expected a finite number > 0"),
        (dict(init_std=0.0), "init_std"),
        (dict(norm_eps=0.0), "norm_eps: expected a finite number > 0"),
        (dict(norm_eps=-1e-6), "norm_eps"),
        (dict(rope_theta=0.0), "rope_theta: expected a finite number > 0"),
        (dict(rope_theta=-1e4), "rope_theta"),
        (dict(rope_theta=float("nan")), "rope_theta"),
        (dict(norm_eps=float("inf")), "norm_eps"),
        # options a rule would silently ignore
        (dict(n_blocks=3), r"n_blocks: only used by residual in \('full', 'block'\).*residual='prenorm'"),
        (dict(block_size=2), r"block_size: .*residual='prenorm'"),
        (dict(query="input"), r"query: .*residual='prenorm'"),
        (dict(depth_heads=2), r"depth_heads: .*residual='prenorm'"),
        (dict(normalize="sigmoid"), "normalize"),
        (dict(key_norm=False), "key_norm"),
        (dict(window=4), r"window: only used by residual in \('swa',\).*residual='prenorm'"),
        (dict(streams=2), r"streams: .*residual='prenorm'"),
        (dict(residual="mhc", window=3), r"window: .*residual='mhc'"),
        (dict(residual="swa", block_size=2), r"block_size: .*residual='swa'"),
        (dict(residual="denseformer", depth_heads=2), r"depth_heads: .*residual='denseformer'"),
        (dict(residual="swa", intra_gate=True), "intra_gate"),
        (dict(residual="full", query_rank=4), r"query_rank: only used with query='lowrank'.*query='static'"),
    ],
)
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        GPT(tiny(**kw))


def test_bad_idx_and_lengths():
    model = GPT(tiny())
    with pytest.raises(ValueError, match="idx"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 49, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(torch.zeros(1, 40, dtype=torch.long), 10)


def test_mlp_hidden_none_is_the_default_width():
    assert tiny().hidden == 128 and tiny(mlp_hidden=48).hidden == 48  # d = 32: 8/3 * 32 -> 128
    assert GPT(tiny(mlp_hidden=48)).layers[1].down.in_features == 48


@pytest.mark.parametrize(
    "kw",
    [
        dict(residual="full", block_size=2),
        dict(residual="full", n_blocks=3),
        dict(residual="swa", window=2, depth_heads=2),
        dict(residual="mhc", streams=2),
        dict(residual="block", query="lowrank", query_rank=4),
    ],
)
def test_rule_options_accepted_where_used(kw):
    GPT(tiny(**kw))


def test_make_connection_rejects_options_its_rule_ignores():
    """The check lives with the rules (make_connection), so apply_attnres and the HF model get it too."""
    with pytest.raises(ValueError, match=r"window: only used by residual in \('swa',\).*residual='mhc'"):
        make_connection("mhc", 4, 8, window=3)
    with pytest.raises(ValueError, match="n_blocks: only used by residual in"):
        make_connection("prenorm", 4, 8, n_blocks=2)
    with pytest.raises(ValueError, match="query_rank: only used with query='lowrank'"):
        make_connection("full", 4, 8, query_rank=4)
    make_connection("full", 4, 8, query="lowrank", query_rank=4)


@pytest.mark.parametrize(
    "bad,match",
    [
        (torch.full((1, 4), 300), r"idx: token ids must be in 0..vocab_size-1=63, got ids in 300..300"),
        (torch.tensor([[1, -1, 2]]), r"idx: token ids must be in 0..vocab_size-1=63, got ids in -1..2"),
        (torch.full((1, 4), 64, dtype=torch.int32), "idx: token ids"),
        (torch.zeros(1, 0, dtype=torch.long), r"idx: expected at least one .* got shape \(1, 0\)"),
        (torch.zeros(0, 4, dtype=torch.long), r"idx: expected at least one .* got shape \(0, 4\)"),
        (torch.zeros(4, dtype=torch.long), r"idx: expected integer token ids of shape \[B, T\]"),
    ],
)
def test_bad_idx_values(bad, match):
    model = GPT(tiny())
    with pytest.raises(ValueError, match=match):
        model(bad)
    with pytest.raises(ValueError, match="idx"):
        model.forward_hidden(bad)
    with pytest.raises(ValueError, match="idx"):
        model.generate(bad, 2)


def test_bad_idx_type_and_targets():
    model = GPT(tiny())
    with pytest.raises(TypeError, match="idx: expected a torch.Tensor"):
        model([[1, 2, 3]])
    x = torch.randint(0, 64, (2, 5))
    with pytest.raises(ValueError, match=r"targets: token ids must be in 0..vocab_size-1=63 \(or -1"):
        model(x, torch.full((2, 5), 64))
    with pytest.raises(ValueError, match="targets: token ids"):
        model(x, torch.full((2, 5), -2))
    with pytest.raises(ValueError, match="targets: expected integer token ids"):
        model(x, torch.zeros(2, 5))
    with pytest.raises(ValueError, match="targets: every position is -1"):
        model(x, torch.full((2, 5), -1))
    # -1 (ignored) and int32 targets are fine and give the int64 loss
    y = x.clone()
    y[:, 0] = -1
    torch.testing.assert_close(model(x, y.int())[1], model(x, y)[1])


def test_config_round_trip():
    cfg = tiny("block", n_blocks=3, depth_heads=2)
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown"):
        GPTConfig.from_dict({**cfg.to_dict(), "bogus": 1})


@pytest.mark.parametrize(
    "kw",
    [dict(residual=r) for r in RESIDUALS]
    + [
        dict(residual="full", query="input"),
        dict(residual="block", normalize="sigmoid", block_size=2),
        dict(residual="block", depth_heads=4, block_size=2),
        dict(residual="full", key_norm=False),
        dict(residual="block", key_norm=False, block_size=2),
        dict(residual="block", query="lowrank", query_rank=4),
        dict(residual="block", intra_gate=True, block_size=2),
    ],
)
def test_every_rule_learns(kw):
    """Loss falls on a tiny repetitive corpus within 50 steps (each ablation row must train)."""
    torch.manual_seed(0)
    model = GPT(tiny(**kw))
    text = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 8)) % 64
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _step in range(50):
        starts = torch.randint(0, len(text) - 33, (8,))
        x = torch.stack([text[s : s + 32] for s in starts])
        y = torch.stack([text[s + 1 : s + 33] for s in starts])
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses[::10]


@pytest.mark.parametrize("residual", ["full", "block", "swa", "mixing", "mhc", "denseformer"])
def test_depth_params_get_gradients(residual, idx):
    model = GPT(tiny(residual, block_size=2 if residual == "block" else None))
    _, loss = model(idx, idx)
    loss.backward()
    grads = [p.grad for p in model.residual.parameters()]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("residual", ["block", "full", "prenorm"])
def test_generate_prefills_with_the_fastest_exact_schedule(residual):
    model = randomize_depth_params(GPT(tiny(residual))).double().eval()
    assert model.inference_schedule() == ("plain" if residual == "prenorm" else "two_phase")
    prompt = torch.randint(0, 64, (2, 7))
    fast = model.generate(prompt, 6, temperature=0)
    assert torch.equal(fast, model.generate(prompt, 6, temperature=0, schedule="plain"))
    assert torch.equal(fast, model.generate(prompt, 6, temperature=0, use_cache=False))
