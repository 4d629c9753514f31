"""Static per-tensor int8 activation thresholds ("calibration") for W8A8 quantization.

Every method works on one histogram of |x| over all calibration data (`abs_histogram`) and returns
a clipping threshold `amax`; `scale_from_threshold` turns it into a symmetric scale (amax / 127).

* min-max: amax = max |x|.
* percentile: the smallest bin right edge below which `pct` percent of the data lies.
* entropy (KL): the threshold that minimises KL(reference || quantized) between the clipped
  histogram and its 128-level quantized version. This follows NVIDIA's entropy calibration, i.e.
  `_compute_amax_entropy` in pytorch-quantization's `pytorch_quantization/calib/histogram.py`
  (`HistogramCalibrator.compute_amax("entropy")`), itself the algorithm of TensorRT's entropy
  calibrator. For each candidate bin count i (start_bin, start_bin + stride, ..., len(bins)):
    - reference P = bins[:i], with the clipped mass sum(bins[i:]) added to its last bin;
    - candidate Q = bins[:i] merged into 128 levels (source bin k goes to level k * 128 // i)
      and expanded back, each level's mass spread evenly over its *nonzero* source bins only;
    - divergence = KL(P || Q) with both normalised (scipy.stats.entropy semantics);
  and the answer is edges[i] for the minimising i, ties going to the larger i.

The search is vectorised over bins with numpy (one pass per candidate, no per-bin Python loop) and
reproduces NVIDIA's results, quirks included; the quirks are named where they are reproduced.
Only numpy and torch are needed: scipy is a dev dependency of this project, not a runtime one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

# A zero scale would make quantize() divide by zero. Any positive scale maps an all-zero tensor to
# zeros exactly, so a tiny one is safe for the only case that needs it (amax == 0).
EPS_SCALE = 1e-8
_HIST_SLICE = 1 << 24  # elements per histc call (see abs_histogram)


# eq=False: the generated __eq__/__hash__ would compare/hash numpy arrays and raise.
@dataclass(frozen=True, eq=False)
class AbsHistogram:
    """Histogram of |x| with equal-width bins over [0, amax]."""

    counts: np.ndarray  # float64 or int64, shape (bins,)
    edges: np.ndarray  # float64, shape (bins + 1,), edges[0] == 0.0, edges[-1] == amax
    amax: float  # max |x| over the data

    def __post_init__(self) -> None:
        counts = np.array(self.counts, copy=True)
        edges = np.array(self.edges, dtype=np.float64, copy=True)
        if counts.ndim != 1 or counts.size < 1:
            raise ValueError(f"AbsHistogram: counts must be 1-D and non-empty, got shape {counts.shape}")
        if edges.shape != (counts.size + 1,):
            raise ValueError(f"AbsHistogram: edges must have shape ({counts.size + 1},), got {edges.shape}")
        if not np.all(np.isfinite(counts)) or np.any(counts < 0):
            raise ValueError("AbsHistogram: counts must be finite and non-negative")
        if not math.isfinite(self.amax) or self.amax < 0:
            raise ValueError(f"AbsHistogram: amax must be finite and >= 0, got {self.amax}")
        # Copies made read-only so the frozen object really is immutable and callers' arrays are
        # never aliased.
        counts.setflags(write=False)
        edges.setflags(write=False)
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "edges", edges)
        object.__setattr__(self, "amax", float(self.amax))


def _as_float_chunk(c: torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(c).detach()
    # Integers go to float64 first: abs(int8 -128) overflows, and histc needs floating input.
    return t if t.is_floating_point() else t.to(torch.float64)


def abs_histogram(chunks: Iterable[torch.Tensor] | torch.Tensor, bins: int = 2048) -> AbsHistogram:
    """Histogram of |x| over all chunks: exactly `bins` equal-width bins over [0, max |x|].

    Two passes (amax first, then counts) so that every chunk shares one set of edges; unlike
    NVIDIA's collector, which grows the range batch by batch, the result does not depend on how the
    data was split. A sequence is iterated twice; a one-shot iterable is materialised first.
    All-zero data gives amax 0, all-zero edges and every count in bin 0 (all thresholds are 0).
    """
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"abs_histogram: bins must be a positive int, got {bins!r}")
    if isinstance(chunks, torch.Tensor):
        chunks = [chunks]
    elif not isinstance(chunks, Sequence):
        chunks = list(chunks)

    amax = 0.0
    numel = 0
    for k, c in enumerate(chunks):
        t = _as_float_chunk(c)
        if t.numel() == 0:
            continue
        lo, hi = (float(v) for v in torch.aminmax(t))  # one pass; NaN and inf come out in the extremes
        if math.isnan(lo) or math.isnan(hi):
            raise ValueError(f"abs_histogram: chunk {k} contains NaN values")
        if math.isinf(lo) or math.isinf(hi):
            raise ValueError(f"abs_histogram: chunk {k} contains inf values")
        numel += t.numel()
        amax = max(amax, -lo, hi)
    if numel == 0:
        raise ValueError("abs_histogram: no data (all chunks are empty)")

    if amax == 0.0:
        # torch.histc widens a zero-width range to [min-1, max+1], which would put zeros in the
        # middle bin; place them in bin 0 ourselves so that every threshold comes out as 0.
        counts = np.zeros(bins, dtype=np.int64)
        counts[0] = numel
        return AbsHistogram(counts=counts, edges=np.zeros(bins + 1), amax=0.0)

    # histc counts in its input's dtype, exact in float32 up to 2**24 per bin: slices of at most that many
    # elements, summed in float64 (this also bounds the |x| temporary to one slice).
    acc = torch.zeros(bins, dtype=torch.float64)
    for c in chunks:
        flat = _as_float_chunk(c).reshape(-1)
        for a in range(0, flat.numel(), _HIST_SLICE):
            part = torch.histc(flat[a : a + _HIST_SLICE].abs(), bins=bins, min=0.0, max=amax)
            acc += part.to(device="cpu", dtype=torch.float64)
    counts = acc.round().to(torch.int64).cpu().numpy()
    # linspace pins edges[-1] to amax exactly (histc puts |x| == amax in the last bin).
    return AbsHistogram(counts=counts, edges=np.linspace(0.0, amax, bins + 1), amax=amax)


def minmax_threshold(h: AbsHistogram) -> float:
    """The largest |x| seen: nothing is clipped."""
    return h.amax


def percentile_threshold(h: AbsHistogram, pct: float) -> float:
    """Smallest bin right edge at which the cumulative count reaches pct/100 of the total.

    Same search as NVIDIA's `_compute_amax_percentile` (cdf + searchsorted, side='left'), with one
    deliberate difference: NVIDIA returns edges[idx], the *left* edge of the bin where the cdf
    crosses, which clips part of that bin and gives amax - width for pct=100. We return the right
    edge edges[idx + 1], so that pct=100 gives amax and at least pct percent lies below the result.
    Cumulative counts (not a normalised cdf) avoid rounding keeping the cdf just below 1.0.
    """
    try:
        ok = 0.0 < float(pct) <= 100.0  # also False for NaN
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"percentile_threshold: pct must be in (0, 100], got pct={pct!r}")
    cum = np.cumsum(np.asarray(h.counts, dtype=np.float64))
    total = cum[-1]
    if total == 0 or h.amax == 0.0:
        return 0.0
    idx = int(np.searchsorted(cum, total * (float(pct) / 100.0), side="left"))
    idx = min(idx, len(cum) - 1)
    return float(h.edges[idx + 1])


def _kl_normalised(p: np.ndarray, p_sum: float, q: np.ndarray, q_sum: float) -> float:
    """KL(p || q) after normalising both, as scipy.stats.entropy(p, q) computes it."""
    pn = p / p_sum
    qn = q / q_sum
    pos = pn > 0
    if np.any(pos & (qn == 0)):
        return math.inf  # rel_entr(x > 0, 0) = inf
    terms = np.zeros_like(pn)
    terms[pos] = pn[pos] * np.log(pn[pos] / qn[pos])
    # Summed over the full length-i vector (zeros included) so numpy's pairwise summation groups
    # the terms the way scipy's sum over rel_entr's output does.
    return float(np.sum(terms))


def kl_threshold(h: AbsHistogram, num_bits: int = 8, start_bin: int = 128, stride: int = 1) -> float:
    """Entropy (KL-divergence) calibration, reproducing NVIDIA's `_compute_amax_entropy`.

    Signed quantization only: 1 << (num_bits - 1) levels (128 for int8), like NVIDIA with
    unsigned=False. Returns h.edges[i] for the best candidate i in start_bin..len(bins) by stride.
    """
    if num_bits < 2:
        raise ValueError(f"kl_threshold: num_bits must be >= 2, got {num_bits}")
    if stride < 1:
        raise ValueError(f"kl_threshold: stride must be >= 1, got {stride}")
    n = len(h.counts)
    if n < 2:
        raise ValueError("kl_threshold: the histogram needs at least 2 bins")
    if not 1 <= start_bin <= n:
        # NVIDIA would fail inside np.argmin on an empty list here.
        raise ValueError(f"kl_threshold: start_bin must be in [1, {n}] (number of bins), got {start_bin}")
    if h.amax == 0.0:
        return 0.0

    # Work on a copy: NVIDIA's `bins = calib_hist[:]` is a numpy *view*, so its next line writes
    # into the caller's histogram (on its numpy-collector path). We keep the effect, not the mutation.
    bins = np.array(h.counts, dtype=np.float64)
    # Quirk reproduced: NVIDIA overwrites bin 0 with bin 1 before the search (and before taking
    # the total), so the spike of exact zeros after ReLU/padding neither dominates nor counts
    # toward the divergence. The real count of bin 0 is therefore ignored.
    bins[0] = bins[1]
    total = float(np.sum(bins))
    if total == 0.0:
        return 0.0
    nbins = 1 << (num_bits - 1)

    candidates = np.arange(start_bin, n + 1, stride)
    divergences = np.empty(len(candidates))
    src = np.arange(n, dtype=np.int64)
    nonzero = bins != 0
    for c, i in enumerate(candidates):
        kept = bins[:i]
        # NVIDIA uses np.digitize(range(i), np.linspace(0, i, nbins + 1)) - 1; nbins is a power of
        # two, so those edges are exact and the level of source bin k is exactly k * nbins // i.
        level = (src[:i] * nbins) // i
        nz = nonzero[:i]
        level_mass = np.bincount(level, weights=kept, minlength=nbins)
        level_nnz = np.bincount(level[nz], minlength=nbins)
        # Empty source bins stay empty in Q: a level's mass is spread only over its nonzero bins.
        with np.errstate(divide="ignore", invalid="ignore"):
            per_bin = level_mass / level_nnz
        q = np.where(nz, per_bin[level], 0.0)

        p = kept.copy()
        p[-1] += np.sum(bins[i:])  # clipped outliers all land in the last kept bin
        q_sum = float(np.sum(q))
        if q_sum == 0.0:
            # Quirk reproduced: when every kept bin is empty, scipy normalises Q by 0 and the
            # divergence is NaN; np.argmin treats NaN as the minimum, so NVIDIA *selects* such a
            # candidate (the largest one), clipping at the start of the data. Only histograms
            # whose bins 1..start_bin-1 are all empty can hit this.
            divergences[c] = math.nan
        else:
            divergences[c] = _kl_normalised(p, float(np.sum(p)), q, q_sum)

    # Ties (and NaNs, see above) go to the last candidate, i.e. the larger threshold, as NVIDIA's
    # `len(d) - 1 - np.argmin(d[::-1])` does.
    best = len(divergences) - 1 - int(np.argmin(divergences[::-1]))
    return float(h.edges[int(candidates[best])])


def scale_from_threshold(amax: float, num_bits: int = 8) -> float:
    """Symmetric scale for the integer range [-(2**(b-1) - 1), 2**(b-1) - 1]: amax / 127 for int8.

    amax <= 0 (all-zero calibration data) returns EPS_SCALE (1e-8) instead of 0, so that
    quantizing divides by a positive number; every zero input still quantizes to 0.
    """
    if num_bits < 2:
        raise ValueError(f"scale_from_threshold: num_bits must be >= 2, got {num_bits}")
    if math.isnan(amax) or math.isinf(amax):
        raise ValueError(f"scale_from_threshold: amax must be finite, got {amax}")
    if amax <= 0:
        return EPS_SCALE
    scale = amax / ((1 << (num_bits - 1)) - 1)
    return scale if scale > 0 else EPS_SCALE  # amax so small the division underflowed
