"""Per-Linear kernel timings on the default model's shapes: where each low-bit kernel wins.

For each Linear shape of SmolLM2-135M and row counts from decode (1) to prefill (512): the dense
matmul in fp32 and bf16, our runtime modules (int8 weight-only, int4 GPTQ, w8a8) on their fast path
and on the dequantize path. This is the measurement behind INT8PACK_MAX_ROWS / INT4PACK_MAX_ROWS.

    python bench/kernels.py
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from quant import gptq, int4, layers

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"q/o 576x576": (576, 576), "gate/up 1536x576": (1536, 576), "down 576x1536": (576, 1536)}
ROWS = (1, 8, 32, 64, 512)


def timeit(fn, min_time=0.2) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    samples = []
    while time.perf_counter() - t0 < min_time or n < 5:
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
        n += 1
    return statistics.median(samples) * 1e6


@torch.inference_mode()
def main() -> None:
    torch.manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        lin = nn.Linear(k, n, bias=False)
        w8 = layers.Int8WeightLinear.from_float(lin, affine=False)
        w4 = int4.GPTQLinear.from_quantized(gptq.rtn(lin.weight.data, 4, 64), None, v2=False)
        w4.prepare(torch.bfloat16)
        a8 = layers.W8A8Linear.from_float(lin, input_scale=0.05)
        wb = lin.weight.data.bfloat16()
        for m in ROWS:
            x32 = torch.randn(m, k)
            xb = x32.bfloat16()
            r = {
                "shape": name, "rows": m,
                "dense fp32": timeit(lambda: x32 @ lin.weight.data.t()),
                "dense bf16": timeit(lambda: xb @ wb.t()),
                "int8 kernel (bf16)": timeit(lambda: torch.ops.aten._weight_int8pack_mm(xb, w8.weight, w8.weight_scale.bfloat16())),
                "int8 dequant+dense (bf16)": timeit(lambda: xb @ w8.dequantized(torch.bfloat16).t()),
                "int4 kernel (bf16)": timeit(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w4.packed, 64, w4.scales_zeros)),
                "int4 dequant+dense (bf16)": timeit(lambda: xb @ w4.dequantized(torch.bfloat16).t()),
                "w8a8 _int_mm (incl. act quant)": timeit(lambda: a8(xb)),
            }
            rows.append(r)
    out = ROOT / "bench" / "out" / "kernels.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    cols = [c for c in rows[0] if c not in ("shape", "rows")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median microseconds per call")
    print("| shape | rows | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for r in rows:
        print(f"| {r['shape']} | {r['rows']} | " + " | ".join(f"{r[c]:.0f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
