"""Whether the depth mixing learns: ``--log-depth`` (the depth-weight summary at each evaluation,
the depth-mixing parameters' RMS, gradient and update at each logged step) leaves training
bit-identical; ``--depth-lr-scale`` gives ``residual.*`` its own learning rate; the summary reads
each head of a multi-head model on its own."""

from __future__ import annotations

import math

import pytest
import torch

from attention_residuals import GPT, GPTConfig
from attention_residuals.training import make_config, read_metrics, train
from attention_residuals.training.checkpoint import read_checkpoint
from attention_residuals.training.data import Corpus
from attention_residuals.training.depth import depth_parameters, depth_weight_summary, parameter_step
from attention_residuals.training.optim import build_optimizer

TEXT = "".join(f"def g{i}(y):\n    return y * {i % 11} - {i % 5}\n\n" for i in range(400))


@pytest.fixture(scope="module")
def corpus():
    return Corpus.from_text(TEXT, val_fraction=0.1)


def tiny(out, **kw):
    base = dict(
        n_layer=2,
        n_head=2,
        d_model=32,
        seq_len=32,
        batch_size=4,
        steps=12,
        warmup=2,
        eval_interval=6,
        eval_batches=2,
        log_interval=3,
        progress=False,
        residual="block",
        block_size=2,
        out=str(out),
    )
    base.update(kw)
    return make_config(**base)


def test_log_depth_records_and_leaves_training_bit_identical(tmp_path, corpus):
    train(tiny(tmp_path / "plain"), corpus=corpus)
    train(tiny(tmp_path / "logged", log_depth=True), corpus=corpus)
    plain, logged = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "logged")
    keys = ("step", "train_loss", "val_loss", "lr", "grad_norm")
    assert [[r.get(k) for k in keys] for r in plain] == [[r.get(k) for k in keys] for r in logged]
    wa = read_checkpoint(tmp_path / "plain" / "checkpoint.safetensors")[0]
    wb = read_checkpoint(tmp_path / "logged" / "checkpoint.safetensors")[0]
    assert all(torch.equal(wa[k], wb[k]) for k in wa if k.startswith(("model/", "optimizer/")))
    steps = {r["step"]: r.get("depth") for r in logged}
    assert steps[0] is None and all("depth" not in r for r in plain)
    for step in (3, 6, 9, 12):
        d = steps[step]
        assert d["param_rms"] > 0 and d["grad_rms"] > 0 and d["update_rms"] > 0
        assert ("entropy_ratio" in d) == (step % 6 == 0)  # the weights at evaluations only
    last = steps[12]
    assert (
        0 < last["entropy_ratio"] < 1 and 0 < last["embedding_weight"] < 1 and last["query_logit_scale"] > 0
    )


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"residual": "prenorm", "block_size": None}, "log_depth: residual='prenorm' has no depth weights"),
        ({"fsdp": True}, "log_depth: needs the whole model on every rank"),
        (
            {"log_depth": False, "residual": "prenorm", "block_size": None, "depth_lr_scale": 3.0},
            "depth_lr_scale: residual='prenorm' has no depth-mixing parameters",
        ),
        ({"depth_lr_scale": 0.0}, "depth_lr_scale"),
    ],
)
def test_log_depth_refusals_name_the_option(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        tiny(tmp_path / "r", **{"log_depth": True, **kw}).validate()


def test_depth_lr_scale_gives_the_depth_parameters_their_own_rate():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, vocab_size=32, residual="block"))
    depth = {id(p) for p in depth_parameters(model)}
    assert depth and depth == {id(p) for p in model.residual.parameters()}
    same = build_optimizer(model, lr=1e-3)
    scaled = build_optimizer(model, lr=1e-3, depth_lr_scale=10.0)
    assert len(scaled.param_groups) == len(same.param_groups) + 1
    (group,) = [g for g in scaled.param_groups if {id(p) for p in g["params"]} & depth]
    assert {id(p) for p in group["params"]} == depth and group["lr"] == pytest.approx(1e-2)
    assert group["weight_decay"] == 0.0
    others = [g for g in scaled.param_groups if g is not group]
    assert all(g["lr"] == 1e-3 for g in others)
    muon = build_optimizer(model, "muon", lr=1e-3, depth_lr_scale=3.0)
    assert sorted(g["lr"] for g in muon.param_groups) == pytest.approx([1e-3, 1e-3, 1e-3, 3e-3])


def test_depth_lr_scale_speeds_the_queries_only(tmp_path, corpus):
    """At 10x the rate the queries move 10x further in the first step (Adam's first step from zero
    is lr * sign(grad)); every other weight is unchanged (the groups step independently)."""
    runs = {}
    for scale in (1.0, 10.0):
        out = tmp_path / f"s{scale:g}"
        train(
            tiny(out, steps=1, warmup=0, eval_interval=1, log_interval=1, depth_lr_scale=scale), corpus=corpus
        )
        runs[scale] = read_checkpoint(out / "checkpoint.safetensors")[0]
    for k in runs[1.0]:
        if not k.startswith("model/"):
            continue
        if k.startswith("model/residual."):
            assert runs[1.0][k].abs().max() > 0
            torch.testing.assert_close(runs[10.0][k], 10 * runs[1.0][k], rtol=1e-3, atol=1e-7, msg=k)
        else:
            assert torch.equal(runs[1.0][k], runs[10.0][k]), k


def test_parameter_step_measures_the_update():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 2.0)
    opt = torch.optim.SGD([p], lr=0.5)
    stats = parameter_step([p], opt.step)
    assert stats == pytest.approx({"param_rms": 1.0, "grad_rms": 2.0, "update_rms": 1.0})


def test_summary_reads_each_head_on_its_own():
    """Two heads with their own queries: the entropy ratio is the mean of the heads' entropies,
    below that of the head-averaged weights (entropy is concave: averaging heads reads as more
    uniform than any head is, which is what the per-head summary avoids)."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, vocab_size=32, residual="full", depth_heads=2)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for p in model.residual.parameters():
            p.copy_(torch.randn_like(p) * 3)
    idx = torch.randint(0, 32, (2, 8))
    w = model.depth_weights(idx, per_head=True)
    assert w.shape == (5, 5, 2)
    torch.testing.assert_close(model.depth_weights(idx), w.mean(-1), equal_nan=True)
    s = depth_weight_summary(model, idx)
    entropies = []
    for l in range(2, 5):
        for h in range(2):
            p = w[l, :, h][~torch.isnan(w[l, :, h])]
            p = p / p.sum()
            entropies.append(float(-(p * p.log()).sum()) / math.log(p.numel()))
    assert s["entropy_ratio"] == pytest.approx(sum(entropies) / len(entropies))
    assert s["per_head"] is True
    averaged = []
    for l in range(2, 5):
        p = w[l].mean(-1)[~torch.isnan(w[l].mean(-1))]
        p = p / p.sum()
        averaged.append(float(-(p * p.log()).sum()) / math.log(p.numel()))
    assert s["entropy_ratio"] < sum(averaged) / len(averaged) - 0.01


def test_log_depth_of_a_rule_without_static_queries_writes_valid_json(tmp_path, corpus):
    train(tiny(tmp_path / "mix", residual="mixing", block_size=None, log_depth=True), corpus=corpus)
    rows = [r["depth"] for r in read_metrics(tmp_path / "mix") if "entropy_ratio" in r.get("depth", {})]
    assert rows and all(d["query_logit_scale"] is None for d in rows)
    assert "NaN" not in (tmp_path / "mix" / "metrics.jsonl").read_text()


def test_log_depth_rows_only_on_logged_steps(tmp_path, corpus):
    """The per-step statistics are taken only on the steps that write a row."""
    train(tiny(tmp_path / "r", log_depth=True, log_interval=5, steps=12), corpus=corpus)
    assert [r["step"] for r in read_metrics(tmp_path / "r") if "depth" in r] == [5, 6, 10, 12]
