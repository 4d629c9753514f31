"""4-bit weights: the GPTQ checkpoint format on disk, PyTorch's int4 kernels at run time.

On disk (what transformers through gptqmodel, optimum and vLLM load), for W (N, K), G = K / group:
- `qweight` int32 (K/8, N): eight 4-bit codes per int32, packed LSB-first along the input dimension;
- `qzeros`  int32 (G, N/8): zero-points packed LSB-first along the output dimension, stored as
  zero - 1 in the v1 format (`checkpoint_format: "gptq"`) and as zero in v2 (`"gptq_v2"`);
- `scales`  fp16 (G, N);  `g_idx` int32 (K,): the group of each input column.
W[n, k] = scales[g_idx[k], n] * (code[k, n] - zero[g_idx[k], n]).

At load time the codes are repacked once for `aten._weight_int4pack_mm_for_cpu` (CPU) or
`aten._weight_int4pack_mm` (CUDA). Those kernels compute (code - 8) * s + z_f per group, so the
zero-point goes in the float domain: z_f = s * (8 - zero). The packed layout is never persisted.
The kernels take groups of consecutive input columns; a checkpoint written with act-order (`desc_act`: GPTQ
with a permuted `g_idx`, as GPTQModel and AutoGPTQ write it) has its columns sorted by group at load and the
activations gathered in that order per call (as exllama and vLLM do); a `g_idx` whose groups are not all
`group_size` columns is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from quant.errors import ArtifactError
from quant.layers import WeightOnlyLinear, fused_bias

BITS = 4
PACK = 32 // BITS  # codes per int32
# The int4 kernel beats unpacking and a dense matmul at every row count measured (1 to 512 rows,
# bench/kernels.py), so 16-bit inputs always take it; the dequantize path serves fp32 and the reference.
INT4PACK_MAX_ROWS = 1 << 30
KERNEL_GROUP_SIZES = (32, 64, 128, 256)


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 holding values in [0, 2^32) -> int32 with the same bits (two's complement)."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """(R, C) codes in [0, 15] -> (R/8, C) int32, code r*8+j in bits 4j..4j+3 of row r."""
    r, c = codes.shape
    if r % PACK:
        raise ValueError(f"cannot pack {r} rows into int32 words of {PACK} codes")
    v = codes.to(torch.int64).reshape(r // PACK, PACK, c)
    shifts = (torch.arange(PACK, dtype=torch.int64) * BITS)[None, :, None]
    return _to_int32((v << shifts).sum(dim=1))


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_rows: (R/8, C) int32 -> (R, C) int32 codes."""
    v = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = (torch.arange(PACK, dtype=torch.int64) * BITS)[None, :, None]
    codes = (v[:, None, :] >> shifts) & 0xF  # (R/8, 8, C)
    return codes.reshape(-1, packed.shape[1]).to(torch.int32)


def pack_gptq(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, v2: bool) -> dict:
    """codes (N, K), scales (G, N), zeros (G, N) -> the four GPTQ tensors."""
    n, k = codes.shape
    stored = zeros.to(torch.int64) if v2 else (zeros.to(torch.int64) - 1) & 0xF  # v1 stores zero - 1
    return {
        "qweight": pack_rows(codes.t().contiguous()),  # (K/8, N)
        "qzeros": pack_rows(stored.t().contiguous()).t().contiguous(),  # (G, N/8)
        "scales": scales.to(torch.float16).contiguous(),  # (G, N)
        "g_idx": (torch.arange(k, device=codes.device) // group_size).to(torch.int32),  # (K,)
    }


def unpack_gptq(qweight, qzeros, scales, g_idx, v2: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GPTQ tensors -> codes (N, K), zeros (G, N) int32, scales (G, N) fp32."""
    codes = unpack_rows(qweight).t().contiguous()  # (N, K)
    zeros = unpack_rows(qzeros.t().contiguous()).t().contiguous()  # (G, N)
    if not v2:
        # As v1 loaders read it: no wrap-around, so a stored 15 (zero 0 written as -1) reads as 16.
        zeros = zeros + 1
    return codes, zeros, scales.float()


def dequantize_gptq(qweight, qzeros, scales, g_idx, v2: bool) -> torch.Tensor:
    """W (N, K) fp32 by the formula above (the reference the kernels are held to)."""
    codes, zeros, s = unpack_gptq(qweight, qzeros, scales, g_idx, v2)
    g = g_idx.long()
    return s[g].t() * (codes.float() - zeros[g].t().float())


def act_order_perm(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The input-column order that makes `g_idx` consecutive groups (None when it already is): column perm[i]
    goes to position i, and position i is in group i // group_size."""
    g = g_idx.long()  # (K,)
    consecutive = torch.arange(g.numel(), device=g.device) // group_size  # (K,)
    if torch.equal(g, consecutive):
        return None
    perm = torch.argsort(g, stable=True)  # (K,)
    if not torch.equal(g[perm], consecutive):
        sizes = torch.bincount(g).tolist()
        raise ArtifactError(f"g_idx assigns groups of {min(sizes)}..{max(sizes)} columns, not {group_size} each: "
                            "this act-order layout is not supported")
    return perm


class GPTQLinear(WeightOnlyLinear):
    """A Linear whose weight is stored in the GPTQ format and multiplied with PyTorch's int4 kernels.

    The CPU kernel is only used for 16-bit activations (fp32 measured ~20x slower than dense)."""

    SPEC_TYPE = "gptq"
    DATA_TENSORS = ("qweight",)
    PARAM_TENSORS = ("qzeros", "scales", "g_idx")
    max_kernel_rows = INT4PACK_MAX_ROWS

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int, v2: bool, device=None):
        super().__init__()
        self.in_features, self.out_features, self.group_size, self.v2 = in_features, out_features, group_size, v2
        groups = in_features // group_size
        self.register_buffer("qweight", torch.empty(in_features // PACK, out_features, dtype=torch.int32, device=device))
        self.register_buffer("qzeros", torch.empty(groups, out_features // PACK, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.empty(groups, out_features, dtype=torch.float16, device=device))
        self.register_buffer("g_idx", torch.empty(in_features, dtype=torch.int32, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None
        self._packed: torch.Tensor | None = None
        self._perm: torch.Tensor | None = None  # act-order: the kernel's column order (see act_order_perm)
        self._sz: dict[torch.dtype, torch.Tensor] = {}

    @classmethod
    def from_quantized(cls, q, bias: torch.Tensor | None, v2: bool) -> "GPTQLinear":
        n, k = q.codes.shape
        m = cls(k, n, bias is not None, q.group_size, v2, device="meta")  # every tensor is set below
        for name, t in pack_gptq(q.codes, q.scales, q.zeros, q.group_size, v2).items():
            setattr(m, name, t)
        if bias is not None:
            m.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return m

    def spec(self) -> dict:
        return {"type": self.SPEC_TYPE, "group_size": self.group_size, "v2": self.v2, "bias": self.bias is not None}

    @classmethod
    def from_spec(cls, spec: dict, in_features: int, out_features: int, device=None) -> "GPTQLinear":
        return cls(in_features, out_features, spec["bias"], spec["group_size"], spec["v2"], device=device)

    @classmethod
    def fuse(cls, mods: list["GPTQLinear"]) -> "GPTQLinear | None":
        """GPTQ tensors pack along the output axis in columns, so the fused module gets its own kernel repack
        and the parts drop theirs (they fall back to their dequantizing path if called directly)."""
        first = mods[0]
        if any(m.out_features % PACK for m in mods) or any(
                m.group_size != first.group_size or m.v2 != first.v2 or not torch.equal(m.g_idx, first.g_idx)
                for m in mods):
            return None  # different group assignments (act-order with a permuted g_idx) cannot share a kernel call
        bias = fused_bias(mods, torch.float32)
        fused = cls(first.in_features, sum(m.out_features for m in mods), bias is not None, first.group_size,
                    first.v2, device="meta")
        fused.qweight = torch.cat([m.qweight for m in mods], dim=1)  # (K/8, N) packs along K: columns concatenate
        fused.qzeros = torch.cat([m.qzeros for m in mods], dim=1)  # (G, N/8)
        fused.scales = torch.cat([m.scales for m in mods], dim=1)  # (G, N)
        fused.g_idx = first.g_idx.clone()
        fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        fused.prepare()
        for m in mods:
            m._packed, m._perm, m._sz = None, None, {}  # the fused module holds the only kernel copy
        return fused

    def warm(self, dtype: torch.dtype) -> None:
        if self._packed is not None and dtype in (torch.bfloat16, torch.float16):
            self._scales_and_zeros(dtype)

    def runtime_tensors(self) -> list[torch.Tensor]:
        extra = [t for t in (self._packed, self._perm) if t is not None]
        return extra + list(self._sz.values())

    def kernel(self, dtype: torch.dtype) -> str:
        if dtype in (torch.bfloat16, torch.float16):
            return "aten._weight_int4pack_mm(_for_cpu) at every row count"
        return "dequantize + matmul (the fp32 int4pack kernel is slower than dense on CPU)"

    def _use_kernel(self) -> bool:
        return self.group_size in KERNEL_GROUP_SIZES and self.in_features % 64 == 0 and self.out_features % 64 == 0

    def prepare(self) -> None:
        """Repack the codes for this device's int4 kernel (once, at load time)."""
        if not self._use_kernel():
            return
        codes, _, _ = unpack_gptq(self.qweight, self.qzeros, self.scales, self.g_idx, self.v2)  # (N, K)
        self._perm = act_order_perm(self.g_idx, self.group_size)
        if self._perm is not None:
            codes = codes[:, self._perm].contiguous()  # (N, K) columns sorted by group
        if self.qweight.is_cuda:
            # The CUDA op takes two codes per byte, even column in the high nibble.
            u8 = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
            self._packed = torch.ops.aten._convert_weight_to_int4pack(u8, 8)
        else:
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        self._sz = {}

    def _scales_and_zeros(self, dtype: torch.dtype) -> torch.Tensor:
        sz = self._sz.get(dtype)
        if sz is None:
            _, zeros, s = unpack_gptq(self.qweight, self.qzeros, self.scales, self.g_idx, self.v2)
            sz = torch.stack([s, s * (8 - zeros.float())], dim=-1).to(dtype).contiguous()  # (G, N, 2)
            self._sz[dtype] = sz
        return sz

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_gptq(self.qweight, self.qzeros, self.scales, self.g_idx, self.v2).to(dtype)

    def kernel_runs(self, rows: int, dtype: torch.dtype) -> bool:
        # No repacked weight: a group size without a kernel, or a part whose fused module holds the pack.
        return self._packed is not None and super().kernel_runs(rows, dtype)

    def _kernel_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        sz = self._scales_and_zeros(x2.dtype)
        if self._perm is not None:
            x2 = x2.index_select(1, self._perm)  # (M, K) in the repacked column order
        if x2.is_cuda:
            return torch.ops.aten._weight_int4pack_mm(x2, self._packed, self.group_size, sz)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self._packed, self.group_size, sz)
