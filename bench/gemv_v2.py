"""The one-row W4A16 kernel of sessions 21-22, never timed on a GPU before it was replaced, kept in the bench only so
that bench/gpu.py times it beside quant.triton_kernels.w4_gemv_kernel in the same run: codes turned into floats
through 2^23's mantissa and an add, x converted through shared memory at every K step (bench/sass.py: 7.5
instructions per weight on the 8B gate_up, 12 barriers per K step, against the new kernel's 5.2 and 4). It is
launched with the new kernel's rule, so the two differ in the kernel only. Imported on the GPU only."""

import triton
import triton.language as tl

from quant import triton_ops as T
from quant.triton_kernels import store_or_reduce


@triton.jit
def _kernel(X, QW, SZ, Y, WS, LOCKS, N, K, GS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            SPLIT_K: tl.constexpr):
    # One input row, so FMAs in registers and no tl.dot (whose operand staging through shared memory a 1-row product
    # cannot repay). A tile is (BLOCK_K / 8 words, BLOCK_N columns) within one group. Per weight: a shift, a mask,
    # an OR and an add turn the 4-bit code into the float (code - 8) exactly (the code in the mantissa of 2^23,
    # then 2^23 + 8 subtracted: no int-to-float conversion, which issues at a fraction of the FMA rate), then one
    # FMA with x. The sums stay per word row, (BLOCK_K / 8, BLOCK_N), until after the loop: nothing crosses
    # threads inside it. The next tile's words are loaded before this one is used, so two are in flight.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    j = tl.arange(0, 8)
    r = tl.arange(0, BLOCK_K // 8)
    acc = tl.zeros((BLOCK_K // 8, BLOCK_N), tl.float32)  # sum over the rows' words of s * x (code - 8)
    acc_z = tl.zeros((BLOCK_K // 8, BLOCK_N), tl.float32)  # and of z * x
    k0 = pid_k * BLOCK_K
    w_ok = (k0 // 8 + r < K // 8)[:, None] & n_ok[None, :]
    words = tl.load(QW + (k0 // 8 + r)[:, None] * N + rn[None, :], mask=w_ok, other=0)  # (BK/8, BN)
    for k in range(k0, K, BLOCK_K * SPLIT_K):
        rw = k // 8 + r
        kn = k + BLOCK_K * SPLIT_K  # the next tile's words, in flight while this one is used
        nxt = tl.load(QW + (kn // 8 + r)[:, None] * N + rn[None, :],
                      mask=(kn // 8 + r < K // 8)[:, None] & n_ok[None, :], other=0)
        x = tl.load(X + rw[:, None] * 8 + j[None, :], mask=(rw < K // 8)[:, None], other=0.0).to(tl.float32)
        q = (words[:, None, :] >> (j * 4)[None, :, None]) & 0xF  # (BK/8, 8, BN) codes
        f = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # 2^23 + q - (2^23 + 8) = q - 8, exact
        t = tl.sum(f * x[:, :, None], 1)  # (BK/8, BN): each word's 8 codes, in the thread holding the word
        g = k // GS
        s = tl.load(SZ + (g * N + rn) * 2, mask=n_ok, other=0.0).to(tl.float32)  # (BN,)
        z = tl.load(SZ + (g * N + rn) * 2 + 1, mask=n_ok, other=0.0).to(tl.float32)
        acc += t * s[None, :]
        acc_z += tl.sum(x, 1)[:, None] * z[None, :]
        words = nxt
    y = tl.sum(acc + acc_z, 0)  # (BN,)
    store_or_reduce(Y + rn, WS + rn, y, n_ok, LOCKS + pid_n, pid_k, N, SPLIT_K, 0)


def w4_gemv_v2(x, qweight, scales_zeros, group_size: int):
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    bn, bk, split, warps = T.w4_gemv_config(n, k, group_size, T.multiprocessors(x.device))
    tiles = -(-n // bn)
    y = x.new_empty(1, n)
    ws, locks = T.split_workspace(x, split, 1, n, tiles)
    _kernel[(tiles, split)](x, qweight, scales_zeros, y, ws, locks, n, k, GS=group_size, BLOCK_N=bn, BLOCK_K=bk,
                            SPLIT_K=split, num_warps=warps)
    return y
