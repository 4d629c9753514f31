"""The quantization schemes, registered by name: the one place the build, the loader, the memory model and
the server look a scheme up (see ``quant.schemes.base`` for what a scheme states). A new scheme is one module
here plus its runtime module; nothing else switches on scheme names.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from quant import artifact
from quant.errors import ArtifactError, ConfigError
from quant.layers import QuantizedLinear
from quant.schemes import int8, w4, w8a8
from quant.schemes.base import LayerQuantizer, Scheme

REGISTRY: dict[str, Scheme] = {s.name: s for mod in (int8, w8a8, w4) for s in mod.SCHEMES}
# Runtime modules by the spec type an artifact's config names them with.
RUNTIME: dict[str, type[QuantizedLinear]] = {cls.SPEC_TYPE: cls for s in REGISTRY.values() for cls in s.runtime}

__all__ = ["REGISTRY", "RUNTIME", "LayerQuantizer", "Scheme", "get", "module_from_spec", "module_specs", "names",
           "quantized_modules"]


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def get(name: str, flag: str = "--scheme") -> Scheme:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown {flag} {name!r}; choose one of {', '.join(REGISTRY)}") from None


def module_from_spec(spec: dict, in_features: int, out_features: int, device=None) -> QuantizedLinear:
    """The empty runtime module an artifact's config describes (filled by load_state_dict)."""
    cls = RUNTIME.get(spec.get("type"))
    if cls is None:
        raise ValueError(f"unknown quantized module type {spec.get('type')!r}; known: {', '.join(RUNTIME)}")
    return cls.from_spec(spec, in_features, out_features, device=device)


def module_specs(qc, state: dict, root: Path) -> dict[str, dict]:
    """Which modules of an artifact are quantized, and how: from our own config block, or for GPTQ
    checkpoints (ours or another tool's) from the tensors themselves."""
    if isinstance(qc, dict) and qc.get("quant_method") == artifact.QUANT_METHOD:
        return qc["modules"]
    if isinstance(qc, dict) and qc.get("quant_method") == "gptq":
        return w4.read_specs(qc, state, root / "config.json")
    raise ArtifactError(f"{root / 'config.json'} has no quantserve or GPTQ quantization_config")


def quantized_modules(model: nn.Module) -> dict[str, QuantizedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
