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


def _write(ops, units, k, v, start, row, table, tail):
    """The writes of one sequence's rows k, v at positions start..: its completed blocks, then its tail."""
    completed, slots = kv_int4.chunk_writes(start, k.shape[0], row, list(table), tail, BS)
    ops.store_blocks_int4(k, v, units, torch.tensor(completed, dtype=torch.int64).view(-1, 5), BS)
    ops.store_tail_int4(k, v, units, torch.tensor(slots, dtype=torch.int64).view(-1, 2), BS)


def _run(chunks, k, v, q, table=(5, 2, 7), tail=(1, 6), window=0, softcap=0.0):
    """Write and attend one sequence chunk by chunk as a backend would: store_blocks, attention, store_tail."""
    units = kv_int4.allocate(1, 8, BS, HKV, D)[0]
    outs, start = [], 0
    for n in chunks:
        kc, vc = k[start: start + n], v[start: start + n]
        completed, slots = kv_int4.chunk_writes(start, n, 0, list(table), tail, BS)
        kv_int4.ref_store_blocks_int4(kc, vc, units, torch.tensor(completed, dtype=torch.int64).view(-1, 5), BS)
        outs.append(kv_int4.ref_attention_int4(q[start: start + n], kc, vc, units,
                                               torch.tensor([[0, n, start, *tail]]), torch.tensor([table]), BS,
                                               window, D ** -0.5, softcap))
        kv_int4.ref_store_tail_int4(kc, vc, units, torch.tensor(slots).view(-1, 2), BS)
        start += n
    return torch.cat(outs), units


def _blocks(units, table=(5, 2, 7)):
    """The int4 blocks' bytes of a sequence's table (its tail units hold scratch)."""
    return units[list(table)]


def _data(T=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, HKV, D, generator=g)
    k[..., 5] *= 10  # an outlier channel
    return k, torch.randn(T, HKV, D, generator=g), torch.randn(T, H, D, generator=g)


@pytest.mark.unit
def test_chunk_writes_name_the_blocks_a_chunk_completes_and_the_rest_s_tail_slots():
    completed, slots = kv_int4.chunk_writes(20, 50, 3, [5, 2, 7], (1, 4), 32)  # positions 20..69: blocks 0, 1 complete
    assert completed == [(5, 1, 4, 20, 3), (2, 1, 4, 0, 15)]
    assert slots == [(-1, -1)] * 44 + [(32 + p % 32, 128 + p % 32) for p in range(64, 70)]
    assert kv_int4.chunk_writes(3, 1, 0, [4], (0, 1), 32) == ([], [(3, 35)])


@pytest.mark.reference
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (40, 0.0), (0, 20.0)])
def test_every_chunking_reads_what_token_by_token_decode_reads(window, softcap):
    k, v, q = _data()
    decode, units = _run([1] * 70, k, v, q, window=window, softcap=softcap)
    for chunks in ([70], [7, 40, 23], [32, 32, 6], [31, 2, 37]):
        got, other = _run(chunks, k, v, q, window=window, softcap=softcap)
        torch.testing.assert_close(got, decode, atol=1e-5, rtol=1e-5)
        assert torch.equal(_blocks(other), _blocks(units))  # the int4 blocks bit for bit


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
    """A pool with two sequences written by the references (A: 45 positions, tail units (0, 8); B: 70, tail (2, 5))
    and the next step's rows: A's decode row (position 45), then B's prefill chunk of 30 (positions 70..99,
    completing its block 2); k and v strided slices of one projection's output, as the model hands them."""
    g = torch.Generator().manual_seed(seed)
    units = kv_int4.allocate(1, 10, BS, HKV, D)[0]
    tables = {"A": [3, 6], "B": [1, 4, 9, 7]}
    tails = {"A": (0, 8), "B": (2, 5)}
    for name, length in (("A", 45), ("B", 70)):
        k = torch.randn(length, HKV, D, generator=g) * (1 + 9 * (torch.arange(D) == 5))
        v = torch.randn(length, HKV, D, generator=g)
        _write(REF, units, k, v, 0, 0, tables[name], tails[name])
    qkv = (torch.randn(31, (H + 2 * HKV) * D, generator=g) * 2).to(dtype)
    q = qkv[:, : H * D].view(31, H, D)
    k = qkv[:, H * D: (H + HKV) * D].view(31, HKV, D)
    v = qkv[:, (H + HKV) * D:].view(31, HKV, D)
    ca, sa = kv_int4.chunk_writes(45, 1, 0, tables["A"], tails["A"], BS)
    cb, sb = kv_int4.chunk_writes(70, 30, 1, tables["B"], tails["B"], BS)
    completed = torch.tensor(ca + cb).view(-1, 5)
    chunks = torch.tensor([[0, 1, 45, *tails["A"]], [1, 30, 70, *tails["B"]]])
    table = torch.tensor([tables["A"] + [0, 0], tables["B"]])
    return units, q, k, v, completed, chunks, table, torch.tensor(sa + sb).view(-1, 2)


@pytest.mark.unit
def test_a_unit_holds_an_int4_block_or_a_tail_half_in_the_formats_bytes():
    from quant.shape.kv_formats import token_bytes

    for hkv, d in ((1, 64), (3, 64), (8, 128), (2, 80)):
        ub = kv_int4.unit_bytes(BS, hkv, d)
        assert ub == BS * hkv * token_bytes("int4", d)  # a block costs what the format says it costs
        u = kv_int4.views(kv_int4.allocate(1, 2, BS, hkv, d)[0], BS, hkv, d)
        tail_end = u["tail_scales"][0, -1, -1:].data_ptr() + 2 - u["tail"].data_ptr()
        assert tail_end <= ub  # a tail half fits in a unit
        block_end = u["vparams"][0, -1, -1, -1:].data_ptr() + 2 - u["kcodes"].data_ptr()
        assert block_end == ub  # and a block fills it
    with pytest.raises(ValueError, match="not a multiple of 8"):
        kv_int4.allocate(1, 2, BS, 1, 60)


@pytest.mark.reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_blocks_int4_and_store_tail_int4_write_the_references_bytes(dtype):
    fused = _fused()
    units, q, k, v, completed, _, _, slots = _state(dtype)
    want = units.clone()
    REF.store_blocks_int4(k, v, want, completed, BS)
    REF.store_tail_int4(k, v, want, slots, BS)
    fused.store_blocks_int4(k, v, units, completed, BS)
    fused.store_tail_int4(k, v, units, slots, BS)
    assert torch.equal(units, want)
    assert not torch.equal(want, _state(dtype)[0])  # the step did write


@pytest.mark.reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (50, 0.0), (0, 30.0)])
def test_attention_int4_matches_its_reference(dtype, window, softcap):
    """A decode row and a prefill chunk in one call, GQA (4 query heads on 2 KV heads), against the reference."""
    fused = _fused()
    units, q, k, v, completed, chunks, table, _ = _state(dtype)
    REF.store_blocks_int4(k, v, units, completed, BS)
    args = (units, chunks, table, BS, window, D ** -0.5, softcap)
    got = fused.attention_int4(q, k, v, *args)
    want = REF.attention_int4(q, k, v, *args)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)


@pytest.mark.unit
def test_the_int4_ops_refuse_what_is_outside_the_pool_or_the_step():
    fused = _fused()
    units, q, k, v, completed, chunks, table, slots = _state(torch.float32)
    before = units.clone()
    bad = completed.clone()
    bad[-1, 0] = 10
    with pytest.raises(RuntimeError, match="block 10 is outside the pool"):
        fused.store_blocks_int4(k, v, units, bad, BS)
    bad = completed.clone()
    bad[-1, 4] = 20  # its rows run past the step's 31
    with pytest.raises(RuntimeError, match="reads rows outside the step"):
        fused.store_blocks_int4(k, v, units, bad, BS)
    with pytest.raises(RuntimeError, match="units must be"):
        fused.store_blocks_int4(k, v, units[:, :-2].contiguous(), completed, BS)
    bad = slots.clone()
    bad[0, 1] = 10 * BS
    with pytest.raises(RuntimeError, match="tail slot 320 is outside the pool"):
        fused.store_tail_int4(k, v, units, bad, BS)
    bad = chunks.clone()
    bad[1, 4] = 11
    with pytest.raises(RuntimeError, match="tail unit 11 is outside the pool"):
        fused.attention_int4(q, k, v, units, bad, table, BS, 0, 0.125, 0.0)
    with pytest.raises(RuntimeError, match="outside its block table"):
        fused.attention_int4(q, k, v, units, chunks, table[:, :3].contiguous(), BS, 0, 0.125, 0.0)
    assert torch.equal(units, before)  # nothing was written


@pytest.mark.reference
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (200, 0.0), (0, 30.0)])
def test_a_long_decode_row_matches_its_reference_on_any_thread_count(window, softcap):
    """A decode row over 300 positions (ten blocks, the online softmax carried across them) beside a short one,
    against the reference, on 1, 2 and 4 threads."""
    fused = _fused()
    g = torch.Generator().manual_seed(7)
    units = kv_int4.allocate(1, 16, BS, HKV, D)[0]
    tables = {"A": list(range(10)), "B": [12, 13]}
    tails = {"A": (10, 11), "B": (14, 15)}
    for name, length in (("A", 300), ("B", 40)):
        k = torch.randn(length, HKV, D, generator=g) * (1 + 9 * (torch.arange(D) == 5))
        _write(REF, units, k, torch.randn(length, HKV, D, generator=g), 0, 0, tables[name], tails[name])
    q, k, v = (torch.randn(2, n, D, generator=g) for n in (H, HKV, HKV))
    chunks = torch.tensor([[0, 1, 300, *tails["A"]], [1, 1, 40, *tails["B"]]])
    table = torch.tensor([tables["A"], tables["B"] + [0] * 8])
    args = (units, chunks, table, BS, window, D ** -0.5, softcap)
    want = REF.attention_int4(q, k, v, *args)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            torch.testing.assert_close(fused.attention_int4(q, k, v, *args), want, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.unit
def test_the_int4_backend_refuses_storage_it_cannot_read():
    from server.attention import Int4Backend
    from server.attention.base import AttentionSpec

    spec = AttentionSpec(H, HKV, D, D ** -0.5)
    units = kv_int4.allocate(2, 4, BS, HKV, D)
    Int4Backend(units, BS, [spec, spec], REF)  # what it reads
    with pytest.raises(ValueError, match="takes no scales or rotation"):
        Int4Backend(units, BS, [spec, spec], REF, kv_rotation=(64, 64))
    with pytest.raises(ValueError, match="one KV head count and head_dim"):
        Int4Backend(units, BS, [spec, AttentionSpec(H, H, D, D ** -0.5)], REF)
    with pytest.raises(ValueError, match="int4 KV storage must be"):
        Int4Backend(units[:1], BS, [spec, spec], REF)
    with pytest.raises(ValueError, match="int4 KV storage must be"):
        Int4Backend(units.view(torch.int8), BS, [spec, spec], REF)
    from server.batch import StepInputs

    backend = Int4Backend(units, BS, [spec, spec], REF)
    i64 = torch.zeros(1, dtype=torch.int64)
    step = StepInputs(i64, i64, i64, i64, decode=[(5, [0])], chunks=[], block_size=BS)
    with pytest.raises(ValueError, match="needs each row's sequence's tail"):
        backend.prepare(step)
    step.tails = [[1, 2]]
    assert backend.prepare(step).chunks.tolist() == [[0, 1, 5, 1, 2]]
