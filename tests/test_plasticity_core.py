"""Attention plasticity (SPEC 4) against independent ground truth: planted Gaussian query models and
brute-force Monte Carlo, hand computations of the thesis equations, brute-force pair enumeration and
naive bootstrap loops."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from qk_core.capture.store import HeadData
from qk_core.config.options import PlasticityOptions, PlasticityOptionsError, resolve_options
from qk_core.plasticity import aggregates as agg
from qk_core.plasticity import analyse_head
from qk_core.plasticity.heatmap import HeatmapAccumulator
from qk_core.plasticity.pairs import index_keys, pair_rng, sample_pairs, unrank_pairs
from qk_core.plasticity.query_model import fit_query_model, householder, ledoit_wolf
from qk_core.stats.bootstrap import doc_bucket_sums, doc_weights, resampled_profiles


# ---- planted Gaussian heads ------------------------------------------------------------------------
def random_orthogonal(d: int, rng: np.random.Generator) -> np.ndarray:
    Q, R = np.linalg.qr(rng.standard_normal((d, d)))
    return Q * np.sign(np.diag(R))


def random_spd(d: int, rng: np.random.Generator, cond: float = 6.0) -> np.ndarray:
    """A covariance with strong correlations: random eigenbasis, eigenvalues spread over [1, cond]."""
    U = random_orthogonal(d, rng)
    return U @ np.diag(np.geomspace(1.0, cond, d)) @ U.T


def planted_head(*, d: int, L: int, B: int, a: np.ndarray, b: np.ndarray, Sigma: np.ndarray,
                 q_per_bucket: int, n_docs: int, key_drift: np.ndarray, key_sd: float, rng: np.random.Generator,
                 keys_per_bucket: int = 1) -> HeadData:
    """Queries q = a + b t + eps, eps ~ N(0, Sigma), t uniform per bucket; keys c t + key_sd * N(0, I)
    with ``keys_per_bucket`` keys per document and bucket."""
    J = L // B
    q_pos = np.concatenate([rng.integers(j * B, (j + 1) * B, size=q_per_bucket) for j in range(J)])
    Lc = np.linalg.cholesky(Sigma)
    q = a + np.outer(q_pos, b) + rng.standard_normal((len(q_pos), d)) @ Lc.T
    q_doc = rng.integers(0, n_docs, size=len(q_pos))
    k_doc = np.repeat(np.arange(n_docs), J * keys_per_bucket)
    k_pos = np.concatenate([rng.integers(j * B, (j + 1) * B, size=keys_per_bucket)
                            for _ in range(n_docs) for j in range(J)])
    k = np.outer(k_pos, key_drift) + key_sd * rng.standard_normal((len(k_pos), d))
    return HeadData(0, 0, 0, q, q_pos.astype(np.int32), q_doc.astype(np.int64), k, k_pos.astype(np.int32),
                    k_doc.astype(np.int64), L, B)


def mc_bucket_ap(delta: np.ndarray, j: int, B: int, a: np.ndarray, b: np.ndarray, Sigma: np.ndarray,
                 n_mc: int, rng: np.random.Generator) -> np.ndarray:
    """Brute force: fresh queries of bucket j from the planted model; PP = 4 p_hat (1 - p_hat) per pair."""
    t = rng.integers(j * B, (j + 1) * B, size=n_mc)
    q = a + np.outer(t, b) + rng.standard_normal((n_mc, len(a))) @ np.linalg.cholesky(Sigma).T
    p = ((q @ delta.T) > 0).mean(axis=0)
    return 4 * p * (1 - p)


def sampled_deltas(head: HeadData, j: int, opts: PlasticityOptions) -> np.ndarray:
    J = head.window // head.bucket
    bp = sample_pairs(index_keys(head.k_pos, head.k_doc, head.bucket, J), j, opts.pairs_per_bucket,
                      pair_rng(opts.seed, head.layer, head.q_head, j))
    return head.k[bp.i] - head.k[bp.j]


# ---- SPEC 4.1 pieces -------------------------------------------------------------------------------
def test_householder_maps_beta_to_e1() -> None:
    rng = np.random.default_rng(1)
    for beta in (rng.standard_normal(7), -np.eye(7)[0] * 3.0, np.eye(7)[0] * 2.0, np.eye(7)[3]):
        H = householder(beta)
        np.testing.assert_allclose(H @ H.T, np.eye(7), atol=1e-12)
        np.testing.assert_allclose(H, H.T, atol=1e-12)
        np.testing.assert_allclose(H @ (beta / np.linalg.norm(beta)), np.eye(7)[0], atol=1e-12)
    np.testing.assert_array_equal(householder(np.zeros(5)), np.eye(5))


def test_ledoit_wolf_matches_the_published_formula() -> None:
    """Ledoit & Wolf (2004), Lemma 3.2-3.4, written as an explicit loop over observations."""
    rng = np.random.default_rng(2)
    n, d = 40, 12
    X = rng.standard_normal((n, d)) @ random_spd(d, rng, 20.0)
    S_hat, s_hat = ledoit_wolf(X)
    Xc = X - X.mean(0)
    S = Xc.T @ Xc / n
    norm2 = lambda A: float((A * A).sum()) / d  # noqa: E731  (their normalised Frobenius norm)
    m = np.trace(S) / d
    d2 = norm2(S - m * np.eye(d))
    b2_bar = sum(norm2(np.outer(x, x) - S) for x in Xc) / n**2
    b2 = min(b2_bar, d2)
    assert s_hat == pytest.approx(b2 / d2, rel=1e-10)
    np.testing.assert_allclose(S_hat, (b2 / d2) * m * np.eye(d) + (1 - b2 / d2) * S, rtol=1e-10, atol=1e-12)
    R = random_orthogonal(d, rng)
    S_rot, s_rot = ledoit_wolf(X @ R.T)
    assert s_rot == pytest.approx(s_hat, rel=1e-9)
    np.testing.assert_allclose(S_rot, R @ S_hat @ R.T, atol=1e-9)


def test_component_weights_from_planted_drift() -> None:
    """SPEC 4.8: R^2 of each coordinate on t (hand formula), constant coordinate 0, weights sum to 1."""
    rng = np.random.default_rng(3)
    t = rng.integers(0, 1024, size=4000).astype(float)
    q = np.column_stack([0.01 * t + rng.standard_normal(4000), rng.standard_normal(4000),
                         np.full(4000, 2.5), -0.002 * t + rng.standard_normal(4000)])
    model = fit_query_model(q, t, 1024, 64)
    expect = [np.corrcoef(q[:, k], t)[0, 1] ** 2 for k in (0, 1, 3)]
    np.testing.assert_allclose(model.r2[[0, 1, 3]], expect, rtol=1e-9)
    assert model.r2[2] == 0.0
    w = model.component_weights()
    assert w.sum() == pytest.approx(1.0) and w[2] == 0.0
    np.testing.assert_allclose(w[[0, 1, 3]], np.array(expect) / sum(expect), rtol=1e-9)


# ---- SPEC 4.2 pairs ----------------------------------------------------------------------------------
def test_pairs_are_eligible_distinct_and_counted_like_brute_force() -> None:
    rng = np.random.default_rng(4)
    B, J = 10, 6
    k_doc = rng.integers(0, 5, size=60)
    k_pos = rng.integers(0, B * J, size=60)
    idx = index_keys(k_pos, k_doc, B, J)
    for j in range(J):
        brute = {(a, b) for a, b in itertools.combinations(range(60), 2)
                 if k_doc[a] == k_doc[b] and k_pos[a] // B < j and k_pos[b] // B < j}
        bp = sample_pairs(idx, j, 25, pair_rng(0, 3, 1, j))
        assert bp.n_eligible == len(brute)
        got = [tuple(sorted(p)) for p in zip(bp.i.tolist(), bp.j.tolist(), strict=True)]
        assert len(got) == len(set(got)) == min(25, len(brute))
        assert set(got) <= brute
        assert all(k_pos[i] <= k_pos[jj] for i, jj in zip(bp.i, bp.j, strict=True))
        again = sample_pairs(idx, j, 25, pair_rng(0, 3, 1, j))
        np.testing.assert_array_equal(again.i, bp.i)


def test_pair_sampling_is_uniform_without_replacement() -> None:
    """Inclusion frequency of each of the 10 eligible pairs when drawing 3: 3/10 (chi-square)."""
    k_doc = np.array([0, 0, 0, 1, 1, 1, 1])
    k_pos = np.array([0, 1, 2, 0, 1, 2, 3])
    idx = index_keys(k_pos, k_doc, 10, 2)  # all keys in bucket 0: 3 + 6 = 9 eligible pairs for bucket 1
    counts: dict[tuple[int, int], int] = {}
    n_rep = 3000
    for s in range(n_rep):
        bp = sample_pairs(idx, 1, 3, pair_rng(s, 0, 0, 1))
        assert len(set(zip(bp.i.tolist(), bp.j.tolist(), strict=True))) == 3
        for p in zip(bp.i.tolist(), bp.j.tolist(), strict=True):
            counts[p] = counts.get(p, 0) + 1
    assert len(counts) == 9
    obs = np.array(list(counts.values()))
    expected = n_rep * 3 / 9
    chi2 = ((obs - expected) ** 2 / expected).sum()
    assert stats.chi2.sf(chi2, df=8) > 1e-3


def test_unrank_pairs_matches_enumeration() -> None:
    enum = [(a, b) for b in range(1, 400) for a in range(b)]
    a, b = unrank_pairs(np.arange(len(enum)))
    assert list(zip(a.tolist(), b.tolist(), strict=True)) == enum
    big = np.array([10**12, 10**13 + 7, 2**52])
    a, b = unrank_pairs(big)
    assert np.all((b * (b - 1)) // 2 + a == big) and np.all(a < b) and np.all(a >= 0)


# ---- SPEC 4.3 (a): closed form vs brute-force Monte Carlo --------------------------------------------
def _mc_case(covariance: str, seed: int) -> tuple[HeadData, dict[str, np.ndarray], PlasticityOptions]:
    rng = np.random.default_rng(seed)
    d, L, B = 6, 1024, 64
    b = rng.standard_normal(d)
    b *= 4.0 / (np.linalg.norm(b) * L)  # |b| L = 4: the query mean moves 4 units over the window
    a = 0.5 * rng.standard_normal(d)
    if covariance == "full":
        Sigma = 0.2 * random_spd(d, rng, 8.0)
    else:  # diagonal in the Householder basis of the planted drift, as eqs. 4.11-4.12 assume
        H = householder(b)
        Sigma = H @ np.diag(0.2 * np.geomspace(0.5, 4.0, d)) @ H
    c = rng.standard_normal(d) * 3.0 / L
    head = planted_head(d=d, L=L, B=B, a=a, b=b, Sigma=Sigma, q_per_bucket=3000, n_docs=30, key_drift=c,
                        key_sd=0.4, rng=rng)
    opts = PlasticityOptions(pairs_per_bucket=64, covariance=covariance, bootstrap=0)
    return head, {"a": a, "b": b, "Sigma": Sigma}, opts


@pytest.mark.parametrize("covariance", ["full", "diagonal"])
def test_closed_form_matches_monte_carlo(covariance: str) -> None:
    """Bucket AP from the fitted closed form vs 4 p (1 - p) with p from 40,000 fresh planted queries.

    Tolerance 0.015 on a bucket's AP (64 pairs): MC standard error < 0.004, query-model estimation
    error (3,000 queries per bucket) < 0.005, within-bucket drift ignored by the model < 0.002.
    """
    head, truth, opts = _mc_case(covariance, seed=5)
    res = analyse_head(head, opts)
    mc_rng = np.random.default_rng(6)
    seen = []
    for j in (3, 8, 15):
        delta = sampled_deltas(head, j, opts)
        mc = mc_bucket_ap(delta, j, head.bucket, truth["a"], truth["b"], truth["Sigma"], 40_000, mc_rng)
        assert res.profile.loc[j, "status"] == "ok"
        assert res.ap[j] == pytest.approx(mc.mean(), abs=0.015)
        seen.append(mc.mean())
    assert max(seen) - min(seen) > 0.1  # the buckets probe different AP levels, not a constant


def test_diagonal_model_is_wrong_on_correlated_noise() -> None:
    """The MC check has teeth: with correlated noise the diagonal approximation misses the truth."""
    head, truth, opts = _mc_case("full", seed=5)
    res = analyse_head(head, opts.with_(covariance="diagonal"))
    errors = []
    for j in (3, 15):
        delta = sampled_deltas(head, j, opts)
        mc = mc_bucket_ap(delta, j, head.bucket, truth["a"], truth["b"], truth["Sigma"], 40_000,
                          np.random.default_rng(7))
        errors.append(abs(res.ap[j] - mc.mean()))
    assert max(errors) > 0.03


# ---- (b) rotation invariance ---------------------------------------------------------------------------
def test_full_covariance_is_invariant_to_a_common_rotation() -> None:
    head, _, opts = _mc_case("full", seed=8)
    opts = opts.with_(bootstrap=50)
    R = random_orthogonal(head.d, np.random.default_rng(9))
    rot = HeadData(0, 0, 0, head.q @ R.T, head.q_pos, head.q_doc, head.k @ R.T, head.k_pos, head.k_doc,
                   head.window, head.bucket)
    r0, r1 = analyse_head(head, opts), analyse_head(rot, opts)
    ok = r0.profile["status"].eq("ok").to_numpy()
    assert ok.sum() >= 12
    np.testing.assert_allclose(r1.ap[ok], r0.ap[ok], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(r1.pairs["z"], r0.pairs["z"], rtol=1e-4, atol=1e-5)  # float32 records
    for name in ("ap_overall", "ap_drop", "ap_overall_lo", "ap_drop_hi"):
        assert r1.row[name] == pytest.approx(r0.row[name], rel=1e-9)
    # the diagonal option is basis dependent, so the same rotation changes it
    d0 = analyse_head(head, opts.with_(covariance="diagonal"))
    d1 = analyse_head(rot, opts.with_(covariance="diagonal"))
    assert np.nanmax(np.abs(d1.ap - d0.ap)) > 1e-3


# ---- (c) diagonal option by hand (thesis eqs. 4.11-4.12) ----------------------------------------------
def _hand_head(swap: bool) -> HeadData:
    """L = 4, B = 2, d = 2; queries of two documents at t = 0..3 with designed residuals."""
    s = np.array([1.0, -1.0, -1.0, 1.0])  # orthogonal to 1 and to t = 0..3
    t = np.tile(np.arange(4), 2)
    q = np.column_stack([1 + 0.5 * t + 0.2 * np.tile(s, 2), 3 + 0.5 * np.tile(s, 2)])
    k = np.array([[1.0, 0.0], [0.5, 0.6], [9.0, 9.0], [2.0, 1.0], [1.9, 1.05], [7.0, -3.0]])
    k_pos = np.array([0, 1, 2, 0, 1, 3])
    k_doc = np.array([0, 0, 0, 1, 1, 1])
    if swap:  # drift along coordinate 2: the Householder reflection must swap the coordinates back
        q, k = q[:, ::-1].copy(), k[:, ::-1].copy()
    return HeadData(0, 0, 0, q, t.astype(np.int32), np.repeat([0, 1], 4), k, k_pos.astype(np.int32), k_doc, 4, 2)


@pytest.mark.parametrize("swap", [False, True])
def test_diagonal_option_reproduces_hand_computation(swap: bool) -> None:
    # by hand: OLS alpha = (1, 3), beta = (0.5, 0); residual of coordinate 1 = 0.2 s, RSS = 8 * 0.04
    sigma_pos2 = 8 * 0.04 / (8 - 2)
    var2 = 4 * 0.5**2 / 3  # bucket 1 values 2.5, 3.5, 2.5, 3.5, ddof 1
    mean = (1 + 0.5 * 3.0, 3.0)  # tau_1 = 1.5 * B = 3
    expected = []
    for d1, d2 in ((1.0 - 0.5, 0.0 - 0.6), (2.0 - 1.9, 1.0 - 1.05)):  # the two eligible pairs of bucket 1
        m = mean[0] * d1 + mean[1] * d2
        v = d1**2 * sigma_pos2 + d2**2 * var2
        p = 0.5 * (1 + math.erf(m / math.sqrt(v) / math.sqrt(2)))
        expected.append(4 * p * (1 - p))
    opts = PlasticityOptions(covariance="diagonal", min_queries_per_bucket=2, bootstrap=0)
    res = analyse_head(_hand_head(swap), opts)
    assert res.profile.loc[1, "status"] == "ok" and res.profile.loc[1, "n_pairs"] == 2
    got = res.pairs.sort_values("example_id")["pp"].to_numpy(float)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert res.ap[1] == pytest.approx(np.mean(expected), rel=1e-9)
    assert expected[0] == pytest.approx(0.2466, abs=1e-3) and expected[1] == pytest.approx(0.0136, abs=1e-3)


# ---- (d) decay under planted linear drift ---------------------------------------------------------------
def _drift_head(drift: float, seed: int) -> HeadData:
    rng = np.random.default_rng(seed)
    d, L, B = 16, 4096, 256
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    return planted_head(d=d, L=L, B=B, a=0.2 * u, b=drift * u / L, Sigma=np.eye(d), q_per_bucket=200,
                        n_docs=80, key_drift=drift * u / L, key_sd=0.5, rng=rng)


def test_ap_decays_with_query_position_under_linear_drift() -> None:
    opts = PlasticityOptions(pairs_per_bucket=256, bootstrap=100)
    res = analyse_head(_drift_head(2.0, seed=10), opts)
    ok = res.profile["status"].eq("ok").to_numpy()
    rho = stats.spearmanr(res.profile["tau_tokens"][ok], res.ap[ok]).statistic
    assert rho < -0.9
    assert res.row["ap_drop"] > 0.1 and res.row["ap_drop_lo"] > 0
    # without drift the profile is flat: no decay
    flat = analyse_head(_drift_head(0.0, seed=10), opts)
    ok = flat.profile["status"].eq("ok").to_numpy()
    assert abs(flat.row["ap_drop"]) < 0.03
    assert stats.spearmanr(flat.profile["tau_tokens"][ok], flat.ap[ok]).statistic > -0.6


# ---- (e) empirical vs closed form -----------------------------------------------------------------------
def test_empirical_agrees_with_closed_form_on_gaussian_data_and_gap_is_reported() -> None:
    res = analyse_head(_drift_head(2.0, seed=11), PlasticityOptions(pairs_per_bucket=256, bootstrap=0))
    ok = res.profile["status"].eq("ok")
    gap = res.profile.loc[ok, "ap"] - res.profile.loc[ok, "ap_empirical"]
    assert gap.abs().max() < 0.02
    assert res.row["gap_mean"] == pytest.approx(gap.mean(), rel=1e-12)
    assert res.row["gap_max_abs"] == pytest.approx(gap.abs().max(), rel=1e-12)


def test_gap_flags_non_gaussian_queries() -> None:
    """Queries bimodal along the key direction (90% at +1, 10% at -9: mean 0): the Gaussian closed form
    says p = 1/2 (PP ~ 1), the data say p = 0.9 or 0.1 (PP = 0.36); the diagnostic reports the gap."""
    rng = np.random.default_rng(12)
    L, B, n = 1024, 64, 4000
    q_pos = rng.integers(0, L, n)
    x = np.where(rng.random(n) < 0.9, 1.0, -9.0) + 0.05 * rng.standard_normal(n)
    q = np.column_stack([q_pos / L + 0.05 * rng.standard_normal(n), x, rng.standard_normal((n, 2))])
    k_doc = np.repeat(np.arange(40), 16)
    k_pos = np.tile(np.arange(16) * B + 3, 40)
    k = np.column_stack([np.zeros(640), rng.standard_normal(640), 0.01 * rng.standard_normal((640, 2))])
    head = HeadData(0, 0, 0, q, q_pos, rng.integers(0, 40, n), k, k_pos, k_doc, L, B)
    res = analyse_head(head, PlasticityOptions(pairs_per_bucket=128, bootstrap=0))
    assert res.row["gap_mean"] > 0.4
    assert res.row["ap_overall"] > 0.8 and res.row["ap_overall_empirical"] < 0.5


def test_residual_shape_diagnostics_match_planted_distribution() -> None:
    """SPEC 4.9: coordinate-1 residual exponential (skew 2, excess kurtosis 6)."""
    rng = np.random.default_rng(13)
    n, L = 20000, 2048
    t = rng.integers(0, L, n)
    q = np.column_stack([0.01 * t + rng.exponential(size=n), 0.1 * rng.standard_normal((n, 3))])
    k = rng.standard_normal((64, 4))
    head = HeadData(0, 0, 0, q, t, np.zeros(n, int), k, np.tile(np.arange(16) * 128, 4), np.repeat(np.arange(4), 16),
                    L, 128)
    row = analyse_head(head, PlasticityOptions(bootstrap=0)).row
    assert row["resid1_skew"] == pytest.approx(2.0, abs=0.25)
    assert row["resid1_excess_kurtosis"] == pytest.approx(6.0, abs=2.0)
    assert row["beta_norm_per_token"] == pytest.approx(0.01, rel=0.02)
    assert row["beta_norm_window"] == pytest.approx(0.01 * L, rel=0.02)


# ---- SPEC 4.5 aggregates ---------------------------------------------------------------------------------
def test_aggregates_by_hand_with_partial_last_bucket() -> None:
    L, B = 100, 12  # 9 buckets, the last holds 4 positions; tau = 6, 18, ..., 90, 102
    ap = np.array([np.nan, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2])
    h = agg.headline(ap, L, B)
    assert h["ap_overall"] == pytest.approx((0.9 + 0.8 + 0.7 + 0.6 + 0.5 + 0.4 + 0.3) * 12 / 88 + 0.2 * 4 / 88)
    assert h["ap_first20"] == pytest.approx(0.9)  # tau in [0, 20): buckets 0 (no value), 1
    assert h["ap_last20"] == pytest.approx(0.3)  # tau in [80, 100]: bucket 7 (tau 90); tau 102 > L
    assert h["ap_drop"] == pytest.approx(0.6)
    assert np.isnan(agg.headline(ap[:7], 100, 16)["ap_first20"])  # B = 16: only bucket 0 has tau < 20
    stacked = agg.headline(np.stack([ap, ap - 0.1]), L, B)
    np.testing.assert_allclose(stacked["ap_overall"], [h["ap_overall"], h["ap_overall"] - 0.1])


def test_bins_membership_missing_and_labels() -> None:
    L, B = 131072, 8192
    opts = PlasticityOptions()
    bins = agg.all_bins(L, B, opts)
    keys = {(b.metric, b.key) for b in bins}
    assert {("ap_quintile", "0-20%"), ("ap_decile", "90-100%"), ("ap_length_bin", "64k-128k"),
            ("ap_length_bin_ruler", "4k"), ("ap_length_bin_ruler", "128k"), ("ap_position_bin", "8k-16k")} <= keys
    ap = np.linspace(0.9, 0.5, 16)
    ap[0] = np.nan
    vals = agg.masked_mean(ap, agg.membership(bins, L, B))
    status = agg.bin_status(bins, L, B, np.isfinite(ap))
    by = {(b.metric, b.key): (v, s) for b, v, s in zip(bins, vals, status, strict=True)}
    tau = (np.arange(16) + 0.5) * B
    # ruler X matches (X/2, X]: 32k -> tau in (16384, 32768] = buckets 2, 3
    assert by[("ap_length_bin_ruler", "32k")][0] == pytest.approx(ap[[2, 3]].mean())
    assert by[("ap_length_bin_ruler", "4k")] == (pytest.approx(np.nan, nan_ok=True), "narrower_than_bucket")
    assert by[("ap_length_bin_ruler", "8k")][1] == "narrower_than_bucket"
    assert by[("ap_length_bin", "0-8k")][1] == "no_usable_bucket"  # only bucket 0, which has no value
    assert by[("ap_length_bin", "64k-128k")][0] == pytest.approx(ap[(tau >= 65536)].mean())
    assert by[("ap_decile", "0-10%")][0] == pytest.approx(ap[1])  # tau 4096 (no value), 12288
    # a bin that holds no bucket at all
    odd = agg.all_bins(4096, 256, opts.with_(length_bin_edges=(0, 8192, 16384)))
    st = agg.bin_status(odd, 4096, 256, np.ones(16, bool))
    assert dict(zip([(b.metric, b.key) for b in odd], st, strict=True))[("ap_length_bin", "8k-16k")] == "no_bucket"
    assert [agg.fmt_tokens(x) for x in (0, 256, 512, 1024, 1536, 8192, 49152, 131072)] == [
        "0", "256", "512", "1k", "1.5k", "8k", "48k", "128k"]
    assert opts.resolved_position_edges(4096, 256) == (0, 256, 512, 1024, 2048, 4096)


# ---- SPEC 4.6 bootstrap --------------------------------------------------------------------------------
def test_bootstrap_matrix_equals_naive_document_resampling() -> None:
    rng = np.random.default_rng(14)
    n_docs, J = 9, 5
    doc = rng.integers(0, n_docs, 300)
    bucket = rng.integers(1, J, 300)
    pp = rng.random(300)
    W = doc_weights(n_docs, 40, seed=3)
    assert np.all(W.sum(axis=1) == n_docs)
    S, N = doc_bucket_sums(doc, bucket, pp, n_docs, J)
    fast = resampled_profiles(W, S, N)
    for r in range(40):
        chosen = np.repeat(np.arange(n_docs), W[r].astype(int))  # the resample, documents with multiplicity
        sel = np.concatenate([np.flatnonzero(doc == d_) for d_ in chosen])
        for j in range(J):
            vals = pp[sel][bucket[sel] == j]
            if vals.size:
                assert fast[r, j] == pytest.approx(vals.mean(), rel=1e-12)
            else:
                assert np.isnan(fast[r, j])


def test_bootstrap_standard_error_matches_resampling_new_documents() -> None:
    """Query model fixed; the spread of AP_overall over freshly drawn key documents ~ bootstrap SE."""
    rng = np.random.default_rng(15)
    d, L, B, n_docs = 8, 2048, 128, 60
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    base = planted_head(d=d, L=L, B=B, a=0.3 * u, b=1.5 * u / L, Sigma=np.eye(d), q_per_bucket=40, n_docs=n_docs,
                        key_drift=1.5 * u / L, key_sd=0.8, rng=rng)
    opts = PlasticityOptions(pairs_per_bucket=10_000, bootstrap=200)  # every eligible pair: docs are the only noise

    def with_new_keys(r: np.random.Generator) -> HeadData:
        k = np.outer(base.k_pos, 1.5 * u / L) + 0.8 * r.standard_normal(base.k.shape)
        return HeadData(0, 0, 0, base.q, base.q_pos, base.q_doc, k, base.k_pos, base.k_doc, L, B)

    values = [analyse_head(with_new_keys(rng), opts.with_(bootstrap=0)).row["ap_overall"] for _ in range(120)]
    true_sd = float(np.std(values, ddof=1))
    boot_sd = []
    for _ in range(4):
        res = analyse_head(with_new_keys(rng), opts)
        boot_sd.append(float(np.nanstd(agg.headline(res.boot, L, B)["ap_overall"], ddof=1)))
    ratio = np.mean(boot_sd) / true_sd
    assert 0.7 < ratio < 1.4, (np.mean(boot_sd), true_sd)


# ---- SPEC 4.7 heatmap ---------------------------------------------------------------------------------
def test_heatmap_cells_by_hand() -> None:
    hm = HeatmapAccumulator(L=64, width=16)
    t_i = np.array([0, 2, 20, 0])
    t_j = np.array([10, 12, 40, 4])
    tau = np.array([56.0, 56.0, 56.0, 24.0])
    pp = np.array([0.2, 0.4, 0.9, np.nan])
    hm.add(t_i, t_j, tau, pp, np.array([0.1, 0.3, 0.8, 0.5]))
    df = hm.frame().set_index(["x_lo_tokens", "y_lo_tokens"])
    # pairs 1-2: x = 10, y = 56 - 5 = 51, 56 - 7 = 49 -> cell (0, 48); pair 3: x = 20, y = 26 -> (16, 16)
    assert df.loc[(0, 48), "n_pairs"] == 2 and df.loc[(0, 48), "pp_mean"] == pytest.approx(0.3)
    assert df.loc[(0, 48), "pp_empirical_mean"] == pytest.approx(0.2)
    assert df.loc[(16, 16), "pp_mean"] == pytest.approx(0.9)
    assert len(df) == 2  # the NaN pair is left out; empty cells are absent
    grid, count = hm.grid()
    assert np.isnan(grid[0, 0]) and count.sum() == 3


# ---- SPEC 4, bad input ------------------------------------------------------------------------------------
def test_bad_buckets_are_reported_never_silent() -> None:
    rng = np.random.default_rng(16)
    d, L, B = 4, 512, 64
    q_pos = np.concatenate([rng.integers(j * B, (j + 1) * B, 30) for j in range(8) if j != 5])  # bucket 5 empty
    q_pos[(q_pos // B) == 6] = 6 * B + 3
    q = rng.standard_normal((len(q_pos), d)) + np.outer(q_pos, np.ones(d) / L)
    q[(q_pos // B) == 6] = 1.0  # bucket 6: identical queries at one position -> zero detrended covariance
    # keys: bucket 0-1 one key per document (no pair for bucket 1), then more
    k_doc = np.repeat(np.arange(6), 8)
    k_pos = np.tile(np.arange(8) * B + 5, 6)
    k = rng.standard_normal((48, d))
    k[k_pos // B == 2] = k[k_pos // B == 1]  # buckets 1 and 2 hold identical keys per doc
    k = k.copy()
    head = HeadData(0, 0, 0, q, q_pos, np.zeros(len(q_pos), int), k, k_pos, k_doc, L, B)
    res = analyse_head(head, PlasticityOptions(bootstrap=20, min_queries_per_bucket=5))
    st = res.profile["status"].tolist()
    assert st[0] == "first_bucket"
    assert st[1] == "no_eligible_pairs"
    assert st[5] == "too_few_queries"
    assert st[6] == "degenerate_covariance"
    assert st[7] == "ok"
    for j in range(8):
        assert np.isnan(res.ap[j]) == (st[j] != "ok")
    assert res.row["n_buckets_too_few_queries"] == 1 and res.row["n_buckets_degenerate_covariance"] == 1
    assert np.isfinite(res.row["ap_overall"]) and res.row["status"] == "ok"
    # keys identical across buckets 1/2 of a document: those pairs have delta = 0 and are skipped
    assert res.profile.loc[3, "n_pairs"] < res.profile.loc[3, "n_pairs_sampled"]
    missing = res.bins[res.bins["value"].isna()]
    assert (missing["status"] != "ok").all()


def test_head_with_no_usable_bucket_and_unfit_queries() -> None:
    d, L, B = 3, 256, 32
    rng = np.random.default_rng(17)
    q_pos = rng.integers(0, L, 200)
    head = HeadData(0, 0, 0, rng.standard_normal((200, d)), q_pos, np.zeros(200, int), rng.standard_normal((8, d)),
                    np.arange(8) * B, np.arange(8), L, B)  # one key per document: no pair anywhere
    res = analyse_head(head, PlasticityOptions(bootstrap=10))
    assert res.row["status"] == "no_usable_bucket" and np.isnan(res.row["ap_overall"])
    assert set(res.profile["status"]) == {"first_bucket", "no_eligible_pairs"}
    one_pos = HeadData(0, 0, 0, rng.standard_normal((50, d)), np.full(50, 7), np.zeros(50, int),
                       rng.standard_normal((8, d)), np.arange(8) * B, np.zeros(8, int), L, B)
    bad = analyse_head(one_pos, PlasticityOptions(bootstrap=10))
    assert bad.row["status"].startswith("query_model_failed")


def test_options_from_registry_analysis_table() -> None:
    opts = resolve_options("plasticity", {"plasticity": {"pairs_per_bucket": 64, "length_bin_edges": [0, 4096, 8192]},
                                          "pca": {"n_components": 4}})
    assert opts.pairs_per_bucket == 64 and opts.length_bin_edges == (0, 4096, 8192)
    assert resolve_options("plasticity", None) == PlasticityOptions()
    rec = opts.record(4096, 256)
    assert rec["L"] == 4096 and rec["B"] == 256 and rec["n_buckets"] == 16 and rec["heatmap_bin"] == 256
    with pytest.raises(PlasticityOptionsError, match="unknown plasticity options"):
        resolve_options("plasticity", {"plasticity": {"pairs": 3}})
    with pytest.raises(PlasticityOptionsError, match="covariance"):
        PlasticityOptions(covariance="banded")


# ---- SPEC 4.5-4.6 model level -----------------------------------------------------------------------
def test_model_level_interval_equals_naive_resampling_of_every_head() -> None:
    """Model metric lo/hi: percentiles over resamples of the mean over heads, each head's AP_overall
    recomputed from its per-pair records of the resampled documents (independent of the matrix path)."""
    from qk_core.plasticity import analyse_model

    heads = {}
    for h in range(3):
        x = _drift_head(1.0 + h, seed=20 + h)
        heads[(0, h)] = HeadData(0, h, 0, x.q, x.q_pos, x.q_doc, x.k, x.k_pos, x.k_doc, x.window, x.bucket)
    L, B = 4096, 256
    opts = PlasticityOptions(pairs_per_bucket=64, bootstrap=40, seed=5, interval="percentile")  # the bootstrap rule
    docs = np.arange(80)
    res = analyse_model("m", list(heads), lambda layer, h: heads[(layer, h)], docs, L, B, opts)
    W = doc_weights(len(docs), 40, 5)
    pairs = res.pairs[res.pairs["valid"]]
    weights = agg.bucket_weights(L, B)
    model_boot = []
    for r in range(40):
        per_head = []
        for _key, grp in pairs.groupby(["layer", "q_head"]):
            w = W[r][grp["example_id"].to_numpy()]
            ap = np.full(L // B, np.nan)
            for j, g in grp.assign(w=w).groupby("bucket"):
                if g["w"].sum() > 0:
                    ap[j] = (g["pp"].astype(float) * g["w"]).sum() / g["w"].sum()
            have = np.isfinite(ap)
            per_head.append((ap[have] * weights[have]).sum() / weights[have].sum())
        model_boot.append(np.mean(per_head))
    row = res.metrics.set_index(["metric", "key"]).loc[("ap_overall", "")]
    lo, hi = np.percentile(model_boot, [2.5, 97.5])
    assert row["lo"] == pytest.approx(lo, abs=2e-6) and row["hi"] == pytest.approx(hi, abs=2e-6)  # float32 PP
    assert row["value"] == pytest.approx(res.heads["ap_overall"].mean(), rel=1e-12)
    assert row["n_heads"] == 3


def test_empirical_estimator_intervals_equal_naive_resampling_with_the_same_weights() -> None:
    """SPEC 4.6: the empirical AP gets its intervals from the same document resamples. Reference: each
    head's empirical AP_overall / AP_drop recomputed per resample from its per-pair PP_empirical records,
    weighting each pair by its document's multiplicity (no matrix path), then percentiles."""
    from qk_core.plasticity import analyse_model

    heads = {}
    for h in range(2):
        x = _drift_head(1.5 + h, seed=40 + h)
        heads[(0, h)] = HeadData(0, h, 0, x.q, x.q_pos, x.q_doc, x.k, x.k_pos, x.k_doc, x.window, x.bucket)
    L, B = 4096, 256
    opts = PlasticityOptions(pairs_per_bucket=64, bootstrap=30, seed=7, interval="percentile")  # the bootstrap rule
    docs = np.arange(80)
    res = analyse_model("m", list(heads), lambda layer, h: heads[(layer, h)], docs, L, B, opts)
    W = doc_weights(len(docs), 30, 7)
    pairs = res.pairs[res.pairs["valid"]]
    tau = agg.bucket_tau(L, B)
    weights = agg.bucket_weights(L, B)
    model_boot = {"ap_overall": [], "ap_drop": []}
    per_head_boot: dict[int, dict[str, list[float]]] = {h: {"ap_overall": [], "ap_drop": []} for h in range(2)}
    for r in range(30):
        vals = {"ap_overall": [], "ap_drop": []}
        for (_, h), grp in pairs.groupby(["layer", "q_head"]):
            w = W[r][grp["example_id"].to_numpy()]
            ap = np.full(L // B, np.nan)
            for j, g in grp.assign(w=w).groupby("bucket"):
                if g["w"].sum() > 0:
                    ap[j] = (g["pp_empirical"].astype(float) * g["w"]).sum() / g["w"].sum()
            have = np.isfinite(ap)
            overall = (ap[have] * weights[have]).sum() / weights[have].sum()
            first = np.nanmean(ap[tau < 0.2 * L])
            last = np.nanmean(ap[tau >= 0.8 * L])
            for name, v in (("ap_overall", overall), ("ap_drop", first - last)):
                vals[name].append(v)
                per_head_boot[h][name].append(v)
        for name in vals:
            model_boot[name].append(np.mean(vals[name]))
    m = res.metrics.set_index(["metric", "key"])
    for name in ("ap_overall", "ap_drop"):
        lo, hi = np.percentile(model_boot[name], [2.5, 97.5])
        row = m.loc[(f"{name}_empirical", "")]
        assert row["lo"] == pytest.approx(lo, abs=2e-6) and row["hi"] == pytest.approx(hi, abs=2e-6)
        assert row["lo"] <= row["value"] <= row["hi"]
        for h in range(2):
            head = res.heads[res.heads["q_head"] == h].iloc[0]
            hlo, hhi = np.percentile(per_head_boot[h][name], [2.5, 97.5])
            assert head[f"{name}_empirical_lo"] == pytest.approx(hlo, abs=2e-6)
            assert head[f"{name}_empirical_hi"] == pytest.approx(hhi, abs=2e-6)
    # the closed-form and empirical intervals differ (different PP values, same resamples)
    assert m.loc[("ap_overall", ""), "lo"] != m.loc[("ap_overall_empirical", ""), "lo"]
