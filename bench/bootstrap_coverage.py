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
from qk_core.stats.bootstrap import doc_weights  # noqa: E402
from qk_core.stats.intervals import basic_interval, bc_interval, percentile_interval  # noqa: E402

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
    ap.add_argument("--demo-storage", default="", help="instead: print z0, bootstrap bias, basic and percentile "
                    "intervals of a finished demo's cross-corpus comparison (storage root, read only)")
    args = ap.parse_args()
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
