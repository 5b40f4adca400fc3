"""The HF model beyond plain logits: padding and batched generation, hidden states and attention
weights, gradient checkpointing, positions past the training context, torch.compile, Trainer."""

import pytest
import torch

pytest.importorskip("transformers")

from attention_residuals.integrations.hf import from_gpt  # noqa: E402
from attention_residuals.kernels import use_backend  # noqa: E402
from attention_residuals.model import GPT, GPTConfig  # noqa: E402


def tiny_hf(residual="block", **kw):
    base = dict(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=40, residual=residual)
    if residual == "block":
        base["block_size"] = 3
    base.update(kw)
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**base)).eval()
    with torch.no_grad():
        for p in gpt.residual.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    hf = from_gpt(gpt).eval()
    hf.generation_config.pad_token_id = 0
    hf.generation_config.eos_token_id = None  # greedy runs never stop early
    return gpt, hf


def left_pad(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    return ids, mask


@pytest.mark.parametrize("residual", ["block", "mhc"])
def test_batched_left_padded_generate_equals_each_row_alone(residual):
    _, hf = tiny_hf(residual)
    torch.manual_seed(1)
    prompts = [torch.randint(1, 64, (n,)) for n in (3, 7, 5)]
    ids, mask = left_pad(prompts)
    for kwargs in ({}, {"num_beams": 2}, {"cache_implementation": "static"}):
        batched = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **kwargs)
        for i, p in enumerate(prompts):
            alone = hf.generate(p[None], max_new_tokens=6, do_sample=False, **kwargs)
            assert torch.equal(batched[i, ids.shape[1] :], alone[0, len(p) :]), (kwargs, i)
    # and the prompt logits of the real tokens are those of each row alone
    with torch.no_grad():
        out = hf(ids, attention_mask=mask).logits
        for i, p in enumerate(prompts):
            torch.testing.assert_close(out[i, -len(p) :], hf(p[None]).logits[0], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()  # padded positions too (a padded query attends to itself)


def test_right_padding_keeps_the_real_tokens_exact():
    _, hf = tiny_hf("full")
    a, b = torch.randint(0, 64, (9,)), torch.randint(0, 64, (4,))
    ids = torch.stack([a, torch.cat([b, torch.zeros(5, dtype=torch.long)])])
    mask = torch.tensor([[1] * 9, [1] * 4 + [0] * 5])
    with torch.no_grad():
        out = hf(ids, attention_mask=mask).logits
        torch.testing.assert_close(out[0], hf(a[None]).logits[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[1, :4], hf(b[None]).logits[0], rtol=1e-5, atol=1e-5)
        # a mask of ones is the unmasked (causal) model, bit for bit
        torch.testing.assert_close(
            hf(ids, attention_mask=torch.ones_like(ids)).logits, hf(ids).logits, rtol=0, atol=0
        )


def test_hidden_states_and_attention_weights():
    gpt, hf = tiny_hf("block")
    idx = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        out = hf(idx, output_hidden_states=True)
        both = hf(idx, output_hidden_states=True, output_attentions=True)
        plain = hf(idx).logits
    hs, att = out.hidden_states, both.attentions
    assert out.attentions is None and len(both.hidden_states) == len(hs)
    assert len(hs) == gpt.config.n_layer + 1 and all(h.shape == (2, 7, 32) for h in hs)
    torch.testing.assert_close(hs[0], gpt.embed(idx), rtol=0, atol=0)  # h_0 = the embedding
    torch.testing.assert_close(hf.model.lm_head(hs[-1]), out.logits, rtol=0, atol=0)  # the final output
    with torch.no_grad(), use_backend("reference"):
        torch.testing.assert_close(hs[-1], gpt.forward_hidden(idx), rtol=0, atol=0)
    assert not torch.equal(hs[1], hs[0])
    assert len(att) == gpt.config.n_layer and att[0].shape == (2, 2, 7, 7)
    torch.testing.assert_close(att[0].sum(-1), torch.ones(2, 2, 7))
    assert (att[1].triu(1) == 0).all()  # causal
    torch.testing.assert_close(out.logits, plain, rtol=0, atol=0)
    torch.testing.assert_close(both.logits, plain, rtol=1e-5, atol=1e-5)  # eager attention, same model


def test_gradient_checkpointing_gives_the_same_gradients():
    _, hf = tiny_hf("block", key_norm_gain=True)
    idx = torch.randint(0, 64, (2, 9))
    hf.train()

    def grads():
        hf.zero_grad()
        loss = hf(idx, labels=idx).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}

    loss_ref, ref = grads()
    hf.gradient_checkpointing_enable()
    assert hf.model.gradient_checkpointing
    calls = []
    inner = hf.model._gradient_checkpointing_func
    hf.model._gradient_checkpointing_func = lambda *a, **k: calls.append(1) or inner(*a, **k)
    loss, got = grads()
    assert len(calls) == 4  # every sublayer recomputed in backward
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=0)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-7, msg=name)


def test_labels_ignore_index_and_num_items():
    gpt, hf = tiny_hf("full")
    idx = torch.randint(0, 64, (2, 9))
    labels = idx.clone()
    labels[:, :4] = -100
    with torch.no_grad(), use_backend("reference"):
        loss = hf(idx, labels=labels).loss
        _, ref = gpt(idx[:, :-1], torch.where(labels[:, 1:] == -100, -1, labels[:, 1:]))
        torch.testing.assert_close(loss, ref)
        # Trainer's form: a summed loss over the items of the whole (accumulated) batch
        summed = hf(idx, labels=labels, num_items_in_batch=torch.tensor(20)).loss
    torch.testing.assert_close(summed, ref * 10 / 20)


def test_generation_past_the_training_context():
    _, hf = tiny_hf("block", seq_len=16)
    trained = hf.model.rope_cos.clone()
    prompt = torch.randint(0, 64, (1, 10))
    with torch.no_grad():
        before = hf(prompt).logits
    long = hf.generate(prompt, max_new_tokens=20, do_sample=False)
    assert long.shape == (1, 30)
    assert torch.equal(hf.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=False), long)
    assert hf.model.rope_cos.shape[0] >= 30  # the RoPE tables grew ...
    assert torch.equal(hf.model.rope_cos[:16], trained)  # ... keeping the trained positions' rows
    with torch.no_grad():
        torch.testing.assert_close(hf(long).logits[:, :10], before, rtol=1e-5, atol=1e-5)


def test_compile_fullgraph_gpt_and_hf():
    gpt, hf = tiny_hf("block", key_norm_gain=True)
    idx = torch.randint(0, 64, (2, 9))
    torch._dynamo.reset()
    with torch.no_grad():
        eager_gpt, eager_hf = gpt(idx), hf(idx, use_cache=False).logits
        got_gpt = torch.compile(gpt, fullgraph=True, backend="eager")(idx)
        got_hf = torch.compile(hf, fullgraph=True, backend="eager")(idx, use_cache=False).logits
    torch.testing.assert_close(got_gpt, eager_gpt, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_hf, eager_hf, rtol=0, atol=0)


def test_trainer_runs_two_steps(tmp_path):
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    _, hf = tiny_hf("block")
    hf.train()
    torch.manual_seed(2)
    rows = [torch.randint(1, 64, (8,)) for _ in range(4)]
    data = [{"input_ids": r, "attention_mask": torch.ones(8, dtype=torch.long), "labels": r} for r in rows]
    before = {n: p.detach().clone() for n, p in hf.named_parameters()}
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    result = Trainer(model=hf, args=args, train_dataset=data).train()
    assert result.global_step == 2
    assert all(torch.isfinite(torch.tensor(result.training_loss)).reshape(-1))
    assert not torch.equal(hf.model.residual.queries, before["model.residual.queries"])
