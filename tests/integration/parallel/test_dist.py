"""Process groups fail loudly: a dead, stalled or missing rank and a wrong world size raise, never hang."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from attention_residuals.model import GPT, GPTConfig
from attention_residuals.parallel import (
    DistributedError,
    PipelinedGPT,
    init_distributed,
    launcher_env,
    spawn,
)

CFG = dict(vocab_size=32, n_layer=2, n_head=2, d_model=16, seq_len=8, residual="block", block_size=2)


def _pipeline(rank, world, microbatches, fault):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    idx = torch.randint(0, 32, (2, 8))
    pp = PipelinedGPT(model, microbatches=microbatches)
    if rank == 1 and fault == "die":
        os._exit(7)
    if rank == 1 and fault == "stall":
        time.sleep(4.0)
        return "late"
    return float(pp.step(idx if rank == 0 else None, idx))


def test_dead_rank_raises_clear_error():
    start = time.monotonic()
    with pytest.raises(DistributedError) as err:
        spawn(_pipeline, 2, 2, "die", timeout_s=30, group_timeout_s=3)
    msg = str(err.value)
    assert "rank 1: exited with code 7" in msg
    assert "pipeline schedule (rank 0)" in msg or "probably died" in msg
    assert time.monotonic() - start < 20


def test_stalled_rank_times_out():
    with pytest.raises(DistributedError) as err:
        spawn(_pipeline, 2, 2, "stall", timeout_s=30, group_timeout_s=1.5)
    msg = str(err.value)
    assert "rank 0" in msg and "timed out" in msg


def _noop(rank, world):
    return rank


def test_missing_rank_rendezvous_times_out():
    """world_size=2 but only rank 0 starts: the rendezvous gives up with a message, no hang."""
    start = time.monotonic()
    with pytest.raises(DistributedError, match="rendezvous failed.*fewer processes started than world_size"):
        spawn(_noop, 2, ranks=[0], timeout_s=30, group_timeout_s=2)
    assert time.monotonic() - start < 20


def _expect(rank, world):
    return init_distributed(expected_world_size=3)


def test_expected_world_size_mismatch():
    with pytest.raises(DistributedError, match="needs world_size=3 processes but runs with world_size=2"):
        spawn(_expect, 2, timeout_s=30)


def _disagree(rank, world, value):
    from attention_residuals.parallel import check_consistent

    check_consistent(value(rank), "model config")


def test_check_consistent_names_each_rank():
    with pytest.raises(DistributedError, match=r"ranks disagree on model config: rank 0: 2, rank 1: 3"):
        spawn(_disagree, 2, lambda rank: 2 + rank, timeout_s=30)


def test_check_consistent_names_the_differing_fields_of_a_config():
    with pytest.raises(
        DistributedError,
        match=r"ranks disagree on model config: rank 1 has model.n_layer=3 where rank 0 has 2$",
    ):
        spawn(_disagree, 2, lambda rank: {"model": {"n_layer": 2 + rank, "d": 8}}, timeout_s=30)


def test_spawn_returns_results_in_rank_order():
    assert spawn(_noop, 3, timeout_s=30) == [0, 1, 2]


def test_launcher_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert launcher_env() is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    env = launcher_env()
    assert (env.rank, env.world_size, env.local_rank, env.launched) == (1, 4, 1, True)
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(DistributedError, match="RANK=4 is not in"):
        launcher_env()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(DistributedError, match="RANK: expected an integer"):
        launcher_env()


def test_single_process_needs_no_group(monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    env = init_distributed()
    assert (env.rank, env.world_size, env.launched) == (0, 1, False)
    assert not dist.is_initialized()
