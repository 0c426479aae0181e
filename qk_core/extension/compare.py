"""The extension comparison of one base model (SPEC 13.3): per variant, the AP profile in absolute positions up
to W with C marked, AP over positions < C and over [C, W), the rotation measures, accuracy by length and depth,
and the effective length; across the variants, the rank correlation of each geometry measure with retrieval
accuracy beyond C (exact p and n, SPEC 5 rules; n >= 3 or no statistic) and a plain statement.

Two scopes of correlation:

- ``cells``: one point per (variant, tested length L > C): AP over [C, L) (the positions the prompt of length L
  adds beyond C) or the variant's whole-window rotation measure, against the accuracy at L;
- ``variants``: one point per variant: AP over [C, W) or the rotation measure, against the accuracy pooled over
  the lengths > C.

The rotation measures over a region of positions (:func:`rotation_regions`) refit SPEC 3 per head on the captured
rows whose positions lie in it (queries and keys), then average over the heads it could analyse; without the
capture the comparison falls back to the variant's whole-window ``rotation_metrics`` and says so (``region``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from qk_core.capture.store import HeadData
from qk_core.config.options import RotationOptions
from qk_core.geometry.heads import HeadInputError
from qk_core.geometry.rotation import analyse_rotation, rotation_record
from qk_core.stats.correlation import MIN_N, correlations, p_clause

ROTATION_MEASURES = ("bias_strength", "abs_r_k_a", "plane_var_fraction", "split_half_cos")
AP_MEASURE = "ap_beyond_c"
ALPHA = 0.05
CORRELATION_COLUMNS = ["scope", "measure", "region", "n", "spearman_rho", "spearman_p", "spearman_method",
                       "kendall_tau", "kendall_p", "pearson_r", "pearson_p", "predicts", "statement"]


Region = tuple[int, int]


def rotation_regions(heads: Iterable[HeadData | HeadInputError], regions: list[Region],
                     options: RotationOptions | None = None) -> dict[Region, dict[str, float]]:
    """Per region [lo, hi): SPEC 3 refitted on each head's rows with positions in it, the mean of each rotation
    measure over the heads it could analyse, and ``n_heads`` (one pass over the heads)."""
    options = options or RotationOptions()
    vals: dict[Region, dict[str, list[float]]] = {r: {m: [] for m in ROTATION_MEASURES} for r in regions}
    for head in heads:
        if isinstance(head, HeadInputError):
            continue
        for lo, hi in regions:
            qm = (head.q_pos >= lo) & (head.q_pos < hi)
            km = (head.k_pos >= lo) & (head.k_pos < hi)
            try:
                res = analyse_rotation(head.q[qm], head.q_pos[qm], head.q_doc[qm], head.k[km], head.k_pos[km],
                                       head.k_doc[km], window=head.window, options=options)
            except HeadInputError:
                continue
            rec = rotation_record(res)
            for m in ROTATION_MEASURES:
                vals[(lo, hi)][m].append(float(rec[m]))
    out = {}
    for r, by in vals.items():
        n = len(by[ROTATION_MEASURES[0]])
        out[r] = {m: float(np.nanmean(v)) if n and np.isfinite(v).any() else float("nan") for m, v in by.items()}
        out[r]["n_heads"] = float(n)
    return out


@dataclass
class VariantInputs:
    """What the comparison reads of one variant (None: not materialised yet)."""

    key: str
    name: str
    type: str
    factor: float | None
    rope_theta: float | None
    profiles: pd.DataFrame | None = None  # plasticity_profiles
    rotation: pd.DataFrame | None = None  # rotation_metrics (long format)
    accuracy: pd.DataFrame | None = None  # extension_accuracy
    effective: pd.DataFrame | None = None  # extension_effective_length (one row)
    regions: dict[Region, dict[str, float]] | None = None  # rotation_regions of the variant's capture

    def missing(self) -> list[str]:
        return [n for n in ("profiles", "rotation", "accuracy", "effective") if getattr(self, n) is None]


def ap_profile(profiles: pd.DataFrame) -> pd.DataFrame:
    """Mean AP over heads per bucket in absolute positions (``tau_tokens``), with the number of heads."""
    ok = profiles[np.isfinite(profiles["ap"].to_numpy(float))]
    g = ok.groupby("tau_tokens")["ap"]
    return pd.DataFrame({"tau_tokens": g.mean().index.to_numpy(float), "ap": g.mean().to_numpy(float),
                         "ap_sd": g.std().to_numpy(float), "n_heads": g.size().to_numpy(int)})


def ap_region(profiles: pd.DataFrame, lo: float, hi: float) -> float:
    """AP over query buckets whose centre lies in [lo, hi): each head's mean over those buckets, then the mean
    over heads (SPEC 4.5); NaN when no bucket with a value lies there."""
    tau = profiles["tau_tokens"].to_numpy(float)
    sel = profiles[(tau >= lo) & (tau < hi) & np.isfinite(profiles["ap"].to_numpy(float))]
    if sel.empty:
        return float("nan")
    return float(sel.groupby(["layer", "q_head"])["ap"].mean().mean())


def _metric(rotation: pd.DataFrame | None, name: str) -> float:
    if rotation is None:
        return float("nan")
    row = rotation[(rotation["metric"] == name) & (rotation["key"].fillna("") == "")]
    return float(row["value"].iloc[0]) if len(row) else float("nan")


def _pooled(accuracy: pd.DataFrame) -> pd.DataFrame:
    return accuracy[accuracy["depth"] < 0].sort_values("length")


def variant_table(variants: list[VariantInputs], trained_context: int, window: int) -> pd.DataFrame:
    """One row per variant: override, AP below / beyond C, rotation measures, accuracy per length, effective
    length, what is missing."""
    C = trained_context
    rows = []
    for v in variants:
        row: dict[str, Any] = {"variant": v.key, "name": v.name, "type": v.type, "factor": v.factor,
                               "rope_theta": v.rope_theta, "trained_context": C, "window": window,
                               "missing": ",".join(v.missing())}
        prof = v.profiles
        row["ap_below_c"] = ap_region(prof, 0, C) if prof is not None else float("nan")
        row[AP_MEASURE] = ap_region(prof, C, window) if prof is not None else float("nan")
        for m in ROTATION_MEASURES:
            row[m] = _metric(v.rotation, m)
        beyond = (v.regions or {}).get((C, window))
        for m in ROTATION_MEASURES:
            row[f"{m}_beyond_c"] = beyond[m] if beyond else float("nan")
        row["n_heads_beyond_c"] = beyond["n_heads"] if beyond else float("nan")
        if v.accuracy is not None:
            pooled = _pooled(v.accuracy)
            for r in pooled.itertuples():
                row[f"accuracy_{int(r.length)}"] = float(r.accuracy)
            beyond = pooled[pooled["length"] > C]
            n = beyond["n_trials"].sum()
            row["accuracy_beyond_c"] = float(beyond["n_correct"].sum() / n) if n else float("nan")
        if v.effective is not None and len(v.effective):
            row["effective_length"] = float(v.effective["effective_length"].iloc[0])
        rows.append(row)
    return pd.DataFrame(rows)


def correlation_rows(variants: list[VariantInputs], trained_context: int, window: int) -> pd.DataFrame:
    """Rank correlations of each geometry measure with accuracy beyond C, per scope, each with n and exact p
    (n < 3: no statistic, said so)."""
    C = trained_context
    table = variant_table(variants, C, window)
    rows = []
    # scope "variants": one point per variant
    refit = all(v.regions for v in variants)  # every variant's capture read: rotation measures over [C, W)
    for measure in (AP_MEASURE, *ROTATION_MEASURES):
        col = measure if measure == AP_MEASURE or not refit else f"{measure}_beyond_c"
        x = table[col].to_numpy(float) if col in table else np.full(len(table), np.nan)
        y = table["accuracy_beyond_c"].to_numpy(float) if "accuracy_beyond_c" in table else np.full(len(table), np.nan)
        region = f"[{C}, {window})" if measure == AP_MEASURE or refit else "whole window (no capture read)"
        rows.append(_row("variants", measure, region, x, y))
    # scope "cells": one point per (variant, length > C)
    xs: dict[str, list[float]] = {m: [] for m in (AP_MEASURE, *ROTATION_MEASURES)}
    ys: list[float] = []
    for v, (_, trow) in zip(variants, table.iterrows(), strict=True):
        if v.accuracy is None:
            continue
        for r in _pooled(v.accuracy).itertuples():
            if r.length <= C:
                continue
            ys.append(float(r.accuracy))
            xs[AP_MEASURE].append(ap_region(v.profiles, C, r.length) if v.profiles is not None else float("nan"))
            cell = (v.regions or {}).get((C, int(r.length)))
            for m in ROTATION_MEASURES:
                xs[m].append(cell[m] if refit and cell else float(trow[m]) if not refit else float("nan"))
    for measure, x in xs.items():
        region = f"[{C}, L) per length L" if measure == AP_MEASURE or refit else "whole window (no capture read)"
        rows.append(_row("cells", measure, region, np.asarray(x, float), np.asarray(ys, float)))
    return pd.DataFrame(rows, columns=CORRELATION_COLUMNS)


def _row(scope: str, measure: str, region: str, x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    st = correlations(x, y)
    n = int(st["n"])
    rho, p = st["spearman_rho"], st["spearman_p"]
    if n < MIN_N:
        statement = f"{measure}: n = {n} < {MIN_N} {scope}, no correlation computed"
        predicts = False
    elif not np.isfinite(rho):
        statement = f"{measure}: constant over the {n} {scope}, no correlation"
        predicts = False
    else:
        predicts = bool(p < ALPHA)
        verb = "predicts" if predicts else "does not predict"
        statement = (f"{measure} ({region}) {verb} retrieval beyond C across {scope}: Spearman rho = {rho:.2f}, "
                     f"{p_clause(p, st['spearman_method'], st['spearman_permutations'])} ({st['spearman_method']}), "
                     f"n = {n}")
    return {"scope": scope, "measure": measure, "region": region, "n": n, "spearman_rho": rho, "spearman_p": p,
            "spearman_method": st["spearman_method"], "kendall_tau": st["kendall_tau"], "kendall_p": st["kendall_p"],
            "pearson_r": st["pearson_r"], "pearson_p": st["pearson_p"], "predicts": predicts,
            "statement": statement}


def plain_statement(base: str, table: pd.DataFrame, corr: pd.DataFrame, trained_context: int) -> str:
    """SPEC 13.3: which measure, if any, predicts which extension keeps retrieval working - also when none does."""
    if table.empty:
        return f"{base}: no variant declared ([variants.{base}] in the registry); nothing to compare"
    eff = table.get("effective_length")
    ranked = ""
    if eff is not None and eff.notna().any():
        order = table.sort_values("effective_length", ascending=False)
        ranked = "; effective length (NoLiMa rule): " + ", ".join(
            f"{r.name} {int(r.effective_length)}" if np.isfinite(r.effective_length) else f"{r.name} n/a"
            for r in order.itertuples())
    tested = corr[corr["n"] >= MIN_N]
    if tested.empty:
        return (f"{base} (C = {trained_context}): too few variants with results for a correlation "
                f"(n < {MIN_N} in every scope){ranked}.")
    hits = tested[tested["predicts"]]
    if hits.empty:
        return (f"{base} (C = {trained_context}): no geometry measure predicts which extension keeps retrieval "
                f"working beyond C (p >= {ALPHA} for every measure, n = {int(tested['n'].max())} at most){ranked}.")
    said = "; ".join(hits["statement"])
    return f"{base} (C = {trained_context}): {said}{ranked}."
