"""Attention plasticity per model (SPEC 4) and decile profiles across models, with the figures of SPEC 7.

``plasticity`` (a multi-asset, partitioned like the capture) reads the capture one head at a time and
calls :func:`qk_core.plasticity.analyse_model`. Its outputs:

- ``plasticity_heads``: one row per sampled head (its queries' model from every position with coverage
  ``all``, SPEC 12.2; ``coverage``, ``n_queries_model``, ``n_docs``): AP_overall / first20 / last20 / drop
  with 95% document bootstrap intervals, the empirical counterparts, the closed-form vs empirical gap,
  diagnostics (|beta| per token and x L, mean R^2, skew / excess kurtosis of the coordinate-1 residual),
  counts, bucket status counts, status / reason, options;
- ``plasticity_profiles``: per head and bucket: tau (raw tokens and / L), AP closed form with interval,
  AP empirical, gap, pairs drawn / valid / eligible, queries, keys, Ledoit-Wolf shrinkage, status;
- ``plasticity_bins``: per head and bin (quintiles, deciles, length bins, RULER bins, absolute position
  bins): value, empirical value, interval, buckets used, status (missing bins say why);
- ``plasticity_pairs``: per pair: document, t_i, t_j (raw tokens), bucket, tau, delta_1, z, PP closed
  form and empirical, valid;
- ``plasticity_heatmap``: non-empty cells of the pooled 2-D heatmap (bin edges in raw tokens, pairs,
  mean PP closed form and empirical);
- ``plasticity_components``: per head and original query coordinate: R^2 on position and weight;
- ``plasticity_query_heads``: per head, its query model (SPEC 4.1: |beta| per token and x L, alpha_pos, sigma_pos,
  mean R^2): with coverage ``all`` of every eligible head, from the capture's moments alone (SPEC 12.2), ``sampled``
  marking the heads that have key pairs and so AP; with ``sampled`` the analysed heads' rows;
- ``plasticity_metrics``: the long metrics format (qk_core.io.metrics) with model-level bootstrap lo / hi; with
  coverage ``all`` its query-model rows (``query_drift_*``, ``query_mean_coord_r2``) average every eligible head.

``plasticity_coverage_gap`` (per model partition; SPEC 12.3) compares the published AP and query model with the other
coverage refitted from the same capture (:func:`qk_core.plasticity.coverage.plasticity_coverage_gap`), per metric.

``plasticity_deciles`` (unpartitioned) collects the ``ap_decile`` rows of every model that has them.

Options, lowest to highest precedence: :class:`qk_core.plasticity.PlasticityOptions` defaults, the
registry entry's ``analysis.plasticity`` table, the run config. L and B come from the capture.
"""

import json

import pandas as pd
from dagster import (
    AssetExecutionContext,
    AssetIn,
    AssetOut,
    MetadataValue,
    Output,
    asset,
    multi_asset,
)

from qk_assets import checks
from qk_assets.automation import AFTER_UPSTREAM, PER_PAIR
from qk_assets.figures import save_figures
from qk_assets.metadata import MEAN_MEDIAN, coverage_gap_metadata, headline_values, results_first, table_value
from qk_assets.options import AnalysisConfig, analysis_options
from qk_assets.partitions import by_model, model_corpus_partitions, registry, split_key
from qk_assets.progress import progress_logger
from qk_assets.resources import RayClusterResource, StorageResource
from qk_core.capture.store import CaptureError
from qk_core.config.options import PlasticityOptions
from qk_core.plasticity import analyse_capture, coverage
from qk_core.runtime.cluster import on_cpu_worker

GROUP = "plasticity"
# every output: eager for the pairs the registry lists (new partitions, upstream updates; model_automation_sensor)
OUT = {"group_name": GROUP, "kinds": {"parquet"}, "automation_condition": PER_PAIR}
# per-partition checks (qk_assets/checks.py); heads_analysed and values_finite block what follows
CHECKS = checks.check_specs([
    ("plasticity_heads", checks.HEADS_ANALYSED), ("plasticity_heads", checks.INTERVALS_CONTAIN),
    ("plasticity_metrics", checks.VALUES_FINITE), ("plasticity_metrics", checks.INTERVALS_CONTAIN),
    ("plasticity_profiles", checks.PROFILE_COVERAGE)], model_corpus_partitions())
HEAD_INTERVALS = [(f"{name}{kind}", f"{name}{kind}_lo", f"{name}{kind}_hi")
                  for name in ("ap_overall", "ap_first20", "ap_last20", "ap_drop") for kind in ("", "_empirical")]

UNITS = {
    "tau_tokens, t_i, t_j, *_tokens": "raw token positions",
    "tau_frac": "tau / L (window-normalised)",
    "ap, ap_*, pp, pp_*, value, gap*": "attention plasticity (dimensionless, [0, 1])",
    "beta_norm_per_token": "per token", "beta_norm_window": "window-normalised (x L)",
    "z": "standard-normal quantile m / sqrt(v)", "delta_1": "key difference along the query drift axis",
}


#: the query model's per-head values drawn by depth (qk_core.plots.geometry.fig_depth_heatmaps panels)
QUERY_PANELS = [("beta_norm_window", "|beta| x L (window-normalised)", "positive"),
                ("alpha_pos", "alpha_pos (drift-axis intercept)", "signed"),
                ("sigma_pos", "sigma_pos (drift-axis residual sd)", "positive"),
                ("mean_coord_r2", "mean R^2 of coordinates on t", "positive")]


def plasticity_options(model_key: str, config: AnalysisConfig | None = None) -> PlasticityOptions:
    """Defaults < the registry's ``analysis.plasticity`` table < run config (SPEC 4 options)."""
    (opts,) = analysis_options(model_key, config, "plasticity")
    return opts


def _md(df: pd.DataFrame, n: int = 30) -> MetadataValue:
    return table_value(df, max_rows=n)


@multi_asset(
    outs={
        "plasticity_heads": AssetOut(**OUT, description=(
            "Per head: AP_overall/first20/last20/drop with 95% document-bootstrap intervals, empirical "
            "counterparts, closed-form vs empirical gap, diagnostics, counts, status/reason, options (SPEC 4).")),
        "plasticity_profiles": AssetOut(**OUT, description=(
            "Per head and query bucket: tau (raw tokens, / L), AP closed form + interval, AP empirical, pairs, "
            "queries, keys, status (SPEC 4.4); ap_loo: the jackknife's leave-one-document (group)-out AP behind the "
            "interval (4.6), which the cross-corpus comparison reads.")),
        "plasticity_bins": AssetOut(**OUT, description=(
            "Per head and bin: quintiles, deciles, length bins, RULER bins, absolute position bins; missing "
            "bins carry their reason (SPEC 4.5).")),
        "plasticity_pairs": AssetOut(**OUT, description=(
            "Per key pair: document, t_i, t_j, bucket, tau, delta_1, z, PP closed form and empirical (SPEC 4.7).")),
        "plasticity_heatmap": AssetOut(**OUT, description=(
            "Mean PP by inter-key distance x query-to-key-midpoint distance, pooled over heads (SPEC 4.7).")),
        "plasticity_components": AssetOut(**OUT, description=(
            "Per head and query coordinate: R^2 on position and normalised weight (SPEC 4.8).")),
        "plasticity_query_heads": AssetOut(**OUT, description=(
            "Per head: its query model (|beta| per token and x L, alpha_pos, sigma_pos, mean R^2; SPEC 4.1), with "
            "coverage `all` for every eligible head from the capture's moments (SPEC 12.2), `sampled` marking the "
            "heads with key pairs (AP in plasticity_heads); positions and documents each rests on.")),
        "plasticity_metrics": AssetOut(**OUT, description=(
            "Per-model plasticity metrics in the long format: ap_overall, ap_first20, ap_last20, ap_drop, "
            "ap_quintile, ap_decile, ap_length_bin, ap_length_bin_ruler, ap_position_bin (model-level "
            "bootstrap lo/hi), empirical and diagnostic means.")),
    },
    ins={"qk_capture": AssetIn()},
    deps=["registry_analysis"],  # an analysis-option edit re-runs this, not the capture
    partitions_def=model_corpus_partitions(),
    can_subset=False,
    check_specs=CHECKS,
)
def plasticity(context: AssetExecutionContext, config: AnalysisConfig, storage: StorageResource,
               ray: RayClusterResource, qk_capture: pd.DataFrame):
    """Attention plasticity of every sampled head of one model (SPEC 4), with figures (SPEC 7)."""
    model, corpus = split_key(context.partition_key)
    opts = plasticity_options(model, config)
    store = storage.get()
    if qk_capture.empty:
        raise CaptureError(f"{model}: the capture lists no heads")
    prefixes = sorted(set(qk_capture["capture_prefix"].astype(str)))
    if len(prefixes) != 1:
        raise CaptureError(f"{model}: qk_capture points at {len(prefixes)} captures {prefixes}; expected one")
    heads = [(int(r.layer), int(r.q_head)) for r in qk_capture.sort_values(["layer", "q_head"]).itertuples()]
    log = progress_logger(context, f"plasticity {model}")

    def progress(i: int, res) -> None:
        log(i + 1, len(heads))

    placed = on_cpu_worker(  # a CPU task on the Ray cluster when connected (issue 12), else here
        analyse_capture, model, store, prefixes[0], heads, opts, progress=None if ray.enabled else progress,
        cluster=ray.enabled, ray_log=context.log, name=f"qk_plasticity:{model}:{corpus}")
    context.log.info(f"plasticity {model} on {corpus}: {len(heads)} heads on {placed.where}")
    result = placed.value
    L, B = result.window, result.bucket
    record = result.options
    h = result.heads
    skipped = h.loc[h["status"] != "ok", "status"].value_counts().to_dict() if len(h) else {}
    if skipped:
        context.log.warning(f"plasticity {model}: heads without a value {skipped}; see status/reason")
    figures = _figures(result, model, L, B, record)
    folder = f"plasticity/{model}/{corpus}"
    common = {"options": MetadataValue.json(record), "L_tokens": L, "B_tokens": B,
              "heads_ok": int((h["status"] == "ok").sum()) if len(h) else 0,
              "heads_missing": int(record.get("n_heads_missing", 0)),
              "heads_skipped": MetadataValue.json({str(k): int(v) for k, v in skipped.items()})}
    headline = result.metrics[result.metrics["key"] == ""][["metric", "value", "lo", "hi", "median", "n_heads",
                                                            "unit"]].rename(columns=MEAN_MEDIAN)
    prof_status = (result.profiles["status"].value_counts().to_dict() if len(result.profiles) else {})
    lead = headline_values(result.metrics)
    yield Output(h, output_name="plasticity_heads", metadata=results_first(lead, {
        **common, "model_values": _md(headline), "units": MetadataValue.json(UNITS),
        **save_figures(store, folder, {"closed_vs_empirical": figures["closed_vs_empirical"]})}))
    yield Output(result.profiles, output_name="plasticity_profiles", metadata=results_first(lead, {
        **common, "bucket_status": MetadataValue.json({str(k): int(v) for k, v in prof_status.items()}),
        **save_figures(store, folder, {"profiles": figures["profiles"]})}))
    bins = result.bins
    missing = (bins[bins["status"] != "ok"].groupby(["metric", "key", "status"]).size().reset_index(name="heads")
               if len(bins) else pd.DataFrame())
    yield Output(bins, output_name="plasticity_bins",
                 metadata=results_first(lead, {**common, "missing_bins": _md(missing, 60)}))
    yield Output(result.pairs, output_name="plasticity_pairs",
                 metadata=results_first(lead, {**common, "pairs": len(result.pairs)}))
    yield Output(result.heatmap, output_name="plasticity_heatmap", metadata=results_first(lead, {
        **common, "cells": len(result.heatmap), **save_figures(store, folder, {"heatmap": figures["heatmap"]})}))
    yield Output(result.components, output_name="plasticity_components", metadata=results_first(lead, {
        **common, **save_figures(store, folder, {"components": figures["components"]})}))
    qh = result.query_heads
    yield Output(qh, output_name="plasticity_query_heads", metadata=results_first(lead, {
        **common, "heads": len(qh), "heads_sampled": int(qh["sampled"].sum()) if len(qh) else 0,
        "coverage": ", ".join(sorted(set(qh["coverage"].dropna().astype(str)))) if len(qh) else "",
        "positions_per_head": int(qh["n_queries_model"].median()) if qh["n_queries_model"].notna().any() else 0,
        **save_figures(store, folder, {"depth_query_model": figures["depth_query_model"]})}))
    yield Output(result.metrics, output_name="plasticity_metrics", metadata=results_first(lead, {
        **common, "preview": _md(result.metrics[["metric", "key", "value", "lo", "hi", "median", "n_heads"]]
                        .rename(columns=MEAN_MEDIAN), 60)}))
    yield from checks.selected(context, [
        checks.heads_analysed("plasticity_heads", qk_capture, h, opts.allow_partial,
                              "analysis.plasticity.allow_partial (run config options.plasticity.allow_partial)"),
        checks.intervals_contain_values("plasticity_heads", h, HEAD_INTERVALS, ["layer", "q_head"]),
        checks.values_finite("plasticity_metrics", result.metrics),
        checks.intervals_contain_values("plasticity_metrics", result.metrics, [("value", "lo", "hi")],
                                        ["metric", "key"]),
        checks.profile_coverage("plasticity_profiles", result.profiles, h, L, B)])


def _figures(result, model: str, L: int, B: int, record: dict) -> dict:
    from qk_core.plots.geometry import fig_depth_heatmaps
    from qk_core.plots.plasticity import fig_closed_vs_empirical, fig_components, fig_heatmap, fig_profiles

    empty = pd.DataFrame(columns=["layer", "q_head", "tau_tokens", "tau_frac", "ap", "ap_empirical", "status"])
    prof = result.profiles if len(result.profiles) else empty
    return {
        "profiles": fig_profiles(prof, model, L, B, record),
        "heatmap": fig_heatmap(result.heatmap, model, L, B, record),
        "components": fig_components(result.components, model, L, B, record),
        "closed_vs_empirical": fig_closed_vs_empirical(prof, result.heads, model, L, B, record),
        "depth_query_model": fig_depth_heatmaps(result.query_heads, QUERY_PANELS, model,
                                                f"{model}: query model by depth (SPEC 4.1)"),
    }


@asset(
    ins={"qk_capture": AssetIn(), "plasticity_heads": AssetIn(), "plasticity_query_heads": AssetIn(),
         "plasticity_profiles": AssetIn()},
    partitions_def=model_corpus_partitions(),
    group_name=GROUP,
    kinds={"parquet"},
    automation_condition=PER_PAIR,
    description=(
        "How far the sampled protocol's plasticity (the query model of the sampled positions) is from the query "
        "model of every position (SPEC 12.3), per metric: AP of the capture's sampled heads (their key pairs under "
        "both; so the gap is position sampling alone, ± its document jackknife standard error where both analyses "
        "left out the same documents, SPEC 4.6) and the query model (every eligible head under coverage `all`: "
        "head sampling ± its finite-population standard error, flagged beyond 1.96 of them, and position sampling, "
        "one draw's). The other coverage is refitted from the same capture with the recorded options; empty when "
        "the capture holds no moments."),
)
def plasticity_coverage_gap(context: AssetExecutionContext, storage: StorageResource, ray: RayClusterResource,
                            qk_capture: pd.DataFrame, plasticity_heads: pd.DataFrame,
                            plasticity_query_heads: pd.DataFrame,
                            plasticity_profiles: pd.DataFrame) -> Output[pd.DataFrame]:
    """The sampled protocol's AP and query model against every position's, per metric (SPEC 12.3)."""
    model, corpus = split_key(context.partition_key)
    prefixes = sorted(set(qk_capture["capture_prefix"].astype(str)))
    if len(prefixes) != 1:
        raise CaptureError(f"{model}: qk_capture points at {len(prefixes)} captures {prefixes}; expected one")
    heads = [(int(r.layer), int(r.q_head)) for r in qk_capture.sort_values(["layer", "q_head"]).itertuples()]
    placed = on_cpu_worker(coverage.plasticity_coverage_gap, model, storage.get(), prefixes[0], heads,
                           plasticity_heads, plasticity_query_heads, plasticity_profiles, cluster=ray.enabled,
                           ray_log=context.log,
                           name=f"qk_plasticity_coverage_gap:{model}:{corpus}")
    table, note = placed.value
    context.log.info(f"plasticity coverage gap {model} on {corpus}: {note} ({placed.where})")
    return Output(table, metadata=coverage_gap_metadata(table, note))


DECILE_COLUMNS = ["model", "key", "decile_lo", "decile_hi", "decile_mid", "value", "median", "lo", "hi", "n_heads",
                  "L", "B", "options"]


def decile_table(metrics_by_model: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """The ``ap_decile`` rows of every model, with the decile bounds as fractions of L."""
    parts = []
    for model in sorted(metrics_by_model):
        m = metrics_by_model[model]
        d = m[m["metric"] == "ap_decile"].copy()
        if d.empty:
            continue
        bounds = d["key"].str.rstrip("%").str.split("-", expand=True).astype(float) / 100.0
        d["decile_lo"], d["decile_hi"] = bounds[0], bounds[1]
        d["decile_mid"] = (d["decile_lo"] + d["decile_hi"]) / 2
        opts = [json.loads(o) for o in d["options"]]
        d["L"] = [int(o.get("L", 0)) for o in opts]
        d["B"] = [int(o.get("B", 0)) for o in opts]
        parts.append(d)
    if not parts:
        return pd.DataFrame(columns=DECILE_COLUMNS)
    return pd.concat(parts, ignore_index=True)[DECILE_COLUMNS].sort_values(["model", "decile_lo"],
                                                                           ignore_index=True)


@asset(ins={"plasticity_metrics": AssetIn()}, group_name=GROUP, kinds={"parquet"}, automation_condition=AFTER_UPSTREAM)
def plasticity_deciles(storage: StorageResource, plasticity_metrics: dict):
    """Decile profiles (mean AP over heads per tenth of the window) of every model that has them (SPEC 7)."""
    from qk_core.plots.plasticity import fig_deciles

    plasticity_metrics = by_model(plasticity_metrics, registry())  # each model on its first corpus
    table = decile_table(plasticity_metrics)
    meta = save_figures(storage.get(), "plasticity/all_models", {"decile_profiles": fig_deciles(table)})
    wide = table.pivot_table(index="model", columns="key", values="value") if len(table) else pd.DataFrame()
    return Output(table, metadata={"models": int(table["model"].nunique()) if len(table) else 0,
                                   "deciles": table_value(wide, index=True, digits=3) if len(wide)
                                   else MetadataValue.text("(no model yet)"),
                                   "missing_models": MetadataValue.json(sorted(set(registry().model_keys)
                                                                               - set(plasticity_metrics))),
                                   **meta})

