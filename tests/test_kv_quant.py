"""KV cache formats (quant/runtime/kv_quant.py): each round trip against its definition, the bytes each costs, and
the KV cache view quant eval measures them with (quant/build/evaluate.py's KVCacheView)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from quant.runtime import hadamard
from quant.runtime.kv_quant import attend_held, held, round_trip, round_trip_format
from quant.shape.kv_formats import FORMATS


def _kv(tokens=40, heads=3, dim=64, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, heads, tokens, dim, generator=g)
    x[..., 5] *= 12  # an outlier channel, as keys have
    return x


@pytest.mark.unit
def test_int8_is_symmetric_per_token_and_head_within_half_a_step():
    x = _kv()
    y = round_trip("int8-plain", x, key=True)
    step = (x.abs().amax(-1, keepdim=True) / 127).half().float()
    assert ((y - x).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(y / step, torch.round(y / step))  # every value on its vector's grid
    assert torch.equal(round_trip("int8", torch.zeros(1, 1, 2, 64), key=False), torch.zeros(1, 1, 2, 64))
    # int8-rotk leaves values unrotated
    assert torch.equal(round_trip("int8-rotk", x, key=False), round_trip("int8-plain", x, key=False))


@pytest.mark.unit
def test_int8_rotates_keys_so_an_outlier_channel_costs_the_others_less():
    """int8's keys are quantized rotated (H x on its grid, read back as H Q(H x)): with an outlier channel, the other
    channels' error falls below the unrotated format's."""
    x = _kv()
    rot = round_trip("int8", x, key=True)
    step = (hadamard.rotate(x, 64).abs().amax(-1, keepdim=True) / 127).half().float()
    back = hadamard.rotate(rot, 64)  # the stored rotated key
    assert torch.allclose(back / step, torch.round(back / step), atol=1e-3)
    others = [c for c in range(64) if c != 5]
    err = {f: float((round_trip(f, x, key=True) - x)[..., others].pow(2).mean()) for f in ("int8", "int8-plain")}
    assert err["int8"] < 0.5 * err["int8-plain"], err


@pytest.mark.unit
def test_int4_rotated_keys_are_the_rotated_round_trip_rotated_back():
    x = _kv()
    plain = round_trip("int4-token", hadamard.rotate(x, 64), key=False)
    assert torch.allclose(round_trip("int4-token-rot", x, key=True), hadamard.rotate(plain, 64), atol=1e-5)
    assert torch.equal(round_trip("int4-token-rot", x, key=False), round_trip("int4-token", x, key=False))  # values per token
    # the rotation spreads the outlier channel: the keys' error is smaller than unrotated
    err = {f: float((round_trip(f, x, key=True) - x).pow(2).mean()) for f in ("int4-token", "int4-token-rot")}
    assert err["int4-token-rot"] < err["int4-token"]


@pytest.mark.unit
def test_int4_channel_keys_scale_each_channel_over_each_block_of_tokens():
    x = _kv(tokens=37)
    y = round_trip("int4-chan", x, key=True)
    for t0 in (0, 16, 32):
        blk, got = x[..., t0:t0 + 16, :], y[..., t0:t0 + 16, :]
        lo = blk.amin(-2).half().float()
        step = ((blk.amax(-2) - lo) / 15).half().float()  # (1, heads, dim)
        assert ((got - blk).abs() <= step[..., None, :] / 2 + 1e-3 * step[..., None, :] + 1e-5).all()
        assert torch.allclose((got - lo[..., None, :]) / step[..., None, :],
                              torch.round((got - lo[..., None, :]) / step[..., None, :]), atol=1e-3)


@pytest.mark.unit
def test_fp8_keeps_e4m3_codes_under_a_per_vector_scale():
    x = _kv()
    y = round_trip("fp8", x, key=False)
    s = (x.abs().amax(-1, keepdim=True) / 448).half().float()
    assert torch.equal((y / s).to(torch.float8_e4m3fn).float(), (y / s))  # exactly representable
    assert float(((y - x).abs() / x.abs().amax(-1, keepdim=True)).max()) < 2**-4


@pytest.mark.unit
def test_bytes_per_token_against_bf16():
    bf16 = 64 * 2
    assert FORMATS["int8"].bytes_per_vector(64) / bf16 == pytest.approx(66 / 128)  # <= 0.53
    assert FORMATS["fp8"].bytes_per_vector(64) == 66
    assert FORMATS["int4-token"].bytes_per_vector(64) / bf16 == pytest.approx(36 / 128)  # <= 0.3
    # per-channel keys: a scale and a minimum per channel per 16 tokens, 64 x 2 x 2 / 16 = 16 bytes a token
    assert FORMATS["int4-chan"].bytes_per_vector(64, key=True) == 32 + 16
    assert FORMATS["int4-chan"].bytes_per_token(64) / (2 * bf16) == pytest.approx((48 + 36) / 256)  # 0.328
    # KIVI over 32 tokens: 64 x 2 x 2 / 32 = 8 bytes of key scales a token: 0.297x; its residual holds 32 tokens'
    # K and V in int8 (66 bytes each) per sequence per KV head, or the keys only
    assert FORMATS["int4"].bytes_per_token(64) / (2 * bf16) == pytest.approx((40 + 36) / 256)
    assert FORMATS["int4"].residual_bytes(64) == 32 * 2 * 66
    assert FORMATS["int4-kres"].residual_bytes(64) == 32 * 66
    assert FORMATS["int8"].residual_bytes(64) == 0


@pytest.mark.unit
def test_a_float_cache_is_a_rounding_and_an_unknown_format_is_refused_by_name():
    x = _kv()
    assert torch.equal(round_trip("bfloat16", x, key=True), x.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="no KV cache format 'int3'"):
        round_trip("int3", x, key=True)


@pytest.mark.reference
def test_the_kv_view_changes_only_what_attention_reads(tiny_model_dir):
    """A float32 view equals the model; an int8 view moves the logits a little and leaves the model as it was."""
    from helpers import hf_causal_lm

    from quant.build.evaluate import KVCacheView

    model = hf_causal_lm(tiny_model_dir)
    ids = torch.randint(3, 400, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        same = KVCacheView(model, "float32")(ids).logits
        moved = KVCacheView(model, "int8")(ids).logits
        kivi = KVCacheView(model, "int4")(torch.cat([ids, ids[:, :20]], 1)).logits
        again = model(ids).logits
    assert torch.allclose(same, want, atol=1e-5) and torch.equal(again, want)
    # int4's first 32 positions read their own group, all from its int8 residual: the int8-rotv view's logits;
    # later positions read the first group's int4 codes
    with torch.no_grad():
        longer = KVCacheView(model, "int8-rotv")(torch.cat([ids, ids[:, :20]], 1)).logits
    assert torch.allclose(kivi[:, :32], longer[:, :32], atol=1e-4)
    assert not torch.allclose(kivi[:, 32:], longer[:, 32:], atol=1e-3)
    assert 0 < float((moved - want).abs().max()) < 0.05 * float(want.abs().max())
    with pytest.raises(ValueError, match="no KV cache format"):
        KVCacheView(model, "int3")


@pytest.mark.unit
def test_int8_rotates_values_as_well_as_keys():
    """int8 (served) rotates keys and values; int8-rotk the keys only; int8-plain neither."""
    x = _kv()
    plain = round_trip("int8-plain", hadamard.rotate(x, 64), key=False)
    assert torch.allclose(round_trip("int8", x, key=False), hadamard.rotate(plain, 64), atol=1e-6)
    assert torch.equal(round_trip("int8-rotk", x, key=True), round_trip("int8", x, key=True))
    assert torch.equal(round_trip("int8-rotk", x, key=False), round_trip("int8-plain", x, key=False))
    assert not torch.equal(round_trip("int8", x, key=False), round_trip("int8-rotk", x, key=False))


@pytest.mark.unit
def test_a_residual_format_holds_an_incomplete_group_in_its_residual():
    """int4: what later groups' queries read is int4-chan over 32 tokens of the int8 residual's values (values
    rotated); a position's own group reads the residual itself. int4-kres keeps no values in its residual."""
    x = _kv(tokens=70)
    done, own = held("int4", x, key=True)
    assert torch.equal(own, round_trip("int8-plain", x, key=True))
    assert torch.equal(done, round_trip_format(replace(FORMATS["int4-chan"], key_group=32), own, key=True))
    vdone, vown = held("int4", x, key=False)
    assert torch.equal(vown, round_trip("int8", x, key=False))  # int8-rotv's values: int8's
    assert held("int4-kres", x, key=False)[1] is None and held("int4-kres", x, key=True)[1] is not None
    assert held("int8", x, key=True)[1] is None


@pytest.mark.reference
def test_attention_over_held_positions_reads_each_query_s_own_group_from_the_residual():
    """attend_held against a per-query loop that builds each query's keys and values by hand."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 6, 40, 64, generator=g)
    k, v = _kv(tokens=40, seed=1), _kv(tokens=40, seed=2)
    kh, vh = held("int4", k, True), held("int4", v, False)
    qpos = torch.arange(40)
    visible = qpos[None, :] <= qpos[:, None]
    got = attend_held(q, kh, vh, 32, qpos, visible, 0.125)
    for i in (0, 17, 31, 32, 39):
        own = (qpos // 32) == i // 32
        kk = torch.where(own[:, None], kh[1][0], kh[0][0])[:, : i + 1].repeat_interleave(2, 0)  # (H, i + 1, D)
        vv = torch.where(own[:, None], vh[1][0], vh[0][0])[:, : i + 1].repeat_interleave(2, 0)
        want = torch.softmax(q[0, :, i : i + 1] @ kk.transpose(-1, -2) * 0.125, -1) @ vv
        torch.testing.assert_close(got[0, :, i], want[:, 0], atol=1e-5, rtol=1e-5)
    # no residual (int8): plain attention over the round trip
    plain = attend_held(q, held("int8", k, True), held("int8", v, False), 32, qpos, visible, 0.125)
    want = torch.nn.functional.scaled_dot_product_attention(q, round_trip("int8", k, True).repeat_interleave(2, 1),
                                                            round_trip("int8", v, False).repeat_interleave(2, 1),
                                                            is_causal=True, scale=0.125)
    torch.testing.assert_close(plain, want, atol=1e-5, rtol=0)
