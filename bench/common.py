"""Helpers shared by the bench scripts. A script imports them as ``from common import ...``: run as
``python bench/x.py``, Python searches the script's folder (bench/) first for modules. The package itself (quant,
server, quantserve) is installed in editable mode and imports as it is.

Heavy imports (torch, transformers, the package) stay inside the functions, so that importing this module is cheap.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2"  # ../shared beside the checkout

# ------------------------------------------------------------------------------------------------ the machine


def cpu_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (the platform's processor string where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


# ----------------------------------------------------------------------------- the engine's CPU decode and prefill

PROMPT = "The history of the city begins in the early years of the"
NEW = 128  # new tokens of a decode measurement (EOS suppressed, so every run makes them all)
PREFILL = 512  # tokens of a prefill measurement (one new token after them)
PREFILLS = 5  # prefills per process (~0.25 s each), the best kept: with 2, a process's best spread by ~10% run to run


def greedy(max_new: int = NEW):
    """Greedy sampling of exactly ``max_new`` tokens."""
    from server.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_new_tokens=max_new, min_tokens=max_new, seed=0)


def ensure_artifact(art_dir: Path, scheme: str, cache: Path) -> Path:
    """``art_dir/scheme``: the default model's artifact of ``scheme``, built by ``quant build`` where it is absent."""
    path = art_dir / scheme
    if (path / "quant_manifest.json").is_file():
        return path
    cmd = [sys.executable, "-m", "quant.cli", "build", "--scheme", scheme, "--out", str(path), "--no-progress"]
    print("building", scheme, ":", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "QUANTSERVE_CACHE": str(cache)})
    return path


# ---------------------------------------------------------------------------------------- random-weight models


def word_tokenizer(vocab: int):
    """A tokenizer over ids alone (random-weight models have no text): token i is the word 't<i>'."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="t2", eos_token="t1", unk_token="t0")


# ------------------------------------------------------------------------------------------------- the GPU


PEAK_BW = {"H100": 3.35e12, "H200": 4.8e12}  # HBM bytes/s by the vendor's figure (H100 SXM5, H200)
SHAPES = {
    "135M": dict(hidden=576, inter=1536, layers=30, heads=9, kv=3, vocab=49152),
    "8B": dict(hidden=4096, inter=14336, layers=32, heads=32, kv=8, vocab=128256),
}


def cuda_time(fn, reps: int = 20, warm: int = 3, inner: int = 10, graph: bool = True) -> float:
    """Median seconds of one fn() on the GPU (quant.runtime.timing.cuda_time_us: calls captured in a CUDA graph and
    replayed, as the decode step's graphs replay them, the L2 written over before each); ``graph=False``: eager
    calls, for a peer that synchronises (the sdpa gather path builds its metadata from host lists)."""
    from quant.runtime.timing import cuda_time_us

    return cuda_time_us(fn, reps, warm, inner, graph=graph) / 1e6


# ------------------------------------------------------------------------------------ lm-evaluation-harness data

LM_EVAL_TASKS = ROOT / "tests" / "lm_eval_tasks"  # the task definitions lm-eval is pointed at (--include_path)
_TITLE = re.compile(r"^ = [^=].* = $")  # a top-level heading (" = = Section = = " is a section)


def wikitext_articles(docs: int = 0) -> list[str]:
    """The WikiText-2 test articles lm-eval scores in the qs_wikitext task (the first ``docs`` when given), as
    tests/lm_eval_tasks/qs_tasks.py's ``wikitext`` splits them: the shared WikiText-2 test set, else the small
    sample beside that module. Not detokenized."""
    src = WIKITEXT / "test.txt"
    if not src.is_file():
        src = LM_EVAL_TASKS / "wikitext_sample.txt"
    pages: list[list[str]] = []
    for line in src.read_text(encoding="utf-8").splitlines(keepends=True):
        if _TITLE.match(line.rstrip("\n")) or not pages:
            pages.append([])
        pages[-1].append(line)
    pages = ["".join(p).strip("\n") + "\n" for p in pages if "".join(p).strip()]
    return pages[:docs] if docs else pages
