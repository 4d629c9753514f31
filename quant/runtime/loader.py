"""Load an artifact: an empty model, quantized modules swapped in, tensors memory-mapped.

Two-phase, as in gpt-fast: all quantization work happened offline; here a model skeleton is built without
weights, the Linears named in `config.json`'s `quantization_config.modules` become empty runtime modules, and
every tensor is assigned from the mmapped file. ``load`` builds transformers' model class (its forward
evaluates); ``load_for_engine`` builds a module tree by checkpoint name (``quant.runtime.module_tree``), which is all the
engine's own model definitions read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from quant.errors import ArtifactError
from quant.format import artifact, model_config, shards
from quant.runtime import module_tree, moe, registry
from quant.runtime.linear import QuantizedLinear, set_module


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


def copy_small_params(model: nn.Module) -> None:
    """Copy the float vectors (norm weights, biases) out of the weights file's map. Kept mapped, each one's
    first touch faults in the whole page-cache folio around it, and its neighbours in the file are the large
    weights that loading replaced and released: a request then brought 36 MiB of them back into the 1.1B 4-bit
    server's RSS (bench/served_memory.py). The copies are a few hundred KiB."""
    for mod in model.modules():
        if isinstance(mod, QuantizedLinear):
            continue  # its small tensors (scales) sit beside its own weights in the file, which it holds
        for p in mod.parameters(recurse=False):
            if p.is_floating_point() and p.dim() <= 1:
                p.data = p.data.clone()


def _read(root: Path, verify: bool) -> tuple[dict, dict, dict | None, dict]:
    """(manifest, config.json less its quantization block, that block, name -> tensor memory-mapped). Hashes are
    verified first unless ``verify`` is False, which also admits a checkpoint without our manifest (a GPTQ
    checkpoint another tool wrote, or a plain model dir: its config says what it holds)."""
    if verify or not root.is_dir() or (root / artifact.MANIFEST).is_file():
        manifest = artifact.verify(root) if verify else artifact.read_manifest(root)
    else:
        manifest = {"scheme": None, "foreign": True}
    raw_config = json.loads((root / "config.json").read_text())
    qc = raw_config.pop("quantization_config", None)
    return manifest, raw_config, qc, shards.read_weights(root)


def _finish(model: nn.Module, dtype: torch.dtype | None, device: str) -> None:
    """Cast the float parameters, move, run every quantized module's after-load hook for the activation dtype
    (int4 repacking, kernel alignment), and let go of the file pages that replaced tensors occupied."""
    if dtype is not None:
        cast_float_params(model, dtype)
    copy_small_params(model)
    model.to(device).eval()
    # what the quantized modules will be called with
    act = dtype if dtype is not None else model.get_input_embeddings().weight.dtype
    for mod in model.modules():
        if isinstance(mod, QuantizedLinear):
            mod.prepare(act)
    artifact.release_unheld_pages([*model.parameters(), *model.buffers()])  # what repacking and casting replaced


def load(path: str | Path, dtype: torch.dtype | None = None, device: str = "cpu", verify: bool = True) -> LoadedArtifact:
    """Load the artifact at `path` into transformers' model class (for its forward: evaluation, export checks).
    Float tensors are cast to `dtype` when given (quantized tensors and their scales keep their own dtypes).
    Hashes are verified first unless `verify=False` (see ``_read``)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    root = Path(path)
    manifest, raw_config, qc, state = _read(root, verify)
    modules = registry.module_specs(qc, state, root)
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
            empty = registry.module_from_spec(spec, lin.in_features, lin.out_features, device="meta")
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
        model.config.dtype = dtype
        if tied:
            model.tie_weights()
    _finish(model, None, device)
    tok = AutoTokenizer.from_pretrained(root)
    return LoadedArtifact(model, tok, manifest, root)


def load_for_engine(path: str | Path, dtype: torch.dtype | None = None, device: str = "cpu", verify: bool = True,
                    cache_dir: str | Path | None = None, check_config=None) -> LoadedArtifact:
    """Load an artifact, a GPTQ checkpoint (``verify=False``) or a plain safetensors model dir (``verify=False``:
    served unquantized) as the engine reads it: a module tree by checkpoint name (``quant.runtime.module_tree``), the
    config normalised by transformers out of process (``quant.format.model_config``, cached under ``cache_dir``), the
    tokenizer transformers' AutoTokenizer picks. transformers' modeling classes are never imported, so the
    serving process does not carry them (bench/served_memory.py). ``check_config(config)`` runs before any
    weight is read (the engine refuses an architecture it does not serve there)."""
    from transformers import AutoTokenizer

    root = Path(path)
    manifest, _, qc, state = _read(root, verify)  # hashes checked; the weights mapped, not read
    config = model_config.read(root, cache_dir)
    if check_config is not None:
        check_config(config)
    specs = registry.module_specs(qc, state, root) if qc is not None else {}
    model = module_tree.build(state, specs, config, model_config.generation_eos(root))
    _finish(model, dtype, device)
    tok = AutoTokenizer.from_pretrained(root, config=config)  # given the config, it imports no config class
    return LoadedArtifact(model, tok, manifest, root)
