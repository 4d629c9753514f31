"""GPTQ's streamed Hessian on the CPU: the upper-triangle row blocks of `quant.gptq.Hessian` against one full
`addmm_` per sample (what it replaced), for the input widths of the default model (576, 1536) and an 8B model
(4096). Each: 16 samples of 512 rows (4 for K = 4096), median of 5 repeats, one process, nothing else running.

    python bench/hessian.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_time import cpu_name  # noqa: E402

from quant.gptq import Hessian  # noqa: E402


def full(xs: list[torch.Tensor], k: int) -> torch.Tensor:
    h = torch.zeros(k, k)
    for x in xs:
        h.addmm_(x.t(), x)
    return h


def blocked(xs: list[torch.Tensor], k: int) -> torch.Tensor:
    h = Hessian(k)
    for x in xs:
        h.add(x)
    return h.value()


def median_ms(f, *args, repeats: int = 5) -> float:
    f(*args)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(*args)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| K | samples x rows | full addmm_ ms | upper-triangle blocks ms | ratio |\n|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for k, n in ((576, 16), (1536, 16), (4096, 4)):
        xs = [torch.randn(512, k, generator=g) for _ in range(n)]
        ref = 2 * full(xs, k) / (512 * n)
        assert torch.allclose(blocked(xs, k), ref, rtol=1e-4, atol=1e-4)
        a, b = median_ms(full, xs, k), median_ms(blocked, xs, k)
        print(f"| {k} | {n} x 512 | {a:.1f} | {b:.1f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
