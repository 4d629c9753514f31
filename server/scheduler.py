"""Continuous batching: which requests run in the next step, and how much of each.

Requests wait in FIFO order until the KV pool can hold their whole reservation (prompt + max_new_tokens,
rounded up to blocks) and the batch has a free slot; strict FIFO, so a large request at the head is not
starved by small ones behind it. Every step:

1. admit from the head of the queue while the head fits (blocks reserved all-or-nothing; the prompt's blocks the
   prefix cache holds are mapped instead, and its prefill starts after them, unless the request scores its
   prompt: prompt logprobs need every position computed);
2. every running request that has finished its prompt decodes one token (the token sampled for it last may still
   be on the device: with the engine's overlapped steps it is fed from there, ``Sequence.pending``; a request
   with a response_format waits a step instead, its grammar's mask needing that token on the host);
3. requests still in their prompt get prefill chunks, oldest first, until ``max_prefill_tokens`` prompt
   tokens are planned for this step: a long prompt is spread over several steps, so the decode latency of
   the running requests stays bounded by one chunk, not by the longest prompt that arrives.

Requests join at any step boundary and leave the moment they finish or are cancelled, with their blocks
returned to the pool at once. The scheduler is used only from the engine thread.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from server.kv_pool import BlockPool, shared_blocks
from server.sampling_params import SamplingParams


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

    @property
    def request_id(self) -> str:
        return self.group.id if self.group is not None else self.id

    @property
    def waiting_for_leader(self) -> bool:
        return self.group is not None and self.index > 0 and self.group.leader.prefilled < self.wait_tokens

    @property
    def reserve_tokens(self) -> int:
        return len(self.prompt) + self.params.max_new_tokens

    @property
    def in_prompt(self) -> bool:
        return self.prefilled < len(self.prompt)

    @property
    def kv_tokens(self) -> int:
        """Positions whose K/V has been written: the prompt so far, then one per fed-back token."""
        return self.prefilled + max(0, len(self.generated) - 1)


@dataclass
class Plan:
    decode: list[Sequence]
    prefill: list[tuple[Sequence, int, int]]  # (sequence, first prompt index, chunk length)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, pool: BlockPool, max_batch: int, max_prefill_tokens: int):
        self.pool = pool
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, request_id: str) -> tuple[list[Sequence], bool] | None:
        """Take a request (all its samples) out wherever it is, releasing its blocks; (its sequences not done yet,
        was it waiting?) or None."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                members = seq.group.members if seq.group is not None else [seq]
                for m in members:
                    m.done = True
                return members, True
        found = [s for s in self.running if s.request_id == request_id]
        for seq in found:
            self.finish(seq)
        return (found, False) if found else None

    def finish(self, seq: Sequence) -> None:
        seq.done = True
        self.running.remove(seq)
        seq.shared_blocks = self.pool.shared_blocks(seq.id)
        self.pool.release(seq.id)

    def admit(self) -> list[Sequence]:
        """Admit from the head of the queue while it fits; the requests admitted (a request of several samples
        once, by its first). A request's prompt blocks that the prefix cache holds are mapped, not reserved anew,
        and its prefill starts after them; a request's samples are admitted together, sharing its prompt's
        blocks."""
        admitted = []
        bs = self.pool.layout.block_size
        while self.waiting:
            seq = self.waiting[0]
            members = seq.group.members if seq.group is not None else [seq]
            if len(self.running) + len(members) > self.max_batch:
                break
            use_cache = seq.params.prompt_logprobs is None  # scoring the prompt computes all of it
            if seq.group is None:
                tables = [self.pool.try_reserve(seq.id, seq.reserve_tokens, seq.prompt, use_cache)]
            else:
                tables = self.pool.try_reserve_group([m.id for m in members], seq.reserve_tokens, seq.prompt,
                                                     use_cache)
            if tables is None or tables[0] is None:
                break  # strict FIFO: wait for blocks rather than let later requests overtake
            self.waiting.popleft()
            shared = shared_blocks(len(seq.prompt), bs) * bs
            for m, table in zip(members, tables):
                m.blocks = table
                m.cached = m.prefilled = self.pool.hit_blocks(m.id) * bs if m is seq else shared
                m.wait_tokens = 0 if m is seq else shared
                self.running.append(m)
            admitted.append(seq)
        return admitted

    def plan(self) -> Plan:
        # A request whose last token is already sampled (by a launched step not read yet) has nothing to decode.
        # A request with a response_format waits for its last sample to be read: its grammar's mask needs it.
        decode = [s for s in self.running
                  if not s.in_prompt and len(s.generated) + s.pending < s.params.max_new_tokens
                  and not (s.pending and s.params.response_format is not None)]
        prefill = []
        budget = self.max_prefill_tokens
        for seq in self.running:
            if budget == 0:
                break
            if seq.in_prompt and not seq.waiting_for_leader:
                n = min(len(seq.prompt) - seq.prefilled, budget)
                prefill.append((seq, seq.prefilled, n))
                budget -= n
        return Plan(decode, prefill)
