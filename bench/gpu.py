"""The GPU check and benchmarks (run by scripts/gpu_check.sh on a machine with a CUDA device).

    python bench/gpu.py [--out DIR] [--quick] [--only PARTS] [--deadline SECONDS]

Parts, in the order a lease runs them (PARTS): headline, bf16, attention, linear, gemv, engine, default; a part's
timings stop at PART_S seconds (what was cut is reported) so that each ends within two minutes.

1. Kernels vs their plain PyTorch references on the GPU, at the default model's shapes and an 8B model's
   (Llama-3-8B: hidden 4096, MLP 14336, 32/8 heads of 128): the Triton W4A16 and int8 GEMMs, the Triton paged
   attention (decode with split-K, prefill with past). Any mismatch past tolerance fails the run.
2. Kernel timings (CUDA events, median of repeats), the peers in the same run: W4A16 Triton vs tinygemm
   (``_weight_int4pack_mm``) vs bf16 cuBLAS; int8 Triton vs ``_weight_int8pack_mm`` vs bf16; paged decode
   attention (Triton) vs the sdpa backend's gather path.
3. The engine on the GPU over random-weight models of the default model's shape and an 8B shape, w4a16 (random
   codes: the speed does not depend on the values), and a bf16 8B beside it: batch-1 greedy decode tok/s and its share of the bandwidth
   limit (weight bytes / peak bandwidth), TTFT of a 512-token prompt, 64 streams x 512 tokens aggregate tok/s
   with the triton backend vs the sdpa backend, host syncs per decode step (torch.cuda.set_sync_debug_mode),
   and the accounting (weights, KV pool, activation estimate) against the CUDA allocator.

Writes DIR/gpu.json and DIR/gpu.md (the RESULTS.md section). Exit status 1 when a correctness check fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEAK_BW = {"H100": 3.35e12, "H200": 4.8e12}  # HBM bytes/s by the vendor's figure (H100 SXM5, H200)
SHAPES = {
    "135M": dict(hidden=576, inter=1536, layers=30, heads=9, kv=3, vocab=49152),
    "8B": dict(hidden=4096, inter=14336, layers=32, heads=32, kv=8, vocab=128256),
}


PART_S = 110.0  # a part's timings stop after this many seconds (each part of a lease's check ends within 120 s)


class Clock:
    """A part's time: timings past ``limit`` seconds are skipped (what was cut is reported), checks still run."""

    def __init__(self, limit: float = PART_S):
        self.t0, self.limit, self.cut = time.perf_counter(), limit, 0

    def over(self) -> bool:
        return time.perf_counter() - self.t0 > self.limit


def cuda_time(fn, reps: int = 20, warm: int = 3, inner: int = 10, graph: bool = True) -> float:
    """Median seconds of one fn() on the GPU (quant.timing.cuda_time_us: calls captured in a CUDA graph and
    replayed, as the decode step's graphs replay them, the L2 written over before each); ``graph=False``: eager
    calls, for a peer that synchronises (the sdpa gather path builds its metadata from host lists)."""
    from quant.timing import cuda_time_us

    return cuda_time_us(fn, reps, warm, inner, graph=graph) / 1e6


# ----------------------------------------------------------------------------------------------- 1 + 2: kernels

def linear_shapes(name: str) -> list[tuple[str, int, int]]:
    s = SHAPES[name]
    qkv = (s["heads"] + 2 * s["kv"]) * (s["hidden"] // s["heads"])
    return [("qkv", qkv, s["hidden"]), ("o", s["hidden"], s["hidden"]), ("gate_up", 2 * s["inter"], s["hidden"]),
            ("down", s["hidden"], s["inter"])]


def random_w4(n: int, k: int, gs: int, dtype, dev):
    from quant.int4 import pack_rows

    codes = torch.randint(0, 16, (n, k), device=dev)
    s = torch.rand(k // gs, n, device=dev) * 0.02 + 0.001
    zero = torch.randint(0, 16, (k // gs, n), device=dev).float()
    sz = torch.stack([s, s * (8 - zero)], dim=-1).to(dtype).contiguous()
    return pack_rows(codes.t().contiguous()), sz, codes


def rel_err(got, want) -> float:
    """Max absolute error relative to the reference's largest magnitude."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def kernel_checks(results: dict, failures: list, quick: bool, clock: Clock) -> None:
    """The W4A16 and int8 products against their references at every row count, the 8B shapes first; timed beside
    their peers while the part's clock allows (rows past it are checked, not timed)."""
    from quant import triton_ops as T
    from quant.int4 import _pack_for_kernel
    from quant.primitives import dequantize_weight

    dev = "cuda"
    rows = []
    for shape in ("8B", "135M"):
        for name, n, k in linear_shapes(shape):
            gs = 64 if shape == "135M" else 128
            for dtype in (torch.bfloat16, torch.float16):
                qw, sz, codes = random_w4(n, k, gs, dtype, dev)
                if dtype == torch.bfloat16:  # the peers' weights, made once per shape
                    w_ref = torch.randn(n, k, device=dev, dtype=dtype)
                    packed = _pack_for_kernel(codes.to(torch.int32)) if k % 32 == 0 else None
                for m in (1, 16, 256) if quick else (1, 4, 16, 64, 256, 1024):
                    x = torch.randn(m, k, device=dev).to(dtype)
                    got = T.w4_matmul(x, qw, sz, gs)
                    want = T.w4_reference(x, qw, sz, gs)
                    err = rel_err(got, want)
                    row = {"op": "w4", "shape": shape, "layer": name, "n": n, "k": k, "m": m, "dtype": str(dtype)[6:],
                           "rel_err": err}
                    if err > 2e-2:
                        failures.append(f"w4 {shape} {name} m={m} {dtype}: relative error {err:.3g}")
                    if T.w4_planes_launch(x, gs, True) is not None:  # the code planes: a symmetric table too
                        sym = sz.clone()
                        sym[..., 1] = 0
                        if rel_err(T.w4_matmul(x, qw, sym, gs, zero_free=True), T.w4_reference(x, qw, sym, gs)) > 2e-2:
                            failures.append(f"w4 symmetric {shape} {name} m={m} {dtype}: relative error past 2e-2")
                        if dtype == torch.bfloat16 and not clock.over():  # beside the whole-weight path, replaced here
                            row["sym_us"] = cuda_time(lambda: T.w4_matmul(x, qw, sym, gs, zero_free=True)) * 1e6
                            row["whole_us"] = cuda_time(lambda: T._launch("w4_kernel", x, n, k, T.w4_block_k(gs, m),
                                                                          qw, sz, GS=gs)) * 1e6
                    if dtype == torch.bfloat16 and clock.over():
                        clock.cut += 1
                    elif dtype == torch.bfloat16:
                        row["triton_us"] = cuda_time(lambda: T.w4_matmul(x, qw, sz, gs)) * 1e6
                        if packed is not None:
                            row["tinygemm_us"] = cuda_time(
                                lambda: torch.ops.aten._weight_int4pack_mm(x, packed, gs, sz)) * 1e6
                            row["tinygemm_rel_err"] = rel_err(torch.ops.aten._weight_int4pack_mm(x, packed, gs, sz),
                                                              want)
                        row["bf16_us"] = cuda_time(lambda: x @ w_ref.t()) * 1e6
                        row["dequant_cublas_us"] = cuda_time(lambda: x @ T.w4_dequant(qw, sz, gs, dtype)) * 1e6
                    rows.append(row)
            # int8 weight-only
            w8 = torch.randint(-128, 128, (n, k), device=dev, dtype=torch.int8)
            sc = torch.rand(n, device=dev) * 0.01
            zp = torch.randint(-10, 10, (n,), device=dev, dtype=torch.int8)
            wb = w8.to(torch.bfloat16)
            for m in (1, 16, 256) if quick else (1, 16, 64, 256, 1024):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                errs = []
                for zero in (None, zp):
                    errs.append(rel_err(T.int8_matmul(x, w8, sc, zero), T.int8_reference(x, w8, sc, zero)))
                    if errs[-1] > 2e-2:
                        failures.append(f"int8 {shape} {name} m={m} affine={zero is not None}: rel error "
                                        f"{errs[-1]:.3g}")
                row = {"op": "int8", "shape": shape, "layer": name, "n": n, "k": k, "m": m, "rel_err": max(errs)}
                if clock.over():
                    clock.cut += 1
                else:
                    row["triton_us"] = cuda_time(lambda: T.int8_matmul(x, w8, sc, None)) * 1e6
                    row["int8pack_us"] = cuda_time(
                        lambda: torch.ops.aten._weight_int8pack_mm(x, w8, sc.to(x.dtype))) * 1e6
                    row["bf16_us"] = cuda_time(lambda: x @ wb.t()) * 1e6
                    row["dequant_cublas_us"] = cuda_time(
                        lambda: x @ dequantize_weight(w8, sc, None, x.dtype).t()) * 1e6
                rows.append(row)
    results["linear"] = rows
    if clock.cut:
        results.setdefault("cut", []).append(f"linear: {clock.cut} rows checked but not timed (past "
                                             f"{clock.limit:.0f} s)")


GEMV_SWEEP = [(bn, bk, split, warps) for bn in (64, 128, 256) for bk in (64, 128) for split in (1, 2, 4, 8)
              for warps in (4, 8)] + [(512, 32, split, 4) for split in (1, 2, 4, 8)]  # 52 variants, at four shapes
INT8_GEMV_SWEEP = [(bn, bk, split, warps) for bn in (32, 64, 128) for bk in (128, 256) for split in (1, 2, 4, 8)
                   for warps in (4, 8)]


def _searched(row: dict, space_of, gemv, x, want, k: int) -> None:
    """What the server's search (quant.kernel_choice.search, from the rule's config) picks for this layer, how many
    launches it measured and how long it took, and the pick's time measured as the sweep measures: in ``row``."""
    from quant.kernel_choice import LaunchSpace, search
    from quant.triton_ops import GEMV_AXES

    start, axes = space_of
    t = time.perf_counter()
    cfg, timed = search(LaunchSpace(start, axes, GEMV_AXES, lambda c: (lambda xx: gemv(c)), lambda xx: want), k,
                        x.dtype, x.device)
    row.update(searched=cfg, searched_measured=len(timed), search_s=time.perf_counter() - t,
               searched_us=cuda_time(lambda: gemv(cfg)) * 1e6)


def _sweep(row: dict, gemv, configs, want, failures: list, peers: tuple[str, ...], bw: float | None,
           clock: Clock) -> dict:
    """Time ``gemv(config)`` over ``configs`` (each first held to ``want``), add the fastest to ``row`` and each
    timing's share of the bandwidth limit (``row["bytes"]`` read once) for the rule, the fastest, the search's
    pick and ``peers``."""
    times = {}
    for cfg in configs:
        if clock.over() and times:  # the rule and the search's pick are timed already; the rest of the sweep waits
            clock.cut += 1
            continue
        err = rel_err(gemv(cfg), want)
        if err > 2e-2:
            failures.append(f"{row['op']} gemv {row['layer']} config {cfg}: relative error {err:.3g}")
            continue
        times[cfg] = cuda_time(lambda: gemv(cfg)) * 1e6
    best = min(times, key=times.get)
    row.update(best=best, best_us=times[best], top5=sorted(times.items(), key=lambda kv: kv[1])[:5])
    if bw:
        for key in ("rule", "best", "searched", *peers):
            row[f"{key}_bw_share"] = row["bytes"] / (row[f"{key}_us"] * 1e-6) / bw
    return row


def _gated(gemv, failures: list) -> dict:
    """A decode step's gate_up as the engine launches it, the activation in the GEMV's epilogue, against the GEMV then
    the glue's act_mul (two launches, what ran before session 25), at the rule's launch; the two must be equal."""
    from server import glue_triton as G

    if not torch.equal(gemv("silu_mul"), G.silu_mul(gemv())):
        failures.append("w4 gemv gate_up: the gated epilogue differs from the product then silu_mul")
    return {"gated_us": cuda_time(lambda: gemv("silu_mul")) * 1e6,
            "then_act_us": cuda_time(lambda: G.silu_mul(gemv())) * 1e6}


def _normed(gemv, n: int, failures: list) -> dict:
    """A decode step's down as the engine launches it, the residual add and the next RMSNorm in the GEMV's epilogue,
    against the GEMV then the glue's add_rms_norm (two launches, what ran before session 25), at the rule's launch."""
    from quant import triton_ops as T
    from server import glue_triton as G

    res = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
    got, want = gemv(T.AddNorm(res, w, 1e-5)), G.add_rms_norm(res, gemv(), w, 1e-5)
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
    if diff > 2e-2:
        failures.append(f"w4 gemv down: the norm epilogue differs from the product then add_rms_norm by {diff:.3g}")
    return {"normed_us": cuda_time(lambda: gemv(T.AddNorm(res, w, 1e-5))) * 1e6,
            "then_norm_us": cuda_time(lambda: G.add_rms_norm(res, gemv(), w, 1e-5)) * 1e6, "normed_max_diff": diff}


def gemv_sweep(results: dict, failures: list, clock: Clock) -> None:
    """The one-row W4A16 kernel at the 8B shapes (g128, bf16) over GEMV_SWEEP's tile shapes, splits and warps,
    against tinygemm and the two kernels before it (bench/gemv_v1.py, gemv_v2.py) in the same run: per layer the
    rule's config (quant.triton_ops.w4_gemv_config), the fastest, and each one's share of the bandwidth limit (the
    codes and the scale/zero table read once). Then the one-row int8 kernel over INT8_GEMV_SWEEP against the tiled
    int8 GEMM."""
    from gemv_v1 import w4_gemv_v1  # bench/: session 14's kernel, for the same-run comparison
    from gemv_v2 import w4_gemv_v2  # bench/: sessions 21-22's, which the present kernel replaced unmeasured

    from quant import triton_ops as T
    from quant.int4 import _pack_for_kernel

    dev, gs, dtype = "cuda", 128, torch.bfloat16
    bw = next((v for k, v in PEAK_BW.items() if k in torch.cuda.get_device_name()), None)
    sms = T.multiprocessors(torch.device(dev))
    rows = []
    for name, n, k in linear_shapes("8B"):
        qw, sz, codes = random_w4(n, k, gs, dtype, dev)
        packed = _pack_for_kernel(codes.to(torch.int32))
        x = torch.randn(1, k, device=dev, dtype=dtype)
        want = T.w4_reference(x, qw, sz, gs)
        for label, prior in (("v1", w4_gemv_v1), ("v2", w4_gemv_v2)):
            if rel_err(prior(x, qw, sz, gs), want) > 2e-2:
                failures.append(f"w4 gemv {label} {name}: relative error past 2e-2")
        row = {"op": "w4", "layer": name, "n": n, "k": k, "bytes": qw.nbytes + sz.nbytes,
               "rule": T.w4_gemv_config(n, k, gs, sms), "rule_us": cuda_time(lambda: T.w4_gemv(x, qw, sz, gs)) * 1e6,
               "tinygemm_us": cuda_time(lambda: torch.ops.aten._weight_int4pack_mm(x, packed, gs, sz)) * 1e6,
               "v1_us": cuda_time(lambda: w4_gemv_v1(x, qw, sz, gs)) * 1e6,
               "v2_us": cuda_time(lambda: w4_gemv_v2(x, qw, sz, gs)) * 1e6}
        sym = sz.clone()
        sym[..., 1] = 0  # a symmetric checkpoint's table: the rule's launch told its zeros are all 0
        if rel_err(T.w4_gemv(x, qw, sym, gs, None, True), T.w4_reference(x, qw, sym, gs)) > 2e-2:
            failures.append(f"w4 gemv symmetric {name}: relative error past 2e-2")
        row["sym_us"] = cuda_time(lambda: T.w4_gemv(x, qw, sym, gs, None, True)) * 1e6
        if name == "gate_up":
            row.update(_gated(lambda gated=None: T.w4_gemv(x, qw, sz, gs, None, False, gated), failures))
        if name == "down":
            row.update(_normed(lambda norm=None: T.w4_gemv(x, qw, sz, gs, None, False, None, norm), n, failures))
        _searched(row, T.w4_gemv_space(n, k, gs, sms), lambda cfg: T.w4_gemv(x, qw, sz, gs, cfg), x, want, k)
        rows.append(_sweep(row, lambda cfg: T.w4_gemv(x, qw, sz, gs, cfg), GEMV_SWEEP, want, failures,
                           ("sym", "v1", "v2", "tinygemm"), bw, clock))
    for name, n, k in linear_shapes("8B"):  # int8 weight-only, one row: the GEMV's rule and sweep vs the tiled GEMM
        w8 = torch.randint(-128, 128, (n, k), device=dev, dtype=torch.int8)
        sc = torch.rand(n, device=dev) * 0.01
        x = torch.randn(1, k, device=dev, dtype=dtype)
        row = {"op": "int8", "layer": name, "n": n, "k": k, "bytes": w8.nbytes + sc.nbytes,
               "rule": T.int8_gemv_config(n, k, sms), "rule_us": cuda_time(lambda: T.int8_gemv(x, w8, sc, None)) * 1e6,
               "gemm_us": cuda_time(lambda: T.int8_gemm(x, w8, sc, None)) * 1e6}
        want = T.int8_reference(x, w8, sc, None)
        _searched(row, T.int8_gemv_space(n, k, sms), lambda cfg: T.int8_gemv(x, w8, sc, None, cfg), x, want, k)
        rows.append(_sweep(row, lambda cfg: T.int8_gemv(x, w8, sc, None, cfg), INT8_GEMV_SWEEP, want, failures,
                           ("gemm",), bw, clock))
    results["gemv_sweep"] = rows
    if clock.cut:
        results.setdefault("cut", []).append(f"gemv: {clock.cut} sweep configurations not timed (past "
                                             f"{clock.limit:.0f} s)")


def attention_checks(results: dict, failures: list, quick: bool) -> None:
    """The paged attention (decode with split-K at four batch x context shapes, prefill with past) against the
    plain reference, timed beside the sdpa backend's gather path."""
    from server import fastops
    from server.attention import reference as R
    from server.attention.base import AttentionSpec
    from server.attention.sdpa import SdpaBackend
    from server.attention.triton_paged import TritonBackend
    from server.batch import StepInputs

    dev = torch.device("cuda")
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for shape, seqs, ctx in (("135M", 1, 512), ("8B", 1, 4096), ("8B", 64, 512), ("8B", 16, 2048)):
        s = SHAPES[shape]
        d = s["hidden"] // s["heads"]
        spec = AttentionSpec(s["heads"], s["kv"], d, d ** -0.5)
        bs = 16
        nblocks = seqs * (ctx // bs + 1) + 1
        storage = torch.randn(TritonBackend.kv_shape(1, nblocks, bs, s["kv"], d), device=dev, generator=g,
                              dtype=torch.bfloat16)
        perm = torch.randperm(nblocks, device="cpu").tolist()  # scattered pages, as a busy pool leaves them
        tables = [perm[i * (ctx // bs + 1): (i + 1) * (ctx // bs + 1)] for i in range(seqs)]
        q = torch.randn(seqs, s["heads"], d, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(seqs, s["kv"], d, device=dev, dtype=torch.bfloat16, generator=g)
        step = StepInputs(torch.zeros(seqs, dtype=torch.int64, device=dev), torch.full((seqs,), ctx, device=dev),
                          torch.tensor([t[ctx // bs] * bs + ctx % bs for t in tables], device=dev),
                          torch.zeros(seqs, dtype=torch.int64, device=dev), [(ctx, t) for t in tables], [], bs)
        ops = fastops.Ops("eager")
        tb = TritonBackend(storage, bs, [spec], ops)
        sb = SdpaBackend(storage.clone(), bs, [spec], ops)
        got = tb.forward(q, k, k, 0, tb.prepare(step))
        ref = sb.forward(q, k, k, 0, sb.prepare(step))
        kvv = tb.kv[0]
        worst = 0.0
        for i in range(min(seqs, 4)):
            slots = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(ctx + 1)], device=dev)
            want = R.attention(q[i:i + 1].float(), kvv[0, slots].float(), kvv[1, slots].float(),
                               torch.tensor([ctx], device=dev), torch.arange(ctx + 1, device=dev), spec)
            worst = max(worst, (got[i:i + 1].float() - want).abs().max().item())
        if worst > 2e-2:
            failures.append(f"paged decode {shape} {seqs}x{ctx}: max error {worst:.3g}")
        row = {"op": "decode_attention", "shape": shape, "seqs": seqs, "ctx": ctx, "max_err": worst,
               "sdpa_vs_triton_max_diff": (got.float() - ref.float()).abs().max().item(),
               "splits": tb.prepare(step).splits,
               # the metadata staged once, as a decode graph holds it (its copies are the step's, not the kernel's)
               "triton_us": cuda_time(lambda m=tb.prepare(step): tb.forward(q, k, k, 0, m)) * 1e6,
               "sdpa_gather_us": cuda_time(lambda: sb.forward(q, k, k, 0, sb.prepare(step)), graph=False) * 1e6}
        row["triton_page_us"] = _one_page_per_step(tb, lambda m=tb.prepare(step): tb.forward(q, k, k, 0, m))
        row.update(_fused_rope(tb, step, spec, q, k))
        if row["fused_rope_max_diff"] > 2e-2:
            failures.append(f"paged decode {shape} {seqs}x{ctx}: the fused rotary differs from rope_store_kv_ by "
                            f"{row['fused_rope_max_diff']:.3g}")
        rows.append(row)
    # prefill with past: a 512-token chunk after 1024 cached tokens
    s = SHAPES["8B"]
    d = 128
    spec = AttentionSpec(s["heads"], s["kv"], d, d ** -0.5)
    past, c, bs = 1024, 512, 16
    nb = (past + c) // bs
    storage = torch.randn(TritonBackend.kv_shape(1, nb + 4, bs, s["kv"], d), device=dev, generator=g,
                          dtype=torch.bfloat16)
    table = torch.randperm(nb + 4)[:nb].tolist()
    q = torch.randn(c, s["heads"], d, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(c, s["kv"], d, device=dev, dtype=torch.bfloat16, generator=g)
    slots_new = torch.tensor([table[p // bs] * bs + p % bs for p in range(past, past + c)], device=dev)
    step = StepInputs(torch.zeros(c, dtype=torch.int64, device=dev), torch.arange(past, past + c, device=dev),
                      slots_new, torch.tensor([c - 1], device=dev), [], [(0, c, past, table)], bs)
    tb = TritonBackend(storage, bs, [spec], fastops.Ops("eager"))
    sb = SdpaBackend(storage.clone(), bs, [spec], fastops.Ops("eager"))
    got = tb.forward(q, k, k, 0, tb.prepare(step))
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(past + c)], device=dev)
    want = R.attention(q.float(), tb.kv[0, 0, slots].float(), tb.kv[0, 1, slots].float(),
                       torch.arange(past, past + c, device=dev), torch.arange(past + c, device=dev), spec)
    err = (got.float() - want).abs().max().item()
    if err > 2e-2:
        failures.append(f"paged prefill 8B {c} after {past}: max error {err:.3g}")
    rows.append({"op": "prefill_attention", "shape": "8B", "chunk": c, "past": past, "max_err": err,
                 "triton_us": cuda_time(lambda m=tb.prepare(step): tb.forward(q, k, k, 0, m)) * 1e6,
                 "sdpa_us": cuda_time(lambda: sb.forward(q, k, k, 0, sb.prepare(step)), graph=False) * 1e6,
                 "triton_page_us": _one_page_per_step(tb, lambda m=tb.prepare(step): tb.forward(q, k, k, 0, m))})
    results["attention"] = rows


def _fused_rope(tb, step, spec, q, k) -> dict:
    """A decode step as the engine runs it: the rotary and the cache write inside the attention launch, against the
    triton glue's rope_store_kv_ launch before the attention's (what a decode step ran before session 25), same
    inputs. The cos/sin timed are 1 and 0, so that repeated calls leave q and k as they are; the check uses real
    angles."""
    from server import fastops
    from server.attention.triton_paged import paged_attention

    ops = fastops.Ops("triton")
    kvv, bs, seqs, d = tb.kv[0], tb.block_size, q.shape[0], q.shape[2]
    angles = torch.rand(seqs, d, device=q.device) * 100
    cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
    meta = tb.prepare(step)
    saved = kvv.clone()
    fused = paged_attention(q, kvv[0], kvv[1], meta, spec, bs, rope=(k, k, cos, sin))
    fused_kv = kvv.clone()
    kvv.copy_(saved)
    q2, k2 = q.clone(), k.clone()
    ops.rope_store_kv_(q2, k2, k2.clone(), cos, sin, kvv, meta.slots)
    pair = paged_attention(q2, kvv[0], kvv[1], meta, spec, bs)
    one, zero = torch.ones_like(cos), torch.zeros_like(sin)
    return {"fused_rope_max_diff": max((fused.float() - pair.float()).abs().max().item(),
                                       (fused_kv.float() - kvv.float()).abs().max().item()),
            "triton_fused_rope_us": cuda_time(lambda: paged_attention(q, kvv[0], kvv[1], meta, spec, bs,
                                                                      rope=(k, k, one, zero))) * 1e6,
            "triton_rope_then_attention_us": cuda_time(lambda: (ops.rope_store_kv_(q2, k2, k2, one, zero, kvv,
                                                                                   meta.slots),
                                                                paged_attention(q2, kvv[0], kvv[1], meta, spec,
                                                                                bs))) * 1e6}


def _one_page_per_step(backend, call) -> float:
    """µs of ``call`` with the backend's kernel stepping one page of keys at a time, as it did before session 23."""
    backend.keys_per_step = backend.block_size
    try:
        return cuda_time(call) * 1e6
    finally:
        backend.keys_per_step = None


# ----------------------------------------------------------------------------------------------- 3: the engine

def word_tokenizer(vocab: int):
    """A tokenizer over ids alone (random-weight models have no text): token i is the word 't<i>'."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="t2", eos_token="t1", unk_token="t0")


def random_model(shape: str, dev: str, scheme: str = "w4a16", gs: int = 128):
    """A Llama of the shape in bf16 on the device: with ``scheme="w4a16"`` every decoder Linear a GPTQLinear of
    random codes, prepared for bf16; with ``"bf16"`` plain Linears of random weights (the float peer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from quant.int4 import GPTQLinear, pack_rows

    s = SHAPES[shape]
    cfg = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=s["layers"],
                      num_attention_heads=s["heads"], num_key_value_heads=s["kv"], vocab_size=s["vocab"],
                      max_position_embeddings=8192, tie_word_embeddings=shape == "135M", eos_token_id=1,
                      torch_dtype="bfloat16")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)  # nothing allocated: the decoder Linears are replaced before any exists
    gs = gs if shape == "8B" else 64
    for layer in model.model.layers if scheme == "w4a16" else ():
        for parent in (layer.self_attn, layer.mlp):
            for name, lin in list(parent.named_children()):
                if not isinstance(lin, torch.nn.Linear):
                    continue
                n, k = lin.out_features, lin.in_features
                m = GPTQLinear(k, n, False, gs, v2=False, device=dev)
                m.qweight = pack_rows(torch.randint(0, 16, (k, n), device=dev))
                m.qzeros = pack_rows(torch.full((n, k // gs), 7, device=dev)).t().contiguous()
                m.scales = (torch.rand(k // gs, n, device=dev) * 0.004).half()
                m.g_idx = (torch.arange(k, device=dev) // gs).to(torch.int32)
                m.prepare(torch.bfloat16)
                setattr(parent, name, m)
    with torch.no_grad():  # the float rest (embeddings, norms, head), in bf16 on the device
        for mod in model.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                if p.is_meta:
                    t = torch.empty(p.shape, dtype=torch.bfloat16, device=dev)
                    t.fill_(1.0) if name == "weight" and p.dim() == 1 else t.normal_(0, 0.02)
                    setattr(mod, name, torch.nn.Parameter(t, requires_grad=False))
        for mod in model.modules():  # rotary tables and other buffers computed from the config
            for name, b in list(mod.named_buffers(recurse=False)):
                if b is not None and b.is_meta:
                    mod.register_buffer(name, torch.zeros(b.shape, dtype=b.dtype, device=dev), persistent=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


_PLANS: list[Path] = []  # one kernel-plan cache for this run's engines: a shape's kernels are measured once


def make_engine(model, tok, budget: str, fused_ops: bool = True, kernels: str = "measure"):
    import tempfile

    from server.engine import Engine, EngineConfig

    if not _PLANS:
        _PLANS.append(Path(tempfile.mkdtemp(prefix="quantserve-plans-")))
    return Engine(model, tok, EngineConfig(memory_budget=budget, dtype="bfloat16", device="cuda", max_batch=64,
                                           max_prefill_tokens=4096, fused_ops=fused_ops, kernels=kernels),
                  cache_dir=_PLANS[0]).start()


def use_backend(eng, mode: str, saved: dict) -> None:
    """Swap the engine's attention path between runs (same pool, same weights: a model's modules are fused once,
    so a second engine over them cannot be built): "triton+graphs" (what the engine chose), "triton" (eager
    steps), "sdpa" (the gather path, eager)."""
    from server import attention

    r = eng.runner
    saved.setdefault("start", (r.backend, r.graphs, r.attention))
    backend, graphs, name = saved["start"]
    if mode == "sdpa":
        cls = attention.BACKENDS["sdpa"]
        r.backend, r.graphs, r.attention = cls(eng.pool.storage, eng.layout.block_size, r.model.attention_specs,
                                               r.ops), None, "sdpa"
    else:
        r.backend, r.graphs, r.attention = backend, graphs if mode == "triton+graphs" else None, name


def run_requests(eng, prompts: list[list[int]], new: int) -> tuple[float, list]:
    from server.sampling import SamplingParams

    import concurrent.futures as cf

    p = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda pr: eng.complete(pr, p), prompts))
    return time.perf_counter() - t0, outs


def decode_profile(run, steps: int, top: int = 12) -> dict:
    """Where a batch-1 decode step's time goes on the device: ``run`` (one request of ``steps`` decode steps after
    its prefill) under torch.profiler, the device kernels it launched (those replayed inside CUDA graphs included)
    summed by name. Returns the wall time per step, the device's busy time per step (the rest is the device waiting
    on the host), kernels per step, and the ``top`` kernels by time (us per step, calls per step)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        run()
        wall = time.perf_counter() - t0
    by_name: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:  # a kernel or copy on the device
            by_name.setdefault(ev.name, []).append(ev.time_range.elapsed_us())
    busy = sum(sum(v) for v in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"wall_us_per_step": wall * 1e6 / (steps + 1), "device_busy_us_per_step": busy / (steps + 1),
            "kernels_per_step": sum(len(v) for v in by_name.values()) / (steps + 1),
            "top": [(name[:60], sum(v) / (steps + 1), len(v) / (steps + 1)) for name, v in ranked]}


def engine_bench(results: dict, failures: list, shape: str, quick: bool, headline: bool = False,
                 scheme: str = "w4a16") -> None:
    """headline: batch 1 (overlapped and serial steps, its profile), TTFT, host syncs, the accounting and 64 streams
    x 256 tokens as the engine runs them only; not the 64 streams on three backends nor the engines with the eager
    glue and the built-in kernel rules. ``scheme``: the decoder Linears' (w4a16 random codes, or bf16)."""
    dev = "cuda"
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = random_model(shape, dev, scheme)
    tok = word_tokenizer(SHAPES[shape]["vocab"])
    g = torch.Generator().manual_seed(0)
    vocab = SHAPES[shape]["vocab"]
    prompt = lambda n: torch.randint(2, vocab, (n,), generator=g).tolist()  # noqa: E731
    row: dict = {"shape": shape + (" (headline rows)" if headline else ""), "scheme": scheme}
    loaded = torch.cuda.memory_allocated()
    t = time.perf_counter()
    eng = make_engine(model, tok, "16GiB")  # kernels measured (this shape's first engine): launches, plans
    row["engine_start_s"] = time.perf_counter() - t
    try:
        row["kernels"] = list(eng.info.kernels)
        row["attention"] = eng.attention
        row["glue_ops"] = eng.info.glue_ops
        row["cuda_graphs"] = eng.cuda_graphs
        row["weight_bytes"] = eng.weight_bytes
        row["allocated_after_load"] = loaded - before
        row["kv_pool_bytes"] = eng.pool.capacity_bytes
        row["kv_pool_alloc"] = eng.pool.storage.untyped_storage().nbytes()
        name = torch.cuda.get_device_name()
        bw = next((v for k, v in PEAK_BW.items() if k in name), None)
        # batch 1: 128 new tokens after a 16-token prompt, 3 runs, median
        runs = []
        for _ in range(3):
            dt, outs = run_requests(eng, [prompt(16)], 128)
            runs.append(128 / dt)
        row["b1_tok_s"] = statistics.median(runs)
        eng.overlap = False  # the same with serial steps (each step's samples read before the next is launched)
        row["b1_serial_tok_s"] = statistics.median([128 / run_requests(eng, [prompt(16)], 128)[0] for _ in range(3)])
        eng.overlap = True
        row["b1_profile"] = decode_profile(lambda: run_requests(eng, [prompt(16)], 65), 64)
        # bytes a decode step reads: every weight but an untied input embedding (one row of it is looked up)
        emb = model.model.embed_tokens.weight
        row["read_bytes"] = eng.weight_bytes - (0 if model.lm_head.weight is emb else emb.nbytes)
        if bw:
            row["b1_bandwidth_share"] = row["b1_tok_s"] * row["read_bytes"] / bw
        # TTFT of a 512-token prompt (1 new token), median of 3
        ttft = [run_requests(eng, [prompt(512)], 1)[0] for _ in range(3)]
        row["ttft_512_ms"] = statistics.median(ttft) * 1e3
        # the prefix cache: a 1024-token prefix an earlier request wrote + a 32-token suffix, against 1056 tokens no
        # request began with (median of 3 each)
        stem = prompt(1024)
        run_requests(eng, [stem + prompt(32)], 1)  # publishes the stem's 64 blocks
        row["ttft_shared1024_cached_ms"] = statistics.median(
            [run_requests(eng, [stem + prompt(32)], 1)[0] for _ in range(3)]) * 1e3
        row["ttft_shared1024_uncached_ms"] = statistics.median(
            [run_requests(eng, [prompt(1056)], 1)[0] for _ in range(3)]) * 1e3
        # host syncs per decode step, counted by torch's sync debug mode over one batch-1 request
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                run_requests(eng, [prompt(16)], 33)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        row["syncs_per_step"] = len(syncs) / 33
        row["sync_sites"] = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})[:12]
        # activation estimate vs the allocator's peak over a 512-token prefill
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run_requests(eng, [prompt(512)], 1)
        row["prefill512_peak_over_base"] = torch.cuda.max_memory_allocated() - base
        row["prefill512_estimate"] = eng.activation_estimate(512, 0)
        results.setdefault("engine", []).append(row)
        if headline:  # the aggregate as the engine runs it (triton backend, graphs), the 64 x 256
            run_requests(eng, [prompt(16) for _ in range(4)], 8)  # warm
            dt, _ = run_requests(eng, [prompt(64) for _ in range(64)], 256)
            row["streams64x256_triton+graphs_tok_s"] = 64 * 256 / dt
            return
        # 64 streams x 512 new tokens, the triton backend vs the sdpa backend's gather path, same run
        streams, new = (64, 128) if quick else (64, 512)
        saved: dict = {}
        for mode in ("triton+graphs", "triton", "sdpa"):
            use_backend(eng, mode, saved)
            run_requests(eng, [prompt(16) for _ in range(4)], 8)  # warm
            dt, outs = run_requests(eng, [prompt(64) for _ in range(streams)], new)
            row[f"streams{streams}x{new}_{mode}_tok_s"] = streams * new / dt
            if mode == "triton":  # batch 1 without graphs, for the graphs' share
                row["b1_eager_tok_s"] = 128 / run_requests(eng, [prompt(16)], 128)[0]
        use_backend(eng, "triton+graphs", saved)
    finally:
        eng.close()
    del model
    torch.cuda.empty_cache()
    # the same batch-1 decode with the eager glue ops, then with the kernels' built-in rules (no launch searched,
    # no plan measured); a fresh model each: modules are fused once per engine
    for key, kw in (("b1_eager_glue_tok_s", dict(fused_ops=False)),
                    ("b1_static_kernels_tok_s", dict(kernels="static"))):
        model = random_model(shape, dev, scheme)
        eng = make_engine(model, tok, "4GiB", **kw)
        try:
            row[key] = statistics.median([128 / run_requests(eng, [prompt(16)], 128)[0] for _ in range(3)])
        finally:
            eng.close()
        del model
        torch.cuda.empty_cache()


def default_model_check(results: dict, failures: list, gguf: Path, data: Path, work: Path) -> None:
    """The default model on the GPU: `quant build` of its w4a16 artifact with calibration and GPTQ on CUDA (timed,
    its quality report read back), then the artifact served by the engine on CUDA (triton backend, graphs):
    greedy tokens, batch-1 decode speed, and the CUDA engine's greedy choices checked against the CPU engine's
    logits on the same tokens (teacher-forced: the CPU's argmax at each generated position)."""
    import subprocess

    from server.engine import Engine, EngineConfig
    from server.sampling import SamplingParams

    art = work / "art-w4a16"
    cmd = [sys.executable, "-m", "quant.cli", "build", "--model", str(gguf), "--scheme", "w4a16", "--out", str(art),
           "--force", "--device", "cuda", "--calib", str(data / "valid.txt"), "--eval-data", str(data / "test.txt"),
           "--eval-windows", "16", "--eval-seqlen", "512"]
    env = {**__import__("os").environ, "QUANTSERVE_CACHE": str(work / "cache")}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    row: dict = {"build_s": time.perf_counter() - t0, "build_rc": r.returncode}
    print(r.stdout[-3000:], r.stderr[-3000:], flush=True)
    results["default_model"] = row
    if r.returncode != 0:
        failures.append(f"default model w4a16 build on CUDA: exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
        return
    manifest = json.loads((art / "quant_manifest.json").read_text())
    q = manifest.get("quality") or {}
    row["quality"] = {k: v for k, v in q.items() if not isinstance(v, (dict, list))} or q
    row["timings"] = manifest.get("timings")
    row["build_memory"] = {k: v for k, v in manifest.get("memory", {}).items() if "peak" in k or "build" in k}
    p = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
    gpu = Engine.from_path(str(art), EngineConfig(device="cuda", dtype="bfloat16", memory_budget="2GiB"), work / "cache")
    try:
        prompt = gpu.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
        out = gpu.complete(prompt, p)
        row["text"] = out.text[:200]
        row["attention"], row["cuda_graphs"] = gpu.attention, gpu.cuda_graphs
        dts = []
        for _ in range(3):
            t0 = time.perf_counter()
            gpu.complete(prompt, SamplingParams(temperature=0.0, max_new_tokens=128, ignore_eos=True))
            dts.append(time.perf_counter() - t0)
        row["b1_tok_s"] = 128 / statistics.median(dts)
        row["weight_bytes"] = gpu.weight_bytes
    finally:
        gpu.close()
    cpu = Engine.from_path(str(art), EngineConfig(device="cpu", dtype="float32", memory_budget="256MiB"),
                           work / "cache")
    try:
        from server.batch import StepInputs

        ids = list(prompt) + list(out.token_ids)
        table = cpu.pool.try_reserve("check", len(ids))
        t = len(ids)
        step = StepInputs(torch.tensor(ids), torch.arange(t), torch.tensor([table[i // 16] * 16 + i % 16 for i in range(t)]),
                          torch.arange(len(prompt) - 1, t - 1), [], [(0, t, 0, table)], 16)
        logits = cpu.runner.model.forward(step, cpu.runner.backend, cpu.runner.backend.prepare(step))  # (64, V)
        agree = (logits.argmax(-1) == torch.tensor(out.token_ids)).float().mean().item()
        row["cpu_fp32_agreement"] = agree
        if agree < 0.9:
            failures.append(f"default model: CUDA greedy tokens agree with the CPU fp32 argmax at {agree:.0%} only")
    finally:
        cpu.close()


def markdown(results: dict, failures: list) -> str:
    env = results["env"]
    out = [f"## GPU check {env['date']} on {env['device']} (bench/gpu.py via scripts/gpu_check.sh)", "",
           f"torch {env['torch']}, triton {env['triton']}. Correctness: "
           + ("every check that ran was within tolerance of its reference." if not failures else
              "FAILED: " + "; ".join(failures)),
           "Kernel timings (quant.timing.cuda_time_us): the median per call of 10 calls captured in one CUDA graph "
           "and replayed (no host launch latency, as the decode step's graphs replay them), 20 replays, each call "
           "after a write over twice the L2 cache (timed apart and subtracted), so weights come from memory as in a "
           "decode step; session 14's tables were timed without that write.", ""]
    if results.get("linear"):
        out += ["W4A16 rows of 2-32 with groups of 128 run the tiled kernel over code planes (2-64 on sm_90 with a symmetric table); beside it the kernel's "
                "whole-weight path (what ran before) and the planes on a symmetric table (zeros skipped).", "",
                "| op | shape | layer | N x K | M | triton us | whole-weight / symmetric us | tinygemm / int8pack us "
                "| dequant + cuBLAS us | bf16 cuBLAS us | rel err |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["linear"]:
            if "triton_us" not in r:
                continue
            peer = r.get("tinygemm_us", r.get("int8pack_us"))
            planes = f"{r['whole_us']:.1f} / {r['sym_us']:.1f}" if "whole_us" in r else "-"
            out.append(f"| {r['op']} | {r['shape']} | {r['layer']} | {r['n']}x{r['k']} | {r['m']} | "
                       f"{r['triton_us']:.1f} | {planes} | {'-' if peer is None else f'{peer:.1f}'} | "
                       f"{r['dequant_cublas_us']:.1f} | "
                       f"{r['bf16_us']:.1f} | "
                       f"{r['rel_err']:.1e} |")
        out.append("")
    if results.get("attention"):
        out += ["| attention | shape | batch | triton us | triton, one page per step us | decode with the rotary and "
                "cache write fused / rope_store_kv_ launch + attention us | sdpa us | max err |",
                "|---|---|---|---|---|---|---|---|"]
        for r in results["attention"]:
            b = f"{r['seqs']} x {r['ctx']} (splits {r['splits']})" if "seqs" in r else f"{r['chunk']} after {r['past']}"
            peer = r.get("sdpa_gather_us", r.get("sdpa_us"))
            fused = (f"{r['triton_fused_rope_us']:.1f} / {r['triton_rope_then_attention_us']:.1f}"
                     if "triton_fused_rope_us" in r else "-")
            out.append(f"| {r['op']} | {r['shape']} | {b} | {r['triton_us']:.1f} | {r['triton_page_us']:.1f} | "
                       f"{fused} | {peer:.1f} | {r['max_err']:.1e} |")
        out.append("")
    if results.get("gemv_sweep"):
        tables = [("w4", ("sym", "v1", "v2", "tinygemm"), "One-row W4A16 at the 8B shapes (g128, bf16): the rule's "
                   "config, the sweep's fastest (BLOCK_N, BLOCK_K, SPLIT_K, warps), the rule's on a symmetric table "
                   "(zeros skipped), session 14's kernel (bench/gemv_v1.py), sessions 21-22's at the rule's config "
                   "(bench/gemv_v2.py), tinygemm; us and share of the bandwidth limit (codes + table read once)."),
                  ("int8", ("gemm",), "One-row int8 weight-only at the 8B shapes (bf16 activations): the GEMV's rule "
                   "and fastest config, the tiled GEMM at one row (what ran before); us and share of the bandwidth "
                   "limit.")]
        for op, peers, title in tables:
            keys = ("rule", "best", "searched", *peers)
            out += [title + " `searched`: the server's search from the rule's config (launches measured, "
                    "seconds).", "",
                    "| layer | N x K | rule | best | searched | " + " | ".join(f"{key} us" for key in keys)
                    + " | BW share " + " / ".join(keys) + " |", "|---" * (6 + len(keys)) + "|"]
            for r in (r for r in results["gemv_sweep"] if r["op"] == op):
                share = " / ".join(f"{100 * r[f'{key}_bw_share']:.0f}%" if f"{key}_bw_share" in r else "-"
                                   for key in keys)
                out.append(f"| {r['layer']} | {r['n']}x{r['k']} | {tuple(r['rule'])} | {tuple(r['best'])} | "
                           f"{tuple(r['searched'])} ({r['searched_measured']}, {r['search_s']:.1f} s) | "
                           + " | ".join(f"{r[f'{key}_us']:.1f}" for key in keys) + f" | {share} |")
            out.append("")
            out += [f"- {r['op']} {r['layer']} at the rule's launch with SiLU in its epilogue: {r['gated_us']:.1f} us, "
                    f"against the product then the glue's silu_mul: {r['then_act_us']:.1f} us" for r in
                    results["gemv_sweep"] if r["op"] == op and "gated_us" in r]
            out += [f"- {r['op']} {r['layer']} at the rule's launch with the residual add and RMSNorm in its epilogue: "
                    f"{r['normed_us']:.1f} us, against the product then the glue's add_rms_norm: "
                    f"{r['then_norm_us']:.1f} us (largest difference {r['normed_max_diff']:.1e})" for r in
                    results["gemv_sweep"] if r["op"] == op and "normed_us" in r]
    if results.get("skipped"):
        out.append(f"- not run, past the run's deadline: {', '.join(results['skipped'])}")
    out += [f"- cut to the part's time: {c}" for c in results.get("cut", [])]
    if results.get("default_model_skipped"):
        out.append(f"- default model skipped: {results['default_model_skipped']}")
    if results.get("default_model"):
        r = results["default_model"]
        out.append(f"- default model (SmolLM2-135M-Instruct): `quant build --scheme w4a16 --device cuda` (WikiText-2 "
                   f"calibration, 16x512 eval) took {r['build_s']:.1f} s wall, exit {r['build_rc']}; timings "
                   f"{json.dumps(r.get('timings'))[:300]}; memory {json.dumps(r.get('build_memory'))}; quality "
                   f"{json.dumps(r.get('quality'))[:400]}; served on CUDA ({r.get('attention')}, graphs "
                   f"{r.get('cuda_graphs')}): batch-1 {r.get('b1_tok_s', 0):.1f} tok/s, greedy tokens agree with the "
                   f"CPU fp32 engine's argmax at {100 * r.get('cpu_fp32_agreement', 0):.0f}% of 64 positions; "
                   f"text: {r.get('text', '')[:120]!r}")
    variants = (("b1_eager_tok_s", "eager steps"), ("b1_eager_glue_tok_s", "with the eager glue ops"),
                ("b1_serial_tok_s", "serial steps instead of overlapped"),
                ("b1_static_kernels_tok_s", "with the kernels' built-in rules instead of measured launches and plans"))
    for r in results.get("engine", []):
        ran = [f"{label}: {r[key]:.1f}" for key, label in variants if key in r]  # a part runs only some variants
        out.append(f"- engine, random-weight {r.get('scheme', 'w4a16')} {r['shape']} ({r['attention']}, cuda graphs {r['cuda_graphs']}): "
                   f"batch-1 {r['b1_tok_s']:.1f} tok/s (glue {r.get('glue_ops')}; " + "; ".join(ran + [
                       f"engine start {r.get('engine_start_s', 0):.1f} s with the measuring"]) + ")"
                   + (f" = {100 * r['b1_bandwidth_share']:.1f}% of the bandwidth limit ({r['read_bytes'] / 2**20:.0f} MiB"
                      " read per token)" if "b1_bandwidth_share" in r else "")
                   + f"; TTFT(512) {r['ttft_512_ms']:.1f} ms"
                   + (f"; TTFT of 1024 cached + 32 tokens {r['ttft_shared1024_cached_ms']:.1f} ms against 1056 "
                      f"uncached {r['ttft_shared1024_uncached_ms']:.1f} ms" if "ttft_shared1024_cached_ms" in r else "")
                   + f"; host syncs per decode step {r['syncs_per_step']:.2f} (plus the "
                   "wait on each step's samples' event, which sync debug mode does not count); "
                   + ", ".join(f"{k} {v:.0f}" for k, v in r.items() if k.startswith("streams"))
                   + f"; weights {r['weight_bytes'] / 2**20:.1f} MiB counted vs {r['allocated_after_load'] / 2**20:.1f}"
                   f" MiB allocated; KV pool {r['kv_pool_bytes'] / 2**20:.0f} MiB vs {r['kv_pool_alloc'] / 2**20:.0f}"
                   f" MiB; 512-token prefill activations estimated {r['prefill512_estimate'] / 2**20:.1f} MiB vs"
                   f" allocator peak {r['prefill512_peak_over_base'] / 2**20:.1f} MiB")
    for r in results.get("engine", []):
        if r.get("kernels"):
            out += ["", f"Kernels the {r.get('scheme', 'w4a16')} {r['shape']} engine measured (`ModelInfo.kernels`):", ""]
            out += [f"- {line}" for line in r["kernels"]]
    for r in results.get("engine", []):
        p = r.get("b1_profile")
        if p:
            out += ["", f"Batch-1 decode step of the {r.get('scheme', 'w4a16')} {r['shape']} engine under torch.profiler (64 steps after a "
                        f"16-token prompt): {p['wall_us_per_step']:.0f} us per step wall, the device busy "
                        f"{p['device_busy_us_per_step']:.0f} us of it, {p['kernels_per_step']:.0f} kernels per step.",
                    "", "| kernel | us per step | calls per step |", "|---|---|---|"]
            out += [f"| `{name}` | {us:.1f} | {calls:.1f} |" for name, us, calls in p["top"]]
    return "\n".join(out) + "\n"


PARTS = ("headline", "bf16", "attention", "linear", "gemv", "engine", "default")  # by priority: a lease's order
HELP_PARTS = {
    "headline": "the 8B w4a16 engine: batch 1, TTFT, syncs, accounting, 64 x 256 streams",
    "bf16": "the same rows for a bf16 8B engine (the float peer)",
    "attention": "paged attention vs its reference, timed beside sdpa",
    "linear": "W4A16 and int8 products vs their references, timed beside tinygemm, int8pack and cuBLAS",
    "gemv": "the one-row kernels' launch sweeps at the 8B shapes",
    "engine": "the 135M and 8B w4a16 engines: backends, eager glue, built-in rules",
    "default": "the default model built with --device cuda and served",
}


def parts(text: str) -> list[str]:
    """--only's value: known part names, in the order given."""
    chosen = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in chosen if p not in PARTS]
    if bad or not chosen:
        raise argparse.ArgumentTypeError(f"unknown part(s) {', '.join(bad) or '(none)'}; parts: {', '.join(PARTS)}")
    return chosen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "gpu"))
    ap.add_argument("--quick", action="store_true", help="fewer row counts and shorter streams")
    ap.add_argument("--only", default=None, type=parts,
                    help="comma-separated parts, run in the order given (default: all, in this order): "
                         + "; ".join(f"{k}: {v}" for k, v in HELP_PARTS.items()))
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds: start no part after this many (a lease's budget); what ran is written")
    ap.add_argument("--default-model", type=Path, default=None, help="the default model's GGUF: build + serve it")
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "wikitext-2")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here", file=sys.stderr)
        return 2
    import triton

    results = {"env": {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "triton": triton.__version__}}
    failures: list[str] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save():
        (out / "gpu.json").write_text(json.dumps({"results": results, "failures": failures}, indent=1))
        (out / "gpu.md").write_text(markdown(results, failures))

    if args.default_model is None:  # the embedded default model, where its package is installed
        try:
            from quant.models import default_gguf_path

            args.default_model = default_gguf_path()
        except Exception as e:  # noqa: BLE001 - said in the report, not a failure of the GPU path
            results["default_model_skipped"] = f"{e} (pass --default-model GGUF)"
    run = {
        "headline": [("engine 8B, headline", lambda: engine_bench(results, failures, "8B", args.quick, headline=True))],
        "bf16": [("engine 8B bf16, headline", lambda: engine_bench(results, failures, "8B", args.quick, headline=True,
                                                                   scheme="bf16"))],
        "linear": [("linear", lambda: kernel_checks(results, failures, args.quick, Clock()))],
        "attention": [("attention", lambda: attention_checks(results, failures, args.quick))],
        "gemv": [("gemv sweep", lambda: gemv_sweep(results, failures, Clock()))],
        "default": [("default model", lambda: default_model_check(results, failures, args.default_model, args.data,
                                                                  out / "work"))] if args.default_model else [],
        "engine": [(f"engine {s}", lambda s=s: engine_bench(results, failures, s, args.quick)) for s in ("135M", "8B")],
    }
    chosen = args.only or [p for p in PARTS if not (p == "gemv" and args.quick)]
    t_start = time.perf_counter()
    for name, fn in (step for part in chosen for step in run[part]):
        if args.deadline is not None and time.perf_counter() - t_start > args.deadline:
            results.setdefault("skipped", []).append(name)
            print(f"[gpu] {name}: skipped, past the {args.deadline:.0f} s deadline", flush=True)
            save()
            continue
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # a step that breaks is a failure to report, and the others still run
            import traceback

            traceback.print_exc()
            failures.append(f"{name}: {type(e).__name__}: {e}")
        print(f"[gpu] {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        save()
    print(markdown(results, failures))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
