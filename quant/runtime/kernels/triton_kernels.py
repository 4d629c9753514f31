"""The Triton kernels of quant.runtime.kernels.triton_ops (imported on first use: importing triton costs ~50 MiB of RSS, which a
CPU server that never runs them should not pay). The wrappers, launch rules and references are in
quant/runtime/kernels/triton_ops.py."""

import triton
import triton.language as tl


@triton.jit
def tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output tile: row and column indices and their in-range masks."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm, rn, rm < M, rn < N


@triton.jit
def gated_act(g, GELU: tl.constexpr):
    """act(g) in fp32 for a gated MLP (server/glue_triton.py's act_mul and the one-row products' gated epilogue):
    SiLU, or GELU with the tanh approximation computed as x sigmoid(2u) (the same function as 0.5 x (1 + tanh u),
    without its cancellation for negative x)."""
    if GELU:
        return g / (1.0 + tl.exp(-1.5957691216057308 * (g + 0.044715 * g * g * g)))
    return g / (1.0 + tl.exp(-g))


@triton.jit
def finish(Yt, y, mask, GATED: tl.constexpr):
    """A program's summed tile into Y. GATED (1: SiLU, 2: GELU-tanh; one-row products of a [gate | up] projection):
    y holds BN/2 gate columns then their BN/2 up columns, and Yt points at the BN/2 outputs act(gate) * up, each
    operand rounded to Y's dtype as if the projection's output were stored and the glue's act_mul read it."""
    dt = Yt.dtype.element_ty
    if GATED:
        gate, up = tl.split(tl.permute(tl.reshape(y, (2, y.shape[0] // 2)), (1, 0)))  # (BN/2,) each
        a = gated_act(gate.to(dt).to(tl.float32), GATED == 2).to(dt).to(tl.float32)
        tl.store(Yt, (a * up.to(dt).to(tl.float32)).to(dt))
    else:
        tl.store(Yt, y.to(dt), mask=mask)


@triton.jit
def arrived_last(counter, arrivals):
    """Whether this program is the last of ``arrivals`` to reach ``counter`` (zero between launches), after every
    thread of it has stored what it made: the one rule by which a program acts on others' results in one launch (the
    split products' reduce, the norm epilogue, the attention's merge). The last reads those results from L2 (".cg"),
    never a stale line of its SM's L1, then calls ``rearm``."""
    tl.debug_barrier()  # every thread's stores happen before the count (release, gpu scope)
    return tl.atomic_add(counter, 1) == arrivals - 1  # acq_rel: the others' stores are visible to the last


@triton.jit
def rearm(counter):
    """The last arrival re-arms the counter for the next launch (launches on a stream run one after another)."""
    tl.atomic_xchg(counter, 0)


@triton.jit
def inv_rms(sum_sq, n, eps):
    """1 / rms from a row's fp32 sum of squares over its n elements: the RMSNorm of the glue (server/glue_triton.py),
    of the attention's q/k head norms and of the one-row products' norm epilogue, one expression for all three."""
    return 1.0 / tl.sqrt(sum_sq / n + eps)


@triton.jit
def rms_normed(x, inv, w):
    """w * (x * inv rounded to x's dtype), in fp32 for the caller to round: the eager ref_rms_norm's roundings."""
    return w.to(tl.float32) * (x.to(tl.float32) * inv).to(x.dtype).to(tl.float32)


@triton.jit
def store_or_reduce(Yt, Wt, acc, mask, LOCK, split, plane, SPLIT_K: tl.constexpr, GATED: tl.constexpr):
    """A program's result tile into Y (``finish``, which says what GATED does). Yt, Wt: the tile's pointers in Y and
    in split 0's plane of the fp32 workspace (SPLIT_K, ...) of ``plane`` elements per split; this program computed
    split ``split`` of K; LOCK: the tile's counter (zero between products).

    With K split across programs, each stores its fp32 partial tile; the last of the tile's programs to finish
    (the counter says which) sums the partials in split order and writes Y in its dtype, then re-arms the counter.
    So a split product is one kernel: no zeroed fp32 output before it, no cast after it (two more launches per
    Linear at decode shapes, each a couple of microseconds of a CUDA graph's replay), and its sums do not depend on
    which program finished first, as fp32 atomics' do."""
    wrote = 1  # whether this program wrote the tile's result (returned)
    if SPLIT_K == 1:
        finish(Yt, acc, mask, GATED)
    else:
        tl.store(Wt + split * plane, acc, mask=mask)
        wrote = arrived_last(LOCK, SPLIT_K)
        if wrote:
            total = tl.zeros_like(acc)
            for i in tl.static_range(SPLIT_K):
                total += tl.load(Wt + i * plane, mask=mask, other=0.0, cache_modifier=".cg")
            finish(Yt, total, mask, GATED)
            rearm(LOCK)
    return wrote


@triton.jit
def add_rms_norm_row(Y, X, XO, W, H, PW, N, eps, post_eps, scale, NORM: tl.constexpr, CHUNK: tl.constexpr,
                     CHUNKS: tl.constexpr):
    """The norm epilogue's work on the product's whole row y (Y, read from L2: other programs wrote it), in the glue's
    order and roundings (server/models/base.py's layer; NORM's bits, quant.runtime.kernels.triton_ops.AddNorm, say which steps run):
    1. (NORM & 4) y = the sub-layer's output RMSNorm of y (weight PW, post_eps: Gemma 2/3, OLMo 2), rounded;
    2. (NORM & 8) y = y * scale, rounded (Granite's residual multiplier);
    3. XO = X + y, rounded once (the residual stream);
    4. (NORM & 2) H = the next input RMSNorm of XO (weight W, eps), as server/glue_triton.py's add_rms_norm.
    Each sum of squares runs in CHUNK lanes over the CHUNKS chunks (unrolled: the product's K loop stays the
    kernel's only loop), then across the lanes (one chunk when N <= CHUNK: the glue kernel's own sum)."""
    c = tl.arange(0, CHUNK)
    inv_y = 1.0
    if NORM & 4:  # the output norm needs its row's sum of squares before any element of it
        sy = tl.zeros((CHUNK,), tl.float32)
        for i in tl.static_range(CHUNKS):
            y = tl.load(Y + i * CHUNK + c, mask=i * CHUNK + c < N, other=0.0, cache_modifier=".cg").to(tl.float32)
            sy += y * y
        inv_y = inv_rms(tl.sum(sy, axis=0), N, post_eps)
    ss = tl.zeros((CHUNK,), tl.float32)
    for i in tl.static_range(CHUNKS):
        s = i * CHUNK
        ok = s + c < N
        x = tl.load(X + s + c, mask=ok, other=0.0)
        y = tl.load(Y + s + c, mask=ok, other=0.0, cache_modifier=".cg")
        if NORM & 4:
            y = rms_normed(y, inv_y, tl.load(PW + s + c, mask=ok, other=0.0)).to(y.dtype)
        if NORM & 8:
            y = (y.to(tl.float32) * scale).to(y.dtype)
        xn = (x.to(tl.float32) + y.to(tl.float32)).to(x.dtype)
        tl.store(XO + s + c, xn, mask=ok)
        ss += xn.to(tl.float32) * xn.to(tl.float32)
    if NORM & 2:
        inv = inv_rms(tl.sum(ss, axis=0), N, eps)
        tl.debug_barrier()  # (each thread reads back what it stored: the same layout)
        for i in tl.static_range(CHUNKS):
            s = i * CHUNK
            ok = s + c < N
            xn = tl.load(XO + s + c, mask=ok, other=0.0)
            w = tl.load(W + s + c, mask=ok, other=0.0)
            tl.store(H + s + c, rms_normed(xn, inv, w).to(H.dtype.element_ty), mask=ok)


@triton.jit
def add_norm_when_last(wrote, DONE, Y, X, XO, W, H, PW, N, eps, post_eps, scale, NORM: tl.constexpr,
                       CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """NORM (one-row products that a residual add and norms follow: o and down): the program that writes the
    product's last tile (DONE counts the tiles written; zero between launches) runs ``add_rms_norm_row`` over the
    whole row, so the norms are no launches of their own."""
    if wrote:
        if arrived_last(DONE, tl.num_programs(0)):  # every tile is written
            add_rms_norm_row(Y, X, XO, W, H, PW, N, eps, post_eps, scale, NORM, CHUNK, CHUNKS)
            rearm(DONE)


@triton.jit
def gemv_columns(N, INTER, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """A one-row program's weight columns and where its outputs go: (rn, n_ok, out). Plain: BN consecutive columns,
    written where they are. GATED (a [gate | up] projection of N = 2 INTER, INTER a multiple of BN/2): BN/2 gate
    columns and the same BN/2 of up, whose BN/2 outputs act(gate) * up go to out; each half is contiguous and
    starts at a multiple of BN/2, which the hints tell the compiler (its loads stay vectorized)."""
    c = tl.arange(0, BLOCK_N)
    if GATED:
        col = tl.program_id(0) * (BLOCK_N // 2) + c % (BLOCK_N // 2)
        rn = tl.max_contiguous(tl.multiple_of(tl.where(c < BLOCK_N // 2, col, INTER + col), BLOCK_N // 2),
                               BLOCK_N // 2)
        out = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        rn = tl.program_id(0) * BLOCK_N + c
        out = rn
    return rn, rn < N, out


@triton.jit
def write(Y, WS, LOCKS, acc, rm, rn, m_ok, n_ok, M, N, stride_ym, SPLIT_K: tl.constexpr):
    """An (M, N) product's tile into Y (see store_or_reduce); the tiles' counters are LOCKS[pid_m * tiles_n + pid_n]."""
    lock = LOCKS + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    store_or_reduce(Y + rm[:, None] * stride_ym + rn[None, :], WS + rm[:, None] * N + rn[None, :], acc,
                    m_ok[:, None] & n_ok[None, :], lock, tl.program_id(2), M * N, SPLIT_K, 0)


@triton.jit
def code_plane(words, P: tl.constexpr, CODE_BITS: tl.constexpr, CODE_BIAS: tl.constexpr, dtype: tl.constexpr):
    """q - 8 in the 16-bit ``dtype``, exact, for the codes q at bits P..P+3 of ``words``: the code set into the
    mantissa of 2^7 (bf16) or 2^10 (fp16), whose unit is 1, gives 2^7 + q or 2^10 + q; one packed 16-bit subtraction
    (two codes per instruction) takes the bias 2^7 + 8 or 2^10 + 8 off. No int-to-float conversion."""
    bits = ((words >> P) & 0xF) | CODE_BITS
    return (bits.to(tl.int16).to(dtype, bitcast=True) - CODE_BIAS).to(dtype)


@triton.jit
def w4_planes(xt, words, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, CODE_BITS: tl.constexpr,
              CODE_BIAS: tl.constexpr):
    """(BN, BM) fp32: sum_k (q[k, n] - 8) x[m, k] over a tile of codes in one group, as eight products of K = BK/8,
    one per code position j of the words (k = 8 * word + j). words (BN, BK/8); xt (BK, BM), split into its eight
    row planes in registers. Each plane of codes is the first operand of its product, made as it is unpacked: the
    tensor cores take that operand from registers (mma.sync; Hopper's wgmma too), so no code goes through shared
    memory, where a (BK, BN) tile of whole weights as the second operand went one 16-bit store per weight."""
    x5 = tl.reshape(xt, (BLOCK_K // 8, 2, 2, 2, BLOCK_M))  # k = 8 w + 4 a + 2 b + c
    x5 = tl.permute(x5, (0, 4, 1, 2, 3))  # (BK/8, BM, a, b, c): tl.split takes the last axis
    c0, c1 = tl.split(x5)
    c00, c01 = tl.split(c0)
    c10, c11 = tl.split(c1)
    x0, x4 = tl.split(c00)  # (BK/8, BM): rows 8 w + j of x^T
    x2, x6 = tl.split(c01)
    x1, x5 = tl.split(c10)
    x3, x7 = tl.split(c11)
    dt: tl.constexpr = xt.dtype
    part = tl.dot(code_plane(words, 0, CODE_BITS, CODE_BIAS, dt), x0)  # (BN, BM)
    part = tl.dot(code_plane(words, 4, CODE_BITS, CODE_BIAS, dt), x1, part)
    part = tl.dot(code_plane(words, 8, CODE_BITS, CODE_BIAS, dt), x2, part)
    part = tl.dot(code_plane(words, 12, CODE_BITS, CODE_BIAS, dt), x3, part)
    part = tl.dot(code_plane(words, 16, CODE_BITS, CODE_BIAS, dt), x4, part)
    part = tl.dot(code_plane(words, 20, CODE_BITS, CODE_BIAS, dt), x5, part)
    part = tl.dot(code_plane(words, 24, CODE_BITS, CODE_BIAS, dt), x6, part)
    return tl.dot(code_plane(words, 28, CODE_BITS, CODE_BIAS, dt), x7, part)


@triton.jit
def w4_planes_kernel(X, QW, SZ, Y, WS, LOCKS, M, N, K, stride_xm, stride_ym,
                     GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, HAS_ZERO: tl.constexpr, CODE_BITS: tl.constexpr,
                     CODE_BIAS: tl.constexpr):
    """x (M, K) @ W^T for a few rows of 16-bit x, BK = 128 in one group, computed transposed: per K tile the
    group's scale times the codes' sums (w4_planes), plus its zero times x's column sums (skipped when not
    HAS_ZERO, a symmetric table)."""
    pid_k = tl.program_id(2)
    rm, rn, m_ok, n_ok = tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(X + rm[None, :] * stride_xm + rk[:, None], mask=m_ok[None, :] & (rk < K)[:, None],
                     other=0.0)  # (BK, BM)
        rw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(QW + rw[None, :] * N + rn[:, None], mask=(rw < K // 8)[None, :] & n_ok[:, None],
                        other=0)  # (BN, BK/8)
        g = k0 // GS
        s = tl.load(SZ + (g * N + rn) * 2, mask=n_ok, other=0.0).to(tl.float32)  # (BN,)
        acc += w4_planes(xt, words, BLOCK_M, BLOCK_K, CODE_BITS, CODE_BIAS) * s[:, None]
        if HAS_ZERO:
            z = tl.load(SZ + (g * N + rn) * 2 + 1, mask=n_ok, other=0.0).to(tl.float32)
            acc += z[:, None] * tl.sum(xt.to(tl.float32), axis=0)[None, :]
    write(Y, WS, LOCKS, tl.trans(acc), rm, rn, m_ok, n_ok, M, N, stride_ym, SPLIT_K)


@triton.jit
def w4_kernel(X, QW, SZ, Y, WS, LOCKS, M, N, K, stride_xm, stride_ym,
              GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              SPLIT_K: tl.constexpr):
    """x (M, K) @ W^T, each weight of a (BK, BN) tile dequantized whole (any group size, fp32 x, and the row counts
    w4_planes_kernel does not take)."""
    pid_k = tl.program_id(2)
    rm, rn, m_ok, n_ok = tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :],
                    other=0.0)  # (BM, BK)
        rw = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # each word once: (BK/8, BN), unpacked in registers
        words = tl.load(QW + rw[:, None] * N + rn[None, :], mask=(rw < K // 8)[:, None] & n_ok[None, :],
                        other=0)
        codes = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF  # (BK/8, 8, BN): k = 8 w + j
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
    write(Y, WS, LOCKS, acc, rm, rn, m_ok, n_ok, M, N, stride_ym, SPLIT_K)

@triton.jit
def code_minus_8(words, P: tl.constexpr, ONE):
    """q - 8, exact, for the 4-bit codes q at bits P..P+3 of ``words`` (P <= 19): one LOP3 sets them into the
    mantissa of 1.0 (ONE holds its bits), f = 1 + q 2^(P-23); one FMA gives f 2^(23-P) - (2^(23-P) + 8)."""
    f = ((words & (15 << P)) | ONE).to(tl.float32, bitcast=True)
    return f * float(1 << (23 - P)) - float((1 << (23 - P)) + 8)


@triton.jit
def w4_gemv_kernel(X, QW, SZ, Y, WS, LOCKS, N, K, ONE, INTER, R, RO, NW, HO, PW, eps, post_eps, rscale,
                   GS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   HAS_ZERO: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr, CHUNK: tl.constexpr,
                   CHUNKS: tl.constexpr):
    # One input row, so FMAs in registers and no tl.dot (whose operand staging through shared memory a 1-row product
    # cannot repay). A tile is (BLOCK_K / 8 words, BLOCK_N columns) within one group, and every operation of the K
    # loop stays in the words' own layout: nothing crosses threads inside it but the scales' broadcast.
    #
    # A weight costs three instructions: one LOP3 puts its 4-bit code q, where it lies in the word (bits p..p+3:
    # p = 4j for codes j = 0..4, p = 4j - 12 for codes 5..7 of the word shifted right by 12, one shift for three),
    # into the mantissa of 1.0: f = 1 + q 2^(p-23), exact. ONE holds 1.0's bits: passed at run time, it stays in a
    # register and the mask-and-set is one instruction (as two immediates it is two). Then one FMA gives
    # f 2^(23-p) - (2^(23-p) + 8) = q - 8, exact (a power of two times f, then integers below 2^24), and one FMA
    # adds (q - 8) x to the tile's sum. The zero-points need sum(x): one add per x value, which a thread shares
    # across its columns, as it does each x's load and conversion; a symmetric checkpoint's table has none
    # (HAS_ZERO false: z = s (8 - 8) = 0 throughout, known at load). (The kernel this replaces spent ~7.5
    # instructions per weight, bench/sass.py.) The next tile's words are loaded before this one is used.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn, n_ok, out = gemv_columns(N, INTER, BLOCK_N, GATED)
    r = tl.arange(0, BLOCK_K // 8)
    acc = tl.zeros((BLOCK_K // 8, BLOCK_N), tl.float32)  # per (word row, column): sum of s (q - 8) x + z x
    k0 = pid_k * BLOCK_K
    w_ok = (k0 // 8 + r < K // 8)[:, None] & n_ok[None, :]
    words = tl.load(QW + (k0 // 8 + r)[:, None] * N + rn[None, :], mask=w_ok, other=0)  # (BK/8, BN)
    for k in range(k0, K, BLOCK_K * SPLIT_K):
        kn = k + BLOCK_K * SPLIT_K  # the next tile's words, in flight while this one is used
        nxt = tl.load(QW + (kn // 8 + r)[:, None] * N + rn[None, :],
                      mask=(kn // 8 + r < K // 8)[:, None] & n_ok[None, :], other=0)
        r_ok = k // 8 + r < K // 8
        t = tl.zeros((BLOCK_K // 8, BLOCK_N), tl.float32)  # this tile's sum of (q - 8) x
        xs = tl.zeros((BLOCK_K // 8,), tl.float32)  # and of x, per word row
        hi = words >> 12  # codes 5..7 at bits 8..19
        for j in tl.static_range(8):
            xj = tl.load(X + k + r * 8 + j, mask=r_ok, other=0.0).to(tl.float32)  # (BK/8,): x of code j
            if j < 5:
                t += code_minus_8(words, 4 * j, ONE) * xj[:, None]  # (BK/8, BN)
            else:
                t += code_minus_8(hi, 4 * j - 12, ONE) * xj[:, None]
            if HAS_ZERO:
                xs += xj
        g = k // GS
        s = tl.load(SZ + (g * N + rn) * 2, mask=n_ok, other=0.0).to(tl.float32)  # (BN,)
        acc += t * s[None, :]
        if HAS_ZERO:
            z = tl.load(SZ + (g * N + rn) * 2 + 1, mask=n_ok, other=0.0).to(tl.float32)
            acc += xs[:, None] * z[None, :]
        words = nxt
    y = tl.sum(acc, 0)  # (BN,)
    wrote = store_or_reduce(Y + out, WS + rn, y, n_ok, LOCKS + pid_n, pid_k, N, SPLIT_K, GATED)
    if NORM:  # R, RO, HO (1, N): the residual in and out, the normed row; NW, PW the next and the output norm's weights
        add_norm_when_last(wrote, LOCKS + tl.num_programs(0), Y, R, RO, NW, HO, PW, N, eps, post_eps, rscale, NORM,
                           CHUNK, CHUNKS)


@triton.jit
def int8_gemv_kernel(X, W, S, ZP, Y, WS, LOCKS, N, K, stride_wn, INTER, R, RO, NW, HO, PW, eps, post_eps, rscale,
                     AFFINE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                     GATED: tl.constexpr, NORM: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    # One input row against W (N, K) int8, rows of W contiguous along K. Per weight: its sign-extended value + 128 in
    # the mantissa of 2^23, then 2^23 + 128 subtracted (exact; no int-to-float conversion), and one FMA with x. The
    # products stay in a (BLOCK_N, BLOCK_K) accumulator until after the K loop; the next tile is loaded ahead.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn, n_ok, out = gemv_columns(N, INTER, BLOCK_N, GATED)
    c = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    xs = tl.zeros((BLOCK_K,), tl.float32)  # sum of x over this program's K range, for the zero-points
    k0 = pid_k * BLOCK_K
    w = tl.load(W + rn[:, None] * stride_wn + (k0 + c)[None, :], mask=n_ok[:, None] & (k0 + c < K)[None, :], other=0)
    for k in range(k0, K, BLOCK_K * SPLIT_K):
        kn = k + BLOCK_K * SPLIT_K
        nxt = tl.load(W + rn[:, None] * stride_wn + (kn + c)[None, :], mask=n_ok[:, None] & (kn + c < K)[None, :],
                      other=0)
        x = tl.load(X + k + c, mask=k + c < K, other=0.0).to(tl.float32)  # (BK,)
        f = ((w.to(tl.int32) + 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0  # exact int8 value
        acc += f * x[None, :]
        if AFFINE:
            xs += x
        w = nxt
    s = tl.load(S + rn, mask=n_ok, other=0.0)  # (BN,) fp32
    y = tl.sum(acc, 1) * s
    if AFFINE:
        zp = tl.load(ZP + rn, mask=n_ok, other=0).to(tl.float32)
        y -= tl.sum(xs, 0) * (s * zp)
    wrote = store_or_reduce(Y + out, WS + rn, y, n_ok, LOCKS + pid_n, pid_k, N, SPLIT_K, GATED)
    if NORM:  # as w4_gemv_kernel's
        add_norm_when_last(wrote, LOCKS + tl.num_programs(0), Y, R, RO, NW, HO, PW, N, eps, post_eps, rscale, NORM,
                           CHUNK, CHUNKS)


@triton.jit
def int8_kernel(X, W, S, ZP, Y, WS, LOCKS, M, N, K, stride_xm, stride_wn, stride_ym,
                AFFINE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT_K: tl.constexpr):
    pid_k = tl.program_id(2)
    rm, rn, m_ok, n_ok = tile(M, N, BLOCK_M, BLOCK_N)
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
    write(Y, WS, LOCKS, y, rm, rn, m_ok, n_ok, M, N, stride_ym, SPLIT_K)


@triton.jit
def w4_dequant_kernel(QW, SZ, WT, N, K, GS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
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
