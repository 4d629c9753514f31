"""lm-evaluation-harness on the served model against the same weights in transformers, in full: every WikiText-2
test article (rolling loglikelihood: word and byte perplexity) and the 24-fact multiple-choice task of
tests/lm_eval_tasks, for the default model in float and as its w4a16 artifact, and the token perplexity lm-eval's
per-article loglikelihoods give against `quant eval`'s on the same text and windows.

    python bench/lm_eval_compare.py [--artifact W4A16_DIR] [--docs 0] [--window 512] [--out bench/out/lm_eval]

- served: `quant serve` in a process of its own on a loopback port, scored by `lm_eval --model local-completions`
  (echo, logprobs 1, 4 prompts per request);
- transformers: the float model by `lm_eval --model hf`; the w4a16 artifact through quant.load (its GPTQ-format
  layers in the transformers model; gptqmodel publishes no wheel, only a source build) by lm-eval's HFLM;
- quant eval: quant.build.evaluate over the articles lm-eval scored (detokenized as it detokenizes them), in windows of
  --window tokens, against lm-eval's token perplexity exp(-sum loglikelihood / tokens).

Without --artifact the w4a16 artifact is built as the README builds it (GPTQ on WikiText-2 valid).
Prints a markdown table for bench/RESULTS.md.

    python bench/lm_eval_compare.py --kv-dtypes auto,int8 [--serve-dtype bfloat16] [--docs 8] [--models float]

instead scores the served model once per KV cache dtype (`quant serve --kv-dtype`, activations in --serve-dtype)
and prints each one's metrics against the first's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from common import LM_EVAL_TASKS as TASKS
from common import cpu_name, wikitext_articles

ROOT = Path(__file__).resolve().parents[1]

ENV = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lm_eval_cli(out: Path, model: str, model_args: str, docs: int, *extra: str) -> Path:
    """The lm_eval command as a user runs it; the directory of its results and samples."""
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
           "--tasks", "qs_choice,qs_wikitext", "--include_path", str(TASKS), "--metadata", json.dumps({"docs": docs}),
           "--output_path", str(out), "--log_samples", "--seed", "0", *extra]
    subprocess.run(cmd, check=True, env=ENV, cwd=ROOT)
    return out


def read_run(out: Path) -> tuple[dict, list[float]]:
    """(results, per-article loglikelihoods in document order) of an lm_eval run."""
    (results,) = list(out.rglob("results_*.json"))
    (samples,) = list(out.rglob("samples_qs_wikitext_*.jsonl"))
    rows = sorted((json.loads(line) for line in samples.read_text().splitlines() if line), key=lambda r: r["doc_id"])
    return json.loads(results.read_text())["results"], [float(r["filtered_resps"][0]) for r in rows]


def served(path: str, out: Path, docs: int, window: int, tokenizer: str, dtype: str = "float32",
           kv_dtype: str = "auto") -> tuple[dict, list[float]]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", path, "--http-port", str(port), "--grpc-port", "-1",
                             "--memory-budget", "512MiB", "--dtype", dtype, "--kv-dtype", kv_dtype], cwd=ROOT, env=ENV)
    try:
        import httpx

        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise RuntimeError("quant serve did not come up")
        args = (f"base_url=http://127.0.0.1:{port}/v1/completions,model=m,tokenizer_backend=huggingface,"
                f"tokenizer={tokenizer},max_length={window + 2},max_retries=1")  # = hf's windows (test_lm_eval.py)
        return read_run(lm_eval_cli(out, "local-completions", args, docs, "--batch_size", "4"))
    finally:
        proc.terminate()
        proc.wait(60)


def in_transformers(model_dir: str, artifact: str | None, out: Path, docs: int, window: int) -> tuple[dict, list[float]]:
    if artifact is None:
        return read_run(lm_eval_cli(out, "hf", f"pretrained={model_dir},dtype=float32,max_length={window}", docs,
                                    "--device", "cpu", "--batch_size", "4"))
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from quant import load

    art = load(artifact, dtype=torch.float32)
    lm = HFLM(pretrained=art.model, tokenizer=art.tokenizer, max_length=window, batch_size=4, device="cpu")
    tracker = EvaluationTracker(output_path=str(out))
    manager = TaskManager(include_path=str(TASKS), metadata={"docs": docs})  # the CLI's --metadata goes here too
    res = simple_evaluate(model=lm, tasks=["qs_choice", "qs_wikitext"], task_manager=manager,
                          metadata={"docs": docs}, log_samples=True, random_seed=0, numpy_random_seed=0,
                          torch_random_seed=0, fewshot_random_seed=0, evaluation_tracker=tracker)
    tracker.save_results_aggregated(results=res, samples=res["samples"])
    for name, samples in res["samples"].items():
        tracker.save_results_samples(task_name=name, samples=samples)
    return read_run(out)


def quant_eval(path: str, model_dir: str, docs: int, window: int, work: Path) -> tuple[float, int]:
    """quant.build.evaluate's perplexity (and tokens) over the articles lm-eval scored, in windows of ``window``."""
    import torch
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    from quant import load
    from quant.build import calibration, evaluate
    from quant.build.pipeline import reference_model
    from quant.format import sources as models
    from quant.format.sources import default_cache_dir

    pages = [wikitext_detokenizer({"page": p}) for p in wikitext_articles(docs)]
    text = work / "articles.txt"
    text.write_text("".join(pages), encoding="utf-8")
    source = models.resolve(None, default_cache_dir())
    base = reference_model(source, None, torch.float32)
    if path == model_dir:
        model, tok = base, models.load_model(source, torch.float32)[1]
    else:
        art = load(path, dtype=torch.float32)
        model, tok = art.model, art.tokenizer
    n = calibration.eval_windows(tok, text, 1, window).total_tokens // window
    windows = calibration.eval_windows(tok, text, n, window)
    q = evaluate.compare(base, {"m": model}, windows, progress=False)["m"]
    return q.ppl, q.tokens


def token_ppl(loglik: list[float], tokenizer: str, docs: int) -> float:
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    pages = [wikitext_detokenizer({"page": p}) for p in wikitext_articles(docs)]
    tokens = sum(len(tok(p, add_special_tokens=False).input_ids) for p in pages)
    return math.exp(-sum(loglik) / tokens)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", default=None, help="the w4a16 artifact (default: built as the README does)")
    ap.add_argument("--docs", type=int, default=0, help="WikiText-2 test articles (0: all 62)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "lm_eval"))
    ap.add_argument("--models", default="float,w4a16", help="which of float, w4a16 to compare")
    ap.add_argument("--kv-dtypes", default=None, help="instead: the served model by KV cache dtype, e.g. auto,int8")
    ap.add_argument("--serve-dtype", default="bfloat16", help="with --kv-dtypes: quant serve's --dtype")
    a = ap.parse_args(argv)
    from quant.format import sources as models
    from quant.format.sources import default_cache_dir

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = str(models.resolve(None, default_cache_dir()).path)
    artifact = a.artifact
    if artifact is None and "w4a16" in a.models.split(","):
        artifact = str(out / "w4a16")
        if not (Path(artifact) / "quant_manifest.json").is_file():
            subprocess.run([sys.executable, "-m", "quant.cli", "build", "--scheme", "w4a16", "--calib",
                            str(ROOT.parent / "shared" / "data" / "wikitext-2" / "valid.txt"), "--out", artifact,
                            "--force"], check=True, cwd=ROOT, env=ENV)
    if a.kv_dtypes:
        return by_kv_dtype(a, model_dir, artifact, out)
    rows = []
    for name, path, art in (("float", model_dir, None), ("w4a16", artifact, artifact)):
        if name not in a.models.split(","):
            continue
        t0 = time.perf_counter()
        s_res, s_ll = served(path, out / f"{name}-served", a.docs, a.window, model_dir)
        t1 = time.perf_counter()
        h_res, h_ll = in_transformers(model_dir, art, out / f"{name}-transformers", a.docs, a.window)
        t2 = time.perf_counter()
        q_ppl, q_tokens = quant_eval(path, model_dir, a.docs, a.window, out)
        rows.append((name, s_res, h_res, token_ppl(s_ll, model_dir, a.docs), token_ppl(h_ll, model_dir, a.docs),
                     q_ppl, q_tokens, t1 - t0, t2 - t1))
    docs = a.docs or 62
    print(f"lm-evaluation-harness {__import__('lm_eval').__version__}, {docs} WikiText-2 test articles in windows of "
          f"{a.window} tokens and 24 facts by multiple choice, {cpu_name()}; served = quant serve (float32) scored "
          f"by local-completions, transformers = the same weights in transformers (float32).\n")
    print("| model | metric | served | transformers | served / transformers | wall s served / transformers |")
    print("|---|---|---|---|---|---|")
    for name, s, h, s_tok, h_tok, q_ppl, q_tokens, ts, th in rows:
        for task, metric in (("qs_wikitext", "word_perplexity,none"), ("qs_wikitext", "byte_perplexity,none"),
                             ("qs_choice", "acc,none"), ("qs_choice", "acc_norm,none")):
            print(f"| {name} | {metric.split(',')[0]} | {s[task][metric]:.4f} | {h[task][metric]:.4f} | "
                  f"{s[task][metric] / h[task][metric]:.5f} | {ts:.0f} / {th:.0f} |")
        print(f"| {name} | token perplexity (lm-eval) vs quant eval ({q_tokens} tokens) | {s_tok:.4f} | {q_ppl:.4f} "
              f"(quant eval) | {s_tok / q_ppl:.5f} | |")
        print(f"| {name} | token perplexity, transformers under lm-eval | {h_tok:.4f} | | {s_tok / h_tok:.5f} | |")
    return 0


METRICS = (("qs_wikitext", "word_perplexity,none"), ("qs_wikitext", "byte_perplexity,none"), ("qs_choice", "acc,none"),
           ("qs_choice", "acc_norm,none"))


def by_kv_dtype(a, model_dir: str, artifact: str, out: Path) -> int:
    """The served model scored once per KV cache dtype, each against the first."""
    kvs = a.kv_dtypes.split(",")
    print(f"lm-evaluation-harness {__import__('lm_eval').__version__}, {a.docs or 62} WikiText-2 test articles in "
          f"windows of {a.window} tokens and 24 facts by multiple choice, {cpu_name()}; quant serve --dtype "
          f"{a.serve_dtype} --kv-dtype each, scored by local-completions.\n")
    print(f"| model | metric | {' | '.join(kvs)} | {' | '.join(f'{k} / {kvs[0]}' for k in kvs[1:])} | wall s |")
    print(f"|---|---|{'---|' * (2 * len(kvs) - 1)}---|")
    for name, path in (("float", model_dir), ("w4a16", artifact)):
        if name not in a.models.split(","):
            continue
        res, wall = {}, {}
        for kv in kvs:
            t0 = time.perf_counter()
            res[kv], _ = served(path, out / f"{name}-served-{a.serve_dtype}-kv-{kv}", a.docs, a.window, model_dir,
                                a.serve_dtype, kv)
            wall[kv] = time.perf_counter() - t0
        for task, metric in METRICS:
            v = [res[kv][task][metric] for kv in kvs]
            print(f"| {name} | {metric.split(',')[0]} | {' | '.join(f'{x:.4f}' for x in v)} | "
                  f"{' | '.join(f'{x / v[0]:.5f}' for x in v[1:])} | {' / '.join(f'{wall[k]:.0f}' for k in kvs)} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
