"""Floor 4: a decoder-only language model that takes any depth-mixing rule.

Token embedding -> L sublayers (attention and MLP alternate; each is its own layer with its own
input RMSNorm) wired by the rule ``config.residual`` -> final RMSNorm -> LM head. Attention is causal
``F.scaled_dot_product_attention`` with rotary positions; the MLP is SwiGLU. The residual wiring
is the only thing that changes between the baseline and AttnRes::

    v_0 = embed(idx)
    h_l = residual.read(state, l)          # PreNorm: h_{l-1} + v_{l-1};  AttnRes: sum_i alpha_{i->l} v_i
    v_l = f_l(RMSNorm_l(h_l))
    logits = lm_head(RMSNorm(residual.final(state)))
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from .connections import LEGACY_NAMES, ResidualConfig, make_connection, resolve_block_size
from .typed import check_field_types, check_number, option

__all__ = ["GPTConfig", "GPT", "KVCache", "check_sampling", "sample_token"]


@dataclass
class GPTConfig:
    """Model shape and depth-mixing rule.

    ``residual`` is a :class:`~attention_residuals.connections.ResidualConfig` (the rule and its
    options); a rule name is taken as ``ResidualConfig(name)``, and the rule options may be given
    flat as a convenience — ``GPTConfig(residual="block", n_blocks=8)`` is
    ``GPTConfig(residual=ResidualConfig("block", n_blocks=8))``. ``seq_len`` is the context length;
    the AttnRes ``block_size`` is counted in sublayers (L = 2 * n_layer), unlike nanoGPT where
    block_size is the context length. ``mlp_hidden=None`` means the default width; ``rope_theta``,
    ``norm_eps`` and ``init_std`` must be finite and > 0.
    """

    vocab_size: int = option(256, "vocabulary size (256 for byte tokens)")
    n_layer: int = option(4, "transformer blocks (L = 2 * n_layer sublayers: attention and MLP)")
    n_head: int = option(4, "attention heads")
    d_model: int = option(128, "model width")
    seq_len: int = option(256, "context length in tokens")
    residual: ResidualConfig = field(default_factory=ResidualConfig)
    mlp_hidden: int | None = option(None, "SwiGLU hidden width (default 8/3 d_model rounded up to 64)")
    rope_theta: float = option(10000.0, "RoPE base")
    norm_eps: float = option(1e-6, "RMSNorm epsilon")
    init_std: float = option(0.02, "std of the normal initialisation")
    tie_embeddings: bool = option(False, "tie the LM head to the token embedding")

    def __post_init__(self) -> None:
        if isinstance(self.residual, str):
            self.residual = ResidualConfig(self.residual)
        elif isinstance(self.residual, dict):
            self.residual = ResidualConfig.from_dict(self.residual)
        elif not isinstance(self.residual, ResidualConfig):
            raise ValueError(f"residual: expected a rule name or a ResidualConfig, got {self.residual!r}")

    @property
    def n_sublayers(self) -> int:
        return 2 * self.n_layer

    @property
    def hidden(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return 64 * math.ceil(8 * self.d_model / 3 / 64)

    def validate(self) -> GPTConfig:
        """Raise ``ValueError`` naming the field if the configuration cannot be built."""
        check_field_types(self)
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if self.mlp_hidden is not None and self.mlp_hidden < 1:
            raise ValueError(
                "mlp_hidden: expected a positive integer, or None for the default "
                f"(8/3 * d_model rounded up to a multiple of 64), got {self.mlp_hidden!r}"
            )
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise ValueError(
                f"n_head: d_model={self.d_model} must split into n_head={self.n_head} even-sized heads"
            )
        resolve_block_size(self.n_sublayers, self.residual.block_size, self.residual.n_blocks)
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> GPTConfig:
        """From :meth:`to_dict`, or the flat form of earlier runs (``"residual": "block"`` beside
        ``"n_blocks"``, ``"heads"``...): every committed ``config.json`` keeps loading."""
        data = dict(data)
        residual = data.pop("residual", None)
        residual = residual.to_dict() if isinstance(residual, ResidualConfig) else residual
        flat = {k: data.pop(k) for k in list(data) if k in _RESIDUAL_KEYS}
        if isinstance(residual, dict):
            flat = {**residual, **flat}
        elif residual is not None:
            flat["rule"] = residual
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"GPTConfig: unknown fields {sorted(unknown)}")
        return cls(**data, residual=ResidualConfig.from_dict(flat))


_RESIDUAL_KEYS = {f.name for f in fields(ResidualConfig)} | set(LEGACY_NAMES)
_dataclass_init = GPTConfig.__init__


def _init_with_flat_options(self: GPTConfig, *args, **kwargs) -> None:
    """The generated ``__init__``, also taking the rule options flat (``n_blocks=8``): they are
    folded into ``residual``. An old name (``heads``) is a TypeError naming the new one."""
    for old, new in LEGACY_NAMES.items():
        if old in kwargs and old != "residual":
            raise TypeError(f"GPTConfig: {old}= is now {new}= (see ResidualConfig)")
    flat = {k: kwargs.pop(k) for k in list(kwargs) if k in _RESIDUAL_KEYS and k != "residual"}
    _dataclass_init(self, *args, **kwargs)
    if flat:
        self.residual = self.residual.replace(**flat)


GPTConfig.__init__ = _init_with_flat_options  # type: ignore[method-assign]


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[seq_len, head_dim / 2]`` for rotary position embedding."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x_{2i}, x_{2i+1})`` of ``x`` ``[B, H, T, hd]`` by position-dependent angles."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


class KVCache:
    """Pre-allocated keys and values of every attention sublayer for incremental decoding."""

    def __init__(self, n_attn: int, batch: int, n_head: int, max_len: int, head_dim: int, device, dtype):
        shape = (n_attn, batch, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0  # tokens already cached
        self.max_len = max_len

    def update(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.length, self.length + k.shape[2]
        self.k[index, :, :, start:end] = k
        self.v[index, :, :, start:end] = v
        return self.k[index, :, :, :end], self.v[index, :, :, :end]

    def attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store the new tokens' ``k``, ``v`` ``[B, H, T, hd]`` after the cached ones and attend
        ``q`` over them all: every cached token and the causal part of the new ones. (A cache
        owns this step so that a sharded cache can replace it: ``parallel.kv``.)"""
        past = self.length
        k, v = self.update(index, k, v)
        if past == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        T = q.shape[2]
        mask = torch.ones(T, past + T, dtype=torch.bool, device=q.device).tril(past)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def advance(self, tokens: int) -> None:
        """Count ``tokens`` more as cached (after every attention sublayer stored them)."""
        self.length += tokens


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, index: int) -> None:
        super().__init__()
        self.n_head, self.head_dim, self.index = config.n_head, config.d_model // config.n_head, index
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x, cos, sin, cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = cache.attend(self.index, q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(config.d_model, 2 * config.hidden, bias=False)
        self.down = nn.Linear(config.hidden, config.d_model, bias=False)

    def forward(self, x, *unused) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Sublayer:
    """``h -> f_l(RMSNorm_l(h))`` for activation checkpointing (a plain callable, no KV cache:
    only training recomputes)."""

    def __init__(self, layer: nn.Module, norm: nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.layer, self.norm, self.cos, self.sin = layer, norm, cos, sin

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.layer(self.norm(h), self.cos, self.sin)


def check_sampling(temperature: float, top_k: int | None) -> None:
    """``ValueError`` naming the argument unless ``temperature`` is finite and >= 0 (a negative
    one would sample the least likely tokens, NaN or inf garbage) and ``top_k`` an int >= 1 or
    None."""
    check_number("temperature", temperature, ge=0)
    check_number("top_k", top_k, integer=True, optional=True, ge=1)


def sample_token(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """Next token ids ``[B, 1]`` from ``logits`` ``[B, vocab]`` (float32 softmax):
    ``temperature=0`` is greedy, ``top_k`` keeps the k most likely."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)


class GPT(nn.Module):
    """Decoder-only LM; ``config.residual`` picks the depth-mixing rule (see connections)."""

    #: recompute every sublayer in backward (``attnres train --activation-checkpointing``)
    activation_checkpointing: bool = False

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config.validate()
        c = config
        L = c.n_sublayers
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList(
            CausalSelfAttention(c, l // 2) if l % 2 == 0 else SwiGLU(c) for l in range(L)
        )
        self.norms = nn.ModuleList(nn.RMSNorm(c.d_model, eps=c.norm_eps) for _ in range(L))
        self.residual = make_connection(c.residual, L, c.d_model, c.norm_eps, random_init=False)
        self.norm_f = nn.RMSNorm(c.d_model, eps=c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        cos, sin = rope_tables(c.seq_len, c.d_model // c.n_head, c.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _init_weights(self) -> None:
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
        # scale the projections that write into the residual stream by depth (GPT-2 style)
        for layer in self.layers:
            out = layer.proj if isinstance(layer, CausalSelfAttention) else layer.down
            nn.init.normal_(out.weight, mean=0.0, std=std / math.sqrt(len(self.layers)))
        self.residual.init_random()  # last: a random query init leaves every other weight as its twin's

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: ``6 N`` for the matmuls (N non-embedding params, LM head
        included) plus ``12 n_layer d T`` for attention scores and values (Kaplan/PaLM form)."""
        c, T = self.config, seq_len or self.config.seq_len
        n = self.num_params(non_embedding=True)
        return 6.0 * n + 12.0 * c.n_layer * c.d_model * T

    def _check_ids(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> None:
        """``idx``: int64/int32 token ids ``[B, T]``, ``B, T >= 1``, every id in ``0..vocab_size-1``;
        ``targets`` (if given): integer ids of the same shape in ``0..vocab_size-1`` or ``-1``
        (ignored positions).

        The range check is one min/max reduction read back to the host, so it runs on CPU tensors
        only (on a GPU it would cost a device sync per step, and an id out of range trips the
        embedding's device-side assert there anyway) and not while ``torch.compile`` traces.
        """
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"idx: expected a torch.Tensor of token ids [B, T], got {type(idx).__name__}")
        if idx.ndim != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"idx: expected integer token ids of shape [B, T], got {tuple(idx.shape)} {idx.dtype}"
            )
        if idx.shape[0] < 1 or idx.shape[1] < 1:
            raise ValueError(
                f"idx: expected at least one sequence and one token (B, T >= 1), got shape {tuple(idx.shape)}"
            )
        if targets is not None:
            if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int64, torch.int32):
                got = targets.dtype if isinstance(targets, torch.Tensor) else type(targets).__name__
                raise ValueError(f"targets: expected integer token ids (int64 or int32), got {got}")
            if targets.shape != idx.shape:
                raise ValueError(f"targets: expected shape {tuple(idx.shape)}, got {tuple(targets.shape)}")
        if torch.compiler.is_compiling() or idx.device.type != "cpu":
            return
        ranges = [torch.aminmax(idx)] + ([torch.aminmax(targets)] if targets is not None else [])
        bounds = torch.stack([v.long() for r in ranges for v in r]).tolist()  # one host read
        top = self.config.vocab_size - 1
        if bounds[0] < 0 or bounds[1] > top:
            raise ValueError(
                f"idx: token ids must be in 0..vocab_size-1={top}, got ids in {bounds[0]}..{bounds[1]}"
            )
        if targets is not None and (bounds[2] < -1 or bounds[3] > top):
            raise ValueError(
                f"targets: token ids must be in 0..vocab_size-1={top} (or -1 to ignore a position), "
                f"got ids in {bounds[2]}..{bounds[3]}"
            )
        if targets is not None and bounds[3] == -1:
            raise ValueError("targets: every position is -1 (ignored): the loss would be 0/0")

    def _run(
        self,
        idx: torch.Tensor,
        schedule: str = "plain",
        cache: KVCache | None = None,
        record: bool = False,
        check: bool = True,
    ) -> tuple[torch.Tensor, dict | None]:
        if check:
            self._check_ids(idx)
        B, T = idx.shape
        start = cache.length if cache is not None else 0
        if start + T > self.config.seq_len:
            raise ValueError(
                f"idx: {start + T} tokens exceed the context length seq_len={self.config.seq_len}"
            )
        cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]
        x = self.embed(idx)
        state = self.residual.init_state(x, schedule=schedule, record=record)
        for l, (layer, norm) in enumerate(zip(self.layers, self.norms, strict=False)):
            if self.activation_checkpointing and torch.is_grad_enabled():
                v = self.residual.read_checkpointed(state, l, Sublayer(layer, norm, cos, sin))
            else:
                v = layer(self.residual.read_normed(state, l, norm), cos, sin, cache)  # f_l(RMSNorm_l(h_l))
            self.residual.write(state, l, v)
        out = self.residual.final_normed(state, self.norm_f)
        if cache is not None:
            cache.advance(T)
        return out, state.record

    def forward_hidden(
        self, idx: torch.Tensor, cache: KVCache | None = None, schedule: str = "plain"
    ) -> torch.Tensor:
        """Final normalised hidden states ``[B, T, d]`` (what the LM head sees); with ``cache``
        the tokens continue the cached prefix and are appended to it."""
        return self._run(idx, schedule, cache)[0]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, schedule: str = "plain"):
        """``model(idx)`` -> logits ``[B, T, vocab]``; with ``targets`` -> ``(logits, loss)``.

        ``schedule="two_phase"``: the exact two-phase block schedule (static queries only).
        """
        self._check_ids(idx, targets)
        hidden, _ = self._run(idx, schedule, check=False)
        logits = self.lm_head(hidden)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.long().flatten(), ignore_index=-1)
        return logits, loss

    def new_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        c = self.config
        p = self.lm_head.weight
        return KVCache(
            c.n_layer, batch, c.n_head, max_len or c.seq_len, c.d_model // c.n_head, p.device, p.dtype
        )

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        schedule: str | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after ``idx`` ``[B, T]``; ``temperature=0`` is greedy.

        With ``use_cache`` (default) the prompt is prefilled once and every new token costs one
        position through the network (KV cache); without it the whole prefix is recomputed. The
        prefill runs ``schedule`` (default :meth:`inference_schedule`: the exact two-phase schedule
        where the rule has it); the tokens after it, one position each, the plain one.
        """
        check_number("max_new_tokens", max_new_tokens, integer=True, ge=0)
        check_sampling(temperature, top_k)
        self._check_ids(idx)  # once: the sampled ids are in range by construction
        if idx.shape[1] + max_new_tokens > self.config.seq_len:
            raise ValueError(
                f"max_new_tokens: prompt ({idx.shape[1]}) + {max_new_tokens} new tokens exceed seq_len={self.config.seq_len}"
            )
        cache = self.new_cache(idx.shape[0]) if use_cache else None
        pending = idx
        prefill = self.inference_schedule() if schedule is None else schedule
        for i in range(max_new_tokens):
            run_schedule = prefill if i == 0 or not use_cache else "plain"
            hidden, _ = self._run(pending if use_cache else idx, run_schedule, cache, check=False)
            nxt = sample_token(self.lm_head(hidden[:, -1]), temperature, top_k, generator)
            idx = torch.cat([idx, nxt], dim=1)
            pending = nxt
        return idx

    def inference_schedule(self) -> str:
        """The fastest exact schedule for a forward without gradients: ``"two_phase"`` when the rule
        supports it (static softmax queries: one batched read of a block's sources for all its
        layers, the report's section 4), else ``"plain"``."""
        return "two_phase" if self.residual.supports_two_phase else "plain"

    @torch.no_grad()
    def depth_weights(self, idx: torch.Tensor, per_head: bool = False) -> torch.Tensor:
        """Learned depth-attention weights averaged over batch and tokens (and heads).

        Returns ``[L + 1, n_columns]`` (``[L + 1, n_columns, heads]`` with ``per_head``): row ``l``
        is sublayer ``l`` (even rows: pre-attention, odd rows: pre-MLP), the last row the final
        readout; column ``j`` is source ``j`` (Full: ``v_j``; Block: block ``b_j``); NaN where a
        layer has no such source.
        """
        _, record = self._run(idx, record=True)
        heads = getattr(self.residual, "heads", 1)
        out = torch.full((self.residual.n_layers + 1, self.residual.n_columns(), heads), float("nan"))
        for layer, (cols, w) in record.items():
            out[layer, cols] = (w if w.ndim == 2 else w[:, None]).float().cpu()
        return out if per_head else out.mean(-1)
