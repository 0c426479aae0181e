"""Benchmark joins and statistics (SPEC 5 a-c), their figures (SPEC 7), and the automation around them.

- ``benchmark_joins`` (5 a): every metric of every aliased model x the benchmark's overall score.
- ``benchmark_length_joins`` (5 b): plasticity length bins x per-length scores.
- ``benchmark_stats`` (5 c): Pearson / Spearman / Kendall with p and n, per benchmark, suite and mode;
  its materialisation shows the aggregates-vs-score figures (thesis Fig. 6.7) and the per-length ones.

Values: measured where present, the thesis's reference values otherwise; every row says which
(``value_source``). Only the aliases of models the registry lists are joined (the others are logged and
ignored: the alias file covers the study, a registry may hold fewer models). An alias that points at a
benchmark model without scores fails the join, naming the alias file, line and field; the previous join
stays materialised.

Automation, no clicking: ``benchmark_files_sensor`` hashes every file of ``benchmarks/`` and
``reference/`` (local or S3) and materialises the source assets a new, changed or removed file feeds;
``automation_sensor`` (qk_assets.automation) then runs ``model_report`` and the joins through their automation
conditions (eager: as soon as an input updates). Both sensors are on by default. Without a cursor
(first start) the file sensor compares against the hashes recorded on the latest source
materialisations, so restarting the daemon recomputes nothing that is up to date.

The model report (SPEC 5): every model's PCA, rotation and plasticity summaries in one table.

Inputs are the per-model long-format metric assets (``pca_metrics``, ``rotation_metrics``,
``plasticity_metrics``, partitioned by model) — loaded as ``{partition: DataFrame}`` of the partitions
that exist, so a model not analysed yet (or a stage not defined yet) is simply absent — and the thesis's
published values (``reference_metrics``). Both kinds of row are kept, labelled by ``value_source``
(measured | reference); the joins apply the precedence (measured over reference).

Re-materialises by itself whenever any metric partition or the reference values change
(:data:`REPORT_CONDITION`, evaluated by ``automation_sensor``).
"""

import json

import pandas as pd
from dagster import (
    AssetExecutionContext,
    AssetIn,
    AssetKey,
    AssetSelection,
    AutomationCondition,
    Config,
    DagsterInstance,
    DefaultSensorStatus,
    Failure,
    MetadataValue,
    RunRequest,
    SensorEvaluationContext,
    SkipReason,
    asset,
    sensor,
)
from pydantic import Field

from qk_assets.figures import save_figures
from qk_assets.metadata import results_first, table_value
from qk_assets.partitions import by_model, registry
from qk_assets.resources import StorageResource
from qk_core.benchmarks.joins import (
    MEASURED_ASSETS,
    STAT_METRICS,
    THESIS_LBP_MODELS,
    build_model_report,
    compute_stats,
    join_length,
    join_model,
    metric_values,
)
from qk_core.benchmarks.scores import (
    BenchmarkDataError,
    check_aliases,
    classify,
    ensure_seed_files,
    registry_aliases,
    scan_files,
)
from qk_core.io.storage import Storage
from qk_core.stats.correlation import MIN_N

GROUP = "benchmarks"
FIGURE_FOLDER = "benchmarks"
SENSOR_INTERVAL_S = 5
ASSET_OF_KIND = {"scores": "benchmark_scores", "aliases": "model_aliases", "model_types": "benchmark_models",
                 "reference": "reference_metrics"}
AUTOMATED = ("model_report", "benchmark_joins", "benchmark_length_joins", "benchmark_stats")


def _aliases(context: AssetExecutionContext, aliases: pd.DataFrame, scores: pd.DataFrame,
             storage: StorageResource) -> pd.DataFrame:
    """The aliases of the registry's models (others are ignored, and logged), each checked against the scores."""
    uri = storage.get().uri
    kept, ignored = registry_aliases(aliases, registry().model_keys, uri)
    if ignored:
        context.log.info(f"{len(ignored)} alias(es) of models the registry does not list are ignored, e.g. "
                         f"{ignored[0]}")
    problems = check_aliases(kept, scores, uri)
    if problems:
        raise Failure(description="\n".join(problems),
                      metadata={"problems": MetadataValue.md("\n".join(f"- {p}" for p in problems))})
    return kept


def _summary(df: pd.DataFrame) -> MetadataValue:
    groups = df.groupby(["benchmark", "suite", "mode", "value_source"]).agg(
        models=("model", "nunique"), rows=("model", "size"))
    return table_value(groups, index=True)


@asset(group_name=GROUP, kinds={"parquet"}, automation_condition=AutomationCondition.eager())
def benchmark_joins(context: AssetExecutionContext, storage: StorageResource, model_report: pd.DataFrame,
                    benchmark_scores: pd.DataFrame, model_aliases: pd.DataFrame,
                    benchmark_models: pd.DataFrame) -> pd.DataFrame:
    """SPEC 5 a: per model, every metric (measured, else reference) x the benchmark overall score."""
    aliases = _aliases(context, model_aliases, benchmark_scores, storage)
    df = join_model(metric_values(model_report), aliases, benchmark_scores, benchmark_models)
    context.add_output_metadata({"rows": len(df), "models": df["model"].nunique(), "summary": _summary(df)})
    return df


@asset(group_name=GROUP, kinds={"parquet"}, automation_condition=AutomationCondition.eager())
def benchmark_length_joins(context: AssetExecutionContext, storage: StorageResource, model_report: pd.DataFrame,
                           benchmark_scores: pd.DataFrame, model_aliases: pd.DataFrame) -> pd.DataFrame:
    """SPEC 5 b: per model and length, plasticity length bin x the benchmark score at that length."""
    aliases = _aliases(context, model_aliases, benchmark_scores, storage)
    df = join_length(metric_values(model_report), aliases, benchmark_scores)
    context.add_output_metadata({"rows": len(df), "models": df["model"].nunique(), "summary": _summary(df)})
    return df


class BenchmarkStatsConfig(Config):
    """Which aggregates are correlated with the overall score, and the named model subsets (scopes)."""

    metrics: list[str] = Field(default_factory=lambda: list(STAT_METRICS))
    scopes: dict[str, list[str]] = Field(default_factory=lambda: {"thesis": list(THESIS_LBP_MODELS)})


def _stem(kind: str, bench: str, suite: str, *parts: str) -> str:
    """A readable figure name: kind, benchmark, suite (when it differs from the benchmark), mode, ..."""
    from qk_core.plots.benchmarks import slug  # matplotlib only when the figures are drawn

    words = [kind, slug(bench)] + ([slug(suite, 32)] if slug(suite) != slug(bench) else []) + [slug(p) for p in parts]
    return "_".join(words)


def _unique(figs: dict[str, object], name: str) -> str:
    """``name``, or ``name-2``, ``name-3``, ... when two groups slug alike (readable, collision-free)."""
    out, i = name, 2
    while out in figs:
        out, i = f"{name}-{i}", i + 1
    return out


def _figures(jm: pd.DataFrame, jl: pd.DataFrame, stats: pd.DataFrame, cfg: BenchmarkStatsConfig) -> dict:
    from qk_core.plots.benchmarks import fig_length, fig_scores_vs_metrics  # matplotlib only when the asset runs

    figs: dict[str, object] = {}
    pref = stats[stats["value_basis"] == "preferred"]
    across = pref[pref["analysis"] == "across_models"]
    for (bench, suite, mode, basis), st in across.groupby(["benchmark", "suite", "mode", "score_basis"], sort=True):
        if st["n"].max() < MIN_N:
            continue
        g = jm[(jm["benchmark"] == bench) & (jm["suite"] == suite) & (jm["mode"] == mode)
               & (jm["score_basis"] == basis)]
        title = f"{bench} ({mode}) overall score vs plasticity / bias aggregates — suite: {suite}; score: {basis}"
        figs[_unique(figs, _stem("scores", bench, suite, mode))] = fig_scores_vs_metrics(
            g, st, metrics=list(cfg.metrics), scopes=dict(cfg.scopes), title=title)
    per = pref[pref["analysis"] != "across_models"]
    for (bench, suite, mode, metric), st in per.groupby(["benchmark", "suite", "mode", "metric"], sort=True):
        g = jl[(jl["benchmark"] == bench) & (jl["suite"] == suite) & (jl["mode"] == mode)
               & (jl["length_metric"] == metric)]
        if g.empty or st["n"].max() < MIN_N:
            continue
        title = f"{bench} ({mode}) per-length score vs {metric} — suite: {suite}"
        figs[_unique(figs, _stem("length", bench, suite, mode, metric))] = fig_length(
            g, st, title=title)
    return figs


def statistic_values(headline: pd.DataFrame, metric: str = "ap_drop") -> dict[str, float]:
    """The headline statistic as plain floats: ``metric`` against the first benchmark's overall score over all
    matched models (Spearman rho and its p, Pearson r, n), as the report's findings state it."""
    rows = headline[headline["metric"] == metric]
    if "scope" in rows.columns and (rows["scope"] == "all").any():
        rows = rows[rows["scope"] == "all"]
    if not len(rows):
        return {}
    r = rows.sort_values(["benchmark", "mode"]).iloc[0]
    return {f"{metric}_spearman_rho": float(r["spearman_rho"]), f"{metric}_spearman_p": float(r["spearman_p"]),
            f"{metric}_pearson_r": float(r["pearson_r"]), "n_models": int(r["n"])}


@asset(group_name=GROUP, kinds={"parquet"}, automation_condition=AutomationCondition.eager())
def benchmark_stats(context: AssetExecutionContext, config: BenchmarkStatsConfig, storage: StorageResource,
                    model_report: pd.DataFrame, benchmark_scores: pd.DataFrame, model_aliases: pd.DataFrame,
                    benchmark_joins: pd.DataFrame, benchmark_length_joins: pd.DataFrame) -> pd.DataFrame:
    """SPEC 5 c: correlations with p-values and n, per benchmark / suite / mode, never mixing them."""
    aliases = _aliases(context, model_aliases, benchmark_scores, storage)
    df = compute_stats(model_report, aliases, benchmark_scores, metrics=config.metrics, scopes=config.scopes)
    st = storage.get()
    figs = _figures(benchmark_joins, benchmark_length_joins, df, config)
    meta = save_figures(st, FIGURE_FOLDER, figs)
    keep = {f"figures/{FIGURE_FOLDER}/{name}.{ext}" for name in figs for ext in ("png", "pdf")}
    for rel in st.ls(f"figures/{FIGURE_FOLDER}"):
        if rel not in keep:  # a suite that is gone leaves no stale figure behind
            st.delete(rel)
    headline = df[(df["analysis"] == "across_models") & (df["value_basis"] == "preferred") & (df["n"] >= MIN_N)]
    cols = ["benchmark", "suite", "mode", "scope", "metric", "n", "pearson_r", "pearson_p", "spearman_rho",
            "spearman_p", "spearman_permutations", "kendall_tau", "kendall_p"]
    context.add_output_metadata(results_first(statistic_values(headline), {
        **meta, "rows": len(df),
        "headline": table_value(headline[cols], digits=3),
    }))
    return df


# ---- sensors ------------------------------------------------------------------------------------
def baseline(instance: DagsterInstance, st: Storage) -> dict[str, dict[str, str]]:
    """File hashes behind the latest materialisation of each source asset (its ``files`` metadata).

    A sensor without a cursor (first start, reset) compares against these, so files the stored
    assets were already computed from do not trigger a run; anything else counts as new.
    """
    prefix = st.uri("").rstrip("/") + "/"
    out: dict[str, dict[str, str]] = {}
    for name in ASSET_OF_KIND.values():
        event = instance.get_latest_materialization_event(AssetKey(name))
        mat = event.asset_materialization if event else None
        files = mat.metadata.get("files") if mat else None
        for uri, sha in (getattr(files, "value", None) or {}).items():
            if uri.startswith(prefix):
                out[uri[len(prefix):]] = {"token": "", "sha256": sha}
    return out


@sensor(
    name="benchmark_files_sensor",
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=DefaultSensorStatus.RUNNING,
    target=AssetSelection.keys(*ASSET_OF_KIND.values()),
    description="Materialises the benchmark source assets when a file under benchmarks/ or reference/ is "
                "added, changed (by content hash) or removed, local or S3.",
)
def benchmark_files_sensor(context: SensorEvaluationContext, storage: StorageResource) -> RunRequest | SkipReason:
    st = storage.get()
    ensure_seed_files(st)
    previous = json.loads(context.cursor) if context.cursor else baseline(context.instance, st)
    state, changed = scan_files(st, previous)
    if not changed:
        return SkipReason(f"no benchmark or reference file changed ({len(state)} files)")
    targets = sorted({ASSET_OF_KIND[classify(rel)] for rel in changed})
    context.update_cursor(json.dumps(state, sort_keys=True))
    context.log.info(f"changed: {changed} -> {targets}")
    return RunRequest(asset_selection=[AssetKey(t) for t in targets],
                      tags={"qk/trigger": "benchmark-files", "qk/changed": json.dumps(changed)[:1000]})

SENSORS = [benchmark_files_sensor]


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
    measured_models = set(df.loc[df["value_source"] == "measured", "model"])
    lead = {"n_models_measured": len(measured_models), "n_models_reference": len(set(df["model"]) - measured_models)}
    context.add_output_metadata(results_first(lead, {
        "partitions_read": MetadataValue.json({k: sorted(v) for k, v in measured.items()}),
        "models_measured": MetadataValue.json(sorted(df.loc[df["value_source"] == "measured", "model"].unique())),
        "models_reference": MetadataValue.json(sorted(df.loc[df["value_source"] == "reference", "model"].unique())),
        "counts": table_value(counts, index=True),
        "rows": len(df),
    }))
    return df
