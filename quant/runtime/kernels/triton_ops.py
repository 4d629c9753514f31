"""Triton GEMMs for the weight-only runtime Linears on CUDA, each beside the plain PyTorch reference it is held to
(tests/test_triton_ops.py, under ``TRITON_INTERPRET=1`` on a CPU; bench/gpu.py on a GPU).

- ``w4_matmul``: x (M, K) @ W^T with W stored as GPTQ's ``qweight`` (K/8, N) int32, eight 4-bit codes per word
  packed LSB-first along K, and a (G, N, 2) scale/zero table in the activation dtype, W[n, k] = (code - 8) * s +
  z per group (the same table the CPU int4 kernel reads, so both devices hold one layout shape). Each word is
  loaded once and its eight codes unpacked and scaled in registers, tile by tile: the weight is read once per
  block of M rows, not re-dequantized per 16 rows as tinygemm does.
- ``int8_matmul``: x (M, K) @ W^T with W (N, K) int8 and per-row fp32 scales (and int8 zero-points, affine: the
  zero is folded out as s * (x.q - z * sum(x))), returning the activation dtype. PyTorch's CUDA
  ``_weight_int8pack_mm`` walks K serially per output (~7x slower than bf16 on Hopper, by others' figures).

Both use fp32 accumulation and split K across programs when the (M, N) tiles alone would leave most of the GPU
idle (the decode shapes): each program stores its fp32 partial and the last one of a tile sums them in a fixed
order (``triton_kernels.store_or_reduce``), so a split product is one launch and deterministic.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch
from torch import Tensor


def available() -> str | None:
    """None when the kernels can run here, else why not (looked up without importing triton: the kernels module
    is imported on the first launch)."""
    return None if importlib.util.find_spec("triton") is not None else "triton is not installed"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The split-K rules aim for this many programs per multiprocessor on a decode-shaped product: two for the tiled
# kernels, four for the one-row kernels (enough weight bytes in flight for the memory's bandwidth).
PROGRAMS_PER_SM = 2
GEMV_PROGRAMS_PER_SM = 4
H100_SMS = 132  # what the rules assume off a GPU (the interpreter runs the GPU's rules)


def _cuda_properties(device: torch.device):
    return torch.cuda.get_device_properties(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors (CUDA), else an H100's."""
    return _cuda_properties(device).multi_processor_count if device.type == "cuda" else H100_SMS


@functools.lru_cache(maxsize=None)
def capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability (CUDA), else an H100's (the interpreter runs the H100's rules)."""
    if device.type != "cuda":
        return (9, 0)
    props = _cuda_properties(device)
    return props.major, props.minor


# Above this many rows the int4 Linears dequantize on CUDA (one Triton pass into the activation dtype) and
# multiply with cuBLAS, which measured faster there than the fused kernel (bench/gpu.py measures both sides;
# the int8 kernel stays ahead of dequantizing at every row count measured, so int8 takes it throughout).
CUDA_KERNEL_MAX_ROWS = 64


def w4_block_k(group_size: int, rows: int = 1) -> int | None:
    """The K tile of the int4 kernel for inputs of ``rows`` rows: 128 for decode shapes (more weight bytes in
    flight per program), 64 above; a tile holds whole groups or lies in one (the group size a power of two >= 8).
    None when the group size allows neither."""
    if group_size < 8 or group_size & (group_size - 1):
        return None
    return 128 if rows <= 64 else 64


def _config(m: int, n: int, k: int, bk: int, sms: int = H100_SMS,
            tile: tuple[int, int, int] | None = None) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, SPLIT_K, num_warps, num_stages) for an (m x k) @ (k x n) product (no autotuning: it
    does not run under the interpreter, and a fixed rule keeps the first call's latency flat); ``tile``: a
    kernel's own (BLOCK_M, BLOCK_N, num_warps), K split by the same rule."""
    bm = 16 if m <= 16 else (32 if m <= 32 else (64 if m <= 64 else 128))
    bn, warps = (64, 4) if m <= 64 else (128, 8)
    if tile is not None:
        bm, bn, warps = tile
    tiles = -(-m // bm) * -(-n // bn)
    split = 1
    if m <= 64:
        steps = -(-k // bk)
        while tiles * split * 2 <= PROGRAMS_PER_SM * sms and steps >= split * 2 * 4:  # >= 4 K tiles per program
            split *= 2
    return bm, bn, split, warps, 3


_LOCKS: dict[torch.device, list[Tensor]] = {}


def split_workspace(x: Tensor, split: int, m: int, n: int, tiles: int) -> tuple[Tensor, Tensor]:
    """A split-K product's fp32 partials (split, m, n) and its tiles' counters (triton_kernels.store_or_reduce).

    The counters are zeros held per device and shared by every product, which assumes the products on a device run
    one after another (the engine launches everything on one stream): each leaves its counters at zero. The first
    call on a device zeroes them, outside any CUDA graph (graphs are captured after warm-up runs of the same
    shapes). A larger set, should a product need one, is added beside the old, which stays allocated: captured
    graphs hold its address. (The split rules keep tiles far below the first set's 4096.)"""
    if split == 1:
        return x, x  # unused
    return torch.empty(split, m, n, dtype=torch.float32, device=x.device), split_counters(x.device, tiles)


def split_counters(device: torch.device, tiles: int) -> Tensor:
    """At least ``tiles`` int32 counters, zero between launches, held per device and shared by every split launch on
    it (the products here, the paged attention's split keys): see :func:`split_workspace`."""
    held = _LOCKS.setdefault(torch.device(device), [])
    if not held or held[-1].numel() < tiles:
        with torch.inference_mode(False):  # a normal tensor, even on a first launch under inference mode: the
            # counters are re-armed in place outside it too (reset_split_counters, after a launch search refuses one)
            held.append(torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device))
    return held[-1]


def reset_split_counters(device: torch.device) -> None:
    """Zero the split-K counters held for ``device``: after a launch that failed or computed wrong sums
    (quant.runtime.kernel_choice.search refuses it), which may have left a tile's counter mid-count."""
    for held in _LOCKS.get(torch.device(device), []):
        held.zero_()


def _launch(kernel: str, x: Tensor, n: int, k: int, bk: int, *args, tile: tuple[int, int, int] | None = None,
            **consts) -> Tensor:
    from quant.runtime.kernels import triton_kernels

    kernel = getattr(triton_kernels, kernel)
    m = x.shape[0]
    bm, bn, split, warps, stages = _config(m, n, k, bk, multiprocessors(x.device), tile)
    grid = (_cdiv(m, bm), _cdiv(n, bn), split)
    y = x.new_empty(m, n)
    ws, locks = split_workspace(x, split, m, n, grid[0] * grid[1])
    kernel[grid](x, *args, y, ws, locks, m, n, k, x.stride(0), *consts.pop("strides", ()), y.stride(0),
                 **consts, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)
    return y


def w4_dequant(qweight: Tensor, scales_zeros: Tensor, group_size: int, dtype: torch.dtype) -> Tensor:
    """W^T (K, N) in ``dtype`` from the GPTQ words and the scale/zero table, in one pass (the prefill path's
    weight for cuBLAS; K-major so that the stores follow the words' layout)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    from quant.runtime.kernels.triton_kernels import w4_dequant_kernel

    wt = torch.empty(k, n, dtype=dtype, device=qweight.device)
    grid = (_cdiv(k, 64), _cdiv(n, 128))
    w4_dequant_kernel[grid](qweight, scales_zeros, wt, n, k, GS=group_size, BLOCK_K=64, BLOCK_N=128)
    return wt


# The tiled W4A16 kernel's code planes (triton_kernels.w4_planes), per 16-bit activation dtype: the bits of 2^7
# (bf16) or 2^10 (fp16), whose mantissa unit is 1, and that power plus 8, so that (code | bits) - bias = q - 8.
CODE_PLANE_BITS = {torch.bfloat16: (0x4300, 136.0), torch.float16: (0x6400, 1032.0)}
PLANES_BLOCK_K = 128  # its K tile, in one group: eight products of K = 16, the tensor cores' least for 16-bit


def w4_planes_tile(rows: int, cap: tuple[int, int], zero_free: bool) -> tuple[int, int, int] | None:
    """(BLOCK_M, BLOCK_N, num_warps) of w4_planes_kernel for ``rows`` rows on a GPU of compute capability ``cap``,
    or None where it does not pay: the fewest loop instructions per weight with nothing spilled at Llama-3-8B's
    shapes (bench/sass.py). On sm_90: 4.3 / 4.8 / 6.6 at 16 / 32 / 64 rows with a symmetric table, 5.0 / 6.0 with
    zeros up to 32 rows, where the tile of whole weights issues 8.6 / 9.2 / 9.1; at 64 rows the zeros' column sums
    leave the planes no better than whole weights. On sm_80 the 64-row tile spills or issues more than whole
    weights, and the 32-row tile takes 8 warps to keep the split products' epilogue out of local memory."""
    if rows <= 16:
        return 16, 128, 4
    if rows <= 32:
        return (32, 128, 4) if cap >= (9, 0) else (32, 128, 8)
    if rows <= 64 and cap >= (9, 0) and zero_free:
        return 64, 128, 8
    return None


def w4_planes_launch(x: Tensor, group_size: int, zero_free: bool) -> tuple[int, int, int] | None:
    """The planes kernel's tile for this product, or None where w4_matmul takes another kernel: the GEMV at one row,
    whole weights for fp32 x, groups a K tile (PLANES_BLOCK_K) does not lie in one of, or past w4_planes_tile."""
    if x.shape[0] < 2 or x.dtype not in CODE_PLANE_BITS or group_size % PLANES_BLOCK_K:
        return None
    return w4_planes_tile(x.shape[0], capability(x.device), zero_free)


def _one_row_only(x: Tensor, gated: str | None, norm, name: str) -> None:
    if (gated is not None or norm is not None) and x.shape[0] != 1:
        raise ValueError(f"{name}: the gated and norm epilogues are the one-row kernel's; x has {x.shape[0]} rows")


def w4_matmul(x: Tensor, qweight: Tensor, scales_zeros: Tensor, group_size: int,
              gemv_config: tuple[int, int, int, int] | None = None, zero_free: bool = False,
              gated: str | None = None, norm: AddNorm | None = None):
    """x (M, K) 16-bit or fp32, contiguous; qweight (K/8, N) int32; scales_zeros (G, N, 2) -> (M, N) in x's dtype.
    One row (batch-1 decode) takes the GEMV kernel (launched with ``gemv_config``, else its rule's; ``gated`` and
    ``norm``: see :func:`w4_gemv`); a few rows of 16-bit x in groups of 128 or more the tiled kernel over code planes
    (w4_planes_launch), others the one over whole weights. ``zero_free``: the table's zeros are all 0, a symmetric
    checkpoint's, and the kernels skip them."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    bk = w4_block_k(group_size, x.shape[0])
    if bk is None or x.shape[1] != k:
        raise ValueError(f"w4_matmul: group size {group_size} has no K tile, or x has {x.shape[1]} columns, not {k}")
    _one_row_only(x, gated, norm, "w4_matmul")
    if x.shape[0] == 1:
        return w4_gemv(x, qweight, scales_zeros, group_size, gemv_config, zero_free, gated, norm)
    tile = w4_planes_launch(x, group_size, zero_free)
    if tile is not None:
        bits, bias = CODE_PLANE_BITS[x.dtype]
        return _launch("w4_planes_kernel", x, n, k, PLANES_BLOCK_K, qweight, scales_zeros, tile=tile, GS=group_size,
                       HAS_ZERO=not zero_free, CODE_BITS=bits, CODE_BIAS=bias)
    return _launch("w4_kernel", x, n, k, bk, qweight, scales_zeros, GS=group_size)


def _gemv_split(tiles: int, steps: int, sms: int) -> int:
    """K split (a power of two) until the programs reach GEMV_PROGRAMS_PER_SM per multiprocessor, each keeping >= 2
    K tiles."""
    split = 1
    while tiles * split * 2 <= GEMV_PROGRAMS_PER_SM * sms and steps >= split * 2 * 2:
        split *= 2
    return split


def w4_gemv_config(n: int, k: int, group_size: int, sms: int = H100_SMS) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps) of the one-row kernel. (bench/gpu.py sweeps these on a GPU.)"""
    bn, bk = 128, min(group_size, 128)
    return bn, bk, _gemv_split(_cdiv(n, bn), _cdiv(k, bk), sms), 4


# The values a device's search tries per position of a one-row kernel's config (quant.runtime.kernel_choice.search, from
# the rule's config, one axis at a time): what bench/gpu.py's sweep spans, plus the neighbours it left out.
GEMV_AXES = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps")
_SPLITS = (1, 2, 4, 8, 16, 32)


def _space(start: tuple[int, ...], axes: tuple[tuple[int, ...], ...]):
    """(start, axes), each axis holding the start's value too (a rule's split can exceed the axis's largest)."""
    return start, tuple(tuple(sorted({*vals, v})) for vals, v in zip(axes, start))


def w4_gemv_space(n: int, k: int, group_size: int, sms: int = H100_SMS):
    """(start, values per axis of GEMV_AXES) for the one-row W4A16 kernel: BLOCK_K a power of two from 32 that
    divides the group size (a tile lies in one group). BLOCK_N up to 512: at (512, 32) with 4 warps the warps split
    the columns, and the K loop has no barrier (bench/sass.py)."""
    bks = tuple(b for b in (32, 64, 128, 256) if b <= group_size and group_size % b == 0)
    return _space(w4_gemv_config(n, k, group_size, sms), ((32, 64, 128, 256, 512), bks, _SPLITS, (2, 4, 8)))


def int8_gemv_space(n: int, k: int, sms: int = H100_SMS):
    """(start, values per axis of GEMV_AXES) for the one-row int8 kernel."""
    return _space(int8_gemv_config(n, k, sms), ((16, 32, 64, 128), (64, 128, 256), _SPLITS, (2, 4, 8)))


ONE_BITS = 0x3F800000  # 1.0f: the one-row W4A16 kernel sets each code's bits in its mantissa
# A thread holds this many words of a tile, its next tile's and two fp32 sums per word: past 32 (at 32, 255
# registers on sm_90) the kernel spills, so the wrapper refuses such a launch and a device's search skips it.
GEMV_MAX_WORDS_PER_THREAD = 32


def w4_gemv_words_per_thread(config: tuple[int, int, int, int]) -> float:
    bn, bk, _, warps = config
    return bn * bk / 8 / (32 * warps)


# The one-row kernels' gated epilogue, by the glue op it stands for (server.layers.mlp): the kernels' GATED code.
GATED_ACTS = {"silu_mul": 1, "gelu_tanh_mul": 2}


def gated_fits(n: int, block_n: int) -> bool:
    """Whether a one-row launch of BLOCK_N columns can end in the gated epilogue over a [gate | up] projection of n
    outputs: each program takes BLOCK_N/2 columns of gate and the same of up, so they must tile the gate's."""
    return block_n >= 2 and n % 2 == 0 and (n // 2) % (block_n // 2) == 0


def _gemv_out(x: Tensor, n: int, bn: int, gated: str | None, name: str) -> tuple[Tensor, int, int]:
    """(y, GATED, INTER) of a one-row launch: y (1, N), or (1, N/2) holding act(gate) * up for ``gated``."""
    if gated is None:
        return x.new_empty(1, n), 0, 0
    if gated not in GATED_ACTS or not gated_fits(n, bn):
        raise ValueError(f"{name}: a gated epilogue needs an activation of {sorted(GATED_ACTS)} and BLOCK_N/2 "
                         f"dividing half of {n} columns; got {gated!r}, BLOCK_N {bn}")
    return x.new_empty(1, n // 2), GATED_ACTS[gated], n // 2


@dataclass(frozen=True)
class AddNorm:
    """What follows a one-row product y (o, down) in its own launch, the norm epilogue, in the glue's order and
    roundings (server/models/base.py's layer):

    1. y = rms_norm(y) * post[0]  the sub-layer's output norm (Gemma 2/3, OLMo 2), where ``post`` = (weight, eps);
    2. y = y * scale              the residual multiplier (Granite), where it is not 1;
    3. x = residual + y           the residual stream, returned;
    4. h = rms_norm(x) * weight   the next input norm, returned; h is x itself where ``weight`` is None (OLMo 2)."""
    residual: Tensor  # (1, N)
    weight: Tensor | None  # (N,)
    eps: float = 0.0
    post: tuple[Tensor, float] | None = None
    scale: float = 1.0

    def flags(self) -> int:
        """The kernels' NORM bits: 1 the add, 2 the next norm, 4 the output norm, 8 the multiplier."""
        return 1 | (2 if self.weight is not None else 0) | (4 if self.post is not None else 0) | \
            (8 if self.scale != 1.0 else 0)


def norm_weights_fit(n: int, dtype: torch.dtype, weight: Tensor | None, post: tuple[Tensor, float] | None) -> bool:
    """Whether a norm epilogue's weights (the next norm's and the output norm's, those given) are (n,) in ``dtype``."""
    return all(t.shape == (n,) and t.dtype == dtype for t in (weight, post and post[0]) if t is not None)


def _norm_args(x: Tensor, n: int, tiles: int, norm: AddNorm | None, gated: str | None, locks: Tensor, name: str):
    """(kernel arguments R, RO, NW, HO, PW, eps, post_eps, rscale, NORM, CHUNK, CHUNKS; the counters; the outputs
    (x + y, h) or None) of a one-row launch whose last tile runs the norm epilogue ``norm`` over the row."""
    if norm is None:
        return (x, x, x, x, x, 0.0, 0.0, 1.0, 0, 1, 1), locks, None
    res, w, post = norm.residual, norm.weight, norm.post
    if gated is not None or res.shape != (1, n) or not res.is_contiguous() or res.dtype != x.dtype \
            or not norm_weights_fit(n, x.dtype, w, post):
        raise ValueError(f"{name}: a norm epilogue takes a contiguous (1, {n}) residual and ({n},) norm weights in "
                         f"{x.dtype}, and no gated epilogue beside it")
    xo = torch.empty_like(res)
    h = xo if w is None else torch.empty_like(res)
    chunk = min(1024, 1 << max(0, (n - 1).bit_length()))
    args = (res, xo, x if w is None else w, h, x if post is None else post[0], float(norm.eps),
            0.0 if post is None else float(post[1]), float(norm.scale), norm.flags(), chunk, _cdiv(n, chunk))
    # the tiles' counters, then one more: the tiles written (the split counters are unused without a split)
    return args, split_counters(x.device, tiles + 1), (xo, h)


def w4_gemv(x: Tensor, qweight: Tensor, scales_zeros: Tensor, group_size: int,
            config: tuple[int, int, int, int] | None = None, zero_free: bool = False,
            gated: str | None = None, norm: AddNorm | None = None):
    """x (1, K) @ W^T -> (1, N) in x's dtype through the one-row kernel; ``config`` overrides
    :func:`w4_gemv_config` (a BLOCK_K that divides the group size, powers of two). ``zero_free``: the caller
    knows every zero of the table is 0 (a symmetric checkpoint), and the kernel skips them and the sums of x they
    need; wrong if any is not. ``gated`` ("silu_mul", "gelu_tanh_mul"): W is a [gate | up] projection and the
    result is act(gate) * up (1, N/2), from the same launch (see :func:`gated_fits`). ``norm``: the result is
    (x, h) of the norm epilogue :class:`AddNorm` (the glue's add_rms_norm, with the output norm and multiplier of
    the families that have them), from the same launch."""
    from quant.runtime.kernels.triton_kernels import w4_gemv_kernel

    k, n = qweight.shape[0] * 8, qweight.shape[1]
    bn, bk, split, warps = config or w4_gemv_config(n, k, group_size, multiprocessors(x.device))
    if x.shape != (1, k) or bk < 8 or group_size % bk or bn & (bn - 1) or bk & (bk - 1):
        raise ValueError(f"w4_gemv: x must be (1, {k}) and BLOCK_K a power of two dividing the group size "
                         f"{group_size}; got x {tuple(x.shape)}, config {(bn, bk, split, warps)}")
    if w4_gemv_words_per_thread((bn, bk, split, warps)) > GEMV_MAX_WORDS_PER_THREAD:
        raise ValueError(f"w4_gemv: a ({bk} x {bn}) tile over {warps} warps is more than "
                         f"{GEMV_MAX_WORDS_PER_THREAD} words per thread, which spill (bench/sass.py)")
    tiles = _cdiv(n, bn)
    y, code, inter = _gemv_out(x, n, bn, gated, "w4_gemv")
    ws, locks = split_workspace(x, split, 1, n, tiles)
    (*nargs, norm_on, chunk, chunks), locks, normed = _norm_args(x, n, tiles, norm, gated, locks, "w4_gemv")
    w4_gemv_kernel[(tiles, split)](x, qweight, scales_zeros, y, ws, locks, n, k, ONE_BITS, inter, *nargs,
                                    GS=group_size, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, HAS_ZERO=not zero_free,
                                    GATED=code, NORM=norm_on, CHUNK=chunk, CHUNKS=chunks, num_warps=warps)
    return y if normed is None else normed


def w4_reference(x: Tensor, qweight: Tensor, scales_zeros: Tensor, group_size: int) -> Tensor:
    """The plain PyTorch product the kernel is held to: W from the codes and table in fp32, x @ W^T in fp32."""
    from quant.runtime.kernels.dequant import int4_codes_reference
    from quant.runtime.kernels.int4_layout import unpack_rows

    w = int4_codes_reference(unpack_rows(qweight).t(), scales_zeros, group_size, None, torch.float32)  # (N, K)
    return (x.float() @ w.t()).to(x.dtype)


def int8_matmul(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor | None,
                gemv_config: tuple[int, int, int, int] | None = None, gated: str | None = None,
                norm: AddNorm | None = None):
    """x (M, K) contiguous; weight (N, K) int8; scale (N,) fp32; zero (N,) int8 or None -> (M, N) in x's dtype.
    One row (batch-1 decode) takes the GEMV kernel (launched with ``gemv_config``, else its rule's; ``gated`` and
    ``norm``: see :func:`w4_gemv`), more the tiled GEMM."""
    _one_row_only(x, gated, norm, "int8_matmul")
    if x.shape[0] == 1:
        return int8_gemv(x, weight, scale, zero, gemv_config, gated, norm)
    return int8_gemm(x, weight, scale, zero)


def int8_gemm(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor | None) -> Tensor:
    """The tiled int8 kernel (tl.dot on 16-bit tiles) at any row count."""
    n, k = weight.shape
    affine = zero is not None
    return _launch("int8_kernel", x, n, k, 64, weight, scale, zero if affine else scale, strides=(weight.stride(0),),
                   AFFINE=affine)


def int8_gemv_config(n: int, k: int, sms: int = H100_SMS) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps) of the one-row int8 kernel, over (BLOCK_N, BLOCK_K) int8 tiles of 8 KiB.
    (bench/gpu.py sweeps these on a GPU.)"""
    bn, bk = 64, 128
    return bn, bk, _gemv_split(_cdiv(n, bn), _cdiv(k, bk), sms), 4


def int8_gemv(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor | None,
              config: tuple[int, int, int, int] | None = None, gated: str | None = None,
              norm: AddNorm | None = None):
    """x (1, K) @ W^T through the one-row kernel; ``config`` overrides :func:`int8_gemv_config`; ``gated`` and
    ``norm`` as :func:`w4_gemv`'s."""
    from quant.runtime.kernels.triton_kernels import int8_gemv_kernel

    n, k = weight.shape
    bn, bk, split, warps = config or int8_gemv_config(n, k, multiprocessors(x.device))
    if x.shape != (1, k) or weight.stride(1) != 1 or bn & (bn - 1) or bk & (bk - 1):
        raise ValueError(f"int8_gemv: x must be (1, {k}), W's rows contiguous, tiles powers of two; got x "
                         f"{tuple(x.shape)}, config {(bn, bk, split, warps)}")
    tiles = _cdiv(n, bn)
    y, code, inter = _gemv_out(x, n, bn, gated, "int8_gemv")
    ws, locks = split_workspace(x, split, 1, n, tiles)
    (*nargs, norm_on, chunk, chunks), locks, normed = _norm_args(x, n, tiles, norm, gated, locks, "int8_gemv")
    affine = zero is not None
    int8_gemv_kernel[(tiles, split)](x, weight, scale, zero if affine else scale, y, ws, locks, n, k, weight.stride(0),
                                     inter, *nargs, AFFINE=affine, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, GATED=code,
                                     NORM=norm_on, CHUNK=chunk, CHUNKS=chunks, num_warps=warps)
    return y if normed is None else normed


def int8_reference(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor | None) -> Tensor:
    from quant.runtime.primitives import dequantize_weight

    return (x.float() @ dequantize_weight(weight, scale, zero, torch.float32).t()).to(x.dtype)
