"""Walsh-Hadamard rotation of a Linear's input (QuaRot / SmoothRot style), applied online.

For an orthonormal H, y = W x = (W H^T)(H x): the build stores the rotated weight W H^T and the runtime rotates its
input before quantizing it. H spreads a channel outlier over every channel of its block, so one per-tensor int8
scale covers the rotated input with far less rounding error for the other channels (down_proj's input, whose few
outlier channels cost the static w8a8 build most of its loss: the rotated and unrotated rows of bench/RESULTS.md#quality-perplexity-and-kl-by-scheme-benchqualitypy).

H is block diagonal: blocks of `b` consecutive channels, b the largest power of two dividing K (at most
MAX_BLOCK), each the normalized Sylvester matrix H_b / sqrt(b). Sylvester matrices are symmetric, so the same
transform rotates the weight rows (W H^T = rotate(W)). Computed as the fast Walsh-Hadamard butterfly: log2 b passes
of sums and differences, then the scale. Every value is one fixed chain of exactly rounded sums, so:
- on the CPU one C++ op (quant.runtime.kernels.rows.hadamard_), whose sums the W8A8 rows pass applies inside its kernel: every CPU
  path of a rotated module quantizes the same rotated values bit for bit (a rounding edge must not fall differently
  between the batch-1 decode and a prefill), and in float64 (`quant eval`) no BLAS's summation order enters;
- elsewhere (CUDA), and on a CPU without the C++ ops, the same butterfly in PyTorch, bit for bit the same sums
  (2 log2 b + 1 small kernels). `kronecker` computes H_b = H_b1 (x) H_b2 as two small products per block (two
  launches) instead; it is CUDA's faster form, off (`CUDA_KRONECKER`) until a GPU run verifies it
  (scripts/gpu_unverified.md).
"""

from __future__ import annotations

import functools
import math

import torch

from quant.runtime.kernels import rows as rowops

MAX_BLOCK = 4096  # larger blocks spread no better and cost more; 14336 = 7 x 2048 gets 2048
MIN_BLOCK = 16  # smaller blocks spread an outlier over too few channels to pay for the pass: left unrotated
# CUDA inputs through `kronecker` (two products per block, factors cached per device and made by the module's prepare,
# before any graph capture) instead of the butterfly's PyTorch kernels. Off until a GPU run verifies it.
CUDA_KRONECKER = False


def block_size(k: int) -> int:
    """The rotation's block for an input of `k` channels: the largest power of two dividing k, at most MAX_BLOCK;
    0 (not rotated) where that is under MIN_BLOCK."""
    b = min(k & -k, MAX_BLOCK)
    return b if b >= MIN_BLOCK else 0


def is_block(k: int, block) -> bool:
    """Whether `block` can rotate `k` channels: an int power of two >= 2 dividing k."""
    return type(block) is int and block >= 2 and not block & (block - 1) and not k % block


def check_block(k: int, block: int) -> None:
    if not is_block(k, block):
        raise ValueError(f"cannot rotate {k} channels in blocks of {block!r}: a block is a power of two dividing them")


def sylvester(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The unnormalized n x n Sylvester-Hadamard matrix (entries +-1), n a power of two. Reference and factor."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester-Hadamard matrix needs a power of two, got {n}")
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)  # (2m, 2m)
    return h


def rotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (..., K) -> x H^T (..., K) in x's dtype: each run of `block` channels times H_block / sqrt(block)."""
    check_block(x.shape[-1], block)
    if _cpu_op(x):
        return rotate_(x.clone(memory_format=torch.contiguous_format), block)
    if CUDA_KRONECKER and x.is_cuda:
        return kronecker(x, block)
    return butterfly(x, block)


def rotate_(x: torch.Tensor, block: int) -> torch.Tensor:
    """`rotate` into x itself (returned), for callers that own x: in place where the CPU op can (x contiguous, fp32 or
    fp64, on the CPU: the build's calibration inputs, tokens x K, which a copy would double), else copied back."""
    check_block(x.shape[-1], block)
    if _cpu_op(x) and x.is_contiguous():
        rowops.hadamard_(x.view(-1, x.shape[-1]), block)
        return x
    return x.copy_(rotate(x, block))


def _cpu_op(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and rowops.available(x)


def butterfly(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (..., K) rotated by the butterfly in PyTorch, the C++ op's sums in its order: pass h pairs channel j with
    j + h inside each run of 2h (h = 1, 2, 4, ...), (a, c) -> (a + c, a - c); then the scale, rounded to x's dtype."""
    v = x.reshape(-1, block)  # (M * K / b, b)
    h = 1
    while h < block:
        pairs = v.view(-1, block // (2 * h), 2, h)
        a, c = pairs[:, :, 0], pairs[:, :, 1]  # (R, b / 2h, h) each
        v = torch.stack((a + c, a - c), dim=2).view(-1, block)
        h *= 2
    return (v * (1.0 / math.sqrt(block))).reshape(x.shape)


def kronecker(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (..., K) rotated by two small products per block: a block read row-major as a (b1, b2) matrix X becomes
    H_b1 X H_b2 (b = b1 b2). Its sums run in the BLAS's order, not the butterfly's (and in TF32 where a process
    allows it for fp32 products)."""
    h1, h2 = _factors(block, x.dtype, x.device)
    b1, b2 = h1.shape[0], h2.shape[0]
    xb = x.reshape(-1, b1, b2)  # (M * K / b, b1, b2): one block of one row per matrix
    y = torch.matmul(torch.matmul(h1, xb), h2)  # (M * K / b, b1, b2)
    return y.reshape(x.shape)


@functools.lru_cache(maxsize=None)
def _factors(block: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """H_b1 and H_b2 (b1 <= b2, b1 b2 = block), normalization folded into both (1 / sqrt of each size).
    Cached: `warm` makes them before a CUDA graph is captured. One made inside a capture would live in the graph's
    private pool and be overwritten after it, so that is refused (the capture fails, saying why)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"quant.runtime.hadamard: the {block}-block factors for {dtype} on {device} were not made before "
                           "this CUDA graph capture (the module's prepare makes them)")
    b1 = 1 << (int(math.log2(block)) // 2)
    b2 = block // b1
    return (sylvester(b1, dtype, device) / math.sqrt(b1), sylvester(b2, dtype, device) / math.sqrt(b2))


def warm(block: int, dtype: torch.dtype, device: torch.device) -> None:
    """Make `kronecker`'s factors for CUDA inputs now (a module's prepare, before any graph capture)."""
    device = torch.device(device)
    if CUDA_KRONECKER and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        _factors(block, dtype, torch.device("cuda", index))


def rotate_reference(x: torch.Tensor, block: int) -> torch.Tensor:
    """`rotate` as one dense block-diagonal product, for tests."""
    k = x.shape[-1]
    h = sylvester(block, x.dtype, x.device) / math.sqrt(block)  # (b, b)
    return (x.reshape(*x.shape[:-1], k // block, block) @ h.t()).reshape(x.shape)
