"""Tests for quant.build.thresholds: histogram collection and min-max / percentile / entropy thresholds."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest
import torch

scipy_stats = pytest.importorskip("scipy.stats")

from quant.build.thresholds import (
    EPS_SCALE,
    AbsHistogram,
    abs_histogram,
    kl_threshold,
    minmax_threshold,
    percentile_threshold,
    scale_from_threshold,
)


def nvidia_entropy_reference(counts, edges, num_bits=8, start_bin=128, stride=1) -> float:
    """Straight, slow port of the steps of NVIDIA pytorch-quantization's `_compute_amax_entropy`."""
    bins = np.array(counts)  # copy: the original mutates its input through a view
    bins[0] = bins[1]
    nbins = 1 << (num_bits - 1)
    divergences = []
    for i in range(start_bin, len(bins) + 1, stride):
        space = np.linspace(0, i, num=nbins + 1)
        digitized = np.digitize(range(i), space) - 1
        digitized[bins[:i] == 0] = -1

        level_counts = np.zeros(nbins, dtype=np.float64)
        for idx, d in enumerate(digitized):
            if d != -1:
                level_counts[d] += bins[idx]
        for key, val in Counter(digitized).items():
            if key != -1:
                level_counts[key] = level_counts[key] / val

        candidate = np.zeros(i, dtype=np.float64)
        for idx, d in enumerate(digitized):
            if d != -1:
                candidate[idx] = level_counts[d]

        reference = np.array(bins[:i])
        reference[-1] += np.sum(bins[i:])
        with np.errstate(invalid="ignore", divide="ignore"):
            divergences.append(scipy_stats.entropy(reference, candidate))

    divergences = np.array(divergences)
    last_argmin = len(divergences) - 1 - np.argmin(divergences[::-1])
    return float(edges[last_argmin * stride + start_bin])


def _hist_from_counts(counts, amax=3.0) -> AbsHistogram:
    counts = np.asarray(counts, dtype=np.int64)
    return AbsHistogram(counts=counts, edges=np.linspace(0.0, amax, len(counts) + 1), amax=amax)


def _gaussian(bins):
    g = torch.Generator().manual_seed(0)
    return abs_histogram([torch.randn(50_000, generator=g)], bins=bins)


def _laplace_outliers(bins):
    rng = np.random.default_rng(1)
    x = rng.laplace(scale=0.5, size=40_000)
    x[:20] = rng.choice([-1.0, 1.0], 20) * rng.uniform(20, 60, 20)
    return abs_histogram([torch.from_numpy(x)], bins=bins)


def _sparse_zero_bins(bins):
    rng = np.random.default_rng(2)
    counts = rng.integers(0, 500, size=bins)
    counts[rng.random(bins) < 0.35] = 0
    counts[-1] = max(counts[-1], 1)
    return _hist_from_counts(counts)


def _front_loaded(bins):
    # nearly all data in the first bins, a lone max at the end (and a ReLU-style spike in bin 0)
    counts = np.zeros(bins, dtype=np.int64)
    counts[:12] = [90_000, 700, 650, 500, 400, 300, 120, 60, 30, 10, 3, 1]
    counts[-1] = 1
    return _hist_from_counts(counts)


def _front_loaded_no_tail(bins):
    # trailing empty bins: many candidates tie at KL == 0 and the larger one must win
    counts = np.zeros(bins, dtype=np.int64)
    counts[:6] = [10, 40, 30, 20, 10, 5]
    return _hist_from_counts(counts)


def _gap_then_cluster(bins):
    # bins 1..199 empty: candidates keeping only empty bins give NaN, which NVIDIA's argmin selects
    counts = np.zeros(bins, dtype=np.int64)
    counts[0] = 5000
    counts[200:] = np.random.default_rng(3).integers(1, 100, size=bins - 200)
    return _hist_from_counts(counts)


@pytest.mark.reference
@pytest.mark.parametrize(
    "make, bins, start_bin, stride",
    [
        (_gaussian, 256, 128, 1),
        (_gaussian, 512, 128, 1),
        (_laplace_outliers, 256, 128, 1),
        (_laplace_outliers, 2048, 128, 16),
        (_sparse_zero_bins, 256, 128, 1),
        (_sparse_zero_bins, 300, 100, 3),
        (_front_loaded, 256, 128, 1),
        (_front_loaded_no_tail, 256, 128, 1),
        (_gap_then_cluster, 256, 128, 1),
    ],
)
def test_kl_matches_nvidia_reference(make, bins, start_bin, stride):
    h = make(bins)
    want = nvidia_entropy_reference(h.counts, h.edges, start_bin=start_bin, stride=stride)
    assert kl_threshold(h, start_bin=start_bin, stride=stride) == want


@pytest.mark.reference
def test_kl_matches_reference_other_bit_width():
    h = _laplace_outliers(256)
    want = nvidia_entropy_reference(h.counts, h.edges, num_bits=6, start_bin=64)
    assert kl_threshold(h, num_bits=6, start_bin=64) == want


@pytest.mark.unit
def test_kl_ignores_bin_zero_count():
    # NVIDIA's bins[0] = bins[1]: the real count in bin 0 has no effect on the result.
    h = _laplace_outliers(256)
    counts = np.array(h.counts)
    counts[0] = 10**7
    h2 = AbsHistogram(counts=counts, edges=h.edges, amax=h.amax)
    assert kl_threshold(h2) == kl_threshold(h)


@pytest.mark.unit
def test_kl_nan_quirk_selects_start_of_data():
    # Candidates keeping only empty bins have NaN divergence; like NVIDIA we let argmin pick the
    # last of them, so the threshold lands on the left edge of the first populated bin.
    h = _gap_then_cluster(256)
    assert kl_threshold(h) == h.edges[200]


@pytest.mark.unit
def test_kl_does_not_mutate_histogram():
    h = _gaussian(256)
    before = np.array(h.counts)
    kl_threshold(h)
    np.testing.assert_array_equal(h.counts, before)


@pytest.mark.unit
def test_kl_clips_heavy_tails_and_keeps_uniform():
    g = torch.Generator().manual_seed(4)
    heavy = torch.from_numpy(np.random.default_rng(4).standard_t(1.5, size=200_000))
    h = abs_histogram([heavy], bins=2048)
    assert kl_threshold(h) < 0.5 * h.amax

    uniform = torch.rand(200_000, generator=g) * 2 - 1
    h = abs_histogram([uniform], bins=2048)
    assert kl_threshold(h) >= 0.97 * h.amax


@pytest.mark.unit
def test_kl_full_search_is_fast():
    h = _laplace_outliers(2048)
    t0 = time.perf_counter()
    kl_threshold(h)
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.unit
def test_kl_argument_checks():
    h = _gaussian(256)
    with pytest.raises(ValueError, match="start_bin"):
        kl_threshold(h, start_bin=257)
    with pytest.raises(ValueError, match="stride"):
        kl_threshold(h, stride=0)


@pytest.mark.unit
def test_percentile_matches_quantile_within_one_bin():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(100_000, generator=g) * 1.7
    h = abs_histogram([x], bins=2048)
    width = h.edges[1] - h.edges[0]
    data = x.abs().double().numpy()
    for pct in (10.0, 50.0, 90.0, 99.0, 99.9, 99.99):
        assert abs(percentile_threshold(h, pct) - np.quantile(data, pct / 100)) <= width * (1 + 1e-9)


@pytest.mark.unit
def test_percentile_100_is_amax_and_bad_pct_rejected():
    h = _gaussian(2048)
    assert percentile_threshold(h, 100) == h.amax == minmax_threshold(h)
    for bad in (0, -1, 100.5, float("nan"), "x"):
        with pytest.raises(ValueError, match="pct"):
            percentile_threshold(h, bad)


@pytest.mark.unit
def test_abs_histogram_basic_properties():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 1000, generator=g)
    h = abs_histogram([x], bins=512)
    assert h.counts.shape == (512,) and h.edges.shape == (513,)
    assert h.counts.sum() == x.numel()
    assert h.edges[0] == 0.0 and h.edges[-1] == h.amax == float(x.abs().max())
    assert not h.counts.flags.writeable


@pytest.mark.unit
def test_abs_histogram_chunks_equal_concatenation():
    g = torch.Generator().manual_seed(7)
    parts = [torch.randn(n, generator=g) * s for n, s in ((1000, 1.0), (10, 9.0), (0, 1.0), (500, 0.1))]
    whole = abs_histogram([torch.cat(parts)], bins=256)
    split = abs_histogram(parts, bins=256)
    as_iter = abs_histogram(iter(parts), bins=256)
    for h in (split, as_iter):
        np.testing.assert_array_equal(h.counts, whole.counts)
        np.testing.assert_array_equal(h.edges, whole.edges)
        assert h.amax == whole.amax


@pytest.mark.unit
def test_abs_histogram_rejects_non_finite_and_empty():
    with pytest.raises(ValueError, match="NaN"):
        abs_histogram([torch.ones(4), torch.tensor([1.0, float("nan")])])
    with pytest.raises(ValueError, match="inf"):
        abs_histogram([torch.tensor([1.0, -float("inf")])])
    with pytest.raises(ValueError, match="no data"):
        abs_histogram([torch.empty(0)])


@pytest.mark.unit
def test_all_zero_data():
    h = abs_histogram([torch.zeros(10, 10), torch.zeros(5)], bins=64)
    assert h.amax == 0.0 and h.counts.sum() == 105 and h.edges[-1] == 0.0
    assert minmax_threshold(h) == percentile_threshold(h, 99.9) == kl_threshold(h, start_bin=32) == 0.0
    assert scale_from_threshold(kl_threshold(h, start_bin=32)) == EPS_SCALE


@pytest.mark.unit
def test_integer_input():
    h = abs_histogram([torch.tensor([-128, 0, 5], dtype=torch.int8)], bins=8)
    assert h.amax == 128.0 and h.counts.sum() == 3


@pytest.mark.unit
def test_scale_from_threshold():
    assert scale_from_threshold(127.0) == 1.0
    assert scale_from_threshold(2.54) == pytest.approx(0.02)
    assert scale_from_threshold(7.0, num_bits=4) == 1.0
    assert scale_from_threshold(0.0) == EPS_SCALE > 0
    assert scale_from_threshold(-3.0) == EPS_SCALE
    with pytest.raises(ValueError):
        scale_from_threshold(float("nan"))
