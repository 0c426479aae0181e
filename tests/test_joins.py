"""Model report, benchmark joins and statistics (SPEC 5 a-c), in qk_core and through Dagster.

Ground truth: the thesis's published check (SPEC 5), correlation formulas written out here with
numpy, planted measured values, and hand-derived bin / length matches.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from qk_core.benchmarks.joins import (
    THESIS_LBP_MODELS,
    build_model_report,
    compute_stats,
    join_length,
    join_model,
    metric_values,
    overall_scores,
)
from qk_core.benchmarks.scores import SourceFile, load_aliases, load_model_types, load_reference, load_scores
from qk_core.io.metrics import COLUMNS, metric_row, metrics_frame
from qk_core.stats.correlation import correlations

REPO = Path(__file__).resolve().parent.parent
SEED = REPO / "data" / "benchmarks"
REF = REPO / "data" / "reference" / "thesis_metrics.csv"


def seed(name: str, folder: Path = SEED) -> SourceFile:
    return SourceFile(f"{folder.name}/{name}", (folder / name).read_bytes())


@pytest.fixture(scope="module")
def scores() -> pd.DataFrame:
    return load_scores([seed("longbench_pro.csv"), seed("ruler.csv")])


@pytest.fixture(scope="module")
def aliases() -> pd.DataFrame:
    return load_aliases(seed("model_aliases.csv"))


@pytest.fixture(scope="module")
def reference() -> pd.DataFrame:
    return load_reference([seed("thesis_metrics.csv", REF.parent)])


@pytest.fixture(scope="module")
def report(reference: pd.DataFrame) -> pd.DataFrame:
    return build_model_report({}, reference)


# ---- statistics ---------------------------------------------------------------------------------
def _ranks(a: np.ndarray) -> np.ndarray:
    order = np.argsort(a)
    r = np.empty(len(a))
    r[order] = np.arange(1, len(a) + 1)
    return r


def test_correlations_match_written_out_formulas() -> None:
    rng = np.random.default_rng(7)
    x = rng.normal(size=11)
    y = 0.6 * x + rng.normal(size=11)
    res = correlations(x, y)
    n = len(x)
    r = np.sum((x - x.mean()) * (y - y.mean())) / math.sqrt(np.sum((x - x.mean()) ** 2) * np.sum((y - y.mean()) ** 2))
    t = r * math.sqrt((n - 2) / (1 - r * r))
    p = 2 * sps.t.sf(abs(t), n - 2)
    rx, ry = _ranks(x), _ranks(y)
    rho = np.corrcoef(rx, ry)[0, 1]
    conc = sum(np.sign(x[i] - x[j]) * np.sign(y[i] - y[j]) for i, j in itertools.combinations(range(n), 2))
    tau = conc / (n * (n - 1) / 2)
    assert res["n"] == n
    assert res["pearson_r"] == pytest.approx(r, abs=1e-12) and res["pearson_p"] == pytest.approx(p, rel=1e-9)
    assert res["spearman_rho"] == pytest.approx(rho, abs=1e-12)
    assert res["kendall_tau"] == pytest.approx(tau, abs=1e-12)
    assert 0 < res["spearman_p"] < 1 and 0 < res["kendall_p"] < 1
    # NaN pairs are dropped; too few points or a constant variable give NaN with n
    short = correlations([1.0, 2.0, np.nan], [1.0, 3.0, 2.0])
    assert short["n"] == 2 and math.isnan(short["pearson_r"])
    assert math.isnan(correlations([1, 1, 1, 1], [1, 2, 3, 4])["kendall_tau"])


def test_thesis_check_on_reference_values(report: pd.DataFrame, aliases: pd.DataFrame, scores: pd.DataFrame) -> None:
    """SPEC 5: the 7 LongBench-Pro-matched models (non-thinking), reference values."""
    st = compute_stats(report, aliases, scores)
    sel = st[(st["analysis"] == "across_models") & (st["value_basis"] == "reference") & (st["scope"] == "thesis")
             & (st["benchmark"] == "LongBench-Pro") & (st["mode"] == "nonthinking")].set_index("metric")
    assert set(sel.loc["ap_drop", "models"].split(",")) == set(THESIS_LBP_MODELS)
    assert int(sel.loc["ap_drop", "n"]) == 7
    tol = 1e-3  # the published values are rounded to 3 decimals from unrounded AP values
    assert sel.loc["ap_drop", "pearson_r"] == pytest.approx(-0.675, abs=tol)
    assert sel.loc["ap_drop", "pearson_p"] == pytest.approx(0.096, abs=tol)
    assert sel.loc["ap_drop", "spearman_rho"] == pytest.approx(-0.643, abs=tol)
    assert sel.loc["ap_drop", "kendall_tau"] == pytest.approx(-0.619, abs=tol)
    assert sel.loc["ap_last20", "pearson_r"] == pytest.approx(0.716, abs=tol)
    assert sel.loc["ap_overall", "pearson_r"] == pytest.approx(0.705, abs=tol)
    # the "all" scope adds the eighth alias (Llama-3.1-8B), which the thesis did not use
    every = st[(st["analysis"] == "across_models") & (st["value_basis"] == "reference") & (st["scope"] == "all")
               & (st["benchmark"] == "LongBench-Pro") & (st["metric"] == "ap_drop")]
    assert every["n"].tolist() == [8] and "llama3.1-8b" in every["models"].iloc[0]


def test_statistics_never_mix_modes_or_suites(report: pd.DataFrame, aliases: pd.DataFrame,
                                              scores: pd.DataFrame) -> None:
    extra = pd.DataFrame([{**aliases.iloc[4].to_dict(), "mode": "thinking", "location": "line 99"}])  # qwen3-8b
    al = pd.concat([aliases, extra], ignore_index=True)
    st = compute_stats(report, al, scores)
    jm = join_model(metric_values(report), al, scores)
    for row in st[st["n"] > 0].itertuples():
        grp = jm[(jm["benchmark"] == row.benchmark) & (jm["suite"] == row.suite) & (jm["mode"] == row.mode)]
        assert set(row.models.split(",")) <= set(grp["model"]), row
    thinking = st[(st["mode"] == "thinking") & (st["analysis"] == "across_models")]
    assert set(thinking["models"]) == {"qwen3-8b"} and set(thinking["n"]) == {1}
    ruler = st[(st["benchmark"] == "RULER") & (st["analysis"] == "across_models") & (st["value_basis"] == "reference")]
    # qwen3-4b is in two RULER suites (Qwen3 report, non-thinking; SmolLM3 card, base): never together
    assert ruler.groupby(["suite", "mode"]).size().size == 3
    for _, g in ruler.groupby(["suite", "mode"]):
        assert g["models"].nunique() == 1


def test_ruler_overall_is_the_mean_of_its_lengths(scores: pd.DataFrame) -> None:
    ov = overall_scores(scores)
    ruler = pd.read_csv(SEED / "ruler.csv")
    q = ruler[(ruler["model_name"] == "Qwen3-8B") & (ruler["mode"] == "non-thinking")]
    got = ov[(ov["model_name"] == "Qwen3-8B") & (ov["mode"] == "non-thinking")]
    assert got["score"].tolist() == [pytest.approx(q["score"].mean())]
    assert got["score_basis"].iloc[0] == "mean over lengths 4k, 8k, 16k, 32k, 64k, 128k"
    lbp = ov[(ov["benchmark"] == "LongBench-Pro") & (ov["model_name"] == "Qwen3-8B") & (ov["mode"] == "nonthinking")]
    assert lbp["score_basis"].tolist() == ["reported"] and lbp["score"].iloc[0] == pytest.approx(33.4126)
    # a model missing one of the suite's lengths gets no overall score (never a partial mean)
    cut = scores[~((scores["model_name"] == "Qwen3-8B") & (scores["key"] == "128k") & (scores["benchmark"] == "RULER"))]
    assert overall_scores(cut).query("model_name == 'Qwen3-8B' and mode == 'non-thinking'").empty


def _measured(model: str, metric: str, value: float, key: str = "") -> dict:
    return metric_row(model, metric, [value, value], key=key, unit="AP", options={"L": 131072})


def test_measured_values_take_precedence_and_say_so(reference: pd.DataFrame, aliases: pd.DataFrame,
                                                    scores: pd.DataFrame) -> None:
    plast = metrics_frame([_measured("qwen3-8b", "ap_drop", 0.5), _measured("qwen3-8b", "ap_length_bin", 0.9, "8k-16k"),
                           _measured("gemma3-270m", "ap_drop", 0.3)])
    report = build_model_report({"plasticity_metrics": {"qwen3-8b": plast}}, reference)
    both = report[(report["model"] == "qwen3-8b") & (report["metric"] == "ap_drop")]
    assert sorted(both["value_source"]) == ["measured", "reference"]  # the report keeps both, labelled
    jm = join_model(metric_values(report), aliases, scores)
    q = jm[(jm["model"] == "qwen3-8b") & (jm["metric"] == "ap_drop")]
    assert set(q["value"]) == {0.5} and set(q["value_source"]) == {"measured"}
    assert set(q["metric_source"]) == {"assets/plasticity_metrics/qwen3-8b.parquet"}
    other = jm[(jm["model"] == "qwen3-4b") & (jm["metric"] == "ap_drop")]
    assert set(other["value_source"]) == {"reference"} and set(other["value"]) == {0.186}
    assert "gemma3-270m" not in set(jm["model"])  # no alias, no join row
    jl = join_length(metric_values(report), aliases, scores)
    cell = jl[(jl["model"] == "qwen3-8b") & (jl["bin_key"] == "8k-16k") & (jl["benchmark"] == "LongBench-Pro")]
    assert cell[["value", "value_source", "length"]].values.tolist() == [[0.9, "measured", "16k"]]
    st = compute_stats(report, aliases, scores)
    pick = st[(st["analysis"] == "across_models") & (st["metric"] == "ap_drop") & (st["scope"] == "thesis")]
    by = pick.set_index("value_basis")
    assert by.loc["preferred", "n_measured"] == 1 and by.loc["reference", "n_measured"] == 0
    assert by.loc["preferred", "pearson_r"] != pytest.approx(by.loc["reference", "pearson_r"])
    assert by.loc["reference", "pearson_r"] == pytest.approx(-0.675, abs=1e-3)


def test_length_join_matches_bin_upper_edge(report: pd.DataFrame, aliases: pd.DataFrame, scores: pd.DataFrame) -> None:
    jl = join_length(metric_values(report), aliases, scores)
    lbp = jl[(jl["model"] == "qwen3-4b") & (jl["benchmark"] == "LongBench-Pro")]
    assert dict(zip(lbp["bin_key"], lbp["length"], strict=True)) == {
        "0-8k": "8k", "8k-16k": "16k", "16k-32k": "32k", "32k-64k": "64k", "64k-128k": "128k"}  # no 256k bin
    src = pd.read_csv(SEED / "longbench_pro.csv")
    want = src[(src["model_name"] == "Qwen3-4B") & (src["mode"] == "nonthinking") & (src["breakdown"] == "length")]
    for row in lbp.itertuples():
        assert row.score == pytest.approx(want.set_index("key").loc[row.length, "score"])
    ruler = jl[(jl["model"] == "llama3.1-8b") & (jl["benchmark"] == "RULER")]
    assert set(ruler["length_metric"]) == {"ap_length_bin_ruler"}
    assert dict(zip(ruler["bin_key"], ruler["length"], strict=True)) == {k: k for k in
                                                                         ["4k", "8k", "16k", "32k", "64k", "128k"]}


def test_model_types_join(report: pd.DataFrame, aliases: pd.DataFrame, scores: pd.DataFrame) -> None:
    types = load_model_types([seed("longbench_pro_models.csv")])
    jm = join_model(metric_values(report), aliases, scores, types)
    t = jm.drop_duplicates(["model", "benchmark", "mode"]).set_index(["model", "benchmark"])["model_type"]
    assert t[("qwen3-8b", "LongBench-Pro")] == "Mixed" and t[("llama3.2-3b", "LongBench-Pro")] == "Instruct"
    assert t[("mistral-v0.2-7b", "RULER")] == ""


def test_report_rejects_malformed_measured_frames(reference: pd.DataFrame) -> None:
    from qk_core.benchmarks.scores import BenchmarkDataError

    bad = metrics_frame([_measured("qwen3-8b", "ap_drop", 0.5)]).drop(columns=["median"])
    with pytest.raises(BenchmarkDataError, match=r"assets/rotation_metrics/qwen3-8b.parquet: field 'median'"):
        build_model_report({"rotation_metrics": {"qwen3-8b": bad}}, reference)
    assert list(COLUMNS) == list(metrics_frame([]).columns)


def test_joins_score_only_the_aliased_models_with_the_same_result(aliases: pd.DataFrame, scores: pd.DataFrame) -> None:
    """Issue 25.6: overall scores computed for the aliased models only equal the full computation's rows for
    them, including a RULER-style suite whose set of lengths comes from models that are not aliased."""
    full = overall_scores(scores)
    only = overall_scores(scores, aliases)
    keys = set(zip(aliases["benchmark"], aliases["benchmark_model_name"], aliases["mode"], strict=True))
    want = full[[k in keys for k in zip(full["benchmark"], full["model_name"], full["mode"], strict=True)]]
    assert len(only) == len(want) > 0 and len(only) < len(full)
    pd.testing.assert_frame_equal(only.astype(str).reset_index(drop=True), want.astype(str).reset_index(drop=True))
    # a longer length reported by an unaliased model only: no aliased model is complete in that suite any more
    suite, mode = only.loc[only["score_basis"] != "reported", ["suite", "mode"]].iloc[0]
    ruler = scores[(scores["breakdown"] == "length") & (scores["suite"] == suite) & (scores["mode"] == mode)]
    extra = ruler.iloc[[0]].astype(object).assign(model_name="unaliased/model", key="9m", length_tokens=9_000_000)
    more = pd.concat([scores.astype(object), extra], ignore_index=True)
    for out in (overall_scores(more, aliases), overall_scores(more)):
        assert not ((out["suite"] == suite) & (out["mode"] == mode) & (out["score_basis"] != "reported")).any()
