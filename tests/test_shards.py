"""Sharded safetensors written a tensor at a time (quant.format.shards): what the safetensors library and
transformers read back, the shard layout and index, the header-reserve overflow, damaged shards."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from quant.errors import ArtifactError
from quant.format.shards import INDEX, ShardWriter, header_reserve, read_weights


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "a.qweight": torch.randint(-2**31, 2**31 - 1, (8, 64), generator=g, dtype=torch.int32),
        "b.scales": torch.randn(4, 64, generator=g).half(),
        "b.weight": torch.randint(-128, 127, (64, 64), generator=g, dtype=torch.int8),
        "c.input_scale": torch.tensor(0.25),
        "c.mask": torch.rand(16, generator=g) > 0.5,
        "d.empty": torch.empty(0, 8),
        "e.bias": torch.randn(64, generator=g, dtype=torch.float64),
        "f.norm": torch.randn(7, generator=g).to(torch.bfloat16),  # 14 bytes: would misalign what follows
        "g.weight": torch.randint(-128, 127, (32, 64), generator=g, dtype=torch.int8),
    }


def _library_read(root, files) -> dict[str, torch.Tensor]:
    out = {}
    for f in files:
        if f.endswith(".safetensors"):
            with safe_open(str(root / f), "pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.mark.unit
@pytest.mark.parametrize("max_bytes,reserve", [(10**9, 4096), (3000, 4096), (10**9, 8), (3000, 16)])
def test_written_shards_read_back_exactly(tmp_path, max_bytes, reserve):
    """One file or many, with the header reserve large enough or overflowing (the shard is rewritten):
    the safetensors library and our memory-mapped reader both return every tensor bit for bit."""
    tensors = _tensors()
    w = ShardWriter(tmp_path, max_bytes, reserve)
    w.add_state(tensors)
    files = w.finish()
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.rewrite"))
    if max_bytes > 10**6:
        assert files == ["model.safetensors"]
    else:
        n = len(files) - 1
        assert n > 1 and files[-1] == INDEX
        assert files[:-1] == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
        index = json.loads((tmp_path / INDEX).read_text())
        assert set(index["weight_map"]) == set(tensors)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
        for name, file in index["weight_map"].items():
            with safe_open(str(tmp_path / file), "pt") as h:
                assert name in h.keys()
    for got in (_library_read(tmp_path, files), read_weights(tmp_path)):
        assert set(got) == set(tensors)
        for k, t in tensors.items():
            assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k
    # Every tensor of a size that keeps alignment starts 64-byte aligned in the memory map.
    mapped = read_weights(tmp_path)
    assert [k for k, t in tensors.items() if (t.numel() * t.element_size()) % 64 == 0 and t.numel()
            and mapped[k].data_ptr() % 64] == []


@pytest.mark.unit
def test_a_tensor_larger_than_a_shard_gets_a_shard_of_its_own(tmp_path):
    w = ShardWriter(tmp_path, 100, 1024)
    w.add("small", torch.zeros(4))
    w.add("big", torch.zeros(1000))
    w.add("small2", torch.zeros(4))
    files = w.finish()
    assert len(files) == 4  # three shards and the index
    assert json.loads((tmp_path / INDEX).read_text())["weight_map"]["big"] == files[1]


@pytest.mark.reference
def test_transformers_loads_a_sharded_model(tmp_path):
    """The layout is the one transformers reads: a tiny Llama written through ShardWriter in small
    shards loads with from_pretrained and gives the same logits."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    cfg.save_pretrained(tmp_path)
    state = model.state_dict()
    w = ShardWriter(tmp_path, 20_000, header_reserve(state))
    w.add_state(state)
    assert len(w.finish()) > 2
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (1, 12))
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.unit
def test_writer_refuses_misuse(tmp_path):
    w = ShardWriter(tmp_path, 1000, 256)
    w.add("x", torch.zeros(2))
    with pytest.raises(ValueError, match="written twice"):
        w.add("x", torch.zeros(2))
    with pytest.raises(ValueError, match="cannot store"):
        w.add("c", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="no tensors"):
        ShardWriter(tmp_path / "other", 1000, 256).finish()
    with pytest.raises(ValueError, match="positive"):
        ShardWriter(tmp_path, 0, 256)


def _sharded(tmp_path):
    w = ShardWriter(tmp_path, 3000, 4096)
    w.add_state(_tensors())
    return w.finish()


@pytest.mark.unit
def test_damaged_shard_sets_are_refused_naming_the_file(tmp_path):
    files = _sharded(tmp_path)
    index_path = tmp_path / INDEX
    index = json.loads(index_path.read_text())

    (tmp_path / files[1]).unlink()
    with pytest.raises(ArtifactError, match=files[1]):
        read_weights(tmp_path)

    _sharded(tmp_path)
    index["weight_map"]["a.weight"] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ArtifactError, match="elsewhere"):
        read_weights(tmp_path)

    index_path.write_text("{not json")
    with pytest.raises(ArtifactError, match="not a safetensors index"):
        read_weights(tmp_path)

    index_path.unlink()
    with pytest.raises(ArtifactError, match="neither"):
        read_weights(tmp_path)


@pytest.mark.unit
def test_an_index_that_misplaces_a_tensor_is_refused(tmp_path):
    _sharded(tmp_path)
    index_path = tmp_path / INDEX
    index = json.loads(index_path.read_text())
    names = sorted(index["weight_map"])
    a, b = next((x, y) for x in names for y in names if index["weight_map"][x] != index["weight_map"][y])
    index["weight_map"][a], index["weight_map"][b] = index["weight_map"][b], index["weight_map"][a]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ArtifactError, match="places elsewhere"):
        read_weights(tmp_path)
