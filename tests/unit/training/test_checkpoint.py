"""Checkpoints: exact round trip of weights / optimizer / scheduler / RNG, atomic writes, corruption."""

from __future__ import annotations

import json
import os
import random
import struct

import numpy as np
import pytest
import torch

from attention_residuals import GPT, GPTConfig
from attention_residuals.training.checkpoint import (
    CheckpointError,
    flatten_state,
    load_checkpoint,
    load_latest,
    previous_path,
    read_checkpoint,
    save_checkpoint,
    unflatten_state,
    verify_checkpoint,
)
from attention_residuals.training.optim import build_optimizer, build_scheduler

CFG = GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8, residual="block", n_blocks=2)


def _trained(optimizer="muon", seed=0):
    torch.manual_seed(seed)
    model = GPT(CFG)
    opt = build_optimizer(model, optimizer, lr=1e-2)
    sched = build_scheduler(opt, "cosine", steps=10, warmup=2, min_lr=1e-3)
    x = torch.randint(0, 256, (2, 8))
    for _ in range(3):
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def _states_equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_states_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_states_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


def test_flatten_roundtrip_keeps_types():
    state = {
        0: {"step": torch.tensor(3.0), "buf": torch.ones(2, 2)},
        "groups": [{"betas": (0.9, 0.95), "lr": 1e-3, "foreach": None, "inf": float("inf")}],
        "arr": np.arange(5, dtype=np.uint32),
        "dtype": torch.bfloat16,
    }
    structure, tensors = flatten_state(state)
    json.dumps(structure)  # JSON-able
    back = unflatten_state(json.loads(json.dumps(structure)), tensors)
    assert set(back) == {0, "groups", "arr", "dtype"}
    assert back["groups"][0]["betas"] == (0.9, 0.95) and back["groups"][0]["inf"] == float("inf")
    assert back["arr"].dtype == np.uint32 and back["arr"].tolist() == [0, 1, 2, 3, 4]
    assert back["dtype"] is torch.bfloat16 and torch.equal(back[0]["buf"], torch.ones(2, 2))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_roundtrip_model_optimizer_scheduler_rng(tmp_path, optimizer):
    model, opt, sched = _trained(optimizer)
    path = tmp_path / "ck.safetensors"
    torch.manual_seed(123)
    np.random.seed(5)
    random.seed(7)
    save_checkpoint(
        path, model=model, optimizer=opt, scheduler=sched, step=3, config={"a": 1}, extra={"tokens": 48}
    )
    expect = (torch.rand(3), np.random.rand(), random.random())
    model2, opt2, sched2 = _trained(optimizer, seed=99)  # different weights and state
    info = load_checkpoint(path, model=model2, optimizer=opt2, scheduler=sched2)
    assert info["step"] == 3 and info["config"] == {"a": 1} and info["extra"] == {"tokens": 48}
    assert _states_equal(model.state_dict(), model2.state_dict())
    assert _states_equal(opt.state_dict(), opt2.state_dict())
    assert sched.state_dict() == sched2.state_dict()
    got = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(expect[0], got[0]) and expect[1:] == got[1:]
    # both continue identically
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    for m, o in ((model, opt), (model2, opt2)):
        m(x, x)[1].backward()
        o.step()
    assert _states_equal(model.state_dict(), model2.state_dict())


def test_tied_embeddings_roundtrip(tmp_path):
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8, tie_embeddings=True))
    save_checkpoint(tmp_path / "t.safetensors", model=model)
    other = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8, tie_embeddings=True))
    load_checkpoint(tmp_path / "t.safetensors", model=other)
    assert torch.equal(model.embed.weight, other.embed.weight)


def test_truncated_and_corrupt_files_raise_checkpoint_error(tmp_path):
    model, opt, sched = _trained("adamw")
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, step=3)
    blob = path.read_bytes()
    assert verify_checkpoint(path)

    bad = tmp_path / "bad.safetensors"
    for damaged in (blob[: len(blob) // 2], blob[:5], b""):  # truncated
        bad.write_bytes(damaged)
        with pytest.raises(CheckpointError, match="bad.safetensors"):
            read_checkpoint(bad)
    flipped = bytearray(blob)
    flipped[-7] ^= 0xFF  # a bit flip in the tensor data
    bad.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="bad.safetensors.*checksum"):
        load_checkpoint(bad, model=model)
    # a same-length edit of the metadata (step 3 -> 9) is caught too: the checksum covers the file
    (n,) = struct.unpack("<Q", blob[:8])
    header = blob[8 : 8 + n].replace(b'"step":"3"', b'"step":"9"')
    assert header != blob[8 : 8 + n]
    bad.write_bytes(blob[:8] + header + blob[8 + n :])
    with pytest.raises(CheckpointError, match="file checksum"):
        read_checkpoint(bad)
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="bad.safetensors"):
        read_checkpoint(bad)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "nope.safetensors")
    # the wrong model shape is a CheckpointError as well
    other = GPT(GPTConfig(n_layer=1, n_head=2, d_model=32, seq_len=8))
    with pytest.raises(CheckpointError, match="does not fit"):
        load_checkpoint(path, model=other)


def test_failed_write_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    model, opt, sched = _trained("adamw")
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, step=3)
    good = path.read_bytes()

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, step=4, keep_previous=True)
    monkeypatch.undo()
    assert path.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.safetensors"]  # no temp file left behind
    assert read_checkpoint(path)[1]["step"] == 3


def test_keep_previous_and_fallback(tmp_path):
    model, opt, sched = _trained("adamw")
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, model=model, step=1, keep_previous=True)
    save_checkpoint(path, model=model, step=2, keep_previous=True)
    prev = previous_path(path)
    assert prev.name == "ck.prev.safetensors" and read_checkpoint(prev)[1]["step"] == 1
    info, warnings = load_latest(path, model=model)
    assert info["step"] == 2 and warnings == []
    path.write_bytes(path.read_bytes()[:100])  # the newest file gets damaged on disk
    info, warnings = load_latest(path, model=model)
    assert info["step"] == 1 and "ck.safetensors" in warnings[0] and "previous good checkpoint" in warnings[0]
    prev.write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="previous checkpoint is unusable"):
        load_latest(path, model=model)


# --------------------------------------------------------------------------- integrity of the whole file

SOAK = int(os.environ.get("ATTNRES_SOAK", "0") or 0)  # > 0: the long variant (more random faults)


def _regions(blob: bytes) -> dict[str, int]:
    """A byte offset in each part of a checkpoint file."""
    (n,) = struct.unpack("<Q", blob[:8])
    header = blob[8 : 8 + n]
    dtype_at = 8 + header.index(b'"dtype":"F32"') + len(b'"dtype":"')
    return {
        "header length": 0,
        "header length, high byte": 7,
        "header opening brace": 8,
        "a tensor's dtype": dtype_at,
        "a tensor's shape": 8 + header.index(b'"shape":[') + len(b'"shape":['),
        "a tensor's data offsets": 8 + header.index(b'"data_offsets":[') + len(b'"data_offsets":['),
        "the metadata (step)": 8 + header.index(b'"step":"') + len(b'"step":"'),
        "the recorded config": 8 + header.index(b'"config":"') + len(b'"config":"'),
        "the checksum itself": 8 + header.index(b'"sha256_file":"') + len(b'"sha256_file":"'),
        "the header's last byte (padding)": 8 + n - 1,
        "the first data byte": 8 + n,
        "a data byte in the middle": 8 + n + (len(blob) - 8 - n) // 2,
        "the last data byte": len(blob) - 1,
    }


def _flip_positions(blob: bytes) -> list[tuple[str, int]]:
    rng = random.Random(0)
    named = list(_regions(blob).items())
    return named + [(f"random byte {i}", rng.randrange(len(blob))) for i in range(48 + 2000 * SOAK)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model, opt, sched = _trained("adamw")
    path = tmp_path_factory.mktemp("ck") / "ck.safetensors"
    save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, step=3, config={"model": {"d": 1}})
    return path, path.read_bytes()


def test_bit_flip_anywhere_in_the_file_is_caught(saved, tmp_path):
    _, blob = saved
    bad = tmp_path / "bad.safetensors"
    rng = random.Random(1)
    for what, at in _flip_positions(blob):
        flipped = bytearray(blob)
        flipped[at] ^= rng.randrange(1, 256)
        bad.write_bytes(bytes(flipped))
        with pytest.raises(CheckpointError, match="bad.safetensors") as e:
            read_checkpoint(bad)
        assert "Traceback" not in str(e.value), what


def test_truncation_anywhere_is_caught(saved, tmp_path):
    _, blob = saved
    (n,) = struct.unpack("<Q", blob[:8])
    cuts = [0, 1, 7, 8, 9, 8 + n - 1, 8 + n, 8 + n + 1, len(blob) - 1]
    rng = random.Random(2)
    cuts += [rng.randrange(len(blob)) for _ in range(16 + 500 * SOAK)]
    bad = tmp_path / "bad.safetensors"
    for cut in cuts:
        bad.write_bytes(blob[:cut])
        with pytest.raises(CheckpointError, match="bad.safetensors"):
            read_checkpoint(bad)
    bad.write_bytes(blob + b"\0")  # appended bytes too
    with pytest.raises(CheckpointError, match="checksum"):
        read_checkpoint(bad)


def test_a_tensor_dtype_edited_in_the_header_is_caught(saved, tmp_path):
    """The case of the issue: F32 -> I32 keeps every offset valid, so safetensors itself loads it."""
    _, blob = saved
    (n,) = struct.unpack("<Q", blob[:8])
    header = blob[8 : 8 + n].replace(b'"dtype":"F32"', b'"dtype":"I32"', 1)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(blob[:8] + header + blob[8 + n :])
    with pytest.raises(CheckpointError, match="file checksum"):
        read_checkpoint(bad)


def _legacy_v1(path, model, dtype_edit=False):
    """A checkpoint as format version 1 wrote it (data and metadata checksums only)."""
    import hashlib

    from safetensors.torch import save as st_save

    tensors = {f"model/{k}": v.contiguous() for k, v in model.state_dict().items()}
    structure, _ = flatten_state({"optimizer": None, "scheduler": None, "rng": None})
    meta = {
        "format": "attention_residuals.checkpoint",
        "version": "1",
        "step": "5",
        "config": "{}",
        "extra": "{}",
        "state": json.dumps(structure),
        "torch": torch.__version__,
    }
    probe = st_save(tensors, metadata={**meta, "sha256_data": "0" * 64, "sha256_meta": "0" * 64})
    (n,) = struct.unpack("<Q", probe[:8])
    meta["sha256_data"] = hashlib.sha256(probe[8 + n :]).hexdigest()
    meta["sha256_meta"] = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()
    blob = st_save(tensors, metadata=meta)
    if dtype_edit:
        (n,) = struct.unpack("<Q", blob[:8])
        blob = blob[:8] + blob[8 : 8 + n].replace(b'"dtype":"F32"', b'"dtype":"I32"', 1) + blob[8 + n :]
    path.write_bytes(blob)
    return path


def test_version_1_files_still_load_and_their_dtypes_are_checked_against_the_model(tmp_path):
    model, _, _ = _trained("adamw")
    other = GPT(CFG)
    info = load_checkpoint(_legacy_v1(tmp_path / "v1.safetensors", model), model=other)
    assert info["step"] == 5 and torch.equal(other.embed.weight, model.embed.weight)
    bad = _legacy_v1(tmp_path / "v1bad.safetensors", model, dtype_edit=True)  # v1 cannot see this edit
    fresh = GPT(CFG)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"does not fit the model: .*int32 .* in the file, float32"):
        load_checkpoint(bad, model=fresh)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())  # nothing loaded


def test_dtype_and_shape_are_checked_before_anything_is_loaded(saved):
    path, _ = saved
    wide = GPT(CFG).double()
    before = {k: v.clone() for k, v in wide.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"float32 \[.*\] in the file, float64 \[.*\] in the model"):
        load_checkpoint(path, model=wide)
    assert all(torch.equal(before[k], v) for k, v in wide.state_dict().items())
    other = GPT(GPTConfig(n_layer=1, n_head=2, d_model=32, seq_len=8, residual="block", n_blocks=2))
    with pytest.raises(
        CheckpointError, match=r"embed.weight: float32 \[256, 16\] in the file, float32 \[256, 32\]"
    ):
        load_checkpoint(path, model=other)
    deeper = GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, residual="block", n_blocks=2))
    with pytest.raises(CheckpointError, match="missing tensors"):
        load_checkpoint(path, model=deeper)


def test_another_runs_checkpoint_is_refused_naming_fields_without_fallback(tmp_path):
    from attention_residuals.training.checkpoint import CheckpointMismatchError

    model, _, _ = _trained("adamw")
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, model=model, step=1, config={"train": {"lr": 0.1}}, keep_previous=True)
    save_checkpoint(path, model=model, step=2, config={"train": {"lr": 0.5}}, keep_previous=True)

    def check(recorded):
        return [] if recorded == {"train": {"lr": 0.1}} else [f"train.lr: {recorded['train']['lr']} != 0.1"]

    with pytest.raises(CheckpointMismatchError, match=r"another run: train.lr: 0.5 != 0.1"):
        load_latest(path, model=GPT(CFG), check_config=check)  # the previous one would match: no fallback
    assert load_checkpoint(previous_path(path), model=GPT(CFG), check_config=check)["step"] == 1
