"""The inference engine: a model runner, a KV block pool and a scheduler on a thread of their own.

Callers (the transports, benchmarks, tests) talk to it through :meth:`Engine.submit` (from any thread; returns a
handle at once or raises a request error before any work) and receive :class:`~server.outputs.Event` objects
through a sink: :meth:`Engine.generate` wraps that as an async iterator for asyncio code, :meth:`Engine.stream`
and :meth:`Engine.complete` as blocking iterators / results for plain threads. Commands (add, cancel) reach the
engine thread through one queue; it applies them at token boundaries, so a cancelled request's blocks are
back in the pool by the next step.

Each step of the engine thread: apply commands, admit what fits (FIFO), plan decode rows and bounded prefill
chunks (``server.scheduler``), run one forward over all of them (``server.runner``), sample every row in one
batched call (``server.sampling``), then per request: detokenize, check EOS / stop strings / length, emit. With
overlapped steps (CUDA's default, ``EngineConfig.overlap``) the per-request part of a step runs after the next
step is launched, its decode rows fed their tokens on the device, so the host's work hides behind the device's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import math
import logging
import queue
import secrets
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from quant.format import artifact
from quant.runtime.kernel_choice import Chooser
from quant.shape.model import ModelShape
from server import accounting, capacity, models, speculate, step_costs
from server import outputs as out
from server.config import EngineConfig, ModelInfo
from server.detokenize import IncrementalDetokenizer, StopMatcher
from server.grammar import Grammars, Matcher
from server.draft import DraftModel, draft_kv_layout, split_budget
from server.kv_pool import BlockPool, KVLayout, budget_fraction, resolve_budget
from server.layers.embedding import describe as describe_embeddings
from server.layers.embedding import resolve as resolve_embeddings
from server.loading import (freeze_loaded_objects, load_for_serving, release_freed_memory, share_one_heap,
                            thaw_frozen_objects)
from server.outputs import EngineClosedError, EngineTotals, Event, OverloadedError, RequestError
from server.runner import ModelRunner
from server.sampling_params import SEED_LIMIT, SamplingParams, SamplingParamsError
from server.scheduler import Group, Scheduler, Sequence
from server.step import (
    Launched,
    Stepper,
    add_prompt_logprobs,
    first_prompt_logprobs,
    next_token,
)
from server.text import TextCodec, eos_ids

log = logging.getLogger("quantserve.engine")
_PAD_ID = "__cuda_graph_padding__"  # the pool id of the CUDA graphs' padding block (in use from the start)


class RequestHandle:
    def __init__(self, engine: "Engine", request_id: str, seed: int, prompt_tokens: int):
        self._engine = engine
        self.id = request_id
        self.seed = seed
        self.prompt_tokens = prompt_tokens

    def cancel(self) -> None:
        self._engine.cancel(self.id)


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig, model_name: str = "model", scheme: str = "none",
                 cache_dir: Path | None = None, draft: tuple | None = None):
        """draft: (model, tokenizer, name, scheme) of the draft model of ``--speculate draft`` (server/draft.py)."""
        self.config = config.validate()
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        mcfg = model.config
        models.model_class(mcfg)  # an architecture the engine does not serve is refused before any allocation
        self.shape = ModelShape.from_config(mcfg)
        self.context_length = int(mcfg.max_position_embeddings)
        self.vocab_size = int(mcfg.vocab_size)
        self.layout = KVLayout.from_config(mcfg, self.dtype, config.kv_block_size, config.kv_format)
        draft_layout = draft and draft_kv_layout(draft, tokenizer, model_name, config)
        share = lambda b: split_budget(b, self.layout, draft_layout)  # noqa: E731 - the target's and draft's pools
        fraction = budget_fraction(config.memory_budget)
        # A fraction of free memory is taken once the runner exists (weights repacked and fused, the transients of
        # doing so freed), less one step's activation workspace; until then a one-block stand-in pool serves.
        # A block's K/V depends on its tokens and on these (the prefix cache's salt); the pool is the engine's own.
        self._kv_salt = f"{model_name}|{scheme}|{config.dtype}|{config.int4_activations}"
        budget = share(0 if fraction else resolve_budget(config.memory_budget, self.device))
        self.pool = self._pool(self.layout.bytes_per_block if fraction else budget[0])
        self.embeddings = resolve_embeddings(config.embeddings, self.dtype, scheme != "none")
        chooser = Chooser(config.kernels, cache_dir, config.threads, head_rows=config.max_batch,
                          device=self.device)  # plans per device
        self.runner = ModelRunner(model, self.pool.storage, self.layout.block_size, fused_ops=config.fused_ops,
                                  embeddings=self.embeddings, chooser=chooser, kv_scales=self.pool.scales,
                                  kv_rotation=self.layout.rotation, kv_format=self.layout.kv_format,
                                  int4_activations=config.int4_activations, cpu_graphs=config.cpu_graphs)
        if fraction:
            budget = share(accounting.fraction_budget(self.device, fraction, self.step_workspace(), config))
            self.pool = self._pool(budget[0])
            self.runner.use_kv_storage(self.pool.storage, self.pool.scales)
        self.draft = draft and DraftModel(draft, draft_layout, budget[1], config, self.vocab_size,
                                          eos_ids(model, tokenizer), chooser)
        self.cuda_graphs = "off"
        self._held_ids: set[str] = set()  # pool ids the engine holds itself (never a request's)
        if self.device.type == "cuda" and config.cuda_graphs:
            # The graphs' padding rows read and write one block of their own.
            if self.pool.num_blocks < 2:
                self.cuda_graphs = "off (the KV pool has no block to spare for padding rows)"
            else:
                pad = self.pool.try_reserve(_PAD_ID, 1)
                self._held_ids.add(_PAD_ID)
                self.cuda_graphs = self.runner.enable_cuda_graphs(
                    config.max_batch, self.layout.blocks_for(self.context_length), pad[0])
        # Pages of the weights file that fusing or int8 embeddings replaced leave the resident set, and what is held
        # in place is copied out of the file (artifact.own_held_pages says why).
        held = self.runner.held_tensors()
        artifact.own_held_pages(held)
        artifact.release_unheld_pages(held)
        self.attention = self.runner.attention  # the backend's name (server.attention)
        self.scheduler = Scheduler(self.pool, config.max_batch, config.max_prefill_tokens, config.kv_admission,
                                   math.ceil(config.kv_watermark * self.usable_blocks))
        self.overlap = config.overlap if config.overlap is not None else self.device.type == "cuda"
        self.eos_ids = eos_ids(model, tokenizer)
        self.step = Stepper(self.runner, self.pool, self.layout.block_size, self.device, self.eos_ids, self.vocab_size,
                            self.activation_estimate)
        if config.speculates:
            self.step.drafter = self.draft
            cache = cache_dir and step_costs.CostCache(cache_dir, self.device, config.threads, [
                step_costs.describe(self.runner, self.pool, self.dtype), scheme, chooser.table(), config.embeddings,
                config.int4_activations, config.cpu_graphs, config.max_batch, self.draft and [step_costs.describe(
                    self.draft.runner, self.draft.pool, config.draft_torch_dtype), self.draft.scheme]])
            costs, proposer = step_costs.costs(self.runner, self.pool, self.device, self.draft, cache)
            self.scheduler.speculate(costs, config.speculate_tokens, self.draft, proposer)
        self.weight_bytes = self.runner.weight_bytes()  # as held: what a step reads (fused, int8 embeddings), once each
        self.info = ModelInfo(
            model=model_name, scheme=scheme, dtype=config.dtype, device=str(self.device), attention=self.attention,
            context_length=self.context_length, vocab_size=self.vocab_size, weight_bytes=self.weight_bytes,
            kv_bytes_per_token=self.layout.bytes_per_token, kv_capacity_bytes=self.pool.capacity_bytes,
            kv_block_size=self.layout.block_size, glue_ops=self.runner.glue_ops,
            embeddings=describe_embeddings(self.embeddings), kernels=(*chooser.table(), *self.runner.kernel_notes()),
            speculation=self.draft.describe() if self.draft else config.speculation,
        )
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _queued, _accepting, _live
        self.text = TextCodec(tokenizer, self.vocab_size)  # the tokenizer, behind its lock
        self.grammars = Grammars(tokenizer, self.vocab_size, sorted(self.eos_ids), self.text.lock)  # response_format
        self._deferred: list | None = None  # events of the step being advanced, delivered after it
        self._queued = 0
        self._live: set[str] = set(self._held_ids)  # ids in use: requests', their samples', the engine's own
        self._accepting = True
        self._stop_at: float | None = None  # monotonic deadline once close() was called
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        log.info(
            "engine: %s (%s) on %s, %s, attention=%s, glue ops %s, cuda graphs %s, cpu graphs %s, %s steps, "
            "embeddings %s, weights %.1f MiB, KV pool %.1f MiB (%d tokens)",
            model_name, scheme, self.device, config.dtype, self.attention, self.runner.glue_ops, self.cuda_graphs,
            "on" if self.runner.cpu_graphs is not None else "off", "overlapped" if self.overlap else "serial",
            self.embeddings, self.weight_bytes / 2**20, self.pool.capacity_bytes / 2**20, self.pool.capacity_tokens,
        )

    @property
    def usable_blocks(self) -> int:
        """KV blocks requests can reserve: the pool's, less those the engine holds itself (CUDA graphs' padding)."""
        return self.pool.num_blocks - sum(self.pool.held_blocks(i) for i in self._held_ids)

    def _pool(self, budget_bytes: int) -> BlockPool:
        return BlockPool(self.layout, budget_bytes, self.device, prefix_cache=self.config.prefix_cache,
                         salt=self._kv_salt)

    @classmethod
    def from_path(cls, spec: str | None, config: EngineConfig, cache_dir: Path) -> "Engine":
        """Load ``spec`` and return a started engine. Loading happens on the thread that then runs the engine
        loop: OpenMP keeps one worker pool per thread that starts parallel work, and a thread whose pool is
        second to another's ran the same decode step about 3x slower here (a one-off diagnostic), so all torch work
        of a served model stays on the engine thread."""
        config.validate()
        box: dict = {}
        ready = threading.Event()

        def run() -> None:
            try:
                if config.threads:
                    torch.set_num_threads(config.threads)
                dtype = getattr(torch, config.dtype)
                model, tok, name, scheme = load_for_serving(spec, dtype, config.device, cache_dir)
                draft = None if config.draft is None else load_for_serving(
                    config.draft, config.draft_torch_dtype, config.device, cache_dir)
                box["engine"] = cls(model, tok, config, name, scheme, cache_dir, draft)
                release_freed_memory()
                freeze_loaded_objects()
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                box["error"] = e
                return
            finally:
                ready.set()
            box["engine"]._loop()

        share_one_heap()
        thread = threading.Thread(target=run, name="quantserve-engine", daemon=True)
        thread.start()
        ready.wait()
        if "error" in box:
            thread.join()
            raise box["error"]
        engine = box["engine"]
        engine._thread = thread
        return engine

    # ------------------------------------------------------------------------------------ lifecycle

    def start(self) -> "Engine":
        if self._thread is None:
            share_one_heap()
            freeze_loaded_objects()  # (from_path's engines: on their thread, once built)
            self._thread = threading.Thread(target=self._loop, name="quantserve-engine", daemon=True)
            self._thread.start()
        return self

    def close(self, grace_s: float = 0.0) -> None:
        """Stop taking requests; let running and queued ones finish for up to ``grace_s`` seconds, then cancel
        the rest (their final events say "cancelled") and stop the thread."""
        with self._lock:
            self._accepting = False
        self._stop_at = time.monotonic() + grace_s
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        thaw_frozen_objects()

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def accepting(self) -> bool:
        return self._accepting

    # ------------------------------------------------------------------------------------ requests

    def tokenize(self, text: str) -> list[int]:
        return self.text.tokenize(text)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return self.text.chat_prompt(messages)

    def token_text(self, token_id: int) -> str:
        return self.text.token_text(token_id)

    def decode(self, ids: list[int]) -> str:
        return self.text.decode(ids)

    def prompt_ids(self, prompt) -> list[int]:
        return self.text.prompt_ids(prompt)

    def check(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Admission checks that need no queue state: raise RequestError naming the parameter and numbers."""
        capacity.check_shape(prompt_tokens, max_new_tokens, self.context_length, self.usable_blocks, self.layout)

    def submit(self, prompt, params: SamplingParams, sink, request_id: str | None = None, n: int = 1
               ) -> RequestHandle:
        """Queue a request; ``sink(event)`` is called from the engine thread for each event. Raises
        RequestError (invalid, never fits), OverloadedError (queue full) or EngineClosedError before any work.

        ``n`` > 1: that many samples of the prompt, admitted together; the prompt is prefilled once (its full blocks
        before the block of its last token shared, server/kv_pool.py) and sample i draws with seed
        ``(seed + i) mod 2**63``, so it is what a request of that seed alone gives. Events carry ``index`` (i);
        each sample ends with its own final event."""
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        if not self._accepting:
            raise EngineClosedError("the engine is shutting down and takes no new requests")
        ids = self.prompt_ids(prompt)
        self.check(len(ids), params.max_new_tokens)
        past = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if past:
            raise SamplingParamsError("logit_bias", f"logit_bias keys must be token ids in [0, {self.vocab_size}), "
                                                    f"got {past[0]}")
        grammar = self.grammars.compile(params.response_format) if params.response_format is not None else None
        capacity.check_n(n, len(ids), params.max_new_tokens, self.config.max_batch, self.usable_blocks,
                         self.layout.block_size, self.layout.tail_blocks)
        seed = params.seed if params.seed is not None else secrets.randbelow(SEED_LIMIT)
        rid = request_id or f"req-{next(self._ids)}"
        sample_ids = [rid] + [f"{rid}/{i}" for i in range(1, n)]  # the pool's and scheduler's keys of its samples
        with self._lock:
            if not self._accepting:
                raise EngineClosedError("the engine is shutting down and takes no new requests")
            taken = next((i for i in sample_ids if i in self._live), None)
            if taken is not None:
                what = "request id" if taken == rid else f"request id {rid!r} names its samples {rid + '/i'!r};"
                raise RequestError("request_id", f"{what} {taken!r} is already in use")
            if self._queued >= self.config.max_queue:
                raise OverloadedError(
                    f"overloaded: {self._queued} requests are already waiting (--max-queue {self.config.max_queue})"
                )
            self._queued += 1
            self._live.update(sample_ids)
        seq = Sequence(rid, ids, params.with_seed(seed), sink)
        if n > 1:
            group = Group(rid, left=n)
            group.members = [seq] + [Sequence(sample_ids[i], ids, params.with_seed((seed + i) % SEED_LIMIT), sink,
                                              arrival=seq.arrival, index=i) for i in range(1, n)]
            for m in group.members:
                m.group = group
        for m in seq.group.members if seq.group is not None else [seq]:
            if grammar is not None:
                m.state["grammar"] = Matcher(self.grammars, grammar)  # each sample its own state
            if self.config.speculates and m.params.speculate:
                m.spec = speculate.Speculation(self.scheduler.draft_costs.draw_of(m.params))
        self._inbox.put(("add", seq))
        return RequestHandle(self, rid, seed, len(ids))

    def cancel(self, request_id: str) -> None:
        """Cancel a request wherever it is; harmless if it already finished."""
        self._inbox.put(("cancel", request_id))

    def stream(self, prompt, params: SamplingParams, request_id: str | None = None):
        """(handle, blocking iterator of events) for code running in a plain thread."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        handle = self.submit(prompt, params, q.put, request_id)

        def events():
            while True:
                ev = q.get()
                yield ev
                if ev.finished:
                    return

        return handle, events()

    def complete(self, prompt, params: SamplingParams, request_id: str | None = None) -> out.Completion:
        return out.collect(self.stream(prompt, params, request_id)[1])

    def samples(self, prompt, params: SamplingParams, n: int, request_id: str | None = None) -> list[out.Completion]:
        """``n`` samples of one prompt (:meth:`submit`'s ``n``), in index order, once all have finished."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        self.submit(prompt, params, q.put, request_id, n)
        events: dict[int, list[Event]] = {i: [] for i in range(n)}
        left = n
        while left:
            ev = q.get()
            events[ev.index].append(ev)
            left -= ev.finished
        return [out.collect(events[i]) for i in range(n)]

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None, n: int = 1):
        """Async iterator of a request's events (of its ``n`` samples, interleaved, each with its ``index``) until
        every sample's final event. Submission (tokenization) runs off the event loop; leaving the iteration early
        (client gone, task cancelled) cancels the request in the engine."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def sink(ev: Event) -> None:
            loop.call_soon_threadsafe(q.put_nowait, ev)

        handle = await asyncio.to_thread(self.submit, prompt, params, sink, request_id, n)
        left = n
        finished = False
        try:
            while not finished:
                ev = await q.get()
                left -= ev.finished
                finished = left == 0
                yield ev
        finally:
            if not finished:
                handle.cancel()

    # ------------------------------------------------------------------------------------ accounting

    def totals(self) -> EngineTotals:
        return accounting.engine_totals(self.pool, self.layout, self.weight_bytes, self.scheduler, self._queued,
                                        self.draft)

    def activation_estimate(self, chunk_tokens: int, past: int = 0, scored: int = 0) -> int:
        return accounting.activation_estimate(self.shape, self.dtype, self.runner, chunk_tokens, past, scored)

    def step_workspace(self) -> int:
        return accounting.step_workspace(self.activation_estimate, self.config.max_prefill_tokens,
                                         self.config.max_batch, self.shape if self.runner.ops.fused else None)

    def plan(self, shapes: list[capacity.Shape], check: Callable[[int, int], capacity.Refusal | None]
             ) -> concurrent.futures.Future:
        """A Future of the capacity plan (server/capacity.py) of ``shapes`` from a snapshot of the pool and the
        queue, taken on the engine thread between steps (the activation estimate may measure a dequantization
        there, and torch work stays on that thread); computed here when the engine thread is not running. An
        invalid plan (capacity.validate) is the Future's RequestError."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(("plan", (shapes, check, fut)))
        else:
            self._plan_now(shapes, check, fut)
        return fut

    def _plan_now(self, shapes, check, fut: concurrent.futures.Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            state = accounting.engine_state(self.usable_blocks, self.pool, self.layout, self.scheduler, self.config,
                                            self._queued)
            fut.set_result(capacity.plan(shapes, state, check, self.activation_estimate))
        except BaseException as e:  # noqa: BLE001 - the caller's to raise
            fut.set_exception(e)

    # ------------------------------------------------------------------------------------ engine thread

    def _emit(self, seq: Sequence, ev: Event) -> None:
        if self._deferred is not None:  # inside a step's tokenizer section: deliver after it (see _read)
            self._deferred.append((seq, ev))
            return
        try:
            seq.sink(ev)
        except Exception:  # noqa: BLE001 - a caller's broken sink (closed loop) must not stop the engine
            log.warning("request %s: event sink failed; cancelling it", seq.request_id, exc_info=True)
            self._inbox.put(("cancel", seq.request_id))

    def _final(self, seq: Sequence, reason: str, text: str = "", token_ids=(),
               logprobs=(), trace=(), stop=None, error=None, prompt_logprobs=()) -> None:
        now = time.monotonic()
        g = seq.group
        if g is not None:
            g.left -= 1
        if g is None or g.left == 0:  # the request's last sample: its ids are free again
            with self._lock:
                self._live.difference_update([m.id for m in g.members] if g is not None else [seq.id])
        self._emit(seq, Event(
            seq.request_id, seq.params.seed, text, tuple(token_ids), tuple(logprobs), tuple(trace), True, reason,
            stop, accounting.request_accounting(seq, self.layout, self.attention, self.totals(),
                                                self.draft and self.draft.layout.bytes_per_block), error,
            None if seq.first_token_at is None else seq.first_token_at - seq.arrival, now - seq.arrival,
            index=seq.index, prompt_logprobs=tuple(prompt_logprobs),
        ))

    def _dequeued(self) -> None:
        with self._lock:
            self._queued -= 1

    def _apply(self, cmd: str, arg) -> None:
        if cmd == "add":
            for seq in arg.group.members if arg.group is not None else [arg]:
                seq.state["detok"] = IncrementalDetokenizer(self.tokenizer, seq.prompt)
                seq.state["stop"] = StopMatcher(seq.params.stop)
            self.scheduler.add(arg)
        elif cmd == "cancel":
            self._cancel(arg)
        elif cmd == "plan":
            self._plan_now(*arg)

    def _cancel(self, request_id: str, error: str | None = None) -> None:
        found = self.scheduler.remove(request_id)
        if found is not None:
            seqs, was_waiting = found
            if was_waiting:
                self._dequeued()
            for seq in seqs:
                self._final(seq, out.CANCELLED, error=error)

    def _drain_inbox(self, block: bool) -> None:
        """Apply every queued command; when ``block``, wait up to 0.5 s for the first one."""
        wait = 0.5 if block else None
        while True:
            try:
                cmd, arg = self._inbox.get(timeout=wait) if wait else self._inbox.get_nowait()
            except queue.Empty:
                return
            self._apply(cmd, arg)
            wait = None

    def _loop(self) -> None:
        """Steps until closed. With ``overlap`` a launched step's samples are read (and the requests advanced)
        after the next step is launched: on CUDA the host's work for one token runs while the device computes the
        next. A step's plan needs nothing read back: a decode row's token, and its place in the penalties'
        history, are filled from the previous step's samples on the device; a request that finished there (EOS, a
        stop string) stays in one step more, and that row's sample is dropped. The exception: a request with a
        response_format is planned only once its last sample is read (its grammar's mask is filled on the host)."""
        inflight: Launched | None = None
        with torch.inference_mode():
            dirty = False  # steps ran since the heap was last trimmed
            while True:
                idle = not self.scheduler.has_work and self._stop_at is None and inflight is None
                if idle and dirty:
                    # Steps free their activations into glibc's arenas (one per thread touching them); given
                    # back when idle, resident memory tracks what is in use, not the busiest moment so far.
                    release_freed_memory()
                    dirty = False
                self._drain_inbox(block=idle)
                if self._stop_at is not None and (not self.scheduler.has_work or time.monotonic() >= self._stop_at):
                    inflight = self._read(inflight)
                    self._cancel_all("the engine shut down before the request finished")
                    return
                for _ in self.scheduler.admit():
                    self._dequeued()
                plan = self.scheduler.plan(can_preempt=inflight is None)
                if plan is None:  # a preemption waits for the step in flight to be read
                    inflight = self._read(inflight)
                    continue
                if inflight is not None and plan.empty:
                    inflight = self._read(inflight)  # then plan again with its samples in
                    continue
                if plan.empty:
                    continue
                dirty = True
                try:
                    if plan.propose:  # the draft model drafts what the plan verifies
                        self.scheduler.drafted(plan, self.step.drafter.propose(plan.propose, self.step.draw))
                    launched = self.step.launch(plan, inflight)
                except Exception as e:  # noqa: BLE001 - fail the step's requests, keep serving the rest
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    inflight = self._read(inflight)
                    self._fail(plan.sequences, e)
                    continue
                inflight = self._read(inflight)
                if launched is not None and not self.overlap:
                    launched = self._read(launched)
                inflight = launched

    def _fail(self, seqs: list[Sequence], e: Exception) -> None:
        failed = [s for s in seqs if not s.done]
        # A request's samples waiting for its first sample's prefill would wait for ever: they fail with it.
        failed += [m for s in failed if s.group is not None and s.index == 0 for m in s.group.members[1:]
                   if not m.done and m.waiting_for_leader and m not in failed]
        for seq in failed:
            self.scheduler.finish(seq)
            self._final(seq, out.ERROR, error=f"internal error: {type(e).__name__}")

    def _cancel_all(self, why: str) -> None:
        self._drain_inbox(block=False)  # commands that arrived meanwhile: adds must still get their final event
        for rid in dict.fromkeys(s.request_id for s in [*self.scheduler.waiting, *self.scheduler.running]):
            self._cancel(rid, error=why)

    def _advance(self, seq: Sequence, tok: int, i: int, lp, top, trace, now: float, draft: int | None) -> bool:
        """Row ``i``'s token (``draft``: what was drafted there) onto its request: its event, or its final one;
        whether the request goes on."""
        o = next_token(seq, tok, i, lp, top, trace, now, self.eos_ids, draft)
        if o.reason is None:
            self._emit(seq, Event(seq.request_id, seq.params.seed, o.text, (tok,), o.logprobs, o.trace,
                                  index=seq.index, prompt_logprobs=o.prompt_logprobs))
            return True
        self.scheduler.finish(seq)
        self._final(seq, o.reason, o.text, (tok,), o.logprobs, o.trace, o.stop, prompt_logprobs=o.prompt_logprobs)
        return False

    def _read(self, launched: Launched | None) -> None:
        """Wait for a launched step's samples and advance its requests (those finished or cancelled meanwhile
        drop theirs). Returns None, for ``inflight = self._read(inflight)``."""
        if launched is None:
            return None
        try:
            tokens, lp, top, trace, plp = launched.results()  # the one wait on the device per step
        except Exception as e:  # noqa: BLE001 - fail the step's requests, keep serving the rest
            log.error("engine step failed:\n%s", traceback.format_exc())
            for s in launched.sampled:
                s.pending -= 1
            self._fail(launched.sampled + [s for s, _, _ in launched.scoring] + launched.scored_only, e)
            return None
        now = time.monotonic()
        # Sinks run after the tokenizer lock is released: a slow sink must not hold up tokenization elsewhere.
        self._deferred = []
        try:
            with self.text.lock:
                if plp is not None:  # before the samples: a request's first event carries its prompt's logprobs
                    add_prompt_logprobs(launched.scoring, *plp)
                for seq in launched.scored_only:  # max_new_tokens 0: the prompt scored, nothing to generate
                    if not seq.done:
                        self.scheduler.finish(seq)
                        self._final(seq, out.LENGTH, prompt_logprobs=first_prompt_logprobs(seq))
                for seq, first, drafts in launched.units:
                    seq.pending -= 1
                    seq.drafts = []
                    if seq.done:
                        continue
                    try:
                        rows = self.scheduler.verified(seq, drafts, tokens[first:]) if drafts else 1
                        for i, d in zip(range(first, first + rows), [*drafts, None]):
                            if not self._advance(seq, tokens[i], i, lp, top, trace, now, d):
                                break
                        else:
                            if drafts:
                                self.scheduler.rollback(seq)
                    except Exception as e:  # noqa: BLE001 - fail this request, advance the others
                        log.error("request %s: advancing it failed:\n%s", seq.id, traceback.format_exc())
                        self._fail([seq], e)
        finally:
            deferred, self._deferred = self._deferred, None
            for seq, ev in deferred:
                self._emit(seq, ev)
        return None
