"""What an artifact and its build will take, predicted per scheme: the weights as the artifact lays them out
(or as a loaded model holds them), and a build's peak beyond the process's own runtime."""

from __future__ import annotations

from dataclasses import dataclass

from quant.build import schemes
from quant.shape.model import ModelShape


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
