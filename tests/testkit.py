"""Helpers shared by test modules (``tests`` is on pytest's ``pythonpath``)."""

from attention_residuals.training import TrainConfig, make_config

# the smallest run that still trains, evaluates, logs and checkpoints on a CPU in well under a second
TINY_RUN = dict(
    n_layer=1,
    n_head=2,
    d_model=16,
    seq_len=16,
    batch_size=4,
    steps=8,
    warmup=1,
    eval_interval=4,
    eval_batches=1,
    log_interval=2,
    progress=False,
)

# the data- and model-parallel tests' run: 2 blocks of Block AttnRes and gradient accumulation, so
# that sharding, accumulation and the block boundaries are all exercised
PARALLEL_RUN = dict(
    n_layer=2,
    d_model=32,
    grad_accum=2,
    steps=6,
    eval_interval=3,
    eval_batches=2,
    log_interval=1,
    residual="block",
    block_size=2,
)

# a 2-block model trained long enough for the loss to fall (20 steps; more where a test needs it)
LEARNING_RUN = dict(
    n_layer=2,
    d_model=32,
    seq_len=32,
    batch_size=8,
    steps=20,
    warmup=2,
    lr=3e-3,
    min_lr=3e-4,
    eval_interval=10,
    eval_batches=2,
    log_interval=5,
)


def tiny_config(out, **overrides) -> TrainConfig:
    """``TINY_RUN`` writing to ``out``, with ``overrides`` on top."""
    return make_config(**{**TINY_RUN, "out": str(out), **overrides})
