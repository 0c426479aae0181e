"""Automation conditions shared by the assets (Dagster declarative automation).

- per (model, corpus) asset: ``AutomationCondition.eager()`` (new partitions once their corpus and registry
  entry exist, and after any upstream update), evaluated by ``model_automation_sensor``
  (qk_assets.assets.registry; stopped by default);
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
    DefaultSensorStatus,
)

SENSOR_INTERVAL_S = 5

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
