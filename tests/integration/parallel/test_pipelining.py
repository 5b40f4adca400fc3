"""Pipeline-parallel Block AttnRes on torch.distributed.pipelining (gloo, 2 and 4 processes):
loss and every gradient equal one process for GPipe, 1F1B and interleaved 1F1B, with and without
the cross-stage cache; the bytes each stage sends are the layout's (the report's formula). Full
AttnRes, mixing, PreNorm and mHC-lite ride the same runtime, equal to one process too."""

import pytest
import torch

from attention_residuals.model import GPT, GPTConfig
from attention_residuals.parallel import DistributedError, spawn
from attention_residuals.parallel.pipeline import derived_transfers
from attention_residuals.parallel.pipelining import PipelinedGPT

B, T, D, V = 4, 8, 16, 32


def config(tie=False, block_size=2, residual="block"):
    return GPTConfig(
        n_layer=4,
        n_head=2,
        d_model=D,
        seq_len=T,
        vocab_size=V,
        residual=residual,
        tie_embeddings=tie,
        **({"block_size": block_size} if residual in ("block", "full") else {}),
    )


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def make_model(tie, block_size, residual="block"):
    torch.manual_seed(0)
    model = GPT(config(tie, block_size, residual))
    with torch.no_grad():  # zero-init queries would make every depth mix a plain mean (blind to order)
        for p in model.residual.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model


def _pipelined(rank, world, kw, tie, block_size, residual="block"):
    model = make_model(tie, block_size, residual)
    names = {id(p): n for n, p in model.named_parameters()}
    pp = PipelinedGPT(model, microbatches=world, **kw)
    results = []
    for seed in (1, 2):  # two steps: the second has no metadata inference in it
        for p in pp.parameters():
            p.grad = None
        x, y = batch(seed)
        loss = pp.step(x if rank == 0 else None, y)
        grads = {names[id(p)]: p.grad.clone() for p in pp.parameters() if p.grad is not None}
        results.append((float(loss), grads, pp.sent_elements()))
    # gradient accumulation over two batches (shared gradients summed once, at the end), the
    # global gradient norm, and a forward-only evaluation
    for p in pp.parameters():
        p.grad = None
    for seed, sync in ((1, False), (2, True)):
        x, y = batch(seed)
        pp.step(x if rank == 0 else None, y, scale=0.5, sync=sync)
    norm = float(pp.clip_grad_norm_(0.0))
    grads = {names[id(p)]: p.grad.clone() for p in pp.parameters() if p.grad is not None}
    x, y = batch(1)
    results.append((float(pp.evaluate(x if rank == 0 else None, y)), grads, norm))
    return results


def reference(tie, block_size, *seeds, residual="block"):
    """One process: the mean loss over ``seeds``' batches and its gradients."""
    model = make_model(tie, block_size, residual)
    total = 0.0
    for seed in seeds:
        x, y = batch(seed)
        _, loss = model(x, y)
        (loss / len(seeds)).backward()
        total += float(loss.detach()) / len(seeds)
    return total, {n: p.grad for n, p in model.named_parameters()}


def merged(out, index):
    """Every rank's gradients of result ``index`` in one dict (a parameter held by two ranks, a
    tied embedding, must have the same summed gradient on both)."""
    got = {}
    for r in out:
        for name, g in r[index][1].items():
            if name in got:
                torch.testing.assert_close(g, got[name], rtol=0, atol=0)
            got[name] = g
    return got


def assert_grads(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


CASES = [
    (2, {"schedule": "gpipe", "scheme": "naive"}, False),
    (2, {"schedule": "1f1b", "scheme": "cached"}, True),
    (2, {"schedule": "interleaved", "virtual": 2, "scheme": "cached"}, True),
    (2, {"schedule": "interleaved", "virtual": 2, "scheme": "naive"}, False),
    (4, {"schedule": "1f1b", "scheme": "cached"}, False),
    (4, {"schedule": "interleaved", "virtual": 2, "scheme": "cached"}, True),
]


@pytest.mark.parametrize(
    "world, kw, tie",
    CASES,
    ids=[f"{w}x{k['schedule']}-{k['scheme']}{'-tied' if t else ''}" for w, k, t in CASES],
)
def test_pipelining_equals_one_process(world, kw, tie):
    assert_equals_one_process(spawn(_pipelined, world, kw, tie, 2, timeout_s=120), world, tie)


def assert_equals_one_process(out, world, tie, residual="block"):
    """Both steps' losses (on every rank) and gradients, the accumulated gradients, their norm and
    the forward-only loss of :func:`_pipelined` equal one process."""
    for step, seed in enumerate((1, 2)):
        want_loss, want = reference(tie, 2, seed, residual=residual)
        assert [r[step][0] for r in out] == pytest.approx([want_loss] * world, rel=1e-6)  # every rank
        assert_grads(merged(out, step), want)
    want_loss, want = reference(tie, 2, 1, 2, residual=residual)  # accumulated over two batches
    assert_grads(merged(out, 2), want)
    norm = torch.nn.utils.get_total_norm(list(want.values()))
    assert [r[2][2] for r in out] == pytest.approx([float(norm)] * world, rel=1e-5)
    want_eval = reference(tie, 2, 1, residual=residual)[0]
    assert [r[2][0] for r in out] == pytest.approx([want_eval] * world, rel=1e-6)


RULE_CASES = [
    ("prenorm", 2, {"schedule": "1f1b", "scheme": "cached"}),
    ("prenorm", 2, {"schedule": "interleaved", "virtual": 2, "scheme": "cached"}),
    ("full", 2, {"schedule": "interleaved", "virtual": 2, "scheme": "cached"}),
    ("full", 4, {"schedule": "1f1b", "scheme": "naive"}),
    ("mixing", 2, {"schedule": "interleaved", "virtual": 2, "scheme": "cached"}),
    ("mhc", 2, {"schedule": "interleaved", "virtual": 2, "scheme": "cached"}),
]


@pytest.mark.parametrize(
    "residual, world, kw",
    RULE_CASES,
    ids=[f"{r}-{w}x{k['schedule']}-{k['scheme']}" for r, w, k in RULE_CASES],
)
def test_other_rules_equal_one_process(residual, world, kw):
    """The baseline and the other carried rules train through the same runtime: full and mixing
    carry their sources (cached on the interleaved rank), prenorm and mHC one tensor per hop."""
    out = spawn(_pipelined, world, kw, True, 2, residual, timeout_s=120)
    assert_equals_one_process(out, world, True, residual)


@pytest.mark.parametrize("block_size", [2, 3])
@pytest.mark.parametrize("world, virtual", [(2, 2), (4, 2)])
def test_bytes_sent_are_the_layouts(world, virtual, block_size):
    """What each stage sends per step (its output tensor), cached and naive, is the layout's
    count of ``[B, T, d]`` tensors; the cached total is the closed form of the report's scheme."""
    totals = {}
    for scheme in ("naive", "cached"):
        kw = {"schedule": "interleaved", "virtual": virtual, "scheme": scheme}
        out = spawn(_pipelined, world, kw, False, block_size, timeout_s=120)
        sent = {c: n for r in out for c, n in r[1][2].items()}  # the second step
        pp_layout = _layout(world, virtual, block_size)
        for c in range(pp_layout.chunks - 1):
            assert sent[c] == pp_layout.tensors_sent(c + 1, scheme) * B * T * D, (scheme, c)
        totals[scheme] = sum(sent.values()) // (B * T * D)
        assert totals[scheme] == derived_transfers(pp_layout.bounds, block_size, world, scheme)
    assert totals["cached"] < totals["naive"]


@pytest.mark.parametrize("residual", ["full", "prenorm"])
def test_bytes_sent_by_other_rules(residual):
    """Full AttnRes sends its sources as blocks of one (the cache keeps what the rank received);
    PreNorm one ``[B, T, d]`` tensor per hop whatever the scheme."""
    world, virtual = 2, 2
    layout = _layout(world, virtual, 1, hidden=residual == "prenorm")
    totals = {}
    for scheme in ("naive", "cached"):
        kw = {"schedule": "interleaved", "virtual": virtual, "scheme": scheme}
        out = spawn(_pipelined, world, kw, False, 2, residual, timeout_s=120)
        sent = {c: n for r in out for c, n in r[1][2].items()}
        assert [sent[c] for c in range(layout.chunks - 1)] == [
            layout.tensors_sent(c + 1, scheme) * B * T * D for c in range(layout.chunks - 1)
        ]
        totals[scheme] = sum(sent.values()) // (B * T * D)
    if residual == "prenorm":
        assert totals == {"naive": layout.chunks - 1, "cached": layout.chunks - 1}
    else:
        assert totals["cached"] == derived_transfers(layout.bounds, 1, world, "cached") < totals["naive"]


def _layout(world, virtual, block_size, hidden=False):
    from attention_residuals.parallel.pipeline import PipelineLayout

    return PipelineLayout.build(8, block_size, world, virtual, hidden=hidden)


def _bad(rank, world, kw, model_kw):
    torch.manual_seed(0)
    PipelinedGPT(GPT(GPTConfig(n_layer=2, n_head=2, d_model=D, seq_len=T, vocab_size=V, **model_kw)), **kw)


@pytest.mark.parametrize(
    "kw, model_kw, message",
    [
        (
            {},
            {"residual": "swa"},
            "pipelining carries the states of block, full, mixing, prenorm, mhc; got residual='swa'",
        ),
        ({"schedule": "interleaved"}, {"residual": "block"}, "interleaved schedule needs virtual > 1"),
        ({"schedule": "zb"}, {"residual": "block"}, "schedule: expected one of"),
        ({"scheme": "cached_all"}, {"residual": "block"}, "scheme: expected one of"),
        ({"microbatches": 1}, {"residual": "block"}, "microbatches: 1f1b needs at least 2"),
    ],
)
def test_bad_pipelines_are_named_errors_on_every_rank(kw, model_kw, message):
    with pytest.raises(DistributedError, match="rank 0") as err:
        spawn(_bad, 2, kw, model_kw, timeout_s=60)
    assert message in str(err.value)
