"""Correlation statistics for the benchmark joins (SPEC 5 c).

Pearson r, Spearman rho and Kendall tau (tau-b), each with its two-sided p-value and n, as scipy
computes them: Pearson's p from the t distribution with n - 2 degrees of freedom, Spearman's from the
t approximation, Kendall's exact for small samples without ties. Fewer than ``MIN_N`` finite pairs, or
a constant variable, gives NaN statistics (n is still reported).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from scipy import stats

MIN_N = 3
STAT_FIELDS = ["n", "pearson_r", "pearson_p", "spearman_rho", "spearman_p", "kendall_tau", "kendall_p"]


def correlations(x: Any, y: Any) -> dict[str, float | int]:
    """Pearson, Spearman and Kendall correlation of paired samples with p-values and n (SPEC 5 c)."""
    xa = np.asarray(x, dtype=float)
    ya = np.asarray(y, dtype=float)
    if xa.shape != ya.shape:
        raise ValueError(f"paired samples differ in length: {xa.shape} vs {ya.shape}")
    ok = np.isfinite(xa) & np.isfinite(ya)
    xa, ya = xa[ok], ya[ok]
    n = int(xa.size)
    out: dict[str, float | int] = dict.fromkeys(STAT_FIELDS, float("nan"))
    out["n"] = n
    if n < MIN_N or np.ptp(xa) == 0 or np.ptp(ya) == 0:
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pr = stats.pearsonr(xa, ya)
        sr = stats.spearmanr(xa, ya)
        kt = stats.kendalltau(xa, ya)
    out.update(pearson_r=float(pr.statistic), pearson_p=float(pr.pvalue),
               spearman_rho=float(sr.statistic), spearman_p=float(sr.pvalue),
               kendall_tau=float(kt.statistic), kendall_p=float(kt.pvalue))
    return out


def trend_line(x: Any, y: Any) -> tuple[float, float] | None:
    """Ordinary least-squares (slope, intercept) of y on x over finite pairs; None if undefined."""
    xa = np.asarray(x, dtype=float)
    ya = np.asarray(y, dtype=float)
    ok = np.isfinite(xa) & np.isfinite(ya)
    xa, ya = xa[ok], ya[ok]
    if xa.size < 2 or np.ptp(xa) == 0:
        return None
    slope, intercept = np.polyfit(xa, ya, 1)
    return float(slope), float(intercept)
