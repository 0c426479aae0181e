"""Aggregates of a plasticity profile (SPEC 4.5), vectorised over leading axes (heads, resamples).

A profile is AP_j for buckets j = 0..J-1 (NaN where a bucket has no value) at midpoints
tau_j = (j + 0.5) B in raw tokens.

- AP_overall: mean of AP_j weighted by the bucket's positions inside L, min(B, L - jB).
- AP_first20 / AP_last20: plain mean of AP_j over tau_j in [0, 0.2 L) / [0.8 L, L]; AP_drop = difference.
- Quintiles, deciles: the same rule on [kL/n, (k+1)L/n), the last bin closed.
- Length bins: [e_i, e_{i+1}) on the configured raw-token edges, last bin closed. RULER lengths X:
  (X/2, X]. Absolute position bins: [e_i, e_{i+1}), last closed.
A bucket belongs to the bin holding its tau. A bin narrower than one bucket is missing (status
``narrower_than_bucket``), never interpolated; a bin holding no bucket (``no_bucket``) or only buckets
without a value (``no_usable_bucket``) is missing too.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from qk_core.config.options import PlasticityOptions, n_buckets

HEADLINE = ("ap_overall", "ap_first20", "ap_last20", "ap_drop")
BIN_METRICS = ("ap_quintile", "ap_decile", "ap_length_bin", "ap_length_bin_ruler", "ap_position_bin")


def fmt_tokens(x: float) -> str:
    """Token counts as the thesis labels them: 0, 256, 512, 1k, 1.5k, 8k, 128k."""
    x = round(x)
    if x >= 1024 and x % 512 == 0:
        return f"{x / 1024:g}k"
    return str(x)


@dataclass(frozen=True)
class Bin:
    """A set of query positions in raw tokens: lo..hi with the given closedness."""

    metric: str
    key: str
    lo: float
    hi: float
    left_closed: bool = True
    right_closed: bool = False

    @property
    def width(self) -> float:
        return self.hi - self.lo

    def members(self, tau: np.ndarray) -> np.ndarray:
        left = tau >= self.lo if self.left_closed else tau > self.lo
        right = tau <= self.hi if self.right_closed else tau < self.hi
        return left & right


def _edge_bins(metric: str, edges: tuple[float, ...] | list[float], labels: list[str] | None = None) -> list[Bin]:
    n = len(edges) - 1
    labels = labels or [f"{fmt_tokens(a)}-{fmt_tokens(b)}" for a, b in itertools.pairwise(edges)]
    return [Bin(metric, labels[i], float(edges[i]), float(edges[i + 1]), True, i == n - 1) for i in range(n)]


def _fraction_bins(metric: str, L: int, n: int) -> list[Bin]:
    step = 100 // n
    labels = [f"{k * step}-{(k + 1) * step}%" for k in range(n)]
    return _edge_bins(metric, [k * L / n for k in range(n + 1)], labels)


def headline_bins(L: int) -> list[Bin]:
    """The first-20% and last-20% bins of SPEC 4.5."""
    return [Bin("ap_first20", "", 0.0, 0.2 * L, True, False), Bin("ap_last20", "", 0.8 * L, float(L), True, True)]


def all_bins(L: int, B: int, opts: PlasticityOptions) -> list[Bin]:
    """Quintiles, deciles, length bins, RULER bins and absolute position bins, in that order."""
    out = _fraction_bins("ap_quintile", L, 5) + _fraction_bins("ap_decile", L, 10)
    out += _edge_bins("ap_length_bin", opts.length_bin_edges)
    out += [Bin("ap_length_bin_ruler", fmt_tokens(x), x / 2, float(x), False, True) for x in opts.ruler_lengths]
    out += _edge_bins("ap_position_bin", opts.resolved_position_edges(L, B))
    return out


def bucket_tau(L: int, B: int) -> np.ndarray:
    return (np.arange(n_buckets(L, B)) + 0.5) * B


def bucket_weights(L: int, B: int) -> np.ndarray:
    """Positions of bucket j inside the window: min(B, L - jB) (SPEC 4.5)."""
    j = np.arange(n_buckets(L, B))
    return np.clip(L - j * B, 0, B).astype(np.float64)


def membership(bins: list[Bin], L: int, B: int) -> np.ndarray:
    """(n_bins, J) boolean: bucket j belongs to the bin; rows of bins narrower than B are all False."""
    tau = bucket_tau(L, B)
    return np.array([b.members(tau) & (b.width >= B) for b in bins], dtype=bool).reshape(len(bins), len(tau))


def bin_status(bins: list[Bin], L: int, B: int, has_value: np.ndarray) -> list[str]:
    """Per bin: ok, narrower_than_bucket, no_bucket or no_usable_bucket (has_value: (J,) bool)."""
    tau = bucket_tau(L, B)
    out = []
    for b in bins:
        mem = b.members(tau)
        if b.width < B:
            out.append("narrower_than_bucket")
        elif not mem.any():
            out.append("no_bucket")
        elif not (mem & has_value).any():
            out.append("no_usable_bucket")
        else:
            out.append("ok")
    return out


def masked_mean(ap: np.ndarray, mask: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Mean over the last axis of ap restricted to mask rows; ap (..., J), mask (n, J) -> (..., n).

    NaN entries of ap are left out; a row with nothing left is NaN (its status says why).
    """
    ap = np.asarray(ap, dtype=np.float64)
    w = np.ones(ap.shape[-1]) if weights is None else np.asarray(weights, dtype=np.float64)
    have = np.isfinite(ap)
    vals = np.where(have, ap, 0.0) * w
    W = mask.astype(np.float64).T  # (J, n)
    num = vals @ W
    den = (have * w) @ W
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def headline(ap: np.ndarray, L: int, B: int) -> dict[str, np.ndarray]:
    """AP_overall, AP_first20, AP_last20, AP_drop of profiles ap (..., J) (SPEC 4.5)."""
    overall = masked_mean(ap, np.ones((1, ap.shape[-1]), dtype=bool), bucket_weights(L, B))[..., 0]
    fl = masked_mean(ap, membership(headline_bins(L), L, B))
    return {"ap_overall": overall, "ap_first20": fl[..., 0], "ap_last20": fl[..., 1],
            "ap_drop": fl[..., 0] - fl[..., 1]}
