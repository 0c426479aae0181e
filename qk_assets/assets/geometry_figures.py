"""Cross-model geometry figures (SPEC 7): ``geometry_figures``, unpartitioned, over every model partition.

Loads ``pca_metrics``, ``rotation_metrics`` and ``rotation_heads`` of all model partitions that exist
(the IO manager hands over a dict keyed by model) and draws the thesis figures 6.1 (PC roles), 6.2
(|r_q_a| vs |r_k_a|), A.2 (bias_strength per family) and A.3 (bias vs separation per family). Its value
is one row per model with the values the figures show.
"""

import pandas as pd
from dagster import AllPartitionMapping, AssetExecutionContext, AssetIn, MetadataValue, asset

from qk_assets.assets.geometry import GROUP
from qk_assets.automation import AFTER_UPSTREAM
from qk_assets.figures import save_figures
from qk_assets.metadata import table_value
from qk_assets.partitions import by_model, registry
from qk_assets.resources import StorageResource
from qk_core.geometry.summaries import ok_mask, wide_by_model

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
