"""The one-row W4A16 kernel as session 14 measured it (48.7 us on the 8B gate_up, tinygemm 33.7), kept in the bench
only, so that bench/gpu.py times it beside quant.triton_kernels.w4_gemv_kernel in the same run: codes converted
with int-to-float instructions, the tile reduced across threads at every K step, split K through fp32 atomics into
a zeroed buffer and a cast after (three launches). Imported on the GPU only (it imports triton)."""

import torch
import triton
import triton.language as tl

GEMV_TARGET_PROGRAMS = 528  # what session 14's rule aimed for (four programs per H100 multiprocessor)


@triton.jit
def _kernel(X, QW, SZ, Y, N, K, GS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            SPLIT_K: tl.constexpr):
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
        t = tl.sum(tl.sum(codes * x[:, :, None], 1), 0)  # (BN,)
        g = k0 // GS
        s = tl.load(SZ + (g * N + rn) * 2, mask=n_ok, other=0.0).to(tl.float32)
        z = tl.load(SZ + (g * N + rn) * 2 + 1, mask=n_ok, other=0.0).to(tl.float32)
        acc += s * t + z * tl.sum(tl.sum(x, 1), 0)
    if SPLIT_K == 1:
        tl.store(Y + rn, acc.to(Y.dtype.element_ty), mask=n_ok)
    else:
        tl.atomic_add(Y + rn, acc, mask=n_ok)


def w4_gemv_v1(x, qweight, scales_zeros, group_size: int):
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    bn, bk = 128, min(group_size, 256)
    tiles, steps = -(-n // bn), -(-k // bk)
    split = 1
    while tiles * split * 2 <= GEMV_TARGET_PROGRAMS and steps >= split * 2 * 2:
        split *= 2
    y = torch.zeros(1, n, dtype=torch.float32, device=x.device) if split > 1 else x.new_empty(1, n)
    _kernel[(tiles, split)](x, qweight, scales_zeros, y, n, k, GS=group_size, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                            num_warps=4)
    return y.to(x.dtype) if split > 1 else y
