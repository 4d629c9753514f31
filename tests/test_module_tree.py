"""The engine's loading path without transformers' modeling classes: the config normalised out of process
(quant.format.model_config), the checkpoint as a module tree by name (quant.runtime.module_tree), and what the serving process
then does not import."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from archs import ARCHITECTURES

from quant.errors import ArtifactError, ModelSourceError, QuantError
from quant.format import model_config
from quant.runtime import module_tree
from server.kv_pool import BlockPool, KVLayout
from server.loading import load_for_serving
from server.runner import ModelRunner, build_step

ROOT = Path(__file__).resolve().parents[1]
IDS = torch.randint(100, 40000, (40,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_model_dir) -> Path:
    """An int8-sym artifact of the tiny Llama: our config block names every quantized module with its spec."""
    from conftest import run_cli

    out = tmp_path_factory.mktemp("tree") / "int8"
    assert run_cli("build", "--scheme", "int8-sym", "--model", str(tiny_model_dir), "--out", str(out),
                   "--no-progress") == 0
    return out


def engine_logits(model) -> torch.Tensor:
    """(40, V) fp32 at every position, through the engine's model definition."""
    lay = KVLayout.from_config(model.config, torch.float32, block_size=16)
    pool = BlockPool(lay, lay.bytes_per_block * 4)
    step = build_step([], [(IDS, 0, pool.try_reserve("a", len(IDS)), True)], 16, torch.device("cpu"))
    step.sample_index = torch.arange(len(IDS))
    return ModelRunner(model, pool.storage, 16, "sdpa").forward(step)


@pytest.mark.reference
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_the_module_tree_computes_what_transformers_model_class_does(arch, arch_dirs, cache_dir):
    """Same tensors, found by name: the engine over the tree equals the engine over transformers' model, bit for
    bit, and both hold the same bytes (the tied head is one tensor in both)."""
    from transformers import AutoModelForCausalLM

    path = arch_dirs(arch)
    tree, tok, _, scheme = load_for_serving(str(path), torch.float32, "cpu", cache_dir)
    assert isinstance(tree, module_tree.CheckpointModel) and scheme == "none"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    got = engine_logits(tree)
    assert torch.equal(got, engine_logits(hf))
    assert got.abs().max() > 1.0
    tied = tree.get_submodule("lm_head").weight
    assert tied.untyped_storage().data_ptr() == tree.get_input_embeddings().weight.untyped_storage().data_ptr()
    assert tok("hello world")["input_ids"] == tok.__class__.from_pretrained(path)("hello world")["input_ids"]


@pytest.mark.reference
@pytest.mark.parametrize("arch", ["gemma3", "llama3-rope", "phi3-partial-window"])
def test_the_config_normalised_in_a_child_equals_transformers_config_here(arch, arch_dirs, tmp_path):
    """The serving process reads the config a child process normalised (per-layer RoPE sets, layer types,
    defaults); every field equals what transformers' config class gives in process, and the second read is
    the cached one."""
    from transformers import AutoConfig

    path = arch_dirs(arch)
    cache = tmp_path / "cache"
    got = model_config.read(path, cache, in_process=False)
    want = AutoConfig.from_pretrained(path)
    skip = {"transformers_version", "architectures", "dtype"}
    want_d = {k: v for k, v in json.loads(want.to_json_string(use_diff=False)).items() if k not in skip}
    got_d = {k: getattr(got, k) for k in want_d}
    assert json.loads(json.dumps(got_d)) == want_d
    assert got.model_type == want.model_type
    assert getattr(got, "layer_types", None) == getattr(want, "layer_types", None)
    [cached] = (cache / "configs").iterdir()
    cached.write_text(json.dumps({**json.loads(cached.read_text()), "vocab_size": 7}))
    assert model_config.read(path, cache, in_process=False).vocab_size == 7  # read from the cache, no child


@pytest.mark.reference
def test_a_config_transformers_cannot_read_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_family", "hidden_size": 8}))
    for in_process in (True, False):
        with pytest.raises(ModelSourceError) as e:
            model_config.read(tmp_path, tmp_path / "cache", in_process=in_process)
        assert "\n" not in str(e.value) and "no_such_family" in str(e.value)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelSourceError, match="not a JSON object"):
        model_config.read(tmp_path, tmp_path / "cache")


@pytest.mark.reference
def test_quantized_tensors_that_do_not_fit_their_spec_are_refused_naming_the_module(tmp_path, artifact):
    """A GPTQ checkpoint (no manifest: nothing verifies its hashes) whose config names a module the weights do
    not hold, or whose tensors do not match their spec, is refused in one line naming the module."""
    other = tmp_path / "theirs"
    shutil.copytree(artifact, other)
    (other / "quant_manifest.json").unlink()
    cfg = json.loads((other / "config.json").read_text())
    qc = cfg["quantization_config"]
    name = next(iter(qc["modules"]))
    qc["modules"]["model.layers.0.no_such_proj"] = qc["modules"][name]
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ArtifactError, match="no_such_proj") as e:
        load_for_serving(str(other), torch.float32, "cpu", tmp_path / "cache")
    assert "\n" not in str(e.value)
    del qc["modules"]["model.layers.0.no_such_proj"]
    qc["modules"][name] = {**qc["modules"][name], "type": "no_such_type"}
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantError, match=name.replace(".", r"\.")):
        load_for_serving(str(other), torch.float32, "cpu", tmp_path / "cache")


@pytest.mark.e2e
def test_the_serving_process_imports_no_modeling_stack(artifact, tmp_path):
    """Load an artifact for the engine and complete a request in a fresh process: transformers' modeling
    classes, its config classes and torch dynamo (the ~190 MiB bench/served_memory.py measures) stay out."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from server.config import EngineConfig
        from server.engine import Engine
        from server.sampling_params import SamplingParams
        e = Engine.from_path({str(artifact)!r}, EngineConfig(memory_budget="8MiB", dtype="float32"),
                             Path({str(tmp_path / 'cache')!r}))
        with e:
            r = e.complete("Hello", SamplingParams(max_new_tokens=4, temperature=0.0))
        assert len(r.token_ids) == 4
        heavy = [m for m in ("transformers.modeling_utils", "transformers.utils.type_validators", "torch._dynamo",
                             "accelerate") if m in sys.modules]
        print("heavy:", heavy)
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "heavy: []" in p.stdout, p.stdout


@pytest.mark.reference
def test_small_float_tensors_are_copied_out_of_the_weights_map(arch_dirs, cache_dir):
    """Served in the file's dtype, the projections stay views of the memory map, but norm weights are copies:
    touching a mapped norm would fault its page-cache folio in, with the released neighbours around it."""
    from helpers import file_mappings

    path = arch_dirs("llama")
    tree, *_ = load_for_serving(str(path), torch.float32, "cpu", cache_dir)
    spans = [(a, b) for a, b, _ in file_mappings(path / "model.safetensors")]
    assert spans

    def mapped(t: torch.Tensor) -> bool:
        return any(a <= t.data_ptr() < b for a, b in spans)

    layer = tree.get_submodule("model.layers.0")
    assert mapped(layer.self_attn.q_proj.weight) and mapped(layer.mlp.down_proj.weight)
    assert not mapped(layer.input_layernorm.weight) and not mapped(tree.get_submodule("model.norm").weight)
    assert torch.equal(layer.input_layernorm.weight, load_file_tensor(path, "model.layers.0.input_layernorm.weight"))


def load_file_tensor(path: Path, name: str) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")[name]


@pytest.mark.reference
def test_a_checkpoint_that_is_not_a_module_tree_is_refused_in_one_line(tmp_path):
    """Tensors with no module path, or a name that is both a module's tensors and another module's parent, are
    refused naming them; a dir without a readable config.json is refused naming the file."""
    w = torch.zeros(4, 4)
    with pytest.raises(ArtifactError, match="top-level tensors") as e:
        module_tree.build({"weight": w}, {}, None)
    assert "\n" not in str(e.value)
    with pytest.raises(ArtifactError, match="'model.a' twice"):
        module_tree.build({"model.a.b.weight": w, "model.a.weight": w}, {}, None)
    with pytest.raises(ModelSourceError, match="config.json") as e:
        model_config.read(tmp_path, tmp_path / "cache")
    assert "\n" not in str(e.value)
