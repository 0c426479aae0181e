"""The report's layout: findings first, then the paper figures, provenance last (issue 26.1).

A page rendered from realistic tables (two measured models, the cross-corpus and intervention verdicts, the
benchmark statistics, twenty reference models, a wide heatmap) is checked as a reader sees it: the builder's
content and order without a browser, then headless Chromium at 1440 x 900 measures where the first finding and
the first figure sit, that the table of contents stays in view, and that no table or figure is cut at the right.
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from chromium import probe_page

from qk_core.io.metrics import metric_row, metrics_frame
from qk_core.report.findings import build_findings
from qk_core.report.html import Figure, ReportInputs, render_report

MODELS = ["smollm2-135m", "gemma3-270m"]
REFERENCE = [f"ref-model-{i:02d}" for i in range(20)]
WIDTH, HEIGHT = 1440, 900


def model_report() -> pd.DataFrame:
    rows = []
    for i, model in enumerate(MODELS):
        rng = np.random.default_rng(i)
        for metric, unit, lo, hi in (("ap_overall", "AP", 0.58, 0.62), ("ap_drop", "AP", 0.07, 0.11),
                                     ("bias_strength", "per token", np.nan, np.nan),
                                     ("abs_r_k_a", "correlation", np.nan, np.nan)):
            rows.append(metric_row(model, metric, rng.uniform(0.5, 0.7, 12), unit=unit, options={"L": 2048},
                                   lo=lo, hi=hi))
    df = metrics_frame(rows).assign(value_source="measured")
    ref = metrics_frame([metric_row(m, "ap_overall", [0.55], unit="AP", options={}) for m in REFERENCE])
    return pd.concat([df, ref.assign(value_source="reference", n_heads=0)], ignore_index=True)


def cross_corpus(model: str) -> dict[str, pd.DataFrame]:
    verdicts = pd.DataFrame({
        "model": model, "scope": ["model value", "per head"], "metric": ["ap_drop", "ap_overall"],
        "corpus": "code-demo", "reference": "sotu-demo", "verdict": ["text", "same heads"],
        "statement": ["ap_drop: the text moves it.", "Per head: the same heads."]})
    metrics = pd.DataFrame({"model": model, "kind": "difference", "corpus": "code-demo", "reference": "sotu-demo",
                            "metric": ["ap_drop"], "unit": "AP", "value": [-0.0342], "lo": [-0.0577],
                            "hi": [-0.0045], "verdict": "text"})
    corr = pd.DataFrame({"model": model, "metric": ["ap_overall"], "corpus": "code-demo", "reference": "sotu-demo",
                         "n_heads": [270], "spearman_rho": [0.904], "spearman_p": [1 / 20001],
                         "spearman_method": "monte carlo", "spearman_permutations": [20000],
                         "share_head": [0.95], "share_corpus": [0.0], "share_rest": [0.05]})
    return {"cross_corpus_verdicts": verdicts, "cross_corpus_metrics": metrics, "cross_corpus_correlations": corr}


def intervention_verdicts() -> pd.DataFrame:
    return pd.DataFrame({
        "hypothesis": ["H2: removing bias raises distant plasticity (AP_last20)", ""],
        "intervention": ["debias", ""], "k": [40, 0], "estimate": [0.0511, np.nan], "lo": [0.0348, np.nan],
        "hi": [0.0673, np.nan], "unit": ["AP (debias - baseline)", ""], "evidence": "",
        "verdict": ["supported", "not run"], "statement": ["debias raises AP_last20.", "not run on code-demo"]})


def benchmark_stats() -> pd.DataFrame:
    return pd.DataFrame({
        "analysis": "across_models", "benchmark": "LongBench-Pro", "suite": "LongBench-Pro", "mode": "nonthinking",
        "value_basis": "preferred", "scope": ["all", "thesis", "all"], "metric": ["ap_drop", "ap_drop", "ap_overall"],
        "n": [8, 7, 8], "pearson_r": [-0.6445, -0.6748, 0.755], "pearson_p": [0.0845, 0.0963, 0.0303],
        "spearman_rho": [-0.5476, -0.6429, 0.5476], "spearman_p": [0.1709821, 0.1388889, 0.1709821],
        "spearman_method": "exact", "spearman_permutations": [40320, 5040, 40320], "kendall_tau": [-0.5, -0.6, 0.4],
        "kendall_p": [0.11, 0.07, 0.18], "kendall_method": "exact", "n_measured": [2, 0, 2],
        "n_reference": [6, 7, 6]})


def save_png(path: Path, size: tuple[float, float], seed: int) -> tuple[int, int]:
    fig, ax = plt.subplots(figsize=size)
    ax.imshow(np.random.default_rng(seed).uniform(0, 1, (20, 60)), aspect="auto", cmap="viridis")
    ax.set(title=path.stem, xlabel="x (tokens)", ylabel="y")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    from matplotlib.image import imread

    h, w = imread(str(path)).shape[:2]
    return w, h


def report_inputs(folder: Path) -> ReportInputs:
    """A page's inputs: every kind of finding, paper and section figures (one 2000 px wide), wide tables."""
    figures = []
    specs = [("plasticity_heatmap", "heatmap", (20, 5)), ("plasticity_profiles", "profiles", (7, 4)),
             ("rotation_heads", "diagnostics", (11, 4)), ("pca_heads", "explained_variance", (6, 4))]
    for i, (asset, name, size) in enumerate(specs):
        for model in MODELS:
            src = f"figures/{asset}/{model}/{name}.png"
            w, h = save_png(folder / src, size, i)
            files = (("PDF", src[:-4] + ".pdf"),) if name == "heatmap" else ()
            figures.append(Figure(src, name, asset, model, w, h, files=files))
    src = "figures/geometry/pc_roles.png"
    figures.append(Figure(src, "pc_roles", "geometry_figures", None, *save_png(folder / src, (9, 4), 9)))
    tables: dict[str, dict[str | None, pd.DataFrame]] = {
        "model_report": {None: model_report()}, "benchmark_stats": {None: benchmark_stats()},
        "intervention_verdicts": {m: intervention_verdicts() for m in MODELS},
        "reference_metrics": {None: model_report().query("value_source == 'reference'")},
        "rotation_heads": {m: pd.DataFrame({"layer": range(300), "value": np.linspace(0, 1, 300)}) for m in MODELS},
    }
    for model in MODELS:
        for asset, df in cross_corpus(model).items():
            tables.setdefault(asset, {})[model] = df
    return ReportInputs(title="layout", models=[], tables=tables, figures=figures, states=[],
                        defined_assets=sorted(tables), model_order=MODELS)


def test_findings_state_every_verdict_with_its_interval_and_the_exact_p(tmp_path: Path) -> None:
    found = build_findings(report_inputs(tmp_path).tables, MODELS)
    assert found.headline is not None and [r[0].text for r in found.headline.rows] == MODELS  # measured only
    assert all("mean [95% CI]" in c for c in found.headline.columns[1:])
    ap = found.headline.rows[0][1]
    assert ap.ci == "[0.58, 0.62]" and ap.note == "n = 12 heads" and ap.href == "#plasticity"
    assert found.headline.rows[0][3].ci == "no interval defined"  # said, not left blank
    texts = [f.text for f in found.verdicts]
    assert len(texts) == 2 * 3  # 2 cross-corpus + 1 intervention verdict per model; 'not run' left to the section
    assert any("difference -0.0342 [-0.0577, -0.0045] (95% CI)" in t and "text's" in t for t in texts)
    assert any("Spearman ρ = 0.904 (p < 1/20000, n = 270 heads)" in t for t in texts)
    assert any("0.0511 [0.0348, 0.0673] (95% CI)" in t and t.endswith("supported") for t in texts)
    assert [f.href for f in found.verdicts] == ["#corpora"] * 4 + ["#interventions"] * 2
    (stat,) = found.statistics  # ap_drop over all matched models, not the thesis subset
    assert "p = 0.171, exact, 40,320 permutations" in stat.text and "n = 8 models" in stat.text


def test_page_order_findings_figures_sections_then_options_and_provenance(tmp_path: Path) -> None:
    page = render_report(report_inputs(tmp_path))
    ids = re.findall(r'<section id="([^"]+)"', page)
    assert ids[:2] == ["findings", "figures"] and ids[-2:] == ["appendix", "provenance"]
    figures = page[page.index('<section id="figures"'):page.index('<section id="summary"')]
    assert figures.count("<img ") == 5  # heatmap and profiles per model, pc_roles; not the diagnostics
    assert 'href="figures/plasticity_heatmap/smollm2-135m/heatmap.pdf"' in figures  # the vector file beside it
    assert "median over heads (no interval)" in page and "value (mean over heads)" in page
    # the mean, then its interval, then the median apart (never a median between a mean and its interval)
    head = page.index("value (mean over heads)")
    assert head < page.index("lo (95% CI of the mean)", head) < page.index("hi (95% CI of the mean)", head) \
        < page.index("median over heads (no interval)", head)
    assert page.index("options behind these numbers") > page.index('<section id="appendix"')


@pytest.mark.slow  # Chromium
def test_first_screen_shows_the_findings_and_nothing_is_cut_at_1440px(tmp_path: Path) -> None:
    page = tmp_path / "index.html"
    page.write_text(render_report(report_inputs(tmp_path)), encoding="utf-8")
    probe = probe_page(page, """
      const box = e => { const b = e.getBoundingClientRect(); return {x: b.left, y: b.top + scrollY, w: b.width,
                                                                       h: b.height, right: b.right}; };
      const q = s => document.querySelector(s);
      const findings = [...document.querySelectorAll('.finding')].map(box);
      const wraps = [...document.querySelectorAll('.tablewrap')].filter(w => w.offsetParent)
                    .map(w => ({scroll: w.scrollWidth, client: w.clientWidth}));
      const imgs = [...document.querySelectorAll('figure img')].map(i => ({...box(i), natural: i.naturalWidth}));
      const sections = [...document.querySelectorAll('main > section')].map(s => [s.id, box(s).y]);
      const statistic = box([...document.querySelectorAll('li.finding')].pop());
      window.scrollTo(0, 3000);
      return {findings, wraps, imgs, sections, statistic, headline: box(q('table.headline')),
              nav: box(q('nav')), navTopScrolled: q('nav').getBoundingClientRect().top, scrolled: scrollY,
              pageWidth: document.documentElement.scrollWidth};
    """, width=WIDTH, height=HEIGHT)
    first, last = probe["findings"][0], probe["statistic"]
    # the first finding, the headline table and the benchmark statistic are on the first screen
    assert 0 < first["y"] < HEIGHT and probe["headline"]["y"] + probe["headline"]["h"] < HEIGHT, probe["findings"]
    assert last["y"] + last["h"] <= HEIGHT, f"the benchmark statistic ends at {last['y'] + last['h']} px"
    # the first figure follows the findings, before any section of the body and long before the provenance
    sections = dict(probe["sections"])
    fig_y = probe["imgs"][0]["y"]
    assert last["y"] < sections["figures"] < fig_y < sections["summary"] < sections["appendix"] < sections["provenance"]
    assert fig_y < 2 * HEIGHT, f"first figure at {fig_y} px"
    # the table of contents stays in view (sticky) once the page is scrolled
    assert probe["scrolled"] == 3000 and probe["navTopScrolled"] == 0 and probe["nav"]["h"] < 60
    # nothing cut at the right: no table scrolls sideways, no figure is wider than the page or upscaled
    assert probe["pageWidth"] <= WIDTH
    assert probe["wraps"] and all(w["scroll"] <= w["client"] + 1 for w in probe["wraps"]), probe["wraps"]
    for img in probe["imgs"]:
        assert img["right"] <= WIDTH and img["w"] <= img["natural"] + 1, img
