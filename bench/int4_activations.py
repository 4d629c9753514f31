"""What int8 activations cost the w4a16 default model in quality (``--int4-activations int8``), and what they buy in
its projections' one-row speed.

    python bench/int4_activations.py [--windows 40] [--seqlen 512] [--artifacts DIR] [--rounds 300] [--json]

Quality: the w4a16 artifact (built under --artifacts where absent) evaluated in float32 on WikiText-2 test windows,
its projections on their input as it is and on its input quantized in blocks of 32 columns (the served int8 path's
function: quant.runtime.int4.GPTQLinear.use_int8_activations), each against the float model (Δppl %, mean KL,
top-1 agreement) and the int8 one against the same weights on float activations.
Speed: each projection of a layer as the server calls it (q/k/v and gate/up fused), one and four bf16 rows (a
verification's), the exact ``rows`` op against ``rows16`` (``rows.int4_a16``: int16 block activations, the default
plans' path for 16-bit rows) and the int8 one (``rows.int4_a8``), called in turn, median µs of --rounds calls, on this
process's threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common import cpu_name, ensure_artifact

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "wikitext-2" / "test.txt"


def quality(art_path: Path, windows: int, seqlen: int) -> list[dict]:
    import torch

    from quant.build import calibration
    from quant.build.evaluate import compare
    from quant.format import sources
    from quant.format.sources import default_cache_dir
    from quant.runtime import int4, loader

    base, tok = sources.load_model(sources.resolve(None, default_cache_dir()), torch.float32)
    exact = loader.load(str(art_path), dtype=torch.float32).model
    a8 = loader.load(str(art_path), dtype=torch.float32).model
    int4.use_int8_activations(a8)
    wins = calibration.eval_windows(tok, DATA, windows, seqlen)
    on_float = compare(base, {"w4a16": exact, "w4a16, int8 activations": a8}, wins, progress=False)
    on_w4 = compare(exact, {"w4a16, int8 activations": a8}, wins, progress=False)
    rows = [{"model": name, "against": "float model", **q.to_dict()} for name, q in on_float.items()]
    rows += [{"model": name, "against": "w4a16", **q.to_dict()} for name, q in on_w4.items()]
    return rows


def speed(art_path: Path, rounds: int) -> list[dict]:
    import torch

    from quant.runtime import int4, loader
    from quant.runtime.kernels import rows as rowops

    model = loader.load(str(art_path), dtype=torch.bfloat16).model
    layer = model.model.layers[0]  # the projections as the server fuses them: q/k/v and gate/up one product each
    att, mlp = layer.self_attn, layer.mlp
    mods = [int4.GPTQLinear.fuse([att.q_proj, att.k_proj, att.v_proj]), att.o_proj,
            int4.GPTQLinear.fuse([mlp.gate_proj, mlp.up_proj]), mlp.down_proj]
    shapes = {(m.out_features, m.in_features): m for m in mods}
    out = []
    for (n, k), m in sorted(shapes.items()):
        layout = int4.cpu_layout()
        if not int4.int8_activations_supported(layout, n, k, m.group_size):
            continue
        bias = None if m.bias is None else m.bias.data.float()
        calls = {"float": rowops.int4(m.packed, n, k, layout, m.scales_zeros, m.group_size, bias),
                 "int16": rowops.int4_a16(m.packed, n, k, m.scales_zeros, m.group_size, bias),
                 "int8": rowops.int4_a8(m.packed, n, k, m.scales_zeros, m.group_size, bias)}
        for rows in (1, 4):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(0)).bfloat16()
            times = {name: [] for name in calls}
            for name, call in calls.items():
                for _ in range(20):
                    call(x)
            for _ in range(rounds):
                for name, call in calls.items():
                    t = time.perf_counter()
                    call(x)
                    times[name].append(time.perf_counter() - t)
            us = {name: 1e6 * statistics.median(ts) for name, ts in times.items()}
            out.append({"n": n, "k": k, "rows": rows, **{f"{name}_us": v for name, v in us.items()},
                        "int16_speedup": us["float"] / us["int16"], "speedup": us["float"] / us["int8"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--artifacts", default=str(ROOT / "bench" / "out" / "quality"))
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    from quant.format.sources import default_cache_dir

    art = ensure_artifact(Path(args.artifacts), "w4a16", default_cache_dir())
    report = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "speed": speed(art, args.rounds)}
    if not args.json:
        for r in report["speed"]:
            print(f"{r['n']:5d} x {r['k']:5d}, {r['rows']} row(s): float {r['float_us']:7.1f} us, int16 "
                  f"{r['int16_us']:7.1f} us ({r['int16_speedup']:.2f}x), int8 {r['int8_us']:7.1f} us "
                  f"({r['speedup']:.2f}x)", flush=True)
    if not args.skip_quality:
        report["windows"], report["seqlen"] = args.windows, args.seqlen
        report["quality"] = quality(art, args.windows, args.seqlen)
        if not args.json:
            for r in report["quality"]:
                print(f"{r['model']:26s} against {r['against']:12s}: Δppl {r['delta_ppl_pct']:+.3f}% ± "
                      f"{r['delta_ppl_se_pct']:.3f}  KL {r['mean_kl']:.5f}  top-1 {r['top1_agreement']:.4f}", flush=True)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"CPU: {report['cpu']}, {report['threads']} threads; quality in float32 on WikiText-2 test")


if __name__ == "__main__":
    main()
