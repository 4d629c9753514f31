"""The real thing: the embedded SmolLM2-135M-Instruct, converted from its GGUF, quantized and
evaluated on WikiText-2. Slow (a minute or two) but run in CI."""

from __future__ import annotations

import pytest
import torch

from conftest import SHARED_DATA
from quant import artifact, load, models
from quant.build import build
from quant.config import BuildConfig, CalibConfig, EvalConfig

pytestmark = pytest.mark.slow

TEST_TXT = SHARED_DATA / "test.txt"
VALID_TXT = SHARED_DATA / "valid.txt"
needs_data = pytest.mark.skipif(not TEST_TXT.is_file(), reason="WikiText-2 not present beside the checkout")


def test_default_model_converts_once_and_is_the_real_model(cache_dir):
    src = models.resolve(None, cache_dir)
    again = models.resolve(None, cache_dir)
    assert src.path == again.path and src.fingerprint == again.fingerprint
    model, tok = models.load_model(src)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size) == (30, 576, 3, 49152)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


@needs_data
def test_int8_sym_on_default_model_within_half_a_percent(tmp_path, cache_dir):
    cfg = BuildConfig(scheme="int8-sym", out=str(tmp_path / "a"), eval=EvalConfig(data=str(TEST_TXT), windows=8))
    out = build(cfg, cache_dir, progress=False)
    q = artifact.verify(out)["quality"]
    assert q["tokens"] == 8 * 511
    assert abs(q["delta_ppl_pct"]) < 0.5, q
    assert q["top1_agreement"] > 0.9
    art = load(out, dtype=torch.bfloat16)
    tok = art.tokenizer
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    gen = art.model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tok.decode(gen[0, ids.shape[1]:])


@needs_data
def test_w8a8_dynamic_on_default_model(tmp_path, cache_dir):
    cfg = BuildConfig(
        scheme="w8a8", out=str(tmp_path / "a"), act_dynamic=True,
        calib=CalibConfig(source=str(VALID_TXT), samples=8, seqlen=256),
        eval=EvalConfig(data=str(TEST_TXT), windows=4),
    )
    out = build(cfg, cache_dir, progress=False)
    q = artifact.read_manifest(out)["quality"]
    assert abs(q["delta_ppl_pct"]) < 3.0, q
