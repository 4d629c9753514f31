"""The model runner: one forward over a flat batch of tokens from many requests, against the paged KV pool.

gpt-fast style: the runner does not call transformers' forward (its per-call mask building, cache objects and
generic attention dispatch cost more than the math at batch 1 on a small model); it runs the decoder itself
over the model's own modules (embedding, RMSNorms, rotary embedding, and the Linears, which may be our
quantized runtime layers), so every scheme's kernels are used as loaded.

A step is a flat list of T tokens (one per decoding request, a chunk of prompt per prefilling request), so the
Linears see all of them as one (T, hidden) matrix and each weight is read once per step. Attention is per
request: each token's K/V is written to its slot in the pool (slot = block * block_size + offset), then each
request attends over its own slots. Decode rows are batched into one padded SDPA call; prefill chunks attend
causally to their past plus themselves.

Supported: decoder-only Llama-style models (llama, mistral without sliding window, qwen2 without sliding
window). Anything else is refused by name at load rather than run wrong.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quant.int4 import GPTQLinear
from quant.layers import WeightOnlyLinear
from server import fastops
from server.fuse import fuse_linears

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    pass


def attention_implementation(device: torch.device) -> str:
    """DESIGN.md: flash_attention_2 on CUDA when flash-attn is installed, else PyTorch SDPA."""
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


@dataclass
class StepInputs:
    """One step's flat batch. Decode rows come first (one token each), then prefill chunks."""

    input_ids: Tensor  # (T,) int64
    positions: Tensor  # (T,) int64
    slots: Tensor  # (T,) int64: where each token's K/V is written
    num_decode: int  # Bd: the first Bd tokens are single-token decode rows
    decode_slots: Tensor | None  # (Bd, Lmax) int64: every cached slot of each decode row, padded with 0
    decode_mask: Tensor | None  # (Bd, 1, 1, Lmax) bool: True where the slot is real
    chunks: list[tuple[int, int, Tensor | slice]]  # (start in T, length C, slots (past + C,) of the request)
    sample_index: Tensor  # (S,) int64: the token positions in T whose logits are returned
    # A lone decode row whose slots are one contiguous run attends to a view of the cache (no gather).
    decode_range: slice | None = None


def _slots_for(table: list[int], end: int, block_size: int) -> list[int]:
    """Slot indices of positions [0, end) for a request whose blocks are `table`."""
    return [table[p // block_size] * block_size + p % block_size for p in range(end)]


def _as_range(table: list[int], end: int, block_size: int) -> slice | None:
    """The slots of positions [0, end) as slice(a, a + end) when the blocks they use are consecutive (a
    fresh pool hands them out that way), else None. Decided on the block table, not per position."""
    used = table[: -(-end // block_size)]
    if used != list(range(used[0], used[0] + len(used))):
        return None
    return slice(used[0] * block_size, used[0] * block_size + end)


def build_step(decode: list[tuple[int, int, list[int]]], prefill: list[tuple[list[int], int, list[int], bool]],
               block_size: int, device: torch.device) -> StepInputs:
    """decode: (token, position, block table) per decoding request (it attends to positions 0..position).
    prefill: (chunk tokens, first position, block table, sample last?) per prefilling request.
    Sampled rows are returned in this order: every decode row, then each prefill chunk with sample=True."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    sample: list[int] = []
    dec_rows: list[list[int]] = []
    drange = _as_range(decode[0][2], decode[0][1] + 1, block_size) if len(decode) == 1 else None
    for token, p, table in decode:
        ids.append(token)
        pos.append(p)
        slots.append(table[p // block_size] * block_size + p % block_size)
        sample.append(len(ids) - 1)
        if drange is None:  # rows attending through a gather need every slot
            dec_rows.append(_slots_for(table, p + 1, block_size))
    chunks = []
    for tokens, start, table, want in prefill:
        s = _slots_for(table, start + len(tokens), block_size)
        t0 = len(ids)
        ids.extend(tokens)
        pos.extend(range(start, start + len(tokens)))
        slots.extend(s[start:])
        span = _as_range(table, len(s), block_size)
        chunks.append((t0, len(tokens), span or torch.tensor(s, dtype=torch.int64, device=device)))
        if want:
            sample.append(len(ids) - 1)
    i64 = dict(dtype=torch.int64, device=device)
    dslots = dmask = None
    if dec_rows:
        width = max(len(r) for r in dec_rows)
        dslots = torch.tensor([r + [0] * (width - len(r)) for r in dec_rows], **i64)  # (Bd, Lmax)
        lens = torch.tensor([len(r) for r in dec_rows], **i64)  # (Bd,)
        dmask = (torch.arange(width, device=device)[None, :] < lens[:, None])[:, None, None, :]  # (Bd,1,1,L)
    return StepInputs(
        input_ids=torch.tensor(ids, **i64),
        positions=torch.tensor(pos, **i64),
        slots=torch.tensor(slots, **i64),
        num_decode=len(decode),
        decode_slots=dslots,
        decode_mask=dmask,
        chunks=chunks,
        sample_index=torch.tensor(sample, **i64),
        decode_range=drange,
    )


class ModelRunner:
    """Runs a loaded causal LM's decoder over :class:`StepInputs` with K/V in a block pool's storage."""

    def __init__(self, model: nn.Module, kv_storage: Tensor, block_size: int, attn: str, fused_ops: bool = True):
        cfg = model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"the engine runs {', '.join(SUPPORTED_MODEL_TYPES)} models; this one is {cfg.model_type!r}"
            )
        if getattr(cfg, "use_sliding_window", False) or (
            cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None)
        ):
            raise UnsupportedModelError("sliding-window attention is not supported by the engine")
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = self.heads // self.kv_heads
        self.scale = self.layers[0].self_attn.scaling
        self.block_size = block_size
        self.attn = attn
        layers, two, blocks, bs, kvh, d = kv_storage.shape
        assert (layers, two, bs, kvh, d) == (len(self.layers), 2, block_size, self.kv_heads, self.head_dim)
        self.kv = kv_storage.view(layers, 2, blocks * bs, kvh, d)  # (L, 2, slots, Hkv, D)
        self.dtype = self.inner.embed_tokens.weight.dtype
        norms = [n for l in self.layers for n in (l.input_layernorm, l.post_attention_layernorm)] + [self.inner.norm]
        if any(getattr(n, "variance_epsilon", None) is None or getattr(n, "weight", None) is None for n in norms):
            raise UnsupportedModelError("the engine needs Llama-style RMSNorm layers (weight and variance_epsilon)")
        self.eps = float(self.inner.norm.variance_epsilon)
        # Projections that read the same input run as one matmul (server.fuse); W8A8 ones run apart.
        self.fused_groups = 0
        self.projections: dict[str, list[nn.Module]] = {"qkv": [], "o": [], "gate_up": [], "down": []}
        self._dequant_cache: dict[tuple, tuple[int, int]] = {}
        self._transients: dict[int, dict[str, int]] = {}
        self.qkv = [self._bind_group("qkv", [l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj])
                    for l in self.layers]
        self.gate_up = [self._bind_group("gate_up", [l.mlp.gate_proj, l.mlp.up_proj]) for l in self.layers]
        self.o_proj = [self._bind_group("o", [l.self_attn.o_proj]) for l in self.layers]
        self.down = [self._bind_group("down", [l.mlp.down_proj]) for l in self.layers]
        if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
            raise UnsupportedModelError(f"the engine runs SiLU-gated MLPs; this model uses {cfg.hidden_act!r}")
        # The fused glue ops (server.fastops) need one dtype across activations, norm weights and the cache.
        same_dtype = all(n.weight.dtype == self.dtype for n in norms) and kv_storage.dtype == self.dtype
        if not fused_ops:
            self.glue_ops = "eager (fused ops turned off)"
        elif kv_storage.device.type != "cpu":
            self.glue_ops = "eager (the fused kernels are CPU kernels)"
        elif not same_dtype:
            self.glue_ops = "eager (norm weights, activations and KV cache differ in dtype)"
        elif not fastops.load():
            self.glue_ops = f"eager ({fastops.unavailable_reason()})"
        else:
            self.glue_ops = "fused"
        self.ops = fastops.Ops(self.glue_ops == "fused")
        for m in self._gptq_modules():  # the kernels' scale/zero tables, built now rather than on a first request
            if m._packed is not None and self.dtype in (torch.bfloat16, torch.float16):
                m._scales_and_zeros(self.dtype)
        if attn == "flash_attention_2":
            from flash_attn import flash_attn_varlen_func

            self._flash = flash_attn_varlen_func

    def _bind_group(self, role: str, mods: list[nn.Module]):
        """One callable for projections that read the same input (fused into one matmul where possible)."""
        if len(mods) == 1:
            self.projections[role].append(mods[0])
            return _bind(mods[0])
        fused = fuse_linears(mods)
        if fused is not None:
            self.fused_groups += 1
            self.projections[role].append(fused)
            return _bind(fused)
        self.projections[role].extend(mods)
        parts = [_bind(m) for m in mods]
        return lambda h: torch.cat([p(h) for p in parts], dim=-1)

    # ------------------------------------------------------------------------------------ attention

    def _attend_sdpa(self, q: Tensor, kc: Tensor, vc: Tensor, step: StepInputs) -> Tensor:
        T = q.shape[0]
        out = q.new_empty(T, self.heads, self.head_dim)  # (T, H, D)
        bd = step.num_decode
        if step.decode_range is not None:  # one row, contiguous slots: attend to a view, no mask needed
            qd = q[:1].view(1, self.kv_heads, self.group, self.head_dim)  # (1, Hkv, g, D)
            k = kc[step.decode_range].transpose(0, 1)[None]  # (1, Hkv, L, D)
            v = vc[step.decode_range].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qd, k, v, scale=self.scale)
            out[:1] = o.reshape(1, self.heads, self.head_dim)
        elif bd:
            # One query per row, so the g query heads sharing a KV head can stand in for the query axis:
            # (Bd, Hkv, g, D) against (Bd, Hkv, L, D), no K/V repetition for GQA.
            qd = q[:bd].view(bd, self.kv_heads, self.group, self.head_dim)  # (Bd, Hkv, g, D)
            k = kc[step.decode_slots].transpose(1, 2)  # (Bd, Hkv, L, D)
            v = vc[step.decode_slots].transpose(1, 2)  # (Bd, Hkv, L, D)
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=step.decode_mask, scale=self.scale)
            out[:bd] = o.reshape(bd, self.heads, self.head_dim)
        for t0, c, slots in step.chunks:
            past = (slots.stop - slots.start if isinstance(slots, slice) else slots.shape[0]) - c
            qc = q[t0 : t0 + c].transpose(0, 1)[None]  # (1, H, C, D)
            k = kc[slots].transpose(0, 1)[None]  # (1, Hkv, past + C, D)
            v = vc[slots].transpose(0, 1)[None]
            if past == 0:
                o = F.scaled_dot_product_attention(qc, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                # Query i sits at position past + i and sees keys 0..past + i (causal, bottom-right aligned).
                qi = torch.arange(c, device=q.device)[:, None]
                kj = torch.arange(past + c, device=q.device)[None, :]
                mask = kj <= qi + past  # (C, past + C)
                o = F.scaled_dot_product_attention(qc, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[t0 : t0 + c] = o[0].transpose(0, 1)
        return out

    def _attend_flash(self, q: Tensor, kc: Tensor, vc: Tensor, step: StepInputs) -> Tensor:
        # Varlen FlashAttention over each request's gathered K/V; causal masks are bottom-right aligned,
        # which is exactly "query at position past + i sees keys <= past + i".
        bd = step.num_decode
        arange = lambda r: torch.arange(r.start, r.stop, device=q.device)  # noqa: E731
        if step.decode_range is not None:
            seqs_k = [arange(step.decode_range)]
        else:
            seqs_k = [step.decode_slots[i, : int(step.decode_mask[i].sum())] for i in range(bd)]
        seqs_k += [arange(s) if isinstance(s, slice) else s for _, _, s in step.chunks]
        q_lens = [1] * bd + [c for _, c, _ in step.chunks]
        idx = torch.cat(seqs_k)
        cu_q = torch.tensor([0] + q_lens, device=q.device).cumsum(0, dtype=torch.int32)
        cu_k = torch.tensor([0] + [len(s) for s in seqs_k], device=q.device).cumsum(0, dtype=torch.int32)
        return self._flash(
            q, kc[idx], vc[idx], cu_q, cu_k, max(q_lens), max(len(s) for s in seqs_k),
            softmax_scale=self.scale, causal=True,
        )

    # ------------------------------------------------------------------------------------ forward

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> Tensor:
        """Logits (S, V) fp32 for the tokens in ``step.sample_index``.

        Per layer: h = norm(x); x += attention(h); h = norm(x); x += down(silu(gate(h)) * up(h)). The residual
        add is folded into the next norm, so x is updated one op late (delta holds the pending output)."""
        ops, eps = self.ops, self.eps
        x = F.embedding(step.input_ids, self.inner.embed_tokens.weight)  # (T, hidden)
        cos, sin = self.inner.rotary_emb(x, step.positions[None])  # (1, T, D) each
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # (T, D)
        delta = None
        for i, layer in enumerate(self.layers):
            w_in, w_post = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
            if delta is None:
                h = ops.rms_norm(x, w_in, eps)  # (T, hidden)
            else:
                x, h = ops.add_rms_norm(x, delta, w_in, eps)
            x, h = ops.add_rms_norm(x, self._attention(i, h, cos, sin, step), w_post, eps)
            delta = self.down[i](ops.silu_mul(self.gate_up[i](h)))  # (T, hidden)
        idx = step.sample_index  # only the rows that are sampled go through the final norm and the head
        _, h = ops.add_rms_norm(x[idx], delta[idx], self.inner.norm.weight, eps)  # (S, hidden)
        return self.model.lm_head(h).float()  # (S, V)

    def _attention(self, i: int, h: Tensor, cos: Tensor, sin: Tensor, step: StepInputs) -> Tensor:
        """Layer i's attention sub-layer output (T, hidden). A method of its own so that q and the attention
        output are freed before the MLP, the layer's activation peak (quant.memory.engine_prefill_bytes)."""
        T = h.shape[0]
        q = self.ops.rope_store(self.qkv[i](h), cos, sin, self.kv[i], step.slots, self.heads, self.kv_heads)
        attend = self._attend_flash if self.attn == "flash_attention_2" else self._attend_sdpa
        o = attend(q, self.kv[i, 0], self.kv[i, 1], step)  # (T, H, D)
        return self.o_proj[i](o.reshape(T, self.heads * self.head_dim))

    def _gptq_modules(self) -> list[GPTQLinear]:
        mods = {id(m): m for m in self.model.modules() if isinstance(m, GPTQLinear)}
        mods.update({id(m): m for ms in self.projections.values() for m in ms if isinstance(m, GPTQLinear)})
        return list(mods.values())

    def runtime_weight_bytes(self) -> int:
        """Weight memory the runner holds beyond the model's own tensors (quant.memory.weight_report): fused
        projections that could not be views of their parts (GPTQ) and the int4 kernels' repacked weights and
        scale/zero tables. Counted by storage, so views of one tensor count once."""
        seen = {t.untyped_storage().data_ptr() for t in [*self.model.parameters(), *self.model.buffers()]}
        extra = 0
        tensors = [t for ms in self.projections.values() for m in ms
                   for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]]
        for m in self._gptq_modules():
            tensors += [m._packed] if m._packed is not None else []
            tensors += list(m._sz.values())
        for t in tensors:
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                extra += st.nbytes()
        return extra

    def projection_transients(self, rows: int) -> dict[str, int]:
        """Bytes each projection role holds beyond its output while it runs on ``rows`` rows: weight-only
        layers above their kernel's row limit (or without a kernel for this dtype) dequantize the weight
        first, peaking at D bytes before the matmul and holding the dequantized weight W during it, so the
        role adds max(W, D - output). D and W are measured once per layer shape with quant.memory's
        MemoryTracker (each scheme dequantizes with its own arithmetic; tracking it is exact)."""
        if rows not in self._transients:
            out = {}
            b = torch.empty((), dtype=self.dtype).element_size()
            for role, mods in self.projections.items():
                extra = [max(w, d - rows * m.out_features * b) for m in mods
                         if isinstance(m, WeightOnlyLinear) and not m.kernel_runs(rows, self.dtype)
                         for d, w in [self._dequant_peak(m)]]
                out[role] = max(extra, default=0)
            self._transients[rows] = out
        return self._transients[rows]

    def _dequant_peak(self, m: WeightOnlyLinear) -> tuple[int, int]:
        """(peak bytes while dequantizing, bytes of the dequantized weight) for m's shape and class."""
        key = (type(m).__name__, m.out_features, m.in_features)
        if key not in self._dequant_cache:
            from quant.memory import MemoryTracker

            with torch.inference_mode(), MemoryTracker() as mt:
                w = m.dequantized(self.dtype)
            self._dequant_cache[key] = (mt.peak, w.numel() * w.element_size())
        return self._dequant_cache[key]


def _bind(mod: nn.Module):
    """A direct call of a projection on a (M, K) contiguous input, without Module.__call__ and the reshapes
    a generic forward needs: the low-bit kernel when it takes this input, the module's own forward otherwise."""
    if type(mod) is nn.Linear:
        w, b = mod.weight, mod.bias
        return lambda x: F.linear(x, w, b)
    if isinstance(mod, WeightOnlyLinear) and mod.bias is None:
        kernel, runs = mod._kernel_matmul, mod.kernel_runs

        def call(x: Tensor) -> Tensor:
            return kernel(x) if runs(x.shape[0], x.dtype) else mod(x)

        return call
    return mod
