"""The Gaussian query model of SPEC 4.1 and the component weights of SPEC 4.8.

Per head: every query coordinate is regressed on the raw token position t (OLS), giving intercepts
alpha and slopes beta (per token). The Householder reflection H maps beta/|beta| to e1, so in the
rotated basis coordinate 1 carries all the drift: x_1 = alpha_pos + beta_pos * t + eps with
beta_pos = |beta| and residual variance sigma_pos^2; coordinates 2..d have no slope.

Per query bucket b (raw tokens [bB, (b+1)B)) the model's mean at the bucket midpoint tau_b is
``(alpha_pos + beta_pos * tau_b, mu_b[2..d])`` (mu_b: the bucket's mean rotated query) and its
covariance is

- ``full``: the Ledoit-Wolf-shrunk covariance of the bucket's detrended queries (all d coordinates),
  which transforms as H S H^T, so the closed form does not depend on the Householder basis;
- ``diagonal`` (thesis eqs. 4.11-4.12): coordinate 1 has variance sigma_pos^2 (over all queries),
  coordinates 2..d have the bucket's per-coordinate variances sigma_{b,j}^2.

Variance conventions: sigma_pos^2 = RSS / (n - 2) and sigma_{b,j}^2 with ddof = 1 (unbiased);
Ledoit-Wolf starts from the maximum-likelihood covariance (divide by n), as in its definition.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from qk_core.config.options import COVARIANCES

#: per-bucket status values (SPEC 4, bad input is reported per bucket, never a silent NaN)
OK = "ok"
TOO_FEW_QUERIES = "too_few_queries"
DEGENERATE_COVARIANCE = "degenerate_covariance"


class QueryModelError(ValueError):
    """The queries cannot support a query model at all (e.g. every query at one position)."""


def householder_vector(beta: np.ndarray, tol: float = 1e-12) -> tuple[np.ndarray, float]:
    """(u, h) with H = I - h u u^T symmetric orthogonal and H @ (beta/|beta|) = e1 (SPEC 4.1).

    h = 0 (H = identity) when |beta| ~ 0 or beta already points along +e1.
    """
    d = beta.shape[0]
    norm = float(np.linalg.norm(beta))
    if norm <= tol:
        return np.zeros(d), 0.0
    u = beta / norm
    u[0] -= 1.0
    nu = float(u @ u)
    if nu <= tol * tol:
        return np.zeros(d), 0.0
    return u, 2.0 / nu


def householder(beta: np.ndarray, tol: float = 1e-12) -> np.ndarray:
    """The matrix H of :func:`householder_vector`."""
    u, h = householder_vector(beta, tol)
    return np.eye(beta.shape[0]) - h * np.outer(u, u)


def reflect_rows(X: np.ndarray, u: np.ndarray, h: float) -> np.ndarray:
    """Rows x -> H x for H = I - h u u^T, in O(n d) (no d x d product)."""
    if h == 0.0:
        return X.copy()
    return X - h * np.multiply.outer(X @ u, u)


def reflect_both(S: np.ndarray, u: np.ndarray, h: float) -> np.ndarray:
    """H S H for symmetric H = I - h u u^T, in O(d^2)."""
    if h == 0.0:
        return S.copy()
    A = S - h * np.outer(u, u @ S)
    return A - h * np.outer(A @ u, u)


def ledoit_wolf(X: np.ndarray) -> tuple[np.ndarray, float]:
    """Ledoit-Wolf shrinkage of the covariance of the rows of X toward (tr S / d) I (SPEC 4.1).

    Rows are centred here; S is the maximum-likelihood covariance. Returns (shrunk covariance,
    shrinkage intensity in [0, 1]). Every quantity is rotation invariant, so the result transforms
    as R S R^T when the rows are rotated by R.
    """
    n, d = X.shape
    Xc = X - X.mean(axis=0)
    S = (Xc.T @ Xc) / n
    mu = float(np.trace(S)) / d
    delta = float(((S - mu * np.eye(d)) ** 2).sum()) / d
    row_sq = (Xc * Xc).sum(axis=1)
    beta_bar = float(((row_sq * row_sq).sum() / n - (S * S).sum()) / (d * n))
    shrink = 0.0 if delta <= 0.0 else min(max(beta_bar, 0.0), delta) / delta
    out = (1.0 - shrink) * S
    out[np.diag_indices(d)] += shrink * mu
    return out, shrink


@dataclass
class QueryModel:
    """Fitted query model of one head (SPEC 4.1); all arrays float64, positions in raw tokens."""

    covariance: str
    L: int
    B: int
    alpha: np.ndarray  # (d,) intercepts, original basis
    beta: np.ndarray  # (d,) slopes per token, original basis
    H: np.ndarray  # (d, d) Householder rotation H = I - h u u^T
    u: np.ndarray  # (d,) Householder vector
    h: float  # Householder scale (0: identity)
    alpha_pos: float  # intercept of rotated coordinate 1
    beta_pos: float  # |beta|, per token
    sigma_pos2: float  # residual variance of rotated coordinate 1 over all queries
    resid1: np.ndarray  # (n_q,) coordinate-1 residuals (for diagnostics)
    r2: np.ndarray  # (d,) per-coordinate R^2 of the query coordinate on t, clipped at 0 (SPEC 4.8)
    n_queries: np.ndarray  # (J,) queries per bucket
    status: list[str]  # (J,) per-bucket status
    mean: np.ndarray  # (J, d) rotated model mean at tau_b (NaN where status != ok)
    cov: np.ndarray  # (J, d, d) rotated covariance (full) or (J, d) variances (diagonal)
    shrinkage: np.ndarray  # (J,) Ledoit-Wolf intensity (NaN for diagonal)
    # how the intensity's fourth moment was had: "exact" (rows, or moments with the exact terms) or "gaussian"
    lw_intensity: str = "exact"
    _orig: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)

    @property
    def d(self) -> int:
        return int(self.alpha.shape[0])

    @property
    def tau(self) -> np.ndarray:
        """Bucket midpoints tau_b = (b + 0.5) B in raw tokens."""
        return (np.arange(len(self.status)) + 0.5) * self.B

    def rotate(self, X: np.ndarray) -> np.ndarray:
        """Rows of X in the rotated basis (x -> H x)."""
        return reflect_rows(np.asarray(X, dtype=np.float64), self.u, self.h)

    def variance(self, b: int, delta_rot: np.ndarray) -> np.ndarray:
        """v = delta^T S_b delta (full) or the diagonal sum of eqs. 4.11-4.12, per row of delta_rot."""
        if self.covariance == "full":
            return np.einsum("pi,pi->p", delta_rot @ self.cov[b], delta_rot)
        return (delta_rot * delta_rot) @ self.cov[b]

    def original_basis(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Bucket b's model mean and covariance mapped back to the original basis (H^T = H).

        m = mean_rot . (H delta) = (H mean_rot) . delta and v = delta^T (H S_rot H) delta, also for the
        diagonal option (S_rot = diag(variances)): the same numbers at one d x d product per pair.
        """
        if b not in self._orig:
            S = self.cov[b] if self.covariance == "full" else np.diag(self.cov[b])
            self._orig[b] = (reflect_rows(self.mean[b], self.u, self.h), reflect_both(S, self.u, self.h))
        return self._orig[b]

    def component_weights(self) -> np.ndarray:
        """R^2 per original coordinate normalised to sum 1 (all zeros if no coordinate drifts) (4.8)."""
        total = float(self.r2.sum())
        return self.r2 / total if total > 0 else np.zeros_like(self.r2)


def coordinate_r2(sst: np.ndarray, ssr: np.ndarray) -> np.ndarray:
    """Each coordinate's R^2 on position (SPEC 4.8) from its total and regression sums of squares (last axis: the
    coordinates), clipped to [0, 1]; 0 for a coordinate whose spread is below 1e-12 of the largest."""
    scale = np.maximum(np.max(sst, axis=-1, keepdims=True, initial=0.0), 1e-300)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(sst > 1e-12 * scale, np.clip(ssr / np.where(sst > 0, sst, 1.0), 0.0, 1.0), 0.0)


def fit_query_model(q: np.ndarray, t: np.ndarray, L: int, B: int, covariance: str = "full",
                    min_queries: int = 10) -> QueryModel:
    """Fit the SPEC 4.1 query model to queries q (n, d) at raw token positions t (n,)."""
    t = np.asarray(t, dtype=np.float64)
    J = -(-int(L) // int(B))
    bucket = np.clip(np.floor_divide(t, B).astype(np.int64), 0, J - 1)
    order = np.argsort(bucket, kind="stable")
    return fit_sorted_queries(np.asarray(q)[order], t[order], np.bincount(bucket, minlength=J), L, B, covariance,
                              min_queries)


def fit_sorted_queries(q: np.ndarray, t: np.ndarray, counts: np.ndarray, L: int, B: int, covariance: str = "full",
                       min_queries: int = 10) -> QueryModel:
    """:func:`fit_query_model` of queries already sorted by bucket: bucket b holds ``counts[b]`` rows.

    One float64 copy of the queries; every other step works on one bucket's rows at a time, so the
    detrended queries are never held in full (``resid1`` is in the given, bucket-sorted, row order).
    """
    if covariance not in COVARIANCES:
        raise ValueError(f"covariance must be one of {COVARIANCES}")
    Q = np.asarray(q, dtype=np.float64)
    t = np.asarray(t, dtype=np.float64)
    n, d = Q.shape
    if n < 3:
        raise QueryModelError(f"{n} queries: a per-coordinate regression on position needs at least 3")
    tc = t - t.mean()
    stt = float(tc @ tc)
    if stt <= 0.0:
        raise QueryModelError("every query sits at one position: the slope on position is undefined")
    J = len(counts)
    starts = np.concatenate([[0], np.cumsum(counts)])
    blocks = [(b, int(starts[b]), int(starts[b + 1])) for b in range(J) if counts[b]]
    qbar = Q.mean(axis=0)
    # OLS of every coordinate on t from centred cross products, accumulated bucket by bucket
    xty = np.zeros(d)
    sst = np.zeros(d)
    for _, s, e in blocks:
        Qc = Q[s:e] - qbar
        xty += tc[s:e] @ Qc
        sst += np.einsum("ij,ij->j", Qc, Qc)
    beta = xty / stt
    alpha = qbar - beta * t.mean()
    r2 = coordinate_r2(sst, beta * beta * stt)

    beta_norm = float(np.linalg.norm(beta))
    # |beta| ~ 0: drift across the queries' span negligible next to their spread -> H = identity
    negligible = beta_norm * np.sqrt(stt / n) <= 1e-9 * np.sqrt(float(sst.sum()) / n + 1e-300)
    u, h = (np.zeros(d), 0.0) if negligible else householder_vector(beta)
    H = np.eye(d) - h * np.outer(u, u)
    bhat = H[0]  # first row of H = beta/|beta| (H symmetric), or e1
    alpha_pos = float(bhat @ alpha)
    beta_pos = float(bhat @ beta)

    tau = (np.arange(J) + 0.5) * B
    mean = np.full((J, d), np.nan)
    cov = np.full((J, d, d), np.nan) if covariance == "full" else np.full((J, d), np.nan)
    shrink = np.full(J, np.nan)
    status = [OK] * J
    level = np.full(J, np.nan)  # a bucket's mean variance, compared with the head's residual scale below
    resid1 = np.empty(n)
    rss = 0.0
    orig: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for b, s, e in blocks:
        R = Q[s:e] - qbar
        R -= np.multiply.outer(tc[s:e], beta)  # detrended queries: q - alpha - beta t
        resid1[s:e] = R @ bhat
        rss += float(np.einsum("ij,ij->", R, R))
        if counts[b] < min_queries:
            continue
        mu = reflect_rows(Q[s:e].mean(axis=0), u, h)
        mu[0] = alpha_pos + beta_pos * tau[b]
        mean[b] = mu
        if covariance == "full":
            # Ledoit-Wolf is rotation equivariant: shrink in the original basis, rotate the result
            S_o, shrink[b] = ledoit_wolf(R)
            level[b] = float(np.trace(S_o)) / d if np.all(np.isfinite(S_o)) else np.nan
            cov[b] = reflect_both(S_o, u, h)
            orig[b] = (reflect_rows(mu, u, h), S_o)
        else:
            cov[b] = reflect_rows(Q[s:e], u, h).var(axis=0, ddof=1)  # coordinate 1: sigma_pos^2, set below
    sigma_pos2 = float(resid1 @ resid1) / max(n - 2, 1)
    if covariance == "diagonal":
        for b, _, _ in blocks:
            if counts[b] >= min_queries:
                cov[b, 0] = sigma_pos2
                level[b] = float(cov[b].sum()) / d if np.all(np.isfinite(cov[b])) else np.nan
    # a bucket's covariance is degenerate when its total variance is ~0 next to the head's residual scale
    floor = 1e-10 * max(rss / Q.size, 1e-300)
    for b in range(J):
        if counts[b] < min_queries:
            status[b] = TOO_FEW_QUERIES
        elif not level[b] > floor:  # NaN (non-finite covariance) is degenerate too
            status[b] = DEGENERATE_COVARIANCE
    return QueryModel(covariance, int(L), int(B), alpha, beta, H, u, h, alpha_pos, beta_pos, sigma_pos2, resid1,
                      r2, counts, status, mean, cov, shrink, "exact", orig)


#: the per-bucket query sums (without ``q_``) that :func:`bucket_fourth_moments` reads
FOURTH_KEYS = ("n", "s", "ss", "s3", "s4", "x", "xt", "xx", "xxs", "xxs2", "xs2", "xs3", "r2x", "r2xs", "r4", "r2",
               "r2s", "r2s2")


def bucket_fourth_moments(s: Mapping[str, np.ndarray], a: np.ndarray, beta: np.ndarray,
                          tau: float | np.ndarray) -> np.ndarray:
    """sum |q - a - beta s|^4 over one bucket's queries (s = t - tau, tau the bucket's midpoint), from its SPEC 12.1
    sums, for G fits at once: ``s`` maps :data:`FOURTH_KEYS` to (G, ...) arrays (one bucket of G sets of sums),
    ``a`` and ``beta`` are (G, d), ``tau`` one midpoint or one per fit (G,).

    With v = a + beta s: |y|^2 = |q|^2 - 2 q.v + |v|^2 =: A - 2 B + C, so sum |y|^4 = sum A^2 + 4 B^2 + C^2
    - 4 A B + 2 A C - 4 B C, each a contraction of a, beta with sums of q, q q^T, |q|^2 times powers of s.
    """
    def dot(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return (x * y).sum(axis=-1)

    def quad(x: np.ndarray, M: np.ndarray, y: np.ndarray) -> np.ndarray:
        return (x[:, :, None] * M * y[:, None, :]).sum(axis=(1, 2))

    xs = s["xt"] - np.asarray(tau, dtype=np.float64)[..., None] * s["x"]  # sum s x
    c0, c1, c2 = dot(a, a), 2.0 * dot(a, beta), dot(beta, beta)
    S0, S1, S2, S3, S4 = (s[k] for k in ("n", "s", "ss", "s3", "s4"))
    B2 = quad(a, s["xx"], a) + 2.0 * quad(a, s["xxs"], beta) + quad(beta, s["xxs2"], beta)
    C2 = c0 * c0 * S0 + 2 * c0 * c1 * S1 + (c1 * c1 + 2 * c0 * c2) * S2 + 2 * c1 * c2 * S3 + c2 * c2 * S4
    AB = dot(a, s["r2x"]) + dot(beta, s["r2xs"])
    AC = c0 * s["r2"] + c1 * s["r2s"] + c2 * s["r2s2"]
    BC = (dot(a, c0[:, None] * s["x"] + c1[:, None] * xs + c2[:, None] * s["xs2"])
          + dot(beta, c0[:, None] * xs + c1[:, None] * s["xs2"] + c2[:, None] * s["xs3"]))
    return s["r4"] + 4 * B2 + C2 - 4 * AB + 2 * AC - 4 * BC


@dataclass(frozen=True)
class PositionRegressions:
    """SPEC 4.1's per-coordinate OLS of the queries on raw position t for G sets of query sums at once, every
    array with a leading G axis: n, stt (centred sum of t^2) and stt_raw (uncentred), qbar, the centred scatter S,
    xty (centred cross products with t), the slopes beta and intercepts alpha, and the residual scatter S_res of
    q - alpha - beta t."""

    n: np.ndarray
    stt: np.ndarray
    stt_raw: np.ndarray
    qbar: np.ndarray
    S: np.ndarray
    xty: np.ndarray
    beta: np.ndarray
    alpha: np.ndarray
    S_res: np.ndarray

    @property
    def fitted(self) -> np.ndarray:
        """(G,) the regression exists: at least 3 queries, not all at one position."""
        with np.errstate(invalid="ignore"):
            return (self.n >= 3) & (self.stt > 1e-12 * self.stt_raw)

    @cached_property
    def beta_norm(self) -> np.ndarray:
        """(G,) |beta|."""
        return np.linalg.norm(self.beta, axis=-1)

    @property
    def negligible(self) -> np.ndarray:
        """(G,) the drift beta t is below 1e-9 of the queries' spread: no direction is positional."""
        sst = np.trace(self.S, axis1=-2, axis2=-1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.beta_norm * np.sqrt(self.stt / self.n) <= 1e-9 * np.sqrt(sst / self.n + 1e-300)

    @property
    def r2(self) -> np.ndarray:
        """(G, d) each coordinate's R^2 on position (SPEC 4.8), 0 for a coordinate without spread (below 1e-12 of the
        largest)."""
        return coordinate_r2(np.diagonal(self.S, axis1=-2, axis2=-1), self.beta * self.beta * self.stt[:, None])

    @property
    def bhat(self) -> np.ndarray:
        """(G, d) the first row of each fit's Householder matrix H (:func:`householder_vector`): beta / |beta|, or
        e_1 where the drift is negligible or |beta| is below the Householder's tolerance."""
        norm, e1 = self.beta_norm, np.eye(self.beta.shape[-1])[0]
        with np.errstate(invalid="ignore", divide="ignore"):
            flat = self.negligible | (norm <= 1e-12)
            return np.where(flat[:, None], e1, self.beta / np.where(norm > 0, norm, 1.0)[:, None])


def drift_values(reg: PositionRegressions, L: int) -> dict[str, np.ndarray]:
    """SPEC 4.1 / 4.9's drift summaries of G regressions at once, (G,) each, NaN where a set carries no regression:
    beta_norm_per_token = |beta|, beta_norm_window = |beta| L, alpha_pos = bhat . alpha, sigma_pos = sqrt(bhat^T S_res
    bhat / (n - 2)) and mean_coord_r2 (the mean of :attr:`PositionRegressions.r2`): what the query model fitted on the
    same sums or rows reports (``qk_core.plasticity.analysis``), for leave-one-out refits of them alone."""
    bhat = reg.bhat
    with np.errstate(invalid="ignore"):
        sigma2 = np.einsum("gi,gij,gj->g", bhat, reg.S_res, bhat) / np.maximum(reg.n - 2, 1)
        values = {"beta_norm_per_token": reg.beta_norm, "beta_norm_window": reg.beta_norm * L,
                  "alpha_pos": (bhat * reg.alpha).sum(axis=-1), "sigma_pos": np.sqrt(sigma2),
                  "mean_coord_r2": reg.r2.mean(axis=-1)}
    return {k: np.where(reg.fitted, v, np.nan) for k, v in values.items()}


def position_regressions(sums: Mapping[str, np.ndarray]) -> PositionRegressions:
    """:class:`PositionRegressions` of ``sums`` (the keys of :func:`fit_query_model_from_moments`, (G, J, ...)
    arrays), pooled over the J buckets. Sets that cannot carry a regression (:attr:`PositionRegressions.fitted`
    false) hold non-finite values."""
    n = np.asarray(sums["n"], dtype=np.float64).sum(axis=1)
    st, stt_raw = sums["t"].sum(axis=1), sums["tt"].sum(axis=1)
    sx, sxt, sxx = sums["x"].sum(axis=1), sums["xt"].sum(axis=1), sums["xx"].sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        tm = st / n
        stt = stt_raw - st * tm
        qbar = sx / n[:, None]
        S = sxx - n[:, None, None] * (qbar[:, :, None] * qbar[:, None, :])
        xty = sxt - sx * tm[:, None]
        beta = xty / stt[:, None]
        alpha = qbar - beta * tm[:, None]
        S_res = (S - beta[:, :, None] * xty[:, None, :] - xty[:, :, None] * beta[:, None, :]
                 + stt[:, None, None] * (beta[:, :, None] * beta[:, None, :]))
    return PositionRegressions(n, stt, stt_raw, qbar, S, xty, beta, alpha, S_res)


#: bytes of one (G, buckets, d, d) float64 block of :func:`shrunk_bucket_covariances`
_BLOCK_BYTES = 4 * 2**20


def shrunk_bucket_covariances(sums: Mapping[str, np.ndarray], beta: np.ndarray, B: int
                              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per query bucket of G sets of per-bucket sums at once (SPEC 4.1 ``full``, 12.2): ``sums`` maps the keys of
    :func:`fit_query_model_from_moments` to (G, J, ...) arrays, ``beta`` (G, d) is each set's slope on position.

    Returns (xb, cov, shrink, level): the bucket means (G, J, d); the Ledoit-Wolf-shrunk ML covariance of the
    bucket's detrended queries q - beta t in the original basis (G, J, d, d); the intensity (G, J), exact when the
    sums hold the exact terms (:func:`bucket_fourth_moments`), else from a Gaussian fourth moment; level = tr / d
    (G, J), NaN where the covariance is not finite. Buckets without queries give NaN; callers mask them (too few
    queries). Memory: the results and one scratch block of ``_BLOCK_BYTES``; each block is formed in place in the
    result (blocks of a few MB kept the d = 256 case about twice as fast as one pass over every bucket)."""
    nb = np.asarray(sums["n"], dtype=np.float64)
    G, J = nb.shape
    d = int(sums["x"].shape[-1])
    exact_lw = "xxs" in sums
    diag = np.arange(d)
    bt = np.asarray(beta, dtype=np.float64)[:, None, :]  # (G, 1, d)
    xb, cov = np.empty((G, J, d)), np.empty((G, J, d, d))
    shrink, level = np.empty((G, J)), np.empty((G, J))
    step = max(1, min(J, _BLOCK_BYTES // (G * d * d * 8)))
    scratch = np.empty((G, step, d, d))
    with np.errstate(invalid="ignore", divide="ignore"):
        for j0 in range(0, J, step):
            sl = slice(j0, min(j0 + step, J))
            m = nb[:, sl]
            x = sums["x"][:, sl]
            xm = x / m[..., None]
            # in place in this block of ``cov`` and one scratch array: the bucket's centred scatter Sb, then the
            # scatter of q - beta t, Sb - beta (x) u - u (x) beta with u = sxt - stt beta / 2 (the same as
            # Sb - beta sxt^T - sxt beta^T + stt beta beta^T), symmetrised, / n_b
            S, tmp = cov[:, sl], scratch[:, : sl.stop - sl.start]
            np.multiply(x[..., :, None], xm[..., None, :], out=S)
            np.subtract(sums["xx"][:, sl], S, out=S)
            sxt = sums["xt"][:, sl] - x * (sums["t"][:, sl] / m)[..., None]
            stt = sums["ss"][:, sl] - sums["s"][:, sl] ** 2 / m
            u = sxt - (0.5 * stt)[..., None] * bt
            np.multiply(bt[..., :, None], u[..., None, :], out=tmp)
            S -= tmp
            S -= np.swapaxes(tmp, -1, -2)
            np.add(S, np.swapaxes(S, -1, -2), out=tmp)
            np.multiply(tmp, (0.5 / m)[..., None, None], out=S)
            mu = np.trace(S, axis1=-2, axis2=-1) / d
            F2 = np.einsum("...ij,...ij->...", S, S)
            if exact_lw:
                a = xm - bt * (sums["s"][:, sl] / m)[..., None]  # bucket mean of q - beta s
                tau = np.tile((np.arange(sl.start, sl.stop) + 0.5) * B, G)
                fourth = bucket_fourth_moments(
                    {k: sums[k][:, sl].reshape(-1, *sums[k].shape[2:]) for k in FOURTH_KEYS}, a.reshape(-1, d),
                    np.broadcast_to(bt, a.shape).reshape(-1, d), tau).reshape(m.shape)
            else:
                fourth = m * ((d * mu) ** 2 + 2.0 * F2)
            tmp[...] = S
            tmp[..., diag, diag] -= mu[..., None]
            dev = np.einsum("...ij,...ij->...", tmp, tmp) / d  # |S - mu I|_F^2 / d
            beta_bar = (fourth / m - F2) / (d * m)
            lam = np.where(dev <= 0.0, 0.0, np.minimum(np.maximum(beta_bar, 0.0), dev) / dev)
            S *= (1.0 - lam)[..., None, None]  # shrunk: (1 - lam) S + lam mu I
            S[..., diag, diag] += (lam * mu)[..., None]
            xb[:, sl], shrink[:, sl] = xm, lam
            level[:, sl] = np.where(np.isfinite(S).all(axis=(-2, -1)), np.trace(S, axis1=-2, axis2=-1) / d, np.nan)
    return xb, cov, shrink, level


def fit_query_model_from_moments(sums: dict[str, np.ndarray], L: int, B: int, covariance: str = "full",
                                 min_queries: int = 10) -> QueryModel:
    """The SPEC 4.1 query model of one head from its per-bucket query sums alone (SPEC 12.2).

    ``sums`` maps the query keys of :mod:`qk_core.capture.moments` without their ``q_`` prefix (n, t, tt, x,
    xt, xx and the Ledoit-Wolf terms) to that head's (J, ...) arrays. Equals :func:`fit_query_model` of the
    same rows (``resid1`` is empty: the coordinate-1 residuals are rows, SPEC 4.9 diagnostics read the
    sampled ones). The Ledoit-Wolf intensity is exact when the sums hold the exact terms (``xxs`` ...), from the
    bucket's fourth moment (:func:`bucket_fourth_moments`; its expansion loses about 4 log10(|mean| / spread)
    digits); otherwise the fourth moment is a Gaussian's with the bucket's covariance S (SPEC 12.1),
    sum |y|^4 = n_b ((tr S)^2 + 2 |S|_F^2), so the intensity's numerator is ((tr S)^2 + |S|_F^2) / (d n_b).
    """
    if covariance not in COVARIANCES:
        raise ValueError(f"covariance must be one of {COVARIANCES}")
    nb = np.asarray(sums["n"], dtype=np.float64)
    J = len(nb)
    counts = np.rint(nb).astype(np.int64)
    n = float(nb.sum())
    d = int(sums["x"].shape[-1])
    exact_lw = "xxs" in sums
    if n < 3:
        raise QueryModelError(f"{int(n)} queries: a per-coordinate regression on position needs at least 3")
    reg = position_regressions({k: sums[k][None] for k in ("n", "t", "tt", "x", "xt", "xx")})
    if not reg.fitted[0]:
        raise QueryModelError("every query sits at one position: the slope on position is undefined")
    beta, alpha, S_res = reg.beta[0], reg.alpha[0], reg.S_res[0]
    r2 = reg.r2[0]
    u, h = (np.zeros(d), 0.0) if reg.negligible[0] else householder_vector(beta)
    H = np.eye(d) - h * np.outer(u, u)
    bhat = H[0]
    alpha_pos = float(bhat @ alpha)
    beta_pos = float(bhat @ beta)
    sigma_pos2 = float(bhat @ S_res @ bhat) / max(n - 2, 1)
    rss = float(np.trace(S_res))

    tau = (np.arange(J) + 0.5) * B
    mean = np.full((J, d), np.nan)
    cov = np.full((J, d, d), np.nan) if covariance == "full" else np.full((J, d), np.nan)
    shrink = np.full(J, np.nan)
    level = np.full(J, np.nan)
    orig: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    if covariance == "full":
        xbs, shrunk, lams, levels = (a[0] for a in shrunk_bucket_covariances({k: v[None] for k, v in sums.items()},
                                                                           beta[None], B))
    for b in range(J):
        m_b = nb[b]
        if counts[b] < min_queries:
            continue
        xb = xbs[b] if covariance == "full" else sums["x"][b] / m_b
        mu = reflect_rows(xb, u, h)
        mu[0] = alpha_pos + beta_pos * tau[b]
        mean[b] = mu
        if covariance == "full":
            shrink[b], level[b] = lams[b], levels[b]
            cov[b] = reflect_both(shrunk[b], u, h)
            orig[b] = (reflect_rows(mu, u, h), shrunk[b])
        else:
            Sb = sums["xx"][b] - np.outer(sums["x"][b], xb)  # the bucket's centred scatter
            cov[b] = np.diag(reflect_both(Sb, u, h)) / (m_b - 1)
            cov[b, 0] = sigma_pos2
            level[b] = float(cov[b].sum()) / d if np.all(np.isfinite(cov[b])) else np.nan
    floor = 1e-10 * max(rss / (n * d), 1e-300)
    status = [OK] * J
    for b in range(J):
        if counts[b] < min_queries:
            status[b] = TOO_FEW_QUERIES
        elif not level[b] > floor:
            status[b] = DEGENERATE_COVARIANCE
    return QueryModel(covariance, int(L), int(B), alpha, beta, H, u, h, alpha_pos, beta_pos, sigma_pos2,
                      np.zeros(0), r2, counts, status, mean, cov, shrink, "exact" if exact_lw else "gaussian", orig)
