"""The engine's model definitions: one module per architecture family, built from ``server.layers`` over
``server.attention``, registered by ``config.model_type``.

Adding an architecture is one file here plus its test in tests/test_models.py:

1. subclass ``base.CausalLM`` and set what differs from Llama: weight names (``qkv``, ``gate_up`` ...,
   one name where the checkpoint stores a fused projection), ``norms`` (which of the four a layer has),
   ``norm_offset`` (Gemma's 1 + w), ``qk_norm``; override the hooks the config drives (``attention_spec``
   for scale / window / soft-cap, ``embed_scale``, ``residual_scale``, ``finish_logits``, ``activation``,
   ``rope_layer_type``);
2. decorate it with ``@register("model_type", ...)``. Every module in this package is imported by
   ``model_class``, so nothing else needs editing;
3. add the model type to ``ARCHITECTURES`` in tests/test_models.py: the engine is held to transformers'
   forward and ``generate`` on a tiny random model of it, and each scheme's artifact to ``quant.load``.

A model type nobody registered is refused in one line naming it and listing the supported ones.
"""

from __future__ import annotations

import importlib
import pkgutil

from quant.errors import UnsupportedModelError

_REGISTRY: dict[str, type] = {}
_loaded = False


def register(*model_types: str):
    def deco(cls):
        for t in model_types:
            if t in _REGISTRY:
                raise ValueError(f"model type {t!r} registered twice ({_REGISTRY[t].__name__}, {cls.__name__})")
            _REGISTRY[t] = cls
        return cls

    return deco


def _load_all() -> None:
    global _loaded
    if not _loaded:
        for m in pkgutil.iter_modules(__path__):
            if m.name != "base":
                importlib.import_module(f"{__name__}.{m.name}")
        _loaded = True


def supported() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def model_class(config) -> type:
    _load_all()
    kind = getattr(config, "model_type", None)
    if kind not in _REGISTRY:
        raise UnsupportedModelError(
            f"the engine does not serve model type {kind!r}; it serves: {', '.join(supported())}")
    return _REGISTRY[kind]


def build(model, ops, embeddings: str = "float", chooser=None):
    """The engine's model over a loaded checkpoint's module tree (``base.Weights``), its embedding and head held
    as ``embeddings`` says (server.layers.embedding), each projection computed by the path ``chooser`` (a
    ``quant.runtime.kernel_choice.Chooser``) plans for it, or by its module's own rule without one."""
    from server.models.base import Weights

    return model_class(model.config)(model.config, Weights(model), ops, embeddings, chooser)


__all__ = ["UnsupportedModelError", "build", "model_class", "register", "supported"]
