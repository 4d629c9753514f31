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


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ModelRunner:
    """Runs a loaded causal LM's decoder over :class:`StepInputs` with K/V in a block pool's storage."""

    def __init__(self, model: nn.Module, kv_storage: Tensor, block_size: int, attn: str):
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
        self.intermediate = cfg.intermediate_size
        # Projections that read the same input run as one matmul (server.fuse); None: run them apart.
        self.qkv = [fuse_linears([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]) for l in self.layers]
        self.gate_up = [fuse_linears([l.mlp.gate_proj, l.mlp.up_proj]) for l in self.layers]
        if attn == "flash_attention_2":
            from flash_attn import flash_attn_varlen_func

            self._flash = flash_attn_varlen_func

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

    def _norm(self, norm: nn.Module, x: Tensor) -> Tensor:
        # LlamaRMSNorm's arithmetic (fp32 normalisation, cast, then the weight) in 3 kernels instead of 7.
        eps = getattr(norm, "variance_epsilon", None)
        if eps is None:
            return norm(x)
        return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> Tensor:
        """Logits (S, V) fp32 for the tokens in ``step.sample_index``."""
        T = step.input_ids.shape[0]
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        x = self.inner.embed_tokens(step.input_ids)  # (T, hidden)
        cos, sin = self.inner.rotary_emb(x, step.positions[None])  # (1, T, D) each
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # (T, 1, D)
        attend = self._attend_flash if self.attn == "flash_attention_2" else self._attend_sdpa
        for i, layer in enumerate(self.layers):
            sa, mlp = layer.self_attn, layer.mlp
            h = self._norm(layer.input_layernorm, x)  # (T, hidden)
            if self.qkv[i] is not None:
                qkv = self.qkv[i](h).view(T, H + 2 * Hkv, D)  # (T, H + 2Hkv, D)
            else:
                qkv = torch.cat([sa.q_proj(h), sa.k_proj(h), sa.v_proj(h)], -1).view(T, H + 2 * Hkv, D)
            qk = qkv[:, : H + Hkv]  # (T, H + Hkv, D): rotary on q and k in one pass
            qk = qk * cos + rotate_half(qk) * sin
            q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + Hkv :]  # (T, H, D), (T, Hkv, D), (T, Hkv, D)
            kc, vc = self.kv[i, 0], self.kv[i, 1]  # (slots, Hkv, D) each
            kc.index_copy_(0, step.slots, k.to(kc.dtype))
            vc.index_copy_(0, step.slots, v.to(vc.dtype))
            o = attend(q, kc, vc, step)  # (T, H, D)
            x = x + sa.o_proj(o.reshape(T, H * D))
            h = self._norm(layer.post_attention_layernorm, x)
            if self.gate_up[i] is not None:
                g, u = self.gate_up[i](h).split(self.intermediate, -1)  # (T, I) each
            else:
                g, u = mlp.gate_proj(h), mlp.up_proj(h)
            x = x + mlp.down_proj(mlp.act_fn(g) * u)
        x = self._norm(self.inner.norm, x[step.sample_index])  # (S, hidden): only the rows that are sampled
        return self.model.lm_head(x).float()  # (S, V)
