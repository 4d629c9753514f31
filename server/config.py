"""The engine's and the service's settings (``EngineConfig``, ``Limits``: validated once, at the boundary; those
`quant serve` exposes take their default and meaning from the settings table, server/settings.py) and what the
engine reports of the model it serves (``ModelInfo``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant.runtime.kernel_choice import MODES as KERNEL_MODES
from quant.shape.kv_formats import FLOAT_BYTES
from server import kv_int4
from server.kv_pool import SERVED_FORMATS, default_block_size
from server.layers.embedding import check_mode as check_embeddings
from server.settings import BY_NAME, setting


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings. Those `quant serve` exposes take their default and meaning from the settings table
    (server/settings.py); the others are the engine's own."""

    memory_budget: str = setting("memory_budget")
    max_queue: int = setting("max_queue")
    max_batch: int = setting("max_batch")
    max_prefill_tokens: int = setting("max_prefill_tokens")
    prefix_cache: bool = setting("prefix_cache")  # server/kv_pool.py's BlockPool
    kv_admission: str = setting("kv_admission")  # server/scheduler.py
    kv_watermark: float = setting("kv_watermark")
    kv_dtype: str = setting("kv_dtype")  # server/kv_pool.py's KVLayout
    block_size: int | None = None  # tokens per KV block; None: the KV dtype's (kv_block_size)
    speculate: str = setting("speculate")  # server/speculate.py
    draft: str | None = setting("draft")  # server/draft.py
    draft_dtype: str = setting("draft_dtype")
    speculate_tokens: int = setting("speculate_tokens")
    dtype: str = setting("dtype")
    device: str = setting("device")
    embeddings: str = setting("embeddings")  # server/layers/embedding.py
    int4_activations: str = setting("int4_activations")  # quant/runtime/int4.py: GPTQLinear.use_int8_activations
    kernels: str = setting("kernels")  # quant/runtime/kernel_choice.py
    threads: int | None = setting("threads")  # None leaves torch's default
    fused_ops: bool = True  # the fused glue kernels: C++ on CPU (server/fastops.py), Triton on CUDA (False: eager)
    cuda_graphs: bool = True  # CUDA: decode steps replay graphs captured at start (server/cuda_graphs.py)
    cpu_graphs: bool = True  # CPU, fused ops: decode steps replay their recorded ops from C++ (server/cpu_graphs.py)
    # Launch each step before reading the previous one's samples back (decode rows take their tokens on the device),
    # so the host's per-token work overlaps the device's; None: on CUDA, where the device runs asynchronously.
    overlap: bool | None = None

    @property
    def kv_format(self) -> str | None:
        """The quantized format the KV pool holds (int8, fp8, int4), or None for the activations' dtype."""
        return self.kv_dtype if self.kv_dtype in SERVED_FORMATS else None

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV block: ``block_size`` when given, else the KV format's default (server/kv_pool.py)."""
        return self.block_size if self.block_size is not None else default_block_size(self.kv_format)

    @property
    def speculation(self) -> str:
        """How requests draft (server/speculate.py): ``draft`` (a draft model, server/draft.py), ``ngram`` or
        ``off``; ``auto`` is the draft model when one is given, else n-grams on the CPU without an int4 cache."""
        if self.speculate == "auto":
            if self.draft is not None:
                return "draft"
            return "ngram" if torch.device(self.device).type == "cpu" and self.kv_dtype != "int4" else "off"
        return self.speculate

    @property
    def draft_torch_dtype(self) -> torch.dtype:
        """The draft model's dtype: ``draft_dtype``, or for auto the target's but bfloat16 for a float32 target."""
        if self.draft_dtype != "auto":
            return getattr(torch, self.draft_dtype)
        return torch.bfloat16 if self.dtype == "float32" else getattr(torch, self.dtype)

    @property
    def speculates(self) -> bool:
        return self.speculation != "off"

    def validate(self) -> "EngineConfig":
        for name in ("max_queue", "max_batch", "max_prefill_tokens", "block_size", "speculate_tokens"):
            v = self.kv_block_size if name == "block_size" else getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"--dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"--threads must be an integer >= 1, got {self.threads!r}")
        check_embeddings(self.embeddings, getattr(torch, self.dtype))
        if self.int4_activations not in BY_NAME["int4_activations"].choices:
            raise ValueError(f"--int4-activations must be one of {', '.join(BY_NAME['int4_activations'].choices)}, "
                             f"got {self.int4_activations!r}")
        if self.kernels not in KERNEL_MODES:
            raise ValueError(f"--kernels must be one of {', '.join(KERNEL_MODES)}, got {self.kernels!r}")
        admissions = BY_NAME["kv_admission"].choices
        if self.kv_admission not in admissions:
            raise ValueError(f"--kv-admission must be one of {', '.join(admissions)}, got {self.kv_admission!r}")
        w = self.kv_watermark
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < 1:
            raise ValueError(f"--kv-watermark must be a number in [0, 1), got {w!r}")
        kv_dtypes = BY_NAME["kv_dtype"].choices
        if self.kv_dtype not in kv_dtypes:
            raise ValueError(f"--kv-dtype must be one of {', '.join(kv_dtypes)}, got {self.kv_dtype!r}")
        if self.kv_dtype in FLOAT_BYTES and self.kv_dtype != self.dtype:
            raise ValueError(f"--kv-dtype {self.kv_dtype}: a float KV cache is held in the activations' dtype "
                             f"(--dtype {self.dtype}); choose auto, int8 or fp8")
        if self.kv_format and torch.device(self.device).type != "cpu":
            raise ValueError(f"--kv-dtype {self.kv_dtype}: a quantized KV cache is served on the CPU only for now "
                             f"(the {torch.device(self.device).type} attention kernels read none yet); choose auto")
        if self.kv_dtype == "int4" and self.kv_block_size != kv_int4.BLOCK_SIZE:
            raise ValueError(f"--kv-dtype int4 is held in blocks of its key group, {kv_int4.BLOCK_SIZE} tokens; "
                             f"block size {self.kv_block_size} was asked for")
        modes = BY_NAME["speculate"].choices
        if self.speculate not in modes:
            raise ValueError(f"--speculate must be one of {', '.join(modes)}, got {self.speculate!r}")
        if self.draft_dtype not in BY_NAME["draft_dtype"].choices:
            raise ValueError(f"--draft-dtype must be one of {', '.join(BY_NAME['draft_dtype'].choices)}, "
                             f"got {self.draft_dtype!r}")
        if self.speculate == "draft" and self.draft is None:
            raise ValueError("--speculate draft needs a draft model: --draft MODEL")
        if self.draft is not None and self.speculate not in ("draft", "auto"):
            raise ValueError(f"--draft is the draft model of --speculate draft (or auto), not --speculate "
                             f"{self.speculate}")
        if self.speculates and self.kv_dtype == "int4":
            raise ValueError("--speculate: not with --kv-dtype int4 (a block is quantized as its tokens complete it, "
                             "which a rejected draft could not take back); choose int8 or turn speculation off")
        if not isinstance(self.prefix_cache, bool):
            raise ValueError(f"--prefix-cache must be true or false, got {self.prefix_cache!r}")
        return self


@dataclass(frozen=True)
class ModelInfo:
    model: str  # what was loaded (artifact dir or model source)
    scheme: str  # quantization scheme, or "none" for a model served unquantized
    dtype: str
    device: str
    attention: str
    context_length: int
    vocab_size: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_capacity_bytes: int
    kv_block_size: int
    glue_ops: str  # "fused" (server/csrc kernels), "triton" (server/glue_triton.py) or "eager" with the reason
    embeddings: str  # "float", or "int8" with the head's kernel (server/layers/embedding.py)
    kernels: tuple[str, ...] = ()  # per projection computation: the path at each row count and why (measured)
    speculation: str = "off"  # off, ngram, or the draft model: "draft <model> (<scheme>)"


@dataclass(frozen=True)
class Limits:
    """Per-request limits of a server (on top of the engine's own: context length, KV pool)."""

    max_prompt_tokens: int | None = setting("max_prompt_tokens")  # None: the model's context length
    max_new_tokens: int = setting("max_new_tokens")
    max_request_bytes: int = setting("max_request_bytes")
    max_stop: int = 16  # stop sequences per request (SamplingParams allows at most 16)

    def validate(self) -> "Limits":
        for name in ("max_new_tokens", "max_request_bytes", "max_stop"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.max_prompt_tokens is not None and (not isinstance(self.max_prompt_tokens, int)
                                                   or self.max_prompt_tokens < 1):
            raise ValueError(f"--max-prompt-tokens must be an integer >= 1, got {self.max_prompt_tokens!r}")
        return self
