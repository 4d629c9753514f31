"""Frozen configuration for the offline pipeline.

Everything a build depends on is in these dataclasses, passed explicitly; nothing is read from the
environment at import time. `quant.build.schemes.validated(cfg)` is called once at the boundary (`quant.build.pipeline.build`): it
checks the scheme's own options and `BuildConfig.validate()` the rest, naming the offending option.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from quant.errors import ConfigError

if TYPE_CHECKING:
    import torch

CALIB_METHODS = ("minmax", "percentile", "kl", "auto")
# Percentiles tried by `percentile` (the first one) and offered to `auto` as candidates.
PERCENTILES = (99.99, 99.999, 99.9)
# Smoothing strengths tried when --smooth-alpha is not given.
ALPHA_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
DTYPES = ("float32", "bfloat16", "float16")
# Evaluation: float64 is the reference arithmetic (quantized modules by their reference_forward), whose figures are
# the same on every CPU; the others run the serving kernels this CPU picks, which move Δppl by tenths of a point.
EVAL_DTYPES = ("float64", *DTYPES)
MATMUL_DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class CalibConfig:
    source: str = "self"  # "self" (model-generated, seeded) or a path to .txt / .jsonl
    samples: int = 128
    seqlen: int = 512
    seed: int = 0

    def validate(self) -> None:
        if self.samples < 1:
            raise ConfigError(f"--calib-samples must be >= 1, got {self.samples}")
        if self.seqlen < 2:
            raise ConfigError(f"--calib-seqlen must be >= 2, got {self.seqlen}")


@dataclass(frozen=True)
class EvalConfig:
    data: str | None = None  # text file; None means no quality report at build time
    windows: int = 40
    seqlen: int = 512
    dtype: str = "float64"

    # How the options are spelled where this config came from: `quant eval --windows`, but
    # `quant build --eval-windows`; errors name the option the user typed.
    flag: str = "--"

    def validate(self) -> None:
        if self.windows < 1:
            raise ConfigError(f"{self.flag}windows must be >= 1, got {self.windows}")
        if self.seqlen < 2:
            raise ConfigError(f"{self.flag}seqlen must be >= 2, got {self.seqlen}")
        if self.dtype not in EVAL_DTYPES:
            raise ConfigError(f"{self.flag}dtype must be one of {', '.join(EVAL_DTYPES)}, got {self.dtype!r}")


@dataclass(frozen=True)
class BuildConfig:
    scheme: str  # a name registered in quant.build.schemes
    model: str | None = None  # None: the embedded default model
    lora: str | None = None  # a PEFT LoRA adapter dir merged into the base before quantization
    out: str | None = None
    force: bool = False
    calib: CalibConfig = field(default_factory=CalibConfig)
    calib_method: str = "auto"
    smooth: bool = True
    smooth_alpha: float | None = None  # None: searched over ALPHA_GRID per smoothing group
    act_dynamic: bool = False
    # w8a8: int8 weights by GPTQ against each Linear's smoothed calibration inputs (False: round to nearest).
    # Smoothing moves activation range into the weights, where rounding to nearest costs the default model as much
    # KL as the int8 activations do (bench/RESULTS.md#quality-perplexity-and-kl-by-scheme-benchqualitypy).
    weight_gptq: bool = True
    # w8a8: down_proj's input rotated online by a block Hadamard transform (quant.runtime.hadamard), its weight
    # stored rotated: its few outlier channels spread over their block before the int8 rounding (the rotated and
    # unrotated rows of bench/RESULTS.md#quality-perplexity-and-kl-by-scheme-benchqualitypy). On the CPU the
    # transform runs inside the C++ rows pass.
    rotate: bool = True
    include_lm_head: bool = False
    dtype: str = "bfloat16"  # storage dtype of the tensors that stay float (embeddings, norms, biases)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # w4a16 / rtn-w4
    group_size: int | None = None  # None: 128 if it divides every Linear's input dim, else 64, else 32
    asym: bool = False
    damp: float = 0.01
    # On by default: on the default model GPTQ recovers more of RTN's perplexity loss with act-order than without
    # (bench/RESULTS.md#gptq-options-by-group-size-benchgptq_optionspy). Static groups make it free at run time.
    act_order: bool = True
    # w4a16: each group's range searched (shrunk where that rounds the group closer, each weight's error weighed by
    # its input's energy, quant.build.gptq.group_params), which recovers more of RTN's perplexity loss on the default
    # model (bench/RESULTS.md#quality-perplexity-and-kl-by-scheme-benchqualitypy).
    clip_search: bool = True
    # Tokens sampled from the calibration set to score alpha / threshold candidates by output error.
    search_tokens: int = 4096
    # Where calibration and GPTQ run: "auto" (cuda when available), "cpu", "cuda" or "cuda:N".
    device: str = "auto"
    # The dtype the calibration pass's Linear products are computed in: "auto" (bfloat16 where this device
    # multiplies it clearly faster than fp32, float32 elsewhere), "float32" or "bfloat16". Weights, norms,
    # attention, captured inputs, Hessians and the GPTQ solve stay fp32 (quant.build.sequential.linear_products_in).
    matmul_dtype: str = "auto"
    # Data bytes per safetensors shard of the artifact (one model.safetensors when it all fits).
    max_shard_bytes: int = 5_000_000_000
    # Quality gate, measured on `eval.data`: the artifact is not published past either bound.
    max_dppl: float | None = None  # perplexity increase over the float model, percent
    max_kl: float | None = None  # mean KL(float || quantized) per token, nats

    def validate(self) -> None:
        if self.calib_method not in CALIB_METHODS:
            raise ConfigError(
                f"unknown --calib-method {self.calib_method!r}; choose one of {', '.join(CALIB_METHODS)}"
            )
        if self.smooth_alpha is not None and not (
            math.isfinite(self.smooth_alpha) and 0.0 <= self.smooth_alpha <= 1.0
        ):
            raise ConfigError(f"--smooth-alpha must be in [0, 1], got {self.smooth_alpha}")
        if self.group_size is not None and self.group_size not in (32, 64, 128, 256):
            raise ConfigError(f"--group-size must be one of 32, 64, 128, 256, got {self.group_size}")
        if not (math.isfinite(self.damp) and 0.0 < self.damp < 1.0):
            raise ConfigError(f"--damp must be in (0, 1), got {self.damp}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise ConfigError(f"--matmul-dtype must be one of {', '.join(MATMUL_DTYPES)}, got {self.matmul_dtype!r}")
        if self.max_shard_bytes < 1:
            raise ConfigError(f"--max-shard-size must be positive, got {self.max_shard_bytes} bytes")
        for flag, bound in (("--max-dppl", self.max_dppl), ("--max-kl", self.max_kl)):
            if bound is None:
                continue
            if not (math.isfinite(bound) and bound >= 0):
                raise ConfigError(f"{flag} must be a finite number >= 0, got {bound}")
            if not self.eval.data:
                raise ConfigError(f"{flag} needs --eval-data FILE: the gate is measured on that text")
        if self.search_tokens < 1:
            raise ConfigError(f"search_tokens must be >= 1, got {self.search_tokens}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        self.calib.validate()
        self.eval.validate()

    def torch_device(self):
        """The device to build on; refuses a CUDA device this machine does not have."""
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(f"--device {self.device}: no CUDA device is available to this process")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise ConfigError(f"--device {self.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return dev

    def matmul_torch_dtype(self, device) -> "torch.dtype":
        """`matmul_dtype` for a build on `device`, "auto" resolved by measuring (once per process)."""
        import torch

        from quant.runtime.primitives import bf16_matmul_is_faster

        if self.matmul_dtype == "auto":
            return torch.bfloat16 if bf16_matmul_is_faster(device) else torch.float32
        return getattr(torch, self.matmul_dtype)

    def to_dict(self) -> dict:
        return asdict(self)
