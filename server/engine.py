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
import logging
import queue
import secrets
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from quant.format import artifact
from quant.runtime.kernel_choice import MODES as KERNEL_MODES
from quant.runtime.kernel_choice import Chooser
from quant.shape.memory import dtype_bytes, engine_prefill_bytes
from quant.shape.model import ModelShape
from server import capacity, models
from server import outputs as out
from server.batch import stage
from server.detokenize import IncrementalDetokenizer, StopMatcher
from server.grammar import Grammars, Matcher, fill_bitmask
from server.kv_pool import (
    BlockPool,
    KVBudgetError,
    KVLayout,
    budget_fraction,
    free_memory,
    resolve_budget,
)
from server.layers.embedding import check_mode as check_embeddings
from server.layers.embedding import describe as describe_embeddings
from server.layers.embedding import resolve as resolve_embeddings
from server.outputs import (
    Accounting,
    EngineClosedError,
    EngineTotals,
    Event,
    OverloadedError,
    RequestError,
    TokenLogprob,
    TraceStep,
)
from server.runner import SCORE_ROWS, ModelRunner, build_step
from server.sampling import (
    SEED_LIMIT,
    TRACE_STAGES,
    TRACE_STATS,
    SamplingBatch,
    SamplingParams,
    SamplingParamsError,
    sample,
)
from server.scheduler import Group, Scheduler, Sequence
from server.settings import setting

log = logging.getLogger("quantserve.engine")
_PAD_ID = "__cuda_graph_padding__"  # the pool id of the CUDA graphs' padding block (in use from the start)


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings. Those `quant serve` exposes take their default and meaning from the settings table
    (server/settings.py); the others are the engine's own."""

    memory_budget: str = setting("memory_budget")
    max_queue: int = setting("max_queue")
    max_batch: int = setting("max_batch")
    max_prefill_tokens: int = setting("max_prefill_tokens")
    prefix_cache: bool = setting("prefix_cache")  # server/kv_pool.py's BlockPool
    block_size: int = 16  # tokens per KV block
    dtype: str = setting("dtype")
    device: str = setting("device")
    embeddings: str = setting("embeddings")  # server/layers/embedding.py
    kernels: str = setting("kernels")  # quant/runtime/kernel_choice.py
    threads: int | None = setting("threads")  # None leaves torch's default
    fused_ops: bool = True  # the fused glue kernels: C++ on CPU (server/fastops.py), Triton on CUDA (False: eager)
    cuda_graphs: bool = True  # CUDA: decode steps replay graphs captured at start (server/cuda_graphs.py)
    # Launch each step before reading the previous one's samples back (decode rows take their tokens on the device),
    # so the host's per-token work overlaps the device's; None: on CUDA, where the device runs asynchronously.
    overlap: bool | None = None

    def validate(self) -> "EngineConfig":
        for name in ("max_queue", "max_batch", "max_prefill_tokens", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"--dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"--threads must be an integer >= 1, got {self.threads!r}")
        check_embeddings(self.embeddings, getattr(torch, self.dtype))
        if self.kernels not in KERNEL_MODES:
            raise ValueError(f"--kernels must be one of {', '.join(KERNEL_MODES)}, got {self.kernels!r}")
        if not isinstance(self.prefix_cache, bool):
            raise ValueError(f"--prefix-cache must be true or false, got {self.prefix_cache!r}")
        return self


@dataclass(frozen=True)
class ModelInfo:
    model: str  # what was loaded (artifact dir or model source)
    scheme: str  # quantization scheme, or "none" for a model served unquantized
    dtype: str
    device: str
    attention: str
    context_length: int
    vocab_size: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_capacity_bytes: int
    kv_block_size: int
    glue_ops: str  # "fused" (server/csrc kernels), "triton" (server/glue_triton.py) or "eager" with the reason
    embeddings: str  # "float", or "int8" with the head's kernel (server/layers/embedding.py)
    kernels: tuple[str, ...] = ()  # per projection computation: the path at each row count and why (measured)


def load_for_serving(spec: str | None, dtype: torch.dtype, device: str, cache_dir: Path):
    """(model, tokenizer, name, scheme): a quantserve / GPTQ artifact dir, or a plain model dir, GGUF or hub id
    (served unquantized); None is the embedded default model. Local safetensors checkpoints load as a module tree
    without transformers' modeling classes (quant.runtime.loader.load_for_engine); a hub id or a .bin-only dir goes
    through transformers."""
    from quant.format import shards
    from quant.format import sources as sources
    from quant.runtime import loader

    check = models.model_class  # an architecture the engine does not serve is refused before any weight
    p = Path(spec).expanduser() if spec else None
    if p is not None and p.is_dir() and (p / "quant_manifest.json").is_file():
        la = loader.load_for_engine(p, dtype=dtype, device=device, cache_dir=cache_dir, check_config=check)
        return la.model, la.tokenizer, str(p), str(la.manifest["scheme"])
    if p is not None and p.is_dir() and (p / "config.json").is_file() and "quantization_config" in (
        p / "config.json"
    ).read_text():
        # e.g. a GPTQ checkpoint made elsewhere
        la = loader.load_for_engine(p, dtype=dtype, device=device, verify=False, cache_dir=cache_dir,
                                    check_config=check)
        return la.model, la.tokenizer, str(p), "gptq"
    source = sources.resolve(spec, cache_dir)
    local = Path(source.path)
    if local.is_dir() and ((local / shards.WEIGHTS).is_file() or (local / shards.INDEX).is_file()):
        la = loader.load_for_engine(local, dtype=dtype, device=device, verify=False, cache_dir=cache_dir,
                                    check_config=check)
        return la.model, la.tokenizer, source.spec, "none"
    model, tok = sources.load_model(source, dtype=dtype, device=device)
    return model, tok, source.spec, "none"


def share_one_heap() -> None:
    """Make threads started from now on allocate from glibc's main heap instead of one arena each. malloc_trim
    returns the free top of the main heap only; a thread arena keeps its free top (up to twice the dynamic mmap
    threshold, tens of MiB once the step's logits have been freed), so the engine thread's arena left server RSS
    at either ~487 or ~528 MiB after identical rounds of load (tests/test_reliability.py). With one heap it stays
    at one figure, at the same speed (6.5 s per 64-stream round either way). Called before the engine thread
    starts; a no-op where glibc is not the allocator."""
    libc = artifact.linux_libc()
    if libc is not None:
        try:
            libc.mallopt(-8, 1)  # M_ARENA_MAX
        except AttributeError:
            pass


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (after loading, and whenever the engine goes idle). Unpacking and
    repacking quantized tensors frees hundreds of MiB of temporaries that glibc keeps in its heap
    (bench/decode.py --only rss: a w4a16 server at 1837 MiB RSS before this call existed, 1053 MiB with it);
    malloc_trim returns it. A no-op where glibc is not the allocator."""
    libc = artifact.linux_libc()
    if libc is not None:
        try:
            libc.malloc_trim(0)
        except AttributeError:
            pass


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
                 cache_dir: Path | None = None):
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
        self.layout = KVLayout.from_config(mcfg, self.dtype, config.block_size)
        fraction = budget_fraction(config.memory_budget)
        # A fraction of free memory is taken once the runner exists (weights repacked and fused, the transients of
        # doing so freed), less one step's activation workspace; until then a one-block stand-in pool serves.
        # A block's K/V depends on its tokens and on these (the prefix cache's salt); the pool is the engine's own.
        self._kv_salt = f"{model_name}|{scheme}|{config.dtype}"
        self.pool = self._pool(self.layout.bytes_per_block if fraction else
                               resolve_budget(config.memory_budget, self.device))
        self.embeddings = resolve_embeddings(config.embeddings, self.dtype, scheme != "none")
        chooser = Chooser(config.kernels, cache_dir, config.threads, head_rows=config.max_batch,
                          device=self.device)  # plans per device
        self.runner = ModelRunner(model, self.pool.storage, config.block_size, fused_ops=config.fused_ops,
                                  embeddings=self.embeddings, chooser=chooser)
        if fraction:
            self.pool = self._pool(self._fraction_budget(fraction))
            self.runner.use_kv_storage(self.pool.storage)
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
        self.scheduler = Scheduler(self.pool, config.max_batch, config.max_prefill_tokens)
        self.overlap = config.overlap if config.overlap is not None else self.device.type == "cuda"
        self.eos_ids = self._eos_ids(model, tokenizer)
        self._eos_tensor = torch.tensor(sorted(self.eos_ids), dtype=torch.int64, device=self.device)
        # Weights as held in memory: what a step reads (fused projections, int8 embeddings), each storage once.
        self.weight_bytes = self.runner.weight_bytes()
        self.info = ModelInfo(
            model=model_name, scheme=scheme, dtype=config.dtype, device=str(self.device), attention=self.attention,
            context_length=self.context_length, vocab_size=self.vocab_size, weight_bytes=self.weight_bytes,
            kv_bytes_per_token=self.layout.bytes_per_token, kv_capacity_bytes=self.pool.capacity_bytes,
            kv_block_size=config.block_size, glue_ops=self.runner.glue_ops,
            embeddings=describe_embeddings(self.embeddings), kernels=(*chooser.table(), *self.runner.kernel_notes()),
        )
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _queued, _accepting, _live
        self._tok_lock = threading.Lock()  # a fast tokenizer must not be used from two threads at once
        self.grammars = Grammars(tokenizer, self.vocab_size, sorted(self.eos_ids), self._tok_lock)  # response_format
        self._deferred: list | None = None  # events of the step being advanced, delivered after it
        self._queued = 0
        self._live: set[str] = set(self._held_ids)  # ids in use: requests', their samples', the engine's own
        self._accepting = True
        self._stop_at: float | None = None  # monotonic deadline once close() was called
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        log.info(
            "engine: %s (%s) on %s, %s, attention=%s, glue ops %s, cuda graphs %s, %s steps, embeddings %s, "
            "weights %.1f MiB, KV pool %.1f MiB (%d tokens)",
            model_name, scheme, self.device, config.dtype, self.attention, self.runner.glue_ops, self.cuda_graphs,
            "overlapped" if self.overlap else "serial", self.embeddings,
            self.weight_bytes / 2**20,
            self.pool.capacity_bytes / 2**20, self.pool.capacity_tokens,
        )

    @property
    def usable_blocks(self) -> int:
        """KV blocks requests can reserve: the pool's, less those the engine holds itself (CUDA graphs' padding)."""
        return self.pool.num_blocks - sum(len(self.pool.blocks_of(i)) for i in self._held_ids)

    def _pool(self, budget_bytes: int) -> BlockPool:
        return BlockPool(self.layout, budget_bytes, self.device, prefix_cache=self.config.prefix_cache,
                         salt=self._kv_salt)

    @classmethod
    def from_path(cls, spec: str | None, config: EngineConfig, cache_dir: Path) -> "Engine":
        """Load ``spec`` and return a started engine. Loading happens on the thread that then runs the engine
        loop: OpenMP keeps one worker pool per thread that starts parallel work, and a thread whose pool is
        second to another's ran the same decode step about 3x slower here (a one-off diagnostic, bench/RESULTS.md), so all
        torch work of a served model stays on the engine thread."""
        config.validate()
        box: dict = {}
        ready = threading.Event()

        def run() -> None:
            try:
                if config.threads:
                    torch.set_num_threads(config.threads)
                model, tok, name, scheme = load_for_serving(spec, getattr(torch, config.dtype), config.device,
                                                            cache_dir)
                box["engine"] = cls(model, tok, config, name, scheme, cache_dir)
                release_freed_memory()
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

    @staticmethod
    def _eos_ids(model, tokenizer) -> frozenset[int]:
        ids = set()
        gen = getattr(model, "generation_config", None)  # a transformers model's; a module tree carries the ids
        for src in (getattr(gen, "eos_token_id", None), getattr(model, "generation_eos", None),
                    model.config.eos_token_id, tokenizer.eos_token_id):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(i) for i in src)
        return frozenset(ids)

    # ------------------------------------------------------------------------------------ lifecycle

    def start(self) -> "Engine":
        if self._thread is None:
            share_one_heap()
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

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def accepting(self) -> bool:
        return self._accepting

    # ------------------------------------------------------------------------------------ requests

    def tokenize(self, text: str) -> list[int]:
        with self._tok_lock:
            return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template, ready for the assistant's turn."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("messages", "this model's tokenizer has no chat template; use /v1/completions")
        with self._tok_lock:
            ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def token_text(self, token_id: int) -> str:
        """One token's text on its own (for logprobs and traces shown to people)."""
        with self._tok_lock:
            return self.tokenizer.decode([token_id])

    def decode(self, ids: list[int]) -> str:
        """The text of token ids, special tokens included (an echoed prompt)."""
        with self._tok_lock:
            return self.tokenizer.decode(ids)

    def prompt_ids(self, prompt) -> list[int]:
        """A prompt's token ids: a text tokenized, or ids checked (integers in the vocabulary); RequestError naming
        ``prompt`` otherwise."""
        if isinstance(prompt, str):
            return self.tokenize(prompt) if prompt else []
        if not isinstance(prompt, (list, tuple)):
            raise RequestError("prompt", f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise RequestError("prompt", f"prompt token ids must be integers in [0, {self.vocab_size}), got {t!r}")
        return list(prompt)

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
                         self.layout.block_size)
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
        if grammar is not None:
            for m in seq.group.members if seq.group is not None else [seq]:
                m.state["grammar"] = Matcher(self.grammars, grammar)  # each sample its own state
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
        p, bpb = self.pool, self.layout.bytes_per_block
        return EngineTotals(
            weight_bytes=self.weight_bytes, kv_capacity_bytes=p.capacity_bytes, kv_used_bytes=p.used_blocks * bpb,
            kv_block_size=self.layout.block_size, running=len(self.scheduler.running), queued=self._queued,
            kv_cached_bytes=p.cached_blocks * bpb, prefix_cache=p.prefix_cache, prefix_hit_tokens=p.hit_tokens,
            prefix_queried_tokens=p.queried_tokens, prefix_evictions=p.evictions,
        )

    def _accounting(self, seq: Sequence) -> Accounting:
        bpt, bpb = self.layout.bytes_per_token, self.layout.bytes_per_block
        reserved_blocks = len(seq.blocks or ())  # None: never admitted; the scheduler keeps it after release
        return Accounting(
            prompt_tokens=len(seq.prompt), generated_tokens=len(seq.generated), kv_bytes_per_token=bpt,
            kv_blocks_reserved=reserved_blocks, kv_bytes_reserved=reserved_blocks * bpb,
            kv_bytes_used=seq.kv_tokens * bpt, activation_peak_bytes=seq.activation_peak,
            attention=self.attention, engine=self.totals(),
            kv_bytes_shared=seq.shared_blocks * bpb, kv_bytes_own=(reserved_blocks - seq.shared_blocks) * bpb,
            prompt_tokens_cached=seq.cached,
        )

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
            state = capacity.EngineState(
                self.usable_blocks, self.pool.free_blocks, self.layout.block_size, self.layout.bytes_per_block,
                len(self.scheduler.running), self.config.max_batch, self.config.max_prefill_tokens,
                tuple((self.pool.group_blocks(len(s.prompt), s.reserve_tokens, len(s.group.members)),
                       len(s.group.members)) if s.group is not None else (self.layout.blocks_for(s.reserve_tokens), 1)
                      for s in self.scheduler.waiting), self._queued,
                self.config.max_queue,
            )
            fut.set_result(capacity.plan(shapes, state, check, self.activation_estimate))
        except BaseException as e:  # noqa: BLE001 - the caller's to raise
            fut.set_exception(e)

    def _fraction_budget(self, fraction: float) -> int:
        """The pool's bytes for a fractional --memory-budget: that fraction of the memory free now, refused in one
        line when it would not leave the workspace of the largest step (a prefill of max_prefill_tokens, or the
        decode of max_batch rows)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        free = free_memory(self.device)
        workspace = self.step_workspace()
        budget = int(free * fraction)
        if free - budget < workspace:
            most = max(0.0, (free - workspace) / free)
            raise KVBudgetError(
                f"--memory-budget {self.config.memory_budget} of {free / 2**20:.0f} MiB free leaves "
                f"{(free - budget) / 2**20:.0f} MiB for the activations of one step, which need "
                f"{workspace / 2**20:.0f} MiB (--max-prefill-tokens {self.config.max_prefill_tokens}); use at most "
                f"{most:.2f} or fewer prefill tokens")
        return budget

    def step_workspace(self) -> int:
        """The activations of the largest step: a prefill of max_prefill_tokens (scoring its prompt rows), or the
        decode of max_batch rows."""
        return max(self.activation_estimate(self.config.max_prefill_tokens, scored=SCORE_ROWS),
                   self.activation_estimate(self.config.max_batch))

    def activation_estimate(self, chunk_tokens: int, past: int = 0, scored: int = 0) -> int:
        """Estimated activation peak of a step that prefills a chunk of this many tokens after ``past`` cached
        ones (quant.shape.memory.engine_prefill_bytes, the runner's own model, with its glue ops and the measured
        dequantization transients of this model's projections). ``scored``: rows of it whose next token is scored
        (prompt logprobs): the runner forms their logits SCORE_ROWS at a time, each row's in the head's output and
        its fp32 log-softmax, counted as two more sampled rows each."""
        return engine_prefill_bytes(
            self.shape, chunk_tokens, dtype_bytes(self.dtype), self.runner.ops.memory,
            past=past, sampled=1 + 2 * min(scored, SCORE_ROWS),
            transients=self.runner.projection_transients(chunk_tokens),
        )

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
            stop, self._accounting(seq), error,
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
        inflight: _Launched | None = None
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
                plan = self.scheduler.plan()
                if inflight is not None and plan.empty:
                    inflight = self._read(inflight)  # then plan again with its samples in
                    continue
                if plan.empty:
                    continue
                dirty = True
                try:
                    launched = self._launch(plan, inflight)
                except Exception as e:  # noqa: BLE001 - fail the step's requests, keep serving the rest
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    inflight = self._read(inflight)
                    self._fail(plan.decode + [s for s, _, _ in plan.prefill], e)
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

    def _launch(self, plan, prev: "_Launched | None") -> "_Launched | None":
        """Run a plan's forward and sampling; the samples' copy back is queued, not waited for. A decode row whose
        last token ``prev`` sampled takes it from ``prev``'s device tensor."""
        bs = self.layout.block_size
        decode, rows, index = [], [], []
        for i, seq in enumerate(plan.decode):
            if seq.pending:  # its token is prev's sample, still on the device
                rows.append(i)
                index.append(prev.row[seq])
            decode.append((0 if seq.pending else seq.generated[-1],
                           len(seq.prompt) + len(seq.generated) + seq.pending - 1, seq.blocks))
        prefill, sampled, score, scoring, scored_only = [], list(plan.decode), [], [], []
        for seq, start, n in plan.prefill:
            last = start + n == len(seq.prompt)
            # prompt logprobs: the rows whose next token is the prompt's (the first sample of a request scores)
            k = max(0, min(n, len(seq.prompt) - 1 - start)) if seq.params.prompt_logprobs is not None and \
                seq.index == 0 else 0
            generates = last and seq.params.max_new_tokens > 0  # max_new_tokens 0: scored, never sampled
            prefill.append((seq.prompt[start : start + n], start, seq.blocks, generates))
            score.append(k)
            if k:
                scoring.append((seq, start, k))
            seq.activation_peak = max(seq.activation_peak, self.activation_estimate(n, start, k))
            if last:
                (sampled if generates else scored_only).append(seq)
        step = build_step(decode, prefill, bs, self.device, (prev.tokens, rows, index) if rows else None,
                          score if scoring else None)
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
            return _Launched([], None, False, scoring, scores, scored_only) if scoring or scored_only else None
        params = [s.params for s in sampled]
        counts = [len(s.generated) + s.pending for s in sampled]  # this draw's index in each request
        suppress = [i for i, s in enumerate(sampled) if counts[i] < s.params.min_tokens]
        if suppress and self.eos_ids:
            rows_t = stage(suppress, torch.int64, self.device)
            logits[rows_t[:, None], self._eos_tensor[None, :]] = -float("inf")
        histories = None
        if any(p.uses_history for p in params):  # a pending token's place is filled on the device
            histories = [s.prompt + s.generated + [-1] * s.pending for s in sampled]
        batch = SamplingBatch.build(params, [p.seed for p in params], counts, histories, device=self.device,
                                    prompt_lens=[len(s.prompt) for s in sampled])
        if histories is not None and rows:  # the fed decode rows are the same rows of ``sampled``
            idx = stage(rows + [len(histories[i]) - 1 for i in rows] + index, torch.int64, self.device).view(3, -1)
            batch.history[idx[0], idx[1]] = prev.tokens.index_select(0, idx[2])
        grammars = [s.state.get("grammar") for s in sampled]  # each one's last token is read back (see plan)
        if any(g is not None for g in grammars):
            batch.allowed = fill_bitmask(grammars, self.vocab_size, self.device)
        res = sample(logits, batch)
        for s in sampled:
            s.pending += 1
        return _Launched(sampled, res, any(p.logprobs is not None for p in params), scoring, scores, scored_only)

    def _read(self, launched: "_Launched | None") -> None:
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
            with self._tok_lock:
                if plp is not None:  # before the samples: a request's first event carries its prompt's logprobs
                    self._add_prompt_logprobs(launched.scoring, *plp)
                for seq in launched.scored_only:  # max_new_tokens 0: the prompt scored, nothing to generate
                    if not seq.done:
                        self.scheduler.finish(seq)
                        self._final(seq, out.LENGTH, prompt_logprobs=self._first_prompt_logprobs(seq))
                for i, (seq, tok) in enumerate(zip(launched.sampled, tokens)):
                    seq.pending -= 1
                    if seq.done:
                        continue
                    try:
                        self._advance(seq, tok, i, lp, top, trace, now)
                    except Exception as e:  # noqa: BLE001 - fail this request, advance the others
                        log.error("request %s: advancing it failed:\n%s", seq.id, traceback.format_exc())
                        self._fail([seq], e)
        finally:
            deferred, self._deferred = self._deferred, None
            for seq, ev in deferred:
                self._emit(seq, ev)
        return None

    def _add_prompt_logprobs(self, scoring, chosen, top_ids, top_lp) -> None:
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

    @staticmethod
    def _first_prompt_logprobs(seq: Sequence) -> tuple:
        """The prompt's logprobs (tokens 1..), for the first event of a request that asked for them; () after."""
        if seq.params.prompt_logprobs is None or seq.prompt_logprobs_sent:
            return ()
        seq.prompt_logprobs_sent = True
        return tuple(seq.prompt_logprobs) if seq.group is None or seq.index == 0 else seq.group.prompt_logprobs

    def _advance(self, seq: Sequence, tok: int, i: int, lp, top, trace, now: float) -> None:
        p = seq.params
        plp = self._first_prompt_logprobs(seq)
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
            steps = (TraceStep(**stages, **stats | counts),)
        detok, matcher = seq.state["detok"], seq.state["stop"]
        grammar = seq.state.get("grammar")
        if grammar is not None and not grammar.accept(tok):  # the mask allowed it: a bug, failing this request
            raise RuntimeError(f"the response_format grammar refused token {tok} that its mask allowed")
        # a grammar that has accepted its EOS ends the request (also with ignore_eos: it allows nothing after)
        eos = (tok in self.eos_ids and not p.ignore_eos) or (grammar is not None and grammar.terminated)
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
            self._emit(seq, Event(seq.request_id, p.seed, text, (tok,), logprobs, steps, index=seq.index,
                                  prompt_logprobs=plp))
            return
        if stop is None or stop == "<eos>":  # held text was not a stop after all
            tail, stopped = matcher.push(detok.flush()) if len(seq.generated) > p.min_tokens else (detok.flush(), False)
            text += tail
            if stopped:
                stop = matcher.matched
            else:
                text += matcher.flush()
        self.scheduler.finish(seq)
        self._final(seq, reason, text, (tok,), logprobs, steps, stop, prompt_logprobs=plp)


class _Launched:
    """A step whose forward and sampling are queued on the device: its sampled requests in row order, the
    samples, its scored prompt rows (prompt logprobs), and their copies to the host queued behind them (pinned
    buffers and an event on CUDA), so reading them waits for this step only, never for a step launched after it.
    ``scored_only``: requests of max_new_tokens 0 whose prefill ended in this step (nothing sampled for them)."""

    def __init__(self, sampled: list[Sequence], res, want_logprob: bool, scoring=(), scores=None, scored_only=()):
        self.sampled = sampled
        self.scoring = list(scoring)  # (request, first position, rows) per scored chunk, in row order
        self.scored_only = list(scored_only)
        self.row = {s: i for i, s in enumerate(sampled)}
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
