"""What the per-partition asset checks test, as pure functions of result tables (issues 21.4 and 25.2).

Each function returns the offending rows (empty: the check passes) or a small result object; the Dagster
wiring (check specs, severities, blocking) is in :mod:`qk_assets.checks`. Nothing here imports Dagster.

- :func:`nonfinite_values`: rows of a table that should hold values whose value is NaN or infinite, and
  :func:`unfounded_values`: those of named metrics that are NaN because no head founds them (``n_heads`` 0,
  e.g. the share of heads with a verdict when no head carries a linear position signal, SPEC 3 (ii));
- :func:`head_coverage`: every head the capture lists has a row in a per-head table (none silently missing),
  and how many were analysed (status ``ok``) against how many were configured, skipped heads with reasons;
- :func:`intervals_missing_point`: rows whose interval [lo, hi] does not contain its point value (the
  document-bootstrap AP intervals of SPEC 4.6 are centred on their point: resamples of ratio estimators);
- :func:`inverted_intervals`: rows with lo > hi (a basic interval need not contain its point, SPEC 10, but is
  never inverted);
- :func:`profile_gaps`: analysed heads whose plasticity profile (SPEC 4.4) lacks bucket rows, or has no value
  in the first or the last 20% of the window, which AP_first20 / AP_last20 / AP_drop need (SPEC 4.5).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

OK = "ok"
HEAD_KEY = ("layer", "q_head")
#: relative slack of an interval bound against its point (the bound is a resample, the point another sum)
INTERVAL_RTOL = 1e-9


def _floats(s: pd.Series) -> np.ndarray:
    return pd.to_numeric(s, errors="coerce").to_numpy(dtype=float)


def nonfinite_values(df: pd.DataFrame, column: str = "value") -> pd.DataFrame:
    """Rows of ``df`` whose ``column`` is missing, NaN or infinite."""
    if column not in df.columns:
        raise KeyError(f"table has no column '{column}' (columns: {list(df.columns)})")
    return df[~np.isfinite(_floats(df[column]))]


def unfounded_values(df: pd.DataFrame, metrics: Collection[str], column: str = "value") -> pd.DataFrame:
    """Rows of ``df`` for one of ``metrics`` whose ``column`` is NaN because no head founds it (``n_heads`` 0):
    a summary over an empty set of heads, undefined rather than wrong where the analysis says it may be."""
    if "n_heads" not in df.columns or "metric" not in df.columns or not metrics:
        return df.iloc[:0]
    return df[df["metric"].isin(list(metrics)) & np.isnan(_floats(df[column])) & (_floats(df["n_heads"]) == 0)]


@dataclass
class HeadCoverage:
    """Heads of one per-head table against the heads the capture lists (the configured heads)."""

    configured: int
    analysed: int
    absent: list[tuple[int, int]]  # listed by the capture, no row in the table: silently missing
    skipped: pd.DataFrame  # rows whose status is not ok: layer, q_head, status, reason
    reasons: dict[str, int] = field(default_factory=dict)  # status -> heads

    def passed(self, allow_partial: bool) -> bool:
        """No head silently missing, at least one analysed, and all of them unless ``allow_partial``."""
        if self.absent or self.analysed == 0:
            return False
        return allow_partial or self.analysed >= self.configured

    def describe(self, what: str, allow_partial: bool, option: str) -> str:
        """One sentence naming what failed (or what passed), with the first skipped head and its reason."""
        parts = [f"{what}: {self.analysed} of {self.configured} configured heads analysed"]
        if self.reasons:
            first = self.skipped.iloc[0]
            parts.append(f"skipped {self.reasons} (first: layer {first['layer']} head {first['q_head']}: "
                         f"{first['status']}: {first['reason']})")
        if self.absent:
            parts.append(f"{len(self.absent)} heads of the capture have no row at all (first: layer "
                         f"{self.absent[0][0]} head {self.absent[0][1]})")
        text = "; ".join(parts)
        if self.analysed == 0:
            return text + "; no head holds a value"
        if self.analysed < self.configured and not self.absent:
            return text + ("; allowed by " + option if allow_partial else
                           f"; set {option} = true to accept fewer heads")
        return text


def head_coverage(configured: pd.DataFrame, table: pd.DataFrame) -> HeadCoverage:
    """Compare a per-head table (``layer``, ``q_head``, ``status``, ``reason``) with the configured heads."""
    want = {(int(a), int(b)) for a, b in zip(configured["layer"], configured["q_head"], strict=True)}
    have = {(int(a), int(b)) for a, b in zip(table["layer"], table["q_head"], strict=True)} if len(table) else set()
    status = table["status"].astype(str) if len(table) else pd.Series(dtype=str)
    ok = (status == OK).to_numpy()
    skipped = table.loc[~ok, ["layer", "q_head", "status", *(["reason"] if "reason" in table else [])]].copy()
    if "reason" not in skipped:
        skipped["reason"] = ""
    skipped = skipped.sort_values(list(HEAD_KEY), ignore_index=True)
    reasons = {str(k): int(v) for k, v in skipped["status"].astype(str).value_counts().sort_index().items()}
    return HeadCoverage(configured=len(want), analysed=int(ok.sum()), absent=sorted(want - have),
                        skipped=skipped, reasons=reasons)


def intervals_missing_point(df: pd.DataFrame, value: str, lo: str, hi: str,
                            rtol: float = INTERVAL_RTOL) -> pd.DataFrame:
    """Rows whose finite interval [``lo``, ``hi``] does not contain their finite ``value``.

    Rows without an interval (NaN bound) or value are not judged here (:func:`nonfinite_values` is)."""
    v, a, b = _floats(df[value]), _floats(df[lo]), _floats(df[hi])
    judged = np.isfinite(v) & np.isfinite(a) & np.isfinite(b)
    slack = rtol * np.maximum(1.0, np.abs(np.where(judged, v, 0.0)))
    with np.errstate(invalid="ignore"):
        outside = judged & ((v < a - slack) | (v > b + slack))
    return df[outside]


def inverted_intervals(df: pd.DataFrame, lo: str = "lo", hi: str = "hi") -> pd.DataFrame:
    """Rows whose finite interval has ``lo`` > ``hi``."""
    a, b = _floats(df[lo]), _floats(df[hi])
    with np.errstate(invalid="ignore"):
        return df[np.isfinite(a) & np.isfinite(b) & (a > b)]


def profile_gaps(profiles: pd.DataFrame, heads: pd.DataFrame, window: int, bucket: int,
                 edges: Sequence[float] = (0.2, 0.8)) -> pd.DataFrame:
    """Analysed (``ok``) heads whose profile does not cover the window (SPEC 4.4-4.5).

    A profile covers it when it has a row for every bucket 0 .. L/B - 1 and a finite ``ap`` in a bucket with
    tau in [0, 0.2 L) and in one with tau in [0.8 L, L]. Returns one row per uncovered head: layer, q_head,
    buckets (rows present), buckets_with_value, first20, last20 (has a value there) and what is missing.
    """
    n_buckets = max(int(window) // max(int(bucket), 1), 1)
    ok_heads = heads.loc[heads["status"].astype(str) == OK, list(HEAD_KEY)]
    groups = profiles.groupby(list(HEAD_KEY)) if len(profiles) else {}
    rows = []
    for layer, q_head in ok_heads.itertuples(index=False):
        key = (int(layer), int(q_head))
        prof = groups.get_group(key) if len(profiles) and key in groups.groups else profiles.iloc[0:0]
        ap = _floats(prof["ap"]) if len(prof) else np.zeros(0)
        frac = _floats(prof["tau_frac"]) if len(prof) else np.zeros(0)
        has = np.isfinite(ap)
        first = bool((has & (frac < edges[0])).any())
        last = bool((has & (frac >= edges[1])).any())
        n_rows = int(prof["bucket"].nunique()) if len(prof) else 0
        missing = [m for m, bad in (("bucket rows", n_rows < n_buckets), ("first 20%", not first),
                                    ("last 20%", not last)) if bad]
        if missing:
            rows.append({"layer": key[0], "q_head": key[1], "buckets": n_rows, "buckets_expected": n_buckets,
                         "buckets_with_value": int(has.sum()), "first20": first, "last20": last,
                         "missing": ", ".join(missing)})
    return pd.DataFrame(rows, columns=["layer", "q_head", "buckets", "buckets_expected", "buckets_with_value",
                                       "first20", "last20", "missing"])
