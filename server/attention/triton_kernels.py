"""The Triton kernels of the ``triton`` attention backend (server/attention/triton_paged.py, which says what they
compute), imported on the backend's first launch: importing triton costs ~50 MiB of RSS, which a CPU server
should not pay."""

import triton
import triton.language as tl

from quant.runtime.kernels.triton_kernels import (  # shared with the products' epilogues
    arrived_last,
    inv_rms,
    rearm,
    rms_normed,
)


@triton.jit
def tanh_exp(x):
    # tanh through exp (libdevice's tanh does not run in the interpreter): 1 - 2 / (e^2x + 1)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

@triton.jit
def rotate(x, xp, c, sn):
    """x's rotated dims from x, the dims they pair with (xp), cos and the signed sin (-sin on the first half), each
    product and the sum rounded to x's dtype, as the glue's rope_ (server/glue_triton.py) rounds them."""
    dt = x.dtype
    xf, xpf = x.to(tl.float32), xp.to(tl.float32)
    return ((xf * c).to(dt).to(tl.float32) + (xpf * sn).to(dt).to(tl.float32)).to(dt)


@triton.jit
def head_inv_rms(x, D: tl.constexpr, eps, AXIS: tl.constexpr):
    """1 / rms of x over its D dims along AXIS (the rest are zeros)."""
    xf = x.to(tl.float32)
    return inv_rms(tl.sum(xf * xf, axis=AXIS), D, eps)


@triton.jit
def head_norm(x, inv, w):
    """x's RMSNorm by inv and the weight w, rounded to x's dtype."""
    return rms_normed(x, inv, w).to(x.dtype)


@triton.jit
def paged_attention(
    Q, K, V, O, M_part, L_part, O_part,  # Q, O (T, H, D); K, V (slots, Hkv, D); *_part: split-K partials
    LOCKS,  # split-K: a counter per (sequence, KV head, block of rows), zero between launches
    meta, tables,  # meta (3, S): q_start, q_len, ctx_len; tables (S, width) int32
    Kn, Vn, COS, SIN, SLOTS,  # ROPE: the step's k, v (T, Hkv, D) before the cache, cos and sin (T, 2 HALF), slots (T,)
    QW, KW, qk_eps,  # QK_NORM: RMSNorm weights (D,) over each head of q and of k, before the rotary (Qwen3, Gemma 3)
    S, width, nslots,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_ot, stride_oh, stride_knt, stride_vnt, stride_ct,
    scale, softcap, window,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, SPLITS: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
    ROPE: tl.constexpr, HALF: tl.constexpr, QK_NORM: tl.constexpr,
):
    # A step of the key loop takes BLOCK_N keys, BLOCK_N / PAGE pages of the block table: each key's slot is its
    # page's block times PAGE plus its place in the page, so a step's K and V are each one gather load whatever
    # the pages are, and a 4096-key context is 32 steps (16 per split-K program), not 256 of one page each.
    # The grid is (SPLITS x blocks of rows, sequences, KV heads), split-major along its first axis: the interpreter
    # runs programs in grid order, innermost axis first, so the programs of one merge are far apart there, as they
    # may finish on a GPU (the tests then see a merge that counts the wrong programs).
    mblocks = tl.num_programs(0) // SPLITS
    split = tl.program_id(0) // mblocks
    mblk = tl.program_id(0) % mblocks
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q0 = tl.load(meta + seq)
    ql = tl.load(meta + S + seq)
    L = tl.load(meta + 2 * S + seq)

    r = mblk * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) rows: token r // G, query head kvh * G + r % G
    tok = r // G
    head = kvh * G + r % G
    row_ok = tok < ql
    qpos = L - ql + tok  # (BM,) each row's position
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_ptr = Q + (q0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh  # (BM, 1)
    q = tl.load(q_ptr + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BM, BD)
    if ROPE:  # one token per sequence (decode rows): q rotated here, in registers, as the glue's rope_ would
        rot = d < 2 * HALF
        pair = tl.where(d < HALF, d + HALF, d - HALF)  # (BD,) the dim each rotated dim pairs with
        c = tl.load(COS + q0 * stride_ct + d, mask=rot, other=1.0).to(tl.float32)  # (BD,)
        sn = tl.load(SIN + q0 * stride_ct + d, mask=rot, other=0.0).to(tl.float32)
        sn = tl.where(d < HALF, -sn, sn)
        qp = tl.load(q_ptr + pair[None, :], mask=row_ok[:, None] & rot[None, :], other=0.0)  # (BM, BD)
        if QK_NORM:  # each head normed first, its pair dims by the same row's norm
            inv = head_inv_rms(q, D, qk_eps, 1)  # (BM,)
            q = head_norm(q, inv[:, None], tl.load(QW + d, mask=d_ok, other=0.0)[None, :])
            qp = head_norm(qp, inv[:, None], tl.load(QW + pair, mask=rot, other=0.0)[None, :])
        q = tl.where(rot[None, :], rotate(q, qp, c[None, :], sn[None, :]), q)

    # keys this block of rows can see: up to its last row's position, from its first row's window
    first = L - ql + mblk * BLOCK_M // G
    last = L - ql + tl.minimum(ql - 1, ((mblk + 1) * BLOCK_M - 1) // G)
    hi = tl.minimum(last + 1, L)
    lo = 0
    if WINDOW:
        lo = tl.maximum(first - window + 1, 0)
    lo = lo // BLOCK_N * BLOCK_N  # (the keys below the window's start in the first step are masked out)
    if SPLITS > 1:  # this program's share of the steps
        steps = tl.cdiv(hi - lo, BLOCK_N)
        per = tl.cdiv(steps, SPLITS)
        lo_s = lo + split * per * BLOCK_N
        hi = tl.minimum(hi, lo_s + per * BLOCK_N)
        lo = lo_s

    if ROPE:  # the program whose keys hold the token's own position writes its rotated k and its v to the cache
        new = tl.load(SLOTS + q0)  # the token's slot
        # (masked stores, not a branch: a slot outside the cache writes nothing)
        writes = d_ok & (L - 1 >= lo) & (L - 1 < hi) & (new >= 0) & (new < nslots)  # (BD,)
        kn_ptr = Kn + q0 * stride_knt + kvh * D
        kr = tl.load(kn_ptr + d, mask=d_ok, other=0.0)  # (BD,)
        kp = tl.load(kn_ptr + pair, mask=rot, other=0.0)
        if QK_NORM:
            inv_k = head_inv_rms(kr, D, qk_eps, 0)  # a scalar
            kr = head_norm(kr, inv_k, tl.load(KW + d, mask=d_ok, other=0.0))
            kp = head_norm(kp, inv_k, tl.load(KW + pair, mask=rot, other=0.0))
        kr = tl.where(rot, rotate(kr, kp, c, sn), kr)
        tl.store(K + new * stride_kn + kvh * stride_kh + d, kr, mask=writes)
        vr = tl.load(Vn + q0 * stride_vnt + kvh * D + d, mask=d_ok, other=0.0)
        tl.store(V + new * stride_kn + kvh * stride_kh + d, vr, mask=writes)
        tl.debug_barrier()  # the whole program reads the key it wrote (a CTA's writes are visible to it after)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # (BN,) key positions
        k_ok = n < hi
        blk = tl.load(tables + seq * width + n // PAGE, mask=k_ok, other=0)  # (BN,) each key's page's block
        slot = blk * PAGE + n % PAGE  # (BN,) their slots
        k = tl.load(K + slot[None, :] * stride_kn + kvh * stride_kh + d[:, None],
                    mask=d_ok[:, None] & k_ok[None, :], other=0.0)  # (BD, BN)
        s = tl.dot(q, k) * scale  # (BM, BN) fp32
        if SOFTCAP:
            s = softcap * tanh_exp(s / softcap)
        vis = (n[None, :] <= qpos[:, None]) & k_ok[None, :]
        if WINDOW:
            vis = vis & (n[None, :] > qpos[:, None] - window)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp(s - m_safe[:, None])  # (BM, BN)
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(V + slot[:, None] * stride_kn + kvh * stride_kh + d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # (BN, BD)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out_ptr = O + (q0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]  # (BM, BD)
    out_ok = row_ok[:, None] & d_ok[None, :]
    if SPLITS == 1:
        tl.store(out_ptr, (acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]).to(O.dtype.element_ty), mask=out_ok)
    else:
        # Partials (S, H, SPLITS[, D]) (rows are single tokens: decode); the last of the row block's SPLITS programs
        # to finish (its counter says which) merges them in split order, so the merge is no launch of its own and
        # its sums do not depend on which program finished first (as quant.runtime.kernels.triton_kernels.store_or_reduce).
        part = (seq * G * tl.num_programs(2) + head) * SPLITS  # (BM,) split 0's partial of each row
        tl.store(M_part + part + split, m_i, mask=row_ok)
        tl.store(L_part + part + split, l_i, mask=row_ok)
        tl.store(O_part + (part + split)[:, None] * D + d[None, :], acc, mask=out_ok)
        lock = LOCKS + (seq * tl.num_programs(2) + kvh) * mblocks + mblk
        if arrived_last(lock, SPLITS):
            mx = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            for i in tl.static_range(SPLITS):
                mx = tl.maximum(mx, tl.load(M_part + part + i, mask=row_ok, other=float("-inf"), cache_modifier=".cg"))
            mx = tl.where(mx == float("-inf"), 0.0, mx)  # a row no split saw a key of
            total = tl.zeros((BLOCK_M,), tl.float32)
            merged = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
            for i in tl.static_range(SPLITS):
                w = tl.exp(tl.load(M_part + part + i, mask=row_ok, other=float("-inf"), cache_modifier=".cg") - mx)
                total += w * tl.load(L_part + part + i, mask=row_ok, other=0.0, cache_modifier=".cg")
                o_i = tl.load(O_part + (part + i)[:, None] * D + d[None, :], mask=out_ok, other=0.0,
                              cache_modifier=".cg")  # (BM, BD)
                merged += w[:, None] * o_i  # an empty split has m = -inf: weight 0
            tl.store(out_ptr, (merged / tl.where(total == 0.0, 1.0, total)[:, None]).to(O.dtype.element_ty),
                     mask=out_ok)
            rearm(lock)
