"""Merge a PEFT LoRA adapter into a model's Linear weights before quantizing, like `merge_and_unload()`.

Semantics follow PEFT 0.21 (peft/tuners/lora/layer.py `Linear.merge`/`get_delta_weight`,
tuners/tuners_utils.py `check_target_module_exists`/`_maybe_include_all_linear_layers`,
utils/other.py `get_pattern_key`, tuners/lora/model.py `_create_and_replace`, `dispatch_default`):
- W' = W + transpose(B @ A, fan_in_fan_out) * scaling, scaling = alpha / r (alpha / sqrt(r) with
  rsLoRA); the sum is taken in fp32 (fp64 for fp64 weights) and rounded once to W's dtype, which is
  what PEFT's `weight.data += delta` does with the fp32 adapter it autocasts on load;
- fan_in_fan_out is forced False for nn.Linear and True for transformers' Conv1D, whatever the config;
- r / alpha per module: the first `rank_pattern` / `alpha_pattern` key (file order) that matches
  `re.match(rf"(.*\\.)?({key})$", module_name)`, i.e. a regex anchored at a dot boundary at the end;
- targets: `exclude_modules` (str: fullmatch; list: exact or ".suffix") wins; `target_modules` as a
  str is a regex fullmatch ("all-linear": every Linear/Conv1D but the output embedding); as a list,
  exact name or ".suffix", then filtered by `layers_to_transform` (index after `layers_pattern`, or the
  first numbered segment) unless the name was listed exactly.
Stricter than PEFT where PEFT would silently drop or invent weights: tensors for a module the config
does not target, or a targeted module without tensors, are refused. `modules_to_save` (full trained
copies of modules) are refused rather than applied: replacing e.g. a tied lm_head would silently untie
or rewrite the embedding; likewise a saved `<module>.base_layer.weight` (PEFT saves lm_head's) is
accepted only when it equals the model's weight. A targeted Linear whose weight is tied to another
module (lm_head / embed_tokens) changes both, as in PEFT. Only safetensors are read; nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from quant.errors import QuantError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"(?P<module>.+)\.(?:lora_(?P<which>[AB])|base_layer)\.weight")  # base_layer: "W"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# init schemes that only set A/B (overwritten by the loaded tensors); pissa/olora/corda/loftq/lora_ga
# also rewrite the base weight when PEFT loads the adapter, which we cannot reproduce.
_PLAIN_INITS = ("gaussian", "eva", "orthogonal")  # and True / False
_UNSUPPORTED_FIELDS = (  # LoRA variants and extras whose merge is not W + s * B @ A
    "velora_config", "alora_invocation_tokens", "monteclora_config", "use_bdlora", "arrow_config",
    "kasa_config", "use_qalora", "layer_replication", "target_parameters", "trainable_token_indices",
    "lora_bias", "megatron_config",
)


class LoraError(QuantError):
    """A LoRA adapter is missing, damaged, of an unsupported kind or does not fit the model."""


@dataclass(frozen=True)
class AdapterInfo:
    path: str
    fingerprint: str  # sha256 over adapter_config.json + adapter_model.safetensors bytes
    base_model: str | None  # adapter_config's base_model_name_or_path
    r: int
    lora_alpha: float
    use_rslora: bool
    modules: tuple[str, ...]  # full module names merged, sorted

    def to_dict(self) -> dict:
        d = asdict(self)
        d["modules"] = list(self.modules)
        return d


def read_adapter(adapter_dir) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json as a dict, adapter_model.safetensors tensors); never unpickles."""
    config, tensors, _ = _read(Path(adapter_dir))
    return config, tensors


def adapter_fingerprint(adapter_dir) -> str:
    """The sha256 recorded in AdapterInfo.fingerprint, for checking an adapter has not changed."""
    return _read(Path(adapter_dir))[2]


def _read(d: Path) -> tuple[dict, dict[str, torch.Tensor], str]:
    """Config, tensors and the sha256 of exactly the bytes they were parsed from."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    if not d.is_dir():
        raise LoraError(f"adapter directory {d} does not exist or is not a directory")
    cfg_path = d / CONFIG_NAME
    if not cfg_path.is_file():
        raise LoraError(f"{CONFIG_NAME} is missing from adapter directory {d}")
    try:
        cfg_bytes = cfg_path.read_bytes()
        config = json.loads(cfg_bytes.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraError(f"{CONFIG_NAME} in {d} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoraError(f"{CONFIG_NAME} in {d} is not a JSON object")
    w_path = d / WEIGHTS_NAME
    if not w_path.is_file():
        pickled = sorted(p.name for p in d.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickled:
            raise LoraError(
                f"{WEIGHTS_NAME} is missing from {d} (found {', '.join(pickled)}): only safetensors adapters "
                "are loaded; nothing is unpickled"
            )
        raise LoraError(f"{WEIGHTS_NAME} is missing from adapter directory {d}")
    try:
        w_bytes = w_path.read_bytes()
        tensors = load(w_bytes)
    except (SafetensorError, OSError, ValueError) as e:
        raise LoraError(f"{WEIGHTS_NAME} in {d} is not a valid safetensors file: {e}") from None
    h = hashlib.sha256(cfg_bytes)
    h.update(w_bytes)
    return config, tensors, h.hexdigest()


def _check_config(config: dict) -> None:
    if config.get("peft_type") != "LORA":
        raise LoraError(f"adapter peft_type is {config.get('peft_type')!r}; only LORA adapters can be merged")
    if config.get("use_dora"):
        raise LoraError("DoRA adapters (use_dora: true) are not supported; only plain LoRA can be merged")
    for field in _UNSUPPORTED_FIELDS:
        if config.get(field):
            raise LoraError(f"adapter uses {field}={config[field]!r}, which is not supported for merging")
    if config.get("bias", "none") != "none":
        raise LoraError(f"adapter has bias={config['bias']!r}; only bias='none' adapters can be merged")
    if config.get("modules_to_save"):
        raise LoraError(
            f"adapter has modules_to_save {config['modules_to_save']!r} (full trained copies of modules); "
            "they are not merged, refusing rather than silently dropping them"
        )
    init = config.get("init_lora_weights", True)
    if not (isinstance(init, bool) or (isinstance(init, str) and init in _PLAIN_INITS)):
        raise LoraError(
            f"adapter has init_lora_weights={init!r}, which rewrites the base weights when loaded; convert it "
            "with PEFT (path_initial_model_for_weight_conversion) first"
        )
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise LoraError(f"adapter r={r!r} is not a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraError(f"adapter lora_alpha={alpha!r} is not a number")
    tm = config.get("target_modules")
    if not tm or not isinstance(tm, (str, list)):
        raise LoraError(f"adapter target_modules={tm!r} is not a module list or regex")
    if isinstance(tm, str) and (config.get("layers_to_transform") is not None or config.get("layers_pattern")):
        raise LoraError("layers_to_transform / layers_pattern cannot be used with a regex target_modules")


def _all_linear(model: nn.Module) -> set[str]:
    from transformers.pytorch_utils import Conv1D

    names = {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))}
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if callable(get_out) else None
    return names - {n for n, m in model.named_modules() if out is not None and m is out}


def _is_target(config: dict, key: str, targets) -> bool:
    exclude = config.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, key):
                return False
        elif key in exclude or any(key.endswith(f".{e}") for e in exclude):
            return False
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    if key in targets:
        return True
    found = any(key.endswith(f".{t}") for t in targets)
    layers = config.get("layers_to_transform")
    if not found or layers is None or (isinstance(layers, list) and not layers):
        return found
    patterns = config.get("layers_pattern")
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
            if match is not None:
                break
    if match is None:
        return False
    idx = int(match.group("idx"))
    return idx == layers if isinstance(layers, int) else idx in layers


def _pattern_value(patterns: dict, key: str, default):
    for p in patterns or {}:
        if re.match(rf"(.*\.)?({p})$", key):
            return patterns[p]
    return default


def _pairs(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    if emb := [k for k in sorted(tensors) if ".lora_embedding_" in k]:
        raise LoraError(f"embedding LoRA not supported (tensor {emb[0]!r})")
    for key in sorted(tensors):
        name = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        if "modules_to_save" in key:
            raise LoraError(f"adapter tensor {key!r} is a modules_to_save copy; those are not merged")
        m = _KEY.fullmatch(name)
        if not key.startswith(_PREFIX) or m is None:
            raise LoraError(f"unexpected tensor {key!r} in {WEIGHTS_NAME}: expected <prefix>.lora_A/B.weight")
        pairs.setdefault(m["module"], {})[m["which"] or "W"] = tensors[key]
    for name, ab in pairs.items():
        if "A" not in ab or "B" not in ab:
            lacking = "lora_B" if "A" in ab else "lora_A"
            raise LoraError(f"adapter module {name!r} has no {lacking}.weight in {WEIGHTS_NAME}")
    return pairs


@dataclass
class _Delta:
    module: str
    a: torch.Tensor  # (r, in)
    b: torch.Tensor  # (out, r)
    transpose: bool
    scaling: float
    saved: torch.Tensor | None  # a full base weight PEFT saved for the module (lm_head), checked on apply


class AdapterPlan:
    """An adapter checked against a model's modules (shapes, dtypes, targets), not yet applied: `apply`
    merges it into a weight when that weight is materialised, so a layer-streamed build merges layer by
    layer. The checks that need the weight's values (a saved base weight) run there."""

    def __init__(self, info: AdapterInfo, deltas: dict[str, _Delta]):
        self.info = info
        self.deltas = deltas  # weight parameter name -> delta
        self.applied: set[str] = set()

    @staticmethod
    def _check_saved(d: _Delta, w: torch.Tensor) -> None:
        if d.saved is not None and (d.saved.shape != w.shape or not torch.equal(d.saved.to(w.device, w.dtype), w)):
            raise LoraError(
                f"adapter carries a full base weight for {d.module!r} that differs from the model's "
                f"({tuple(d.saved.shape)} vs {tuple(w.shape)}); replacement weights are not merged"
            )

    @torch.no_grad()
    def apply(self, names: tuple[str, ...], w: torch.Tensor) -> None:
        """Merge every delta for the parameter known by `names` (tied weights have several) into `w`, a
        weight as read from the checkpoint (each time it is materialised)."""
        for name in names:
            d = self.deltas.get(name)
            if d is None:
                continue
            self._check_saved(d, w)
            cdt = torch.float64 if w.dtype == torch.float64 else torch.float32
            delta = d.b.to(w.device, cdt) @ d.a.to(w.device, cdt)
            delta = (delta.T if d.transpose else delta) * d.scaling
            w.copy_((w.to(cdt) + delta).to(w.dtype))
            self.applied.add(name)

    def apply_all(self, model: nn.Module) -> None:
        """Merge into a model whose weights are all materialised; every saved base weight is checked first."""
        params = dict(model.named_parameters(remove_duplicate=False))
        for name in sorted(self.deltas):
            self._check_saved(self.deltas[name], params[name])  # before any weight is touched
        for name in sorted(self.deltas):
            self.apply((name,), params[name])


def plan_adapter(model: nn.Module, adapter_dir: str | Path) -> AdapterPlan:
    """Read and check the adapter against `model` (real or meta weights); nothing is changed."""
    from transformers.pytorch_utils import Conv1D

    d = Path(adapter_dir)
    config, tensors, fingerprint = _read(d)
    _check_config(config)
    pairs = _pairs(tensors)
    modules = dict(model.named_modules())
    for name in pairs:
        if name not in modules:
            raise LoraError(f"adapter module {name!r} is not in the base model")
    targets = config["target_modules"]
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = _all_linear(model)
    targeted = {k for k in modules if k and _is_target(config, k, targets)}
    if extra := sorted(set(pairs) - targeted):
        raise LoraError(f"adapter has weights for modules its config does not target: {extra[:5]}")
    if missing := sorted(targeted - set(pairs)):
        raise LoraError(f"adapter config targets modules without lora_A/lora_B weights: {missing[:5]}")
    if not pairs:
        raise LoraError(f"adapter in {d} has no LoRA weights")

    use_rslora = bool(config.get("use_rslora", False))
    deltas = {}
    for name in sorted(pairs):
        mod, a, b = modules[name], pairs[name]["A"], pairs[name]["B"]
        if isinstance(mod, nn.Embedding):
            raise LoraError(f"embedding LoRA not supported (module {name!r})")
        if not isinstance(mod, (nn.Linear, Conv1D)):
            raise LoraError(f"adapter module {name!r} is a {type(mod).__name__}; only Linear layers are merged")
        w = mod.weight
        if not w.dtype.is_floating_point:
            raise LoraError(f"base weight of {name!r} has dtype {w.dtype}; merge before quantizing")
        r = _pattern_value(config.get("rank_pattern"), name, config["r"])
        alpha = _pattern_value(config.get("alpha_pattern"), name, config["lora_alpha"])
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != r or b.shape[1] != r:
            raise LoraError(
                f"adapter module {name!r}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit rank r={r}"
            )
        transpose = isinstance(mod, Conv1D)  # PEFT forces fan_in_fan_out per layer type
        delta_shape = (a.shape[1], b.shape[0]) if transpose else (b.shape[0], a.shape[1])
        if tuple(w.shape) != delta_shape:
            raise LoraError(
                f"adapter module {name!r}: B @ A has shape {delta_shape} but the base weight has {tuple(w.shape)}"
            )
        # PEFT saves the base weight of targeted embedding-like layers (lm_head) and loads it over the
        # model's; we only accept it when it is the model's weight already (a retrained/resized one is refused).
        scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        deltas[f"{name}.weight"] = _Delta(name, a, b, transpose, scaling, pairs[name].get("W"))

    info = AdapterInfo(
        path=str(d),
        fingerprint=fingerprint,
        base_model=config.get("base_model_name_or_path"),
        r=int(config["r"]),
        lora_alpha=float(config["lora_alpha"]),
        use_rslora=use_rslora,
        modules=tuple(sorted(pairs)),
    )
    return AdapterPlan(info, deltas)


def merge_adapter(model: nn.Module, adapter_dir: str | Path) -> AdapterInfo:
    """Merge the adapter in place into `model` (W' = W + scaling * B @ A); checks everything first."""
    plan = plan_adapter(model, adapter_dir)
    plan.apply_all(model)
    return plan.info
