"""The registry inside Dagster: its entries as data versions, its keys as dynamic partitions.

- ``registry_entry`` [model, corpus]: an observable source asset. Its data version per (model, corpus)
  is a hash of what configures that pair's capture: the model entry (source, tokenizer, window, capture
  options, ...; not its analysis options, groups, description or corpus list) and the corpus entry.
  ``qk_capture`` depends on it, so editing an entry makes that pair's lineage stale in Dagster's own
  staleness (UI: "upstream data version changed") and automation re-runs it. Pairs the registry never
  listed are never observed, so Dagster treats them as missing and automation leaves them alone; pairs it
  no longer lists keep their last observation and are left alone by the per-pair condition.
- ``registry_analysis`` [model, corpus]: the same for the entry's ``analysis`` tables (SPEC 2-4, 11
  options). The per-model analyses (geometry, plasticity, interventions) depend on it, so editing an
  analysis option re-runs the analyses on the stored capture, never the capture (the GPU work).
- ``registry_listing`` (unpartitioned): a hash of what the registry lists; ``report_html`` depends on it, so an
  entry removed from the file rebuilds the report (which shows only what the registry lists).
- ``registry_partitions_sensor`` (running by default): every few seconds it reads the registry file and adds the
  model, corpus and series keys the instance lacks (``SensorResult(dynamic_partitions_requests)``), then observes
  ``registry_entry``, ``registry_analysis`` and ``registry_listing`` when any entry changed. Entries removed from
  the file are reported (tick message and log), never deleted: their partitions, materialisations and stored
  outputs stay, and automation no longer requests them (``RegistryListed`` in qk_assets.automation says why a
  condition rather than deleting the dynamic partition keys); the report leaves them out.
- ``model_automation_sensor`` (stopped by default; start it in the UI under Automation): evaluates the
  automation conditions of ``corpus`` and of every (model, corpus) asset, so a new model, checkpoint or
  corpus materialises its lineage by itself. It runs in the code server (``use_user_code_server``), where
  the per-pair condition reads the registry file. It is off by default because the shipped registry's
  study models download LongBench-Pro and checkpoints from the hub.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from collections.abc import Callable

import pandas as pd
from dagster import (
    AssetKey,
    AssetSelection,
    AutomationConditionSensorDefinition,
    BetaWarning,
    DataVersion,
    DataVersionsByPartition,
    DefaultSensorStatus,
    MetadataValue,
    ObserveResult,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    observable_source_asset,
    sensor,
)

from qk_assets.metadata import table_value
from qk_assets.partitions import (
    CORPUS_DIM,
    MODEL_DIM,
    SERIES_DIM,
    model_corpus_partitions,
    pair_key,
    partition_requests,
    registry_pairs,
)
from qk_assets.resources import GPU_POOL, initialise_pools
from qk_core.config.registry import Registry, RegistryError, load_registry

REGISTRY_ENTRY = AssetKey("registry_entry")
SENSOR_INTERVAL_S = 5
REGISTRY_ANALYSIS = AssetKey("registry_analysis")
REGISTRY_LISTING = AssetKey("registry_listing")
# Fields of a model entry that do not change what is captured for a (model, corpus) pair ("analysis" has a
# data version of its own: registry_analysis). A variant's record (SPEC 13.1) acts through its config_overrides and
# window, which stay in the version; leaving the record out keeps the versions of every other entry unchanged.
NOT_CONFIGURING = ("groups", "description", "corpus", "corpora", "step_index", "analysis", "variant")
WHERE_IT_RUNS = ("shards", "num_gpus")  # capture options that only decide where a capture runs (issue 12)


def _pair_versions(reg: Registry, configuring: Callable[[str, str], object]) -> dict[str, str]:
    """Data version per (model, corpus) partition key: a hash of what ``configuring(model, corpus)`` returns."""
    out = {}
    for model, corpus in registry_pairs(reg):
        blob = json.dumps(configuring(model, corpus), sort_keys=True, default=str)
        out[str(pair_key(model, corpus))] = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return out


def entry_versions(reg: Registry) -> dict[str, str]:
    """``registry_entry``'s versions: the model entry (analysis options and NOT_CONFIGURING fields aside) and
    the corpus entry."""
    def configuring(model: str, corpus: str) -> dict:
        entry = {k: v for k, v in dataclasses.asdict(reg.model(model)).items() if k not in NOT_CONFIGURING}
        entry["capture"] = {k: v for k, v in entry["capture"].items() if k not in WHERE_IT_RUNS}
        return {"model": entry, "corpus": dataclasses.asdict(reg.corpus(corpus))}
    return _pair_versions(reg, configuring)


def analysis_versions(reg: Registry) -> dict[str, str]:
    """``registry_analysis``'s versions: the model's ``analysis`` tables."""
    return _pair_versions(reg, lambda model, _corpus: reg.model(model).analysis)


def listing_version(reg: Registry) -> str:
    """``registry_listing``'s version: a hash of what the registry lists (model keys, (model, corpus) pairs,
    series); it changes when an entry is added or removed, not when one is edited."""
    listing = [sorted(reg.model_keys), sorted(map(list, registry_pairs(reg))), sorted(reg.series)]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:16]


def listing_metadata(reg: Registry) -> dict[str, MetadataValue]:
    """What the registry asks for, as ``registry_listing``'s observation shows it: the number of (model, corpus)
    pairs, one row per pair (its groups, its series for a checkpoint, whether it is compared across corpora),
    and the listed model keys (``report_html`` dates a removal from them)."""
    series_of = {k: s.name for s in reg.series.values() for k in s.checkpoint_keys}
    rows = pd.DataFrame([{"model": m, "corpus": c, "groups": ", ".join(reg.model(m).groups),
                          "series": series_of.get(m, ""), "corpora": len(reg.model(m).corpora)}
                         for m, c in registry_pairs(reg)], columns=["model", "corpus", "groups", "series", "corpora"])
    return {"pairs_listed": MetadataValue.int(len(rows)),
            "pairs": table_value(rows, max_rows=len(rows) or 1),
            "models": MetadataValue.json(sorted(reg.model_keys))}


def observe_listing() -> ObserveResult:
    reg = load_registry()
    return ObserveResult(data_version=DataVersion(listing_version(reg)), metadata=listing_metadata(reg))


def _observe(versions: Callable[[Registry], dict[str, str]]) -> DataVersionsByPartition:
    reg = load_registry()  # the file as it is now, not as the code location loaded it
    return DataVersionsByPartition({pk: DataVersion(v) for pk, v in versions(reg).items()})


def observe_registry() -> DataVersionsByPartition:
    return _observe(entry_versions)


def observe_analysis() -> DataVersionsByPartition:
    return _observe(analysis_versions)


with warnings.catch_warnings():  # observable_source_asset is marked beta; its use here is the documented one
    warnings.simplefilter("ignore", BetaWarning)
    registry_entry = observable_source_asset(
        name="registry_entry", partitions_def=model_corpus_partitions(), group_name="registry",
        description="One data version per (model, corpus) the registry lists: a hash of its model entry "
                    "(analysis options aside) and corpus entry. Observed by registry_partitions_sensor whenever "
                    "the registry file changes; qk_capture depends on it.",
    )(observe_registry)
    registry_analysis = observable_source_asset(
        name="registry_analysis", partitions_def=model_corpus_partitions(), group_name="registry",
        description="One data version per (model, corpus) the registry lists: a hash of the model's analysis "
                    "options. The per-model analyses depend on it: an analysis edit re-runs them, not the capture.",
    )(observe_analysis)
    registry_listing = observable_source_asset(
        name="registry_listing", group_name="registry",
        description="What the registry lists (its model keys, (model, corpus) pairs and series) as one data version; "
                    "each observation shows the pairs it asks for (`pairs`: model, corpus, groups, series), the "
                    "only keys of the (model, corpus) grid automation materialises (report_html's `registry_pairs` "
                    "says which are missing). Observed by registry_partitions_sensor when an entry changes; "
                    "report_html depends on it, so removing an entry rebuilds the report without it.",
    )(observe_listing)


@sensor(
    name="registry_partitions_sensor",
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=DefaultSensorStatus.RUNNING,
    asset_selection=AssetSelection.assets(REGISTRY_ENTRY, REGISTRY_ANALYSIS, REGISTRY_LISTING),
    description="Adds the registry's models, checkpoints, corpora and series as partitions (no reload) and "
                "observes registry_entry and registry_analysis when an entry changes; removed entries are reported, "
                "never deleted, and no longer automated.",
)
def registry_partitions_sensor(context: SensorEvaluationContext) -> SensorResult | SkipReason:
    try:
        reg = load_registry()
    except RegistryError as exc:
        return SkipReason(f"registry not loaded, partitions unchanged: {exc}")
    if initialise_pools(context.instance):
        context.log.info(f"concurrency pool {GPU_POOL!r}: default limit set")
    existing = {d: list(context.instance.get_dynamic_partitions(d)) for d in (MODEL_DIM, CORPUS_DIM, SERIES_DIM)}
    adds, gone = partition_requests(reg, existing)
    versions = entry_versions(reg)
    state = hashlib.sha256(json.dumps([versions, analysis_versions(reg)], sort_keys=True).encode()).hexdigest()
    seen = hashlib.sha256(json.dumps([state, gone], sort_keys=True).encode()).hexdigest()[:16]
    cursor_state, _, cursor_seen = (context.cursor or "").partition(":")
    notes = [f"added {r.partitions_def_name}: {', '.join(r.partition_keys)}" for r in adds]
    removed = [f"no longer in {reg.path}: {dim} {', '.join(keys)} (partitions and stored outputs kept)"
               for dim, keys in gone.items()]
    if seen != cursor_seen:  # a removal is reported once, on the tick that first sees it, not on every tick
        notes += removed
    for note in notes:
        context.log.info(note)
    cursor = f"{state}:{seen}"
    if not adds and state == cursor_state:
        if seen != cursor_seen:
            return SensorResult(skip_reason="; ".join(notes), cursor=cursor)
        return SkipReason(f"registry unchanged ({len(versions)} (model, corpus) pairs"
                          + (f"; {sum(map(len, gone.values()))} removed keys reported earlier)" if gone else ")"))
    runs = [] if state == cursor_state else [RunRequest(
        run_key=state, asset_selection=[REGISTRY_ENTRY, REGISTRY_ANALYSIS, REGISTRY_LISTING],
        tags={"qk/trigger": "registry"})]
    return SensorResult(run_requests=runs, dynamic_partitions_requests=adds, cursor=cursor)


def model_automation_sensor(per_model: list[AssetKey], interval_s: int = 30) -> AutomationConditionSensorDefinition:
    """The sensor evaluating ``corpus`` and every (model, corpus) asset (``per_model``, found by
    :func:`qk_assets.definitions.build_definitions` from their partitions, so a new per-model analysis
    joins by itself)."""
    with warnings.catch_warnings():  # use_user_code_server is marked beta; the Python condition needs it
        warnings.simplefilter("ignore", BetaWarning)
        return AutomationConditionSensorDefinition(
            "model_automation_sensor",
            target=AssetSelection.assets("corpus", *per_model),
            minimum_interval_seconds=interval_s,
            default_status=DefaultSensorStatus.STOPPED,
            use_user_code_server=True,  # RegistryListed (qk_assets.automation) reads the registry file
            description="Materialises new and changed (model, corpus) partitions the registry lists, and their "
                        "analyses, by their automation conditions. Off by default (the study models need the "
                        "hub); start it here.",
        )


SENSORS = [registry_partitions_sensor]
