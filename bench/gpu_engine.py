"""The GPU check's engine parts (bench/gpu.py runs them): the engine on the GPU over random-weight Llamas of the
default model's shape and an 8B shape (w4a16 random codes: the speed does not depend on the values; a bf16 8B
beside it), and the default model built with ``--device cuda`` and served.

Per engine: batch-1 greedy decode tok/s (overlapped and serial steps, under the profiler) and its share of the
bandwidth limit, TTFT of a 512-token prompt and of a cached 1024-token prefix, host syncs per decode step, the
accounting (weights, KV pool, activation estimate) against the CUDA allocator, and 64 streams' aggregate tok/s
(the full part: on the triton backend with and without graphs and on the sdpa backend, and batch 1 with the eager
glue and with the kernels' built-in rules).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from common import PEAK_BW, ROOT, SHAPES, word_tokenizer


def random_model(shape: str, dev: str, scheme: str = "w4a16", gs: int = 128):
    """A Llama of the shape in bf16 on the device: with ``scheme="w4a16"`` every decoder Linear a GPTQLinear of
    random codes, prepared for bf16; with ``"bf16"`` plain Linears of random weights (the float peer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from quant.runtime.int4 import GPTQLinear
    from quant.runtime.kernels.int4_layout import pack_rows

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


def make_engine(model, tok, budget: str, fused_ops: bool = True, kernels: str = "measure", embeddings: str = "auto"):
    import tempfile

    from server.config import EngineConfig
    from server.engine import Engine

    if not _PLANS:
        _PLANS.append(Path(tempfile.mkdtemp(prefix="quantserve-plans-")))
    return Engine(model, tok, EngineConfig(memory_budget=budget, dtype="bfloat16", device="cuda", max_batch=64,
                                           max_prefill_tokens=4096, fused_ops=fused_ops, kernels=kernels,
                                           embeddings=embeddings),
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
    import concurrent.futures as cf

    from server.sampling_params import SamplingParams

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
    # the embedding and head as a w4a16 artifact is served by default (int8 rows: layers.embedding.resolve), which
    # a random model passed as modules would not get from "auto"; a bf16 model's as they are
    embeddings = "int8" if scheme == "w4a16" else "float"
    row: dict = {"shape": shape + (" (headline rows)" if headline else ""), "scheme": scheme, "embeddings": embeddings}
    loaded = torch.cuda.memory_allocated()
    t = time.perf_counter()
    eng = make_engine(model, tok, "16GiB", embeddings=embeddings)  # kernels measured (this shape's first engine)
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
        # bytes a decode step reads: every weight but an untied input embedding (one row of it is looked up; in
        # int8, the first two tensors the model holds for its embedding and head: the lookup's codes and scales)
        emb = model.model.embed_tokens.weight
        lookup = emb.nbytes if embeddings == "float" else sum(t.nbytes for t in eng.runner.model.embedding_tensors[:2])
        row["read_bytes"] = eng.weight_bytes - (0 if model.lm_head.weight is emb else lookup)
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
        if headline:  # the aggregate as the engine runs it (triton backend, graphs), 64 streams x 256 tokens
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
        eng = make_engine(model, tok, "4GiB", embeddings=embeddings, **kw)
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

    from server.config import EngineConfig
    from server.engine import Engine
    from server.sampling_params import SamplingParams

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
