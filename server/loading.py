"""Loading a model for serving, and the process's heap around it: an artifact, a GPTQ checkpoint or a plain model
(as a module tree of the engine's own model definitions where it can), and glibc's heap made to give freed memory
back."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from quant.format import artifact
from server import models


def load_for_serving(spec: str | None, dtype: torch.dtype, device: str, cache_dir: Path):
    """(model, tokenizer, name, scheme): a quantserve / GPTQ artifact dir, or a plain model dir, GGUF or hub id
    (served unquantized); None is the embedded default model. Local safetensors checkpoints load as a module tree
    without transformers' modeling classes (quant.runtime.loader.load_for_engine); a hub id or a .bin-only dir goes
    through transformers."""
    from quant.format import shards
    from quant.format import sources as sources
    from quant.runtime import loader

    check = models.model_class  # an architecture the engine does not serve is refused before any weight
    p = Path(spec).expanduser() if spec else None
    if p is not None and p.is_dir() and (p / "quant_manifest.json").is_file():
        la = loader.load_for_engine(p, dtype=dtype, device=device, cache_dir=cache_dir, check_config=check)
        return la.model, la.tokenizer, str(p), str(la.manifest["scheme"])
    if p is not None and p.is_dir() and (p / "config.json").is_file() and "quantization_config" in (
        p / "config.json"
    ).read_text():
        # e.g. a GPTQ checkpoint made elsewhere
        la = loader.load_for_engine(p, dtype=dtype, device=device, verify=False, cache_dir=cache_dir,
                                    check_config=check)
        return la.model, la.tokenizer, str(p), "gptq"
    source = sources.resolve(spec, cache_dir, fingerprint=False)
    local = Path(source.path)
    if local.is_dir() and ((local / shards.WEIGHTS).is_file() or (local / shards.INDEX).is_file()):
        la = loader.load_for_engine(local, dtype=dtype, device=device, verify=False, cache_dir=cache_dir,
                                    check_config=check)
        return la.model, la.tokenizer, source.spec, "none"
    model, tok = sources.load_model(source, dtype=dtype, device=device)
    return model, tok, source.spec, "none"


def share_one_heap() -> None:
    """Make threads started from now on allocate from glibc's main heap instead of one arena each. malloc_trim
    returns the free top of the main heap only; a thread arena keeps its free top (up to twice the dynamic mmap
    threshold, tens of MiB once the step's logits have been freed), so the engine thread's arena left server RSS
    at either ~487 or ~528 MiB after identical rounds of load (tests/test_reliability.py). With one heap it stays
    at one figure, at the same speed (6.5 s per 64-stream round either way). Called before the engine thread
    starts; a no-op where glibc is not the allocator."""
    libc = artifact.linux_libc()
    if libc is not None:
        try:
            libc.mallopt(-8, 1)  # M_ARENA_MAX
        except AttributeError:
            pass


def freeze_loaded_objects() -> None:
    """Move every object alive (the modules, the model, the tokenizer: ~10^5-10^6 of them) out of the garbage
    collector's reach: its full collections, which a step's allocations trigger now and then, otherwise walk them
    all (2.7% of the engine thread's samples in a batch-1 decode, perf, 2026-12-07). Called once the engine is built,
    before its thread starts; what is frozen is what a process keeps anyway (no collection first: a full one costs
    a test process ~0.1 s an engine, and loading leaves few cycles)."""
    gc.freeze()


def thaw_frozen_objects() -> None:
    """An engine closed: what :func:`freeze_loaded_objects` froze is the collector's again, so that a process that
    goes on (a test session, a script that starts another engine) collects the closed engine's cycles."""
    gc.unfreeze()


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (after loading, and whenever the engine goes idle). Unpacking and
    repacking quantized tensors frees hundreds of MiB of temporaries that glibc keeps in its heap
    (bench/decode.py --only rss: a w4a16 server at 1837 MiB RSS before this call existed, 1053 MiB with it);
    malloc_trim returns it. A no-op where glibc is not the allocator."""
    libc = artifact.linux_libc()
    if libc is not None:
        try:
            libc.malloc_trim(0)
        except AttributeError:
            pass
