"""How the CLI shows results: the one-line summary, the info table, per-step trace tables, the sweep table.

Everything a server sends (generated text, token texts) is wrapped in rich ``Text`` objects, never parsed as
rich markup: a token like "[/b]" must print as itself.
"""

from __future__ import annotations

import math
from typing import Sequence

from rich.console import Group
from rich.table import Table
from rich.text import Text

from quantserve.client.sweep import SweepRow
from quantserve.client.types import ModelInfo, Plan, Result, TokenLogprob, TraceStep


def human_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # unreachable; keeps type checkers quiet


def summary(r: Result) -> str:
    """tokens (prompt) · finish reason · seed · KV held at its peak / used (dtype) [· preemptions] · activation peak
    [· ttft, duration]."""
    reason = r.finish_reason + (f" ({r.stop})" if r.stop else "")
    n = r.usage.completion_tokens
    parts = [f"{n} token{'' if n == 1 else 's'} (prompt {r.usage.prompt_tokens})", f"finish {reason}", f"seed {r.seed}"]
    if r.memory is not None:
        m = r.memory
        dtype = f" ({m.kv_dtype})" if m.kv_dtype else ""
        parts.append(f"KV peak {human_bytes(m.kv_bytes_reserved)} / used {human_bytes(m.kv_bytes_used)}{dtype}")
        if m.preemptions:
            parts.append(f"preempted {m.preemptions}x, {m.recomputed_tokens} tokens recomputed")
        if m.speculated_tokens:
            parts.append(f"drafted {m.speculated_tokens}, accepted {m.accepted_tokens}, drafts' KV peak "
                         f"{human_bytes(m.kv_bytes_speculative)}"
                         + (f", draft model's KV peak {human_bytes(m.kv_bytes_draft)}" if m.kv_bytes_draft else ""))
        if m.kv_bytes_shared:
            parts.append(f"shared {human_bytes(m.kv_bytes_shared)} / own {human_bytes(m.kv_bytes_own)}, "
                         f"{m.prompt_tokens_cached} prompt tokens cached")
        parts.append(f"activation peak {human_bytes(m.activation_peak_bytes)}")
    if r.ttft_s is not None and r.duration_s is not None:
        parts.append(f"ttft {r.ttft_s * 1000:.0f} ms, {r.duration_s:.2f} s")
    return "[" + " · ".join(parts) + "]"


def info_table(i: ModelInfo, transport: str) -> Table:
    def na(v) -> str:
        return "n/a" if v is None else str(v)

    t = Table(title=f"quantserve model ({transport})", show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value")
    rows = [("model", i.model), ("scheme", i.scheme), ("dtype", na(i.dtype)), ("attention", na(i.attention)),
            ("device", na(i.device)), ("glue ops", na(i.glue_ops)), ("embeddings", na(i.embeddings)),
            ("context length", str(i.context_length)),
            ("vocab size", na(i.vocab_size)),
            ("KV bytes / token", na(i.kv_bytes_per_token)), ("speculative decoding", na(i.speculation))]
    if i.memory is not None:
        m = i.memory
        rows += [("weights", human_bytes(m.weight_bytes)), ("KV pool capacity", human_bytes(m.kv_capacity_bytes)),
                 ("KV pool in use", human_bytes(m.kv_used_bytes)), ("KV block size", f"{m.kv_block_size} tokens"),
                 ("running / queued", f"{m.running} / {m.queued}"),
                 ("prefix cache", f"{human_bytes(m.kv_cached_bytes)} cached, hit rate {100 * m.prefix_hit_rate:.1f}% "
                  f"({m.prefix_hit_tokens} of {m.prefix_queried_tokens} prompt tokens), {m.prefix_evictions} "
                  "evictions" if m.prefix_cache else "off")]
        if m.speculated_tokens:
            rows.append(("speculation", f"{m.speculated_tokens} drafted, {100 * m.acceptance_rate:.1f}% accepted"))
        if m.draft_weight_bytes:
            rows.append(("draft model", f"weights {human_bytes(m.draft_weight_bytes)}, KV pool "
                                        f"{human_bytes(m.draft_kv_capacity_bytes)}"))
    else:
        rows.append(("memory totals", "n/a"))
    rows += [("max new tokens (limit)", na(i.max_new_tokens_limit)), ("max prompt tokens", na(i.max_prompt_tokens))]
    rows += [("kernels" if n == 0 else "", k) for n, k in enumerate(i.kernels)]
    for k, v in rows:
        t.add_row(k, Text(v))
    return t


def plan_table(p: Plan, transport: str) -> Group:
    """One row per shape: KV per request, how many fit now / when idle (and what limits it), the activation
    peak, and the outcomes of sending them now; a refusal's reason on the line below its row; then the pool."""
    admission = ", KV " + " ".join(x for x in (p.kv_dtype, p.kv_admission) if x) if p.kv_admission else ""
    t = Table(title=f"capacity plan ({transport}{admission})", title_justify="left")
    for name in ("prompt", "max new", "count", "n", "KV / request", "fit now", "fit idle", "expected",
                 "activation peak", "admitted", "queued", "refused"):
        t.add_column(name, justify="right")
    notes = []
    e = p.engine
    bpb = e.kv_capacity_bytes // p.kv_capacity_blocks if e is not None and p.kv_capacity_blocks else 0
    for i, s in enumerate(p.shapes):
        shared = f", {s.kv_blocks_shared} shared" if s.kv_blocks_shared else ""
        t.add_row(str(s.shape.prompt_tokens), str(s.shape.max_new_tokens), str(s.shape.count), str(s.shape.n),
                  f"{human_bytes(s.kv_blocks * bpb)} ({s.kv_blocks} blocks{shared})",
                  f"{s.fit_now} ({s.fit_now_limited_by})", f"{s.fit_empty} ({s.fit_empty_limited_by})",
                  f"{s.fit_expected} at {s.shape.expected_new_tokens or s.shape.max_new_tokens} new",
                  human_bytes(s.activation_peak_bytes), str(s.admitted), str(s.queued), str(s.refused))
        if s.refusal is not None:
            notes.append(Text(f"shape {i + 1} refused: {s.refusal.code}: {s.refusal.message}"))
    pool = Text(f"KV pool: {p.kv_free_blocks} of {p.kv_capacity_blocks} blocks free "
                f"({human_bytes(p.kv_free_blocks * bpb)} of {human_bytes(p.kv_capacity_blocks * bpb)}), "
                f"{p.kv_bytes_per_token} bytes / token; running {e.running if e else 'n/a'} of max {p.max_batch}, "
                f"queued {e.queued if e else 'n/a'} of max {p.max_queue}; prefill chunk {p.max_prefill_tokens} "
                f"tokens; attention {p.attention}")
    return Group(t, *notes, pool)


def _tok(s: str) -> str:
    return repr(s)  # quoted, escaped: leading spaces, newlines and control characters stay visible


_REMOVED_STYLE = {"min-p": "magenta", "top-k": "red", "top-p": "yellow"}


def trace_table(index: int, step: TraceStep, chosen: TokenLogprob | None, n: int) -> Group:
    """One step: the top candidates after each stage of the sampling order side by side (after the logit bias
    and penalties, temperature, min-p, top-k, top-p), a "removed by" column (min-p, top-k and top-p each keep a
    prefix of the sorted candidates, so rank >= kept_* means that control removed it), then one line with the
    exact kept counts, masses (after temperature) and entropy of the step."""
    drew = f" drew {_tok(chosen.token)} (logprob {chosen.logprob:.3f})" if chosen is not None else ""
    if step.draft_token is not None:  # speculation drafted this position: the draw kept or replaced the draft
        kept = chosen is not None and (chosen.token_id == step.draft_token_id if chosen.token_id is not None
                                       else chosen.token == step.draft_token)
        drew += f" · drafted {_tok(step.draft_token)}: {'accepted' if kept else 'rejected'}"
    t = Table(title=Text(f"step {index}:{drew}"), title_justify="left")
    t.add_column("#", justify="right")
    names = ("after penalties", "after temperature", "after min-p", "after top-k", "after top-p")
    for name in names:
        t.add_column(name)
        t.add_column("p", justify="right")
        if name == "after temperature":
            t.add_column("removed by")
    kept = (None, None, step.kept_min_p, step.kept_top_k, step.kept_top_p)  # survivors of each stage's control
    cols = (step.after_penalties, step.after_temperature, step.after_min_p, step.after_top_k, step.after_top_p)
    drawn = len(cols) - 1
    for rank in range(min(n, max((len(c) for c in cols), default=0))):
        removed = ("min-p" if rank >= step.kept_min_p else "top-k" if rank >= step.kept_top_k
                   else "top-p" if rank >= step.kept_top_p else "")
        cells: list = [str(rank + 1)]
        for stage, cands in enumerate(cols):
            c = cands[rank] if rank < len(cands) else None
            style = ""
            if stage == 1 and removed:
                style = f"{_REMOVED_STYLE[removed]} strike"
            elif kept[stage] is not None and rank >= kept[stage]:
                style = "dim"  # listed with probability 0: this stage removed it
            if (stage == drawn and c is not None and chosen is not None
                    and (c.token_id == chosen.token_id if chosen.token_id is not None else c.token == chosen.token)):
                style = "bold green"  # the drawn token (over HTTP, matched by its text)
            cells += [Text(_tok(c.token), style=style), Text(f"{c.prob:.4g}", style=style)] if c else ["", ""]
            if stage == 1:
                cells.append(Text(removed, style=_REMOVED_STYLE.get(removed, "")))
        t.add_row(*cells)
    stats = Text(f"  min-p kept {step.kept_min_p} tokens (mass {step.mass_min_p:.4g}, removed "
                 f"{max(1 - step.mass_min_p, 0):.4g}) · top-k kept {step.kept_top_k} (mass {step.mass_top_k:.4g}, "
                 f"removed {max(step.mass_min_p - step.mass_top_k, 0):.4g}) · top-p kept {step.kept_top_p} (mass "
                 f"{step.mass_top_p:.4g}, removed {max(step.mass_top_k - step.mass_top_p, 0):.4g}) · entropy "
                 f"{step.entropy:.4g} nats")
    return Group(t, stats)


def _f(v: float, fmt: str = ".3f") -> str:
    return "n/a" if v is None or math.isnan(v) else format(v, fmt)


def sweep_table(rows: Sequence[SweepRow], seeds: int, transport: str) -> Table:
    t = Table(title=f"sweep: {len(rows)} cells x {seeds} seeds ({transport}; distinct-n over "
                    f"{'token ids' if transport == 'grpc' else 'token texts'})")
    for name in ("T", "top_k", "top_p", "len", "distinct-1", "distinct-2", "rep. rate", "mean logprob",
                 "mean entropy", "KV peak", "KV used", "act. peak"):
        t.add_column(name, justify="right")
    for r in rows:
        m = r.metrics
        t.add_row(f"{r.temperature:g}", str(r.top_k), f"{r.top_p:g}", _f(m.mean_length, ".1f"), _f(m.distinct_1),
                  _f(m.distinct_2), _f(m.repetition_rate), _f(m.mean_logprob), _f(m.mean_entropy),
                  human_bytes(m.kv_bytes_reserved), human_bytes(m.kv_bytes_used),
                  human_bytes(m.activation_peak_bytes))
    return t
