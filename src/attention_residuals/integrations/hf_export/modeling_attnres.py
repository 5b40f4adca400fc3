"""An Attention Residuals (AttnRes) causal LM for ``transformers``; imports only torch and transformers.

The same network as ``attention_residuals.GPT`` (same parameter names under ``model.``, same
operations in the same order, so the logits match it exactly when the GPT runs its reference
depth-attention formula): token embedding -> ``2 n_layer`` sublayers (causal attention with RoPE,
SwiGLU MLP, each with its own input RMSNorm) wired by a depth-mixing rule -> final RMSNorm -> LM head::

    v_0 = embed(ids)
    h_l = rule.read(state, l)            # prenorm: h_{l-1} + v_{l-1};  AttnRes: sum_i alpha_{i->l} v_i
    v_l = sublayer_l(RMSNorm_l(h_l))
    logits = lm_head(RMSNorm(rule.final(state)))

Every rule of the package is here: ``prenorm``, ``full``, ``block``, ``swa`` (with static / input /
lowrank queries, softmax or sigmoid, depth heads, key norm and its gain, Block's intra gate),
``mixing``, ``denseformer`` and ``mhc``. Depth attention mixes each token's own earlier
representations only, so padding concerns the sequence attention alone: ``attention_mask`` (left or
right padding) masks padded keys, and positions come from ``position_ids`` (``generate`` derives
them from the mask, so a left-padded row sees the positions it would see unpadded).

``output_hidden_states``: the input of each decoder block before its norm (``h_0`` = the
embedding, ``h_2``, ..., ``h_{L-2}``) and the final normalised output, ``n_layer + 1`` tensors as
in Llama. ``output_attentions``: the sequence attention weights ``[B, heads, T, S]`` per attention
sublayer (computed eagerly when asked). Positions past ``max_position_embeddings`` (the training
context) are computed (RoPE extrapolates; quality there is not what training measured).

Schedule: prefill and decode here run the plain schedule (one depth read per sublayer, the KV
cache for the sequence attention); the exact two-phase block schedule of
``attention_residuals.GPT`` (``attnres sample``) is not part of this file, which depends on torch
and transformers only. :meth:`AttnResForCausalLM.inference_schedule` says so programmatically.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_attnres import AttnResConfig, block_size_of

try:  # transformers >= 5: init functions that skip tensors already loaded
    from transformers import initialization as _init
except ImportError:  # pragma: no cover
    _init = types.SimpleNamespace(
        copy_=lambda t, v: t.data.copy_(v),
        normal_=nn.init.normal_,
        ones_=nn.init.ones_,
        zeros_=nn.init.zeros_,
    )

__all__ = ["AttnResConfig", "AttnResForCausalLM", "AttnResModel", "AttnResPreTrainedModel"]

_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


# --------------------------------------------------------------------------- the math


def rope_tables(n: int, head_dim: int, theta: float, device=None, start: int = 0):
    """cos/sin ``[n - start, head_dim / 2]`` of positions ``start..n-1``."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(start, n, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x_{2i}, x_{2i+1})`` of ``x`` ``[B, H, T, hd]`` by their positions' angles."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight=None, eps=eps)


def _activation_dtype(sources: list[torch.Tensor]) -> torch.dtype:
    """Autocast's dtype under autocast (float64 excepted), else the promoted dtype of the sources."""
    dtypes = [s.dtype for s in sources]
    kind = sources[0].device.type
    with contextlib.suppress(RuntimeError):
        if torch.float64 not in dtypes and torch.is_autocast_enabled(kind):
            return torch.get_autocast_dtype(kind)
    return functools.reduce(torch.promote_types, dtypes)


def _no_autocast(kind: str):
    with contextlib.suppress(RuntimeError):
        if torch.is_autocast_enabled(kind):
            return torch.autocast(kind, enabled=False)
    return contextlib.nullcontext()


def depth_attention(query, sources, eps, heads=1, key_norm=True, normalize="softmax") -> torch.Tensor:
    """``sum_i softmax_i(q . RMSNorm(v_i)) v_i`` over the list ``sources`` (each ``[*batch, d]``).

    Sources read in the activation dtype, logits / softmax / weighted sum in float32 (float64 for
    float64), output rounded once to the activation dtype. ``heads`` splits d into groups with a
    softmax each; ``normalize="sigmoid"`` gates each source on its own.
    """
    act = _activation_dtype(sources)
    acc = torch.promote_types(act, torch.float32)
    with _no_autocast(sources[0].device.type):
        v = torch.stack([s.to(act) for s in sources]).to(act).to(acc)
        d = v.shape[-1]
        keys = v.unflatten(-1, (heads, d // heads))
        if key_norm:
            keys = rms_norm(keys, eps)
        z = (keys * query.to(acc).unflatten(-1, (heads, d // heads))).sum(-1)
        w = torch.softmax(z, dim=0) if normalize == "softmax" else torch.sigmoid(z)
        w = w.repeat_interleave(d // heads, dim=-1) if heads > 1 else w
        out = (w * v).sum(0)
    return out.to(act)


# --------------------------------------------------------------------------- depth-mixing rules


class _State:
    """Per-forward state of a rule (which fields are used depends on the rule)."""

    def __init__(self, embedding: torch.Tensor) -> None:
        self.h = embedding
        self.values = [embedding]
        self.blocks = [embedding]
        self.partial = None
        self.streams = None
        self.pending = None


class _Rule(nn.Module):
    """A depth-mixing rule for ``n`` sublayers of width ``d`` (``read`` / ``write`` / ``final``)."""

    def __init__(self, n: int, d: int, eps: float, options: dict) -> None:
        super().__init__()
        self.n_layers, self.d_model, self.eps, self.options = n, d, eps, options

    def init_state(self, embedding: torch.Tensor) -> _State:
        return _State(embedding)

    def reset_parameters(self) -> None:
        """The rule's initial parameters (through ``transformers.initialization``: loaded ones stay)."""


class PreNorm(_Rule):
    def read(self, state, layer):
        return state.h

    def write(self, state, layer, output):
        state.h = state.h + output

    def final(self, state):
        return state.h


class DepthAttention(_Rule):
    """Full / Block / SWA AttnRes: layer ``l`` attends over its sources with pseudo-query ``w_l``."""

    def __init__(self, n, d, eps, options, rule: str) -> None:
        super().__init__(n, d, eps, options)
        self.rule = rule
        self.queries = nn.Parameter(torch.zeros(n + 1, d))
        if options["key_norm_gain"]:
            self.key_gain = nn.Parameter(torch.ones(n + 1, d))
        if options["query"] == "input":
            self.query_proj = nn.Parameter(torch.zeros(n + 1, d, d))
        if options["query"] == "lowrank":
            self.query_down = nn.Parameter(torch.randn(n + 1, d, options["query_rank"]) / math.sqrt(d))
            self.query_up = nn.Parameter(torch.zeros(n + 1, options["query_rank"], d))
        size = block_size_of(n, options)
        self.block_size = size or (math.ceil(n / 8) if rule == "block" else max(1, math.ceil(n / 8)))
        if rule == "block" and options["intra_gate"]:
            self.gate_logits = nn.Parameter(torch.zeros(n))

    def reset_parameters(self) -> None:
        if self.options["query_init_std"] > 0:
            _init.normal_(self.queries, mean=0.0, std=self.options["query_init_std"])
        else:
            _init.zeros_(self.queries)
        if hasattr(self, "key_gain"):
            _init.ones_(self.key_gain)
        if hasattr(self, "query_proj"):
            _init.zeros_(self.query_proj)
        if hasattr(self, "query_down"):
            _init.normal_(self.query_down, mean=0.0, std=1 / math.sqrt(self.d_model))
            _init.zeros_(self.query_up)
        if hasattr(self, "gate_logits"):
            _init.zeros_(self.gate_logits)

    def sources(self, state, layer):
        if self.rule == "block":
            return state.blocks + ([state.partial] if state.partial is not None else [])
        if self.rule == "swa":
            n = len(state.values)
            return [state.values[0]] + state.values[max(1, n - self.options["window"]) :]
        return state.values

    def query(self, layer, sources):
        w = self.queries[layer]
        if self.options["key_norm_gain"]:
            w = w * self.key_gain[layer]
        if self.options["query"] == "input":
            w = w + rms_norm(sources[-1], self.eps) @ self.query_proj[layer].T / self.d_model
        elif self.options["query"] == "lowrank":
            down, up = self.query_down[layer], self.query_up[layer]
            w = w + rms_norm(sources[-1], self.eps) @ down @ up / up.shape[0]
        return w

    def read(self, state, layer):
        srcs = self.sources(state, layer)
        o = self.options
        return depth_attention(
            self.query(layer, srcs), srcs, self.eps, o["depth_heads"], o["key_norm"], o["normalize"]
        )

    def write(self, state, layer, output):
        if self.rule != "block":
            state.values.append(output)
            return
        if hasattr(self, "gate_logits"):
            output = output * (2 * torch.sigmoid(self.gate_logits[layer])).to(output.dtype)
        state.partial = output if state.partial is None else state.partial + output
        if (layer + 1) % self.block_size == 0:
            state.blocks.append(state.partial)
            state.partial = None

    def final(self, state):
        return self.read(state, self.n_layers)


class Mixing(_Rule):
    """``h_l = sum_i softmax_i(s_{l,i}) v_i`` with learned scalars (AttnRes without query and keys)."""

    def __init__(self, n, d, eps, options) -> None:
        super().__init__(n, d, eps, options)
        self.logits = nn.Parameter(torch.zeros(n + 1, n + 1))

    def reset_parameters(self) -> None:
        _init.zeros_(self.logits)

    def read(self, state, layer):
        w = torch.softmax(self.logits[layer, : len(state.values)].float(), 0)
        return sum(w[i] * v.float() for i, v in enumerate(state.values)).to(state.values[0].dtype)

    def write(self, state, layer, output):
        state.values.append(output)

    def final(self, state):
        return self.read(state, self.n_layers)


class DenseFormer(_Rule):
    """A depth-weighted average of every hidden state after each layer (DenseFormer)."""

    def __init__(self, n, d, eps, options) -> None:
        super().__init__(n, d, eps, options)
        self.weights = nn.Parameter(self._identity())

    def _identity(self) -> torch.Tensor:
        n = self.n_layers
        w = torch.zeros(n, n + 1)
        w[torch.arange(n), torch.arange(1, n + 1)] = 1.0
        return w

    def reset_parameters(self) -> None:
        _init.copy_(self.weights, self._identity())

    def read(self, state, layer):
        return state.h

    def write(self, state, layer, output):
        state.values.append(state.h + output)
        a = self.weights[layer]
        state.h = sum(a[j] * x for j, x in enumerate(state.values))

    def final(self, state):
        return state.h


class MHCLite(_Rule):
    """mHC-lite: ``m`` residual streams mixed by convex combinations of permutation matrices."""

    def __init__(self, n, d, eps, options) -> None:
        super().__init__(n, d, eps, options)
        m = self.m = options["streams"]
        self.register_buffer("perms", self._perms(), persistent=False)
        self.n_perm = math.factorial(m)
        self.proj = nn.Parameter(torch.zeros(n, m * d, 2 * m + self.n_perm))
        self.bias = nn.Parameter(self._bias())

    def _perms(self) -> torch.Tensor:
        eye = torch.eye(self.m)
        return torch.stack([eye[list(p)] for p in itertools.permutations(range(self.m))])

    def _bias(self) -> torch.Tensor:
        m, n_perm = self.m, math.factorial(self.m)
        bias = torch.zeros(self.n_layers, 2 * m + n_perm)
        bias[:, :m] = math.log(1 / m / (1 - 1 / m)) if m > 1 else 10.0
        bias[:, 2 * m] = math.log(max(n_perm - 1, 1))
        return bias

    def reset_parameters(self) -> None:
        _init.copy_(self.perms, self._perms())
        _init.zeros_(self.proj)
        _init.copy_(self.bias, self._bias())

    def init_state(self, embedding):
        state = _State(embedding)
        state.streams = embedding.unsqueeze(-2).expand(*embedding.shape[:-1], self.m, embedding.shape[-1])
        return state

    def read(self, state, layer):
        H, m = state.streams, self.m
        flat = H.flatten(-2)
        r = torch.rsqrt(
            torch.linalg.vector_norm(flat, dim=-1, keepdim=True).square() / flat.shape[-1] + self.eps
        )
        coef = (flat @ self.proj[layer]) * r + self.bias[layer]
        pre = torch.sigmoid(coef[..., :m])
        post = 2 * torch.sigmoid(coef[..., m : 2 * m])
        mix = torch.softmax(coef[..., 2 * m :].float(), -1).to(H.dtype)
        A = (mix @ self.perms.to(H.dtype).flatten(1)).unflatten(-1, (m, m))
        state.pending = (post, A)
        return (pre.unsqueeze(-2) @ H).squeeze(-2)

    def write(self, state, layer, output):
        post, A = state.pending
        state.streams = A.transpose(-1, -2) @ state.streams + post.unsqueeze(-1) * output.unsqueeze(-2)
        state.pending = None

    def final(self, state):
        return state.streams.mean(-2)


def make_rule(config: AttnResConfig) -> _Rule:
    options, n, d, eps = config.residual, 2 * config.n_layer, config.d_model, config.norm_eps
    rule = options["rule"]
    if rule in ("full", "block", "swa"):
        return DepthAttention(n, d, eps, options, rule)
    return {"prenorm": PreNorm, "mixing": Mixing, "denseformer": DenseFormer, "mhc": MHCLite}[rule](
        n, d, eps, options
    )


# --------------------------------------------------------------------------- sublayers and model


class Attention(nn.Module):
    """Causal self-attention with RoPE; keys/values go through a ``transformers`` Cache when given."""

    def __init__(self, config: AttnResConfig, index: int) -> None:
        super().__init__()
        self.n_head, self.head_dim, self.index = config.n_head, config.d_model // config.n_head, index
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x, cos, sin, cache=None, past=0, mask=None, weights=None):
        """``mask``: None (causal after ``past`` cached tokens) or a boolean ``[B, 1, T, S]`` (True:
        attend). ``weights``: a list to append the attention weights to (computed eagerly)."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.index)
            k, v = k[:, :, : past + T], v[:, :, : past + T]  # a static cache returns its whole buffer
        if mask is None and (weights is not None or past > 0):
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
        if weights is not None:
            scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(self.head_dim)
            p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            weights.append(p)
            y = (p @ v.float()).to(q.dtype)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU."""

    def __init__(self, config: AttnResConfig) -> None:
        super().__init__()
        hidden = config.mlp_hidden or 64 * math.ceil(8 * config.d_model / 3 / 64)
        self.gate_up = nn.Linear(config.d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, config.d_model, bias=False)

    def forward(self, x, *unused, **unused_kw) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class AttnResModel(nn.Module):
    """The network (``attention_residuals.GPT``'s modules and names), LM head included."""

    gradient_checkpointing = False  # set by PreTrainedModel.gradient_checkpointing_enable

    def __init__(self, config: AttnResConfig) -> None:
        super().__init__()
        c, L = config, 2 * config.n_layer
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList(Attention(c, l // 2) if l % 2 == 0 else MLP(c) for l in range(L))
        for layer in self.layers:  # the projections writing into the residual stream: init scaled by depth
            (layer.proj if isinstance(layer, Attention) else layer.down)._attnres_writes_residual = True
        self.norms = nn.ModuleList(nn.RMSNorm(c.d_model, eps=c.norm_eps) for _ in range(L))
        self.residual = make_rule(c)
        self.norm_f = nn.RMSNorm(c.d_model, eps=c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.head_dim, self.rope_theta = c.d_model // c.n_head, c.rope_theta
        cos, sin = rope_tables(c.seq_len, self.head_dim, c.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def rope(self, positions: torch.Tensor | None, past: int, T: int, need: int):
        """cos/sin of the positions (``past..past+T-1`` when None); the tables grow past the
        training context on demand (new rows appended, the trained ones untouched)."""
        have = self.rope_cos.shape[0]
        if need > have:
            cos, sin = rope_tables(
                max(need, 2 * have), self.head_dim, self.rope_theta, self.rope_cos.device, have
            )
            self.rope_cos = torch.cat([self.rope_cos, cos])
            self.rope_sin = torch.cat([self.rope_sin, sin])
        if positions is None:
            return self.rope_cos[past : past + T], self.rope_sin[past : past + T]
        return self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)

    def forward(self, x, cos, sin, cache=None, past=0, mask=None, hidden=None, weights=None):
        """Final normalised hidden states ``[B, T, d]`` of the embeddings ``x``; ``hidden`` /
        ``weights``: lists to collect the hidden states / attention weights into."""
        rule = self.residual
        state = rule.init_state(x)
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for l, (layer, norm) in enumerate(zip(self.layers, self.norms)):
            h = rule.read(state, l)
            if hidden is not None and l % 2 == 0:
                hidden.append(h)
            if checkpointing:  # recompute the sublayer in backward; the depth sources are kept anyway
                run = functools.partial(_sublayer, layer, norm, cos=cos, sin=sin, mask=mask)
                rule.write(state, l, self._gradient_checkpointing_func(run, h))
            else:
                rule.write(state, l, layer(norm(h), cos, sin, cache, past, mask, weights))
        out = self.norm_f(rule.final(state))
        if hidden is not None:
            hidden.append(out)
        return out


def _sublayer(layer, norm, h, cos, sin, mask):
    return layer(norm(h), cos, sin, None, 0, mask)


class AttnResPreTrainedModel(PreTrainedModel):
    config_class = AttnResConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["AttnResModel"]  # depth attention reads every earlier sublayer: one device

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """``attention_residuals.GPT``'s initialisation, for whatever was not loaded (and the
        non-persistent RoPE / permutation tables, never saved)."""
        std = self.config.init_std
        if isinstance(module, AttnResModel):
            cos, sin = rope_tables(
                module.rope_cos.shape[0], module.head_dim, module.rope_theta, module.rope_cos.device
            )
            _init.copy_(module.rope_cos, cos)
            _init.copy_(module.rope_sin, sin)
        elif isinstance(module, nn.Embedding):
            _init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Linear):
            scale = (
                math.sqrt(2 * self.config.n_layer)
                if getattr(module, "_attnres_writes_residual", False)
                else 1.0
            )
            _init.normal_(module.weight, mean=0.0, std=std / scale)
        elif isinstance(module, nn.RMSNorm):
            _init.ones_(module.weight)
        elif isinstance(module, _Rule):
            module.reset_parameters()


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    """AttnRes causal LM: ``self.model`` holds the network under ``attention_residuals.GPT``'s names."""

    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}

    def __init__(self, config: AttnResConfig) -> None:
        super().__init__(config)
        self.model = AttnResModel(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.model.lm_head = value

    def inference_schedule(self) -> str:
        """The depth schedule :meth:`forward` and ``generate`` run: always ``"plain"`` here (see
        the module docstring; ``attention_residuals.GPT.inference_schedule`` has two-phase)."""
        return "plain"

    def create_masks_for_generate(self, attention_mask=None, **unused):
        """``generate`` hands the 2D padding mask on as it is: :meth:`forward` builds its own."""
        return attention_mask

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """Logits ``[B, T, vocab]``; with ``labels`` the shifted next-token loss (``-100`` ignored).

        ``attention_mask``: ``[B, past + T]`` (1 = token, 0 = padding; left or right) or a boolean
        ``[B, 1, T, S]``. ``position_ids`` ``[B, T]``: default ``past..past+T-1``. A padded query
        attends to itself only (its output is defined and ignored); no token attends to padding.
        """
        x = self._embed(input_ids, inputs_embeds)
        B, T = x.shape[:2]
        cache = self._cache(cache if cache is not None else past_key_values, use_cache)
        past = int(cache.get_seq_length()) if cache is not None else 0
        mask = _attention_mask(attention_mask, B, T, past, x.device)
        cos, sin = self._positions(position_ids, past, T)
        cfg = self.config
        hidden = [] if _flag(output_hidden_states, cfg.output_hidden_states) else None
        weights = [] if _flag(output_attentions, cfg.output_attentions) else None
        out = self.model(x, cos, sin, cache, past, mask, hidden, weights)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.model.lm_head(out[:, keep, :])
        loss = None
        if labels is not None:
            if labels.shape != (B, T):
                raise ValueError(f"labels: expected shape {(B, T)}, got {tuple(labels.shape)}")
            full = logits if logits.shape[1] == T else self.model.lm_head(out)
            loss = self.loss_function(logits=full, labels=labels, vocab_size=cfg.vocab_size, **kwargs)
        result = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=tuple(hidden) if hidden is not None else None,
            attentions=tuple(weights) if weights is not None else None,
            **{_CACHE_FIELD: cache},
        )
        return_dict = cfg.return_dict if return_dict is None else return_dict
        return result if return_dict else result.to_tuple()

    def _cache(self, cache: Cache | None, use_cache: bool | None) -> Cache | None:
        """The cache this forward writes to: the given one, a new ``DynamicCache`` (eval with
        ``use_cache``), or None (no cache, or recomputation under gradient checkpointing)."""
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        if self.model.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return None  # a recomputed sublayer would write its keys twice
        if not use_cache:
            return None
        if cache is None and not self.training:
            cache = DynamicCache(config=self.config)
        return cache

    def _positions(self, position_ids: torch.Tensor | None, past: int, T: int):
        """RoPE cos/sin of ``position_ids`` (checked: no negative position), default ``past..past+T-1``."""
        need = past + T
        if position_ids is not None:
            position_ids = position_ids.view(-1, T) if position_ids.ndim == 1 else position_ids
            if not torch.compiler.is_compiling():
                lo, hi = torch.aminmax(position_ids)
                if int(lo) < 0:
                    raise ValueError(f"position_ids: expected positions >= 0, got {int(lo)}")
                need = max(need, int(hi) + 1)
        return self.model.rope(position_ids, past, T, need)

    def _embed(self, input_ids, inputs_embeds) -> torch.Tensor:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("input_ids / inputs_embeds: give exactly one of them")
        if inputs_embeds is not None:
            if inputs_embeds.ndim != 3 or inputs_embeds.shape[-1] != self.config.d_model:
                raise ValueError(
                    f"inputs_embeds: expected [B, T, {self.config.d_model}], got {tuple(inputs_embeds.shape)}"
                )
            return inputs_embeds
        if input_ids.ndim != 2 or input_ids.shape[1] < 1 or input_ids.is_floating_point():
            raise ValueError(
                f"input_ids: expected integer ids [B, T] with T >= 1, got {tuple(input_ids.shape)}"
            )
        if not torch.compiler.is_compiling() and input_ids.device.type == "cpu":
            lo, hi = torch.aminmax(input_ids)
            if int(lo) < 0 or int(hi) >= self.config.vocab_size:
                raise ValueError(
                    f"input_ids: expected ids in 0..{self.config.vocab_size - 1}, got {int(lo)}..{int(hi)}"
                )
        return self.model.embed(input_ids)


def _flag(value: bool | None, default: bool | None) -> bool:
    return bool(default if value is None else value)


def _attention_mask(mask, B: int, T: int, past: int, device) -> torch.Tensor | None:
    """The boolean ``[B, 1, T, past + T]`` mask of a 2D padding mask (None when nothing is padded:
    the plain causal path); a 4D mask is checked and cut to ``past + T`` keys."""
    if mask is None:
        return None
    S = past + T
    if mask.ndim == 4:
        if mask.shape[0] not in (1, B) or mask.shape[-2] != T or mask.shape[-1] < S:
            raise ValueError(f"attention_mask: expected [B, 1, {T}, >={S}], got {tuple(mask.shape)}")
        mask = mask[..., :S]
        return mask if mask.dtype == torch.bool else mask == 0
    if mask.ndim != 2 or mask.shape[0] != B or mask.shape[1] < S:
        raise ValueError(
            f"attention_mask: expected [batch={B}, cached + new tokens={S}] (1 = token, 0 = padding), "
            f"got {tuple(mask.shape)}"
        )
    keep = mask[:, :S].bool()
    if not torch.compiler.is_compiling() and bool(keep.all()):
        return None
    slots = torch.arange(S, device=device)
    query = slots[past:, None]  # [T, 1]
    allowed = (slots <= query) & keep[:, None, :]  # causal, and no padded key
    return (allowed | (slots == query))[:, None]  # a padded query sees itself: no empty row


AttnResForCausalLM.register_for_auto_class("AutoModelForCausalLM")
