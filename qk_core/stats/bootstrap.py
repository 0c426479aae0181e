"""Document-level cluster bootstrap of the per-pair PP values (SPEC 4.6), query model held fixed.

A resample draws D documents with replacement from the capture's D documents; document d enters
with multiplicity w_rd. Every pair of a document belongs to one query bucket, so the resampled
profile is AP*_rj = sum_d w_rd S_dj / sum_d w_rd N_dj, with S_dj the sum and N_dj the count of the
PP values of document d's pairs in bucket j. All resamples are one matrix product W @ S.

The weight matrix depends only on (seed, D): every head of a model shares it, so a model-level
interval is the percentile interval of the mean over heads of the per-head resampled aggregates.
"""

from __future__ import annotations

import numpy as np

from qk_core.stats.intervals import percentile_interval

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


def doc_sums(doc_index: np.ndarray, values: np.ndarray, n_docs: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-document sums of ``values`` and trial counts (the bootstrap's sufficient statistics)."""
    s = np.bincount(doc_index, weights=values.astype(np.float64), minlength=n_docs)
    n = np.bincount(doc_index, minlength=n_docs).astype(np.float64)
    return s, n


def boot_means(W: np.ndarray, s: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Resampled means (R,) from (R, D) document weights and per-document sums / counts."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return (W @ s) / (W @ n)


def mean_interval(doc_index: np.ndarray, values: np.ndarray, n_docs: int, resamples: int, seed: int,
                  ci: float = 0.95) -> tuple[float, float]:
    """Document bootstrap interval of the mean of ``values``."""
    W = doc_weights(n_docs, resamples, seed)
    s, n = doc_sums(doc_index, values, n_docs)
    lo, hi = percentile_interval(boot_means(W, s, n), ci)
    return float(lo), float(hi)
