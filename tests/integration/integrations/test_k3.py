"""The K3 state-dict adapter on a tiny random checkpoint in the K3 AttnRes layout."""

import pytest
import torch
import torch.nn.functional as F

from attention_residuals.connections import ResidualConfig
from attention_residuals.integrations.k3 import from_k3, k3_block_size, residual_config_from_k3, to_k3
from attention_residuals.integrations.patch import apply_attnres

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

N, D, BLOCK = 4, 32, 2  # decoder layers, width, K3 attn_res_block_size (layers per block)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=D,
        intermediate_size=64,
        num_hidden_layers=N,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config).eval()


def k3_checkpoint() -> dict[str, torch.Tensor]:
    """A Llama's weights plus random AttnRes tensors named and shaped as a K3 checkpoint names them."""
    sd = dict(tiny_llama().state_dict())
    g = torch.Generator().manual_seed(1)
    for name in [f"model.layers.{i}.{s}" for i in range(N) for s in ("self_attention_res", "mlp_res")] + [
        "model.output_attn_res"
    ]:
        sd[f"{name}_proj.weight"] = torch.randn(1, D, generator=g) * 0.5
        sd[f"{name}_norm.weight"] = 1 + 0.3 * torch.randn(D, generator=g)
    return sd


def k3_reference_logits(model: LlamaForCausalLM, sd: dict, idx: torch.Tensor) -> torch.Tensor:
    """K3's Block AttnRes written from its published reference: values = sealed blocks + the
    prefix sum, keys = RMSNorm(values) * gain, softmax of keys @ proj over depth; a block is sealed
    after every BLOCK decoder layers."""
    inner, eps = model.model, model.config.rms_norm_eps
    x = inner.embed_tokens(idx)
    T = idx.shape[1]
    cos_sin = inner.rotary_emb(x, position_ids=torch.arange(T)[None])
    mask = torch.full((T, T), torch.finfo(x.dtype).min).triu(1)[None, None]
    blocks, prefix = [x], None

    def attn_res(name):
        values = torch.stack(blocks + ([prefix] if prefix is not None else []))
        keys = F.rms_norm(values, (D,), sd[f"{name}_norm.weight"], eps)
        probs = (keys @ sd[f"{name}_proj.weight"][0]).softmax(0)
        return (probs.unsqueeze(-1) * values).sum(0)

    for i, layer in enumerate(inner.layers):
        h = attn_res(f"model.layers.{i}.self_attention_res")
        v = layer.self_attn(layer.input_layernorm(h), position_embeddings=cos_sin, attention_mask=mask)[0]
        prefix = v if prefix is None else prefix + v
        h = attn_res(f"model.layers.{i}.mlp_res")
        prefix = prefix + layer.mlp(layer.post_attention_layernorm(h))
        if (i + 1) % BLOCK == 0:
            blocks.append(prefix)
            prefix = None
    return model.lm_head(inner.norm(attn_res("model.output_attn_res")))


def test_k3_checkpoint_loads_into_a_patched_llama_and_matches_the_k3_formula():
    sd = k3_checkpoint()
    idx = torch.randint(0, 64, (2, 7))
    model = tiny_llama()
    rule = residual_config_from_k3(BLOCK)
    assert rule == ResidualConfig("block", block_size=2 * BLOCK, key_norm_gain=True)
    apply_attnres(model, "block", block_size=rule.block_size, key_norm_gain=True)
    ours = from_k3(sd)
    assert ours["model.attnres.queries"].shape == (2 * N + 1, D) and ours["model.attnres.key_gain"].shape == (
        2 * N + 1,
        D,
    )
    model.load_state_dict(ours, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(
            model(idx).logits, k3_reference_logits(model, sd, idx), rtol=1e-5, atol=1e-5
        )
    # and back: the K3 checkpoint, tensor for tensor
    back = to_k3(model.state_dict())
    assert back.keys() == sd.keys()
    for k, v in sd.items():
        assert torch.equal(back[k], v), k
    assert k3_block_size(model.attnres_patch.connection.config, 2 * N) == BLOCK


def test_k3_adapter_errors_name_the_problem():
    with pytest.raises(ValueError, match="block_size"):
        k3_block_size(ResidualConfig("block", block_size=3), 8)
    with pytest.raises(ValueError, match="depth_heads"):
        k3_block_size(ResidualConfig("block", block_size=2, depth_heads=2), 8)
    with pytest.raises(ValueError, match="rule"):
        k3_block_size(ResidualConfig("full"), 8)
    with pytest.raises(ValueError, match="attn_res_block_size"):
        residual_config_from_k3(0)
    sd = k3_checkpoint()
    del sd["model.output_attn_res_norm.weight"]
    with pytest.raises(ValueError, match="missing"):
        from_k3(sd)
    with pytest.raises(ValueError, match="no K3 form"):
        to_k3({"model.attnres.queries": torch.zeros(5, 4), "model.attnres.query_up": torch.zeros(5, 2, 4)})
    # a rule without a gain exports gains of one
    out = to_k3({"model.attnres.queries": torch.zeros(5, 4)})
    assert torch.equal(out["model.layers.1.mlp_res_norm.weight"], torch.ones(4))
