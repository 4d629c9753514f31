"""The GPU check's kernel parts (bench/gpu.py runs them): each kernel against its plain PyTorch reference on the
GPU, timed beside its peers in the same run.

- ``linear``: the Triton W4A16 and int8 products at the default model's and an 8B model's shapes, every row count,
  beside tinygemm (``_weight_int4pack_mm``) / ``_weight_int8pack_mm``, GemLite (W4A16, where its wheel is
  installed: ``scripts/gpu_wheels.sh``), dequantize + cuBLAS and bf16 cuBLAS;
- ``gemv``: the one-row W4A16 and int8 kernels' launch sweeps at the 8B shapes beside tinygemm and GemLite, the
  server's launch search, the fused epilogues (activation, residual add + RMSNorm) beside the launches they replace;
- ``attention``: the paged attention (decode with split-K, prefill with past) beside the sdpa backend's gather path.

A mismatch past tolerance is a failure; a part's timings stop at PART_S seconds (what was cut is reported).
"""

from __future__ import annotations

import sys
import time

import torch
from common import PEAK_BW, SHAPES, cuda_time

PART_S = 110.0  # a part's timings stop after this many seconds (each part of a lease's check ends within 120 s)


class Clock:
    """A part's time: timings past ``limit`` seconds are skipped (what was cut is reported), checks still run."""

    def __init__(self, limit: float = PART_S):
        self.t0, self.limit, self.cut = time.perf_counter(), limit, 0

    def over(self) -> bool:
        return time.perf_counter() - self.t0 > self.limit

# ----------------------------------------------------------------------------------------------- 1 + 2: kernels

def linear_shapes(name: str) -> list[tuple[str, int, int]]:
    s = SHAPES[name]
    qkv = (s["heads"] + 2 * s["kv"]) * (s["hidden"] // s["heads"])
    return [("qkv", qkv, s["hidden"]), ("o", s["hidden"], s["hidden"]), ("gate_up", 2 * s["inter"], s["hidden"]),
            ("down", s["hidden"], s["inter"])]


def random_w4(n: int, k: int, gs: int, dtype, dev):
    """Random codes (N, K) in groups of ``gs``: (the GPTQ words (K/8, N), the kernels' scale/zero table (G, N, 2),
    the codes, their scales and zero-points (G, N) as a checkpoint holds them, which GemLite packs)."""
    from quant.runtime.kernels.int4_layout import pack_rows

    codes = torch.randint(0, 16, (n, k), device=dev)
    s = torch.rand(k // gs, n, device=dev) * 0.02 + 0.001
    zero = torch.randint(0, 16, (k // gs, n), device=dev).float()
    sz = torch.stack([s, s * (8 - zero)], dim=-1).to(dtype).contiguous()
    return pack_rows(codes.t().contiguous()), sz, codes, s, zero


def gemlite_w4(codes, s, zero, gs: int, dtype):
    """GemLite's A16W4 Linear (the W4A16 peer: Triton kernels chosen per row count, autotuned at its first call of
    a shape, from its per-GPU config where it ships one) over the same codes (N, K), scales and zero-points (G, N):
    its HQQ convention W = (W_q - zeros) * scales is ours, W = s (code - zero). Returns (the Linear, None), or (None,
    why) where gemlite is not installed or refuses the shape: a peer's failure is reported, not failed."""
    try:
        from gemlite import DType, GemLiteLinear

        n, k = codes.shape
        kind = {torch.bfloat16: DType.BF16, torch.float16: DType.FP16}[dtype]
        lin = GemLiteLinear(4, group_size=gs, in_features=k, out_features=n, input_dtype=kind, output_dtype=kind)
        lin.pack(codes.to(torch.uint8), s.t().to(dtype).contiguous(), zero.t().to(dtype).contiguous(), None)
        return lin, None
    except Exception as e:  # noqa: BLE001 - ImportError where the wheel was not carried, else the peer's own
        return None, f"gemlite {getattr(sys.modules.get('gemlite'), '__version__', '')}: {type(e).__name__}: {e}"[:200]


def note_peer(results: dict, why: str) -> None:
    """Why a peer did not run, said once in the report however many rows it missed."""
    if why not in results.setdefault("peers", []):
        results["peers"].append(why)


def gemlite_row(row: dict, lin, x, want) -> None:
    """GemLite's time and error on ``x`` into ``row`` (``gemlite_us``, ``gemlite_rel_err``), or why not
    (``gemlite_error``): a call its CUDA graph capture refuses is timed eagerly (``gemlite_eager``)."""
    try:
        row["gemlite_rel_err"] = rel_err(lin(x), want)
        try:
            row["gemlite_us"] = cuda_time(lambda: lin(x)) * 1e6
        except Exception:  # noqa: BLE001 - not capturable: host launch latency included, and said
            row["gemlite_us"], row["gemlite_eager"] = cuda_time(lambda: lin(x), graph=False) * 1e6, True
    except Exception as e:  # noqa: BLE001
        row["gemlite_error"] = f"{type(e).__name__}: {e}"[:200]


def rel_err(got, want) -> float:
    """Max absolute error relative to the reference's largest magnitude."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def kernel_checks(results: dict, failures: list, quick: bool, clock: Clock) -> None:
    """The W4A16 and int8 products against their references at every row count, the 8B shapes first; timed beside
    their peers while the part's clock allows (rows past it are checked, not timed)."""
    from quant.runtime.kernels import triton_ops as T
    from quant.runtime.kernels.int4_layout import pack_for_kernel
    from quant.runtime.primitives import dequantize_weight

    dev = "cuda"
    rows = []
    for shape in ("8B", "135M"):
        for name, n, k in linear_shapes(shape):
            gs = 64 if shape == "135M" else 128
            for dtype in (torch.bfloat16, torch.float16):
                qw, sz, codes, s, zero = random_w4(n, k, gs, dtype, dev)
                if dtype == torch.bfloat16:  # the peers' weights, made once per shape
                    w_ref = torch.randn(n, k, device=dev, dtype=dtype)
                    packed = pack_for_kernel(codes.to(torch.int32)) if k % 32 == 0 else None
                    gl, why = gemlite_w4(codes, s, zero, gs, dtype)
                    if why:
                        note_peer(results, why)
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
                        if gl is not None:
                            gemlite_row(row, gl, x, want)
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
    """What the server's search (quant.runtime.kernel_choice.search, from the rule's config) picks for this layer, how many
    launches it measured and how long it took, and the pick's time measured as the sweep measures: in ``row``."""
    from quant.runtime.kernel_choice import LaunchSpace, search
    from quant.runtime.kernels.triton_ops import GEMV_AXES

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
    the glue's act_mul (two launches, what ran before the fusion), at the rule's launch; the two must be equal."""
    from server import glue_triton as G

    if not torch.equal(gemv("silu_mul"), G.silu_mul(gemv())):
        failures.append("w4 gemv gate_up: the gated epilogue differs from the product then silu_mul")
    return {"gated_us": cuda_time(lambda: gemv("silu_mul")) * 1e6,
            "then_act_us": cuda_time(lambda: G.silu_mul(gemv())) * 1e6}


def _normed(gemv, n: int, failures: list) -> dict:
    """A decode step's down as the engine launches it, the residual add and the next RMSNorm in the GEMV's epilogue,
    against the GEMV then the glue's add_rms_norm (two launches, what ran before the fusion), at the rule's launch."""
    from quant.runtime.kernels import triton_ops as T
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
    against tinygemm in the same run: per layer the rule's config (quant.runtime.kernels.triton_ops.w4_gemv_config),
    the fastest, the server's search's pick, the rule's on a symmetric table, and each one's share of the bandwidth
    limit (the codes and the scale/zero table read once). Then the one-row int8 kernel over INT8_GEMV_SWEEP against
    the tiled int8 GEMM."""
    from quant.runtime.kernels import triton_ops as T
    from quant.runtime.kernels.int4_layout import pack_for_kernel

    dev, gs, dtype = "cuda", 128, torch.bfloat16
    bw = next((v for k, v in PEAK_BW.items() if k in torch.cuda.get_device_name()), None)
    sms = T.multiprocessors(torch.device(dev))
    rows = []
    for name, n, k in linear_shapes("8B"):
        qw, sz, codes, s, zero = random_w4(n, k, gs, dtype, dev)
        packed = pack_for_kernel(codes.to(torch.int32))
        x = torch.randn(1, k, device=dev, dtype=dtype)
        want = T.w4_reference(x, qw, sz, gs)
        row = {"op": "w4", "layer": name, "n": n, "k": k, "bytes": qw.nbytes + sz.nbytes,
               "rule": T.w4_gemv_config(n, k, gs, sms), "rule_us": cuda_time(lambda: T.w4_gemv(x, qw, sz, gs)) * 1e6,
               "tinygemm_us": cuda_time(lambda: torch.ops.aten._weight_int4pack_mm(x, packed, gs, sz)) * 1e6}
        gl, why = gemlite_w4(codes, s, zero, gs, dtype)
        if gl is not None:
            gemlite_row(row, gl, x, want)
        else:
            note_peer(results, why)
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
                           ("sym", "tinygemm") + (("gemlite",) if "gemlite_us" in row else ()), bw, clock))
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
    triton glue's rope_store_kv_ launch before the attention's (what a decode step ran before the fusion), same
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
    """µs of ``call`` with the backend's kernel stepping one page of keys at a time, as it did before it gathered several pages a step."""
    backend.keys_per_step = backend.block_size
    try:
        return cuda_time(call) * 1e6
    finally:
        backend.keys_per_step = None
