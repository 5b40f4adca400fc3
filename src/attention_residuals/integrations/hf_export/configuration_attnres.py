"""Configuration of an Attention Residuals (AttnRes) causal LM; imports only ``transformers``.

Written next to exported weights (``trust_remote_code``) and registered by ``attention_residuals``
for the auto classes. The fields are those of ``attention_residuals.GPTConfig``; ``residual`` is the
depth-mixing rule and its options as a dict (the fields of ``attention_residuals.ResidualConfig``).
"""

from __future__ import annotations

import math

from transformers import PretrainedConfig

#: the options of the depth-mixing rule and their defaults (``ResidualConfig``; a test keeps them equal)
RESIDUAL_DEFAULTS = {
    "rule": "prenorm",
    "block_size": None,
    "n_blocks": None,
    "query": "static",
    "normalize": "softmax",
    "depth_heads": 1,
    "key_norm": True,
    "key_norm_gain": False,
    "query_rank": 8,
    "query_init_std": 0.0,
    "window": 8,
    "streams": 4,
    "intra_gate": False,
}
RULES = ("prenorm", "full", "block", "denseformer", "mhc", "swa", "mixing")
#: names the options had before (configs written then keep loading)
LEGACY_NAMES = {"heads": "depth_heads", "residual": "rule"}
#: model fields and defaults (``GPTConfig``; a test keeps them equal)
MODEL_DEFAULTS = {
    "vocab_size": 256,
    "n_layer": 4,
    "n_head": 4,
    "d_model": 128,
    "seq_len": 256,
    "mlp_hidden": None,
    "rope_theta": 10000.0,
    "norm_eps": 1e-6,
    "init_std": 0.02,
    "tie_embeddings": False,
}


def residual_options(residual, flat: dict) -> dict:
    """The rule options as a full dict from ``residual`` (a rule name, a dict or None) and the
    options given flat beside it (older exports: ``"residual": "block", "n_blocks": 4, "heads": 2``)."""
    if residual is None:
        options = {}
    elif isinstance(residual, str):
        options = {"rule": residual}
    elif isinstance(residual, dict):
        options = {LEGACY_NAMES.get(k, k): v for k, v in residual.items()}
    else:
        raise ValueError(f"residual: expected a rule name or a dict of rule options, got {residual!r}")
    options.update({LEGACY_NAMES.get(k, k): v for k, v in flat.items()})
    unknown = set(options) - set(RESIDUAL_DEFAULTS)
    if unknown:
        raise ValueError(f"residual: unknown rule options {sorted(unknown)}")
    return {**RESIDUAL_DEFAULTS, **options}


def block_size_of(n_sublayers: int, residual: dict) -> int | None:
    """Block size in sublayers from ``block_size`` or ``n_blocks`` (checked against the depth)."""
    size, blocks = residual["block_size"], residual["n_blocks"]
    if size is not None and blocks is not None:
        raise ValueError("block_size and n_blocks: give one of them, not both")
    if blocks is not None:
        if not 1 <= blocks <= n_sublayers:
            raise ValueError(f"n_blocks: must be in 1..L={n_sublayers}, got {blocks}")
        size = math.ceil(n_sublayers / blocks)
        if math.ceil(n_sublayers / size) != blocks:
            raise ValueError(
                f"n_blocks: {blocks} blocks do not fit L={n_sublayers} sublayers; give block_size"
            )
    if size is not None and not 1 <= size <= n_sublayers:
        raise ValueError(f"block_size: must be in 1..L={n_sublayers} sublayers (L = 2 * n_layer), got {size}")
    return size


class AttnResConfig(PretrainedConfig):
    """An AttnRes GPT: ``d_model`` wide, ``n_layer`` blocks (``2 n_layer`` sublayers), ``residual`` rule.

    The usual names are aliases: ``hidden_size`` = ``d_model``, ``num_hidden_layers`` = ``n_layer``,
    ``num_attention_heads`` = ``n_head``, ``max_position_embeddings`` = ``seq_len`` (the training
    context; RoPE positions beyond it are computed, not refused), ``tie_word_embeddings`` =
    ``tie_embeddings``, ``rms_norm_eps`` = ``norm_eps``, ``initializer_range`` = ``init_std``.
    """

    model_type = "attnres"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layer",
        "num_attention_heads": "n_head",
        "max_position_embeddings": "seq_len",
        "tie_word_embeddings": "tie_embeddings",
        "rms_norm_eps": "norm_eps",
        "initializer_range": "init_std",
    }

    def __init__(self, residual=None, **kwargs) -> None:
        for alias, name in self.attribute_map.items():
            if alias in kwargs:
                value = kwargs.pop(alias)
                if name in kwargs and kwargs[name] != value:
                    raise ValueError(f"{alias}={value!r} contradicts {name}={kwargs[name]!r}")
                kwargs[name] = value
        flat = {k: kwargs.pop(k) for k in list(kwargs) if k in RESIDUAL_DEFAULTS or k in LEGACY_NAMES}
        model = {name: kwargs.pop(name, default) for name, default in MODEL_DEFAULTS.items()}
        super().__init__(**kwargs)
        for name, value in model.items():
            setattr(self, name, value)
        self.residual = residual_options(residual, flat)
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the field when no model can be built from this config."""
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise ValueError(
                f"n_head: d_model={self.d_model} must split into n_head={self.n_head} even-sized heads"
            )
        r = self.residual
        if r["rule"] not in RULES:
            raise ValueError(f"residual: expected one of {RULES}, got {r['rule']!r}")
        if r["depth_heads"] < 1 or self.d_model % r["depth_heads"]:
            raise ValueError(f"depth_heads: must divide d_model={self.d_model}, got {r['depth_heads']}")
        if r["query"] not in ("static", "input", "lowrank"):
            raise ValueError(f"query: expected 'static', 'input' or 'lowrank', got {r['query']!r}")
        if r["normalize"] not in ("softmax", "sigmoid"):
            raise ValueError(f"normalize: expected 'softmax' or 'sigmoid', got {r['normalize']!r}")
        std = r["query_init_std"]
        if isinstance(std, bool) or not isinstance(std, int | float) or not 0 <= std < math.inf:
            raise ValueError(f"query_init_std: expected a finite number >= 0, got {std!r}")
        if r["rule"] == "mhc" and not 1 <= r["streams"] <= 6:
            raise ValueError(f"streams: expected 1..6, got {r['streams']}")
        block_size_of(2 * self.n_layer, r)


AttnResConfig.register_for_auto_class()
