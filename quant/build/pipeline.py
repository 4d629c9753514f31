"""`quant build`: model -> (calibrate) -> quantize -> artifact (-> quality report)."""

from __future__ import annotations

import datetime as dt
import json
import resource
import shutil
import time
from pathlib import Path

import torch
from torch import nn

import quant
from quant.build import calibration, evaluate, lora, schemes, stream
from quant.build import memory as build_memory
from quant.build.config import DTYPES, BuildConfig
from quant.build.progress import track
from quant.build.sequential import decoder_layers
from quant.errors import ConfigError, QualityGateError
from quant.format import artifact
from quant.format import sources as models
from quant.format.shards import ShardWriter, header_reserve
from quant.runtime import loader, measure, moe, registry
from quant.shape import memory as shape_memory
from quant.shape.model import ModelShape


def default_out(cfg: BuildConfig, source: models.ModelSource) -> Path:
    name = models.DEFAULT_MODEL_NAME if source.kind == "default" else Path(source.spec.rstrip("/")).name
    if name.endswith(".gguf"):
        name = name[: -len(".gguf")]
    return Path("artifacts") / f"{name}-{cfg.scheme}"


def _quantize_lm_head(model: nn.Module, cfg: BuildConfig) -> None:
    new = schemes.get(cfg.scheme).quantize_head(cfg, model.get_output_embeddings())
    # The quantized head no longer shares the embedding matrix.
    model.config.tie_word_embeddings = False
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = None
    model.lm_head = new


def _modules_spec(model: nn.Module) -> dict[str, dict]:
    """Each quantized module's spec, by its name in the artifact (the checkpoint's)."""
    to_ckpt = moe.Names(model.config).to_checkpoint
    return {to_ckpt(name): mod.spec() for name, mod in registry.quantized_modules(model).items()}


def _runtime_kernels(model: nn.Module) -> dict[str, str]:
    mod = next(iter(registry.quantized_modules(model).values()))
    return {str(d).replace("torch.", ""): mod.kernel(d) for d in (torch.bfloat16, torch.float32)}


def _calibration(cfg: BuildConfig, sm: stream.StreamedModel, log, progress: bool) -> calibration.TokenWindows | None:
    if not schemes.get(cfg.scheme).needs_calibration:
        return None
    if cfg.calib.source != "self":
        return calibration.random_windows(sm.tokenizer, cfg.calib.source, cfg.calib.samples, cfg.calib.seqlen,
                                          cfg.calib.seed)
    # Generating needs every weight at once: the whole model is materialised for it, if it fits.
    need = measure.float_model_bytes(sm.model, sm.dtype)
    budget = measure.available_bytes(sm.device) // 2
    if need > budget:
        raise ConfigError(
            f"--calib self generates text with the whole model in memory ({need / 2**30:.1f} GiB in "
            f"{str(sm.dtype).replace('torch.', '')}, more than half of the {2 * budget / 2**30:.1f} GiB available); "
            "pass --calib FILE (text or JSONL)"
        )
    batch = calibration.generation_batch(sm.model.config, cfg.calib.samples, cfg.calib.seqlen, budget - need)
    log(f"generating {cfg.calib.samples} x {cfg.calib.seqlen} calibration tokens from the model (seed {cfg.calib.seed}, "
        f"{batch} at once)")
    sm.load()
    try:
        return calibration.self_generated(sm.model, sm.tokenizer, cfg.calib.samples, cfg.calib.seqlen, cfg.calib.seed,
                                          batch=batch, progress=progress)
    finally:
        if sm.streamed:
            sm.release()


def _quantize_streamed(cfg: BuildConfig, sm: stream.StreamedModel, calib, resolved: dict,
                       writer: ShardWriter, progress: bool) -> tuple[dict | None, list[float]]:
    """Quantize and write the model part by part: the embeddings (materialised to capture the first
    layer's calibration inputs), each decoder layer, the head. Only the part at hand holds storage."""
    model = sm.model
    store_dtype = models.torch_dtype(cfg.dtype)
    layers = decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers)
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    outer = (prefix, head)

    names = moe.Names(model.config)  # the artifact names tensors as the source checkpoint does

    def put(state: dict[str, torch.Tensor]) -> None:
        writer.add_state({names.to_checkpoint(k): v for k, v in state.items()})

    sm.load("", exclude=outer)
    # Calibrated schemes capture layer 0's inputs here.
    quantizer = schemes.get(cfg.scheme).layer_quantizer(cfg, model, None if calib is None else calib.ids, resolved)
    put(sm.part_state("", outer, store_dtype))
    sm.release("", exclude=outer)

    seconds = []
    for li in track(range(len(layers)), len(layers), f"quantizing ({cfg.scheme})", "layers", progress):
        t = time.perf_counter()
        part = f"{prefix}.{li}"
        sm.load(part)
        quantizer.quantize_layer(li, layers[li])
        put(sm.part_state(part, (), store_dtype))
        sm.release(part)
        seconds.append(time.perf_counter() - t)

    if cfg.include_lm_head:
        sm.load(head)
        _quantize_lm_head(model, cfg)
        put(sm.part_state(head, (), store_dtype))
        sm.release(head)
        # A tied head brought the embedding back, in the compute dtype: drop it in the dtype it was written in.
        sm.part_state("", outer, store_dtype)
        sm.release("", exclude=outer)
    elif not getattr(model.config, "tie_word_embeddings", False):
        sm.load(head)
        put(sm.part_state(head, (), store_dtype))
        sm.release(head)
    expected = {names.to_checkpoint(n) for n in sm.part_state()}
    if getattr(model.config, "tie_word_embeddings", False):
        expected -= {f"{head}.weight"}
    if expected != writer.names:
        raise RuntimeError(f"internal error: the artifact's tensors differ from the model's "
                           f"(missing {sorted(expected - writer.names)[:3]}, extra {sorted(writer.names - expected)[:3]})")
    return quantizer.report, seconds


def build(cfg: BuildConfig, cache_dir: Path, progress: bool = True, log=print) -> Path:
    """Build the artifact described by `cfg`; returns its directory. Nothing is left at the target
    unless the build completes.

    The model is streamed: built on the meta device, each decoder layer read from the checkpoint,
    quantized, written and dropped in turn, so memory is bounded by one layer plus the calibration
    activations (quant.build.stream). Sources that cannot be streamed are loaded whole and go the same way."""
    scheme = schemes.validated(cfg)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    # Fail on bad paths and options before minutes of work.
    if cfg.calib.source != "self" and scheme.needs_calibration:
        calibration.read_texts(cfg.calib.source)
    if cfg.eval.data:
        calibration.read_texts(cfg.eval.data)
    device = cfg.torch_device()
    source = models.resolve(cfg.model, cache_dir)
    out = Path(cfg.out) if cfg.out else default_out(cfg, source)
    artifact.check_target(out, cfg.force)
    rss_before = measure.current_rss_bytes()
    sm = stream.open_model(source, torch.float32, device, log=log)
    model, tok = sm.model, sm.tokenizer
    adapter_plan = lora.plan_adapter(model, cfg.lora) if cfg.lora else None
    if adapter_plan is not None:
        if sm.streamed:
            sm.on_load = adapter_plan.apply
        else:
            adapter_plan.apply_all(model)
    eval_windows = None
    if cfg.eval.data:
        eval_windows = calibration.eval_windows(tok, cfg.eval.data, cfg.eval.windows, cfg.eval.seqlen, cfg.eval.flag)
    store_dtype = models.torch_dtype(cfg.dtype)
    base_bytes = measure.float_model_bytes(model, store_dtype)
    matmul = cfg.matmul_torch_dtype(device) if scheme.needs_calibration else None  # the calibration products' dtype
    resolved = scheme.resolve(cfg, model)
    estimate = build_memory.build_peak_bytes(
        ModelShape.from_config(model.config), cfg.scheme,
        cfg.calib.samples * cfg.calib.seqlen if scheme.needs_calibration else 0,
        streamed=sm.streamed, self_calibration=scheme.needs_calibration and cfg.calib.source == "self",
        matmul_bytes=None if matmul is None else matmul.itemsize,
    )
    estimate["runtime"] = rss_before
    estimate["total"] += rss_before
    log(f"estimated peak memory of this build: {estimate['total'] / 2**30:.2f} GiB")
    timings["load_s"] = time.perf_counter() - t0

    t = time.perf_counter()
    calib = _calibration(cfg, sm, log, progress)
    if calib is not None:
        timings["calibration_data_s"] = time.perf_counter() - t

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = artifact.staging_dir(out)
    try:
        t = time.perf_counter()
        to_ckpt = moe.Names(model.config).to_checkpoint
        writer = ShardWriter(staging, cfg.max_shard_bytes, header_reserve(map(to_ckpt, model.state_dict())))
        report, layer_seconds = _quantize_streamed(cfg, sm, calib, resolved, writer, progress)
        writer.finish()
        if adapter_plan is not None and (left := sorted(set(adapter_plan.deltas) - adapter_plan.applied)):
            raise RuntimeError(f"internal error: LoRA deltas never merged: {left[:3]}")
        timings["quantize_s"] = time.perf_counter() - t
        measured_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        log(f"peak memory: {measured_peak / 2**30:.2f} GiB (estimated {estimate['total'] / 2**30:.2f} GiB)")
        device_peak = {}
        if sm.device.type == "cuda":  # what the build took of the GPU, by its allocator
            device_peak = {"build_peak_device_allocated_bytes": torch.cuda.max_memory_allocated(sm.device),
                           "build_peak_device_reserved_bytes": torch.cuda.max_memory_reserved(sm.device)}
            log(f"peak {sm.device} memory: {device_peak['build_peak_device_allocated_bytes'] / 2**30:.2f} GiB "
                f"allocated, {device_peak['build_peak_device_reserved_bytes'] / 2**30:.2f} GiB reserved")
        weights = measure.weight_report(model)
        mem = {
            "weights": weights,
            "base_weight_bytes": base_bytes,
            "base_dtype": cfg.dtype,
            "compression_ratio": base_bytes / weights["total"],
            "kv_bytes_per_token": {
                "bfloat16": shape_memory.kv_bytes_per_token(model.config, torch.bfloat16),
                "float32": shape_memory.kv_bytes_per_token(model.config, torch.float32),
            },
            "build_peak_rss_bytes": measured_peak,
            **device_peak,
            "build_peak_estimate_bytes": estimate,
        }
        params = {
            "include_lm_head": cfg.include_lm_head,
            "float_dtype": cfg.dtype,
            "weight_granularity": "per-output-channel",
            **scheme.parameters(cfg, resolved, report),
            "runtime_kernels": _runtime_kernels(model),
        }
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = cfg.dtype
        modules = _modules_spec(model)
        version = artifact.format_version(modules)
        config["quantization_config"] = scheme.quantization_config(cfg, resolved, modules)
        for name, text in scheme.extra_files(cfg, resolved).items():
            (staging / name).write_text(text)
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
            "adapter": None if adapter_plan is None else adapter_plan.info.to_dict(),
            "calibration": None if calib is None else {**calib.describe(), "seed": cfg.calib.seed},
            "memory": mem,
            "build": {"streamed": sm.streamed, "not_streamed_because": sm.reason, "device": str(sm.device),
                      "matmul_dtype": None if matmul is None else str(matmul).removeprefix("torch."),
                      "layer_seconds": [round(x, 3) for x in layer_seconds], "moe": moe.describe(model)},
            "quality": None,
            "timings": timings,
        }
        artifact.write_manifest(staging, manifest, version)
        del model, sm
        if eval_windows is not None:
            t = time.perf_counter()
            manifest["quality"] = evaluate_artifact(staging, source, cfg.lora, eval_windows, cfg.eval.dtype, progress)
            timings["eval_s"] = time.perf_counter() - t
            manifest["quality"]["gate"] = quality_gate(cfg, manifest["quality"])
        timings["total_s"] = time.perf_counter() - t0
        artifact.write_manifest(staging, manifest, version)
        artifact.commit(staging, out, cfg.force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def quality_gate(cfg: BuildConfig, quality: dict) -> dict | None:
    """The gate's record for the manifest, or QualityGateError (the build then publishes nothing) saying by how
    much each missed bound was missed."""
    bounds = {"max_dppl": (cfg.max_dppl, quality["delta_ppl_pct"], "perplexity {:+.2f}%", "%"),
              "max_kl": (cfg.max_kl, quality["mean_kl"], "mean KL {:.4f}", "")}
    gate = {name: bound for name, (bound, *_) in bounds.items() if bound is not None}
    if not gate:
        return None
    missed = [f"{what.format(value)} > --{name.replace('_', '-')} {bound:g}{unit} (by {value - bound:.4g}{unit})"
              for name, (bound, value, what, unit) in bounds.items() if bound is not None and value > bound]
    if missed:
        raise QualityGateError(f"the artifact misses its quality gate on {quality['data']['source']}: "
                               f"{'; '.join(missed)}; nothing was written")
    return {**gate, "passed": True}


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
