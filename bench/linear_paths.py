"""Per-Linear path timings on the default model's served shapes: where each path wins, and what the tiled `gemm`
path (quant/runtime/kernels/gemm.py) gains over the dequantize + dense product it stands in for, against the unquantized Linear.

For each projection of SmolLM2-135M as the server fuses them (q/k/v 960x576, o 576x576, gate/up 3072x576, down
576x1536; with ``--head`` also the tied 49152x576 head, which int8 embeddings serve as int8-sym rows) and each row
count, every path the runtime modules offer for bf16 activations (``paths(bf16)``: the same call the kernel plans
time) for the unquantized bf16 Linear, int8-sym, int4 (GPTQ layout, RTN codes, group 64) and
W8A8 (static scale); the paths of one shape and row count are called in turn, a round at a time, so a change in the
machine's speed falls on all alike; median µs. Weights are warm (one shape at a time): a served layer's are read
from memory, which bench/cpu_paths.py measures end to end.

    python bench/linear_paths.py [--rows 64,256,512] [--rounds 15] [--head]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python bench/linear_paths.py  # AVX2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {"qkv 960x576": (960, 576), "o 576x576": (576, 576), "gate/up 3072x576": (3072, 576),
          "down 576x1536": (576, 1536)}
HEAD = {"head 49152x576": (49152, 576)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64,256,512")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--head", action="store_true", help="also the default model's head shape")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "kernels.json"))
    a = ap.parse_args()

    import torch
    from torch import nn

    from quant.build import gptq
    from quant.runtime import int4
    from quant.runtime.int8 import Int8WeightLinear
    from quant.runtime.kernel_choice import dense_paths
    from quant.runtime.w8a8 import W8A8Linear

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dt = torch.bfloat16
    results = []
    with torch.inference_mode():
        for name, (n, k) in (SHAPES | (HEAD if a.head else {})).items():
            lin = nn.Linear(k, n, bias=False)
            w8 = Int8WeightLinear.from_float(lin, affine=False)
            w4 = int4.GPTQLinear.from_quantized(gptq.rtn(lin.weight.data, 4, 64), None, v2=False)
            a8 = W8A8Linear.from_float(lin, input_scale=0.05)
            for m in (w8, w4, a8):
                m.prepare(dt)
            paths = {f"bf16 {p}": f for p, f in dense_paths(lin.weight.data.to(dt), None, dt).items()}
            for label, mod in (("int8", w8), ("int4", w4), ("w8a8", a8)):
                paths.update({f"{label} {p}": f for p, f in mod.paths(dt).items()})
            for rows in (int(r) for r in a.rows.split(",")):
                x = torch.randn(rows, k).to(dt)  # (M, K)
                samples: dict[str, list[float]] = {p: [] for p in paths}
                for f in paths.values():
                    f(x)
                for _ in range(a.rounds):
                    for p, f in paths.items():
                        t = time.perf_counter()
                        f(x)
                        samples[p].append(time.perf_counter() - t)
                us = {p: round(statistics.median(v) * 1e6, 1) for p, v in samples.items()}
                results.append({"shape": name, "rows": rows, "us": us})
                best = {s: min((v, p) for p, v in us.items() if p.startswith(s + " ")) for s in ("bf16", "int8",
                                                                                                   "int4", "w8a8")}
                print(f"{name} x {rows} rows: " + ", ".join(f"{s} best {p.split(' ', 1)[1]} {v:.0f}"
                                                            for s, (v, p) in best.items()), flush=True)
    info = {"capability": torch.backends.cpu.get_cpu_capability(), "threads": a.threads,
            "torch": torch.__version__, "results": results}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(info, indent=2))
    cols = sorted({p for r in results for p in r["us"]})
    print(f"\n{info['capability']}, {a.threads} threads, torch {torch.__version__}; median µs per call")
    print("| shape | rows | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for r in results:
        print(f"| {r['shape']} | {r['rows']} | " + " | ".join(f"{r['us'].get(c, float('nan')):.0f}" for c in cols)
              + " |")


if __name__ == "__main__":
    main()
