"""Automation conditions shared by the assets (Dagster declarative automation).

- per (model, corpus) asset: ``AutomationCondition.eager()`` (new partitions once their corpus and registry
  entry exist, and after any upstream update), evaluated by ``model_automation_sensor``;
- cross-model assets: :data:`AFTER_UPSTREAM` (like eager, but a model that is not analysed yet does not
  block them), evaluated by ``automation_sensor`` with the report, so one tick requests everything that
  follows one update and the report is built last, in the same run.
"""

from dagster import AutomationCondition

AFTER_UPSTREAM = (
    (AutomationCondition.newly_missing() | AutomationCondition.any_deps_updated()).since_last_handled()
    & ~AutomationCondition.any_deps_in_progress()
    & ~AutomationCondition.in_progress()
).with_label("after upstream updates, once nothing upstream runs (tolerates missing partitions)")
