"""The int4 KV pool's reference ops (server/kv_int4.py): a sequence written and attended in any chunking reads the
same keys and values as token-by-token decode (what makes a recomputed request equal the original), and those
reads are quant/runtime/kv_quant.py's ``held`` view of int4, which bench/kv_quality.py measures."""

from __future__ import annotations

import pytest
import torch

from quant.runtime import kv_quant
from server import fastops, kv_int4

BS, HKV, H, D = 32, 2, 4, 64
REF = fastops.Ops("eager")


def _run(chunks, k, v, q, table=(5, 2, 7), tail=1, window=0, softcap=0.0):
    """Write and attend one sequence chunk by chunk as a backend would: store_blocks, attention, store_tail."""
    pool = kv_int4.allocate(1, 8, 3, BS, HKV, D)
    layer = [pool[n][0] for n in ("tail", "tail_scales", "codes", "kparams", "vparams")]
    outs, start = [], 0
    for n in chunks:
        kc, vc = k[start: start + n], v[start: start + n]
        completed, slots = kv_int4.chunk_writes(start, n, 0, list(table), tail, BS)
        kv_int4.ref_store_blocks_int4(kc, vc, *layer, torch.tensor(completed, dtype=torch.int64).view(-1, 4), BS)
        outs.append(kv_int4.ref_attention_int4(q[start: start + n], kc, vc, *layer, torch.tensor([[0, n, start, tail]]),
                                               torch.tensor([table]), BS, window, D ** -0.5, softcap))
        kv_int4.store_tail(REF, kc, vc, *layer[:2], slots)
        start += n
    return torch.cat(outs), pool


def _data(T=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, HKV, D, generator=g)
    k[..., 5] *= 10  # an outlier channel
    return k, torch.randn(T, HKV, D, generator=g), torch.randn(T, H, D, generator=g)


@pytest.mark.unit
def test_chunk_writes_name_the_blocks_a_chunk_completes_and_the_rest_s_tail_slots():
    completed, slots = kv_int4.chunk_writes(20, 50, 3, [5, 2, 7], 1, 32)  # positions 20..69: blocks 0, 1 complete
    assert completed == [(5, 1, 20, 3), (2, 1, 0, 15)]
    assert slots == [-1] * 44 + [32 + p % 32 for p in range(64, 70)]
    assert kv_int4.chunk_writes(3, 1, 0, [4], 0, 32) == ([], [3])


@pytest.mark.reference
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (40, 0.0), (0, 20.0)])
def test_every_chunking_reads_what_token_by_token_decode_reads(window, softcap):
    k, v, q = _data()
    decode, pool = _run([1] * 70, k, v, q, window=window, softcap=softcap)
    for chunks in ([70], [7, 40, 23], [32, 32, 6], [31, 2, 37]):
        got, other = _run(chunks, k, v, q, window=window, softcap=softcap)
        torch.testing.assert_close(got, decode, atol=1e-5, rtol=1e-5)
        for name in ("codes", "kparams", "vparams"):  # the int4 blocks bit for bit
            assert torch.equal(other[name], pool[name]), name


@pytest.mark.reference
def test_the_reads_are_kv_quant_s_held_view_of_int4_kivi():
    k, v, q = _data(seed=1)
    got, _ = _run([9, 61], k, v, q)
    t = lambda x: x.transpose(0, 1)  # noqa: E731 - (T, h, D) <-> (h, T, D)
    pos = torch.arange(70)
    want = kv_quant.attend_held(t(q), kv_quant.held("int4", t(k), True), kv_quant.held("int4", t(v), False),
                                32, pos, pos[None, :] <= pos[:, None], D ** -0.5)
    torch.testing.assert_close(got, t(want), atol=1e-4, rtol=1e-4)


def _fused():
    if not fastops.load():
        pytest.skip(f"fused ops unavailable: {fastops.unavailable_reason()}")
    return fastops.Ops("fused")


def _state(dtype, seed=4):
    """A pool with two sequences written by the references (A: 45 positions, tail 0; B: 70, tail 2) and the next
    step's rows: A's decode row (position 45), then B's prefill chunk of 30 (positions 70..99, completing its block
    2); k and v strided slices of one projection's output, as the model hands them."""
    g = torch.Generator().manual_seed(seed)
    pool = kv_int4.allocate(1, 9, 3, BS, HKV, D)
    layer = [pool[n][0] for n in ("tail", "tail_scales", "codes", "kparams", "vparams")]
    tables = {"A": [3, 6], "B": [1, 4, 0, 7]}
    for name, length, tail in (("A", 45, 0), ("B", 70, 2)):
        k = torch.randn(length, HKV, D, generator=g) * (1 + 9 * (torch.arange(D) == 5))
        v = torch.randn(length, HKV, D, generator=g)
        completed, slots = kv_int4.chunk_writes(0, length, 0, tables[name], tail, BS)
        kv_int4.ref_store_blocks_int4(k, v, *layer, torch.tensor(completed).view(-1, 4), BS)
        kv_int4.store_tail(REF, k, v, *layer[:2], slots)
    qkv = (torch.randn(31, (H + 2 * HKV) * D, generator=g) * 2).to(dtype)
    q = qkv[:, : H * D].view(31, H, D)
    k = qkv[:, H * D: (H + HKV) * D].view(31, HKV, D)
    v = qkv[:, (H + HKV) * D:].view(31, HKV, D)
    ca, _ = kv_int4.chunk_writes(45, 1, 0, tables["A"], 0, BS)
    cb, _ = kv_int4.chunk_writes(70, 30, 1, tables["B"], 2, BS)
    completed = torch.tensor(ca + cb).view(-1, 4)
    chunks = torch.tensor([[0, 1, 45, 0], [1, 30, 70, 2]])
    table = torch.tensor([tables["A"] + [0, 0], tables["B"]])
    return pool, layer, q, k, v, completed, chunks, table


@pytest.mark.reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_blocks_int4_writes_the_references_codes(dtype):
    fused = _fused()
    pool, layer, q, k, v, completed, _, _ = _state(dtype)
    want = [t.clone() for t in layer]
    REF.store_blocks_int4(k, v, *want, completed, BS)
    fused.store_blocks_int4(k, v, *layer, completed, BS)
    for got, ref in zip(layer, want):
        assert torch.equal(got, ref)
    assert not torch.equal(want[2], _state(dtype)[1][2])  # the step did write a block


@pytest.mark.reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (50, 0.0), (0, 30.0)])
def test_attention_int4_matches_its_reference(dtype, window, softcap):
    """A decode row and a prefill chunk in one call, GQA (4 query heads on 2 KV heads), against the reference."""
    fused = _fused()
    pool, layer, q, k, v, completed, chunks, table = _state(dtype)
    REF.store_blocks_int4(k, v, *layer, completed, BS)
    args = (*layer, chunks, table, BS, window, D ** -0.5, softcap)
    got = fused.attention_int4(q, k, v, *args)
    want = REF.attention_int4(q, k, v, *args)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)


@pytest.mark.unit
def test_the_int4_ops_refuse_what_is_outside_the_pool_or_the_step():
    fused = _fused()
    pool, layer, q, k, v, completed, chunks, table = _state(torch.float32)
    before = [t.clone() for t in layer]
    bad = completed.clone()
    bad[-1, 0] = 9
    with pytest.raises(RuntimeError, match="block 9 is outside the pool"):
        fused.store_blocks_int4(k, v, *layer, bad, BS)
    bad = completed.clone()
    bad[-1, 3] = 20  # its rows run past the step's 31
    with pytest.raises(RuntimeError, match="reads rows outside the step"):
        fused.store_blocks_int4(k, v, *layer, bad, BS)
    with pytest.raises(RuntimeError, match="kparams must be"):
        fused.store_blocks_int4(k, v, layer[0], layer[1], layer[2], layer[3][:4], layer[4], completed, BS)
    bad = chunks.clone()
    bad[1, 3] = 3
    with pytest.raises(RuntimeError, match="tail 3 is outside the pool"):
        fused.attention_int4(q, k, v, *layer, bad, table, BS, 0, 0.125, 0.0)
    with pytest.raises(RuntimeError, match="outside its block table"):
        fused.attention_int4(q, k, v, *layer, chunks, table[:, :3].contiguous(), BS, 0, 0.125, 0.0)
    for got, was in zip(layer, before):
        assert torch.equal(got, was)  # nothing was written
