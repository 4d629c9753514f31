"""The runtime modules by the spec type an artifact's config names them with: the one place the loader and the
checkpoint tree turn a module spec into an empty quantized module (filled by ``load_state_dict``), and read the
specs of a GPTQ checkpoint (ours or another tool's) from its tensors."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from quant.errors import ArtifactError
from quant.format import artifact
from quant.runtime.int4 import GPTQLinear
from quant.runtime.int8 import Int8WeightLinear
from quant.runtime.linear import QuantizedLinear
from quant.runtime.w8a8 import W8A8Linear

RUNTIME: dict[str, type[QuantizedLinear]] = {cls.SPEC_TYPE: cls for cls in (Int8WeightLinear, W8A8Linear, GPTQLinear)}


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
        return gptq_specs(qc, state, root / "config.json")
    raise ArtifactError(f"{root / 'config.json'} has no quantserve or GPTQ quantization_config")


def gptq_specs(qc: dict, state: dict, config_path: Path) -> dict[str, dict]:
    """Module specs of a GPTQ checkpoint (ours or another tool's): every module with a `qweight`."""
    if qc.get("bits") != 4 or qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise ArtifactError(f"{config_path}: only 4-bit GPTQ (gptq / gptq_v2) is supported")
    v2 = qc.get("checkpoint_format") == "gptq_v2"
    names = [k[: -len(".qweight")] for k in state if k.endswith(".qweight")]
    return {n: {"type": GPTQLinear.SPEC_TYPE, "group_size": int(qc["group_size"]), "v2": v2,
                "bias": f"{n}.bias" in state} for n in names}


def quantized_modules(model: nn.Module) -> dict[str, QuantizedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
