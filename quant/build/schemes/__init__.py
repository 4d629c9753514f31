"""The quantization schemes, registered by name: the one place the build, the memory predictions and the CLI look
a scheme up (see ``quant.build.schemes.base`` for what a scheme states). A new scheme is one module here (its
options, its layer quantizer, what it writes, its predicted bytes) plus its runtime module in ``quant/runtime/``
(listed in ``quant.runtime.registry``); nothing else switches on scheme names.
"""

from __future__ import annotations

from quant.build.schemes import int8, w4, w8a8
from quant.build.schemes.base import LayerQuantizer, Scheme
from quant.errors import ConfigError

REGISTRY: dict[str, Scheme] = {s.name: s for mod in (int8, w8a8, w4) for s in mod.SCHEMES}

__all__ = ["REGISTRY", "LayerQuantizer", "Scheme", "get", "names", "validated"]


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def get(name: str, flag: str = "--scheme") -> Scheme:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown {flag} {name!r}; choose one of {', '.join(REGISTRY)}") from None


def validated(cfg) -> Scheme:
    """The scheme a build uses, after refusing (in one line, before any work) an unknown scheme, options it cannot
    honour, and any invalid option of the build (``BuildConfig.validate``)."""
    scheme = get(cfg.scheme)
    scheme.check(cfg)
    cfg.validate()
    return scheme
