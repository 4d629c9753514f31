"""The fused CPU ops (server/csrc/decode_ops.cpp: the glue; attention_ops.cpp: decode and prefill attention over
the paged cache) against their eager references (server/fastops.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import rerun_capped_to_avx2
from glue_cases import check_activations, check_norms, check_rope, check_store_kv

from server import fastops

pytestmark = [pytest.mark.reference,
              pytest.mark.skipif(not fastops.load(), reason=f"fused ops not built: {fastops.unavailable_reason()}")]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FUSED = fastops.Ops("fused")
REF = fastops.Ops("eager")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 7, 300])  # 300 rows crosses the grain, so the parallel loop splits them
def test_norms_match_reference(dtype, T):
    check_norms(FUSED, REF, dtype, T, 576)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5, 200])
@pytest.mark.parametrize("R", [64, 48])  # full and partial rotary (Phi-4-mini, GPT-NeoX rotate part of a head)
def test_rope_in_place_matches_reference_on_strided_views(dtype, T, R):
    check_rope(FUSED, REF, dtype, T, R, H=9, Hkv=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 200])
def test_store_kv_matches_reference(dtype, T):
    check_store_kv(FUSED, REF, dtype, T, Hkv=3, D=64, nslots=512)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 40])
def test_gated_activations_match_reference(dtype, T):
    check_activations(FUSED, REF, dtype, T, 1536)


def paged_case(dtype, B=3, H=9, Hkv=3, D=64, bs=16, blocks=40, seed=0):
    """Random q (B, H, D) strided like a slice of a fused qkv row, one layer's cache, and shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, (H + 2 * Hkv) * D, generator=g).to(dtype)
    q = qkv[:, : H * D].view(B, H, D)  # rows strided by the fused width
    kv = torch.randn(2, blocks * bs, Hkv, D, generator=g).to(dtype)
    lens = torch.tensor([1, 37, 150][:B])
    order = torch.randperm(blocks, generator=g)
    nb = -(-int(lens.max()) // bs)
    tables = torch.stack([order[i * nb : (i + 1) * nb] for i in range(B)])  # (B, nb) disjoint, shuffled
    return q, kv, tables, lens, bs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (20, 0.0), (0, 30.0), (64, 5.0)])
@pytest.mark.parametrize("D", [64, 12])  # head sizes in eights take the kernel's tiles of keys; others one at a time
def test_decode_attention_matches_reference(dtype, window, softcap, D):
    q, kv, tables, lens, bs = paged_case(dtype, D=D)
    got = FUSED.decode_attention(q, kv, tables, lens, bs, window, 0.125, softcap)
    want = REF.decode_attention(q, kv, tables, lens, bs, window, 0.125, softcap)
    # both run in fp32 and round once; exp differs in the last bit and sums run in another order
    tol = dict(atol=2e-6, rtol=2e-5) if dtype == torch.float32 else dict(atol=torch.finfo(dtype).eps, rtol=0)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 300])
def test_decode_attention_of_long_contexts_merges_its_chunks(dtype, window):
    """Rows of 1,000 and 640 keys: each KV head's keys cut into four parts, one work item each (64-key spans inside
    it, an online softmax across them), their parts merged by maxima and sums; a window of 300 cuts only the keys
    it sees."""
    q, kv, tables, lens, bs = paged_case(dtype, B=2, blocks=160)
    lens = torch.tensor([1000, 640])
    nb = -(-1000 // bs)
    order = torch.randperm(160, generator=torch.Generator().manual_seed(1))
    tables = torch.stack([order[:nb], order[nb : 2 * nb]])
    got = FUSED.decode_attention(q, kv, tables, lens, bs, window, 0.125, 0.0)
    want = REF.decode_attention(q, kv, tables, lens, bs, window, 0.125, 0.0)
    tol = dict(atol=2e-6, rtol=2e-5) if dtype == torch.float32 else dict(atol=torch.finfo(dtype).eps, rtol=0)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_decode_attention_parts_are_what_the_engines_workspace_counts():
    """The kernel cuts a row's KV head into at most decode_attention_parts() parts, held in fp32 until merged
    (acc g x D, maximum and sum g each): quant/shape/memory.py's copy of the constant, and a fused engine's step
    workspace counts them beside a decode of max_batch rows."""
    from quant.shape.memory import DECODE_ATTENTION_PARTS, decode_attention_scratch
    from quant.shape.model import ModelShape
    from server.accounting import step_workspace

    assert torch.ops.quantserve.decode_attention_parts() == DECODE_ATTENTION_PARTS == 4
    shape = ModelShape(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152,
                       tie_embeddings=True, name="default model")
    assert decode_attention_scratch(shape, 1) == 3 * 4 * (3 * 64 + 2 * 3) * 4  # 9,504 bytes a row
    estimate = lambda tokens, scored=0: 1000 * tokens  # noqa: E731
    assert step_workspace(estimate, 16, 64, shape) == 64_000 + 64 * 9504
    assert step_workspace(estimate, 16, 64) == 64_000  # no fused CPU kernel: no parts
    assert step_workspace(estimate, 4096, 64, shape) == 4_096_000


def test_decode_attention_row_is_the_same_in_any_batch_on_any_threads():
    """A row's keys are cut into chunks by its own length alone and each part is computed the same wherever it
    runs: its output is the same bits alone or beside other rows, on one thread or two."""
    q, kv, tables, lens, bs = paged_case(torch.bfloat16, B=3, blocks=80)
    lens = torch.tensor([1, 150, 600])
    nb = -(-600 // bs)
    order = torch.randperm(80, generator=torch.Generator().manual_seed(2))
    tables = torch.stack([order[:nb], order[nb : 2 * nb], order[:nb]])
    args = (bs, 0, 0.125, 0.0)
    full = FUSED.decode_attention(q, kv, tables, lens, *args)
    for b in range(3):
        assert torch.equal(FUSED.decode_attention(q[b : b + 1], kv, tables[b : b + 1], lens[b : b + 1], *args),
                           full[b : b + 1])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = FUSED.decode_attention(q, kv, tables, lens, *args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, full)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache,rotation", [("float", (0, 0)), ("int8", (64, 0)), ("fp8", (0, 0))])
def test_rotary_decode_attention_is_the_calls_it_replaces(dtype, cache, rotation):
    """One call from the fused qkv output (the rotary, the cache write, the decode attention) leaves the bits the
    separate fused calls leave, in the output and the cache, and stays within the attention's tolerance of its
    reference (the references' composition)."""
    B, H, Hkv, D, R, bs = 3, 9, 3, 64, 48, 16  # partial rotary, GQA
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(B, (H + 2 * Hkv) * D, generator=g).to(dtype)
    cos, sin = (torch.randn(B, R, generator=g).to(dtype) for _ in range(2))
    codes = {"float": dtype, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[cache]
    kv = torch.randn(2, 40 * bs, Hkv, D, generator=g).to(dtype).to(codes)  # earlier positions, some content
    scales = None if cache == "float" else (torch.rand(2, 40 * bs, Hkv, generator=g) * 0.05 + 0.01).half()
    lens = torch.tensor([1, 37, 150])
    order = torch.randperm(40, generator=g)
    tables = torch.stack([order[i * 10: (i + 1) * 10] for i in range(B)])  # (B, 10) disjoint, shuffled
    pos = lens - 1
    slots = tables[torch.arange(B), pos // bs] * bs + pos % bs  # where each row's new K/V goes
    args = (slots, tables, lens, H, bs, 20, 0.125, 30.0, *rotation)

    def state():
        return qkv.clone(), kv.clone(), None if scales is None else scales.clone()

    q1, kv1, sc1 = state()
    got = FUSED.rotary_decode_attention(q1, cos, sin, kv1, sc1, *args)
    q2, kv2, sc2 = state()
    q, k, v = q2.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(B, H, D), k.view(B, Hkv, D), v.view(B, Hkv, D)
    FUSED.rope_(q, k, cos, sin)
    attend = (tables, lens, bs, 20, 0.125, 30.0)
    if scales is None:
        FUSED.store_kv(k, v, kv2, slots)
        want = FUSED.decode_attention(q, kv2, *attend)
    else:
        FUSED.store_kv_quant(k, v, kv2, sc2, slots, *rotation)
        want = FUSED.decode_attention_quant(q, kv2, sc2, *attend, *rotation)
    assert got.shape == (B, H * D) and torch.equal(got, want.reshape(B, H * D))
    assert torch.equal(kv1.view(torch.uint8), kv2.view(torch.uint8)) and torch.equal(q1, q2)
    assert sc1 is None or torch.equal(sc1, sc2)
    q3, kv3, sc3 = state()
    ref = REF.rotary_decode_attention(q3, cos, sin, kv3, sc3, *args)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=0)


def test_decode_attention_reference_is_sdpa_over_the_gathered_keys():
    """The reference itself against PyTorch's SDPA on each row's keys gathered in order (GQA, fp32)."""
    q, kv, tables, lens, bs = paged_case(torch.float32)
    got = REF.decode_attention(q, kv, tables, lens, bs, 0, 0.125, 0.0)
    for b in range(q.shape[0]):
        pos = torch.arange(int(lens[b]))
        slots = tables[b, pos // bs] * bs + pos % bs
        k, v = kv[0, slots].transpose(0, 1)[None], kv[1, slots].transpose(0, 1)[None]  # (1, Hkv, L, D)
        want = torch.nn.functional.scaled_dot_product_attention(q[b][None, :, None], k, v, scale=0.125,
                                                                enable_gqa=True)  # (1, H, 1, D)
        torch.testing.assert_close(got[b], want[0, :, 0], atol=1e-5, rtol=1e-5)


def prefill_case(dtype, C, start, H=9, Hkv=3, D=64, bs=16, seed=0):
    """A chunk's q (C, H, D) strided like a slice of fused qkv rows, one layer's cache holding the request's keys at
    positions [0, start + C) (and other requests' blocks), and its shuffled block table (blocks,)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(C, (H + 2 * Hkv) * D, generator=g).to(dtype)[:, : H * D].view(C, H, D)
    nb = -(-(start + C) // bs)
    kv = torch.randn(2, (nb + 5) * bs, Hkv, D, generator=g).to(dtype)
    return q, kv, torch.randperm(nb + 5, generator=g)[:nb], bs


# (C, start, H, Hkv, D): the default model's chunks (first, after a past, a short prompt), MHA, a D that is not a
# multiple of the vector width (80: Phi's), a group of 4 and D 128 (Llama-3-8B's), a one-token chunk, and an odd D
# (no bf16 pairs along it: bf16 takes the fp32 products)
PREFILL_SHAPES = [(256, 0, 9, 3, 64), (100, 300, 9, 3, 64), (7, 0, 9, 3, 64), (33, 5, 4, 4, 80),
                  (70, 64, 8, 2, 128), (1, 40, 9, 3, 64), (20, 9, 4, 2, 33)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=lambda s: "C{}-past{}-H{}-{}-D{}".format(*s))
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (20, 0.0), (0, 30.0), (64, 5.0)])
def test_prefill_attention_matches_reference(dtype, shape, window, softcap):
    C, start, H, Hkv, D = shape
    q, kv, table, bs = prefill_case(dtype, C, start, H, Hkv, D)
    got = FUSED.prefill_attention(q, kv, table, start, bs, window, D ** -0.5, softcap)
    want = REF.prefill_attention(q, kv, table, start, bs, window, D ** -0.5, softcap)
    # both run in fp32 and round once; exp differs in the last bits and the sums run in another order (tiles)
    tol = dict(atol=5e-6, rtol=5e-5) if dtype == torch.float32 else dict(atol=torch.finfo(dtype).eps, rtol=0)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_prefill_attention_reference_is_sdpa_over_the_gathered_keys():
    """The reference against PyTorch's SDPA over the request's keys gathered in order, with its causal mask
    aligned to the chunk's positions (GQA, fp32), and against the decode reference for its last row."""
    C, start = 40, 25
    q, kv, table, bs = prefill_case(torch.float32, C, start)
    got = REF.prefill_attention(q, kv, table, start, bs, 0, 0.125, 0.0)
    pos = torch.arange(start + C)
    slots = table[pos // bs] * bs + pos % bs
    k, v = kv[0, slots].transpose(0, 1)[None], kv[1, slots].transpose(0, 1)[None]  # (1, Hkv, L, D)
    mask = pos[None, :] <= torch.arange(start, start + C)[:, None]  # (C, L)
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask,
                                                            scale=0.125, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    last = REF.decode_attention(q[-1:], kv, table[None], torch.tensor([start + C]), bs, 0, 0.125, 0.0)
    torch.testing.assert_close(got[-1:], last, atol=1e-6, rtol=1e-6)


def test_prefill_attention_rows_do_not_depend_on_the_chunking():
    """A prompt's attention computed as one chunk equals it computed in two chunks (the second after the first's
    keys): the kernel reads the past through the block table as the chunk's own keys."""
    q, kv, table, bs = prefill_case(torch.bfloat16, 300, 0)
    whole = FUSED.prefill_attention(q, kv, table, 0, bs, 0, 0.125, 0.0)
    parts = torch.cat([FUSED.prefill_attention(q[:130], kv, table, 0, bs, 0, 0.125, 0.0),
                       FUSED.prefill_attention(q[130:], kv, table, 130, bs, 0, 0.125, 0.0)])
    assert torch.equal(whole, parts)


def test_the_attention_kernels_under_an_avx2_cap():
    """A CPU without AVX-512 gets the prefill kernel's 8-wide register blocks (attention_ops.cpp): the attention
    tests, run again under an AVX2 cap."""
    rerun_capped_to_avx2(__file__, "attention and not under_an_avx2_cap")


def test_bad_inputs_are_refused_with_the_argument_named():
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="contiguous"):
        FUSED.rms_norm(x.t(), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="w must be"):
        FUSED.rms_norm(x, torch.ones(63), 1e-5)
    with pytest.raises(RuntimeError, match="delta must match"):
        FUSED.add_rms_norm(x, torch.randn(4, 64, dtype=torch.float64), torch.ones(64), 1e-5)
    k, cs = torch.randn(2, 1, 8), torch.randn(2, 8)
    kv = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        FUSED.store_kv(k, k, kv, torch.tensor([0, 4]))
    assert kv.abs().sum() == 0  # slots are checked before anything is written
    with pytest.raises(RuntimeError, match="k and v must be"):
        FUSED.store_kv(k, torch.randn(2, 1, 7), kv, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="R <= D"):
        FUSED.rope_(torch.randn(2, 3, 8), k, torch.randn(2, 10), torch.randn(2, 10))
    with pytest.raises(RuntimeError, match="contiguous heads"):
        FUSED.rope_(torch.randn(2, 8, 3).transpose(1, 2), k, cs, cs)
    for op in (FUSED.silu_mul, FUSED.gelu_tanh_mul):
        with pytest.raises(RuntimeError, match="even width"):
            op(torch.randn(2, 5))
    q, kv, tables, lens, bs = paged_case(torch.float32)
    with pytest.raises(RuntimeError, match="outside the cache"):
        FUSED.decode_attention(q, kv, tables + 1000, lens, bs, 0, 0.1, 0.0)
    with pytest.raises(RuntimeError, match="outside its block table"):
        FUSED.decode_attention(q, kv, tables, lens * 100, bs, 0, 0.1, 0.0)
    with pytest.raises(RuntimeError, match="multiple of kv's"):
        FUSED.decode_attention(q[:, :8], kv, tables, lens, bs, 0, 0.1, 0.0)
    with pytest.raises(RuntimeError, match="int64"):
        FUSED.decode_attention(q, kv, tables.int(), lens, bs, 0, 0.1, 0.0)
    q, kv, table, bs = prefill_case(torch.float32, 20, 10)
    with pytest.raises(RuntimeError, match="outside the cache"):
        FUSED.prefill_attention(q, kv, table + 1000, 10, bs, 0, 0.1, 0.0)
    with pytest.raises(RuntimeError, match="outside the block table"):
        FUSED.prefill_attention(q, kv, table, 100, bs, 0, 0.1, 0.0)
    with pytest.raises(RuntimeError, match="multiple of kv's"):
        FUSED.prefill_attention(q[:, :8], kv, table, 10, bs, 0, 0.1, 0.0)
    with pytest.raises(RuntimeError, match="of q's dtype"):
        FUSED.prefill_attention(q, kv.double(), table, 10, bs, 0, 0.1, 0.0)
    with pytest.raises(RuntimeError, match="int64"):
        FUSED.prefill_attention(q, kv, table.int(), 10, bs, 0, 0.1, 0.0)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        FUSED.prefill_attention(q.transpose(1, 2), kv, table, 10, bs, 0, 0.1, 0.0)
    with pytest.raises(RuntimeError, match="whole blocks"):
        FUSED.prefill_attention(q, kv, table, 10, 5, 0, 0.1, 0.0)  # 112 slots
    qkv, cs = torch.randn(2, (4 + 2 * 2) * 8), torch.randn(2, 8)  # 4 query heads, 2 KV heads of 8
    kv, tables, lens = torch.zeros(2, 32, 2, 8), torch.tensor([[0, 1], [2, 3]]), torch.tensor([3, 5])
    with pytest.raises(RuntimeError, match="qkv must be"):
        FUSED.rotary_decode_attention(qkv[:, :-8], cs, cs, kv, None, torch.tensor([2, 20]), tables, lens, 4, 8, 0,
                                      0.1, 0.0, 0, 0)
    with pytest.raises(RuntimeError, match="kv must be"):
        FUSED.rotary_decode_attention(qkv, cs, cs, kv[0], None, torch.tensor([2, 20]), tables, lens, 4, 8, 0, 0.1,
                                      0.0, 0, 0)
    with pytest.raises(RuntimeError, match="outside the cache"):
        FUSED.rotary_decode_attention(qkv, cs, cs, kv, None, torch.tensor([2, 32]), tables, lens, 4, 8, 0, 0.1, 0.0,
                                      0, 0)
    assert kv.abs().sum() == 0  # slots are checked before anything is written


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_start():
    """torch's builder waits forever on a ``lock`` file that a build killed midway leaves behind (a server
    stopped during its first start hung every later one); load() removes such a leftover under its flock."""
    import subprocess
    import sys

    stale = fastops.build_directory() / "lock"
    stale.touch()
    try:
        p = subprocess.run([sys.executable, "-c", "from server import fastops; assert fastops.load(), "
                            "fastops.unavailable_reason()"], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        assert not stale.exists()
        assert "left by a build that did not finish" in p.stderr
    finally:
        stale.unlink(missing_ok=True)
