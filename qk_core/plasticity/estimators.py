"""Pairwise plasticity PP = 4 p (1 - p): the closed form and the empirical check (SPEC 4.3).

p is the probability that a query of bucket j scores key i above key j: q . (k_i - k_j) > 0.

- closed form: delta = H (k_i - k_j), m = mean_j . delta, v = delta^T S_j delta (or the diagonal sum),
  z = m / sqrt(v), p = Phi(z);
- empirical: p_hat = share of bucket-j queries with q . (k_i - k_j) > 0.

PP is 1 when the pair's order is a coin flip for the bucket's queries and 0 when every query ranks the
pair the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import ndtr

from qk_core.plasticity.query_model import QueryModel


@dataclass
class ClosedForm:
    """Closed-form values per pair; ``valid`` is False where delta = 0 or v is not positive."""

    delta1: np.ndarray  # rotated coordinate 1 of delta (the drift direction)
    m: np.ndarray
    v: np.ndarray
    z: np.ndarray
    pp: np.ndarray
    valid: np.ndarray
    zero_delta: np.ndarray  # pairs skipped because k_i = k_j


def pp_from_z(z: np.ndarray) -> np.ndarray:
    """4 p (1 - p) with p = Phi(z), computed as 4 Phi(z) Phi(-z) (accurate in both tails)."""
    return 4.0 * ndtr(z) * ndtr(-z)


def closed_form(model: QueryModel, b: int, delta: np.ndarray) -> ClosedForm:
    """Closed-form PP of query bucket b for key differences ``delta`` (P, d), original basis (4.3).

    Evaluated as m = (H mean_b) . delta and v = delta^T (H S_b H) delta, identical to the SPEC's
    rotated form mean_b . (H delta) and (H delta)^T S_b (H delta) since H is symmetric orthogonal.
    """
    delta = np.asarray(delta, dtype=np.float64)
    mean_o, cov_o = model.original_basis(b)
    norm2 = np.einsum("pi,pi->p", delta, delta)
    zero = norm2 == 0.0
    m = delta @ mean_o
    v = np.einsum("pi,pi->p", delta @ cov_o, delta)  # float64: near-degenerate directions stay exact
    delta1 = delta @ model.H[0]
    scale = (np.trace(model.cov[b]) if model.covariance == "full" else model.cov[b].sum()) / model.d
    valid = (~zero) & np.isfinite(v) & (v > 1e-12 * scale * norm2)
    z = np.full(len(m), np.nan)
    z[valid] = m[valid] / np.sqrt(v[valid])
    pp = np.full(len(m), np.nan)
    pp[valid] = pp_from_z(z[valid])
    return ClosedForm(delta1, m, v, z, pp, valid, zero)


def empirical_p(q_bucket: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """p_hat per pair: share of the bucket's queries with q . delta > 0 (float32 products) (4.3)."""
    scores = np.asarray(q_bucket, dtype=np.float32) @ np.asarray(delta, dtype=np.float32).T
    # column counts of the positive scores: bytes summed down the rows (5x faster than count_nonzero(axis=0))
    acc = np.uint16 if len(scores) < 2**16 else np.int64
    positive = np.add.reduce(np.greater(scores, 0).view(np.uint8), axis=0, dtype=acc)
    return positive / max(len(q_bucket), 1)


def pp_from_p(p: np.ndarray) -> np.ndarray:
    return 4.0 * p * (1.0 - p)
