"""The model runner: prepares each step's flat batch and hands it to the model and its attention backend.

gpt-fast style: the engine does not call transformers' forward (its per-call mask building, cache objects and
generic attention dispatch cost more than the math at batch 1 on a small model); it runs its own model
definitions (``server.models``, built from ``server.layers`` over the loaded checkpoint's tensors and
quantized modules, so every scheme's kernels run as loaded), with attention from ``server.attention``.

A step is a flat list of T tokens (one per decoding request, a chunk of prompt per prefilling request), so the
Linears see all of them as one (T, hidden) matrix and each weight is read once per step. ``build_step`` turns
the scheduler's plan into that batch; the backend prepares its own per-step metadata from it once.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from quant.errors import UnsupportedModelError
from quant.runtime.int4 import use_int8_activations
from server import attention, fastops, models
from server.batch import StepInputs, stage
from server.cpu_graphs import CpuGraphs
from server.sampling import LOGPROB_FLOOR

SCORE_ROWS = 32  # prompt rows whose logits are formed at once when scoring a prompt (Engine: its memory estimate)


def build_step(decode: list[tuple[int, int, list[int]]], prefill: list[tuple[list[int], int, list[int], bool]],
               block_size: int, device: torch.device,
               feed: tuple[Tensor, list[int], list[int]] | None = None, score: list[int] | None = None,
               tails: list[list[int]] | None = None) -> StepInputs:
    """decode: (token, position, block table) per decoding request (it attends to positions 0..position).
    prefill: (chunk tokens, first position, block table, rows sampled) per prefilling request: its last rows
    sampled, 0 or 1 for a prompt's chunk (a bool will do), every row for a verification of drafts
    (server/speculate.py).
    feed: (tokens, rows, index): decode rows ``rows`` take their token from the device tensor ``tokens`` (the
    previous step's samples, not read back yet) at ``index``, in place of the token given for them.
    score: per prefill chunk, how many of its first rows have their next prompt token scored (prompt logprobs).
    tails: per decode row, then per prefill chunk, its sequence's tail blocks (an int4 pool's; StepInputs.tails).
    Sampled rows are returned in this order: every decode row, then each prefill chunk's sampled rows; scored
    rows in chunk order."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    sample: list[int] = []
    chunks = []
    for token, p, table in decode:
        ids.append(token)
        pos.append(p)
        slots.append(table[p // block_size] * block_size + p % block_size)
        sample.append(len(ids) - 1)
    scored: list[int] = []
    for c, (tokens, start, table, want) in enumerate(prefill):
        t0 = len(ids)
        if score and score[c]:
            scored.extend(range(t0, t0 + score[c]))
        ids.extend(tokens)
        pos.extend(range(start, start + len(tokens)))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + len(tokens)))
        chunks.append((t0, len(tokens), start, table))
        sample.extend(range(len(ids) - int(want), len(ids)))
    t, s, r = len(ids), len(sample), len(scored)
    rows, index = ([], []) if feed is None else feed[1:]
    # one copy for all index vectors
    flat = stage(ids + pos + slots + sample + scored + rows + index, torch.int64, device)
    if rows:  # on the device: nothing waits for the previous step's samples to be read back
        f = 3 * t + s + r
        flat[:t].index_copy_(0, flat[f: f + len(rows)], feed[0].index_select(0, flat[f + len(rows):]))
    return StepInputs(
        input_ids=flat[:t], positions=flat[t: 2 * t], slots=flat[2 * t: 3 * t], sample_index=flat[3 * t: 3 * t + s],
        decode=[(p, table) for _, p, table in decode], chunks=chunks, block_size=block_size, tails=tails,
        score_index=flat[3 * t + s: 3 * t + s + r] if r else None,
    )


def glue_ops_choice(dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device, wanted: bool) -> str:
    """The glue ops this model runs with (server.fastops.Ops): "fused" (the C++ CPU kernels) or "triton" (the
    Triton kernels, on CUDA) when they can run it, else "eager (why)"."""
    if not wanted:
        return "eager (fused ops turned off)"
    if dtype != kv_dtype:
        return "eager (activations and KV cache differ in dtype)"
    if device.type == "cuda":
        from server.attention.triton_paged import available

        why = available()
        return "triton" if why is None else f"eager ({why})"
    if device.type != "cpu":
        return f"eager (no fused kernels for {device.type})"
    if not fastops.load():
        return f"eager ({fastops.unavailable_reason()})"
    return "fused"


class ModelRunner:
    """Runs a loaded causal LM, through the engine's model definition for its architecture, over
    :class:`StepInputs` with K/V in a block pool's storage."""

    def __init__(self, model: nn.Module, kv_storage: Tensor, block_size: int, backend: str | None = None,
                 fused_ops: bool = True, embeddings: str = "float", chooser=None, glue: str | None = None,
                 kv_scales: Tensor | None = None, kv_rotation: tuple[int, int] = (0, 0),
                 kv_format: str | None = None, int4_activations: str = "float", cpu_graphs: bool = True):
        """glue: an Ops kind that overrides the choice (the tests run "triton" on a CPU under the interpreter).
        int4_activations: int8 puts every int4 projection on int8 activations (quant.runtime.int4), before binding.
        kv_format: the quantized format the pool holds (server.kv_pool.KVLayout.kv_format), or None; kv_scales: the
        pool's scales for int8 and fp8 (kv_storage then holds their codes); kv_rotation: their keys' and values'
        rotation blocks (KVLayout.rotation). int4 (kv_storage: the pool's units) has its own backend. cpu_graphs:
        steps of up to 64 rows replay their recorded ops from C++ where the fused CPU ops are loaded
        (server/cpu_graphs.py)."""
        dtype = model.get_input_embeddings().weight.dtype
        cache_dtype = dtype if kv_format else kv_storage.dtype  # codes are read in the model's dtype
        self.glue_ops = glue or glue_ops_choice(dtype, cache_dtype, kv_storage.device, fused_ops)
        self.ops = fastops.Ops(glue or fastops.kind_of(self.glue_ops))
        self._notes = [use_int8_activations(model)] if int4_activations == "int8" else []
        self.model = models.build(model, self.ops, embeddings, chooser)
        if kv_format == "int4":
            if backend not in (None, attention.Int4Backend.name):
                raise UnsupportedModelError(f"an int4 KV cache is read by the int4 attention backend, not {backend!r}")
            backend = attention.Int4Backend.name
        cls = attention.choose(kv_storage.device) if backend is None else attention.BACKENDS.get(backend)
        if cls is None:
            raise UnsupportedModelError(
                f"no attention backend {backend!r}; there are: {', '.join(attention.BACKENDS)}")
        specs = self.model.attention_specs
        why = cls.unsupported(specs)
        if why is not None:
            raise UnsupportedModelError(why)
        self.backend = cls(kv_storage, block_size, specs, self.ops, kv_scales=kv_scales, kv_rotation=kv_rotation)
        self.kv_rotation = kv_rotation
        self.attention = cls.name
        self.block_size = block_size
        self.graphs = None  # server.cuda_graphs.DecodeGraphs once enable_cuda_graphs captured them
        self._cpu_graphs = cpu_graphs and self.ops.fused and kv_storage.device.type == "cpu"
        self.cpu_graphs = CpuGraphs(self.model, self.backend) if self._cpu_graphs else None

    def use_kv_storage(self, kv_storage: Tensor, kv_scales: Tensor | None = None) -> None:
        """Attend over another pool's storage (the engine sizes its pool after building the runner); before any
        graph is captured, since graphs hold the storage they were captured with."""
        if self.graphs is not None:
            raise RuntimeError("use_kv_storage after the CUDA graphs were captured")
        self.backend = type(self.backend)(kv_storage, self.block_size, self.model.attention_specs, self.ops,
                                          kv_scales=kv_scales, kv_rotation=self.kv_rotation)
        self.cpu_graphs = CpuGraphs(self.model, self.backend) if self._cpu_graphs else None  # programs hold the pool

    def enable_cuda_graphs(self, max_batch: int, max_blocks: int, pad_block: int) -> str:
        """Capture the decode step's CUDA graphs (the engine calls this on CUDA); returns what was done, for the
        log."""
        if not hasattr(self.backend, "graph_meta"):
            return f"off (the {self.attention} backend does not support CUDA graphs)"
        from server.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(self.model, self.backend, self.block_size, max_batch, max_blocks, pad_block,
                              self.backend.kv.device)
        with torch.inference_mode():
            graphs.capture()
        self.graphs = graphs
        return f"decode batch buckets {','.join(map(str, graphs.buckets))}"

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> Tensor:
        """Logits (S, V) fp32 for the tokens in ``step.sample_index``: a captured graph's replay for decode-only
        steps that fit one (CUDA graphs; on a CPU the recorded program of its shape), else the eager forward (the
        reference)."""
        if self.graphs is not None and (b := self.graphs.bucket(step)) is not None:
            return self.graphs.run(step, b)
        if self.cpu_graphs is not None:
            return self.cpu_graphs.forward(step, self.backend.prepare(step))
        return self.model.forward(step, self.backend, self.backend.prepare(step))

    @torch.inference_mode()
    def score(self, hidden: Tensor, targets: Tensor, k: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Prompt logprobs from a step's scored rows: ``hidden`` (P, H) final-normed states, ``targets`` (P,) the
        prompt token each row predicts. The head runs over SCORE_ROWS rows at a time, so the logits never exceed
        (SCORE_ROWS, V) whatever the chunk; fp32 log-softmax of the model's own logits (no sampling control), at
        least LOGPROB_FLOOR as the sampler reports them. Returns (chosen (P,) fp32, top ids (P, k) int64, top
        logprobs (P, k) fp32; None when k = 0)."""
        chosen, ids, lps = [], [], []
        for i in range(0, hidden.shape[0], SCORE_ROWS):
            lp = torch.log_softmax(self.model.logits(hidden[i: i + SCORE_ROWS]), -1)  # (R, V) fp32
            chosen.append(lp.gather(1, targets[i: i + SCORE_ROWS, None])[:, 0].clamp_(min=LOGPROB_FLOOR))  # (R,)
            if k:
                top = lp.topk(min(k, lp.shape[1]), dim=-1)  # (R, k) each
                ids.append(top.indices)
                lps.append(top.values.clamp_(min=LOGPROB_FLOOR))
            del lp
        return torch.cat(chosen), (torch.cat(ids) if k else None), (torch.cat(lps) if k else None)

    # The engine's accounting reads these.
    @property
    def fused_groups(self) -> int:
        return self.model.projections.fused_groups

    @property
    def layers(self) -> list:
        return self.model.layers

    def kernel_notes(self) -> list[str]:
        return [*self._notes, *self.model.projections.describe()]

    def runtime_weight_bytes(self) -> int:
        return self.model.runtime_weight_bytes()

    def held_tensors(self) -> list[Tensor]:
        return self.model.held_tensors()

    def weight_bytes(self) -> int:
        return self.model.weight_bytes()

    def projection_transients(self, rows: int) -> dict[str, int]:
        return self.model.projections.transients(rows)
