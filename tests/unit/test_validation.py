"""A table-driven sweep of bad inputs through every entry point: the ``attnres train`` / ``eval`` /
``sample`` command lines, a JSON config, and the library constructors (``GPTConfig``,
``ResidualConfig``, ``make_connection``, ``TrainConfig``, ``generate``).

Each bad input must end in a clear error — an exception (or, on the command line, exit status 2
and one line on stderr) naming the argument — before anything is written; never a traceback, a
NaN, a silent broadcast or a silently different run. A good input next to each table shows the
harness itself passes what it should.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from attention_residuals import GPT, GPTConfig, cli
from attention_residuals.connections import ResidualConfig, make_connection
from attention_residuals.training import TrainConfig, make_config
from attention_residuals.training.sample import generate_text

NAN, INF = float("nan"), float("inf")
BASE = [
    *("--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16", "--batch-size", "2"),
    *("--steps", "4", "--warmup", "1", "--eval-interval", "2", "--eval-batches", "1", "--no-progress"),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    (root / "c.txt").write_text("".join(f"print('row {i}')\n" for i in range(200)))
    return root


def run_cli(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse
        return int(e.code)


def assert_one_line_error(capsys, rc: int, *words: str) -> str:
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    assert err.count("\n") == 1 and "error:" in err and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)
    return err


# --------------------------------------------------------------------------- attnres train

# (flags, words the one-line error must hold)
TRAIN_FLAGS = [
    (["--steps", "0"], "steps"),
    (["--steps", "-1"], "steps"),
    (["--steps", "1.5"], "--steps"),
    (["--steps", "x"], "--steps"),
    (["--batch-size", "0"], "batch_size"),
    (["--grad-accum", "0"], "grad_accum"),
    (["--lr", "0"], "lr"),
    (["--lr", "-1"], "lr"),
    (["--lr", "nan"], "lr"),
    (["--lr", "inf"], "lr"),
    (["--min-lr", "-1"], "min_lr"),
    (["--min-lr", "nan"], "min_lr"),
    (["--min-lr", "1"], "min_lr"),
    (["--warmup", "-1"], "warmup"),
    (["--warmup", "100"], "warmup"),
    (["--schedule", "wsd", "--decay-frac", "2"], "decay_frac"),
    (["--decay-frac", "nan"], "decay_frac"),
    (["--weight-decay", "-0.1"], "weight_decay"),
    (["--weight-decay", "nan"], "weight_decay"),
    (["--beta1", "1"], "beta1"),
    (["--beta1", "-0.1"], "beta1"),
    (["--beta2", "nan"], "beta2"),
    (["--grad-clip", "nan"], "grad_clip"),  # silently disabled clipping before
    (["--grad-clip", "-1"], "grad_clip"),
    (["--grad-clip", "inf"], "grad_clip"),
    (["--seed", "-1"], "seed"),
    (["--seed", str(2**64)], "seed"),
    (["--seed", "1e3"], "--seed"),
    (["--val-fraction", "0"], "val_fraction"),
    (["--val-fraction", "1"], "val_fraction"),
    (["--val-fraction", "nan"], "val_fraction"),
    (["--eval-interval", "0"], "eval_interval"),
    (["--eval-batches", "0"], "eval_batches"),
    (["--log-interval", "0"], "log_interval"),
    (["--ckpt-interval", "-1"], "ckpt_interval"),
    (["--stop-at", "-1"], "stop_at"),
    (["--dtype", "float8"], "--dtype"),
    (["--optimizer", "sgd"], "--optimizer"),
    (["--schedule", "step"], "--schedule"),
    (["--residual", "nope"], "--residual"),
    (["--d-model", "0"], "d_model"),
    (["--d-model", "-8"], "d_model"),
    (["--n-layer", "0"], "n_layer"),
    (["--n-head", "3"], "n_head"),
    (["--n-head", "0"], "n_head"),
    (["--seq-len", "0"], "seq_len"),
    (["--vocab-size", "0"], "vocab_size"),
    (["--vocab-size", "100"], "vocab_size"),  # the byte corpus needs 256
    (["--mlp-hidden", "0"], "mlp_hidden"),
    (["--mlp-hidden", str(10**12)], "out of memory"),  # a raw allocator error before
    (["--rope-theta", "nan"], "rope_theta"),
    (["--norm-eps", "0"], "norm_eps"),
    (["--init-std", "-1"], "init_std"),
    (["--residual", "block", "--n-blocks", "0"], "n_blocks"),
    (["--residual", "block", "--n-blocks", "3"], "n_blocks"),  # L = 2
    (["--residual", "block", "--block-size", "99"], "block_size"),
    (["--residual", "full", "--depth-heads", "0"], "depth_heads"),
    (["--window", "2"], "window"),  # an option the rule does not read
    (["--no-key-norm"], "key_norm"),
    (["--device", "tpu"], "device"),
    (["--device", "cuda:7"], "device"),
    (["--resume", "--overwrite"], "resume"),
    (["--nope"], "--nope"),
    (["--data", "/nonexistent/corpus.txt"], "--data"),
    (["--tokenizer", "/nonexistent/tok"], "--tokenizer"),
    (["--config", "/nonexistent.json"], "--config"),
]
# JSON config files: (content, words)
TRAIN_CONFIGS = [
    ("{not json", "not a JSON file"),
    ("[1, 2]", "expected a JSON object"),
    ('{"grad_accum": "10"}', "grad_accum: expected an int"),
    ('{"grad_accum": true}', "grad_accum: expected an int"),  # a bool is no int
    ('{"lr": true}', "lr: expected a float"),
    ('{"key_norm": "false"}', "key_norm: expected a bool"),  # a string is no bool
    ('{"tie_embeddings": 1}', "tie_embeddings: expected a bool"),
    ('{"grad_clip": NaN}', "grad_clip"),
    ('{"lr": Infinity}', "lr"),
    ('{"no_such_field": 1}', "unknown config field"),
    ('{"model": {"mlp_hidden": -1}, "train": {}}', "mlp_hidden"),
    ('{"model": {}, "train": {"nope": 1}}', "unknown fields"),
    ('{"model": {}, "bogus": {}}', "unknown sections"),
]


def _train_argv(data, out, flags):
    return [
        "train",
        *BASE,
        "--data",
        str(data / "c.txt"),
        "--cache-dir",
        str(data / "cache"),
        "--out",
        str(out),
        *flags,
    ]


def test_train_harness_accepts_the_base_flags(tmp_path, data, capsys):
    assert run_cli(_train_argv(data, tmp_path / "ok", [])) == 0
    assert (tmp_path / "ok" / "summary.json").is_file()


@pytest.mark.parametrize(
    "flags,words", TRAIN_FLAGS, ids=lambda x: " ".join(x) if isinstance(x, list) else None
)
def test_train_rejects_bad_flags_before_writing(tmp_path, data, capsys, flags, words):
    if flags[:2] == ["--device", "cuda:7"] and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 GPUs")
    out = tmp_path / "run"
    assert_one_line_error(capsys, run_cli(_train_argv(data, out, flags)), words)
    assert not out.exists()


@pytest.mark.parametrize("content,words", TRAIN_CONFIGS)
def test_train_rejects_bad_config_files_before_writing(tmp_path, data, capsys, content, words):
    path = tmp_path / "cfg.json"
    path.write_text(content)
    out = tmp_path / "run"
    assert_one_line_error(capsys, run_cli(_train_argv(data, out, ["--config", str(path)])), words)
    assert not out.exists()


# --------------------------------------------------------------------------- library constructors

# (callable, exception type, words of the message)
CONSTRUCTORS = [
    *[
        (lambda kw=kw: GPT(GPTConfig(**kw)), ValueError, next(iter(kw)))
        for kw in (
            {"n_layer": 0},
            {"n_layer": -1},
            {"n_layer": True},
            {"n_layer": 1.0},
            {"n_layer": "2"},
            {"d_model": 0},
            {"d_model": True},
            {"n_head": 0},
            {"seq_len": 0},
            {"vocab_size": 0},
            {"vocab_size": 256.0},
            {"mlp_hidden": 0},
            {"rope_theta": NAN},
            {"rope_theta": INF},
            {"rope_theta": 0.0},
            {"rope_theta": "1e4"},
            {"norm_eps": NAN},
            {"norm_eps": 0.0},
            {"init_std": -0.02},
            {"tie_embeddings": "false"},
            {"tie_embeddings": 1},
        )
    ],
    (lambda: GPTConfig(residual="nope"), ValueError, "residual"),
    (lambda: GPTConfig(residual=3), ValueError, "residual"),
    (lambda: GPTConfig(heads=2), TypeError, "depth_heads"),
    (lambda: GPTConfig.from_dict({"d_model": 8, "bogus": 1}), ValueError, "unknown fields"),
    (lambda: ResidualConfig("nope"), ValueError, "residual"),
    (lambda: ResidualConfig("block", n_blocks=0), ValueError, "n_blocks"),
    (lambda: ResidualConfig("block", n_blocks=-1), ValueError, "n_blocks"),
    (lambda: ResidualConfig("block", n_blocks=True), ValueError, "n_blocks"),
    (lambda: ResidualConfig("block", n_blocks=2.0), ValueError, "n_blocks"),
    (lambda: ResidualConfig("block", block_size=0), ValueError, "block_size"),
    (lambda: ResidualConfig("block", block_size=2, n_blocks=2), ValueError, "block_size and n_blocks"),
    (lambda: ResidualConfig("full", depth_heads=0), ValueError, "depth_heads"),
    (lambda: ResidualConfig("full", key_norm="false"), ValueError, "key_norm"),
    (lambda: ResidualConfig("full", key_norm=1), ValueError, "key_norm"),
    (lambda: ResidualConfig("full", query="random"), ValueError, "query"),
    (lambda: ResidualConfig("full", normalize="relu"), ValueError, "normalize"),
    (lambda: ResidualConfig("prenorm", window=2), ValueError, "window"),
    (lambda: ResidualConfig("mhc", streams=0), ValueError, "streams"),
    (lambda: ResidualConfig("full", query_rank=4), ValueError, "query_rank"),
    (lambda: ResidualConfig("full", key_norm=False, key_norm_gain=True), ValueError, "key_norm_gain"),
    (lambda: ResidualConfig.from_dict({"rule": "full", "bogus": 1}), ValueError, "unknown fields"),
    (lambda: make_connection("nope", 4, 8), ValueError, "residual"),
    (lambda: make_connection("block", 4, 8, n_blocks=99), ValueError, "n_blocks"),
    (lambda: make_connection("block", 4, 8, block_size=9), ValueError, "block_size"),
    (lambda: make_connection("full", 4, 8, key_norm="false"), ValueError, "key_norm"),
    (lambda: make_connection("full", 4, 8, heads=2), TypeError, "depth_heads"),
    (lambda: make_connection("full", 4, 8, bogus=1), TypeError, "bogus"),
    *[
        (lambda kw=kw: make_config(**kw).validate(), ValueError, next(iter(kw)))
        for kw in (
            {"steps": True},
            {"steps": 1.5},
            {"lr": True},
            {"lr": NAN},
            {"lr": "fast"},
            {"grad_clip": NAN},
            {"grad_clip": False},
            {"beta2": 1.0},
            {"weight_decay": INF},
            {"seed": -1},
            {"seed": 0.5},
            {"progress": 1},
            {"resume": "yes"},
            {"out": None},
            {"out": ""},
            {"out": 3},
            {"data": 3},
            {"device": ""},
            {"stop_at": -2},
            {"val_fraction": 1.5},
            {"dtype": "float64"},
            {"optimizer": "sgd"},
        )
    ],
    (lambda: make_config(bogus=1), TypeError, "unknown config field"),
    (lambda: TrainConfig.from_dict({"train": {"bogus": 1}}), ValueError, "unknown fields"),
]
# make_connection's own geometry arguments (n_layers, d_model, eps)
CONNECTION_GEOMETRY = [
    {"n_layers": 0},
    {"n_layers": -1},
    {"n_layers": True},
    {"d_model": 0},
    {"d_model": -1},
    {"eps": NAN},
    {"eps": -1.0},
]


@pytest.mark.parametrize("make,exc,words", CONSTRUCTORS)
def test_constructors_reject_bad_values_naming_them(make, exc, words):
    with pytest.raises(exc) as e:
        make()
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_constructor_harness_accepts_good_values():
    GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8, residual="block", n_blocks=2))
    make_connection("full", 4, 8, key_norm=False)
    assert make_config(lr=1e-3, grad_clip=0, seed=2**62).validate().grad_clip == 0


@pytest.mark.parametrize("kw", CONNECTION_GEOMETRY, ids=str)
def test_make_connection_checks_its_geometry(kw):
    args = {"n_layers": 4, "d_model": 8, "eps": 1e-6, **kw}
    with pytest.raises(ValueError, match=next(iter(kw))):
        make_connection("full", **args)


# --------------------------------------------------------------------------- generate

GENERATE = [
    ({"temperature": -1.0}, "temperature"),  # sampled the least likely tokens before
    ({"temperature": NAN}, "temperature"),
    ({"temperature": INF}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ({"max_new_tokens": 100}, "max_new_tokens"),  # past seq_len
    ({"idx": torch.zeros(1, 2)}, "idx"),  # float ids
    ({"idx": torch.zeros(3, dtype=torch.long)}, "idx"),  # 1-D
    ({"idx": torch.full((1, 2), 999)}, "idx"),  # out of the vocabulary
    ({"idx": [[1, 2]]}, "idx"),
]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8)).eval()


@pytest.mark.parametrize("kw,words", GENERATE, ids=lambda x: str(x) if isinstance(x, dict) else None)
def test_generate_rejects_bad_arguments(model, kw, words):
    args = {"idx": torch.zeros(1, 2, dtype=torch.long), "max_new_tokens": 2, **kw}
    with pytest.raises((ValueError, TypeError)) as e:
        model.generate(**args)
    assert words in str(e.value), str(e.value)


def test_generate_harness_accepts_good_arguments(model):
    out = model.generate(torch.zeros(1, 2, dtype=torch.long), 3, temperature=0.5, top_k=5)
    assert out.shape == (1, 5) and model.generate(out, 0).shape == (1, 5)


@pytest.mark.parametrize(
    "kw,words",
    [({"num_samples": 0}, "num_samples"), ({"seed": -1}, "seed"), ({"temperature": NAN}, "temperature")],
)
def test_generate_text_rejects_bad_arguments(model, kw, words):
    with pytest.raises(ValueError, match=words):
        generate_text(model, "x", max_new_tokens=2, **kw)


# --------------------------------------------------------------------------- attnres eval / sample

EVAL_FLAGS = [
    (["--batches", "0"], "batches"),
    (["--batch-size", "-1"], "batch_size"),
    (["--batches", "x"], "--batches"),
    (["--split", "test"], "--split"),
    (["--device", "tpu"], "device"),
    (["--checkpoint", "/nonexistent.safetensors"], "does not exist"),
]
SAMPLE_FLAGS = [
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "inf"], "--temperature"),
    (["--top-k", "-3"], "--top-k"),
    (["--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--num-samples", "0"], "--num-samples"),
    (["--seed", "-1"], "--seed"),
    (["--tokenizer", "/nonexistent"], "--tokenizer"),
    (["--device", "cuda:7"], "device"),
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data):
    out = tmp_path_factory.mktemp("r") / "run"
    assert run_cli(_train_argv(data, out, [])) == 0
    return out


@pytest.mark.parametrize(
    "command,flags,words",
    [("eval", f, w) for f, w in EVAL_FLAGS] + [("sample", f, w) for f, w in SAMPLE_FLAGS],
    ids=lambda x: " ".join(x) if isinstance(x, list) else x,
)
def test_eval_and_sample_reject_bad_flags(run_dir, capsys, command, flags, words):
    if "cuda:7" in flags and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 GPUs")
    capsys.readouterr()
    assert_one_line_error(capsys, run_cli([command, str(run_dir), *flags]), words)


def test_eval_and_sample_harness_accept_good_flags(run_dir, capsys):
    assert run_cli(["eval", str(run_dir), "--batches", "1"]) == 0
    assert math.isfinite(json.loads(capsys.readouterr().out)["val_loss"])
    assert run_cli(["sample", str(run_dir), "--max-new-tokens", "3", "--temperature", "0", "--json"]) == 0
    assert "prefill, KV-cache decode" in capsys.readouterr().err  # sample says which schedule ran
    for missing in ("eval", "sample"):
        assert_one_line_error(
            capsys, run_cli([missing, str(run_dir.parent / "nowhere")]), "not a run directory"
        )


def table_sizes() -> dict[str, int]:
    """How many bad inputs each table tries (for the record)."""
    return {
        "train flags": len(TRAIN_FLAGS),
        "train config files": len(TRAIN_CONFIGS),
        "constructors": len(CONSTRUCTORS),
        "make_connection geometry": len(CONNECTION_GEOMETRY),
        "generate": len(GENERATE) + 3,
        "eval/sample flags": len(EVAL_FLAGS) + len(SAMPLE_FLAGS) + 2,
    }
