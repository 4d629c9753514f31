"""4-bit weights: the GPTQ checkpoint format on disk, PyTorch's int4 kernels at run time.

On disk (what transformers through gptqmodel, optimum and vLLM load), for W (N, K), G = K / group:
- `qweight` int32 (K/8, N): eight 4-bit codes per int32, packed LSB-first along the input dimension;
- `qzeros`  int32 (G, N/8): zero-points packed LSB-first along the output dimension, stored as
  zero - 1 in the v1 format (`checkpoint_format: "gptq"`) and as zero in v2 (`"gptq_v2"`);
- `scales`  fp16 (G, N);  `g_idx` int32 (K,): the group of each input column.
W[n, k] = scales[g_idx[k], n] * (code[k, n] - zero[g_idx[k], n]).

At load time the codes are repacked once for `aten._weight_int4pack_mm_for_cpu` (CPU) or
`aten._weight_int4pack_mm` (CUDA), and the module then holds that layout instead of the GPTQ tensors. Those
kernels compute (code - 8) * s + z_f per group, so the zero-point goes in the float domain:
z_f = s * (8 - zero), stored with s in the activation dtype. The packed layout is never persisted (it depends
on the device, and on a CPU on its vector width).
The kernels take groups of consecutive input columns; a checkpoint written with act-order (`desc_act`: GPTQ
with a permuted `g_idx`, as GPTQModel and AutoGPTQ write it) has its columns sorted by group at load and the
activations gathered in that order per call (as exllama and vLLM do); a `g_idx` whose groups are not all
`group_size` columns is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from quant.runtime import primitives as P
from quant.runtime.kernels import dequant, gemm, triton_ops
from quant.runtime.kernels import rows as rowops
from quant.runtime.kernels.int4_layout import (
    PACK,
    act_order_perm,
    cpu_layout,
    dequantize_gptq,
    int4_mm,
    pack_for_kernel,
    pack_gptq,
    pack_rows,
    packs_concatenate,
    unpack_gptq,
    unpack_rows,
)
from quant.runtime.linear import WeightOnlyLinear, fused_bias, fused_offsets

# The int4 kernel beats unpacking and a dense matmul at every row count measured (1 to 512 rows,
# bench/linear_paths.py), so 16-bit inputs always take it; the dequantize path serves fp32 and the reference.
INT4PACK_MAX_ROWS = 1 << 30


KERNEL_GROUP_SIZES = (32, 64, 128, 256)


class GPTQLinear(WeightOnlyLinear):
    """A Linear stored in the GPTQ format, holding one runtime layout after `prepare(dtype)`:

    - "int4pack" (16-bit activations, a kernel group size): the codes repacked for PyTorch's int4 kernel
      (`packed`), one scale/zero table in the activation dtype (`scales_zeros`, (G, N, 2)) and, for an act-order
      checkpoint, the kernel's column order (`perm`). The GPTQ tensors are dropped: the checkpoint pages they
      were read from are not touched again (the engine returns them to the OS).
      fp32 activations on a CPU take the same layout without PyTorch's kernel (in fp32 it measured ~20x slower
      than dense): the ``rows`` op reads it for few rows, the one-pass dequantizer for many.
    - "gptq" (CUDA fp32, other group sizes): the checkpoint tensors as stored, dequantized per call.
    """

    SPEC_TYPE = "gptq"
    DATA_TENSORS = ("qweight", "packed")
    PARAM_TENSORS = ("qzeros", "scales", "g_idx", "scales_zeros", "perm")

    @property
    def max_kernel_rows(self) -> int:
        """CUDA (w4triton): the fused kernel for decode-sized inputs, a one-pass dequantize + cuBLAS above."""
        return triton_ops.CUDA_KERNEL_MAX_ROWS if self.layout == "w4triton" else INT4PACK_MAX_ROWS

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int, v2: bool, device=None):
        super().__init__()
        self.in_features, self.out_features, self.group_size, self.v2 = in_features, out_features, group_size, v2
        groups = in_features // group_size
        self.register_buffer("qweight", torch.empty(in_features // PACK, out_features, dtype=torch.int32, device=device))
        self.register_buffer("qzeros", torch.empty(groups, out_features // PACK, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.empty(groups, out_features, dtype=torch.float16, device=device))
        self.register_buffer("g_idx", torch.empty(in_features, dtype=torch.int32, device=device))
        # The int4pack layout, set by prepare() in place of the four above.
        self.register_buffer("packed", None)
        self.register_buffer("scales_zeros", None)
        self.register_buffer("perm", None)
        self._whole: tuple[GPTQLinear, int, int] | None = None  # a fused part: (fused module, first row, end row)
        self.zero_free = False  # set by prepare(): every zero of scales_zeros is 0 (a symmetric checkpoint)
        self.int8_activations = False  # use_int8_activations(): inputs quantized in blocks of 32 columns
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None

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
    def features(cls, tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
        """(in, out) from ``qweight``, (in / 8, out) int32 words."""
        qw = tensors.get("qweight")
        if qw is None or qw.dim() != 2:
            raise ValueError(f"a GPTQ module stores a 2-D qweight, found {sorted(tensors)}")
        return int(qw.shape[0]) * PACK, int(qw.shape[1])

    @property
    def layout(self) -> str:
        if self._whole is not None:
            return self._whole[0].layout
        if self.packed is not None:
            return "int4pack"
        return "w4triton" if self.scales_zeros is not None else "gptq"

    def runtime_layout(self, dtype: torch.dtype | None) -> str:
        """The layout ``prepare(dtype)`` gives this module on its device: "int4pack" (PyTorch's int4 kernels: on
        CUDA bf16 only, with K a multiple of 32; on a CPU fp32 too, read by our C++ ops: :func:`repacked_on_cpu`),
        "w4triton" (CUDA: the Triton kernel over the GPTQ codes, any 16-bit dtype, preferred there) or "gptq" (as
        stored, dequantized per call)."""
        n, k, gs = self.out_features, self.in_features, self.group_size
        if not self.qweight.is_cuda:
            return "int4pack" if repacked_on_cpu(n, gs, dtype) else "gptq"
        if dtype not in (torch.bfloat16, torch.float16):
            return "gptq"
        if triton_ops.available() is None and triton_ops.w4_block_k(gs) is not None:
            return "w4triton"
        ok = dtype == torch.bfloat16 and gs in KERNEL_GROUP_SIZES and k % 32 == 0 and n % 8 == 0
        return "int4pack" if ok else "gptq"

    def prepare(self, dtype: torch.dtype | None = None) -> None:
        """Hold the layout that serves activations in `dtype` (once, after loading; idempotent)."""
        if self.scales_zeros is None and self._whole is None:
            self._prepare_as(self.runtime_layout(dtype), dtype)

    def _prepare_as(self, layout: str, dtype: torch.dtype) -> None:
        if layout == "gptq":
            return
        codes, zeros, s = unpack_gptq(self.qweight, self.qzeros, self.scales, self.g_idx, self.v2)  # (N, K), (G, N) x2
        perm = act_order_perm(self.g_idx, self.group_size)
        if perm is not None:
            codes = codes[:, perm].contiguous()  # (N, K) columns sorted by group
        if layout == "int4pack":
            self.packed = pack_for_kernel(codes)
            self.qweight = None
        elif perm is not None:  # w4triton: the GPTQ words, repacked only when the column order changed
            self.qweight = pack_rows(codes.t().contiguous())  # (K/8, N)
        self.scales_zeros = torch.stack([s, s * (8 - zeros.float())], dim=-1).to(dtype).contiguous()  # (G, N, 2)
        self.zero_free = bool((zeros == 8).all())  # z = s (8 - 8) = 0: the CUDA kernels skip the zeros
        self.perm = perm
        self.qzeros = self.scales = self.g_idx = None

    @classmethod
    def fuse(cls, mods: list["GPTQLinear"]) -> "GPTQLinear | None":
        """One module over the parts' concatenated outputs, holding their layout once.

        gptq layout: the GPTQ tensors concatenated by columns, the parts become views of their columns.
        int4pack: the packs concatenated where the kernel's layout blocks along N at the parts' boundaries (checked
        on a probe), else repacked from the parts' codes; the parts then hold nothing and compute their rows
        through the fused module (the engine never calls them)."""
        first = mods[0]
        if (len({(m.layout, m.group_size, m.v2, m.int8_activations) for m in mods}) != 1
                or any(m.out_features % PACK for m in mods)):
            return None
        bias = fused_bias(mods, torch.float32)
        fused = cls(first.in_features, sum(m.out_features for m in mods), bias is not None, first.group_size,
                    first.v2, device="meta")
        fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        fused.int8_activations = first.int8_activations
        spans = fused_offsets(mods)
        if first.layout in ("int4pack", "w4triton"):
            if (any(m.scales_zeros.dtype != first.scales_zeros.dtype for m in mods)
                    or any(not _same(m.perm, first.perm) for m in mods)):
                return None  # different column orders (act-order) cannot share one kernel call
            if first.layout == "w4triton":
                fused.qweight = torch.cat([m.qweight for m in mods], dim=1)  # (K/8, N): columns concatenate
            elif packs_concatenate(tuple(m.out_features for m in mods), first.packed.device):
                fused.packed = torch.cat([m.packed for m in mods])  # (N, ...) blocked along N: rows concatenate
                fused.qweight = None
            else:
                fused.packed = pack_for_kernel(torch.cat([m._kernel_codes() for m in mods]))
                fused.qweight = None
            fused.scales_zeros = torch.cat([m.scales_zeros for m in mods], dim=1)  # (G, N, 2)
            fused.zero_free = all(m.zero_free for m in mods)
            fused.perm = first.perm
            fused.qzeros = fused.scales = fused.g_idx = None
            for m, span in zip(mods, spans):
                m.packed = m.scales_zeros = m.perm = m.qweight = None
                m._whole = (fused, *span)
            return fused
        if any(not torch.equal(m.g_idx, first.g_idx) for m in mods):
            return None  # different group assignments (act-order with a permuted g_idx)
        fused.qweight = torch.cat([m.qweight for m in mods], dim=1)  # (K/8, N) packs along K: columns concatenate
        fused.qzeros = torch.cat([m.qzeros for m in mods], dim=1)  # (G, N/8)
        fused.scales = torch.cat([m.scales for m in mods], dim=1)  # (G, N)
        fused.g_idx = first.g_idx
        for m, (a, b) in zip(mods, spans):
            m.qweight, m.scales = fused.qweight[:, a:b], fused.scales[:, a:b]
            m.qzeros = fused.qzeros[:, a // PACK: b // PACK]
        return fused

    def kernel(self, dtype: torch.dtype) -> str:
        if self.layout == "w4triton":
            return (f"Triton W4A16 GEMM over the GPTQ codes (quant.runtime.kernels.triton_ops.w4_matmul) up to "
                    f"{triton_ops.CUDA_KERNEL_MAX_ROWS} rows, one-pass Triton dequantize + cuBLAS above")
        if self.has_kernel(dtype):
            return ("aten._weight_int4pack_mm(_for_cpu), one C++ pass (quant.runtime.kernels.rows), a tiled C++ product (quant.runtime.kernels.gemm, "
                    "bf16) or dequantize + matmul; per row count the fastest on the serving CPU")
        if self.packed is not None:  # fp32 on a CPU: the int4pack layout without PyTorch's kernel
            return ("one C++ pass (quant.runtime.kernels.rows) or a one-pass dequantize + matmul, per row count the "
                    "fastest on the serving CPU (the fp32 int4pack kernel is slower than dense)")
        return "dequantize + matmul"

    def has_kernel(self, dtype: torch.dtype) -> bool:
        if self._whole is not None:
            return self._whole[0].has_kernel(dtype)
        if self.scales_zeros is None:
            return False
        if self.packed is not None and self.packed.is_cuda:
            return dtype == torch.bfloat16  # the CUDA int4pack kernel is bf16-only
        return super().has_kernel(dtype)

    def paths(self, dtype: torch.dtype) -> dict:
        """As every weight-only module's, less the dequantizing paths where the int4pack layout cannot be read
        back cheaply on this CPU (an unknown layout: only the kernel's identity product would do, K x K x N), and
        with ``rows`` (``quant.runtime.kernels.rows.int4``, few rows) and ``gemm`` (``quant.runtime.kernels.gemm.int4``, many) where they can."""
        out = super().paths(dtype)
        bias = None if self.bias is None else self.bias.data.float()
        products = self._rows_products(dtype)
        if self.packed is not None and self.packed.device.type == "cpu":
            layout = cpu_layout()
            if layout is None:
                return {"kernel": out["kernel"]}
            n, k, gs = self.out_features, self.in_features, self.group_size
            if not self.int8_activations:
                out.update({name: self._in_order(p) for name, p in products.items()})
            if gemm.available(self.packed, n, k, dtype, int4_layout=layout):  # gemm: in L1 tiles, for many rows
                out["gemm"] = self._in_order(gemm.int4(self.packed, n, k, self.scales_zeros, gs, bias))
        if self.int8_activations:
            out = {name: _on_blocks(call, self.perm) for name, call in out.items() if name not in ("rows", "rows16")}
            out.update({name: self._in_order(p) for name, p in products.items()})
        return out

    def _rows_products(self, dtype: torch.dtype) -> dict[str, rowops.Product]:
        """The C++ rows passes this module computes inputs of ``dtype`` with, by path name: ``rows`` (the whole
        product straight from the CPU int4pack layout, one call; with int8 activations the int8 product itself) and
        ``rows16`` (the same pass on x held as int16 in blocks of 32: power-of-two scales, so a bf16 element no
        smaller than 2^-7 of its block's largest is held exactly; integer sums, 16 products an instruction)."""
        if self.packed is None or self.packed.device.type != "cpu" or not rowops.available(self.packed):
            return {}
        layout = cpu_layout()
        n, k, gs, sz = self.out_features, self.in_features, self.group_size, self.scales_zeros
        bias = None if self.bias is None else self.bias.data.float()
        if self.int8_activations:
            supported = int8_activations_supported(layout, n, k, gs)
            return {"rows": rowops.int4_a8(self.packed, n, k, sz, gs, bias)} if supported else {}
        if layout is None:
            return {}
        out = {"rows": rowops.int4(self.packed, n, k, layout, sz, gs, bias)}
        if dtype in (torch.bfloat16, torch.float16) and int8_activations_supported(layout, n, k, gs):
            out["rows16"] = rowops.int4_a16(self.packed, n, k, sz, gs, bias)
        return out

    def _in_order(self, call):
        return _in_kernel_order(call, self.perm)

    def use_int8_activations(self) -> None:
        """From now on this module computes its input quantized to int8 in blocks of 32 columns of the kernel's
        column order (``primitives.quantize_act_blocks``; an act-order checkpoint's blocks are of its permuted
        columns), llama.cpp's Q8 activations: on AVX2's layout the ``rows`` path is the int8 product itself
        (``rows.int4_a8``), every other path computes on the dequantized blocks (in the activation dtype: bf16 rounds
        them), and a GPU's one-row epilogues are not taken. The reference (:meth:`reference_forward`) quantizes the
        same way, so every path still computes one function, to the activation dtype's rounding."""
        self.int8_activations = True
        self._plan = None

    def _one_row_launch(self, dtype: torch.dtype) -> tuple[int, ...] | None:
        return None if self.int8_activations else super()._one_row_launch(dtype)

    def plan_key(self, dtype: torch.dtype) -> str:
        return super().plan_key(dtype) + ("|int8-activations" if self.int8_activations else "")

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.int8_activations:
            return super().reference_forward(x)
        shape = x.shape
        xh = quantized_blocks(x.reshape(-1, self.in_features), self.perm)  # fp32 (float64 for float64 x)
        return super().reference_forward(xh).reshape(*shape[:-1], self.out_features)

    def _gemv_space(self, dtype: torch.dtype):
        if self._whole is not None or self.layout != "w4triton":
            return None
        return triton_ops.w4_gemv_space(self.out_features, self.in_features, self.group_size,
                                        triton_ops.multiprocessors(self.qweight.device))

    def _kernel_matmul(self, x2: torch.Tensor, gemv_config: tuple[int, ...] | None = None,
                       gated: str | None = None, norm=None):
        if self._whole is not None:  # a part of a fused module: its rows of the fused product
            if gated is not None or norm is not None:
                raise ValueError("a part of a fused projection has no epilogues: call the fused module")
            fused, a, b = self._whole
            return fused._kernel_matmul(x2, gemv_config)[:, a:b]
        sz = self.scales_zeros
        if sz.dtype != x2.dtype:  # another 16-bit dtype than the one prepared for
            sz = sz.to(x2.dtype)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)  # (M, K) in the repacked column order
        if self.packed is None:  # w4triton
            return triton_ops.w4_matmul(x2, self.qweight, sz, self.group_size, gemv_config or self.gemv_config,
                                        self.zero_free, gated, norm)
        if gated is not None or norm is not None:
            raise ValueError("the int4pack kernels have no epilogues")
        return int4_mm(x2, self.packed, self.group_size, sz)

    def _kernel_codes(self) -> torch.Tensor:
        """(N, K) int32 codes in the kernel's column order, read back through the kernel itself with scale 1 and
        zero 8 (so no assumption about the packed layout is made): K x K x N work, for tests and rare repacks."""
        k, sz = self.in_features, self.scales_zeros
        unit = torch.empty_like(sz)
        unit[..., 0], unit[..., 1] = 1, 8  # (code - 8) * 1 + 8 = code, exact in 16 bits
        eye = torch.eye(k, dtype=sz.dtype, device=sz.device)
        codes_t = torch.cat([int4_mm(eye[a: a + 1024], self.packed, self.group_size, unit) for a in range(0, k, 1024)])
        return codes_t.t().to(torch.int32).contiguous()  # (N, K)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W (N, K) as this module computes it: from the GPTQ tensors, or from the int4pack layout's codes and its
        scale/zero table."""
        if self._whole is not None:
            fused, a, b = self._whole
            return fused.dequantized(dtype)[a:b]
        if self.scales_zeros is None:
            return dequantize_gptq(self.qweight, self.qzeros, self.scales, self.g_idx, self.v2).to(dtype)
        if self.packed is None:  # w4triton: the codes as stored, in the kernel's column order
            if self.qweight.is_cuda:
                w = triton_ops.w4_dequant(self.qweight, self.scales_zeros, self.group_size, dtype).t()  # (N, K)
                return w if self.perm is None else torch.empty_like(w).index_copy_(1, self.perm, w)
            return dequant.int4_codes_reference(unpack_rows(self.qweight).t(), self.scales_zeros, self.group_size,
                                                self.perm, dtype)
        n, k, gs = self.out_features, self.in_features, self.group_size
        layout = cpu_layout() if self.packed.device.type == "cpu" else None
        if layout:  # one pass from the kernel layout (C++ where built), the fp32 values the kernel computes
            return dequant.int4pack(self.packed, n, k, layout, self.scales_zeros, gs, self.perm, dtype)
        return dequant.int4_codes_reference(self._kernel_codes(), self.scales_zeros, gs, self.perm, dtype)


def repacked_on_cpu(n: int, group_size: int, dtype: torch.dtype | None) -> bool:
    """Whether a CPU module of ``n`` outputs in groups of ``group_size`` holds the int4pack layout for ``dtype``
    activations (``GPTQLinear.prepare``; the served-weight prediction, quant.build.schemes.w4, follows it): a kernel
    group size, whole 16-row blocks, and 16-bit activations, or fp32 where our C++ ops read the layout."""
    if group_size not in KERNEL_GROUP_SIZES or n % 16:
        return False
    return dtype in (torch.bfloat16, torch.float16) or (dtype == torch.float32 and fp32_int4pack_on_cpu())


def fp32_int4pack_on_cpu() -> bool:
    """Whether fp32 activations on this CPU have paths from the int4pack layout that beat dequantizing the GPTQ
    tensors per call: the ``rows`` op for few rows and the one-pass C++ dequantizer for many (PyTorch's own int4
    kernel in fp32 measured ~20x slower than dense), both reading a layout this code knows."""
    return rowops.available(torch.empty(0)) and dequant.load() and cpu_layout() is not None


def int4_modules(model: nn.Module) -> list[GPTQLinear]:
    """The model's int4 modules; ValueError where it has none (int8 activations apply to int4 weights only)."""
    mods = [m for m in model.modules() if isinstance(m, GPTQLinear)]
    if not mods:
        raise ValueError("--int4-activations int8 applies to int4 weights (a w4a16 artifact); this model has none")
    return mods


def use_int8_activations(model: nn.Module) -> str:
    """Every GPTQLinear of a served ``model`` computes on int8 activations from now on
    (:meth:`GPTQLinear.use_int8_activations`), set before the server binds and fuses them; what ModelInfo.kernels
    says of it. ValueError, saying what is missing, for a model without int4 weights or where the int8 product is not
    built (served for its speed: an AVX2 CPU's int4pack layout)."""
    mods = int4_modules(model)
    if any(m.packed is None or m.packed.device.type != "cpu" for m in mods):
        raise ValueError("--int4-activations int8 is served on the CPU only (the int4 weights here are not in the "
                         "CPU's int4pack layout)")
    layout = cpu_layout()
    if not any(int8_activations_supported(layout, m.out_features, m.in_features, m.group_size) for m in mods):
        why = rowops.unavailable_reason() or f"this CPU's int4 layout is {layout}, the int8 product reads (32, True)"
        raise ValueError(f"--int4-activations int8 needs an AVX2 CPU without AVX-512 and the C++ rows ops ({why})")
    for m in mods:
        m.use_int8_activations()
    return f"int4 projections ({len(mods)} modules): int8 activations in blocks of 32 columns (--int4-activations int8)"


def int8_activations_supported(layout, n: int, k: int, group_size: int) -> bool:
    """Whether the int8-activation product (``rows.int4_a8``) reads this shape on this CPU: AVX2's int4pack layout
    (32-row split blocks, where the C++ ops are built), N and K multiples of 32, groups of whole 32-column blocks."""
    return (layout == (32, True) and rowops.available(torch.empty(0)) and n % P.ACT_BLOCK == 0
            and k % P.ACT_BLOCK == 0 and group_size % P.ACT_BLOCK == 0)


def quantized_blocks(x: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) with its blocks of 32 columns of the kernel's order quantized and dequantized
    (``primitives.quantize_act_blocks``), in W's column order, fp32 (float64 for float64 x)."""
    if perm is None:
        return P.quantize_act_blocks(x)
    xh = P.quantize_act_blocks(x.index_select(1, perm))
    return torch.empty_like(xh).index_copy_(1, perm, xh)


def _on_blocks(call, perm: torch.Tensor | None):
    """A path computing on x's quantized blocks (in x's dtype) instead of x."""
    return lambda x: call(quantized_blocks(x, perm).to(x.dtype))


def _in_kernel_order(call, perm: torch.Tensor | None):
    """A call on x (then any other arguments) in the kernel's column order, taking x in W's (act-order checkpoints
    permute K at load)."""
    return call if perm is None else lambda x, *rest: call(x.index_select(1, perm), *rest)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
