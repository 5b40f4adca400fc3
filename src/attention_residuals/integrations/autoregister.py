"""Register the HF classes with ``transformers``' auto classes as soon as ``transformers`` loads them.

``import attention_residuals`` calls :func:`install`. It must not import ``transformers`` itself
(seconds, and an optional extra): if the auto modules are loaded already the classes are registered
now, otherwise a one-shot import hook registers them right after ``transformers`` has executed
``models.auto.configuration_auto`` (the config) and ``models.auto.modeling_auto`` (the model),
so ``AutoModelForCausalLM.from_pretrained(folder)`` works without ``trust_remote_code`` whichever of
the two packages is imported first.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["install"]

_CONFIG = "transformers.models.auto.configuration_auto"
_MODEL = "transformers.models.auto.modeling_auto"


def _register_config() -> None:
    from transformers import AutoConfig, PretrainedConfig

    from .hf_export.configuration_attnres import AttnResConfig
    from .patch import PATCHED_MODEL_TYPE

    class AttnResPatchedConfig(PretrainedConfig):
        """A folder of a model patched by ``apply_attnres``: auto classes refuse it with the way out."""

        model_type = PATCHED_MODEL_TYPE

        @classmethod
        def from_dict(cls, config_dict, **kwargs):
            raise ValueError(
                f"model_type {PATCHED_MODEL_TYPE!r}: this folder holds a {config_dict.get('attnres', {}).get('base_architecture')} "
                "patched with AttnRes, which a plain from_pretrained would load without it; "
                "load it with attention_residuals.load_patched(path)"
            )

    AutoConfig.register("attnres", AttnResConfig, exist_ok=True)
    AutoConfig.register(PATCHED_MODEL_TYPE, AttnResPatchedConfig, exist_ok=True)


def _register_model() -> None:
    from transformers import AutoModelForCausalLM

    from .hf_export.configuration_attnres import AttnResConfig
    from .hf_export.modeling_attnres import AttnResForCausalLM

    AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)


_STEPS = {_CONFIG: _register_config, _MODEL: _register_model}


def _run(name: str) -> None:
    try:
        _STEPS[name]()
    except Exception as exc:  # a broken transformers must not break `import attention_residuals`
        warnings.warn(f"attention_residuals: could not register the HF classes ({exc})", stacklevel=2)


class _Hook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of the two auto modules to register after them."""

    def __init__(self, pending: set[str]) -> None:
        self.pending = pending

    def find_spec(self, name, path=None, target=None):
        if name not in self.pending:
            return None
        self.pending.discard(name)
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)  # the finders after this one (it is no longer pending)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            _run(name)

        spec.loader.exec_module = exec_and_register
        return spec


def install() -> None:
    """Register now for what ``transformers`` has loaded, and hook the rest."""
    pending = set()
    for name in (_CONFIG, _MODEL):
        if name in sys.modules:
            _run(name)
        else:
            pending.add(name)
    if pending and not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook(pending))
