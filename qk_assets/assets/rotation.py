"""Planar rotation per head (SPEC 3): ``rotation_heads``, ``rotation_layers``, ``rotation_metrics`` per model.

Reads the capture one head at a time and calls :func:`qk_core.rotation.run_rotation`. Options, lowest to
highest precedence: the defaults of :class:`qk_core.rotation.RotationOptions`, the registry entry's
``analysis.rotation`` table, the run config. Slopes and bias are stored per token and window-normalised
(x L); the options, L and B are recorded in every output.
"""

import json

import pandas as pd
from dagster import AssetExecutionContext, AssetIn, AssetOut, Config, MetadataValue, Output, multi_asset

from qk_assets.assets.pca import GROUP, analysis_overrides, logged, units_markdown
from qk_assets.figures import save_figures
from qk_assets.partitions import model_partitions
from qk_assets.resources import StorageResource
from qk_core.blas import blas_threads
from qk_core.pca import iter_capture_heads
from qk_core.rotation import ROTATION_UNITS, RotationOptions, run_rotation
from qk_core.summaries import skipped_summary


class RotationConfig(Config):
    """Run-time overrides of the rotation options; unset fields keep the registry / default values."""

    separation: str | None = None  # "centroid" (default) or "eigen"
    complement: bool | None = None
    complement_pairs: int | None = None
    min_rows: int | None = None
    min_pairs: int | None = None
    plane_points: int = 400  # Q and K rows per head kept for the {a, b}-plane figure
    blas_threads: int = 1  # OpenBLAS threads while analysing (0: leave as is); results do not depend on it


@multi_asset(
    outs={
        "rotation_heads": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "One row per sampled head: drift axis a, separation axis b, alpha_Q/alpha_K (per token and x L), "
            "mu_Q/K^a, mu_Q/K^b, bias_strength (per token, x L), r_q_a, r_k_a, variance fractions, "
            "separation_strength, orthogonal-complement check, optional complement pairs, status/reason/notes, "
            "options (SPEC 3).")),
        "rotation_layers": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "Per-layer and whole-model summaries of the per-head rotation values: mean, median, quartiles, "
            "IQR, heads used and skipped.")),
        "rotation_metrics": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "Per-model rotation values in the long metrics format (bias_strength, bias_strength_window, "
            "abs_alpha_k, mu_q_a, abs_r_k_a, abs_r_q_a, separation_strength, plane_var_fraction, ...).")),
    },
    ins={"qk_capture": AssetIn()},
    partitions_def=model_partitions(),
    can_subset=False,
)
def rotation(context: AssetExecutionContext, config: RotationConfig, storage: StorageResource,
             qk_capture: pd.DataFrame):
    """Planar rotation of every sampled head of one model (SPEC 3), with figures (SPEC 7)."""
    model = context.partition_key
    run_only = ("plane_points", "blas_threads")
    overrides = {k: v for k, v in config.model_dump().items() if v is not None and k not in run_only}
    options = RotationOptions.from_dict({**analysis_overrides(model, "rotation"), **overrides})
    store = storage.get()
    heads_iter = logged(context, iter_capture_heads(store, qk_capture), len(qk_capture), f"rotation {model}")
    with blas_threads(config.blas_threads):
        heads, layers, metrics, points = run_rotation(model, heads_iter, options, keep_points=config.plane_points)
    skipped = skipped_summary(heads)
    if skipped:
        context.log.warning(f"rotation {model}: skipped heads {skipped}; see the status/reason columns")
    figures = save_figures(store, f"rotation/{model}", _figures(heads, points, model))
    model_rows = layers[layers["scope"] == "model"].drop(columns=["model", "scope", "layer"])
    main = ["bias_strength", "bias_strength_window", "abs_alpha_k", "mu_q_a", "abs_r_k_a", "abs_r_q_a",
            "separation_strength", "plane_var_fraction", "orth_check"]
    common = {"options": MetadataValue.json(json.loads(heads["options"].iloc[0]) if len(heads) else {}),
              "heads_ok": int((heads["status"] == "ok").sum()), "heads_skipped": int(sum(skipped.values())),
              "skipped_reasons": MetadataValue.json(skipped),
              "heads_with_notes": int((heads["notes"].fillna("") != "").sum()) if "notes" in heads else 0}
    yield Output(heads, output_name="rotation_heads", metadata={
        **common, "units": MetadataValue.md(units_markdown(ROTATION_UNITS)),
        "max_orth_check": float(heads["orth_check"].max()) if len(heads) else float("nan"), **figures})
    yield Output(layers, output_name="rotation_layers", metadata={
        **common, "model_summary": MetadataValue.md(model_rows.to_markdown(index=False, floatfmt=".4g"))})
    yield Output(metrics, output_name="rotation_metrics", metadata={
        **common, "preview": MetadataValue.md(
            metrics.loc[metrics["metric"].isin(main), ["metric", "value", "median", "n_heads", "unit"]]
            .to_markdown(index=False, floatfmt=".4g"))})


def _figures(heads: pd.DataFrame, points: dict, model: str) -> dict:
    from qk_core.plots.geometry import fig_depth_heatmaps, fig_plane_scatter

    return {
        "ab_plane": fig_plane_scatter(heads, points, model),
        "depth_rotation": fig_depth_heatmaps(
            heads, [("abs_r_k_a", r"$|r_{k,a}|$", "abs"), ("bias_strength", "bias_strength (per token)", "signed")],
            model, f"{model}: key drift and bias strength by depth"),
    }
