"""apply_attnres: AttnRes in place of the residuals of someone else's pre-norm Transformer."""

import copy
import json

import pytest
import torch
import torch.nn as nn

from attention_residuals.integrations.patch import (
    PATCHED_MODEL_TYPE,
    apply_attnres,
    find_decoder_layers,
    load_patched,
    patched_class,
    remove_attnres,
)

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

N_LAYERS = 3  # L = 6 sublayers


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,  # greedy runs never stop early
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def idx():
    return torch.randint(0, 64, (2, 11))


def depth_mean_logits(
    model: LlamaForCausalLM, idx: torch.Tensor, mode: str, block_size: int = 1
) -> torch.Tensor:
    """The depth-mean model written out by hand from the Llama's own modules.

    Every sublayer reads the plain mean of its sources (Full: the embedding and every earlier
    output; Block: the embedding, the completed block sums and the current partial sum) and the
    final norm reads the mean of all of them: AttnRes with zero queries.
    """
    inner = model.model
    x = inner.embed_tokens(idx)
    T = idx.shape[1]
    cos_sin = inner.rotary_emb(x, position_ids=torch.arange(T)[None])
    mask = torch.full((T, T), torch.finfo(x.dtype).min).triu(1)[None, None]
    values, blocks, partial = [x], [x], None

    def mean_of_sources():
        srcs = values if mode == "full" else blocks + ([partial] if partial is not None else [])
        return torch.stack(srcs).mean(0)

    for l in range(2 * N_LAYERS):
        layer = inner.layers[l // 2]
        h = mean_of_sources()
        if l % 2 == 0:
            v = layer.self_attn(layer.input_layernorm(h), position_embeddings=cos_sin, attention_mask=mask)[0]
        else:
            v = layer.mlp(layer.post_attention_layernorm(h))
        values.append(v)
        partial = v if partial is None else partial + v
        if (l + 1) % block_size == 0:
            blocks.append(partial)
            partial = None
    return model.lm_head(inner.norm(mean_of_sources()))


def test_prenorm_patch_rebuilds_the_original_model(idx):
    """mode='prenorm' is the residual sum again: the wiring itself changes nothing."""
    model = tiny_llama()
    with torch.no_grad():
        ref = model(idx).logits
        apply_attnres(model, "prenorm")
        torch.testing.assert_close(model(idx).logits, ref, rtol=0, atol=0)
        remove_attnres(model)
        assert not any("attnres" in k for k in model.state_dict())
        torch.testing.assert_close(model(idx).logits, ref, rtol=0, atol=0)


@pytest.mark.parametrize(
    "mode,kwargs,size",
    [
        ("block", {"block_size": 2}, 2),
        ("block", {"block_size": 4}, 4),
        ("block", {"n_blocks": 3}, 2),
        ("full", {}, 1),
    ],
)
def test_patched_llama_at_init_is_the_depth_mean_model(idx, mode, kwargs, size):
    model = tiny_llama()
    apply_attnres(model, mode, **kwargs)
    queries = model.model.attnres.queries
    assert (
        queries.shape == (2 * N_LAYERS + 1, 32) and not queries.any()
    )  # zero-init, one per sublayer + final
    with torch.no_grad():
        got = model(idx).logits
        expected = depth_mean_logits(model, idx, mode, size)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if mode == "block":
        with torch.no_grad():  # and it is not the plain residual model
            remove_attnres(model)
            assert (model(idx).logits - got).abs().max() > 1e-4


def test_patched_llama_trains_and_generates(idx):
    torch.manual_seed(0)
    model = apply_attnres(tiny_llama(), "block", block_size=2)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        loss = model(idx, labels=idx).loss
        opt.zero_grad()
        loss.backward()
        if not losses:
            assert model.model.attnres.queries.grad.abs().sum() > 0  # gradients reach the depth queries
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    assert model.model.attnres.queries.abs().sum() > 0  # learned away from the depth mean
    model.eval()
    prompt = idx[:, :4]
    with_cache = model.generate(prompt, max_new_tokens=8, do_sample=False)
    no_cache = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False)
    assert with_cache.shape == (2, 12) and torch.equal(with_cache, no_cache)
    # greedy decoding is the argmax of the full forward at every step
    seq = prompt
    with torch.no_grad():
        for _ in range(8):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(seq, with_cache)
    sampled = model.generate(prompt, max_new_tokens=5, do_sample=True, top_k=5)
    assert sampled.shape == (2, 9)


def test_patch_options_dtype_and_state_dict(idx):
    model = tiny_llama().to(torch.float64)
    apply_attnres(model, "full", query="lowrank", query_rank=4)
    conn = model.model.attnres
    assert conn.queries.dtype == torch.float64
    assert {k for k in model.state_dict() if "attnres" in k} == {
        "model.attnres.queries",
        "model.attnres.query_down",
        "model.attnres.query_up",
    }
    # a second model patched the same way loads the state dict (how a trained patch is reloaded)
    other = apply_attnres(tiny_llama().to(torch.float64), "full", query="lowrank", query_rank=4)
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(other(idx).logits, model(idx).logits, rtol=0, atol=0)
    clone = copy.deepcopy(model)  # deepcopy gives an independent working copy
    assert clone.model.layers[2]._attnres_connection is clone.model.attnres
    with torch.no_grad():
        torch.testing.assert_close(clone(idx).logits, model(idx).logits, rtol=0, atol=0)


def test_patch_errors():
    model = tiny_llama()
    apply_attnres(model, "block")
    with pytest.raises(ValueError, match="already applied"):
        apply_attnres(model, "block")
    with pytest.raises(ValueError, match="residual"):
        apply_attnres(tiny_llama(), "nope")
    with pytest.raises(ValueError, match="block_size"):
        apply_attnres(tiny_llama(), "block", block_size=7)
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        apply_attnres(nn.Sequential(nn.Linear(4, 4)), "block")
    layer = model.model.layers[1]
    with pytest.raises(RuntimeError, match="depth state is unknown"):
        layer(torch.zeros(1, 3, 32))  # a middle layer called on its own


class ToyAttn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x, scale=1.0):
        return self.proj(x) * scale


class ToyBlock(nn.Module):
    """nanoGPT-style pre-norm block whose attention takes an extra argument."""

    def __init__(self, d):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = ToyAttn(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, scale=1.0):
        x = x + self.attn(self.ln_1(x), scale=scale)
        return x + self.mlp(self.ln_2(x))


class ToyGPT(nn.Module):
    def __init__(self, d=16, n=4):
        super().__init__()
        self.wte = nn.Embedding(32, d)
        self.h = nn.ModuleList(ToyBlock(d) for _ in range(n))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx, scale=1.0):
        x = self.wte(idx)
        for block in self.h:
            x = block(x, scale)  # positional: the patch names it from the original signature
        return self.ln_f(x)


def test_generic_pre_norm_model():
    torch.manual_seed(0)
    model = ToyGPT()
    idx = torch.randint(0, 32, (2, 5))
    path, layers, names = find_decoder_layers(model)
    assert path == "h" and names == ("attn", "mlp", "ln_1", "ln_2")
    with torch.no_grad():
        ref = model(idx, 0.5)
        apply_attnres(model, "prenorm")
        torch.testing.assert_close(model(idx, 0.5), ref, rtol=0, atol=0)
        remove_attnres(model)
        apply_attnres(model, "full")
        assert model.attnres.queries.shape == (9, 16)
        out = model(idx, 0.5)
    assert out.shape == ref.shape and not torch.allclose(out, ref)


def test_query_init_std_reaches_a_patched_model():
    """apply_attnres draws the pseudo-queries when asked (zero by default), as GPT does."""
    zero = apply_attnres(tiny_llama(), "block", block_size=2).model.attnres.queries
    drawn = apply_attnres(tiny_llama(), "block", block_size=2, query_init_std=0.5).model.attnres.queries
    assert torch.count_nonzero(zero) == 0 and 0.3 < float(drawn.detach().std()) < 0.7


def trained_patch(model, residual="block", **kw):
    """Patched, with depth parameters away from their zero init."""
    apply_attnres(model, residual, **kw)
    with torch.no_grad():
        for p in model.model.attnres.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model


def test_patched_llama_save_reload_is_exact_and_a_plain_load_is_refused(tmp_path, idx, caplog):
    from transformers import AutoModelForCausalLM

    model = trained_patch(tiny_llama(), "block", block_size=2, key_norm_gain=True)
    with torch.no_grad():
        ref = model(idx).logits
    model.save_pretrained(tmp_path)
    record = json.loads((tmp_path / "config.json").read_text())
    assert record["model_type"] == PATCHED_MODEL_TYPE
    assert (
        record["attnres"]["residual"]["rule"] == "block" and record["attnres"]["base_model_type"] == "llama"
    )
    eager = {"attn_implementation": "eager"}  # as tiny_llama (sdpa would differ in the last bits)
    for loaded in (
        load_patched(tmp_path, **eager),
        patched_class(LlamaForCausalLM).from_pretrained(tmp_path, **eager),
    ):
        loaded.eval()
        assert isinstance(loaded, LlamaForCausalLM) and loaded.attnres_patch.residual == "block"
        with torch.no_grad():
            torch.testing.assert_close(loaded(idx).logits, ref, rtol=0, atol=0)
    # saved again from the reloaded model: still a patched folder that reloads exactly
    load_patched(tmp_path).save_pretrained(tmp_path / "again")
    with torch.no_grad():
        again = load_patched(tmp_path / "again", **eager).eval()
        torch.testing.assert_close(again(idx).logits, ref, rtol=0, atol=0)
    # a plain load does not silently drop AttnRes: the auto class refuses, the base class warns
    with pytest.raises(ValueError, match="load_patched"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    with caplog.at_level("WARNING"):
        LlamaForCausalLM.from_pretrained(tmp_path)
    assert PATCHED_MODEL_TYPE in caplog.text
    tiny_llama().save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="not a model saved with apply_attnres"):
        load_patched(tmp_path / "plain")


def test_gradient_checkpointing_of_a_patched_llama_works(idx):
    model = trained_patch(tiny_llama(), "full")
    model.train()

    def grads():
        model.zero_grad()
        model(idx, labels=idx).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = grads()
    model.gradient_checkpointing_enable()
    calls = []
    for layer in model.model.layers:
        inner = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, _f=inner, **k: calls.append(1) or _f(*a, **k)
    got = grads()
    assert len(calls) == 2 * N_LAYERS  # each sublayer recomputed in backward
    assert got.keys() == ref.keys() and "model.attnres.queries" in got
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-7, msg=name)


def test_patched_llama_compiles_with_fullgraph(idx):
    model = trained_patch(tiny_llama(), "block", block_size=2)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(idx, use_cache=False).logits
        compiled = torch.compile(model, fullgraph=True, backend="eager")(idx, use_cache=False).logits
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_patched_qwen2_and_gpt2_save_reload_exactly(tmp_path, idx, family):
    if family == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager",
        )  # fmt: skip
        model = Qwen2ForCausalLM(config)
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, attn_implementation="eager")
        model = GPT2LMHeadModel(config)
    model = trained_patch(model.eval(), "full") if family == "qwen2" else model.eval()
    if family == "gpt2":  # GPT-2's layers sit at transformer.h, the rule at transformer.attnres
        apply_attnres(model, "block", block_size=2)
        with torch.no_grad():
            model.transformer.attnres.queries.add_(torch.randn_like(model.transformer.attnres.queries))
    with torch.no_grad():
        ref = model(idx).logits
    model.save_pretrained(tmp_path)
    loaded = load_patched(tmp_path, attn_implementation="eager").eval()
    assert type(loaded).__mro__[1] is type(model)
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx).logits, ref, rtol=0, atol=0)
