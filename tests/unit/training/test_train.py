"""Training loop: every rule trains, exact resume, run-directory rules, optimizers and schedules."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import pytest
import torch
from testkit import LEARNING_RUN, tiny_config

from attention_residuals import GPT, GPTConfig
from attention_residuals.connections import RESIDUALS, ResidualConfig
from attention_residuals.training import (
    ConfigMismatchError,
    RunError,
    TrainConfig,
    command_line,
    config_from_args,
    is_done,
    make_config,
    read_metrics,
    train,
)
from attention_residuals.training.checkpoint import CheckpointError, read_checkpoint
from attention_residuals.training.data import Corpus
from attention_residuals.training.optim import LRSchedule, build_optimizer, split_params

TEXT = "".join(f"def f{i}(x):\n    return x + {i % 17}\n\n" for i in range(400))


@pytest.fixture(scope="module")
def corpus():
    return Corpus.from_text(TEXT, val_fraction=0.1)


def tiny(out, **kw):
    return tiny_config(out, **{**LEARNING_RUN, **kw})


# every rule of the report's ablation table; tiny models: L = 4 sublayers
VARIANTS = [dict(residual=r) for r in RESIDUALS] + [
    dict(residual="block", n_blocks=2),
    dict(residual="full", query="input"),
    dict(residual="full", normalize="sigmoid"),
    dict(residual="full", depth_heads=2),
    dict(residual="full", key_norm=False),
    dict(residual="block", block_size=2, key_norm=False),
    dict(residual="block", block_size=3),  # L = 4 not divisible by S: the last partial sum is the last block
    dict(residual="swa", window=2),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={v[k]}" for k in v))
def test_every_rule_trains(tmp_path, corpus, variant):
    s = train(tiny(tmp_path / "run", steps=30, eval_interval=30, lr=1e-2, **variant), corpus=corpus)
    rows = read_metrics(tmp_path / "run")
    first = next(r for r in rows if r["train_loss"] is not None)["train_loss"]
    assert s["done"] and s["step"] == 30
    assert s["final_train_loss"] < first - 0.8, (first, s["final_train_loss"])
    assert s["final_val_loss"] < rows[0]["val_loss"] - 0.8


def test_run_dir_layout_and_metrics(tmp_path, corpus):
    s = train(tiny(tmp_path / "r"), corpus=corpus)
    names = {p.name for p in (tmp_path / "r").iterdir()}
    assert {"config.json", "metrics.jsonl", "checkpoint.safetensors", "summary.json"} <= names
    rows = read_metrics(tmp_path / "r")
    assert [r["step"] for r in rows] == [0, 5, 10, 15, 20]
    for r in rows:
        assert {"step", "train_loss", "val_loss", "lr", "tokens", "tokens_per_s", "wall_s"} <= set(r)
    assert (
        rows[-1]["tokens"] == 20 * 8 * 32 and rows[2]["val_loss"] is not None and rows[1]["val_loss"] is None
    )
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    assert (
        cfg["model"]["d_model"] == 32
        and cfg["train"]["steps"] == 20
        and cfg["data"]["sha256"] == corpus.sha256
    )
    assert cfg["command"].startswith("attnres train ") and "--d-model 32" in cfg["command"]
    assert s["done"] and is_done(tmp_path / "r") and s["params"] > 0 and s["tokens_per_s"] > 0
    assert read_checkpoint(tmp_path / "r" / "checkpoint.safetensors")[1]["step"] == 20


@pytest.mark.parametrize("optimizer,schedule", [("adamw", "cosine"), ("muon", "wsd")])
def test_resume_is_exact(tmp_path, corpus, optimizer, schedule):
    kw = dict(optimizer=optimizer, schedule=schedule, residual="block", n_blocks=2, steps=20)
    train(tiny(tmp_path / "once", **kw), corpus=corpus)
    half = train(tiny(tmp_path / "twice", stop_at=10, **kw), corpus=corpus)
    assert not half["done"] and half["step"] == 10 and not is_done(tmp_path / "twice")
    again = train(tiny(tmp_path / "twice", resume=True, **kw), corpus=corpus)
    assert again["done"] and again["step"] == 20
    a, b = read_metrics(tmp_path / "once"), read_metrics(tmp_path / "twice")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert [(r["train_loss"], r["val_loss"], r["lr"], r["tokens"]) for r in a] == [
        (r["train_loss"], r["val_loss"], r["lr"], r["tokens"]) for r in b
    ]  # bit-for-bit
    wa = read_checkpoint(tmp_path / "once" / "checkpoint.safetensors")[0]
    wb = read_checkpoint(tmp_path / "twice" / "checkpoint.safetensors")[0]
    assert all(torch.equal(wa[k], wb[k]) for k in wa if k.startswith("model/"))


def test_resume_of_a_run_recorded_with_flat_rule_options(tmp_path, corpus):
    """config.json written before the residual config was nested ("residual": "block" beside
    "n_blocks" and "heads") resumes: its identity is read through GPTConfig.from_dict."""
    kw = dict(residual="block", n_blocks=2, depth_heads=2, steps=12)
    train(tiny(tmp_path / "once", **kw), corpus=corpus)
    train(tiny(tmp_path / "old", stop_at=6, **kw), corpus=corpus)
    path = tmp_path / "old" / "config.json"
    record = json.loads(path.read_text())
    model = dict(record["model"])
    rule = model.pop("residual")
    flat = {
        "residual": rule.pop("rule"),
        **{("heads" if k == "depth_heads" else k): v for k, v in rule.items() if k != "key_norm_gain"},
    }
    record["model"] = {**model, **flat}
    path.write_text(json.dumps(record))
    again = train(tiny(tmp_path / "old", resume=True, **kw), corpus=corpus)
    assert again["done"] and again["final_val_loss"] == read_metrics(tmp_path / "once")[-1]["val_loss"]


def test_resume_with_other_config_lists_fields(tmp_path, corpus):
    train(tiny(tmp_path / "r", stop_at=5), corpus=corpus)
    with pytest.raises(ConfigMismatchError) as e:
        train(tiny(tmp_path / "r", resume=True, d_model=64, lr=1e-2), corpus=corpus)
    msg = str(e.value)
    assert "model.d_model" in msg and "train.lr" in msg and "config.json" in msg
    other = Corpus.from_text(TEXT.replace("return", "yield"), val_fraction=0.1)
    with pytest.raises(ConfigMismatchError, match="data.sha256"):
        train(tiny(tmp_path / "r", resume=True), corpus=other)


def test_finished_run_dir_rules(tmp_path, corpus):
    out = tmp_path / "r"
    train(tiny(out, steps=10), corpus=corpus)
    with pytest.raises(RunError, match="--resume.*--overwrite"):
        train(tiny(out, steps=10), corpus=corpus)
    ck = out / "checkpoint.safetensors"
    before = ck.stat().st_mtime_ns
    s = train(tiny(out, steps=10, resume=True), corpus=corpus)  # a finished run is skipped
    assert s["done"] and ck.stat().st_mtime_ns == before
    s = train(tiny(out, steps=10, overwrite=True, seed=1), corpus=corpus)
    assert s["done"] and json.loads((out / "config.json").read_text())["train"]["seed"] == 1


def test_resume_falls_back_to_previous_checkpoint(tmp_path, corpus):
    out = tmp_path / "r"
    train(tiny(out, stop_at=10, eval_interval=5), corpus=corpus)  # checkpoints at 5 and 10
    ck = out / "checkpoint.safetensors"
    ck.write_bytes(ck.read_bytes()[:1000])  # newest checkpoint truncated on disk
    s = train(tiny(out, resume=True, eval_interval=5), corpus=corpus)
    assert s["done"]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 5, 10, 15, 20]  # rows past step 5 were rewritten once
    # both checkpoints bad -> a clear error naming the files
    train(tiny(tmp_path / "b", stop_at=10, eval_interval=5), corpus=corpus)
    for name in ("checkpoint.safetensors", "checkpoint.prev.safetensors"):
        (tmp_path / "b" / name).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="checkpoint.safetensors"):
        train(tiny(tmp_path / "b", resume=True, eval_interval=5), corpus=corpus)


def test_bad_configs_raise_naming_the_field(tmp_path, corpus):
    with pytest.raises(ValueError, match="residual"):
        train(tiny(tmp_path / "a", residual="nope"), corpus=corpus)
    with pytest.raises(ValueError, match="block_size"):
        train(tiny(tmp_path / "b", residual="block", block_size=99), corpus=corpus)  # L = 4
    with pytest.raises(ValueError, match="seq_len"):
        train(tiny(tmp_path / "c", seq_len=10_000), corpus=corpus)
    with pytest.raises(ValueError, match="min_lr"):
        train(tiny(tmp_path / "d", min_lr=1.0), corpus=corpus)
    with pytest.raises(TypeError, match="unknown config field"):
        make_config(no_such_field=1)
    assert not (tmp_path / "a").exists()


def test_config_routing_roundtrip_and_command_line(tmp_path):
    cfg = make_config(residual="block", n_blocks=4, steps=7, lr=1e-3, out=str(tmp_path))
    assert cfg.model.residual == ResidualConfig("block", n_blocks=4) and cfg.steps == 7
    back = TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg
    cmd = command_line(cfg)
    assert "--residual block" in cmd and "--n-blocks 4" in cmd and "--steps 7" in cmd and "--out" in cmd
    parsed = config_from_args(cmd.split()[2:])
    assert parsed.identity() == cfg.identity()
    parsed = config_from_args(
        ["--residual", "full", "--no-key-norm", "--block-size", "none", "--stop-at", "3"]
    )
    assert parsed.model.residual == ResidualConfig("full", key_norm=False) and parsed.stop_at == 3


def test_param_groups_and_schedules():
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8, residual="full", query="input"))
    split = split_params(model).names()
    assert all(n.startswith("layers.") for n in split["matrices"]) and split["matrices"]
    assert set(split["decay"]) == {"embed.weight", "lm_head.weight"}
    assert any(n.startswith("residual.") for n in split["no_decay"])
    assert all(n.startswith("residual.") or "norm" in n for n in split["no_decay"])
    opt = build_optimizer(model, "adamw", weight_decay=0.1)
    decays = {n: g["weight_decay"] for g in opt.param_groups for n in g["param_names"]}
    assert decays["residual.queries"] == 0.0 and decays["embed.weight"] == 0.1
    cos = LRSchedule("cosine", steps=100, warmup=10, min_ratio=0.1)
    assert cos(0) == pytest.approx(0.1) and cos(9) == 1.0 and cos(99) == pytest.approx(0.1)
    assert all(cos(i) >= cos(i + 1) for i in range(10, 99))
    wsd = LRSchedule("wsd", steps=100, warmup=10, min_ratio=0.0, decay_frac=0.2)
    assert wsd(50) == 1.0 and wsd(79) == 1.0 and wsd(80) < 1.0 and wsd(99) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="schedule"):
        LRSchedule("linear", steps=10)


# --------------------------------------------------------------------------- the command line's input


def test_config_file_flat_or_sections_and_its_errors(tmp_path, capsys):
    from attention_residuals import cli
    from attention_residuals.training import read_config

    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"d_model": 48, "n_layer": 3, "steps": 7}))
    cfg = config_from_args(["--config", str(flat), "--steps", "9"])
    assert cfg.model.d_model == 48 and cfg.model.n_layer == 3 and cfg.steps == 9  # flags override the file
    run_like = tmp_path / "run.json"
    run_like.write_text(
        json.dumps({"format": 1, **make_config(d_model=40).to_dict(), "data": {}, "command": "x"})
    )
    assert config_from_args(["--config", str(run_like)]).model.d_model == 40
    cases = [
        ("missing.json", None, "no such file"),
        ("bad.json", "{not json", "not a JSON file"),
        ("list.json", "[1, 2]", "expected a JSON object"),
        ("unknown.json", '{"d_model": 32, "no_such_field": 1}', "no_such_field"),
        ("section.json", '{"model": {"d_model": 32}, "extra": {}}', "extra"),
        ("lr.json", '{"lr": "fast"}', "lr: expected a float"),
        ("bool.json", '{"key_norm": "false"}', "key_norm: expected a bool"),
        ("steps.json", '{"steps": 10.5}', "steps: expected an int"),
    ]
    for name, text, words in cases:
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        rc = cli.main(["train", "--config", str(path), "--out", str(tmp_path / "o"), "--no-progress"])
        err = capsys.readouterr().err
        assert rc == 2 and words in err and "Traceback" not in err, (name, err)
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="bad.json"):
        read_config(tmp_path / "bad.json")


def test_bad_device_names_the_argument():
    from attention_residuals.training import resolve_device

    with pytest.raises(ValueError, match="device: expected cpu, cuda, cuda:N or auto, got 'tpu'"):
        resolve_device("tpu")


def test_run_records_absolute_paths(tmp_path, monkeypatch, capsys):
    """A run trained on a relative --data path is evaluated and resumed from anywhere (byte tokens
    with the end-of-text id: vocab 257)."""
    from attention_residuals import cli

    work = tmp_path / "work"
    work.mkdir()
    (work / "corpus.txt").write_text(TEXT)
    monkeypatch.chdir(work)
    cfg = tiny(
        "run",
        steps=6,
        eval_interval=3,
        stop_at=3,
        data="corpus.txt",
        cache_dir=str(tmp_path / "cache"),
        vocab_size=257,
    )
    train(cfg)
    record = json.loads((work / "run" / "config.json").read_text())
    assert record["train"]["data"] == str(work / "corpus.txt")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["eval", str(work / "run"), "--cache-dir", str(tmp_path / "cache")]) == 0
    assert json.loads(capsys.readouterr().out)["corpus_matches_run"] is True
    done = train(
        tiny(
            work / "run",
            steps=6,
            eval_interval=3,
            data=str(work / "corpus.txt"),
            resume=True,
            cache_dir=str(tmp_path / "cache"),
            vocab_size=257,
        )
    )
    assert done["done"]
    # a run recorded with a relative path (before paths were made absolute) resumes from its folder
    old = tmp_path / "old"
    monkeypatch.chdir(work)
    train(
        tiny(
            old,
            steps=6,
            eval_interval=3,
            stop_at=3,
            data="corpus.txt",
            cache_dir=str(tmp_path / "cache"),
            vocab_size=257,
        )
    )
    record = json.loads((old / "config.json").read_text())
    record["train"]["data"] = "corpus.txt"
    (old / "config.json").write_text(json.dumps(record))
    assert train(
        tiny(
            old,
            steps=6,
            eval_interval=3,
            data="corpus.txt",
            resume=True,
            cache_dir=str(tmp_path / "cache"),
            vocab_size=257,
        )
    )["done"]


def test_eval_batch_arguments_are_checked(tmp_path, corpus, capsys):
    from attention_residuals import cli

    train(tiny(tmp_path / "r", steps=2, eval_interval=2), corpus=corpus)
    for flag, value in (("--batches", "0"), ("--batches", "-3"), ("--batch-size", "0")):
        assert cli.main(["eval", str(tmp_path / "r"), flag, value]) == 2
        err = capsys.readouterr().err
        assert flag[2:].replace("-", "_") in err and "positive integer" in err


def test_ctrl_c_stops_at_a_step_boundary_with_a_checkpoint(tmp_path, corpus, monkeypatch):
    """The first Ctrl-C finishes the step, checkpoints and stops (exit 130 on the command line);
    --resume then continues exactly as if the run had never stopped."""
    import os
    import signal

    from attention_residuals.training import loop as train_module

    kw = dict(residual="block", n_blocks=2, steps=20, grad_accum=2)
    train(tiny(tmp_path / "once", **kw), corpus=corpus)
    real = train_module.get_batch

    def interrupting(*args, step, **kwargs):
        if step == 2 * 7 + 1:  # the second micro-batch of step 7 (0-based): mid-step
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, step=step, **kwargs)

    monkeypatch.setattr(train_module, "get_batch", interrupting)
    half = train(tiny(tmp_path / "twice", **kw), corpus=corpus)
    assert half["interrupted"] and half["step"] == 8 and not half["done"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
    monkeypatch.setattr(train_module, "get_batch", real)
    assert read_checkpoint(tmp_path / "twice" / "checkpoint.safetensors")[1]["step"] == 8
    again = train(tiny(tmp_path / "twice", resume=True, **kw), corpus=corpus)
    assert again["done"] and not again["interrupted"]
    a, b = read_metrics(tmp_path / "once"), read_metrics(tmp_path / "twice")
    assert [(r["step"], r["train_loss"], r["val_loss"]) for r in a] == [
        (r["step"], r["train_loss"], r["val_loss"]) for r in b
    ]


# --------------------------------------------------------------------------- flat options over nested configs


@dataclass(frozen=True)
class _Rule:
    """A made-up nested, frozen sub-config (as GPTConfig.residual will be): its rule is ``--residual``."""

    rule: str = field(
        default="plain", metadata={"help": "mixing rule", "choices": ("plain", "block"), "flag": "--residual"}
    )
    n_blocks: int | None = field(default=None, metadata={"help": "number of blocks"})
    key_norm: bool = field(default=True, metadata={"help": "normalise the keys"})

    def __post_init__(self):  # options of another rule are refused: changes must land at once
        if self.n_blocks is not None and self.rule != "block":
            raise ValueError("n_blocks: only with rule 'block'")


@dataclass
class _Net:
    width: int = field(default=8, metadata={"help": "width"})
    residual: _Rule = field(default_factory=_Rule)


@dataclass
class _Outer:
    model: _Net = field(default_factory=_Net)
    steps: int = field(default=10, metadata={"help": "steps"})
    resume: bool = field(default=False, metadata={"help": "resume", "switch": True})


def test_nested_dataclasses_get_flat_flags_and_are_rebuilt():
    import argparse

    from attention_residuals.training.args import add_flags, to_flags
    from attention_residuals.training.config import check_field_types, flat_fields, flat_values, replace_flat

    assert [(ff.name, ff.path) for ff in flat_fields(_Outer)] == [
        ("width", ("model", "width")),
        ("residual", ("model", "residual", "rule")),
        ("n_blocks", ("model", "residual", "n_blocks")),
        ("key_norm", ("model", "residual", "key_norm")),
        ("steps", ("steps",)),
        ("resume", ("resume",)),
    ]
    p = argparse.ArgumentParser()
    add_flags(p, _Outer)
    assert vars(p.parse_args([])) == {}  # only the flags given
    assert "--residual {plain,block}" in p.format_help() and "--no-key-norm" in p.format_help()
    ns = vars(
        p.parse_args(["--residual", "block", "--n-blocks", "4", "--no-key-norm", "--steps", "3", "--resume"])
    )
    cfg = replace_flat(_Outer(), **ns)
    want = _Outer(model=_Net(residual=_Rule("block", 4, False)), steps=3, resume=True)
    assert cfg == want and flat_values(cfg)["residual"] == "block"
    assert replace_flat(_Outer(), **vars(p.parse_args(to_flags(cfg)))) == cfg  # to_flags is the inverse
    assert (
        to_flags(_Outer()) == [] and to_flags(_Outer(), always=("resume",)) == []
    )  # an off switch has no flag
    with pytest.raises(SystemExit):
        p.parse_args(["--residual", "nope"])
    # a nested value given whole, then leaves on it; unknown names and wrong types are refused
    assert replace_flat(_Outer(), residual=_Rule("block"), n_blocks=2).model.residual == _Rule("block", 2)
    assert replace_flat(_Outer(), model=_Net(width=3), n_blocks=None).model == _Net(width=3)
    with pytest.raises(TypeError, match="unknown config field 'depth'"):
        replace_flat(_Outer(), depth=2)
    with pytest.raises(ValueError, match="key_norm: expected a bool"):
        check_field_types(_Outer(model=_Net(residual=_Rule(key_norm="no"))))
    with pytest.raises(ValueError, match="residual: expected a _Rule"):
        check_field_types(_Outer(model=_Net(residual="block")))


@dataclass
class _Clash:
    steps: int = 1
    inner: _Outer = field(default_factory=_Outer)


def test_flat_names_must_be_unique_and_train_config_is_flat_as_before():
    from attention_residuals.training.config import flat_fields

    with pytest.raises(TypeError, match="share the flat name 'steps'"):
        flat_fields(_Clash)
    names = [ff.name for ff in flat_fields(TrainConfig)]
    model = [f.name for f in dataclasses.fields(GPTConfig) if f.name != "residual"]
    rule = ["residual"] + [f.name for f in dataclasses.fields(ResidualConfig)][1:]  # `rule` is --residual
    assert names[: len(model) + len(rule)] == model[:5] + rule + model[5:]  # the rule's options in place
    assert "model" not in names and "rule" not in names and names[-2:] == ["cache_dir", "trust_remote_code"]
    from attention_residuals import train as entry  # the `attnres train` / torchrun entry module

    assert entry.train is train and entry.make_config is make_config and callable(entry.main)


# --------------------------------------------------------------------------- --log-depth, --depth-lr-scale

DEPTH = {"residual": "block", "block_size": 2}  # a rule with depth weights and pseudo-queries


def test_log_depth_records_and_leaves_training_bit_identical(tmp_path, corpus):
    train(tiny(tmp_path / "plain", **DEPTH), corpus=corpus)
    train(tiny(tmp_path / "logged", log_depth=True, **DEPTH), corpus=corpus)
    plain, logged = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "logged")
    keys = ("step", "train_loss", "val_loss", "lr", "grad_norm")
    assert [[r.get(k) for k in keys] for r in plain] == [[r.get(k) for k in keys] for r in logged]
    wa = read_checkpoint(tmp_path / "plain" / "checkpoint.safetensors")[0]
    wb = read_checkpoint(tmp_path / "logged" / "checkpoint.safetensors")[0]
    assert all(torch.equal(wa[k], wb[k]) for k in wa if k.startswith(("model/", "optimizer/")))
    steps = {r["step"]: r.get("depth") for r in logged}
    assert steps[0] is None and all("depth" not in r for r in plain)
    for step in (5, 10, 15, 20):
        d = steps[step]
        assert d["param_rms"] > 0 and d["grad_rms"] > 0 and d["update_rms"] > 0
        assert ("entropy_ratio" in d) == (step % 10 == 0)  # the weights at evaluations only
    last = steps[20]
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
        (
            {"log_depth": False, "residual": "prenorm", "block_size": None, "depth_weight_decay": 0.1},
            "depth_weight_decay: residual='prenorm' has no depth-mixing parameters",
        ),
        ({"depth_lr_scale": 0.0}, "depth_lr_scale"),
        ({"depth_weight_decay": -0.1}, "depth_weight_decay"),
    ],
)
def test_log_depth_refusals_name_the_option(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        tiny(tmp_path / "r", **{**DEPTH, "log_depth": True, **kw}).validate()


def test_depth_lr_scale_speeds_the_queries_only(tmp_path, corpus):
    """At 10x the rate the queries move 10x further in the first step (Adam's first step from zero
    is lr * sign(grad)); every other weight is unchanged (the groups step independently)."""
    runs = {}
    for scale in (1.0, 10.0):
        out = tmp_path / f"s{scale:g}"
        train(
            tiny(out, steps=1, warmup=0, eval_interval=1, log_interval=1, depth_lr_scale=scale, **DEPTH),
            corpus=corpus,
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


def test_log_depth_of_a_rule_without_static_queries_writes_valid_json(tmp_path, corpus):
    train(tiny(tmp_path / "mix", residual="mixing", log_depth=True), corpus=corpus)
    rows = [r["depth"] for r in read_metrics(tmp_path / "mix") if "entropy_ratio" in r.get("depth", {})]
    assert rows and all(d["query_logit_scale"] is None for d in rows)
    assert "NaN" not in (tmp_path / "mix" / "metrics.jsonl").read_text()


def test_log_depth_rows_only_on_logged_steps(tmp_path, corpus):
    """The per-step statistics are taken only on the steps that write a row."""
    train(tiny(tmp_path / "r", log_depth=True, eval_interval=6, steps=12, **DEPTH), corpus=corpus)
    assert [r["step"] for r in read_metrics(tmp_path / "r") if "depth" in r] == [5, 6, 10, 12]


def test_compile_in_one_process_trains_as_eager(tmp_path, corpus):
    """`--compile` without a launcher (the default inductor backend, fullgraph) on Block AttnRes:
    the same losses as eager within float32 reassociation."""
    kw = {"residual": "block", "n_blocks": 2, "steps": 4, "eval_interval": 2, "log_interval": 1}
    eager = train(tiny_config(tmp_path / "eager", **kw), corpus=corpus)
    compiled = train(tiny_config(tmp_path / "compiled", compile=True, **kw), corpus=corpus)
    assert compiled["final_train_loss"] == pytest.approx(eager["final_train_loss"], abs=1e-4)
    assert compiled["final_val_loss"] == pytest.approx(eager["final_val_loss"], abs=1e-4)
