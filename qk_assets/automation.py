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

from dagster import (
    AssetKey,
    AssetSelection,
    AutomationCondition,
    AutomationConditionSensorDefinition,
    AutomationContext,
    AutomationResult,
    DefaultSensorStatus,
)

from qk_assets.partitions import listed_keys
from qk_core.config.registry import RegistryError, load_registry

SENSOR_INTERVAL_S = 5


class RegistryListed(AutomationCondition):
    """True for the partitions the registry file lists now (re-read at each evaluation): a model, corpus or
    checkpoint removed from the file is never requested again, while its partitions, materialisations and
    stored outputs stay; listed again, it catches up on what it missed.

    Why a condition and not deleting the removed dynamic partition keys (``DeleteDynamicPartitionsRequest``):
    a pair leaves the registry also when only a model's ``corpora`` list shrinks, and then both of its keys
    stay (the model and the corpus are still listed), so deleting keys cannot stop automation there; and a
    deleted key hides the partitions' history from the UI, which the registry promises to keep ("removing
    an entry is reported, never silently deletes outputs"). Removed pairs keep their last ``registry_entry``
    observation, so Dagster's own conditions (which only see data) cannot tell them apart. A Python
    condition runs in the code server: ``model_automation_sensor`` sets ``use_user_code_server``.
    A registry file that does not load lists nothing (``registry_partitions_sensor`` names the error).
    """

    @property
    def name(self) -> str:
        return "registry_listed"

    @property
    def description(self) -> str:
        return "the registry file lists this partition now"

    @property
    def requires_cursor(self) -> bool:
        return False

    def evaluate(self, context: AutomationContext) -> AutomationResult:
        subset = context.candidate_subset
        if subset.is_empty or not subset.is_partitioned:  # on the right of `&`: only what the rest selected
            return AutomationResult(context, subset)
        try:
            listed = listed_keys(load_registry(), context.partitions_def)
        except RegistryError:
            return AutomationResult(context, context.get_empty_subset())
        if listed is None:
            return AutomationResult(context, subset)
        keys = {k for k in subset.expensively_compute_partition_keys() if k in listed}
        return AutomationResult(context, subset.compute_intersection_with_partition_keys(keys))


PER_PAIR = (AutomationCondition.eager() & RegistryListed()).with_label(
    "eager, for the (model, corpus) pairs the registry lists")

AFTER_UPSTREAM = (
    (AutomationCondition.newly_missing() | AutomationCondition.any_deps_updated()).since_last_handled()
    & ~AutomationCondition.any_deps_in_progress()
    & ~AutomationCondition.in_progress()
).with_label("after upstream updates, once nothing upstream runs (tolerates missing partitions)")


def automation_sensor(derived: list[AssetKey]) -> AutomationConditionSensorDefinition:
    """One sensor for every derived asset that is not per (model, corpus): model report, joins, statistics,
    cross-model figures, trajectory and ``report_html``. One tick evaluates them all, so an update requests
    everything that follows it at once (an unpartitioned set in one run, in dependency order): the report
    is rebuilt after the joins, statistics and figures it shows, never beside stale ones."""
    return AutomationConditionSensorDefinition(
        "automation_sensor",
        target=AssetSelection.assets(*derived),
        minimum_interval_seconds=SENSOR_INTERVAL_S,
        default_status=DefaultSensorStatus.RUNNING,
        description="Rebuilds the model report, joins, statistics, cross-model figures, trajectories and the "
                    "report after their inputs change, the report last (one tick, one run).",
    )
