"""The model report and the benchmark joins (SPEC 5).

- :func:`build_model_report` gathers the per-model long-format metrics of the PCA, rotation and
  plasticity analyses (measured) beside the thesis's published values (reference), both labelled.
- :func:`metric_values` picks one value per (model, metric, key): measured where present, reference
  otherwise (``basis="preferred"``), or one source only.
- :func:`join_model` (SPEC 5 a): every metric x the benchmark overall score, via the alias table.
- :func:`join_length` (SPEC 5 b): plasticity length bins x per-length scores; a bin [X/2, X) meets
  benchmark length X (SPEC 4.5), i.e. the bin's upper edge equals the benchmark length.
- :func:`compute_stats` (SPEC 5 c): Pearson, Spearman, Kendall (with p and n) across models for the
  aggregates against the overall score, and per-length correlations within and across models. A
  statistic never mixes benchmarks, suites (RULER sources) or modes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import pandas as pd

from qk_core.benchmarks.scores import REFERENCE_COLUMNS, BenchmarkDataError, analysis_of, bin_upper_tokens
from qk_core.io.metrics import COLUMNS as METRIC_COLUMNS
from qk_core.stats.correlation import MIN_N, STAT_FIELDS, correlations

REPORT_COLUMNS = REFERENCE_COLUMNS
MEASURED_ASSETS = {"pca_metrics": "pca", "rotation_metrics": "rotation", "plasticity_metrics": "plasticity"}
LENGTH_METRICS = ("ap_length_bin", "ap_length_bin_ruler")
STAT_METRICS = ("ap_overall", "ap_first20", "ap_last20", "ap_drop", "bias_strength")
VALUE_BASES = ("preferred", "reference", "measured")
# SPEC 5 check: the 7 LongBench-Pro-matched models of the thesis (the alias table's Llama-3.1-8B match
# is marked "match not used by the thesis").
THESIS_LBP_MODELS = ("ministral3-3b", "ministral3-8b", "ministral3-14b", "qwen3-4b", "qwen3-8b", "qwen3-14b",
                     "llama3.2-3b")

JOIN_MODEL_COLUMNS = ["model", "metric", "key", "value", "value_source", "metric_source", "unit", "n_heads", "lo",
                      "hi", "benchmark", "suite", "mode", "benchmark_model_name", "checkpoint_relation", "model_type",
                      "score", "score_basis", "score_source", "score_file"]
JOIN_LENGTH_COLUMNS = ["model", "length_metric", "bin_key", "value", "value_source", "metric_source", "benchmark",
                       "suite", "mode", "benchmark_model_name", "checkpoint_relation", "length", "length_tokens",
                       "score", "score_source", "score_file"]
STATS_COLUMNS = ["analysis", "benchmark", "suite", "mode", "score_basis", "value_basis", "scope", "metric", "key",
                 "length", "model", *STAT_FIELDS, "n_measured", "n_reference", "models"]


# ---- model report -------------------------------------------------------------------------------
def build_model_report(measured: Mapping[str, Mapping[str, pd.DataFrame]], reference: pd.DataFrame) -> pd.DataFrame:
    """Measured metrics of every model (``{asset: {partition: frame}}``) and the reference values.

    Measured frames must carry the long-format columns (qk_core.io.metrics.COLUMNS); a missing column or
    a (model, metric, key) given twice is a :class:`BenchmarkDataError` naming the asset partition.
    Both sources are kept, labelled by ``value_source``; precedence is applied by :func:`metric_values`.
    """
    problems: list[str] = []
    frames = []
    seen: dict[tuple[str, str, str], str] = {}
    for asset in sorted(measured):
        for partition in sorted(measured[asset]):
            df = measured[asset][partition]
            where = f"assets/{asset}/{partition}.parquet"
            miss = [c for c in METRIC_COLUMNS if c not in df.columns]
            if miss:
                problems += [f"{where}: field '{c}': missing column" for c in miss]
                continue
            df = df[METRIC_COLUMNS].copy()
            df["model"] = df["model"].fillna(partition).astype(str)
            df["key"] = df["key"].fillna("").astype(str)
            for i, ident in enumerate(zip(df["model"], df["metric"], df["key"], strict=True)):
                if ident in seen:
                    problems.append(f"{where}: row {i}, field 'metric': {'/'.join(ident)} is also in {seen[ident]}")
                seen.setdefault(ident, where)
            df["analysis"] = MEASURED_ASSETS.get(asset) or df["metric"].map(analysis_of)
            df["value_source"] = "measured"
            df["source"] = where
            frames.append(df)
    if problems:
        raise BenchmarkDataError(problems)
    ref = reference.reindex(columns=REPORT_COLUMNS)
    out = pd.concat([*frames, ref], ignore_index=True) if frames else ref.copy()
    out["n_heads"] = out["n_heads"].fillna(0).astype("int64")
    for col in ("value", "median", "lo", "hi"):
        out[col] = out[col].astype("float64")
    return out.sort_values(["model", "metric", "key", "value_source"], kind="stable").reset_index(drop=True)


def metric_values(report: pd.DataFrame, basis: str = "preferred") -> pd.DataFrame:
    """One row per (model, metric, key): measured where present, else reference (SPEC 5).

    ``basis`` ``"measured"`` or ``"reference"`` keeps only that source.
    """
    if basis not in VALUE_BASES:
        raise ValueError(f"basis must be one of {VALUE_BASES}, got {basis!r}")
    df = report if basis == "preferred" else report[report["value_source"] == basis]
    rank = df["value_source"].map({"measured": 0, "reference": 1}).fillna(2)
    df = df.assign(_rank=rank).sort_values(["model", "metric", "key", "_rank"], kind="stable")
    return df.drop_duplicates(["model", "metric", "key"]).drop(columns="_rank").reset_index(drop=True)


# ---- scores -------------------------------------------------------------------------------------
def overall_scores(scores: pd.DataFrame, aliases: pd.DataFrame | None = None) -> pd.DataFrame:
    """The overall score of every (benchmark, suite, mode, model) (SPEC 5 a).

    A reported ``overall`` row is used as is. A suite that reports per-length scores only (RULER
    tables) gets the mean over its lengths — the RULER paper's average — for models that have every
    length the suite reports in that mode; ``score_basis`` says which. With ``aliases``, only the
    models they name are scored (issue 25.6: a join needs a few models of a table that may hold
    millions of rows); a suite's set of lengths is still taken from every model.
    """
    cols = ["benchmark", "suite", "mode", "model_name", "score", "score_basis", "score_source", "score_file"]
    suites = ["benchmark", "suite", "mode"]
    firsts = scores.loc[scores["breakdown"] == "length", [*suites, "length_tokens", "key"]].drop_duplicates(
        [*suites, "length_tokens"])  # each suite's lengths (first label of each), without copying every row
    full_of = {g: (sorted(set(grp["length_tokens"].dropna().astype(int))),
                   grp.sort_values("length_tokens")["key"].tolist())
               for g, grp in firsts.groupby(suites, sort=True, observed=True)}
    if aliases is not None:
        scores = aliased_scores(scores, aliases)
    lengths = scores[scores["breakdown"] == "length"]
    rep = scores[scores["breakdown"] == "overall"]
    out = [pd.DataFrame({
        "benchmark": rep["benchmark"], "suite": rep["suite"], "mode": rep["mode"], "model_name": rep["model_name"],
        "score": rep["score"], "score_basis": "reported", "score_source": rep["source"], "score_file": rep["file"]})]
    have = set(zip(rep["benchmark"], rep["suite"], rep["mode"], rep["model_name"], strict=True))
    rows = []
    for (bench, suite, mode), grp in lengths.groupby(["benchmark", "suite", "mode"], sort=True, observed=True):
        full, labels = full_of[(bench, suite, mode)]
        for model, mg in grp.groupby("model_name", sort=True, observed=True):
            if (bench, suite, mode, model) in have or sorted(set(mg["length_tokens"].astype(int))) != full:
                continue
            rows.append({
                "benchmark": bench, "suite": suite, "mode": mode, "model_name": model,
                "score": float(mg["score"].mean()), "score_basis": f"mean over lengths {', '.join(labels)}",
                "score_source": " | ".join(sorted(set(mg["source"]))),
                "score_file": " | ".join(sorted(set(mg["file"]))),
            })
    if rows:
        out.append(pd.DataFrame(rows))
    return pd.concat(out, ignore_index=True)[cols]


def aliased_scores(scores: pd.DataFrame, aliases: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``scores`` whose (benchmark, model_name, mode) an alias names; the others cannot join."""
    keys = aliases[["benchmark", "benchmark_model_name", "mode"]].drop_duplicates()
    sub = scores[scores["model_name"].isin(set(keys["benchmark_model_name"]))]
    want = set(zip(keys["benchmark"], keys["benchmark_model_name"], keys["mode"], strict=True))
    mask = [t in want for t in zip(sub["benchmark"], sub["model_name"], sub["mode"], strict=True)]
    return sub[mask]


def _alias_frame(aliases: pd.DataFrame) -> pd.DataFrame:
    return aliases[["model", "benchmark", "benchmark_model_name", "mode", "checkpoint_relation"]]


def join_model(values: pd.DataFrame, aliases: pd.DataFrame, scores: pd.DataFrame,
               model_types: pd.DataFrame | None = None) -> pd.DataFrame:
    """SPEC 5 a: every metric of every aliased model x the benchmark's overall score."""
    ov = overall_scores(scores, aliases).rename(columns={"model_name": "benchmark_model_name"})
    matched = _alias_frame(aliases).merge(ov, on=["benchmark", "benchmark_model_name", "mode"], how="inner")
    if model_types is not None and len(model_types):
        types = model_types[["benchmark", "model_name", "type"]].rename(
            columns={"model_name": "benchmark_model_name", "type": "model_type"})
        matched = matched.merge(types.drop_duplicates(["benchmark", "benchmark_model_name"]),
                                on=["benchmark", "benchmark_model_name"], how="left")
    else:
        matched = matched.assign(model_type=pd.NA)
    vals = values.rename(columns={"source": "metric_source"})
    out = vals.merge(matched, on="model", how="inner")
    out["model_type"] = out["model_type"].fillna("").astype(str)
    out = out.reindex(columns=JOIN_MODEL_COLUMNS)
    order = ["benchmark", "suite", "mode", "model", "metric", "key"]
    return out.sort_values(order, kind="stable").reset_index(drop=True)


def join_length(values: pd.DataFrame, aliases: pd.DataFrame, scores: pd.DataFrame) -> pd.DataFrame:
    """SPEC 5 b: plasticity length bins x per-length scores (bin upper edge = benchmark length)."""
    bins = values[values["metric"].isin(LENGTH_METRICS)].copy()
    bins["length_tokens"] = bins["key"].map(bin_upper_tokens).astype("Int64")
    bins = bins.rename(columns={"metric": "length_metric", "key": "bin_key", "source": "metric_source"})
    scores = aliased_scores(scores, aliases)
    per_len = scores[scores["breakdown"] == "length"].rename(columns={
        "model_name": "benchmark_model_name", "key": "length", "source": "score_source", "file": "score_file"})
    per_len = per_len[["benchmark", "suite", "mode", "benchmark_model_name", "length", "length_tokens", "score",
                       "score_source", "score_file"]]
    matched = _alias_frame(aliases).merge(per_len, on=["benchmark", "benchmark_model_name", "mode"], how="inner")
    out = bins.merge(matched, on=["model", "length_tokens"], how="inner").reindex(columns=JOIN_LENGTH_COLUMNS)
    return out.sort_values(["benchmark", "suite", "mode", "length_metric", "model", "length_tokens"],
                           kind="stable").reset_index(drop=True)


# ---- statistics ---------------------------------------------------------------------------------
def _stat_row(group: pd.DataFrame, x: str, y: str, **labels: object) -> dict[str, object]:
    res = correlations(group[x].to_numpy(float), group[y].to_numpy(float))
    finite = group[np.isfinite(group[x].to_numpy(float)) & np.isfinite(group[y].to_numpy(float))]
    return {**labels, **res,
            "n_measured": int((finite["value_source"] == "measured").sum()),
            "n_reference": int((finite["value_source"] == "reference").sum()),
            "models": ",".join(finite["model"].astype(str))}


def _scoped(group: pd.DataFrame, scopes: Mapping[str, Iterable[str]]) -> list[tuple[str, pd.DataFrame]]:
    """("all", group) plus each named scope that changes the membership and keeps at least MIN_N."""
    out = [("all", group)]
    for name, models in scopes.items():
        sub = group[group["model"].isin(set(models))]
        if len(sub) != len(group) and sub["value"].notna().sum() >= MIN_N:
            out.append((name, sub))
    return out


def across_model_stats(jm: pd.DataFrame, basis: str, metrics: Iterable[str],
                       scopes: Mapping[str, Iterable[str]]) -> list[dict[str, object]]:
    """Each aggregate metric (key "") against the overall score, per benchmark/suite/mode (SPEC 5 c)."""
    rows: list[dict[str, object]] = []
    sel = jm[jm["metric"].isin(list(metrics)) & (jm["key"] == "")]
    for (bench, suite, mode, sbasis, metric), grp in sel.groupby(
            ["benchmark", "suite", "mode", "score_basis", "metric"], sort=True):
        for scope, sub in _scoped(grp, scopes):
            rows.append(_stat_row(sub, "value", "score", analysis="across_models", benchmark=bench, suite=suite,
                                  mode=mode, score_basis=sbasis, value_basis=basis, scope=scope, metric=metric,
                                  key="", length="", model=""))
    return rows


def per_length_stats(jl: pd.DataFrame, basis: str, scopes: Mapping[str, Iterable[str]]) -> list[dict[str, object]]:
    """Per-length correlations: within one model across lengths, and across models at one length."""
    rows: list[dict[str, object]] = []
    base = dict(score_basis="per-length", value_basis=basis, key="")
    for (bench, suite, mode, metric), grp in jl.groupby(["benchmark", "suite", "mode", "length_metric"], sort=True):
        labels = dict(benchmark=bench, suite=suite, mode=mode, metric=metric, **base)
        for model, mg in grp.groupby("model", sort=True):
            rows.append(_stat_row(mg, "value", "score", analysis="within_model_per_length", scope="all",
                                  length="", model=model, **labels))
        for _, lg in grp.groupby("length_tokens", sort=True):
            for scope, sub in _scoped(lg, scopes):
                rows.append(_stat_row(sub, "value", "score", analysis="across_models_per_length", scope=scope,
                                      length=str(lg["length"].iloc[0]), model="", **labels))
    return rows


def compute_stats(report: pd.DataFrame, aliases: pd.DataFrame, scores: pd.DataFrame, *,
                  metrics: Iterable[str] = STAT_METRICS,
                  scopes: Mapping[str, Iterable[str]] | None = None,
                  bases: Iterable[str] = VALUE_BASES) -> pd.DataFrame:
    """All SPEC 5 c statistics, for each value basis that has values (preferred, reference, measured).

    ``scopes`` names model subsets (default: the thesis's 7 LongBench-Pro models) reported beside
    ``all`` where they change a statistic's membership.
    """
    scopes = {"thesis": THESIS_LBP_MODELS} if scopes is None else scopes
    metrics = list(metrics)
    rows: list[dict[str, object]] = []
    for basis in bases:
        values = metric_values(report, basis)
        if values.empty:
            continue
        rows += across_model_stats(join_model(values, aliases, scores), basis, metrics, scopes)
        rows += per_length_stats(join_length(values, aliases, scores), basis, scopes)
    df = pd.DataFrame(rows, columns=STATS_COLUMNS)
    df["n"] = df["n"].astype("int64")
    return df.reset_index(drop=True)
