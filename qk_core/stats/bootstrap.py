"""Document-level cluster bootstrap of the per-pair PP values (SPEC 4.6), query model held fixed.

A resample draws D documents with replacement from the capture's D documents; document d enters
with multiplicity w_rd. Every pair of a document belongs to one query bucket, so the resampled
profile is AP*_rj = sum_d w_rd S_dj / sum_d w_rd N_dj, with S_dj the sum and N_dj the count of the
PP values of document d's pairs in bucket j. All resamples are one matrix product W @ S.

The weight matrix depends only on (seed, D): every head of a model shares it, so a model-level
interval is the percentile interval of the mean over heads of the per-head resampled aggregates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.special

BOOTSTRAP_STREAM = 0xB0_07  # separates the bootstrap generator from the pair generators


def doc_weights(n_docs: int, n_resamples: int, seed: int, stream: int = 0) -> np.ndarray:
    """(R, D) multiplicities of D documents in R resamples with replacement (rows sum to D).

    ``stream`` > 0 draws resamples independent of stream 0's for the same (seed, D): SPEC 10 resamples each
    corpus of a model independently (:mod:`qk_core.cross_corpus.compare`); stream 0 is what every analysis uses.
    """
    rng = np.random.default_rng([int(seed), BOOTSTRAP_STREAM, *([int(stream)] if stream else [])])
    if n_resamples <= 0 or n_docs <= 0:
        return np.zeros((0, max(n_docs, 0)))
    draws = rng.integers(0, n_docs, size=(n_resamples, n_docs))
    flat = (np.arange(n_resamples)[:, None] * n_docs + draws).ravel()
    return np.bincount(flat, minlength=n_resamples * n_docs).reshape(n_resamples, n_docs).astype(np.float64)


def doc_bucket_sums(doc_index: np.ndarray, bucket: np.ndarray, pp: np.ndarray, n_docs: int,
                    J: int) -> tuple[np.ndarray, np.ndarray]:
    """(D, J) sums and counts of PP per document and query bucket (non-finite PP left out)."""
    ok = np.isfinite(pp)
    flat = doc_index[ok] * J + bucket[ok]
    S = np.bincount(flat, weights=pp[ok], minlength=n_docs * J).reshape(n_docs, J)
    N = np.bincount(flat, minlength=n_docs * J).reshape(n_docs, J).astype(np.float64)
    return S, N


def resampled_profiles(W: np.ndarray, S: np.ndarray, N: np.ndarray) -> np.ndarray:
    """(R, J) resampled AP_j; NaN where a resample holds no pair of bucket j."""
    num = W @ S
    den = W @ N
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def _sorted_quantiles(srt: np.ndarray, n: np.ndarray, q: np.ndarray) -> np.ndarray:
    """numpy's default (linear) quantile q (per column, broadcast) of the first n values of each sorted column."""
    pos = q * np.maximum(n - 1, 0)
    below = np.floor(pos).astype(np.int64)
    above = np.minimum(below + 1, np.maximum(n - 1, 0))
    frac = pos - below
    lo_v = np.take_along_axis(srt, below[None, ...], axis=0)[0]
    hi_v = np.take_along_axis(srt, above[None, ...], axis=0)[0]
    diff = hi_v - lo_v
    with np.errstate(invalid="ignore"):  # numpy's lerp: exact at both ends
        val = np.where(frac >= 0.5, hi_v - diff * (1.0 - frac), lo_v + diff * frac)
    return np.where(n > 0, val, np.nan)


def percentile_interval(samples: np.ndarray, ci: float = 0.95, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval over ``axis`` ignoring NaN resamples (all-NaN -> NaN).

    numpy's default (linear) percentile of the non-NaN values, computed for every column at once from one
    sort (NaN sorts last) instead of ``np.nanpercentile``'s loop over columns.
    """
    a = (1.0 - ci) / 2.0
    x = np.moveaxis(np.asarray(samples, dtype=np.float64), axis, 0)
    if x.shape[0] == 0:
        return np.full(x.shape[1:], np.nan), np.full(x.shape[1:], np.nan)
    srt = np.sort(x, axis=0)
    n = (~np.isnan(x)).sum(axis=0)
    return (_sorted_quantiles(srt, n, np.full(n.shape, a)), _sorted_quantiles(srt, n, np.full(n.shape, 1.0 - a)))


@dataclass(frozen=True)
class BCInterval:
    """A bias-corrected percentile interval and what it corrected (arrays, one value per column)."""

    lo: np.ndarray
    hi: np.ndarray
    z0: np.ndarray  # Phi^-1(share of resamples below the point value; ties count half)
    bias: np.ndarray  # bootstrap bias: mean of the resamples - point value
    q_lo: np.ndarray  # the percentiles (in [0, 1]) read off the resamples
    q_hi: np.ndarray


def bc_interval(samples: np.ndarray, point: np.ndarray | float, ci: float = 0.95, axis: int = 0) -> BCInterval:
    """Bias-corrected (BC) percentile interval (Efron 1982; Efron & Tibshirani 1993, section 14.3).

    z0 = Phi^-1(p), p = share of the non-NaN resamples below the point value (ties count half); the interval
    is the pair of resample quantiles Phi(2 z0 - z) and Phi(2 z0 + z), z = Phi^-1((1 + ci) / 2), read like
    :func:`percentile_interval` (which it equals when z0 = 0, i.e. when the point is the resamples' median).
    It holds the point value whenever |z0| < z (the point lies inside the resamples' central ci range); when
    every resample falls on one side of the point (|z0| infinite) it ends at the extreme resample.
    """
    x = np.moveaxis(np.asarray(samples, dtype=np.float64), axis, 0)
    theta = np.broadcast_to(np.asarray(point, dtype=np.float64), x.shape[1:])
    shape = x.shape[1:]
    if x.shape[0] == 0:
        nan = np.full(shape, np.nan)
        return BCInterval(nan, nan, nan, nan, nan, nan)
    ok = ~np.isnan(x)
    n = ok.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        below = ((x < theta) & ok).sum(axis=0) + 0.5 * ((x == theta) & ok).sum(axis=0)
        z0 = np.where((n > 0) & np.isfinite(theta), scipy.special.ndtri(below / np.maximum(n, 1)), np.nan)
        bias = np.where(n > 0, np.where(ok, x, 0.0).sum(axis=0) / np.maximum(n, 1) - theta, np.nan)
    z = scipy.special.ndtri((1.0 + ci) / 2.0)
    q_lo, q_hi = scipy.special.ndtr(2 * z0 - z), scipy.special.ndtr(2 * z0 + z)
    srt = np.sort(x, axis=0)
    valid = ~np.isnan(z0)
    lo = np.where(valid, _sorted_quantiles(srt, n, np.where(valid, q_lo, 0.0)), np.nan)
    hi = np.where(valid, _sorted_quantiles(srt, n, np.where(valid, q_hi, 0.0)), np.nan)
    return BCInterval(lo, hi, z0, bias, q_lo, q_hi)


def basic_interval(samples: np.ndarray, point: np.ndarray | float, ci: float = 0.95,
                   axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Basic (reverse percentile) interval [2 theta - q_hi, 2 theta - q_lo] (Davison & Hinkley 1997, eq. 5.6):
    the resamples' spread around the point value, reflected, so a resample distribution that sits below the
    point (a downward-biased estimator) moves the interval up. Holds the point exactly when
    :func:`percentile_interval` does."""
    q_lo, q_hi = percentile_interval(samples, ci, axis)
    theta = np.asarray(point, dtype=np.float64)
    return 2 * theta - q_hi, 2 * theta - q_lo
