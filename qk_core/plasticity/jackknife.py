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

With the query model of every position (coverage ``all``, SPEC 12.2) the refit subtracts the left-out
document's per-bucket query sums from the merged ones (:func:`loo_profiles_from_moments`); the capture keeps
those sums for at most ``capture.moment_groups`` contiguous groups of documents, so past that many documents
the unit left out is a group (the delete-a-group jackknife, G - 1 degrees of freedom).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from qk_core.plasticity.estimators import closed_form, pp_from_p, pp_from_z
from qk_core.plasticity.query_model import (
    OK,
    QueryModel,
    QueryModelError,
    fit_query_model_from_moments,
    fit_sorted_queries,
    position_regressions,
    shrunk_bucket_covariances,
)


@dataclass
class LeaveOneOut:
    """(D, J) leave-one-document-out profiles; NaN where a bucket has no value without the document."""

    closed: np.ndarray
    empirical: np.ndarray


def loo_profiles(q_sorted: np.ndarray, t_sorted: np.ndarray, qdoc_sorted: np.ndarray, counts: np.ndarray,
                 L: int, B: int, covariance: str, min_queries: int, pair_bucket: np.ndarray, delta: np.ndarray,
                 pair_doc: np.ndarray, n_docs: int, refit_loop: bool = False) -> LeaveOneOut:
    """Leave-one-out AP_j of every document (module docstring).

    q_sorted, t_sorted, qdoc_sorted: queries sorted by bucket (``counts`` per bucket), their positions and their
    documents as indices 0..n_docs-1 (-1: not a bootstrap document, never left out); pair_bucket, delta,
    pair_doc: the valid pairs' query bucket, k_i - k_j (float64) and document index. ``covariance = "full"``
    uses :func:`_closed_full` (the same numbers from per-document sums of the pair projections q . delta);
    ``refit_loop`` (and ``diagonal``) refits :func:`fit_sorted_queries` per document and runs the closed form.
    """
    J = len(counts)
    closed = np.full((n_docs, J), np.nan)
    starts = np.concatenate([[0], np.cumsum(counts)])
    buckets = [j for j in np.unique(pair_bucket) if counts[j]]
    emp = _loo_empirical(q_sorted, qdoc_sorted, starts, buckets, pair_bucket, delta, pair_doc, n_docs, min_queries)
    if covariance == "full" and not refit_loop:
        _closed_full(closed, emp, q_sorted, t_sorted, qdoc_sorted, counts, B, min_queries, buckets, pair_bucket,
                     delta, pair_doc)
        return LeaveOneOut(closed, emp)
    # closed form: the query model refitted without document d (4.1, 4.3)
    for d in range(n_docs):
        keep = qdoc_sorted != d
        cnt_d = np.bincount(np.searchsorted(starts[1:], np.flatnonzero(~keep), side="right"), minlength=J)
        try:
            model = fit_sorted_queries(q_sorted[keep], t_sorted[keep], counts - cnt_d[:J], L, B, covariance,
                                       min_queries)
        except QueryModelError:
            continue
        _closed_refitted(closed, emp, d, model, buckets, pair_bucket, pair_doc, delta)
    return LeaveOneOut(closed, emp)


def _closed_refitted(closed: np.ndarray, emp: np.ndarray, d: int, model: QueryModel, buckets: list[int],
                     pair_bucket: np.ndarray, pair_doc: np.ndarray, delta: np.ndarray) -> None:
    """Row ``d`` of ``closed``: the closed form (4.3) of the pairs outside unit ``d`` under ``model``, the query
    model refitted without it; a bucket the refit leaves without a model loses its empirical value too."""
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


def _closed_full(closed: np.ndarray, emp: np.ndarray, q: np.ndarray, t: np.ndarray, qdoc: np.ndarray,
                 counts: np.ndarray, B: int, min_queries: int, buckets: list[int], pair_bucket: np.ndarray,
                 delta: np.ndarray, pair_doc: np.ndarray) -> None:
    """Leave-one-out closed form (4.1, 4.3, covariance ``full``) for every document at once, into ``closed``.

    Without document d the regression gives alpha, beta (per-document sums of n, t, t^2, x, x t), bhat = beta /
    |beta| (e1 when the drift is negligible, as in :func:`fit_sorted_queries`) and bucket j's model
    m = mean . delta + (alpha_pos + beta_pos tau_j - bhat . mean)(bhat . delta) and
    v = (1 - lambda) delta^T S delta + lambda mu |delta|^2, S the ML covariance of the detrended queries
    r = q - alpha - beta t, whose quadratic form is mean (r . delta)^2 - (mean r . delta)^2: from per-document
    sums of q . delta, (q . delta)^2 and t q . delta. The Ledoit-Wolf intensity lambda and mu = tr S / d come
    from :func:`ledoit_wolf` on the bucket's remaining detrended queries, as in the refit.
    """
    D, d = closed.shape[0], q.shape[1]
    Q = np.asarray(q, dtype=np.float64)
    t = np.asarray(t, dtype=np.float64)
    known = qdoc >= 0
    onehot = np.zeros((D, len(t)))
    onehot[qdoc[known], np.flatnonzero(known)] = 1.0
    # the regression on position without each document (4.1)
    n = len(t) - onehot.sum(axis=1)
    st, stt = t.sum() - onehot @ t, (t * t).sum() - onehot @ (t * t)
    sx, sxt = Q.sum(axis=0) - onehot @ Q, t @ Q - onehot @ (Q * t[:, None])
    sxx = (Q * Q).sum() - onehot @ (Q * Q).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        tbar, qbar = st / n, sx / n[:, None]
        s_tt = stt - n * tbar * tbar
        beta = (sxt - n[:, None] * qbar * tbar[:, None]) / s_tt[:, None]
        alpha = qbar - beta * tbar[:, None]
        norm = np.linalg.norm(beta, axis=1)
        sst = sxx - n * (qbar * qbar).sum(axis=1)
        negligible = (norm * np.sqrt(s_tt / n) <= 1e-9 * np.sqrt(sst / n + 1e-300)) | (norm <= 1e-12)
        bhat = np.where(negligible[:, None], np.eye(d)[0], beta / np.where(norm > 0, norm, 1.0)[:, None])
    alpha_pos, beta_pos = (bhat * alpha).sum(axis=1), (bhat * beta).sum(axis=1)
    starts = np.concatenate([[0], np.cumsum(counts)])
    own = pair_doc[None, :] == np.arange(D)[:, None]
    for j in buckets:
        s, e = int(starts[j]), int(starts[j + 1])
        sel = np.flatnonzero(pair_bucket == j)
        dl, Qb, tb, oh = delta[sel], Q[s:e], t[s:e], onehot[:, s:e]
        proj = Qb @ dl.T  # (n_b, P): q . delta
        nb = (e - s) - oh.sum(axis=1)  # (D,) the bucket's queries without document d
        a1 = proj.sum(axis=0)[None, :] - oh @ proj
        a2 = (proj * proj).sum(axis=0)[None, :] - oh @ (proj * proj)
        at = (tb @ proj)[None, :] - oh @ (proj * tb[:, None])
        sb_t, sb_tt = tb.sum() - oh @ tb, (tb * tb).sum() - oh @ (tb * tb)
        sb_x = Qb.sum(axis=0)[None, :] - oh @ Qb  # (D, d)
        ad, bd = alpha @ dl.T, beta @ dl.T  # (D, P): alpha . delta, beta . delta
        with np.errstate(invalid="ignore", divide="ignore"):
            nn = nb[:, None]
            r1 = a1 - nn * ad - bd * sb_t[:, None]  # sum of r . delta over the bucket
            r2 = (a2 - 2 * ad * a1 - 2 * bd * at + nn * ad * ad + 2 * ad * bd * sb_t[:, None]
                  + bd * bd * sb_tt[:, None])  # sum of (r . delta)^2
            quad = r2 / nn - (r1 / nn) ** 2
            coef = alpha_pos + beta_pos * (j + 0.5) * B - (bhat * (sb_x / nb[:, None])).sum(axis=1)
            m = a1 / nn + coef[:, None] * (bhat @ dl.T)
        norm2 = (dl * dl).sum(axis=1)[None, :]
        lam, mu = ledoit_wolf_left_out(Qb, tb, alpha, beta, oh, nb >= min_queries)
        with np.errstate(invalid="ignore", divide="ignore"):
            v = (1 - lam[:, None]) * quad + (lam * mu)[:, None] * norm2
            valid = np.isfinite(v) & (v > 1e-12 * mu[:, None] * norm2) & ~own[:, sel]
            pp = np.where(valid, pp_from_z(m / np.sqrt(np.where(valid, v, 1.0))), 0.0)
            cnt = valid.sum(axis=1)
            closed[:, j] = np.where(cnt > 0, pp.sum(axis=1) / np.maximum(cnt, 1), np.nan)
        bad = (nb < min_queries) | ~(mu > 0)
        closed[bad, j] = np.nan
        emp[bad, j] = np.nan


def ledoit_wolf_left_out(Qb: np.ndarray, tb: np.ndarray, alpha: np.ndarray, beta: np.ndarray, left: np.ndarray,
                         ok: np.ndarray, block: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Per unit k: :func:`ledoit_wolf` of the bucket's detrended queries ``Qb - alpha_k - t beta_k`` without the
    rows ``left[k]`` marks (1.0), for all units at once; returns (intensity lambda_k, mu_k = tr S_k / d), NaN where
    ``ok`` is False. Units are taken ``block`` at a time, so memory stays (block, n_b, d)."""
    D, d = len(alpha), Qb.shape[1]
    lam, mu = np.full(D, np.nan), np.full(D, np.nan)
    for k0 in range(0, D, block):
        ks = np.flatnonzero(ok[k0:k0 + block]) + k0
        if not len(ks):
            continue
        w = 1.0 - left[ks]  # (K, n_b) rows kept
        n = w.sum(axis=1)
        Y = Qb[None] - alpha[ks, None, :] - tb[None, :, None] * beta[ks, None, :]  # (K, n_b, d)
        Yc = (Y - (w[:, None, :] @ Y) / n[:, None, None]) * w[:, :, None]
        S = (Yc.transpose(0, 2, 1) @ Yc) / n[:, None, None]  # batched BLAS (einsum here is 4x slower)
        m = np.trace(S, axis1=1, axis2=2) / d
        S2 = (S * S).sum(axis=(1, 2))
        delta = ((S - m[:, None, None] * np.eye(d)) ** 2).sum(axis=(1, 2)) / d
        row_sq = (Yc * Yc).sum(axis=2)
        beta_bar = ((row_sq * row_sq).sum(axis=1) / n - S2) / (d * n)
        with np.errstate(invalid="ignore", divide="ignore"):
            lam[ks] = np.where(delta <= 0.0, 0.0, np.minimum(np.maximum(beta_bar, 0.0), delta) / delta)
        mu[ks] = m
    return lam, mu


def _loo_empirical(q_sorted: np.ndarray, qdoc_sorted: np.ndarray, starts: np.ndarray, buckets: list[int],
                   pair_bucket: np.ndarray, delta: np.ndarray, pair_doc: np.ndarray, n_docs: int,
                   min_queries: int) -> np.ndarray:
    """(D, J) leave-one-out empirical AP_j (4.3): positives per (query document, pair) once; leaving d out
    subtracts its row, and drops its own pairs."""
    emp = np.full((n_docs, len(starts) - 1), np.nan)
    q32 = np.asarray(q_sorted, dtype=np.float32)
    for j in buckets:
        sel = np.flatnonzero(pair_bucket == j)
        s, e = int(starts[j]), int(starts[j + 1])
        qd = qdoc_sorted[s:e]
        positive = (q32[s:e] @ delta[sel].astype(np.float32).T > 0).astype(np.float64)  # (n_b, P_j)
        known = np.flatnonzero(qd >= 0)
        member = np.zeros((n_docs, e - s))  # (D, n_b): query of document d
        member[qd[known], known] = 1.0
        pos_d = member @ positive  # positives per (document, pair)
        n_d = member.sum(axis=1)
        n_left = (e - s) - n_d  # (D,)
        with np.errstate(invalid="ignore", divide="ignore"):
            p = (positive.sum(axis=0)[None, :] - pos_d) / n_left[:, None]
        pp = pp_from_p(p)
        pp[pair_doc[sel][None, :] == np.arange(n_docs)[:, None]] = np.nan  # the document's own pairs leave too
        pp[n_left < min_queries] = np.nan
        with np.errstate(invalid="ignore"):
            cnt = np.isfinite(pp).sum(axis=1)
            emp[:, j] = np.where(cnt > 0, np.nansum(pp, axis=1) / np.maximum(cnt, 1), np.nan)
    return emp


def loo_profiles_from_moments(sums: dict[str, np.ndarray], group_sums: dict[str, np.ndarray], L: int, B: int,
                              covariance: str, min_queries: int, pair_bucket: np.ndarray, delta: np.ndarray,
                              pair_group: np.ndarray, q_sorted: np.ndarray, qgroup_sorted: np.ndarray,
                              counts: np.ndarray) -> LeaveOneOut:
    """Leave-one-group-out AP_j with the query model of every position (coverage ``all``, SPEC 12.2, 4.6).

    ``sums``: the head's per-bucket query sums over every document (keys without ``q_``); ``group_sums`` the
    same per document group, (G, J, ...): group g left out, the query model is refitted from ``sums - group g``
    (:func:`fit_query_model_from_moments`) and the closed form runs on the other groups' pairs (pair_bucket,
    delta, pair_group as in :func:`loo_profiles`, groups for documents). The empirical estimator stays on the
    sampled queries (q_sorted by bucket, ``counts`` per bucket, qgroup_sorted their groups, -1 never left out),
    each group left out as in :func:`loo_profiles`. With one document per group this is the delete-one-document
    jackknife of the rows' :func:`loo_profiles` run on every position.
    """
    G = int(next(iter(group_sums.values())).shape[0])
    J = len(counts)
    closed = np.full((G, J), np.nan)
    starts = np.concatenate([[0], np.cumsum(counts)])
    buckets = [j for j in np.unique(pair_bucket) if j < J]
    emp = _loo_empirical(q_sorted, qgroup_sorted, starts, [j for j in buckets if counts[j]], pair_bucket, delta,
                         pair_group, G, min_queries)
    left = {k: sums[k][None] - group_sums[k] for k in group_sums if k in sums}  # (G, J, ...) sums without group g
    if covariance == "full":
        _closed_full_from_moments(closed, emp, left, B, min_queries, buckets, pair_bucket, pair_group, delta)
        return LeaveOneOut(closed, emp)
    for g in range(G):
        try:
            model = fit_query_model_from_moments({k: v[g] for k, v in left.items()}, L, B, covariance, min_queries)
        except QueryModelError:
            continue
        _closed_refitted(closed, emp, g, model, buckets, pair_bucket, pair_group, delta)
    return LeaveOneOut(closed, emp)


def _closed_full_from_moments(closed: np.ndarray, emp: np.ndarray, s: dict[str, np.ndarray], B: int,
                              min_queries: int, buckets: list[int], pair_bucket: np.ndarray, pair_group: np.ndarray,
                              delta: np.ndarray) -> None:
    """:func:`fit_query_model_from_moments` (covariance ``full``) and the closed form (4.3) of every left-out group
    at once: ``s`` holds each group's complement sums, (G, J, ...). Row g equals the refit of ``s[.][g]`` and
    :func:`_closed_refitted` (a group whose sums cannot carry a model keeps its row as it is), with arrays over
    groups in place of a Python loop: per group the regression on position and bhat (4.1), per bucket the model
    mean m = xbar . delta + (alpha_pos + beta_pos tau - bhat . xbar)(bhat . delta) and the Ledoit-Wolf-shrunk
    covariance of the detrended queries, exact or Gaussian fourth moment, from the refit's own
    :func:`shrunk_bucket_covariances` (every group and bucket in one call)."""
    nb = np.asarray(s["n"], dtype=np.float64)  # (G, J)
    counts = np.rint(nb).astype(np.int64)
    reg = position_regressions(s)  # the refit's regression on position, every group at once
    fitted, beta, bhat = reg.fitted, reg.beta, reg.bhat  # not fitted: QueryModelError, the row is left as it is
    with np.errstate(invalid="ignore", divide="ignore"):
        floor = 1e-10 * np.maximum(np.trace(reg.S_res, axis1=1, axis2=2) / (reg.n * beta.shape[1]), 1e-300)
    alpha_pos, beta_pos = (bhat * reg.alpha).sum(axis=1), (bhat * beta).sum(axis=1)
    # every group's bucket means and shrunk covariances at once; a bucket has a model where the group's fit exists,
    # it has enough queries and its covariance is not degenerate
    xbs, covs, _, levels = shrunk_bucket_covariances(s, beta, B)
    with np.errstate(invalid="ignore"):
        has_model = fitted[:, None] & (counts >= min_queries) & (levels > floor[:, None])
    for b in buckets:
        ok = has_model[:, b]
        g_ok = np.flatnonzero(ok)
        cov, level, xb = covs[g_ok, b], levels[g_ok, b], xbs[g_ok, b]
        emp[fitted & ~ok, b] = np.nan  # the refit left the bucket without a model
        sel = np.flatnonzero(pair_bucket == b)
        if not len(g_ok) or not len(sel):
            continue
        dl = delta[sel]
        hb = bhat[g_ok]
        coef = alpha_pos[g_ok] + beta_pos[g_ok] * (b + 0.5) * B - (hb * xb).sum(axis=1)
        m = xb @ dl.T + coef[:, None] * (hb @ dl.T)  # (G_ok, P)
        # (G, P, d) by one batched product, reduced over its contiguous axis: a product of broadcast (G, d, P)
        # arrays summed over the middle axis was 3-6x slower (the demo's cross-corpus step spent 60% here)
        v = np.einsum("gpd,pd->gp", dl @ cov, dl)
        norm2 = (dl * dl).sum(axis=1)[None, :]
        with np.errstate(invalid="ignore", divide="ignore"):
            valid = ((norm2 != 0.0) & np.isfinite(v) & (v > 1e-12 * level[:, None] * norm2)
                     & (pair_group[sel][None, :] != g_ok[:, None]))
            pp = np.where(valid, pp_from_z(m / np.sqrt(np.where(valid, v, 1.0))), 0.0)
            cnt = valid.sum(axis=1)
            closed[g_ok, b] = np.where(cnt > 0, pp.sum(axis=1) / np.maximum(cnt, 1), np.nan)


def stored_loo_profiles(profiles: pd.DataFrame | None, heads: list[tuple[int, int]], J: int,
                        where: str = "") -> np.ndarray | None:
    """(H, G, J) leave-one-out AP_j of ``heads`` as a plasticity analysis stored them (``plasticity_profiles``'
    ``ap_loo``: one per bucket row, G documents or document groups, SPEC 4.6), NaN for a head the table lacks; None
    when it has none (interval not ``jackknife_t``, no resamples, or materialised before the column). A head whose rows
    do not hold one value per bucket and unit, all of one length, is a ``ValueError`` naming it (``where`` leads)."""
    if profiles is None or "ap_loo" not in profiles.columns or not len(profiles) or profiles["ap_loo"].isna().all():
        return None
    by_head = {key: g for key, g in profiles.groupby(["layer", "q_head"], sort=False)}
    units = {len(v) for v in profiles["ap_loo"] if v is not None}
    if len(units) != 1:
        raise ValueError(f"{where}plasticity_profiles: ap_loo has lengths {sorted(units)}, expected one")
    out = np.full((len(heads), units.pop(), J), np.nan)
    for h, key in enumerate(heads):
        g = by_head.get(key)
        if g is None:
            continue
        buckets = g["bucket"].to_numpy(np.int64)
        if len(buckets) != J or sorted(buckets) != list(range(J)) or g["ap_loo"].isna().any():
            raise ValueError(f"{where}plasticity_profiles: head {key} has ap_loo for buckets "
                             f"{sorted(buckets.tolist())}, expected one per bucket 0..{J - 1}")
        out[h][:, buckets] = np.stack([np.asarray(v, np.float64) for v in g["ap_loo"]], axis=1)
    return out
