"""Interval rules (SPEC 4.6, 10, 11.3): percentile, basic (reverse percentile) and bias-corrected (BC)
bootstrap intervals from resamples, the rule a table records, and Wilson's score interval of a proportion."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import scipy.special


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


#: How an interval is read off the resamples (module docstring): basic, bias-corrected (BC) or plain percentile.
INTERVAL_METHODS = {"jackknife_t": "delete-one-document jackknife-t interval, query model refitted, bias-corrected "
                                   "centre, calibrated inflation (SPEC 4.6, 10 revised; qk_core.stats.jackknife)",
                    "basic": "basic (reverse percentile) interval, Davison & Hinkley 1997 eq. 5.6",
                    "bc": "bias-corrected (BC) percentile interval, Efron 1982",
                    "percentile": "percentile interval"}


def read_interval(boot: np.ndarray, point: np.ndarray | float, ci: float, method: str
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(lo, hi, z0, bootstrap bias) of resamples ``boot`` (axis 0) around ``point`` by ``method`` (SPEC 4.6, 10):
    ``basic`` (reverse percentile), ``bc`` (bias-corrected percentile) or ``percentile``; z0 and the bias always."""
    bc = bc_interval(boot, point, ci)
    if method == "bc":
        return bc.lo, bc.hi, bc.z0, bc.bias
    lo, hi = basic_interval(boot, point, ci) if method == "basic" else percentile_interval(boot, ci)
    return lo, hi, bc.z0, bc.bias


def interval_rule(table: pd.DataFrame) -> str:
    """The rule a cross-corpus table's intervals were read by, with its citation (its ``interval`` column;
    a table written before that column: the percentile interval)."""
    given = table["interval"].dropna() if "interval" in table else pd.Series(dtype=object)
    return INTERVAL_METHODS.get(str(given.iloc[0]) if len(given) else "percentile", INTERVAL_METHODS["percentile"])


def wilson(successes: float, n: float, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a proportion (95% by default); (nan, nan) when n = 0."""
    if n <= 0:
        return float("nan"), float("nan")
    p = successes / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return float(max(0.0, centre - half)), float(min(1.0, centre + half))
