"""The batched sampler (docs/design.md, "Sampling: the documented order").

For every request and every generated token the sampler applies, on fp32 logits (before it, the engine sets the
EOS logits to -inf while a request has fewer than ``min_tokens`` tokens):

1. logit bias (``logit_bias``, OpenAI's): each listed token id's bias, in [-100, 100], is added to its raw logit
   (-100 all but bans a token, +100 all but forces it);
2. repetition penalty (if != 1), HF semantics: every token id seen in the request's prompt or generated tokens
   gets ``logit / p`` when ``logit > 0`` and ``logit * p`` otherwise;
3. presence and frequency penalties (OpenAI's definitions, over the generated tokens only):
   ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``, count = times the id was generated;
   then the structured-output mask (``response_format``, server/grammar.py): tokens the grammar forbids get -inf;
4. temperature: ``logits / T``; ``T == 0`` is greedy (argmax of the logits after 1-3) and skips 5-8;
5. min-p: keep the tokens whose probability after temperature is >= min_p x the most probable token's
   (min_p = 0: off; the most probable token always survives). Before top-k and top-p, as vLLM does;
   transformers' MinPLogitsWarper runs after them, which differs only when top-p cuts inside min-p's set;
6. top-k: keep the k highest logits (k = 0: off; tokens tied with the k-th are kept, as transformers does);
7. top-p: softmax over what min-p and top-k kept, sorted descending; keep the smallest prefix whose cumulative
   probability reaches p (the crossing token is kept), i.e. a token survives iff the mass strictly before it
   is < p. p = 1: off; p = 0: only the most probable token. The first token always survives;
8. renormalise the survivors and draw one token with the request's own random stream (server/random_stream.py:
   uniforms that are a pure function of seed, step and token id; a Gumbel-max draw on them).

Every step is skipped for the whole batch when no row uses it (host flags on :class:`SamplingBatch`), so a request
that uses none of the controls pays for none of them.

The parameters were validated once, at the boundary (server/sampling_params.py), into ranges where every step
stays finite in fp32 for finite logits: nothing here checks or clamps them. Reported logprobs are the model's own
(log-softmax of the raw logits), floored at :data:`LOGPROB_FLOOR` so a token of zero probability has a finite one.

Each fast op below names its reference: plain per-row code in server/sampling_reference.py that the tests hold the
batched path (:func:`filtered_probs`, the distribution :func:`sample` draws from) equal to.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from server.batch import stage
from server.random_stream import random_uniform
from server.sampling_params import SEED_LIMIT

# A reported logprob of -inf (a token the model gives zero probability, such as an EOS held off by min_tokens) is
# this instead: JSON has no infinity and a proto double should not carry one. vLLM's OpenAI server floors at -9999.0.
LOGPROB_FLOOR = -9999.0


@dataclass
class SamplingBatch:
    """The per-step, per-row sampling tensors of the running batch (built once per step by :meth:`build`)."""

    temperature: Tensor  # (B,) fp32; 0 = greedy
    top_k: Tensor  # (B,) int64; 0 = off
    top_p: Tensor  # (B,) fp32; 1 = off
    repetition_penalty: Tensor  # (B,) fp32; 1 = off
    seeds: Tensor  # (B,) int64
    steps: Tensor  # (B,) int64: the request's generated-token index for this draw
    history: Tensor | None  # (B, L) int64 prompt + generated ids padded with -1; None when no row has a penalty
    logprobs_n: int = 0  # max over rows of logprobs
    trace_n: int = 0  # max over rows of trace
    # Host-side facts computed from the params, so sample() branches without reading device tensors (no sync).
    # Defaults are the safe "anything may be on" values for hand-built batches.
    any_filter: bool = True  # some sampled row has top_k > 0, top_p < 1 or min_p > 0
    all_greedy: bool = False  # every row has T == 0 (no random draw needed)
    want_logprob: bool = True  # some row asked for logprobs (else a greedy batch skips the log-softmax)
    any_repetition: bool = True  # some row has repetition_penalty != 1 (else step 2 is skipped)
    min_p: Tensor | None = None  # (B,) fp32; None when no row has min_p > 0
    # presence and frequency penalties, (B,) fp32 each, and where each row's generated ids start in ``history``
    # (B,) int64; None when no row has either penalty
    presence: Tensor | None = None
    frequency: Tensor | None = None
    generated_from: Tensor | None = None
    # logit_bias as (B, E) token ids padded with -1 and (B, E) fp32 biases; None when no row has one
    bias_ids: Tensor | None = None
    bias_values: Tensor | None = None
    # the structured-output mask, (B, ceil(V / 32)) int32 (server/grammar.py fills it; rows without a grammar all
    # ones); None when no row has one
    allowed: Tensor | None = None

    @classmethod
    def build(cls, params, seeds, steps, histories, device=None, prompt_lens=None) -> SamplingBatch:
        """``histories``: each row's prompt + generated ids (needed when a row has a penalty); ``prompt_lens``: how
        many of them are the prompt's (needed when a row has a presence or frequency penalty)."""
        n = len(params)
        if len(seeds) != n or len(steps) != n or (histories is not None and len(histories) != n):
            raise ValueError("params, seeds, steps and histories must have one entry per row")
        for s in seeds:
            if isinstance(s, bool) or not isinstance(s, numbers.Integral) or not 0 <= s < SEED_LIMIT:
                raise ValueError(f"seed must be an integer in [0, 2**63), got {s!r}")
        if any(int(t) < 0 for t in steps):
            raise ValueError("steps must be >= 0")
        history = None
        if any(p.uses_history for p in params):
            if histories is None:
                raise ValueError("histories are required when a row has a penalty")
            width = max(1, max(len(h) for h in histories))
            flat_h = [t for h in histories for t in (*h, *[-1] * (width - len(h)))]  # -1 pads: ignored by the penalty
            history = stage(flat_h, torch.int64, device).view(n, width)  # (B, L)
        counted = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
        if counted and (prompt_lens is None or len(prompt_lens) != n):
            raise ValueError("prompt_lens (one per row) are required when a row has a presence or frequency penalty")
        sampled = [p for p in params if p.temperature != 0.0]
        # Two staged copies per step (fp32 and int64 columns), never a synchronising one.
        f = stage([p.temperature for p in params] + [p.top_p for p in params]
                  + [p.repetition_penalty for p in params] + [p.min_p for p in params]
                  + [p.presence_penalty for p in params] + [p.frequency_penalty for p in params],
                  torch.float32, device).view(6, n)
        i = stage([p.top_k for p in params] + [int(s) for s in seeds] + [int(t) for t in steps]
                  + [int(x) for x in (prompt_lens if counted else [0] * n)], torch.int64, device).view(4, n)
        bias_ids = bias_values = None
        if any(p.logit_bias for p in params):
            width = max(len(p.logit_bias) for p in params)
            pad = [(-1, 0.0)] * width
            pairs = [e for p in params for e in (*p.logit_bias, *pad[len(p.logit_bias):])]
            bias_ids = stage([t for t, _ in pairs], torch.int64, device).view(n, width)  # (B, E)
            bias_values = stage([b for _, b in pairs], torch.float32, device).view(n, width)  # (B, E)
        return cls(
            temperature=f[0], top_k=i[0], top_p=f[1], repetition_penalty=f[2], seeds=i[1], steps=i[2],
            history=history,
            logprobs_n=max([p.logprobs or 0 for p in params], default=0),
            trace_n=max([p.trace or 0 for p in params], default=0),
            any_filter=any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in sampled),
            all_greedy=not sampled,
            want_logprob=any(p.logprobs is not None for p in params),
            any_repetition=any(p.repetition_penalty != 1.0 for p in params),
            min_p=f[3] if any(p.min_p > 0.0 for p in sampled) else None,
            presence=f[4] if counted else None, frequency=f[5] if counted else None,
            generated_from=i[3] if counted else None,
            bias_ids=bias_ids, bias_values=bias_values,
        )


TRACE_STAGES = ("penalties", "temperature", "min_p", "top_k", "top_p")  # after steps 1-3, 4, 5, 6, 7
TRACE_STATS = ("kept_min_p", "kept_top_k", "kept_top_p", "mass_min_p", "mass_top_k", "mass_top_p", "entropy")


@dataclass
class SampleOutput:
    tokens: Tensor  # (B,) int64
    # (B,) fp32: log-prob of the chosen token under log_softmax(raw logits), like vLLM's default, at least
    # LOGPROB_FLOOR; None for a greedy batch in which no row asked for logprobs or a trace
    logprob: Tensor | None
    # ids (B, N) int64, logprobs (B, N) fp32 of the raw distribution (at least LOGPROB_FLOOR)
    top_logprobs: tuple[Tensor, Tensor] | None
    # TRACE_STAGES -> (ids (B, N), probs (B, N)), every stage listing the same ids (the temperature stage's top N)
    trace: dict[str, tuple[Tensor, Tensor]] | None
    # Exact over the whole vocabulary (the top-N above is not), with a trace only; (B, 7) float64 columns
    # (TRACE_STATS): tokens min-p kept, tokens top-k kept as well, tokens top-p kept as well (the support of the
    # draw), and the temperature stage's mass of each of those three sets, then the entropy (nats) of the
    # distribution the token was drawn from. Greedy rows: 1, 1, 1, 1, 1, 1, 0.
    trace_stats: Tensor | None = None



# ---------------------------------------------------------------------------------------------- fast path


def apply_logit_bias(logits: Tensor, ids: Tensor | None, values: Tensor | None) -> Tensor:
    """Step 1, batched: ``values`` (B, E) added at ``ids`` (B, E) of each row (-1 pads go to a dropped column).
    Reference: ``ref_logit_bias``."""
    if ids is None:
        return logits
    B, V = logits.shape
    cols = torch.where((ids < 0) | (ids >= V), V, ids)  # (B, E)
    bias = torch.zeros(B, V + 1, dtype=logits.dtype, device=logits.device).scatter_(1, cols, values)  # (B, V+1)
    return logits + bias[:, :V]  # (B, V) a new tensor: the caller's logits stay the raw ones


def apply_penalty(logits: Tensor, penalty: Tensor, history: Tensor | None) -> Tensor:
    """Step 2, batched: HF repetition penalty on every id in each row's history (-1 pads ignored). Reference:
    ``ref_penalty``."""
    if history is None:
        return logits
    B, V = logits.shape
    # ids outside [0, V) (pads, or an embedding larger than the head) go to a spare column that is dropped.
    ids = torch.where((history < 0) | (history >= V), V, history)  # (B, L)
    seen = torch.zeros(B, V + 1, dtype=torch.bool, device=logits.device)  # (B, V+1)
    seen.scatter_(1, ids, True)
    p = penalty[:, None]  # (B, 1)
    penalised = torch.where(logits > 0, logits / p, logits * p)  # (B, V)
    return torch.where(seen[:, :V], penalised, logits)  # (B, V)


def apply_presence_frequency(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Step 3, batched: OpenAI's presence and frequency penalties over each row's generated ids. Reference:
    ``ref_presence_frequency``."""
    if batch.frequency is None:
        return logits
    B, V = logits.shape
    h = batch.history  # (B, L) prompt + generated ids
    pos = torch.arange(h.shape[1], device=h.device)[None, :]  # (1, L)
    generated = (pos >= batch.generated_from[:, None]) & (h >= 0) & (h < V)  # (B, L)
    cols = torch.where(generated, h, V)  # (B, L) the prompt's ids and pads to the dropped column
    counts = torch.zeros(B, V + 1, dtype=logits.dtype, device=logits.device)  # (B, V+1)
    counts.scatter_add_(1, cols, torch.ones_like(cols, dtype=logits.dtype))
    counts = counts[:, :V]  # (B, V)
    return logits - batch.frequency[:, None] * counts - batch.presence[:, None] * (counts > 0).to(logits.dtype)


def unpack_bitmask(mask: Tensor, vocab: int) -> Tensor:
    """(B, W) int32 bitmask -> (B, V) bool: bit j of word w allows token 32 w + j. Reference: ``ref_unpack``."""
    bits = torch.arange(32, dtype=torch.int32, device=mask.device)  # (32,)
    return ((mask[:, :, None] >> bits) & 1).bool().view(mask.shape[0], -1)[:, :vocab]  # (B, V)


def processed_logits(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Steps 1-3 on fp32 logits (B, V), then the structured-output mask; a new tensor whenever a step changes
    anything."""
    x = apply_logit_bias(logits.float(), batch.bias_ids, batch.bias_values)  # (B, V)
    x = apply_penalty(x, batch.repetition_penalty, batch.history if batch.any_repetition else None)  # (B, V)
    x = apply_presence_frequency(x, batch)  # (B, V)
    if batch.allowed is not None:
        x = x.masked_fill(~unpack_bitmask(batch.allowed, x.shape[1]), -math.inf)  # (B, V)
    return x


def _filter(x: Tensor, batch: SamplingBatch, want_trace: bool):
    """Steps 4-8 but the draw on the processed logits ``x`` (B, V) (steps 1-3, :func:`processed_logits`), whole
    batch: (probs (B, V), greedy tokens (B,), trace stages, trace stats)."""
    processed = x
    B, V = x.shape
    greedy = batch.temperature == 0  # (B,)
    greedy_tok = x.argmax(-1)  # (B,) of the processed logits; first index among ties, like the stable sort
    onehot = torch.nn.functional.one_hot(greedy_tok, V).to(torch.float32)  # (B, V)
    # Greedy rows divide by 1 only to stay finite; their result is replaced by the one-hot below.
    t = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)  # (B,)
    x = x / t[:, None]  # (B, V)
    if not (batch.any_filter or want_trace):
        probs = torch.where(greedy[:, None], onehot, torch.softmax(x, -1))  # (B, V)
        return probs, greedy_tok, None, None

    # One stable descending sort serves min-p, top-k, top-p and the trace (every stage keeps this order).
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)  # (B, V) each
    pt = torch.softmax(vals, -1) if (want_trace or batch.min_p is not None) else None  # (B, V) temperature stage
    # tokens at -inf (the JSON mask, EOS held off) are in no stage's kept set: the counts are the draw's support
    keep_m = vals > -math.inf  # (B, V)
    if batch.min_p is not None:
        keep_m &= pt >= batch.min_p[:, None] * pt[:, :1]  # (B, V) p >= min_p * p_max: the first always passes
    k = torch.where(batch.top_k > 0, batch.top_k.clamp(max=V), V)  # (B,) k = 0 -> keep all
    kth = vals.gather(1, (k - 1)[:, None])  # (B, 1)
    keep_k = keep_m & (vals >= kth)  # (B, V) ties with the k-th value are kept, as transformers does
    pk = torch.softmax(vals.masked_fill(~keep_k, -math.inf), -1)  # (B, V) the min-p and top-k stage, sorted
    keep_sorted = keep_k & ~_top_p_drops(pk, batch.top_p)  # (B, V)
    keep = torch.zeros_like(keep_sorted).scatter_(1, idx, keep_sorted)  # (B, V) back to vocab order
    probs = torch.softmax(x.masked_fill(~keep, -math.inf), -1)  # (B, V) step 8's renormalisation
    probs = torch.where(greedy[:, None], onehot, probs)  # (B, V)
    stages = stats = None
    if want_trace:
        n = min(batch.trace_n, V)
        first = torch.zeros(B, n, dtype=torch.float32, device=x.device)  # (B, N) greedy: all mass on sorted[0]
        first[:, 0] = 1.0
        g = greedy[:, None]  # (B, 1)
        top = idx[:, :n]  # (B, N)
        dists = {"temperature": pt, "min_p": torch.softmax(vals.masked_fill(~keep_m, -math.inf), -1),  # sorted
                 "top_k": pk, "top_p": torch.softmax(vals.masked_fill(~keep_sorted, -math.inf), -1)}
        stages = {"penalties": (top, torch.softmax(processed, -1).gather(1, top))}  # before temperature: any row
        stages |= {name: (top, torch.where(g, first, dists[name][:, :n])) for name in TRACE_STAGES[1:]}  # (B, N)
        kept = [keep_m, keep_k, keep_sorted]
        stats = torch.stack([m.sum(-1).double() for m in kept] + [(pt * m).sum(-1).double() for m in kept]
                            + [torch.special.entr(probs).sum(-1).double()], -1)  # (B, 7) TRACE_STATS
        greedy_stats = torch.tensor([1.0] * 6 + [0.0], dtype=torch.float64, device=x.device)  # (7,)
        stats = torch.where(g, greedy_stats, stats)  # (B, 7)
    return probs, greedy_tok, stages, stats


def _top_p_drops(pk: Tensor, top_p: Tensor) -> Tensor:
    """Step 7 on sorted probabilities ``pk`` (B, N), most probable first: the tokens top-p removes, those whose mass
    strictly before them reaches p (B, N)."""
    cum = pk.cumsum(-1)  # (B, N)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], -1)  # (B, N) mass strictly before
    p = top_p[:, None]  # (B, 1)
    # p == 1 is "off" explicitly: fp32 cumsum may reach 1.0 early and would otherwise drop tiny tails.
    drop = (before >= p) & (p < 1)  # (B, N)
    drop[:, 0] = False  # the most probable token always survives (p = 0 keeps exactly it)
    return drop


def _gumbel_argmax(uniforms, batch: SamplingBatch, ids: int | Tensor, probs: Tensor) -> Tensor:
    """Step 8's draw: the index (B,) of each row's Gumbel-max over ``probs`` (B, N), the uniforms of its seed and
    step at token ids ``ids`` (every id below it, or (B, N) ids)."""
    gumbel = uniforms(batch.seeds, batch.steps, ids).log_().neg_().log_().neg_()  # (B, N) -log(-log u), finite
    return gumbel.add_(probs.double().log()).argmax(-1)  # (B,) log 0 = -inf: removed tokens never win


def filtered_probs(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """The (B, V) distribution that :func:`sample` draws from (steps 1-7, renormalised); one-hot for greedy rows.
    Reference: ``reference_filter`` (steps 4-7 one by one: ``ref_temperature``, ``ref_min_p``, ``ref_top_k``,
    ``ref_top_p``)."""
    return _filter(processed_logits(logits, batch), batch, want_trace=False)[0]


# The CPU's draw under min-p, top-k or top-p looks among each row's this many most probable tokens before it sorts
# the whole vocabulary (_draw_candidates); a nucleus wider than this takes the full sort.
TOP_CANDIDATES = 1024


def _draw_candidates(x: Tensor, batch: SamplingBatch, uniforms) -> tuple[Tensor, Tensor] | None:
    """Steps 1-8 of a batch whose sampled rows filter, over each row's :data:`TOP_CANDIDATES` most probable tokens
    instead of a sort of the whole vocabulary: (drawn tokens (B,), greedy tokens (B,)), or None when some sampled
    row's kept set may reach past its candidates.

    The candidates, ordered by value and then id, are exactly the full stable sort's prefix down to the values tied
    with the last (a sentinel: one more than TOP_CANDIDATES is taken). A row qualifies when every token it keeps is
    strictly above the sentinel and, unless min-p and top-k are both off for it (top-p's mass is then the temperature
    stage's over the whole row), every token min-p and top-k keep is. Every stage then decides as :func:`_filter`
    does, the temperature stage normalised over the whole row, and the Gumbel-max draw over the kept candidates
    is the draw over the vocabulary with the removed tokens at log 0. One host read (the qualification), so only
    the CPU path takes it. ``x``: the processed logits (steps 1-3). Reference: :func:`_filter` and the draw of
    :func:`sample`."""
    greedy = batch.temperature == 0  # (B,)
    greedy_tok = x.argmax(-1)  # (B,)
    x = x / torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)[:, None]  # (B, V)
    B, V = x.shape
    top, ids = x.topk(min(V, TOP_CANDIDATES + 1), dim=-1)  # (B, K) each, descending; ties in no stated order
    ids, by_id = ids.sort(dim=-1)  # by id, so the stable sort below orders ties by id, as the full one does
    vals, order = top.gather(1, by_id).sort(dim=-1, descending=True, stable=True)  # (B, K)
    ids = ids.gather(1, order)  # (B, K)
    K = vals.shape[1]
    # strictly above the sentinel (the last): the full sort's prefix for certain; with the whole row, everything
    inside = vals > vals[:, -1:] if K < V else torch.ones_like(vals, dtype=torch.bool)  # (B, K)
    m = vals[:, :1]  # (B, 1) the row's max
    pt = torch.exp(vals - m) / torch.exp(x - m).sum(-1, keepdim=True)  # (B, K) temperature stage, whole-row mass
    keep_k = vals > -math.inf  # (B, K)
    min_p = batch.min_p if batch.min_p is not None else torch.zeros_like(batch.temperature)  # (B,)
    keep_k &= pt >= min_p[:, None] * pt[:, :1]
    k = batch.top_k  # (B,)
    kth = vals.gather(1, (k.clamp(1, K) - 1)[:, None])  # (B, 1)
    keep_k &= (vals >= kth) | (k == 0)[:, None]  # k >= K keeps the sentinel: the row fails below
    whole = (k == 0) & (min_p == 0)  # (B,) min-p and top-k keep every finite token
    bounded = ~(keep_k & ~inside).any(-1)  # (B,)
    pk = torch.where(whole[:, None], pt, torch.softmax(vals.masked_fill(~keep_k, -math.inf), -1))  # (B, K)
    keep = keep_k & ~_top_p_drops(pk, batch.top_p)  # (B, K)
    ok = (whole | bounded) & ~(keep & ~inside).any(-1)  # (B,)
    if not bool((ok | greedy).all()):
        return None
    probs = torch.softmax(vals.masked_fill(~keep, -math.inf), -1)  # (B, K) step 8's renormalisation
    drawn = ids.gather(1, _gumbel_argmax(uniforms, batch, ids, probs)[:, None])[:, 0]  # (B,)
    return drawn, greedy_tok


def sample(logits: Tensor, batch: SamplingBatch, ops=None) -> SampleOutput:
    """Draw one token per row of ``logits`` (B, V) following the documented order.

    1. logit bias added to the raw fp32 logits;
    2. repetition penalty (rows with penalty 1 are unchanged);
    3. presence and frequency penalties over the generated ids;
    4. temperature (T = 0: greedy argmax of the logits after 1-3; steps 5-8 skipped);
    5. min-p (p >= min_p x p_max after temperature; the most probable token survives);
    6. top-k (ties with the k-th logit kept);
    7. top-p over what min-p and top-k kept (crossing token kept; at least one token survives);
    8. renormalise and draw with Gumbel-max on the counter-based uniforms of (seed, step, v).

    Also returns the chosen token's log-prob under the raw distribution, the raw top-N log-probs when any row
    asked for logprobs (both floored at LOGPROB_FLOOR), and each stage's top-N when any row asked for a trace.
    ``ops`` (server.fastops.Ops) gives the uniforms; with the fused CPU ops a filtering batch without a trace draws
    among each row's top candidates (:func:`_draw_candidates`, one host read). Otherwise no host synchronisation.
    A greedy batch that asked for none of these is the argmax of steps 1-3 alone, with ``logprob`` None: at batch
    1 the softmaxes and one-hot of the general path cost ~5% of a decode step of the default model.
    """
    assert logits.dim() == 2 and logits.shape[0] == batch.seeds.shape[0], "logits must be (B, V)"
    if batch.all_greedy and not batch.want_logprob and batch.trace_n == 0:
        x = processed_logits(logits, batch)  # (B, V)
        return SampleOutput(tokens=x.argmax(-1), logprob=None, top_logprobs=None, trace=None)
    uniforms = random_uniform if ops is None else ops.random_uniform
    raw = torch.log_softmax(logits.float(), -1)  # (B, V) the model's own distribution, for logprobs
    x = processed_logits(logits, batch)  # (B, V) steps 1-3, once for either path
    found = None
    if ops is not None and ops.fused and batch.any_filter and batch.trace_n == 0 and not batch.all_greedy:
        found = _draw_candidates(x, batch, uniforms)
    stages = stats = None
    if found is not None:
        drawn, greedy_tok = found
    else:
        probs, greedy_tok, stages, stats = _filter(x, batch, want_trace=batch.trace_n > 0)  # (B, V), (B,)
        drawn = None if batch.all_greedy else _gumbel_argmax(uniforms, batch, probs.shape[1], probs)  # (B,)
    tokens = greedy_tok if drawn is None else torch.where(batch.temperature == 0, greedy_tok, drawn)  # (B,)
    logprob = raw.gather(1, tokens[:, None])[:, 0].clamp_(min=LOGPROB_FLOOR)  # (B,)
    top = None
    if batch.logprobs_n > 0:
        top_lp, top_ids = raw.topk(min(batch.logprobs_n, raw.shape[1]), dim=-1)  # (B, N) each
        top = (top_ids, top_lp.clamp_(min=LOGPROB_FLOOR))
    return SampleOutput(tokens=tokens, logprob=logprob, top_logprobs=top, trace=stages, trace_stats=stats)
