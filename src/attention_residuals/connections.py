"""Floor 3: every depth-mixing rule as an ``nn.Module`` behind one interface.

A Transformer with ``L`` sublayers (each attention and each MLP is its own layer) runs::

    state = residual.init_state(embedding)        # v_0 = h_1 = the token embedding
    for l in range(L):
        h = residual.read(state, l)                # the input h_l of layer l
        v = f_l(RMSNorm_l(h))                      # the layer's output v_l
        residual.write(state, l, v)
    out = residual.final(state)                    # what the final norm and LM head see

Rules (``make_connection(residual, ...)``, the registry :data:`RULES`):

- ``prenorm``: ``h_{l+1} = h_l + v_l`` (the baseline: uniform sum of every earlier output).
- ``full``: ``h_l = sum_{i<=l} softmax_i(w_l . RMSNorm(v_i)) v_i`` over the embedding and all outputs.
- ``block``: outputs summed inside blocks of ``block_size`` layers; layer ``l`` attends over
  ``[b_0 = embedding, b_1, ..., b_{n-1}]`` plus the current partial sum ``b_n^{i-1}``.
- ``swa``: like ``full`` but over the embedding plus only the last ``window`` outputs.
- ``mixing``: input-independent softmax weights per (layer, source) over the full sources.
- ``denseformer``: depth-weighted average of the hidden states after every layer (DenseFormer).
- ``mhc``: mHC-lite, ``m`` residual streams mixed by a doubly-stochastic matrix built as a convex
  combination of permutation matrices (exact, no Sinkhorn iterations).

A rule and its options are one frozen :class:`ResidualConfig` (each option's default, help and
check live in its field); a rule class names the options it reads in ``options``, and an option
set away from its default with a rule that does not read it is an error. The attention rules
(``full``, ``block``, ``swa``) take ``query="static"|"input"|"lowrank"``,
``normalize="softmax"|"sigmoid"``, ``depth_heads`` and ``key_norm`` (``key_norm_gain``). Every rule
has one more query / weight row for the final readout (index ``L``). Queries are zero-initialised,
so at step 0 every attention layer sees the mean of its sources (``query_init_std`` > 0 draws them
from a normal instead: an ablation).

"Heads" here are always *depth-attention* heads (``depth_heads``: d split into groups, one
pseudo-query slice and one softmax over depth each), never the model's attention heads (``n_head``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .functional import DepthState, activation_dtype, depth_logits, rms_norm, stack_sources
from .kernels import depth_attention, depth_attention_merged, depth_attention_normed, depth_states_batched
from .typed import check_bounds, check_choices, check_field_types, check_number, field_default, option

__all__ = [
    "RESIDUALS",
    "RULES",
    "Connection",
    "ResidualConfig",
    "ResidualState",
    "make_connection",
    "resolve_block_size",
]

SCHEDULES = ("plain", "two_phase")
# names an option had before (config files keep loading; code spelled the old way gets a clear error)
LEGACY_NAMES = {"heads": "depth_heads", "residual": "rule"}


@dataclass(frozen=True)
class ResidualConfig:
    """A depth-mixing rule and its options: the one home of each option's default, help and check.

    ``rule`` names the rule (``--residual`` on the command line, ``residual=`` in
    :class:`~attention_residuals.model.GPTConfig` and :func:`make_connection`). An option set away
    from its default with a rule that does not read it (the rule class's ``options``) is an error,
    not silently ignored. ``n_blocks``/``block_size`` are checked against the depth where the depth
    is known (:func:`make_connection`).
    """

    rule: str = option("prenorm", "depth-mixing rule", flag="residual", choices=lambda: RESIDUALS)
    block_size: int | None = option(
        None, "Block AttnRes block size S, in sublayers (full: the two-phase group size)"
    )
    n_blocks: int | None = option(None, "Block AttnRes number of blocks N (instead of --block-size)")
    query: str = option(
        "static",
        "depth-attention query: static (learned vector per layer), input "
        "(projection of the hidden state), lowrank",
        choices=("static", "input", "lowrank"),
    )
    normalize: str = option("softmax", "depth-attention normalisation", choices=("softmax", "sigmoid"))
    depth_heads: int = option(
        1,
        "depth-attention heads: d_model split into groups, one pseudo-query slice "
        "and softmax over depth each (not the model's attention heads, --n-head)",
    )
    key_norm: bool = option(True, "RMSNorm the depth-attention keys")
    key_norm_gain: bool = option(
        False,
        "a learnable gain (one d-vector per layer, init 1) in the key RMSNorm, "
        "as production AttnRes has; folded into the query: w.(g*k) = (g*w).k",
    )
    query_rank: int = option(8, "lowrank query: rank")
    query_init_std: float = option(
        0.0,
        "std of a normal initialisation of the pseudo-queries (0: zero, as the report: every "
        "depth mix starts as the mean of its sources)",
        ge=0,
    )
    window: int = option(8, "swa: number of most recent sources attended")
    streams: int = option(4, "mhc: number of residual streams m (1..6)")
    intra_gate: bool = option(False, "block: gate the intra-block partial sum (2 sigmoid(c_l), init 1)")

    def __post_init__(self) -> None:
        check_field_types(self)
        check_bounds(self)
        if self.rule not in RULES:  # before the other choices: the message names the flag
            raise ValueError(f"residual: expected one of {RESIDUALS}, got {self.rule!r}")
        check_choices(self)
        for name in ("block_size", "n_blocks", "depth_heads", "query_rank", "window", "streams"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        reads = RULES[self.rule].options
        for f in fields(self):
            default = field_default(f)
            if f.name != "rule" and f.name not in reads and getattr(self, f.name) != default:
                users = tuple(r for r, cls in RULES.items() if f.name in cls.options)
                raise ValueError(
                    f"{f.name}: only used by residual in {users}, got {f.name}={getattr(self, f.name)!r} "
                    f"with residual={self.rule!r} (leave it at its default {default!r})"
                )
        if self.query_rank != 8 and self.query != "lowrank":
            raise ValueError(
                f"query_rank: only used with query='lowrank', got query_rank={self.query_rank!r} "
                f"with query={self.query!r}"
            )
        if self.key_norm_gain and not self.key_norm:
            raise ValueError("key_norm_gain: a gain of the key RMSNorm needs key_norm=True")
        if self.block_size is not None and self.n_blocks is not None:
            raise ValueError("block_size and n_blocks: give one of them, not both")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ResidualConfig:
        """From :meth:`to_dict` or an older flat spelling (``residual``, ``heads``): config files of
        earlier runs keep loading. Unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        renamed = {LEGACY_NAMES.get(k, k): v for k, v in data.items()}
        unknown = set(renamed) - known
        if unknown:
            raise ValueError(f"ResidualConfig: unknown fields {sorted(unknown)}")
        return cls(**renamed)

    def replace(self, **changes: Any) -> ResidualConfig:
        return dataclasses.replace(self, **changes)


@dataclass
class ResidualState:
    """Mutable per-forward state of a connection (its fields depend on the rule).

    ``record`` collects depth weights for :meth:`GPT.depth_weights`: layer -> (columns, weights
    ``[n]`` or ``[n, heads]`` averaged over batch and tokens).
    ``phase1`` caches two-phase results: group index -> (batched state, layers, sources covered).
    """

    schedule: str = "plain"
    h: torch.Tensor | None = None
    values: list[torch.Tensor] = field(default_factory=list)
    blocks: list[torch.Tensor] = field(default_factory=list)
    partial: torch.Tensor | None = None
    streams: torch.Tensor | None = None
    pending: tuple[torch.Tensor, torch.Tensor] | None = None
    record: dict[int, tuple[list[int], torch.Tensor]] | None = None
    phase1: dict[int, tuple[DepthState, list[int], int]] = field(default_factory=dict)


class Connection(nn.Module):
    """Base class: a depth-mixing rule for ``n_layers`` sublayers of width ``d_model``."""

    #: whether ``read`` attends over explicit sources (so depth weights can be recorded)
    has_depth_weights = False
    #: whether the exact two-phase schedule applies
    supports_two_phase = False
    #: the :class:`ResidualConfig` options this rule reads (any other must keep its default)
    options: tuple[str, ...] = ()
    #: the registry name (:data:`RULES`)
    rule: str = ""

    def __init__(
        self, n_layers: int, d_model: int, eps: float = 1e-6, config: ResidualConfig | None = None
    ) -> None:
        super().__init__()
        self.n_layers, self.d_model, self.eps = n_layers, d_model, eps
        self.config = config if config is not None else ResidualConfig(type(self).rule)

    def init_random(self) -> None:
        """Draw the rule's random initial values (none by default). The model calls it after
        drawing its own weights, so a variant that draws here keeps the rest of its twin's start."""

    def init_state(
        self, embedding: torch.Tensor, schedule: str = "plain", record: bool = False
    ) -> ResidualState:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
        if schedule == "two_phase" and not self.supports_two_phase:
            raise ValueError(f"schedule='two_phase' needs {self.two_phase_requirement()}")
        if record and not self.has_depth_weights:
            raise ValueError(f"depth weights are not defined for residual={self.rule!r}")
        return ResidualState(schedule=schedule, record={} if record else None)

    def two_phase_requirement(self) -> str:
        return "residual='full' or 'block' with static softmax queries"

    def read(self, state: ResidualState, layer: int) -> torch.Tensor:
        raise NotImplementedError

    def write(self, state: ResidualState, layer: int, output: torch.Tensor) -> None:
        raise NotImplementedError

    def final(self, state: ResidualState) -> torch.Tensor:
        raise NotImplementedError

    def read_normed(self, state: ResidualState, layer: int, norm: nn.Module) -> torch.Tensor:
        """``norm(read(state, layer))``, the input of sublayer ``layer`` (its own RMSNorm applied).
        The depth-attention rules override it to recompute the pair in backward."""
        return norm(self.read(state, layer))

    def final_normed(self, state: ResidualState, norm: nn.Module) -> torch.Tensor:
        """``norm(final(state))``: what the LM head reads (recomputed in backward like
        :meth:`read_normed` by the depth-attention rules)."""
        return norm(self.final(state))

    def read_checkpointed(
        self, state: ResidualState, layer: int, body: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``body(read(state, layer))`` under ``torch.utils.checkpoint`` (activation checkpointing:
        ``body`` is the sublayer with its norm). Backward keeps only what the read depends on —
        here its output, for the depth-attention rules their sources — and recomputes the rest."""
        return checkpoint(body, self.read(state, layer), use_reentrant=False)

    def n_columns(self) -> int:
        """Number of distinct source columns in :meth:`GPT.depth_weights`."""
        return self.n_layers + 1


class PreNormResidual(Connection):
    """``h_{l+1} = h_l + f_l(RMSNorm(h_l))``: the standard residual, the baseline."""

    rule = "prenorm"

    def init_state(self, embedding, schedule="plain", record=False):
        state = super().init_state(embedding, schedule, record)
        state.h = embedding
        return state

    def read(self, state, layer):
        return state.h

    def write(self, state, layer, output):
        state.h = state.h + output

    def final(self, state):
        return state.h


class DepthAttentionResidual(Connection):
    """Shared machinery of the rules that attend over explicit sources (full, block, swa).

    Query of layer ``l``: the learned pseudo-query ``w_l`` (zero-init), plus, with
    ``query="input"``, ``W_l RMSNorm(latest source) / d`` (``W_l`` zero-init, ``d x d``) so the mix
    depends on the current token's most recent representation (the report's ablation), or with
    ``query="lowrank"`` the cheap version ``B_l A_l RMSNorm(latest source) / r`` of rank
    ``r = query_rank`` (``A_l`` random, ``B_l`` zero-init: ``2 r d`` parameters instead of ``d^2``;
    one of the open problems of the critique: input-dependent but cheap queries).

    Why the ``1/d`` (``1/r``): Adam moves every entry of a matrix by about ``lr`` per step, so a
    matrix-vector product over ``d`` (``r``) coherent terms moves ``d`` (``r``) times faster than the
    static ``w_l``; unscaled, the projected query saturated the depth softmax within 100 steps at
    lr 3e-3 and training plateaued (val 2.43 vs 1.66 for the static query, our first ablation). The
    scale puts both parts of the query on the same per-step footing (as muP scales output layers).
    """

    has_depth_weights = True
    options = (
        "query",
        "normalize",
        "depth_heads",
        "key_norm",
        "key_norm_gain",
        "query_rank",
        "query_init_std",
    )

    def __init__(
        self, n_layers: int, d_model: int, eps: float = 1e-6, config: ResidualConfig | None = None
    ) -> None:
        super().__init__(n_layers, d_model, eps, config)
        c = self.config
        if d_model % c.depth_heads:
            raise ValueError(f"depth_heads: must divide d_model={d_model}, got {c.depth_heads}")
        self.query_mode, self.normalize, self.heads, self.key_norm = (
            c.query,
            c.normalize,
            c.depth_heads,
            c.key_norm,
        )
        # one pseudo-query per layer plus one for the final readout; zero-init (the report's: every
        # mix starts uniform) unless query_init_std asks for a draw (init_random)
        self.queries = nn.Parameter(torch.zeros(n_layers + 1, d_model))
        if c.key_norm_gain:  # RMSNorm(v) * g inside the logits is the query g * w: kernels unchanged
            self.key_gain = nn.Parameter(torch.ones(n_layers + 1, d_model))
        if c.query == "input":
            self.query_proj = nn.Parameter(torch.zeros(n_layers + 1, d_model, d_model))
        if c.query == "lowrank":
            if not 1 <= c.query_rank <= d_model:
                raise ValueError(f"query_rank: expected 1..d_model={d_model}, got {c.query_rank}")
            self.query_down = nn.Parameter(
                torch.randn(n_layers + 1, d_model, c.query_rank) / math.sqrt(d_model)
            )
            self.query_up = nn.Parameter(torch.zeros(n_layers + 1, c.query_rank, d_model))
        self.supports_two_phase = (
            type(self).prefix_sources and c.query == "static" and c.normalize == "softmax"
        )

    def init_random(self) -> None:
        if self.config.query_init_std > 0:
            nn.init.normal_(self.queries, mean=0.0, std=self.config.query_init_std)

    #: whether every layer's sources start with all sources known at its group's first layer
    prefix_sources = False

    def sources(self, state: ResidualState, layer: int) -> tuple[list[torch.Tensor], list[int]]:
        """Sources of ``layer`` (``layer == n_layers``: the final readout) and their columns."""
        raise NotImplementedError

    def group_size(self) -> int:
        """Layers per two-phase group (the block size)."""
        raise NotImplementedError

    def static_queries(self, layers: int | list[int] | slice) -> torch.Tensor:
        """The input-independent part of the queries of ``layers`` (``[d]`` or ``[len, d]``): the
        pseudo-queries, times the key-norm gain when there is one."""
        w = self.queries[layers]
        return w * self.key_gain[layers] if self.config.key_norm_gain else w

    def query(self, layer: int, sources: list[torch.Tensor]) -> torch.Tensor:
        w = self.static_queries(layer)
        if self.query_mode == "input":
            w = w + rms_norm(sources[-1], self.eps) @ self.query_proj[layer].T / self.d_model
        elif self.query_mode == "lowrank":
            down, up = self.query_down[layer], self.query_up[layer]
            w = w + rms_norm(sources[-1], self.eps) @ down @ up / up.shape[0]
        return w

    #: recompute depth attention and the sublayer's RMSNorm in backward (:meth:`read_normed`)
    recompute = True

    def _attend(self, state: ResidualState, layer: int) -> torch.Tensor:
        srcs, cols = self.sources(state, layer)
        if state.schedule == "two_phase":
            return self._attend_two_phase(state, layer, srcs)
        if state.record is not None:
            q = self.query(layer, srcs)
            z = depth_logits(q, stack_sources(srcs), self.eps, heads=self.heads, key_norm=self.key_norm)
            w = torch.softmax(z, 0) if self.normalize == "softmax" else torch.sigmoid(z)
            state.record[layer] = (cols, w.detach().flatten(1, -2).mean(1))  # [n, heads]
        return self._attend_sources(layer, *srcs)

    def _attend_sources(self, layer: int, *srcs: torch.Tensor) -> torch.Tensor:
        # the sources as a list: the compiled kernel reads them in place (no stacked copy)
        return depth_attention(
            self.query(layer, list(srcs)),
            list(srcs),
            self.eps,
            heads=self.heads,
            key_norm=self.key_norm,
            normalize=self.normalize,
        )

    def read_normed(self, state, layer, norm):
        """``norm(h_l)``. In training (grad enabled, plain schedule) the pair runs under
        ``torch.utils.checkpoint``: backward keeps only the sources (which PreNorm keeps too, as its
        residual stream) and recomputes ``h_l`` and its norm, so Block/Full AttnRes save as many
        activations as the PreNorm baseline instead of one more ``[*batch, d]`` per sublayer."""
        plain = state.schedule == "plain" and state.record is None
        if plain and self.recompute and self._fuses_read(norm):
            # one fused call: depth attention and the norm, its backward recomputing both
            srcs, _ = self.sources(state, layer)
            return depth_attention_normed(
                self.static_queries(layer),
                srcs,
                norm.weight,
                self.eps,
                norm.eps,
                heads=self.heads,
                key_norm=self.key_norm,
            )
        if not (self.recompute and torch.is_grad_enabled() and plain):
            return norm(self._attend(state, layer))
        srcs, _ = self.sources(state, layer)
        return checkpoint(lambda *s: norm(self._attend_sources(layer, *s)), *srcs, use_reentrant=False)

    def _fuses_read(self, norm: nn.Module) -> bool:
        """Whether :func:`~attention_residuals.kernels.depth_attention_normed` computes this read:
        a static softmax query and a plain ``nn.RMSNorm`` with a gain and an epsilon (a sharded
        gain, e.g. a DTensor under tensor parallelism, or a norm with hooks on it, takes the two
        ops in turn)."""
        return (
            self.query_mode == "static"
            and self.normalize == "softmax"
            and type(norm) is nn.RMSNorm
            and norm.weight is not None
            and norm.eps is not None
            and type(norm.weight.data) is torch.Tensor
            and not (norm._forward_hooks or norm._forward_pre_hooks)  # a hooked norm must run
        )

    def final_normed(self, state, norm):
        return self.read_normed(state, self.n_layers, norm)  # the readout is row L of the queries

    def read_checkpointed(self, state, layer, body):
        if state.schedule != "plain" or state.record is not None:
            return super().read_checkpointed(state, layer, body)
        srcs, _ = self.sources(state, layer)
        return checkpoint(lambda *s: body(self._attend_sources(layer, *s)), *srcs, use_reentrant=False)

    def _attend_two_phase(self, state: ResidualState, layer: int, srcs: list[torch.Tensor]) -> torch.Tensor:
        """Phase 1 once per group: every query of the group (and the final readout's, in the
        last group) over the sources already known, in one batched pass. Phase 2 per layer:
        the sources added since, merged into the phase-1 statistics by online softmax."""
        size = self.group_size()
        group = min(layer, self.n_layers - 1) // size
        if group not in state.phase1:
            layers = list(range(group * size, min((group + 1) * size, self.n_layers)))
            if layers[-1] == self.n_layers - 1:
                layers.append(self.n_layers)  # the final readout joins the last group
            batched = depth_states_batched(
                self.static_queries(layers), srcs, self.eps, heads=self.heads, key_norm=self.key_norm
            )
            state.phase1[group] = (batched, layers, len(srcs))
        batched, layers, covered = state.phase1[group]
        merged = batched[layers.index(layer)]
        rest = srcs[covered:]
        if not rest:
            return merged.output()
        return depth_attention_merged(
            merged, self.static_queries(layer), rest, self.eps, heads=self.heads, key_norm=self.key_norm
        )

    def init_state(self, embedding, schedule="plain", record=False):
        state = super().init_state(embedding, schedule, record)
        # the embedding joins the sources in the activation dtype, cast once here (under autocast
        # it is float32 while the sublayer outputs are bf16/fp16), not once per layer by the op
        embedding = embedding.to(activation_dtype([embedding]))
        state.values = [embedding]
        state.blocks = [embedding]
        return state

    def read(self, state, layer):
        return self._attend(state, layer)

    def final(self, state):
        return self._attend(state, self.n_layers)


class FullAttnRes(DepthAttentionResidual):
    """Full AttnRes: layer ``l`` attends over ``[v_0 = embedding, v_1, ..., v_l]``.

    ``block_size`` only sets the two-phase schedule's group size (the architecture has no
    blocks); by default ~8 groups.
    """

    rule = "full"
    prefix_sources = True
    options = DepthAttentionResidual.options + ("block_size", "n_blocks")

    def __init__(self, n_layers, d_model, eps=1e-6, config=None):
        super().__init__(n_layers, d_model, eps, config)
        size = resolve_block_size(n_layers, self.config.block_size, self.config.n_blocks)
        self.block_size = size or max(1, math.ceil(n_layers / 8))

    def sources(self, state, layer):
        return state.values, list(range(len(state.values)))

    def group_size(self):
        return self.block_size

    def write(self, state, layer, output):
        state.values.append(output)


class BlockAttnRes(DepthAttentionResidual):
    """Block AttnRes: sum inside blocks of ``block_size`` layers, attend across blocks.

    Layer ``l`` in block ``n`` (``n = l // S + 1``) sees ``[b_0, ..., b_{n-1}]`` and, unless it
    opens the block, the partial sum ``b_n^{i-1}``. The final readout sees every block (the
    last one possibly partial when ``S`` does not divide ``L``). Column ``j`` of the depth
    weights is block ``b_j``.
    """

    rule = "block"
    prefix_sources = True
    options = DepthAttentionResidual.options + ("block_size", "n_blocks", "intra_gate")

    def __init__(self, n_layers, d_model, eps=1e-6, config=None):
        super().__init__(n_layers, d_model, eps, config)
        size = resolve_block_size(n_layers, self.config.block_size, self.config.n_blocks)
        self.block_size = size or math.ceil(n_layers / 8)  # the report's default: N ~ 8 blocks
        intra_gate = self.config.intra_gate
        if intra_gate:
            # open problem of the critique: selectivity inside a block. b_n^i = sum_j g_j v_j with
            # g_j = 2 sigmoid(c_j), c_j zero-init (g_j = 1: plain Block AttnRes at step 0)
            self.gate_logits = nn.Parameter(torch.zeros(n_layers))
        self.intra_gate = intra_gate

    def sources(self, state, layer):
        srcs = state.blocks + ([state.partial] if state.partial is not None else [])
        return srcs, list(range(len(srcs)))

    def group_size(self):
        return self.block_size

    def write(self, state, layer, output):
        if self.intra_gate:
            output = output * (2 * torch.sigmoid(self.gate_logits[layer])).to(output.dtype)
        state.partial = output if state.partial is None else state.partial + output
        if (layer + 1) % self.block_size == 0:
            state.blocks.append(state.partial)
            state.partial = None

    def n_columns(self):
        return math.ceil(self.n_layers / self.block_size) + 1


class SlidingWindowAttnRes(DepthAttentionResidual):
    """Depth-SWA: attend over the embedding plus only the last ``window`` layer outputs."""

    rule = "swa"
    options = DepthAttentionResidual.options + ("window",)

    def __init__(self, n_layers, d_model, eps=1e-6, config=None):
        super().__init__(n_layers, d_model, eps, config)
        self.window = self.config.window

    def sources(self, state, layer):
        n = len(state.values)
        first = max(1, n - self.window)
        return [state.values[0]] + state.values[first:], [0] + list(range(first, n))

    def write(self, state, layer, output):
        state.values.append(output)
        if len(state.values) > self.window + 1:  # keep memory at O(window): drop what is out of reach
            state.values[len(state.values) - self.window - 1] = None  # type: ignore[call-overload]


class MixingResidual(Connection):
    """Input-independent mixing: ``h_l = sum_i softmax_i(s_{l,i}) v_i`` with learned scalars
    ``s`` (zero-init: the mean of the sources), i.e. AttnRes without query and keys."""

    rule = "mixing"
    has_depth_weights = True

    def __init__(self, n_layers, d_model, eps=1e-6, config=None):
        super().__init__(n_layers, d_model, eps, config)
        self.logits = nn.Parameter(torch.zeros(n_layers + 1, n_layers + 1))

    def init_state(self, embedding, schedule="plain", record=False):
        state = super().init_state(embedding, schedule, record)
        state.values = [embedding]
        return state

    def _mix(self, state, layer):
        n = len(state.values)
        w = torch.softmax(self.logits[layer, :n].float(), 0)
        if state.record is not None:
            state.record[layer] = (list(range(n)), w.detach())
        out = sum(w[i] * v.float() for i, v in enumerate(state.values))
        return out.to(state.values[0].dtype)

    def read(self, state, layer):
        return self._mix(state, layer)

    def write(self, state, layer, output):
        state.values.append(output)

    def final(self, state):
        return self._mix(state, self.n_layers)


class DenseFormerResidual(Connection):
    """DenseFormer: after every layer, a depth-weighted average of all hidden states so far,
    ``h_{l+1} = sum_{j<=l+1} a_{l,j} x_j`` with ``x_0`` the embedding and ``x_{j+1} = h_j + v_j``.
    Initialised to ``a_{l,l+1} = 1`` (others 0), i.e. exactly the PreNorm baseline at step 0."""

    rule = "denseformer"

    def __init__(self, n_layers, d_model, eps=1e-6, config=None):
        super().__init__(n_layers, d_model, eps, config)
        init = torch.zeros(n_layers, n_layers + 1)
        init[torch.arange(n_layers), torch.arange(1, n_layers + 1)] = 1.0
        self.weights = nn.Parameter(init)

    def init_state(self, embedding, schedule="plain", record=False):
        state = super().init_state(embedding, schedule, record)
        state.values, state.h = [embedding], embedding
        return state

    def read(self, state, layer):
        return state.h

    def write(self, state, layer, output):
        state.values.append(state.h + output)
        a = self.weights[layer]
        state.h = sum(a[j] * x for j, x in enumerate(state.values))

    def final(self, state):
        return state.h


class MHCLiteResidual(Connection):
    """mHC-lite: ``m`` residual streams ``H`` (``[*batch, m, d]``), per layer and token::

        x      = sum_k pre_k H_k                      (the layer input)
        H'_j   = sum_k A_kj H_k + post_j v            (A doubly stochastic)

    with ``pre = sigmoid(.)``, ``post = 2 sigmoid(.)`` and ``A = sum_p softmax(.)_p P_p`` over
    the ``m!`` permutation matrices ``P_p`` (Birkhoff: exactly doubly stochastic). All three are
    ``bias + RMSNorm(vec H) @ W`` (``W`` zero-init: static at step 0). The streams start as
    copies of the embedding and ``pre = 1/m``, ``post = 1``, so at init it is the PreNorm
    baseline. The output is the mean of the streams. The streams sit token-major, so ``vec H`` is
    a view and the mixes are batched matmuls; ``RMSNorm(vec H) @ W = r (vec H @ W)`` with the
    per-token scalar ``r``, so the normalised copy of all streams is never built.
    """

    rule = "mhc"
    options = ("streams",)

    def __init__(self, n_layers, d_model, eps=1e-6, config=None):
        super().__init__(n_layers, d_model, eps, config)
        streams = self.config.streams
        if not 1 <= streams <= 6:
            raise ValueError(f"streams: expected 1..6 (m! permutations are enumerated), got {streams}")
        m = streams
        perms = list(itertools.permutations(range(m)))
        eye = torch.eye(m)
        self.register_buffer("perms", torch.stack([eye[list(p)] for p in perms]), persistent=False)
        self.m, self.n_perm = m, len(perms)
        width = 2 * m + self.n_perm
        self.proj = nn.Parameter(torch.zeros(n_layers, m * d_model, width))
        bias = torch.zeros(n_layers, width)
        bias[:, :m] = math.log(1 / m / (1 - 1 / m)) if m > 1 else 10.0  # sigmoid(.) = 1/m
        bias[:, 2 * m] = math.log(max(self.n_perm - 1, 1))  # the identity permutation gets weight 1/2
        self.bias = nn.Parameter(bias)

    def init_state(self, embedding, schedule="plain", record=False):
        state = super().init_state(embedding, schedule, record)
        state.streams = embedding.unsqueeze(-2).expand(*embedding.shape[:-1], self.m, embedding.shape[-1])
        return state

    def read(self, state, layer):
        H = state.streams  # [*batch, m, d]
        m = self.m
        flat = H.flatten(-2)  # vec H, [*batch, m*d]
        r = torch.rsqrt(
            torch.linalg.vector_norm(flat, dim=-1, keepdim=True).square() / flat.shape[-1] + self.eps
        )
        coef = (flat @ self.proj[layer]) * r + self.bias[layer]
        pre = torch.sigmoid(coef[..., :m])
        post = 2 * torch.sigmoid(coef[..., m : 2 * m])
        mix = torch.softmax(coef[..., 2 * m :].float(), -1).to(H.dtype)
        A = (mix @ self.perms.to(H.dtype).flatten(1)).unflatten(-1, (m, m))  # sum_p mix_p P_p
        state.pending = (post, A)
        return (pre.unsqueeze(-2) @ H).squeeze(-2)

    def write(self, state, layer, output):
        post, A = state.pending
        state.streams = A.transpose(-1, -2) @ state.streams + post.unsqueeze(-1) * output.unsqueeze(-2)
        state.pending = None

    def final(self, state):
        return state.streams.mean(-2)


def resolve_block_size(n_layers: int, block_size: int | None, n_blocks: int | None) -> int | None:
    """Block size ``S`` (in sublayers) from ``block_size`` or ``n_blocks``; checks it fits."""
    if block_size is not None and n_blocks is not None:
        raise ValueError("block_size and n_blocks: give one of them, not both")
    if n_blocks is not None:
        if not 1 <= n_blocks <= n_layers:
            raise ValueError(f"n_blocks: must be in 1..L={n_layers}, got {n_blocks}")
        size = math.ceil(n_layers / n_blocks)  # N blocks of S, the last one possibly partial
        if math.ceil(n_layers / size) != n_blocks:  # e.g. L = 18, N = 8: S = 3 makes 6 blocks
            fits = sorted({math.ceil(n_layers / s) for s in range(1, n_layers + 1)})
            raise ValueError(
                f"n_blocks: {n_blocks} blocks do not fit L={n_layers} sublayers (blocks of "
                f"S=ceil(L/N)={size} make {math.ceil(n_layers / size)}); n_blocks that fit: {fits}, "
                "or give block_size"
            )
        return size
    if block_size is not None and not 1 <= block_size <= n_layers:
        raise ValueError(
            f"block_size: must be in 1..L={n_layers} sublayers (L = 2 * n_layer), got {block_size}"
        )
    return block_size


#: the registry of depth-mixing rules: name -> class (a class names itself in ``rule``)
RULES: dict[str, type[Connection]] = {
    cls.rule: cls
    for cls in (
        PreNormResidual,
        FullAttnRes,
        BlockAttnRes,
        DenseFormerResidual,
        MHCLiteResidual,
        SlidingWindowAttnRes,
        MixingResidual,
    )
}
RESIDUALS = tuple(RULES)


def make_connection(
    residual: str | ResidualConfig,
    n_layers: int,
    d_model: int,
    eps: float = 1e-6,
    *,
    random_init: bool = True,
    **options: Any,
) -> Connection:
    """Build the depth-mixing rule ``residual`` (a name of :data:`RESIDUALS` plus the
    :class:`ResidualConfig` options as keywords, or a ``ResidualConfig``) for ``n_layers`` sublayers
    of width ``d_model``, its random values drawn (:meth:`Connection.init_random`) unless
    ``random_init=False``: a model that draws its own weights first calls that itself, after them."""
    for old, new in LEGACY_NAMES.items():
        if old in options:
            raise TypeError(f"make_connection: {old}= is now {new}= ({new!r}: see ResidualConfig)")
    check_number("n_layers", n_layers, integer=True, ge=1)
    check_number("d_model", d_model, integer=True, ge=1)
    check_number("eps", eps, ge=0)
    if isinstance(residual, ResidualConfig):
        if options:
            residual = residual.replace(**options)
        config = residual
    else:
        config = ResidualConfig(residual, **options)
    resolve_block_size(n_layers, config.block_size, config.n_blocks)
    connection = RULES[config.rule](n_layers, d_model, eps, config)
    if random_init:
        connection.init_random()
    return connection
