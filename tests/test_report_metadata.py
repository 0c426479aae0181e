"""Issue 26.2 without Dagster runs: the headline values a materialisation leads with, their order, and that they
are the numbers the report's findings print (the asset-level checks are in test_plasticity_assets.py and
test_geometry_assets.py, over the metadata the assets produce)."""

from __future__ import annotations

import numpy as np
import pandas as pd
from dagster import MetadataValue

from qk_assets.defs.cross_corpus import difference_values
from qk_assets.defs.interventions import verdict_values
from qk_assets.defs.joins import statistic_values
from qk_assets.metadata import headline_values, results_first, table_value
from qk_core.io.metrics import metric_row, metrics_frame
from qk_core.report.findings import build_findings
from qk_core.report.tables import fmt_num


def metrics() -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rows = [metric_row("m", name, rng.uniform(0, 1, 9), unit="AP", options={"L": 2048}, lo=0.1, hi=0.9)
            for name in ("ap_first20", "ap_overall", "ap_drop", "ap_last20", "ap_overall_empirical")]
    rows.append(metric_row("m", "ap_decile", [0.3], key="0-10%", unit="AP", options={}))
    rows.append(metric_row("m", "bias_strength", [np.nan], unit="per token", options={}))  # no value: left out
    return metrics_frame(rows)


def test_headline_values_are_plain_model_values_in_a_fixed_order() -> None:
    lead = headline_values(metrics())
    assert list(lead) == ["ap_overall", "ap_drop", "ap_first20", "ap_last20", "n_heads"]
    assert all(type(v) is float for k, v in lead.items() if k != "n_heads") and lead["n_heads"] == 9
    m = metrics().set_index("metric")
    assert lead["ap_drop"] == m.loc["ap_drop", "value"]
    assert headline_values(pd.DataFrame()) == {}


def test_results_first_orders_figures_tables_others_and_options_last() -> None:
    meta = {"options": MetadataValue.json({"L": 2048}), "heads_ok": 9, "preview": table_value(pd.DataFrame({"a": [1]})),
            "fig_x": MetadataValue.md("![x](data:...)"), "fig_x_path": MetadataValue.path("/f/x.png"),
            "md_table": MetadataValue.md("| a |\n|---|\n| 1 |"), "ap_overall": 0.1}
    out = results_first({"ap_overall": 0.5, "n_heads": 9}, meta)
    assert list(out) == ["ap_overall", "n_heads", "fig_x", "fig_x_path", "preview", "md_table", "heads_ok", "options"]
    assert out["ap_overall"] == 0.5  # the headline value wins over an entry of the same name
    assert list(results_first({}, {"a": 1}, options={"seed": 0})) == ["a", "options"]


def test_report_findings_print_the_numbers_the_asset_pages_plot() -> None:
    df = metrics().assign(value_source="measured")
    lead = headline_values(df)
    found = build_findings({"model_report": {None: df}}, ["m"])
    assert found.headline is not None
    cells = dict(zip(found.headline.columns, found.headline.rows[0], strict=True))
    assert cells["AP_overall: mean [95% CI]"].text == fmt_num(lead["ap_overall"])
    assert cells["AP_drop: mean [95% CI]"].text == fmt_num(lead["ap_drop"])
    assert cells["AP_drop: mean [95% CI]"].note == f"n = {lead['n_heads']} heads"


def test_cross_corpus_interventions_and_statistics_lead_with_their_numbers() -> None:
    cc = pd.DataFrame({"kind": ["corpus", "difference", "difference"],
                       "metric": ["ap_drop", "ap_drop", "bias_strength"], "value": [0.09, -0.034, np.nan],
                       "n_heads": [270, 270, 270]})
    assert difference_values(cc) == {"ap_drop_difference": -0.034, "n_heads": 270}
    verdicts = pd.DataFrame({"hypothesis": ["H1: low ...", "H2: removing ...", ""],
                             "intervention": ["ablate", "debias", ""], "k": [40, 40, 0],
                             "estimate": [0.0, 0.051, np.nan]})
    assert verdict_values(verdicts) == {"h1_ablate_k40": 0.0, "h2_debias_k40": 0.051}
    stats = pd.DataFrame({"benchmark": ["RULER", "LongBench-Pro", "LongBench-Pro"], "mode": "x",
                          "scope": ["all", "thesis", "all"], "metric": "ap_drop", "n": [3, 7, 8],
                          "spearman_rho": [1.0, -0.64, -0.55], "spearman_p": [0.33, 0.14, 0.17],
                          "pearson_r": [0.99, -0.67, -0.64]})
    assert statistic_values(stats) == {"ap_drop_spearman_rho": -0.55, "ap_drop_spearman_p": 0.17,
                                       "ap_drop_pearson_r": -0.64, "n_models": 8}


def test_wide_figures_are_embedded_narrow_enough_for_the_dialog_and_paper_figures_saved_as_pdf(tmp_path) -> None:
    """Issue 26: the Dagster UI shows an embedded figure in a dialog at most 80% of the window wide; a wide
    figure is embedded scaled down (the file stays full size); a paper figure is also stored as PDF."""
    import base64

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qk_assets.figures import MAX_EMBED_PX, png_size, save_figures
    from qk_core.io.storage import Storage

    st = Storage(str(tmp_path))
    wide, ax = plt.subplots(figsize=(18, 4))
    ax.imshow(np.random.default_rng(0).uniform(0, 1, (10, 50)), aspect="auto")
    narrow, ax2 = plt.subplots(figsize=(5, 3))
    ax2.plot([0, 1], [1, 0])
    meta = save_figures(st, "plasticity/m/c", {"heatmap": wide, "closed_vs_empirical": narrow})
    for name in ("heatmap", "closed_vs_empirical"):
        full = (tmp_path / "figures" / "plasticity" / "m" / "c" / f"{name}.png").read_bytes()
        embedded = base64.b64decode(str(meta[f"fig_{name}"].value).split("base64,", 1)[1][:-1])
        (fw, fh), (ew, eh) = png_size(full), png_size(embedded)
        if name == "heatmap":
            assert fw > MAX_EMBED_PX and ew == MAX_EMBED_PX and abs(eh / ew - fh / fw) < 0.01
        else:
            assert fw <= MAX_EMBED_PX and embedded == full
    assert (tmp_path / "figures" / "plasticity" / "m" / "c" / "heatmap.pdf").read_bytes()[:5] == b"%PDF-"
    assert not (tmp_path / "figures" / "plasticity" / "m" / "c" / "closed_vs_empirical.pdf").exists()
