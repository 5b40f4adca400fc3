"""Floor 5: torch.distributed for Attention Residuals.

* :mod:`.dist` — process groups with timeouts, launcher detection, clear errors, local spawn.
* :mod:`.pipeline` — the pipeline layout and its traffic formulas.
* :mod:`.pipelining` — pipeline parallel training on ``torch.distributed.pipelining`` (GPipe,
  1F1B, interleaved 1F1B): Block AttnRes with the cross-stage block cache, and Full AttnRes,
  mixing, mHC-lite and the PreNorm baseline on the same runtime.
* :mod:`.prefill` — sequence- or hidden-dim sharded and chunked prefill of the block states.
* :mod:`.kv`, :mod:`.generate` — context parallelism: a KV cache sharded by token, generation on it.
* :mod:`.tp` — tensor-parallel inference: sharded sublayer weights and KV heads, depth state by token.
* :mod:`.data_parallel` — the hooks of ``torchrun`` training: process group, DDP, batch slicing.
* :mod:`.fsdp` — FSDP2 ``fully_shard`` of the GPT per sublayer, with a mixed-precision policy.
"""

from .dist import (
    DistEnv,
    DistributedError,
    check_consistent,
    destroy_distributed,
    init_distributed,
    launcher_env,
    spawn,
)
from .pipeline import (
    SCHEMES,
    PipelineLayout,
    aligned_transfers,
    derived_transfers,
    report_transfers,
)
from .pipelining import PipelinedGPT

__all__ = [
    "DistEnv",
    "DistributedError",
    "PipelineLayout",
    "PipelinedGPT",
    "SCHEMES",
    "aligned_transfers",
    "check_consistent",
    "derived_transfers",
    "destroy_distributed",
    "init_distributed",
    "launcher_env",
    "report_transfers",
    "spawn",
]
