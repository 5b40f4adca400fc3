"""Hidden-dim sharded and sequence-chunked prefill equal the plain prefill; block memory as derived;
decoding with the KV cache sharded by token equals plain decoding."""

import pytest
import torch

from attention_residuals.model import GPT, GPTConfig
from attention_residuals.parallel import spawn
from attention_residuals.parallel.generate import sharded_generate
from attention_residuals.parallel.kv import ShardedKVCache
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
    if shard == "hidden":
        return out.logits, out.stats.to_dict(), out.cache.k.clone()
    n = out.cache.n_local  # sharded by token: this rank's keys and their positions
    return (
        out.logits,
        out.stats.to_dict(),
        (out.cache.k[:, :, :, :n].clone(), out.cache.positions[:n].clone()),
    )


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
    cache = model.new_cache(idx.shape[0])
    model._run(idx, cache=cache)
    for chunk in (None, 8):
        results = spawn(_sharded, 2, cfg, chunk, "sequence", timeout_s=60)
        positions = torch.cat([pos for *_, (_, pos) in results]).sort().values
        assert positions.tolist() == list(range(cfg["seq_len"]))  # every token on exactly one rank
        for logits, stats, (k, pos) in results:
            torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(k, cache.k[:, :, :, pos], rtol=1e-4, atol=1e-5)
            assert stats["allreduce_bytes"] == 0  # depth attention is per token: no reduction at all
            assert stats["attention_bytes"] > 0
            assert stats["kv_cache_bytes"] == (cache.k.numel() * 2 * 4) // cfg["seq_len"] * (
                cfg["seq_len"] // 2 + 1
            )


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


DECODE_RULES = {
    "block": {},  # the sequence-sharded block-state prefill
    "block_two_heads": dict(depth_heads=2),
    "full": dict(residual="full"),  # the replicated prefill into the sharded KV cache
    "prenorm": dict(residual="prenorm", block_size=None),
}


def _decode_logits(model, idx, prompt, cache):
    """Logits of every position after ``prompt`` tokens, fed one at a time through ``cache``."""
    first = model.lm_head(model.forward_hidden(idx[:, :prompt], cache))
    steps = [
        model.lm_head(model.forward_hidden(idx[:, t : t + 1], cache)) for t in range(prompt, idx.shape[1])
    ]
    return torch.cat([first] + steps, dim=1)


def _sharded_decode(rank, world, cfg, prompt):
    import torch.distributed as dist

    model, idx = make_model(cfg), make_idx(cfg)
    cache = ShardedKVCache.for_model(model, idx.shape[0], cfg["seq_len"], dist.group.WORLD)
    with torch.no_grad():
        logits = _decode_logits(model, idx, prompt, cache)
    greedy, gen_cache = sharded_generate(
        model, idx[:, :11], 9, temperature=0, group=dist.group.WORLD, chunk_size=2 * world
    )
    sampled, _ = sharded_generate(
        model,
        idx[:, :5],
        6,
        temperature=1.0,
        top_k=8,
        generator=torch.Generator().manual_seed(rank),
        group=dist.group.WORLD,
    )
    return logits, cache.n_local, cache.nbytes(), greedy, gen_cache.sent_bytes, sampled


@pytest.mark.parametrize("rule", list(DECODE_RULES))
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_kv_decode_equals_plain(rule, world):
    """Every position's logits through a KV cache split over the ranks equal the plain forward;
    sharded generation gives the ids of GPT.generate; every rank samples the same tokens."""
    cfg = {**BASE, **DECODE_RULES[rule]}
    model, idx = make_model(cfg), make_idx(cfg)
    ref = model(idx)
    greedy_ref = model.generate(idx[:, :11], 9, temperature=0)
    results = spawn(_sharded_decode, world, cfg, 7, timeout_s=120)
    assert sum(r[1] for r in results) == cfg["seq_len"]  # each token's keys on one rank
    full_bytes = model.new_cache(idx.shape[0]).k.numel() * 2 * 4
    for logits, n_local, nbytes, greedy, sent, sampled in results:
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-5)
        assert n_local in (cfg["seq_len"] // world, -(-cfg["seq_len"] // world))
        assert nbytes == full_bytes // cfg["seq_len"] * (-(-cfg["seq_len"] // world) + 1)
        assert torch.equal(greedy, greedy_ref) and sent > 0
        assert torch.equal(sampled, results[0][5])  # rank 0's token broadcast, whatever the local seed


def test_sharded_kv_one_rank_is_the_plain_cache():
    model, idx = make_model(BASE), make_idx(BASE)
    cache = ShardedKVCache.for_model(model, idx.shape[0], BASE["seq_len"])
    with torch.no_grad():
        torch.testing.assert_close(_decode_logits(model, idx, 5, cache), model(idx), rtol=1e-4, atol=1e-5)
    assert cache.sent_bytes == 0 and cache.n_local == BASE["seq_len"]
    ids, _ = sharded_generate(model, idx[:, :7], 10, temperature=0, chunk_size=3)
    assert torch.equal(ids, model.generate(idx[:, :7], 10, temperature=0))
    small = ShardedKVCache.for_model(model, idx.shape[0], 6)
    model.forward_hidden(idx[:, :6], small)
    with pytest.raises(ValueError, match="7 tokens exceed max_len=6"):
        model.forward_hidden(idx[:, 6:7], small)  # a full cache says so


def test_sharded_generate_rejects_bad_arguments():
    model, idx = make_model(BASE), make_idx(BASE)
    for kwargs, match in (
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(max_new_tokens=BASE["seq_len"]), "exceed seq_len"),
        (dict(max_new_tokens=2, temperature=-1.0), "temperature"),
        (dict(max_new_tokens=2, chunk_size=0), "chunk_size"),
    ):
        with pytest.raises(ValueError, match=match):
            sharded_generate(model, idx[:, :4], **kwargs)
    with pytest.raises(ValueError, match="idx"):
        sharded_generate(model, idx[0], 2)


def _odd_chunk(rank, world):
    import torch.distributed as dist

    sharded_generate(make_model(BASE), make_idx(BASE)[:, :8], 2, group=dist.group.WORLD, chunk_size=3)


def test_sharded_generate_needs_chunks_that_split():
    from attention_residuals.parallel import DistributedError

    with pytest.raises(DistributedError, match="chunk_size: expected a multiple of the 2 ranks, got 3"):
        spawn(_odd_chunk, 2, timeout_s=60)
