"""Hugging Face ``transformers`` integration: our GPT as a ``PreTrainedModel``.

:class:`AttnResConfig` (``model_type="attnres"``) holds every :class:`~attention_residuals.model.GPTConfig`
field; :class:`AttnResForCausalLM` wraps a :class:`~attention_residuals.model.GPT` under the
attribute ``model``, so its parameter names are ours with a ``model.`` prefix (a run checkpoint
stores ``model/<name>``: conversion is a rename). Importing this module registers both with
``AutoConfig`` / ``AutoModelForCausalLM``::

    import attention_residuals.integrations.hf  # registers model_type "attnres"
    model = AutoModelForCausalLM.from_pretrained("out_dir")       # safetensors, no network
    out = model.generate(ids, max_new_tokens=32, do_sample=False)  # greedy == GPT.generate(temperature=0)

``generate()`` works greedy, sampling and beam search, with or without a cache. The cache is
a ``transformers`` ``Cache`` (``DynamicCache`` by default, ``StaticCache`` via
``cache_implementation="static"``): the GPT's attention sublayers write their keys/values into
it through a small adapter, so ``generate``'s cache bookkeeping (beam reordering, cropping...)
is the library's own. Padding is not supported: the model has no attention mask, so a batch
with padding (an ``attention_mask`` with zeros) raises instead of silently attending to pads;
nor are ``inputs_embeds`` and ``output_hidden_states`` / ``output_attentions``. Tested with
``transformers`` 5.x.

Command line::

    attnres export-hf RUN_DIR OUT_DIR [--dtype float32|bfloat16|float16]
    attnres export-hf --import HF_DIR RUN_DIR     # back: an HF folder -> a run directory

The export writes ``config.json`` + ``generation_config.json`` + ``model.safetensors`` and, when
the run used ``--tokenizer PATH``, that tokenizer's files (else a byte-level tokenizer matching the
default byte tokens), so ``AutoTokenizer.from_pretrained(OUT_DIR)`` works too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..connections import LEGACY_NAMES, Connection, ResidualConfig, make_connection
from ..model import GPT, CausalSelfAttention, GPTConfig, rope_tables
from ..training import tokenizer as tok
from ..training.checkpoint import read_checkpoint, save_checkpoint
from ..training.data import BYTE_TOKENIZER

__all__ = [
    "AttnResConfig",
    "AttnResForCausalLM",
    "export_hf",
    "from_gpt",
    "import_hf",
    "main",
    "to_gpt",
]

EXPORT_FILE = "attnres_export.json"  # beside an exported model: where it came from
_GPT_FIELDS = tuple(f.name for f in fields(GPTConfig))
_GPT_KEYS = set(_GPT_FIELDS) | {f.name for f in fields(ResidualConfig)} | set(LEGACY_NAMES)
_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


class AttnResConfig(PretrainedConfig):
    """Every :class:`GPTConfig` field (same names, same defaults) plus the usual HF options.

    The standard HF names are aliases of ours: ``hidden_size`` = ``d_model``,
    ``num_hidden_layers`` = ``n_layer``, ``num_attention_heads`` = ``n_head``,
    ``max_position_embeddings`` = ``seq_len``, ``tie_word_embeddings`` = ``tie_embeddings``,
    ``rms_norm_eps`` = ``norm_eps``, ``initializer_range`` = ``init_std``.
    """

    model_type = "attnres"
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layer",
        "num_attention_heads": "n_head",
        "max_position_embeddings": "seq_len",
        "tie_word_embeddings": "tie_embeddings",
        "rms_norm_eps": "norm_eps",
        "initializer_range": "init_std",
    }

    def __init__(self, **kwargs):
        for alias, name in self.attribute_map.items():
            if alias in kwargs:
                value = kwargs.pop(alias)
                if name in kwargs and kwargs[name] != value:
                    raise ValueError(f"{alias}={value!r} contradicts {name}={kwargs[name]!r}")
                kwargs[name] = value
        # GPTConfig.from_dict fills defaults and folds the flat rule options of older exports
        # ("residual": "block" beside "n_blocks", "heads") into the nested residual config
        ours = GPTConfig.from_dict({k: kwargs.pop(k) for k in list(kwargs) if k in _GPT_KEYS}).to_dict()
        super().__init__(**kwargs)
        for name, value in ours.items():
            setattr(self, name, value)
        self.to_gpt_config()  # validate: errors name the field at fault

    def to_gpt_config(self) -> GPTConfig:
        """The :class:`GPTConfig` these fields describe (validated)."""
        return GPTConfig.from_dict({name: getattr(self, name) for name in _GPT_FIELDS}).validate()

    @classmethod
    def from_gpt_config(cls, config: GPTConfig, **kwargs) -> AttnResConfig:
        return cls(**config.to_dict(), **kwargs)


class _CacheView:
    """Presents a ``transformers`` Cache to :meth:`GPT._run` as our ``KVCache`` interface.

    ``length`` is the number of tokens cached before this forward (read once: the HF cache's own
    length grows as the attention sublayers write into it); ``update`` returns the keys/values of
    every position so far. A ``StaticCache`` returns its whole pre-allocated buffer, cut here.
    """

    def __init__(self, cache: Cache) -> None:
        self.cache = cache
        self.length = int(cache.get_seq_length())  # a StaticCache's is a tensor it updates in place

    def update(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.cache.update(k, v, index)
        end = self.length + k.shape[2]
        return keys[:, :, :end], values[:, :, :end]


class AttnResPreTrainedModel(PreTrainedModel):
    config_class = AttnResConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["GPT"]  # depth attention reads every earlier sublayer: keep the GPT on one device

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Our GPT's initialisation, applied by ``transformers`` to whatever was not loaded.

        ``from_pretrained`` builds the model on the meta device, loads the weights, then calls this
        for the rest: the RoPE tables (non-persistent buffers) are recomputed here.
        """
        init = _init_ops()
        c = self.config
        std = c.init_std
        if isinstance(module, GPT):
            cos, sin = rope_tables(
                c.seq_len, c.d_model // c.n_head, c.rope_theta, device=module.rope_cos.device
            )
            init.copy_(module.rope_cos, cos)
            init.copy_(module.rope_sin, sin)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Linear):
            # the projections writing into the residual stream are scaled by depth (GPT-2 style)
            scale = math.sqrt(2 * c.n_layer) if getattr(module, "_attnres_writes_residual", False) else 1.0
            init.normal_(module.weight, mean=0.0, std=std / scale)
        elif isinstance(module, nn.RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, Connection):
            # a freshly built rule of the same configuration holds the right init (zero queries...)
            # (its non-persistent buffers, e.g. mHC's permutation matrices, are never loaded)
            own = {
                **dict(module.named_parameters(recurse=False)),
                **dict(module.named_buffers(recurse=False)),
            }
            if own and not all(getattr(p, "_is_hf_initialized", False) for p in own.values()):
                fresh = _fresh_connection(c.to_gpt_config())
                values = {
                    **dict(fresh.named_parameters(recurse=False)),
                    **dict(fresh.named_buffers(recurse=False)),
                }
                for name, value in values.items():
                    init.copy_(own[name], value.to(own[name].dtype))


def _init_ops():
    """``transformers.initialization`` (>= 5: skips tensors already loaded), else plain torch."""
    try:
        from transformers import initialization
    except ImportError:  # pragma: no cover - transformers 4.x calls _init_weights on missing weights only
        import types

        return types.SimpleNamespace(
            copy_=lambda t, v: t.copy_(v), normal_=nn.init.normal_, ones_=nn.init.ones_
        )
    return initialization


def _fresh_connection(c: GPTConfig) -> Connection:
    with torch.device("cpu"):
        return make_connection(c.residual, c.n_sublayers, c.d_model, c.norm_eps)


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    """Our :class:`GPT` (any residual rule) as a ``transformers`` causal LM.

    ``self.model`` *is* the GPT: ``to_gpt(hf)`` / ``from_gpt(gpt)`` move weights without copying
    names around, and ``hf.model.generate`` is our own sampler.
    """

    if _TRANSFORMERS_MAJOR >= 5:
        _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}
    else:  # pragma: no cover - transformers 4.x lists the tied keys
        _tied_weights_keys = ["model.lm_head.weight"]

    def __init__(self, config: AttnResConfig) -> None:
        super().__init__(config)
        self.model = GPT(config.to_gpt_config())
        for layer in self.model.layers:  # modules without parameters of their own are not visited by
            out = layer.proj if isinstance(layer, CausalSelfAttention) else layer.down  # _init_weights
            out._attnres_writes_residual = True
        self.post_init()

    # -- embeddings (used by resize_token_embeddings and weight tying)
    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.model.lm_head = value

    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
        """``GenerationMixin.generate``, failing up front when the prompt plus ``max_new_tokens``
        would not fit the context length ``seq_len`` (instead of after generating up to it)."""
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        config = generation_config if generation_config is not None else self.generation_config
        new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
        if isinstance(ids, torch.Tensor) and new is not None and ids.shape[-1] + new > self.config.seq_len:
            raise ValueError(
                f"max_new_tokens: prompt ({ids.shape[-1]}) + {new} new tokens exceed seq_len={self.config.seq_len}"
            )
        return super().generate(inputs, generation_config=generation_config, **kwargs)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """Logits ``[B, T, vocab]`` (float32 from the LM head's dtype); with ``labels`` the shifted
        next-token loss (``-100`` ignored), as every ``transformers`` causal LM.

        ``position_ids`` are accepted and must be the contiguous positions after the cache (our
        RoPE positions follow the cache length). ``logits_to_keep=n`` keeps the last ``n``.
        """
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds: not supported by AttnResForCausalLM, pass input_ids")
        for name in ("output_hidden_states", "output_attentions"):
            if kwargs.get(name):
                raise ValueError(
                    f"{name}: not supported (use GPT.depth_weights for the depth-attention weights)"
                )
        if input_ids is None:
            raise ValueError("input_ids: required")
        if cache is None:
            cache = past_key_values  # the transformers 4.x name
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        if use_cache and cache is None and not self.training:
            cache = _new_dynamic_cache(self.config)
        if not use_cache:
            cache = None
        view = _CacheView(cache) if cache is not None else None
        if attention_mask is not None:
            _check_no_padding(attention_mask, view.length if view is not None else 0, input_ids.shape[1])
        if position_ids is not None:
            start = view.length if view is not None else 0
            expected = torch.arange(start, start + input_ids.shape[1], device=position_ids.device)
            if not bool((position_ids == expected).all()):
                raise ValueError("position_ids: only the contiguous positions after the cache are supported")
        hidden = self.model.forward_hidden(input_ids, cache=view)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.model.lm_head(hidden[:, keep, :])
        loss = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(
                    f"labels: expected shape {tuple(input_ids.shape)}, got {tuple(labels.shape)}"
                )
            full = logits if logits.shape[1] == input_ids.shape[1] else self.model.lm_head(hidden)
            loss = F.cross_entropy(
                full[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
            )
        return_dict = self.config.return_dict if return_dict is None else return_dict
        if not return_dict:
            out = (logits, cache) if cache is not None else (logits,)
            return (loss, *out) if loss is not None else out
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})


def _check_no_padding(mask: torch.Tensor, past: int, T: int) -> None:
    """Accept only masks that say "causal, nothing padded": the model cannot mask tokens out.

    ``mask`` is a 2D ``[B, past + T]`` 0/1 mask or the 4D ``[B, 1, T, S]`` mask ``generate`` builds
    for static caches (boolean: True = attend; float: 0 = attend), ``S >= past + T``.
    """
    if mask.ndim == 2:
        ok = bool(mask.bool().all())
    elif mask.ndim == 4 and mask.shape[-2] == T and mask.shape[-1] >= past + T:
        allowed = mask if mask.dtype == torch.bool else mask == 0
        causal = torch.ones(T, past + T, dtype=torch.bool, device=mask.device).tril(past)
        ok = bool((allowed[..., : past + T] == causal).all()) and not bool(allowed[..., past + T :].any())
    else:
        raise ValueError(
            f"attention_mask: expected a [B, S] or [B, 1, T, S] mask, got shape {tuple(mask.shape)}"
        )
    if not ok:
        raise ValueError(
            "attention_mask: padding is not supported (the model attends to every earlier token); "
            "generate unpadded prompts of equal length, or one prompt at a time"
        )


_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _new_dynamic_cache(config: AttnResConfig) -> DynamicCache:
    try:
        return DynamicCache(config=config)
    except TypeError:  # pragma: no cover - transformers 4.x
        return DynamicCache()


AutoConfig.register("attnres", AttnResConfig, exist_ok=True)
AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)


# --------------------------------------------------------------------------- conversion


def from_gpt(model: GPT, **config_kwargs) -> AttnResForCausalLM:
    """An :class:`AttnResForCausalLM` holding a copy of ``model``'s weights (same dtype/device)."""
    config = AttnResConfig.from_gpt_config(model.config, **config_kwargs)
    p = next(model.parameters())
    with torch.device(p.device):
        hf = AttnResForCausalLM(config)
    hf.to(p.dtype)
    hf.model.load_state_dict(model.state_dict(), strict=True)
    return hf.train(model.training)


def to_gpt(model: AttnResForCausalLM) -> GPT:
    """A plain :class:`GPT` holding a copy of ``model``'s weights."""
    p = next(model.parameters())
    with torch.device(p.device):
        gpt = GPT(model.config.to_gpt_config())
    gpt.to(p.dtype)
    gpt.load_state_dict(model.model.state_dict(), strict=True)
    return gpt.train(model.training)


def _read_run(run_dir: Path) -> tuple[GPTConfig, dict[str, torch.Tensor], dict, int]:
    """Model config, model weights, run config and step of a run directory."""
    ckpt = run_dir / "checkpoint.safetensors"
    tensors, info = read_checkpoint(ckpt)
    config_json = run_dir / "config.json"
    record = json.loads(config_json.read_text()) if config_json.is_file() else {}
    saved = info.get("config") or {}
    run_config = {**record, **saved}  # the checkpoint's own config wins, section by section
    for key, section in saved.items():
        if isinstance(section, dict) and isinstance(record.get(key), dict):
            run_config[key] = {**record[key], **section}
    model_cfg = _model_config_of(run_config, where=str(ckpt))
    weights = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    return model_cfg, weights, run_config, info["step"]


def _model_config_of(run_config: dict, where: str) -> GPTConfig:
    """The :class:`GPTConfig` inside a run config (``{"model": {...}}`` or flat fields)."""
    section = run_config.get("model", run_config)
    if not isinstance(section, dict):
        raise ValueError(f"{where}: run config has no model section")
    known = {k: v for k, v in section.items() if k in _GPT_FIELDS}
    if not known:
        raise ValueError(f"{where}: run config holds no GPTConfig fields")
    return GPTConfig.from_dict(known).validate()


def export_hf(
    run_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype | None = None
) -> Path:
    """Convert a run directory (``config.json`` + ``checkpoint.safetensors``) to an HF model folder."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    gpt_cfg, weights, run_config, step = _read_run(run_dir)
    config = AttnResConfig.from_gpt_config(gpt_cfg, architectures=["AttnResForCausalLM"])
    model = AttnResForCausalLM(config)
    model.model.load_state_dict(weights, strict=True)
    if dtype is not None:
        model.to(dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    note = _export_tokenizer(run_config, gpt_cfg, out_dir)
    # the run's training config and corpus identity travel along, so that --import gives back a run
    # that `attnres eval` reads on its own corpus (an HF loader ignores this file)
    run = {key: run_config[key] for key in ("train", "data") if isinstance(run_config.get(key), dict)}
    (out_dir / EXPORT_FILE).write_text(
        json.dumps({"run_dir": str(run_dir.resolve()), "step": step, "tokenizer": note, "run": run}, indent=1)
    )
    return out_dir


def _export_tokenizer(run_config: dict, gpt_cfg: GPTConfig, out_dir: Path) -> str:
    """Save the run's tokenizer next to the model; returns what was done (for the CLI)."""
    path = tok.tokenizer_path_of(run_config)
    used = (run_config.get("data") or {}).get("tokenizer", BYTE_TOKENIZER)
    if path is not None:
        tok.load_tokenizer(path).save_pretrained(out_dir)
        return f"tokenizer from {path}"
    if used == BYTE_TOKENIZER and gpt_cfg.vocab_size >= 256:
        tok.byte_tokenizer().save_pretrained(out_dir)
        return "byte tokenizer"
    return f"no tokenizer (the run used {used!r} but its config records no tokenizer path)"


def import_hf(hf_dir: str | os.PathLike, run_dir: str | os.PathLike) -> Path:
    """Convert an HF folder written by :func:`export_hf` back to a run directory.

    Writes ``checkpoint.safetensors`` (weights only: no optimizer state) and ``config.json``
    with the model config under ``"model"`` and, when the folder came from :func:`export_hf`, the
    run's ``"train"`` and ``"data"`` sections (its corpus, tokenizer and hyperparameters); returns
    the checkpoint path.
    """
    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    hf = AttnResForCausalLM.from_pretrained(hf_dir, local_files_only=True)
    gpt = to_gpt(hf)
    exported = json.loads((hf_dir / EXPORT_FILE).read_text()) if (hf_dir / EXPORT_FILE).is_file() else {}
    run_config = {**exported.get("run", {}), "model": gpt.config.to_dict(), "imported_from": str(hf_dir)}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(run_config, indent=1, sort_keys=True))
    return save_checkpoint(run_dir / "checkpoint.safetensors", model=gpt, config=run_config, rng=False)


# --------------------------------------------------------------------------- CLI

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="attnres export-hf",
        description="Convert a run directory (config.json + checkpoint.safetensors) to a Hugging Face model "
        "folder loadable with AutoModelForCausalLM.from_pretrained (import attention_residuals.integrations.hf first), "
        "or back with --import.",
    )
    parser.add_argument("src", help="RUN_DIR (or HF_DIR with --import)")
    parser.add_argument("dst", help="OUT_DIR (or RUN_DIR with --import)")
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), default=None, help="cast the weights (default: keep)"
    )
    parser.add_argument(
        "--import", dest="reverse", action="store_true", help="convert HF_DIR back to RUN_DIR"
    )
    args = parser.parse_args(argv)
    try:
        if args.reverse:
            path = import_hf(args.src, args.dst)
            print(f"wrote {path}")
        else:
            out = export_hf(args.src, args.dst, dtype=_DTYPES.get(args.dtype))
            note = json.loads((out / EXPORT_FILE).read_text())["tokenizer"]
            print(f"wrote {out} with {note}")
            print(
                "load it with: import attention_residuals.integrations.hf; AutoModelForCausalLM.from_pretrained(...)"
            )
    except (OSError, ValueError, RuntimeError) as e:
        print(f"attnres export-hf: error: {e}", file=sys.stderr)
        return 1
    return 0
