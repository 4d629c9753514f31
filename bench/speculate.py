"""Speculative decoding on the default model on this CPU: tokens/s with speculation on against off, in the same run.

    python bench/speculate.py [--dtypes bfloat16,float32] [--tokens 128] [--concurrent 16]
                              [--workloads grounded,chat,concurrent] [--rounds 2] [--json]
                              [--draft ARTIFACT [--every-draft]]

Workloads, each run with ``--speculate off`` and ``ngram`` (or ``draft`` with ``--draft``, e.g. a w4a16 artifact
of the default model) on engines loaded side by side (runs alternate, so a drift of the machine falls on all);
``--every-draft`` adds an engine on which every request drafts all it may each step (its costs set to nothing),
which measures the draft's acceptance rate at full draft length whether or not drafting pays on this device:

- **grounded**: input-grounded requests (rewrite a WikiText-2 passage of 500-1000 tokens with its spelling
  fixed, extract the sentences of a passage that mention a number, a function's code with a variable renamed),
  batch 1, at temperature 0 and at temperature 0.7 with top-p 0.9;
- **chat**: open questions (an essay on a topic), batch 1, at temperature 0 and at 0.7 / top-p 0.9;
- **grounded x N**: N grounded requests at once (``--concurrent``), temperature 0.

Each request makes ``--tokens`` new tokens (EOS held off by min_tokens, so both engines do the same work). Reported
per cell: tokens/s of each engine, their ratio, drafted and accepted tokens, and whether the outputs are the same
tokens (greedy: token for token in float32; in bf16 a (k+1)-row forward rounds apart from a one-row one, so a
near tie may fall the other way; sampled: a seed gives the same tokens with speculation on as off, up to the same
rounding).
"""

from __future__ import annotations

import argparse
import json
import time

from common import WIKITEXT, cpu_name

CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            result.append(total / window)
    return result


def normalise(values):
    """Values scaled to [0, 1]."""
    low, high = min(values), max(values)
    if high == low:
        return [0.0 for value in values]
    return [(value - low) / (high - low) for value in values]


def summary(values, window):
    averaged = moving_average(values, window)
    scaled = normalise(averaged)
    return {"count": len(values), "window": window, "averages": averaged, "scaled": scaled}
'''

QUESTIONS = ["Write a long essay about the history of the printing press.",
             "Explain in detail how bridges carry their load.",
             "Write a story about a lighthouse keeper and a storm.",
             "Describe the water cycle for a school class."]


def passages(n: int, lo_words: int = 300, hi_words: int = 650) -> list[str]:
    """WikiText-2 test paragraphs of lo..hi words (about 500-1000 tokens), the markup's spacing undone."""
    text = (WIKITEXT / "test.txt").read_text()
    out = []
    for para in text.split("\n"):
        words = para.split()
        if lo_words <= len(words) <= hi_words and not para.strip().startswith("="):
            clean = (para.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".").replace(" ,", ",")
                     .replace(" .", ".").replace(" 's", "'s").replace("( ", "(").replace(" )", ")").strip())
            out.append(clean)
        if len(out) == n:
            break
    return out


def grounded(n: int) -> list[list[dict]]:
    ps = passages(max(2, n))
    tasks = [f"Rewrite the following text with its spelling and punctuation corrected. Keep every sentence.\n\n{ps[0]}",
             f"Copy out every sentence of the following text that contains a number.\n\n{ps[1]}",
             f"Rename the variable `values` to `samples` everywhere in this code, and return the whole code.\n\n"
             f"```python\n{CODE}```"]
    tasks += [f"Rewrite the following text with its spelling and punctuation corrected.\n\n{p}" for p in ps[2:]]
    return [[{"role": "user", "content": t}] for t in tasks[:n]]


def chat(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]


def run(eng, prompts: list[list[int]], params) -> tuple:
    """All prompts at once; (seconds, seconds after the first token, outputs, drafted, accepted, and of those the
    draft model's drafted and accepted)."""
    before = eng.totals()
    model = eng.scheduler.model_speculated_tokens, eng.scheduler.model_accepted_tokens
    t = time.perf_counter()
    streams = [eng.stream(p, params)[1] for p in prompts]
    outs, first = [], None
    for s in streams:
        evs = []
        for ev in s:
            first = time.perf_counter() if first is None else first
            evs.append(ev)
        outs.append(evs)
    end = time.perf_counter()
    after = eng.totals()
    toks = [[tok for ev in evs for tok in ev.token_ids] for evs in outs]
    return (end - t, end - first, toks, after.speculated_tokens - before.speculated_tokens,
            after.accepted_tokens - before.accepted_tokens, eng.scheduler.model_speculated_tokens - model[0],
            eng.scheduler.model_accepted_tokens - model[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each cell per engine (the best kept)")
    ap.add_argument("--workloads", default="grounded,chat,concurrent",
                    help="which cells to run: grounded (batch 1), chat, concurrent (grounded x N)")
    ap.add_argument("--draft", default=None, help="a draft model (artifact or model dir): --speculate draft")
    ap.add_argument("--every-draft", action="store_true",
                    help="also an engine on which every request drafts all it may each step")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    wanted = set(args.workloads.split(","))

    import torch

    from quant.format import sources
    from server.config import EngineConfig
    from server.engine import Engine
    from server.sampling_params import SamplingParams
    from server.speculate import DraftCosts

    cache = sources.default_cache_dir()
    rows = []
    print(f"CPU: {cpu_name()}, torch threads {torch.get_num_threads()}", flush=True)
    for dtype in args.dtypes.split(","):
        mode = "draft" if args.draft else "ngram"
        modes = ("off", mode) + (("every",) if args.every_draft else ())
        engines = {m: Engine.from_path(None, EngineConfig(
            memory_budget="512MiB", dtype=dtype, speculate="off" if m == "off" else mode,
            draft=None if m == "off" else args.draft, max_batch=max(16, args.concurrent)), cache) for m in modes}
        if "every" in engines:
            e = engines["every"]
            e.scheduler.speculate(DraftCosts(), e.config.speculate_tokens, e.draft,
                                  e.draft and DraftCosts((1,), (0.0,)))
        off = engines["off"]
        costs = engines[mode].scheduler.draft_costs
        if args.draft:
            pc = engines[mode].scheduler.proposer_costs
            print(f"draft {args.draft}: its forward's time by its rows over the target's one row: "
                  + " ".join(f"{r}: {t / costs.seconds[0]:.2f}" for r, t in zip(pc.rows, pc.seconds)), flush=True)
        print(f"{dtype}: a forward's time by its rows, measured at start, over one row's: "
              + " ".join(f"{r}: {t / costs.seconds[0]:.2f}" for r, t in zip(costs.rows, costs.seconds))
              + f"; a row's attention {costs.attend * 1e6:.2f} µs a token of its context"
              + f"; a row's draw {costs.draw / costs.seconds[0]:.3f} (temperature), "
              f"{costs.filtered / costs.seconds[0]:.3f} (top-p)", flush=True)
        n = args.tokens
        cells = [
            ("grounded", grounded(3), dict(temperature=0.0)),
            ("grounded", grounded(3), dict(temperature=0.7, top_p=0.9, seed=1)),
            ("chat", chat(3), dict(temperature=0.0)),
            ("chat", chat(3), dict(temperature=0.7, top_p=0.9, seed=1)),
            (f"grounded x{args.concurrent}", grounded(args.concurrent), dict(temperature=0.0)),
        ]
        for name, msgs, kw in cells:
            if ("concurrent" if name.startswith("grounded x") else name) not in wanted:
                continue
            prompts = [off.chat_prompt(m) for m in msgs]
            params = SamplingParams(max_new_tokens=n, min_tokens=n, **kw)
            batched = name.startswith("grounded x")
            best = {m: None for m in engines}
            for _ in range(args.rounds):
                for m, eng in engines.items():
                    if batched:
                        cell = run(eng, prompts, params)
                    else:  # batch 1: one request after another, their times summed
                        parts = [run(eng, [p], params) for p in prompts]
                        cell = (sum(p[0] for p in parts), sum(p[1] for p in parts), [p[2][0] for p in parts],
                                *(sum(p[j] for p in parts) for j in range(3, 7)))
                    if best[m] is None or cell[0] < best[m][0]:
                        best[m] = cell
            tokens = n * len(prompts)
            decoded = tokens - (1 if batched else len(prompts))  # after the (first) first token
            (t_off, d_off, out_off, *_), (t_on, d_on, out_on, drafted, acc, m_dr, m_acc) = best["off"], best[mode]
            row = dict(dtype=dtype, workload=name, temperature=kw["temperature"], requests=len(prompts),
                       prompt_tokens=[len(p) for p in prompts], tokens=tokens,
                       off_tok_s=round(tokens / t_off, 2), on_tok_s=round(tokens / t_on, 2),
                       ratio=round(t_off / t_on, 3), off_decode_tok_s=round(decoded / d_off, 2),
                       on_decode_tok_s=round(decoded / d_on, 2), decode_ratio=round(d_off / d_on, 3),
                       drafted=drafted, accepted=acc, acceptance=round(acc / drafted, 3) if drafted else 0.0,
                       same_tokens=sum(a == b for a, b in zip(out_off, out_on)), mode=mode,
                       model_drafted=m_dr, model_accepted=m_acc)
            if "every" in best:
                t_e, _, out_e, dr_e, acc_e, m_dr_e, m_acc_e = best["every"]
                row.update(every_tok_s=round(tokens / t_e, 2), every_ratio=round(t_off / t_e, 3), every_drafted=dr_e,
                           every_accepted=acc_e, every_acceptance=round(acc_e / dr_e, 3) if dr_e else 0.0,
                           every_same_tokens=sum(a == b for a, b in zip(out_off, out_e)), every_model_drafted=m_dr_e,
                           every_model_accepted=m_acc_e,
                           every_model_acceptance=round(m_acc_e / m_dr_e, 3) if m_dr_e else 0.0)
            rows.append(row)
            print(json.dumps(row) if args.json else
                  f"{dtype:9} {name:13} T={kw['temperature']:<4} tok/s off {row['off_tok_s']:6.2f} {mode} "
                  f"{row['on_tok_s']:6.2f} ({row['ratio']:.3f}x); after the first token off "
                  f"{row['off_decode_tok_s']:6.2f} {mode} {row['on_decode_tok_s']:6.2f} ({row['decode_ratio']:.3f}x); "
                  f"drafted {drafted} accepted {acc} ({row['acceptance']:.2f}"
                  + (f"; the draft model's {m_dr} / {m_acc}" if args.draft else "") + f"); same {row['same_tokens']}/"
                  f"{len(prompts)}" + ("" if "every" not in best else
                                       f"; every draft: {row['every_tok_s']:6.2f} tok/s ({row['every_ratio']:.3f}x), "
                                       f"drafted {row['every_drafted']} accepted {row['every_accepted']} "
                                       f"({row['every_acceptance']:.2f}; the draft model's "
                                       f"{row['every_model_accepted']} / {row['every_model_drafted']}), same "
                                       f"{row['every_same_tokens']}/"
                                       f"{len(prompts)}"), flush=True)
        for e in engines.values():
            e.close()
    if args.json:
        print(json.dumps({"cpu": cpu_name(), "rows": rows}))


if __name__ == "__main__":
    main()
