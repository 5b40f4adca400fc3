"""Tensor-parallel inference (sharded layer weights, KV cache by head, depth state by token)
equals the one-process model for every depth-mixing rule; memory per rank is 1/P."""

import pytest
import torch

from attention_residuals.model import GPT, GPTConfig
from attention_residuals.parallel import spawn
from attention_residuals.parallel.tp import TensorParallelGPT, tensor_parallel_generate

BASE = dict(vocab_size=64, n_layer=3, n_head=4, d_model=32, seq_len=24, mlp_hidden=64)
RULES = {
    "block": dict(residual="block", block_size=2),
    "block_depth_heads": dict(residual="block", block_size=2, depth_heads=4),
    "block_input_query": dict(residual="block", block_size=4, query="input"),
    "full": dict(residual="full"),
    "prenorm": dict(residual="prenorm"),
    "mhc": dict(residual="mhc"),
    "denseformer": dict(residual="denseformer"),
}


def make_model(cfg):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    with torch.no_grad():
        for p in model.residual.parameters():
            p.add_(torch.randn_like(p) * 0.5)  # depth weights far from uniform
    return model.eval()


def make_idx(cfg, batch=2):
    return torch.randint(
        0, cfg["vocab_size"], (batch, cfg["seq_len"]), generator=torch.Generator().manual_seed(1)
    )


def _every_position(tp, idx, chunks):
    """Final hidden states of every position: the prompt in ``chunks``, then one token at a time."""
    cache = tp.new_cache(idx.shape[0], idx.shape[1])
    bounds = [0, *chunks, idx.shape[1]]
    return torch.cat([tp.forward_hidden(idx[:, a:b], cache) for a, b in zip(bounds, bounds[1:])], dim=1)


def _tp(rank, world, cfg, chunks):
    import torch.distributed as dist

    model, idx = make_model(cfg), make_idx(cfg)
    tp = TensorParallelGPT(model, dist.group.WORLD)
    hidden = _every_position(tp, idx, chunks)
    greedy, _ = tensor_parallel_generate(tp, idx[:, :9], 10, temperature=0, chunk_size=4)
    sampled, _ = tensor_parallel_generate(
        tp, idx[:, :5], 6, temperature=1.0, top_k=8, generator=torch.Generator().manual_seed(rank)
    )
    return hidden, tp.stats.to_dict(), greedy, sampled


@pytest.mark.parametrize("rule", list(RULES))
def test_tensor_parallel_equals_one_process(rule):
    """Chunks that split over the ranks (reduce-scatter) and chunks that do not (all-reduce),
    then decode: every position equals the plain forward; greedy ids equal GPT.generate."""
    cfg = {**BASE, **RULES[rule]}
    model, idx = make_model(cfg), make_idx(cfg)
    ref = model.forward_hidden(idx)
    chunks = [8, 13, 16]  # 8 | 5 (uneven) | 3 (uneven) | one token at a time from 16
    chunks += list(range(17, cfg["seq_len"]))
    results = spawn(_tp, 2, cfg, chunks, timeout_s=120)
    greedy_ref = model.generate(idx[:, :9], 10, temperature=0)
    for hidden, stats, greedy, sampled in results:
        torch.testing.assert_close(hidden, ref, rtol=1e-4, atol=1e-5)
        assert torch.equal(greedy, greedy_ref)
        assert torch.equal(sampled, results[0][3])  # rank 0's token broadcast, whatever the local seed
        assert stats["reduce_scatter_bytes"] > 0 and stats["allreduce_bytes"] > 0


def _memory(rank, world, cfg):
    import torch.distributed as dist

    tp = TensorParallelGPT(make_model(cfg), dist.group.WORLD if world > 1 else None)
    tp.forward_hidden(make_idx(cfg), tp.new_cache(2))
    return tp.stats.to_dict()


@pytest.mark.parametrize("rule", ["block", "full"])
def test_memory_per_rank_is_one_over_p(rule):
    """Layer weights, KV cache and the depth state (block states) per rank: 1/P of one process."""
    cfg = {**BASE, **RULES[rule]}
    one = _memory(0, 1, cfg)
    four = spawn(_memory, 4, cfg, timeout_s=120)
    for stats in four:
        for key in ("layer_weight_bytes", "kv_cache_bytes", "peak_state_bytes"):
            assert stats[key] * 4 == one[key], key
        # per sublayer: all-gather of the input, reduce-scatter of the output, (P-1)/P of B T d each
        per = 3 * 2 * cfg["seq_len"] * cfg["d_model"] * 4 // 4
        assert stats["reduce_scatter_bytes"] == 2 * cfg["n_layer"] * per
        assert stats["allgather_bytes"] == (2 * cfg["n_layer"] + 1) * per  # + the final hidden states
        assert stats["allreduce_bytes"] == 0


def test_one_rank_is_the_model():
    cfg = {**BASE, **RULES["block"]}
    model, idx = make_model(cfg), make_idx(cfg)
    tp = TensorParallelGPT(model)
    # float32 roundoff only: the chunked path sums in another order (1.7e-6 on hidden states ~0.2
    # seen on one AMD EPYC; within 1e-6 on others)
    torch.testing.assert_close(
        _every_position(tp, idx, [10]), model.forward_hidden(idx), rtol=1e-5, atol=1e-5
    )


def test_bf16_autocast_stays_close():
    cfg = {**BASE, **RULES["block"]}
    model, idx = make_model(cfg), make_idx(cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model.forward_hidden(idx)
        results = spawn(_autocast_hidden, 2, cfg, timeout_s=120)
    for hidden in results:
        torch.testing.assert_close(hidden.float(), ref.float(), rtol=0.05, atol=0.05)


def _autocast_hidden(rank, world, cfg):
    import torch.distributed as dist

    tp = TensorParallelGPT(make_model(cfg), dist.group.WORLD)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return _every_position(tp, make_idx(cfg), [12])


def _uneven_heads(rank, world, cfg):
    import torch.distributed as dist

    TensorParallelGPT(make_model(cfg), dist.group.WORLD)


def test_refuses_what_does_not_split():
    from attention_residuals.parallel import DistributedError

    with pytest.raises(
        DistributedError, match="n_head=4 and the MLP width 64 must split evenly over 3 ranks"
    ):
        spawn(_uneven_heads, 3, {**BASE, **RULES["block"]}, timeout_s=60)
    cfg = {**BASE, **RULES["block"]}
    tp = TensorParallelGPT(make_model(cfg))
    cache = tp.new_cache(2, 6)
    with pytest.raises(ValueError, match="exceed the cache's capacity of 6 tokens"):
        tp.forward_hidden(make_idx(cfg)[:, :7], cache)
    for kwargs, match in (
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(max_new_tokens=cfg["seq_len"]), "exceed seq_len"),
        (dict(max_new_tokens=2, top_k=0), "top_k"),
        (dict(max_new_tokens=2, chunk_size=0), "chunk_size"),
    ):
        with pytest.raises(ValueError, match=match):
            tensor_parallel_generate(tp, make_idx(cfg)[:, :4], **kwargs)
