"""Coverage of the document-bootstrap intervals of bias_strength (SPEC 3, 4.6, 10) on planted data.

Why: bias_strength = mu_Q^a * alpha_K is refitted in every document resample (qk_core.cross_corpus.compare), drift axis
a included; a resample with duplicated documents has a noisier axis, and misalignment shrinks both factors, so
the resamples sit below the point value and a percentile interval can miss its own point estimate. This script
measures, on synthetic Q/K rows with a known drift axis and a known bias_strength, how often each candidate
95% interval covers the true value and how often it excludes its own point estimate:

- ``percentile``: the resamples' 2.5% and 97.5% quantiles (what SPEC 4.6's plasticity intervals use);
- ``basic`` (reverse percentile): [2 theta - q_97.5, 2 theta - q_2.5];
- ``bc``: bias-corrected percentile (Efron 1982), :func:`qk_core.stats.bootstrap.bc_interval`;
- ``bca``: BC with the jackknife (leave one document out) acceleration (Efron 1987); for a difference of two
  independently resampled corpora the acceleration sums both corpora's jackknife terms.

Planted corpora: tests/planted_bias.py (a known drift axis, document effects, and the true bias_strength
(m_a + s_q L / 2) s_k per head, averaged over heads as in the asset). Point values and resamples come from
qk_core's own code (doc_moments, bias_from_moments, doc_weights). Seeded: the same command prints the same
numbers.

    .venv/bin/python bench/bootstrap_coverage.py --reps 1000 --out bench/results/bootstrap_coverage

Results: bench/results/bootstrap_coverage.{json,md} (with `uptime` load; the machine is usually shared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import scipy.special

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # planted_bias: the planted corpora (shared with the tests)

from planted_bias import Regime, plant, truth  # noqa: E402
from synthetic import CloudSpec, HeadSpec, plant_cloud, random_axes, stratified_positions  # noqa: E402

from qk_core.capture.store import HeadData  # noqa: E402
from qk_core.config.options import PlasticityOptions  # noqa: E402
from qk_core.cross_corpus.compare import ap_resamples, bias_from_moments  # noqa: E402
from qk_core.plasticity import aggregates as agg  # noqa: E402
from qk_core.plasticity import analyse_model  # noqa: E402
from qk_core.plasticity.analysis import analyse_head  # noqa: E402
from qk_core.stats.bootstrap import doc_weights  # noqa: E402
from qk_core.stats.intervals import basic_interval, bc_interval, percentile_interval  # noqa: E402
from qk_core.stats.jackknife import difference, jackknife, t_quantile  # noqa: E402

CI = 0.95
METHODS = ("percentile", "basic", "bc", "bca")


def model_values(moments: list[tuple[np.ndarray, np.ndarray]], W: np.ndarray) -> np.ndarray:
    """Mean over heads of bias_strength for every weight row of W."""
    return np.mean([bias_from_moments(W @ Mq, W @ Mk) for Mq, Mk in moments], axis=0)


def jackknife_terms(moments, D: int) -> np.ndarray:
    """U_i = mean of the leave-one-out values - leave-one-out value i (Efron & Tibshirani 1993, 14.15)."""
    jack = model_values(moments, 1.0 - np.eye(D))
    return jack.mean() - jack


def intervals(point: float, boot: np.ndarray, u: np.ndarray) -> dict[str, tuple[float, float]]:
    lo, hi = (float(v) for v in percentile_interval(boot, CI))
    bc = bc_interval(boot, point, CI)
    z0 = float(bc.z0)
    z = scipy.special.ndtri((1 + CI) / 2)
    accel = float((u**3).sum() / (6 * (u**2).sum() ** 1.5)) if (u**2).sum() > 0 else 0.0
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.array([scipy.special.ndtr(z0 + (z0 + zz) / (1 - accel * (z0 + zz))) for zz in (-z, z)])
    if not np.isfinite(q).all():  # |z0| infinite (every resample on one side): BC's levels (0 or 1)
        q = np.array([float(bc.q_lo), float(bc.q_hi)])
    bca = np.quantile(boot[np.isfinite(boot)], q)
    b_lo, b_hi = (float(v) for v in basic_interval(boot, point, CI))
    return {"percentile": (lo, hi), "basic": (b_lo, b_hi), "bc": (float(bc.lo), float(bc.hi)),
            "bca": (float(bca[0]), float(bca[1]))}


def run(r: Regime, reps: int, base: Regime | None, seed: int) -> dict:
    """``reps`` planted corpora (or pairs: ``base`` is the reference corpus, r the other) and their intervals."""
    true = truth(r) - (truth(base) if base else 0.0)
    hits = {m: [] for m in METHODS}
    excl = {m: [] for m in METHODS}
    low = {m: [] for m in METHODS}
    widths = {m: [] for m in METHODS}
    points, z0s, biases, boot_sd = [], [], [], []
    for rep in range(reps):
        rng = np.random.default_rng([seed, rep])
        mom = plant(r, rng)
        W = doc_weights(r.docs, r.resamples, seed=rep, stream=1)
        point = float(model_values(mom, np.ones((1, r.docs)))[0])
        boot = model_values(mom, W)
        u = jackknife_terms(mom, r.docs)
        if base is not None:
            mom0 = plant(base, rng)
            W0 = doc_weights(base.docs, base.resamples, seed=rep, stream=0)
            point -= float(model_values(mom0, np.ones((1, base.docs)))[0])
            boot = boot - model_values(mom0, W0)
            u = np.concatenate([u, -jackknife_terms(mom0, base.docs)])
        ivs = intervals(point, boot, u)
        for m, (lo, hi) in ivs.items():
            hits[m].append(lo <= true <= hi)
            excl[m].append(not lo <= point <= hi)
            low[m].append(hi < true)
            widths[m].append(hi - lo)
        points.append(point)
        z0s.append(float(bc_interval(boot, point, CI).z0))
        biases.append(float(np.nanmean(boot) - point))
        boot_sd.append(float(np.nanstd(boot, ddof=1)))
    points_a = np.array(points)
    scale = abs(true) if true else abs(truth(base))  # a zero difference: relative to the reference's value
    return {
        "regime": r.name, "params": asdict(r), "reference": asdict(base) if base else None, "reps": reps,
        "true": true, "mean_point": float(points_a.mean()),
        "point_bias_rel": float((points_a.mean() - true) / scale),
        "boot_bias_rel": float(np.mean(biases) / scale),
        "sd_point_rel": float(points_a.std(ddof=1) / scale), "mean_boot_sd_rel": float(np.mean(boot_sd) / scale),
        "mean_z0": float(np.mean(np.clip(z0s, -8, 8))),
        "methods": {m: {"coverage": float(np.mean(hits[m])), "excludes_point": float(np.mean(excl[m])),
                        "misses_low": float(np.mean(low[m])),  # interval entirely below the truth
                        "mean_width_rel": float(np.mean(widths[m]) / scale)} for m in METHODS},
    }


# ---- AP_overall / AP_drop (SPEC 4.4-4.6): the real plasticity pipeline on planted heads ------------------------
AP_D, AP_L, AP_B, AP_PER_BUCKET = 16, 1024, 64, 4  # tests/test_cross_corpus.py's planted corpora
AP_HEADS = [(0, 0), (0, 1), (1, 0), (1, 1)]


def ap_corpus(n_docs: int, seed: int, pairs_per_bucket: int) -> tuple[np.ndarray, object]:
    """(doc ids, plasticity_pairs) of a planted corpus: tests/test_cross_corpus.py's heads, SPEC 4 run on them."""
    doc_tokens = {1000 * seed + j: AP_L - 29 * (j % 8) for j in range(n_docs)}
    doc, pos = stratified_positions(doc_tokens, AP_B, AP_PER_BUCKET, seed)
    heads = {}
    for i, (layer, qh) in enumerate(AP_HEADS):
        axes = random_axes(AP_D, 100 + i)
        rng = np.random.default_rng([seed, i])
        spec = HeadSpec(q=CloudSpec(m_a=0.8 + 0.4 * i, slope=0.4 / AP_L, m_b=0.6, sigma=1.0),
                        k=CloudSpec(slope=(0.8 + 0.3 * i) / AP_L, m_b=-0.6, sigma=1.0))
        q, k = plant_cloud(spec.q, axes, pos, rng), plant_cloud(spec.k, axes, pos, rng)
        heads[(layer, qh)] = HeadData(layer, qh, qh, q, pos.copy(), doc.copy(), k, pos.copy(), doc.copy(), AP_L, AP_B)
    doc_ids = np.array(sorted(doc_tokens), dtype=np.int64)
    opts = PlasticityOptions(pairs_per_bucket=pairs_per_bucket, bootstrap=0, min_queries_per_bucket=8)
    res = analyse_model("planted", AP_HEADS, lambda la, h: heads[(la, h)], doc_ids, AP_L, AP_B, opts, workers=1)
    return doc_ids, res.pairs


def ap_values(pairs, doc_ids: np.ndarray, W: np.ndarray) -> dict[str, np.ndarray]:
    """Mean over heads of AP_overall and AP_drop for every weight row of W (qk_core.cross_corpus.compare's rule)."""
    h = agg.headline(ap_resamples(pairs, doc_ids, W, AP_L, AP_B).boot, AP_L, AP_B)
    return {m: np.nanmean(h[m], axis=0) for m in ("ap_overall", "ap_drop")}


def run_ap(reps: int, docs: int, seed: int, truth_docs: int) -> list[dict]:
    """Coverage of AP_overall and AP_drop intervals; truth = the value on one planted corpus of truth_docs
    documents with 64x the pairs (its own sampling error is reported)."""
    t_ids, t_pairs = ap_corpus(truth_docs, seed + 10_000, 96 * 64)
    true = {m: float(v[0]) for m, v in ap_values(t_pairs, t_ids, np.ones((1, len(t_ids)))).items()}
    t_se = {m: float(np.nanstd(v, ddof=1)) for m, v in
            ap_values(t_pairs, t_ids, doc_weights(len(t_ids), 100, seed, stream=2)).items()}
    acc = {m: {"hits": {k: [] for k in METHODS}, "excl": {k: [] for k in METHODS}, "low": {k: [] for k in METHODS},
               "width": {k: [] for k in METHODS}, "points": [], "z0": [], "bias": [], "sd": []} for m in true}
    for rep in range(reps):
        ids, pairs = ap_corpus(docs, seed + rep, 96)
        point = ap_values(pairs, ids, np.ones((1, docs)))
        boot = ap_values(pairs, ids, doc_weights(docs, 200, seed=rep, stream=1))
        jack = ap_values(pairs, ids, 1.0 - np.eye(docs))
        for m, a in acc.items():
            p = float(point[m][0])
            ivs = intervals(p, boot[m], jack[m].mean() - jack[m])
            for k, (lo, hi) in ivs.items():
                a["hits"][k].append(lo <= true[m] <= hi)
                a["excl"][k].append(not lo <= p <= hi)
                a["low"][k].append(hi < true[m])
                a["width"][k].append(hi - lo)
            a["points"].append(p)
            a["z0"].append(float(bc_interval(boot[m], p, CI).z0))
            a["bias"].append(float(np.nanmean(boot[m]) - p))
            a["sd"].append(float(np.nanstd(boot[m], ddof=1)))
    out = []
    for m, a in acc.items():
        pts, scale = np.array(a["points"]), abs(true[m])
        out.append({"regime": f"{m}, test geometry ({docs} docs; truth: {truth_docs} docs, SE {t_se[m]:.2g})",
                    "params": {"docs": docs, "truth_docs": truth_docs, "truth_se": t_se[m]}, "reference": None,
                    "reps": reps, "true": true[m], "mean_point": float(pts.mean()),
                    "point_bias_rel": float((pts.mean() - true[m]) / scale),
                    "boot_bias_rel": float(np.mean(a["bias"]) / scale), "sd_point_rel": float(pts.std(ddof=1) / scale),
                    "mean_boot_sd_rel": float(np.mean(a["sd"]) / scale), "mean_z0": float(np.mean(a["z0"])),
                    "methods": {k: {"coverage": float(np.mean(a["hits"][k])),
                                    "excludes_point": float(np.mean(a["excl"][k])),
                                    "misses_low": float(np.mean(a["low"][k])),
                                    "mean_width_rel": float(np.mean(a["width"][k]) / scale)} for k in METHODS}})
    return out



# ---- issue 24: calibrated intervals and verdicts (SPEC 4.6 and 10 as revised) ---------------------------------
# Planted worlds at the document counts the platform runs with, the demo's sampling (L 2048, B 128, 8 positions per
# bucket and document; tests/test_cross_corpus.py's heads, d 16 for cost, document offsets along the drift axis).
# Truth: the SPEC 4.3 closed form (and p_hat) under the *population* query model, by Monte Carlo over key pairs
# drawn as SPEC 4.2 draws them - computed here from the planted parameters with numpy only, independent of
# qk_core. Per repetition two corpora of identical geometry (A, B): both give single-corpus intervals, B - A a
# difference whose truth is 0 (its "text" verdicts are false positives).
CAL_L, CAL_B, CAL_PB, CAL_D, CAL_HEADS, CAL_PAIRS, CAL_TAU = 2048, 128, 8, 16, 3, 128, 0.3
CAL_DOCS = ("8", "16", "32", "64", "16v8")  # documents per corpus; "16v8": the demo's two corpora (16 vs 8)
CAL_SEEDS = {"calibration": 1_000_000, "report": 2_000_000}  # disjoint seed ranges (never tune and report on one)
QUANTS = ("ap_overall", "ap_first20", "ap_last20", "ap_drop")
ESTIMATORS = ("closed", "empirical")


def cal_head_params(i: int) -> dict[str, float]:
    """Planted head i (tests/test_cross_corpus.py's heads): query / key drift, offsets, noise."""
    return {"m_a": 0.8 + 0.4 * i, "s_q": 0.4 / CAL_L, "m_bq": 0.6, "s_k": (0.8 + 0.3 * i) / CAL_L, "sigma": 1.0}


def cal_truth(n_pairs: int = 100_000, seed: int = 7) -> dict[str, dict[str, float]]:
    """Population AP per quantity and estimator (mean over heads), independent of qk_core (SPEC 4.3-4.5).

    Keys of one document, positions uniform below the query bucket: delta = s_k (t_i - t_j) a + noise_i - noise_j
    (document offsets cancel within a document). Population query model of bucket j: mean (m_a + s_q tau_j) a +
    m_bq b, covariance sigma^2 I + tau_u^2 a a^T. Empirical: p = mean over t in the bucket of
    Phi(mean(t) . delta / sqrt(delta^T S delta)).
    """
    rng = np.random.default_rng(seed)
    J = CAL_L // CAL_B
    tau = (np.arange(J) + 0.5) * CAL_B
    out: dict[str, dict[str, list[float]]] = {e: {q: [] for q in QUANTS} for e in ESTIMATORS}
    for i in range(CAL_HEADS):
        p = cal_head_params(i)
        prof = {e: np.full(J, np.nan) for e in ESTIMATORS}
        for j in range(1, J):
            ti, tj = rng.uniform(0, j * CAL_B, (2, n_pairs))
            delta = p["sigma"] * rng.standard_normal((n_pairs, CAL_D)) * np.sqrt(2.0)
            delta[:, 0] += p["s_k"] * (ti - tj)
            sd = np.sqrt(p["sigma"] ** 2 * (delta**2).sum(axis=1) + CAL_TAU**2 * delta[:, 0] ** 2)
            m = (p["m_a"] + p["s_q"] * tau[j]) * delta[:, 0] + p["m_bq"] * delta[:, 1]
            z = m / sd
            prof["closed"][j] = np.mean(4 * scipy.special.ndtr(z) * scipy.special.ndtr(-z))
            tq = j * CAL_B + (np.arange(16) + 0.5) * CAL_B / 16
            ph = scipy.special.ndtr(((p["m_a"] + p["s_q"] * tq[:, None]) * delta[:, 0] + p["m_bq"] * delta[:, 1])
                                    / sd).mean(axis=0)
            prof["empirical"][j] = np.mean(4 * ph * (1 - ph))
        for e in ESTIMATORS:
            first = prof[e][(tau < 0.2 * CAL_L) & np.isfinite(prof[e])].mean()
            last = prof[e][(tau >= 0.8 * CAL_L) & np.isfinite(prof[e])].mean()
            vals = {"ap_overall": np.nanmean(prof[e]), "ap_first20": first, "ap_last20": last,
                    "ap_drop": first - last}
            for q in QUANTS:
                out[e][q].append(float(vals[q]))
    return {e: {q: float(np.mean(v)) for q, v in d.items()} for e, d in out.items()}


def cal_corpus(n_docs: int, seed: int, stream: int, interval: str) -> dict[str, dict[str, np.ndarray]]:
    """One planted corpus through SPEC 4 (qk_core's analyse_head per head): per estimator and quantity the model
    point value, the (R,) bootstrap resamples (query model fixed; weights of ``stream`` as SPEC 10 draws them)
    and the (D,) leave-one-out values (query model refitted), each the mean over heads."""
    doc_tokens = {j: CAL_L for j in range(n_docs)}
    doc, pos = stratified_positions(doc_tokens, CAL_B, CAL_PB, seed)
    ids = np.arange(n_docs, dtype=np.int64)
    W = doc_weights(n_docs, 200, seed=0, stream=stream)
    opts = PlasticityOptions(pairs_per_bucket=CAL_PAIRS, bootstrap=200, min_queries_per_bucket=8, seed=seed,
                             interval=interval, keep_pairs=False)
    acc: dict[str, dict[str, list[np.ndarray]]] = {k: {e: [] for e in ESTIMATORS} for k in ("point", "boot", "loo")}
    for i in range(CAL_HEADS):
        p = cal_head_params(i)
        axes = random_axes(CAL_D, 100 + i)
        rng = np.random.default_rng([seed, i])
        q = plant_cloud(CloudSpec(m_a=p["m_a"], slope=p["s_q"], m_b=p["m_bq"], sigma=p["sigma"]), axes, pos, rng)
        q += (CAL_TAU * rng.standard_normal(n_docs))[doc][:, None].astype(np.float32) * axes[0][None, :]
        k = plant_cloud(CloudSpec(slope=p["s_k"], m_b=-0.6, sigma=p["sigma"]), axes, pos, rng)
        k += (CAL_TAU * rng.standard_normal(n_docs))[doc][:, None].astype(np.float32) * axes[0][None, :]
        res = analyse_head(HeadData(0, i, i, q, pos.copy(), doc.copy(), k, pos.copy(), doc.copy(), CAL_L, CAL_B),
                           opts, ids, W)
        for e, (pt, bt, lo) in {"closed": (res.ap, res.boot, res.loo),
                                "empirical": (res.ap_empirical, res.boot_empirical, res.loo_empirical)}.items():
            acc["point"][e].append(pt)
            acc["boot"][e].append(bt)
            acc["loo"][e].append(lo if lo is not None else np.full((n_docs, len(pt)), np.nan))
    out: dict[str, dict[str, np.ndarray]] = {}
    for e in ESTIMATORS:
        h = {k: agg.headline(np.stack(acc[k][e]), CAL_L, CAL_B) for k in acc}
        for q in QUANTS:
            out[f"{e}:{q}"] = {k: np.nanmean(h[k][q], axis=0) for k in h}
    return out


def cal_rep(args: tuple[int, int, int]) -> dict[str, Any]:
    """One repetition: corpora A and B (n_docs, n_docs_b documents) of identical geometry, old and new rules'
    intervals and verdicts."""
    n_docs, seed, n_docs_b = args
    t0 = time.monotonic()
    a = cal_corpus(n_docs, seed, 0, "jackknife_t")
    b = cal_corpus(n_docs_b, seed + 500_000, 1, "jackknife_t")
    out: dict[str, Any] = {}
    for key in a:
        res = {}
        for name, c in (("A", a[key]), ("B", b[key])):
            jk = jackknife(c["point"], c["loo"])
            lo, hi = percentile_interval(c["boot"], CI)
            res[name] = {"point": float(c["point"]), "corrected": float(jk.corrected), "se": float(jk.se),
                         "df": float(jk.df), "pct": (float(lo), float(hi))}
        dj = difference(jackknife(a[key]["point"], a[key]["loo"]), jackknife(b[key]["point"], b[key]["loo"]), CI)
        d_point = float(b[key]["point"] - a[key]["point"])
        blo, bhi = basic_interval(b[key]["boot"] - a[key]["boot"], d_point, CI)
        res["diff"] = {"point": d_point, "corrected": float(dj.value), "se": float(dj.se), "df": float(dj.df),
                       "basic": (float(blo), float(bhi))}
        out[key] = res
    print(f"  rep D={n_docs} seed={seed}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    return out


def cal_bias_rep(args: tuple[int, int, int]) -> dict[str, Any]:
    """bias_strength (SPEC 3, 10): planted_bias corpora (demo-like, d 64), two of identical geometry."""
    n_a, seed, n_b = args
    rng = np.random.default_rng([seed, 24])
    res = {}
    ests = []
    for name, stream, n_docs in (("A", 0, n_a), ("B", 1, n_b)):
        r = Regime("calib", docs=n_docs)
        mom = plant(r, rng)
        point = float(model_values(mom, np.ones((1, n_docs)))[0])
        boot = model_values(mom, doc_weights(n_docs, 200, seed=0, stream=stream))
        loo = model_values(mom, 1.0 - np.eye(n_docs))
        jk = jackknife(point, loo)
        ests.append((jk, boot, point))
        b_lo, b_hi = basic_interval(boot, point, CI)
        res[name] = {"point": point, "corrected": float(jk.corrected), "se": float(jk.se), "df": float(jk.df),
                     "basic": (float(b_lo), float(b_hi))}
    dj = difference(ests[0][0], ests[1][0], CI)
    d_point = ests[1][2] - ests[0][2]
    blo, bhi = basic_interval(ests[1][1] - ests[0][1], d_point, CI)
    res["diff"] = {"point": d_point, "corrected": float(dj.value), "se": float(dj.se), "df": float(dj.df),
                   "basic": (float(blo), float(bhi))}
    return {"bias_strength": res}


def cal_counts(label: str) -> tuple[int, int]:
    """'16' -> (16, 16); '16v8' -> (16, 8): the document counts of corpora A and B."""
    a, _, b = label.partition("v")
    return int(a), int(b or a)


def cal_run(docs: tuple[str, ...], reps: int, bias_reps: int, base: int, workers: int) -> dict[str, list[dict]]:
    """Every repetition's numbers per cell (seeds base + 1000 D_A (+ 500 when D_B differs) + rep; half the
    repetitions where a corpus has 64 documents)."""
    import multiprocessing

    tasks, btasks = [], []
    for label in docs:
        a, b = cal_counts(label)
        first = base + 1000 * a + (500 if b != a else 0)
        tasks += [(label, (a, first + rep, b)) for rep in range(reps if max(a, b) < 64 else max(reps // 2, 1))]
        btasks += [(label, (a, first + rep, b)) for rep in range(bias_reps)]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        ap = pool.map(cal_rep, [t for _, t in tasks], chunksize=1)
        bs = pool.map(cal_bias_rep, [t for _, t in btasks], chunksize=4)
    out: dict[str, list[dict]] = {label: [] for label in docs}
    for (label, _), r in zip(tasks + btasks, ap + bs, strict=True):
        out[label].append(r)
    return out


def _hull_hit(c: dict[str, Any], truth_value: float, inflation: float) -> tuple[bool, bool]:
    """(covers the truth, excludes 0) of the jackknife-t interval of one record, extended to hold its point."""
    half = inflation * float(t_quantile(CI, c["df"])) * c["se"]
    lo, hi = min(c["corrected"] - half, c["point"]), max(c["corrected"] + half, c["point"])
    return bool(lo <= truth_value <= hi), bool(lo > 0 or hi < 0)


def cal_ratios(reps: list[dict], truth: dict[str, float]) -> dict[str, dict[str, np.ndarray]]:
    """Per quantity: |corrected - truth| / (t_df se) of the single corpora and of the differences (truth 0): the
    inflation each needs (conservative: the interval's extension to hold its point is ignored here)."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in reps:
        for key, v in r.items():
            o = out.setdefault(key, {"single": [], "diff": []})
            for name in ("A", "B"):
                s = v[name]
                o["single"].append(abs(s["corrected"] - truth[key]) / (t_quantile(CI, s["df"]) * s["se"]))
            d = v["diff"]
            o["diff"].append(abs(d["corrected"]) / (t_quantile(CI, d["df"]) * d["se"]))
    return {k: {s: np.asarray(x, dtype=np.float64) for s, x in v.items()} for k, v in out.items()}


def cal_summary(reps: list[dict], truth: dict[str, float], inflation: float) -> dict[str, dict[str, float]]:
    """Per quantity: coverage old / new, false "text" rate old / new, bias before / after the correction."""
    ratios = cal_ratios(reps, truth)
    out: dict[str, dict[str, float]] = {}
    for key, rr in ratios.items():
        rows = [r[key] for r in reps if key in r]
        old_name = "pct" if "pct" in rows[0]["A"] else "basic"
        singles = [r[n] for r in rows for n in ("A", "B")]
        cov_old = np.mean([s[old_name][0] <= truth[key] <= s[old_name][1] for s in singles])
        fpr_old = np.mean([not r["diff"]["basic"][0] <= 0 <= r["diff"]["basic"][1] for r in rows])
        cov_new = np.mean([_hull_hit(s, truth[key], inflation)[0] for s in singles])
        fpr_new = np.mean([_hull_hit(r["diff"], 0.0, inflation)[1] for r in rows])
        pts = np.array([s["point"] for s in singles])
        cor = np.array([s["corrected"] for s in singles])
        scale = 1.0 if "ap_drop" in key else abs(truth[key])  # AP_drop's truth is near 0: absolute bias
        out[key] = {"n_single": len(singles), "n_diff": len(rows), "truth": truth[key],
                    "coverage_old": float(cov_old), "coverage_new": float(cov_new),
                    "fpr_old": float(fpr_old), "fpr_new": float(fpr_new),
                    "bias_before": float((pts.mean() - truth[key]) / scale),
                    "bias_after": float((cor.mean() - truth[key]) / scale),
                    "bias_se": float(pts.std(ddof=1) / np.sqrt(len(pts)) / scale),
                    "relative": scale != 1.0,
                    "needed_inflation_single": float(np.quantile(rr["single"], CI)),
                    "needed_inflation_diff": float(np.quantile(rr["diff"], CI))}
    return out


def cal_truths() -> dict[str, float]:
    """Truth per table key: AP (closed form, empirical) from :func:`cal_truth`; bias_strength from planted_bias."""
    t = cal_truth()
    out = {f"{e}:{q}": t[e][q] for e in ESTIMATORS for q in QUANTS}
    out["bias_strength"] = truth(Regime("calib"))
    return out


def calib_main(args: argparse.Namespace) -> None:
    """--calib: calibrate the jackknife inflation on the calibration seeds, report on the report seeds."""
    load_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    t0 = time.monotonic()
    truths = cal_truths()
    docs = tuple(args.docs)
    cal = cal_run(docs, args.cal_reps, args.cal_reps * 2, CAL_SEEDS["calibration"], args.workers)
    needed = {D: {k: max(v["needed_inflation_single"], v["needed_inflation_diff"])
                  for k, v in cal_summary(reps, truths, 1.0).items()} for D, reps in cal.items()}
    inflation = max(1.0, max(x for d in needed.values() for x in d.values()))
    inflation = float(np.ceil(inflation * 100) / 100)
    print(f"calibration: {args.cal_reps} reps per count; needed inflation per count and quantity: "
          f"{json.dumps(needed)}; chosen {inflation}", flush=True)
    rep = cal_run(docs, args.reps, args.reps * 2, CAL_SEEDS["report"], args.workers)
    report = {D: cal_summary(reps, truths, inflation) for D, reps in rep.items()}
    report_plain = {D: cal_summary(reps, truths, 1.0) for D, reps in rep.items()}
    wall = time.monotonic() - t0
    load_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    cmd = ("OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/bootstrap_coverage.py --calib "
           f"--docs {' '.join(map(str, docs))} --cal-reps {args.cal_reps} --reps {args.reps} "
           f"--workers {args.workers} --out {args.out}")
    res = {"command": cmd, "uptime_before": load_before, "uptime_after": load_after, "wall_s": wall,
           "cpu_count": os.cpu_count(), "truth": truths, "seeds": CAL_SEEDS, "inflation": inflation,
           "needed_inflation_calibration": needed,
           "world": {"L": CAL_L, "B": CAL_B, "per_bucket": CAL_PB, "d": CAL_D, "heads": CAL_HEADS,
                     "pairs_per_bucket": CAL_PAIRS, "tau_u": CAL_TAU, "bias_strength_regime": asdict(Regime("calib"))},
           "report": report, "report_without_inflation": report_plain}
    print(json.dumps(report, indent=1), flush=True)
    with open("/tmp/bootstrap_coverage_calib_reps.json", "w") as f:  # every repetition, to re-read (not committed)
        json.dump({"calibration": {str(k): v for k, v in cal.items()}, "report": {str(k): v for k, v in rep.items()},
                   "truth": truths}, f)
    if args.out:
        write_calib(res, args.out)


CALIB_END = "<!-- end of the issue 24 section; below: earlier results of this script -->"


def write_calib(res: dict[str, Any], out: str) -> None:
    """The --calib results into ``out``.json (key ``calib``, earlier results kept under ``issue16``) and ``out``.md
    (its own section on top, the earlier text kept below)."""
    jpath, mpath = Path(out + ".json"), Path(out + ".md")
    data = json.loads(jpath.read_text()) if jpath.exists() else {}
    if "results" in data:  # the issue 16 file: keep it whole
        data = {"issue16": data}
    data["calib"] = res
    jpath.write_text(json.dumps(data, indent=1))
    old = mpath.read_text() if mpath.exists() else ""
    old = old.split(CALIB_END, 1)[1].lstrip() if CALIB_END in old else old
    mpath.write_text(calib_markdown(res) + "\n" + CALIB_END + "\n\n" + old)


def calib_markdown(res: dict[str, Any]) -> str:
    """The --calib results as the report reads them."""
    c = res["inflation"]
    lines = ["# Calibrated intervals and verdicts (SPEC 4.6 and 10 as revised; issue 24)", "",
             f"Command: `{res['command']}` (seeded; wall {res['wall_s']:.0f} s, {res['cpu_count']} cores shared "
             f"with other work). Load before: `{res['uptime_before']}`; after: `{res['uptime_after']}`.", "",
             "Planted worlds (independent truth; `cal_truth`): L 2048, B 128, 8 positions per bucket and document "
             f"(the demo's sampling), d {CAL_D}, {CAL_HEADS} heads (tests/test_cross_corpus.py's), "
             f"{CAL_PAIRS} pairs per bucket, query document offsets sd {CAL_TAU} along the drift axis; "
             "bias_strength: tests/planted_bias.py's demo-like regime (d 64). Per repetition two corpora of "
             "identical geometry A and B (cell \"16v8\": A 16 documents, B 8, the demo's two corpora): coverage counts "
             "both (truth = the planted value), the difference B - A has "
             "truth 0, so every \"text\" verdict is a false positive.", "",
             "Old rules: plasticity intervals = percentile of 200 document resamples with the query model fixed; "
             "cross-corpus (bias_strength, differences) = basic interval of the same, \"text\" when it excludes 0. "
             "New rule (`interval = \"jackknife_t\"`): delete-one-document jackknife with the query model refitted, "
             "bias-corrected centre, half-width c * t_(D-1) * se_J (differences: Welch df), \"text\" when "
             f"|diff| > c * t_df * se. Inflation c = **{c}**, calibrated on seeds from "
             f"{res['seeds']['calibration']} (smallest c >= 1 giving >= 95% on every quantity and count there), "
             f"reported on seeds from {res['seeds']['report']}.", "",
             "Monte Carlo standard error: coverage sqrt(p(1-p)/n), n = single intervals (first number of column n: "
             "2.2 points at n = 100 and 3.1 at n = 50 for p = 95%); false \"text\" rate with n = differences (second "
             "number: 3.1 points at n = 50, 4.4 at n = 25 for p = 5%). Coverage c = 1: the jackknife-t rule without "
             "the calibrated inflation (what t_(D-1) alone gives).", "",
             "| docs | quantity | truth | n | coverage old | coverage new | coverage c = 1 | false text old | "
             "false text new | false text c = 1 | bias before | bias after (+/- MC se) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    short: list[str] = []
    for D, rows in res["report"].items():
        for key, v in rows.items():
            v1 = res["report_without_inflation"][D][key]
            fmt = (lambda x: f"{x:+.2%}") if v["relative"] else (lambda x: f"{x:+.4f}")
            lines.append(f"| {D} | {key} | {v['truth']:.4g} | {v['n_single']}/{v['n_diff']} | "
                         f"{v['coverage_old']:.1%} | {v['coverage_new']:.1%} | {v1['coverage_new']:.1%} | "
                         f"{v['fpr_old']:.1%} | {v['fpr_new']:.1%} | {v1['fpr_new']:.1%} | "
                         f"{fmt(v['bias_before'])}{'' if v['relative'] else ' (abs)'} | "
                         f"{fmt(v['bias_after'])} +/- {v['bias_se']:.2g} |")
            if v["coverage_new"] < 0.93:
                short.append(f"{key} at {D} documents: coverage {v['coverage_new']:.1%} "
                             f"({0.95 - v['coverage_new']:.1%} short of 95%)")
            if v["fpr_new"] > 0.05:
                short.append(f"{key} at {D} documents: false \"text\" rate {v['fpr_new']:.1%} "
                             f"({v['fpr_new'] - 0.05:.1%} over 5%)")
    lines += ["", "Still short after the change (coverage < 93% or false-positive rate > 5%): " +
              ("; ".join(short) if short else "none") + "."]
    return "\n".join(lines) + "\n"


def regimes() -> list[tuple[Regime, Regime | None]]:
    test_like = Regime("test geometry (d 16, 12 docs x 64 rows, no document effects)", d=16, docs=12, L=1024,
                       per_bucket=4, heads=6, tau_u=0.0, tau_v=0.0)
    demo = Regime("demo-like (d 64, 16 docs x 128 rows, sigma 1)")
    single = [test_like, demo,
              replace(demo, name="demo-like, 8 docs", docs=8),
              replace(demo, name="demo-like, 32 docs", docs=32),
              replace(demo, name="demo-like, sigma 0.5 (stable axis)", sigma=0.5),
              replace(demo, name="demo-like, sigma 2 (noisy axis)", sigma=2.0),
              replace(demo, name="noisy axis, few rows (d 64, 8 docs x 32 rows, sigma 3)", docs=8, per_bucket=2,
                      sigma=3.0)]
    ref, other = replace(demo, name="16 docs"), replace(demo, docs=8)
    t_ref, t_other = replace(test_like, name="12 docs"), replace(test_like, docs=10)
    pairs = [(replace(t_other, name="difference, test geometry, same geometry (10 vs 12 docs)"), t_ref),
             (replace(t_other, name="difference, test geometry, key drift x2 (10 vs 12 docs)", drift=2.0), t_ref),
             (replace(other, name="difference, demo-like, same geometry (8 vs 16 docs)"), ref),
             (replace(other, name="difference, demo-like, key drift x2 (8 vs 16 docs)", drift=2.0), ref)]
    return [(r, None) for r in single] + pairs


def to_markdown(res: list[dict], cmd: str, load_before: str, load_after: str, wall: float) -> str:
    lines = ["# Coverage of document-bootstrap intervals: bias_strength, its between-corpus differences, AP "
             "(SPEC 3, 4.6, 10; issue 16)", "",
             f"Command: `{cmd}` (seeded; wall {wall:.0f} s). Machine: the shared 2-core development machine, "
             "not quiet (other helpers ran beside it).", "",
             f"Load (`uptime`) before: `{load_before}`; after: `{load_after}`.", "",
             "Nominal level 95%, 200 document resamples per interval (SPEC 4.6 default); truth = the planted "
             "bias_strength (mean over heads); coverage = share of repetitions whose interval holds the truth; "
             "excl. point = share whose interval does not hold its own point estimate; misses low = interval "
             "entirely below the truth; biases, sds and widths relative to |truth| (a zero difference: to the "
             "reference corpus's value); sd(point) = the point values' spread over repetitions, mean boot sd = "
             "the bootstrap's estimate of it. Monte Carlo standard error of a coverage near 95%: 0.7 points with "
             "1000 repetitions, 1.3 with 300. AP rows: the real SPEC 4 pipeline on tests/test_cross_corpus.py's "
             "planted heads, truth = the value on a 400-document corpus with 64x the pairs.", "",
             "Nearest 95% per regime: " + "; ".join(
                 f"{r['regime']}: **{min(METHODS, key=lambda m: abs(r['methods'][m]['coverage'] - CI))}**"
                 for r in res) + ".", "",
             "| regime | reps | point bias | boot bias | sd(point) | mean boot sd | mean z0 | method | coverage "
             "| excl. point | misses low | width |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res:
        first = True
        for m in METHODS:
            s = r["methods"][m]
            head = (f"| {r['regime']} | {r['reps']} | {r['point_bias_rel']:+.1%} | {r['boot_bias_rel']:+.1%} | "
                    f"{r['sd_point_rel']:.1%} | {r['mean_boot_sd_rel']:.1%} | {r['mean_z0']:+.2f} "
                    if first else "| | | | | | | ")
            lines.append(f"{head}| {m} | {s['coverage']:.1%} | {s['excludes_point']:.1%} | {s['misses_low']:.1%} "
                         f"| {s['mean_width_rel']:.1%} |")
            first = False
    return "\n".join(lines) + "\n"


def demo_rows(root: str) -> None:
    """The cross-corpus comparison of every demo model with two corpora, recomputed from a demo's storage."""
    import pandas as pd

    from qk_assets.defs.cross_corpus import load_corpus
    from qk_assets.partitions import registry
    from qk_core.cross_corpus.compare import CrossCorpusOptions, compare_corpora
    from qk_core.io.storage import Storage

    storage = Storage(root)
    for slug, entry in ((m, registry().model(m)) for m in ("gemma3-270m", "smollm2-135m")):
        inputs = [inp for inp, _ in (load_corpus(storage, slug, c) for c in entry.corpora) if inp is not None]
        if len(inputs) < 2:
            print(f"{slug}: fewer than two corpora in {root}")
            continue
        res = compare_corpora(slug, inputs, CrossCorpusOptions())
        cols = ["kind", "corpus", "metric", "value", "lo", "hi", "pct_lo", "pct_hi", "z0", "boot_bias", "verdict"]
        with pd.option_context("display.width", 200):
            print(slug, "\n", res.metrics[cols].to_string(), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--only", type=int, nargs="*", help="indices of the regimes to run (default: all)")
    ap.add_argument("--ap-reps", type=int, default=0, help="also AP_overall / AP_drop: repetitions (0: skip)")
    ap.add_argument("--out", default="")
    ap.add_argument("--calib", action="store_true", help="issue 24: calibrate the jackknife-t rule on planted "
                    "worlds (--cal-reps per count) and report old / new coverage and false 'text' rates (--reps)")
    ap.add_argument("--docs", nargs="*", default=list(CAL_DOCS), help="cells: D (both corpora) or DAvDB")
    ap.add_argument("--cal-reps", type=int, default=60)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--demo-storage", default="", help="instead: print z0, bootstrap bias, basic and percentile "
                    "intervals of a finished demo's cross-corpus comparison (storage root, read only)")
    args = ap.parse_args()
    if args.calib:
        calib_main(args)
        return
    if args.demo_storage:
        demo_rows(args.demo_storage)
        return
    load_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    t0 = time.monotonic()
    res = []
    for i, (r, base) in enumerate(regimes()):
        if args.only and i not in args.only:
            continue
        t1 = time.monotonic()
        out = run(r, args.reps, base, args.seed + i)
        res.append(out)
        cov = ", ".join(f"{m} {s['coverage']:.3f}/{s['excludes_point']:.3f}" for m, s in out["methods"].items())
        print(f"[{i}] {r.name}: point bias {out['point_bias_rel']:+.3f}, boot bias {out['boot_bias_rel']:+.3f}, "
              f"z0 {out['mean_z0']:+.2f}; coverage/excl.point: {cov} ({time.monotonic() - t1:.0f} s)", flush=True)
    if args.ap_reps:
        t1 = time.monotonic()
        for out in run_ap(args.ap_reps, 12, args.seed + 100, 400):
            res.append(out)
            cov = ", ".join(f"{m} {s['coverage']:.3f}/{s['excludes_point']:.3f}" for m, s in out["methods"].items())
            print(f"[AP] {out['regime']}: point bias {out['point_bias_rel']:+.3f}, boot bias "
                  f"{out['boot_bias_rel']:+.3f}, z0 {out['mean_z0']:+.2f}; coverage/excl.point: {cov} "
                  f"({time.monotonic() - t1:.0f} s)", flush=True)
    wall = time.monotonic() - t0
    load_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    if args.out:
        cmd = "PYTHONPATH=. .venv/bin/python bench/bootstrap_coverage.py " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items() if v)
        with open(args.out + ".json", "w") as f:
            json.dump({"command": cmd, "uptime_before": load_before, "uptime_after": load_after, "wall_s": wall,
                       "cpu_count": os.cpu_count(), "results": res}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(to_markdown(res, cmd, load_before, load_after, wall))


if __name__ == "__main__":
    main()
