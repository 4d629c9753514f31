"""The artifact directory: atomic writes, the manifest, hashes, verification, memory-mapped reads.

Layout: model.safetensors (or shards and their index, quant.format.shards), config.json (with
`quantization_config`), tokenizer files, quant_manifest.json. The manifest lists the sha256 of every
other file; `verify` refuses a damaged artifact naming the file. A build writes into a temporary sibling dir and renames it into place only
when complete, so an interrupted build leaves nothing at the target.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from quant.errors import ArtifactError

# The newest format this quantserve reads. An artifact is written with the oldest version that reads it right
# (`format_version`), so readers that predate a feature refuse the artifacts that use it instead of ignoring it.
# 2: a w8a8 module's spec may carry "rotate" (quant.runtime.hadamard: its weight stored rotated, its input rotated online).
FORMAT_VERSION = 2
MANIFEST = "quant_manifest.json"
WEIGHTS = "model.safetensors"
QUANT_METHOD = "quantserve"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def check_target(out: Path, force: bool) -> None:
    """Refuse an existing target (unless force) or an unwritable parent, before any work is done."""
    if out.exists() and not force:
        raise ArtifactError(f"output dir {out} already exists (pass --force to replace it)")
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"output path {out} exists and is not a directory")
    # Nothing is created here: a build that fails later must leave no trace, not even a parent dir.
    ancestor = out.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ArtifactError(f"cannot create output dir {out}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK):
        raise ArtifactError(f"cannot create output dir {out}: {ancestor} is not writable")


def staging_dir(out: Path) -> Path:
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))


def hash_files(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def format_version(modules: dict[str, dict]) -> int:
    """The oldest format version that reads an artifact of these module specs right."""
    return 2 if any("rotate" in spec for spec in modules.values()) else 1


def write_manifest(root: Path, manifest: dict, version: int) -> None:
    manifest = dict(manifest, format_version=version, files=hash_files(root))
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")


def commit(staging: Path, out: Path, force: bool) -> None:
    """Rename the finished staging dir onto `out`; with force, the old artifact is removed only after
    the new one is in place."""
    old = None
    if out.exists():
        if not force:
            raise ArtifactError(f"output dir {out} already exists (pass --force to replace it)")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    staging.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_manifest(root: Path) -> dict:
    root = Path(root)
    if not root.exists():
        raise ArtifactError(f"artifact not found: {root}")
    if not root.is_dir():
        raise ArtifactError(f"artifact path is not a directory: {root}")
    path = root / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"not a quantserve artifact: {path} is missing")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"damaged artifact: {path} is not valid JSON") from e
    if not isinstance(manifest, dict) or "format_version" not in manifest or "files" not in manifest:
        raise ArtifactError(f"not a quantserve artifact: {path} has no format_version/files")
    version = manifest["format_version"]
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ArtifactError(
            f"artifact {root} has format version {version}; this quantserve reads up to {FORMAT_VERSION}: upgrade quantserve"
        )
    return manifest


def verify(root: Path) -> dict:
    """Check every file's sha256 against the manifest; raise ArtifactError naming the first bad file."""
    root = Path(root)
    manifest = read_manifest(root)
    for rel, digest in manifest["files"].items():
        p = root / rel
        if not p.is_file():
            raise ArtifactError(f"damaged artifact: {p} is missing")
        if sha256_file(p) != digest:
            raise ArtifactError(f"damaged artifact: {p} does not match its sha256 in {MANIFEST}")
    return manifest


_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def mmap_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file as views of a private (copy-on-write) memory map.

    Nothing is read until a tensor is touched, and pages are shared with the page cache, so loading
    an artifact costs neither time nor a second copy of the weights.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise ArtifactError(f"damaged artifact: cannot read {path} ({e})") from e
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ArtifactError(f"damaged artifact: {path} tensor {name} has unsupported dtype {info['dtype']}")
        if end > len(mm) - base:
            raise ArtifactError(f"damaged artifact: {path} is truncated (tensor {name})")
        count = (end - start) // torch.empty((), dtype=dtype).element_size()
        t = torch.frombuffer(mm, dtype=dtype, count=count, offset=base + start) if count else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(info["shape"])
    return out


def own_held_pages(held: Iterable[torch.Tensor]) -> int:
    """Copy every tensor of `held` that lies in a mapped weights file (``*.safetensors``) into memory of its own,
    dropping its file pages from the resident set as each is copied (so the copy never holds a file twice), and
    return the bytes copied. The tensor objects are repointed in place (``set_``): every holder of one sees the
    copy; a view made of one before this keeps reading the file.

    Why: once part of a mapping was released (:func:`release_unheld_pages`), a held tensor read in place brings its
    released neighbours back. Linux 6.18 on ext4 keeps a file's page cache in large folios and maps a whole folio
    on a fault, neither MADV_NOHUGEPAGE nor MADV_RANDOM stopping it: one request on an int8-sym server made 96 MiB
    of a mapping resident where 37 MiB of tensors were held, its RSS growth 1.24x its file. Linux only."""
    libc = linux_libc()
    mapped = _weight_mappings()
    if libc is None or not mapped:
        return 0
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in held:
        ptr = t.untyped_storage().data_ptr()
        if t.device.type == "cpu" and t.untyped_storage().nbytes() and any(a <= ptr < b for a, b in mapped):
            by_storage.setdefault(ptr, []).append(t)
    page, copied = mmap.PAGESIZE, 0
    with torch.no_grad():
        for ptr, ts in by_storage.items():
            old = ts[0].untyped_storage()
            new = old.clone()  # (nbytes,) of the allocator's own memory
            for t in ts:
                t.set_(new, t.storage_offset(), t.size(), t.stride())
            copied += old.nbytes()
            a, b = -(-ptr // page) * page, (ptr + old.nbytes()) // page * page
            if b > a:
                libc.madvise(a, b - a, MADV_DONTNEED)
    return copied


def release_unheld_pages(held: Iterable[torch.Tensor]) -> int:
    """Drop from the process's resident memory every whole page of a mapped weights file (``*.safetensors``,
    mapped by us or by transformers) that no tensor in `held` uses, and return how many bytes that covered.

    Loading reads tensors that are then replaced (int4 codes repacked for the kernel, parts copied into a fused
    projection, floats cast to the serving dtype); their pages stay resident as long as anything else keeps the
    file mapped. MADV_DONTNEED on a file mapping is safe: a page touched again is read back from the file (weights
    are never written in place, so no page holds a private change). The mappings are also marked MADV_NOHUGEPAGE:
    otherwise one fault on a held tensor maps a whole 2 MiB page-cache folio back in, neighbours included
    (measured: a third of the released int8 parts were resident again after one request). Linux only."""
    libc = linux_libc()
    mapped = _weight_mappings()
    if libc is None or not mapped:
        return 0
    spans = sorted((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in held
                   if t.device.type == "cpu" and t.untyped_storage().nbytes())
    page, released = mmap.PAGESIZE, 0
    for start, end in mapped:
        libc.madvise(start, end - start, MADV_NOHUGEPAGE)
        cursor, gaps = start, []
        for a, n in spans:
            if a + n <= start or a >= end:
                continue
            if a > cursor:
                gaps.append((cursor, a))
            cursor = max(cursor, a + n)
        gaps.append((cursor, end))
        for a, b in gaps:
            a, b = -(-a // page) * page, b // page * page  # the whole pages inside the gap
            if b > a and libc.madvise(a, b - a, MADV_DONTNEED) == 0:
                released += b - a
    return released


def _weight_mappings() -> list[tuple[int, int]]:
    """(start, end) of each of this process's mappings of a weights file (``*.safetensors``), from /proc/self/maps
    (none where there is no such file: not Linux)."""
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        return []
    out = []
    for line in maps.read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].endswith(".safetensors"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end))
    return out


MADV_DONTNEED, MADV_NOHUGEPAGE = 4, 15  # <sys/mman.h> on Linux


def linux_libc():
    """glibc through ctypes on Linux (madvise, mallopt, malloc_trim), None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc
