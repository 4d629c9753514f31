"""GPTQ: the algorithm's invariants, the GPTQ v1/v2 checkpoint format bit for bit, the int4 kernels
against their reference, and the staged layer execution against the plain layer."""

from __future__ import annotations

import pytest
import torch

from quant.build import gptq as G
from quant.errors import ConfigError
from quant.runtime import int4
from quant.runtime import primitives as P
from quant.runtime.kernels import int4_layout


def _problem(n=64, k=256, rows=2048, seed=0, corr=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(rows, k, generator=g)
    if corr:  # correlated inputs, as real activations are: this is where GPTQ beats RTN
        x = x @ (torch.eye(k) + 0.3 * torch.randn(k, k, generator=g) / k**0.5)
        x[:, :4] *= 20  # a few outlier channels
    h = 2 * x.t() @ x / rows
    return w, x, h


def _layer_loss(x, w, q) -> float:
    return float((x @ w.t() - x @ q.dequantize().t()).pow(2).mean())


@pytest.mark.unit
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_beats_rtn_on_the_layer_loss(act_order, sym):
    w, x, h = _problem()
    q_rtn = G.rtn(w, 4, 64, sym)
    q_gptq = G.gptq(w, h, 4, 64, sym, act_order=act_order)
    assert q_gptq.fallback is None
    assert _layer_loss(x, w, q_gptq) < 0.8 * _layer_loss(x, w, q_rtn)


def _reference_gptq(w, h, group, sym, damp=0.01, int8=False):
    """The textbook form: one column at a time, explicit inverse Hessian, OBS downdate after each
    column; no Cholesky, no lazy batches. Slow and plain. `int8`: W8A8's grid, [-127, 127], scale absmax / 127."""
    w = w.clone().float()
    h = h.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0])
    hinv = torch.linalg.inv(h.double())
    codes = torch.zeros_like(w, dtype=torch.int32)
    for i in range(w.shape[1]):
        if i % group == 0 and int8:
            s, z = w[:, i : i + group].abs().amax(1) / 127, 0.0
        elif i % group == 0:
            s, z = G.group_params(w[:, i : i + group], 4, sym)
        q = torch.clamp(torch.round(w[:, i] / s) + z, *((-127, 127) if int8 else (0, 15)))
        codes[:, i] = q.int()
        d = hinv[i, i]
        err = ((w[:, i] - s * (q - z)) / d).double()
        w[:, i + 1 :] -= (err[:, None] * hinv[i, i + 1 :][None, :]).float()
        hinv = hinv - hinv[:, i : i + 1] @ hinv[i : i + 1, :] / d
    return codes


@pytest.mark.reference
@pytest.mark.parametrize("sym", [True, False])
def test_blocked_cholesky_gptq_equals_the_textbook_algorithm(sym):
    w, _, h = _problem(n=32, k=256)
    assert torch.equal(G.gptq(w, h, 4, 64, sym, block=128).codes, _reference_gptq(w, h, 64, sym))


@pytest.mark.reference
def test_int8_grid_gptq_equals_the_textbook_algorithm_and_beats_rounding():
    # W8A8's weights: one group per row on the symmetric int8 grid of quant.runtime.primitives.
    w, x, h = _problem(n=32, k=256)
    q = G.gptq(w, h, group_size=256, grid=G.Grid.int8(), block=64)
    assert q.fallback is None and q.bits == 8
    assert torch.equal(q.codes, _reference_gptq(w, h, 256, True, int8=True))
    assert int(q.codes.abs().max()) <= 127 and torch.equal(q.zeros, torch.zeros_like(q.zeros))
    codes, scale = P.quantize_weight_sym(w)
    assert torch.equal(q.scales[0], scale)  # the row scales are round-to-nearest's: only the codes move
    rtn = P.dequantize_weight(codes, scale)
    loss = float((x @ w.t() - x @ q.dequantize().t()).pow(2).mean())
    assert loss < 0.8 * float((x @ w.t() - x @ rtn.t()).pow(2).mean())


@pytest.mark.unit
def test_int8_grid_gptq_with_identity_hessian_is_quantize_weight_sym():
    w, _, _ = _problem()
    q = G.gptq(w, torch.eye(256) * 2, group_size=256, grid=G.Grid.int8(), act_order=True)
    assert torch.equal(q.codes.to(torch.int8), P.quantize_weight_sym(w)[0])


def _range_error(w, s, z, importance=1.0):
    """(N,) the range search's criterion, written plainly: |w - q|^CLIP_NORM of w (N, g) on the 4-bit grid of
    (s, z), each column weighed by `importance`."""
    q = torch.clamp(torch.round(w / s[:, None]) + z[:, None], 0, 15)
    return ((s[:, None] * (q - z[:, None]) - w).abs().pow(G.CLIP_NORM) * importance).sum(1)


@pytest.mark.unit
@pytest.mark.parametrize("sym", [True, False])
def test_the_range_search_never_rounds_a_group_worse_and_only_shrinks_it(sym):
    w, _, _ = _problem(n=64, k=64)
    plain, searched = G.group_params(w, 4, sym), G.group_params(w, 4, sym, clip=True)
    assert bool((_range_error(w, *searched) <= _range_error(w, *plain) * (1 + 1e-6)).all())
    assert bool((searched[0] <= plain[0]).all()) and int((searched[0] < plain[0]).sum()) > 32  # most rows shrink
    q = G.gptq(w, torch.eye(64) * 2, 4, 64, sym, grid=G.Grid.uint(4, sym, clip=True))
    assert torch.equal(q.scales[0], searched[0])  # GPTQ takes the searched parameters


@pytest.mark.unit
@pytest.mark.parametrize("act_order", [True, False])
def test_the_range_search_weighs_each_column_by_its_inputs_energy(act_order):
    w, _, _ = _problem(n=64, k=128)
    energy = torch.rand(128, generator=torch.Generator().manual_seed(3)) * 4 + 0.01  # (K,)
    energy[::16] = 400.0  # a loud input per 16: its weights' errors dominate the output's
    for g in range(2):
        cols = slice(64 * g, 64 * (g + 1))
        wg, e = w[:, cols], energy[cols]
        plain = G.group_params(wg, 4, True, clip=True)
        weighed = G.group_params(wg, 4, True, clip=True, importance=e)
        assert bool((_range_error(wg, *weighed, e) <= _range_error(wg, *plain, e) * (1 + 1e-6)).all())
        assert not torch.equal(weighed[0], plain[0])  # the weights change the choice
    # GPTQ weighs by diag(H); a diagonal H moves no error, so the codes are the weighted search's rounding
    q = G.gptq(w, torch.diag(energy), 4, 64, True, act_order=act_order, grid=G.Grid.uint(4, True, clip=True))
    for g in range(2):
        cols = slice(64 * g, 64 * (g + 1))
        assert torch.equal(q.scales[g], G.group_params(w[:, cols], 4, True, clip=True, importance=energy[cols])[0])


@pytest.mark.unit
def test_gptq_with_identity_hessian_is_rtn():
    # Uncorrelated unit-variance inputs: no error is worth moving, GPTQ must round to nearest.
    w, _, _ = _problem()
    q = G.gptq(w, torch.eye(256) * 2, 4, 64, True)
    r = G.rtn(w, 4, 64, True)
    assert torch.equal(q.codes, r.codes) and torch.equal(q.scales, r.scales)


@pytest.mark.unit
def test_codes_and_grid_are_in_range():
    w, _, h = _problem()
    q = G.gptq(w, h, 4, 64, True)
    assert q.codes.dtype == torch.int32 and int(q.codes.min()) >= 0 and int(q.codes.max()) <= 15
    assert torch.equal(q.zeros, torch.full_like(q.zeros, 8))  # symmetric: the grid's midpoint
    assert q.scales.shape == (4, 64) and torch.equal(q.scales, q.scales.half().float())


@pytest.mark.unit
def test_dead_columns_are_zeroed():
    w, x, _ = _problem()
    x[:, 7] = 0
    h = 2 * x.t() @ x / x.shape[0]
    q = G.gptq(w, h, 4, 64, False)
    assert torch.equal(q.dequantize()[:, 7], torch.zeros(64))


@pytest.mark.unit
def test_cholesky_failure_falls_back_to_rtn():
    w, _, _ = _problem()
    q = G.gptq(w, -torch.eye(256), 4, 64, True)  # negative definite: no damping helps
    assert q.fallback and "Cholesky" in q.fallback
    assert torch.equal(q.codes, G.rtn(w, 4, 64, True).codes)


@pytest.mark.unit
def test_damping_grows_until_cholesky_succeeds():
    w, x, _ = _problem(rows=16)  # rank-deficient Hessian
    h = 2 * x.t() @ x / 16
    h -= torch.eye(256) * float(torch.diag(h).mean()) * 0.02  # pushes it indefinite at the default damp
    q = G.gptq(w, h, 4, 64, True, damp=0.01)
    assert q.fallback is None and q.damp > 0.01


@pytest.mark.unit
def test_group_size_must_divide():
    w, _, h = _problem(k=256)
    with pytest.raises(ValueError, match="group size 96"):
        G.gptq(w, h, 4, 96, True)


@pytest.mark.reference
@pytest.mark.parametrize("v2,sym", [(False, True), (True, False)])
def test_checkpoint_format_bit_for_bit_with_the_v1_formula(v2, sym):
    w, _, h = _problem(n=64, k=256)
    q = G.gptq(w, h, 4, 64, sym)
    t = int4_layout.pack_gptq(q.codes, q.scales, q.zeros, 64, v2)
    assert t["qweight"].shape == (32, 64) and t["qweight"].dtype == torch.int32
    assert t["qzeros"].shape == (4, 8) and t["scales"].dtype == torch.float16
    assert torch.equal(t["g_idx"], torch.arange(256, dtype=torch.int32) // 64)
    # Unpack with the formula as GPTQ loaders write it, element by element on a slice of indices.
    qw, qz, sc, gi = (t[k] for k in ("qweight", "qzeros", "scales", "g_idx"))
    fake = q.dequantize()
    for k in range(0, 256, 37):
        for n in range(0, 64, 5):
            code = (int(qw[k // 8, n]) >> (4 * (k % 8))) & 0xF
            zero = (int(qz[gi[k], n // 8]) >> (4 * (n % 8))) & 0xF
            zero = zero if v2 else zero + 1
            value = float(sc[gi[k], n].float()) * (code - zero)
            assert value == float(fake[n, k]), (k, n)
    # And the whole tensor, vectorised.
    assert torch.equal(int4_layout.dequantize_gptq(qw, qz, sc, gi, v2), fake)


@pytest.mark.unit
def test_v1_cannot_hold_zero_point_zero_but_v2_can():
    codes = torch.zeros(8, 64, dtype=torch.int32)
    zeros = torch.zeros(1, 8, dtype=torch.int32)
    scales = torch.ones(1, 8)
    v1 = int4_layout.pack_gptq(codes, scales, zeros, 64, v2=False)
    v2 = int4_layout.pack_gptq(codes, scales, zeros, 64, v2=True)
    # The known v1 overflow: zero 0 is stored as -1 & 0xF = 15 and read back as 16.
    assert torch.equal(int4_layout.unpack_gptq(*v1.values(), v2=False)[1], zeros + 16)
    assert torch.equal(int4_layout.unpack_gptq(*v2.values(), v2=True)[1], zeros)


@pytest.mark.reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_kernel_matches_reference(dtype, rows, group):
    w, _, h = _problem(n=128, k=256)
    q = G.gptq(w, h, 4, group, True)
    m = int4.GPTQLinear.from_quantized(q, torch.randn(128) * 0.1, v2=False)
    m.prepare(dtype)
    # fp32 on a CPU with the C++ ops takes the int4pack layout too (rows / one-pass dequantize, no PyTorch kernel)
    assert m.layout == ("int4pack" if dtype == torch.bfloat16 or int4.fp32_int4pack_on_cpu() else "gptq")
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(3)).to(dtype)
    ref = m.reference_forward(x)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    paths = m.paths(dtype)
    assert dtype == torch.bfloat16 or "kernel" not in paths
    for name, call in {"forward": m, **paths}.items():
        fast = call(x).float()
        assert float((fast - ref).abs().max() / ref.abs().max()) < tol, name


def _act_order_checkpoint(k: int = 256, n: int = 128, group: int = 64):
    """A GPTQLinear as act-order (desc_act) writers store it: column perm[i] is in group i // group."""
    w, _, h = _problem(n=n, k=k)
    g = torch.Generator().manual_seed(5)
    perm = torch.randperm(k, generator=g)
    q = G.rtn(w[:, perm], 4, group)  # quantized in the permuted order
    m = int4.GPTQLinear.from_quantized(q, None, v2=False)
    inv = torch.argsort(perm)
    t = int4_layout.pack_gptq(q.codes[:, inv], q.scales, q.zeros, group, v2=False)  # codes back in checkpoint order
    m.qweight = t["qweight"]
    m.g_idx = (inv // group).to(torch.int32)  # column c sits at position inv[c] of the order
    return m, w


@pytest.mark.reference
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_act_order_checkpoint_is_computed_with_its_g_idx(dtype):
    m, w = _act_order_checkpoint()
    ref_w = m.dequantized(torch.float32)
    assert float((ref_w - w).abs().max()) < float(w.abs().max()) / 7  # the formula honours g_idx: close to w
    m.prepare(dtype)
    assert (m.perm is not None) == (dtype == torch.bfloat16 or int4.fp32_int4pack_on_cpu())
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(3)).to(dtype)
    fast = m(x).float()
    ref = m.reference_forward(x)
    assert float((fast - ref).abs().max() / ref.abs().max()) < (2e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.unit
def test_act_order_g_idx_with_unequal_groups_is_refused():
    from quant.errors import ArtifactError

    m, _ = _act_order_checkpoint()
    m.g_idx = torch.cat([torch.zeros(65, dtype=torch.int32), m.g_idx[65:]])
    with pytest.raises(ArtifactError, match="not 64 each"):
        m.prepare(torch.bfloat16)


@pytest.mark.unit
def test_int4_kernel_branch_is_used_for_decode(monkeypatch):
    w, _, h = _problem(n=128, k=256)
    m = int4.GPTQLinear.from_quantized(G.rtn(w, 4, 64), None, v2=False)
    m.prepare(torch.bfloat16)
    calls = []
    real = torch.ops.aten._weight_int4pack_mm_for_cpu
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", lambda x, *a: calls.append(x.shape) or real(x, *a))
    m(torch.randn(1, 256, dtype=torch.bfloat16))
    m(torch.randn(600, 256, dtype=torch.bfloat16))
    assert calls == [(1, 256), (600, 256)]
    x = torch.randn(1, 256)
    y = m(x)  # fp32: the dense path, on the codes read straight from the kernel's layout (no kernel call)
    assert calls[2:] == []
    torch.testing.assert_close(y, m.reference_forward(x), rtol=0, atol=1e-5)


@pytest.mark.reference
def test_staged_execution_equals_the_plain_layer(tokenizer, tmp_path):
    from conftest import make_tiny_llama
    from transformers import AutoModelForCausalLM

    from quant.build.families import plan
    from quant.build.sequential import (
        capture_layer_inputs,
        decoder_layers,
        exact_pass,
        run_layer,
        staged_pass,
    )
    from quant.build.smooth import layer_groups

    path = make_tiny_llama(tmp_path / "m", tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 1000, (3, 20), generator=torch.Generator().manual_seed(0))
    hidden, kws = capture_layer_inputs(model, ids)
    kw = kws[0]
    layer = decoder_layers(model)[0]
    lp = plan(model.config, layer)
    assert lp.staged
    seen, seen_exact = [], []

    def rows(xs):
        return sum(x.reshape(-1, x.shape[-1]).shape[0] for x in xs)

    staged = staged_pass(layer, hidden, kw, lambda names, xs: seen.append((names, rows(xs))), lp)
    generic = exact_pass(layer, hidden, kw, lambda names, xs: seen_exact.append((names, rows(xs))), lp,
                         layer_groups(layer, lp))
    plain = run_layer(layer, hidden, kw)
    assert torch.allclose(staged, plain, atol=1e-5) and torch.allclose(generic, plain, atol=1e-5)
    assert [n for n, _ in seen] == [
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",),
    ]
    assert all(count == 3 * 20 for _, count in seen)  # every calibration token reached every Hessian
    assert seen_exact == seen


@pytest.mark.reference
def test_group_size_choice(tokenizer, tmp_path):
    from conftest import make_tiny_llama
    from transformers import AutoModelForCausalLM

    from quant.build.schemes.w4 import choose_group_size

    path = make_tiny_llama(tmp_path / "m", tokenizer, hidden_size=96, intermediate_size=192)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert choose_group_size(model, None) == 32  # 96 is not a multiple of 128 or 64
    with pytest.raises(ConfigError, match="--group-size 64 does not divide .*96"):
        choose_group_size(model, 64)


@pytest.mark.reference
@pytest.mark.parametrize("k", [40, 128, 300])
def test_streamed_hessian_is_the_full_product(k):
    from quant.build.gptq import Hessian

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, 17, k, generator=g) for _ in range(3)] + [torch.randn(5, k, generator=g)]
    h = Hessian(k)
    for x in xs:
        h.add(x)
    x = torch.cat([t.reshape(-1, k) for t in xs])
    got = h.value()
    assert h.n == x.shape[0]
    assert torch.allclose(got, 2 * x.t() @ x / x.shape[0], atol=1e-5)
    assert torch.equal(got, got.t())


@pytest.mark.e2e
def test_a_gptq_checkpoint_without_our_manifest_is_served_as_written(tmp_path, tiny_model_dir, text_file):
    """A GPTQ checkpoint another tool wrote has no quant_manifest.json: load_for_serving reads it from its
    config (unverified: there are no hashes), and it computes what the same tensors compute as our artifact."""
    import shutil

    from conftest import run_cli

    from quant import load
    from quant.errors import ArtifactError
    from server.loading import load_for_serving

    art = tmp_path / "ours"
    assert run_cli("build", "--scheme", "w4a16", "--model", tiny_model_dir, "--out", art, "--calib", text_file,
                   "--calib-samples", "4", "--calib-seqlen", "32", "--no-progress") == 0
    other = tmp_path / "theirs"
    shutil.copytree(art, other)
    (other / "quant_manifest.json").unlink()
    from server.kv_pool import BlockPool, KVLayout
    from server.runner import ModelRunner, build_step

    model, tok, name, scheme = load_for_serving(str(other), torch.float32, "cpu", tmp_path / "cache")
    assert scheme == "gptq" and name == str(other)
    ids = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(0)).tolist()

    def engine_logits(m):  # (12, V) through the engine's model definition
        lay = KVLayout.from_config(m.config, torch.float32, block_size=16)
        pool = BlockPool(lay, lay.bytes_per_block * 4)
        step = build_step([], [(ids, 0, pool.try_reserve("a", len(ids)), True)], 16, torch.device("cpu"))
        step.sample_index = torch.arange(len(ids))
        return ModelRunner(m, pool.storage, 16, "sdpa").forward(step)

    ours = load(art, dtype=torch.float32).model  # transformers' model class over our verified artifact
    got = engine_logits(model)
    assert torch.equal(got, engine_logits(ours))  # the same tensors, read by name from the module tree
    with torch.no_grad():
        ref = ours(torch.tensor([ids])).logits[0]  # (12, V) transformers' forward
    assert (got - ref).abs().max().item() <= 1e-4 and ref.abs().max() > 1.0
    with pytest.raises(ArtifactError, match="not a quantserve artifact"):
        load(other)  # verified loading still wants the manifest
