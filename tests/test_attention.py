"""Attention backends against the eager reference (server/attention/reference.py): decode rows gathered and as a
contiguous view, prefill chunks with and without past, sliding windows and soft-capping, GQA."""

from __future__ import annotations

import pytest
import torch

from server import fastops
from server.attention import BACKENDS, AttentionSpec
from server.attention import reference as R
from server.attention.sdpa import SdpaBackend
from server.batch import StepInputs

pytestmark = pytest.mark.reference

SPECS = {
    "plain": AttentionSpec(8, 2, 16, 0.25),
    "window": AttentionSpec(8, 2, 16, 0.25, window=7),
    "softcap": AttentionSpec(8, 4, 16, 0.3, softcap=5.0),
    "window+softcap": AttentionSpec(8, 8, 16, 0.3, window=5, softcap=2.0),
}


# The backends over a float pool, held to the exact reference; the int4 backend reads only its lossy pool
# (tests/test_kv_int4.py holds its ops to their references, tests/test_kv_cache.py the engine over it).
FLOAT_BACKENDS = [name for name, cls in BACKENDS.items() if cls.name != "int4"]

OPS = ["eager", pytest.param("fused", marks=pytest.mark.skipif(not fastops.load(), reason="fused ops not built"))]


def run_case(backend_name: str, spec: AttentionSpec, decode: list[int], chunks: list[tuple[int, int]], seed: int,
             contiguous: bool, ops: str = "eager"):
    """decode: past lengths of decode rows (each adds one token); chunks: (past, C) of prefill chunks. Every
    request's past K/V is written first, then one step runs; returns (backend output, reference output).
    ops: the glue ops the backend gets (fused: decode rows go through the C++ decode_attention)."""
    g = torch.Generator().manual_seed(seed)
    cls = BACKENDS[backend_name]
    bs, blocks = (16, 64) if backend_name == "triton" else (4, 64)  # triton reads whole pages of >= 16
    storage = torch.zeros(cls.kv_shape(1, blocks, bs, spec.kv_heads, spec.head_dim))
    backend = cls(storage, bs, [spec], fastops.Ops("fused" if ops == "fused" else "eager"))
    free = list(range(blocks)) if contiguous else torch.randperm(blocks, generator=g).tolist()
    reqs = []  # (past, new, table, k_all, v_all)
    for past, new in [(p, 1) for p in decode] + chunks:
        n = -(-(past + new) // bs)
        table, free = free[:n], free[n:]
        k_all = torch.randn(past + new, spec.kv_heads, spec.head_dim, generator=g)
        v_all = torch.randn(past + new, spec.kv_heads, spec.head_dim, generator=g)
        for p in range(past):  # the cache as earlier steps left it
            s = table[p // bs] * bs + p % bs
            backend.kv[0, 0, s], backend.kv[0, 1, s] = k_all[p], v_all[p]
        reqs.append((past, new, table, k_all, v_all))
    return _step(backend, spec, reqs, len(decode), bs, g)


def _step(backend, spec: AttentionSpec, reqs, n_decode: int, bs: int, g):
    """One step over ``reqs`` (past, new, table, k_all, v_all), the first ``n_decode`` of them decode rows, each
    one's past already in the cache: (the backend's output, the reference's over each request's k_all / v_all)."""
    q = torch.randn(sum(r[1] for r in reqs), spec.heads, spec.head_dim, generator=g)
    k = torch.cat([r[3][r[0]:] for r in reqs])
    v = torch.cat([r[4][r[0]:] for r in reqs])
    pos, slots, chunk_meta, t0 = [], [], [], 0
    for i, (past, new, table, _, _) in enumerate(reqs):
        pos += list(range(past, past + new))
        slots += [table[p // bs] * bs + p % bs for p in range(past, past + new)]
        if i >= n_decode:
            chunk_meta.append((t0, new, past, table))
        t0 += new
    step = StepInputs(torch.zeros(len(pos), dtype=torch.int64), torch.tensor(pos), torch.tensor(slots),
                      torch.tensor([0]), [(reqs[i][0], reqs[i][2]) for i in range(n_decode)], chunk_meta, bs)
    got = backend.forward(q, k, v, 0, backend.prepare(step))
    want, t0 = [], 0
    for past, new, _, k_all, v_all in reqs:
        want.append(R.attention(q[t0:t0 + new], k_all, v_all, torch.arange(past, past + new),
                                torch.arange(past + new), spec))
        t0 += new
    return got, torch.cat(want)


@pytest.mark.parametrize("backend", FLOAT_BACKENDS)
@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("ops", OPS)
def test_backend_matches_reference_on_mixed_steps(backend, spec, contiguous, ops):
    got, want = run_case(backend, SPECS[spec], decode=[0, 5, 13], chunks=[(0, 9), (6, 11), (0, 3)], seed=1,
                         contiguous=contiguous, ops=ops)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", FLOAT_BACKENDS)
@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("ops", OPS)
def test_backend_matches_reference_for_a_lone_decode_row(backend, spec, ops):
    for past in (0, 3, 6, 7, 30):  # below, at and past the window
        got, want = run_case(backend, SPECS[spec], decode=[past], chunks=[], seed=past, contiguous=True, ops=ops)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not fastops.load(), reason="fused ops not built")
@pytest.mark.parametrize("spec", list(SPECS))
def test_sdpa_decode_step_in_one_call_is_the_split_calls(spec):
    """A decode-only step's layer through ``decode_qkv`` (one C++ call from the fused qkv output) leaves the bits of
    splitting qkv and calling ``forward_rotary``, in its output and in the pool; a step with a prefill chunk, and
    the eager ops, take the split calls (None)."""
    s, bs, blocks = SPECS[spec], 4, 64
    H, Hkv, D = s.heads, s.kv_heads, s.head_dim
    g = torch.Generator().manual_seed(4)
    pasts = [0, 5, 13]
    order = torch.randperm(blocks, generator=g).tolist()
    tables = [order[8 * i: 8 * i + 8] for i in range(len(pasts))]
    slots = [t[p // bs] * bs + p % bs for p, t in zip(pasts, tables)]
    T = len(pasts)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g)
    cos, sin = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    pool = torch.randn(SdpaBackend.kv_shape(1, blocks, bs, Hkv, D), generator=g)
    step = StepInputs(torch.zeros(T, dtype=torch.int64), torch.tensor(pasts), torch.tensor(slots),
                      torch.arange(T), list(zip(pasts, tables)), [], bs)
    got = []
    for one_call in (True, False):
        backend = SdpaBackend(pool.clone(), bs, [s], fastops.Ops("fused"))
        x, meta = qkv.clone(), backend.prepare(step)
        if one_call:
            o = backend.decode_qkv(x, H, cos, sin, 0, meta)
        else:
            q, k, v = x.split([H * D, Hkv * D, Hkv * D], dim=-1)
            o = backend.forward_rotary(q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D), cos, sin, 0, meta)
        got.append((o.reshape(T, H * D), backend.kv))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    mixed = StepInputs(torch.zeros(T + 2, dtype=torch.int64), torch.tensor(pasts + [0, 1]),
                       torch.tensor(slots + [order[60] * bs, order[60] * bs + 1]), torch.arange(T + 2),
                       list(zip(pasts, tables)), [(T, 2, 0, [order[60]])], bs)
    backend = SdpaBackend(pool.clone(), bs, [s], fastops.Ops("fused"))
    assert backend.decode_qkv(torch.randn(T + 2, (H + 2 * Hkv) * D), H, cos, sin, 0, backend.prepare(mixed)) is None
    eager = SdpaBackend(pool.clone(), bs, [s], fastops.Ops("eager"))
    assert eager.decode_qkv(qkv.clone(), H, cos, sin, 0, eager.prepare(step)) is None


def test_reference_window_mask_is_transformers_rule():
    m = R.visible(torch.arange(5, 8), torch.arange(0, 8), window=3)
    # query 5 sees 3, 4, 5; query 7 sees 5, 6, 7 (kv > q - window and kv <= q)
    assert m[0].nonzero().flatten().tolist() == [3, 4, 5]
    assert m[2].nonzero().flatten().tolist() == [5, 6, 7]


def test_backend_refuses_specs_it_cannot_run():
    from server.attention.base import AttentionBackend

    class NoWindows(AttentionBackend):
        name = "nowin"
        features = frozenset({"softcap"})

    assert NoWindows.unsupported([SPECS["plain"]]) is None
    assert "'window'" in NoWindows.unsupported([SPECS["plain"], SPECS["window"]])
    assert "divide" in BACKENDS["sdpa"].unsupported([AttentionSpec(6, 4, 16, 0.25)])


# ---------------------------------------------------------------------------- the triton backend's own paths
# (under TRITON_INTERPRET=1 without a GPU: tests/conftest.py)

def _triton_case(spec, decode, chunks, seed, dtype=torch.float32, min_split_keys=None):
    from server.attention.triton_paged import TritonBackend

    saved = TritonBackend.MIN_SPLIT_KEYS
    if min_split_keys is not None:
        TritonBackend.MIN_SPLIT_KEYS = min_split_keys
    try:
        got, want = run_case("triton", spec, decode=decode, chunks=chunks, seed=seed, contiguous=False)
    finally:
        TritonBackend.MIN_SPLIT_KEYS = saved
    return got, want


@pytest.mark.parametrize("spec", list(SPECS))
def test_triton_split_k_decode_matches_reference(spec):
    """Decode-only steps over long contexts split each sequence's keys and merge the partials; a split that
    the window leaves empty must weigh nothing."""
    from server.attention.triton_paged import TritonBackend

    got, want = _triton_case(SPECS[spec], decode=[200, 37, 0], chunks=[], seed=3, min_split_keys=32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert TritonBackend.MIN_SPLIT_KEYS == 256  # restored


def test_triton_split_merge_in_one_launch_rearms_its_counters():
    """The split-K partials are merged by the last program of each (sequence, KV head, block of rows) within the
    attention launch, its counter re-armed: with 80 query heads on one KV head a row takes two blocks of 64, so
    each block's counter must count its own programs; a second launch on the same counters gives the same
    output, and every counter is zero after each."""
    from quant.runtime.kernels.triton_ops import split_counters

    spec = AttentionSpec(80, 1, 16, 0.25, window=150)
    for seed in (11, 12):  # twice: a counter left mid-count would hand the merge to the wrong program
        got, want = _triton_case(spec, decode=[200, 90, 0], chunks=[], seed=seed, min_split_keys=16)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert not split_counters(torch.device("cpu"), 1).any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", ["split+window", "partial rotary", "one block", "head norms", "head norms, two eps"])
def test_triton_decode_fuses_the_rotary_and_cache_write_exactly(dtype, case):
    """Steps of one token per sequence (every decode step and CUDA graph): the attention launch rotates q and k (after
    an RMSNorm over each head where the model has one: Qwen3, Gemma 3) and writes k and v to the cache itself. The
    output and the cache it leaves are bit for bit those of the glue's norms, the eager rotary, the cache write and
    the attention one after another; a slot outside the cache writes nothing."""
    from server.attention.triton_paged import TritonBackend
    from server.layers.norm import RMSNorm

    # (spec, rotary dims, MIN_SPLIT_KEYS, the splits of the longest context's 201 keys: a power of two)
    spec, rot, split_keys, want_splits = {
        "split+window": (AttentionSpec(8, 2, 32, 0.2, window=150), 32, 32, 4),
        "partial rotary": (AttentionSpec(6, 3, 32, 0.2), 24, 256, 1),
        "one block": (AttentionSpec(4, 4, 16, 0.25, softcap=3.0), 16, 256, 1),
        "head norms": (AttentionSpec(8, 2, 24, 0.2), 16, 64, 2),
        # q's and k's eps differ: the kernel has one, so the norms run first, apart
        "head norms, two eps": (AttentionSpec(8, 2, 24, 0.2), 16, 64, 2)}[case]
    g = torch.Generator().manual_seed(9)
    bs, blocks, pasts = 16, 64, [200, 37, 0, 90]
    storage = (torch.randn(TritonBackend.kv_shape(1, blocks, bs, spec.kv_heads, spec.head_dim), generator=g)
               .to(dtype))
    perm = torch.randperm(blocks, generator=g).tolist()
    tables, used = [], 0
    for p in pasts:
        n = p // bs + 1
        tables.append(perm[used:used + n])
        used += n
    T = len(pasts)
    slots = [t[p // bs] * bs + p % bs for p, t in zip(pasts, tables)]
    slots[2] = -1  # outside the cache: nothing written, nothing else changed
    step = StepInputs(torch.zeros(T, dtype=torch.int64), torch.tensor(pasts), torch.tensor(slots), torch.tensor([0]),
                      list(zip(pasts, tables)), [], bs)
    qkv = torch.randn(T, (spec.heads + 2 * spec.kv_heads) * spec.head_dim, generator=g).to(dtype)
    angles = torch.tensor(pasts, dtype=torch.float32)[:, None] * torch.rand(rot, generator=g)  # (T, R)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    norms = None
    if case.startswith("head norms"):  # partial rotary too, and a head dim that is not a power of two
        norms = tuple(RMSNorm(torch.rand(spec.head_dim, generator=g) + 0.5, eps, fastops.Ops("triton"), dtype)
                      for eps in (1e-6, 1e-6 if case == "head norms" else 1e-2))

    def run(fused: bool):  # unfused: the eager rotary, then the Triton cache write (which skips slot -1)
        backend = TritonBackend(storage.clone(), bs, [spec], fastops.Ops("triton"))
        backend.MIN_SPLIT_KEYS = split_keys
        meta = backend.prepare(step)
        q, k, v = (t.view(T, -1, spec.head_dim) for t in qkv.clone().split(
            [spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim, spec.kv_heads * spec.head_dim], dim=-1))
        if fused:
            out = backend.forward_rotary(q, k, v, cos, sin, 0, meta, norms)
        else:
            if norms is not None:
                q, k = norms[0](q), norms[1](k)
            fastops.ref_rope_(q, k, cos, sin)
            out = backend.forward(q, k, v, 0, meta)
        return out, backend.kv, meta.splits

    (got, got_kv, splits), (want, want_kv, _) = run(True), run(False)
    assert splits == want_splits
    assert torch.equal(got, want) and torch.equal(got_kv, want_kv)
    assert not torch.equal(got_kv, storage.view_as(got_kv))  # the three slots in the cache were written


def test_triton_prepare_splits_only_decode_steps():
    from server.attention.triton_paged import TritonBackend

    spec = SPECS["plain"]
    storage = torch.zeros(TritonBackend.kv_shape(1, 64, 16, spec.kv_heads, spec.head_dim))
    backend = TritonBackend(storage, 16, [spec], fastops.Ops("eager"))
    table = list(range(40))
    dec = StepInputs(torch.zeros(1, dtype=torch.int64), torch.tensor([600]), torch.tensor([600]),
                     torch.tensor([0]), [(600, table)], [], 16)
    assert backend.prepare(dec).splits == 2  # 601 keys: two parts of >= 256
    mixed = StepInputs(torch.zeros(2, dtype=torch.int64), torch.tensor([600, 0]), torch.tensor([600, 0]),
                       torch.tensor([0]), [(600, table)], [(1, 1, 0, [50])], 16)
    m = backend.prepare(mixed)
    assert (m.splits, m.seqs, m.max_q) == (1, 2, 1)
    assert m.meta.tolist() == [[0, 1], [1, 1], [601, 1]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_triton_long_prefill_with_past_and_wide_groups(dtype):
    """A chunk longer than one block of rows after a past of many pages, 8 query heads per KV head, a head
    dim that is not a power of two (masked lanes), in fp16 as a GPU runs it."""
    spec = AttentionSpec(16, 2, 24, 24 ** -0.5)
    got, want = _triton_case(spec, decode=[70], chunks=[(45, 40), (0, 17)], seed=5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if dtype is torch.float16:  # the same case, cache and activations in fp16, against the fp32 reference
        from server.attention.triton_paged import TritonBackend, paged_attention

        g = torch.Generator().manual_seed(7)
        bs, past, c = 16, 45, 40
        table = torch.randperm(16, generator=g)[:6].tolist()
        storage = torch.randn(TritonBackend.kv_shape(1, 16, bs, 2, 24), generator=g).half()
        backend = TritonBackend(storage, bs, [spec], fastops.Ops("eager"))
        q = torch.randn(c, 16, 24, generator=g).half()
        step = StepInputs(torch.zeros(c, dtype=torch.int64), torch.arange(past, past + c), torch.zeros(c),
                          torch.tensor([0]), [], [(0, c, past, table)], bs)
        got = paged_attention(q, backend.kv[0, 0], backend.kv[0, 1], backend.prepare(step), spec, bs)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(past + c)])
        want = R.attention(q.float(), backend.kv[0, 0, slots].float(), backend.kv[0, 1, slots].float(),
                           torch.arange(past, past + c), torch.arange(past + c), spec)
        assert got.dtype == torch.float16
        torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("keys", [16, 32])
def test_triton_steps_of_any_whole_pages_compute_the_same(keys):
    """The kernel's key loop takes keys_per_step() keys a step (128 for decode rows); one or two pages a step (what
    bench/gpu.py times beside it) give the same attention, and a step that is not whole pages is refused."""
    from server.attention.triton_paged import TritonBackend

    spec = SPECS["window"]
    TritonBackend.keys_per_step = keys
    try:
        got, want = _triton_case(spec, decode=[200, 37], chunks=[(40, 23)], seed=7)
    finally:
        TritonBackend.keys_per_step = None
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_triton_refuses_a_key_step_of_part_pages():
    from server.attention.triton_paged import TritonMeta, paged_attention

    spec = SPECS["plain"]
    meta = TritonMeta(torch.zeros(1, dtype=torch.int64), torch.zeros(3, 1, dtype=torch.int32),
                      torch.zeros(1, 4, dtype=torch.int32), 1, 1, 64, 1)
    kc = torch.zeros(64, spec.kv_heads, spec.head_dim)
    with pytest.raises(ValueError, match="keys per step must be whole pages of 16"):
        paged_attention(torch.zeros(1, spec.heads, spec.head_dim), kc, kc, meta, spec, 16, keys=24)


def test_triton_refuses_block_sizes_it_cannot_page():
    from quant.errors import UnsupportedModelError
    from server.attention.triton_paged import TritonBackend

    spec = SPECS["plain"]
    with pytest.raises(UnsupportedModelError, match="block size 8 must be a power of two >= 16"):
        TritonBackend(torch.zeros(TritonBackend.kv_shape(1, 4, 8, 2, 16)), 8, [spec], fastops.Ops("eager"))


def test_choose_prefers_triton_on_cuda_only():
    from server.attention import choose

    assert choose(torch.device("cpu")).name == "sdpa"
    assert choose(torch.device("cuda")).name == "triton"  # (where triton imports; it does under the dev extra)


def test_triton_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    from quant.errors import UnsupportedModelError
    from server.attention.triton_paged import TritonBackend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UnsupportedModelError, match="runs on CUDA tensors .* not on cpu"):
        TritonBackend(torch.zeros(TritonBackend.kv_shape(1, 4, 16, 2, 16)), 16, [SPECS["plain"]], fastops.Ops("eager"))


def test_triton_graph_metadata_matches_a_step_of_its_own():
    """The static metadata the decode graphs replay with (graph_meta, then update_graph_meta for a step of 3 rows
    in a bucket of 8, spare rows on the pad block) gives the rows the same attention as the step's own prepare."""
    from server.attention.triton_paged import TritonBackend, paged_attention

    spec = SPECS["plain"]
    g = torch.Generator().manual_seed(9)
    bs, pad = 16, 63
    storage = torch.randn(TritonBackend.kv_shape(1, 64, bs, spec.kv_heads, spec.head_dim), generator=g)
    backend = TritonBackend(storage, bs, [spec], fastops.Ops("eager"))
    tables = [[5, 9, 2], [7], [11, 12, 13, 14, 20]]
    lens = [40, 3, 70]
    step = StepInputs(torch.zeros(3, dtype=torch.int64), torch.tensor(lens), torch.zeros(3, dtype=torch.int64),
                      torch.arange(3), [(p, t) for p, t in zip(lens, tables)], [], bs)
    q = torch.randn(3, spec.heads, spec.head_dim, generator=g)
    want = paged_attention(q, backend.kv[0, 0], backend.kv[0, 1], backend.prepare(step), spec, bs)
    meta = backend.graph_meta(8, 6, torch.zeros(8, dtype=torch.int64), pad)
    assert meta.meta.tolist() == [list(range(8)), [1] * 8, [1] * 8] and meta.tables.eq(pad).all()
    backend.update_graph_meta(meta, step, pad)
    assert meta.meta[2].tolist() == [41, 4, 71, 1, 1, 1, 1, 1]
    assert meta.tables[2].tolist() == [11, 12, 13, 14, 20, pad] and meta.tables[3:, 0].eq(pad).all()
    qb = torch.cat([q, torch.zeros(5, spec.heads, spec.head_dim)])  # the bucket's padding rows
    got = paged_attention(qb, backend.kv[0, 0], backend.kv[0, 1], meta, spec, bs)[:3]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_triton_fused_rotary_refuses_what_it_cannot_read():
    """The fused rotary reads each head's dims in pairs and writes one token per sequence: a step of more, heads that
    are not contiguous, or an odd rotary width are refused in one line."""
    from server.attention.triton_paged import TritonMeta, paged_attention

    spec = SPECS["plain"]  # 8 heads on 2, D 16
    kc = torch.zeros(64, 2, 16)
    meta = TritonMeta(torch.zeros(1, dtype=torch.int64), torch.zeros(3, 1, dtype=torch.int32),
                      torch.zeros(1, 4, dtype=torch.int32), 1, 1, 64, 1)
    q, k, cs = torch.zeros(1, 8, 16), torch.zeros(1, 2, 16), torch.zeros(1, 16)
    cases = [(dict(meta=TritonMeta(meta.slots, meta.meta, meta.tables, 1, 2, 64, 1)), "one token per sequence"),
             (dict(q=torch.zeros(1, 16, 8).transpose(1, 2)), "q must be"),
             (dict(k=torch.zeros(1, 2, 17)[..., :16]), "k must be"),
             (dict(cos=torch.zeros(1, 15), sin=torch.zeros(1, 15)), "even R")]
    for change, message in cases:
        args = dict(q=q, k=k, v=k, cos=cs, sin=cs, meta=meta) | change
        with pytest.raises(ValueError, match=message):
            paged_attention(args["q"], kc, kc, args["meta"], spec, 16,
                            rope=(args["k"], args["v"], args["cos"], args["sin"]))


@pytest.mark.parametrize("backend_name", FLOAT_BACKENDS)
def test_backends_read_a_shared_prefix_through_their_tables(backend_name):
    """The prefix cache's tables (server/kv_pool.py): three requests whose tables begin with the same two physical
    blocks (a 32-token prompt stem written once), then blocks of their own, in one step: a decode row after a
    past of 45, a prefill chunk of 20 after the stem (a cache hit), and a chunk of 10 after a past of 40; each
    reads the shared blocks through its own table and matches the reference over stem + its own tokens."""
    spec = SPECS["window"] if backend_name == "sdpa" else SPECS["plain"]
    g = torch.Generator().manual_seed(11)
    cls = BACKENDS[backend_name]
    bs, blocks, stem = 16, 24, 32
    backend = cls(torch.zeros(cls.kv_shape(1, blocks, bs, spec.kv_heads, spec.head_dim)), bs, [spec],
                  fastops.Ops("eager"))
    free = torch.randperm(blocks, generator=g).tolist()
    shared, free = free[:2], free[2:]
    k_stem = torch.randn(stem, spec.kv_heads, spec.head_dim, generator=g)
    v_stem = torch.randn(stem, spec.kv_heads, spec.head_dim, generator=g)
    for p in range(stem):
        s = shared[p // bs] * bs + p % bs
        backend.kv[0, 0, s], backend.kv[0, 1, s] = k_stem[p], v_stem[p]
    reqs = []  # (past, new, table, k_all, v_all)
    for past, new in ((45, 1), (32, 20), (40, 10)):
        n = -(-(past + new) // bs)
        table, free = shared + free[:n - 2], free[n - 2:]
        k_all = torch.cat([k_stem, torch.randn(past + new - stem, spec.kv_heads, spec.head_dim, generator=g)])
        v_all = torch.cat([v_stem, torch.randn(past + new - stem, spec.kv_heads, spec.head_dim, generator=g)])
        for p in range(stem, past):  # its own past, as its earlier steps wrote it
            s = table[p // bs] * bs + p % bs
            backend.kv[0, 0, s], backend.kv[0, 1, s] = k_all[p], v_all[p]
        reqs.append((past, new, table, k_all, v_all))
    got, want = _step(backend, spec, reqs, 1, bs, g)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for p in range(stem):  # the shared blocks are as the stem wrote them: no request wrote into them
        s = shared[p // bs] * bs + p % bs
        assert torch.equal(backend.kv[0, 0, s], k_stem[p]) and torch.equal(backend.kv[0, 1, s], v_stem[p])
