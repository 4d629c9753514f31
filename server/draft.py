"""A draft model for speculative decoding (``--speculate draft --draft MODEL``): a smaller or more quantized model of
the same tokenizer proposes the drafts of requests whose text offers no n-gram (n-grams, free to propose, go first;
server/scheduler.py), which the target verifies (server/speculate.py, server/step.py).

**What it proposes.** At every drafted position the draft model's logits go through the one sampler
(server/sampling.py) in the documented order with the request's controls and state as of that position (penalty
counts over the history with the drafts before it, the grammar advanced along them, ``min_tokens`` by the token's
index), and its token is drawn with the uniforms the target's draw at that position takes (keyed by the seed and
the token's index). So the draft samples its own processed distribution q, and the target keeps the drafts while
its draws equal them: every emitted token is the target's own draw, exactly the non-speculative one for the seed
(the acceptance rule of server/speculate.py, unchanged), and a draft whose q is close to the target's p is kept
nearly as often as the standard rejection rule would keep it (the Gumbel-max coupling: the draws agree with
probability at least (1 - TV) / (1 + TV), where the rule's sum of min(p, q) is 1 - TV). Greedy requests draft the
draft model's argmax and keep it when it is the target's.

**Its KV cache** is its own pool (no prefix cache), split from the engine's KV budget so that it holds as many
tokens as the target's: a request's draft KV covers a prefix of its tokens and is brought up to date, as a prefill
chunk, in the step it next drafts in (its prompt the first time); after a verification it keeps the positions whose
tokens were accepted. The cache is a cache: when its pool runs dry, requests that are not drafting this step give
their draft KV up (and catch up again when they next draft); a request that finds no room does not draft.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from quant.errors import UnsupportedModelError
from server import models
from server.kv_pool import BlockPool, KVLayout
from server.layers.embedding import resolve as resolve_embeddings
from server.runner import ModelRunner, build_step

log = logging.getLogger("quantserve.engine")


def check_tokenizer(target, draft, target_name: str, draft_name: str) -> None:
    """Refuse, in one line, a draft whose tokenizer is not the target's (the same vocabulary: ids and strings)."""
    a, b = target.get_vocab(), draft.get_vocab()
    if a != b:
        differ = sorted(set(a.items()) ^ set(b.items()))[:1]
        raise UnsupportedModelError(
            f"--draft {draft_name}: its tokenizer is not {target_name}'s ({len(b)} tokens against {len(a)}"
            + (f", {differ[0][0]!r} differs" if differ else "") + "); a draft must share the target's vocabulary")


def draft_kv_layout(draft: tuple, tokenizer, target_name: str, config) -> KVLayout:
    """The KV layout of a draft model ``(model, tokenizer, name, scheme)`` of the target's engine config (in its
    ``draft_torch_dtype``), once its tokenizer is found to be the target's."""
    check_tokenizer(tokenizer, draft[1], target_name, draft[2])
    models.model_class(draft[0].config)  # an architecture the engine does not serve is refused in one line
    return KVLayout.from_config(draft[0].config, config.draft_torch_dtype, config.kv_block_size, config.kv_format)


def split_budget(budget_bytes: int, target: KVLayout, draft: KVLayout | None) -> tuple[int, int]:
    """The KV budget's shares for the target's pool and the draft's (none without one), so that both hold as many
    tokens."""
    if draft is None:
        return budget_bytes, 0
    share = budget_bytes * target.bytes_per_token // (target.bytes_per_token + draft.bytes_per_token)
    return share, budget_bytes - share


class DraftModel:
    """The draft model, its runner and its KV pool; ``propose`` runs its forwards for a step's drafting requests."""

    def __init__(self, draft: tuple, layout: KVLayout, budget_bytes: int, config, vocab_size: int,
                 eos_ids: frozenset[int], chooser=None):
        """draft: (model, tokenizer, name, scheme), served in the engine's ``config`` (its device, KV format, glue
        ops and embeddings setting; its ``draft_torch_dtype``); ``vocab_size`` and ``eos_ids``: the target's;
        ``chooser``: the engine's kernel plans (quant.runtime.kernel_choice), which the draft's projections join."""
        model, _, self.name, self.scheme = draft
        self.layout = layout
        self.device = torch.device(config.device)
        self.pool = BlockPool(layout, budget_bytes, self.device, prefix_cache=False)
        embeddings = resolve_embeddings(config.embeddings, config.draft_torch_dtype, self.scheme != "none")
        self.runner = ModelRunner(model, self.pool.storage, layout.block_size, fused_ops=config.fused_ops,
                                  embeddings=embeddings, chooser=chooser, kv_scales=self.pool.scales,
                                  kv_rotation=layout.rotation, kv_format=layout.kv_format, cpu_graphs=config.cpu_graphs)
        self.vocab_size = vocab_size  # the target's: the draft's logits are cut or padded to it
        self.eos_ids = eos_ids  # a drafted end of sequence is its request's last draft
        self.max_catch_up = config.max_prefill_tokens  # tokens a step's first draft forward writes, all together
        self.covered: dict[str, int] = {}  # request -> positions of its tokens whose K/V the draft pool holds
        self._last_used: dict[str, int] = {}  # request -> the step it last drafted in (who gives its KV up first)
        self._steps = 0
        self.evictions = 0  # requests whose draft KV was given up for another's
        self.broken: str | None = None  # why it failed, once it has (it then proposes nothing)
        self.context_length = int(model.config.max_position_embeddings)  # a request past it is not drafted for
        self.weight_bytes = self.runner.weight_bytes()

    def describe(self) -> str:
        return f"draft {self.name} ({self.scheme})"

    def release(self, request_id: str) -> None:
        self.pool.release(request_id)
        self.covered.pop(request_id, None)
        self._last_used.pop(request_id, None)

    def kept(self, seq) -> None:
        """After a request's verification is read: its draft KV keeps the positions whose tokens are its own now
        (the accepted drafts'), and gives back the blocks past them."""
        if seq.id in self.covered:
            self.covered[seq.id] = min(self.covered[seq.id], len(seq.prompt) + len(seq.generated) - 1)
            self.pool.shrink(seq.id, self.covered[seq.id])

    def _room(self, seq, positions: int, busy: set[str]) -> bool:
        """Grow the request's draft table to ``positions``, giving up the draft KV of requests not drafting this
        step (least recently drafting first) while that is short; False when there is no room even so."""
        if seq.id not in self.covered:
            while self.pool.try_reserve(seq.id, 1) is None:
                if not self._evict(busy):
                    return False
            self.covered[seq.id] = 0
        while not self.pool.grow(seq.id, positions):
            if not self._evict(busy):
                return False
        seq.draft_peak_blocks = max(seq.draft_peak_blocks, self.pool.held_blocks(seq.id))
        return True

    def _evict(self, busy: set[str]) -> bool:
        idle = [r for r in self.covered if r not in busy]
        if not idle:
            return False
        self.release(min(idle, key=lambda r: self._last_used.get(r, -1)))
        self.evictions += 1
        return True

    def propose(self, wants: list[tuple[object, int]], draw) -> list[list[int]]:
        """Each request's drafts, at most its ``k`` (fewer when it drafts an end of sequence, when the step's
        catch-up budget leaves it only part of its missing tokens; none when the pool has no room or its drafts
        would pass the draft model's context length).
        ``draw(logits, seqs, aheads)``: the step's sampler, each row drawn as the target would draw the token at
        its position (server/step.py). A request has no sample in flight: its tokens are all known.
        A draft model that fails is not the requests' failure: one log line, its KV given back, and it proposes
        nothing from then on (``broken`` says why); the requests decode as without speculation."""
        if self.broken is None:
            try:
                return self._propose(wants, draw)
            except Exception as e:  # noqa: BLE001 - the draft only ever speeds requests up
                self.broken = f"{type(e).__name__}: {e}"
                log.error("the draft model %s failed; speculation is off from now on: %s", self.name, self.broken)
                for r in list(self.covered):
                    self.release(r)
        return [[] for _ in wants]

    def _propose(self, wants: list[tuple[object, int]], draw) -> list[list[int]]:
        self._steps += 1
        busy = {s.id for s, _ in wants}
        drafts: list[list[int]] = [[] for _ in wants]
        live, chunks, budget = [], [], self.max_catch_up
        for i, (seq, k) in enumerate(wants):
            tokens = seq.prompt + seq.generated
            start = self.covered.get(seq.id, 0)
            n = min(len(tokens) - start, budget)
            if n <= 0 or len(tokens) + k - 1 > self.context_length:
                continue
            if not self._room(seq, start + n + (k - 1 if start + n == len(tokens) else 0), busy):
                continue
            budget -= n
            self._last_used[seq.id] = self._steps
            complete = start + n == len(tokens)
            chunks.append((tokens[start: start + n], start, self.pool.blocks_of(seq.id), complete))
            self.covered[seq.id] = start + n
            if complete:
                live.append((i, seq, k))
        if not chunks:
            return drafts
        logits = self._logits(build_step([], chunks, self.layout.block_size, self.device))
        while live:
            tokens = draw(logits, [s for _, s, _ in live], [tuple(drafts[i]) for i, _, _ in live])
            going = []
            for (i, seq, k), t in zip(live, tokens):
                drafts[i].append(t)
                if len(drafts[i]) < k and not self._ends(seq, t):
                    going.append((i, seq, k))
            live = going
            if not live:
                break
            rows = []
            for i, seq, _ in live:
                p = len(seq.prompt) + len(seq.generated) + len(drafts[i]) - 1
                rows.append((drafts[i][-1], p, self.pool.blocks_of(seq.id)))
                self.covered[seq.id] = p + 1
            logits = self._logits(build_step(rows, [], self.layout.block_size, self.device))
        return drafts

    def _ends(self, seq, token: int) -> bool:
        return token in self.eos_ids and not seq.params.ignore_eos

    def _logits(self, step) -> torch.Tensor:
        """The draft's logits for the step's sampled rows, as wide as the target's vocabulary (a wider head cut,
        a narrower one padded with -inf: tokens it cannot name are never drafted)."""
        logits = self.runner.forward(step)
        v = logits.shape[1]
        if v > self.vocab_size:
            return logits[:, : self.vocab_size].contiguous()
        if v < self.vocab_size:
            pad = logits.new_full((logits.shape[0], self.vocab_size - v), -float("inf"))
            return torch.cat([logits, pad], 1)
        return logits


def draft_params(params):
    """A request's sampling parameters as its draft draws with them: no logprobs or trace of its own."""
    if params.logprobs is None and params.trace is None:
        return params
    return replace(params, logprobs=None, trace=None)
