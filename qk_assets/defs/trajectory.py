"""The training trajectory of each checkpoint series (SPEC 6): ``trajectory`` + ``trajectory_profiles``.

Every checkpoint of a series is a model key (``<series>@<revision>``) of the (model, corpus) partitions of
the capture and of every per-model analysis. The trajectory assets are partitioned by series (dynamic) and
depend on the per-model assets with ``AllPartitionMapping`` (a series' checkpoints are registry data that
grows without a reload). They read each checkpoint on the series' first corpus from the storage root
themselves (the IO manager's layout), so a checkpoint that is not (yet) materialised is reported as
missing — in the metadata and in the ``missing`` column — instead of failing the run. They re-materialise
automatically whenever one of the series' own checkpoints' metrics or profiles change, and only then
(:data:`TRAJECTORY_CONDITION`).
"""

import pandas as pd
from dagster import (
    AllPartitionMapping,
    AssetDep,
    AssetExecutionContext,
    AssetOut,
    AssetSelection,
    AutomationCondition,
    MetadataValue,
    Output,
    multi_asset,
)

from qk_assets.automation import CheckpointPair, RegistryListed, SeriesInputsNewer, deps_updated
from qk_assets.figures import save_figures
from qk_assets.io_manager import asset_rel
from qk_assets.metadata import table_value
from qk_assets.partitions import pair_key, registry, series_partitions
from qk_assets.resources import StorageResource
from qk_core.capture.store import CaptureError, CaptureReader
from qk_core.config.registry import ModelEntry
from qk_core.io.storage import Storage, StorageError
from qk_core.models.loading import load_config
from qk_core.trajectory.series import (
    Checkpoint,
    TrajectoryError,
    checkpoint_config,
    load_reference,
    profile_table,
    summary,
    trajectory_table,
)

CAPTURE = "qk_capture"
METRIC_INPUTS = ("pca_metrics", "rotation_metrics", "plasticity_metrics")
PROFILES = "plasticity_profiles"
UPSTREAM = (CAPTURE, *METRIC_INPUTS, PROFILES)

# Eager, except that missing checkpoints do not block it (AutomationCondition.eager() waits until no
# dependency partition is missing; a series with an unfinished checkpoint must still update), and only a
# checkpoint's update counts: the dependency is on every (model, corpus) partition (AllPartitionMapping), so
# plain any_deps_updated() would re-run every series after any model's analysis, and even deps_updated over
# checkpoint pairs re-runs every series after one series' checkpoint: SeriesInputsNewer keeps the series whose
# own checkpoints changed. A new capture alone does not trigger it: its analyses will.
TRAJECTORY_CONDITION = (
    deps_updated(CheckpointPair(), ignore=AssetSelection.assets(CAPTURE)).since_last_handled()
    & SeriesInputsNewer((*METRIC_INPUTS, PROFILES))
    & RegistryListed()
    & ~AutomationCondition.any_deps_in_progress()
    & ~AutomationCondition.in_progress()
).with_label("after a checkpoint's analyses update (tolerates missing checkpoints)")


def _deps() -> list[AssetDep]:
    # Every (model, corpus) partition: a series' checkpoints are registry data (they grow without a reload),
    # and Dagster has no built-in mapping from a series key to its checkpoints' keys. The asset reads the
    # checkpoints it needs itself.
    return [AssetDep(name, partition_mapping=AllPartitionMapping()) for name in UPSTREAM]


def _read(storage: Storage, asset: str, key: str) -> pd.DataFrame | None:
    """One checkpoint's value on its first corpus (the corpus its registry entry lists first)."""
    rel = asset_rel([asset], str(pair_key(key, registry().model(key).corpus)))
    if not storage.exists(rel):
        return None
    return storage.read_parquet(rel).to_pandas()


def load_checkpoint(storage: Storage, key: str) -> tuple[Checkpoint, dict]:
    """Everything the trajectory needs of one checkpoint; missing inputs stay None."""
    entry = registry().model(key)
    ck = Checkpoint(key=key, revision=entry.revision_label or key, step_index=entry.step_index or 0,
                    fallback_config={"window": entry.window, "bucket": entry.bucket})
    notes: dict = {}
    capture = _read(storage, CAPTURE, key)
    if capture is not None and not capture.empty and "capture_prefix" in capture:
        prefix = str(capture["capture_prefix"].iloc[0])
        try:
            manifest = CaptureReader(storage, prefix).manifest  # verified: committed, of this folder
            ck.config = checkpoint_config(manifest)
            notes["capture"] = storage.uri(prefix)
        except (StorageError, TrajectoryError, CaptureError) as exc:
            notes["capture_error"] = str(exc)
    if ck.config is not None and not ck.config["max_position_embeddings"] > 0:
        # Older manifests do not record it: read it from the revision's own config (SPEC 6).
        ck.config["max_position_embeddings"], notes["max_position_embeddings"] = _config_mpe(entry)
    for name in METRIC_INPUTS:
        ck.metrics[name] = _read(storage, name, key)
    ck.profiles = _read(storage, PROFILES, key)
    return ck, notes


def _config_mpe(entry: ModelEntry) -> tuple[float, str]:
    """max_position_embeddings of the revision's config (transformers imported only here), NaN if unknown."""
    try:
        value = getattr(load_config(entry).get_text_config(), "max_position_embeddings", None)
    except Exception as exc:  # the source may be offline: the value is then unknown
        return float("nan"), f"revision config not available: {exc}"
    return (float(value), "revision config") if value else (float("nan"), "not in the revision config")


@multi_asset(
    outs={
        "trajectory": AssetOut(group_name="trajectory", kinds={"parquet"}, automation_condition=TRAJECTORY_CONDITION,
                               description="One row per checkpoint of the series in training order (SPEC 6)."),
        "trajectory_profiles": AssetOut(
            group_name="trajectory", kinds={"parquet"}, automation_condition=TRAJECTORY_CONDITION,
            description="Mean plasticity profile of every checkpoint in absolute token positions."),
    },
    deps=_deps(),
    partitions_def=series_partitions(),
    can_subset=False,
)
def trajectory(context: AssetExecutionContext, storage: StorageResource):
    """Gather every checkpoint of the series; build the trajectory table, profiles and figures."""
    series = context.partition_key
    if series not in registry().series:
        raise TrajectoryError(f"series '{series}' is not in the registry ({registry().path})")
    store = storage.get()
    checkpoints, notes = [], {}
    for key in registry().series[series].checkpoint_keys:
        ck, note = load_checkpoint(store, key)
        checkpoints.append(ck)
        notes[key] = note
    table = trajectory_table(series, checkpoints, load_reference())
    profiles = profile_table(checkpoints)
    info = summary(table)
    missing = dict(info["missing"])  # revision -> its missing inputs
    figures = save_figures(store, f"trajectory/{series}", _figures(table, profiles, series))
    preview_cols = ["revision", "window", "bucket", "rope_theta", "max_position_embeddings", "bias_strength",
                    "bias_strength_window", "ap_first20", "ap_last20", "ap_drop", "missing"]
    meta = {
        "checkpoints": info["checkpoints"],
        "complete_checkpoints": info["complete"],
        "missing_checkpoints": MetadataValue.json(missing),
        "inputs": MetadataValue.json(notes),  # capture location per checkpoint, where its config came from
        "preview": table_value(table[[c for c in preview_cols if c in table]]),
        **figures,
    }
    if missing:
        context.log.warning(f"trajectory {series}: missing inputs {missing}")
    yield Output(table, output_name="trajectory", metadata=meta)
    yield Output(profiles, output_name="trajectory_profiles",
                 metadata={"checkpoints_with_profiles": int(profiles["model"].nunique()),
                           "fig_profiles_path": figures.get("fig_profiles_path", MetadataValue.text(""))})


def _figures(table: pd.DataFrame, profiles: pd.DataFrame, series: str) -> dict:
    from qk_core.plots.trajectory import trajectory_figures  # matplotlib only when the asset runs

    return trajectory_figures(table, profiles, series)
