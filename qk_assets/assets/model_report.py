"""The model report (SPEC 5): every model's PCA, rotation and plasticity summaries in one table.

Inputs are the per-model long-format metric assets (``pca_metrics``, ``rotation_metrics``,
``plasticity_metrics``, partitioned by model) — loaded as ``{partition: DataFrame}`` of the partitions
that exist, so a model not analysed yet (or a stage not defined yet) is simply absent — and the thesis's
published values (``reference_metrics``). Both kinds of row are kept, labelled by ``value_source``
(measured | reference); the joins apply the precedence (measured over reference).

Re-materialises by itself whenever any metric partition or the reference values change
(:data:`REPORT_CONDITION`, evaluated by ``automation_sensor``).
"""

import pandas as pd
from dagster import (
    AssetExecutionContext,
    AssetIn,
    AssetSelection,
    AutomationCondition,
    Failure,
    MetadataValue,
    asset,
)

from qk_assets.metadata import table_value
from qk_assets.partitions import by_model, registry
from qk_core.benchmarks.joins import MEASURED_ASSETS, build_model_report
from qk_core.benchmarks.scores import BenchmarkDataError

METRIC_ASSETS = tuple(MEASURED_ASSETS)

# Eager, except that missing metric partitions (models not analysed yet) do not block it.
REPORT_CONDITION = (
    (AutomationCondition.newly_missing() | AutomationCondition.any_deps_updated()).since_last_handled()
    & ~AutomationCondition.any_deps_missing().ignore(AssetSelection.keys(*METRIC_ASSETS))
    & ~AutomationCondition.any_deps_in_progress()
    & ~AutomationCondition.in_progress()
).with_label("eager (tolerates missing metric partitions)")


def _measured(frames: object) -> dict[str, pd.DataFrame]:
    """The IO manager's value for a metric input ({partition: frame}) narrowed to each model on its first
    corpus (the corpus the benchmark joins use), keyed ``<model>/<corpus>`` (where the value is stored)."""
    reg = registry()
    return {f"{m}/{reg.model(m).corpus}": df for m, df in by_model(frames, reg).items()}


@asset(
    group_name="benchmarks",
    kinds={"parquet"},
    automation_condition=REPORT_CONDITION,
    ins={
        **{name: AssetIn(key=name, metadata={"allow_missing": True}) for name in METRIC_ASSETS},
        "reference_metrics": AssetIn(key="reference_metrics"),
    },
)
def model_report(context: AssetExecutionContext, pca_metrics: object, rotation_metrics: object,
                 plasticity_metrics: object, reference_metrics: pd.DataFrame) -> pd.DataFrame:
    """Every model's metrics, measured and reference, in the long format plus analysis / value_source / source."""
    measured = {"pca_metrics": _measured(pca_metrics), "rotation_metrics": _measured(rotation_metrics),
                "plasticity_metrics": _measured(plasticity_metrics)}
    try:
        df = build_model_report(measured, reference_metrics)
    except BenchmarkDataError as exc:
        raise Failure(description=str(exc)) from exc
    counts = df.groupby(["value_source", "analysis"]).agg(models=("model", "nunique"), rows=("value", "size"))
    context.add_output_metadata({
        "partitions_read": MetadataValue.json({k: sorted(v) for k, v in measured.items()}),
        "models_measured": MetadataValue.json(sorted(df.loc[df["value_source"] == "measured", "model"].unique())),
        "models_reference": MetadataValue.json(sorted(df.loc[df["value_source"] == "reference", "model"].unique())),
        "counts": table_value(counts, index=True),
        "rows": len(df),
    })
    return df
