"""Q/K geometry per model partition: combined Q+K PCA (SPEC 2) and planar rotation (SPEC 3).

One multi-asset, ``geometry``, with six outputs: ``pca_heads``, ``pca_layers``, ``pca_metrics``,
``rotation_heads``, ``rotation_layers``, ``rotation_metrics``. It reads the capture one head at a time
(``qk_capture`` lists the heads and where the capture lives) and runs both analyses in one pass
(:func:`qk_core.geometry.rotation.run_geometry`): each head's files are read once and its float64 moments are
shared. Selecting only the PCA or only the rotation outputs runs only that analysis.

Options, lowest to highest precedence: the defaults of :class:`qk_core.geometry.pca.PCAOptions` /
:class:`qk_core.geometry.rotation.RotationOptions`, the registry entry's ``analysis.pca`` / ``analysis.rotation``
tables, the run config (``pca_*`` / ``rotation_*`` fields). They are recorded in every output (``options``
column / JSON) with L, B and the skipped heads.

How far the sampled protocol is from every head at every position (SPEC 12.3): ``geometry_coverage_gap``, per
model partition, compares the published ``pca_heads`` / ``rotation_heads`` with the other coverage computed from
the same capture (:func:`qk_core.geometry.coverage.geometry_coverage_gap`), per metric, the position part with its
document jackknife error (:mod:`qk_core.geometry.jackknife`).

Cross-model geometry figures (SPEC 7): ``geometry_figures``, unpartitioned, over every model partition.

Loads ``pca_metrics``, ``rotation_metrics`` and ``rotation_heads`` of all model partitions that exist
(the IO manager hands over a dict keyed by model) and draws the thesis figures 6.1 (PC roles), 6.2
(|r_q_a| vs |r_k_a|), A.2 (bias_strength per family) and A.3 (bias vs separation per family). Its value
is one row per model with the values the figures show.
"""

import json

import pandas as pd
from dagster import (
    AllPartitionMapping,
    AssetExecutionContext,
    AssetIn,
    AssetOut,
    Config,
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
from qk_core.config.options import PCAOptions, RotationOptions
from qk_core.geometry import coverage
from qk_core.geometry.driver import geometry_of_capture
from qk_core.geometry.pca import PCA_UNITS, TAXONOMY
from qk_core.geometry.rotation import DEFINED_WITH_POSITION_SIGNAL, NO_POSITION_SIGNAL, ROTATION_UNITS, flag_values
from qk_core.geometry.summaries import missing_heads, ok_mask, skipped_summary, wide_by_model
from qk_core.runtime.cluster import on_cpu_worker

GROUP = "geometry"
PCA_OUTS = ("pca_heads", "pca_layers", "pca_metrics")
ROTATION_OUTS = ("rotation_heads", "rotation_layers", "rotation_metrics")
# every output: optional (subsettable), eager for the pairs the registry lists (model_automation_sensor)
OUT = {"group_name": GROUP, "kinds": {"parquet"}, "is_required": False,
       "automation_condition": PER_PAIR}
# per-partition checks (qk_assets/checks.py): heads analysed vs the capture's, finite model values; blocking
CHECKS = checks.check_specs([("pca_heads", checks.HEADS_ANALYSED), ("pca_metrics", checks.VALUES_FINITE),
                             ("rotation_heads", checks.HEADS_ANALYSED), ("rotation_metrics", checks.VALUES_FINITE)],
                            model_corpus_partitions())


class GeometryConfig(AnalysisConfig):
    """Run config: ``options`` for ``pca`` and ``rotation`` (as in the registry), and how the pass runs."""

    plane_points: int = 400  # Q and K rows per head kept for the {a, b}-plane figure
    blas_threads: int = 1  # OpenBLAS threads while analysing (0: leave as is); results do not depend on it


def resolve_options(model_key: str, config: GeometryConfig) -> tuple[PCAOptions, RotationOptions]:
    """Defaults < registry ``analysis.pca`` / ``analysis.rotation`` < run config."""
    pca, rotation = analysis_options(model_key, config, "pca", "rotation")
    return pca, rotation


def units_table(units: dict[str, str]) -> MetadataValue:
    return table_value(pd.DataFrame({"column": list(units), "unit": list(units.values())}))


def _common(heads: pd.DataFrame) -> dict:
    skipped = skipped_summary(heads)
    out = {"options": MetadataValue.json(json.loads(heads["options"].iloc[0]) if len(heads) else {}),
           "heads_ok": int((heads["status"] == "ok").sum()), "heads_skipped": int(sum(skipped.values())),
           "skipped_reasons": MetadataValue.json(skipped),
           "heads_missing": int(sum(missing_heads(heads).values()))}
    if "notes" in heads:
        out["heads_with_notes"] = int((heads["notes"].fillna("") != "").sum())
    return out


def _diagnostics_meta(heads: pd.DataFrame, options: RotationOptions) -> dict:
    """SPEC 3 diagnostics on the materialisation: medians, the share of ok heads passing each (over the heads
    with a verdict) and the share of ok heads with no linear position signal (diagnostic ii)."""
    ok = heads[heads["status"] == "ok"] if len(heads) else heads

    def share(flag: str) -> float:  # over heads with a verdict: "no linear position signal" (None) is neither
        vals = pd.Series(flag_values(ok[flag]) if flag in ok else [], dtype=float)
        return float(vals.mean()) if vals.notna().any() else float("nan")

    out = {}
    for col, flag, thr in (("split_half_cos", "stable_axis", options.stability_min),
                           ("position_capture", "captures_position", options.capture_min)):
        med = float(ok[col].median()) if len(ok) else float("nan")
        out[f"median_{col}"] = MetadataValue.float(med)
        out[f"share_{flag}"] = MetadataValue.float(share(flag))
        out[f"{flag}_threshold"] = MetadataValue.float(thr)
    out["share_diagnostics_pass"] = MetadataValue.float(share("diagnostics_pass"))
    no_signal = float((ok["position_capture_status"] == NO_POSITION_SIGNAL).mean()) \
        if len(ok) and "position_capture_status" in ok else float("nan")
    out["share_no_position_signal"] = MetadataValue.float(no_signal)
    return out


@multi_asset(
    outs={
        "pca_heads": AssetOut(**OUT, description=(
            "One row per head (every eligible head with coverage `all`, the capture's sampled heads with coverage "
            "`sampled`; `coverage`, `n_q`, `n_k`, `n_docs` say what each row rests on and `sampled` marks the "
            "capture's sampled heads, SPEC 12.3): EVR, r_q, r_k per "
            "component (sign rule applied), PC0 taxonomy, "
            "positional budgets, the pooled mean and the components (row-major, n_components x d), counts, "
            "status/reason for heads that could not be analysed, options (SPEC 2).")),
        "pca_layers": AssetOut(**OUT, description=(
            "Per-layer and whole-model summaries of the per-head PCA values: mean, median, quartiles, IQR, "
            "heads used and skipped; taxonomy shares.")),
        "pca_metrics": AssetOut(**OUT, description=(
            "Per-model PCA values in the long metrics format: `pca_share_<class>`, pos_budget_q/k, "
            "pca_pc0_*, pca_evr / pca_abs_r_q / pca_abs_r_k per component (key `pc<j>`).")),
        "rotation_heads": AssetOut(**OUT, description=(
            "One row per head (as pca_heads: `coverage`, `sampled`, `n_q`, `n_k`, `n_docs`): drift axis a, "
            "separation axis "
            "b, alpha_Q/alpha_K (per token and x L), "
            "mu_Q/K^a, mu_Q/K^b, bias_strength (per token, x L), r_q_a, r_k_a, variance fractions, "
            "separation_strength, split-half axis stability and position capture with pass/fail flags "
            "(thresholds in options), optional complement pairs, status/reason/notes, options (SPEC 3).")),
        "rotation_layers": AssetOut(**OUT, description=(
            "Per-layer and whole-model summaries of the per-head rotation values: mean, median, quartiles, "
            "IQR, heads used and skipped.")),
        "rotation_metrics": AssetOut(**OUT, description=(
            "Per-model rotation values in the long metrics format (bias_strength, bias_strength_window, "
            "abs_alpha_k, mu_q_a, abs_r_k_a, abs_r_q_a, separation_strength, plane_var_fraction, ...).")),
    },
    ins={"qk_capture": AssetIn()},
    deps=["registry_analysis"],  # an analysis-option edit re-runs this, not the capture
    partitions_def=model_corpus_partitions(),
    can_subset=True,
    check_specs=CHECKS,
)
def geometry(context: AssetExecutionContext, config: GeometryConfig, storage: StorageResource,
             ray: RayClusterResource, qk_capture: pd.DataFrame):
    """Combined Q+K PCA and planar rotation of one model's heads (every eligible head from the capture's moments
    with coverage "all", the sampled heads' rows with "sampled"; SPEC 2, 3, 12), with figures (SPEC 7)."""
    model, corpus = split_key(context.partition_key)
    selected = set(context.selected_output_names)
    pca_opts, rot_opts = resolve_options(model, config)
    do_pca, do_rot = bool(selected & set(PCA_OUTS)), bool(selected & set(ROTATION_OUTS))
    store = storage.get()
    label = f"geometry {model} on {corpus}"
    placed = on_cpu_worker(  # a CPU task on the Ray cluster when connected (issue 12), else here
        geometry_of_capture, model, store, qk_capture, pca_opts if do_pca else None, rot_opts if do_rot else None,
        keep_points=config.plane_points, blas=config.blas_threads,
        progress=None if ray.enabled else progress_logger(context, label), cluster=ray.enabled, ray_log=context.log,
        name=f"qk_geometry:{model}:{corpus}")
    context.log.info(f"{label}: {len(qk_capture)} heads on {placed.where}")
    out = placed.value
    from qk_core.plots import geometry as plots  # matplotlib only when the asset runs

    if do_pca:
        heads, layers, metrics = out["pca"]
        if skipped_summary(heads):
            context.log.warning(f"pca {model}: skipped heads {skipped_summary(heads)} (status/reason columns)")
        figures = save_figures(store, f"pca/{model}/{corpus}", {
            "pc0_taxonomy": plots.fig_pca_taxonomy(heads, model, pca_opts.taxonomy_low, pca_opts.taxonomy_high),
            "explained_variance": plots.fig_pca_explained_variance(heads, model),
            "depth_pc0": plots.fig_depth_heatmaps(
                heads, [("pc0_r_q", r"PC0 $r_q$ (sign rule: $\geq 0$)", "corr"), ("pc0_r_k", r"PC0 $r_k$", "corr")],
                model, f"{model}: PC0 position correlation by depth"),
        })
        common = _common(heads)
        shares = metrics[metrics["metric"].str.startswith("pca_share_")][["metric", "value", "n_heads"]]
        model_rows = layers[layers["scope"] == "model"].drop(columns=["model", "scope", "layer"])
        outputs = {
            "pca_heads": (heads, {**common, "taxonomy": table_value(shares),
                                  "taxonomy_classes": ", ".join(TAXONOMY),
                                  "units": units_table(PCA_UNITS), **figures}),
            "pca_layers": (layers, {**common, "model_summary": table_value(model_rows)}),
            "pca_metrics": (metrics, {**common, "preview": table_value(
                metrics[["metric", "key", "value", "median", "n_heads", "unit"]].rename(columns=MEAN_MEDIAN),
                max_rows=40)}),
        }
        lead = headline_values(metrics)
        for name, (value, meta) in outputs.items():
            if name in selected:
                yield Output(value, output_name=name, metadata=results_first(lead, meta))
        yield from checks.selected(context, [
            checks.heads_analysed("pca_heads", qk_capture, heads, pca_opts.allow_partial,
                                  "analysis.pca.allow_partial (run config options.pca.allow_partial)"),
            checks.values_finite("pca_metrics", metrics)])
    if do_rot:
        heads, layers, metrics, points = out["rotation"]
        if skipped_summary(heads):
            context.log.warning(f"rotation {model}: skipped heads {skipped_summary(heads)} (status/reason columns)")
        figures = save_figures(store, f"rotation/{model}/{corpus}", {
            "ab_plane": plots.fig_plane_scatter(heads, points, model),
            "diagnostics": plots.fig_rotation_diagnostics(heads, model, rot_opts.stability_min, rot_opts.capture_min),
            "depth_rotation": plots.fig_depth_heatmaps(
                heads, [("abs_r_k_a", r"$|r_{k,a}|$", "abs"), ("bias_strength", "bias_strength (per token)", "signed")],
                model, f"{model}: key drift and bias strength by depth"),
        })
        common = _common(heads)
        main = ["bias_strength", "bias_strength_window", "abs_alpha_k", "mu_q_a", "abs_r_k_a", "abs_r_q_a",
                "separation_strength", "plane_var_fraction", "split_half_cos", "position_capture",
                "share_stable_axis", "share_captures_position", "share_diagnostics_pass", "share_no_position_signal"]
        model_rows = layers[layers["scope"] == "model"].drop(columns=["model", "scope", "layer"])
        outputs = {
            "rotation_heads": (heads, {**common, "units": units_table(ROTATION_UNITS),
                                       **_diagnostics_meta(heads, rot_opts),
                                       **figures}),
            "rotation_layers": (layers, {**common, "model_summary": table_value(model_rows)}),
            "rotation_metrics": (metrics, {**common, "preview": table_value(
                metrics.loc[metrics["metric"].isin(main), ["metric", "value", "median", "n_heads", "unit"]]
                .rename(columns=MEAN_MEDIAN))}),
        }
        lead = headline_values(metrics)
        for name, (value, meta) in outputs.items():
            if name in selected:
                yield Output(value, output_name=name, metadata=results_first(lead, meta))
        yield from checks.selected(context, [
            checks.heads_analysed("rotation_heads", qk_capture, heads, rot_opts.allow_partial,
                                  "analysis.rotation.allow_partial (run config options.rotation.allow_partial)"),
            checks.values_finite("rotation_metrics", metrics, may_be_undefined=DEFINED_WITH_POSITION_SIGNAL)])


class CoverageGapConfig(Config):
    """How the coverage comparison runs."""

    blas_threads: int = 1  # OpenBLAS threads while analysing (0: leave as is); results do not depend on it


@asset(
    ins={"qk_capture": AssetIn(), "pca_heads": AssetIn(), "rotation_heads": AssetIn()},
    partitions_def=model_corpus_partitions(),
    group_name=GROUP,
    kinds={"parquet"},
    automation_condition=PER_PAIR,
    description=(
        "How far the sampled protocol (the sampled heads' sampled positions, the thesis's) is from every eligible "
        "head at every position (SPEC 12.3), per PCA and rotation metric: the model mean under each coverage, the "
        "spread over heads, per-head differences, and the gap of the means split into head sampling (± its "
        "finite-population standard error, flagged beyond 1.96 of them) and position sampling (± its "
        "delete-a-document (group) jackknife standard error, both coverages refitted without each document, or "
        "each document group past capture.moment_groups documents; bench/coverage_gap.py measures its noise over "
        "other draws). The other "
        "coverage is computed from the same capture with the options the published tables record; empty when the "
        "capture holds no moments."),
)
def geometry_coverage_gap(context: AssetExecutionContext, config: CoverageGapConfig, storage: StorageResource,
                          ray: RayClusterResource, qk_capture: pd.DataFrame, pca_heads: pd.DataFrame,
                          rotation_heads: pd.DataFrame) -> Output[pd.DataFrame]:
    """The sampled protocol against every head at every position, per geometry metric (SPEC 12.3)."""
    model, corpus = split_key(context.partition_key)
    placed = on_cpu_worker(coverage.geometry_coverage_gap, model, storage.get(), qk_capture, pca_heads, rotation_heads,
                           blas=config.blas_threads, cluster=ray.enabled, ray_log=context.log,
                           name=f"qk_geometry_coverage_gap:{model}:{corpus}")
    table, note = placed.value
    context.log.info(f"coverage gap {model} on {corpus}: {note} ({placed.where})")
    return Output(table, metadata=coverage_gap_metadata(table, note))


SHOWN = ["pca_share_position_dominated", "pca_share_q_positional", "pca_share_k_positional", "pca_share_content",
         "pca_share_mixed", "abs_r_q_a", "abs_r_k_a", "bias_strength", "bias_strength_window", "separation_strength",
         "plane_var_fraction"]


def _concat(parts: dict) -> pd.DataFrame:
    frames = [df for df in (parts or {}).values() if df is not None and len(df)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def model_families(models: list[str]) -> dict[str, str]:
    reg = registry()
    return {m: (reg.model(m).family if m in reg.models else "unknown") for m in models}


def _registry_order(models: list[str]) -> list[str]:
    known = registry().model_keys
    return sorted(models, key=lambda m: (known.index(m) if m in known else len(known), m))


@asset(
    ins={name: AssetIn(partition_mapping=AllPartitionMapping())
         for name in ("pca_metrics", "rotation_metrics", "rotation_heads")},
    group_name=GROUP,
    kinds={"parquet"},
    automation_condition=AFTER_UPSTREAM,
)
def geometry_figures(context: AssetExecutionContext, storage: StorageResource, pca_metrics: dict,
                     rotation_metrics: dict, rotation_heads: dict) -> pd.DataFrame:
    """Across-model PCA and rotation figures (thesis Figs. 6.1, 6.2, A.2, A.3); one row per model shown."""
    from qk_core.plots.geometry import (
        fig_bias_distributions,
        fig_bias_vs_separation,
        fig_pc_roles,
        fig_rq_rk_bars,
        model_order,
    )

    reg = registry()  # each model on its first corpus
    pca_m, rot_m, rot_h = (_concat(by_model(x, reg)) for x in (pca_metrics, rotation_metrics, rotation_heads))
    models = _registry_order(sorted(set(pca_m.get("model", [])) | set(rot_m.get("model", []))))
    families = model_families(models)
    order = model_order(models, families)
    figures = {}
    if len(pca_m):
        pca_models = [m for m in order if m in set(pca_m["model"])]
        figures["pc_roles"] = fig_pc_roles(pca_m, families, pca_models)
    if len(rot_h):
        rot_models = [m for m in order if m in set(rot_h["model"])]
        figures["rq_rk_bars"] = fig_rq_rk_bars(rot_h, families, rot_models)
        figures["bias_distributions"] = fig_bias_distributions(rot_h, families, rot_models)
        figures["bias_vs_separation"] = fig_bias_vs_separation(rot_h, families, rot_models)
    meta = save_figures(storage.get(), "geometry/all-models", figures)
    table = wide_by_model(pd.concat([pca_m, rot_m], ignore_index=True), SHOWN) if len(pca_m) + len(rot_m) else \
        pd.DataFrame({"model": models})
    table.insert(1, "family", table["model"].map(families))
    if len(rot_h):
        n_ok = rot_h.loc[ok_mask(rot_h)].groupby("model").size()
        table["rotation_heads_ok"] = table["model"].map(n_ok).fillna(0).astype(int)
        table["rotation_heads_skipped"] = table["model"].map(rot_h.groupby("model").size()).fillna(0).astype(int) \
            - table["rotation_heads_ok"]
    table = table.set_index("model").loc[[m for m in order if m in set(table["model"])]].reset_index()
    missing = [m for m in registry().model_keys if m not in set(models)]
    context.add_output_metadata({
        "models": len(models), "models_missing": MetadataValue.json(missing),
        "preview": table_value(table, digits=3), **meta})
    return table
