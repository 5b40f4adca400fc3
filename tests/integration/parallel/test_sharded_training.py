"""FSDP2 training (``--fsdp``) and pipeline-parallel training (``--pp-stages``) over gloo
processes equal the single-process run; their sharded checkpoints (torch.distributed.checkpoint)
resume exactly on another world size or layout, and are read by eval; damaged, foreign or planted
checkpoints are refused."""

import hashlib
import json
import os
import pickle
import re
import shutil
import time

import pytest
import torch
from testkit import PARALLEL_RUN, tiny_config

from attention_residuals.parallel import DistributedError, spawn
from attention_residuals.training import loop, read_metrics, train
from attention_residuals.training.checkpoint import CheckpointError, CheckpointMismatchError
from attention_residuals.training.data import Corpus
from attention_residuals.training.evaluate import load_run
from attention_residuals.training.loop import estimate_loss
from attention_residuals.training.sharded import DCP_DIR, DCP_PREV_DIR, MANIFEST

TEXT = "".join(f"def f{i}(x):\n    return x * {i % 13} + {i % 7}\n\n" for i in range(300))


def tiny(out, **kw):
    return tiny_config(out, **{**PARALLEL_RUN, **kw})


def corpus():
    return Corpus.from_text(TEXT, val_fraction=0.1)


def _train(rank, world, out, kw):
    torch.set_num_threads(1)
    return train(tiny(out, **kw), corpus=corpus())["final_train_loss"]


def rows(run):
    return [(r["step"], r["train_loss"], r["val_loss"]) for r in read_metrics(run)]


def assert_same_losses(a, b, rel=1e-5):
    ra, rb = rows(a), rows(b)
    assert [r[0] for r in ra] == [r[0] for r in rb]
    for (_, ta, va), (_, tb, vb) in zip(ra, rb, strict=True):
        assert ta == pytest.approx(tb, rel=rel, abs=1e-6) if ta is not None else tb is None
        assert va == pytest.approx(vb, rel=rel, abs=1e-6) if va is not None else vb is None


def weights_of(run):
    """The model weights of a run's newest checkpoint, whichever format (as ``eval`` loads it)."""
    return load_run(run)[0].state_dict()


def assert_same_weights(a, b, atol=1e-6):
    wa, wb = weights_of(a), weights_of(b)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=atol)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(tiny(out), corpus=corpus())
    finally:
        torch.set_num_threads(n)
    return out


@pytest.mark.parametrize(
    "extra",
    [{}, {"activation_checkpointing": True}, {"compile": True}],
    ids=["plain", "recompute", "compile"],
)
def test_fsdp_equals_single_process(tmp_path, single, extra):
    """2 ranks, FSDP2 per sublayer, gradient accumulation over 2 micro-batches (and with every
    sublayer recomputed in backward, or the model compiled by inductor): losses, gradients (through the updates they make) and final
    weights equal the single-process run's."""
    out = tmp_path / "fsdp"
    finals = spawn(_train, 2, str(out), {"fsdp": True, **extra}, timeout_s=180)
    assert finals[0] == finals[1]
    assert_same_losses(out, single)
    norms = [[r.get("grad_norm") for r in read_metrics(run)] for run in (out, single)]
    assert norms[0][1:] == pytest.approx(norms[1][1:], rel=1e-5)  # the total norm over the shards
    assert_same_weights(out, single)
    assert (out / DCP_DIR / MANIFEST).is_file() and not (out / "checkpoint.safetensors").exists()
    assert sorted(p.name for p in (out / DCP_DIR).iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        MANIFEST,
    ]
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2


@pytest.mark.parametrize(
    "rule",
    [
        {"residual": "prenorm", "block_size": None},
        {"residual": "full", "block_size": None},
        {"residual": "full", "depth_heads": 2, "block_size": None},
        {"residual": "block", "block_size": 2, "depth_heads": 2},
        {"residual": "block", "block_size": 4, "query": "input"},
        {"residual": "mhc", "block_size": None},
        {"residual": "denseformer", "block_size": None},
    ],
    ids=["prenorm", "full", "full-heads", "block-heads", "block-input-query", "mhc", "denseformer"],
)
def test_fsdp_equals_single_process_for_every_rule(tmp_path, rule):
    """The depth-mixing parameters of every rule (in the root group) sharded over 2 ranks: losses
    and final weights equal the single-process run's."""
    spawn(_train, 2, str(tmp_path / "fsdp"), {"fsdp": True, **rule}, timeout_s=180)
    _train(0, 1, str(tmp_path / "one"), rule)
    assert_same_losses(tmp_path / "fsdp", tmp_path / "one")
    # Adam turns float32 reduction-order differences in near-zero gradients into ~1e-6 steps
    # (1e-5: 0.05 % of what 6 steps at lr 3e-3 can move a weight). mHC's zero-initialised
    # projection has roundoff-level gradient entries whose sign Adam follows: one process on 1
    # and on 2 threads already differs there by 2.7e-4.
    atol = 1e-3 if rule["residual"] == "mhc" else 1e-5
    assert_same_weights(tmp_path / "fsdp", tmp_path / "one", atol=atol)


@pytest.mark.parametrize("parallel", [{"fsdp": True}, {"pp_stages": 2}], ids=["fsdp", "pp"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_tracks_the_single_process_run(tmp_path, dtype, parallel):
    """FSDP's mixed-precision policy (parameters gathered in ``dtype``, float32 master weights and
    gradient reduction) or a 2-stage pipeline, under autocast (float16 with its gradient scaler,
    the overflow check agreed by every rank): the training losses follow the single-process
    autocast run's within bf16/fp16 rounding."""
    spawn(_train, 2, str(tmp_path / "fsdp"), {**parallel, "dtype": dtype}, timeout_s=180)
    _train(0, 1, str(tmp_path / "one"), {"dtype": dtype})
    got, want = ([r["train_loss"] for r in read_metrics(tmp_path / k)][1:] for k in ("fsdp", "one"))
    assert len(got) == 6 and got == pytest.approx(want, rel=2e-3)
    assert json.loads((tmp_path / "fsdp" / "config.json").read_text())["train"]["dtype"] == dtype


def test_sharded_checkpoint_resumes_on_other_world_sizes(tmp_path, single):
    """FSDP on 2 ranks to step 3, FSDP on 4 ranks to step 5, then one process without FSDP:
    the same run as the uninterrupted one (DCP reshards on load)."""
    out = tmp_path / "run"
    spawn(_train, 2, str(out), {"fsdp": True, "stop_at": 3}, timeout_s=180)
    assert (out / DCP_DIR).is_dir() and not (out / DCP_PREV_DIR).exists()
    spawn(_train, 4, str(out), {"fsdp": True, "stop_at": 5, "resume": True}, timeout_s=180)
    assert (out / DCP_PREV_DIR).is_dir()  # the step-3 checkpoint kept as the previous one
    train(tiny(out, resume=True), corpus=corpus())  # single process, plain model, single-file
    assert_same_losses(out, single)
    assert_same_weights(out, single)


def test_eval_and_sample_read_a_sharded_run(tmp_path, single):
    """``attnres eval`` / ``sample`` / ``export-hf`` (one process, no process group) load the newest sharded
    checkpoint into a plain model: the same weights and loss as the single-process run's."""
    out = tmp_path / "fsdp"
    spawn(_train, 2, str(out), {"fsdp": True}, timeout_s=180)
    _, _, info = load_run(out)
    assert info["path"] == out / DCP_DIR and info["step"] == 6
    assert_same_weights(out, single)
    val = corpus().val
    got, want = (
        estimate_loss(load_run(r)[0], val, n_batches=2, batch_size=4, seq_len=16) for r in (out, single)
    )
    assert got == pytest.approx(want, rel=1e-5)


# --------------------------------------------------------------------------- faults


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """A 2-rank FSDP run stopped at step 5: checkpoint.dcp (step 5) and checkpoint.prev.dcp (3)."""
    out = tmp_path_factory.mktemp("sharded") / "run"
    spawn(_train, 2, str(out), {"fsdp": True, "stop_at": 3}, timeout_s=180)
    spawn(_train, 2, str(out), {"fsdp": True, "stop_at": 5, "resume": True}, timeout_s=180)
    return out


def copy_of(run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run, dst, symlinks=True)
    return dst


def finish(out, capsys):
    """Resume ``out`` in one process to the end; the warnings it printed."""
    capsys.readouterr()
    train(tiny(out, resume=True), corpus=corpus())
    return capsys.readouterr().err


def test_a_damaged_shard_falls_back_to_the_previous_checkpoint(tmp_path, single, sharded_run, capsys):
    out = copy_of(sharded_run, tmp_path)
    shard = out / DCP_DIR / "__1_0.distcp"
    blob = bytearray(shard.read_bytes())
    blob[len(blob) // 2] ^= 0x01  # one bit
    shard.write_bytes(bytes(blob))
    err = finish(out, capsys)
    assert "__1_0.distcp: sha256 differs" in err and "loaded the previous good checkpoint" in err
    assert "resuming at step 3/6" in err
    assert_same_losses(out, single)


def test_a_write_killed_between_the_renames_resumes_from_the_previous_one(
    tmp_path, single, sharded_run, capsys
):
    """The state a kill leaves after ``checkpoint.dcp`` became the previous one and before the
    new folder took its name: the half-done folder is swept, the previous checkpoint resumes."""
    out = copy_of(sharded_run, tmp_path)
    shutil.rmtree(out / DCP_PREV_DIR)
    os.replace(out / DCP_DIR, out / DCP_PREV_DIR)
    (out / f".{DCP_DIR}.tmp-save").mkdir()
    (out / f".{DCP_DIR}.tmp-save" / "__0_0.distcp").write_bytes(b"half")
    err = finish(out, capsys)
    assert "resuming at step 5/6" in err and "tmp-save" in err  # swept, and said so
    assert not (out / f".{DCP_DIR}.tmp-save").exists()
    assert_same_losses(out, single)


def test_every_sharded_checkpoint_damaged_is_a_named_error(tmp_path, sharded_run):
    out = copy_of(sharded_run, tmp_path)
    (out / DCP_DIR / "__0_0.distcp").write_bytes(b"")
    (out / DCP_PREV_DIR / MANIFEST).write_text("{}")
    with pytest.raises(CheckpointError, match=r"__0_0.distcp.*the previous checkpoint is unusable too"):
        train(tiny(out, resume=True), corpus=corpus())


def test_a_sharded_checkpoint_of_another_run_is_refused(tmp_path, sharded_run):
    out = copy_of(sharded_run, tmp_path)
    other = tmp_path / "other"
    spawn(_train, 2, str(other), {"fsdp": True, "stop_at": 3, "lr": 1e-3}, timeout_s=180)
    shutil.rmtree(out / DCP_DIR)
    shutil.copytree(other / DCP_DIR, out / DCP_DIR)
    with pytest.raises(CheckpointMismatchError, match="lr"):
        train(tiny(out, resume=True), corpus=corpus())


class _Planted:
    """Unpickling this runs code (makes a folder): what a planted DCP index would do to a plain
    ``pickle.load``."""

    def __init__(self, mark):
        self.mark = str(mark)

    def __reduce__(self):
        return (os.mkdir, (self.mark,))


def test_a_planted_index_runs_no_code(tmp_path, sharded_run):
    """A ``.metadata`` pickle that would run code, with a manifest recomputed to match it (an
    attacker controls the whole folder): refused by the restricted unpickler, nothing runs."""
    out = copy_of(sharded_run, tmp_path)
    folder, mark = out / DCP_DIR, tmp_path / "code-ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_Planted(mark)))
    manifest = json.loads((folder / MANIFEST).read_text())
    blob = (folder / ".metadata").read_bytes()
    manifest["files"][".metadata"] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    body = {k: v for k, v in manifest.items() if k != "sha256_manifest"}
    manifest["sha256_manifest"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    (folder / MANIFEST).write_text(json.dumps(manifest, sort_keys=True))
    shutil.rmtree(out / DCP_PREV_DIR)
    with pytest.raises(CheckpointError, match=r"mkdir is not part of a checkpoint index"):
        load_run(out)
    assert not mark.exists()


def test_a_file_planted_in_a_sharded_checkpoint_is_refused(tmp_path, sharded_run):
    out = copy_of(sharded_run, tmp_path)
    (out / DCP_DIR / "__9_0.distcp").write_bytes(b"x")
    shutil.rmtree(out / DCP_PREV_DIR)
    with pytest.raises(CheckpointError, match=r"__9_0.distcp is not part of it"):
        load_run(out)


def test_fsdp_without_a_launcher_is_a_clear_error(tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="fsdp: .*torchrun"):
        train(tiny(out, fsdp=True), corpus=corpus())
    assert not out.exists()


def _train_rank_flags(rank, world, out, per_rank):
    torch.set_num_threads(1)
    return train(tiny(out, **per_rank[rank]), corpus=corpus())["final_train_loss"]


@pytest.mark.parametrize(
    "per_rank, named",
    [
        ([{}, {"lr": 1e-3}], "rank 1 has train.lr=0.001 where rank 0 has 0.003"),
        ([{"fsdp": True}, {}], "rank 1 has run.fsdp=False where rank 0 has True"),
    ],
    ids=["lr", "fsdp"],
)
def test_ranks_with_different_configs_fail_fast_and_name_the_field(tmp_path, per_rank, named):
    """A rank launched with other flags would train another run or wait forever in a collective
    the others never enter: every rank fails at once, naming the field, before anything is written."""
    out = tmp_path / "run"
    with pytest.raises(DistributedError, match=re.escape(named)):
        spawn(_train_rank_flags, 2, str(out), per_rank, timeout_s=60)
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == []


def _fsdp_rank1_dies(rank, world, out):
    """Rank 1 is killed (os._exit) in the middle of step 5, after the step-3 checkpoint."""
    real = loop.get_batch

    def dying(*args, **kw):
        if rank == 1 and kw["step"] == 4 * 2 + 1:  # step 4 (0-based), second micro-batch
            os._exit(9)
        return real(*args, **kw)

    loop.get_batch = dying
    return _train(rank, world, out, {"fsdp": True})


def test_a_rank_killed_mid_step_fails_the_fsdp_run_fast_and_it_resumes_exactly(tmp_path, single):
    out = tmp_path / "run"
    t0 = time.perf_counter()
    with pytest.raises(DistributedError, match="rank 1: exited with code 9"):
        spawn(_fsdp_rank1_dies, 2, str(out), timeout_s=60, group_timeout_s=10)
    assert time.perf_counter() - t0 < 50
    assert json.loads((out / DCP_DIR / MANIFEST).read_text())["step"] == 3
    train(tiny(out, resume=True), corpus=corpus())
    assert_same_losses(out, single)


# --------------------------------------------------------------------------- pipeline parallel


@pytest.mark.parametrize(
    "world, pp",
    [
        (2, {"pp_stages": 2, "pp_schedule": "1f1b"}),
        (2, {"pp_stages": 2, "pp_schedule": "interleaved", "pp_virtual": 2}),
        (4, {"pp_stages": 4, "pp_schedule": "gpipe"}),
        (4, {"pp_stages": 2, "pp_schedule": "1f1b"}),
        (4, {"pp_stages": 2, "pp_schedule": "1f1b", "fsdp": True}),
        (2, {"pp_stages": 2, "pp_schedule": "1f1b", "activation_checkpointing": True}),
        (2, {"pp_stages": 2, "pp_schedule": "1f1b", "compile": True}),
        (
            4,
            {
                "pp_stages": 2,
                "pp_schedule": "interleaved",
                "pp_virtual": 2,
                "pp_microbatches": 2,
                "fsdp": True,
            },
        ),
    ],
    ids=[
        "2x1f1b",
        "2x2-interleaved",
        "4xgpipe",
        "dp2xpp2-1f1b",
        "fsdp2xpp2-1f1b",
        "2x1f1b-recompute",
        "2x1f1b-compile",
        "fsdp2xpp2x2-interleaved",
    ],
)
def test_pipeline_training_equals_single_process(tmp_path, single, world, pp):
    """``--pp-stages`` (gradient accumulation over 2 micro-batches, each split into pipeline
    microbatches; the cross-stage cache on), alone or replicated over a data-parallel mesh
    dimension (plain replicas, or FSDP2 over them): losses, gradient norms and weights equal one
    process."""
    out = tmp_path / "pp"
    finals = spawn(_train, world, str(out), pp, timeout_s=180)
    assert len(set(finals)) == 1
    assert_same_losses(out, single)
    norms = [[r.get("grad_norm") for r in read_metrics(run)] for run in (out, single)]
    assert norms[0][1:] == pytest.approx(norms[1][1:], rel=1e-5)
    assert_same_weights(out, single)
    assert sorted(p.name for p in (out / DCP_DIR).iterdir())[:2] == [".metadata", "__0_0.distcp"]


@pytest.mark.parametrize(
    "rule",
    [
        {"residual": "prenorm", "block_size": None},
        {"residual": "full", "depth_heads": 2, "block_size": None},
        {"residual": "mhc", "block_size": None},
    ],
    ids=["prenorm", "full-heads", "mhc"],
)
def test_pipeline_training_of_other_rules_equals_single_process(tmp_path, rule):
    """The baseline, Full AttnRes and mHC-lite train under ``--pp-stages 2`` (interleaved, the
    cache on) as in one process: the baseline can be compared with AttnRes on the same runtime."""
    pp = {"pp_stages": 2, "pp_schedule": "interleaved", "pp_virtual": 2}
    spawn(_train, 2, str(tmp_path / "pp"), {**pp, **rule}, timeout_s=180)
    _train(0, 1, str(tmp_path / "one"), rule)
    assert_same_losses(tmp_path / "pp", tmp_path / "one")
    # as for FSDP above: mHC's zero-initialised projection follows roundoff-level gradient signs
    assert_same_weights(tmp_path / "pp", tmp_path / "one", atol=1e-3 if rule["residual"] == "mhc" else 1e-5)


def test_fsdp_pipeline_with_tied_embeddings_resumes_in_one_process(tmp_path):
    """FSDP2 over 2 replicas of a 2-stage pipeline with the LM head tied to the embedding (its
    shards on the first and last stage summed shard by shard) to step 3, then one process to the
    end: the uninterrupted single-process run."""
    out, one = tmp_path / "run", tmp_path / "one"
    _train(0, 1, str(one), {"tie_embeddings": True})
    spawn(
        _train,
        4,
        str(out),
        {"pp_stages": 2, "fsdp": True, "tie_embeddings": True, "stop_at": 3},
        timeout_s=180,
    )
    train(tiny(out, tie_embeddings=True, resume=True), corpus=corpus())
    assert_same_losses(out, one)
    assert_same_weights(out, one)


def test_pipeline_checkpoint_resumes_on_another_layout(tmp_path, single):
    """2 replicas of a 2-stage pipeline to step 3, FSDP on 2 ranks to step 5, one process to the end."""
    out = tmp_path / "run"
    spawn(_train, 4, str(out), {"pp_stages": 2, "stop_at": 3}, timeout_s=180)
    spawn(_train, 2, str(out), {"fsdp": True, "stop_at": 5, "resume": True}, timeout_s=180)
    train(tiny(out, resume=True), corpus=corpus())
    assert_same_losses(out, single)
    assert_same_weights(out, single)


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            {"pp_stages": 2, "residual": "denseformer", "block_size": None},
            "pp_stages: pipelining carries the states of block, full",
        ),
        ({"pp_stages": 2, "pp_schedule": "interleaved"}, "pp_virtual: the interleaved schedule needs"),
        ({"pp_stages": 2, "pp_microbatches": 3}, "pp_microbatches: 3 does not divide"),
        ({"pp_virtual": 2}, "pp_virtual / pp_microbatches: only with pp_stages > 1"),
    ],
)
def test_bad_pipeline_options_are_named_before_anything_is_written(tmp_path, kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        train(tiny(tmp_path / "run", **kw), corpus=corpus())
    assert not (tmp_path / "run").exists()


def test_pipeline_stages_must_divide_the_world_size(tmp_path):
    with pytest.raises(
        DistributedError, match=re.escape("pp_stages: 4 pipeline stages need a multiple of 4 ranks")
    ):
        spawn(_train, 2, str(tmp_path / "run"), {"pp_stages": 4}, timeout_s=60)
    with pytest.raises(
        DistributedError, match=re.escape("pp_microbatches: 4 does not divide a replica's micro-batch of 2")
    ):
        spawn(_train, 4, str(tmp_path / "run"), {"pp_stages": 2, "pp_microbatches": 4}, timeout_s=60)
    assert not (tmp_path / "run").exists()


def _overflow_on_one_rank(rank, world):
    """Rank 1's gradient overflows, rank 0's does not: (rank 0's weight moved?, its new scale)."""
    w = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([w], lr=0.1)
    scaler = loop.grad_scaler("float16", torch.device("cpu"), pipelined=True)
    (scaler.scale(w.sum()) * (float("inf") if rank == 1 else 1.0)).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return bool((w != 1).any()), scaler.get_scale()


def test_a_pipeline_overflow_on_one_stage_skips_the_step_on_every_stage():
    """float16 under pipelining: each stage's gradients are its own, so the overflow flag is agreed
    over the ranks; no stage steps and every scale backs off alike."""
    assert spawn(_overflow_on_one_rank, 2, timeout_s=60) == [(False, 2.0**15)] * 2
