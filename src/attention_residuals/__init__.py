"""Attention Residuals (AttnRes): softmax attention over depth in place of residual connections."""

from .connections import RESIDUALS, RULES, Connection, ResidualConfig, make_connection
from .functional import DepthState, depth_state, depth_state_batched, merge_states, rms_norm
from .integrations import autoregister as _autoregister
from .integrations.patch import apply_attnres, load_patched, remove_attnres
from .kernels import depth_attention
from .model import GPT, GPTConfig

__all__ = [
    "GPT",
    "GPTConfig",
    "RESIDUALS",
    "RULES",
    "Connection",
    "ResidualConfig",
    "apply_attnres",
    "load_patched",
    "make_connection",
    "remove_attnres",
    "DepthState",
    "depth_attention",
    "depth_state",
    "depth_state_batched",
    "merge_states",
    "rms_norm",
]
__version__ = "0.1.0"

_autoregister.install()  # the HF classes, once transformers loads its auto classes (never imports it)
