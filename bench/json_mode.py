"""What response_format costs per decode step on this CPU: the default model's engine decoding the same chat prompt
at temperature 1 free and held to a JSON schema (server/grammar.py), interleaved in one run, at batch 1 and 8.

    python bench/json_mode.py [--rounds 5] [--tokens 64]

The cost is read per decode step, (duration - time to first token) / (tokens - 1) of each request, since a
constrained sample ends when its document does. Prints a markdown table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from common import cpu_name

from quant.format import sources as models
from quant.format.sources import default_cache_dir
from server.config import EngineConfig
from server.engine import Engine
from server.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "tags", "address"]}
FORMAT = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}


def step_ms(eng: Engine, prompt: list[int], batch: int, tokens: int, fmt, seed: int) -> float:
    """Median per-step decode time (ms) of ``batch`` concurrent requests."""
    def one(i):
        p = SamplingParams(temperature=1.0, seed=seed + i, max_new_tokens=tokens, response_format=fmt)
        return eng.complete(prompt, p)

    with ThreadPoolExecutor(batch) as pool:
        done = list(pool.map(one, range(batch)))
    per = [(c.duration_s - c.ttft_s) / (len(c.token_ids) - 1) * 1e3 for c in done if len(c.token_ids) > 1]
    return statistics.median(per)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args(argv)
    src = models.resolve(None, default_cache_dir())
    eng = Engine.from_path(str(src.path), EngineConfig(memory_budget="512MiB"), default_cache_dir())
    eng.start()
    try:
        prompt = eng.chat_prompt([{"role": "user", "content": "Describe a person as JSON: name, age, tags, address."}])
        eng.complete(prompt, SamplingParams(max_new_tokens=4, response_format=FORMAT))  # compile, warm up
        rows = []
        for batch in (1, 8):
            free, held = [], []
            for r in range(a.rounds):  # interleaved: drift hits both alike
                free.append(step_ms(eng, prompt, batch, a.tokens, None, 100 * r))
                held.append(step_ms(eng, prompt, batch, a.tokens, FORMAT, 100 * r))
            f, h = statistics.median(free), statistics.median(held)
            rows.append((batch, f, h, h / f))
        t0 = time.perf_counter()
        eng.grammars.compile('{"type":"json_schema","json_schema":{"schema":{"type":"object","properties":'
                             '{"q":{"type":"string"}}}}}')
        compile_ms = (time.perf_counter() - t0) * 1e3
    finally:
        eng.close()
    print(f"response_format cost per decode step, default model ({eng.info.dtype}, {eng.info.attention}), "
          f"{cpu_name()}; median over {a.rounds} interleaved rounds of up to {a.tokens} tokens at temperature 1; "
          f"a new schema compiles in {compile_ms:.1f} ms (then cached).\n")
    print("| batch | free ms / step | JSON schema ms / step | ratio |")
    print("|---|---|---|---|")
    for b, f, h, r in rows:
        print(f"| {b} | {f:.2f} | {h:.2f} | {r:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
