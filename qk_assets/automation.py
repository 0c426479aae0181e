"""Automation conditions shared by the assets (Dagster declarative automation).

- per (model, corpus) asset: :data:`PER_PAIR`, ``AutomationCondition.eager()`` (new partitions once their
  corpus and registry entry exist, and after any upstream update) and :class:`RegistryListed` (the registry
  file lists the pair now), evaluated by ``model_automation_sensor`` (qk_assets.defs.registry; stopped by
  default);
- cross-model assets: :data:`AFTER_UPSTREAM` (like eager, but a model that is not analysed yet does not
  block them) or their own conditions, all evaluated by one :func:`automation_sensor` (running by default)
  with the report, so one tick requests everything that follows one update and the report is built last,
  in the same run.
"""

import warnings
from collections.abc import Sequence

from dagster import (
    AssetKey,
    AssetSelection,
    AutomationCondition,
    AutomationConditionSensorDefinition,
    AutomationContext,
    AutomationResult,
    BetaWarning,
    DagsterEventType,
    DefaultSensorStatus,
)

from qk_assets.partitions import (
    checkpoint_pair_keys,
    listed_keys,
    model_corpus_partitions,
    model_partitions,
    multi_corpus_models,
)
from qk_core.config.registry import Registry, RegistryError, load_registry


class RegistryKeys(AutomationCondition):
    """True for the candidate partitions among :meth:`keys` of the registry file as it is now (re-read at
    each evaluation, so it follows the file without a reload). A subclass names the keys; a partitions
    definition that is not the registry's passes unfiltered, a registry file that does not load gives
    nothing (``registry_partitions_sensor`` names the error). A Python condition runs in the code server:
    the sensors evaluating one set ``use_user_code_server``."""

    def keys(self, reg: Registry, context: AutomationContext) -> set[str] | None:
        """The partition keys to keep of ``context.partitions_def`` (None: that definition is not filtered)."""
        raise NotImplementedError

    @property
    def requires_cursor(self) -> bool:
        return False

    def evaluate(self, context: AutomationContext) -> AutomationResult:
        subset = context.candidate_subset
        if subset.is_empty or not subset.is_partitioned:  # on the right of `&`: only what the rest selected
            return AutomationResult(context, subset)
        try:
            wanted = self.keys(load_registry(), context)
        except RegistryError:
            return AutomationResult(context, context.get_empty_subset())
        if wanted is None:
            return AutomationResult(context, subset)
        keys = {k for k in subset.expensively_compute_partition_keys() if k in wanted}
        return AutomationResult(context, subset.compute_intersection_with_partition_keys(keys))


class RegistryListed(RegistryKeys):
    """True for the partitions the registry file lists now: a model, corpus or checkpoint removed from the
    file is never requested again, while its partitions, materialisations and stored outputs stay; listed
    again, it catches up on what it missed.

    Why a condition and not deleting the removed dynamic partition keys (``DeleteDynamicPartitionsRequest``):
    a pair leaves the registry also when only a model's ``corpora`` list shrinks, and then both of its keys
    stay (the model and the corpus are still listed), so deleting keys cannot stop automation there; and a
    deleted key hides the partitions' history from the UI, which the registry promises to keep ("removing
    an entry is reported, never silently deletes outputs"). Removed pairs keep their last ``registry_entry``
    observation, so Dagster's own conditions (which only see data) cannot tell them apart.
    """

    @property
    def name(self) -> str:
        return "registry_listed"

    @property
    def description(self) -> str:
        return "the registry file lists this partition now"

    def keys(self, reg: Registry, context: AutomationContext) -> set[str] | None:
        return listed_keys(reg, context.partitions_def)


class ComparedModel(RegistryKeys):
    """True for the ``model`` partitions whose registry entry lists two or more corpora: the models the
    cross-corpus comparison (SPEC 10) has something to compare for."""

    @property
    def name(self) -> str:
        return "compared_model"

    @property
    def description(self) -> str:
        return "the registry lists two or more corpora for this model"

    def keys(self, reg: Registry, context: AutomationContext) -> set[str] | None:
        return set(multi_corpus_models(reg)) if context.partitions_def == model_partitions() else None


class CheckpointPair(RegistryKeys):
    """True for the (model, corpus) partitions a trajectory reads: each checkpoint of a listed series on its
    first corpus (SPEC 6). Other models' partitions are not checkpoints of any series."""

    @property
    def name(self) -> str:
        return "checkpoint_pair"

    @property
    def description(self) -> str:
        return "a checkpoint of a listed series, on its first corpus"

    def keys(self, reg: Registry, context: AutomationContext) -> set[str] | None:
        return checkpoint_pair_keys(reg) if context.partitions_def == model_corpus_partitions() else None


class SeriesInputsNewer(RegistryKeys):
    """True for the series partitions (of a trajectory asset) where one of ``inputs`` holds a checkpoint
    partition of that series (each checkpoint on its first corpus, SPEC 6) materialised after the series' own
    latest materialisation of the asset being evaluated, or where that asset was never materialised.

    The trajectory depends on every (model, corpus) partition (``AllPartitionMapping``: a series' checkpoints
    are registry data), so to Dagster's own conditions one series' checkpoint update is an update of every
    series; this compares each series with its own checkpoints only. It reads the instance's latest
    materialisation storage ids per partition, which only grow, so a series caught up stays false."""

    def __init__(self, inputs: Sequence[str]) -> None:
        self.inputs = tuple(AssetKey(name) for name in inputs)

    @property
    def name(self) -> str:
        return "series_inputs_newer"

    @property
    def description(self) -> str:
        return "one of this series' checkpoints was analysed after the series' last materialisation"

    def keys(self, reg: Registry, context: AutomationContext) -> set[str] | None:
        instance = context.asset_graph_view.instance
        candidates = {s for s in context.candidate_subset.expensively_compute_partition_keys() if s in reg.series}
        pairs = {s: checkpoint_pair_keys(reg, [s]) for s in candidates}
        every_pair = set().union(*pairs.values())
        if not every_pair:  # Dagster reads an empty partition set as "every partition"
            return set()
        own = instance.get_latest_storage_id_by_partition(context.key, DagsterEventType.ASSET_MATERIALIZATION,
                                                          candidates)
        latest = [instance.get_latest_storage_id_by_partition(key, DagsterEventType.ASSET_MATERIALIZATION,
                                                              every_pair) for key in self.inputs]
        return {s for s in candidates
                if any(ids.get(p, -1) > own.get(s, -1) for ids in latest for p in pairs[s])}


def deps_updated(where: AutomationCondition, ignore: AssetSelection | None = None) -> AutomationCondition:
    """``any_deps_updated`` counting only the dependency partitions where ``where`` holds (evaluated on the
    dependency's partitions), ``ignore`` left out: Dagster's own ``any_deps_match`` with the operand of
    ``any_deps_updated`` narrowed, so only updates that change the downstream partition's inputs request it."""
    cond = AutomationCondition.any_deps_match(
        (AutomationCondition.newly_updated() | AutomationCondition.will_be_requested()) & where)
    return cond.ignore(ignore) if ignore is not None else cond


PER_PAIR = (AutomationCondition.eager() & RegistryListed()).with_label(
    "eager, for the (model, corpus) pairs the registry lists")

AFTER_UPSTREAM = (
    (AutomationCondition.newly_missing() | AutomationCondition.any_deps_updated()).since_last_handled()
    & ~AutomationCondition.any_deps_in_progress()
    & ~AutomationCondition.in_progress()
).with_label("after upstream updates, once nothing upstream runs (tolerates missing partitions)")


def automation_sensor(derived: list[AssetKey], interval_s: int = 30) -> AutomationConditionSensorDefinition:
    """One sensor for every derived asset that is not per (model, corpus): model report, joins, statistics,
    cross-model figures, trajectory and ``report_html``. One tick evaluates them all, so an update requests
    everything that follows it at once (an unpartitioned set in one run, in dependency order): the report
    is rebuilt after the joins, statistics and figures it shows, never beside stale ones."""
    with warnings.catch_warnings():  # use_user_code_server is marked beta; the Python conditions need it
        warnings.simplefilter("ignore", BetaWarning)
        return AutomationConditionSensorDefinition(
            "automation_sensor",
            target=AssetSelection.assets(*derived),
            minimum_interval_seconds=interval_s,
            default_status=DefaultSensorStatus.RUNNING,
            use_user_code_server=True,  # CheckpointPair / ComparedModel / RegistryListed read the registry file
            description="Rebuilds the model report, joins, statistics, cross-model figures, trajectories and the "
                        "report after their inputs change, the report last (one tick, one run).",
        )
