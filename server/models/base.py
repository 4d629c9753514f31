"""The decoder-only causal LM the engine runs, built from ``server.layers``; architecture files subclass it.

A step is a flat batch of T tokens (``server.batch.StepInputs``). Per layer, with the norms a family has:

    x, h = attn_in.add(x, delta)            # the residual add folded into the next norm (delta: pending output)
    a = attn_out(attention(h)) * r          # r: Granite's residual multiplier, else 1
    x, h = mlp_in.add(x, a)
    delta = mlp_out(mlp(h)) * r

Llama-style models have attn_in (input_layernorm) and mlp_in (post_attention_layernorm); Gemma 2/3 add the
norms on each sub-layer's output; OLMo 2 has only those. After the last layer only the sampled rows go
through the final norm and the head.

A subclass states what its family needs as class attributes (weight names, norms, q/k norm kind, norm offset)
and hooks over the config (attention scale, window and soft-cap per layer, embedding scale, residual
multiplier, logit post-processing); ``server/models/__init__.py`` says how to add one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from quant.errors import UnsupportedModelError
from server.attention.base import AttentionSpec
from server.batch import StepInputs
from server.layers.embedding import embedding_and_head
from server.layers.linear import Projections
from server.layers.linear import bind as bind_module
from server.layers.mlp import GatedMLP, act_op
from server.layers.norm import RMSNorm
from server.layers.rotary import Rotary


class Weights:
    """Named modules and tensors of a loaded checkpoint: the module tree quant's loader (artifacts, with every
    scheme's runtime modules swapped in) or transformers (plain model dirs) built, tensors memory-mapped."""

    def __init__(self, model: nn.Module):
        self.model = model

    def module(self, name: str) -> nn.Module:
        try:
            return self.model.get_submodule(name)
        except AttributeError:
            raise UnsupportedModelError(
                f"{self.model.config.model_type} checkpoint has no module {name!r}; its layout is not the one "
                "the engine's model definition expects") from None

    def tensor(self, name: str) -> Tensor:
        mod, _, leaf = name.rpartition(".")
        t = getattr(self.module(mod), leaf, None)
        if not isinstance(t, Tensor):
            raise UnsupportedModelError(f"{self.model.config.model_type} checkpoint has no tensor {name!r}")
        return t.detach()

    def has(self, name: str) -> bool:
        try:
            self.model.get_submodule(name)
            return True
        except AttributeError:
            return False

    def tensors(self) -> list[Tensor]:
        """Parameters and persistent buffers (not rotary tables a module computed from the config)."""
        return [t for mod in self.model.modules()
                for t in [*mod.parameters(recurse=False),
                          *(b for n, b in mod.named_buffers(recurse=False) if n not in mod._non_persistent_buffers_set)]
                if t is not None]


def _storages(tensors) -> dict[int, int]:
    """Storage address -> bytes: views of one tensor count once."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


@dataclass(frozen=True)
class Norms:
    """Which norms a decoder layer has, by checkpoint name (None: absent)."""

    attn_in: str | None = "input_layernorm"
    attn_out: str | None = None
    mlp_in: str | None = "post_attention_layernorm"
    mlp_out: str | None = None


@dataclass
class _Layer:
    attn_in: RMSNorm | None
    attn_out: RMSNorm | None
    mlp_in: RMSNorm | None
    mlp_out: RMSNorm | None
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    qkv: object  # callable (T, hidden) -> (T, (H + 2 Hkv) * D)
    o: object  # callable (T, H * D) -> (T, hidden)
    mlp: GatedMLP
    spec: AttentionSpec
    rope: int  # index into the model's rotaries
    o_module: object = None  # the module computing o, and down (None where parts run apart)
    down_module: object = None
    # One-row calls (x, residual) -> (x', next norm of x'), x' = residual + out_norm(proj(x)) r, in the projection's
    # own launch where the module has them (a GPU's one-row kernels): o with attn_out and mlp_in, down with mlp_out
    # and the next layer's attn_in (the final norm); each norm where the family has it
    o_norm: object = None
    down_norm: object = None


def _enter(norm: RMSNorm | None, x: Tensor, delta: Tensor | None) -> tuple[Tensor, Tensor]:
    """(x + delta, the sub-layer's input): normed when the layer has an input norm, else the stream itself."""
    if norm is None:
        x = x if delta is None else x + delta
        return x, x
    return (x, norm(x)) if delta is None else norm.add(x, delta)


class CausalLM:
    # ---- what a family states (Llama's values here)
    prefix = "model."
    norms = Norms()
    norm_offset = 0.0  # Gemma: norms scale by (1 + w)
    qk_norm: str | None = None  # "head": RMSNorm over each head's D (Qwen3, Gemma 3); "proj": over H·D (OLMo 2)
    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")  # one name when the checkpoint fuses them
    o_proj = ("self_attn.o_proj",)
    gate_up = ("mlp.gate_proj", "mlp.up_proj")
    down = ("mlp.down_proj",)

    # ---- hooks over the config
    def activation(self, config) -> str:
        return getattr(config, "hidden_act", "silu")

    def layer_type(self, config, i: int) -> str | None:
        types = getattr(config, "layer_types", None)
        return types[i] if types else None

    def window(self, config, i: int) -> int | None:
        """Sliding window of layer i: per layer type where the config has them, else every layer's."""
        w = getattr(config, "sliding_window", None)
        lt = self.layer_type(config, i)
        if lt is not None:
            return w if lt == "sliding_attention" else None
        return w

    def attention_spec(self, config, i: int) -> AttentionSpec:
        return AttentionSpec(self.heads, self.kv_heads, self.head_dim, self.head_dim ** -0.5, self.window(config, i))

    def rope_layer_type(self, config, i: int) -> str | None:
        """Which entry of config.rope_parameters layer i uses (None: the one flat set)."""
        return None

    def embed_scale(self, config) -> float | Tensor | None:
        return None

    def residual_scale(self, config) -> float:
        return 1.0

    def finish_logits(self, logits: Tensor) -> Tensor:
        """(S, V) fp32 from the head -> what sampling sees (soft-capping, scaling)."""
        return logits

    # ---- construction
    def __init__(self, config, weights: Weights, ops, embeddings: str = "float", chooser=None):
        self.config = config
        self.weights = weights
        self.ops = ops
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        p = self.prefix
        embed = weights.tensor(f"{p}embed_tokens.weight")  # (V, hidden)
        self.dtype = embed.dtype
        self.projections = Projections(self.dtype, chooser)
        self.projections.prepare_kernels(self._all_modules())  # before binding: the paths depend on the layout
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        rope_keys: dict[str | None, int] = {}
        self.rotaries: list[Rotary] = []
        self.layers: list[_Layer] = []
        act = self.activation(config)
        op = act_op(act)  # refused here, before any layer, when it is not served
        for i in range(config.num_hidden_layers):
            lp = f"{p}layers.{i}."
            norm = lambda n: None if n is None else self._norm(f"{lp}{n}.weight", eps)  # noqa: E731
            rk = self.rope_layer_type(config, i)
            if rk not in rope_keys:
                rope_keys[rk] = len(self.rotaries)
                self.rotaries.append(Rotary(config, self.head_dim, rk))
            group = self.projections.bind_group
            gate_up, gated = self.projections.bind_gated("gate_up", [weights.module(lp + n) for n in self.gate_up], op)
            o, o_mod = group("o", [weights.module(lp + n) for n in self.o_proj])
            down, down_mod = group("down", [weights.module(lp + n) for n in self.down])
            self.layers.append(_Layer(
                attn_in=norm(self.norms.attn_in), attn_out=norm(self.norms.attn_out),
                mlp_in=norm(self.norms.mlp_in), mlp_out=norm(self.norms.mlp_out),
                q_norm=norm("self_attn.q_norm") if self.qk_norm else None,
                k_norm=norm("self_attn.k_norm") if self.qk_norm else None,
                qkv=self.projections.bind("qkv", [weights.module(lp + n) for n in self.qkv]), o=o,
                mlp=GatedMLP(gate_up, down, act, ops, gated), spec=self.attention_spec(config, i), rope=rope_keys[rk],
                o_module=o_mod, down_module=down_mod,
            ))
        self.norm = self._norm(f"{p}norm.weight", eps)
        self._one_row = self._bind_norm_epilogues()
        lm_head = weights.module("lm_head")
        plain = type(lm_head) is nn.Linear and lm_head.bias is None  # a matrix that int8 rows can stand for
        # lookup: (T,) -> (T, hidden); head: (S, hidden) -> (S, V); tied heads are the embedding's rows
        # A plain head served as stored is planned like the projections, without the fp32-upcast path (a transient
        # fp32 copy of the vocabulary matrix the budget does not count); int8 rows stand for it otherwise, and a
        # head the scheme quantized keeps its module's own rule.
        planned = embeddings == "float" and plain
        chooser = self.projections.chooser if planned else None
        head = bind_module(lm_head, self.dtype, chooser, upcast=False, max_rows=chooser and chooser.head_rows)
        self.lookup, self.head, self.embedding_tensors, self.replaced = embedding_and_head(
            embed, head, lm_head.weight.detach() if plain else None, embeddings, self.dtype, self.projections.chooser)
        self._embed_scale = self.embed_scale(config)
        self._residual = float(self.residual_scale(config))

    def _bind_norm_epilogues(self) -> bool:
        """Whether a one-row step can run every layer as "o, then the norms and residual add around it; down, then
        the same" in the projections' own launches (:meth:`_forward_one_row`): where every o and down has a norm
        epilogue (a GPU's one-row kernels), which takes each family's sub-layer output norm (Gemma 2/3, OLMo 2),
        residual multiplier (Granite) and next input norm, or none (OLMo 2)."""
        r = float(self.residual_scale(self.config))
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].attn_in if i + 1 < len(self.layers) else self.norm
            layer.o_norm = self.projections.normed(layer.o_module, layer.mlp_in, layer.attn_out, r)
            layer.down_norm = self.projections.normed(layer.down_module, nxt, layer.mlp_out, r)
        if not all(layer.o_norm is not None and layer.down_norm is not None for layer in self.layers):
            return False
        self.projections.normed_calls = 2 * len(self.layers)
        return True

    def _norm(self, name: str, eps: float) -> RMSNorm:
        return RMSNorm(self.weights.tensor(name), eps, self.ops, self.dtype, self.norm_offset)

    def _all_modules(self) -> list[nn.Module]:
        return list(self.weights.model.modules())

    @property
    def attention_specs(self) -> list[AttentionSpec]:
        return [layer.spec for layer in self.layers]

    def held_tensors(self) -> list[Tensor]:
        """Every weight tensor a step reads: the checkpoint's (less those replaced, a float embedding held as int8),
        the int8 embedding's, the fused projections'."""
        gone = {t.untyped_storage().data_ptr() for t in self.replaced}
        mods = self.projections.modules()
        return [*(t for t in self.weights.tensors() if t.untyped_storage().data_ptr() not in gone),
                *self.embedding_tensors, *(t for m in mods for t in [*m.parameters(), *m.buffers()])]

    def weight_bytes(self) -> int:
        """Weight memory held, each storage once (the fused projections' parts are views, or hold nothing)."""
        return sum(_storages(self.held_tensors()).values())

    def runtime_weight_bytes(self) -> int:
        """Weight bytes the projections hold beyond the loaded checkpoint's tensors (fused int4 projections, whose
        parts then hold nothing; int8 and dense parts are views of theirs). Gemma's 1 + w norm weights are not
        counted: they replace nothing and are a few KiB."""
        own = _storages(self.weights.tensors())
        mods = self.projections.modules()
        mine = _storages(t for m in mods for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])
        return sum(n for ptr, n in mine.items() if ptr not in own)

    # ---- forward
    @torch.inference_mode()
    def forward(self, step: StepInputs, backend, meta) -> Tensor:
        """Logits (S, V) fp32 for the rows in ``step.sample_index``."""
        x = self.lookup(step.input_ids)  # (T, hidden)
        if self._embed_scale is not None:
            x = x * self._embed_scale
        tables = [r.cos_sin(step.positions, self.dtype) for r in self.rotaries]  # (T, R) cos and sin each
        if self._one_row and x.shape[0] == 1 and step.score_index is None:
            return self._forward_one_row(x, tables, step, backend, meta)
        r = self._residual
        delta = None
        for i, layer in enumerate(self.layers):
            x, h = _enter(layer.attn_in, x, delta)
            a = self._attention(i, layer, h, tables[layer.rope], backend, meta)  # (T, hidden)
            if layer.attn_out is not None:
                a = layer.attn_out(a)
            if r != 1.0:
                a = a * r
            x, h = _enter(layer.mlp_in, x, a)
            del a  # freed before the MLP, the layer's activation peak
            delta = layer.mlp(h)  # (T, hidden)
            if layer.mlp_out is not None:
                delta = layer.mlp_out(delta)
            if r != 1.0:
                delta = delta * r
        if step.score_index is not None:  # prompt logprobs: the runner's head runs over these in slices
            _, step.scored = self.norm.add(x[step.score_index], delta[step.score_index])  # (P, hidden)
        idx = step.sample_index  # only the rows that are sampled go through the final norm and the head
        _, h = self.norm.add(x[idx], delta[idx])  # (S, hidden)
        return self.logits(h)  # (S, V)

    def logits(self, h: Tensor) -> Tensor:
        """fp32 logits (R, V) of final-normed hidden states (R, hidden)."""
        return self.finish_logits(self.head(h).float())

    def _forward_one_row(self, x: Tensor, tables, step: StepInputs, backend, meta) -> Tensor:
        """:meth:`forward` of one token (batch-1 decode) where every o and down ends in the norms and residual add
        around it inside its own launch (:meth:`_bind_norm_epilogues`): per layer the norms launch nothing of their
        own."""
        x, h = _enter(self.layers[0].attn_in, x, None)  # (1, hidden) each
        for i, layer in enumerate(self.layers):
            o = self._attention_heads(i, layer, h, tables[layer.rope], backend, meta)  # (1, H * D)
            x, h = layer.o_norm(o, x)  # x + attn_out(o(o)) r, and mlp_in of that (or the sum itself)
            g = layer.mlp.hidden(h)  # (1, I): act(gate) * up
            x, h = layer.down_norm(g, x)  # x + mlp_out(down(g)) r, and the next layer's attn_in (the final norm) of it
        return self.finish_logits(self.head(h[step.sample_index]).float())  # (S, V)

    def _attention(self, i: int, layer: _Layer, h: Tensor, cos_sin, backend, meta) -> Tensor:
        """Layer i's attention sub-layer output (T, hidden). A method of its own so that q/k/v and the attention
        output are freed before the MLP, the layer's activation peak (quant.shape.memory.engine_prefill_bytes)."""
        return layer.o(self._attention_heads(i, layer, h, cos_sin, backend, meta))

    def _attention_heads(self, i: int, layer: _Layer, h: Tensor, cos_sin, backend, meta) -> Tensor:
        """Layer i's attention before its output projection: (T, H * D)."""
        T, H, Hkv, D = h.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = layer.qkv(h)  # (T, (H + 2 Hkv) D)
        if self.qk_norm is None and (o := backend.decode_qkv(qkv, H, *cos_sin, i, meta)) is not None:
            return o  # a decode step in one call of the backend's
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)  # views of qkv
        if self.qk_norm == "proj":
            q, k = layer.q_norm(q), layer.k_norm(k)
        q, k, v = q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
        norms = (layer.q_norm, layer.k_norm) if self.qk_norm == "head" else None  # over each head, before the rotary
        cos, sin = cos_sin
        o = backend.forward_rotary(q, k, v, cos, sin, i, meta, norms)  # (T, H, D); q and k rotated (in place or not)
        return o.reshape(T, H * D)
