"""The sweep's metrics: pure functions of generated token sequences and per-step numbers.

A "sequence" is one request's generated tokens as hashable keys (their ids; the tokens' texts from logprobs
for a server that returns no ids). A cell of the sweep pools the sequences of all its seeds. An
undefined value (no tokens at all) is NaN, never a made-up 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

from quantserve.client.types import Result

Seq = Sequence[Hashable]


def ngrams(seq: Seq, n: int) -> list[tuple]:
    """The n-grams of one sequence, in order: len(seq) - n + 1 of them (none when the sequence is shorter)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]


def distinct_n(seqs: Iterable[Seq], n: int) -> float:
    """distinct-n = |unique n-grams| / |n-grams|, pooled over ``seqs``.

    N-grams are taken within each sequence (never across two requests' boundary); "unique" is over the pooled
    multiset, so two seeds producing the same text lower the score. NaN when there are no n-grams.
    Example: [[1, 2, 1, 2]] gives distinct-1 = 2/4 = 0.5 and distinct-2 = |{(1,2), (2,1)}| / 3 = 2/3."""
    grams = [g for s in seqs for g in ngrams(s, n)]
    return len(set(grams)) / len(grams) if grams else math.nan


def repeats(seq: Seq) -> int:
    """How many positions t hold a token that already occurred at some position < t of the same sequence
    (len(seq) minus the number of distinct tokens)."""
    return len(seq) - len(set(seq))


def repetition_rate(seqs: Iterable[Seq]) -> float:
    """Fraction of generated tokens that repeat a token seen earlier in the same generation:
    sum over sequences of :func:`repeats` / total tokens. A token seen only in another request, or in the
    prompt, does not count. NaN when there are no tokens. Example: [[5, 6, 5, 5], [7]] gives 2/5 = 0.4."""
    seqs = list(seqs)
    total = sum(len(s) for s in seqs)
    return sum(repeats(s) for s in seqs) / total if total else math.nan


def pooled_mean(groups: Iterable[Iterable[float]]) -> float:
    """Mean over all values of all groups (each value weighs the same, so a longer generation weighs more).
    NaN when there are no values."""
    vals = [float(v) for g in groups for v in g]
    return math.fsum(vals) / len(vals) if vals else math.nan


def mean(values: Iterable[float]) -> float:
    vals = [float(v) for v in values]
    return math.fsum(vals) / len(vals) if vals else math.nan


@dataclass(frozen=True)
class CellMetrics:
    """One sweep cell, aggregated over its seeds (per-request memory figures are means over the requests)."""

    requests: int
    mean_length: float  # generated tokens per request
    distinct_1: float
    distinct_2: float
    repetition_rate: float
    mean_logprob: float  # per generated token, under the model's raw distribution (needs logprobs >= 0)
    mean_entropy: float  # nats per step, of the distribution each token was drawn from (needs trace >= 1)
    kv_bytes_reserved: float
    kv_bytes_used: float
    activation_peak_bytes: float


METRIC_NAMES = ("requests", "mean_length", "distinct_1", "distinct_2", "repetition_rate", "mean_logprob",
                "mean_entropy", "kv_bytes_reserved", "kv_bytes_used", "activation_peak_bytes")


def cell_metrics(results: Sequence[Result]) -> CellMetrics:
    """Metrics of one cell's results. Logprob and entropy come from the results' ``logprobs`` and ``trace``
    (NaN if the requests did not ask for them); memory from their accounting."""
    seqs = [r.token_keys() for r in results]
    mem = [r.memory for r in results if r.memory is not None]
    return CellMetrics(
        requests=len(results),
        mean_length=mean(r.usage.completion_tokens for r in results),
        distinct_1=distinct_n(seqs, 1),
        distinct_2=distinct_n(seqs, 2),
        repetition_rate=repetition_rate(seqs),
        mean_logprob=pooled_mean([lp.logprob for lp in r.logprobs] for r in results),
        mean_entropy=pooled_mean([t.entropy for t in r.trace] for r in results),
        kv_bytes_reserved=mean(m.kv_bytes_reserved for m in mem),
        kv_bytes_used=mean(m.kv_bytes_used for m in mem),
        activation_peak_bytes=mean(m.activation_peak_bytes for m in mem),
    )
