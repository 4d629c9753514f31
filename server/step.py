"""One engine step, either side of the device: ``Stepper.launch`` turns the scheduler's plan into the runner's
inputs, runs the forward and the sampling and queues the samples' copy back (``Launched``); once read back,
``next_token`` turns each sample into its request's outcome (text, logprobs, trace, and whether and why it
stops), and the prompt-logprob helpers hand a scored prompt to its request's first event. The engine
(server/engine.py) decides when each runs and delivers the events."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server import outputs as out
from server.batch import stage
from server.draft import draft_params
from server.grammar import fill_bitmask
from server.outputs import TokenLogprob, TraceStep
from server.runner import build_step
from server.sampling import TRACE_STAGES, TRACE_STATS, SamplingBatch, sample
from server.scheduler import Sequence


@dataclass(frozen=True)
class Outcome:
    """What a sampled token makes of its request: the text it releases, its logprobs and trace entries, the prompt's
    logprobs on the first event, and the finish ``reason`` (None: the request goes on) with the ``stop`` matched."""

    text: str
    logprobs: tuple
    trace: tuple
    prompt_logprobs: tuple
    reason: str | None = None
    stop: str | None = None


class Stepper:
    def __init__(self, runner, pool, block_size: int, device: torch.device, eos_ids: frozenset[int], vocab_size: int,
                 estimate):
        self.runner = runner
        self.pool = pool
        self.block_size = block_size
        self.device = device
        self.eos_ids = eos_ids
        self.eos_tensor = torch.tensor(sorted(eos_ids), dtype=torch.int64, device=device)
        self.vocab_size = vocab_size
        self.estimate = estimate  # (chunk tokens, past, scored rows) -> activation bytes, for each request's peak
        self.drafter = None  # a draft model (server/draft.py): it proposes the drafts of a plan's ``propose``

    def draw(self, logits, sampled: list[Sequence], ahead: list[tuple]):
        """Sample ``logits`` (one row per entry of ``sampled``, none with a sample in flight) as this step's sampler
        draws the token at each row's position: ``ahead[i]``, the drafts between its request's tokens and that
        position. A draft model's proposals (server/draft.py): the token ids, read back; no logprobs or trace."""
        params = [draft_params(s.params) for s in sampled]
        batch = self._batch(logits, sampled, params, ahead)
        return sample(logits, batch, self.runner.ops).tokens.tolist()

    def _batch(self, logits, sampled: list[Sequence], params: list, ahead: list[tuple]) -> SamplingBatch:
        """The sampling batch of a step's rows, each row's state as of its position: its draw's index (the token's
        index in its output), its end of sequence suppressed while short of min_tokens (in ``logits``), the
        penalties' history (a pending token's place marked -1, filled on the device by the caller), the grammar
        advanced along its drafts."""
        counts = [len(s.generated) + s.pending + len(a) for s, a in zip(sampled, ahead)]  # each draw's index
        suppress = [i for i, s in enumerate(sampled) if counts[i] < s.params.min_tokens]
        if suppress and self.eos_ids:
            rows_t = stage(suppress, torch.int64, self.device)
            logits[rows_t[:, None], self.eos_tensor[None, :]] = -float("inf")
        histories = None
        if any(p.uses_history for p in params):
            histories = [s.prompt + s.generated + [-1] * s.pending + list(a) for s, a in zip(sampled, ahead)]
        batch = SamplingBatch.build(params, [p.seed for p in params], counts, histories, device=self.device,
                                    prompt_lens=[len(s.prompt) for s in sampled])
        grammars = [s.state.get("grammar") for s in sampled]  # each one's last token is read back (see plan)
        if any(g is not None for g in grammars):
            batch.allowed = fill_bitmask(grammars, self.vocab_size, self.device, ahead)
        return batch

    def launch(self, plan, prev: Launched | None) -> Launched | None:
        """Run a plan's forward and sampling; the samples' copy back is queued, not waited for. A decode row whose
        last token ``prev`` sampled takes it from ``prev``'s device tensor."""
        bs = self.block_size
        decode, rows, index = [], [], []
        for i, seq in enumerate(plan.decode):
            if seq.pending:  # its token is prev's sample, still on the device
                rows.append(i)
                index.append(prev.row[seq])
            decode.append((0 if seq.pending else seq.generated[-1],
                           len(seq.prompt) + len(seq.generated) + seq.pending - 1, seq.blocks))
        prefill, sampled, score, scoring, scored_only = [], list(plan.decode), [], [], []
        for seq, start, n in plan.prefill:
            last = start + n == seq.fill_len
            # prompt logprobs: the rows whose next token is the prompt's (the first sample of a request scores)
            k = max(0, min(n, len(seq.prompt) - 1 - start)) if seq.scores_prompt else 0
            generates = last and seq.params.max_new_tokens > 0  # max_new_tokens 0: scored, never sampled
            prefill.append((seq.fill_tokens(start, n), start, seq.blocks, generates))
            score.append(k)
            if k:
                scoring.append((seq, start, k))
            seq.activation_peak = max(seq.activation_peak, self.estimate(n, start, k))
            if last:
                (sampled if generates else scored_only).append(seq)
        ahead = [()] * len(sampled)  # per sampled row: the drafts between its request's tokens and its position
        units = [(s, i, []) for i, s in enumerate(sampled)]  # (request, its first row, its drafts)
        for seq, drafts in plan.verify:  # [last token, drafts] written and every position sampled: one unit
            start = seq.next_position
            prefill.append(([seq.generated[-1], *drafts], start, seq.blocks, len(drafts) + 1))
            score.append(0)
            seq.activation_peak = max(seq.activation_peak, self.estimate(len(drafts) + 1, start, 0))
            seq.drafts = list(drafts)
            units.append((seq, len(sampled), seq.drafts))
            sampled += [seq] * (len(drafts) + 1)
            ahead += [tuple(drafts[:j]) for j in range(len(drafts) + 1)]
        tails = None
        if self.pool.layout.tail_blocks:  # int4: each row's sequence's residual tail
            tails = [self.pool.tail_of(s.id) for s in plan.decode] + [self.pool.tail_of(s.id) for s, _, _ in plan.prefill]
        step = build_step(decode, prefill, bs, self.device, (prev.tokens, rows, index) if rows else None,
                          score if scoring else None, tails)
        logits = self.runner.forward(step)  # (S, V) fp32
        for seq, start, n in plan.prefill:
            seq.prefilled = start + n
            self.pool.publish(seq.id, seq.prefilled)  # its full blocks written: later requests map them
        scores = None
        if scoring:  # each scored row's target is the prompt's next token
            targets = stage([t for seq, start, k in scoring for t in seq.prompt[start + 1 : start + 1 + k]],
                            torch.int64, self.device)
            scores = self.runner.score(step.scored, targets,
                                       max(seq.params.prompt_logprobs for seq, _, _ in scoring))
        step.scored = None
        if not sampled:
            return Launched([], None, False, scoring, scores, scored_only) if scoring or scored_only else None
        params = [s.params for s in sampled]
        batch = self._batch(logits, sampled, params, ahead)
        if batch.history is not None and rows:  # the fed decode rows (the first of ``sampled``): their pending token
            ends = [len(sampled[i].prompt) + len(sampled[i].generated) + sampled[i].pending - 1 for i in rows]
            idx = stage(rows + ends + index, torch.int64, self.device).view(3, -1)
            batch.history[idx[0], idx[1]] = prev.tokens.index_select(0, idx[2])
        res = sample(logits, batch, self.runner.ops)
        for s, _, _ in units:
            s.pending += 1
        return Launched(units, res, any(p.logprobs is not None for p in params), scoring, scores, scored_only)


def add_prompt_logprobs(scoring, chosen, top_ids, top_lp) -> None:
    """A step's scored prompt rows (read back) onto their requests, in the order the step scored them; a
    request's samples get the first's list once its whole prompt is scored."""
    r = 0
    for seq, start, k in scoring:
        n = seq.params.prompt_logprobs
        for j in range(k):
            alts = tuple(zip(top_ids[r + j][:n], top_lp[r + j][:n])) if n else ()
            seq.prompt_logprobs.append(TokenLogprob(seq.prompt[start + 1 + j], chosen[r + j], alts))
        r += k
        if seq.group is not None and len(seq.prompt_logprobs) == len(seq.prompt) - 1:
            seq.group.prompt_logprobs = tuple(seq.prompt_logprobs)

def first_prompt_logprobs(seq: Sequence) -> tuple:
    """The prompt's logprobs (tokens 1..), for the first event of a request that asked for them; () after."""
    if seq.params.prompt_logprobs is None or seq.prompt_logprobs_sent:
        return ()
    seq.prompt_logprobs_sent = True
    return tuple(seq.prompt_logprobs) if seq.group is None or seq.index == 0 else seq.group.prompt_logprobs


def next_token(seq: Sequence, tok: int, i: int, lp, top, trace, now: float, eos_ids: frozenset[int],
               draft: int | None = None) -> Outcome:
    """Row ``i`` of a step's samples, ``tok``, appended to its request: its logprobs and trace (with the token
    speculation drafted there, if any) read off the step's results, its text detokenized, and whether it ends the request (EOS, a grammar that terminated, a stop string,
    the length); a stop string's text is held back until it is known not to be one."""
    p = seq.params
    plp = first_prompt_logprobs(seq)
    seq.generated.append(tok)
    if seq.first_token_at is None:
        seq.first_token_at = now
    logprobs = ()
    if p.logprobs is not None:
        alts = tuple(zip(top[0][i][: p.logprobs], top[1][i][: p.logprobs])) if top else ()
        logprobs = (TokenLogprob(tok, lp[i], alts),)
    steps = ()
    if p.trace is not None:
        stages = {k: tuple(zip(trace[k][0][i][: p.trace], trace[k][1][i][: p.trace])) for k in TRACE_STAGES}
        stats = dict(zip(TRACE_STATS, trace["stats"][i]))
        counts = {k: int(v) for k, v in stats.items() if k.startswith("kept_")}
        steps = (TraceStep(**stages, **stats | counts, draft=draft),)
    detok, matcher = seq.state["detok"], seq.state["stop"]
    grammar = seq.state.get("grammar")
    if grammar is not None and not grammar.accept(tok):  # the mask allowed it: a bug, failing this request
        raise RuntimeError(f"the response_format grammar refused token {tok} that its mask allowed")
    # a grammar that has accepted its EOS ends the request (also with ignore_eos: it allows nothing after)
    eos = (tok in eos_ids and not p.ignore_eos) or (grammar is not None and grammar.terminated)
    text = "" if eos else detok.push(tok)
    stop = None
    if len(seq.generated) > p.min_tokens:  # stop strings count only once min_tokens are out (as vLLM)
        text, stopped = matcher.push(text)
        stop = matcher.matched if stopped else None
    reason = None
    if stop is not None:
        reason = out.STOP
    elif eos:
        reason, stop = out.STOP, "<eos>"
    elif len(seq.generated) >= p.max_new_tokens:
        reason = out.LENGTH
    if reason is None:
        return Outcome(text, logprobs, steps, plp)
    if stop is None or stop == "<eos>":  # held text was not a stop after all
        tail, stopped = matcher.push(detok.flush()) if len(seq.generated) > p.min_tokens else (detok.flush(), False)
        text += tail
        if stopped:
            stop = matcher.matched
        else:
            text += matcher.flush()
    return Outcome(text, logprobs, steps, plp, reason, stop)


class Launched:
    """A step whose forward and sampling are queued on the device: its sampled requests in row order (a
    verification's rows as one unit), the samples, its scored prompt rows (prompt logprobs), and their copies to the
    host queued behind them (pinned buffers and an event on CUDA), so reading them waits for this step only, never
    for a step launched after it.
    ``scored_only``: requests of max_new_tokens 0 whose prefill ended in this step (nothing sampled for them)."""

    def __init__(self, units: list[tuple[Sequence, int, list[int]]], res, want_logprob: bool, scoring=(),
                 scores=None, scored_only=()):
        self.units = units  # (request, its first sampled row, the drafts its rows verify: [] for one row)
        self.sampled = [s for s, _, _ in units]
        self.scoring = list(scoring)  # (request, first position, rows) per scored chunk, in row order
        self.scored_only = list(scored_only)
        self.row = {s: i for s, i, _ in units}
        self.tokens = res.tokens if res is not None else None  # (S,) int64 on the device: the next step's decode
        parts = {}                                               # rows read theirs from here
        if res is not None:
            parts["tokens"] = res.tokens
            if want_logprob:  # logprobs=0 asks for the chosen token's logprob alone (no top list then)
                parts["logprob"] = res.logprob
            if res.top_logprobs:
                parts["top_ids"], parts["top_lp"] = res.top_logprobs
            for k, (ids, pr) in (res.trace or {}).items():
                parts[f"trace_{k}_ids"], parts[f"trace_{k}_p"] = ids, pr
            if res.trace:
                parts["trace_stats"] = res.trace_stats
        if scores is not None:
            parts["plp"] = scores[0]
            if scores[1] is not None:
                parts["plp_ids"], parts["plp_lp"] = scores[1], scores[2]
        self.event = None
        if any(t.is_cuda for t in parts.values()):
            parts = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                     for k, t in parts.items()}
            self.event = torch.cuda.Event()
            self.event.record()
        self.parts = parts
        self.trace_keys = tuple((res.trace or {}).keys()) if res is not None else ()

    def results(self):
        """(tokens, logprobs or None, (top ids, top logprobs) or None, trace or None, prompt logprobs or None) as
        lists; prompt logprobs are (chosen, top ids or [], top logprobs or []) over the scored rows."""
        if self.event is not None:
            self.event.synchronize()
        p = {k: t.tolist() for k, t in self.parts.items()}
        top = (p["top_ids"], p["top_lp"]) if "top_ids" in p else None
        trace = None
        if self.trace_keys:
            trace = {k: (p[f"trace_{k}_ids"], p[f"trace_{k}_p"]) for k in self.trace_keys}
            trace["stats"] = p["trace_stats"]
        plp = (p["plp"], p.get("plp_ids", []), p.get("plp_lp", [])) if "plp" in p else None
        return p.get("tokens", []), p.get("logprob"), top, trace, plp
