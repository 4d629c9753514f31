"""Speculative decoding with n-gram proposals (prompt lookup), verified so that sampling stays exact.

A request that speculates proposes k tokens ``d_1..d_k`` that may follow its text (the n-gram proposer below: the
tokens that followed the last earlier occurrence of its final n tokens, in its prompt or its output). One forward
pass over ``[last, d_1..d_k]`` gives the target's logits at the k+1 positions; each is sampled by the one sampler
(server/sampling.py) in the documented order with the state as of its position: penalty counts over the
history that includes the drafts before it, the grammar advanced along them, ``min_tokens`` by its index, and the
draw's uniforms keyed by (seed, the token's index). Call ``t_j`` the token drawn at position j.

**Acceptance.** The drafts are accepted while they equal the draws: ``a`` = the first j with ``t_j != d_{j+1}``
(k when all equal), and the step emits ``t_0..t_a``: the accepted drafts, then the draw at the first rejection or,
after k accepted drafts, the bonus token drawn at the last position. This is the standard rejection rule for a
point-mass proposal q = δ(d): the Gumbel-max draw ``t_j`` equals d with probability p(d) = min(1, p(d)/q(d)), and
given that it does not, it is distributed as p restricted to the other tokens and renormalised, which is
normalize(max(0, p - q)). So every emitted token has exactly the distribution the documented order defines, and
more: ``t_j`` is the very token a non-speculative step would draw there (the same logits, seed and index give the
same uniforms), so **a seed gives the same tokens with speculation on as off**, up to the last bits of the logits
a (k+1)-row forward computes against a one-row one (a near tie can then fall the other way; float32 on the CPU: the
same tokens in every test). Greedy requests accept exactly the argmax.

**Draft length.** A draft's chance of acceptance grows with how long the text has been copying its source: the
n-gram proposer also reports its match, the tokens before the current end that agree with those before the earlier
occurrence (at least the n-gram's n, counted to :data:`MATCH_CAP`), and a draft that would extend a match of l
tokens is weighed as accepted with probability l / (l + beta) (the rule-of-succession shape; on input-grounded
rewrites of the default model the rate at l = 2, 4, 8, 16, 32, 64 was 0.57, 0.66, 0.94, 0.96, 0.98, 0.98, and beta =
1.5 fits it; on six other passages, three rewritten and three summarised, beta came out 1.1-2.2 along l). Each
request estimates its own beta from its verifications by maximum likelihood (each draft examined is a trial at its
match length, a rejection the failure that ends the run; the evidence exponentially weighted, with
:data:`PRIOR_BETA` worth :data:`PRIOR_TRIALS` trials at :data:`PRIOR_MATCH`), so open chat, whose matches fail,
learns a large beta and drafts little. The draft model's drafts have no match: they keep a running per-token rate
alpha (accepted over examined, exponentially weighted). Each step the scheduler offers every decoding request's
drafts to :func:`allocate` with each draft's conditional rate, and the j-th draft adds the product of the first j
rates in expected tokens and one row to the step's forward, whose time by its rows was measured on this device when
the engine started (:class:`DraftCosts`; a step of decode rows alone, which a CPU replays as a recorded program,
measured apart), with that row's attention over its request's context beside other requests' (measured per
token of context, as the step's own rows' is; a lone request's drafted rows read its context from the cache) and
its draw where the request samples; every draft's expected tokens are weighed by the engine's calibration, the
share of the drafts its estimates expected that were accepted (:class:`Calibration`). A lone request drafts while
its rates pay for the rows; in a large batch, where a row costs nearly its share of the compute, only the likely drafts are verified; none
where plain decoding does best. After :data:`PROBE_AFTER` steps without a verification its evidence is halved (its
estimates move towards the priors), and the request probes: a few drafts verified as if likely, whose outcome
updates the estimates (where a plain step costs far less than a verification, as with a CPU's replayed decode steps,
the priors alone may not pay, and a repetitive text would never be found); a probe that fails doubles the wait for
the next, so open chat pays for few. A request probes at its first drafts.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

NGRAM_MAX = 4  # longest suffix matched
NGRAM_MIN = 2  # shortest: a single token repeats too often in ordinary text to predict the next ones
PRIOR = 0.5  # the acceptance rate of a draft model's drafts a request starts with
DECAY = 0.8  # weight of the past in that running rate, per verified step
PRIOR_BETA = 1.5  # an n-gram draft extending a match of l tokens is accepted with l / (l + beta): beta's prior,
PRIOR_TRIALS = 2.0  # worth this many drafts examined
PRIOR_MATCH = 4  # at this match
BETA_DECAY = 0.9  # weight of the past in beta's evidence, per verified step
MATCH_CAP = 64  # the longest match counted
MAX_RATE = 0.99  # no draft is weighed as certain
# Drafts are verified only where they promise this much more than the step without them: the step costs measured at
# start moved by more than that between runs on a shared 2-core CPU (8 bf16 rows: 1.34-2.71 one-row forwards in four
# runs of a day), so a draft that promises less is as likely to cost as to gain
MARGIN = 0.05
PROBE_AFTER = 16  # steps without a verification after which the estimates' evidence is halved, and
# after which (doubling after each probe that failed, up to MAX_PROBE_AFTER) a request probes: its drafts (at most
# PROBE_DRAFTS but at its first verification) weighed at no less than PROBE_RATE, so that a rate too low to pay is
# measured again
MAX_PROBE_AFTER = 256
PROBE_DRAFTS = 3
PROBE_RATE = 0.9
CALIBRATION_DECAY = 0.99  # weight of the past in an engine's calibration (:class:`Calibration`), per verification
CALIBRATION_PRIOR = 16.0  # expected drafts, all accepted, that it starts with


def accepted(drafts: list[int], draws: list[int]) -> int:
    """How many leading drafts the draws accept: the first j with ``draws[j] != drafts[j]`` (``len(drafts)`` when
    all equal); ``draws`` has one more entry than ``drafts`` (the bonus position)."""
    for j, d in enumerate(drafts):
        if draws[j] != d:
            return j
    return len(drafts)


def geometric(alpha: float, n: int) -> list[float]:
    """n drafts each accepted with ``alpha`` given the ones before: a draft model's, weighed by its running rate."""
    return [alpha] * n


def expected(rates: list[float]) -> float:
    """How many of drafts with these conditional rates are expected to be accepted: the sum of their prefixes'
    products (the j-th counts only if every one before it was accepted)."""
    out, p = 0.0, 1.0
    for r in rates:
        p *= r
        out += p
    return out


@dataclass
class Calibration:
    """Of the drafts an engine's estimates expected to be accepted, the share that were, over its recent
    verifications (exponentially weighted, :data:`CALIBRATION_DECAY`; a probe's drafts by the request's estimates,
    not the rate they were weighed at, so that the evidence goes on where drafting has stopped). Where
    :func:`allocate` keeps only the likeliest drafts of many, the estimates it picks by are the high ones, and fewer
    are accepted than they say: 16 grounded requests at once (float32) accepted 0.91 of the
    drafts expected, one at a time 1.00. ``scale`` (at most 1) weighs every draft's gain."""

    expected: float = CALIBRATION_PRIOR
    accepted: float = CALIBRATION_PRIOR

    @property
    def scale(self) -> float:
        return min(1.0, self.accepted / self.expected)

    def record(self, expected_: float, accepted_: int) -> None:
        self.expected = CALIBRATION_DECAY * self.expected + expected_
        self.accepted = CALIBRATION_DECAY * self.accepted + accepted_


def allocate(offers: list[tuple], base_rows: int, base_tokens: float, budget: int,
             costs: DraftCosts, proposer: DraftCosts | None = None, decode_only: bool = False,
             base_extra: float = 0.0, scale: float = 1.0) -> list[int]:
    """How many drafts each request verifies this step: ``offers`` (one per request that could: its drafts'
    conditional acceptance rates, the j-th the chance the j-th draft is accepted if every one before it was, one per
    draft it has; a drafted row's draw in seconds; and optionally whether the draft model proposes them: True when
    left out), on top of a step of ``base_rows`` forward rows that yields ``base_tokens`` tokens (its decode rows and
    the prefills it completes), at most ``budget`` drafts in all. ``proposer``: the draft model's steps by their rows
    (server/draft.py; it proposes by decode steps, :meth:`DraftCosts.plain`), None without one (n-gram drafts cost
    nothing to propose).

    The j-th draft of a request adds the product of its first j rates in expected tokens (it counts only if every
    draft before it was accepted). Drafts are added best gain first, each growing the step's time by the forward of
    one more row (:meth:`DraftCosts.forward`, measured) and its draw; a draft model's j-th draft also adds a row to
    its j-th forward (the first makes that forward) and the draft's own draw. Of all those prefixes the one with the
    most expected tokens per second is taken, none if plain decoding does best or within :data:`MARGIN` of it. So a lone request drafts as long as
    its rates pay for the rows, and in a large batch, whose extra rows cost nearly their share of the step's compute,
    only drafts that are likely accepted are verified. ``decode_only``: the step without drafts has decode rows
    alone, so it costs :meth:`DraftCosts.plain` (a replayed program on a CPU) where any draft makes it a forward.
    ``base_extra``: seconds the step spends beyond its rows' forward either way (its rows' attention over their
    contexts, :meth:`DraftCosts.attention`); a drafted row's own is in its offer's draw. ``scale``: every draft's
    expected tokens times this (:class:`Calibration`)."""
    ks = [0] * len(offers)
    depth: list[int] = []  # a draft model's rows in its j-th forward
    heap = [(-o[0][0] * scale, i) for i, o in enumerate(offers) if len(o[0]) and o[0][0] > 0]
    heapq.heapify(heap)
    rows, extra, tokens = base_rows, base_extra, base_tokens
    best_rate, best = tokens / ((costs.plain(rows) if decode_only else costs.forward(rows)) + extra) * (1 + MARGIN), \
        list(ks)
    while heap and rows - base_rows < budget:
        gain, i = heapq.heappop(heap)
        rates, draw = offers[i][:2]
        ks[i] += 1
        rows, extra, tokens = rows + 1, extra + draw, tokens - gain
        if proposer is not None and (len(offers[i]) < 3 or offers[i][2]):
            j = ks[i] - 1
            if j == len(depth):
                depth.append(0)
            depth[j] += 1
            extra += draw + proposer.plain(depth[j]) - (proposer.plain(depth[j] - 1) if depth[j] > 1 else 0.0)
        if ks[i] < len(rates) and rates[ks[i]] > 0:
            heapq.heappush(heap, (gain * rates[ks[i]], i))
        rate = tokens / (costs.forward(rows) + extra)
        if rate > best_rate * (1 + 1e-9):
            best_rate, best = rate, list(ks)
    return best


class NgramIndex:
    """Where each n-gram (NGRAM_MIN..NGRAM_MAX tokens) of a token sequence last ended, kept as tokens are
    appended; proposes the tokens that followed the last earlier occurrence of the sequence's final n-gram."""

    def __init__(self, tokens: list[int] = ()):
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> index just past its latest occurrence but the final
        self._final: dict[int, tuple[int, ...]] = {}  # n -> the sequence's final n-gram, not yet in _last
        self.match = 0  # the last proposal's match: see propose
        self.extend(tokens)

    def extend(self, tokens) -> None:
        for t in tokens:
            end = len(self.tokens)  # the final n-grams end here: they become earlier occurrences now
            for n, gram in self._final.items():
                self._last[gram] = end
            self.tokens.append(t)
            end += 1
            self._final = {n: tuple(self.tokens[end - n:]) for n in range(NGRAM_MIN, NGRAM_MAX + 1) if end >= n}

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the last earlier occurrence of the longest final n-gram seen before; its
        match (``self.match``, 0 with no proposal): how many tokens before the end agree with those before that
        occurrence, the n-gram's n at least, at most :data:`MATCH_CAP`."""
        self.match = 0
        if k <= 0:
            return []
        toks, end = self.tokens, len(self.tokens)
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            gram = self._final.get(n)
            at = self._last.get(gram) if gram is not None else None
            if at is not None:
                m = n
                while m < MATCH_CAP and at - 1 - m >= 0 and toks[at - 1 - m] == toks[end - 1 - m]:
                    m += 1
                self.match = m
                return toks[at: at + k]
        return []


def _interpolate(rows: tuple[int, ...], secs: tuple[float, ...], n: int) -> float:
    if n <= rows[0] or len(rows) == 1:
        return secs[0]
    hi = next((j for j, r in enumerate(rows) if r >= n), len(rows) - 1)
    t = secs[hi - 1] + (secs[hi] - secs[hi - 1]) * (n - rows[hi - 1]) / (rows[hi] - rows[hi - 1])
    return max(t, *secs[: hi + (rows[hi] < n)])


@dataclass(frozen=True)
class DraftCosts:
    """What a step costs on this device (server/step_costs.py measures it when the engine starts, kept per device):
    a forward's seconds by its rows (``rows`` ascending from 1, ``seconds`` each), and one row's draw in seconds
    where the request samples: with the temperature alone (``draw``) or through min-p, top-k or top-p
    (``filtered``). A verification draws every one of its rows, a plain step one."""

    rows: tuple[int, ...] = (1,)
    seconds: tuple[float, ...] = (1.0,)
    draw: float = 0.0
    filtered: float = 0.0
    decode: tuple[float, ...] | None = None  # a decode-only step of the first len(decode) of ``rows`` (None: as
    # ``seconds``)
    attend: float = 0.0  # seconds a row's attention costs per token of its context, beyond what ``seconds`` and
    # ``decode`` measured (rows at the first positions): a step's rows over 500-token contexts cost 1.6x those

    def attention(self, tokens: float) -> float:
        """Seconds the attention of rows over ``tokens`` tokens of context in all costs, beyond the forward's."""
        return self.attend * tokens

    def forward(self, n: int) -> float:
        """Seconds of a forward over n rows that verify drafts or prefill: linear between the rows measured, and
        beyond the last along the last two's slope; never less than a forward over fewer rows."""
        return _interpolate(self.rows, self.seconds, n)

    def plain(self, n: int) -> float:
        """Seconds of a step of n decode rows and nothing else (not a verification's forward: on a CPU a replayed
        program of the decode kernels, server/cpu_graphs.py). Beyond the rows measured so: a forward's time less
        what the last of them saved against one (a step's fixed costs, not its rows')."""
        if not self.decode:
            return self.forward(n)
        k = len(self.decode)
        if n <= self.rows[k - 1]:
            return _interpolate(self.rows[:k], self.decode, n)
        return max(self.decode[-1], self.forward(n) - (self.seconds[k - 1] - self.decode[-1]))

    def draw_of(self, params) -> float:
        """One drafted row's draw, in seconds, for a request of these sampling parameters (0 when greedy)."""
        if params.temperature == 0.0:
            return 0.0
        return self.filtered if params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0 else self.draw


@dataclass
class Speculation:
    """One sequence's speculation: its n-gram index, its acceptance estimates (beta for n-gram drafts, alpha for a
    draft model's), and what it has proposed and had accepted (its response reports both). ``draw``: a drafted row's
    draw in seconds (:meth:`DraftCosts.draw_of`)."""

    draw: float = 0.0
    index: NgramIndex = field(default_factory=NgramIndex)
    beta: float = PRIOR_BETA
    evidence: dict[int, list[float]] = field(default_factory=dict)  # match -> [drafts examined, rejected] there,
    # exponentially weighted (see BETA_DECAY)
    model_alpha: float = PRIOR  # the draft model's drafts' rate (server/draft.py)
    idle: int = PROBE_AFTER  # steps since its last verification (a request probes at its first drafts)
    probe_after: int = PROBE_AFTER  # idle steps after which it probes
    proposed: int = 0
    accepted: int = 0
    steps: int = 0  # verifications
    by_model: bool = False  # its verification in flight checks the draft model's drafts (else n-grams')
    expected: float | None = None  # the accepted drafts its estimates expect of its verification in flight (None:
    # the draft model's, not calibrated)

    def offer(self, prompt: list[int], generated: list[int], limit: int) -> list[int]:
        """The drafts it could verify next, at most ``limit`` (what its max_new_tokens and the step leave), from its
        prompt and generated tokens (indexed here, on the engine thread, as they come); :func:`allocate` decides
        how many it does."""
        seen = len(self.index.tokens)
        if seen < len(prompt):
            self.index.extend(prompt[seen:])
        self.index.extend(generated[max(0, seen - len(prompt)):])
        return self.index.propose(limit)

    @property
    def match(self) -> int:
        """The match of the n-gram drafts it offered last (:meth:`NgramIndex.propose`)."""
        return self.index.match

    @property
    def probing(self) -> bool:
        """Whether its next drafts are a probe (:data:`PROBE_AFTER`)."""
        return self.idle >= self.probe_after

    def rate_at(self, match: int) -> float:
        """The chance that an n-gram draft extending a match of ``match`` tokens is accepted: l / (l + beta), l the
        match counted to :data:`MATCH_CAP` as the evidence counts it, at most :data:`MAX_RATE`."""
        match = min(match, MATCH_CAP)
        return min(match / (match + self.beta), MAX_RATE)

    def rates(self, n: int, model: bool = False) -> list[float]:
        """Its estimates of the conditional acceptance rates of the n drafts it offered (the draft model's with
        ``model``)."""
        return geometric(self.model_alpha, n) if model else [self.rate_at(self.match + j) for j in range(n)]

    def weighed(self, rates: list[float]) -> list[float]:
        """The rates its drafts are weighed at: each no less than :data:`PROBE_RATE` when it probes."""
        return [max(r, PROBE_RATE) for r in rates] if self.probing else rates

    def skip(self) -> None:
        """A step in which it verified nothing: every :data:`PROBE_AFTER` of them in a row its evidence is halved
        (its estimates move towards the priors), so a request whose text turns repetitive drafts again."""
        self.idle += 1
        if self.idle % PROBE_AFTER == 0:
            self._weigh(0.5)
            self.model_alpha = (self.model_alpha + PRIOR) / 2

    def _weigh(self, decay: float, match: int = 0, examined: int = 0, rejected: bool = False) -> None:
        """Its evidence times ``decay``, then ``examined`` drafts from ``match`` on added (the last ``rejected``), and
        beta estimated again: the maximum of the likelihood (drafts accepted l / (l + beta), rejected beta / (l +
        beta)) with the prior's trials, by bisection on log beta."""
        ev = {}
        for m, (t, f) in self.evidence.items():
            if t * decay > 1e-3:
                ev[m] = [t * decay, f * decay]
        for j in range(examined):
            e = ev.setdefault(min(match + j, MATCH_CAP), [0.0, 0.0])
            e[0] += 1
            e[1] += rejected and j == examined - 1
        self.evidence = ev
        prior_f = PRIOR_TRIALS * PRIOR_BETA / (PRIOR_MATCH + PRIOR_BETA)  # the prior's expected rejections
        failures = prior_f + sum(f for _, f in ev.values())

        def score(beta: float) -> float:  # d log L / d beta
            exposure = PRIOR_TRIALS / (PRIOR_MATCH + beta) + sum(t / (m + beta) for m, (t, _) in ev.items())
            return failures / beta - exposure

        lo, hi = math.log(1e-3), math.log(1e4)  # the score falls through zero once in between (or beta is at a bound)
        for _ in range(14):  # to 0.1% of beta
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if score(math.exp(mid)) > 0 else (lo, mid)
        self.beta = math.exp((lo + hi) / 2)

    def record(self, proposed: int, accepted_: int, model: bool = False) -> None:
        """A verification's outcome: ``accepted_`` of ``proposed`` drafts accepted (``model``: the draft model's,
        else the n-gram drafts of the match offered last)."""
        if self.probing:  # a probe: the next one as soon where it found drafts worth keeping, else twice as late
            self.probe_after = PROBE_AFTER if 2 * accepted_ >= proposed else min(2 * self.probe_after,
                                                                                  MAX_PROBE_AFTER)
        self.idle = 0
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted_
        trials = accepted_ + (accepted_ < proposed)  # drafts examined: up to and including the first rejected
        if model:
            self.model_alpha = DECAY * self.model_alpha + (1 - DECAY) * (accepted_ / trials)
            return
        self._weigh(BETA_DECAY, self.match, trials, accepted_ < proposed)
