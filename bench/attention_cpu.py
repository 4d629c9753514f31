"""Prefill attention on the CPU: the sdpa backend's fused kernel (server/csrc/attention_ops.cpp,
``prefill_attention``: key tiles read through the block table in place, online softmax) against what the backend
ran before it and still runs without the fused ops: the chunk's keys gathered from the paged cache and PyTorch's
``scaled_dot_product_attention`` (``is_causal`` for a chunk without past, else with the backend's bool mask).

Kernel cases: the default model's chunks of a 512- and a 1024-token prompt (256 tokens each, served with
``max_prefill_tokens`` 256; 9 query / 3 KV heads of 64), and Llama-3-8B's heads (32 / 8 of 128). The two are
called in turn, a round at a time; median ms, bf16, 2 threads by default.

Served: the default bf16 model's 512-token prefill (ms to the first token, best of 5 per process, as
bench/cpu_paths.py measures it) in a fresh engine process with the kernel and one without
(``SdpaBackend.FUSED_PREFILL = False``), alternated for ``--engine-rounds`` rounds; the median is kept.

    python bench/attention_cpu.py [--rounds 15] [--engine-rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from common import PREFILL, PREFILLS, PROMPT, greedy

ROOT = Path(__file__).resolve().parents[1]

# (name, chunk, past, heads, kv heads, head dim)
CASES = [("135M chunk 1 of 512", 256, 0, 9, 3, 64), ("135M chunk 2 of 512", 256, 256, 9, 3, 64),
         ("135M chunk 4 of 1024", 256, 768, 9, 3, 64), ("8B-heads chunk 1", 256, 0, 32, 8, 128),
         ("8B-heads chunk 2", 256, 256, 32, 8, 128)]


def served_prefill(fused: bool, threads: int) -> float:
    """ms to the first token of a 512-token prompt through a fresh engine on the default model, best of 5."""
    import torch

    from quant.format.sources import default_cache_dir
    from server.attention.sdpa import SdpaBackend
    from server.config import EngineConfig
    from server.engine import Engine

    torch.set_num_threads(threads)
    SdpaBackend.FUSED_PREFILL = fused
    eng = Engine.from_path(None, EngineConfig(memory_budget="256MiB", threads=threads), default_cache_dir())
    try:
        ids = eng.tokenize(PROMPT * 60)[:PREFILL]
        eng.complete(ids, greedy(1))
        best = float("inf")
        for _ in range(PREFILLS):
            t = time.perf_counter()
            eng.complete(ids, greedy(1))
            best = min(best, time.perf_counter() - t)
        return 1e3 * best
    finally:
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--engine-rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "attention_cpu.json"))
    ap.add_argument("--served-case", choices=("fused", "sdpa"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.served_case:
        print(json.dumps(served_prefill(a.served_case == "fused", a.threads)))
        return

    import torch

    from server import fastops
    from server.attention.base import AttentionSpec
    from server.attention.reference import visible
    from server.attention.sdpa import _attend

    torch.set_num_threads(a.threads)
    if not fastops.load():
        raise SystemExit(f"the fused ops cannot be built here: {fastops.unavailable_reason()}")
    ops = fastops.Ops("fused")
    bs = 16
    res = {"date": time.strftime("%Y-%m-%d"), "threads": a.threads, "cpu": torch.backends.cpu.get_cpu_capability(),
           "cases": {}}
    for name, C, past, H, Hkv, D in CASES:
        g = torch.Generator().manual_seed(0)
        L, nb = past + C, -(-(past + C) // bs)
        kv = torch.randn(2, (nb + 8) * bs, Hkv, D, generator=g).bfloat16()  # (2, slots, Hkv, D)
        table = torch.randperm(nb + 8, generator=g)[:nb]
        q = torch.randn(C, H, D, generator=g).bfloat16()
        spec = AttentionSpec(heads=H, kv_heads=Hkv, head_dim=D, scale=D ** -0.5)
        pos = torch.arange(L)
        slots = table[pos // bs] * bs + pos % bs
        mask = visible(torch.arange(past, L), pos, None) if past else None

        def ours():
            return ops.prefill_attention(q, kv, table, past, bs, 0, spec.scale, 0.0)

        def sdpa():  # the backend's unfused chunk path
            k, v = kv[0][slots].transpose(0, 1)[None], kv[1][slots].transpose(0, 1)[None]  # (1, Hkv, L, D)
            return _attend(q.transpose(0, 1)[None], k, v, mask, mask is None, spec)[0].transpose(0, 1)

        diff = (ours().float() - sdpa().float()).abs().max().item()
        times = {"fused": [], "sdpa": []}
        for _ in range(a.rounds):
            for key, f in (("fused", ours), ("sdpa", sdpa)):
                t = time.perf_counter()
                f()
                times[key].append(time.perf_counter() - t)
        fused, peer = (1e3 * statistics.median(times[k]) for k in ("fused", "sdpa"))
        flops = 4 * H * D * (C * past + C * C / 2)  # causal: half the square
        res["cases"][name] = {"fused_ms": round(fused, 3), "sdpa_ms": round(peer, 3),
                              "speedup": round(peer / fused, 2), "fused_gflops": round(flops / fused / 1e6, 1),
                              "max_abs_diff": diff}
        print(f"{name:22s} fused {fused:7.2f} ms ({flops / fused / 1e6:5.0f} GFLOP/s)  sdpa {peer:7.2f} ms  "
              f"{peer / fused:5.2f}x  (max |diff| {diff:.1e})", flush=True)
    import subprocess

    served = {"fused": [], "sdpa": []}
    for _ in range(a.engine_rounds):
        for case in served:
            p = subprocess.run([sys.executable, __file__, "--served-case", case, "--threads", str(a.threads)],
                               capture_output=True, text=True, cwd=ROOT)
            if p.returncode:
                raise RuntimeError(f"served {case} failed:\n{p.stderr[-3000:]}")
            served[case].append(json.loads(p.stdout.strip().splitlines()[-1]))
    if a.engine_rounds:
        f, b = (statistics.median(served[k]) for k in ("fused", "sdpa"))
        res["served_prefill_512"] = {"fused_ms": round(f, 1), "sdpa_ms": round(b, 1), "speedup": round(b / f, 3),
                                     "runs": served}
        print(f"served 512-token prefill (bf16 default model): fused {f:.1f} ms  sdpa {b:.1f} ms  {b / f:.2f}x")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
