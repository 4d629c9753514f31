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

Both use fp32 accumulation and split K across programs (fp32 atomics into a zeroed buffer) when the (M, N) tiles
alone would leave most of the GPU idle: the decode shapes (M <= 16).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - machines without triton use the dequantize paths
    triton = None


def available() -> str | None:
    """None when the kernels can run here, else why not."""
    return None if triton is not None else "triton is not installed"


# The split-K rule aims for this many programs on a decode-shaped product (an H100 has 132 multiprocessors).
TARGET_PROGRAMS = 264
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


def _config(m: int, n: int, k: int, bk: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, SPLIT_K, num_warps, num_stages) for an (m x k) @ (k x n) product (no autotuning: it
    does not run under the interpreter, and a fixed rule keeps the first call's latency flat)."""
    bm = 16 if m <= 16 else (32 if m <= 32 else (64 if m <= 64 else 128))
    bn = 64 if m <= 64 else 128
    tiles = -(-m // bm) * -(-n // bn)
    split = 1
    if m <= 64:
        steps = -(-k // bk)
        while tiles * split * 2 <= TARGET_PROGRAMS and steps >= split * 2 * 4:  # >= 4 K tiles per program
            split *= 2
    return bm, bn, split, (4 if m <= 64 else 8), 3


if triton is not None:

    @triton.jit
    def _w4_kernel(X, QW, SZ, Y, M, N, K, stride_xm, stride_ym,
                   GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        shifts = tl.arange(0, 8) * 4
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :],
                        other=0.0)  # (BM, BK)
            rw = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # each word once: (BK/8, BN), unpacked in registers
            words = tl.load(QW + rw[:, None] * N + rn[None, :], mask=(rw < K // 8)[:, None] & n_ok[None, :],
                            other=0)
            codes = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # (BK/8, 8, BN): k = 8 * word + j
            if GS >= BLOCK_K:  # the tile lies in one group: one scale/zero row
                g = k0 // GS
                s = tl.load(SZ + (g * N + rn) * 2, mask=n_ok, other=0.0).to(tl.float32)  # (BN,)
                z = tl.load(SZ + (g * N + rn) * 2 + 1, mask=n_ok, other=0.0).to(tl.float32)
                w = (tl.reshape(codes, (BLOCK_K, BLOCK_N)) - 8).to(tl.float32) * s[None, :] + z[None, :]
            else:  # BLOCK_K / GS groups: (groups, GS, BN) against (groups, 1, BN)
                rg = k0 // GS + tl.arange(0, BLOCK_K // GS)
                at = (rg[:, None] * N + rn[None, :]) * 2
                g_ok = (rg < K // GS)[:, None] & n_ok[None, :]
                s = tl.load(SZ + at, mask=g_ok, other=0.0).to(tl.float32)  # (BK/GS, BN)
                z = tl.load(SZ + at + 1, mask=g_ok, other=0.0).to(tl.float32)
                c3 = tl.reshape(codes, (BLOCK_K // GS, GS, BLOCK_N))
                w = tl.reshape((c3 - 8).to(tl.float32) * s[:, None, :] + z[:, None, :], (BLOCK_K, BLOCK_N))
            acc += tl.dot(x, w.to(x.dtype))
        if SPLIT_K == 1:
            tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
                     mask=m_ok[:, None] & n_ok[None, :])
        else:
            tl.atomic_add(Y + rm[:, None] * stride_ym + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _w4_gemv_kernel(X, QW, SZ, Y, N, K, GS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr):
        # One input row: FMAs and reductions in registers, no tl.dot (whose operand staging through shared memory
        # a 1-row product cannot repay). BLOCK_K lies within one group.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        j = tl.arange(0, 8)
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            rw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            w_ok = rw < K // 8
            words = tl.load(QW + rw[:, None] * N + rn[None, :], mask=w_ok[:, None] & n_ok[None, :], other=0)
            codes = ((words[:, None, :] >> (j * 4)[None, :, None]) & 0xF).to(tl.float32) - 8.0  # (BK/8, 8, BN)
            x = tl.load(X + rw[:, None] * 8 + j[None, :], mask=w_ok[:, None], other=0.0).to(tl.float32)  # (BK/8, 8)
            t = tl.sum(tl.sum(codes * x[:, :, None], 1), 0)  # (BN,) sum_k x_k (code_k - 8)
            g = k0 // GS
            s = tl.load(SZ + (g * N + rn) * 2, mask=n_ok, other=0.0).to(tl.float32)
            z = tl.load(SZ + (g * N + rn) * 2 + 1, mask=n_ok, other=0.0).to(tl.float32)
            acc += s * t + z * tl.sum(tl.sum(x, 1), 0)
        if SPLIT_K == 1:
            tl.store(Y + rn, acc.to(Y.dtype.element_ty), mask=n_ok)
        else:
            tl.atomic_add(Y + rn, acc, mask=n_ok)

    @triton.jit
    def _int8_kernel(X, W, S, ZP, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                     AFFINE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        xsum = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(W + rn[None, :] * stride_wn + rk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
            acc += tl.dot(x, w.to(x.dtype))  # int8 values are exact in 16 bits
            if AFFINE:
                xsum += tl.sum(x.to(tl.float32), 1)
        s = tl.load(S + rn, mask=n_ok, other=0.0)  # (BN,) fp32
        y = acc * s[None, :]
        if AFFINE:
            zp = tl.load(ZP + rn, mask=n_ok, other=0).to(tl.float32)
            y -= xsum[:, None] * (s * zp)[None, :]
        if SPLIT_K == 1:
            tl.store(Y + rm[:, None] * stride_ym + rn[None, :], y.to(Y.dtype.element_ty),
                     mask=m_ok[:, None] & n_ok[None, :])
        else:
            tl.atomic_add(Y + rm[:, None] * stride_ym + rn[None, :], y, mask=m_ok[:, None] & n_ok[None, :])


    @triton.jit
    def _w4_dequant_kernel(QW, SZ, WT, N, K, GS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        rk = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = (rk < K)[:, None] & (rn < N)[None, :]
        rw = tl.program_id(0) * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        words = tl.load(QW + rw[:, None] * N + rn[None, :], mask=(rw < K // 8)[:, None] & (rn < N)[None, :],
                        other=0)  # (BK/8, BN): each word once
        codes = tl.reshape((words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        at = ((rk // GS)[:, None] * N + rn[None, :]) * 2
        s = tl.load(SZ + at, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(SZ + at + 1, mask=ok, other=0.0).to(tl.float32)
        w = (codes - 8).to(tl.float32) * s + z
        tl.store(WT + rk[:, None] * N + rn[None, :], w.to(WT.dtype.element_ty), mask=ok)


def _launch(kernel, x: Tensor, n: int, k: int, bk: int, *args, **consts) -> Tensor:
    m = x.shape[0]
    bm, bn, split, warps, stages = _config(m, n, k, bk)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    y = torch.zeros(m, n, dtype=torch.float32, device=x.device) if split > 1 else x.new_empty(m, n)
    kernel[grid](x, *args, y, m, n, k, x.stride(0), *consts.pop("strides", ()), y.stride(0),
                 **consts, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)
    return y.to(x.dtype) if split > 1 else y


def w4_dequant(qweight: Tensor, scales_zeros: Tensor, group_size: int, dtype: torch.dtype) -> Tensor:
    """W^T (K, N) in ``dtype`` from the GPTQ words and the scale/zero table, in one pass (the prefill path's
    weight for cuBLAS; K-major so that the stores follow the words' layout)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    wt = torch.empty(k, n, dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(k, 64), triton.cdiv(n, 128))
    _w4_dequant_kernel[grid](qweight, scales_zeros, wt, n, k, GS=group_size, BLOCK_K=64, BLOCK_N=128)
    return wt


def w4_matmul(x: Tensor, qweight: Tensor, scales_zeros: Tensor, group_size: int) -> Tensor:
    """x (M, K) 16-bit or fp32, contiguous; qweight (K/8, N) int32; scales_zeros (G, N, 2) -> (M, N) in x's dtype.
    One row (batch-1 decode) takes the GEMV kernel, more the tiled GEMM."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    bk = w4_block_k(group_size, x.shape[0])
    if bk is None or x.shape[1] != k:
        raise ValueError(f"w4_matmul: group size {group_size} has no K tile, or x has {x.shape[1]} columns, not {k}")
    if x.shape[0] == 1:
        return _w4_gemv(x, qweight, scales_zeros, group_size, n, k)
    return _launch(_w4_kernel, x, n, k, bk, qweight, scales_zeros, GS=group_size)


GEMV_TARGET_PROGRAMS = 528  # four per multiprocessor of an H100: enough weight bytes in flight for its bandwidth


def _w4_gemv(x: Tensor, qweight: Tensor, scales_zeros: Tensor, group_size: int, n: int, k: int) -> Tensor:
    bn, bk = 128, min(group_size, 256)
    tiles, steps = triton.cdiv(n, bn), triton.cdiv(k, bk)
    split = 1
    while tiles * split * 2 <= GEMV_TARGET_PROGRAMS and steps >= split * 2 * 2:  # >= 2 K tiles per program
        split *= 2
    y = torch.zeros(1, n, dtype=torch.float32, device=x.device) if split > 1 else x.new_empty(1, n)
    _w4_gemv_kernel[(tiles, split)](x, qweight, scales_zeros, y, n, k, GS=group_size, BLOCK_N=bn, BLOCK_K=bk,
                                    SPLIT_K=split, num_warps=4)
    return y.to(x.dtype) if split > 1 else y


def w4_reference(x: Tensor, qweight: Tensor, scales_zeros: Tensor, group_size: int) -> Tensor:
    """The plain PyTorch product the kernel is held to: W from the codes and table in fp32, x @ W^T in fp32."""
    from quant.dequant import int4_codes_reference
    from quant.int4 import unpack_rows

    w = int4_codes_reference(unpack_rows(qweight).t(), scales_zeros, group_size, None, torch.float32)  # (N, K)
    return (x.float() @ w.t()).to(x.dtype)


def int8_matmul(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor | None) -> Tensor:
    """x (M, K) contiguous; weight (N, K) int8; scale (N,) fp32; zero (N,) int8 or None -> (M, N) in x's dtype."""
    n, k = weight.shape
    affine = zero is not None
    return _launch(_int8_kernel, x, n, k, 64, weight, scale, zero if affine else scale, strides=(weight.stride(0),),
                   AFFINE=affine)


def int8_reference(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor | None) -> Tensor:
    from quant.primitives import dequantize_weight

    return (x.float() @ dequantize_weight(weight, scale, zero, torch.float32).t()).to(x.dtype)
