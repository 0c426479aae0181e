"""Interventions on heads and the retrieval probe, one partition per (model, corpus) (SPEC 10, 11).

Thin wrapper over :func:`qk_core.interventions.study.run_study`: loads the model with its LM head on the
device resource (pool ``gpu``), reads the pair's corpus (the haystacks), its capture, per-head plasticity
(AP_last20 ranks the heads) and rotation (the drift axes of `debias`). Outputs:

- ``intervention_trials``: one row per (trial, condition): document, nominal and measured depth, condition
  (intervention, head set, random seed, k), correct, rank, log-prob margin, seconds;
- ``intervention_summary``: accuracy (Wilson 95%) and mean margin (document bootstrap 95%) per
  (intervention, head set, k, depth), chance 1/K; figure: accuracy vs depth;
- ``intervention_contrast``: drop(S) - drop(random) per (intervention, k, depth), S = lowest / highest, with
  document-bootstrap intervals; figure: contrast vs depth;
- ``intervention_head_sets``: the heads of every set with their AP_last20 and how many heads each set shares
  with `lowest` (a random set equals `lowest` only when no other set has its layer distribution);
- ``intervention_debias_profiles`` / ``intervention_debias_metrics``: the `lowest` heads recaptured without
  and with `debias`, SPEC 3 and 4 re-run: AP profiles, AP headline and bias_strength with paired intervals;
  figure: AP profile with and without debias;
- ``intervention_verdicts``: plain statements of what the data support (H1, H2) with their intervals;
- ``intervention_calibration``: the probe's calibration (:mod:`qk_core.interventions.calibrate`): every
  setting tried on the held-out documents with its accuracy (Wilson 95%), the chosen one, and the study's
  baseline accuracy at it; metadata: the status, the chosen settings and the calibration in one sentence (the
  H1 verdicts say so plainly when the probe could not leave the ceiling or the floor).

Options: :class:`qk_core.interventions.options.InterventionOptions` defaults < the registry entry's
``analysis.interventions`` table < the run config (the demo models' registry entries hold reduced settings).
On a corpus its ``corpora`` option leaves out (SPEC 10: the demo runs the study on its prose corpus only)
the outputs are empty - the verdicts say why in one row - and no model is loaded.
"""

import pandas as pd
from dagster import AssetExecutionContext, AssetIn, AssetOut, MetadataValue, Output, multi_asset

from qk_assets.figures import save_figures
from qk_assets.metadata import results_first
from qk_assets.options import AnalysisConfig, analysis_options
from qk_assets.partitions import listed_pair, model_corpus_partitions, registry
from qk_assets.resources import GPU_POOL, StorageResource, TorchDeviceResource
from qk_core.capture.store import CaptureError
from qk_core.config.options import resolve_options
from qk_core.interventions.verdict import COLUMNS
from qk_core.models.loading import load_model

GROUP = "interventions"


def _md(df: pd.DataFrame, n: int = 40) -> MetadataValue:
    return MetadataValue.md(df.head(n).to_markdown(index=False, floatfmt=".4g") if len(df) else "(empty)")


@multi_asset(
    outs={
        "intervention_trials": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "Retrieval probe trials x conditions: document, depth (nominal, measured in prompt tokens), "
            "intervention, head set, k, correct, rank, log-prob margin (nats), seconds (SPEC 11.1-11.2).")),
        "intervention_summary": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "Accuracy (Wilson 95%) and mean margin (document bootstrap 95%) per intervention, head set, k and "
            "depth; chance = 1/K (SPEC 11.3).")),
        "intervention_contrast": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "Causal contrast drop(S) - drop(random) per intervention, k and depth, S = lowest / highest "
            "AP_last20 heads, document-bootstrap 95% interval (SPEC 11.3).")),
        "intervention_head_sets": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "Heads of the lowest / highest / random sets per k with their AP_last20 (SPEC 11.2).")),
        "intervention_debias_profiles": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "AP profiles of the lowest heads re-measured without and with debias (SPEC 11.3).")),
        "intervention_verdicts": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "What the data support, stated plainly with intervals: H1 low-plasticity heads matter more for "
            "distant retrieval than random heads; H2 removing bias raises distant plasticity (SPEC 11.3).")),
        "intervention_debias_metrics": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "AP_overall / first20 / last20 / drop and bias_strength of the lowest heads without and with "
            "debias, and the paired difference with document-bootstrap 95% intervals (SPEC 11.3).")),
        "intervention_calibration": AssetOut(group_name=GROUP, kinds={"parquet"}, description=(
            "The probe's difficulty calibration on held-out documents: each setting tried (window, K, "
            "distractors, decoys) with its baseline accuracy (Wilson 95%), the chosen one, and the study's "
            "baseline accuracy at it; target band in the options (issue 24 item 4).")),
    },
    # Dagster maps the corpus partition to the pairs' corpus dimension (as for the capture)
    ins={"qk_capture": AssetIn(), "plasticity_heads": AssetIn(), "rotation_heads": AssetIn(), "corpus": AssetIn()},
    deps=["registry_analysis"],  # its options are analysis.interventions
    partitions_def=model_corpus_partitions(),
    pool=GPU_POOL,
    can_subset=False,
)
def interventions(context: AssetExecutionContext, config: AnalysisConfig, storage: StorageResource,
                  device: TorchDeviceResource, qk_capture: pd.DataFrame, plasticity_heads: pd.DataFrame,
                  rotation_heads: pd.DataFrame, corpus: pd.DataFrame):
    """SPEC 11 on one model: probe, ablate / debias head sets, contrast, plasticity under debias."""
    from qk_core.interventions.study import run_study  # torch only when the asset runs
    from qk_core.plots.interventions import fig_accuracy, fig_contrast, fig_debias_profile

    model, corpus_name, entry = listed_pair(context.partition_key)
    (opts,) = analysis_options(model, config, "interventions")
    if not opts.runs_on(corpus_name):
        yield from _not_run(model, corpus_name, opts)
        return
    popts = resolve_options("plasticity", entry.analysis)
    prefixes = sorted(set(qk_capture["capture_prefix"].astype(str))) if len(qk_capture) else []
    if len(prefixes) != 1:
        raise CaptureError(f"{model}: qk_capture points at {len(prefixes)} captures {prefixes}; expected one")
    store = storage.get()
    context.log.info(f"{model}: loading the model with its LM head on {device.resolve()}")
    loaded = load_model(entry, device.resolve(), with_head=True)
    res = run_study(entry, corpus, store, prefixes[0], plasticity_heads, rotation_heads, opts, popts, loaded,
                    corpus_name=corpus_name, log=context.log)
    folder = f"interventions/{model}/{corpus_name}"
    title = f"{model} on {corpus_name}"
    common = {"model": model, "corpus": corpus_name, "options": MetadataValue.json(res.options),
              "seconds_per_forward": float(round(res.seconds_per_forward, 3))}
    headline = res.contrast.sort_values(["intervention", "k", "head_set", "depth"]) if len(res.contrast) else \
        res.contrast
    lead = verdict_values(res.verdicts)
    yield Output(res.trials, output_name="intervention_trials", metadata=results_first(lead, {
        **common, "trials": int(res.trials[["doc_id", "depth", "repeat"]].drop_duplicates().shape[0]),
        "conditions": int(res.trials.groupby(["intervention", "head_set", "set_seed", "k"]).ngroups)}))
    yield Output(res.summary, output_name="intervention_summary", metadata=results_first(lead, {
        **common, "preview": _md(res.summary[["intervention", "head_set", "k", "depth", "n_trials", "accuracy",
                                              "accuracy_lo", "accuracy_hi", "margin", "margin_lo", "margin_hi"]], 80),
        **save_figures(store, folder, {"accuracy": fig_accuracy(res.summary, title, res.options)})}))
    yield Output(res.contrast, output_name="intervention_contrast", metadata=results_first(lead, {
        **common, "preview": _md(headline, 80),
        **save_figures(store, folder, {"contrast": fig_contrast(res.contrast, title, res.options)})}))
    hs = res.head_sets
    rnd = hs[hs["head_set"] == "random"].groupby(["k", "set_seed"])["overlap_lowest"].first().reset_index() \
        if len(hs) else hs
    yield Output(hs, output_name="intervention_head_sets", metadata=results_first(lead, {
        **common, "preview": _md(hs[hs["head_set"] != "random"] if len(hs) else hs, 60),
        "random_overlap_with_lowest": _md(rnd, 40)}))
    yield Output(res.profiles, output_name="intervention_debias_profiles", metadata=results_first(lead, {
        **common, **save_figures(store, folder, {"debias_profile": fig_debias_profile(
        res.profiles, res.remeasured, title)})}))
    yield Output(res.remeasured, output_name="intervention_debias_metrics", metadata=results_first(lead, {
        **common, "preview": _md(res.remeasured, 40)}))
    cal = res.options.get("probe_calibration", {})
    study_row = res.calibration[res.calibration["phase"] == "study"] if len(res.calibration) else res.calibration
    baseline = {}
    if len(study_row):
        r = study_row.iloc[0]
        baseline = {"baseline_accuracy": float(r["accuracy"]), "baseline_accuracy_lo": float(r["accuracy_lo"]),
                    "baseline_accuracy_hi": float(r["accuracy_hi"])}
    yield Output(res.calibration, output_name="intervention_calibration", metadata=results_first(baseline, {
        **common, "status": str(cal.get("status", "")), "chosen": str(cal.get("chosen", "")),
        "configured": str(cal.get("configured", "")), "target_band": MetadataValue.json(cal.get("band", [])),
        "held_out_documents": MetadataValue.json(cal.get("held_out_documents", [])),
        "calibration": MetadataValue.md(res.probe_statement or "(none)"),
        "preview": _md(res.calibration.drop(columns=["documents"]) if len(res.calibration) else res.calibration)}))
    yield Output(res.verdicts, output_name="intervention_verdicts", metadata=results_first(lead, {
        **common, "statements": MetadataValue.md("\n".join(f"- **{r.verdict}** - {r.statement}"
                                                           for r in res.verdicts.itertuples()) or "(none)")}))


OUTPUTS = ("intervention_trials", "intervention_summary", "intervention_contrast", "intervention_head_sets",
           "intervention_debias_profiles", "intervention_debias_metrics", "intervention_verdicts",
           "intervention_calibration")


def verdict_values(verdicts: pd.DataFrame) -> dict[str, float]:
    """Each stated verdict's estimate as a plain float (``h1_ablate_k40``: hypothesis, intervention, k heads): what
    an intervention materialisation leads with (the verdicts and their intervals are its table)."""
    out: dict[str, float] = {}
    for r in verdicts.itertuples():
        hyp = str(r.hypothesis).split(":", 1)[0].strip().lower()
        if hyp and r.intervention and pd.notna(r.estimate):
            out[f"{hyp}_{r.intervention}_k{int(r.k)}"] = float(r.estimate)
    return out


def _not_run(model: str, corpus_name: str, opts) -> list[Output]:
    """Empty outputs for a corpus the registry leaves out of the study (``analysis.interventions.corpora``)."""
    from qk_core.interventions.study import TRIAL_COLUMNS  # torch only when the asset runs

    why = (f"not run on corpus '{corpus_name}': {registry().path}, model '{model}', field "
           f"'analysis.interventions.corpora' lists {list(opts.corpora or ())}")
    nan = float("nan")
    verdict = pd.DataFrame([{"hypothesis": "", "intervention": "", "k": 0, "estimate": nan, "lo": nan, "hi": nan,
                             "unit": "", "evidence": "", "verdict": "not run", "statement": why}], columns=COLUMNS)
    meta = {"model": model, "corpus": corpus_name, "not_run": why}
    empty = pd.DataFrame({"note": pd.Series([], dtype="string")})
    return [Output(pd.DataFrame(columns=TRIAL_COLUMNS) if name == "intervention_trials" else
                   verdict if name == "intervention_verdicts" else empty, output_name=name, metadata=meta)
            for name in OUTPUTS]
