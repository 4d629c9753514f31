"""The GPU check's report: bench/RESULTS.md's GPU check section, which bench/gpu.py writes (DIR/gpu.md) from its
results (DIR/gpu.json). ``python bench/gpu.py --render gpu.json`` renders a saved run again, and ``--record`` puts a
report in place of the section, on any machine."""

from __future__ import annotations

import json

HEADING = "## GPU check (`bench/gpu.py`)"  # one section, replaced by each run (`bench/gpu.py --record`)


def gemlite_cell(r: dict) -> str:
    """GemLite's µs and its error against our reference (a flag where it is past the checks' 2e-2), "eager" where
    its call was not capturable, "-" where it did not run."""
    if "gemlite_us" not in r:
        return "-"
    err = r["gemlite_rel_err"]
    return (f"{r['gemlite_us']:.1f}{' eager' if r.get('gemlite_eager') else ''} ({err:.0e}"
            f"{', WRONG' if err > 2e-2 else ''})")


def markdown(results: dict, failures: list) -> str:
    env = results["env"]
    commit = f", commit {env['commit']}" if env.get("commit") else ""
    out = [HEADING, "",
           f"Run {env['date']} on {env['device']}{commit}, torch {env['torch']}, triton {env['triton']}"
           f"{', gemlite ' + env['gemlite'] if env.get('gemlite') else ''} "
           "(`scripts/gpu_check.sh` runs the CUDA tests, then bench/gpu.py's parts in a lease's order, and puts each "
           "run's report in place of this section). Correctness: "
           + ("every check that ran was within tolerance of its reference." if not failures else
              "FAILED: " + "; ".join(failures)),
           "Kernel timings (quant.runtime.timing.cuda_time_us): the median per call of 10 calls captured in one CUDA graph "
           "and replayed (no host launch latency, as the decode step's graphs replay them), 20 replays, each call "
           "after a write over twice the L2 cache (timed apart and subtracted), so weights come from memory as in a "
           "decode step.", ""]
    if results.get("linear"):
        out += ["W4A16 rows of 2-32 with groups of 128 run the tiled kernel over code planes (2-64 on sm_90 with a symmetric table); beside it the kernel's "
                "whole-weight path (what ran before) and the planes on a symmetric table (zeros skipped).", "",
                "| op | shape | layer | N x K | M | triton us | whole-weight / symmetric us | tinygemm / int8pack us "
                "| GemLite us (rel err) | dequant + cuBLAS us | bf16 cuBLAS us | triton / bf16 | rel err |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["linear"]:
            if "triton_us" not in r:
                continue
            peer = r.get("tinygemm_us", r.get("int8pack_us"))
            planes = f"{r['whole_us']:.1f} / {r['sym_us']:.1f}" if "whole_us" in r else "-"
            out.append(f"| {r['op']} | {r['shape']} | {r['layer']} | {r['n']}x{r['k']} | {r['m']} | "
                       f"{r['triton_us']:.1f} | {planes} | {'-' if peer is None else f'{peer:.1f}'} | "
                       f"{gemlite_cell(r)} | {r['dequant_cublas_us']:.1f} | {r['bf16_us']:.1f} | "
                       f"{r['triton_us'] / r['bf16_us']:.2f}x | {r['rel_err']:.1e} |")
        out.append("")
    out += [f"- W4A16 peer not run: {why}" for why in results.get("peers", [])]
    out += [f"- GemLite {r['shape']} {r['layer']} M={r['m']}: {r['gemlite_error']}" for r in results.get("linear", [])
            if "gemlite_error" in r]
    if out[-1]:
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
        tables = [("w4", ("sym", "tinygemm", "gemlite"), "One-row W4A16 at the 8B shapes (g128, bf16): the rule's "
                   "config, the sweep's fastest (BLOCK_N, BLOCK_K, SPLIT_K, warps), the rule's on a symmetric table "
                   "(zeros skipped), tinygemm, GemLite; us and share of the bandwidth limit (codes + table read "
                   "once)."),
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
                           + " | ".join(f"{r[f'{key}_us']:.1f}" if f"{key}_us" in r else "-" for key in keys)
                           + f" | {share} |")
            out.append("")
            out += [f"- {r['op']} {r['layer']} at the rule's launch with SiLU in its epilogue: {r['gated_us']:.1f} us, "
                    f"against the product then the glue's silu_mul: {r['then_act_us']:.1f} us" for r in
                    results["gemv_sweep"] if r["op"] == op and "gated_us" in r]
            out += [f"- {r['op']} {r['layer']} at the rule's launch with the residual add and RMSNorm in its epilogue: "
                    f"{r['normed_us']:.1f} us, against the product then the glue's add_rms_norm: "
                    f"{r['then_norm_us']:.1f} us (largest difference {r['normed_max_diff']:.1e})" for r in
                    results["gemv_sweep"] if r["op"] == op and "normed_us" in r]
            if out[-1]:
                out.append("")  # the next table's title starts a paragraph of its own
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
        out.append(f"- engine, random-weight {r.get('scheme', 'w4a16')} {r['shape']} ({r['attention']}, cuda graphs "
                   f"{r['cuda_graphs']}{', embeddings and head ' + r['embeddings'] if 'embeddings' in r else ''}): "
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
