"""Memory: the one model every part of the project uses (W weights, A activations, KV cache; for
training also G gradients and O optimizer states), and a tracker that measures tensor memory.

Inference prefill activation peak, for a Llama-family decoder as transformers executes it
(b batch, s tokens, H hidden, I intermediate, h / kv heads of size d, V vocab):
- held across the whole forward: the embeddings output and the current layer's input, 2·b·s·H;
- MLP phase: the residual and the normed input (2·b·s·H) plus act(gate), up and their product
  (3·b·s·I), live together when the product is formed;
- attention phase: normed input b·s·H, q/k/v b·s·(h+2kv)·d, rotary outputs and temporaries
  2·b·s·(h+kv)·d, the attention output b·s·h·d; with eager attention also the repeated K/V
  (2·b·s·h·d), the mask b·s² and the scores: quadratic, 8·b·h·s² bytes because the softmax runs in
  fp32 while its input is still alive (for 16-bit: input, fp32 output and the cast back).
  SDPA / FlashAttention never materialise the scores: linear in s;
- the rotary tables 2·s·d and the logits b·keep·V (keep = 1 when only the next token is needed).
The tests and bench/memory_check.py hold this to measured peaks (MemoryTracker) within 15%.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass

import torch
from torch import nn

from quant import schemes
from quant.layers import QuantizedLinear

ATTN_IMPLS = ("eager", "sdpa", "flash_attention_2")


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------------------------------
# Measured: weights of a loaded model by tensor class.


def _unique_tensors(model: nn.Module):
    """(name, tensor, owning module) for every parameter and persistent buffer, shared storage once."""
    seen: set[int] = set()
    for mod_name, mod in model.named_modules():
        tensors = list(mod.named_parameters(recurse=False)) + [
            (n, b) for n, b in mod.named_buffers(recurse=False) if n not in mod._non_persistent_buffers_set
        ]
        for n, t in tensors:
            # Shared storage is one tensor; a meta tensor (a streamed build's released part) has none,
            # and ties there are the same Parameter object.
            if t is None:
                continue
            key = id(t) if t.is_meta else t.data_ptr()
            if key in seen and t.numel():
                continue
            seen.add(key)
            yield (f"{mod_name}.{n}" if mod_name else n), t, mod


def weight_report(model: nn.Module) -> dict:
    """Bytes per class: quantized integer weights, quantization parameters, float tensors."""
    classes = {"quantized_weights": 0, "quant_params": 0, "float_weights": 0}
    for name, t, mod in _unique_tensors(model):
        leaf = name.rsplit(".", 1)[-1]
        nbytes = t.numel() * t.element_size()
        # Tensor classes of the weight memory (W): quantized modules name their tensors; anything else is float.
        quantized_module = isinstance(mod, QuantizedLinear)
        if quantized_module and leaf in mod.DATA_TENSORS and not t.is_floating_point():
            classes["quantized_weights"] += nbytes
        elif quantized_module and leaf in mod.PARAM_TENSORS:
            classes["quant_params"] += nbytes
        else:
            classes["float_weights"] += nbytes
    classes["total"] = sum(classes.values())
    return classes


def float_model_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Weight bytes of an unquantized model, optionally as if stored in `dtype`."""
    total = 0
    for _, t, _ in _unique_tensors(model):
        size = dtype_bytes(dtype) if (dtype is not None and t.is_floating_point()) else t.element_size()
        total += t.numel() * size
    return total


# ---------------------------------------------------------------------------------------------------
# Predicted: the model by shape.


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie_embeddings: bool = False
    name: str = "custom"

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        heads = config.num_attention_heads
        return cls(
            layers=config.num_hidden_layers, hidden=config.hidden_size, intermediate=config.intermediate_size,
            heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab=config.vocab_size, tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            name=getattr(config, "_name_or_path", "") or "config",
        )

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, out, in) of the Linears in one decoder layer."""
        h, kv, d, H, I = self.heads, self.kv_heads, self.head_dim, self.hidden, self.intermediate
        return [("q_proj", h * d, H), ("k_proj", kv * d, H), ("v_proj", kv * d, H), ("o_proj", H, h * d),
                ("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I)]

    def block_params(self) -> int:
        return self.layers * (sum(n * k for _, n, k in self.linears()) + 2 * self.hidden)

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2) + self.hidden

    def params(self) -> int:
        return self.block_params() + self.embedding_params()

    def to_dict(self) -> dict:
        return asdict(self)


# Llama-family shapes for `--params 7B`-style sizes (public configs).
KNOWN_SHAPES = {
    "135M": ModelShape(30, 576, 1536, 9, 3, 64, 49152, True, "SmolLM2-135M"),
    "360M": ModelShape(32, 960, 2560, 15, 5, 64, 49152, True, "SmolLM2-360M"),
    "1B": ModelShape(16, 2048, 8192, 32, 8, 64, 128256, True, "Llama-3.2-1B"),
    "1.7B": ModelShape(24, 2048, 8192, 32, 32, 64, 49152, True, "SmolLM2-1.7B"),
    "3B": ModelShape(28, 3072, 8192, 24, 8, 128, 128256, True, "Llama-3.2-3B"),
    "7B": ModelShape(32, 4096, 11008, 32, 32, 128, 32000, False, "Llama-2-7B"),
    "8B": ModelShape(32, 4096, 14336, 32, 8, 128, 128256, False, "Llama-3.1-8B"),
    "13B": ModelShape(40, 5120, 13824, 40, 40, 128, 32000, False, "Llama-2-13B"),
    "70B": ModelShape(80, 8192, 28672, 64, 8, 128, 128256, False, "Llama-3.1-70B"),
}


def parse_size(text: str) -> float:
    """'7B' -> 7e9, '135M' -> 1.35e8, '1.5e9' -> 1.5e9."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kKmMbBtT]?)\s*", text)
    if not m:
        raise ValueError(f"cannot read a parameter count from {text!r} (try 7B, 135M)")
    mult = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
    return float(m.group(1)) * mult


def shape_for_params(params: float) -> ModelShape:
    """The known Llama-family shape nearest (in log space) to `params`."""
    return min(KNOWN_SHAPES.values(), key=lambda s: abs(math.log(s.params() / params)))


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read a size from {text!r} (try 24GiB, 80GB)")
    unit = (m.group(2) or "B").lower()
    mult = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
            "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}[unit]
    return int(float(m.group(1)) * mult)


def weight_bytes(shape: ModelShape, scheme: str, float_bytes: int = 2, group_size: int = 128,
                 include_lm_head: bool = False, served: bool = False) -> dict:
    """Predicted weight bytes by class for `scheme` ("float" for an unquantized model), exactly as the
    artifacts lay them out (each scheme's `linear_bytes`: int8 fp32 per-channel scales, GPTQ
    qweight/qzeros/fp16 scales/g_idx, ...), or with `served` as a loaded model holds them on the CPU in
    `float_bytes` activations (`served_linear_bytes`: int4 repacked for the kernel)."""
    q = p = 0
    fl = shape.embedding_params() * float_bytes + 2 * shape.layers * shape.hidden * float_bytes
    if scheme == "float":
        fl += shape.layers * sum(n * k for _, n, k in shape.linears()) * float_bytes
        return {"quantized_weights": 0, "quant_params": 0, "float_weights": fl, "total": fl}
    sch = schemes.get(scheme)
    for _, n, k in shape.linears():
        lq, lp = sch.served_linear_bytes(n, k, group_size, float_bytes) if served else sch.linear_bytes(n, k, group_size)
        q += shape.layers * lq
        p += shape.layers * lp
    if include_lm_head and sch.supports_lm_head:
        if not shape.tie_embeddings:
            fl -= shape.vocab * shape.hidden * float_bytes
        hq, hp = sch.head_bytes(shape.vocab, shape.hidden)
        q += hq
        p += hp
    return {"quantized_weights": q, "quant_params": p, "float_weights": fl, "total": q + p + fl}


def build_peak_bytes(shape: ModelShape, scheme: str, calib_tokens: int, streamed: bool = True,
                     self_calibration: bool = False, compute_bytes: int = 4, matmul_bytes: int | None = None) -> dict:
    """Predicted peak memory of `quant build` beyond the process's own runtime, by what holds it:
    - part: the model part materialised at a time, in the compute dtype (fp32): one decoder layer, or
      the embedding matrix while the first layer's inputs are captured; the whole model when it is not
      streamed or generates its own calibration text; with calibration products in another dtype
      (`matmul_bytes` per element, `--matmul-dtype`), the layer's Linear weights once more in it (each cast is
      kept through the layer pass; W8A8's simulated Linears make none, so this is at most);
    - activations: the calibration set's hidden states (S*T x hidden, fp32) in, out and in the middle of
      a layer, plus what a scheme keeps of a layer's inner activations (GPTQ: the attention output and
      the MLP's down_proj input; W8A8: every smoothing group's input at once);
    - solver: the largest Linear's working set (GPTQ: the group's Hessian, GPTQ's own copy and two
      factorisation steps, K x K fp32 each, plus the weight's fp32 copies and codes).
    """
    H = shape.hidden
    linear = sum(n * k for _, n, k in shape.linears())
    layer = (linear + 2 * H) * compute_bytes
    if matmul_bytes is not None and matmul_bytes != compute_bytes:
        layer += linear * matmul_bytes
    embed = shape.vocab * H * compute_bytes
    whole = shape.params() * compute_bytes
    part = whole if (not streamed or self_calibration) else max(layer, embed)
    sch = schemes.get(scheme)
    activations = sch.calib_activation_bytes(shape, calib_tokens) if sch.needs_calibration else 0
    biggest_n, biggest_k = max(((n, k) for _, n, k in shape.linears()), key=lambda nk: (nk[1], nk[0]))
    solver = sch.solver_bytes(biggest_n, biggest_k)
    return {"part": part, "activations": activations, "solver": solver, "total": part + activations + solver}


def current_rss_bytes() -> int:
    """This process's resident memory now (Linux /proc; 0 where that is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def available_bytes(device: torch.device) -> int:
    """Memory a build may use on `device`: free CUDA memory, or the machine's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_bytes_per_token(config_or_shape, dtype: torch.dtype | int) -> int:
    """2 (K and V) · layers · kv_heads · head_dim · bytes(dtype)."""
    s = config_or_shape if isinstance(config_or_shape, ModelShape) else ModelShape.from_config(config_or_shape)
    b = dtype if isinstance(dtype, int) else dtype_bytes(dtype)
    return 2 * s.layers * s.kv_heads * s.head_dim * b


def prefill_activation_bytes(shape: ModelShape, batch: int, seq: int, attn: str, dtype_bytes_: int,
                             logits_kept: int = 1) -> int:
    """Peak activation bytes of one inference forward over `batch` x `seq` tokens (module docstring)."""
    if attn not in ATTN_IMPLS:
        raise ValueError(f"unknown attention implementation {attn!r}")
    b, s, H, I = batch, seq, shape.hidden, shape.intermediate
    h, kv, d = shape.heads, shape.kv_heads, shape.head_dim
    held = 2 * b * s * H
    mlp = 2 * b * s * H + 3 * b * s * I
    base = b * s * H + b * s * (h + 2 * kv) * d  # normed input, q/k/v
    att = max(base + 2 * b * s * (h + kv) * d, base + b * s * h * d) * dtype_bytes_  # rotary; output
    if attn == "eager":
        # At the cast after the fp32 softmax three copies of the scores are alive: the masked input
        # (dtype), the softmax output (fp32) and the cast (dtype); for fp32 the cast is a no-op.
        per_score = dtype_bytes_ + 4 + (dtype_bytes_ if dtype_bytes_ != 4 else 0)
        eager = (base + 2 * b * s * h * d + b * s * s) * dtype_bytes_ + b * h * s * s * per_score
        att = max(att, eager)
    peak = held * dtype_bytes_ + max(mlp * dtype_bytes_, att)
    return peak + 2 * s * d * dtype_bytes_ + batch * logits_kept * shape.vocab * dtype_bytes_


def engine_prefill_bytes(shape: ModelShape, tokens: int, dtype_bytes_: int, glue: str = "fused", past: int = 0,
                         sampled: int = 1, transients: dict | None = None) -> int:
    """Peak activation bytes of one step of the serving engine's model (server/models/base.py) over ``tokens``
    new tokens (after ``past`` cached ones), ``sampled`` of which get logits. The engine runs its own model
    definitions, not transformers' forward, so it has its own model, phase by phase (T tokens, b bytes per
    element):

    - alive throughout: the rotary tables 2·T·d; the residual x, the sub-layer input h and the previous
      sub-layer's output (the residual add is folded into the next norm): X = 3·T·H; eager glue only, for a
      chunk after cached tokens: the attention backend's bool mask T·(past+T), built once per step;
    - attention: q/k/v T·(h+2kv)·d, rotated in place (the eager rotary keeps ~3·T·h·d of temporaries), alive
      until o_proj has run; the attention output and its copy into the step's output (2·T·h·d), and with eager
      glue SDPA's fp32 log-sum-exp T·h·4 (the fused prefill kernel's fp32 tiles, ~110 KiB per thread whatever
      T, are not counted); the o projection's output T·H, then the next norm's two outputs (2·T·H) while the
      old ones live;
    - MLP: gate|up T·2I and silu(gate)·up T·I (fused glue; the eager ops also keep silu(gate), T·I more);
      then the down projection's output T·H;
    - eager glue only: the RMSNorm's fp32 copies (2·T·H·4);
    - the end: x and the pending output for the sampled rows, the logits S·V in the dtype and in fp32.
    ``transients``: bytes a projection allocates while it runs (a weight-only layer dequantizing its
    weight above its kernel's row limit), by role: qkv, o, gate_up, down. bench/engine_memory.py holds
    this to the engine's measured peak.
    """
    if glue not in ("fused", "eager"):
        raise ValueError(f"glue must be 'fused' or 'eager', got {glue!r}")
    tr = {"qkv": 0, "o": 0, "gate_up": 0, "down": 0, **(transients or {})}
    b, T, S = dtype_bytes_, tokens, sampled
    H, I, h, kv, d = shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim
    eager = glue == "eager"
    base = 2 * T * d * b + 3 * T * H * b + (T * (past + T) if past and eager else 0)
    qkv = T * (h + 2 * kv) * d * b
    rope = qkv + (3 * T * h * d * b if eager else 0)
    attend = qkv + 2 * T * h * d * b + (4 * T * h if eager else 0)
    norm = 3 * T * H * b + (2 * 4 * T * H if eager else 0)
    phases = [
        qkv + tr["qkv"], rope, attend,
        qkv + T * h * d * b + T * H * b + tr["o"],  # q/k/v and the attention output bound while o_proj runs
        norm,
        2 * T * I * b + tr["gate_up"],
        (4 if eager else 3) * T * I * b,
        T * I * b + T * H * b + tr["down"],
    ]
    logits = S * shape.vocab * (b + (4 if b != 4 else 0))  # in the dtype, then the fp32 copy (none for fp32)
    end = 2 * T * H * b + 2 * S * H * b + logits - 3 * T * H * b  # x and delta stay, the last h is gone
    return base + max(max(phases), end)


# ---------------------------------------------------------------------------------------------------
# Training: W, A, G, O.


@dataclass(frozen=True)
class TrainSetup:
    precision: str = "mixed"  # "fp32" | "mixed" (16-bit working copy + fp32 master weights)
    optimizer_bits: int = 32  # Adam moments: 32, 8 or 4 bits
    lora_rank: int = 0  # > 0: only LoRA adapters on every block Linear are trained
    base_scheme: str = "float"  # LoRA: the frozen base may be quantized (QLoRA: w4a16)
    checkpointing: bool = False


def lora_params(shape: ModelShape, rank: int) -> int:
    return shape.layers * sum(rank * (n + k) for _, n, k in shape.linears())


def training_bytes(shape: ModelShape, setup: TrainSetup, batch: int, seq: int, attn: str = "sdpa") -> dict:
    """W, A, G, O for one training step with Adam.

    Activations saved for backward per layer follow Korthikanti et al. ("Reducing Activation
    Recomputation", 2022) for a 16-bit transformer layer, 34·s·b·H bytes plus 5·h·s²·b bytes for the
    attention scores (the latter absent with SDPA/FlashAttention, which recompute them), adjusted for
    SwiGLU (3·I wide instead of 4·H) and scaled by the working dtype. With checkpointing only each
    layer's input (b·s·H) is kept, plus one layer's full activations during recomputation.
    """
    work = 4 if setup.precision == "fp32" else 2
    P = shape.params()
    per_layer = batch * seq * (18 * shape.hidden + 6 * shape.intermediate) * work // 2
    if attn == "eager":
        per_layer += 5 * shape.heads * seq * seq * batch * work // 2
    logits = batch * seq * shape.vocab * 4
    if setup.checkpointing:
        acts = shape.layers * batch * seq * shape.hidden * work + per_layer + logits
    else:
        acts = shape.layers * per_layer + logits
    opt_per_param = 2 * setup.optimizer_bits / 8
    if setup.lora_rank > 0:
        trainable = lora_params(shape, setup.lora_rank)
        base = weight_bytes(shape, setup.base_scheme, float_bytes=2)["total"]
        w = base + trainable * 4
        g = trainable * 4
        o = trainable * opt_per_param
    else:
        trainable = P
        w = P * 4 if setup.precision == "fp32" else P * (2 + 4)
        g = P * work
        o = P * opt_per_param
    out = {"W": int(w), "A": int(acts), "G": int(g), "O": int(o)}
    out["total"] = sum(out.values())
    out["trainable_params"] = int(trainable)
    return out


# ---------------------------------------------------------------------------------------------------
# Measurement.


class MemoryTracker:
    """Live tensor bytes during a region, op by op (the allocator's view, on any device).

    A TorchDispatchMode records every storage an op creates and drops it once its last reference is
    gone; `peak` is the most ever alive at once, counting only storages created inside the region.
    """

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            @classmethod
            def _should_skip_dynamo(cls) -> bool:
                # Otherwise the mode's handler is wrapped to keep torch.compile out of it, and that wrapper's
                # first call imports torch dynamo: ~120 MiB resident in a server that never compiles (it
                # measures its projections' transients with this tracker).
                return False

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._observe(out)
                return out

        self._mode = _Mode()
        self.live: dict[int, tuple] = {}
        self.current = 0
        self.peak = 0

    def _observe(self, out) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_flatten

        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                st = t.untyped_storage()
                if st.nbytes() and st.data_ptr() not in self.live:
                    self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
                    self.current += st.nbytes()
        self.peak = max(self.peak, self.current)

    def exclude(self, t: torch.Tensor) -> "MemoryTracker":
        """Leave out a storage that existed before the region (ops that return views of it create nothing)."""
        from torch.multiprocessing.reductions import StorageWeakRef

        st = t.untyped_storage()
        self.live[st.data_ptr()] = (StorageWeakRef(st), 0)
        return self

    def __enter__(self) -> "MemoryTracker":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
