"""Context extension without training (SPEC 13): retrieval beyond C per (model, corpus) and the comparison of
a base model's variants.

Variants are registry models ``<base>~<name>`` (``[variants.<base>]``, :mod:`qk_core.config.variants`): their
capture and analyses are those of any model. Here:

- ``extension_retrieval`` [model, corpus] (pool ``gpu``), thin over
  :func:`qk_core.extension.retrieval.run_retrieval`: the SPEC 11.1 probe, unintervened, at prompt lengths
  C/2, C, 3C/2, 2C (``analysis.extension``) and the configured depths. Outputs ``extension_trials`` (one row per
  trial), ``extension_accuracy`` (accuracy, Wilson 95%, margin per length and depth, depth = -1 pooled) and
  ``extension_effective_length`` (NoLiMa's rule, threshold an option). On a model that is not a variant, or on
  a corpus other than the variant's first, the outputs are empty and say why (no model is loaded).
- ``extension_comparison`` [model] for a base model: reads every variant's ``extension_accuracy``,
  ``extension_effective_length``, ``plasticity_profiles``, ``rotation_metrics`` and capture (its first corpus,
  SPEC 3 refitted over [C, L) and [C, W)) from the storage root (``AllPartitionMapping``: Dagster has no
  mapping from a base key to its variants' keys) and reports a variant without results as missing. Outputs
  ``extension_comparison`` (per variant),
  ``extension_correlations`` (rank correlations with exact p and n, SPEC 13.3) and ``extension_profiles`` (AP
  per variant in absolute positions), with the figures and the plain statement. Neither asset has an automation
  condition (like the interventions: model forwards, hours on a CPU); ``make demo ARGS="--group extension"``
  materialises them.
"""

import pandas as pd
from dagster import (
    AllPartitionMapping,
    AssetDep,
    AssetExecutionContext,
    AssetIn,
    AssetOut,
    MetadataValue,
    Output,
    multi_asset,
)

from qk_assets import checks
from qk_assets.figures import save_figures
from qk_assets.io_manager import asset_rel
from qk_assets.metadata import results_first, table_value
from qk_assets.options import AnalysisConfig, analysis_options
from qk_assets.partitions import listed_pair, model_corpus_partitions, model_partitions, pair_key, registry
from qk_assets.resources import GPU_POOL, StorageResource, TorchDeviceResource
from qk_core.capture.store import CaptureError
from qk_core.config.options import resolve_options
from qk_core.extension.compare import (
    CORRELATION_COLUMNS,
    VariantInputs,
    ap_profile,
    correlation_rows,
    plain_statement,
    rotation_regions,
    variant_table,
)
from qk_core.extension.retrieval import ACCURACY_COLUMNS, EFFECTIVE_COLUMNS, TRIAL_COLUMNS, run_retrieval
from qk_core.geometry.heads import iter_capture_heads
from qk_core.io.storage import Storage
from qk_core.models.loading import load_model

GROUP = "extension"
RETRIEVAL_OUTPUTS = ("extension_trials", "extension_accuracy", "extension_effective_length")
# per-partition check (qk_assets/checks.py, not blocking): every Wilson interval of extension_accuracy has lo <= hi
CHECKS = checks.check_specs([("extension_accuracy", checks.INTERVALS_FORMED)], model_corpus_partitions())
COMPARISON_INPUTS = ("extension_accuracy", "extension_effective_length", "plasticity_profiles", "rotation_metrics")
CAPTURE = "qk_capture"


@multi_asset(
    outs={
        "extension_trials": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "Retrieval probe beyond the trained context: one row per (length, document, depth, repeat) with the "
            "prompt length, correct, rank and log-prob margin (SPEC 13.2, 11.1).")),
        "extension_accuracy": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "Accuracy (Wilson 95%) and mean margin per prompt length and depth, depth = -1 pooled over depths; "
            "lengths as multiples of C (SPEC 13.2).")),
        "extension_effective_length": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "Effective length (NoLiMa's rule: the longest length with accuracy >= threshold x the accuracy at "
            "the shortest length), with the accuracies behind it (SPEC 13.2).")),
    },
    ins={"corpus": AssetIn()},
    deps=["registry_analysis", "registry_entry"],  # options: analysis.extension; the variant's RoPE override
    partitions_def=model_corpus_partitions(),
    pool=GPU_POOL,
    can_subset=False,
    check_specs=CHECKS,
)
def extension_retrieval(context: AssetExecutionContext, config: AnalysisConfig, storage: StorageResource,
                        device: TorchDeviceResource, corpus: pd.DataFrame):
    """SPEC 13.2 on one variant: probe at lengths around C, accuracy with Wilson intervals, effective length."""
    model, corpus_name, entry = listed_pair(context.partition_key)
    if entry.variant is None or corpus_name != entry.corpus:
        why = (f"'{model}' is not a context-extension variant (SPEC 13.1: declare it under [variants.<base>] in "
               f"{registry().path})" if entry.variant is None else
               f"runs on the variant's first corpus '{entry.corpus}' only, not '{corpus_name}'")
        yield from _not_run(model, corpus_name, why)
        yield from checks.selected(context, [_intervals_check(pd.DataFrame(columns=ACCURACY_COLUMNS))])
        return
    (opts,) = analysis_options(model, config, "extension")
    v = entry.variant
    context.log.info(f"{model}: {v.describe()}; loading the model with its LM head on {device.resolve()}")
    loaded = load_model(entry, device.resolve(), with_head=True)
    res = run_retrieval(loaded, corpus, v.trained_context, entry.window, opts, where=f"{model} on {corpus_name}: ",
                        on_trial=lambda i, n: context.log.info(f"{model}: trial {i}/{n}") if i % 10 == 0 else None)
    eff = pd.DataFrame([{"model": model, **res.effective}], columns=["model", *EFFECTIVE_COLUMNS])
    pooled = res.accuracy[res.accuracy["depth"] < 0]
    lead = {"effective_length": float(res.effective["effective_length"]),
            **{f"accuracy_{int(r.length)}": float(r.accuracy) for r in pooled.itertuples()}}
    common = {"model": model, "corpus": corpus_name, "variant": v.describe(),
              "options": MetadataValue.json(res.options),
              "seconds_per_trial": float(res.trials["seconds"].mean()) if len(res.trials) else float("nan")}
    yield Output(res.trials, output_name="extension_trials", metadata=results_first(lead, {
        **common, "trials": len(res.trials)}))
    yield Output(res.accuracy, output_name="extension_accuracy", metadata=results_first(lead, {
        **common, "preview": table_value(pooled)}))
    yield Output(eff, output_name="extension_effective_length", metadata=results_first(lead, {
        **common, "rule": str(res.effective["reason"])}))
    yield from checks.selected(context, [_intervals_check(res.accuracy)])


def _intervals_check(accuracy: pd.DataFrame):
    table = accuracy.rename(columns={"accuracy": "value", "accuracy_lo": "lo", "accuracy_hi": "hi"})
    return checks.intervals_well_formed("extension_accuracy", table, ("length", "depth"))


def _not_run(model: str, corpus_name: str, why: str) -> list[Output]:
    meta = {"model": model, "corpus": corpus_name, "not_run": why}
    nan = float("nan")
    eff = pd.DataFrame([{"model": model, **dict.fromkeys(EFFECTIVE_COLUMNS, nan), "passing_lengths": "",
                         "non_monotone": False, "reason": f"not run: {why}"}], columns=["model", *EFFECTIVE_COLUMNS])
    frames = {"extension_trials": pd.DataFrame(columns=TRIAL_COLUMNS),
              "extension_accuracy": pd.DataFrame(columns=ACCURACY_COLUMNS), "extension_effective_length": eff}
    return [Output(frames[name], output_name=name, metadata=meta) for name in RETRIEVAL_OUTPUTS]


def _read(storage: Storage, asset: str, model: str, corpus: str) -> pd.DataFrame | None:
    rel = asset_rel([asset], str(pair_key(model, corpus)))
    if not storage.exists(rel):
        return None
    df = storage.read_parquet(rel).to_pandas()
    return df if len(df) else None


def load_variant(storage: Storage, key: str) -> VariantInputs:
    """One variant's inputs on its first corpus (None where not materialised); with its capture, the rotation
    measures refitted over [C, L) for every tested length L > C and over [C, W) (SPEC 13.3)."""
    entry = registry().model(key)
    v = entry.variant
    read = {name: _read(storage, name, key, entry.corpus) for name in (*COMPARISON_INPUTS, CAPTURE)}
    regions = None
    if read[CAPTURE] is not None:
        C, W = v.trained_context, entry.window
        lengths = resolve_options("extension", entry.analysis).prompt_lengths(C, W)
        spans = sorted({(C, int(n)) for n in lengths if n > C} | {(C, W)})
        try:
            regions = rotation_regions((h for _, h in iter_capture_heads(storage, read[CAPTURE])), spans,
                                       resolve_options("rotation", entry.analysis))
        except CaptureError:
            regions = None
    eff = read["extension_effective_length"]
    if eff is not None and not eff["effective_length"].notna().any() and str(eff["reason"].iloc[0]).startswith(
            "not run"):
        eff = None
    return VariantInputs(key=key, name=v.name, type=v.type, factor=v.factor, rope_theta=v.rope_theta,
                         profiles=read["plasticity_profiles"], rotation=read["rotation_metrics"],
                         accuracy=read["extension_accuracy"], effective=eff, regions=regions)


@multi_asset(
    outs={
        "extension_comparison": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "Per variant of a base model: RoPE override, AP over positions < C and over [C, W), bias_strength, "
            "|r_k_a|, plane_var_fraction, split-half stability, accuracy per length, effective length (SPEC 13.3).")),
        "extension_correlations": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "Rank correlation of each geometry measure with retrieval accuracy beyond C across the variants and "
            "their length cells, exact p and n (n >= 3), and the plain statement (SPEC 13.3).")),
        "extension_profiles": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "AP (mean over heads) per variant in absolute positions up to W, C recorded (SPEC 13.3).")),
    },
    deps=[AssetDep(name, partition_mapping=AllPartitionMapping()) for name in (*COMPARISON_INPUTS, CAPTURE)],
    partitions_def=model_partitions(),
    can_subset=False,
)
def extension_comparison(context: AssetExecutionContext, storage: StorageResource):
    """SPEC 13.3 for one base model: its variants side by side, geometry vs retrieval beyond C."""
    from qk_core.plots.extension import (  # matplotlib only when the asset runs
        fig_accuracy_by_depth,
        fig_accuracy_by_length,
        fig_ap_profiles,
        fig_measure_vs_accuracy,
    )

    base = context.partition_key
    reg = registry()
    keys = reg.variants_of(base)
    store = storage.get()
    variants = [load_variant(store, k) for k in keys]
    C = reg.model(keys[0]).variant.trained_context if keys else 0
    W = reg.model(keys[0]).window if keys else 0
    table = variant_table(variants, C, W) if keys else pd.DataFrame(columns=["variant"])
    corr = correlation_rows(variants, C, W) if keys else pd.DataFrame(columns=CORRELATION_COLUMNS)
    statement = plain_statement(base, table if keys else pd.DataFrame(), corr, C)
    corr = corr.assign(base=base, summary=statement) if len(corr) else corr
    prof = pd.concat([ap_profile(v.profiles).assign(variant=v.key, trained_context=C, window=W)
                      for v in variants if v.profiles is not None], ignore_index=True) \
        if any(v.profiles is not None for v in variants) else pd.DataFrame(
            columns=["tau_tokens", "ap", "ap_sd", "n_heads", "variant", "trained_context", "window"])
    missing = {v.key: v.missing() for v in variants if v.missing()}
    figures = {}
    if keys:
        title = f"{base} variants"
        accuracy = {v.name: v.accuracy for v in variants}
        figures = save_figures(store, f"extension/{base}", {
            "ap_profiles": fig_ap_profiles({v.name: v.profiles for v in variants}, title, C, W),
            "accuracy_by_length": fig_accuracy_by_length(accuracy, title, C),
            "accuracy_by_depth": fig_accuracy_by_depth(accuracy, title, C),
            "measure_vs_accuracy": fig_measure_vs_accuracy(table, corr, title)})
    if missing:
        context.log.warning(f"extension_comparison {base}: missing inputs {missing}")
    common = {"base": base, "variants": len(keys), "trained_context": C, "window": W,
              "statement": MetadataValue.md(statement), "missing": MetadataValue.json(missing)}
    lead = {"variants_with_results": sum(1 for v in variants if v.accuracy is not None)}
    yield Output(table, output_name="extension_comparison", metadata=results_first(lead, {
        **common, **figures, "preview": table_value(table)}))
    yield Output(corr, output_name="extension_correlations", metadata=results_first(lead, {
        **common, "preview": table_value(corr.drop(columns=["summary"], errors="ignore"))}))
    yield Output(prof, output_name="extension_profiles", metadata=results_first(lead, {
        **common, **{k: v for k, v in figures.items() if k.startswith("fig_ap_profiles")}}))
