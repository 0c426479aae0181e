"""Combined Q+K PCA per head (SPEC 2): ``pca_heads``, ``pca_layers``, ``pca_metrics`` per model partition.

Reads the capture one head at a time (``qk_capture`` lists the heads and where the capture lives) and
calls :func:`qk_core.pca.run_pca`. Options, lowest to highest precedence: the defaults of
:class:`qk_core.pca.PCAOptions`, the registry entry's ``analysis.pca`` table, the run config. They are
recorded in every output (``options`` column / JSON) together with L, B and the skipped heads.
"""

import json

import pandas as pd
from dagster import AssetExecutionContext, AssetIn, AssetOut, Config, MetadataValue, Output, multi_asset

from qk_assets.figures import save_figures
from qk_assets.partitions import model_partitions, registry
from qk_assets.resources import StorageResource
from qk_core.blas import blas_threads
from qk_core.pca import PCA_UNITS, TAXONOMY, PCAOptions, iter_capture_heads, run_pca
from qk_core.summaries import skipped_summary

GROUP = "geometry"


class PCAConfig(Config):
    """Run-time overrides of the PCA options; unset fields keep the registry / default values."""

    n_components: int | None = None
    sign_threshold: float | None = None
    min_rows: int | None = None
    blas_threads: int = 1  # OpenBLAS threads while analysing (0: leave as is); results do not depend on it


def analysis_overrides(model_key: str, section: str) -> dict:
    """The registry's ``analysis.<section>`` table of a model ({} when absent or not in the registry)."""
    reg = registry()
    if model_key not in reg.models:
        return {}
    raw = reg.model(model_key).analysis.get(section, {})
    if not isinstance(raw, dict):
        raise ValueError(f"{reg.path}: model '{model_key}', field 'analysis.{section}' must be a table")
    return dict(raw)


def logged(context: AssetExecutionContext, items, total: int, label: str):
    """Pass items through, logging progress every ~10 %."""
    step = max(1, total // 10)
    for i, item in enumerate(items, 1):
        if i % step == 0 or i == total:
            context.log.info(f"{label}: {i}/{total} heads")
        yield item


def units_markdown(units: dict[str, str]) -> str:
    return "| column | unit |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in units.items())


@multi_asset(
    outs={
        "pca_heads": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "One row per sampled head: EVR, r_q, r_k per component (sign rule applied), PC0 taxonomy, "
            "positional budgets, the pooled mean and the components (row-major, n_components x d), counts, "
            "status/reason for heads that could not be analysed, options (SPEC 2).")),
        "pca_layers": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "Per-layer and whole-model summaries of the per-head PCA values: mean, median, quartiles, IQR, "
            "heads used and skipped; taxonomy shares.")),
        "pca_metrics": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "Per-model PCA values in the long metrics format: pca_share_<class>, pos_budget_q/k, "
            "pca_pc0_*, pca_evr / pca_abs_r_q / pca_abs_r_k per component (key pc<j>).")),
    },
    ins={"qk_capture": AssetIn()},
    partitions_def=model_partitions(),
    can_subset=False,
)
def pca(context: AssetExecutionContext, config: PCAConfig, storage: StorageResource, qk_capture: pd.DataFrame):
    """Combined Q+K PCA of every sampled head of one model (SPEC 2), with figures (SPEC 7)."""
    model = context.partition_key
    overrides = {k: v for k, v in config.model_dump().items() if v is not None and k != "blas_threads"}
    options = PCAOptions.from_dict({**analysis_overrides(model, "pca"), **overrides})
    store = storage.get()
    heads_iter = logged(context, iter_capture_heads(store, qk_capture), len(qk_capture), f"pca {model}")
    with blas_threads(config.blas_threads):
        heads, layers, metrics = run_pca(model, heads_iter, options)
    skipped = skipped_summary(heads)
    if skipped:
        context.log.warning(f"pca {model}: skipped heads {skipped}; see the status/reason columns")
    figures = save_figures(store, f"pca/{model}", _figures(heads, model, options))
    model_rows = layers[layers["scope"] == "model"].drop(columns=["model", "scope", "layer"])
    shares = metrics[metrics["metric"].str.startswith("pca_share_")][["metric", "value", "n_heads"]]
    common = {"options": MetadataValue.json(json.loads(heads["options"].iloc[0]) if len(heads) else {}),
              "heads_ok": int((heads["status"] == "ok").sum()), "heads_skipped": int(sum(skipped.values())),
              "skipped_reasons": MetadataValue.json(skipped)}
    yield Output(heads, output_name="pca_heads", metadata={
        **common, "taxonomy": MetadataValue.md(shares.to_markdown(index=False)),
        "units": MetadataValue.md(units_markdown(PCA_UNITS)), "taxonomy_classes": ", ".join(TAXONOMY),
        **figures})
    yield Output(layers, output_name="pca_layers", metadata={
        **common, "model_summary": MetadataValue.md(model_rows.to_markdown(index=False, floatfmt=".4g"))})
    yield Output(metrics, output_name="pca_metrics", metadata={
        **common, "preview": MetadataValue.md(
            metrics[["metric", "key", "value", "median", "n_heads", "unit"]].head(40).to_markdown(
                index=False, floatfmt=".4g"))})


def _figures(heads: pd.DataFrame, model: str, options: PCAOptions) -> dict:
    from qk_core.plots.geometry import fig_depth_heatmaps, fig_pca_explained_variance, fig_pca_taxonomy

    return {
        "pc0_taxonomy": fig_pca_taxonomy(heads, model, options.taxonomy_low, options.taxonomy_high),
        "explained_variance": fig_pca_explained_variance(heads, model),
        "depth_pc0": fig_depth_heatmaps(
            heads, [("pc0_r_q", r"PC0 $r_q$ (sign rule: $\geq 0$)", "corr"), ("pc0_r_k", r"PC0 $r_k$", "corr")],
            model, f"{model}: PC0 position correlation by depth"),
    }
