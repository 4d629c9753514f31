"""A checkpoint's tensors as a module tree by their names, without transformers' modeling classes.

The engine reads a checkpoint through its own model definitions (``server.models``), which only look modules
and tensors up by name. Building transformers' model class on the meta device to hold them costs the serving
process the whole modeling stack (bench/served_memory.py). Here each name's parent path becomes a plain
``nn.Module``; a module whose tensors are a 2-D ``weight`` and an optional 1-D ``bias`` becomes an
``nn.Linear`` (the input embedding too: only its weight is read); the modules an artifact's config quantizes become
their scheme's runtime module, shaped from their stored tensors. Every tensor is the memory-mapped one,
assigned, not copied. A tied head (``tie_word_embeddings`` and no separate head weight in the file, or
transformers' tying rule) shares the embedding's parameter.
"""

from __future__ import annotations

from collections import defaultdict

from torch import Tensor, nn

from quant.errors import ArtifactError
from quant.runtime import registry

EMBEDDING = "embed_tokens"  # the input embedding's module name in every family the engine serves
HEAD = "lm_head"


class CheckpointModel(nn.Module):
    """The module tree of one checkpoint, with its normalised config and generation stop ids."""

    def __init__(self, config, generation_eos=None):
        super().__init__()
        self.config = config
        self.generation_eos = generation_eos  # generation_config.json's eos_token_id, when the file has one
        self._embedding: str | None = None

    def get_input_embeddings(self) -> nn.Module:
        if self._embedding is None:
            raise ArtifactError(f"the checkpoint has no {EMBEDDING} weight")
        return self.get_submodule(self._embedding)


def _place(root: nn.Module, name: str, mod: nn.Module) -> None:
    """Put ``mod`` at dotted ``name`` under ``root``, creating plain containers on the way."""
    *path, leaf = name.split(".")
    parent = root
    for part in path:
        child = parent._modules.get(part)
        if child is None:
            child = nn.Module()
            parent.add_module(part, child)
        parent = child
    if leaf in parent._modules:
        raise ArtifactError(f"the checkpoint names module {name!r} twice")
    parent.add_module(leaf, mod)


def _linear(w: Tensor, b: Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` over given tensors (a Parameter is taken as it is: a tied head shares the embedding's),
    built without its constructor: that would initialise the weight, which on the meta device runs a torch
    reference op that imports torch dynamo (~120 MiB resident)."""
    mod = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(mod)
    mod.in_features, mod.out_features = int(w.shape[1]), int(w.shape[0])
    mod.weight = w if isinstance(w, nn.Parameter) else nn.Parameter(w, requires_grad=False)
    mod.bias = None if b is None else nn.Parameter(b, requires_grad=False)
    return mod


def _float_module(tensors: dict[str, Tensor]) -> nn.Module:
    """A Linear where the tensors are an (out, in) weight and an optional (out,) bias; else a plain holder."""
    w, b = tensors.get("weight"), tensors.get("bias")
    if (w is not None and w.dim() == 2 and set(tensors) <= {"weight", "bias"}
            and (b is None or (b.dim() == 1 and b.shape[0] == w.shape[0]))):
        return _linear(w, b)
    mod = nn.Module()
    for leaf, t in tensors.items():
        setattr(mod, leaf, nn.Parameter(t, requires_grad=False))
    return mod


def build(state: dict[str, Tensor], specs: dict[str, dict], config, generation_eos=None) -> CheckpointModel:
    """The tree of ``state`` (name -> tensor, memory-mapped), the modules in ``specs`` (name -> the artifact's
    per-module spec) as their scheme's runtime modules. Raises ArtifactError naming a module whose tensors do not
    fit its spec."""
    root = CheckpointModel(config, generation_eos)
    by_module: dict[str, dict[str, Tensor]] = defaultdict(dict)
    for key, t in state.items():
        mod, _, leaf = key.rpartition(".")
        by_module[mod][leaf] = t
    for name, spec in specs.items():
        tensors = by_module.pop(name, None)
        if not tensors:
            raise ArtifactError(f"config.json names quantized module {name} that the weights do not hold")
        try:
            cls = registry.RUNTIME[spec.get("type")]
            mod = registry.module_from_spec(spec, *cls.features(tensors), device="meta")
            mod.load_state_dict(tensors, strict=True, assign=True)
        except (KeyError, ValueError, RuntimeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ArtifactError(f"module {name}: its tensors do not fit its spec {spec}: {first}") from None
        _place(root, name, mod)
    for name, tensors in by_module.items():
        if not name:
            raise ArtifactError(f"the checkpoint holds top-level tensors {sorted(tensors)[:3]}, not a model's")
        _place(root, name, _float_module(tensors))
        if name.rpartition(".")[2] == EMBEDDING and "weight" in tensors:
            root._embedding = name
    _tie_head(root, config)
    return root


def _tie_head(root: CheckpointModel, config) -> None:
    """transformers' rule: with ``tie_word_embeddings`` the head is the embedding's matrix, whatever the file
    stores under the head's name; without it and without a head weight, nothing is made up."""
    if not getattr(config, "tie_word_embeddings", False) or root._embedding is None:
        return
    head = _linear(root.get_input_embeddings().weight, None)  # (V, hidden), the embedding's own parameter
    if HEAD in root._modules:
        del root._modules[HEAD]
    root.add_module(HEAD, head)

