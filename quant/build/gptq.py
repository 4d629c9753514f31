"""GPTQ (Frantar et al., 2022) for one Linear, written for this project, and its RTN baseline.

Given W (N, K) and the Hessian of the layer-wise squared error H = 2 X^T X / n (K, K), columns are
quantized one at a time and the rounding error of each is spread over the columns not yet quantized,
weighted by the inverse Hessian (Optimal Brain Surgeon). Details that matter:
- dead inputs (H_kk = 0) carry no information: their weights are zeroed and H_kk set to 1;
- damping: lambda = damp * mean(diag H) is added to the diagonal; if the Cholesky factorisation
  still fails, lambda grows x10 up to `max_damp_tries` times, then the caller falls back to RTN;
- the upper Cholesky factor of H^-1 gives every column's update row directly;
- lazy batches of `block` columns: updates inside a block are immediate, the rest of the matrix is
  updated once per block (same result, far fewer memory passes);
- group parameters (scale, zero) are computed when a group's first column is reached, on the
  error-updated weights of that group;
- act-order with static groups: columns are processed by decreasing H_kk, but the groups stay the
  contiguous original ones (parameters computed up front on the original weights), so that
  g_idx[k] = k // group and no runtime reordering is needed.
The grid is a parameter (`Grid`): GPTQ checkpoints' unsigned one (w4a16) or this project's symmetric int8 one
(w8a8's weights, one group per row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant.runtime.primitives import QMAX, weight_scale_sym


@dataclass(frozen=True)
class Grid:
    """The integers a weight group rounds to, w ~ scale * (code - zero), code in [qmin, qmax]:
    "uint": GPTQ checkpoints' [0, 2^bits - 1], min/max range holding 0 (zero mid-grid when symmetric), fp16 scales;
    "int8": quant.runtime.primitives' symmetric int8, [-127, 127], zero 0, fp32 scale absmax / 127 (W8A8Linear's weights)."""

    kind: str
    bits: int
    sym: bool
    clip: bool = False  # "uint": search each group's range (group_params(clip=True))

    @classmethod
    def uint(cls, bits: int, sym: bool, clip: bool = False) -> "Grid":
        return cls("uint", bits, sym, clip)

    @classmethod
    def int8(cls) -> "Grid":
        return cls("int8", 8, True)

    @property
    def qmin(self) -> int:
        return -QMAX if self.kind == "int8" else 0

    @property
    def qmax(self) -> int:
        return QMAX if self.kind == "int8" else 2**self.bits - 1

    def params(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row (scale, zero) for the columns in `w` (N, g); `importance` (g,): the range search's column
        weights (group_params)."""
        if self.kind == "int8":
            scale = weight_scale_sym(w)  # (N,)
            return scale, torch.zeros_like(scale)
        return group_params(w, self.bits, self.sym, self.clip, importance)


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # (N, K) int32 in the grid's [qmin, qmax]
    scales: torch.Tensor  # (G, N) fp32
    zeros: torch.Tensor  # (G, N) int32 in [0, 2^bits - 1]
    group_size: int
    bits: int
    damp: float | None = None  # the damping finally used (None for RTN)
    fallback: str | None = None  # why GPTQ fell back to RTN, if it did
    error: float | None = None  # GPTQ's own loss estimate sum((w - q)^2 / Hinv_kk^2) / 2

    def dequantize(self) -> torch.Tensor:
        """(N, K) fp32: scale * (code - zero) with each column's group parameters."""
        g = torch.arange(self.codes.shape[1], device=self.codes.device) // self.group_size  # (K,)
        s = self.scales[g].t()  # (N, K)
        z = self.zeros[g].t().float()  # (N, K)
        return s * (self.codes.float() - z)


# The range search of `group_params(clip=True)`, GPTQ's reference values: shrink the min/max range by 1%
# steps down to 20% of it, keeping per row the one whose rounding error |w - q|^2.4 summed over the group is least
# (an exponent above 2 weighs the large errors that clipping makes). GPTQ weighs each column's error by its input's
# energy, diag(H) = 2 E[x_k^2]: a weight on a loud input costs more in the output than one on a quiet input, and on
# the default model the weighing recovers more of RTN's perplexity loss (bench/RESULTS.md#quality-perplexity-and-kl-by-scheme-benchqualitypy).
CLIP_STEPS, CLIP_MAX_SHRINK, CLIP_NORM = 100, 0.8, 2.4


def group_params(w: torch.Tensor, bits: int, sym: bool, clip: bool = False,
                 importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (scale, zero) for the columns in `w` (N, g): asymmetric min/max over a range that
    contains 0, or symmetric around the grid's midpoint. zero is an integer on the grid.
    `clip`: the range shrunk per row where that rounds the group closer (CLIP_* above), each column's error
    weighed by `importance` (g,) where given (GPTQ passes diag(H): the energy of that input)."""
    maxq = 2**bits - 1
    lo = w.amin(dim=1).clamp_max(0.0)
    hi = w.amax(dim=1).clamp_min(0.0)
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = -hi
    if clip:
        w = w.contiguous()
        ps = 1 - torch.arange(int(CLIP_MAX_SHRINK * CLIP_STEPS), device=w.device) / CLIP_STEPS  # (P,) 1, 0.99, ..
        errs = []
        for c in ps.split(16):  # 16 candidates at a time: (16, N, g) temporaries
            s, z = _params_for(lo[None] * c[:, None], hi[None] * c[:, None], maxq, sym)  # (C, N) each
            s, z = s[..., None], z[..., None]  # (C, N, 1)
            # code - zero = round(w / s) clamped to [-z, maxq - z]: whole numbers, so the same values as clamping
            # code = round(w / s) + z to [0, maxq] and subtracting z, in place and without two passes.
            e = torch.round(w[None] / s)  # (C, N, g)
            e = torch.minimum(torch.maximum(e, -z, out=e), maxq - z, out=e)
            e = e.mul_(s).sub_(w[None]).abs_().pow_(CLIP_NORM)  # |s (code - zero) - w|^CLIP_NORM
            errs.append(e.sum(dim=-1) if importance is None else e @ importance)  # (C, N)
        best_p = ps[torch.cat(errs).argmin(dim=0)]  # (N,) the first (widest) of equal errors
        lo, hi = lo * best_p, hi * best_p
    return _params_for(lo, hi, maxq, sym)


def _params_for(lo: torch.Tensor, hi: torch.Tensor, maxq: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dead = (lo == 0) & (hi == 0)
    lo = torch.where(dead, torch.full_like(lo, -1.0), lo)
    hi = torch.where(dead, torch.full_like(hi, 1.0), hi)
    # Rounded to fp16 here, as stored on disk, so that GPTQ propagates the error of the weights the
    # artifact will actually hold.
    scale = ((hi - lo) / maxq).half().float()  # (N,)
    if sym:
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        zero = torch.round(-lo / scale)
    return scale, zero


def _quant(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, grid: Grid) -> torch.Tensor:
    return torch.clamp(torch.round(w / scale) + zero, grid.qmin, grid.qmax)


def rtn(w: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True) -> QuantizedWeight:
    """Round-to-nearest with the same groups and grid as GPTQ: the baseline that shows what GPTQ buys."""
    return _rtn_on(w, group_size, Grid.uint(bits, sym))


def _rtn_on(w: torch.Tensor, group_size: int, grid: Grid) -> QuantizedWeight:
    w = w.float()
    n, k = w.shape
    codes = torch.empty(n, k, dtype=torch.int32, device=w.device)
    groups = k // group_size
    scales = torch.empty(groups, n, device=w.device)
    zeros = torch.empty(groups, n, dtype=torch.int32, device=w.device)
    for g in range(groups):
        cols = slice(g * group_size, (g + 1) * group_size)
        s, z = grid.params(w[:, cols])
        codes[:, cols] = _quant(w[:, cols], s[:, None], z[:, None], grid).to(torch.int32)
        scales[g], zeros[g] = s, z.to(torch.int32)
    return QuantizedWeight(codes, scales, zeros, group_size, grid.bits)


class Hessian:
    """Streaming H = 2 X^T X / n in fp32.

    On the CPU only the upper triangle is accumulated, in row blocks (block r: H[r, r:] += X[:, r]^T X[:, r:]),
    and mirrored once at the end: 0.69-0.83x the time of the full product (bench/RESULTS.md#gptq-against-gptqmodel-benchgptq_peerpy), where the
    Hessians cost as much as the layer pass itself. On CUDA one full product per batch is faster."""

    BLOCK = 128  # rows of H per product on the CPU (128..256 timed alike, ad hoc, for K = 576..4096)

    def __init__(self, k: int):
        self.k, self.h, self.n = k, None, 0  # h is allocated on the device of the first batch
        self.upper = False

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # (rows, K)
        if self.h is None:
            self.h = torch.zeros(self.k, self.k, device=x.device)
            self.upper = not x.is_cuda
        if self.upper:
            for r in range(0, self.k, self.BLOCK):
                self.h[r : r + self.BLOCK, r:].addmm_(x[:, r : r + self.BLOCK].t(), x[:, r:])
        else:
            self.h.addmm_(x.t(), x)
        self.n += x.shape[0]

    def value(self) -> torch.Tensor:
        """H, completed and scaled in place (the accumulator is done with): no second K x K copy."""
        if self.h is None:
            return torch.zeros(self.k, self.k)
        if self.upper:
            for r in range(self.BLOCK, self.k, self.BLOCK):
                self.h[r : r + self.BLOCK, :r] = self.h[:r, r : r + self.BLOCK].t()
            self.upper = False
        return self.h.mul_(2.0 / max(self.n, 1))


def _inverse_hessian_factor(h: torch.Tensor, damp: float, tries: int) -> tuple[torch.Tensor | None, float]:
    """Upper Cholesky factor of (H + lambda I)^-1, raising lambda x10 on failure. Each K x K step frees
    the one before it, so the working set is H plus two K x K matrices (an 8B model's down_proj: K = 14336,
    0.8 GB each in fp32)."""
    mean_diag = float(torch.diag(h).mean())
    lam = damp * mean_diag
    for _ in range(tries):
        damped = h.clone()
        damped.diagonal().add_(lam)
        l, info = torch.linalg.cholesky_ex(damped)
        del damped
        if int(info) == 0:
            hinv = torch.cholesky_inverse(l)
            del l
            u, info = torch.linalg.cholesky_ex(hinv, upper=True)
            del hinv
            if int(info) == 0 and bool(torch.isfinite(u).all()):
                return u, lam / max(mean_diag, 1e-30)
        lam = lam * 10 if lam > 0 else 1e-8
    return None, lam / max(mean_diag, 1e-30)


@torch.no_grad()
def gptq(
    w: torch.Tensor, h: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True,
    damp: float = 0.01, act_order: bool = False, block: int = 128, max_damp_tries: int = 6,
    grid: Grid | None = None,
) -> QuantizedWeight:
    """Quantize W (N, K) against Hessian H (K, K) on `grid` (None: GPTQ checkpoints' grid of `bits`, `sym`).
    Falls back to round-to-nearest on that grid (recorded in `fallback`) when no damping up to
    damp * 10^(tries-1) makes H positive definite."""
    grid = grid or Grid.uint(bits, sym)
    w = w.detach().float().clone()
    h = h.detach().float().clone()
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input dimension {k}")
    if not bool(torch.isfinite(h).all()):
        q = _rtn_on(w, group_size, grid)
        q.fallback = "Hessian has non-finite entries"
        return q
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    energy = torch.diag(h).clone() if grid.clip else None  # (K,) the range search's column weights: E[x_k^2]
    w[:, dead] = 0.0

    groups = k // group_size
    scales = torch.empty(groups, n, device=w.device)
    zeros = torch.empty(groups, n, device=w.device)
    if act_order:
        # Static groups: parameters from the original weights, before any error is propagated.
        for g in range(groups):
            cols = slice(g * group_size, (g + 1) * group_size)
            scales[g], zeros[g] = grid.params(w[:, cols], None if energy is None else energy[cols])
        perm = torch.argsort(torch.diag(h), descending=True)
        w = w[:, perm]
        h = h[perm]  # one permuted copy at a time: K x K is the big one
        h = h[:, perm]
    else:
        perm = torch.arange(k, device=w.device)
    group_of = (perm // group_size).tolist()  # each processed column's group, read once (no sync per column)

    u, used_damp = _inverse_hessian_factor(h, damp, max_damp_tries)
    del h  # only its factor is needed from here on
    if u is None:
        q = _rtn_on(w[:, torch.argsort(perm)], group_size, grid)
        q.fallback = f"Cholesky failed up to damp {used_damp:.3g} x mean diag(H)"
        return q

    codes = torch.zeros(n, k, dtype=torch.int32, device=w.device)  # in processing order
    losses = torch.zeros(n, device=w.device)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = w[:, i1:i2].clone()  # (N, B) updated in place as columns are quantized
        err1 = torch.zeros_like(w1)  # (N, B) each column's error divided by its pivot
        q1 = torch.zeros_like(w1)  # (N, B) codes
        u1 = u[i1:i2, i1:i2]  # (B, B)
        for i in range(i2 - i1):
            col = i1 + i
            g = group_of[col]
            if not act_order and col % group_size == 0:
                # The group's weights as updated so far: inside this block from w1, beyond it from w.
                span = w1[:, i : i + group_size]
                if span.shape[1] < group_size:
                    span = torch.cat([span, w[:, i2 : col + group_size]], dim=1)
                scales[g], zeros[g] = grid.params(span, None if energy is None else energy[col : col + group_size])
            x = w1[:, i]  # (N,)
            sc, zc = scales[g], zeros[g]  # (N,) each
            q = _quant(x, sc, zc, grid)  # (N,)
            q1[:, i] = q
            e = (x - sc * (q - zc)) / u1[i, i]  # (N,)
            w1[:, i:].addr_(e, u1[i, i:], alpha=-1.0)
            err1[:, i] = e
        codes[:, i1:i2] = q1.to(torch.int32)
        losses += err1.square().sum(dim=1) / 2  # sum over columns of (w - deq)^2 / d^2 / 2
        w[:, i2:] -= err1 @ u[i1:i2, i2:]

    inv = torch.argsort(perm)
    return QuantizedWeight(
        codes=codes[:, inv].contiguous(), scales=scales, zeros=zeros.to(torch.int32),
        group_size=group_size, bits=grid.bits, damp=used_damp, error=float(losses.sum()),
    )
