"""Memory accounting: what each response reports (its KV blocks and bytes, own and shared, its activation peak),
the engine's totals, the activation estimate of a step, and the KV pool's budget from a fraction of free memory.
The figures come from the pool's layout and the memory model (``quant.shape.memory``), never from a scheme."""

from __future__ import annotations

from typing import Callable

import torch

from quant.shape.memory import decode_attention_scratch, dtype_bytes, engine_prefill_bytes
from server import capacity
from server.kv_pool import KVBudgetError, free_memory
from server.outputs import Accounting, EngineTotals
from server.runner import SCORE_ROWS
from server.scheduler import admission_blocks


def engine_totals(pool, layout, weight_bytes: int, scheduler, queued: int, draft=None) -> EngineTotals:
    """The engine's memory and counters now (``draft``: its draft model, server/draft.py)."""
    bpb = layout.bytes_per_block
    return EngineTotals(
        weight_bytes=weight_bytes, kv_capacity_bytes=pool.capacity_bytes, kv_used_bytes=pool.used_blocks * bpb,
        kv_block_size=layout.block_size, running=len(scheduler.running), queued=queued,
        kv_cached_bytes=pool.cached_blocks * bpb, prefix_cache=pool.prefix_cache, prefix_hit_tokens=pool.hit_tokens,
        prefix_queried_tokens=pool.queried_tokens, prefix_evictions=pool.evictions,
        preemptions=scheduler.preemptions, recomputed_tokens=scheduler.recomputed_tokens,
        speculated_tokens=scheduler.speculated_tokens, accepted_tokens=scheduler.accepted_tokens,
        draft_weight_bytes=draft.weight_bytes if draft else 0,
        draft_kv_capacity_bytes=draft.pool.capacity_bytes if draft else 0,
    )


def request_accounting(seq, layout, attention: str, totals: EngineTotals,
                       draft_bytes_per_block: int | None = 0) -> Accounting:
    """A request's (one sample's) memory as its final event reports it (``draft_bytes_per_block``: of a draft
    model's KV pool, server/draft.py)."""
    bpt, bpb = layout.bytes_per_token, layout.bytes_per_block
    reserved_blocks = seq.peak_blocks
    return Accounting(
        prompt_tokens=len(seq.prompt), generated_tokens=len(seq.generated), kv_bytes_per_token=bpt,
        kv_blocks_reserved=reserved_blocks, kv_bytes_reserved=reserved_blocks * bpb,
        kv_bytes_used=seq.kv_tokens * bpt, activation_peak_bytes=seq.activation_peak,
        attention=attention, engine=totals,
        kv_bytes_shared=seq.shared_blocks * bpb, kv_bytes_own=(reserved_blocks - seq.shared_blocks) * bpb,
        prompt_tokens_cached=seq.cached, kv_dtype=layout.kv_dtype,
        preemptions=seq.preemptions, recomputed_tokens=seq.recomputed_tokens,
        speculated_tokens=seq.spec.proposed if seq.spec else 0, accepted_tokens=seq.spec.accepted if seq.spec else 0,
        kv_bytes_speculative=seq.spec_peak_blocks * bpb,
        kv_bytes_draft=seq.draft_peak_blocks * (draft_bytes_per_block or 0),
    )


def activation_estimate(shape, dtype: torch.dtype, runner, chunk_tokens: int, past: int = 0, scored: int = 0) -> int:
    """Estimated activation peak of a step that prefills a chunk of this many tokens after ``past`` cached
    ones (quant.shape.memory.engine_prefill_bytes, the runner's own model, with its glue ops and the measured
    dequantization transients of this model's projections). ``scored``: rows of it whose next token is scored
    (prompt logprobs): the runner forms their logits SCORE_ROWS at a time, each row's in the head's output and
    its fp32 log-softmax, counted as two more sampled rows each."""
    return engine_prefill_bytes(
        shape, chunk_tokens, dtype_bytes(dtype), runner.ops.memory,
        past=past, sampled=1 + 2 * min(scored, SCORE_ROWS),
        transients=runner.projection_transients(chunk_tokens),
    )


def step_workspace(estimate: Callable[..., int], max_prefill_tokens: int, max_batch: int,
                   fused_shape=None) -> int:
    """The activations of the largest step: a prefill of max_prefill_tokens (scoring its prompt rows), or the
    decode of max_batch rows (with ``fused_shape``, the model's shape where the CPU's fused decode attention runs,
    the parts that kernel keeps beside them)."""
    scratch = 0 if fused_shape is None else decode_attention_scratch(fused_shape, max_batch)
    return max(estimate(max_prefill_tokens, scored=SCORE_ROWS), estimate(max_batch) + scratch)


def fraction_budget(device: torch.device, fraction: float, workspace: int, config) -> int:
    """The pool's bytes for a fractional --memory-budget: that fraction of the memory free now, refused in one
    line when it would not leave the workspace of the largest step (a prefill of max_prefill_tokens, or the
    decode of max_batch rows)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    free = free_memory(device)
    budget = int(free * fraction)
    if free - budget < workspace:
        most = max(0.0, (free - workspace) / free)
        raise KVBudgetError(
            f"--memory-budget {config.memory_budget} of {free / 2**20:.0f} MiB free leaves "
            f"{(free - budget) / 2**20:.0f} MiB for the activations of one step, which need "
            f"{workspace / 2**20:.0f} MiB (--max-prefill-tokens {config.max_prefill_tokens}); use at most "
            f"{most:.2f} or fewer prefill tokens")
    return budget


def engine_state(usable_blocks: int, pool, layout, scheduler, config, queued: int) -> capacity.EngineState:
    """A snapshot of the pool and the queue for a capacity plan (server/capacity.py), taken between steps."""
    waiting = []
    for s in scheduler.waiting:
        if s.preemptions:  # taken back alone, its prompt and generated tokens recomputed
            waiting.append((layout.sample_blocks(len(s.prompt) + len(s.generated)), 1))
        else:
            n = len(scheduler.unit(s))
            waiting.append((admission_blocks(scheduler.admission, len(s.prompt), s.params.max_new_tokens, n,
                                             layout.block_size, layout.tail_blocks), n))
    return capacity.EngineState(
        usable_blocks, pool.free_blocks, layout.block_size, layout.bytes_per_block, len(scheduler.running),
        config.max_batch, config.max_prefill_tokens, tuple(waiting), queued, config.max_queue, scheduler.admission,
        scheduler.watermark_blocks, layout.tail_blocks,
    )
