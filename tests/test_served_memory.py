"""A served quantized model holds its artifact's bytes: one runtime layout per weight, fused groups holding their
parts once, and the weights file's pages that loading replaced returned to the OS (checked in /proc, not only by
counting tensors)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import file_mappings
from torch import nn

from quant.build import gptq as G
from quant.format import artifact
from quant.runtime.int4 import GPTQLinear
from quant.runtime.kernels import rows as rowops
from quant.runtime.measure import weight_report

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def _mapped_rss(path: Path) -> int:
    return sum(rss for _, _, rss in file_mappings(path))


def _gptq_module(n=256, k=512, seed=0) -> GPTQLinear:
    g = torch.Generator().manual_seed(seed)
    return GPTQLinear.from_quantized(G.rtn(torch.randn(n, k, generator=g), 4, 64), None, v2=False)


@pytest.mark.unit
def test_int4pack_layout_replaces_the_gptq_tensors():
    m = _gptq_module()
    stored = m.dequantized(torch.float32)  # (N, K) from the GPTQ tensors
    m.prepare(torch.bfloat16)
    assert m.layout == "int4pack"
    assert all(getattr(m, n) is None for n in ("qweight", "qzeros", "scales", "g_idx"))
    held = {n for n, t in m.named_buffers() if t is not None}
    assert held == {"packed", "scales_zeros"}
    assert m.scales_zeros.dtype == torch.bfloat16 and m.scales_zeros.shape == (512 // 64, 256, 2)
    report = weight_report(nn.Sequential(m))
    assert report["quantized_weights"] == 256 * 512 // 2  # the codes once, at 4 bits
    assert report["quant_params"] == m.scales_zeros.numel() * 2
    # The weight read back from the kernel's layout is the stored one, up to the bf16 rounding of scale and zero.
    torch.testing.assert_close(m.dequantized(torch.float32), stored, atol=0.02 * float(stored.abs().max()), rtol=0)


@pytest.mark.unit
@pytest.mark.parametrize("ops", ["as built", "missing"])
def test_prepare_for_fp32_holds_one_layout_and_is_idempotent(ops, monkeypatch):
    from quant.runtime import int4

    if ops == "missing":  # a machine where the C++ ops did not build: the GPTQ tensors, dequantized per call
        monkeypatch.setattr(int4, "fp32_int4pack_on_cpu", lambda: False)
    m = _gptq_module()
    stored = m.dequantized(torch.float32)
    m.prepare(torch.float32)
    if int4.fp32_int4pack_on_cpu():  # the C++ ops read int4pack in fp32: no GPTQ tensors kept
        assert m.layout == "int4pack" and m.qweight is None and m.scales_zeros.dtype == torch.float32
        torch.testing.assert_close(m.dequantized(torch.float32), stored, atol=1e-6 * float(stored.abs().max()), rtol=0)
    else:  # dequantized from the checkpoint's tensors per call
        assert m.layout == "gptq" and m.packed is None and m.qweight is not None
    held = {n: id(t) for n, t in m.named_buffers() if t is not None}
    m.prepare(torch.float32)
    assert {n: id(t) for n, t in m.named_buffers() if t is not None} == held


@pytest.mark.unit
@linux
def test_release_unheld_pages_drops_only_what_is_not_held(tmp_path):
    from safetensors.torch import save_file

    pages = 64
    t = {n: torch.full((pages * 4096,), i + 1, dtype=torch.uint8) for i, n in enumerate(("a", "b", "c"))}
    path = tmp_path / "w.safetensors"
    save_file(t, str(path))
    mapped = artifact.mmap_safetensors(path)
    assert all(int(v.sum()) == v.numel() * (i + 1) for i, v in enumerate(mapped.values()))  # every page touched
    assert _mapped_rss(path) >= 3 * pages * 4096
    released = artifact.release_unheld_pages([mapped["b"]])
    assert released >= 2 * (pages - 1) * 4096
    assert _mapped_rss(path) <= (pages + 2) * 4096  # b, and the pages a and c share with b or the header
    # A released page is read back from the file if it is touched again: nothing is lost.
    assert int(mapped["a"].sum()) == pages * 4096 and int(mapped["c"].sum()) == 3 * pages * 4096


@pytest.mark.unit
@linux
def test_own_held_pages_moves_held_tensors_out_of_the_file(tmp_path):
    """A held tensor read in place would fault its released neighbours back (a whole page-cache folio per fault on
    some kernels), so the engine copies it: the same tensor object, the same values, none of it in the file."""
    from safetensors.torch import save_file

    pages = 64
    t = {n: torch.full((pages * 4096,), i + 1, dtype=torch.uint8) for i, n in enumerate(("a", "b", "c"))}
    path = tmp_path / "w.safetensors"
    save_file(t, str(path))
    mapped = artifact.mmap_safetensors(path)
    b, view = mapped["b"], mapped["b"].view(pages, 4096)  # a second tensor object on b's storage
    assert int(b.sum()) == b.numel() * 2
    assert artifact.own_held_pages([b, view, torch.zeros(3)]) == pages * 4096  # the file's tensor, once
    assert not any(a <= b.data_ptr() < e for a, e, _ in file_mappings(path))
    assert view.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # still one storage
    artifact.release_unheld_pages([b, view])
    assert int(b.sum()) == b.numel() * 2 and int(view[-1].sum()) == 4096 * 2  # read: nothing comes back
    assert _mapped_rss(path) <= 2 * 4096


def _served(tmp_path: Path, tokenizer, scheme: str):
    """(an engine serving a tiny Llama built with `scheme`, after one request; the artifact's weights file)."""
    from conftest import make_tiny_llama, run_cli

    from server.config import EngineConfig
    from server.engine import Engine
    from server.sampling_params import SamplingParams

    model_dir = make_tiny_llama(tmp_path / "m", tokenizer, hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2)
    out = tmp_path / scheme
    assert run_cli("build", "--model", model_dir, "--scheme", scheme, "--no-progress", "--out", out) == 0
    engine = Engine.from_path(str(out), EngineConfig(memory_budget="8MiB", threads=1, dtype="bfloat16"),
                              tmp_path / "cache")
    try:
        engine.complete("The history of the city", SamplingParams(temperature=0.0, max_new_tokens=4))
    except BaseException:
        engine.close()
        raise
    return engine, out / "model.safetensors"


@pytest.mark.e2e
@linux
def test_served_int8_reads_no_page_of_its_file(tmp_path, tokenizer):
    """An int8-sym artifact: o_proj and down_proj are not fused, so their codes would be read where the file maps
    them; the engine holds copies, and a request leaves the file's mapping with nothing resident."""
    engine, weights = _served(tmp_path, tokenizer, "int8-sym")
    try:
        file_bytes = weights.stat().st_size
        assert engine.weight_bytes <= 1.05 * file_bytes, (engine.weight_bytes, file_bytes)
        maps = file_mappings(weights)
        held = engine.runner.held_tensors()
        assert not any(a <= t.data_ptr() < b for t in held for a, b, _ in maps)
        assert sum(rss for _, _, rss in maps) <= 2 * 4096 * len(maps)
    finally:
        engine.close()


@pytest.mark.e2e
@linux
def test_served_w4a16_holds_its_artifact_bytes(tmp_path, tokenizer, text_file):
    """Load, fuse and serve a w4a16 artifact: weight_bytes within 5% of the file, every projection in the kernel's
    layout only, and the weights file resident only where a held tensor lies."""
    engine, weights = _served(tmp_path, tokenizer, "rtn-w4")
    try:
        gptq = [m for m in engine.model.modules() if isinstance(m, GPTQLinear)]
        assert gptq and all(m.layout == "int4pack" and m.qweight is None for m in gptq)
        fused = [m for ms in engine.runner.model.projections.by_role.values() for m in ms if m not in gptq]
        assert fused and all(m.layout == "int4pack" for m in fused)  # q/k/v and gate/up, their parts hold nothing
        assert all(m.packed is None for m in gptq if m._whole is not None)
        file_bytes = weights.stat().st_size
        assert engine.weight_bytes <= 1.05 * file_bytes, (engine.weight_bytes, file_bytes)
        held = engine.runner.held_tensors()
        maps = file_mappings(weights)
        assert maps, "the artifact is served from its memory map"
        in_file = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held
                   if any(a <= t.data_ptr() < b for a, b, _ in maps)}
        slack = 2 * 4096 * (len(in_file) + len(maps))  # each held tensor's partial first and last page
        # The embedding is held as int8 rows and the norms are copies (quant.runtime.loader.copy_small_params): nothing
        # held lies in the file, so after a request none of it is resident beyond partial pages.
        assert sum(in_file.values()) == 0
        assert _mapped_rss(weights) <= sum(in_file.values()) + slack
    finally:
        engine.close()


# ------------------------------------------------------------------------------------- int8 embeddings


@pytest.mark.reference
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_rows_lookup_and_head_match_their_reference(dtype):
    from server.layers.embedding import Int8Rows, check_mode

    if dtype == torch.float32 and not rowops.available(torch.empty(0, dtype=torch.int8)):
        pytest.skip("fp32 int8 embeddings need the C++ rows op")
    check_mode("int8", dtype)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1000, 64, generator=g).to(dtype)
    rows = Int8Rows(w, dtype)
    # bf16 heads take the pass on int16 block activations where it is built, at every row count
    assert (rows.rows16 is not None) == (dtype == torch.bfloat16 and rowops.rows16_built())
    ref = rows.dequantized()  # (V, H) fp32
    assert float((ref - w.float()).abs().max()) <= float(w.float().abs().amax(1).max()) / 127  # half a step per row
    ids = torch.tensor([3, 999, 3, 0])
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(rows.lookup(ids).float(), ref[ids], atol=tol, rtol=tol)
    assert rows.head(torch.zeros(0, 64).to(dtype)).shape == (0, 1000)  # a step that samples nothing
    for s in (1, 5, 64, 130):  # one kernel call, and 64-row pieces beyond it (bf16)
        h = torch.randn(s, 64, generator=g).to(dtype)
        got = rows.head(h).float()  # (S, V)
        want = h.float() @ ref.t()
        assert got.shape == (s, 1000) and got.dtype == torch.float32
        assert float((got - want).abs().max() / want.abs().max()) < (2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.reference
def test_an_int8_head_whose_triton_kernel_fails_at_start_says_so_and_takes_the_built_in_one(monkeypatch, caplog):
    """A GPU's int8 head launches its Triton kernels once at start; where they fail (here made to), one warning,
    and the head computes the same product through the built-in kernels: the engine does not go down."""
    from quant.runtime.kernels import triton_ops
    from server.layers.embedding import Int8Rows

    def broken(*args, **kwargs):
        raise RuntimeError("out of resources: shared memory\nsecond line")

    monkeypatch.setattr(triton_ops, "int8_matmul", broken)
    w = torch.randn(300, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    with caplog.at_level("WARNING", logger="server.layers.embedding"):
        rows = Int8Rows(w, torch.bfloat16, triton=True)
    assert not rows.triton
    assert [r.getMessage() for r in caplog.records] == [
        "the Triton int8 head (300 x 64) failed at start (RuntimeError: out of resources: shared memory): "
        "aten._weight_int8pack_mm instead"]
    h = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    want = h.float() @ rows.dequantized().t()
    assert float((rows.head(h).float() - want).abs().max() / want.abs().max()) < 2e-2


@pytest.mark.unit
def test_int8_embeddings_need_bfloat16_or_float32_and_name_the_flag(monkeypatch):
    from server.config import EngineConfig
    from server.layers import embedding

    with pytest.raises(ValueError, match="--embeddings int8 needs --dtype bfloat16 or float32 .* float16"):
        EngineConfig(embeddings="int8", dtype="float16").validate()
    if rowops.available(torch.empty(0, dtype=torch.int8)):
        EngineConfig(embeddings="int8", dtype="float32").validate()
    monkeypatch.setattr(embedding.rowops, "available", lambda t: False)  # a machine where the C++ ops did not build
    with pytest.raises(ValueError, match="--embeddings int8 with --dtype float32 needs the C\\+\\+ rows op"):
        EngineConfig(embeddings="int8", dtype="float32").validate()
    EngineConfig(embeddings="int8", dtype="bfloat16").validate()  # bf16 has PyTorch's int8 kernel without them
    with pytest.raises(ValueError, match="--embeddings must be one of auto, float, int8, got 'int4'"):
        EngineConfig(embeddings="int4").validate()


@pytest.mark.reference
@pytest.mark.parametrize("tie,dtype", [(True, "bfloat16"), (False, "bfloat16"), (True, "float32")])
def test_engine_with_int8_embeddings(tmp_path, tokenizer, tie, dtype):
    """The engine's logits with int8 embeddings equal a float model whose embedding (and head) hold the int8 rows'
    values; the float matrix is not held (tied: one int8 tensor for both), and weight_bytes says so."""
    import copy

    from conftest import make_tiny_llama
    from transformers import AutoModelForCausalLM

    from server.config import EngineConfig
    from server.engine import Engine
    from server.layers.embedding import quantize_rows
    from server.runner import build_step

    if dtype == "float32" and not rowops.available(torch.empty(0, dtype=torch.int8)):
        pytest.skip("fp32 int8 embeddings need the C++ rows op")
    dt = getattr(torch, dtype)
    d = make_tiny_llama(tmp_path / "m", tokenizer, tie_word_embeddings=tie)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=dt).eval()
    ref_model = copy.deepcopy(model)
    for lin in {id(m): m for m in (ref_model.get_input_embeddings(), ref_model.get_output_embeddings())}.values():
        q, s = quantize_rows(lin.weight.data)
        lin.weight.data = (q.float() * s.to(dt).float()[:, None]).to(dt)
    cfg = dict(memory_budget="4MiB", threads=1, dtype=dtype)
    float_engine = Engine(copy.deepcopy(model), tokenizer, EngineConfig(**cfg))
    engine = Engine(model, tokenizer, EngineConfig(**cfg, embeddings="int8"))
    assert engine.info.embeddings.startswith("int8") and float_engine.info.embeddings == "float"
    V, H = model.config.vocab_size, model.config.hidden_size
    matrices = 1 if tie else 2
    # float matrices become int8 codes plus one scale per row in the activation dtype
    b = dt.itemsize
    assert float_engine.weight_bytes - engine.weight_bytes == matrices * (V * H * b - (V * H + V * b))
    held = {t.untyped_storage().data_ptr() for t in engine.runner.held_tensors()}
    assert model.get_input_embeddings().weight.untyped_storage().data_ptr() not in held
    ids = list(range(300, 320))
    t = engine.pool.try_reserve("a", 20)
    got = engine.runner.forward(build_step([], [(ids, 0, t, True)], 16, torch.device("cpu")))[0]  # (V,)
    with torch.inference_mode():
        want = ref_model(torch.tensor([ids])).logits[0, -1].float()
    assert int(got.argmax()) == int(want.argmax())
    tol = 0.05 if dtype == "bfloat16" else 1e-4
    torch.testing.assert_close(got, want, atol=tol * float(want.abs().max()), rtol=0)


@pytest.mark.unit
def test_auto_embeddings_are_int8_only_for_quantized_models_in_bfloat16():
    from server.layers.embedding import resolve

    assert resolve("auto", torch.bfloat16, quantized=True) == "int8"
    assert resolve("auto", torch.bfloat16, quantized=False) == "float"  # served unquantized: as it is
    assert resolve("auto", torch.float32, quantized=True) == "float"  # fp32 is served as it is unless int8 is asked
    assert resolve("float", torch.bfloat16, quantized=True) == "float"
