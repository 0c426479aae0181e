"""Per-partition asset checks of the per-model tables (issues 21.4, 25.2): their specs and their results.

What each check tests is a pure function of :mod:`qk_core.io.table_checks`; this module turns it into Dagster
check specs (partitioned like the asset, so each partition has its own result in the asset's *Checks* tab)
and :class:`~dagster.AssetCheckResult` values that name the offending heads or rows in their metadata.
The assets that own the tables evaluate them on the values they have just written (``check_specs`` of the
asset / multi-asset), so a check never re-reads a table.

Checks and whether they block what follows (a failed blocking check fails the step, so the run is not
green and nothing downstream of the asset runs on it):

- ``heads_analysed`` (``pca_heads``, ``rotation_heads``, ``plasticity_heads``; blocking): fails when a head
  the capture lists has no row, no head has a value, or fewer heads were analysed (status ``ok``) than
  configured (the heads the capture sampled: ``capture.heads`` of the registry entry, or every eligible head
  when fewer) without the analysis's ``allow_partial``; skipped heads count against it, their reasons in the
  metadata.
- ``values_finite`` (``pca_metrics``, ``rotation_metrics``, ``plasticity_metrics``, ``cross_corpus_metrics``;
  blocking): fails when the table holds no row, or a row whose ``value`` is NaN / infinite (named by metric
  and key); except that a metric the analysis declares undefined over no head (``rotation_metrics``: the
  values over heads with a linear position signal, SPEC 3 (ii)) may be NaN with ``n_heads`` 0: reported.
- ``intervals_contain_values`` (``plasticity_heads``, ``plasticity_metrics``; not blocking): fails when a
  document-bootstrap interval of AP (SPEC 4.6) does not contain its point value.
- ``intervals_well_formed`` (``cross_corpus_metrics``; not blocking): fails when an interval is inverted
  (lo > hi); its basic intervals (SPEC 10) need not contain the point, so containment is reported, not failed.
- ``profile_coverage`` (``plasticity_profiles``; not blocking): fails when an analysed head's profile lacks
  bucket rows or has no value in the first or the last 20% of the window.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterable, Iterator, Sequence

import pandas as pd
from dagster import (
    AssetCheckKey,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    MetadataValue,
    PartitionsDefinition,
    PreviewWarning,
)

from qk_assets.metadata import table_value
from qk_core.io.table_checks import (
    head_coverage,
    intervals_missing_point,
    inverted_intervals,
    nonfinite_values,
    profile_gaps,
    unfounded_values,
)

HEADS_ANALYSED = "heads_analysed"
VALUES_FINITE = "values_finite"
INTERVALS_CONTAIN = "intervals_contain_values"
INTERVALS_FORMED = "intervals_well_formed"
PROFILE_COVERAGE = "profile_coverage"
#: rows of offending heads / values shown on a check result
SHOWN = 50

DESCRIPTIONS = {
    HEADS_ANALYSED: "Every head the capture lists has a row, and every one was analysed (status ok) unless the "
                    "analysis's allow_partial is set; skipped heads count against it, with their reasons. Blocking.",
    VALUES_FINITE: "The table holds values, and every value is finite (rows named by metric and key). Blocking.",
    INTERVALS_CONTAIN: "Every document-bootstrap interval of AP (SPEC 4.6) contains its point value.",
    INTERVALS_FORMED: "Every interval has lo <= hi. Basic (reverse percentile) intervals need not contain their "
                      "point (SPEC 10, qk_core.cross_corpus.compare); how many do not is reported.",
    PROFILE_COVERAGE: "Every analysed head's profile has a row per bucket and a value in the first and in the last "
                      "20% of the window (what AP_first20, AP_last20 and AP_drop need, SPEC 4.4-4.5).",
}
BLOCKING = {HEADS_ANALYSED: True, VALUES_FINITE: True, INTERVALS_CONTAIN: False, INTERVALS_FORMED: False,
            PROFILE_COVERAGE: False}


def check_spec(name: str, asset: str, description: str, blocking: bool,
               partitions_def: PartitionsDefinition) -> AssetCheckSpec:
    """A check spec partitioned like its asset: one result per partition in the asset's *Checks* tab."""
    with warnings.catch_warnings():  # a partitioned check spec is a Dagster preview API; acknowledged here
        warnings.simplefilter("ignore", PreviewWarning)
        return AssetCheckSpec(name, asset=asset, description=description, blocking=blocking,
                              partitions_def=partitions_def)


def check_specs(checks: Iterable[tuple[str, str]], partitions_def: PartitionsDefinition) -> list[AssetCheckSpec]:
    """Specs of this module's checks for (asset, check name) pairs, partitioned like their asset."""
    return [check_spec(name, asset, DESCRIPTIONS[name], BLOCKING[name], partitions_def) for asset, name in checks]


def selected(context: AssetExecutionContext, results: Iterable[AssetCheckResult]) -> Iterator[AssetCheckResult]:
    """The results whose check is selected in this run (a subset run selects only some)."""
    keys = context.selected_asset_check_keys
    for r in results:
        if AssetCheckKey(r.asset_key, r.check_name) in keys:
            yield r


def _result(asset: str, name: str, passed: bool, description: str, metadata: dict) -> AssetCheckResult:
    return AssetCheckResult(asset_key=asset, check_name=name, passed=bool(passed), severity=AssetCheckSeverity.ERROR,
                            description=description, metadata=metadata)


def heads_analysed(asset: str, capture_heads: pd.DataFrame, heads: pd.DataFrame, allow_partial: bool,
                   option: str) -> AssetCheckResult:
    """``heads_analysed`` of a per-head table against the capture's heads; ``option`` names allow_partial."""
    cov = head_coverage(capture_heads, heads)
    return _result(asset, HEADS_ANALYSED, cov.passed(allow_partial), cov.describe(asset, allow_partial, option), {
        "heads_configured": cov.configured, "heads_analysed": cov.analysed,
        "heads_skipped": MetadataValue.json(cov.reasons), "heads_absent": len(cov.absent),
        "allow_partial": bool(allow_partial),
        "skipped_heads": table_value(cov.skipped, max_rows=SHOWN),
        "absent_heads": MetadataValue.json([list(h) for h in cov.absent[:SHOWN]])})


def values_finite(asset: str, table: pd.DataFrame, labels: Sequence[str] = ("metric", "key"),
                  empty_because: str = "", may_be_undefined: Collection[str] = ()) -> AssetCheckResult:
    """``values_finite`` of a long metrics table (column ``value``); ``empty_because``: why this partition's
    table is rightly empty (it then passes saying so), e.g. a model with one corpus has nothing to compare;
    ``may_be_undefined``: metrics whose NaN over no head (``n_heads`` 0) is reported, not failed."""
    undefined = unfounded_values(table, may_be_undefined)
    bad = nonfinite_values(table).drop(index=undefined.index)
    cols = [c for c in (*labels, "value", "n_heads") if c in table.columns]
    if table.empty and empty_because:
        return _result(asset, VALUES_FINITE, True, f"{asset}: no values expected: {empty_because}",
                       {"rows": 0, "nonfinite": 0})
    if table.empty:
        text = f"{asset}: the table holds no value"
    elif len(bad):
        first = ", ".join(f"{c}={bad.iloc[0][c]!r}" for c in labels if c in bad.columns)
        text = f"{asset}: {len(bad)} of {len(table)} values are NaN or infinite (first: {first})"
    else:
        text = f"{asset}: all {len(table)} values finite"
        if len(undefined):
            names = ", ".join(sorted(set(undefined["metric"])))
            text = f"{asset}: {len(table) - len(undefined)} values finite, {len(undefined)} undefined over no " \
                   f"head ({names})"
    return _result(asset, VALUES_FINITE, bool(len(table)) and bad.empty, text, {
        "rows": len(table), "nonfinite": len(bad), "undefined_over_no_head": len(undefined),
        "nonfinite_rows": table_value(bad[cols], max_rows=SHOWN),
        "undefined_rows": table_value(undefined[cols], max_rows=SHOWN)})


def intervals_contain_values(asset: str, table: pd.DataFrame, triples: Sequence[tuple[str, str, str]],
                             labels: Sequence[str]) -> AssetCheckResult:
    """``intervals_contain_values`` over (value, lo, hi) column triples of ``table``."""
    parts, judged = [], 0
    for value, lo, hi in triples:
        if value not in table.columns:
            continue
        judged += int(table[[value, lo, hi]].notna().all(axis=1).sum())
        out = intervals_missing_point(table, value, lo, hi)
        if len(out):
            parts.append(out[[*labels, value, lo, hi]].rename(columns={value: "value", lo: "lo", hi: "hi"})
                         .assign(column=value))
    bad = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=[*labels, "value", "lo", "hi",
                                                                                  "column"])
    if len(bad):
        first = bad.iloc[0]
        where = ", ".join(f"{c}={first[c]!r}" for c in labels)
        text = (f"{asset}: {len(bad)} of {judged} intervals do not contain their point value (first: {where}, "
                f"{first['column']} = {first['value']:.6g} outside [{first['lo']:.6g}, {first['hi']:.6g}])")
    else:
        text = f"{asset}: all {judged} intervals contain their point value"
    return _result(asset, INTERVALS_CONTAIN, bad.empty, text, {
        "intervals": judged, "outside": len(bad), "outside_rows": table_value(bad, max_rows=SHOWN, digits=6)})


def intervals_well_formed(asset: str, table: pd.DataFrame, labels: Sequence[str]) -> AssetCheckResult:
    """``intervals_well_formed`` of a table with ``value``, ``lo``, ``hi``: lo <= hi; containment reported."""
    if table.empty:
        return _result(asset, INTERVALS_FORMED, True, f"{asset}: no intervals", {"intervals": 0})
    bad = inverted_intervals(table)
    outside = intervals_missing_point(table, "value", "lo", "hi")
    judged = int(table[["lo", "hi"]].notna().all(axis=1).sum()) if len(table) else 0
    cols = [c for c in (*labels, "value", "lo", "hi") if c in table.columns]
    text = (f"{asset}: {len(bad)} of {judged} intervals have lo > hi" if len(bad) else
            f"{asset}: all {judged} intervals have lo <= hi; {len(outside)} do not contain their point value "
            "(allowed for basic intervals, SPEC 10)")
    return _result(asset, INTERVALS_FORMED, bad.empty, text, {
        "intervals": judged, "inverted": len(bad), "not_containing_point": len(outside),
        "inverted_rows": table_value(bad[cols], max_rows=SHOWN, digits=6),
        "not_containing_point_rows": table_value(outside[cols], max_rows=SHOWN, digits=6)})


def profile_coverage(asset: str, profiles: pd.DataFrame, heads: pd.DataFrame, window: int,
                     bucket: int) -> AssetCheckResult:
    """``profile_coverage`` of a plasticity profile table against its per-head table."""
    gaps = profile_gaps(profiles, heads, window, bucket)
    n_ok = int((heads["status"].astype(str) == "ok").sum()) if len(heads) else 0
    if len(gaps):
        first = gaps.iloc[0]
        text = (f"{asset}: {len(gaps)} of {n_ok} analysed heads do not cover the window (first: layer "
                f"{first['layer']} head {first['q_head']}: no {first['missing']})")
    else:
        text = f"{asset}: all {n_ok} analysed heads cover the window (L = {window}, B = {bucket})"
    valued = int(profiles["ap"].notna().sum()) if len(profiles) else 0
    return _result(asset, PROFILE_COVERAGE, gaps.empty, text, {
        "heads_analysed": n_ok, "heads_uncovered": len(gaps), "buckets_with_value": valued,
        "bucket_rows": len(profiles), "uncovered_heads": table_value(gaps, max_rows=SHOWN)})
