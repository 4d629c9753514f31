"""bench/gpu.py's report on the CPU, run as a lease runs it (a process of its own, no import of bench/): the section
a GPU check puts into bench/RESULTS.md is written from rows shaped as each part writes them, so a formatting slip
fails here, not after a lease's GPU time is spent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## GPU check (`bench/gpu.py`)"


def _gpu_py(*args: str) -> str:
    got = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-3000:]
    return got.stdout


def _engine_row(scheme: str, headline: bool) -> dict:
    row = {"shape": "8B" + (" (headline rows)" if headline else ""), "scheme": scheme, "engine_start_s": 35.5,
           "embeddings": "int8" if scheme == "w4a16" else "float",
           "kernels": ["w4 4096x4096 bfloat16: measuring failed (RuntimeError: x), the built-in rule"],
           "attention": "triton", "glue_ops": "triton", "cuda_graphs": "on", "weight_bytes": 5 << 30,
           "allocated_after_load": 5 << 30, "kv_pool_bytes": 16 << 30, "kv_pool_alloc": 16 << 30, "b1_tok_s": 284.4,
           "b1_serial_tok_s": 250.9, "read_bytes": 4539 << 20, "b1_bandwidth_share": 0.404, "ttft_512_ms": 26.6,
           "syncs_per_step": 0.03, "sync_sites": [], "prefill512_peak_over_base": 264 << 20,
           "prefill512_estimate": 264 << 20,
           "b1_profile": {"wall_us_per_step": 3500.0, "device_busy_us_per_step": 3400.0, "kernels_per_step": 165.0,
                          "top": [("w4_gemv_kernel", 2000.0, 128.0)]}}
    if headline:
        row["streams64x256_triton+graphs_tok_s"] = 8192.0
        row.update(ttft_shared1024_cached_ms=9.5, ttft_shared1024_uncached_ms=52.0)
    else:
        row.update({"streams64x512_triton+graphs_tok_s": 8000.0, "b1_eager_tok_s": 100.0,
                    "b1_eager_glue_tok_s": 200.0, "b1_static_kernels_tok_s": 288.9})
    return row


def _run() -> dict:
    """A saved run (gpu.json) with a row of every kind each part writes."""
    return {
        "env": {"date": "2026-11-27", "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0",
                "commit": "629e7b3", "gemlite": "0.6.0.post2"},
        "linear": [{"op": "w4", "shape": "8B", "layer": "qkv", "n": 6144, "k": 4096, "m": 1, "dtype": "bfloat16",
                    "rel_err": 1e-3, "triton_us": 11.8, "whole_us": 12.0, "sym_us": 11.0, "tinygemm_us": 11.0,
                    "bf16_us": 20.0, "dequant_cublas_us": 40.0, "gemlite_us": 13.5, "gemlite_rel_err": 2e-3},
                   {"op": "w4", "shape": "8B", "layer": "o", "n": 4096, "k": 4096, "m": 64, "dtype": "bfloat16",
                    "rel_err": 1e-3, "triton_us": 19.7, "tinygemm_us": 30.0, "bf16_us": 14.7,
                    "dequant_cublas_us": 40.0, "gemlite_us": 12.0, "gemlite_rel_err": 0.5, "gemlite_eager": True},
                   {"op": "w4", "shape": "8B", "layer": "down", "n": 4096, "k": 14336, "m": 16, "dtype": "bfloat16",
                    "rel_err": 1e-3, "triton_us": 30.0, "tinygemm_us": 30.0, "bf16_us": 40.0,
                    "dequant_cublas_us": 60.0, "gemlite_error": "RuntimeError: no config"},
                   {"op": "w4", "shape": "8B", "layer": "o", "n": 4096, "k": 4096, "m": 1024, "dtype": "bfloat16",
                    "rel_err": 1e-3},  # checked, not timed: past the part's clock
                   {"op": "int8", "shape": "8B", "layer": "o", "n": 4096, "k": 4096, "m": 1, "rel_err": 1e-3,
                    "triton_us": 9.0, "int8pack_us": 12.0, "bf16_us": 20.0, "dequant_cublas_us": 30.0}],
        "attention": [{"op": "decode_attention", "shape": "8B", "seqs": 1, "ctx": 4096, "max_err": 1e-3,
                       "sdpa_vs_triton_max_diff": 1e-3, "splits": 8, "triton_us": 20.0, "sdpa_gather_us": 90.0,
                       "triton_page_us": 25.0, "triton_fused_rope_us": 21.0, "triton_rope_then_attention_us": 24.0,
                       "fused_rope_max_diff": 0.0},
                      {"op": "prefill_attention", "shape": "8B", "chunk": 512, "past": 1024, "max_err": 1e-3,
                       "triton_us": 200.0, "sdpa_us": 300.0, "triton_page_us": 210.0}],
        "gemv_sweep": [{"op": "w4", "layer": "gate_up", "n": 28672, "k": 4096, "rule": (128, 64, 1, 4),
                        "best": (128, 64, 2, 4), "searched": (128, 64, 2, 4), "searched_measured": 12,
                        "search_s": 3.0, **{f"{k}_us": 40.0 for k in ("rule", "best", "searched", "sym", "tinygemm")},
                        **{f"{k}_bw_share": 0.4 for k in ("rule", "best", "searched", "sym", "tinygemm")},
                        "gated_us": 41.0, "then_act_us": 45.0, "gemlite_us": 50.0, "gemlite_rel_err": 1e-3,
                        "gemlite_bw_share": 0.32},
                       {"op": "w4", "layer": "o", "n": 4096, "k": 4096, "rule": (128, 64, 1, 4),
                        "best": (128, 64, 2, 4), "searched": (128, 64, 2, 4), "searched_measured": 12,
                        "search_s": 3.0, **{f"{k}_us": 9.0 for k in ("rule", "best", "searched", "sym", "tinygemm")},
                        **{f"{k}_bw_share": 0.6 for k in ("rule", "best", "searched", "sym", "tinygemm")}},
                       {"op": "int8", "layer": "down", "n": 4096, "k": 14336, "rule": (64, 128, 2, 4),
                        "best": (64, 128, 2, 4), "searched": (64, 128, 2, 4), "searched_measured": 8, "search_s": 2.0,
                        **{f"{k}_us": 30.0 for k in ("rule", "best", "searched", "gemm")}}],
        "engine": [_engine_row("w4a16", True), _engine_row("bf16", True), _engine_row("w4a16", False)],
        "skipped": ["default model"],
        "cut": ["linear: 12 rows checked but not timed (past 110 s)"],
        "peers": ["gemlite : ModuleNotFoundError: No module named 'gemlite'"],
    }


def test_the_report_holds_every_parts_rows(tmp_path):
    saved = tmp_path / "gpu.json"
    saved.write_text(json.dumps({"results": _run(), "failures": ["linear: x"]}))  # as bench/gpu.py saves a run
    md = _gpu_py("--render", str(saved))
    assert md.startswith(HEADING + "\n\nRun 2026-11-27 on NVIDIA H100 80GB HBM3, commit 629e7b3, torch 2.11.0, "
                                   "triton 3.6.0, gemlite 0.6.0.post2 ")
    assert "FAILED: linear: x" in md
    assert "random-weight bf16 8B (headline rows)" in md and "random-weight w4a16 8B (headline rows)" in md
    assert "streams64x256_triton+graphs_tok_s 8192" in md
    assert "random-weight w4a16 8B (headline rows) (triton, cuda graphs on, embeddings and head int8)" in md
    assert "TTFT of 1024 cached + 32 tokens 9.5 ms against 1056 uncached 52.0 ms" in md
    assert "cut to the part's time: linear: 12 rows checked but not timed" in md
    assert "| w4 | 8B | o | 4096x4096 | 1024 |" not in md  # an untimed row has no table line
    assert "measuring failed (RuntimeError: x), the built-in rule" in md
    assert "| gate_up | 28672x4096 | (128, 64, 1, 4) |" in md
    assert "40.0 | 40.0 | 40.0 | 40.0 | 40.0 | 50.0 | 40% / 40% / 40% / 40% / 40% / 32% |" in md
    assert "9.0 | 9.0 | 9.0 | 9.0 | 9.0 | - | 60% / 60% / 60% / 60% / 60% / - |" in md  # GemLite did not run there
    # the W4A16 table: GemLite beside ours with its error, flagged where past tolerance or timed eagerly
    assert "| w4 | 8B | qkv | 6144x4096 | 1 | 11.8 | 12.0 / 11.0 | 11.0 | 13.5 (2e-03) | 40.0 | 20.0 | 0.59x |" in md
    assert "| w4 | 8B | o | 4096x4096 | 64 | 19.7 | - | 30.0 | 12.0 eager (5e-01, WRONG) | 40.0 | 14.7 | 1.34x |" in md
    assert "| w4 | 8B | down | 4096x14336 | 16 | 30.0 | - | 30.0 | - | 60.0 | 40.0 | 0.75x |" in md
    assert "- GemLite 8B down M=16: RuntimeError: no config" in md
    assert "- W4A16 peer not run: gemlite : ModuleNotFoundError: No module named 'gemlite'" in md
    headline, full = (line for line in md.splitlines() if line.startswith("- engine, random-weight w4a16"))
    assert "eager steps" not in headline and "serial steps instead of overlapped: 250.9" in headline  # not run: not shown
    assert "eager steps: 100.0" in full and "built-in rules instead of measured launches and plans: 288.9" in full


def test_a_report_replaces_its_section_and_nothing_else(tmp_path):
    results = tmp_path / "RESULTS.md"
    before = ["# Benchmark results", "", "## Quality (`bench/quality.py`)", "", "quality rows", ""]
    after = ["## GPU: earlier figures", "", "older rows", ""]
    results.write_text("\n".join(before + [HEADING, "", "an earlier run's rows", ""] + after))
    section = tmp_path / "section.md"
    section.write_text(f"{HEADING}\n\nthis run's rows\n\n- CUDA tests: 37 passed\n")
    _gpu_py("--record", str(section), "--results", str(results))
    assert results.read_text() == "\n".join(before + [HEADING, "", "this run's rows", "", "- CUDA tests: 37 passed",
                                                      ""] + after)
    _gpu_py("--record", str(section), "--results", str(results))  # a second run: the same, once
    assert results.read_text().count(HEADING) == 1 and "an earlier run's rows" not in results.read_text()
    lone = tmp_path / "LONE.md"  # a file without the section: appended
    lone.write_text("# Benchmark results\n")
    _gpu_py("--record", str(section), "--results", str(lone))
    assert lone.read_text() == f"# Benchmark results\n\n{HEADING}\n\nthis run's rows\n\n- CUDA tests: 37 passed\n"
