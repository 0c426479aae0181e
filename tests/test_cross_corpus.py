"""SPEC 10 on planted data: one model "captured" on two synthetic corpora.

Every head's geometry is planted (tests/synthetic.py): the same axes and parameters on both corpora, with
different documents, positions and noise. With the same geometry the between-corpus differences' intervals
cover 0; with the key drift doubled on the second corpus the bias_strength difference recovers the planted
size (the noise-free SPEC 3 value of :func:`synthetic.expected_rotation`) and AP_overall falls. The real
SPEC 3 and SPEC 4 code produces every input; nothing is mocked.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from synthetic import CloudSpec, HeadSpec, expected_rotation, plant_cloud, random_axes, stratified_positions

from qk_core.capture.store import HeadData
from qk_core.config.options import PlasticityOptions
from qk_core.cross_corpus.compare import (
    CorpusInputs,
    CrossCorpusOptions,
    bias_from_moments,
    compare_corpora,
    doc_moments,
    variance_shares,
)
from qk_core.geometry.driver import run_rotation
from qk_core.geometry.rotation import analyse_rotation
from qk_core.plasticity import analyse_model

D, L, B, PER_BUCKET = 16, 1024, 64, 4
HEADS = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
# the plasticity asset's bootstrap rule, so the reference corpus reproduces its intervals (test below)
POPTS = PlasticityOptions(pairs_per_bucket=96, bootstrap=200, min_queries_per_bucket=8, interval="percentile")


def spec(i: int, drift: float = 1.0) -> HeadSpec:
    """Head i: query offset along a (mu_Q^a) and key drift (alpha_K) that differ between heads."""
    return HeadSpec(q=CloudSpec(m_a=0.8 + 0.4 * i, slope=0.4 / L, m_b=0.6, sigma=1.0),
                    k=CloudSpec(slope=drift * (0.8 + 0.3 * i) / L, m_b=-0.6, sigma=1.0))


def planted_corpus(name: str, seed: int, n_docs: int, drift: float = 1.0) -> tuple[CorpusInputs, dict, dict]:
    """(inputs, heads, plasticity metrics by name) of one synthetic corpus; geometry per head fixed by i."""
    doc_tokens = {1000 * seed + i: L - 29 * i for i in range(n_docs)}
    doc, pos = stratified_positions(doc_tokens, B, PER_BUCKET, seed)
    heads = {}
    for i, (layer, qh) in enumerate(HEADS):
        axes = random_axes(D, 100 + i)  # the same axes on every corpus
        rng = np.random.default_rng([seed, i])
        s = spec(i, drift)
        q, k = plant_cloud(s.q, axes, pos, rng), plant_cloud(s.k, axes, pos, rng)
        heads[(layer, qh)] = HeadData(layer, qh, qh, q, pos.copy(), doc.copy(), k, pos.copy(), doc.copy(), L, B)
    doc_ids = np.array(sorted(doc_tokens), dtype=np.int64)
    res = analyse_model("planted", HEADS, lambda la, h: heads[(la, h)], doc_ids, L, B, POPTS, workers=1)
    rot, _, _, _ = run_rotation("planted", [({"layer": la, "q_head": h}, heads[(la, h)]) for la, h in HEADS])
    metrics = res.metrics.set_index("metric")
    inp = CorpusInputs(name, doc_ids, res.pairs, rot, L, B, lambda la, h: heads[(la, h)])
    return inp, heads, {m: metrics.loc[m] for m in ("ap_overall", "ap_drop")}


@pytest.fixture(scope="module")
def corpora() -> dict:
    return {"prose": planted_corpus("prose", 1, 12), "code": planted_corpus("code", 2, 10),
            "code-drift": planted_corpus("code-drift", 2, 10, drift=2.0)}


def _row(res, kind: str, metric: str, corpus: str) -> pd.Series:
    m = res.metrics
    return m[(m["kind"] == kind) & (m["metric"] == metric) & (m["corpus"] == corpus)].iloc[0]


def test_same_geometry_gives_differences_whose_intervals_cover_zero(corpora: dict) -> None:
    res = compare_corpora("planted", [corpora["prose"][0], corpora["code"][0]], CrossCorpusOptions())
    for metric in ("ap_overall", "ap_drop", "bias_strength"):
        d = _row(res, "difference", metric, "code")
        assert d["lo"] < 0 < d["hi"], (metric, d.to_dict())
        assert d["verdict"] in ("model", "cannot tell") and "difference" in d["statement"]
        # the difference is the difference of the per-corpus model values
        assert d["value"] == pytest.approx(_row(res, "corpus", metric, "code")["value"]
                                           - _row(res, "corpus", metric, "prose")["value"])
    # the same heads stand out on both corpora: the planted per-head bias and drift differ between heads
    corr = res.correlations.set_index("metric")
    assert corr.loc["bias_strength", "spearman_rho"] > 0.8
    assert corr.loc["bias_strength", "spearman_method"] == "exact"  # n = 6 heads: all 720 orderings
    assert corr.loc["bias_strength", "spearman_permutations"] == 720 and corr.loc["bias_strength", "n_heads"] == 6
    assert corr.loc["bias_strength", "share_head"] > 0.8  # the model's, not the text's
    assert set(res.verdicts["scope"]) == {"model value", "per head"}
    # exact p of rho = 1 over 6 heads: 2 of the 720 orderings reach |rho| = 1
    assert "Spearman rho = 1.00 (p = 0.003, exact, n = 6 heads)" in corr.loc["bias_strength", "statement"]


def test_p_clause_never_reads_p_equals_less_than() -> None:
    from qk_core.stats.correlation import METHOD_MC, p_clause

    assert p_clause(1 / 20001, METHOD_MC, 20000) == "p < 1/20000"
    assert p_clause(0.0123) == "p = 0.012"


def test_planted_drift_difference_is_recovered_in_sign_and_size(corpora: dict) -> None:
    prose, _, _ = corpora["prose"]
    drift, _, _ = corpora["code-drift"]
    res = compare_corpora("planted", [prose, drift], CrossCorpusOptions(min_queries_per_bucket=8))
    # planted: alpha_K doubles on the second corpus, so bias_strength = mu_Q^a * alpha_K doubles (SPEC 3)
    expected = {}
    for name, (_, hd, _) in (("prose", corpora["prose"]), ("drift", corpora["code-drift"])):
        expected[name] = np.mean([expected_rotation(spec(i, 2.0 if name == "drift" else 1.0),
                                                    hd[h].q_pos, hd[h].k_pos, D, L)["bias_strength"]
                                  for i, h in enumerate(HEADS)])
    planted = expected["drift"] - expected["prose"]
    d = _row(res, "difference", "bias_strength", "code-drift")
    assert planted > 0 and d["lo"] > 0 and d["verdict"] == "text"
    assert d["lo"] <= planted <= d["hi"], (planted, d.to_dict())
    assert d["value"] == pytest.approx(planted, rel=0.15)
    # more key drift makes key order more positional: plasticity falls (SPEC 4); the calibrated test (jackknife-t,
    # query model refitted: about twice the fixed-model bootstrap's standard error) sees the sign, but with 12 and
    # 10 documents not a significant 2% change; the fixed-model bootstrap's basic interval (the old rule) called it
    ap = _row(res, "difference", "ap_overall", "code-drift")
    assert ap["corrected"] < 0 and ap["value"] < 0 and ap["interval"] == "jackknife_t"
    assert "Test of equality: p = " in ap["statement"] and "calibrated" in ap["statement"]
    old = compare_corpora("planted", [prose, drift], CrossCorpusOptions(interval="basic"))
    ap = _row(old, "difference", "ap_overall", "code-drift")
    assert ap["hi"] < 0 and ap["verdict"] == "text" and "the text moves it" in ap["statement"]


def test_reference_corpus_reproduces_its_plasticity_intervals(corpora: dict) -> None:
    """Stream 0 is the plasticity asset's own resampling: same values, and the percentile interval of the same
    resamples (float32 pairs aside; the reported interval is the basic one, its reflection about the value); the
    second corpus has the same point values and independent resamples."""
    (prose, _, pm), (code, _, cm) = corpora["prose"], corpora["code"]
    res = compare_corpora("planted", [prose, code], CrossCorpusOptions(bootstrap=POPTS.bootstrap, seed=POPTS.seed))
    for metric in ("ap_overall", "ap_drop"):
        ref = _row(res, "corpus", metric, "prose")
        assert ref["value"] == pytest.approx(pm[metric]["value"], abs=1e-6)
        assert (ref["pct_lo"], ref["pct_hi"]) == pytest.approx((pm[metric]["lo"], pm[metric]["hi"]), abs=1e-6)
        assert _row(res, "corpus", metric, "code")["value"] == pytest.approx(cm[metric]["value"], abs=1e-6)
    bias = _row(res, "corpus", "bias_strength", "prose")["value"]
    assert bias == pytest.approx(prose.rotation_heads["bias_strength"].mean(), rel=1e-9)
    assert set(res.profiles["corpus"]) == {"prose", "code"} and res.profiles["ap"].notna().any()


def test_weighted_moments_are_spec3_on_the_resampled_rows(corpora: dict) -> None:
    """bias_strength from per-document sums equals SPEC 3 (analyse_rotation) on the rows themselves, and with
    multiplicities w_d on the rows with each document repeated w_d times (brute force)."""
    inp, heads, _ = corpora["prose"]
    hd = heads[(1, 0)]
    ids = inp.doc_ids
    Mq, Mk = doc_moments(hd.q, hd.q_pos, hd.q_doc, ids), doc_moments(hd.k, hd.k_pos, hd.k_doc, ids)
    ones = np.ones((1, len(ids)))
    rot = analyse_rotation(hd.q, hd.q_pos, hd.q_doc, hd.k, hd.k_pos, hd.k_doc, window=L)
    assert bias_from_moments(ones @ Mq, ones @ Mk)[0] == pytest.approx(rot.bias_strength, rel=1e-9)
    w = np.random.default_rng(3).integers(0, 3, size=len(ids))
    w[0] = 2
    reps = np.repeat(np.arange(len(ids)), w)

    def rows(x, pos, doc):
        parts = [np.flatnonzero(doc == ids[d]) for d in reps]
        idx = np.concatenate(parts)
        new_doc = np.concatenate([np.full(len(p), n) for n, p in enumerate(parts)])  # each copy its own doc
        return x[idx], pos[idx], new_doc

    q, qp, qd = rows(hd.q, hd.q_pos, hd.q_doc)
    k, kp, kd = rows(hd.k, hd.k_pos, hd.k_doc)
    brute = analyse_rotation(q, qp, qd, k, kp, kd, window=L).bias_strength
    assert bias_from_moments(w[None, :] @ Mq, w[None, :] @ Mk)[0] == pytest.approx(brute, rel=1e-9)


def test_variance_shares_of_a_head_plus_corpus_table() -> None:
    head = np.array([0.1, 0.3, 0.5, 0.9])
    x = head[:, None] + np.array([0.0, 0.2])[None, :]  # every head shifted by the same 0.2: no reordering
    s_head, s_corpus, s_rest = variance_shares(x)
    ss_head = 2 * ((head - head.mean()) ** 2).sum()
    ss_corpus = 4 * 2 * 0.1 ** 2
    assert (s_head, s_corpus, s_rest) == pytest.approx((ss_head / (ss_head + ss_corpus),
                                                        ss_corpus / (ss_head + ss_corpus), 0.0), abs=1e-12)
    swapped = np.column_stack([head, head[::-1]])  # the text reverses the head order
    assert variance_shares(swapped)[2] > 0.9


def test_one_corpus_or_missing_results_are_reported_not_compared(corpora: dict) -> None:
    prose = corpora["prose"][0]
    res = compare_corpora("planted", [prose], missing={"code": "plasticity_pairs not materialised"})
    assert res.metrics.empty and res.correlations.empty
    assert res.verdicts["verdict"].tolist() == ["not compared"]
    assert "plasticity_pairs not materialised" in res.verdicts["statement"].iloc[0]
    other = replace(corpora["code"][0], L=2 * L)
    with pytest.raises(ValueError, match="different \\(L, B\\)"):
        compare_corpora("planted", [prose, other])


def test_figures_draw_every_corpus(corpora: dict) -> None:
    from qk_core.plots.cross_corpus import fig_differences, fig_heads, fig_profiles

    res = compare_corpora("planted", [corpora["prose"][0], corpora["code"][0]])
    for fig in (fig_profiles(res.profiles, "planted"), fig_differences(res.metrics, "planted"),
                fig_heads(res.heads, res.correlations, "planted")):
        assert fig.axes and any(ax.has_data() for ax in fig.axes)


def test_report_section_states_every_verdict_with_its_numbers(corpora: dict) -> None:
    import markupsafe

    from qk_core.report.html import ReportInputs, render_report

    res = compare_corpora("planted", [corpora["prose"][0], corpora["code-drift"][0]])
    tables = {"cross_corpus_metrics": {"planted": res.metrics},
              "cross_corpus_correlations": {"planted": res.correlations},
              "cross_corpus_verdicts": {"planted": res.verdicts}}
    page = render_report(ReportInputs(title="t", models=[], tables=tables, figures=[], states=[],
                                      defined_assets=list(tables)))
    section = page.split('id="corpora"', 1)[1].split("</section>", 1)[0]
    assert "planted: how much is the model&#39;s and how much the text&#39;s" in section
    for statement in res.verdicts["statement"]:
        assert str(markupsafe.escape(statement)) in section
    d = _row(res, "difference", "bias_strength", "code-drift")
    assert f'<span class="ci">[{d["lo"]:.4g}, {d["hi"]:.4g}]</span>' in section  # the difference's interval
    assert "code-drift - prose" in section and "Spearman" in section


def test_bc_interval_is_the_resample_quantiles_at_the_shifted_levels() -> None:
    """Efron's BC interval against numpy / scipy.stats directly: z0 = Phi^-1(share below the point), the
    quantiles at Phi(2 z0 -/+ z_0.975); z0 = 0 gives the percentile interval, NaN resamples are left out."""
    from scipy.stats import norm

    from qk_core.stats.intervals import bc_interval, percentile_interval

    rng = np.random.default_rng(7)
    boot = rng.normal(0.0, 1.0, size=(201, 3))
    boot[5, 0] = np.nan
    point = np.array([0.6, np.median(boot[:, 1]), 10.0])  # above most resamples / their median / above all
    bc = bc_interval(boot, point, 0.95)
    col = boot[~np.isnan(boot[:, 0]), 0]
    z0 = norm.ppf(np.mean(col < 0.6))
    assert bc.z0[0] == pytest.approx(z0, rel=1e-12) and z0 > 0.5
    expected = np.quantile(col, norm.cdf([2 * z0 - norm.ppf(0.975), 2 * z0 + norm.ppf(0.975)]))
    assert (bc.lo[0], bc.hi[0]) == pytest.approx(tuple(expected), rel=1e-12)
    assert bc.lo[0] <= 0.6 <= bc.hi[0] and bc.bias[0] == pytest.approx(col.mean() - 0.6, rel=1e-12)
    plo, phi = percentile_interval(boot, 0.95)
    assert bc.z0[1] == 0 and (bc.lo[1], bc.hi[1]) == (plo[1], phi[1])  # the point is the median: no shift
    assert np.isinf(bc.z0[2]) and bc.lo[2] == bc.hi[2] == boot[:, 2].max()  # every resample below the point


def test_bias_strength_interval_covers_the_planted_value_the_percentile_interval_misses(corpora: dict) -> None:
    """The drift axis refitted in every resample biases the bias_strength resamples low (z0 > 0, negative
    bootstrap bias), and the point value is low for the same reason: the plain percentile interval (pct_lo,
    pct_hi; the old rule) lies below the planted value, the basic interval reaches it and holds its point."""
    res = compare_corpora("planted", [corpora["prose"][0], corpora["code"][0], corpora["code-drift"][0]],
                          CrossCorpusOptions(interval="basic"))  # the basic interval's own property
    for name, drift in (("code", 1.0), ("code-drift", 2.0)):
        hd = corpora[name][1]
        planted = np.mean([expected_rotation(spec(i, drift), hd[h].q_pos, hd[h].k_pos, D, L)["bias_strength"]
                           for i, h in enumerate(HEADS)])
        r = _row(res, "corpus", "bias_strength", name)
        assert r["z0"] > 0.5 and r["boot_bias"] < 0 and r["interval"] == "basic", r.to_dict()
        assert r["pct_hi"] < planted, (planted, r.to_dict())  # the percentile interval misses the planted value
        assert r["lo"] <= planted <= r["hi"], (planted, r.to_dict())
        assert (r["lo"], r["hi"]) == pytest.approx((2 * r["value"] - r["pct_hi"], 2 * r["value"] - r["pct_lo"]))
    for r in res.metrics.itertuples():  # every interval holds its own value
        assert r.lo <= r.value <= r.hi, r
    assert json.loads(res.metrics["options"].iloc[0])["interval"] == "basic"


def test_small_coverage_check_basic_beats_percentile_on_planted_bias_strength() -> None:
    """bench/bootstrap_coverage.py in miniature (seeded, 60 planted corpora of the test geometry): the basic
    interval covers the planted bias_strength far more often than the percentile interval of the same
    resamples, and both hold their point value exactly as often (the same condition, |z0| < 1.96)."""
    from planted_bias import Regime, plant, truth

    from qk_core.stats.bootstrap import doc_weights
    from qk_core.stats.intervals import basic_interval, percentile_interval

    r = Regime("test geometry", d=16, docs=12, L=1024, per_bucket=4, heads=6, tau_u=0.0, tau_v=0.0)
    true = truth(r)
    cover = {"basic": 0, "percentile": 0}
    holds = {"basic": 0, "percentile": 0}
    for rep in range(60):
        mom = plant(r, np.random.default_rng([16, rep]))
        W = np.vstack([np.ones((1, r.docs)), doc_weights(r.docs, r.resamples, seed=rep, stream=1)])
        vals = np.mean([bias_from_moments(W @ Mq, W @ Mk) for Mq, Mk in mom], axis=0)
        point, boot = vals[0], vals[1:]
        for name, (lo, hi) in (("basic", basic_interval(boot, point)), ("percentile", percentile_interval(boot))):
            cover[name] += int(lo <= true <= hi)
            holds[name] += int(lo <= point <= hi)
    # measured: 60 and 33 of 60; the first 60 of the bench's 1000 test-geometry repetitions (93.6% vs 52.6%)
    assert cover["basic"] >= 54 and cover["percentile"] <= 42, cover
    assert holds["basic"] == holds["percentile"], holds


def _relabelled(inp: CorpusInputs, seed: int) -> CorpusInputs:
    """The same corpus with its document ids replaced, in the same order, by scattered 62-bit ids (as hashes are)."""
    ids = np.sort(np.random.default_rng(seed).choice(2**62, size=len(inp.doc_ids), replace=False)).astype(np.int64)
    new = dict(zip(inp.doc_ids.tolist(), ids.tolist(), strict=True))
    relabel = np.vectorize(new.__getitem__, otypes=[np.int64])
    heads: dict[tuple[int, int], HeadData] = {}

    def read(layer: int, q_head: int) -> HeadData:
        if (layer, q_head) not in heads:
            hd = inp.read_head(layer, q_head)
            heads[(layer, q_head)] = replace(hd, q_doc=relabel(hd.q_doc), k_doc=relabel(hd.k_doc))
        return heads[(layer, q_head)]

    pairs = inp.pairs.assign(example_id=relabel(inp.pairs["example_id"].to_numpy(np.int64)))
    return replace(inp, doc_ids=ids, pairs=pairs, read_head=read)


def test_hashed_document_ids_give_the_same_comparison(corpora: dict) -> None:
    """Corpus example ids can be 64-bit hashes (the code corpus's are): the refitted jackknife finds each
    pair's keys by (document, position) without overflowing, and ids change nothing but labels."""
    (prose, _, _), (code, _, _) = corpora["prose"], corpora["code"]
    opts = CrossCorpusOptions(bootstrap=50, interval="jackknife_t")
    plain = compare_corpora("planted", [prose, code], opts)
    hashed = compare_corpora("planted", [prose, _relabelled(code, 7)], opts)
    assert plain.metrics["value"].notna().any()
    pd.testing.assert_frame_equal(plain.metrics, hashed.metrics)


def test_options_follow_the_models_plasticity_options() -> None:
    """The asset's and the bench's one mapping: jackknife-t stays jackknife-t, the percentile rule becomes the basic
    bootstrap of the same resamples, and the query model, inflation and thresholds are the plasticity's."""
    p = PlasticityOptions(interval="percentile", covariance="diagonal", interval_inflation=1.5, bootstrap=300, seed=7,
                          ci=0.9, min_queries_per_bucket=5)
    o = CrossCorpusOptions.of_plasticity(p)
    assert (o.interval, o.covariance, o.inflation, o.bootstrap, o.seed, o.ci, o.min_queries_per_bucket) == \
        ("basic", "diagonal", 1.5, 300, 7, 0.9, 5)
    assert CrossCorpusOptions.of_plasticity(PlasticityOptions()).interval == "jackknife_t"
