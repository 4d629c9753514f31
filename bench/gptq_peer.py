"""Our w4a16 (GPTQ) build of the default model against GPTQModel's, on the same calibration tokens.

Both quantize SmolLM2-135M (fp32 source) to 4 bits, symmetric, group 64 (the default model's), damping
0.01, with activation ordering in its static-group form (ours: --act-order; GPTQModel: its default
act_group_aware), on WikiText-2 valid 128 x 512 tokens (seed 0): the bench draws the windows with our
calibration code, checks our build's manifest fingerprint against them, and hands GPTQModel the same ids.
Quality: both (and RTN, the no-calibration floor) against the fp32 base on WikiText-2 test windows in one
pass; GPTQModel's checkpoint is dequantized with the GPTQ format's formula, ours is loaded as served (fp32).
"Recovers" is the share of RTN's Δppl that GPTQ removes.

GPTQModel needs torch >= 2.14.1, so it runs from a venv of its own, nothing of ours imported there:
    python3 -m venv /tmp/gptqm && /tmp/gptqm/bin/pip install torch==2.14.1 gptqmodel==7.7.0
    python bench/gptq_peer.py --peer-python /tmp/gptqm/bin/python [--out bench/out/gptq_peer]
Takes ~25 minutes on 2 cores. Nothing else may run meanwhile (both sides use every core).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import cpu_name

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"
GROUP, DAMP, SEED = 64, 0.01, 0


def _ours(out: Path, scheme: str, samples: int, seqlen: int) -> dict:
    cmd = [sys.executable, "-m", "quant.cli", "build", "--scheme", scheme, "--out", str(out), "--force",
           "--calib", str(DATA / "valid.txt"), "--calib-samples", str(samples), "--calib-seqlen", str(seqlen),
           "--seed", str(SEED), "--group-size", str(GROUP), "--no-progress"]
    if scheme == "w4a16":
        cmd += ["--act-order", "--damp", str(DAMP)]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    wall = time.perf_counter() - t
    m = json.loads((out / "quant_manifest.json").read_text())
    return {"wall_s": wall, "quantize_s": m["timings"]["quantize_s"], "manifest": m}


def _peer(python: str, model: Path, ids: Path, out: Path) -> dict:
    env = {**os.environ, "GPTQMODEL_CPU_WORKERS": str(os.cpu_count() or 1)}  # its default asks for 2 x cores/2
    cmd = [python, str(ROOT / "bench" / "peers" / "gptqmodel_build.py"), str(model), str(ids), str(out),
           "--group-size", str(GROUP), "--damp", str(DAMP)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=out.parent)
    wall = time.perf_counter() - t
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, **stats}


def _dequantized_peer(base_dir: Path, peer_dir: Path):
    """The fp32 base with every Linear GPTQModel quantized replaced by its dequantized weight."""
    from safetensors import safe_open

    from quant.format import sources as models
    from quant.runtime.kernels.int4_layout import dequantize_gptq

    qc = json.loads((peer_dir / "quantize_config.json").read_text())
    assert qc["bits"] == 4 and qc.get("checkpoint_format", qc.get("format")) == "gptq", qc
    model, _ = models.load_model(models.resolve(str(base_dir), models.default_cache_dir()))
    with safe_open(str(peer_dir / "model.safetensors"), "pt") as f:
        names = sorted(k[: -len(".qweight")] for k in f.keys() if k.endswith(".qweight"))
        for n in names:
            t = {p: f.get_tensor(f"{n}.{p}") for p in ("qweight", "qzeros", "scales", "g_idx")}
            w = dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], v2=False)  # (N, K)
            lin = model.get_submodule(n)
            assert lin.weight.shape == w.shape, (n, lin.weight.shape, w.shape)
            lin.weight.data = w.float()
    return model, len(names)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer-python", required=True, help="python of a venv with gptqmodel installed")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "gptq_peer"))
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=40)
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    from quant import load
    from quant.build import calibration, evaluate
    from quant.format import sources as models

    src = models.resolve(None, models.default_cache_dir())
    base, tok = models.load_model(src)
    win = calibration.random_windows(tok, DATA / "valid.txt", args.samples, args.seqlen, SEED)
    torch.save(win.ids, out / "calib_ids.pt")
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__} (ours)", flush=True)

    ours = _ours(out / "ours", "w4a16", args.samples, args.seqlen)
    got = ours["manifest"]["calibration"]["fingerprint"]
    assert got == win.fingerprint, f"our build calibrated on other tokens: {got} != {win.fingerprint}"
    print(f"ours: quantize {ours['quantize_s']:.1f} s, process {ours['wall_s']:.1f} s", flush=True)
    peer = _peer(args.peer_python, Path(src.path), out / "calib_ids.pt", out / "gptqmodel")
    print(f"GPTQModel: quantize {peer['quantize_s']:.1f} s, process {peer['wall_s']:.1f} s "
          f"(act_group_aware={peer['act_group_aware']}, desc_act={peer['desc_act']})", flush=True)
    rtn = _ours(out / "rtn", "rtn-w4", args.samples, args.seqlen)

    peer_model, n_peer = _dequantized_peer(Path(src.path), out / "gptqmodel")
    windows = calibration.eval_windows(tok, DATA / "test.txt", args.eval_windows, args.seqlen)
    from quant.runtime.int4 import GPTQLinear

    ours_model = load(out / "ours", dtype=torch.float32).model
    n_ours = sum(isinstance(m, GPTQLinear) for m in ours_model.modules())
    cands = {"ours": ours_model, "gptqmodel": peer_model,
             "rtn": load(out / "rtn", dtype=torch.float32).model}
    res = evaluate.compare(base, cands, windows, progress=False)
    rtn_d = res["rtn"].delta_ppl_pct
    print(f"\nbase ppl {res['rtn'].base_ppl:.3f}; Linears quantized: {n_ours} by ours, {n_peer} by GPTQModel")
    print("| build | quantize s | process s | ppl | Δppl % | mean KL | recovers of RTN's Δppl |\n|---|---|---|---|---|---|---|")
    rows = {"ours": ours, "gptqmodel": peer, "rtn": rtn}
    for name, q in res.items():
        rec = "" if name == "rtn" else f"{100 * (rtn_d - q.delta_ppl_pct) / rtn_d:.1f}%"
        print(f"| {name} | {rows[name]['quantize_s']:.1f} | {rows[name]['wall_s']:.1f} | {q.ppl:.3f} | "
              f"{q.delta_ppl_pct:+.2f} | {q.mean_kl:.4f} | {rec} |")
    print(f"\nours / GPTQModel: quantize {ours['quantize_s'] / peer['quantize_s']:.2f}x, "
          f"process {ours['wall_s'] / peer['wall_s']:.2f}x")


if __name__ == "__main__":
    main()
