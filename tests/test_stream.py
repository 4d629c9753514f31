"""Layer-streamed builds (quant.build.stream): the model lives on the meta device and one part at a time is
read from the checkpoint. Held to the same build over the model loaded whole, tensor for tensor, with
and without a LoRA adapter; one layer at a time is checked while the build runs."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from conftest import make_adapter

from quant.build import stream
from quant.build.config import BuildConfig, CalibConfig
from quant.build.pipeline import build
from quant.build.schemes import w4 as w4a16
from quant.build.sequential import decoder_layers
from quant.errors import ConfigError
from quant.format.shards import INDEX, read_weights
from quant.format.sources import ModelSource

pytestmark = pytest.mark.e2e


def _source(path) -> ModelSource:
    return ModelSource(str(path), "dir", str(path), "x")


def _resave(src, dst, **save_kwargs):
    """The model at `src` saved again with save_pretrained options (shards, pickled .bin)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(dst, **save_kwargs)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def sharded_dir(tiny_model_dir, tmp_path_factory):
    return _resave(tiny_model_dir, tmp_path_factory.mktemp("sharded") / "m", max_shard_size="100KB")


@pytest.fixture(scope="module")
def pickled_dir(tiny_model_dir, tmp_path_factory):
    """The model as a pickled pytorch_model.bin, which is read whole (transformers 5 writes safetensors only)."""
    from safetensors.torch import load_file

    d = _resave(tiny_model_dir, tmp_path_factory.mktemp("pickled") / "m")
    torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    return d


def _real(model) -> set[str]:
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.is_meta}


def test_parts_are_read_and_dropped_ties_kept(sharded_dir):
    assert (sharded_dir / INDEX).is_file()
    sm = stream.open_model(_source(sharded_dir), torch.float32, "cpu", log=lambda m: None)
    assert sm.streamed and not _real(sm.model)
    sm.load("model.layers.1")
    assert _real(sm.model) == {n for n, _ in sm.model.named_parameters() if n.startswith("model.layers.1.")}
    sm.release("model.layers.1")
    assert not _real(sm.model)
    # Nothing of the checkpoint stays mapped once the part is released: reading layer after layer does
    # not grow the process.
    gc.collect()
    maps = open("/proc/self/maps").read()
    assert not [f for f in sharded_dir.glob("*.safetensors") if str(f.resolve()) in maps]
    sm.load("", exclude=("model.layers", "lm_head"))
    # The tied head is the embedding: materialised with it, as one tensor.
    assert sm.model.lm_head.weight is sm.model.model.embed_tokens.weight
    assert _real(sm.model) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(sharded_dir, dtype=torch.float32)
    assert torch.equal(sm.model.model.embed_tokens.weight, ref.model.embed_tokens.weight)
    sm.release("", exclude=("model.layers",))
    assert not _real(sm.model) and sm.model.lm_head.weight is sm.model.model.embed_tokens.weight


def test_release_drops_the_weights_of_modules_swapped_out_of_the_part(sharded_dir):
    """Quantizing replaces a layer's Linears; the replaced modules still hold the weights read into them,
    and releasing the layer must drop those too (else every layer's float weights stay alive)."""
    sm = stream.open_model(_source(sharded_dir), torch.float32, "cpu", log=lambda m: None)
    sm.load("model.layers.0")
    attn = sm.model.model.layers[0].self_attn
    old = attn.q_proj
    assert not old.weight.is_meta
    attn.q_proj = torch.nn.Linear(old.in_features, old.out_features, bias=False)  # as a quantizer swaps it
    sm.release("model.layers.0")
    assert old.weight.is_meta and attn.q_proj.weight.is_meta
    assert not [n for n, group in sm._slots.items() for _, m, a in group if not m._parameters[a].is_meta]


def test_unstreamable_sources_are_loaded_whole_and_say_why(pickled_dir):
    said = []
    sm = stream.open_model(_source(pickled_dir), torch.float32, "cpu", log=said.append)
    assert not sm.streamed and "not a local safetensors checkpoint" in said[0]
    assert sm.reason and len(_real(sm.model)) == len(list(sm.model.named_parameters(remove_duplicate=False)))
    # Loaded whole, a released layer cannot come back, but a weight tied outside the part stays.
    sm.release("", exclude=("model.layers", "lm_head"))
    assert not sm.model.model.embed_tokens.weight.is_meta and sm.model.model.norm.weight.is_meta
    sm.release("model.layers.0")
    assert all(p.is_meta for p in sm.model.model.layers[0].parameters())


def _build(src, out, scheme, text_file, **kw):
    cfg = BuildConfig(scheme=scheme, model=str(src), out=str(out), calib=CalibConfig(text_file, 8, 64, 0), **kw)
    return build(cfg, out.parent, progress=False, log=lambda m: None)


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8", "int8-affine"])
def test_streamed_build_equals_the_whole_model_build(tmp_path, sharded_dir, pickled_dir, text_file, scheme):
    """Same source weights, one streamed (sharded safetensors) and one loaded whole (.bin): identical
    tensors in the artifact, with a LoRA adapter merged layer by layer in the streamed build."""
    adapter = make_adapter(sharded_dir, tmp_path / "ad", r=4, lora_alpha=8, target_modules="all-linear")
    arts = {}
    for name, src in (("streamed", sharded_dir), ("whole", pickled_dir)):
        arts[name] = read_weights(_build(src, tmp_path / name, scheme, text_file, lora=str(adapter)))
    a, b = arts["streamed"], arts["whole"]
    assert set(a) == set(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_one_layer_is_materialised_at_a_time(tmp_path, sharded_dir, text_file, monkeypatch):
    seen = []
    orig = w4a16.LayerQuantizer.quantize_layer

    def spy(self, li, layer):
        layers = decoder_layers(self.model)
        seen.append((li, [i for i, lay in enumerate(layers) if any(not p.is_meta for p in lay.parameters())],
                     self.model.model.embed_tokens.weight.is_meta))
        return orig(self, li, layer)

    monkeypatch.setattr(w4a16.LayerQuantizer, "quantize_layer", spy)
    out = _build(sharded_dir, tmp_path / "art", "w4a16", text_file)
    assert seen == [(0, [0], True), (1, [1], True)]
    manifest = json.loads((out / "quant_manifest.json").read_text())
    assert manifest["build"]["streamed"] and len(manifest["build"]["layer_seconds"]) == 2
    from quant.runtime.primitives import (
        bf16_matmul_is_faster,  # "auto": what this CPU measured, recorded
    )

    want = "bfloat16" if bf16_matmul_is_faster(torch.device("cpu")) else "float32"
    assert manifest["build"]["matmul_dtype"] == want
    est = manifest["memory"]["build_peak_estimate_bytes"]
    assert est["total"] == est["runtime"] + est["part"] + est["activations"] + est["solver"] > 0


def test_a_sharded_artifact_serves_like_a_single_file(tmp_path, sharded_dir, text_file):
    from quant import load

    one = _build(sharded_dir, tmp_path / "one", "w4a16", text_file)
    many = _build(sharded_dir, tmp_path / "many", "w4a16", text_file, max_shard_bytes=50_000)
    assert (many / INDEX).is_file() and not (many / "model.safetensors").exists()
    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a, b = load(one).model(ids).logits, load(many).model(ids).logits
    assert torch.equal(a, b)


def test_self_calibration_of_a_model_too_large_to_hold_is_refused(tmp_path, sharded_dir, monkeypatch):
    from quant.runtime import measure

    monkeypatch.setattr(measure, "available_bytes", lambda device: 1 << 20)
    cfg = BuildConfig(scheme="w4a16", model=str(sharded_dir), out=str(tmp_path / "art"))
    with pytest.raises(ConfigError, match="--calib self .* pass --calib FILE") as e:
        build(cfg, tmp_path, progress=False, log=lambda m: None)
    assert "\n" not in str(e.value) and not (tmp_path / "art").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".art")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("device,needle", [("cuda", "no CUDA device"), ("cuda:1", "no CUDA device"),
                                           ("tpu", "--device must be auto, cpu, cuda or cuda:N")])
def test_a_device_this_machine_lacks_is_refused_before_any_work(tmp_path, sharded_dir, text_file, device, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        _build(sharded_dir, tmp_path / "art", "w4a16", text_file, device=device)
    assert "\n" not in str(e.value) and not list(tmp_path.iterdir())


def test_an_unknown_matmul_dtype_is_refused_before_any_work(tmp_path, sharded_dir, text_file):
    with pytest.raises(ConfigError, match="--matmul-dtype must be one of auto, float32, bfloat16, got 'fp8'") as e:
        _build(sharded_dir, tmp_path / "art", "w4a16", text_file, matmul_dtype="fp8")
    assert "\n" not in str(e.value) and not list(tmp_path.iterdir())
