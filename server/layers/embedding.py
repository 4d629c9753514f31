"""The token embedding and the LM head: in the model's float dtype, or as per-row int8 (``--embeddings int8``).

A small model's head is its largest matrix: the default model's tied 49152 x 576 embedding is 56 MB in bf16,
read whole at every decode step for the logits (2.4 ms of an 8 ms step on the development machine). In int8 it
is half that, and PyTorch's weight-only int8 kernel multiplies it in 0.8 ms (bench/RESULTS.md#int8-embeddings-and-head-quality-benchembeddings_qualitypy).

int8: every row of the (V, hidden) matrix is quantized symmetrically with its own scale (max |w| / 127), as
``quant.runtime.primitives.quantize_weight_sym`` does for int8 weight-only Linears. The lookup dequantizes only the rows
it looks up; the head runs on the sampled rows alone (``server.models.base``: only they reach the head): in bf16,
where the C++ ops have the pass on 16-bit block activations (AVX2), every row count through it
(``quant.runtime.kernels.rows.int8_weight16``: x held as int16 in blocks of 32 with power-of-two scales, exact
integer sums, within 2^-14 of the exact product's largest logit, far inside the bf16 logits' own rounding),
elsewhere one row through the one-call fp32 product (``rows.int8_weight``) and more through
``aten._weight_int8pack_mm``; 64 rows per call at most (beyond that the kernel loses to a dense matmul, and
dequantizing the whole matrix would cost a transient of its float size); in fp32 every row count through the C++
product (PyTorch's kernel takes ~15x longer there: 49 against 3.0 ms for two rows of the default model's matrix, as
fast as its bf16 kernel at 1 to 64 rows; 1.6 against the dense fp32 head's 4.8 ms for one row on an AVX2 EPYC). A
tied embedding and head share the one int8 tensor; an untied head is quantized the same way on its own. fp16 has
no fast int8 product, so int8 embeddings need ``--dtype bfloat16`` or ``float32`` (the latter where the C++ ops are
built).

On a GPU the head is the Triton int8 weight-only kernels' (``quant.runtime.kernels.triton_ops.int8_matmul``, those
of int8 weight-only Linears there: a GEMV at one row, its launch measured at start like theirs; the tiled GEMM at
more), over the same codes and scales: CUDA's ``_weight_int8pack_mm`` walks K serially. Where that kernel fails at
start, one log line, and the head takes ``_weight_int8pack_mm``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from quant.runtime.int8 import INT8PACK_MAX_ROWS
from quant.runtime.kernel_choice import Chooser, LaunchSpace, computation_key
from quant.runtime.kernels import rows as rowops
from quant.runtime.kernels import triton_ops
from quant.runtime.primitives import quantize_weight_sym

log = logging.getLogger(__name__)

MODES = ("auto", "float", "int8")


def resolve(mode: str, dtype: torch.dtype, quantized: bool) -> str:
    """``auto``: int8 for a quantized artifact served in bf16 (measured on the default model's w4a16 artifact:
    -0.10% perplexity change, mean KL 0.001, bench/RESULTS.md#int8-embeddings-and-head-quality-benchembeddings_qualitypy), float otherwise: a model served unquantized is
    served as it is, fp32 is chosen for its exactness (int8 only when asked), and fp16 has no fast int8 kernel."""
    if mode != "auto":
        return mode
    return "int8" if quantized and dtype == torch.bfloat16 else "float"


def quantize_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """(V, H) float -> (V, H) int8 codes and (V,) fp32 scales, one per row."""
    return quantize_weight_sym(w)


def check_mode(mode: str, dtype: torch.dtype) -> None:
    if mode not in MODES:
        raise ValueError(f"--embeddings must be one of {', '.join(MODES)}, got {mode!r}")
    if mode != "int8" or dtype == torch.bfloat16:
        return
    if dtype != torch.float32:
        raise ValueError(f"--embeddings int8 needs --dtype bfloat16 or float32 (the int8 kernel is ~14x slower with "
                         f"{str(dtype).replace('torch.', '')} activations), or --embeddings float")
    if not rowops.available(torch.empty(0, dtype=torch.int8)):
        raise ValueError(f"--embeddings int8 with --dtype float32 needs the C++ rows op "
                         f"({rowops.unavailable_reason()}): use --dtype bfloat16 or --embeddings float")


def describe(mode: str) -> str:
    """What ModelInfo reports."""
    if mode == "float":
        return "float"
    return ("int8 per row (lookup dequantizes its rows; head: the C++ rows product on int16 block activations where "
            "built, else the C++ rows product and aten._weight_int8pack_mm; on a GPU the Triton int8 GEMV and GEMM)")


class Int8Rows:
    """A (V, H) matrix held as per-row int8: gather rows (an embedding) or multiply by it (a head).

    ``triton``: whether the head takes the Triton int8 kernels (default: on a GPU, where Triton is installed, for
    16-bit activations; the CPU tests pass True to run them under Triton's interpreter)."""

    def __init__(self, w: Tensor, dtype: torch.dtype, triton: bool | None = None):
        self.q, scale = quantize_rows(w)  # (V, H) int8, (V,) fp32
        self.scale = scale.to(dtype)  # (V,) in the activation dtype: what the int8pack kernel takes
        self.dtype = dtype
        self.gemv_config: tuple[int, ...] | None = None  # the one-row launch measured on the device (tune)
        if triton is None:
            triton = self.q.is_cuda
        self.triton = (triton and dtype in (torch.bfloat16, torch.float16) and triton_ops.available() is None
                       and self._triton_runs())
        # One row (batch-1 decode) goes through the one-call C++ product: at 49152 x 576 it reads the matrix in
        # ~0.6x the int8pack kernel's time (bench/RESULTS.md#int8-embeddings-and-head-quality-benchembeddings_qualitypy);
        # where the build has the pass on int16 block activations, bf16 rows up to INT8PACK_MAX_ROWS take that one,
        # ahead of both at every row count measured (1 to 64: bench/RESULTS.md#the-int8-head-on-int16-activations).
        use = not self.triton and dtype in (torch.bfloat16, torch.float32) and rowops.available(self.q)
        self.rows = rowops.int8_weight(self.q, self.scale, None, None) if use else None
        use16 = use and dtype == torch.bfloat16 and self.q.shape[1] % 32 == 0 and rowops.rows16_built()
        self.rows16 = rowops.int8_weight16(self.q, self.scale, None, None) if use16 else None

    def _triton_runs(self) -> bool:
        """The Triton head launched once at one row and at two (the GEMV and the GEMM) before any step runs: where
        either fails, one log line, and the head takes the built-in kernel (a kernel must not take the engine
        down)."""
        try:
            for rows in (1, 2):
                self._triton_head(torch.zeros(rows, self.q.shape[1], dtype=self.dtype, device=self.q.device))
            return True
        except Exception as e:  # noqa: BLE001
            log.warning("the Triton int8 head (%d x %d) failed at start (%s: %s): aten._weight_int8pack_mm instead",
                        *self.q.shape, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return False

    def _triton_head(self, h: Tensor, config: tuple[int, ...] | None = None) -> Tensor:
        return triton_ops.int8_matmul(h, self.q, self.scale, None, config or self.gemv_config)

    def tune(self, chooser: Chooser | None) -> None:
        """The Triton head's one-row launch, measured on its device by ``chooser`` (kept with its plans) as the
        projections' are; the kernel's rule where nothing is measured."""
        if not self.triton or chooser is None:
            return
        v, h = self.q.shape
        dev = self.q.device
        start, axes = triton_ops.int8_gemv_space(v, h, triton_ops.multiprocessors(dev))
        space = LaunchSpace(tuple(start), axes, triton_ops.GEMV_AXES,
                            lambda cfg: (lambda x: self._triton_head(x, cfg)),
                            lambda x: F.linear(x, (self.q.to(self.dtype) * self.scale[:, None])),
                            lambda: triton_ops.reset_split_counters(dev))
        self.gemv_config = chooser.tune(computation_key("int8_rows[head]", v, h, self.dtype), space, h, self.dtype,
                                        dev)

    def lookup(self, ids: Tensor) -> Tensor:
        """(T,) token ids -> (T, H) in the activation dtype, dequantizing only those rows."""
        return F.embedding(ids, self.q).to(self.dtype) * self.scale[ids][:, None]

    def head(self, h: Tensor) -> Tensor:
        """(S, H) -> (S, V) logits in the activation dtype."""
        if self.triton:
            return self._triton_head(h.contiguous())
        h = h.contiguous()
        if self.rows is not None and self.dtype == torch.float32:  # every row count (no fast fp32 int8pack kernel)
            return self.rows(h)
        if h.shape[0] > INT8PACK_MAX_ROWS:
            return torch.cat([self.head(part) for part in h.split(INT8PACK_MAX_ROWS)])
        if self.rows16 is not None:
            return self.rows16(h)
        if self.rows is not None and h.shape[0] == 1:
            return self.rows(h)
        return torch.ops.aten._weight_int8pack_mm(h, self.q, self.scale)

    def dequantized(self) -> Tensor:
        """(V, H) fp32: the values this matrix stands for (the reference the kernels are held to)."""
        return self.q.float() * self.scale.float()[:, None]

    def tensors(self) -> list[Tensor]:
        return [self.q, self.scale]


def embedding_and_head(embed: Tensor, head: Callable[[Tensor], Tensor], head_weight: Tensor | None, mode: str,
                       dtype: torch.dtype, chooser: Chooser | None = None
                       ) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor], list[Tensor], list[Tensor]]:
    """(lookup, head, tensors held, tensors replaced) for a model whose embedding is `embed` (V, H) and whose head
    is the callable `head` over `head_weight` (the embedding itself when tied, None when the head is not a plain
    matrix). float: as given. int8: one Int8Rows for a tied pair, two otherwise; a GPU's int8 head has its one-row
    launch measured by ``chooser`` (:meth:`Int8Rows.tune`)."""
    if mode == "float":
        return (lambda ids: F.embedding(ids, embed)), head, [], []
    check_mode(mode, dtype)
    if mode != "int8":
        raise ValueError(f"embeddings mode {mode!r} must be resolved to float or int8 first (layers.embedding.resolve)")
    tied = (head_weight is not None and head_weight.data_ptr() == embed.data_ptr()
            and head_weight.shape == embed.shape)
    rows = Int8Rows(embed, dtype, triton=None if tied else False)  # a lookup alone takes no head kernel
    if head_weight is None:  # a head the scheme quantized itself keeps its own kernel
        return rows.lookup, head, rows.tensors(), [embed]
    out = rows if tied else Int8Rows(head_weight, dtype)
    out.tune(chooser)
    held = rows.tensors() + ([] if tied else out.tensors())
    replaced = [embed] + ([] if tied else [head_weight])
    return rows.lookup, out.head, held, replaced
