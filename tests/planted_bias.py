"""Planted corpora with a known drift axis and a known bias_strength (SPEC 3), for bootstrap coverage checks.

Per head h, document d and position t (a, b orthonormal: coordinates 0 and 1; noise N(0, sigma^2 I_d)):
q = (m_a + u_d + s_q t) a + m_b b + noise, k = (u'_d + s_k (1 + v_d) t) a - m_b b + noise, with document
effects u_d, u'_d ~ N(0, tau_u^2), v_d ~ N(0, tau_v^2) and positions uniform within each of the window's buckets
(``per_bucket`` per bucket and document, shared by Q and K). With infinitely many documents SPEC 3's pooled
Cov(x, t) points along a (the document effects are independent of t and have mean 0), mu_Q^a = m_a + s_q L / 2
and alpha_K = s_k, so the true bias_strength of head h is (m_a + s_q L / 2) s_k, and the model value (the mean
over heads, as in :mod:`qk_core.cross_corpus.compare`) is :func:`truth`. Head i's parameters are those of
tests/test_cross_corpus.py's planted heads. Used by tests/test_cross_corpus.py and bench/bootstrap_coverage.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qk_core.cross_corpus.compare import doc_moments


@dataclass(frozen=True)
class Regime:
    name: str
    d: int = 64  # head dimension (the demo models: 64)
    docs: int = 16  # documents of the corpus (the demo corpora: 16 and 8)
    L: int = 2048
    buckets: int = 16
    per_bucket: int = 8  # positions per bucket and document (the demo: 8)
    heads: int = 4
    sigma: float = 1.0
    tau_u: float = 0.3  # document offset along a
    tau_v: float = 0.3  # document key-drift variation (relative)
    drift: float = 1.0  # key drift multiplier (a planted between-corpus difference)
    resamples: int = 200  # SPEC 4.6 default


def head_params(i: int, r: Regime) -> tuple[float, float, float, float]:
    """(m_a, s_q, s_k, m_b) of head i."""
    return 0.8 + 0.4 * i, 0.4 / r.L, r.drift * (0.8 + 0.3 * i) / r.L, 0.6


def truth(r: Regime) -> float:
    """The planted model value: mean over heads of (m_a + s_q L / 2) s_k (per token)."""
    vals = []
    for i in range(r.heads):
        m_a, s_q, s_k, _ = head_params(i, r)
        vals.append((m_a + s_q * r.L / 2) * s_k)
    return float(np.mean(vals))


def plant(r: Regime, rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per head: the (Mq, Mk) per-document moments (:func:`qk_core.cross_corpus.compare.doc_moments`) of one corpus."""
    width = r.L / r.buckets
    doc = np.repeat(np.arange(r.docs), r.buckets * r.per_bucket)
    ids = np.arange(r.docs)
    out = []
    for i in range(r.heads):
        m_a, s_q, s_k, m_b = head_params(i, r)
        t = (np.tile(np.repeat(np.arange(r.buckets), r.per_bucket), r.docs) + rng.random(len(doc))) * width
        u_q, u_k = rng.normal(0, r.tau_u, r.docs)[doc], rng.normal(0, r.tau_u, r.docs)[doc]
        v = rng.normal(0, r.tau_v, r.docs)[doc]
        q = r.sigma * rng.standard_normal((len(t), r.d))
        k = r.sigma * rng.standard_normal((len(t), r.d))
        q[:, 0] += m_a + u_q + s_q * t
        q[:, 1] += m_b
        k[:, 0] += u_k + s_k * (1 + v) * t
        k[:, 1] -= m_b
        out.append((doc_moments(q, t, doc, ids), doc_moments(k, t, doc, ids)))
    return out
