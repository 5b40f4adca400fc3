"""``eval`` / ``sample`` read checkpoints as ``train --resume`` does: fallback, identity, bad records."""

from __future__ import annotations

import json
import shutil

import pytest
from testkit import tiny_config

from attention_residuals.training import train
from attention_residuals.training.checkpoint import CheckpointError, CheckpointMismatchError
from attention_residuals.training.data import Corpus
from attention_residuals.training.evaluate import load_run
from attention_residuals.training.evaluate import main as eval_main
from attention_residuals.training.sample import main as sample_main

TEXT = "".join(f"def g{i}(y):\n    return y * {i % 13}\n\n" for i in range(300))


def tiny(out, **kw):
    return tiny_config(out, **{"log_interval": 4, **kw})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs on one corpus, differing in lr and seed (checkpoints at steps 4 and 8)."""
    root = tmp_path_factory.mktemp("runs")
    corpus = Corpus.from_text(TEXT, val_fraction=0.1)
    train(tiny(root / "a"), corpus=corpus)
    train(tiny(root / "b", lr=1e-2, seed=3), corpus=corpus)
    return root


def _copy(runs, name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(runs / name, dst)
    return dst


def test_eval_and_sample_fall_back_to_the_previous_checkpoint(runs, tmp_path, capsys):
    run = _copy(runs, "a", tmp_path)
    ck = run / "checkpoint.safetensors"
    ck.write_bytes(ck.read_bytes()[:-10])  # the newest checkpoint damaged on disk
    _, _, info = load_run(run)
    assert info["step"] == 4 and info["path"].name == "checkpoint.prev.safetensors"
    assert "previous good checkpoint" in capsys.readouterr().err
    assert sample_main([str(run), "--max-new-tokens", "4", "--json"]) == 0
    out = capsys.readouterr()
    assert len(json.loads(out.out)) == 1 and "previous good checkpoint" in out.err
    ck.unlink()  # missing altogether
    assert load_run(run)[2]["step"] == 4
    (run / "checkpoint.prev.safetensors").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="previous checkpoint is unusable too"):
        load_run(run)


def test_a_checkpoint_copied_from_another_run_is_refused_naming_fields(runs, tmp_path, capsys):
    run = _copy(runs, "a", tmp_path)
    for name in ("checkpoint.safetensors", "checkpoint.prev.safetensors"):
        shutil.copy(runs / "b" / name, run / name)
    with pytest.raises(CheckpointMismatchError, match=r"another run: .*train.lr.*train.seed"):
        load_run(run)
    assert eval_main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.lr: 0.01 (checkpoint) != 0.003 (run)" in err
    # train --resume refuses it as well, and does not fall back to another checkpoint silently
    corpus = Corpus.from_text(TEXT, val_fraction=0.1)
    (run / "summary.json").unlink()
    with pytest.raises(CheckpointMismatchError, match="train.seed"):
        train(tiny(run, resume=True, steps=8), corpus=corpus)
    # an explicit --checkpoint may come from another run of the same model
    assert load_run(runs / "a", checkpoint=runs / "b" / "checkpoint.safetensors")[2]["step"] == 8


def test_eval_of_a_tampered_config_json_is_a_clear_error(runs, tmp_path, capsys):
    run = _copy(runs, "a", tmp_path)
    record = json.loads((run / "config.json").read_text())
    for edit, words in (
        (lambda r: r["model"].update(n_layer=-1), "n_layer"),
        (lambda r: r["train"].update(lr="fast"), "lr: expected a float"),
        (lambda r: r["train"].update(grad_clip=float("nan")), "grad_clip"),
        (lambda r: r.update(model=[1]), "not a run's config.json"),
    ):
        bad = json.loads(json.dumps(record))
        edit(bad)
        (run / "config.json").write_text(json.dumps(bad))
        assert eval_main([str(run)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and "config.json" in err, err
    (run / "config.json").write_text("{not json")
    assert eval_main([str(run)]) == 2 and "JSONDecodeError" in capsys.readouterr().err


def test_split_windows_score_every_token_once_and_the_whole_split_loss_is_their_mean():
    import numpy as np
    import torch

    from attention_residuals.model import GPT, GPTConfig
    from attention_residuals.training.data import split_windows
    from attention_residuals.training.loop import split_loss

    tokens = np.arange(1, 52, dtype=np.int64) % 256  # 51 tokens: 6 windows of 8, 2 left over
    batches = list(split_windows(tokens, 4, 8))
    assert [x.shape[0] for x, _ in batches] == [4, 2]
    targets = torch.cat([y for _, y in batches]).flatten()
    assert targets.tolist() == list(range(2, 50))  # each once, in order: not the first, not the tail
    assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in batches)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        next(split_windows(tokens[:8], 4, 8))

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, n_layer=1, n_head=2, d_model=16, seq_len=8))
    got = split_loss(model, tokens, batch_size=4, seq_len=8)
    x = torch.cat([x for x, _ in batches])
    per_token = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), targets, reduction="none")
    assert got["tokens"] == 48 and got["windows"] == 6
    assert got["loss"] == pytest.approx(per_token.mean().item(), rel=1e-6)
    window_means = per_token.view(6, 8).mean(1).double()
    assert got["se"] == pytest.approx((window_means.std() / 6**0.5).item(), rel=1e-4)  # float32 CE
    # the batch size changes nothing but the grouping
    assert split_loss(model, tokens, batch_size=5, seq_len=8)["loss"] == pytest.approx(got["loss"], rel=1e-6)


def test_eval_whole_scores_the_split_and_a_run_with_final_eval_split_records_it(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT)
    summary = train(tiny(tmp_path / "r", data=str(text), eot="off", final_eval="split"))
    split = summary["split_val"]
    assert split["tokens"] % 16 == 0 and split["windows"] == split["tokens"] // 16 and split["se"] > 0
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["split_val"] == split
    assert eval_main([str(tmp_path / "r"), "--whole"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["windows"] == "whole split, disjoint" and out["tokens"] == split["tokens"]
    assert out["split_tokens"] - out["tokens"] <= 16 and out["corpus_matches_run"]
    assert out["loss"] == pytest.approx(split["loss"], rel=1e-6)
    assert out["loss_se"] == pytest.approx(split["se"], rel=1e-6)
    assert eval_main([str(tmp_path / "r"), "--whole", "--batches", "3"]) == 2
    assert "--whole scores the whole split" in capsys.readouterr().err
    # the default (windows) leaves the summary as it was
    assert "split_val" not in train(tiny(tmp_path / "w", data=str(text), eot="off"))
