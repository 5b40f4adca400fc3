"""State-dict adapter between this project's AttnRes parameters and the Kimi K3 naming.

The public K3-style implementations we could read (vLLM's ``kimi_k3`` / ``kimi_linear`` AttnRes
path and its tests, the tiny K3 checkpoints written to test it) store Block AttnRes per decoder
layer ``i`` and once for the final readout, with a learnable RMSNorm gain on the keys::

    model.layers.{i}.self_attention_res_proj.weight   [1, d]   pseudo-query before the attention
    model.layers.{i}.self_attention_res_norm.weight   [d]      key RMSNorm gain
    model.layers.{i}.mlp_res_proj.weight              [1, d]   pseudo-query before the MLP
    model.layers.{i}.mlp_res_norm.weight              [d]
    model.output_attn_res_proj.weight                 [1, d]   final readout
    model.output_attn_res_norm.weight                 [d]
    config: attn_res_block_size                       decoder layers per block (K3: 12)

and compute ``softmax_i(w . (g * RMSNorm(v_i)))`` over ``[b_0 = embedding, b_1.., partial]``, a
block sealed after every ``attn_res_block_size`` decoder layers. That is our ``block`` rule with
static softmax queries, one depth head, ``key_norm`` with ``key_norm_gain``, ``block_size`` =
``2 * attn_res_block_size`` sublayers: ``queries[2i]`` / ``key_gain[2i]`` are layer ``i``'s
attention pair, ``[2i + 1]`` its MLP pair, ``[L]`` the output pair. (A multimodal K3 checkpoint
nests the text model under ``language_model.``: pass ``model_prefix="language_model.model."``.)

Only the AttnRes tensors are renamed; every other key passes through unchanged (the K3 layout
matches a Llama-style ``model.layers.{i}`` patched by :func:`~.patch.apply_attnres`, whose rule
lives at ``model.attnres.``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ..connections import ResidualConfig, resolve_block_size

__all__ = ["BLOCK_SIZE_FIELD", "from_k3", "k3_block_size", "residual_config_from_k3", "to_k3"]

BLOCK_SIZE_FIELD = "attn_res_block_size"
_SUBLAYER = ("self_attention_res", "mlp_res")


def k3_block_size(config: ResidualConfig, n_sublayers: int) -> int:
    """K3's ``attn_res_block_size`` (decoder layers per block) of a rule; raises ``ValueError``
    naming the option when the rule has no K3 form."""
    wanted = {"rule": "block", "query": "static", "normalize": "softmax", "depth_heads": 1, "key_norm": True}
    for name, value in wanted.items():
        if getattr(config, name) != value:
            raise ValueError(f"{name}: K3 AttnRes needs {name}={value!r}, got {getattr(config, name)!r}")
    if config.intra_gate:
        raise ValueError("intra_gate: K3 AttnRes has no intra-block gate")
    size = resolve_block_size(n_sublayers, config.block_size, config.n_blocks)
    if size is None or size % 2:
        raise ValueError(
            f"block_size: K3 counts blocks in decoder layers, so the block size in sublayers must be even, got {size}"
        )
    return size // 2


def residual_config_from_k3(attn_res_block_size: int) -> ResidualConfig:
    """The rule a K3 config's ``attn_res_block_size`` describes (gain on the key norm included)."""
    if (
        isinstance(attn_res_block_size, bool)
        or not isinstance(attn_res_block_size, int)
        or attn_res_block_size < 1
    ):
        raise ValueError(f"{BLOCK_SIZE_FIELD}: expected a positive integer, got {attn_res_block_size!r}")
    return ResidualConfig("block", block_size=2 * attn_res_block_size, key_norm_gain=True)


def _names(n_layers: int, model_prefix: str) -> list[tuple[str, str]]:
    """(query key, gain key) of the K3 checkpoint for rows ``0..2 n_layers`` of our tensors."""
    rows = [
        (f"{model_prefix}layers.{i}.{s}_proj.weight", f"{model_prefix}layers.{i}.{s}_norm.weight")
        for i in range(n_layers)
        for s in _SUBLAYER
    ]
    return rows + [
        (f"{model_prefix}output_attn_res_proj.weight", f"{model_prefix}output_attn_res_norm.weight")
    ]


def to_k3(
    state_dict: Mapping[str, torch.Tensor], *, source: str = "model.attnres.", model_prefix: str = "model."
) -> dict[str, torch.Tensor]:
    """Our names -> K3's: ``{source}queries`` ``[L+1, d]`` (and ``{source}key_gain``; ones when the
    rule had no gain) become the per-layer ``*_res_proj`` / ``*_res_norm`` tensors."""
    if f"{source}queries" not in state_dict:
        raise ValueError(f"state_dict: no {source}queries (the AttnRes rule's pseudo-queries); pass source=")
    extra = sorted(
        k for k in state_dict if k.startswith(source) and k not in (f"{source}queries", f"{source}key_gain")
    )
    if extra:
        raise ValueError(
            f"state_dict: {extra} have no K3 form (K3 AttnRes: static queries and a key-norm gain)"
        )
    queries = state_dict[f"{source}queries"]
    gains = state_dict.get(f"{source}key_gain", torch.ones_like(queries))
    if queries.ndim != 2 or queries.shape[0] % 2 != 1:
        raise ValueError(f"{source}queries: expected [2 * n_layers + 1, d], got {tuple(queries.shape)}")
    out = {k: v for k, v in state_dict.items() if not k.startswith(source)}
    for row, (q_key, g_key) in enumerate(_names(queries.shape[0] // 2, model_prefix)):
        out[q_key] = queries[row].unsqueeze(0).clone()
        out[g_key] = gains[row].clone()
    return out


def from_k3(
    state_dict: Mapping[str, torch.Tensor], *, target: str = "model.attnres.", model_prefix: str = "model."
) -> dict[str, torch.Tensor]:
    """K3's names -> ours: the per-layer AttnRes tensors become ``{target}queries`` and
    ``{target}key_gain`` ``[L+1, d]``; every other key passes through."""
    pattern = re.compile(
        rf"{re.escape(model_prefix)}layers\.(\d+)\.(?:{'|'.join(_SUBLAYER)})_(?:proj|norm)\.weight"
    )
    layers = {int(m.group(1)) for k in state_dict if (m := pattern.fullmatch(k))}
    if not layers:
        raise ValueError(
            f"state_dict: no {model_prefix}layers.<i>.self_attention_res_proj.weight (not a K3 AttnRes layout)"
        )
    names = _names(max(layers) + 1, model_prefix)
    missing = [k for pair in names for k in pair if k not in state_dict]
    if missing:
        raise ValueError(
            f"state_dict: missing K3 AttnRes tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}"
        )
    for q_key, g_key in names:
        q, g = state_dict[q_key], state_dict[g_key]
        if q.ndim != 2 or q.shape[0] != 1 or g.shape != q.shape[1:]:
            raise ValueError(
                f"{q_key}: expected [1, d] beside a [d] gain, got {tuple(q.shape)} and {tuple(g.shape)}"
            )
    used = {k for pair in names for k in pair}
    out = {k: v for k, v in state_dict.items() if k not in used}
    out[f"{target}queries"] = torch.cat([state_dict[q] for q, _ in names])
    out[f"{target}key_gain"] = torch.stack([state_dict[g] for _, g in names])
    return out
