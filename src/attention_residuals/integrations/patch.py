"""Drop-in AttnRes for someone else's pre-norm Transformer (e.g. a ``transformers`` Llama).

:func:`apply_attnres` takes a model whose decoder layers follow the usual pre-norm pattern::

    h = h + attn(attn_norm(h))        # one layer in the AttnRes sense
    h = h + mlp(mlp_norm(h))          # another one

and rewires it in place: every attention and every MLP sublayer becomes one AttnRes layer
(``L = 2 * n_decoder_layers``), fed by a :mod:`~attention_residuals.connections` rule instead of
the running sum::

    v_0 = embedding (what decoder layer 0 receives)
    h_l = residual.read(state, l);  v_l = sublayer_l(norm_l(h_l));  residual.write(state, l, v_l)
    final norm input = residual.final(state)   (Block: a readout over every block)

The sublayers, norms, embedding, final norm and head keep their modules and weights; the only new
parameters are the rule's (zero-initialised pseudo-queries, registered as ``<layers owner>.attnres``,
e.g. ``model.attnres.queries`` on a Llama). So at step 0 every sublayer reads the *mean* of its
sources: the depth-mean model (unless ``query_init_std`` draws the queries at random).

How: each decoder layer's ``forward`` is replaced (instance attribute; the class is untouched) by
one that runs its two sublayers, passing the layer's own keyword arguments (mask, rotary
embeddings, cache...) to the attention module exactly as the original layer would. The tensor a
patched layer returns is the *input of the next sublayer* (``h_{2i+2}``; the last layer returns
``residual.final(state)``), so what flows between layers is still an ordinary ``[B, T, d]``
hidden state, the model's own final norm and head apply unchanged, and ``output_hidden_states``
shows the AttnRes inputs. The depth sources (earlier layer outputs / block sums) live in one state
object per forward, held by the patch (layer 0 starts it, the last layer drops it): plain Python
state, so ``torch.compile(fullgraph=True)`` traces the patched forward without a graph break.

Requirements (checked where possible; errors say what is wrong):

* the decoder layers are one ``nn.ModuleList`` run in order, layer 0 receives the embeddings and
  each layer returns its hidden-states tensor (the ``transformers`` >= 5 convention);
* each layer has an attention module, an MLP and their two input norms (names auto-detected for
  Llama/Mistral/Qwen-style ``self_attn``/``mlp``/``input_layernorm``/``post_attention_layernorm``
  and GPT-2/nanoGPT-style ``attn``/``mlp``/``ln_1``/``ln_2``; or pass them).

Gradient checkpointing (``model.gradient_checkpointing_enable()``, before or after the patch)
works: each sublayer is recomputed in backward (the depth sources are kept, as the residual
stream is), the cache is off while it recomputes, as in ``transformers``.

Example::

    from transformers import LlamaConfig, LlamaForCausalLM
    from attention_residuals.integrations.patch import apply_attnres
    model = apply_attnres(LlamaForCausalLM(LlamaConfig(...)), "block", n_blocks=4)
    model.generate(ids, max_new_tokens=20)     # the KV cache works as before

Saving and loading: on a ``transformers`` model, ``apply_attnres`` records its settings in
``model.config.attnres`` and ``model.save_pretrained(path)`` writes them with the weights (the
``...attnres.*`` tensors included) under ``"model_type": "attnres_patched"``, so that a plain
``from_pretrained`` cannot silently return the model without AttnRes: ``AutoModelForCausalLM``
refuses the folder, ``LlamaForCausalLM.from_pretrained`` warns of the model type. One call restores
it exactly: :func:`load_patched` (``attention_residuals.load_patched(path)``), which is
``from_pretrained`` of the patched class :func:`patched_class` (``patched_class(LlamaForCausalLM)``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from ..connections import RESIDUALS, Connection, ResidualConfig, ResidualState, make_connection
from ..files import atomic_write

__all__ = [
    "PATCHED_MODEL_TYPE",
    "AttnResPatch",
    "apply_attnres",
    "find_decoder_layers",
    "load_patched",
    "patched_class",
    "remove_attnres",
]

#: ``model_type`` of a saved patched model (a plain ``from_pretrained`` must not take it for the base)
PATCHED_MODEL_TYPE = "attnres_patched"
SETTINGS_FORMAT = 1

#: (attention, mlp, attention input norm, mlp input norm) attribute names tried in order
KNOWN_LAYOUTS: tuple[tuple[str, str, str, str], ...] = (
    ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"),  # Llama, Mistral, Qwen, ...
    ("attn", "mlp", "ln_1", "ln_2"),  # GPT-2, nanoGPT
    ("attention", "mlp", "input_layernorm", "post_attention_layernorm"),
    ("attention", "feed_forward", "attention_norm", "ffn_norm"),  # Meta's llama reference code
)

_OWNER_ATTR = "attnres"
_CACHE_KWARGS = ("cache", "past_key_values", "layer_past")


@dataclasses.dataclass
class AttnResPatch:
    """What :func:`apply_attnres` did (also stored as ``model.attnres_patch``)."""

    residual: str
    connection: Connection
    layers: nn.ModuleList
    owner: nn.Module
    names: tuple[str, str, str, str]
    n_sublayers: int
    settings: dict  # what load_patched needs to rebuild it (also model.config.attnres)


def find_decoder_layers(
    model: nn.Module, names: tuple[str, str, str, str] | None = None
) -> tuple[str, nn.ModuleList, tuple[str, str, str, str]]:
    """The first ``nn.ModuleList`` (in module order) whose every item has the four sublayer
    attributes of one :data:`KNOWN_LAYOUTS` entry (or of ``names``): ``(path, list, names)``."""
    layouts = (names,) if names is not None else KNOWN_LAYOUTS
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        for layout in layouts:
            if all(all(isinstance(getattr(layer, n, None), nn.Module) for n in layout) for layer in module):
                return path, module, layout
    wanted = names if names is not None else " or ".join(str(layout) for layout in KNOWN_LAYOUTS)
    raise ValueError(
        f"model: found no nn.ModuleList of decoder layers with sublayers {wanted}; pass layers= and names="
    )


def _norm_eps(norm: nn.Module, default: float = 1e-6) -> float:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(norm, attr, None)
        if isinstance(value, float):
            return value
    return default


def _hidden_size(layer: nn.Module, norm_name: str) -> int:
    weight = getattr(getattr(layer, norm_name), "weight", None)
    if isinstance(weight, torch.Tensor) and weight.ndim == 1:
        return weight.shape[0]
    raise ValueError(f"layers: cannot read the hidden size from {norm_name}.weight; pass d_model=")


def _first(output):
    """A sublayer's output tensor (attention modules often return ``(output, weights)``)."""
    return output[0] if isinstance(output, tuple | list) else output


class _Run:
    """The depth state of the forward in progress (layer 0 sets it, the last layer clears it) and
    the tensor the previous layer returned (the next must receive that very tensor)."""

    state: ResidualState | None = None
    out: torch.Tensor | None = None


@dataclasses.dataclass
class _LayerSpec:
    index: int
    last: bool
    names: tuple[str, str, str, str]
    signature: inspect.Signature | None
    original: Callable
    run: _Run


def _patched_forward(self: nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The forward of a patched decoder layer: two AttnRes layers (attention, then MLP).

    Everything it needs is on the layer (``_attnres_spec``, ``_attnres_connection``, set with
    ``object.__setattr__`` so they are not submodules), so ``copy.deepcopy`` of a patched model
    gives a working, independent copy.
    """
    spec: _LayerSpec = self._attnres_spec
    conn: Connection = self._attnres_connection
    attn_name, mlp_name, attn_norm_name, mlp_norm_name = spec.names
    if args:  # name them as the original layer would, then hand them on by keyword
        kwargs = _by_keyword(spec.signature, hidden_states, args, kwargs)
    run = spec.run
    if spec.index == 0:
        state = run.state = conn.init_state(hidden_states)
        h = conn.read(state, 0)
    else:
        state = run.state
        if state is None or hidden_states is not run.out:
            raise RuntimeError(
                f"AttnRes decoder layer {spec.index}: its input is not the tensor the previous patched layer "
                "returned, so its depth state is unknown. The patched layers must run in order from layer 0, "
                "each receiving the tensor the previous one returned (a module between them replaced it?)"
            )
        h = hidden_states
    attn, attn_norm = getattr(self, attn_name), getattr(self, attn_norm_name)
    mlp, mlp_norm = getattr(self, mlp_name), getattr(self, mlp_norm_name)
    l = 2 * spec.index
    if getattr(self, "gradient_checkpointing", False) and self.training and torch.is_grad_enabled():
        # transformers' checkpointing of the layer is bypassed by the patched forward: recompute
        # each sublayer here instead (the depth sources stay saved, as the residual stream would)
        kwargs = {k: (None if k in _CACHE_KWARGS else v) for k, v in kwargs.items() if k != "use_cache"}
        ckpt = self._gradient_checkpointing_func
        conn.write(state, l, ckpt(functools.partial(_sublayer, attn, attn_norm, **kwargs), h))
        conn.write(state, l + 1, ckpt(functools.partial(_sublayer, mlp, mlp_norm), conn.read(state, l + 1)))
    else:
        conn.write(state, l, _sublayer(attn, attn_norm, h, **kwargs))
        conn.write(state, l + 1, _sublayer(mlp, mlp_norm, conn.read(state, l + 1)))
    if spec.last:
        run.state = run.out = None
        return conn.final(state)
    out = run.out = conn.read(state, l + 2)
    return out


def _sublayer(module: nn.Module, norm: nn.Module, h: torch.Tensor, **kwargs) -> torch.Tensor:
    return _first(module(norm(h), **kwargs))


def _by_keyword(signature: inspect.Signature | None, hidden_states, args, kwargs) -> dict:
    """The extra arguments of a layer call, named as the original layer's signature names them."""
    if signature is None:
        raise TypeError("patched decoder layer: pass the extra arguments by keyword")
    bound = signature.bind_partial(hidden_states, *args, **kwargs)
    named = dict(bound.arguments)
    named.pop(next(iter(signature.parameters)))
    for name, p in signature.parameters.items():  # the original's **kwargs: flatten them
        if p.kind is inspect.Parameter.VAR_KEYWORD and name in named:
            named.update(named.pop(name))
    return named


def _resolve_layers(
    model: nn.Module, layers: nn.ModuleList | str | None, names: tuple[str, str, str, str] | None
) -> tuple[str, nn.ModuleList, tuple[str, str, str, str]]:
    """The decoder layers :func:`apply_attnres` patches: ``(path, list, sublayer names)``."""
    if isinstance(layers, str):
        path, layer_list = layers, model.get_submodule(layers)
        if not isinstance(layer_list, nn.ModuleList):
            raise ValueError(
                f"layers: {layers!r} is a {type(layer_list).__name__}, expected an nn.ModuleList"
            )
        _, _, names = find_decoder_layers(nn.ModuleDict({"layers": layer_list}), names)
    elif isinstance(layers, nn.ModuleList):
        layer_list = layers
        path = next((p for p, m in model.named_modules() if m is layers), None)
        if path is None:
            raise ValueError("layers: this nn.ModuleList is not a submodule of model")
        _, _, names = find_decoder_layers(nn.ModuleDict({"layers": layer_list}), names)
    elif layers is None:
        return find_decoder_layers(model, names)
    else:
        raise TypeError(
            f"layers: expected an nn.ModuleList, a dotted path or None, got {type(layers).__name__}"
        )
    return path, layer_list, names


def _record_settings(model: nn.Module, settings: dict) -> None:
    """On a ``transformers`` model: the settings into ``config.attnres``, and a ``save_pretrained``
    that marks the saved folder as patched (:func:`_save_patched`)."""
    config = getattr(model, "config", None)
    if hasattr(config, "to_json_string"):  # a transformers model: save_pretrained keeps the settings
        config.attnres = {**settings, "base_model_type": getattr(config, "model_type", None)}
        if hasattr(model, "save_pretrained"):
            object.__setattr__(model, "save_pretrained", types.MethodType(_save_patched, model))


def _check_applicable(model: nn.Module, residual: str, options: dict) -> None:
    if "mode" in options:
        raise TypeError("apply_attnres: mode= is now residual= (the rule's one name everywhere)")
    if residual not in RESIDUALS:
        raise ValueError(f"residual: expected one of {RESIDUALS}, got {residual!r}")
    if getattr(model, "attnres_patch", None) is not None:
        raise ValueError("model: AttnRes is already applied (remove_attnres(model) first)")


def _patch_layers(layer_list: nn.ModuleList, names: tuple[str, str, str, str], conn: nn.Module) -> None:
    """Route every layer's forward through :func:`_patched_forward`, one shared run state for all."""
    run = _Run()
    for i, layer in enumerate(layer_list):
        original = layer.forward
        try:
            signature = inspect.signature(original)
        except (TypeError, ValueError):  # pragma: no cover - builtins
            signature = None
        spec = _LayerSpec(i, i == len(layer_list) - 1, names, signature, original, run)
        object.__setattr__(layer, "_attnres_spec", spec)
        object.__setattr__(layer, "_attnres_connection", conn)
        object.__setattr__(layer, "forward", types.MethodType(_patched_forward, layer))


def _settings(
    model: nn.Module, conn: nn.Module, path: str, names: tuple[str, str, str, str], d: int, eps: float
) -> dict:
    """What :func:`apply_attnres` applied: the patch's settings, also kept in a ``transformers`` config."""
    return {
        "format": SETTINGS_FORMAT,
        "residual": conn.config.to_dict(),
        "layers": path,
        "names": list(names),
        "d_model": d,
        "eps": eps,
        "base_architecture": getattr(type(model), "_attnres_base", type(model)).__name__,
    }


def apply_attnres(
    model: nn.Module,
    residual: str = "block",
    *,
    block_size: int | None = None,
    n_blocks: int | None = None,
    layers: nn.ModuleList | str | None = None,
    names: tuple[str, str, str, str] | None = None,
    d_model: int | None = None,
    eps: float | None = None,
    **options,
) -> nn.Module:
    """Replace the residual connections of ``model``'s pre-norm decoder layers by AttnRes; in place.

    Args:
        model: any ``nn.Module`` holding the decoder layers (e.g. a ``transformers``
            ``LlamaForCausalLM``). Returned, patched, for chaining.
        residual: ``"block"`` (Block AttnRes) or ``"full"`` (Full AttnRes); any rule of
            :data:`~attention_residuals.connections.RESIDUALS` works (``"prenorm"`` rebuilds the
            original model exactly, a check of the wiring).
        block_size: Block AttnRes block size ``S`` in *sublayers* (attention and MLP count one
            each, so ``S = 2`` is one decoder layer per block); or give ``n_blocks`` (``N``).
            Default: ``N ~ 8``, as in the report.
        layers: the ``nn.ModuleList`` of decoder layers or its dotted path (default: found).
        names: ``(attention, mlp, attention_norm, mlp_norm)`` attribute names in each layer
            (default: auto-detected, see :data:`KNOWN_LAYOUTS`).
        d_model: hidden size (default: the norms' weight size). ``eps``: epsilon of the key
            RMSNorm of depth attention (default: the layers' norm epsilon).
        options: more :func:`~attention_residuals.connections.make_connection` options
            (the :class:`~attention_residuals.connections.ResidualConfig` fields: ``query``,
            ``normalize``, ``depth_heads``, ``key_norm``, ``key_norm_gain``, ``intra_gate``...).

    The connection's parameters (queries zero, or drawn at ``query_init_std``) are created on the model's device and dtype
    and registered as ``attnres`` on the module owning the layer list.
    """
    _check_applicable(model, residual, options)
    path, layer_list, names = _resolve_layers(model, layers, names)
    owner = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
    if hasattr(owner, _OWNER_ATTR):
        raise ValueError(f"model: {type(owner).__name__} already has an attribute {_OWNER_ATTR!r}")

    first = layer_list[0]
    d = d_model or _hidden_size(first, names[2])
    eps = _norm_eps(getattr(first, names[2])) if eps is None else eps
    n_sub = 2 * len(layer_list)
    conn = make_connection(residual, n_sub, d, eps, block_size=block_size, n_blocks=n_blocks, **options)
    ref = next(iter(model.parameters()), None)
    if ref is not None:
        conn.to(device=ref.device, dtype=ref.dtype if ref.is_floating_point() else None)
    owner.add_module(_OWNER_ATTR, conn)

    _patch_layers(layer_list, names, conn)
    settings = _settings(model, conn, path, names, d, eps)
    patch = AttnResPatch(residual, conn, layer_list, owner, names, n_sub, settings)
    object.__setattr__(model, "attnres_patch", patch)  # not a submodule: no duplicate parameters
    _record_settings(model, settings)
    return model


def remove_attnres(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_attnres`: restore every layer's forward and drop the connection."""
    patch = getattr(model, "attnres_patch", None)
    if patch is None:
        raise ValueError("model: AttnRes is not applied")
    for layer in patch.layers:
        for attr in ("forward", "_attnres_spec", "_attnres_connection"):  # the class's forward shows again
            object.__delattr__(layer, attr)
    delattr(patch.owner, _OWNER_ATTR)
    object.__delattr__(model, "attnres_patch")
    if "save_pretrained" in model.__dict__:
        object.__delattr__(model, "save_pretrained")
    config = getattr(model, "config", None)
    if hasattr(config, "attnres"):
        del config.attnres
    return model


# --------------------------------------------------------------------------- save / load


def _save_patched(model: nn.Module, save_directory: str | os.PathLike, *args, **kwargs):
    """``save_pretrained`` of a patched model: the class's, then ``config.json`` marked as patched."""
    result = type(model).save_pretrained(model, save_directory, *args, **kwargs)
    path = Path(save_directory) / "config.json"
    if path.is_file():
        record = json.loads(path.read_text())
        record["model_type"] = PATCHED_MODEL_TYPE
        record["attnres"] = model.config.attnres
        atomic_write(path, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return result


def _connection_options(settings: dict) -> dict:
    """``apply_attnres`` keywords from recorded settings (checked: errors name the field)."""
    if settings.get("format") != SETTINGS_FORMAT:
        raise ValueError(f"attnres: settings format {settings.get('format')!r} is not {SETTINGS_FORMAT}")
    residual = ResidualConfig.from_dict(settings["residual"]).to_dict()
    rule = residual.pop("rule")
    return {
        "residual": rule,
        **residual,
        "layers": settings["layers"],
        "names": tuple(settings["names"]),
        "d_model": settings["d_model"],
        "eps": settings["eps"],
    }


@functools.cache
def patched_class(base: type) -> type:
    """``base`` (a ``transformers`` model class) whose ``__init__`` applies the AttnRes patch that
    ``config.attnres`` records: ``patched_class(LlamaForCausalLM).from_pretrained(path)`` builds the
    patched model and loads every weight, the ``attnres`` ones included."""

    def __init__(self, config, *args, **kwargs):
        base.__init__(self, config, *args, **kwargs)
        settings = getattr(config, "attnres", None)
        if not isinstance(settings, dict):
            raise ValueError(
                f"config.attnres: {type(self).__name__} needs the AttnRes settings, got {settings!r}"
            )
        apply_attnres(self, **_connection_options(settings))

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, Connection):  # whatever was not loaded: a fresh rule's values
            from transformers import initialization  # local: the hf extra; skips what was loaded

            with torch.device("cpu"):
                fresh = make_connection(module.config, module.n_layers, module.d_model, module.eps)
            for name, value in [*fresh.named_parameters(recurse=False), *fresh.named_buffers(recurse=False)]:
                target = getattr(module, name)
                initialization.copy_(target, value.to(target.dtype))
        else:
            base._init_weights(self, module)

    body = {"__init__": __init__, "_init_weights": _init_weights, "_attnres_base": base}
    return type(f"AttnRes{base.__name__}", (base,), body)


def load_patched(path: str | os.PathLike, **kwargs) -> nn.Module:
    """Load a model that :func:`apply_attnres` patched and ``save_pretrained`` saved, exactly: the
    base architecture, patched the same way, every weight loaded (``kwargs`` go to
    ``from_pretrained``: ``dtype``, ``device_map``...)."""
    import transformers  # local: the hf extra
    from transformers import AutoConfig

    path = Path(path)
    config_json = path / "config.json"
    if not config_json.is_file():
        raise ValueError(f"path {str(path)!r}: no config.json (not a saved model folder)")
    record = json.loads(config_json.read_text())
    settings = record.pop("attnres", None)
    if record.get("model_type") != PATCHED_MODEL_TYPE or not isinstance(settings, dict):
        raise ValueError(
            f"path {str(path)!r}: not a model saved with apply_attnres (model_type {record.get('model_type')!r}, "
            f"expected {PATCHED_MODEL_TYPE!r} with an 'attnres' entry)"
        )
    base_type, arch = settings.get("base_model_type"), settings.get("base_architecture")
    base = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if base is None or base_type is None:
        raise ValueError(f"attnres: base model {arch!r} / {base_type!r} is not a transformers class")
    record.pop("model_type")
    config = AutoConfig.for_model(base_type, **record)
    config.attnres = settings
    return patched_class(base).from_pretrained(path, config=config, **kwargs)
