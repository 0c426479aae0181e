"""Leave-one-document-out profiles with the query model refitted (SPEC 4.6 as revised).

The document bootstrap of SPEC 4.6 holds the query model (4.1) fixed, so the model's own estimation error -
a fitted bucket mean makes |z| too large on average and biases AP low by up to 2% at 16-64 documents - is in
no interval. Here every document d is left out in turn and *everything* is refitted on the others: the query
model (regression, Householder, bucket means and Ledoit-Wolf covariances) from the other documents' queries,
the closed form (4.3) of the other documents' key pairs under it, and the empirical p_hat (4.3) from the
other documents' queries. The (D, J) leave-one-out profiles feed :mod:`qk_core.stats.jackknife`: a
bias-corrected AP (the query model's bias removed) and a standard error that carries the model's error.

The key pairs are those of the full analysis (4.2): a pair belongs to one document, so leaving the document out
drops its pairs. Cost: D query-model fits and D closed-form passes over the pairs per head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qk_core.plasticity.estimators import closed_form, pp_from_p
from qk_core.plasticity.query_model import OK, QueryModelError, fit_sorted_queries


@dataclass
class LeaveOneOut:
    """(D, J) leave-one-document-out profiles; NaN where a bucket has no value without the document."""

    closed: np.ndarray
    empirical: np.ndarray


def loo_profiles(q_sorted: np.ndarray, t_sorted: np.ndarray, qdoc_sorted: np.ndarray, counts: np.ndarray,
                 L: int, B: int, covariance: str, min_queries: int, pair_bucket: np.ndarray, delta: np.ndarray,
                 pair_doc: np.ndarray, n_docs: int) -> LeaveOneOut:
    """Leave-one-out AP_j of every document (module docstring).

    q_sorted, t_sorted, qdoc_sorted: queries sorted by bucket (``counts`` per bucket), their positions and their
    documents as indices 0..n_docs-1 (-1: not a bootstrap document, never left out); pair_bucket, delta,
    pair_doc: the valid pairs' query bucket, k_i - k_j (float64) and document index.
    """
    J = len(counts)
    closed = np.full((n_docs, J), np.nan)
    emp = np.full((n_docs, J), np.nan)
    q32 = np.asarray(q_sorted, dtype=np.float32)
    starts = np.concatenate([[0], np.cumsum(counts)])
    buckets = [j for j in np.unique(pair_bucket) if counts[j]]
    # empirical: positives per (query document, pair) once; leaving d out subtracts its row (4.3)
    for j in buckets:
        sel = np.flatnonzero(pair_bucket == j)
        s, e = int(starts[j]), int(starts[j + 1])
        qd = qdoc_sorted[s:e]
        positive = (q32[s:e] @ delta[sel].astype(np.float32).T > 0).astype(np.float64)  # (n_b, P_j)
        known = qd >= 0
        pos_d = np.zeros((n_docs, len(sel)))
        np.add.at(pos_d, qd[known], positive[known])
        n_d = np.bincount(qd[known], minlength=n_docs).astype(np.float64)
        n_left = (e - s) - n_d  # (D,)
        with np.errstate(invalid="ignore", divide="ignore"):
            p = (positive.sum(axis=0)[None, :] - pos_d) / n_left[:, None]
        pp = pp_from_p(p)
        pp[pair_doc[sel][None, :] == np.arange(n_docs)[:, None]] = np.nan  # the document's own pairs leave too
        pp[n_left < min_queries] = np.nan
        with np.errstate(invalid="ignore"):
            cnt = np.isfinite(pp).sum(axis=1)
            emp[:, j] = np.where(cnt > 0, np.nansum(pp, axis=1) / np.maximum(cnt, 1), np.nan)
    # closed form: the query model refitted without document d (4.1, 4.3)
    for d in range(n_docs):
        keep = qdoc_sorted != d
        cnt_d = np.bincount(np.searchsorted(starts[1:], np.flatnonzero(~keep), side="right"), minlength=J)
        try:
            model = fit_sorted_queries(q_sorted[keep], t_sorted[keep], counts - cnt_d[:J], L, B, covariance,
                                       min_queries)
        except QueryModelError:
            continue
        for j in buckets:
            if model.status[j] != OK:
                emp[d, j] = np.nan
                continue
            sel = (pair_bucket == j) & (pair_doc != d)
            if not sel.any():
                continue
            cf = closed_form(model, j, delta[sel])
            if cf.valid.any():
                closed[d, j] = float(cf.pp[cf.valid].mean())
    return LeaveOneOut(closed, emp)
