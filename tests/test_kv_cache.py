"""The quantized KV pool (``--kv-dtype int8 / fp8``): codes with a float16 scale per token per KV head (int8's keys
rotated by a Walsh-Hadamard transform first), written by ``store_kv_quant`` and read by attention kernels that
dequantize each row as they load it (and rotate each query to match rotated keys).

Tiers: the C++ store and attention ops against their PyTorch references (codes and scales bit for bit; attention
within fp32 rounding, windows and soft-capping included); the references against quant.runtime.kv_quant's round
trip; the served engine against transformers' forward with its attention reading K and V through the same round
trip (quant.build.evaluate.KVCacheView), token for token with logprobs within 1e-4; the pool's bytes and the
accounting; preemption and the prefix cache over quantized blocks; refusals."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy_exact, hf_causal_lm

from quant.build.evaluate import KVCacheView
from quant.runtime import hadamard, kv_quant
from quant.shape.kv_formats import FORMATS
from server import fastops
from server.config import EngineConfig
from server.engine import Engine
from server.kv_pool import BlockPool, KVLayout
from server.sampling_params import SamplingParams

CODES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
REF = fastops.Ops("eager")


def _fused():
    if not fastops.load():
        pytest.skip(f"fused ops unavailable: {fastops.unavailable_reason()}")
    return fastops.Ops("fused")


def _cache(fmt: str, slots: int, kv_heads: int, head_dim: int):
    return (torch.zeros(2, slots, kv_heads, head_dim, dtype=CODES[fmt]),
            torch.zeros(2, slots, kv_heads, dtype=torch.float16))


def _bits(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.uint8)


# ------------------------------------------------------------------------------------------- ops and references


# (format, the keys' rotation block, the values'): int8 as served (both rotated over head_dim 64), keys only, values
# only in blocks of 32, unrotated; fp8
STORED = [("int8", 64, 64), ("int8", 64, 0), ("int8", 0, 32), ("int8", 0, 0), ("fp8", 0, 0)]


@pytest.mark.reference
@pytest.mark.parametrize("fmt,key_block,value_block", STORED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv_quant_writes_the_references_codes_and_scales(fmt, key_block, value_block, dtype):
    fused = _fused()
    torch.manual_seed(0)
    T, Hkv, D, nslots = 37, 3, 64, 96
    k = (torch.randn(T, Hkv, D) * torch.logspace(-3, 2, T)[:, None, None]).to(dtype)  # tiny to large rows
    k[3] = 0  # an all-zero row keeps the smallest scale and zero codes
    qkv = torch.randn(T, 4 * Hkv * D).to(dtype)  # v as a strided slice of a fused projection's output
    v = qkv[:, Hkv * D: 2 * Hkv * D].view(T, Hkv, D)
    slots = torch.randperm(nslots)[:T]
    got, want = _cache(fmt, nslots, Hkv, D), _cache(fmt, nslots, Hkv, D)
    fused.store_kv_quant(k, v, *got, slots, key_block, value_block)
    REF.store_kv_quant(k, v, *want, slots, key_block, value_block)
    assert torch.equal(_bits(got[0]), _bits(want[0])) and torch.equal(got[1], want[1])
    # what the reference stores is kv_quant's round trip of the same vectors, exactly (rotated ones rotated back)
    plain = "fp8" if fmt == "fp8" else "int8-plain"
    for i, (x, block) in enumerate(((k, key_block), (v, value_block))):
        back = kv_quant.dequantize(want[0][i, slots], want[1][i, slots])
        x = x.float()
        if block:
            back, x = hadamard.rotate(back, block), hadamard.rotate(x, block)
        assert torch.equal(back, hadamard.rotate(kv_quant.round_trip(plain, x, key=i == 0), block) if block else
                           kv_quant.round_trip(plain, x, key=i == 0))
        if (key_block, value_block) == (64, 64):  # int8 as served: kv_quant's round trip of the format itself
            assert torch.equal(back, kv_quant.round_trip(fmt, k.float() if i == 0 else v.float(), key=i == 0))
    assert float(want[1][0, slots[3]].max()) == pytest.approx(2.0 ** -14, rel=1e-3)
    assert int(_bits(want[0][0, slots[3]]).max()) == 0


def _paged(fmt, fused, rotation=(0, 0), nblocks=12, bs=16, Hkv=2, D=64, dtype=torch.float32):
    codes, scales = _cache(fmt, nblocks * bs, Hkv, D)
    x = torch.randn(nblocks * bs, Hkv, D).to(dtype)
    fused.store_kv_quant(x * 2, torch.randn_like(x), codes, scales, torch.arange(nblocks * bs), *rotation)
    return codes, scales


@pytest.mark.reference
@pytest.mark.parametrize("fmt,key_block,value_block", STORED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (21, 0.0), (0, 30.0)])
def test_quantized_attention_kernels_match_their_references(fmt, key_block, value_block, dtype, window, softcap):
    """Decode rows and a prefill chunk over a fragmented block table, GQA (8 query heads on 2 KV heads): the C++
    kernels, dequantizing as they load, against the references, which dequantize the whole cache first."""
    fused = _fused()
    torch.manual_seed(1)
    bs, D = 16, 64
    codes, scales = _paged(fmt, fused, (key_block, value_block), dtype=dtype)
    tables = torch.tensor([[3, 7, 1, 0, 5, 9], [11, 2, 4, 6, 8, 10]])
    lens = torch.tensor([50, 96])
    q = torch.randn(2, 8, D).to(dtype)
    args = (tables, lens, bs, window, 0.125, softcap, key_block, value_block)
    got = fused.decode_attention_quant(q, codes, scales, *args)
    want = REF.decode_attention_quant(q, codes, scales, *args)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)
    qc = torch.randn(30, 8, D).to(dtype)
    args = (tables[1], 40, bs, window, D ** -0.5, softcap, key_block, value_block)
    got = fused.prefill_attention_quant(qc, codes, scales, *args)
    want = REF.prefill_attention_quant(qc, codes, scales, *args)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)


@pytest.mark.reference
def test_quantized_attention_equals_float_attention_over_the_dequantized_cache():
    """The quantized kernels read code * scale: the float kernels over a float32 cache holding exactly those values
    (rotated keys and values rotated back) give the same output, so the quantized path is the float path plus the
    format's rounding, nothing else: rotating q leaves q.k as it was, rotating the output back undoes the values'."""
    fused = _fused()
    torch.manual_seed(2)
    bs = 16
    codes, scales = _paged("int8", fused, (64, 64))
    values = hadamard.rotate(kv_quant.dequantize(codes, scales), 64)  # (2, slots, Hkv, D) fp32, both rotated back
    tables, lens = torch.tensor([[4, 2, 9, 1]]), torch.tensor([61])
    q = torch.randn(1, 8, 64)
    got = fused.decode_attention_quant(q, codes, scales, tables, lens, bs, 0, 0.125, 0.0, 64, 64)
    want = fused.decode_attention(q, values, tables, lens, bs, 0, 0.125, 0.0)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
    qc = torch.randn(20, 8, 64)
    got = fused.prefill_attention_quant(qc, codes, scales, tables[0], 41, bs, 0, 0.125, 0.0, 64, 64)
    want = fused.prefill_attention(qc, values, tables[0], 41, bs, 0, 0.125, 0.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)  # fp32 rounding: the rotation's sums come after O's


@pytest.mark.unit
def test_quantized_ops_refuse_mismatched_scales_and_out_of_range_slots():
    fused = _fused()
    codes, scales = _cache("int8", 32, 2, 16)
    k = torch.randn(2, 2, 16)
    with pytest.raises(RuntimeError, match="scales must be a contiguous"):
        fused.store_kv_quant(k, k, codes, scales[:, :16], torch.tensor([0, 1]), 0, 0)
    with pytest.raises(RuntimeError, match="scales must be a contiguous"):
        fused.store_kv_quant(k, k, codes, scales.float(), torch.tensor([0, 1]), 0, 0)
    with pytest.raises(RuntimeError, match="outside the cache"):
        fused.store_kv_quant(k, k, codes, scales, torch.tensor([0, 32]), 0, 0)
    with pytest.raises(RuntimeError, match="int8 or float8_e4m3fn"):
        fused.store_kv_quant(k, k, codes.float(), scales, torch.tensor([0, 1]), 0, 0)
    with pytest.raises(RuntimeError, match="key_block must be 0 or a power of two"):
        fused.store_kv_quant(k, k, codes, scales, torch.tensor([0, 1]), 12, 0)
    with pytest.raises(RuntimeError, match="value_block must be 0 or a power of two"):
        fused.store_kv_quant(k, k, codes, scales, torch.tensor([0, 1]), 0, 32)
    q, table = torch.randn(1, 4, 16), torch.tensor([[0, 1]])
    with pytest.raises(RuntimeError, match="scales must be a contiguous"):
        fused.decode_attention_quant(q, codes, scales[:, :, :1].contiguous(), table, torch.tensor([5]), 16, 0, 1.0, 0.0,
                                     0, 0)
    with pytest.raises(RuntimeError, match="outside"):
        fused.decode_attention_quant(q, codes, scales, table + 5, torch.tensor([5]), 16, 0, 1.0, 0.0, 0, 0)
    with pytest.raises(RuntimeError, match="key_block must be 0 or a power of two"):
        fused.prefill_attention_quant(q, codes, scales, table[0], 0, 16, 0, 1.0, 0.0, 32, 0)
    with pytest.raises(RuntimeError, match="value_block must be 0 or a power of two"):
        fused.decode_attention_quant(q, codes, scales, table, torch.tensor([5]), 16, 0, 1.0, 0.0, 0, 3)
    assert int(_bits(codes).abs().sum()) == 0 and float(scales.abs().sum()) == 0  # nothing was written


# ------------------------------------------------------------------------------------------- the pool


@pytest.mark.unit
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_quantized_pool_counts_its_codes_and_scales_exactly(fmt):
    """Bytes per token: codes and a float16 scale per K and V per head (66 of bf16's 128 a head: 0.516x); the pool's
    two tensors hold exactly the capacity it reports."""
    bf16 = KVLayout(30, 3, 64, torch.bfloat16, 16)
    lay = KVLayout(30, 3, 64, torch.bfloat16, 16, fmt)
    assert lay.kv_dtype == fmt and lay.storage_dtype == CODES[fmt]
    assert lay.rotation == ((64, 64) if fmt == "int8" else (0, 0))
    assert lay.bytes_per_token == 30 * 3 * FORMATS[fmt].bytes_per_token(64) == 30 * 3 * 2 * 66
    assert lay.bytes_per_token / bf16.bytes_per_token == pytest.approx(0.516, abs=1e-3)
    pool = BlockPool(lay, 8 * 2**20)
    held = pool.storage.untyped_storage().nbytes() + pool.scales.untyped_storage().nbytes()
    assert held == pool.capacity_bytes == pool.num_blocks * lay.bytes_per_block
    assert pool.num_blocks == 8 * 2**20 // lay.bytes_per_block > 1.9 * BlockPool(bf16, 8 * 2**20).num_blocks


@pytest.mark.unit
def test_the_prefix_cache_keys_blocks_on_the_kv_dtype():
    prompt = list(range(3, 40))
    keys = {}
    for fmt in (None, "int8", "fp8"):
        pool = BlockPool(KVLayout(2, 2, 16, torch.float32, 16, fmt), 2**20, allocate=False)
        keys[fmt] = pool._chain(prompt)
    assert len({tuple(k) for k in keys.values()}) == 3


@pytest.mark.unit
def test_the_pool_holds_no_format_it_cannot_serve():
    with pytest.raises(ValueError, match="holds no format 'int4-chan'"):
        KVLayout(2, 2, 16, torch.float32, 16, "int4-chan")
    with pytest.raises(ValueError, match="blocks of its key group, 32 tokens, not 16"):
        KVLayout(2, 2, 16, torch.float32, 16, "int4")
    with pytest.raises(ValueError, match="runs of 8 channels: 36 is not a multiple of 8"):
        KVLayout(2, 2, 36, torch.float32, 32, "int4")


# ------------------------------------------------------------------------------------------- the engine


def _engine(path, cache_dir, kv_dtype, fused=True, **kw) -> Engine:
    cfg = dict(memory_budget="2MiB", dtype="float32", max_prefill_tokens=24, kv_dtype=kv_dtype, fused_ops=fused)
    return Engine.from_path(str(path), EngineConfig(**cfg | kw), cache_dir)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.reference
@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
def test_the_engine_over_a_quantized_cache_is_transformers_reading_kv_through_the_format(
        tiny_model_dir, cache_dir, fmt, fused):
    """Greedy tokens and their logprobs, prefilled in chunks of 24 and decoded, equal transformers' float32 forward
    whose attention reads K and V through the format's round trip (the KV cache view quant eval --kv-dtype measures
    with; int4: each query's own block from the residual, earlier ones from int4): the served pool adds the
    format's rounding and nothing else."""
    if fused:
        _fused()
    hf = hf_causal_lm(tiny_model_dir)
    view = KVCacheView(hf, fmt)
    eng = _engine(tiny_model_dir, cache_dir, fmt, fused)
    try:
        assert eng.layout.kv_dtype == fmt and (eng.pool.scales is not None) == (fmt != "int4")
        assert eng.attention == ("int4" if fmt == "int4" else "sdpa")
        for seed in (1, 2):
            prompt = _prompt(57, seed)
            got = eng.complete(prompt, greedy_exact(12, logprobs=1))
            ids = torch.tensor([prompt + list(got.token_ids)])
            with torch.no_grad():
                lp = torch.log_softmax(view(ids).logits[0].float(), -1)  # (T, V)
            for i, (t, tl) in enumerate(zip(got.token_ids, got.logprobs, strict=True)):
                row = lp[len(prompt) - 1 + i]
                assert t == int(row.argmax()), (seed, i)
                assert abs(tl.logprob - float(row[t])) <= 1e-4, (seed, i)
            a = got.accounting
            assert a.kv_dtype == fmt and a.kv_bytes_per_token == eng.layout.bytes_per_token
            assert a.kv_bytes_reserved == a.kv_blocks_reserved * eng.layout.bytes_per_block
            assert a.kv_blocks_reserved == -(-(57 + 11) // eng.layout.block_size) + eng.layout.tail_blocks
        eng.pool.audit()
    finally:
        eng.close()


@pytest.mark.reference
def test_a_quantized_cache_changes_what_the_float_cache_gives_by_its_rounding_only(tiny_model_dir, cache_dir):
    """Against the float32 cache the int8 one moves logprobs by a little (its rounding), not by a wrong read: every
    greedy logprob within 0.05 of the float cache's over 40 tokens, most tokens the same."""
    base, q8 = _engine(tiny_model_dir, cache_dir, "auto"), _engine(tiny_model_dir, cache_dir, "int8")
    try:
        prompt = _prompt(30, 3)
        want = base.complete(prompt, greedy_exact(40, logprobs=1))
        got = q8.complete(prompt, greedy_exact(40, logprobs=1))
        same = [a == b for a, b in zip(got.token_ids, want.token_ids)]
        first = same.index(False) if False in same else len(same)
        assert first >= 10
        for a, b in zip(got.logprobs[:first], want.logprobs[:first]):
            assert abs(a.logprob - b.logprob) <= 0.05
        assert want.accounting.kv_bytes_per_token > 1.9 * got.accounting.kv_bytes_per_token
    finally:
        base.close(), q8.close()


@pytest.mark.reference
@pytest.mark.parametrize("fmt,blocks", [("int8", 10), ("int4", 7)])
def test_preemption_and_prefix_hits_over_a_quantized_cache_change_nothing(tiny_model_dir, cache_dir, fmt, blocks):
    """A pool of 10 blocks (int4: 7 of 32 tokens) running five requests at once (preemptions, recomputation, prompt blocks mapped from the
    prefix cache; int4: each request's tail taken and given back with its blocks) gives each request what a roomy
    engine of the same KV dtype gives it alone: the same tokens, logprobs within 1e-5. Recomputed K/V quantizes to
    the same codes."""
    roomy = _engine(tiny_model_dir, cache_dir, fmt)
    tight = _engine(tiny_model_dir, cache_dir, fmt, memory_budget=str(blocks * roomy.layout.bytes_per_block))
    try:
        shared = _prompt(32, 9)
        prompts = [shared + _prompt(6, s) for s in range(3)] + [_prompt(20, 7), _prompt(26, 8)]
        params = [greedy_exact(40, logprobs=1)] * 3 + [
            SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_new_tokens=40, min_tokens=40, logprobs=1)
            for s in (1, 2)]
        want = [roomy.complete(p, sp) for p, sp in zip(prompts, params)]
        first = tight.complete(prompts[0], params[0])  # publishes the shared prompt's blocks
        got = _together(tight, prompts, params)
        assert first.token_ids == want[0].token_ids
        assert tight.totals().preemptions > 0 and tight.pool.hit_tokens > 0
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids
            for a, b in zip(g.logprobs, w.logprobs, strict=True):
                assert abs(a.logprob - b.logprob) <= 1e-5
        tight.pool.audit()
        assert tight.pool.used_blocks == 0
    finally:
        roomy.close(), tight.close()


@pytest.mark.reference
def test_n_samples_over_an_int4_cache_are_each_its_seed_alone(tiny_model_dir, cache_dir):
    """n = 3 samples of a 70-token prompt over int4: the first prefills the two shared blocks, each other its own
    last block into a tail of its own; sample i equals a request of seed s + i alone, and the three held the
    shared blocks once and a tail each."""
    eng = _engine(tiny_model_dir, cache_dir, "int4")
    try:
        prompt = _prompt(70, 5)
        params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_new_tokens=20, min_tokens=20, logprobs=1)
        got = eng.samples(prompt, params, 3)
        for i, c in enumerate(got):
            alone = eng.complete(prompt, params.with_seed(11 + i))
            assert c.token_ids == alone.token_ids
            for a, b in zip(c.logprobs, alone.logprobs, strict=True):
                assert abs(a.logprob - b.logprob) <= 1e-5
            a = c.accounting
            assert a.kv_blocks_reserved == -(-(70 + 19) // 32) + 2  # its blocks and its tail
            assert a.kv_bytes_shared == 2 * eng.layout.bytes_per_block
        assert len({c.token_ids for c in got}) > 1
        eng.pool.audit()
        assert eng.pool.used_blocks == 0
    finally:
        eng.close()


def _together(engine: Engine, prompts, params):
    import queue

    from server import outputs as out

    q: queue.SimpleQueue = queue.SimpleQueue()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.submit(p, sp, lambda ev, i=i: q.put((i, ev)), request_id=f"r{i}")
    events: dict[int, list] = {}
    left = len(prompts)
    while left:
        i, ev = q.get(timeout=300)
        events.setdefault(i, []).append(ev)
        left -= ev.finished
    return [out.collect(events[i]) for i in range(len(prompts))]


@pytest.mark.unit
@pytest.mark.parametrize("kw,match", [
    (dict(kv_dtype="int3"), "--kv-dtype must be one of auto, bfloat16, float16, float32, int8, fp8, int4, got 'int3'"),
    (dict(kv_dtype="int4", device="cuda"), "served on the CPU only for now"),
    (dict(kv_dtype="int4", block_size=16), "int4 is held in blocks of its key group, 32 tokens; block size 16"),
    (dict(kv_dtype="float16", dtype="bfloat16"), "a float KV cache is held in the activations' dtype"),
    (dict(kv_dtype="int8", device="cuda"), "served on the CPU only for now"),
])
def test_kv_dtypes_the_engine_cannot_serve_are_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**kw).validate()


@pytest.mark.unit
def test_the_triton_backend_refuses_a_quantized_cache(monkeypatch):
    from quant.errors import UnsupportedModelError
    from server.attention.base import AttentionSpec
    from server.attention.triton_paged import TritonBackend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    codes, scales = torch.zeros(1, 2, 4, 16, 1, 16, dtype=torch.int8), torch.zeros(1, 2, 4, 16, 1, dtype=torch.half)
    with pytest.raises(UnsupportedModelError, match="does not read a quantized KV cache yet"):
        TritonBackend(codes, 16, [AttentionSpec(2, 1, 16, 0.25)], REF, kv_scales=scales)
