"""Combined Q+K PCA (SPEC 2) against independent ground truth.

Ground truth: a full SVD of the explicitly stacked and centred rows (numpy), Pearson correlations of
the explicit projections (np.corrcoef), planted clouds whose PC0 role is known by construction, and
hand-chosen values on the taxonomy and sign-rule boundaries.
"""

from __future__ import annotations

import numpy as np
import pytest
from synthetic import CloudSpec, HeadSpec, plant_head, random_orthogonal

from qk_core.config.options import PCAOptions, resolve_options
from qk_core.geometry.heads import HeadInputError
from qk_core.geometry.pca import TAXONOMY, analyse_pca, classify, components_of, pca_record, sign_flips


def anisotropic_head(seed: int = 0, d: int = 24, n: int = 1500):
    """Q and K with distinct variances per direction (clear eigen-gaps) and a drift with position."""
    rng = np.random.default_rng(seed)
    R = random_orthogonal(d, seed + 1)
    scales = 3.0 * 0.8 ** np.arange(d)
    tq = rng.integers(0, 8192, n)
    tk = rng.integers(0, 8192, n + 200)
    q = (rng.standard_normal((n, d)) * scales) @ R + np.outer(tq / 4096.0, R[2]) + 0.5 * R[0]
    k = (rng.standard_normal((n + 200, d)) * scales) @ R - np.outer(tk / 2048.0, R[1]) - 0.5 * R[0]
    return q.astype(np.float32), tq.astype(np.int32), k.astype(np.float32), tk.astype(np.int32)


def test_pca_agrees_with_independent_svd() -> None:
    q, tq, k, tk = anisotropic_head()
    res = analyse_pca(q, tq, k, tk, PCAOptions(n_components=8))
    X = np.vstack([q, k]).astype(np.float64)
    Xc = X - X.mean(axis=0)
    _, s, Vt = np.linalg.svd(Xc, full_matrices=False)
    evr = s**2 / np.sum(s**2)
    assert np.allclose(res.mean, X.mean(axis=0), atol=1e-12)
    assert np.allclose(res.evr, evr[:8], rtol=1e-9, atol=1e-14)
    assert np.allclose(res.explained_variance, s[:8] ** 2 / (len(X) - 1), rtol=1e-9)
    dots = np.sum(res.components * Vt[:8], axis=1)
    assert np.all(np.abs(dots) > 1 - 1e-9)
    assert np.allclose(res.components @ res.components.T, np.eye(8), atol=1e-12)
    # correlations of the explicit projections, with the SVD's sign aligned to ours
    pq = (q.astype(np.float64) - X.mean(axis=0)) @ (Vt[:8] * np.sign(dots)[:, None]).T
    pk = (k.astype(np.float64) - X.mean(axis=0)) @ (Vt[:8] * np.sign(dots)[:, None]).T
    r_q = np.array([np.corrcoef(pq[:, j], tq)[0, 1] for j in range(8)])
    r_k = np.array([np.corrcoef(pk[:, j], tk)[0, 1] for j in range(8)])
    assert np.allclose(res.r_q, r_q, atol=1e-9)
    assert np.allclose(res.r_k, r_k, atol=1e-9)
    assert res.pos_budget_q == pytest.approx(np.sum(evr[:8] * r_q**2), rel=1e-9)
    assert res.pos_budget_k == pytest.approx(np.sum(evr[:8] * r_k**2), rel=1e-9)
    assert np.allclose(res.project(q), pq, atol=1e-9)
    # the stored row reproduces the components
    row = {**pca_record(res), "d": q.shape[1]}
    assert np.array_equal(components_of(row), res.components)


def test_sign_rule_holds_for_every_component_and_is_data_determined() -> None:
    q, tq, k, tk = anisotropic_head(seed=3)
    res = analyse_pca(q, tq, k, tk)
    ok = (res.r_q >= 0) | ((np.abs(res.r_q) < 0.05) & (res.r_k >= 0))
    assert ok.all()
    # Negating every vector negates each eigenvector; after the sign rule the components must be the
    # negation and every correlation identical — the orientation comes from the data, not from eigh.
    neg = analyse_pca(-q, tq, -k, tk)
    assert np.allclose(neg.components, -res.components, atol=1e-9)
    assert np.allclose(neg.r_q, res.r_q, atol=1e-12) and np.allclose(neg.r_k, res.r_k, atol=1e-12)


def test_sign_rule_uses_r_k_when_q_has_no_position_signal() -> None:
    # PC0 is the drift axis; Q has no slope on it (|r_q| << 0.05), K drifts downwards along it.
    spec = HeadSpec(q=CloudSpec(slope=0.0, sigma_a=3.0, sigma=0.3), k=CloudSpec(slope=-2e-3, sigma=0.3))
    head, axes = plant_head(spec, d=16, per_bucket=16)
    for flip in (1.0, -1.0):
        res = analyse_pca(flip * head.q, head.q_pos, flip * head.k, head.k_pos)
        assert abs(res.r_q[0]) < 0.05
        assert res.r_k[0] > 0.9  # oriented by r_k: along the direction K drifts to
        assert res.components[0] @ axes[0] == pytest.approx(-flip, abs=0.01)


@pytest.mark.parametrize(("r_q", "r_k", "flip"), [
    (0.3, -0.9, 1.0), (-0.3, 0.9, -1.0),
    (0.05, -0.9, 1.0),  # |r_q| = 0.05 is not < 0.05: r_q decides
    (-0.05, 0.9, -1.0),
    (-0.0499, 0.9, 1.0), (0.0499, -0.9, -1.0),  # |r_q| < 0.05: r_k decides
    (0.0, 0.0, 1.0), (np.nan, -0.5, -1.0),
])
def test_sign_flips_boundaries(r_q: float, r_k: float, flip: float) -> None:
    assert sign_flips(np.array([r_q]), np.array([r_k]))[0] == flip


@pytest.mark.parametrize(("r_q", "r_k", "label"), [
    (0.71, 0.71, "position_dominated"), (0.71, -0.71, "position_dominated"),
    (0.7, 0.9, "mixed"), (0.9, 0.7, "mixed"), (0.9, -0.7, "mixed"),
    (0.9, 0.29, "q_positional"), (0.9, -0.29, "q_positional"), (0.9, 0.3, "mixed"),
    (0.29, 0.9, "k_positional"), (0.0, -0.9, "k_positional"), (0.3, 0.9, "mixed"),
    (0.29, 0.29, "content"), (-0.04, -0.29, "content"), (0.3, 0.0, "mixed"), (0.0, 0.3, "mixed"),
    (0.5, 0.5, "mixed"), (np.nan, 0.9, "mixed"),
])
def test_taxonomy_boundaries_are_strict(r_q: float, r_k: float, label: str) -> None:
    assert classify(r_q, r_k) == label
    assert classify(np.array([r_q]), np.array([r_k]))[0] == label


SLOPE = 2e-3  # per token: ~4.7 vector units of drift sd over positions spread over 8K tokens


@pytest.mark.parametrize(("spec", "label"), [
    (HeadSpec(q=CloudSpec(slope=SLOPE, sigma=0.3), k=CloudSpec(slope=SLOPE, sigma=0.3)), "position_dominated"),
    (HeadSpec(q=CloudSpec(slope=SLOPE, sigma=0.3), k=CloudSpec(sigma_a=2.5, sigma=0.3)), "q_positional"),
    (HeadSpec(q=CloudSpec(sigma_a=2.5, sigma=0.3), k=CloudSpec(slope=SLOPE, sigma=0.3)), "k_positional"),
    (HeadSpec(q=CloudSpec(slope=1e-4, content=5.0, sigma=0.3), k=CloudSpec(slope=1e-4, content=5.0, sigma=0.3)),
     "content"),
    (HeadSpec(q=CloudSpec(slope=SLOPE, sigma_a=8.0, sigma=0.3), k=CloudSpec(slope=SLOPE, sigma_a=8.0, sigma=0.3)),
     "mixed"),
])
def test_planted_clouds_land_in_their_taxonomy_class(spec: HeadSpec, label: str) -> None:
    head, axes = plant_head(spec, d=16, per_bucket=16, window=8192, bucket=512)
    res = analyse_pca(head.q, head.q_pos, head.k, head.k_pos)
    assert res.taxonomy == label
    assert label in TAXONOMY
    planted_pc0 = axes[2] if label == "content" else axes[0]
    assert abs(res.components[0] @ planted_pc0) > 0.99


def test_rotating_q_and_k_together_leaves_pca_quantities_unchanged() -> None:
    q, tq, k, tk = anisotropic_head(seed=5)
    R = random_orthogonal(q.shape[1], 11)
    a = analyse_pca(q, tq, k, tk)
    b = analyse_pca((q.astype(np.float64) @ R).astype(np.float32), tq, (k.astype(np.float64) @ R).astype(np.float32),
                    tk)
    for name in ("evr", "r_q", "r_k", "explained_variance"):
        assert np.allclose(getattr(a, name), getattr(b, name), rtol=1e-4, atol=1e-5), name
    assert a.taxonomy == b.taxonomy
    assert a.pos_budget_q == pytest.approx(b.pos_budget_q, rel=1e-4)
    assert np.allclose(a.components @ R, b.components, atol=1e-4)


def test_components_capped_at_dimension() -> None:
    q, tq, k, tk = anisotropic_head(d=6)
    res = analyse_pca(q, tq, k, tk, PCAOptions(n_components=10))
    assert res.components.shape == (6, 6)
    assert res.evr.sum() == pytest.approx(1.0, abs=1e-12)


def test_bad_heads_raise_a_named_status() -> None:
    q, tq, k, tk = anisotropic_head(n=50)
    cases = {
        "too_few_rows": (q[:5], tq[:5], k, tk),
        "non_finite": (np.where(np.arange(len(q))[:, None] == 3, np.nan, q), tq, k, tk),
        "constant_positions": (q, np.full_like(tq, 17), k, tk),
        "zero_variance": (np.ones_like(q), tq, np.ones_like(k), tk),
        "bad_shape": (q[:, :5], tq, k, tk),
    }
    for status, args in cases.items():
        with pytest.raises(HeadInputError) as err:
            analyse_pca(*args)
        assert err.value.status == status
    rec = pca_record(None, error=HeadInputError("non_finite", "3 Q rows"))
    assert rec["status"] == "non_finite" and np.isnan(rec["pc0_r_q"])


def test_options_validate_names() -> None:
    assert resolve_options("pca", {"pca": {"n_components": 4}}).n_components == 4
    with pytest.raises(ValueError, match="n_componets"):
        resolve_options("pca", {"pca": {"n_componets": 4}})


def test_blas_thread_limit_is_scoped_and_leaves_results_unchanged() -> None:
    from qk_core.runtime.blas import available, blas_threads, current_threads

    q, tq, k, tk = anisotropic_head(seed=9)
    free = analyse_pca(q, tq, k, tk)
    before = current_threads()
    with blas_threads(1):
        assert not available() or set(current_threads()) == {1}
        limited = analyse_pca(q, tq, k, tk)
    assert current_threads() == before
    assert np.allclose(free.evr, limited.evr, rtol=1e-12) and np.allclose(free.r_q, limited.r_q, atol=1e-12)
