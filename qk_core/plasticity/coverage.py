"""How far the sampled protocol's plasticity is from the query model of every position (SPEC 12.3), on one capture.

AP (SPEC 4.5) needs key pairs, so only the capture's sampled heads have it under either coverage: its gap is the
position part alone (the query model's rows: the sampled queries, or every position, SPEC 12.2), on the same pairs.
The query model itself (SPEC 4.1) exists for every eligible head under coverage ``all``
(``plasticity_query_heads``), so its gap has a head part too. :func:`plasticity_coverage_gap` takes the published
tables (one coverage), refits the other coverage from the same capture with the recorded options (pairs not kept) and
compares per metric (:func:`qk_core.stats.sampling_gap.compare_coverages`).

AP's position part gets a standard error from this one capture where both analyses left each document out in turn
(interval ``jackknife_t``, SPEC 4.6; ``plasticity_profiles``' ``ap_loo``) over the same units: the documents while
there are no more of them than ``capture.moment_groups``, the document groups beyond (coverage ``all`` keeps no
finer sums; coverage ``sampled``'s refits then leave the same groups out: ``analyse_capture(loo_groups=True)``, a
second refit when the published table is the sampled one, whose refits left documents out). The query model's drift
(SPEC 4.1: |beta|, alpha_pos, sigma_pos, mean R^2) gets one over the same units too: its regression on position needs
only pooled sums, so both coverages refit it here (:func:`loo_drift_of_rows`: each sampled head's queries without the
unit's; :func:`loo_drift_of_moments`: every head's merged sums less the unit's own), whatever AP's interval.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from qk_core.capture.store import CaptureError, CaptureReader, NoUnitSumsError
from qk_core.config.options import PlasticityOptions, n_buckets
from qk_core.io.storage import Storage
from qk_core.plasticity import aggregates as agg
from qk_core.plasticity.analysis import analyse_capture
from qk_core.plasticity.jackknife import stored_loo_profiles
from qk_core.plasticity.query_model import drift_values, position_regressions
from qk_core.stats.sampling_gap import (
    KEYS,
    TABLE_COLUMNS,
    compare_coverages,
    other_coverage,
    recorded_coverage,
    recorded_options,
)

#: the per-head values compared, with their units: AP of the sampled heads (SPEC 4.5) and the query model (SPEC 4.1)
AP_GAP_METRICS = {"ap_overall": "AP", "ap_first20": "AP", "ap_last20": "AP", "ap_drop": "AP"}
QUERY_GAP_METRICS = {"beta_norm_per_token": "per token", "beta_norm_window": "window-normalised (x L)",
                     "alpha_pos": "vector units", "sigma_pos": "vector units", "mean_coord_r2": "R^2"}


def loo_headlines(heads: pd.DataFrame, profiles: pd.DataFrame | None) -> dict[str, pd.DataFrame] | None:
    """Per AP headline metric (SPEC 4.5), each analysed head's value with each document (group) left out: a frame
    indexed by (layer, q_head), one column per unit, from the leave-one-out profiles ``profiles`` stores
    (:func:`~qk_core.plasticity.jackknife.stored_loo_profiles`); None when it stores none."""
    ok = heads[heads["status"] == "ok"] if "status" in heads else heads
    if not len(ok) or profiles is None:
        return None
    keys = [(int(a), int(b)) for a, b in zip(ok["layer"], ok["q_head"], strict=True)]
    L, B = int(ok["L"].iloc[0]), int(ok["B"].iloc[0])
    loo = stored_loo_profiles(profiles, keys, n_buckets(L, B))
    if loo is None:
        return None
    index = pd.MultiIndex.from_tuples(keys, names=KEYS)
    return {name: pd.DataFrame(values, index=index) for name, values in agg.headline(loo, L, B).items()}


def _drift_frames(values: Mapping[tuple[int, int], Mapping[str, Sequence[float]]], n_units: int
                  ) -> dict[str, pd.DataFrame]:
    """Per query-model metric, a frame indexed by (layer, q_head), one column per unit, from each head's per-unit
    values."""
    index = pd.MultiIndex.from_tuples(sorted(values), names=KEYS)
    return {m: pd.DataFrame([[values[h][m][u] for u in range(n_units)] for h in index], index=index,
                            columns=range(n_units), dtype=float) for m in QUERY_GAP_METRICS}


def loo_drift_of_rows(reader: CaptureReader, heads: Sequence[tuple[int, int]], units: Sequence[Sequence[int]]
                      ) -> dict[str, pd.DataFrame]:
    """Coverage ``sampled``'s query-model drift (SPEC 4.1: :func:`~qk_core.plasticity.query_model.drift_values`) of
    each sampled head refitted on its sampled queries without each unit's documents in turn (``units``:
    :meth:`~qk_core.capture.store.CaptureReader.units`), per metric a frame (:func:`_drift_frames`); one head's rows
    in memory at a time."""
    values: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    for layer, q_head in heads:
        head = reader.read_head(int(layer), int(q_head))
        q, t = np.asarray(head.q, np.float64), np.asarray(head.q_pos, np.float64)
        sums: dict[str, list[Any]] = {k: [] for k in ("n", "t", "tt", "x", "xt", "xx")}
        for unit in units:
            keep = ~np.isin(head.q_doc, unit)
            qk, tk = q[keep], t[keep]
            for k, v in (("n", float(keep.sum())), ("t", tk.sum()), ("tt", tk @ tk), ("x", qk.sum(axis=0)),
                         ("xt", tk @ qk), ("xx", qk.T @ qk)):
                sums[k].append(v)
        reg = position_regressions({k: np.asarray(v)[:, None] for k, v in sums.items()})
        values[(int(layer), int(q_head))] = drift_values(reg, reader.window)
    return _drift_frames(values, len(units))


def loo_drift_of_moments(reader: CaptureReader) -> tuple[list[list[int]], dict[str, pd.DataFrame]]:
    """Coverage ``all``'s query-model drift (SPEC 4.1, 12.2) of every eligible head refitted on the merged moments less
    each unit's own (:meth:`~qk_core.capture.store.CaptureReader.read_unit_moments`; the pooled query sums are all the
    drift reads), every head of a layer at once: (the units, per metric a frame as :func:`loo_drift_of_rows`'). A
    capture that keeps no unit sums is a :class:`~qk_core.capture.store.NoUnitSumsError`."""
    units = reader.units()
    values: dict[tuple[int, int], dict[str, list[float]]] = {}
    for layer in reader.moment_layers():
        merged = reader.read_moments(layer, pooled=True)
        whole = merged.q_pooled()
        per_unit = []
        for m in reader.read_unit_moments(layer, pooled=True):
            if not np.array_equal(m.q_heads, merged.q_heads):
                raise CaptureError(f"{reader.storage.uri(reader.prefix)}: layer {layer}: documents {m.docs[:3]}... "
                                   f"hold query heads {m.q_heads.tolist()}, the merge {merged.q_heads.tolist()}")
            part = m.q_pooled()
            per_unit.append(drift_values(position_regressions({k: (whole[k] - part[k])[:, None] for k in whole}),
                                         reader.window))
        for i, q_head in enumerate(merged.q_heads):
            values[(int(layer), int(q_head))] = {k: [float(u[k][i]) for u in per_unit] for k in QUERY_GAP_METRICS}
    return units, _drift_frames(values, len(units))


def _units(loo: dict[str, pd.DataFrame]) -> int:
    """The documents (groups) of :func:`loo_headlines`' frames."""
    return next(iter(loo.values())).shape[1]


def plasticity_coverage_gap(model: str, storage: Storage, prefix: str, heads: list[tuple[int, int]],
                            plasticity_heads: pd.DataFrame, query_heads: pd.DataFrame,
                            profiles: pd.DataFrame | None = None) -> tuple[pd.DataFrame, str]:
    """One row per AP and query-model metric (:data:`~qk_core.stats.sampling_gap.TABLE_COLUMNS`; SPEC 12.3) comparing
    coverage ``sampled`` with ``all`` on the capture at ``prefix`` (its sampled ``heads``), and a sentence saying
    what was compared.

    ``plasticity_heads`` / ``query_heads`` / ``profiles`` are the published ``plasticity_heads``,
    ``plasticity_query_heads`` and ``plasticity_profiles`` (either coverage); the other coverage is refitted with the
    options they record. AP's position part has a standard error where both hold leave-one-out values of the same
    documents, the query model's where the capture keeps its units' sums (module docstring). An empty table (and the
    reason) when the capture holds no moments or nothing was analysed."""
    published = recorded_coverage(plasticity_heads)
    if published is None:
        return pd.DataFrame(columns=TABLE_COLUMNS), "no per-head values to compare"
    reader = CaptureReader(storage, prefix)
    if not reader.moment_layers():
        return (pd.DataFrame(columns=TABLE_COLUMNS),
                "the capture holds no moments (capture.moments = false), so coverage 'all' cannot be formed")
    other = other_coverage(published)
    opts = dataclasses.replace(recorded_options(plasticity_heads, PlasticityOptions, other), keep_pairs=False)
    if other == "all" and not reader.moment_groups():  # a capture from before the groups: no refits without one
        opts = dataclasses.replace(opts, interval="percentile")
    refit = analyse_capture(model, storage, prefix, heads, opts, loo_groups=True)
    ap = {published: plasticity_heads, other: refit.heads}
    query = {published: query_heads, other: refit.query_heads}
    loo = {published: loo_headlines(plasticity_heads, profiles), other: loo_headlines(refit.heads, refit.profiles)}
    n_docs = int(reader.doc_tokens().shape[0])
    groups = min(n_docs, reader.moment_groups())  # the units of coverage all's refits
    if published == "sampled" and groups and loo["sampled"] is not None and _units(loo["sampled"]) != groups:
        again = dataclasses.replace(recorded_options(plasticity_heads, PlasticityOptions, "sampled"), keep_pairs=False)
        regrouped = analyse_capture(model, storage, prefix, heads, again, loo_groups=True)
        loo["sampled"] = loo_headlines(regrouped.heads, regrouped.profiles)
    units = {c: _units(v) for c, v in loo.items() if v is not None}  # documents (groups)
    paired = None
    if len(units) < 2:
        why = "AP's position part has no error: no leave-one-out values (interval 'jackknife_t' with resamples)"
    elif units["sampled"] != units["all"]:
        why = (f"AP's position part has no error: coverage 'sampled' left out {units['sampled']} documents, 'all' "
               f"{units['all']} document groups")
    else:
        what = f"{n_docs} documents" if units["all"] == n_docs else f"{units['all']} groups of the {n_docs} documents"
        why = f"AP's position part with its jackknife error over the {what}"
        paired = {m: (loo["sampled"][m], loo["all"][m]) for m in AP_GAP_METRICS}
    try:  # the query model's drift refitted without each unit under both coverages
        drift_units, drift_all = loo_drift_of_moments(reader)
        drift_rows = loo_drift_of_rows(reader, heads, drift_units)
        drift = {m: (drift_rows[m], drift_all[m]) for m in QUERY_GAP_METRICS}
        what = (f"{n_docs} documents" if len(drift_units) == n_docs
                else f"{len(drift_units)} groups of the {n_docs} documents")
        why += f"; the query model's position part with its jackknife error over the {what}"
    except NoUnitSumsError as exc:
        drift = None
        why += f"; the query model's position part has no error: {exc}"
    rows = (compare_coverages(ap["sampled"], ap["all"], AP_GAP_METRICS, "plasticity", loo=paired,
                              inflation=float(opts.interval_inflation))
            + compare_coverages(query["sampled"], query["all"], QUERY_GAP_METRICS, "query model", loo=drift))
    table = pd.DataFrame([{"model": model, "published": published, **r, "n_docs": n_docs} for r in rows],
                         columns=TABLE_COLUMNS)
    return table, (f"plasticity published with coverage {published!r}; coverage {other!r} refitted from the same "
                   f"capture with the recorded options; {why}")
