"""4-bit codes laid out: the GPTQ checkpoint tensors (packing, unpacking, the reference dequantization,
act-order's column order) and PyTorch's int4 kernel layouts (packing for the device, reading the CPU layout back).
See ``quant.runtime.int4`` for the format."""

from __future__ import annotations

import functools

import torch

from quant.errors import ArtifactError

BITS = 4


PACK = 32 // BITS  # codes per int32


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 holding values in [0, 2^32) -> int32 with the same bits (two's complement)."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """(R, C) codes in [0, 15] -> (R/8, C) int32, code r*8+j in bits 4j..4j+3 of row r."""
    r, c = codes.shape
    if r % PACK:
        raise ValueError(f"cannot pack {r} rows into int32 words of {PACK} codes")
    v = codes.to(torch.int64).reshape(r // PACK, PACK, c)
    shifts = (torch.arange(PACK, dtype=torch.int64, device=codes.device) * BITS)[None, :, None]
    return _to_int32((v << shifts).sum(dim=1))


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_rows: (R/8, C) int32 -> (R, C) int32 codes."""
    v = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = (torch.arange(PACK, dtype=torch.int64, device=packed.device) * BITS)[None, :, None]
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


def kernel_codes_cpu(packed: torch.Tensor, n: int, k: int, layout: tuple[int, bool]) -> torch.Tensor:
    """(N, K) uint8 codes from the CPU int4pack layout (see :func:`cpu_layout`): blocks of B rows stored as
    (K, B/2) bytes, byte j of a full block holding row j (low nibble) and row j + B/2 (high nibble) with
    AVX-512/AVX2, rows 2j and 2j+1 otherwise and in a last, partial block."""
    block, split = layout
    flat = packed.reshape(-1)
    full = n // block if split else 0
    parts = []
    if full:
        p = flat[: full * k * block // 2].view(full, k, block // 2)  # (NB, K, B/2)
        blocks = torch.cat([p & 15, p >> 4], dim=-1)  # (NB, K, B): [b, k, j] is row b*B + j
        parts.append(blocks.transpose(1, 2).reshape(full * block, k))
    for r0 in range(full * block, n, block):
        rows = min(block, n - r0)
        p = flat[r0 * k // 2: (r0 + rows) * k // 2].view(k, rows // 2)  # (K, rows/2)
        parts.append(torch.stack([p & 15, p >> 4], dim=-1).reshape(k, rows).t())
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)


@functools.lru_cache(maxsize=1)
def cpu_layout() -> tuple[int, bool] | None:
    """(block rows, split nibbles) of this CPU's int4pack layout (it follows the vector width PyTorch dispatches
    to: 64-row blocks with AVX-512, 32 with AVX2, 32 interleaved without either), checked on a probe with a
    partial last block; None when the probe does not read back (a layout this code does not know)."""
    guess = {"AVX512": (64, True), "AVX2": (32, True)}.get(torch.backends.cpu.get_cpu_capability(), (32, False))
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (2 * guess[0] + 16, 64), generator=g, dtype=torch.int32)  # (N, K)
    got = kernel_codes_cpu(pack_for_kernel(codes), codes.shape[0], codes.shape[1], guess)
    return guess if torch.equal(got.to(torch.int32), codes) else None


def int4_mm(x2: torch.Tensor, packed: torch.Tensor, group_size: int, sz: torch.Tensor) -> torch.Tensor:
    if x2.is_cuda:
        return torch.ops.aten._weight_int4pack_mm(x2, packed, group_size, sz)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, group_size, sz)


def pack_for_kernel(codes: torch.Tensor) -> torch.Tensor:
    """codes (N, K) int32 -> this device's int4 kernel layout."""
    if codes.is_cuda:
        # The CUDA op takes two codes per byte, even column in the high nibble, and K in tiles of 16 x (2, 4 or 8).
        u8 = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
        k = codes.shape[1]
        return torch.ops.aten._convert_weight_to_int4pack(u8, 8 if k % 128 == 0 else (4 if k % 64 == 0 else 2))
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)


@functools.lru_cache(maxsize=64)
def packs_concatenate(sizes: tuple[int, ...], device: torch.device) -> bool:
    """Whether packing parts of these row counts and concatenating equals packing their concatenation (the
    kernel layouts block along N, by a block size that depends on the CPU's vector width): checked on a probe."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (sum(sizes), 128), generator=g, dtype=torch.int32).to(device)  # (N, 128)
    parts = torch.split(codes, list(sizes))
    return torch.equal(pack_for_kernel(codes), torch.cat([pack_for_kernel(p.contiguous()) for p in parts]))
