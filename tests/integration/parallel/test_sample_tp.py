"""`attnres sample --tp N` / `--cp N` under a launcher: the same text as one process."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from attention_residuals.parallel import spawn
from attention_residuals.training import make_config, train
from attention_residuals.training.data import Corpus
from attention_residuals.training.sample import main as sample_main

TEXT = "".join(f"def g{i}(y):\n    return y * {i % 13}\n\n" for i in range(300))


@pytest.fixture(scope="module", params=["block", "full"])
def run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / request.param
    cfg = make_config(
        n_layer=2,
        n_head=2,
        d_model=16,
        seq_len=32,
        batch_size=4,
        steps=4,
        warmup=1,
        eval_interval=4,
        eval_batches=1,
        progress=False,
        residual=request.param,
        block_size=2,
        out=str(out),
    )
    train(cfg, corpus=Corpus.from_text(TEXT, val_fraction=0.1))
    return out


def _sample(rank, world, argv):
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        rc = sample_main(argv)
    return rc, buf.getvalue(), err.getvalue()


@pytest.mark.parametrize("prompt, chunk", [("def g1(", None), ("return y", ["--prefill-chunk", "4"])])
@pytest.mark.parametrize("kind", ["--tp", "--cp"])
def test_sample_parallel_prints_what_one_process_prints(run, prompt, chunk, kind):
    argv = [str(run), "--prompt", prompt, "--max-new-tokens", "12", "--temperature", "0", "--json"]
    rc, alone, _ = _sample(0, 1, argv)
    assert rc == 0
    results = spawn(_sample, 2, argv + [kind, "2"] + (chunk or []), timeout_s=120, launcher=True)
    (rc0, out0, err0), (rc1, out1, _) = results
    assert rc0 == rc1 == 0 and out1 == ""  # rank 0 prints
    assert json.loads(out0) == json.loads(alone)
    if kind == "--tp":
        assert "tensor-parallel over 2 ranks (layer weights and KV cache split by head" in err0
    else:
        prefill = "sequence-sharded block-state prefill" if run.name == "block" else "replicated prefill"
        assert f"context-parallel over 2 ranks: {prefill}, KV cache sharded by token" in err0


def test_sample_tp_refuses_what_cannot_run(run, capsys):
    for kind in ("--tp", "--cp"):
        assert sample_main([str(run), kind, "2"]) == 2  # not launched
        err = capsys.readouterr().err
        assert "needs world_size=2" in err and "torchrun --nproc-per-node 2" in err
    for argv, message in (
        (["--tp", "0"], "--tp: expected >= 1"),
        (["--cp", "0"], "--cp: expected >= 1"),
        (["--tp", "2", "--cp", "2"], "--tp 2 and --cp 2: one kind of parallelism at a time"),
        (["--cp", "2", "--prefill-chunk", "3"], "--prefill-chunk: expected a multiple of --cp 2"),
        (["--cp", "2", "--prefill-chunk", "1"], "--prefill-chunk: expected >= 2"),
        (["--tp", "2", "--prefill-chunk", "0"], "--prefill-chunk: expected >= 1"),
    ):
        with pytest.raises(SystemExit) as exc:
            sample_main([str(run)] + argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err
