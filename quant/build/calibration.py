"""Calibration and evaluation text: files, model-generated text, and seeded token windows."""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from quant.build.progress import track
from quant.errors import CalibrationError
from quant.shape import memory as shape_memory


def min_rows(k: int) -> int:
    """Calibration rows (tokens) a Linear with `k` inputs needs for its calibrated quantization (a GPTQ
    Hessian, a static input scale). Every dense Linear gets all the calibration tokens; an expert of a MoE
    layer only those routed to it, and one that gets fewer than this falls back (GPTQ to RTN, a static
    input scale to a dynamic one), which the build records."""
    return max(16, k // 16)


@dataclass(frozen=True)
class TokenWindows:
    ids: torch.Tensor  # (S, T) int64
    source: str
    fingerprint: str  # sha256 of the token ids and the settings that produced them
    total_tokens: int  # tokens in the whole source before windowing

    def describe(self) -> dict:
        return {
            "source": self.source,
            "windows": int(self.ids.shape[0]),
            "seqlen": int(self.ids.shape[1]),
            "source_tokens": self.total_tokens,
            "fingerprint": self.fingerprint,
        }


def read_texts(path: str | Path) -> list[str]:
    """Plain text (one document) or JSONL with a `text` field per line."""
    p = Path(path)
    if not p.exists():
        raise CalibrationError(f"calibration/evaluation file not found: {p}")
    if not p.is_file():
        raise CalibrationError(f"calibration/evaluation path is not a file: {p}")
    try:
        raw = p.read_text(encoding="utf-8", errors="strict")
    except UnicodeDecodeError as e:
        raise CalibrationError(f"{p} is not UTF-8 text (byte {e.start}: {e.reason})") from e
    if not raw.strip():
        raise CalibrationError(f"calibration/evaluation file is empty: {p}")
    if p.suffix != ".jsonl":
        return [raw]
    texts = []
    for n, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CalibrationError(f"{p}:{n}: not valid JSON ({e.msg})") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise CalibrationError(f"{p}:{n}: a JSONL line needs a string field 'text'")
        texts.append(obj["text"])
    if not any(t.strip() for t in texts):
        raise CalibrationError(f"calibration/evaluation file has no text: {p}")
    return texts


def _tokenize(tok, texts: list[str]) -> torch.Tensor:
    ids = tok("\n\n".join(texts), return_tensors="pt", add_special_tokens=False).input_ids[0]  # (N,)
    return ids


def _fingerprint(ids: torch.Tensor, settings: dict) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    h.update(ids.to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


def random_windows(tok, path: str | Path, samples: int, seqlen: int, seed: int) -> TokenWindows:
    """`samples` windows of `seqlen` tokens at seeded random offsets (GPTQ's calibration recipe)."""
    ids = _tokenize(tok, read_texts(path))
    n = ids.numel()
    if n < seqlen:
        raise CalibrationError(
            f"calibration file {path} has {n} tokens, shorter than one window of {seqlen} (--calib-seqlen)"
        )
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, n - seqlen + 1, (samples,), generator=g)
    windows = torch.stack([ids[s : s + seqlen] for s in starts.tolist()])  # (S, T)
    settings = {"source": str(path), "samples": samples, "seqlen": seqlen, "seed": seed}
    return TokenWindows(windows, str(path), _fingerprint(windows, settings), n)


def eval_windows(tok, path: str | Path, windows: int, seqlen: int, flag: str = "--") -> TokenWindows:
    """`windows` non-overlapping windows spread evenly over the file (deterministic, no seed).

    Asking for more windows than the file holds is an error, not a silent shrink: figures computed on
    fewer windows than stated would be mislabelled.
    """
    ids = _tokenize(tok, read_texts(path))
    n = ids.numel()
    available = n // seqlen
    if available < windows:
        raise CalibrationError(
            f"evaluation file {path} has {n} tokens: {available} windows of {seqlen}, "
            f"fewer than the {windows} requested ({flag}windows)"
        )
    stride = available // windows
    starts = [i * stride * seqlen for i in range(windows)]
    out = torch.stack([ids[s : s + seqlen] for s in starts])  # (W, T)
    settings = {"source": str(path), "windows": windows, "seqlen": seqlen}
    return TokenWindows(out, str(path), _fingerprint(out, settings), n)


GENERATION_BATCH = 128  # most sequences generated at once (memory permitting: generation_batch)


def generation_batch(config, samples: int, seqlen: int, free_bytes: int) -> int:
    """Sequences of model ``config`` generated at once: as many as their fp32 KV (twice over: the cache grows by
    copying) and fp32 logits rows fit in ``free_bytes``, at least 1, at most GENERATION_BATCH. The text does not
    depend on it."""
    per_row = 2 * seqlen * shape_memory.kv_bytes_per_token(config, torch.float32) + 4 * config.vocab_size
    return max(1, min(samples, GENERATION_BATCH, free_bytes // per_row))


@torch.inference_mode()
def self_generated(model, tok, samples: int, seqlen: int, seed: int, batch: int = 16,
                   progress: bool = False) -> TokenWindows:
    """Model-generated calibration text for users without a corpus.

    Each sequence starts from a seeded random vocabulary token and is sampled at temperature 1 with
    the model's own distribution (the LLM-QAT recipe), so the windows follow what the model actually
    produces; end-of-sequence tokens are never drawn. Sequence i draws from a generator of its own,
    seeded (seed, i): its text does not depend on ``batch`` (how many are generated at once, a matter
    of memory and speed) beyond the rounding of batched products. The caller's RNG state is untouched.
    """
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    special = set(tok.all_special_ids)
    perm = [t for t in torch.randperm(vocab, generator=g).tolist() if t not in special]
    firsts = [perm[k % len(perm)] for k in range(samples)]  # a start each; repeated past a small vocabulary
    gen_cfg = getattr(model, "generation_config", None)
    eos = gen_cfg.eos_token_id if gen_cfg is not None else None
    eos = {*([] if eos is None else [eos] if isinstance(eos, int) else eos),
           *([] if tok.eos_token_id is None else [tok.eos_token_id])}
    eos_t = torch.tensor(sorted(eos), dtype=torch.long)
    # transformers 5.25 names the forward's cache argument `cache` (`past_key_values` deprecated), 5.17 the latter
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    rows = []
    starts = range(0, samples, batch)
    for i in track(starts, len(starts), "generating calibration text", "batches", progress):
        ids = torch.tensor(firsts[i : i + batch], dtype=torch.long)[:, None]  # (b, 1)
        n = ids.shape[0]
        gens = [torch.Generator().manual_seed(hash_seed(seed, i + r)) for r in range(n)]
        out = [ids]
        cache = {cache_arg: DynamicCache(config=model.config)}
        for _ in range(seqlen - 1):
            logits = model(input_ids=ids.to(model.device), use_cache=True, **cache).logits[:, -1]
            logits = logits.float().cpu()
            logits[:, eos_t[eos_t < logits.shape[-1]]] = -float("inf")
            probs = logits.softmax(-1)  # (b, V)
            ids = torch.stack([torch.multinomial(probs[r], 1, generator=gens[r]) for r in range(n)])  # (b, 1)
            out.append(ids)
        rows.append(torch.cat(out, dim=1))
    ids = torch.cat(rows)  # (S, T)
    settings = {"source": "self", "samples": samples, "seqlen": seqlen, "seed": seed}
    return TokenWindows(ids, "self", _fingerprint(ids, settings), ids.numel())


def hash_seed(seed: int, index: int) -> int:
    """The seed of sequence ``index``'s generator: 63 bits of sha256 over (seed, index)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little") >> 1
