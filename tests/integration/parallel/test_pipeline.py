"""Pipeline parallel Block AttnRes on gloo processes: naive and cached traffic, exact gradients."""

import itertools

import pytest
import torch

from attention_residuals.model import GPT, GPTConfig
from attention_residuals.parallel import (
    SCHEMES,
    PipelineLayout,
    PipelineParallel,
    aligned_transfers,
    derived_transfers,
    report_transfers,
    spawn,
)


def make_model(cfg: dict) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    with torch.no_grad():  # zero-init queries would make every depth mix a plain mean
        for p in model.residual.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model


def make_batch(cfg: dict, batch: int):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg["vocab_size"], (batch, cfg["seq_len"]), generator=g)
    targets = torch.randint(0, cfg["vocab_size"], (batch, cfg["seq_len"]), generator=g)
    return idx, targets


def pipeline_worker(rank, world, cfg, virtual, batch, microbatches):
    out = {}
    model = make_model(cfg)
    idx, targets = make_batch(cfg, batch)
    for scheme in SCHEMES:
        model.zero_grad(set_to_none=True)
        pp = PipelineParallel(model, virtual=virtual, scheme=scheme)
        stats = pp.step(idx, targets, microbatches=microbatches)
        owned = {id(p) for p in pp.owned_parameters()}
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if id(p) in owned}
        out[scheme] = (stats.to_dict(), grads)
    return out


def reference(cfg, batch):
    model = make_model(cfg)
    idx, targets = make_batch(cfg, batch)
    _, loss = model(idx, targets)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


CASES = {
    # (P, V): aligned, one block per chunk
    "P2V2_aligned": (2, 2, dict(n_layer=4, block_size=2), 4, 2),
    # block_size 3 does not divide the chunks (2 sublayers): partials travel, last block partial
    "P2V2_partial": (2, 2, dict(n_layer=4, block_size=3), 2, 1),
    # the report's Figure 3: 4 ranks x 2 virtual stages, one block per chunk
    "P4V2_figure3": (4, 2, dict(n_layer=4, block_size=1), 2, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_equals_single_process(case):
    P, V, shape, batch, microbatches = CASES[case]
    cfg = dict(vocab_size=64, n_head=2, d_model=32, seq_len=8, residual="block", **shape)
    results = spawn(pipeline_worker, P, cfg, V, batch, microbatches, timeout_s=60)
    ref_loss, ref_grads = reference(cfg, batch)
    d, T, L = cfg["d_model"], cfg["seq_len"], 2 * cfg["n_layer"]
    layout = PipelineLayout.build(L, shape["block_size"], P, V)
    elem = 4 * batch * T * d  # bytes of one [B, T, d] float32 tensor
    sent = {}
    for scheme in SCHEMES:
        merged = {}
        for rank in range(P):
            stats, grads = results[rank][scheme]
            assert stats["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
            for name, g in grads.items():
                if name in merged:  # shared parameters: every owner holds the same summed gradient
                    torch.testing.assert_close(g, merged[name], rtol=0, atol=0)
                merged[name] = g
        assert set(merged) == set(ref_grads)
        for name, g in ref_grads.items():
            torch.testing.assert_close(merged[name], g, rtol=1e-4, atol=1e-6, msg=f"{scheme}: {name}")
        fwd = sum(results[r][scheme][0]["bytes_forward"] for r in range(P))
        bwd = sum(results[r][scheme][0]["bytes_backward"] for r in range(P))
        formula = derived_transfers(layout.bounds, shape["block_size"], P, scheme)
        assert fwd == bwd == formula * elem
        sent[scheme] = fwd
    assert sent["cached_all"] < sent["cached"] < sent["naive"]


def test_one_stage_hands_over_locally():
    """P = 1, V = 2: both chunks on one rank; the hop costs no communication."""
    cfg = dict(vocab_size=64, n_head=2, d_model=32, seq_len=8, residual="block", n_layer=2, block_size=1)
    (out,) = spawn(pipeline_worker, 1, cfg, 2, 2, 1, timeout_s=60)
    ref_loss, ref_grads = reference(cfg, 2)
    for scheme in SCHEMES:
        stats, grads = out[scheme]
        assert stats["loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert stats["bytes_forward"] == stats["bytes_backward"] == 0
        # naive and cached hand the blocks over; cached_all already holds them (block_size 1: no partial)
        assert (stats["bytes_local"] == 0) == (scheme == "cached_all")
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6)


def test_figure3_numbers():
    """P = 4, V = 2, one block per chunk: the report says caching saves 6 block transfers."""
    rep = report_transfers(4, 2, 1)
    assert rep == {"naive": 28, "cached": 22}
    assert aligned_transfers(4, 2, 1, "naive") == 28 + 7  # + b_0 on each of the C - 1 = 7 hops
    assert aligned_transfers(4, 2, 1, "cached") == 22 + 3  # + b_0 on the first P - 1 = 3 hops
    assert aligned_transfers(4, 2, 1, "cached_all") == 22 - 4 + 3  # the receivers' own blocks stay


@pytest.mark.parametrize("P,V,S,Np", list(itertools.product([1, 2, 3, 4], [1, 2, 3], [1, 2, 3], [1, 2])))
def test_layout_aligned_matches_report_formulas(P, V, S, Np):
    C = P * V
    layout = PipelineLayout.build(C * Np * S, S, P, V)
    assert layout.aligned_blocks_per_chunk() == Np
    rep = report_transfers(P, V, Np)
    for scheme in SCHEMES:
        count = layout.transfers(scheme)
        assert count == derived_transfers(layout.bounds, S, P, scheme) == aligned_transfers(P, V, Np, scheme)
    assert layout.transfers("naive") == rep["naive"] + (C - 1)
    assert layout.transfers("cached") == rep["cached"] + (P - 1)


def test_layout_general_matches_closed_form():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        P, V, S = (int(torch.randint(1, 5, (1,), generator=g)) for _ in range(3))
        sizes = torch.randint(1, 5, (P * V,), generator=g).tolist()
        layout = PipelineLayout.build(sum(sizes), S, P, V, chunk_layers=sizes)
        for scheme in SCHEMES:
            assert layout.transfers(scheme) == derived_transfers(layout.bounds, S, P, scheme)
        assert layout.transfers("cached_all") <= layout.transfers("cached") <= layout.transfers("naive")


def test_layout_errors():
    with pytest.raises(ValueError, match="chunks need at least"):
        PipelineLayout.build(4, 1, 4, 2)
    with pytest.raises(ValueError, match="chunk_layers"):
        PipelineLayout.build(4, 1, 2, 1, chunk_layers=[1, 2])
    with pytest.raises(ValueError, match="scheme"):
        PipelineLayout.build(4, 1, 2, 1).transfers("fast")
