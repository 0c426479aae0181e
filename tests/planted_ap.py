"""Planted plasticity worlds with a known AP (SPEC 4.3-4.5), for interval calibration (SPEC 4.6, 10; issue 24).

The demo's sampling (L 2048, B 128, 8 positions per bucket and document), d 16, tests/test_cross_corpus.py's
heads, and per document a query offset along the drift axis (sd ``TAU``), so documents differ. The truth
(:func:`ap_truth`) is computed from the planted parameters with numpy only, independent of qk_core: the SPEC 4.3
closed form (and p_hat) under the *population* query model, by Monte Carlo over key pairs drawn as SPEC 4.2
draws them (two keys of one document below the query bucket: positions uniform there; document offsets cancel
in k_i - k_j). Population model of bucket j: mean (m_a + s_q tau_j) a + m_bq b, covariance
sigma^2 I + TAU^2 a a^T. Used by tests/test_calibration.py and bench/bootstrap_coverage.py.
"""

from __future__ import annotations

import numpy as np
import scipy.special
from synthetic import CloudSpec, plant_cloud, random_axes, stratified_positions

from qk_core.capture.store import HeadData

L, B, PER_BUCKET, D_HEAD, HEADS, TAU = 2048, 128, 8, 16, 3, 0.3
QUANTS = ("ap_overall", "ap_first20", "ap_last20", "ap_drop")


def head_params(i: int) -> dict[str, float]:
    """Planted head i (tests/test_cross_corpus.py's heads): query / key drift, offsets, noise."""
    return {"m_a": 0.8 + 0.4 * i, "s_q": 0.4 / L, "m_bq": 0.6, "s_k": (0.8 + 0.3 * i) / L, "sigma": 1.0}


def plant_heads(n_docs: int, seed: int, heads: int = HEADS) -> tuple[np.ndarray, dict[tuple[int, int], HeadData]]:
    """(doc ids, heads) of one planted corpus of full-window documents."""
    doc, pos = stratified_positions({j: L for j in range(n_docs)}, B, PER_BUCKET, seed)
    out = {}
    for i in range(heads):
        p = head_params(i)
        axes = random_axes(D_HEAD, 100 + i)
        rng = np.random.default_rng([seed, i])
        q = plant_cloud(CloudSpec(m_a=p["m_a"], slope=p["s_q"], m_b=p["m_bq"], sigma=p["sigma"]), axes, pos, rng)
        q += (TAU * rng.standard_normal(n_docs))[doc][:, None].astype(np.float32) * axes[0][None, :]
        k = plant_cloud(CloudSpec(slope=p["s_k"], m_b=-0.6, sigma=p["sigma"]), axes, pos, rng)
        k += (TAU * rng.standard_normal(n_docs))[doc][:, None].astype(np.float32) * axes[0][None, :]
        out[(0, i)] = HeadData(0, i, i, q, pos.copy(), doc.copy(), k, pos.copy(), doc.copy(), L, B)
    return np.arange(n_docs, dtype=np.int64), out


def ap_truth(heads: int = HEADS, n_pairs: int = 100_000, seed: int = 7) -> dict[str, dict[str, float]]:
    """Population AP per estimator (closed, empirical) and quantity, mean over heads (module docstring)."""
    rng = np.random.default_rng(seed)
    J = L // B
    tau = (np.arange(J) + 0.5) * B
    out: dict[str, dict[str, list[float]]] = {e: {q: [] for q in QUANTS} for e in ("closed", "empirical")}
    for i in range(heads):
        p = head_params(i)
        prof = {e: np.full(J, np.nan) for e in out}
        for j in range(1, J):
            ti, tj = rng.uniform(0, j * B, (2, n_pairs))
            delta = p["sigma"] * rng.standard_normal((n_pairs, D_HEAD)) * np.sqrt(2.0)
            delta[:, 0] += p["s_k"] * (ti - tj)
            sd = np.sqrt(p["sigma"] ** 2 * (delta**2).sum(axis=1) + TAU**2 * delta[:, 0] ** 2)
            z = ((p["m_a"] + p["s_q"] * tau[j]) * delta[:, 0] + p["m_bq"] * delta[:, 1]) / sd
            prof["closed"][j] = np.mean(4 * scipy.special.ndtr(z) * scipy.special.ndtr(-z))
            tq = j * B + (np.arange(16) + 0.5) * B / 16
            ph = scipy.special.ndtr(((p["m_a"] + p["s_q"] * tq[:, None]) * delta[:, 0] + p["m_bq"] * delta[:, 1])
                                    / sd).mean(axis=0)
            prof["empirical"][j] = np.mean(4 * ph * (1 - ph))
        for e, pr in prof.items():
            first, last = np.nanmean(pr[tau < 0.2 * L]), np.nanmean(pr[tau >= 0.8 * L])
            vals = {"ap_overall": np.nanmean(pr), "ap_first20": first, "ap_last20": last, "ap_drop": first - last}
            for q in QUANTS:
                out[e][q].append(float(vals[q]))
    return {e: {q: float(np.mean(v)) for q, v in d.items()} for e, d in out.items()}
