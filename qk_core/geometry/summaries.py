"""Per-layer and per-model summaries of per-head tables: mean, median and interquartile range.

A per-head table has one row per sampled head and a ``status`` column (``"ok"`` or the reason code of a
head that could not be analysed). Summaries use the ``ok`` heads with a finite value only and say how
many heads they skipped, so one bad head never turns a model value into NaN silently.

Model values are means over heads (SPEC 4.5, used alike for sections 2 and 3); medians and the
interquartile range (25th-75th percentile, numpy's linear interpolation) are reported beside them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

OK = "ok"
SUMMARY_COLUMNS = ["quantity", "unit", "mean", "median", "q25", "q75", "iqr", "n_heads", "n_skipped"]


def describe(values: Iterable[float] | np.ndarray | pd.Series) -> dict[str, float | int]:
    """Mean, median, quartiles and IQR of the finite values; ``n`` finite, ``n_nonfinite`` dropped."""
    arr = np.asarray(values, dtype=float).ravel()
    finite = arr[np.isfinite(arr)]
    if finite.size == 0:
        nan = float("nan")
        return {"mean": nan, "median": nan, "q25": nan, "q75": nan, "iqr": nan, "n": 0,
                "n_nonfinite": int(arr.size)}
    q25, med, q75 = np.percentile(finite, [25.0, 50.0, 75.0])
    return {"mean": float(finite.mean()), "median": float(med), "q25": float(q25), "q75": float(q75),
            "iqr": float(q75 - q25), "n": int(finite.size), "n_nonfinite": int(arr.size - finite.size)}


def ok_mask(df: pd.DataFrame, status_col: str = "status") -> np.ndarray:
    """Rows whose status is ``ok`` (all rows when the table has no status column)."""
    if status_col not in df.columns:
        return np.ones(len(df), dtype=bool)
    return (df[status_col].astype(str) == OK).to_numpy()


def _groups(df: pd.DataFrame, by: Sequence[str]) -> list[tuple[tuple[Any, ...], np.ndarray]]:
    """(the ``by`` values, the row positions) of each group of ``df``, sorted; all rows in one without ``by``."""
    if not by:
        return [((), np.arange(len(df)))]
    grouped = df.groupby(list(by), sort=True, dropna=False).indices
    return [((k if isinstance(k, tuple) else (k,)), np.asarray(idx)) for k, idx in grouped.items()]


def summarise(df: pd.DataFrame, quantities: Mapping[str, str], by: Sequence[str] = (),
              status_col: str = "status") -> pd.DataFrame:
    """Long summary table: one row per group (``by`` columns) and quantity.

    ``quantities`` maps a column of ``df`` to its unit. ``n_heads`` counts the ok heads with a finite
    value; ``n_skipped`` the other heads of the group (not ok, or a non-finite value).
    """
    good = ok_mask(df, status_col)
    rows = []
    for key, idx in _groups(df, by):
        for col, unit in quantities.items():
            vals = pd.to_numeric(df[col].iloc[idx], errors="coerce").to_numpy(dtype=float)
            vals = np.where(good[idx], vals, np.nan)
            stats = describe(vals)
            rows.append({**dict(zip(by, key, strict=True)), "quantity": col, "unit": unit,
                         "mean": stats["mean"], "median": stats["median"], "q25": stats["q25"],
                         "q75": stats["q75"], "iqr": stats["iqr"], "n_heads": stats["n"],
                         "n_skipped": int(len(idx) - stats["n"])})
    return pd.DataFrame(rows, columns=[*by, *SUMMARY_COLUMNS])


def shares(df: pd.DataFrame, column: str, categories: Sequence[str], by: Sequence[str] = (),
           status_col: str = "status", prefix: str = "share_") -> pd.DataFrame:
    """Share of ok heads in each category of ``column`` per group, in the summary table's layout.

    ``mean`` holds the share (a fraction of the group's ok heads); median and quartiles are NaN.
    """
    good = ok_mask(df, status_col)
    rows = []
    nan = float("nan")
    for key, idx in _groups(df, by):
        sel = idx[good[idx]]
        labels = df[column].iloc[sel].astype(str).to_numpy()
        for cat in categories:
            share = float(np.mean(labels == cat)) if sel.size else nan
            rows.append({**dict(zip(by, key, strict=True)), "quantity": f"{prefix}{cat}",
                         "unit": "fraction of heads", "mean": share, "median": nan, "q25": nan,
                         "q75": nan, "iqr": nan, "n_heads": int(sel.size),
                         "n_skipped": int(len(idx) - sel.size)})
    return pd.DataFrame(rows, columns=[*by, *SUMMARY_COLUMNS])


def layer_and_model_summary(df: pd.DataFrame, quantities: Mapping[str, str], model: str,
                            category: tuple[str, Sequence[str]] | None = None,
                            status_col: str = "status") -> pd.DataFrame:
    """Per-layer rows (``scope = "layer"``) followed by whole-model rows (``scope = "model"``, layer NA).

    ``category`` = (column, categories) adds the category shares (e.g. the PCA taxonomy, SPEC 2).
    """
    parts = []
    for by, scope in ((("layer",), "layer"), ((), "model")):
        part = summarise(df, quantities, by=by, status_col=status_col)
        if category is not None:
            part = pd.concat([part, shares(df, category[0], category[1], by=by, status_col=status_col)],
                             ignore_index=True)
        if not by:
            part.insert(0, "layer", pd.NA)
        part.insert(0, "scope", scope)
        parts.append(part)
    out = pd.concat(parts, ignore_index=True)
    out.insert(0, "model", model)
    out["layer"] = out["layer"].astype("Int64")
    return out


#: Statuses of heads that could not be read or analysed because something is broken (unreadable or damaged
#: files, NaN/inf vectors, wrong shapes), as opposed to what the data gives (too few rows, zero variance).
FAILED_STATUSES = ("read_error", "bad_shape", "non_finite", "failed")


class IncompleteResultError(RuntimeError):
    """Heads could not be read or analysed and partial results were not allowed; nothing is written."""


def missing_heads(df: pd.DataFrame, status_col: str = "status") -> dict[str, int]:
    """Count of heads per :data:`FAILED_STATUSES` status (empty when none failed)."""
    if status_col not in df.columns:
        return {}
    counts = df[status_col].astype(str).value_counts()
    return {s: int(counts[s]) for s in FAILED_STATUSES if s in counts}


def require_complete(df: pd.DataFrame, what: str, allow_partial: bool, option: str) -> dict[str, Any]:
    """Fail unless every head was read and analysed, or ``allow_partial`` (issue 14: nothing silently shrinks).

    Raising before any output is written keeps the previous outputs as they were. Returns what the
    outputs record: ``n_heads_missing`` and ``missing_reasons`` (status -> count).
    """
    reasons = missing_heads(df)
    n = sum(reasons.values())
    if n and not allow_partial:
        bad = df[df["status"].astype(str).isin(list(reasons))]
        first = bad.iloc[0]
        where = f"layer {first.get('layer')} head {first.get('q_head')}: {first.get('status')}: {first.get('reason')}"
        raise IncompleteResultError(
            f"{what}: {n} of {len(df)} heads could not be read or analysed {reasons} (first: {where}). Nothing "
            f"was written; the previous outputs stay. Repair the capture, or set {option} = true to publish "
            "results over the remaining heads (the outputs then record how many are missing and why).")
    return {"n_heads_missing": n, "missing_reasons": reasons}


def skipped_summary(df: pd.DataFrame, status_col: str = "status") -> dict[str, int]:
    """Count of heads per non-ok status (empty when every head is ok)."""
    if status_col not in df.columns:
        return {}
    bad = df.loc[~ok_mask(df, status_col), status_col].astype(str)
    return {str(k): int(v) for k, v in bad.value_counts().sort_index().items()}


def wide_by_model(metrics: pd.DataFrame, names: Sequence[str] | None = None, column: str = "value") -> pd.DataFrame:
    """Long-format metrics (qk_core.io.metrics) -> one row per model, one column per metric (``metric[key]``)."""
    df = metrics if names is None else metrics[metrics["metric"].isin(list(names))]
    if df.empty:
        return pd.DataFrame({"model": pd.Series(dtype=str)})
    keys = df["key"].fillna("").astype(str)
    label = df["metric"].where(keys == "", df["metric"] + "[" + keys + "]")
    wide = df.assign(_label=label).pivot_table(index="model", columns="_label", values=column, aggfunc="first",
                                               sort=False)
    wide.columns.name = None
    return wide.reset_index()
