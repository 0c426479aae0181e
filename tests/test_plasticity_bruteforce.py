"""Plasticity values (SPEC 4.1-4.6) against a plain per-pair reimplementation: same seeds, same pairs.

The reference below is written from the SPEC formulas, one pair and one resample at a time: an OLS fit
per coordinate (``lstsq``), an explicit Householder matrix, rotated bucket means and a Ledoit-Wolf
covariance from the published formula (a loop over observations) of the rotated detrended queries,
delta = H (k_i - k_j) per pair, p = Phi(m / sqrt(v)) from ``erfc`` in both tails, the empirical share
q . delta > 0 in float64, and a bootstrap that rebuilds every resample's pair list from the drawn
documents. Pairs are enumerated as SPEC 4.2 and the pair module's docstring define them (documents in
order, inside a document pair (a, b), a < b, of its keys sorted by position, ordered by b then a) and
drawn with the generator seeded by (seed, layer, head, j). Float64 values must agree to 1e-10 relative,
integers and the pairs exactly, float32 records to their rounding.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from qk_core.capture.store import HeadData
from qk_core.config.options import PlasticityOptions
from qk_core.plasticity import analyse_head, analyse_model
from qk_core.stats.bootstrap import BOOTSTRAP_STREAM

L, B, D, N_DOCS = 2048, 256, 12, 30  # J = 8 buckets; 2 keys per document and bucket
J = L // B
HEADS = [(0, 2), (1, 5)]
# interval "percentile": these brute-force checks re-derive the document bootstrap (the jackknife-t default is
# checked against formulas and planted truth in tests/test_calibration.py); bucket 1: all 30 pairs; later: sampled
OPTS = PlasticityOptions(pairs_per_bucket=40, bootstrap=25, seed=3, interval="percentile")
DOC_IDS = np.arange(500, 500 + N_DOCS, dtype=np.int64)
RTOL = 1e-10


def make_head(layer: int, q_head: int) -> HeadData:
    """Stratified positions (2 distinct per document and bucket) shared by Q and K, drifting correlated
    queries, drifting keys; document 501 repeats a key vector (a zero delta that must be skipped)."""
    rng = np.random.default_rng([5, layer, q_head])
    pos = np.concatenate([np.sort(np.concatenate([j * B + rng.choice(B, 2, replace=False) for j in range(J)]))
                          for _ in range(N_DOCS)]).astype(np.int32)
    doc = np.repeat(DOC_IDS, 2 * J)
    u = rng.standard_normal(D)
    u /= np.linalg.norm(u)
    mix = np.eye(D) + 0.4 * rng.standard_normal((D, D)) / np.sqrt(D)
    drift = np.outer(pos / L, (1.5 + layer) * u)
    q = (0.4 * u + drift + rng.standard_normal((len(pos), D)) @ mix).astype(np.float32)
    k = (0.8 * drift + rng.standard_normal((len(pos), D))).astype(np.float32)
    k[2 * J + 1] = k[2 * J]  # document 501: its two bucket-0 keys are identical
    return HeadData(layer, q_head, q_head // 2, q, pos, doc, k, pos.copy(), doc.copy(), L, B)


# ---- the reference, written plainly -------------------------------------------------------------------
def ledoit_wolf_plain(X: np.ndarray) -> np.ndarray:
    """Ledoit & Wolf (2004): shrink the ML covariance toward (tr S / d) I (loop over observations)."""
    n, d = X.shape
    Xc = X - X.mean(axis=0)
    S = Xc.T @ Xc / n
    nrm = lambda A: float((A * A).sum()) / d  # noqa: E731
    mu = np.trace(S) / d
    d2 = nrm(S - mu * np.eye(d))
    b2 = min(sum(nrm(np.outer(x, x) - S) for x in Xc) / n**2, d2)
    return (b2 / d2) * mu * np.eye(d) + (1 - b2 / d2) * S


def pp_plain(z: float) -> float:
    p, one_minus_p = 0.5 * math.erfc(-z / math.sqrt(2)), 0.5 * math.erfc(z / math.sqrt(2))
    return 4.0 * p * one_minus_p


def eligible_pairs(head: HeadData, j: int) -> list[tuple[int, int]]:
    """Key row pairs (i, j) of one document, both keys in buckets < j, in rank order."""
    out = []
    for d_ in np.unique(head.k_doc):
        rows = [r for r in np.argsort(head.k_pos, kind="stable") if head.k_doc[r] == d_ and head.k_pos[r] // B < j]
        out += [(rows[a], rows[b]) for b in range(len(rows)) for a in range(b)]
    return out


def reference_head(head: HeadData, opts: PlasticityOptions) -> dict:
    q = head.q.astype(np.float64)
    t = head.q_pos.astype(np.float64)
    n, d = q.shape
    (alpha, beta), *_ = np.linalg.lstsq(np.column_stack([np.ones(n), t]), q, rcond=None)
    bhat = beta / np.linalg.norm(beta)
    w = bhat - np.eye(d)[0]
    H = np.eye(d) - 2.0 * np.outer(w, w) / (w @ w)  # H bhat = e1
    assert np.allclose(H @ bhat, np.eye(d)[0])
    alpha_pos, beta_pos = float((H @ alpha)[0]), float(np.linalg.norm(beta))
    rot = q @ H.T
    detrended = (q - alpha - np.outer(t, beta)) @ H.T
    qb = head.q_pos // B
    pairs = []
    ap, ap_emp = np.full(J, np.nan), np.full(J, np.nan)
    for j in range(1, J):
        sel = qb == j
        mean = rot[sel].mean(axis=0)
        mean[0] = alpha_pos + beta_pos * (j + 0.5) * B
        S = ledoit_wolf_plain(detrended[sel])
        cand = eligible_pairs(head, j)
        rng = np.random.default_rng([opts.seed, head.layer, head.q_head, j])
        take = (range(len(cand)) if len(cand) <= opts.pairs_per_bucket
                else np.sort(rng.choice(len(cand), size=opts.pairs_per_bucket, replace=False)))
        pp_j, emp_j = [], []
        for r in take:
            i, k = cand[r]
            raw = head.k[i].astype(np.float64) - head.k[k].astype(np.float64)
            rec = {"doc": int(head.k_doc[i]), "t_i": int(head.k_pos[i]), "t_j": int(head.k_pos[k]), "bucket": j,
                   "valid": bool(np.any(raw != 0))}
            if rec["valid"]:
                delta = H @ raw
                z = float(mean @ delta) / math.sqrt(float(delta @ S @ delta))
                share = float(np.mean(head.q[sel].astype(np.float64) @ raw > 0))
                rec.update(delta_1=float(delta[0]), z=z, pp=pp_plain(z), pp_emp=4 * share * (1 - share))
                pp_j.append(rec["pp"])
                emp_j.append(rec["pp_emp"])
            pairs.append(rec)
        ap[j], ap_emp[j] = np.mean(pp_j), np.mean(emp_j)
    return {"pairs": pairs, "ap": ap, "ap_emp": ap_emp}


def headline_plain(ap: np.ndarray) -> dict[str, float]:
    tau = (np.arange(J) + 0.5) * B
    w = np.minimum(B, L - np.arange(J) * B).astype(float)
    ok = np.isfinite(ap)
    first = ok & (tau < 0.2 * L)
    last = ok & (tau >= 0.8 * L) & (tau <= L)
    vals = {"ap_overall": float((ap[ok] * w[ok]).sum() / w[ok].sum()), "ap_first20": float(ap[first].mean()),
            "ap_last20": float(ap[last].mean())}
    vals["ap_drop"] = vals["ap_first20"] - vals["ap_last20"]
    return vals


def resamples_plain(pairs: list[dict], opts: PlasticityOptions, key: str) -> list[dict[str, float]]:
    """Each resample: draw N_DOCS documents with replacement, pool their pairs (with multiplicity)."""
    draws = np.random.default_rng([opts.seed, BOOTSTRAP_STREAM]).integers(0, N_DOCS, size=(opts.bootstrap, N_DOCS))
    out = []
    for row in draws:
        ap = np.full(J, np.nan)
        for j in range(1, J):
            vals = [p[key] for d_ in row for p in pairs if p["valid"] and p["bucket"] == j and p["doc"] == DOC_IDS[d_]]
            if vals:
                ap[j] = np.mean(vals)
        out.append(headline_plain(ap))
    return out


def interval(samples: list[float], ci: float) -> tuple[float, float]:
    a = 100 * (1 - ci) / 2
    return float(np.percentile(samples, a)), float(np.percentile(samples, 100 - a))


# ---- the comparison ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cases() -> dict:
    heads = {h: make_head(*h) for h in HEADS}
    ref = {h: reference_head(heads[h], OPTS) for h in HEADS}
    for r in ref.values():
        r["boot"] = resamples_plain(r["pairs"], OPTS, "pp")
        r["boot_emp"] = resamples_plain(r["pairs"], OPTS, "pp_emp")
    model = analyse_model("bf", HEADS, lambda la, h: heads[(la, h)], DOC_IDS, L, B, OPTS)
    one = {h: analyse_head(heads[h], OPTS, DOC_IDS) for h in HEADS}
    return {"heads": heads, "ref": ref, "model": model, "one": one}


def test_same_pairs_and_per_pair_values(cases: dict) -> None:
    p = cases["model"].pairs
    for h in HEADS:
        ref = cases["ref"][h]["pairs"]
        got = p[(p["layer"] == h[0]) & (p["q_head"] == h[1])]
        assert len(got) == len(ref)
        for col, key in (("example_id", "doc"), ("t_i", "t_i"), ("t_j", "t_j"), ("bucket", "bucket"),
                         ("valid", "valid")):
            np.testing.assert_array_equal(got[col].to_numpy(), [r[key] for r in ref], err_msg=f"{h} {col}")
        valid = np.array([r["valid"] for r in ref])
        assert not valid.all(), "the planted identical keys must give a skipped pair"
        np.testing.assert_array_equal(got["tau_tokens"], (got["bucket"] + 0.5) * B)
        for col, key in (("delta_1", "delta_1"), ("z", "z"), ("pp", "pp"), ("pp_empirical", "pp_emp")):
            want = np.array([r[key] for r in ref if r["valid"]])
            # float32 records: the float64 value rounded once (one unit in the last place at most)
            np.testing.assert_allclose(got[col].to_numpy(np.float64)[valid], want, rtol=2.0**-23, atol=0,
                                       err_msg=f"{h} {col}")
        assert np.isnan(got["pp"].to_numpy()[~valid]).all() and np.isnan(got["pp_empirical"].to_numpy()[~valid]).all()
        # float64 per-pair PP of the head analysis, and the empirical share as an exact count
        arrays = cases["one"][h].pair_arrays
        np.testing.assert_allclose(arrays["pp"][valid], [r["pp"] for r in ref if r["valid"]], rtol=RTOL, atol=0)
        # p = c / n from an integer count c: the same count gives the same float, exactly
        np.testing.assert_array_equal(arrays["pp_empirical"][valid], [r["pp_emp"] for r in ref if r["valid"]])


def test_profiles_headline_values_and_intervals(cases: dict) -> None:
    res = cases["model"]
    for h in HEADS:
        ref = cases["ref"][h]
        prof = res.profiles[(res.profiles["layer"] == h[0]) & (res.profiles["q_head"] == h[1])]
        np.testing.assert_allclose(prof["ap"], ref["ap"], rtol=RTOL, atol=0, equal_nan=True)
        np.testing.assert_allclose(prof["ap_empirical"], ref["ap_emp"], rtol=RTOL, atol=0, equal_nan=True)
        row = res.heads[(res.heads["layer"] == h[0]) & (res.heads["q_head"] == h[1])].iloc[0]
        point, point_emp = headline_plain(ref["ap"]), headline_plain(ref["ap_emp"])
        for name in point:
            assert row[name] == pytest.approx(point[name], rel=RTOL), name
            assert row[f"{name}_empirical"] == pytest.approx(point_emp[name], rel=RTOL), name
            for suffix, boot in (("", ref["boot"]), ("_empirical", ref["boot_emp"])):
                lo, hi = interval([b[name] for b in boot], OPTS.ci)
                assert row[f"{name}{suffix}_lo"] == pytest.approx(lo, rel=RTOL), (h, name, suffix)
                assert row[f"{name}{suffix}_hi"] == pytest.approx(hi, rel=RTOL), (h, name, suffix)
        assert int(row["n_pairs"]) == sum(r["valid"] for r in ref["pairs"])


def test_model_values_are_means_over_heads_with_resampled_intervals(cases: dict) -> None:
    m = cases["model"].metrics.set_index(["metric", "key"])
    refs = [cases["ref"][h] for h in HEADS]
    for name in ("ap_overall", "ap_first20", "ap_last20", "ap_drop"):
        per_head = [headline_plain(r["ap"])[name] for r in refs]
        row = m.loc[(name, "")]
        assert row["value"] == pytest.approx(np.mean(per_head), rel=RTOL)
        assert row["median"] == pytest.approx(np.median(per_head), rel=RTOL)
        lo, hi = interval([np.mean([r["boot"][k][name] for r in refs]) for k in range(OPTS.bootstrap)], OPTS.ci)
        assert row["lo"] == pytest.approx(lo, rel=RTOL) and row["hi"] == pytest.approx(hi, rel=RTOL), name
