"""SPEC 4.6 and 10 as revised (issue 24): jackknife-t intervals with the query model refitted, and the calibrated
"text" verdict, checked against formulas and against planted truth (tests/planted_ap.py).

The coverage test is bench/bootstrap_coverage.py --calib in miniature (seeded; the bench's committed results are
in bench/results/bootstrap_coverage.md): the old rules (percentile interval of the document bootstrap with the
query model fixed; basic interval of the between-corpus differences) fail it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.stats
from planted_ap import B, L, ap_truth, plant_heads

from qk_core.config.options import INTERVAL_CALIBRATION, JACKKNIFE_INFLATION, PlasticityOptions
from qk_core.cross_corpus.compare import CorpusInputs, CrossCorpusOptions, ap_loo_refit, compare_corpora
from qk_core.plasticity import analyse_model
from qk_core.plasticity.analysis import analyse_head
from qk_core.plasticity.estimators import closed_form
from qk_core.plasticity.jackknife import loo_profiles
from qk_core.plasticity.query_model import fit_query_model
from qk_core.stats.jackknife import difference, jackknife, jackknife_interval

#: The rule under test; "percentile" runs the same test on the pre-revision rule (it fails).
RULE = "jackknife_t"
ROT = pd.DataFrame({"layer": pd.Series([], dtype="int64"), "q_head": pd.Series([], dtype="int64"),
                    "status": pd.Series([], dtype=object), "bias_strength": pd.Series([], dtype="float64")})


def test_jackknife_of_a_mean_is_the_student_t_interval() -> None:
    """For a sample mean the jackknife is exact: theta_J = mean, se_J = s / sqrt(n), interval = t interval."""
    x = np.random.default_rng(0).normal(3.0, 2.0, 11)
    loo = (x.sum() - x) / (len(x) - 1)
    est = jackknife(x.mean(), loo)
    assert est.corrected == pytest.approx(x.mean()) and est.se == pytest.approx(x.std(ddof=1) / np.sqrt(11))
    lo, hi = jackknife_interval(est, 0.95)
    assert (lo, hi) == pytest.approx(scipy.stats.t.interval(0.95, 10, loc=x.mean(), scale=est.se))
    # a biased statistic: x mean squared; the jackknife removes the O(1/n) bias s^2 / n exactly
    est2 = jackknife(x.mean() ** 2, loo**2)
    assert est2.corrected == pytest.approx(x.mean() ** 2 - x.var(ddof=1) / 11)


def test_difference_is_welch() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.normal(0, 1, 9), rng.normal(0.5, 2, 14)
    ja = jackknife(a.mean(), (a.sum() - a) / 8)
    jb = jackknife(b.mean(), (b.sum() - b) / 13)
    d = difference(ja, jb, 0.95)
    ref = scipy.stats.ttest_ind(b, a, equal_var=False)
    assert d.p == pytest.approx(ref.pvalue) and d.t == pytest.approx(ref.statistic)
    assert d.value == pytest.approx(b.mean() - a.mean())


def test_leave_one_out_refits_the_query_model() -> None:
    """A left-out document's profile equals the SPEC 4.1 model fitted without it, applied to the other documents'
    pairs (4.3); the cross-corpus path (pairs table + capture rows) gives the analysis's own leave-one-out values."""
    doc_ids, heads = plant_heads(5, 3, heads=1)
    hd = heads[(0, 0)]
    opts = PlasticityOptions(pairs_per_bucket=32, bootstrap=2, min_queries_per_bucket=8)
    res = analyse_head(hd, opts, doc_ids)
    assert analyse_head(hd, opts.with_(bootstrap=0), doc_ids).loo is None  # bootstrap 0: no intervals at all
    pr = res.pairs[res.pairs["valid"]]
    d = 2
    keep = hd.q_doc != d
    model = fit_query_model(hd.q[keep], hd.q_pos[keep], L, B, "full", 8)
    key = {(int(a), int(b)): r for r, (a, b) in enumerate(zip(hd.k_doc, hd.k_pos, strict=True))}
    for j in (1, 7, 15):
        sel = pr[(pr["bucket"] == j) & (pr["example_id"] != d)]
        ki = np.array([key[(e, t)] for e, t in zip(sel["example_id"], sel["t_i"], strict=True)])
        kj = np.array([key[(e, t)] for e, t in zip(sel["example_id"], sel["t_j"], strict=True)])
        cf = closed_form(model, j, np.subtract(hd.k[ki], hd.k[kj], dtype=np.float64))
        assert res.loo[d, j] == pytest.approx(cf.pp[cf.valid].mean(), rel=1e-9)
    # the default (per-document sums of q . delta) equals refitting the model document by document
    sel = pr[pr["bucket"] > 0]
    ki = np.array([key[(e, t)] for e, t in zip(sel["example_id"], sel["t_i"], strict=True)])
    kj = np.array([key[(e, t)] for e, t in zip(sel["example_id"], sel["t_j"], strict=True)])
    qb = np.clip(hd.q_pos // B, 0, L // B - 1)
    o = np.argsort(qb, kind="stable")
    args = (hd.q[o], hd.q_pos[o].astype(np.float64), hd.q_doc[o].astype(np.int64), np.bincount(qb, minlength=L // B),
            L, B, "full", 8, sel["bucket"].to_numpy(np.int64), np.subtract(hd.k[ki], hd.k[kj], dtype=np.float64),
            sel["example_id"].to_numpy(np.int64), len(doc_ids))
    fast, loop = loo_profiles(*args), loo_profiles(*args, refit_loop=True)
    np.testing.assert_allclose(fast.closed, loop.closed, rtol=1e-9)
    np.testing.assert_array_equal(fast.empirical, loop.empirical)
    # the empirical profile without document d, by brute force: the other documents' queries of bucket j score
    # the other documents' pairs of bucket j (float32 products, as SPEC 4.3's p_hat)
    q_s, qdoc_s, qb_s, dl = args[0], args[2], qb[o], args[9]
    for d in (0, 3):
        for j in (1, 7, 15):
            pj = (args[8] == j) & (args[10] != d)
            qj = q_s[(qb_s == j) & (qdoc_s != d)].astype(np.float32)
            p_hat = ((qj @ dl[pj].astype(np.float32).T) > 0).mean(axis=0)
            assert fast.empirical[d, j] == pytest.approx(float((4 * p_hat * (1 - p_hat)).mean()), rel=1e-12)
    np.testing.assert_allclose(fast.closed, res.loo, rtol=1e-9)
    inp = CorpusInputs("x", doc_ids, res.pairs.assign(layer=0, q_head=0), ROT, L, B, lambda la, h: hd)
    via_pairs = ap_loo_refit(inp, [(0, 0)], doc_ids, CrossCorpusOptions(min_queries_per_bucket=8))[0]
    np.testing.assert_allclose(via_pairs, res.loo, rtol=1e-6)


def _planted(n_docs: int, seed: int, rule: str) -> tuple[pd.DataFrame, CorpusInputs]:
    doc_ids, heads = plant_heads(n_docs, seed)
    opts = PlasticityOptions(pairs_per_bucket=64, bootstrap=200, min_queries_per_bucket=8, interval=rule)
    res = analyse_model("planted", list(heads), lambda la, h: heads[(la, h)], doc_ids, L, B, opts, workers=1)
    return res.metrics.set_index("metric"), CorpusInputs(f"c{seed}", doc_ids, res.pairs, ROT, L, B,
                                                         lambda la, h: heads[(la, h)])


@pytest.mark.slow
def test_small_coverage_and_false_text_rate_on_planted_worlds() -> None:
    """8 documents per corpus, 10 seeded pairs of corpora with identical geometry: the model-level 95% interval
    of AP_overall covers the planted value (the old rule: it sits below it, the query model's bias) and the
    AP_overall difference is never called the text's beyond what a 5% test allows."""
    truth = ap_truth()["closed"]["ap_overall"]
    hits, text = [], []
    cross = CrossCorpusOptions(interval="jackknife_t" if RULE == "jackknife_t" else "basic", min_queries_per_bucket=8)
    for rep in range(10):
        (ma, ia), (mb, ib) = _planted(8, 5000 + rep, RULE), _planted(8, 6000 + rep, RULE)
        for m in (ma, mb):
            hits.append(m.loc["ap_overall", "lo"] <= truth <= m.loc["ap_overall", "hi"])
        res = compare_corpora("planted", [ia, ib], cross)
        row = res.metrics[(res.metrics["kind"] == "difference") & (res.metrics["metric"] == "ap_overall")].iloc[0]
        text.append(row["verdict"] == "text")
    assert np.mean(hits) >= 0.85, (np.mean(hits), hits)
    assert np.sum(text) <= 1, text


def test_outputs_record_the_rule_and_the_calibration_they_rest_on() -> None:
    """The default inflation is the one bench/results/bootstrap_coverage.json chose on its calibration seeds, and
    every plasticity and cross-corpus options record names the rule and that calibration (SPEC 4.6, 10)."""
    calib = json.loads((Path(__file__).resolve().parent.parent / "bench/results/bootstrap_coverage.json")
                       .read_text())["calib"]
    assert calib["inflation"] == JACKKNIFE_INFLATION == PlasticityOptions().interval_inflation
    assert calib["seeds"]["calibration"] != calib["seeds"]["report"]
    rec = PlasticityOptions().record(L, B)
    assert rec["interval"] == "jackknife_t" and "jackknife" in rec["interval_rule"]
    assert rec["interval_calibration"] == INTERVAL_CALIBRATION and "bootstrap_coverage" in INTERVAL_CALIBRATION
    cross = CrossCorpusOptions().record()
    assert cross["interval"] == "jackknife_t" and cross["inflation"] == JACKKNIFE_INFLATION
    assert cross["calibration"] == INTERVAL_CALIBRATION
