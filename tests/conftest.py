"""Shared fixtures: a tiny random-weight Llama with the default model's tokenizer, text files, a cache.

The tiny model has the same architecture as SmolLM2 (Llama, grouped-query attention, tied
embeddings) at a size where a full build takes about a second.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels (server.attention.triton_paged, quant.runtime.kernels.triton_ops) run on CPU tensors under
# Triton's interpreter; it is read when triton decorates a kernel, so it is set before anything imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"


# The modules whose tests take longest, longest first (bench/RESULTS.md#test-suite-wall-time-scriptstestsh: the
# default model's quality guards, where the WikiText-2 data is beside the checkout, take ~620 s of one worker's
# thread). They run first: pytest-xdist's worksteal gives each worker a contiguous half of the tests and balances by
# taking from the end of the other's, so what is left to balance at the end should be short tests. A module stays
# whole and in its own order; the rest keep file order.
_LONG_MODULES = ("test_default_model", "test_lm_eval", "test_json_mode", "test_models", "test_reliability",
                 "test_triton_ops", "test_kernel_choice", "test_triton_compile", "test_prefix_cache", "test_attention",
                 "test_module_tree", "test_pipeline")


# Every test is of one tier (pyproject.toml's markers): unit, reference or e2e, marked on its module (pytestmark) or,
# where a module mixes them, on each test.
TIERS = ("unit", "reference", "e2e")


def _module_tiers(path: Path) -> set[str]:
    """The tiers a test module's source marks."""
    return set(re.findall(r"pytest\.mark\.(unit|reference|e2e)\b", path.read_text()))


def pytest_ignore_collect(collection_path, config):
    """Under ``-m`` over tiers alone (``-m unit``, ``-m "unit or reference"``, ``-m "not e2e"``), a module none of
    whose tiers the expression selects is not imported: its tests would all be deselected, and importing it costs
    (peft, transformers' model classes, the C++ kernels' build on a fresh machine)."""
    expr = config.option.markexpr
    if not expr or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    words = re.findall(r"\(|\)|[^\s()]+", expr)
    if any(w not in ("(", ")", "and", "or", "not") + TIERS for w in words):
        return None  # other markers in the expression: leave the selection to -m
    tiers = _module_tiers(collection_path)
    if not tiers:
        return None
    chosen = [t for t in tiers if eval(" ".join(str(w == t) if w in TIERS else w for w in words), {})]
    return True if not chosen else None


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONG_MODULES)}
    items.sort(key=lambda item: rank.get(Path(item.nodeid.split("::")[0]).stem, len(rank)))  # stable
    wrong = []
    for item in items:
        tiers = [m.name for m in item.iter_markers() if m.name in TIERS]
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid}: {tiers or 'no tier'}")
    if wrong:
        raise pytest.UsageError("every test carries exactly one of the markers " + ", ".join(TIERS) + ":\n  "
                                + "\n  ".join(wrong))


def pytest_configure(config):
    """Under pytest-xdist (scripts/test.sh runs a worker per core) each worker takes its share of the cores for
    torch's intra-op threads, and the processes its tests start inherit it: two workers of two threads each on two
    cores would spin against each other in OpenMP's barriers."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        share = max(1, cores // int(workers))
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """The converted default model is cached once per machine (conversion costs ~25 s), so tests use
    the user cache unless QUANTSERVE_TEST_CACHE points elsewhere."""
    env = os.environ.get("QUANTSERVE_TEST_CACHE")
    if env:
        return Path(env)
    from quant.format.sources import default_cache_dir

    return default_cache_dir()


@pytest.fixture(scope="session")
def tokenizer(cache_dir):
    """The default model's tokenizer, read from its GGUF (no model conversion needed), with the special tokens its
    config names, as the conversion gives it (quant.format.sources.agree_special_tokens). Reading the GGUF costs
    ~10 s (the tokenizer and the config each parse it), so it is read once per machine: the tokenizer is saved
    under the cache, by GGUF and transformers version, and every session and xdist worker reads it from there
    (~1 s; the same files as saving the one read from the GGUF gives)."""
    import shutil
    import tempfile

    import transformers
    from transformers import AutoConfig, AutoTokenizer

    from quant.format.sources import agree_special_tokens, default_gguf_path

    gguf = default_gguf_path()
    st = gguf.stat()
    saved = cache_dir / "test-tokenizers" / f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}-{transformers.__version__}"
    if not (saved / "tokenizer_config.json").is_file():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        agree_special_tokens(tok, AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name))
        saved.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".save-", dir=saved.parent))
        tok.save_pretrained(tmp)
        try:
            tmp.rename(saved)  # written whole, then renamed into place: a worker saving at once loses the race
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(saved)


def wait_until(cond, timeout: float = 30.0) -> bool:
    """Poll ``cond`` every 5 ms until it holds or ``timeout`` seconds pass; its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def make_tiny_llama(path: Path, tokenizer, seed: int = 0, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    with torch.no_grad():
        # Give the norms and a few channels non-trivial scales so smoothing has outliers to move.
        for layer in model.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
            layer.input_layernorm.weight[:3] *= 8.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_adapter(model_dir, out: Path, dtype=torch.float32, seed=0, safe=True, **lora_kwargs) -> Path:
    """A PEFT LoRA adapter for the model at `model_dir`, with random (seeded) lora_A/B so merging changes
    the weights; `lora_kwargs` go to peft.LoraConfig."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        pm = get_peft_model(base, LoraConfig(**lora_kwargs))
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_" in name:
                    torch.nn.init.normal_(p, std=0.2)
        pm.save_pretrained(out, safe_serialization=safe)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", tokenizer)


@pytest.fixture(scope="session")
def tiny_w4a16_dir(tmp_path_factory, tiny_model_dir, text_file) -> Path:
    """The tiny model's w4a16 artifact (4 x 64 calibration tokens), built once per session: tests read it only."""
    out = tmp_path_factory.mktemp("tiny-w4a16") / "w4a16"
    assert run_cli("build", "--model", tiny_model_dir, "--scheme", "w4a16", "--calib", text_file, "--calib-samples",
                   "4", "--calib-seqlen", "64", "--no-progress", "--out", out) == 0
    return out


@pytest.fixture(scope="session")
def arch_dirs(tmp_path_factory, tokenizer):
    """name -> the dir of a tiny model of that architecture (tests/archs.py), made once per session."""
    from archs import make_tiny

    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_tiny(name, tmp_path_factory.mktemp("arch") / name, tokenizer)
        return made[name]

    return get


@pytest.fixture(scope="session")
def arch_artifacts(tmp_path_factory, arch_dirs, text_file):
    """(name, scheme) -> the artifact of the tiny model of that architecture (2 x 32 calibration tokens; w8a8
    calibrated by minmax), built once per session: tests read it only."""
    made: dict[tuple[str, str], Path] = {}

    def get(name: str, scheme: str) -> Path:
        if (name, scheme) not in made:
            out = tmp_path_factory.mktemp("artifact") / f"{name}-{scheme}"
            extra = ["--calib-method", "minmax"] if scheme == "w8a8" else []
            assert run_cli("build", "--model", arch_dirs(name), "--scheme", scheme, "--calib", text_file,
                           "--calib-samples", "2", "--calib-seqlen", "32", "--no-progress", "--out", out, *extra) == 0
            made[(name, scheme)] = out
        return made[(name, scheme)]

    return get


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """Real text for calibration and evaluation: a slice of WikiText-2 valid when present."""
    path = tmp_path_factory.mktemp("data") / "text.txt"
    src = SHARED_DATA / "valid.txt"
    if src.is_file():
        path.write_text(src.read_text()[:60_000])
    else:
        words = "the model reads text and predicts the next token of a sentence about lobsters".split()
        g = torch.Generator().manual_seed(0)
        idx = torch.randint(0, len(words), (12_000,), generator=g).tolist()
        path.write_text(" ".join(words[i] for i in idx))
    return path


@pytest.fixture()
def jsonl_file(tmp_path, text_file) -> Path:
    path = tmp_path / "calib.jsonl"
    text = text_file.read_text()
    lines = [json.dumps({"text": text[i : i + 2000]}) for i in range(0, 20_000, 2000)]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_cli(*args: str) -> int:
    from quant.cli import main

    return main([str(a) for a in args])


def rerun_capped_to_avx2(test_file: str, select: str) -> None:
    """Runs the tests of ``test_file`` that ``-k select`` picks again in a process capped to AVX2
    (``ATEN_CPU_CAPABILITY=avx2``: our C++ kernels are then compiled without AVX-512, quant/runtime/kernels/native.py), so CI on an
    AVX-512 machine holds the kernels an AVX2-only CPU gets too; every test must run and pass there."""
    import subprocess
    import sys

    from quant.runtime.kernels import native

    if "avx512f" not in native.cpu_flags().split() or "avx2" not in native.cpu_flags().split():
        pytest.skip("this CPU's own run covers its kernels; no AVX-512 to cap")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", select],
                       cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    summary = p.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary
