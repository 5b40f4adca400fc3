"""Hidden-dim sharded and sequence-chunked prefill equal the plain prefill; block memory as derived."""

import pytest
import torch

from attention_residuals.model import GPT, GPTConfig
from attention_residuals.parallel import spawn
from attention_residuals.parallel.prefill import block_state_bytes, prefill


def make_model(cfg):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    with torch.no_grad():
        for p in model.residual.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model.eval()


def make_idx(cfg, batch=2):
    return torch.randint(
        0, cfg["vocab_size"], (batch, cfg["seq_len"]), generator=torch.Generator().manual_seed(1)
    )


BASE = dict(vocab_size=64, n_layer=3, n_head=2, d_model=32, seq_len=24, residual="block", block_size=2)
VARIANTS = {
    "plain": {},
    "partial_last_block": dict(block_size=4),  # L = 6, S = 4: the final readout sees a partial
    "heads_cut_by_shard": dict(d_model=24, depth_heads=3),  # depth heads of 8 channels, shards of 12
    "gate_no_keynorm": dict(intra_gate=True, key_norm=False),
}


def _sharded(rank, world, cfg, chunk, shard="hidden"):
    import torch.distributed as dist

    model = make_model(cfg)
    out = prefill(model, make_idx(cfg), group=dist.group.WORLD, chunk_size=chunk, shard=shard)
    return out.logits, out.stats.to_dict(), out.cache.k.clone()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_prefill_equals_plain(variant):
    cfg = {**BASE, **VARIANTS[variant]}
    model = make_model(cfg)
    idx = make_idx(cfg)
    ref = model(idx)
    for chunk in (None, 5, 8, 24):
        out = prefill(model, idx, chunk_size=chunk)
        torch.testing.assert_close(out.logits, ref, rtol=1e-4, atol=1e-5)
        assert out.cache.length == cfg["seq_len"]
    last = prefill(model, idx, chunk_size=7, last_only=True).logits
    torch.testing.assert_close(last, ref[:, -1:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", ["plain", "heads_cut_by_shard", "gate_no_keynorm", "partial_last_block"])
def test_hidden_sharded_prefill_equals_plain(variant):
    cfg = {**BASE, **VARIANTS[variant]}
    model = make_model(cfg)
    idx = make_idx(cfg)
    ref = model(idx)
    cache = model.new_cache(idx.shape[0])
    model._run(idx, cache=cache)
    for chunk in (None, 8):
        results = spawn(_sharded, 2, cfg, chunk, timeout_s=60)
        for logits, stats, k in results:
            torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(k, cache.k, rtol=1e-4, atol=1e-5)
            assert stats["d_shard"] == cfg["d_model"] // 2
            assert stats["allreduce_bytes"] > 0 and stats["allgather_bytes"] > 0


@pytest.mark.parametrize("variant", ["plain", "partial_last_block", "gate_no_keynorm"])
def test_sequence_sharded_prefill_equals_plain(variant):
    cfg = {**BASE, **VARIANTS[variant]}
    model = make_model(cfg)
    idx = make_idx(cfg)
    ref = model(idx)
    for chunk in (None, 8):
        results = spawn(_sharded, 2, cfg, chunk, "sequence", timeout_s=60)
        for logits, stats, _ in results:
            torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-5)
            assert stats["allreduce_bytes"] == 0  # depth attention is per token: no reduction at all


def test_block_state_memory_matches_closed_form():
    """Peak stored block states: (N + 1) tensors (b_0 + N blocks) of batch x chunk x d / P."""
    cfg = {**BASE, "n_layer": 4, "block_size": 2, "seq_len": 32}  # L = 8, N = 4
    model = make_model(cfg)
    idx = make_idx(cfg)
    full = prefill(model, idx).stats
    assert full.peak_block_tensors == 5
    assert full.peak_block_bytes == block_state_bytes(5, 2, 32, 32, 4) == full.formula_block_bytes
    chunked = prefill(model, idx, chunk_size=8).stats
    assert chunked.peak_block_bytes == full.peak_block_bytes // 4 == chunked.formula_block_bytes
    for shard in ("hidden", "sequence"):
        results = spawn(_sharded, 2, cfg, 8, shard, timeout_s=60)
        for _, stats, _ in results:
            assert stats["peak_block_bytes"] == chunked.peak_block_bytes // 2 == stats["formula_block_bytes"]


def test_prefill_rejects_what_it_cannot_shard():
    with pytest.raises(ValueError, match="residual='block'"):
        prefill(make_model({**BASE, "residual": "full"}), make_idx(BASE))
    with pytest.raises(ValueError, match="static softmax queries"):
        prefill(make_model({**BASE, "query": "input"}), make_idx(BASE))
    with pytest.raises(ValueError, match="chunk_size"):
        prefill(make_model(BASE), make_idx(BASE), chunk_size=0)
    with pytest.raises(ValueError, match="shard"):
        prefill(make_model(BASE), make_idx(BASE), shard="heads")


def _uneven(rank, world):
    import torch.distributed as dist

    prefill(make_model(BASE), make_idx(BASE), group=dist.group.WORLD, chunk_size=5, shard="sequence")


def test_sequence_shard_needs_even_chunks():
    from attention_residuals.parallel import DistributedError

    with pytest.raises(DistributedError, match="a chunk of 5 tokens does not split over 2 ranks"):
        spawn(_uneven, 2, timeout_s=60)
