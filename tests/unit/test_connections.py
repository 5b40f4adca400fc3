"""ResidualConfig and the rule registry: one home per option, old spellings still load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attention_residuals import GPT, RULES, GPTConfig, ResidualConfig, make_connection
from attention_residuals.connections import BlockAttnRes

ROOT = Path(__file__).resolve().parents[2]


def test_registry_names_every_rule_once():
    assert set(RULES) == {"prenorm", "full", "block", "denseformer", "mhc", "swa", "mixing"}
    assert all(cls.rule == name for name, cls in RULES.items())
    for cls in RULES.values():  # a rule reads only options that exist
        assert set(cls.options) <= set(ResidualConfig.__dataclass_fields__) - {"rule"}


def test_residual_config_is_frozen_and_checks_itself():
    cfg = ResidualConfig("block", n_blocks=4)
    with pytest.raises(AttributeError):
        cfg.n_blocks = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match="residual: expected one of"):
        ResidualConfig("nope")
    with pytest.raises(ValueError, match="depth_heads: expected an int"):
        ResidualConfig("full", depth_heads=True)  # a bool is not an int
    with pytest.raises(ValueError, match="key_norm: expected a bool"):
        ResidualConfig("full", key_norm="false")
    with pytest.raises(ValueError, match="normalize: expected one of"):
        ResidualConfig("full", normalize="relu")
    with pytest.raises(ValueError, match="key_norm_gain: .*key_norm=True"):
        ResidualConfig("full", key_norm=False, key_norm_gain=True)
    with pytest.raises(
        ValueError, match=r"key_norm_gain: only used by residual in \('full', 'block', 'swa'\)"
    ):
        ResidualConfig("mhc", key_norm_gain=True)


def test_query_init_std_draws_only_the_queries():
    """``query_init_std`` > 0 draws the pseudo-queries after every other weight, so the rest of the
    model is its zero-init twin's at the same seed; 0 (the default) keeps them zero."""
    cfg = dict(n_layer=2, n_head=2, d_model=16, seq_len=8, residual="block", block_size=2)
    torch.manual_seed(3)
    zero = GPT(GPTConfig(**cfg))
    torch.manual_seed(3)
    drawn = GPT(GPTConfig(**cfg, query_init_std=0.25))
    assert torch.count_nonzero(zero.residual.queries) == 0
    assert 0.15 < float(drawn.residual.queries.detach().std()) < 0.35
    others = {k: v for k, v in drawn.state_dict().items() if k != "residual.queries"}
    assert others.keys() and all(torch.equal(v, zero.state_dict()[k]) for k, v in others.items())
    with torch.no_grad():  # a query away from zero: the depth mix no longer starts as the mean
        x = torch.randint(0, 256, (1, 8))
        assert not torch.allclose(zero(x)[0], drawn(x)[0])
    conn = make_connection("block", 4, 16, query_init_std=0.5)  # a rule on its own draws when built
    assert 0.3 < float(conn.queries.detach().std()) < 0.7
    assert (
        torch.count_nonzero(make_connection("block", 4, 16, query_init_std=0.5, random_init=False).queries)
        == 0
    )
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="query_init_std: expected a finite number >= 0"):
            ResidualConfig("full", query_init_std=bad)
    with pytest.raises(
        ValueError, match=r"query_init_std: only used by residual in \('full', 'block', 'swa'\)"
    ):
        ResidualConfig("prenorm", query_init_std=0.1)


def test_flat_and_nested_spellings_are_one_config():
    nested = GPTConfig(
        d_model=32, n_layer=2, n_head=2, residual=ResidualConfig("block", n_blocks=2, depth_heads=2)
    )
    flat = GPTConfig(d_model=32, n_layer=2, n_head=2, residual="block", n_blocks=2, depth_heads=2)
    old = GPTConfig.from_dict(
        {"d_model": 32, "n_layer": 2, "n_head": 2, "residual": "block", "n_blocks": 2, "heads": 2}
    )
    assert nested == flat == old == GPTConfig.from_dict(nested.to_dict())
    assert nested.to_dict()["residual"]["rule"] == "block"
    with pytest.raises(TypeError, match="heads= is now depth_heads="):
        GPTConfig(residual="full", heads=2)
    with pytest.raises(TypeError, match="heads= is now depth_heads="):
        make_connection("full", 4, 8, heads=2)
    with pytest.raises(ValueError, match="unknown fields"):
        GPTConfig.from_dict({"residual": "block", "n_blockz": 2})


def test_every_committed_run_config_loads():
    # finished runs (a study training here has one run without its summary yet: it is not committed)
    paths = sorted(
        p for p in (ROOT / "results" / "runs").glob("*/config.json") if p.with_name("summary.json").exists()
    )
    assert paths, "the committed runs are the compatibility fixture"
    for path in paths:
        record = json.loads(path.read_text())
        cfg = GPTConfig.from_dict(record["model"])
        model = GPT(cfg)
        summary = json.loads((path.parent / "summary.json").read_text())
        assert summary["params"] == model.num_params(), path  # the same architecture as trained


def test_key_norm_gain_is_a_query_gain_and_two_phase_stays_exact():
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=64,
        n_layer=3,
        n_head=2,
        d_model=32,
        seq_len=16,
        residual="block",
        block_size=2,
        key_norm_gain=True,
    )
    model = GPT(cfg).double()
    res = model.residual
    assert isinstance(res, BlockAttnRes) and res.key_gain.shape == (7, 32)
    with torch.no_grad():
        res.queries.normal_()
        res.key_gain.uniform_(0.5, 1.5)
    idx = torch.randint(0, 64, (2, 16))
    plain = model(idx)
    torch.testing.assert_close(model(idx, schedule="two_phase"), plain)
    ref = GPT(GPTConfig(**{**cfg.__dict__, "residual": cfg.residual.replace(key_norm_gain=False)})).double()
    state = {k: v for k, v in model.state_dict().items() if k != "residual.key_gain"}
    state["residual.queries"] = res.queries * res.key_gain  # folded: w' = g * w
    ref.load_state_dict(state)
    torch.testing.assert_close(ref(idx), plain)
    plain.sum().backward()
    assert res.key_gain.grad is not None and res.key_gain.grad.abs().sum() > 0
