"""A model whose weights are read from its checkpoint when a build stage needs them, and dropped after.

The model is built on the meta device (no storage); `load(prefix)` materialises the parameters under a
module from the checkpoint's safetensors, in the compute dtype on the build device, and applies the LoRA
adapter's deltas to them; `release(prefix)` turns everything under it back into meta tensors. A build
holds one decoder layer at a time this way, whatever the model's size.

Each load opens the safetensors files it reads and closes them before returning: the file pages it
touched are unmapped, so reading layer after layer does not grow the process.

Checkpoints that cannot be streamed (pickled `.bin` weights, a hub id, names that differ from the
model's, as transformers' load-time conversions produce for MoE experts) are loaded whole instead, and
the same stages run over the loaded model with `load` a no-op.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from quant.errors import ModelSourceError
from quant.format.shards import INDEX
from quant.format.sources import ModelSource, first_line, load_model
from quant.runtime import moe
from quant.runtime.linear import QuantizedLinear

SINGLE = "model.safetensors"


def _within(name: str, prefix: str) -> bool:
    """Whether the module or tensor `name` is `prefix` or lies under it ("" holds everything)."""
    return not prefix or name == prefix or name.startswith(f"{prefix}.")


class Checkpoint:
    """The safetensors files of a model dir, by tensor name."""

    def __init__(self, root: Path, files: dict[str, str], stored: dict[str, str] | None = None):
        self.root, self.files = root, files  # tensor name -> file name
        self.stored = stored or {}  # tensor name -> the name it is stored under, where they differ

    def renamed(self, to_model: Callable[[str], str]) -> Checkpoint:
        """This checkpoint with its tensors named as the model names them (`to_model` of the stored name)."""
        files, stored = {}, {}
        for name, file in self.files.items():
            new = to_model(name)
            files[new] = file
            if new != name:
                stored[new] = name
        return Checkpoint(self.root, files, stored)

    @classmethod
    def find(cls, root: Path) -> Checkpoint | None:
        """The dir's safetensors checkpoint (one file or an index), or None if it has none."""
        from safetensors import safe_open

        root = Path(root)
        if (root / INDEX).is_file():
            try:
                files = dict(json.loads((root / INDEX).read_text())["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ModelSourceError(f"{root / INDEX} is not a safetensors index: {first_line(e)}") from e
            return cls(root, files)
        if (root / SINGLE).is_file():
            try:
                with safe_open(str(root / SINGLE), "pt") as f:
                    return cls(root, {name: SINGLE for name in f.keys()})
            except Exception as e:  # noqa: BLE001 - the library raises its own error types
                raise ModelSourceError(f"cannot read {root / SINGLE}: {first_line(e)}") from e
        return None

    def read(self, names: dict[str, str], dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
        """{key: tensor} for {key: checkpoint name}, floating tensors in `dtype`, on `device`."""
        from safetensors import safe_open

        by_file: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for key, name in names.items():
            by_file[self.files[name]].append((key, name))
        out = {}
        for file, pairs in by_file.items():
            try:
                with safe_open(str(self.root / file), "pt") as f:
                    for key, name in pairs:
                        t = f.get_tensor(self.stored.get(name, name))
                        out[key] = t.to(device, dtype) if t.is_floating_point() else t.to(device)
            except Exception as e:  # noqa: BLE001 - a damaged shard is a bad model source
                raise ModelSourceError(f"cannot read {self.root / file}: {first_line(e)}") from e
        return out


def _meta_skeleton(path: str):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()  # tied names then share one (meta) Parameter, read once from the checkpoint
    moe.unfuse_experts(model)  # per-expert Linears, named as the checkpoint names them
    return model.eval()


class StreamedModel:
    """`model` plus where each of its parameters comes from. `on_load(names, param)` is called once for
    every parameter materialised (with all the names it goes by, tied weights having several)."""

    def __init__(self, model: nn.Module, tokenizer, ckpt: Checkpoint | None, dtype: torch.dtype,
                 device: torch.device | str, reason: str | None = None):
        self.model, self.tokenizer, self.ckpt = model, tokenizer, ckpt
        self.dtype, self.device = dtype, torch.device(device)
        self.reason = reason  # why the model is not streamed (None when it is)
        self.on_load: Callable[[tuple[str, ...], nn.Parameter], None] | None = None
        # Tied weights are one Parameter under several names: group the slots that hold it.
        slots: dict[int, list[tuple[str, nn.Module, str]]] = defaultdict(list)
        for mod_name, mod in model.named_modules(remove_duplicate=False):
            for attr, p in mod.named_parameters(recurse=False):
                slots[id(p)].append((f"{mod_name}.{attr}" if mod_name else attr, mod, attr))
        self._slots = {name: group for group in slots.values() for name, _, _ in group}
        self._slot_names = {(id(mod), attr): name for name, group in self._slots.items() for _, mod, attr in group}

    @property
    def streamed(self) -> bool:
        return self.ckpt is not None

    def _ckpt_name(self, name: str) -> str:
        for alias, _, _ in self._slots[name]:
            if alias in self.ckpt.files:
                return alias
        raise ModelSourceError(f"the checkpoint has no tensor {name}")

    def _under(self, prefix: str, exclude: tuple[str, ...]):
        """(full name, module) of the modules under `prefix`, minus the subtrees named in `exclude`."""
        root = self.model.get_submodule(prefix)
        dot = f"{prefix}." if prefix else ""
        for n, mod in root.named_modules():
            full = f"{dot}{n}" if n else prefix
            if not any(_within(full, e) for e in exclude):
                yield full, mod

    def load(self, prefix: str = "", exclude: tuple[str, ...] = ()) -> None:
        """Materialise every parameter (and checkpointed buffer) of the modules under `prefix` ("" = the
        whole model) but those under the `exclude` prefixes."""
        if self.ckpt is None:
            return
        params, buffers = {}, set()
        for full, mod in self._under(prefix, exclude):
            dot = f"{full}." if full else ""
            params.update({f"{dot}{a}": p for a, p in mod.named_parameters(recurse=False) if p.is_meta})
            buffers.update(f"{dot}{a}" for a in mod._buffers if f"{dot}{a}" in self.ckpt.files)
        wanted = {name: self._ckpt_name(name) for name in params} | {name: name for name in buffers}
        for name, t in self.ckpt.read(wanted, self.dtype, self.device).items():
            mod_name, _, attr = name.rpartition(".")
            if name in buffers:
                self.model.get_submodule(mod_name).register_buffer(attr, t)
                continue
            p = nn.Parameter(t, requires_grad=False)
            for _, mod, a in self._slots[name]:
                mod._parameters[a] = p
            if self.on_load is not None:
                self.on_load(tuple(n for n, _, _ in self._slots[name]), p)

    def release(self, prefix: str = "", exclude: tuple[str, ...] = ()) -> None:
        """Drop the storage of the parameters and persistent buffers of the modules under `prefix` but those
        under `exclude` (shapes and dtypes stay, on meta). Non-persistent buffers (rotary tables) stay.
        A model loaded whole cannot re-read a weight, so there a weight tied to a module outside the part
        is kept."""
        part = list(self._under(prefix, exclude))
        inside = {id(mod) for _, mod in part}
        for _, mod in part:
            for attr, p in list(mod._parameters.items()):
                if p is None or p.is_meta:
                    continue
                name = self._slot_names.get((id(mod), attr))
                group = self._slots[name] if name else [(None, mod, attr)]
                if not self.streamed and any(id(owner) not in inside for _, owner, _ in group):
                    continue
                meta = nn.Parameter(p.detach().to("meta"), requires_grad=False)
                for _, owner, a in group:
                    owner._parameters[a] = meta
            for attr, b in list(mod._buffers.items()):
                if b is not None and not b.is_meta and attr not in mod._non_persistent_buffers_set:
                    mod._buffers[attr] = b.to("meta")
        # Modules quantization swapped out of the part still hold the weights loaded into them: drop those
        # too (they are no longer in the tree walked above, and would otherwise live on, one layer each).
        if self.streamed:
            for name, group in self._slots.items():
                if _within(name, prefix) and not any(_within(name, e) for e in exclude):
                    for _, owner, a in group:
                        p = owner._parameters.get(a)
                        if p is not None and not p.is_meta:
                            owner._parameters[a] = nn.Parameter(p.detach().to("meta"), requires_grad=False)


    def part_state(self, prefix: str = "", exclude: tuple[str, ...] = (),
                   float_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The parameters and persistent buffers of the modules under `prefix` but `exclude`, by full name.
        With `float_dtype`, the floating parameters of modules that are not quantized are cast to it first
        (quantized modules, those with a `spec`, keep the dtypes they store)."""
        out = {}
        for full, mod in self._under(prefix, exclude):
            dot = f"{full}." if full else ""
            cast = float_dtype is not None and not isinstance(mod, QuantizedLinear)
            for attr, p in mod._parameters.items():
                if p is None:
                    continue
                if cast and p.is_floating_point() and p.dtype != float_dtype:
                    p.data = p.data.to(float_dtype)  # tied slots hold this same Parameter
                out[f"{dot}{attr}"] = p.detach()
            for attr, b in mod._buffers.items():
                if b is not None and attr not in mod._non_persistent_buffers_set:
                    out[f"{dot}{attr}"] = b
        return out


def open_model(source: ModelSource, dtype: torch.dtype, device: torch.device | str, log=print) -> StreamedModel:
    """The source as a StreamedModel: a meta skeleton over its safetensors, or loaded whole when it cannot
    be streamed (the reason is logged)."""
    from transformers import AutoTokenizer

    reason = None
    ckpt = Checkpoint.find(Path(source.path)) if source.kind != "hub" else None
    if ckpt is None:
        reason = "it is not a local safetensors checkpoint"
    else:
        try:
            model = _meta_skeleton(source.path)
            tok = AutoTokenizer.from_pretrained(source.path)
        except Exception as e:  # noqa: BLE001 - any loader failure on user input is a bad model source
            raise ModelSourceError(f"cannot load model {source.spec!r}: {type(e).__name__}: {first_line(e)}") from e
        ckpt = ckpt.renamed(moe.Names(model.config).to_model)
        sm = StreamedModel(model, tok, ckpt, dtype, device)
        names = set(model.state_dict())
        absent = sorted(n for n in names if n in sm._slots and not any(a in ckpt.files for a, _, _ in sm._slots[n]))
        if not absent:
            return sm
        reason = f"its tensor names differ from the model's (no {absent[0]})"
    log(f"loading the whole model (not streamed layer by layer: {reason})")
    model, tok = load_model(source, dtype, device)
    moe.unfuse_experts(model)
    return StreamedModel(model, tok, None, dtype, device, reason)
