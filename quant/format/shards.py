"""Sharded safetensors, written one tensor at a time and read back memory-mapped.

A layer-streamed build never holds the whole quantized model: each tensor goes to disk as soon as its
layer is done. safetensors puts the header (names, dtypes, offsets) before the data, so a shard starts
with a reserved header area; when the shard is closed its header is written there, padded with spaces
(which the format allows). A header that outgrew its reserve is handled by rewriting the shard once.

Alignment: the data area starts at a multiple of ALIGN bytes and tensors whose size is not a multiple of
ALIGN (scalars, odd biases and norms: the small ones) are held back and written last in their shard, so
that every other tensor starts ALIGN-aligned in the memory map; the format allows no gaps between tensors,
and the CPU int8 kernels fault on misaligned weights.

Layout, as transformers writes it: one `model.safetensors` when everything fits in one shard, else
`model-0000k-of-0000n.safetensors` and `model.safetensors.index.json` (`weight_map`: name -> file).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from quant.errors import ArtifactError
from quant.format.artifact import WEIGHTS, mmap_safetensors

INDEX = "model.safetensors.index.json"
ALIGN = 64
_DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def header_reserve(names, per_name: int = 5) -> int:
    """Header bytes to reserve for a shard of a model whose float state has `names`: quantizing turns one
    weight into up to `per_name` tensors (qweight, qzeros, scales, g_idx, bias), each entry about its name
    plus 100 bytes of JSON. An underestimate costs one rewrite of the shard, not a wrong file."""
    total = sum(per_name * (len(n) + 100) for n in names) + 256
    return _aligned_header(total)


def _aligned_header(n: int) -> int:
    """The smallest header length >= n that puts the data (after the 8-byte length) on ALIGN bytes."""
    return n + (-(8 + n)) % ALIGN


class _Shard:
    def __init__(self, path: Path, reserve: int):
        self.path, self.reserve = path, _aligned_header(reserve)
        self.f = open(path, "wb")
        self.f.write(b"\0" * (8 + self.reserve))
        self.entries: dict[str, dict] = {}
        self.size = 0  # data bytes written or held back
        self.held: list[tuple[str, torch.Tensor]] = []  # tensors of a size that would misalign the next

    def add(self, name: str, t: torch.Tensor) -> None:
        t = t.detach().to("cpu").contiguous()
        if (t.numel() * t.element_size()) % ALIGN:
            self.held.append((name, t.clone()))  # its own copy: the module it came from is released
        else:
            self._write(name, t)
        self.size += t.numel() * t.element_size()

    def _write(self, name: str, t: torch.Tensor) -> None:
        start = self.f.tell() - 8 - self.reserve
        nbytes = t.numel() * t.element_size()
        if nbytes:
            self.f.write(t.reshape(-1).view(torch.uint8).numpy().data)
        self.entries[name] = {"dtype": _DTYPE_CODES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [start, start + nbytes]}

    def close(self) -> None:
        for name, t in self.held:
            self._write(name, t)
        self.held = []
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.entries}, separators=(",", ":")).encode()
        if len(header) <= self.reserve:
            self.f.seek(0)
            self.f.write(self.reserve.to_bytes(8, "little") + header + b" " * (self.reserve - len(header)))
            self.f.close()
            return
        # The reserve was too small: write the real header, then move the data behind it.
        self.f.close()
        padded = header + b" " * (_aligned_header(len(header)) - len(header))
        tmp = self.path.with_suffix(".rewrite")
        with open(self.path, "rb") as src, open(tmp, "wb") as dst:
            dst.write(len(padded).to_bytes(8, "little") + padded)
            src.seek(8 + self.reserve)
            shutil.copyfileobj(src, dst, 1 << 24)
        os.replace(tmp, self.path)


class ShardWriter:
    """Writes tensors into shards of at most `max_shard_bytes` of data each (a single larger tensor gets
    a shard of its own) inside `root`; `finish()` names them and writes the index."""

    def __init__(self, root: Path, max_shard_bytes: int, reserve: int):
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.root, self.max_bytes, self.reserve = Path(root), max_shard_bytes, reserve
        self.shards: list[_Shard] = []
        self.names: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.names:
            raise ValueError(f"tensor {name} written twice")
        if tensor.dtype not in _DTYPE_CODES:
            raise ValueError(f"tensor {name} has dtype {tensor.dtype}, which safetensors cannot store")
        nbytes = tensor.numel() * tensor.element_size()
        cur = self.shards[-1] if self.shards else None
        if cur is None or (cur.size and cur.size + nbytes > self.max_bytes):
            if cur is not None:
                cur.close()
            cur = _Shard(self.root / f".shard-{len(self.shards):05d}.tmp", self.reserve)
            self.shards.append(cur)
        cur.add(name, tensor)
        self.names.add(name)

    def add_state(self, state: dict[str, torch.Tensor]) -> None:
        for name, t in state.items():
            self.add(name, t)

    @property
    def bytes_written(self) -> int:
        return sum(s.size for s in self.shards)

    def finish(self) -> list[str]:
        """Close the last shard and give every shard its final name; returns the file names."""
        if not self.shards:
            raise ValueError("no tensors were written")
        self.shards[-1].close()
        n = len(self.shards)
        if n == 1:
            os.replace(self.shards[0].path, self.root / WEIGHTS)
            return [WEIGHTS]
        weight_map, files = {}, []
        for k, s in enumerate(self.shards, start=1):
            name = shard_name(k, n)
            os.replace(s.path, self.root / name)
            weight_map.update({t: name for t in s.entries})
            files.append(name)
        index = {"metadata": {"total_size": self.bytes_written}, "weight_map": dict(sorted(weight_map.items()))}
        (self.root / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return [*files, INDEX]


def read_weights(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the model dir `root` (one file, or shards with their index), memory-mapped."""
    root = Path(root)
    single, index = root / WEIGHTS, root / INDEX
    if single.is_file():
        return mmap_safetensors(single)
    if not index.is_file():
        raise ArtifactError(f"damaged artifact: neither {single} nor {index} is there")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ArtifactError(f"damaged artifact: {index} is not a safetensors index ({e})") from e
    out: dict[str, torch.Tensor] = {}
    for name in files:
        if Path(name).name != name or not (root / name).is_file():
            raise ArtifactError(f"damaged artifact: {index} names shard {name!r}, which is not in {root}")
        tensors = mmap_safetensors(root / name)
        if stray := sorted(t for t in tensors if weight_map.get(t) != name):
            raise ArtifactError(f"damaged artifact: {root / name} holds {stray[0]}, which {index} places elsewhere")
        out.update(tensors)
    if missing := sorted(set(weight_map) - set(out)):
        raise ArtifactError(f"damaged artifact: {index} lists {missing[0]}, which no shard holds")
    return out
