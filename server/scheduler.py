"""Continuous batching: which requests run in the next step, and how much of each; admission and preemption.

Requests wait in FIFO order; strict FIFO, so a large request at the head is not starved by small ones behind it.
How a request takes KV blocks is the admission (``--kv-admission``):

- ``on-demand`` (the default): admitted when its prompt's blocks (those the prefix cache does not hold) fit with a
  watermark of blocks left free; it takes one more block whenever its next token starts one. When a block is
  needed and none is free (cached blocks no request holds are evicted first), the most recently admitted running
  request is *preempted*: its blocks go back to the pool (its published full blocks stay in the prefix cache), it
  returns to the head of the queue, and it is taken back by recomputing its prompt and the tokens it produced as
  one prefill whose last row samples its next token. Its output is what it would have been unpreempted: the
  random stream is keyed by (seed, token index), penalty counts are rebuilt from the tokens, its grammar and
  detokenizer state are kept, and nothing already sent is sent again. No new request is admitted while a
  preempted one waits (it is at the head). An accepted request is never failed for memory: the engine refuses
  at submission one that could not run alone in the whole pool.
- ``reserve``: admitted when every block it can ever need (prompt + max_new_tokens) is free, all or nothing; never
  preempted.

Every step:

1. admit from the head of the queue while the head fits and the batch has a slot (the prompt's blocks the prefix
   cache holds are mapped instead, and its prefill starts after them, unless the request scores its prompt:
   prompt logprobs need every position computed);
2. every running request that has finished its prompt decodes one token (the token sampled for it last may still
   be on the device: with the engine's overlapped steps it is fed from there, ``Sequence.pending``; a request
   with a response_format waits a step instead, its grammar's mask needing that token on the host); on demand,
   oldest first, each takes the block its token is written to, preempting as above (only with no step in flight:
   :meth:`Scheduler.plan` returns None to have the engine read that step first);
3. requests still in their prompt get prefill chunks, oldest first, until ``max_prefill_tokens`` prompt
   tokens are planned for this step: a long prompt is spread over several steps, so the decode latency of
   the running requests stays bounded by one chunk, not by the longest prompt that arrives;
4. a decoding request that speculates (server/speculate.py) and has no sample in flight may turn its row into a
   verification of drafted tokens: the drafts that pay for their rows on top of this step's (``allocate``), with
   what the prefill budget leaves (at most MAX_DRAFT_ROWS drafts a step) and only blocks that are free: drafts
   never preempt. Its rejected drafts' blocks return once it is read
   (:meth:`Scheduler.rollback`). With a draft model (server/draft.py) the plan says how many drafts each request
   verifies (``Plan.propose``) and the step has the draft model propose them.

Requests join at any step boundary and leave the moment they finish or are cancelled, with their blocks
returned to the pool at once. The scheduler is used only from the engine thread.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from server.kv_pool import BlockPool, group_blocks, shared_blocks
from server.sampling_params import SamplingParams
from server.speculate import PROBE_DRAFTS, Calibration, DraftCosts, Speculation, accepted, allocate, expected

ON_DEMAND, RESERVE = "on-demand", "reserve"
MAX_DRAFT_ROWS = 64  # drafted tokens verified in one step, all requests together (each is a row of logits)


def admission_tokens(admission: str, prompt_tokens: int, max_new_tokens: int) -> int:
    """Positions a request's blocks cover when it is admitted: its prompt on demand, its worst case reserved."""
    return prompt_tokens if admission == ON_DEMAND else prompt_tokens + max_new_tokens


def admission_blocks(admission: str, prompt_tokens: int, max_new_tokens: int, n: int, block_size: int,
                     tail_blocks: int) -> int:
    """Blocks a request of ``n`` samples takes when admitted with nothing cached (BlockPool.try_reserve_group)."""
    return group_blocks(prompt_tokens, admission_tokens(admission, prompt_tokens, max_new_tokens), n, block_size,
                        tail_blocks)


def admission_headroom(admission: str, watermark_blocks: int, running: int) -> int:
    """Blocks an admission must leave free: the watermark on demand while anything runs (with nothing running a
    request that fits the pool alone is always admitted). The capacity plan admits by this rule too."""
    return watermark_blocks if admission == ON_DEMAND and running else 0
ADMISSIONS = (ON_DEMAND, RESERVE)


@dataclass(eq=False)
class Group:
    """The samples of one request with ``n`` > 1: admitted together, the first prefilling the prompt's shared
    blocks and the others their own last block once it has (server/kv_pool.py's ``try_reserve_group``)."""

    id: str  # the request's id (each sample's Sequence.id is this, then "/1", "/2", ...)
    members: list["Sequence"] = field(default_factory=list)
    left: int = 0  # samples not finished yet
    prompt_logprobs: tuple = ()  # the first sample's, once its prefill scored the whole prompt: each sample's too

    @property
    def leader(self) -> "Sequence":
        return self.members[0]


@dataclass(eq=False)
class Sequence:
    """One request's state inside the engine (one sample of it, when it asked for several)."""

    id: str
    prompt: list[int]
    params: SamplingParams  # with the seed set
    sink: object  # callable(Event)
    arrival: float = field(default_factory=time.monotonic)
    blocks: list[int] | None = None
    prefilled: int = 0  # prompt tokens whose K/V is in the cache
    cached: int = 0  # prompt tokens mapped from the prefix cache at admission (never prefilled by this request)
    shared_blocks: int = 0  # blocks of its table another holder had too (server/kv_pool.py), counted at release
    generated: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    activation_peak: int = 0  # the largest estimate among this request's prefill chunks
    state: dict = field(default_factory=dict)  # the engine's per-request helpers (detokenizer, stop matcher)
    pending: int = 0  # tokens sampled by launched steps not read yet: 0 or 1 when planning (2 while launching the next)
    done: bool = False  # finished or cancelled: a launched step's sample for it is dropped
    group: Group | None = None  # its request's samples, when it asked for several
    index: int = 0  # which sample of its request
    wait_tokens: int = 0  # a sample after the first: prefills once the first has prefilled this many tokens
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprob of prompt tokens 1.., as its prefill scores them
    prompt_logprobs_sent: bool = False  # given with its first event
    admitted: int = -1  # the scheduler's admission count when it was last admitted: the newest is preempted first
    peak_blocks: int = 0  # the most KV blocks it held at once (its table and its tail)
    recompute: int = 0  # generated tokens its prefill computes again (taken back after a preemption)
    preemptions: int = 0  # times it was preempted
    recomputed_tokens: int = 0  # positions whose K/V it computed again after preemptions
    kv_written: int = 0  # at its last preemption: positions whose K/V it had written
    spec: Speculation | None = None  # its speculation (server/speculate.py); None: it does not speculate
    drafts: list[int] = field(default_factory=list)  # the drafts of its verification in flight
    spec_peak_blocks: int = 0  # the most blocks its drafts held beyond its tokens' (taken for one step each)
    draft_peak_blocks: int = 0  # the most blocks of a draft model's pool it held (server/draft.py)

    @property
    def request_id(self) -> str:
        return self.group.id if self.group is not None else self.id

    @property
    def waiting_for_leader(self) -> bool:
        """A sample after its request's first that must not prefill yet: the first has not written the prompt's
        blocks it maps, or (taken back after a preemption, its first event still to come) has not scored the
        prompt whose logprobs that event carries."""
        if self.group is None or self.index == 0:
            return False
        if self.group.leader.prefilled < self.wait_tokens:
            return True
        return bool(self.preemptions and self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent
                    and not self.group.prompt_logprobs)

    @property
    def reserve_tokens(self) -> int:
        """Positions it can ever write: what ``--kv-admission reserve`` takes at admission."""
        return len(self.prompt) + self.params.max_new_tokens

    @property
    def fill_len(self) -> int:
        """Positions its prefill computes: the prompt, then the generated tokens a preemption made it recompute."""
        return len(self.prompt) + self.recompute

    def fill_tokens(self, start: int, n: int) -> list[int]:
        """Tokens ``start .. start + n`` of what its prefill computes."""
        if start + n <= len(self.prompt):
            return self.prompt[start:start + n]
        return (self.prompt + self.generated[:self.recompute])[start:start + n]

    @property
    def in_prompt(self) -> bool:
        return self.prefilled < self.fill_len

    @property
    def scores_prompt(self) -> bool:
        """Its prefill scores the prompt (prompt logprobs): the first sample, on its first pass over the prompt."""
        return self.params.prompt_logprobs is not None and self.index == 0 and self.recompute == 0

    @property
    def kv_tokens(self) -> int:
        """Positions whose K/V has been written: the prefill so far, then one per fed-back token."""
        return self.prefilled + max(0, len(self.generated) - 1 - self.recompute)

    @property
    def next_position(self) -> int:
        """The position its next decode row writes (a token sampled by a launched step counted)."""
        return len(self.prompt) + len(self.generated) + self.pending - 1


@dataclass
class Plan:
    decode: list[Sequence]
    prefill: list[tuple[Sequence, int, int]]  # (sequence, first prompt index, chunk length)
    verify: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # (sequence, its drafts)
    propose: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, most drafts): a draft model's

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill and not self.verify and not self.propose

    @property
    def sequences(self) -> list[Sequence]:
        return (self.decode + [s for s, _, _ in self.prefill] + [s for s, _ in self.verify]
                + [s for s, _ in self.propose])


class Scheduler:
    def __init__(self, pool: BlockPool, max_batch: int, max_prefill_tokens: int, admission: str = ON_DEMAND,
                 watermark_blocks: int = 0):
        if admission not in ADMISSIONS:
            raise ValueError(f"--kv-admission must be one of {', '.join(ADMISSIONS)}, got {admission!r}")
        self.pool = pool
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.admission = admission
        self.watermark_blocks = watermark_blocks  # on demand: blocks left free by an admission while others run
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0  # requests preempted since the engine started (each sample counted)
        self.recomputed_tokens = 0  # positions computed again after preemptions, since the engine started
        self.draft_costs = DraftCosts()  # what a step costs by its rows, and
        self.max_drafts = 0  # the most drafts a request verifies in one step: speculate() sets both
        self.drafter = None  # a draft model (server/draft.py's DraftModel) proposes the drafts; None: n-grams
        self.proposer_costs: DraftCosts | None = None  # its forwards by their rows
        self.speculated_tokens = 0  # drafts verified, since the engine started
        self.accepted_tokens = 0  # of those, the drafts kept
        self.model_speculated_tokens = 0  # of the drafts verified, the draft model's (server/draft.py)
        self.model_accepted_tokens = 0  # and of those, the drafts kept
        self.calibration = Calibration()  # the drafts accepted against those expected (server/speculate.py)
        self._order = itertools.count()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @staticmethod
    def unit(seq: Sequence) -> list[Sequence]:
        """What a waiting entry admits: a new request's samples together, a preempted sample alone."""
        return seq.group.members if seq.group is not None and not seq.preemptions else [seq]

    def remove(self, request_id: str) -> tuple[list[Sequence], bool] | None:
        """Take a request (all its samples) out wherever they are, releasing their blocks; (its sequences not done
        yet, was it a new request still waiting?) or None."""
        found, new = [], False
        for seq in [s for s in self.waiting if s.request_id == request_id]:
            self.waiting.remove(seq)
            new = new or not seq.preemptions
            for m in self.unit(seq):
                m.done = True
                found.append(m)
        for seq in [s for s in self.running if s.request_id == request_id]:
            self.finish(seq)
            found.append(seq)
        return (found, new) if found else None

    def finish(self, seq: Sequence) -> None:
        seq.done = True
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        elif seq in self.waiting:  # a preempted sample (its request failed while it waited)
            self.waiting.remove(seq)

    def _release(self, seq: Sequence) -> None:
        seq.shared_blocks = max(seq.shared_blocks, self.pool.shared_blocks(seq.id))
        self.pool.release(seq.id)
        if self.drafter is not None:
            self.drafter.release(seq.id)

    def _headroom(self) -> int:
        return admission_headroom(self.admission, self.watermark_blocks, len(self.running))

    def admit(self) -> list[Sequence]:
        """Admit from the head of the queue while it fits; the new requests admitted (a request of several samples
        once, by its first; a preempted sample taken back is not listed). A request's prompt blocks that the prefix
        cache holds are mapped, not reserved anew, and its prefill starts after them; a request's samples are
        admitted together, sharing its prompt's blocks."""
        admitted = []
        bs = self.pool.layout.block_size
        while self.waiting:
            seq = self.waiting[0]
            if seq.preemptions:
                if not self._resume(seq):
                    break
                self.waiting.popleft()
                continue
            members = self.unit(seq)
            if len(self.running) + len(members) > self.max_batch:
                break
            tokens = admission_tokens(self.admission, len(seq.prompt), seq.params.max_new_tokens)
            use_cache = not seq.scores_prompt  # scoring the prompt computes all of it
            if seq.group is None:
                tables = [self.pool.try_reserve(seq.id, tokens, seq.prompt, use_cache, self._headroom())]
            else:
                tables = self.pool.try_reserve_group([m.id for m in members], tokens, seq.prompt, use_cache,
                                                     self._headroom())
            if tables is None or tables[0] is None:
                break  # strict FIFO: wait for blocks rather than let later requests overtake
            self.waiting.popleft()
            shared = shared_blocks(len(seq.prompt), bs) * bs
            order = next(self._order)
            for m, table in zip(members, tables):
                m.blocks = table
                m.peak_blocks = self.pool.held_blocks(m.id)
                m.admitted = order
                m.cached = m.prefilled = self.pool.hit_blocks(m.id) * bs if m is seq else shared
                m.wait_tokens = 0 if m is seq else shared
                self.running.append(m)
            admitted.append(seq)
        return admitted

    def _resume(self, seq: Sequence) -> bool:
        """Take a preempted sample back if its prompt and generated tokens fit: it prefills them again (those the
        prefix cache holds mapped), its prefill's last row sampling its next token."""
        if len(self.running) + 1 > self.max_batch:
            return False
        tokens = seq.prompt + seq.generated
        table = self.pool.try_reserve(seq.id, len(tokens), tokens, not seq.scores_prompt, self._headroom(),
                                      tally=False)
        if table is None:
            return False
        seq.blocks = table
        seq.peak_blocks = max(seq.peak_blocks, self.pool.held_blocks(seq.id))
        seq.admitted = next(self._order)
        seq.recompute = len(seq.generated)
        seq.prefilled = self.pool.hit_blocks(seq.id) * self.pool.layout.block_size
        seq.wait_tokens = 0
        again = max(0, seq.kv_written - seq.prefilled)
        seq.recomputed_tokens += again
        self.recomputed_tokens += again
        self.running.append(seq)
        return True

    def _preempt(self) -> None:
        """Preempt the most recently admitted running request (each of its running samples): blocks released,
        back to the head of the queue, oldest sample first."""
        newest = max(self.running, key=lambda s: s.admitted)
        victims = [s for s in self.running if s.request_id == newest.request_id]
        for s in victims:
            if s.pending:
                raise RuntimeError(f"preempting {s.id} with a sample in flight")
            self.running.remove(s)
            s.kv_written = s.kv_tokens
            self._release(s)
            s.blocks = None
            s.prefilled = 0
            s.recompute = 0
            s.preemptions += 1
            if not s.generated:  # stopped inside its prompt: a scored prompt is scored again from its start
                s.prompt_logprobs.clear()
        for s in reversed(victims):
            self.waiting.appendleft(s)
        self.preemptions += len(victims)

    def plan(self, can_preempt: bool = True) -> Plan | None:
        """The next step's decode rows and prefill chunks. On demand each decode row first takes the block its
        token is written to, preempting when none is free; None when that needs a preemption and
        ``can_preempt`` is False (a step is in flight: the engine reads it, then plans again)."""
        # A request whose last token is already sampled (by a launched step not read yet) has nothing to decode.
        # A request with a response_format waits for its last sample to be read: its grammar's mask needs it.
        # A request whose verification is in flight waits for it: how many of its drafts it keeps is read back.
        decode = [s for s in self.running
                  if not s.in_prompt and len(s.generated) + s.pending < s.params.max_new_tokens
                  and not (s.pending and (s.params.response_format is not None or s.drafts))]
        if self.admission == ON_DEMAND:
            for seq in sorted(decode, key=lambda s: s.admitted):
                while seq.blocks is not None and not self.pool.grow(seq.id, seq.next_position + 1):
                    if not can_preempt:
                        return None
                    self._preempt()
                if seq.blocks is not None:
                    seq.peak_blocks = max(seq.peak_blocks, self.pool.held_blocks(seq.id))
            decode = [s for s in decode if s.blocks is not None]
        prefill = []
        budget = self.max_prefill_tokens
        for seq in self.running:
            if budget == 0:
                break
            if seq.in_prompt and not seq.waiting_for_leader:
                n = min(seq.fill_len - seq.prefilled, budget)
                prefill.append((seq, seq.prefilled, n))
                budget -= n
        completing = sum(start + n == seq.fill_len for seq, start, n in prefill)  # prefills that sample a token
        context = sum(s.next_position + 1 for s in decode) + sum(n * (start + (n + 1) // 2) for _, start, n in prefill)
        verify = self._drafts(decode, len(decode) + self.max_prefill_tokens - budget, len(decode) + completing,
                              min(budget, MAX_DRAFT_ROWS), context)
        if not verify:
            return Plan(decode, prefill)
        drafting = {id(s) for s, _ in verify}
        decode = [s for s in decode if id(s) not in drafting]
        return Plan(decode, prefill, [(s, d) for s, d in verify if d[0] != -1],  # n-grams' and the draft model's
                    [(s, len(d)) for s, d in verify if d[0] == -1])

    def speculate(self, costs: DraftCosts, max_drafts: int, drafter=None, proposer: DraftCosts | None = None) -> None:
        """Let requests with a :class:`Speculation` draft, up to ``max_drafts`` each per step, as ``costs`` (measured
        by the engine; DraftCosts(): a row costs nothing, so every draft is verified) say it pays. ``drafter``: a
        draft model proposes them (its forwards cost ``proposer``), else n-grams do."""
        self.draft_costs, self.max_drafts = costs, max_drafts
        self.drafter, self.proposer_costs = drafter, (proposer or DraftCosts()) if drafter is not None else None

    def _drafts(self, decode: list[Sequence], base_rows: int, base_tokens: int, budget: int,
                base_context: int) -> list[tuple[Sequence, list[int]]]:
        """The decode rows that verify drafts this step, with their drafts: every request that can offers its
        drafts (stopping short of its max_new_tokens): its n-grams', or where its text has none and there is a draft
        model, that model's (placeholders, -1, proposed once the plan is made: ``Plan.propose``), each at its own
        source's acceptance rate; :func:`server.speculate.allocate` keeps those that pay
        on top of the step's ``base_rows`` rows (yielding ``base_tokens`` tokens; their attention over
        ``base_context`` tokens of context in all), within what the prefill budget
        leaves; after every row has its own block and the prefill its chunks, they take only free (or evictable
        cached) blocks, never preempting."""
        offers = []
        model = self.drafter is not None and self.drafter.broken is None  # a failed draft model proposes nothing
        for seq in decode:
            if seq.spec is None or seq.pending or seq.blocks is None:
                continue
            limit = min(budget, PROBE_DRAFTS if seq.spec.probing and seq.spec.steps else self.max_drafts,
                        seq.params.max_new_tokens - len(seq.generated) - 1)
            drafts = seq.spec.offer(seq.prompt, seq.generated, limit) if limit > 0 else []
            by_model = not drafts and model  # where the text offers no n-gram, the draft model proposes
            offers.append((seq, [-1] * max(0, limit) if by_model else drafts, by_model))  # (placeholders)
        # A drafted row attends over its request's context as its decode row does. Alone, that context stays in the
        # cache between the two (4 bf16 rows of a request over 500 tokens: 26.8 ms, the 4-row forward at the first
        # positions 25.4); beside other requests' it is read again (16 at once: ~1.8 ms a drafted row in float32).
        costs, crowded = self.draft_costs, len(decode) > 1
        rates = [s.spec.rates(len(d), m) for s, d, m in offers]
        lengths = allocate([(s.spec.weighed(r), s.spec.draw + (costs.attention(s.next_position) if crowded else 0.0), m)
                            for r, (s, _, m) in zip(rates, offers)], base_rows, base_tokens, budget, costs,
                           self.proposer_costs, base_rows == len(decode), costs.attention(base_context),
                           self.calibration.scale) if offers else []
        verify = []
        for (seq, drafts, _), k, r in zip(offers, lengths, rates):
            drafts = drafts[:k]
            held = self.pool.held_blocks(seq.id)
            while drafts and not self.pool.grow(seq.id, seq.next_position + 1 + len(drafts)):
                drafts = drafts[:-1]
            if not drafts:
                seq.spec.skip()
                continue
            seq.spec.expected = None  # (the draft model's: not calibrated, counted once it has proposed)
            if drafts[0] != -1:
                seq.spec.expected = expected(r[:len(drafts)])
                self._peaks(seq, self.pool.held_blocks(seq.id) - held)
            verify.append((seq, drafts))
        return verify

    def _peaks(self, seq: Sequence, drafts_blocks: int) -> None:
        seq.spec_peak_blocks = max(seq.spec_peak_blocks, drafts_blocks)
        seq.peak_blocks = max(seq.peak_blocks, self.pool.held_blocks(seq.id))

    def drafted(self, plan: Plan, drafts: list[list[int]]) -> None:
        """A draft model's proposals for ``plan.propose`` (server/draft.py): each request verifies those it got (the
        blocks taken for more go back), or decodes a plain row when it got none."""
        blocks = self.pool.layout.blocks_for
        for (seq, _), d in zip(plan.propose, drafts):
            p = seq.next_position + 1
            if self.admission == ON_DEMAND:
                self.pool.shrink(seq.id, p + len(d))
            if d:
                self._peaks(seq, blocks(p + len(d)) - blocks(p) if self.admission == ON_DEMAND else 0)
                plan.verify.append((seq, d))
                seq.spec.by_model = True
            else:
                seq.spec.skip()
                plan.decode.append(seq)
        plan.propose = []

    def verified(self, seq: Sequence, drafts: list[int], draws: list[int]) -> int:
        """A verification read back (``draws``: the step's tokens from its first row on): its drafts are kept up
        to the first its draws reject (server/speculate.py), counted; returns how many of its rows' tokens it
        emits: the kept drafts and the draw after them."""
        keep = accepted(drafts, draws)
        if seq.spec.expected is not None:
            self.calibration.record(seq.spec.expected, keep)
            seq.spec.expected = None
        by_model, seq.spec.by_model = seq.spec.by_model, False
        seq.spec.record(len(drafts), keep, by_model)
        if by_model:
            self.model_speculated_tokens += len(drafts)
            self.model_accepted_tokens += keep
        self.speculated_tokens += len(drafts)
        self.accepted_tokens += keep
        return keep + 1

    def rollback(self, seq: Sequence) -> None:
        """After its verification is read: on demand, the blocks its rejected drafts took go back to the pool (it
        keeps those of the positions written, its next token's is taken when planned)."""
        if self.admission == ON_DEMAND and seq.blocks is not None:
            self.pool.shrink(seq.id, len(seq.prompt) + len(seq.generated) - 1)
        if self.drafter is not None:
            self.drafter.kept(seq)
