"""Load an artifact: an empty model, quantized modules swapped in, tensors memory-mapped.

Two-phase, as in gpt-fast: all quantization work happened offline; here the model skeleton is built
on the meta device, the Linears named in `config.json`'s `quantization_config.modules` are replaced
by empty runtime modules, and `load_state_dict(assign=True)` points every tensor at the mmapped file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from quant import artifact, moe, schemes, shards
from quant.errors import ArtifactError
from quant.layers import QuantizedLinear
from quant.sequential import set_module


@dataclass
class LoadedArtifact:
    model: nn.Module
    tokenizer: object
    manifest: dict
    path: Path


def cast_float_params(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the parameters of every non-quantized module to `dtype`; quantized modules keep their
    integer tensors and fp32 scales as stored."""
    for mod in model.modules():
        if isinstance(mod, QuantizedLinear):
            continue
        for p in mod.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def load(path: str | Path, dtype: torch.dtype | None = None, device: str = "cpu", verify: bool = True) -> LoadedArtifact:
    """Load the artifact at `path`. Float tensors are cast to `dtype` when given (quantized tensors and
    their scales keep their own dtypes). Hashes are verified first unless `verify=False`, which also admits a
    checkpoint without our manifest (a GPTQ checkpoint another tool wrote; its config says what it holds)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    root = Path(path)
    if verify or not root.is_dir() or (root / artifact.MANIFEST).is_file():
        manifest = artifact.verify(root) if verify else artifact.read_manifest(root)
    else:  # a GPTQ checkpoint another tool wrote: no manifest, no hashes to check
        manifest = {"scheme": None, "foreign": True}
    raw_config = json.loads((root / "config.json").read_text())
    qc = raw_config.pop("quantization_config", None)
    state = shards.read_weights(root)
    modules = schemes.module_specs(qc, state, root)
    config = AutoConfig.for_model(**raw_config)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    moe.unfuse_experts(model)  # MoE experts as per-expert Linears, as the artifact stores them
    names = moe.Names(config)
    state = {names.to_model(k): v for k, v in state.items()}
    for name, spec in modules.items():
        try:
            lin = model.get_submodule(names.to_model(name))
        except AttributeError as e:
            raise ArtifactError(f"{root / 'config.json'} names module {name} that the model does not have") from e
        try:
            empty = schemes.module_from_spec(spec, lin.in_features, lin.out_features, device="meta")
        except (ValueError, KeyError) as e:
            raise ArtifactError(f"{root / 'config.json'}: module {name}: {e}") from e
        set_module(model, names.to_model(name), empty)
    result = model.load_state_dict(state, strict=False, assign=True)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise ArtifactError(
            f"the weights in {root} do not match the model: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(result.unexpected_keys)[:3]}"
        )
    if tied:
        model.tie_weights()
    if dtype is not None:
        cast_float_params(model, dtype)
        if tied:
            model.tie_weights()
        model.config.dtype = dtype
    model.to(device).eval()
    act = model.get_input_embeddings().weight.dtype  # what the quantized modules will be called with
    for mod in model.modules():
        if isinstance(mod, QuantizedLinear):
            mod.prepare(act)  # after-load hooks: the runtime layout for `act` (int4 repacking), kernel alignment
    artifact.release_unheld_pages([*model.parameters(), *model.buffers()])  # what repacking and casting replaced
    tok = AutoTokenizer.from_pretrained(root)
    return LoadedArtifact(model, tok, manifest, root)
