"""Capacity planning: what the engine would do with requests of given shapes, answered from its own accounting.

For each request shape (prompt tokens, max new tokens, how many, samples per request ``n``, and optionally the
new tokens a request is expected to produce):

- KV per request at its worst case: ceil((prompt + max_new) / block_size) blocks x bytes per block per sample,
  what ``--kv-admission reserve`` takes at admission; a request of ``n`` samples holds its samples' blocks, the
  prompt's full blocks before its last token's block held once (server/kv_pool.py's ``group_blocks``, the pool's
  own arithmetic). ``kv_bytes_reserved`` is what a sample that runs to max_new_tokens reports (with on-demand
  blocks the positions it wrote, prompt + max_new - 1, its last token's K/V never being written);
- KV at admission: on demand (the default), the prompt's blocks only, with the scheduler's watermark left free
  while others run; with ``reserve``, the worst case;
- the prefill activation peak: the largest ``Engine.activation_estimate`` over the request's prefill chunks
  (``max_prefill_tokens`` each) when it prefills alone, what ``Accounting.activation_peak_bytes`` reports
  for it then (a prompt sharing a step's prefill budget with others is cut into smaller chunks);
- how many such requests the engine could run at once, now and when empty, each reaching max_new_tokens (the
  guaranteed concurrency): free KV blocks / worst-case blocks per request, capped by the free batch slots
  (``limited_by`` says which bound); and, for the stated expected output length, how many an idle engine runs at
  once on demand (the expected concurrency; with ``reserve`` the guaranteed one). Shapes carry no tokens, so the plan
  counts no prefix-cache hit: a request whose prompt begins with blocks the cache holds needs fewer (the plan is
  the bound, exact when nothing it plans is cached);
- the outcome of each request if the shapes were sent now, in order, each after the engine has taken the
  previous one:

  1. refused, INVALID_ARGUMENT, when the server's limits or the engine's admission check refuse the shape
     (the same message and parameter as a real request gets), or UNAVAILABLE while the server drains;
  2. refused, RESOURCE_EXHAUSTED, when ``max_queue`` requests are already waiting;
  3. admitted when nobody waits ahead of it (strict FIFO), a batch slot is free and its blocks at admission are
     free (on demand: with the watermark left while others run);
  4. queued otherwise: it runs once running requests finish and release their blocks.

Pure: the engine hands in a snapshot of its pool and queue (taken on its own thread, so it is consistent);
``quant estimate --requests`` hands in an empty engine built from a model config and a memory budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from server.kv_pool import group_blocks, shared_blocks
from server.outputs import RequestError
from server.scheduler import ON_DEMAND, admission_blocks, admission_headroom

MAX_SHAPES = 256  # shapes per plan
MAX_REQUESTS = 65536  # requests per plan, all shapes together (the outcome walk is one step per request)

ADMITTED, QUEUED, REFUSED = "admitted", "queued", "refused"


@dataclass(frozen=True)
class Shape:
    prompt_tokens: int
    max_new_tokens: int
    count: int = 1
    n: int = 1  # samples per request (they share the prompt's full blocks before its last token's block)
    expected_new_tokens: int = 0  # new tokens a request is expected to produce (0: max_new_tokens)

    @property
    def expected(self) -> int:
        return self.expected_new_tokens or self.max_new_tokens


def validate(shapes: list[Shape]) -> list[Shape]:
    """Raise RequestError naming the first bad field (``requests[1].count``); the plan's own bounds, not the server's (those are outcomes)."""
    if not shapes:
        raise RequestError("requests", "requests must list at least one request shape")
    if len(shapes) > MAX_SHAPES:
        raise RequestError("requests", f"at most {MAX_SHAPES} request shapes per plan, got {len(shapes)}")
    for i, s in enumerate(shapes):
        for name in ("prompt_tokens", "max_new_tokens", "count", "n"):
            v = getattr(s, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise RequestError(f"requests[{i}].{name}", f"requests[{i}].{name} must be an integer >= 1, got {v!r}")
        e = s.expected_new_tokens
        if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e <= s.max_new_tokens:
            raise RequestError(f"requests[{i}].expected_new_tokens", f"requests[{i}].expected_new_tokens must be an "
                                                                     f"integer in [0, max_new_tokens], got {e!r}")
    total = sum(s.count for s in shapes)
    if total > MAX_REQUESTS:
        raise RequestError("requests", f"at most {MAX_REQUESTS} requests per plan in all, got {total}")
    return shapes


def check_max_new_tokens(max_new_tokens: int, limit: int) -> None:
    """A server's limit on max_new_tokens (server.config.Limits): RequestError naming the parameter."""
    if max_new_tokens > limit:
        raise RequestError("max_new_tokens", f"max_new_tokens must be <= {limit} on this server, got {max_new_tokens}")


def check_prompt_tokens(prompt_tokens: int, limit: int) -> None:
    """A server's limit on prompt tokens (its --max-prompt-tokens, or the context): RequestError naming it."""
    if prompt_tokens > limit:
        raise RequestError("prompt", f"prompt has {prompt_tokens} tokens; this server takes at most {limit}")


def check_limits(prompt_tokens: int, max_new_tokens: int, max_new_tokens_limit: int, max_prompt_tokens: int) -> None:
    """Both limits, in the order a request meets them (its parameters are checked before its prompt)."""
    check_max_new_tokens(max_new_tokens, max_new_tokens_limit)
    check_prompt_tokens(prompt_tokens, max_prompt_tokens)


def check_shape(prompt_tokens: int, max_new_tokens: int, context_length: int, num_blocks: int, layout) -> None:
    """The engine's admission checks that need no queue state (``layout``: the KV pool's KVLayout): raise
    RequestError naming the parameter and giving the numbers."""
    n, m = prompt_tokens, max_new_tokens
    if n == 0:
        raise RequestError("prompt", "prompt is empty")
    if n >= context_length:
        raise RequestError("prompt", f"prompt has {n} tokens; the model's context is {context_length}")
    if n + m > context_length:
        raise RequestError(
            "max_new_tokens",
            f"prompt ({n} tokens) + max_new_tokens ({m}) = {n + m} exceeds the model's context "
            f"of {context_length} tokens",
        )
    need = layout.sample_blocks(n + m)
    if need > num_blocks:
        raise RequestError(
            "max_new_tokens",
            f"prompt ({n}) + max_new_tokens ({m}) needs {need} KV blocks = {need * layout.bytes_per_block} "
            f"bytes; the whole KV pool is {num_blocks} blocks = {num_blocks * layout.bytes_per_block} bytes",
        )


def check_n(n: int, prompt_tokens: int, max_new_tokens: int, max_batch: int, num_blocks: int,
            block_size: int, tail_blocks: int) -> None:
    """The engine's admission check of a request's ``n`` (after :func:`check_shape`): RequestError naming it."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_batch:
        raise RequestError("n", f"n must be an integer in [1, {max_batch}] (--max-batch), got {n!r}")
    need = group_blocks(prompt_tokens, prompt_tokens + max_new_tokens, n, block_size, tail_blocks)
    if n > 1 and need > num_blocks:
        raise RequestError("n", f"{n} samples of {prompt_tokens} prompt + {max_new_tokens} new tokens need {need} KV "
                                f"blocks with the prompt's shared; the pool has {num_blocks}")


@dataclass(frozen=True)
class EngineState:
    """What admission depends on, at one moment."""

    num_blocks: int
    free_blocks: int
    block_size: int
    bytes_per_block: int
    running: int
    max_batch: int
    max_prefill_tokens: int
    waiting: tuple[tuple[int, int], ...]  # (blocks at admission, samples) of each waiting entry, in queue order
    queued: int  # accepted and not yet admitted (>= len(waiting): also those still on their way in)
    max_queue: int
    admission: str = ON_DEMAND  # --kv-admission
    watermark_blocks: int = 0  # on demand: blocks an admission leaves free while others run
    tail_blocks: int = 0  # blocks each running sample holds besides its table (KVLayout.tail_blocks: int4's tail)

    @classmethod
    def empty(cls, num_blocks: int, block_size: int, bytes_per_block: int, max_batch: int,
              max_prefill_tokens: int, max_queue: int, admission: str = ON_DEMAND,
              watermark_blocks: int = 0, tail_blocks: int = 0) -> "EngineState":
        return cls(num_blocks, num_blocks, block_size, bytes_per_block, 0, max_batch, max_prefill_tokens, (), 0,
                   max_queue, admission, watermark_blocks, tail_blocks)

    def headroom(self, running: int) -> int:
        """Blocks an admission must leave free with ``running`` samples running (the scheduler's rule)."""
        return admission_headroom(self.admission, self.watermark_blocks, running)

    def admission_blocks(self, prompt_tokens: int, max_new_tokens: int, n: int) -> int:
        """Blocks a request of this shape takes when admitted (nothing cached)."""
        return admission_blocks(self.admission, prompt_tokens, max_new_tokens, n, self.block_size, self.tail_blocks)

    def written_blocks(self, prompt_tokens: int, new_tokens: int) -> int:
        """Blocks a sample holds once it produced ``new_tokens`` (>= 1): on demand those of the positions written,
        the last token's never; with reserve its whole reservation. Its tail's blocks included."""
        if self.admission != ON_DEMAND:
            return math.ceil((prompt_tokens + new_tokens) / self.block_size) + self.tail_blocks
        return math.ceil((prompt_tokens + new_tokens - 1) / self.block_size) + self.tail_blocks


@dataclass(frozen=True)
class Refusal:
    code: str  # INVALID_ARGUMENT, RESOURCE_EXHAUSTED or UNAVAILABLE: what a real request gets
    message: str
    param: str | None = None


@dataclass(frozen=True)
class ShapePlan:
    shape: Shape
    kv_blocks: int  # per request: its samples' blocks in the pool, those they share counted once
    kv_bytes_reserved: int  # per sample: what each sample's Accounting.kv_bytes_reserved reports
    activation_peak_bytes: int
    fit_now: int
    fit_now_limited_by: str  # "kv_blocks", "max_batch", or "refused" (the shape itself is refused)
    fit_empty: int
    fit_empty_limited_by: str
    admitted: int
    queued: int
    refused: int
    refusal: Refusal | None = None  # why the refused ones were refused (the first reason met)
    kv_blocks_shared: int = 0  # per request of n > 1: the blocks all its samples hold (counted once in kv_blocks)
    kv_blocks_admission: int = 0  # per request: the blocks it takes when admitted
    kv_blocks_expected: int = 0  # per request, at the expected output length (on demand; reserve: kv_blocks)
    fit_expected: int = 0  # how many an idle engine runs at once when each produces the expected tokens ...
    fit_expected_limited_by: str = ""  # ... limited by kv_blocks or max_batch


@dataclass(frozen=True)
class PlanResult:
    shapes: tuple[ShapePlan, ...]
    state: EngineState
    outcomes: tuple[str, ...] = field(default=())  # one per request, in the order sent


def _fit(blocks_free: int, slots_free: int, need: int, n: int) -> tuple[int, str]:
    by_kv, by_batch = blocks_free // need, slots_free // n
    return (by_kv, "kv_blocks") if by_kv <= by_batch else (by_batch, "max_batch")


def prefill_peak(prompt_tokens: int, chunk: int, estimate: Callable[[int, int], int]) -> int:
    """Largest ``estimate(chunk_tokens, past)`` over a prompt prefilled alone, ``chunk`` tokens per step."""
    return max(estimate(min(chunk, prompt_tokens - start), start) for start in range(0, prompt_tokens, chunk))


def plan(shapes: list[Shape], state: EngineState, check: Callable[[int, int], Refusal | None],
         estimate: Callable[[int, int], int]) -> PlanResult:
    """``check(prompt_tokens, max_new_tokens)``: the Refusal a request of that shape gets before queueing
    (limits, context, a pool too small), or None; ``estimate(chunk_tokens, past)``: the activation estimate."""
    validate(shapes)
    free, running, queued = state.free_blocks, state.running, state.queued
    waiting = list(state.waiting)
    # What the engine's next admission does with the requests already waiting.
    while waiting and running + waiting[0][1] <= state.max_batch and \
            waiting[0][0] + state.headroom(running) <= free:
        blocks, samples = waiting.pop(0)
        free -= blocks
        running += samples
        queued -= 1
    ahead = len(waiting)  # still waiting: FIFO keeps every new request behind them
    out, outcomes = [], []
    for s in shapes:
        per_sample = state.written_blocks(s.prompt_tokens, s.max_new_tokens)
        need = group_blocks(s.prompt_tokens, s.prompt_tokens + s.max_new_tokens, s.n, state.block_size,
                            state.tail_blocks)
        admit = state.admission_blocks(s.prompt_tokens, s.max_new_tokens, s.n)
        expected = need if state.admission != ON_DEMAND else group_blocks(
            s.prompt_tokens, s.prompt_tokens + s.expected - 1, s.n, state.block_size, state.tail_blocks)
        refusal = check(s.prompt_tokens, s.max_new_tokens)  # None: the shape itself is servable
        if refusal is None:
            try:
                check_n(s.n, s.prompt_tokens, s.max_new_tokens, state.max_batch, state.num_blocks, state.block_size,
                        state.tail_blocks)
            except RequestError as e:
                refusal = Refusal("INVALID_ARGUMENT", str(e), e.param)
        servable = refusal is None
        if servable:
            fit_now = _fit(state.free_blocks, state.max_batch - state.running, need, s.n)
            fit_empty = _fit(state.num_blocks, state.max_batch, need, s.n)
            fit_expected = _fit(state.num_blocks, state.max_batch, max(expected, 1), s.n)
        else:
            fit_now = fit_empty = fit_expected = (0, "refused")
        counts = {ADMITTED: 0, QUEUED: 0, REFUSED: 0}
        for _ in range(s.count):
            if not servable:
                o = REFUSED
            elif queued >= state.max_queue:
                o = REFUSED
                refusal = Refusal("RESOURCE_EXHAUSTED", f"overloaded: {queued} requests are already waiting "
                                                        f"(--max-queue {state.max_queue})")
            elif ahead == 0 and running + s.n <= state.max_batch and admit + state.headroom(running) <= free:
                o, free, running = ADMITTED, free - admit, running + s.n
            else:
                o, queued, ahead = QUEUED, queued + 1, ahead + 1
            counts[o] += 1
            outcomes.append(o)
        peak = prefill_peak(s.prompt_tokens, state.max_prefill_tokens, estimate) if servable else 0
        out.append(ShapePlan(
            s, need, per_sample * state.bytes_per_block, peak, *fit_now, *fit_empty,
            counts[ADMITTED], counts[QUEUED], counts[REFUSED], refusal if counts[REFUSED] else None,
            shared_blocks(s.prompt_tokens, state.block_size) if s.n > 1 else 0, admit, expected, *fit_expected,
        ))
    return PlanResult(tuple(out), state, tuple(outcomes))


def to_dict(result: PlanResult, weight_bytes: int, kv_bytes_per_token: int, attention: str, kv_dtype: str) -> dict:
    """The plan as the wire gives it: the fields and names of quantserve.v1.PlanResponse (the HTTP body as is;
    the gRPC message parsed from it, so the two cannot drift apart)."""
    st = result.state

    def shape_plan(p: ShapePlan) -> dict:
        d = {
            "shape": {"prompt_tokens": p.shape.prompt_tokens, "max_new_tokens": p.shape.max_new_tokens,
                      "count": p.shape.count, "n": p.shape.n, "expected_new_tokens": p.shape.expected},
            "kv_blocks": p.kv_blocks, "kv_blocks_shared": p.kv_blocks_shared, "kv_bytes_reserved": p.kv_bytes_reserved,
            "activation_peak_bytes": p.activation_peak_bytes,
            "fit_now": p.fit_now, "fit_now_limited_by": p.fit_now_limited_by,
            "fit_empty": p.fit_empty, "fit_empty_limited_by": p.fit_empty_limited_by,
            "admitted": p.admitted, "queued": p.queued, "refused": p.refused,
            "kv_blocks_admission": p.kv_blocks_admission, "kv_blocks_expected": p.kv_blocks_expected,
            "fit_expected": p.fit_expected, "fit_expected_limited_by": p.fit_expected_limited_by,
        }
        if p.refusal is not None:
            d["refusal"] = {"code": p.refusal.code, "message": p.refusal.message, "param": p.refusal.param or ""}
        return d

    return {
        "shapes": [shape_plan(p) for p in result.shapes],
        "engine": {
            "weight_bytes": weight_bytes, "kv_capacity_bytes": st.num_blocks * st.bytes_per_block,
            "kv_used_bytes": (st.num_blocks - st.free_blocks) * st.bytes_per_block, "kv_block_size": st.block_size,
            "running": st.running, "queued": st.queued,
        },
        "kv_bytes_per_token": kv_bytes_per_token, "kv_capacity_blocks": st.num_blocks,
        "kv_free_blocks": st.free_blocks, "max_batch": st.max_batch, "max_queue": st.max_queue,
        "max_prefill_tokens": st.max_prefill_tokens, "attention": attention, "kv_admission": st.admission,
        "kv_dtype": kv_dtype,
    }


def offline(spec: str | None, cache_dir, shapes: list[Shape], dtype: str | None = None,
            memory_budget: str | None = None, max_batch: int | None = None, max_queue: int | None = None,
            max_prefill_tokens: int | None = None, max_new_tokens_limit: int | None = None,
            max_prompt_tokens: int | None = None, kv_admission: str | None = None,
            kv_dtype: str | None = None) -> dict:
    """The plan an idle ``quant serve SPEC`` with these settings (None: serve's default) would answer, from the
    model's config alone (no weights are loaded): ``quant estimate --requests``. The activation peak counts no
    dequantization transients (the live plan measures those of a weight-only artifact's layers above their
    kernel's row limit), which the result's ``note`` says when the model is quantized."""
    import torch
    from transformers import AutoConfig

    from quant.format import sources as models
    from quant.shape.memory import dtype_bytes, engine_prefill_bytes
    from quant.shape.model import ModelShape
    from server import attention, fastops
    from server.config import EngineConfig, Limits
    from server.kv_pool import KVLayout, resolve_budget
    from server.runner import glue_ops_choice

    given = {"dtype": dtype, "memory_budget": memory_budget, "max_batch": max_batch, "max_queue": max_queue,
             "max_prefill_tokens": max_prefill_tokens, "kv_admission": kv_admission, "kv_dtype": kv_dtype}
    cfg = EngineConfig(**{k: v for k, v in given.items() if v is not None}).validate()
    limits = Limits(**{k: v for k, v in (("max_new_tokens", max_new_tokens_limit),
                                         ("max_prompt_tokens", max_prompt_tokens)) if v is not None}).validate()
    source = models.resolve(spec, cache_dir, fingerprint=False)
    mcfg = AutoConfig.from_pretrained(source.path)
    models_shape = ModelShape.from_config(mcfg)
    torch_dtype = getattr(torch, cfg.dtype)
    layout = KVLayout.from_config(mcfg, torch_dtype, cfg.kv_block_size, cfg.kv_format)
    num_blocks = resolve_budget(cfg.memory_budget, cfg.device) // layout.bytes_per_block
    context = int(mcfg.max_position_embeddings)
    prompt_limit = min(limits.max_prompt_tokens or context, context)
    device = torch.device(cfg.device)
    glue = fastops.MEMORY_KIND[fastops.kind_of(glue_ops_choice(torch_dtype, torch_dtype, device, cfg.fused_ops))]

    def check(n: int, m: int) -> Refusal | None:  # Service.refusal's order, less the drain
        try:
            check_limits(n, m, limits.max_new_tokens, prompt_limit)
            check_shape(n, m, context, num_blocks, layout)
        except RequestError as e:
            return Refusal("INVALID_ARGUMENT", str(e), e.param)
        return None

    def estimate(chunk: int, past: int) -> int:
        return engine_prefill_bytes(models_shape, chunk, dtype_bytes(torch_dtype), glue, past=past)

    state = EngineState.empty(num_blocks, layout.block_size, layout.bytes_per_block, cfg.max_batch,
                              cfg.max_prefill_tokens, cfg.max_queue, cfg.kv_admission,
                              math.ceil(cfg.kv_watermark * num_blocks), layout.tail_blocks)
    out = to_dict(plan(shapes, state, check, estimate), 0, layout.bytes_per_token, attention.choose(device).name,
                  layout.kv_dtype)
    del out["engine"]["weight_bytes"]  # the live server's figure; not predicted here (quant estimate gives W)
    quantized = getattr(mcfg, "quantization_config", None) is not None or (Path(source.path) /
                                                                           "quant_manifest.json").is_file()
    out["note"] = ("activation peaks exclude dequantization transients of weight-only layers above their kernel's "
                   "row limit; the live server's plan includes them" if quantized else "")
    return out


def estimate_command(args, console, cache_dir) -> int:
    """`quant estimate --requests` (quant/cli.py parses it and hands it here when it runs, as it hands over
    `quant serve`): :func:`offline`, printed as quant-client prints a live plan."""
    import json

    from quantserve.client.render import plan_table
    from quantserve.client.types import parse_shape, plan_from_dict

    from quant.errors import ConfigError

    try:
        shapes = [Shape(s.prompt_tokens, s.max_new_tokens, s.count, s.n, s.expected_new_tokens)
                  for s in map(parse_shape, args.requests.split(","))]
        result = offline(args.model, cache_dir, shapes, dtype=args.dtype, memory_budget=args.memory_budget,
                         max_batch=args.max_batch, max_queue=args.max_queue, max_prefill_tokens=args.max_prefill_tokens,
                         kv_admission=getattr(args, "kv_admission", None), kv_dtype=getattr(args, "kv_dtype", None))
    except ValueError as e:  # RequestError (a bad shape, named), a bad setting, a bad budget
        raise ConfigError(f"--requests: {e}" if isinstance(e, RequestError) else str(e)) from None
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    console.print(plan_table(plan_from_dict(result), f"offline, {args.dtype}, idle engine"))
    if result["note"]:
        console.print(result["note"])
    return 0
