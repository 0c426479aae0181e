"""Is the geometry the model's or the text's? The cross-corpus asset per model (SPEC 10).

Partitioned by the ``model`` dimension alone. For a model whose registry entry lists two or more corpora it
reads, for every listed corpus, that (model, corpus) pair's capture, ``rotation_heads``, ``plasticity_pairs`` and
``plasticity_profiles`` (whose ``ap_loo`` holds plasticity's leave-one-out refits: read, not refitted again) from the
storage root and calls :func:`qk_core.cross_corpus.compare.compare_corpora`. Outputs:

- ``cross_corpus_metrics``: AP_overall, AP_drop, bias_strength per corpus with 95% intervals, and the
  difference of every corpus to the first one with an interval (documents left out within each corpus), its
  verdict and a statement with the numbers; every interval follows the model's plasticity ``interval`` option:
  ``jackknife_t`` (default; SPEC 4.6, 10 revised: query model refitted, calibrated inflation, "text" from a test
  with a calibrated false-positive rate) or, for ``percentile``, the basic bootstrap interval (column
  ``interval``; why: :mod:`qk_core.cross_corpus.compare`), with the bootstrap bias (``boot_bias``), z0 and the
  plain percentile interval beside it; figure: values and differences;
- ``cross_corpus_correlations``: Spearman rho (exact / Monte Carlo p, n) over heads of per-head AP_overall and
  bias_strength between corpora, and the shares of their variance that are the head's (the model's), the
  corpus's (the text's) and the rest; figure: per-head scatter;
- ``cross_corpus_profiles``: the mean plasticity profile over heads per corpus with its band; figure: the
  profiles on one axis;
- ``cross_corpus_heads``: per head and corpus: AP_overall, AP_drop, bias_strength;
- ``cross_corpus_verdicts``: every statement, one row each (the report shows these).

Dependencies map a model to its (model, corpus) partitions (``MultiToSingleDimensionPartitionMapping`` on
the ``model`` dimension, built in), so an update of any of them that the registry lists re-runs this model's
comparison (``automation_sensor``; :data:`CONDITION` requests only models that list two or more corpora).
The grid also holds corpora the model is not captured on; the asset reads the
registry's corpora itself and reports one without results as missing instead of failing. A model with one
corpus gets empty tables and a verdict row saying so. Bootstrap resamples, seed and interval mass are the
model's plasticity options (registry ``analysis.plasticity``).
"""

import numpy as np
import pandas as pd
from dagster import (
    AssetExecutionContext,
    AssetOut,
    AssetSelection,
    AutomationCondition,
    MetadataValue,
    Output,
    multi_asset,
)

from qk_assets import checks
from qk_assets.automation import ComparedModel, RegistryListed, deps_updated
from qk_assets.figures import save_figures
from qk_assets.io_manager import asset_rel
from qk_assets.metadata import results_first, table_value
from qk_assets.partitions import model_partitions, pair_key, registry
from qk_assets.resources import StorageResource
from qk_core.capture.store import CaptureError, CaptureReader
from qk_core.config.options import resolve_options
from qk_core.cross_corpus.compare import PAIR_COLUMNS, CorpusInputs, CrossCorpusOptions, compare_corpora
from qk_core.io.storage import Storage, StorageError
from qk_core.plasticity.analysis import CaptureQuerySums

GROUP = "cross_corpus"
CAPTURE = "qk_capture"
UPSTREAM = (CAPTURE, "rotation_heads", "plasticity_pairs", "plasticity_profiles")

# For the models that list two or more corpora, after one of the model's listed (model, corpus) analyses
# changes, once nothing upstream runs; a new capture alone does not trigger it (its analyses will), a corpus
# without results does not block it, and a model with one corpus is never requested (nothing to compare).
CONDITION = (
    ComparedModel()
    & deps_updated(RegistryListed(), ignore=AssetSelection.assets(CAPTURE)).since_last_handled()
    & ~AutomationCondition.any_deps_in_progress()
    & ~AutomationCondition.in_progress()
).with_label("models with two or more corpora, after their listed analyses update (tolerates missing ones)")
OUT = {"group_name": GROUP, "kinds": {"parquet"}, "automation_condition": CONDITION}
# per-partition (per model) checks, qk_assets/checks.py: finite values (blocking), intervals lo <= hi
CHECKS = checks.check_specs([("cross_corpus_metrics", checks.VALUES_FINITE),
                             ("cross_corpus_metrics", checks.INTERVALS_FORMED)], model_partitions())


def _read(storage: Storage, asset: str, model: str, corpus: str, columns: list[str] | None = None,
          if_present: bool = False) -> pd.DataFrame | None:
    """One pair's table (its ``columns``; ``if_present``: those of them the table has), None when not materialised."""
    rel = asset_rel([asset], str(pair_key(model, corpus)))
    if not storage.exists(rel):
        return None
    if columns is not None and if_present:
        return storage.with_parquet_file(
            rel, lambda pf: pf.read(columns=[c for c in columns if c in pf.schema_arrow.names])).to_pandas()
    return storage.read_parquet(rel, columns=columns).to_pandas()


def load_corpus(storage: Storage, model: str, corpus: str) -> tuple[CorpusInputs | None, str]:
    """One (model, corpus) pair's inputs, or None and why they are missing."""
    capture = _read(storage, CAPTURE, model, corpus)
    rotation = _read(storage, "rotation_heads", model, corpus, ["layer", "q_head", "status", "bias_strength"])
    pairs = _read(storage, "plasticity_pairs", model, corpus, [*PAIR_COLUMNS, "t_i", "t_j"])
    absent = [n for n, v in ((CAPTURE, capture), ("rotation_heads", rotation), ("plasticity_pairs", pairs))
              if v is None]
    if absent:
        return None, f"{', '.join(absent)} not materialised for {pair_key(model, corpus)}"
    prefixes = sorted(set(capture["capture_prefix"].astype(str))) if len(capture) else []
    if len(prefixes) != 1:
        return None, f"qk_capture[{pair_key(model, corpus)}] points at {len(prefixes)} captures {prefixes}"
    coverage = _read(storage, "plasticity_heads", model, corpus, ["coverage"])
    try:
        reader = CaptureReader(storage, prefixes[0])
        doc_ids = reader.doc_tokens()["example_id"].to_numpy()
        # the plasticity refits follow plasticity's query model: every position's (coverage "all") or the rows'
        every = coverage is not None and set(coverage["coverage"]) == {"all"} and reader.moment_groups() > 0
        sums = CaptureQuerySums(reader) if every else None
    except (CaptureError, StorageError) as exc:
        return None, f"capture {prefixes[0]} cannot be read ({exc})"
    # bias_strength is resampled from the capture's rows, so over the heads it sampled (coverage "all" of
    # rotation_heads lists every eligible head)
    rotation = rotation.merge(reader.heads()[["layer", "q_head"]], on=["layer", "q_head"])
    # its refits (ap_loo), where it has them
    loo = _read(storage, "plasticity_profiles", model, corpus, ["layer", "q_head", "bucket", "ap_loo"], if_present=True)
    return CorpusInputs(corpus, doc_ids, pairs, rotation, reader.window, reader.bucket, reader.read_head, sums,
                        loo), ""


def difference_values(metrics: pd.DataFrame) -> dict[str, float]:
    """The between-corpus differences of the model values as plain floats (``<metric>_difference``, the first
    corpus pair) and ``n_heads``: what a cross-corpus materialisation leads with."""
    out: dict[str, float] = {}
    if not len(metrics) or "kind" not in metrics.columns:
        return out
    diffs = metrics[metrics["kind"] == "difference"]
    for r in diffs.drop_duplicates("metric").itertuples():
        if np.isfinite(r.value):
            out[f"{r.metric}_difference"] = float(r.value)
    if len(diffs):
        out["n_heads"] = int(diffs["n_heads"].max())
    return out


@multi_asset(
    outs={
        "cross_corpus_metrics": AssetOut(**OUT, description=(
            "AP_overall, AP_drop, bias_strength per corpus with 95% intervals, and the between-corpus differences "
            "with intervals (delete-one-document jackknife-t within each corpus, query model refitted, inflation "
            "calibrated on planted worlds; \"text\" only where that test rejects equality; the document bootstrap's "
            "z0, bias and percentile interval beside each value), verdicts and statements (SPEC 4.6, 10).")),
        "cross_corpus_correlations": AssetOut(**OUT, description=(
            "Spearman rho over heads (exact / Monte Carlo p, n) of per-head AP_overall and bias_strength between "
            "corpora; shares of their variance that are the head's, the corpus's and the rest (SPEC 10).")),
        "cross_corpus_profiles": AssetOut(**OUT, description=(
            "Mean plasticity profile over heads per corpus with its 95% document-bootstrap band (SPEC 10, 4.4).")),
        "cross_corpus_heads": AssetOut(**OUT, description=(
            "Per head and corpus: AP_overall, AP_drop (SPEC 4.5), bias_strength (SPEC 3).")),
        "cross_corpus_verdicts": AssetOut(**OUT, description=(
            "How much of each metric is the model's and how much the text's, stated with the numbers (SPEC 10).")),
    },
    # a model -> its (model, corpus) partitions: Dagster infers MultiToSingleDimensionPartitionMapping on the
    # shared `model` dimension (built in; tests/test_cross_corpus_asset.py checks the mapping)
    deps=list(UPSTREAM),
    partitions_def=model_partitions(),
    can_subset=False,
    check_specs=CHECKS,
)
def cross_corpus(context: AssetExecutionContext, storage: StorageResource):
    """SPEC 10 for one model: its corpora compared (values, differences, per-head correlations, figures)."""
    model = context.partition_key
    entry = registry().model(model)
    store = storage.get()
    inputs, missing = [], {}
    for corpus in entry.corpora if len(entry.corpora) >= 2 else ():  # one corpus: nothing to read or compare
        inp, why = load_corpus(store, model, corpus)
        if inp is None:
            missing[corpus] = why
            context.log.warning(f"cross_corpus {model}: {corpus}: {why}")
        else:
            inputs.append(inp)
    popts = resolve_options("plasticity", entry.analysis)
    # SPEC 4.6 / 10 (revised): the model's plasticity interval rule; its query model is refitted per left-out document
    opts = CrossCorpusOptions.of_plasticity(popts)
    res = compare_corpora(model, inputs, opts, missing)
    figures = _figures(res, model)
    folder = f"cross_corpus/{model}"
    common = {"corpora": ", ".join(entry.corpora), "options": MetadataValue.json(res.options),
              "missing": MetadataValue.json(missing)}
    statements = MetadataValue.md("\n".join(f"- **{r.verdict}** - {r.statement}"
                                            for r in res.verdicts.itertuples()) or "(none)")
    lead = difference_values(res.metrics)
    yield Output(res.metrics, output_name="cross_corpus_metrics", metadata=results_first(lead, {
        **common, "statements": statements,
        "preview": table_value(res.metrics[["kind", "corpus", "metric", "value", "lo", "hi", "boot_bias", "z0",
                                            "interval", "n_heads", "n_docs", "verdict"]], max_rows=30),
        **save_figures(store, folder, {"differences": figures["differences"]})}))
    yield Output(res.correlations, output_name="cross_corpus_correlations", metadata=results_first(lead, {
        **common, "preview": table_value(res.correlations[["metric", "corpus", "n_heads", "spearman_rho", "spearman_p",
                                                           "spearman_method", "share_head", "share_corpus",
                                                           "verdict"]], max_rows=20),
        **save_figures(store, folder, {"heads": figures["heads"]})}))
    yield Output(res.profiles, output_name="cross_corpus_profiles", metadata=results_first(lead, {
        **common, **save_figures(store, folder, {"profiles": figures["profiles"]})}))
    yield Output(res.heads, output_name="cross_corpus_heads",
                 metadata=results_first(lead, {**common, "rows": len(res.heads)}))
    yield Output(res.verdicts, output_name="cross_corpus_verdicts",
                 metadata=results_first(lead, {**common, "statements": statements}))
    listed = len(entry.corpora)
    yield from checks.selected(context, [
        checks.values_finite("cross_corpus_metrics", res.metrics, ("kind", "corpus", "metric"),
                             empty_because="" if listed >= 2 else f"the registry lists {listed} corpus for {model}"),
        checks.intervals_well_formed("cross_corpus_metrics", res.metrics, ("kind", "corpus", "metric"))])


def _figures(res, model: str) -> dict:
    from qk_core.plots.cross_corpus import fig_differences, fig_heads, fig_profiles  # matplotlib when it runs

    return {"profiles": fig_profiles(res.profiles, model), "differences": fig_differences(res.metrics, model),
            "heads": fig_heads(res.heads, res.correlations, model)}
