"""The Triton kernels of the ``triton`` attention backend (server/attention/triton_paged.py, which says what they
compute), imported on the backend's first launch: importing triton costs ~50 MiB of RSS, which a CPU server
should not pay."""

import triton
import triton.language as tl


@triton.jit
def tanh_exp(x):
    # tanh through exp (libdevice's tanh does not run in the interpreter): 1 - 2 / (e^2x + 1)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

@triton.jit
def paged_attention(
    Q, K, V, O, M_part, L_part, O_part,  # Q, O (T, H, D); K, V (slots, Hkv, D); *_part: split-K partials
    meta, tables,  # meta (3, S): q_start, q_len, ctx_len; tables (S, width) int32
    S, width,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_ot, stride_oh,
    scale, softcap, window,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, SPLITS: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
):
    # A step of the key loop takes BLOCK_N keys, BLOCK_N / PAGE pages of the block table: each key's slot is its
    # page's block times PAGE plus its place in the page, so a step's K and V are each one gather load whatever
    # the pages are, and a 4096-key context is 32 steps (16 per split-K program), not 256 of one page each.
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    mblk = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
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
    q = tl.load(Q + (q0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BM, BD)

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

    if SPLITS > 1:  # partials (S, H, SPLITS[, D]) for the merge; rows are single tokens (decode)
        part = (seq * G * tl.num_programs(1) + head) * SPLITS + split
        tl.store(M_part + part, m_i, mask=row_ok)
        tl.store(L_part + part, l_i, mask=row_ok)
        tl.store(O_part + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(O + (q0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

@triton.jit
def merge_splits(O, M_part, L_part, O_part, meta, stride_ot, stride_oh,
                 H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q0 = tl.load(meta + seq)
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    base = (seq * H + head) * SPLITS
    m = tl.load(M_part + base + sp)  # (SPLITS,)
    l = tl.load(L_part + base + sp)
    o = tl.load(O_part + (base + sp)[:, None] * D + d[None, :], mask=d[None, :] < D, other=0.0)
    mx = tl.max(m, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp(m - mx)  # (SPLITS,) an empty split has m = -inf: weight 0
    total = tl.sum(l * w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(O + q0 * stride_ot + head * stride_oh + d, out.to(O.dtype.element_ty), mask=d < D)
