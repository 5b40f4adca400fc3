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
sources: the depth-mean model.

How: each decoder layer's ``forward`` is replaced (instance attribute; the class is untouched) by
one that runs its two sublayers, passing the layer's own keyword arguments (mask, rotary
embeddings, cache...) to the attention module exactly as the original layer would. The tensor a
patched layer returns is the *input of the next sublayer* (``h_{2i+2}``; the last layer returns
``residual.final(state)``), so what flows between layers is still an ordinary ``[B, T, d]``
hidden state, the model's own final norm and head apply unchanged, and ``output_hidden_states``
shows the AttnRes inputs. The depth sources (earlier layer outputs / block sums) travel with that
tensor as the attribute ``attnres_state``; each layer copies the state before extending it, so a
layer can be re-run (recomputation) without corrupting it.

Requirements (checked where possible; errors say what is wrong):

* the decoder layers are one ``nn.ModuleList`` run in order, layer 0 receives the embeddings and
  each layer returns its hidden-states tensor (the ``transformers`` >= 5 convention);
* each layer has an attention module, an MLP and their two input norms (names auto-detected for
  Llama/Mistral/Qwen-style ``self_attn``/``mlp``/``input_layernorm``/``post_attention_layernorm``
  and GPT-2/nanoGPT-style ``attn``/``mlp``/``ln_1``/``ln_2``; or pass them);
* no gradient checkpointing of the decoder layers (the patched forward bypasses it).

Example::

    from transformers import LlamaConfig, LlamaForCausalLM
    from attention_residuals.integrations.patch import apply_attnres
    model = apply_attnres(LlamaForCausalLM(LlamaConfig(...)), "block", n_blocks=4)
    model.generate(ids, max_new_tokens=20)     # the KV cache works as before

Loading a trained patched model: build and patch the same architecture, then
``load_state_dict`` (the ``...attnres.*`` keys belong to the patch).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable

import torch
import torch.nn as nn

from ..connections import RESIDUALS, Connection, ResidualState, make_connection

__all__ = ["AttnResPatch", "apply_attnres", "find_decoder_layers", "remove_attnres"]

#: (attention, mlp, attention input norm, mlp input norm) attribute names tried in order
KNOWN_LAYOUTS: tuple[tuple[str, str, str, str], ...] = (
    ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"),  # Llama, Mistral, Qwen, ...
    ("attn", "mlp", "ln_1", "ln_2"),  # GPT-2, nanoGPT
    ("attention", "mlp", "input_layernorm", "post_attention_layernorm"),
    ("attention", "feed_forward", "attention_norm", "ffn_norm"),  # Meta's llama reference code
)

STATE_ATTR = "attnres_state"
_OWNER_ATTR = "attnres"


@dataclasses.dataclass
class AttnResPatch:
    """What :func:`apply_attnres` did (also stored as ``model.attnres_patch``)."""

    residual: str
    connection: Connection
    layers: nn.ModuleList
    owner: nn.Module
    names: tuple[str, str, str, str]
    n_sublayers: int


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


def _copy_state(state: ResidualState) -> ResidualState:
    """A copy whose lists/dicts can be extended without touching ``state`` (tensors are shared)."""
    new = dataclasses.replace(state)
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if isinstance(value, list | dict):
            setattr(new, f.name, type(value)(value))
    return new


def _first(output):
    """A sublayer's output tensor (attention modules often return ``(output, weights)``)."""
    return output[0] if isinstance(output, tuple | list) else output


@dataclasses.dataclass
class _LayerSpec:
    index: int
    last: bool
    names: tuple[str, str, str, str]
    signature: inspect.Signature | None
    original: Callable


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
        if spec.signature is None:
            raise TypeError("patched decoder layer: pass the extra arguments by keyword")
        bound = spec.signature.bind_partial(hidden_states, *args, **kwargs)
        kwargs = dict(bound.arguments)
        kwargs.pop(next(iter(spec.signature.parameters)))
        for name, p in spec.signature.parameters.items():  # the original's **kwargs: flatten them
            if p.kind is inspect.Parameter.VAR_KEYWORD and name in kwargs:
                kwargs.update(kwargs.pop(name))
    if spec.index == 0:
        state = conn.init_state(hidden_states)
        h = conn.read(state, 0)
    else:
        incoming = getattr(hidden_states, STATE_ATTR, None)
        if incoming is None:
            raise RuntimeError(
                f"AttnRes decoder layer {spec.index}: its input carries no depth state. The patched layers "
                "must run in order from layer 0, each receiving the tensor the previous one returned (a "
                "module between them replaced it, or gradient checkpointing detached it)"
            )
        state = _copy_state(incoming)
        h = hidden_states
    l = 2 * spec.index
    conn.write(state, l, _first(getattr(self, attn_name)(getattr(self, attn_norm_name)(h), **kwargs)))
    h = conn.read(state, l + 1)
    conn.write(state, l + 1, _first(getattr(self, mlp_name)(getattr(self, mlp_norm_name)(h))))
    if spec.last:
        return conn.final(state)
    # a fresh tensor object carries the state: a source held by the state itself (PreNorm's running
    # sum) would otherwise point back at the state, a reference cycle that delays freeing memory
    out = conn.read(state, l + 2).view_as(h)
    setattr(out, STATE_ATTR, state)
    return out


def _checkpointing(model: nn.Module) -> bool:
    """Whether ``transformers`` gradient (activation) checkpointing is on anywhere in ``model``."""
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        return True
    for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # newer name first
        if isinstance(getattr(type(model), attr, None), property):
            return bool(getattr(model, attr))
    return False


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

    The connection's parameters (zero-init queries) are created on the model's device and dtype
    and registered as ``attnres`` on the module owning the layer list.
    """
    if "mode" in options:
        raise TypeError("apply_attnres: mode= is now residual= (the rule's one name everywhere)")
    if residual not in RESIDUALS:
        raise ValueError(f"residual: expected one of {RESIDUALS}, got {residual!r}")
    if getattr(model, "attnres_patch", None) is not None:
        raise ValueError("model: AttnRes is already applied (remove_attnres(model) first)")
    if _checkpointing(model):
        raise ValueError("model: gradient checkpointing is enabled; disable it before apply_attnres")
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
        path, layer_list, names = find_decoder_layers(model, names)
    else:
        raise TypeError(
            f"layers: expected an nn.ModuleList, a dotted path or None, got {type(layers).__name__}"
        )
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

    for i, layer in enumerate(layer_list):
        original = layer.forward
        try:
            signature = inspect.signature(original)
        except (TypeError, ValueError):  # pragma: no cover - builtins
            signature = None
        spec = _LayerSpec(i, i == len(layer_list) - 1, names, signature, original)
        object.__setattr__(layer, "_attnres_spec", spec)
        object.__setattr__(layer, "_attnres_connection", conn)
        object.__setattr__(layer, "forward", types.MethodType(_patched_forward, layer))
    patch = AttnResPatch(residual, conn, layer_list, owner, names, n_sub)
    object.__setattr__(model, "attnres_patch", patch)  # not a submodule: no duplicate parameters
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
    return model
