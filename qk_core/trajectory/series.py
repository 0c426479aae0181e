"""The training trajectory of a checkpoint series (SPEC 6).

Inputs per checkpoint (one model key ``<series>@<revision>``): its long-format metric tables
(:mod:`qk_core.io.metrics`: PCA, rotation, plasticity), its plasticity profile per head and bucket, and the
configuration recorded in its capture manifest (window L, bucket B, rope_theta,
max_position_embeddings). Nothing is hard-coded per revision: each checkpoint's L and B come from its
own capture, and window-normalised values use that L.

Outputs:

- :func:`trajectory_table` — one row per checkpoint of the series in training (registry) order: config,
  rotation means (raw and window-normalised), plasticity aggregates with 95% intervals, PCA taxonomy
  shares, the thesis's published values as ``ref_<metric>`` columns, and what is missing.
- :func:`profile_table` — the mean plasticity profile of each checkpoint over heads, in absolute token
  positions tau (and tau / L beside it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from qk_core.config.settings import DATA_DIR

REFERENCE_CSV = DATA_DIR / "reference" / "thesis_metrics.csv"

# SPEC 3: rotation means tracked across training. ``*_window`` = per-token value x L (SPEC notation).
ROTATION = ["bias_strength", "bias_strength_window", "abs_alpha_k", "abs_alpha_k_window", "mu_q_a",
            "abs_r_k_a", "separation_strength", "plane_var_fraction"]
# Window-normalised metric -> its per-token metric (derived as value x L when an analysis omits it).
WINDOW_OF = {"bias_strength_window": "bias_strength", "abs_alpha_k_window": "abs_alpha_k"}
# SPEC 4.5-4.6: plasticity aggregates, each with its bootstrap interval (``_lo``/``_hi`` columns).
PLASTICITY = ["ap_overall", "ap_first20", "ap_last20", "ap_drop"]
PCA_SHARE_PREFIX = "pca_share_"  # SPEC 2: taxonomy shares on PC0, one metric per class
INPUTS = ("capture", "pca_metrics", "rotation_metrics", "plasticity_metrics", "plasticity_profiles")
CONFIG_FIELDS = ("window", "bucket", "rope_theta", "max_position_embeddings")
STEP_RE = re.compile(r"step-?(\d+)")
TAU_COLUMNS = ("tau", "tau_tokens")  # raw-token bucket midpoints, as the plasticity profiles name them
AP_COLUMNS = ("ap", "ap_closed", "ap_closed_form", "pp")


class TrajectoryError(ValueError):
    """A trajectory input is malformed; the message names the checkpoint and the input."""


@dataclass
class Checkpoint:
    """Everything known about one checkpoint of a series; ``None`` marks an input that is missing."""

    key: str
    revision: str
    step_index: int
    config: dict[str, Any] | None = None  # from the capture manifest (SPEC 1.8)
    metrics: dict[str, pd.DataFrame | None] = field(default_factory=dict)  # input name -> long table
    profiles: pd.DataFrame | None = None
    fallback_config: dict[str, Any] = field(default_factory=dict)  # registry window/bucket if no capture

    def missing(self) -> list[str]:
        out = [] if self.config is not None else ["capture"]
        out += [name for name in ("pca_metrics", "rotation_metrics", "plasticity_metrics")
                if self.metrics.get(name) is None]
        if self.profiles is None:
            out.append("plasticity_profiles")
        return out


def training_step(revision: str) -> float:
    """The step number written in a revision name (``stage1-step-40000`` -> 40000), NaN if none.

    Steps restart in later phases (``lc-4k-to-32k-step-4000``), so rows are ordered by the registry's
    checkpoint order, and this number is informative only.
    """
    m = STEP_RE.search(revision)
    return float(m.group(1)) if m else float("nan")


def phase(revision: str) -> str:
    """The training phase prefix of a revision (``stage1``, ``lc-4k-to-32k``), or the revision itself."""
    m = STEP_RE.search(revision)
    return revision[: m.start()].rstrip("-_") if m and m.start() > 0 else revision


def _find_key(obj: Any, name: str) -> Any:
    """First non-null scalar stored under ``name`` in a nested dict/list (breadth-first), or None."""
    queue = [obj]
    while queue:
        cur = queue.pop(0)
        if isinstance(cur, Mapping):
            val = cur.get(name)
            if val is not None and not isinstance(val, Mapping | list):
                return val
            queue.extend(cur.values())
        elif isinstance(cur, list):
            queue.extend(cur)
    return None


def _number(val: Any) -> float:
    return float(val) if isinstance(val, int | float) and not isinstance(val, bool) else np.nan


def _layer_rope_theta(manifest: Mapping[str, Any]) -> float:
    """rope_theta of the captured layers (SPEC 1.8 layer metadata): eligible RoPE layers first."""
    layers = [la for la in manifest.get("layers") or [] if isinstance(la, Mapping)]
    for pick in (lambda la: la.get("eligible") and la.get("rope_applied"), lambda la: la.get("rope_applied")):
        thetas = [_number(la.get("rope_theta")) for la in layers if pick(la)]
        thetas = [t for t in thetas if np.isfinite(t)]
        if thetas:
            return thetas[0]
    return np.nan


def checkpoint_config(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """window L, bucket B, rope_theta and max_position_embeddings as recorded in a capture manifest.

    L and B are the capture's own (SPEC 1.8). rope_theta is that of the captured full-attention RoPE
    layers (the layer metadata of SPEC 1.8), else wherever the manifest records one;
    max_position_embeddings wherever the manifest records it (NaN when it does not). SPEC 6: both are
    the revision's own, never hard-coded.
    """
    out: dict[str, Any] = {name: _number(manifest.get(name)) for name in ("window", "bucket")}
    for name in ("window", "bucket"):
        if not np.isfinite(out[name]):
            raise TrajectoryError(f"capture manifest has no '{name}'")
        out[name] = int(out[name])
    theta = _layer_rope_theta(manifest)
    out["rope_theta"] = theta if np.isfinite(theta) else _number(_find_key(manifest, "rope_theta"))
    out["max_position_embeddings"] = _number(_find_key(manifest, "max_position_embeddings"))
    return out


def _metric_lookup(frames: Iterable[pd.DataFrame | None]) -> dict[str, pd.Series]:
    """metric name -> its row (key ``""`` only), over all given long tables."""
    out: dict[str, pd.Series] = {}
    for df in frames:
        if df is None or df.empty:
            continue
        rows = df[df["key"].fillna("") == ""] if "key" in df else df
        for _, row in rows.iterrows():
            out.setdefault(str(row["metric"]), row)
    return out


def load_reference(path: str | Path = REFERENCE_CSV) -> pd.DataFrame:
    """The thesis's published values (SPEC 5: a separate "reference" source), long format."""
    df = pd.read_csv(path, dtype={"key": str}, keep_default_na=False, na_values={"value": [""]})
    return df


def trajectory_table(series: str, checkpoints: list[Checkpoint],
                     reference: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per checkpoint, ordered by training (registry) order (SPEC 6)."""
    ref = _reference_by_model(reference)
    rows = []
    for ck in sorted(checkpoints, key=lambda c: c.step_index):
        cfg = ck.config or {}
        row: dict[str, Any] = {
            "series": series, "model": ck.key, "revision": ck.revision, "step_index": ck.step_index,
            "phase": phase(ck.revision), "step": training_step(ck.revision),
        }
        for name in CONFIG_FIELDS:
            row[name] = cfg.get(name, ck.fallback_config.get(name, np.nan))
        row["config_source"] = "capture" if ck.config is not None else (
            "registry" if ck.fallback_config else "")
        missing = ck.missing()
        row["missing"] = ",".join(missing)
        row["complete"] = not missing
        lookup = _metric_lookup(ck.metrics.get(n) for n in ("rotation_metrics", "plasticity_metrics",
                                                            "pca_metrics"))
        L = float(row["window"]) if row["window"] is not None else np.nan
        for name in ROTATION:
            if name in lookup:
                row[name] = float(lookup[name]["value"])
            elif name in WINDOW_OF and WINDOW_OF[name] in lookup:
                row[name] = float(lookup[WINDOW_OF[name]]["value"]) * L  # SPEC 3: window-normalised = x L
            else:
                row[name] = np.nan
        for name in PLASTICITY:
            r = lookup.get(name)
            row[name] = float(r["value"]) if r is not None else np.nan
            row[f"{name}_lo"] = float(r["lo"]) if r is not None else np.nan
            row[f"{name}_hi"] = float(r["hi"]) if r is not None else np.nan
        if np.isnan(row["ap_drop"]) and np.isfinite(row["ap_first20"]) and np.isfinite(row["ap_last20"]):
            row["ap_drop"] = row["ap_first20"] - row["ap_last20"]  # SPEC 4.5 (interval unknown)
        for name, r in sorted(lookup.items()):
            if name.startswith(PCA_SHARE_PREFIX):
                row[name] = float(r["value"])
        heads = [int(r["n_heads"]) for n, r in lookup.items() if n in ROTATION + PLASTICITY]
        row["n_heads"] = max(heads) if heads else 0
        for name, val in ref.get(ck.key, {}).items():
            row[f"ref_{name}"] = val
        rows.append(row)
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    share_cols = sorted(c for c in df.columns if c.startswith(PCA_SHARE_PREFIX))
    df[share_cols] = df[share_cols].astype(float)
    ref_cols = sorted(c for c in df.columns if c.startswith("ref_"))
    lead = [c for c in df.columns if c not in share_cols + ref_cols]
    return df[lead + share_cols + ref_cols].reset_index(drop=True)


def _reference_by_model(reference: pd.DataFrame | None) -> dict[str, dict[str, float]]:
    if reference is None or reference.empty:
        return {}
    ref = reference[reference["key"].fillna("") == ""]
    out: dict[str, dict[str, float]] = {}
    for _, r in ref.iterrows():
        out.setdefault(str(r["model"]), {})[str(r["metric"])] = float(r["value"])
    return out


def _column(df: pd.DataFrame, names: tuple[str, ...], what: str, key: str) -> str:
    for n in names:
        if n in df.columns:
            return n
    raise TrajectoryError(f"{key}: plasticity_profiles has no {what} column (looked for {list(names)})")


def profile_table(checkpoints: list[Checkpoint]) -> pd.DataFrame:
    """Mean AP profile over heads per checkpoint, in absolute token positions (SPEC 4.4, 6).

    tau_b = (b + 0.5) B in raw tokens of that checkpoint's own B; ``tau_norm`` = tau / L.
    """
    cols = ["model", "revision", "step_index", "window", "bucket_width", "bucket", "tau", "tau_norm",
            "ap", "ap_median", "ap_q25", "ap_q75", "ap_empirical", "n_heads"]
    parts = []
    for ck in sorted(checkpoints, key=lambda c: c.step_index):
        prof = ck.profiles
        if prof is None or prof.empty:
            continue
        cfg = ck.config or ck.fallback_config
        L, B = int(cfg["window"]), int(cfg["bucket"])
        ap_col = _column(prof, AP_COLUMNS, "AP", ck.key)
        p = prof.copy()
        tau_col = next((c for c in TAU_COLUMNS if c in p.columns), None)
        if tau_col is not None:
            p["tau"] = p[tau_col].astype(float)
        else:
            if "bucket" not in p.columns:
                raise TrajectoryError(f"{ck.key}: plasticity_profiles has neither 'tau' nor 'bucket'")
            p["tau"] = (p["bucket"].astype(float) + 0.5) * B  # SPEC notation: tau_b = (b + 0.5) B
        if "bucket" not in p.columns:
            p["bucket"] = np.floor(p["tau"] / B).astype(int)
        p = p[np.isfinite(p[ap_col].astype(float))]
        g = p.groupby(["bucket", "tau"])[ap_col]
        agg = pd.DataFrame({
            "ap": g.mean(), "ap_median": g.median(), "ap_q25": g.quantile(0.25), "ap_q75": g.quantile(0.75),
            "n_heads": g.count(),
            # SPEC 4.3: the empirical estimator's profile beside the closed form, where the analysis has it
            "ap_empirical": (p.groupby(["bucket", "tau"])["ap_empirical"].mean() if "ap_empirical" in p
                             else np.nan),
        }).reset_index().sort_values("tau")
        agg.insert(0, "model", ck.key)
        agg.insert(1, "revision", ck.revision)
        agg.insert(2, "step_index", ck.step_index)
        agg.insert(3, "window", L)
        agg.insert(4, "bucket_width", B)
        agg["tau_norm"] = agg["tau"] / L
        parts.append(agg[cols])
    if not parts:
        return pd.DataFrame(columns=cols)
    out = pd.concat(parts, ignore_index=True)
    out["n_heads"] = out["n_heads"].astype("int64")
    out["bucket"] = out["bucket"].astype("int64")
    return out


def summary(table: pd.DataFrame) -> dict[str, Any]:
    """Short facts for the materialisation: checkpoints present/missing and their inputs."""
    missing = table[~table["complete"]] if not table.empty else table
    return {
        "checkpoints": len(table),
        "complete": int(table["complete"].sum()) if not table.empty else 0,
        "missing": {r["revision"]: r["missing"] for _, r in missing.iterrows()},
    }


def options_of(metrics: pd.DataFrame | None) -> dict[str, Any]:
    """The first non-empty options JSON of a long table (for provenance), {} when none."""
    if metrics is None or metrics.empty or "options" not in metrics:
        return {}
    for s in metrics["options"]:
        if isinstance(s, str) and s:
            try:
                return dict(json.loads(s))
            except (ValueError, TypeError):
                continue
    return {}
