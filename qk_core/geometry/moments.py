"""Float64 sufficient statistics of one head's Q and K rows and of their pooled cloud, shared by the
combined PCA (SPEC 2) and the planar rotation (SPEC 3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class PooledMoments:
    """Float64 sufficient statistics of one head's Q rows, K rows and the pooled cloud (SPEC 2, 3).

    ``S_*`` are centred scatter matrices (sums, not divided by n), ``s_*t`` centred cross-scatter of the
    vectors with position, ``stt_*`` the centred scatter of position.
    """

    n_q: int
    n_k: int
    mu_q: np.ndarray
    mu_k: np.ndarray
    tq_mean: float
    tk_mean: float
    S_q: np.ndarray
    S_k: np.ndarray
    s_qt: np.ndarray
    s_kt: np.ndarray
    stt_q: float
    stt_k: float
    mu: np.ndarray = field(init=False)
    t_mean: float = field(init=False)
    S: np.ndarray = field(init=False)
    s_xt: np.ndarray = field(init=False)
    stt: float = field(init=False)

    def __post_init__(self) -> None:
        n = self.n_q + self.n_k
        self.mu = (self.n_q * self.mu_q + self.n_k * self.mu_k) / n
        self.t_mean = (self.n_q * self.tq_mean + self.n_k * self.tk_mean) / n
        dq, dk = self.mu_q - self.mu, self.mu_k - self.mu
        eq, ek = self.tq_mean - self.t_mean, self.tk_mean - self.t_mean
        self.S = self.S_q + self.S_k + self.n_q * np.outer(dq, dq) + self.n_k * np.outer(dk, dk)
        self.s_xt = self.s_qt + self.s_kt + self.n_q * dq * eq + self.n_k * dk * ek
        self.stt = self.stt_q + self.stt_k + self.n_q * eq * eq + self.n_k * ek * ek

    @property
    def n(self) -> int:
        return self.n_q + self.n_k

    @property
    def d(self) -> int:
        return int(self.mu.shape[0])

    @property
    def total_scatter(self) -> float:
        return float(np.trace(self.S))

    # Within-kind (pooled within-group) moments, for SPEC 3 diagnostic (ii). Regressing t on x plus an
    # intercept and the query/key indicator 1_Q: by Frisch-Waugh-Lovell, partialling out {1, 1_Q} centres
    # x and t on the mean of their own kind, so the slope on x is the OLS of the within-kind centred t on
    # the within-kind centred x, whose scatter, cross-scatter and t-scatter are the sums over the two
    # kinds below. The indicator alone explains stt - stt_within (the between-kind scatter of t); so
    # R^2(t ~ x + 1_Q) = (stt - stt_within + s_within_t^T S_within^-1 s_within_t) / stt.

    @property
    def S_within(self) -> np.ndarray:
        """Within-kind scatter S_q + S_k: the scatter of x after partialling out {1, 1_Q} (SPEC 3 ii)."""
        return self.S_q + self.S_k

    @property
    def s_within_t(self) -> np.ndarray:
        """Within-kind cross-scatter s_qt + s_kt of x with t (SPEC 3 ii)."""
        return self.s_qt + self.s_kt

    @property
    def stt_within(self) -> float:
        """Within-kind scatter of t, stt_q + stt_k; stt - stt_within is what 1_Q explains (SPEC 3 ii)."""
        return self.stt_q + self.stt_k


def _kind_moments(x32: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, float, np.ndarray, np.ndarray, float]:
    xc = np.array(x32, dtype=np.float64)  # a float64 copy, centred in place
    t = np.asarray(pos, dtype=np.float64)
    mu = xc.mean(axis=0)
    xc -= mu
    tm = float(t.mean())
    tc = t - tm
    return mu, tm, xc.T @ xc, tc @ xc, float(tc @ tc)


KindMoments = tuple[np.ndarray, float, np.ndarray, np.ndarray, float]


def kind_moments(x: np.ndarray, pos: np.ndarray) -> KindMoments:
    """(mean, mean position, centred scatter, cross-scatter with position, position scatter) of one kind."""
    return _kind_moments(x, pos)


def pooled_moments(q: np.ndarray, q_pos: np.ndarray, k: np.ndarray, k_pos: np.ndarray,
                   k_stats: KindMoments | None = None) -> PooledMoments:
    """Sufficient statistics of the pooled Q+K cloud X (SPEC 2: Q rows stacked on K rows).

    ``k_stats`` (from :func:`kind_moments` of the same K rows) skips recomputing the K side, e.g. for
    query heads that share a KV head (GQA).
    """
    mq, tq, Sq, sq, tqq = _kind_moments(q, q_pos)
    mk, tk, Sk, sk, tkk = k_stats if k_stats is not None else _kind_moments(k, k_pos)
    return PooledMoments(len(q), len(k), mq, mk, tq, tk, Sq, Sk, sq, sk, tqq, tkk)


def projection_pearson(V: np.ndarray, S: np.ndarray, s_t: np.ndarray, stt: float) -> np.ndarray:
    """Pearson(x·v_j, t) for every column v_j of V, from centred scatter S, cross-scatter s_t, stt.

    SPEC 2 r_q(j), r_k(j) and SPEC 3 r_q_a, r_k_a: Pearson is shift-invariant, so the pooled-mean
    centring of the projections does not matter. NaN where the projection (or t) has no variance.
    """
    num = V.T @ s_t
    var = np.einsum("ij,ij->j", V, S @ V)
    den = np.sqrt(np.clip(var, 0.0, None) * stt)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(den > 0, num / den, np.nan)
    return np.clip(r, -1.0, 1.0)


def pooled_from_sums(q: dict[str, np.ndarray], k: dict[str, np.ndarray]) -> list[PooledMoments]:
    """:class:`PooledMoments` of every head from raw float64 sums (SPEC 12.2), vectorised over heads.

    ``q`` and ``k`` map n, t, tt (H,), x, xt (H, d), xx (H, d, d) to the sums over a head's query rows
    and its KV head's key rows (:meth:`qk_core.capture.moments.LayerMoments.q_pooled` / ``k_pooled``).
    Centred sums follow from raw ones: S = sum x x^T - n mu mu^T, s_xt = sum x t - mu sum t,
    s_tt = sum t^2 - (sum t)^2 / n.
    """

    def centred(s: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
        n = np.asarray(s["n"], dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            mu = s["x"] / n[:, None]
            tm = s["t"] / n
        S = s["xx"] - n[:, None, None] * mu[:, :, None] * mu[:, None, :]
        S = 0.5 * (S + np.swapaxes(S, 1, 2))
        return n, mu, tm, S, s["xt"] - mu * s["t"][:, None], s["tt"] - s["t"] * tm

    nq, mq, tq, Sq, sq, tqq = centred(q)
    nk, mk, tk, Sk, sk, tkk = centred(k)
    return [PooledMoments(int(nq[i]), int(nk[i]), mq[i], mk[i], float(tq[i]), float(tk[i]), Sq[i], Sk[i], sq[i],
                          sk[i], float(tqq[i]), float(tkk[i])) for i in range(len(nq))]
