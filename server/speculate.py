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

**Draft length.** Each request keeps a running acceptance rate alpha (accepted drafts over drafts examined, i.e.
up to and including the first rejected one: the per-token rate's estimate, exponentially weighted) and proposes
the k in 0..max that maximises the tokens a step yields per unit of its time, ``(1 - alpha^(k+1)) / (1 - alpha)``
over ``cost[k]``: a verification of k drafts' time relative to a plain decode step's (its forward, and its rows'
draws where the request samples), measured on this device when the engine starts (:class:`DraftCosts`). k = 0 (plain decode) where speculation does
not pay; after :data:`PROBE_AFTER` steps without a proposal the rate is moved back towards the prior, so a request
whose text turns repetitive starts speculating again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("off", "ngram")
NGRAM_MAX = 4  # longest suffix matched
NGRAM_MIN = 2  # shortest: a single token repeats too often in ordinary text to predict the next ones
PRIOR = 0.5  # the acceptance rate a request starts with
DECAY = 0.8  # weight of the past in the running rate, per verified step
PROBE_AFTER = 16  # steps without a proposal after which the rate is moved half way back to the prior


def accepted(drafts: list[int], draws: list[int]) -> int:
    """How many leading drafts the draws accept: the first j with ``draws[j] != drafts[j]`` (``len(drafts)`` when
    all equal); ``draws`` has one more entry than ``drafts`` (the bonus position)."""
    for j, d in enumerate(drafts):
        if draws[j] != d:
            return j
    return len(drafts)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verification of k drafts yields when each is accepted with probability alpha (until the first
    rejection), counting the draw at the first rejection or the bonus token."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_length(alpha: float, costs: tuple[float, ...]) -> int:
    """The draft length in 0..len(costs) - 1 with the most tokens per unit of step time (ties: the shorter);
    ``costs[k]``: a step with k drafts' time relative to a plain one's (``costs[0]`` = 1)."""
    best, best_rate = 0, 1.0
    for k in range(1, len(costs)):
        rate = expected_tokens(alpha, k) / costs[k]
        if rate > best_rate + 1e-9:
            best, best_rate = k, rate
    return best


def relative_costs(times: dict[int, float], max_k: int) -> tuple[float, ...]:
    """``times``: a forward's seconds by its rows (1 among them); each draft length's time relative to one row's,
    interpolated linearly between the rows measured (k drafts: k + 1 rows), never below a shorter length's."""
    rows = sorted(times)
    costs, last = [], 1.0
    for k in range(max_k + 1):
        n = k + 1
        hi = next((r for r in rows if r >= n), rows[-1])
        lo = max((r for r in rows if r <= n), default=rows[0])
        t = times[lo] if hi == lo else times[lo] + (times[hi] - times[lo]) * (n - lo) / (hi - lo)
        last = max(last, t / times[1]) if k else 1.0
        costs.append(last)
    return tuple(costs)


class NgramIndex:
    """Where each n-gram (NGRAM_MIN..NGRAM_MAX tokens) of a token sequence last ended, kept as tokens are
    appended; proposes the tokens that followed the last earlier occurrence of the sequence's final n-gram."""

    def __init__(self, tokens: list[int] = ()):
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> index just past its latest occurrence but the final
        self._final: dict[int, tuple[int, ...]] = {}  # n -> the sequence's final n-gram, not yet in _last
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
        """Up to k tokens that followed the last earlier occurrence of the longest final n-gram seen before."""
        if k <= 0:
            return []
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            gram = self._final.get(n)
            at = self._last.get(gram) if gram is not None else None
            if at is not None:
                return self.tokens[at: at + k]
        return []


@dataclass(frozen=True)
class DraftCosts:
    """What drafting costs on this device (``server.step.Stepper.draft_costs``): the forward with k drafts relative to
    a plain step's (``forward[k]``), and one row's draw relative to a plain step's forward, where the request samples:
    with the temperature alone (``draw``) or through min-p, top-k or top-p (``filtered``, a sort of the vocabulary).
    A verification draws every one of its rows, a plain step one."""

    forward: tuple[float, ...]
    draw: float = 0.0
    filtered: float = 0.0

    def of(self, params) -> tuple[float, ...]:
        """:func:`best_length`'s costs for a request of these sampling parameters: (forward + k + 1 draws) over
        (a plain forward + one draw)."""
        d = 0.0
        if params.temperature != 0.0:
            d = self.filtered if params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0 else self.draw
        return tuple((c + d * (k + 1)) / (1.0 + d) for k, c in enumerate(self.forward))


@dataclass
class Speculation:
    """One sequence's speculation: its n-gram index, its running acceptance rate, and what it has proposed and had
    accepted (its response reports both). ``costs``: :func:`best_length`'s, one per draft length up to the most."""

    costs: tuple[float, ...]
    index: NgramIndex = field(default_factory=NgramIndex)
    alpha: float = PRIOR
    idle: int = 0  # steps since its last proposal
    proposed: int = 0
    accepted: int = 0
    steps: int = 0  # verifications

    def propose(self, prompt: list[int], generated: list[int], limit: int) -> list[int]:
        """The drafts for its next step, at most ``limit`` (what its max_new_tokens and the pool leave), from its
        prompt and generated tokens (indexed here, on the engine thread, as they come)."""
        seen = len(self.index.tokens)
        if seen < len(prompt):
            self.index.extend(prompt[seen:])
        self.index.extend(generated[max(0, seen - len(prompt)):])
        k = min(limit, best_length(self.alpha, self.costs))
        drafts = self.index.propose(k)
        if not drafts:
            self.idle += 1
            if self.idle >= PROBE_AFTER:
                self.alpha = (self.alpha + PRIOR) / 2
                self.idle = 0
        return drafts

    def record(self, proposed: int, accepted_: int) -> None:
        """A verification's outcome: ``accepted_`` of ``proposed`` drafts accepted."""
        self.idle = 0
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted_
        trials = accepted_ + (accepted_ < proposed)  # drafts examined: up to and including the first rejected
        self.alpha = DECAY * self.alpha + (1 - DECAY) * (accepted_ / trials)
