"""Correlation statistics for the benchmark joins (SPEC 5 c), with exact p-values for small n.

Pearson r, Spearman rho and Kendall tau (tau-b), each with its two-sided p-value and n (SPEC 5):

- Pearson: p from the t distribution with n - 2 degrees of freedom (scipy ``pearsonr``).
- Spearman: a permutation test of rho over the pairings of x with y. For n <= ``EXACT_MAX_N`` (9, i.e.
  at most 362 880 arrangements) every permutation is enumerated; above that ``MC_PERMUTATIONS`` random
  permutations (seeded, so the value is reproducible) are drawn. ``spearman_permutations`` records how
  many, ``spearman_method`` which.
- Kendall: scipy's exact null distribution when neither variable has ties (scipy uses it up to n = 33);
  with ties the same exact enumeration as Spearman's for n <= ``EXACT_MAX_N``, else scipy's asymptotic
  normal approximation. ``kendall_method`` records which.

Two-sided permutation p-values count the arrangements whose |statistic| reaches the observed one:
exactly, p = count / n!; by Monte Carlo, p = (count + 1) / (permutations + 1), the observed arrangement
counted as one of the permutations, so p is never 0 and its resolution is 1 / permutations
(:func:`format_p` prints "< 1/permutations" there). Fewer than ``MIN_N`` finite pairs, or a constant
variable, gives NaN statistics (n is still reported).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np

MIN_N = 3
EXACT_MAX_N = 9
MC_PERMUTATIONS = 20_000
PERMUTATION_SEED = 0
#: relative tolerance when comparing a permuted statistic with the observed one (ties in floating point)
_TOL = 1e-12
STAT_FIELDS = ["n", "pearson_r", "pearson_p", "spearman_rho", "spearman_p", "spearman_method",
               "spearman_permutations", "kendall_tau", "kendall_p", "kendall_method"]
METHOD_EXACT = "exact"
METHOD_MC = "monte carlo"
METHOD_T = "t distribution"
METHOD_ASYMPTOTIC = "asymptotic"


def _pearson_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pearson correlation of each row of ``a`` (..., n) with ``b`` (n,)."""
    ac = a - a.mean(axis=-1, keepdims=True)
    bc = b - b.mean()
    return (ac @ bc) / np.sqrt((ac * ac).sum(axis=-1) * (bc @ bc))


def _kendall_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Kendall tau-b of each row of ``a`` (..., n) with ``b`` (n,); tie counts are permutation-invariant."""
    i, j = np.triu_indices(b.shape[0], k=1)
    sb = np.sign(b[i] - b[j])
    sa = np.sign(a[..., i] - a[..., j])
    n0 = len(i)
    ties_a = n0 - np.count_nonzero(sa[(0,) * (sa.ndim - 1)])
    ties_b = n0 - np.count_nonzero(sb)
    return (sa @ sb) / math.sqrt((n0 - ties_a) * (n0 - ties_b))


def permutation_p(x: np.ndarray, y: np.ndarray, statistic: str, *, exact_max_n: int = EXACT_MAX_N,
                  permutations: int = MC_PERMUTATIONS, seed: int = PERMUTATION_SEED
                  ) -> tuple[float, float, str, int]:
    """(statistic, two-sided p, method, permutations) of a pairing permutation test (SPEC 5).

    ``statistic`` is "spearman" (rho: Pearson of the average ranks) or "kendall" (tau-b). Exact
    enumeration of all n! arrangements when n <= ``exact_max_n``, else ``permutations`` seeded random ones.
    scipy's ``permutation_test`` draws the arrangements and returns the null distribution.
    """
    from scipy import stats  # here, not at import: it is 0.4 s of every process that loads the code location

    if statistic == "spearman":
        a, b, fn = stats.rankdata(x), stats.rankdata(y), _pearson_rows
    elif statistic == "kendall":
        a, b, fn = np.asarray(x, float), np.asarray(y, float), _kendall_rows
    else:
        raise ValueError(f"statistic must be 'spearman' or 'kendall', got {statistic!r}")
    n = len(a)
    exact = n <= exact_max_n or math.factorial(n) <= permutations  # scipy enumerates these anyway
    n_resamples = math.factorial(n) if exact else int(permutations)
    res = stats.permutation_test((a,), lambda s, axis=-1: fn(s, b), permutation_type="pairings",
                                 vectorized=True, n_resamples=n_resamples, rng=np.random.default_rng(seed),
                                 batch=50_000)
    obs = float(res.statistic)
    null = np.asarray(res.null_distribution, dtype=float)
    count = int(np.count_nonzero(np.abs(null) >= abs(obs) * (1 - _TOL) - _TOL))
    if exact:
        return obs, count / len(null), METHOD_EXACT, len(null)
    return obs, (count + 1) / (len(null) + 1), METHOD_MC, len(null)


def correlations(x: Any, y: Any, *, exact_max_n: int = EXACT_MAX_N,
                 permutations: int = MC_PERMUTATIONS) -> dict[str, Any]:
    """Pearson, Spearman and Kendall correlation of paired samples with p-values, methods and n (SPEC 5 c)."""
    from scipy import stats  # here, not at import (as in permutation_p)

    xa = np.asarray(x, dtype=float)
    ya = np.asarray(y, dtype=float)
    if xa.shape != ya.shape:
        raise ValueError(f"paired samples differ in length: {xa.shape} vs {ya.shape}")
    ok = np.isfinite(xa) & np.isfinite(ya)
    xa, ya = xa[ok], ya[ok]
    n = int(xa.size)
    out: dict[str, Any] = dict.fromkeys(STAT_FIELDS, float("nan"))
    out.update(n=n, spearman_method="", kendall_method="", spearman_permutations=0)
    if n < MIN_N or np.ptp(xa) == 0 or np.ptp(ya) == 0:
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pr = stats.pearsonr(xa, ya)
        rho, rho_p, rho_method, n_perm = permutation_p(xa, ya, "spearman", exact_max_n=exact_max_n,
                                                       permutations=permutations)
        ties = len(np.unique(xa)) < n or len(np.unique(ya)) < n
        if not ties and n <= 33:  # scipy's exact null distribution of tau (no ties)
            kt = stats.kendalltau(xa, ya, method="exact")
            tau, tau_p, tau_method = float(kt.statistic), float(kt.pvalue), METHOD_EXACT
        elif n <= exact_max_n:
            tau, tau_p, tau_method, _ = permutation_p(xa, ya, "kendall", exact_max_n=exact_max_n)
        else:
            kt = stats.kendalltau(xa, ya, method="asymptotic")
            tau, tau_p, tau_method = float(kt.statistic), float(kt.pvalue), METHOD_ASYMPTOTIC
    out.update(pearson_r=float(pr.statistic), pearson_p=float(pr.pvalue),
               spearman_rho=rho, spearman_p=float(min(rho_p, 1.0)), spearman_method=rho_method,
               spearman_permutations=int(n_perm),
               kendall_tau=tau, kendall_p=float(min(tau_p, 1.0)), kendall_method=tau_method)
    return out


def format_p(p: float, method: str = "", permutations: int = 0) -> str:
    """A p-value for display; never "0" (SPEC 5).

    A Monte Carlo p at its resolution (no permutation as extreme as the observed one) prints as
    "< 1/permutations"; a p that underflows to 0 (|r| = 1 under the t distribution) as "< 1e-15".
    """
    if p is None or not np.isfinite(p):
        return "n/a"
    if method == METHOD_MC and permutations and p <= 1.0 / (permutations + 1) * (1 + 1e-9):
        return f"< 1/{permutations}"
    if p <= 0:
        return "< 1e-15"
    if p < 1e-3:
        return f"{p:.1e}"
    return f"{p:.3f}" if p < 0.995 else "1"


def p_clause(p: float, method: str = "", permutations: int = 0) -> str:
    """``p = 0.003`` or ``p < 1/20000`` (:func:`format_p` with its relation), for sentences and titles."""
    text = format_p(p, method, permutations)
    return f"p {text}" if text.startswith("<") else f"p = {text}"


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
