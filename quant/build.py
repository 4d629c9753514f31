"""`quant build`: model -> (calibrate) -> quantize -> artifact (-> quality report)."""

from __future__ import annotations

import datetime as dt
import json
import resource
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

import quant
from quant import artifact, calibration, evaluate, loader, lora, memory, models, w4a16, w8a8
from quant.config import DTYPES, BuildConfig
from quant.errors import ConfigError
from quant.layers import Int8WeightLinear, W8A8Linear
from quant.sequential import block_linears, set_module


def default_out(cfg: BuildConfig, source: models.ModelSource) -> Path:
    name = models.DEFAULT_MODEL_NAME if source.kind == "default" else Path(source.spec.rstrip("/")).name
    if name.endswith(".gguf"):
        name = name[: -len(".gguf")]
    return Path("artifacts") / f"{name}-{cfg.scheme}"


def _quantize_weight_only(model: nn.Module, affine: bool) -> None:
    for name, lin in block_linears(model).items():
        set_module(model, name, Int8WeightLinear.from_float(lin, affine))


def _quantize_lm_head(model: nn.Module, cfg: BuildConfig) -> None:
    head = model.get_output_embeddings()
    if cfg.scheme == "w8a8":
        new = W8A8Linear.from_float(head, input_scale=None)  # dynamic: no calibration of the final norm
    else:
        new = Int8WeightLinear.from_float(head, cfg.scheme == "int8-affine")
    # The quantized head no longer shares the embedding matrix.
    model.config.tie_word_embeddings = False
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = None
    model.lm_head = new


def _state_for_disk(model: nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {k: v.detach().contiguous().clone() for k, v in state.items()}


def _modules_spec(model: nn.Module) -> dict[str, dict]:
    return {name: mod.spec() for name, mod in model.named_modules() if hasattr(mod, "spec")}


def _runtime_kernels(model: nn.Module) -> dict[str, str]:
    mod = next(m for m in model.modules() if hasattr(m, "spec"))
    return {str(d).replace("torch.", ""): mod.kernel(d) for d in (torch.bfloat16, torch.float32)}


def _gptq_config(cfg: BuildConfig, group_size: int) -> dict:
    """The standard GPTQ `quantization_config` (transformers/gptqmodel, optimum, vLLM).

    Act-order uses static groups here, so g_idx is the trivial k // group and loaders are told
    desc_act = false: no runtime reordering is needed. Asymmetric zero-points do not survive the v1
    format's zero - 1 storage at zero = 0, hence gptq_v2 for --asym.
    """
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": False,
        "sym": not cfg.asym,
        "static_groups": cfg.act_order,
        "true_sequential": True,
        "damp_percent": cfg.damp,
        "lm_head": False,
        "checkpoint_format": "gptq_v2" if cfg.asym else "gptq",
        "pack_dtype": "int32",
        "model_file_base_name": "model",
    }


def build(cfg: BuildConfig, cache_dir: Path, progress: bool = True, log=print) -> Path:
    """Build the artifact described by `cfg`; returns its directory. Nothing is left at the target
    unless the build completes."""
    cfg.validate()
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    # Fail on bad paths before minutes of work.
    if cfg.calib.source != "self" and cfg.needs_calibration:
        calibration.read_texts(cfg.calib.source)
    if cfg.eval.data:
        calibration.read_texts(cfg.eval.data)
    source = models.resolve(cfg.model, cache_dir)
    out = Path(cfg.out) if cfg.out else default_out(cfg, source)
    artifact.check_target(out, cfg.force)
    model, tok = models.load_model(source, torch.float32)
    adapter = lora.merge_adapter(model, cfg.lora) if cfg.lora else None
    eval_windows = None
    if cfg.eval.data:
        eval_windows = calibration.eval_windows(tok, cfg.eval.data, cfg.eval.windows, cfg.eval.seqlen, cfg.eval.flag)
    store_dtype = models.torch_dtype(cfg.dtype)
    base_bytes = memory.float_model_bytes(model, store_dtype)
    timings["load_s"] = time.perf_counter() - t0

    if cfg.is_int4 and cfg.include_lm_head:
        raise ConfigError("--include-lm-head is not available for 4-bit schemes: the GPTQ format keeps lm_head in float")
    group_size = w4a16.choose_group_size(model, cfg.group_size) if cfg.is_int4 else None

    calib = None
    report: dict | None = None
    t = time.perf_counter()
    if cfg.needs_calibration:
        if cfg.calib.source == "self":
            log(f"generating {cfg.calib.samples} x {cfg.calib.seqlen} calibration tokens from the model (seed {cfg.calib.seed})")
            calib = calibration.self_generated(model, tok, cfg.calib.samples, cfg.calib.seqlen, cfg.calib.seed)
        else:
            calib = calibration.random_windows(tok, cfg.calib.source, cfg.calib.samples, cfg.calib.seqlen, cfg.calib.seed)
        timings["calibration_data_s"] = time.perf_counter() - t
        t = time.perf_counter()
    if cfg.scheme in ("int8-sym", "int8-affine"):
        _quantize_weight_only(model, cfg.scheme == "int8-affine")
    elif cfg.scheme == "w8a8":
        report = w8a8.quantize(model, calib.ids, cfg, progress=progress)
    else:
        method = "gptq" if cfg.scheme == "w4a16" else "rtn"
        report = w4a16.quantize(model, None if calib is None else calib.ids, method, group_size,
                                not cfg.asym, cfg.damp, cfg.act_order, progress)
    if cfg.include_lm_head:
        _quantize_lm_head(model, cfg)
    loader.cast_float_params(model, store_dtype)
    timings["quantize_s"] = time.perf_counter() - t

    weights = memory.weight_report(model)
    mem = {
        "weights": weights,
        "base_weight_bytes": base_bytes,
        "base_dtype": cfg.dtype,
        "compression_ratio": base_bytes / weights["total"],
        "kv_bytes_per_token": {
            "bfloat16": memory.kv_bytes_per_token(model.config, torch.bfloat16),
            "float32": memory.kv_bytes_per_token(model.config, torch.float32),
        },
    }
    params = {
        "calib_method": None if cfg.scheme != "w8a8" or cfg.act_dynamic else cfg.calib_method,
        "act_dynamic": cfg.act_dynamic if cfg.scheme == "w8a8" else None,
        "smooth": cfg.smooth if cfg.scheme == "w8a8" else None,
        "smooth_alpha": (cfg.smooth_alpha if cfg.smooth_alpha is not None else "searched")
        if cfg.scheme == "w8a8" and cfg.smooth else None,
        "include_lm_head": cfg.include_lm_head,
        "float_dtype": cfg.dtype,
        "weight_granularity": "per-output-channel",
        "runtime_kernels": _runtime_kernels(model),
    }
    if cfg.scheme == "w8a8":
        params["calibration_summary"] = w8a8.summarize(report)
    if cfg.is_int4:
        params.update(
            bits=4, group_size=group_size, sym=not cfg.asym,
            damp=cfg.damp if cfg.scheme == "w4a16" else None,
            act_order=cfg.act_order if cfg.scheme == "w4a16" else None,
            checkpoint_format=_gptq_config(cfg, group_size)["checkpoint_format"],
            rtn_fallbacks=report["fallbacks"],
        )
        params["weight_granularity"] = f"per-output-channel, groups of {group_size} inputs"
    mem["build_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = artifact.staging_dir(out)
    try:
        save_file(_state_for_disk(model), str(staging / artifact.WEIGHTS), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = cfg.dtype
        if cfg.is_int4:
            config["quantization_config"] = _gptq_config(cfg, group_size)
            (staging / "quantize_config.json").write_text(json.dumps(_gptq_config(cfg, group_size), indent=2) + "\n")
        else:
            config["quantization_config"] = {
                "quant_method": artifact.QUANT_METHOD,
                "format_version": artifact.FORMAT_VERSION,
                "scheme": cfg.scheme,
                "modules": _modules_spec(model),
            }
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tok.save_pretrained(staging)
        if report is not None:
            (staging / "calibration_report.json").write_text(json.dumps(report, indent=1) + "\n")
        manifest = {
            "tool": {"name": "quantserve", "version": quant.__version__, "torch": torch.__version__},
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "scheme": cfg.scheme,
            "parameters": params,
            "source_model": source.to_dict(),
            "adapter": None if adapter is None else adapter.to_dict(),
            "calibration": None if calib is None else {**calib.describe(), "seed": cfg.calib.seed},
            "memory": mem,
            "quality": None,
            "timings": timings,
        }
        artifact.write_manifest(staging, manifest)
        del model
        if eval_windows is not None:
            t = time.perf_counter()
            manifest["quality"] = evaluate_artifact(staging, source, cfg.lora, eval_windows, cfg.eval.dtype, progress)
            timings["eval_s"] = time.perf_counter() - t
        timings["total_s"] = time.perf_counter() - t0
        artifact.write_manifest(staging, manifest)
        artifact.commit(staging, out, cfg.force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def reference_model(source: models.ModelSource, adapter_dir: str | None, dtype: torch.dtype):
    """The float model an artifact approximates: the source, with its LoRA adapter merged if any."""
    base, _ = models.load_model(source, dtype)
    if adapter_dir:
        lora.merge_adapter(base, adapter_dir)
    return base


def evaluate_artifact(path: Path, source: models.ModelSource, adapter_dir: str | None, windows,
                      dtype_name: str, progress: bool) -> dict:
    """Quality report of the artifact at `path` against its (merged) source model, as loaded for serving."""
    dtype = models.torch_dtype(dtype_name)
    quantized = loader.load(path, dtype=dtype, verify=False).model
    base = reference_model(source, adapter_dir, dtype)
    q = evaluate.compare(base, {"quantized": quantized}, windows, progress=progress)["quantized"]
    return {**q.to_dict(), "dtype": dtype_name, "data": windows.describe()}


def merge(model_spec: str | None, adapter_dir: str, out: Path, force: bool, cache_dir: Path,
          dtype: str | None = None) -> Path:
    """`quant merge`: base + LoRA adapter -> a plain HF model dir (unquantized), written atomically, in the
    base checkpoint's own dtype unless `dtype` is given (as PEFT's merge_and_unload keeps it: bit-exact with
    PEFT on a base loaded in that dtype)."""
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of auto, {', '.join(DTYPES)}, got {dtype!r}")
    artifact.check_target(out, force)
    source = models.resolve(model_spec, cache_dir)
    dtype = dtype or models.stored_dtype(source)
    model, tok = models.load_model(source, models.torch_dtype(dtype))
    info = lora.merge_adapter(model, adapter_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = artifact.staging_dir(out)
    try:
        model.save_pretrained(staging)
        tok.save_pretrained(staging)
        (staging / "quantserve_merge.json").write_text(
            json.dumps({"source_model": source.to_dict(), "adapter": info.to_dict(), "dtype": dtype}, indent=2) + "\n"
        )
        artifact.commit(staging, out, force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def resolve_eval_adapter(manifest: dict) -> str | None:
    """The LoRA adapter an artifact was built with (None if none), checked against its fingerprint."""
    info = manifest.get("adapter")
    if not info:
        return None
    try:
        current = lora.adapter_fingerprint(info["path"])
    except lora.LoraError as e:
        raise ConfigError(f"the artifact was built with LoRA adapter {info['path']}, which cannot be read: {e}") from e
    if current != info["fingerprint"]:
        raise ConfigError(f"LoRA adapter {info['path']} has changed since the build (fingerprint mismatch)")
    return info["path"]


def resolve_eval_source(manifest: dict, cache_dir: Path) -> models.ModelSource:
    """The base model an artifact was built from, checked against its recorded fingerprint."""
    src = manifest["source_model"]
    spec = None if src["kind"] == "default" else src["spec"]
    source = models.resolve(spec, cache_dir)
    if source.fingerprint != src["fingerprint"]:
        raise ConfigError(
            f"the source model {src['spec']!r} has changed since the build (fingerprint mismatch); pass --base"
        )
    return source
