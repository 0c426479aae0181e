"""Intervals of SPEC 11.3: Wilson for accuracy, document cluster bootstrap for margins and contrasts."""

from __future__ import annotations

import numpy as np

from qk_core.stats.bootstrap import doc_weights, percentile_interval


def wilson(successes: float, n: float, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a proportion (95% by default); (nan, nan) when n = 0."""
    if n <= 0:
        return float("nan"), float("nan")
    p = successes / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return float(max(0.0, centre - half)), float(min(1.0, centre + half))


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
